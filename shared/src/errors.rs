//! The one API error of kvgate's HTTP surfaces (the gateway's pingora listener and control port, the workers' axum
//! server): an OpenAI-style body (`{"error": {"message", "type", "param", "code"}}`) with its HTTP status and, for
//! the errors a client may retry, a `Retry-After`. `code` doubles as the metric label. Adapters: the axum one here
//! (feature `axum`: `IntoResponse`, counting each error in the metric the binary names with [`set_error_metric`]),
//! the pingora one in the gateway (`serve::proxy::write_error`).

use crate::openai::ErrorBody;
use crate::prompt::PromptError;

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    /// OpenAI's `type`.
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub param: Option<String>,
    /// Seconds a client should wait before retrying (the header `Retry-After`), for errors worth retrying.
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    pub fn new(status: u16, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, code, message: message.into(), param: None, retry_after_s: None }
    }

    /// The same error naming the field it is about.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Whether a client may send the request again (the server was busy or unavailable).
    pub fn retryable(&self) -> bool {
        self.retry_after_s.is_some()
    }

    /// 400 for a field (`param` names it).
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", "invalid_value", message).with_param(param)
    }
    /// 400 for a field kvgate workers do not implement (`openai::UNSUPPORTED_PARAMETERS`).
    pub fn unsupported(param: &str) -> Self {
        let message =
            format!("{param} is not supported by kvgate workers (leave it out, or send its neutral value)");
        Self::new(400, "invalid_request_error", "unsupported_parameter", message).with_param(param)
    }
    pub fn bad_json(message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", "invalid_json", message)
    }
    /// The prompt plus the output does not fit the model (`param`: the field to change).
    pub fn context_length(message: impl Into<String>, param: &str) -> Self {
        Self::new(400, "invalid_request_error", "context_length_exceeded", message).with_param(param)
    }
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            413,
            "invalid_request_error",
            "request_too_large",
            format!("request body is larger than the limit of {limit} bytes (--max-body-bytes)"),
        )
    }
    /// 503 with Retry-After 1: a worker cannot serve the request, and another may (the gateway retries it there).
    pub fn refused(why: Refusal, message: impl Into<String>) -> Self {
        Self::unavailable(why.code(), message)
    }
    /// 503 with Retry-After 1: the server cannot take the request now.
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        let mut e = Self::new(503, "server_error", code, message);
        e.retry_after_s = Some(1);
        e
    }
    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(401, "authentication_error", code, message)
    }
    /// 404 `model_not_found` (`message` says what is served instead).
    pub fn unknown_model(message: impl Into<String>) -> Self {
        Self::new(404, "not_found_error", "model_not_found", message).with_param("model")
    }
    pub fn not_found_route(path: &str) -> Self {
        Self::new(404, "not_found_error", "route_not_found", format!("no route {path}")).with_param("path")
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "server_error", "internal_error", message)
    }
    /// A prompt that cannot be rendered or tokenized: the client's fault (400 on `param`) or the server's (500).
    pub fn prompt(e: PromptError, param: &str) -> Self {
        if e.is_client_error() {
            Self::invalid(param, e.to_string())
        } else {
            Self::internal(e.to_string())
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody::new(self.kind, self.code, self.message.clone(), self.param.as_deref())
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

#[cfg(feature = "axum")]
mod axum_adapter {
    use std::sync::OnceLock;

    use axum::http::{header, HeaderValue, StatusCode};
    use axum::response::{IntoResponse, Response};

    use super::ApiError;

    pub(super) static METRIC: OnceLock<&'static str> = OnceLock::new();

    impl IntoResponse for ApiError {
        fn into_response(self) -> Response {
            if let Some(name) = METRIC.get() {
                metrics::counter!(*name, "code" => self.code).increment(1);
            }
            let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut resp =
                (status, [(header::CONTENT_TYPE, "application/json")], self.body().to_json()).into_response();
            if let Some(s) = self.retry_after_s {
                resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
            }
            resp
        }
    }
}

/// Names the counter (label `code`) the axum adapter increments for each error answered (once per process).
#[cfg(feature = "axum")]
pub fn set_error_metric(name: &'static str) {
    let _ = axum_adapter::METRIC.set(name);
}

/// Why a worker answers 503 to a request another worker may serve: it refused it before starting, or its engine
/// stopped under it (`EngineStopped`, `Aborted`: a whole answer of which nothing was sent; a split's decode leg that
/// dies after the hand-off answers so; `KvImportNoRoom`: a split's decode worker found no room for the import within
/// its wait). The worker answers with [`ApiError::refused`]; the gateway reads the code back with
/// [`Refusal::from_code`] and tries another worker. One list for both sides: a code added here is retried there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    QueueFull,
    ModelLoading,
    ShuttingDown,
    EngineStopped,
    Aborted,
    KvImportNoRoom,
}

impl Refusal {
    pub const ALL: [Refusal; 6] = [
        Refusal::QueueFull,
        Refusal::ModelLoading,
        Refusal::ShuttingDown,
        Refusal::EngineStopped,
        Refusal::Aborted,
        Refusal::KvImportNoRoom,
    ];

    /// The error code on the wire (and the metric label).
    pub fn code(self) -> &'static str {
        match self {
            Refusal::QueueFull => "queue_full",
            Refusal::ModelLoading => "model_loading",
            Refusal::ShuttingDown => "shutting_down",
            Refusal::EngineStopped => "engine_stopped",
            Refusal::Aborted => "aborted",
            Refusal::KvImportNoRoom => "kv_import_no_room",
        }
    }

    /// The refusal a code names (`None`: not one another worker may take).
    pub fn from_code(code: &str) -> Option<Refusal> {
        Refusal::ALL.into_iter().find(|r| r.code() == code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_reads_back_from_its_code_and_nothing_else_does() {
        for r in Refusal::ALL {
            assert_eq!(Refusal::from_code(r.code()), Some(r));
            let e = ApiError::refused(r, "m");
            assert_eq!((e.status, e.code, e.retry_after_s), (503, r.code(), Some(1)));
        }
        let codes: std::collections::HashSet<_> = Refusal::ALL.iter().map(|r| r.code()).collect();
        assert_eq!(codes.len(), Refusal::ALL.len(), "distinct codes");
        assert_eq!(Refusal::from_code("internal_error"), None);
        assert_eq!(Refusal::from_code(""), None);
    }

    #[test]
    fn bodies_are_openai_shaped_and_retryable_ones_say_when() {
        let e = ApiError::invalid("top_p", "2 is not in (0, 1]");
        let body: serde_json::Value = serde_json::from_str(&e.body().to_json()).expect("json");
        assert_eq!(body["error"]["param"], "top_p");
        assert_eq!(
            (body["error"]["type"].as_str(), body["error"]["code"].as_str()),
            (Some("invalid_request_error"), Some("invalid_value"))
        );
        assert!(!e.retryable());
        let busy = ApiError::unavailable("queue_full", "later");
        assert_eq!((busy.status, busy.retry_after_s, busy.retryable()), (503, Some(1), true));
        assert_eq!(ApiError::context_length("too long", "messages").param.as_deref(), Some("messages"));
    }
}
