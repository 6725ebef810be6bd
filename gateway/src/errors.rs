//! Gateway errors as OpenAI-style bodies (`{"error": {"message", "type", "param", "code"}}`); `code` is also the
//! metric label.

use kvgate_shared::openai::ErrorBody;
use kvgate_shared::prompt::PromptError;
use serde::de::DeserializeOwned;

/// An error answer.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, code: &'static str, message: String) -> Self {
        Self { status, kind, code, message, param: None, retry_after_s: None }
    }
    pub fn invalid(param: &str, message: &str) -> Self {
        let mut e = Self::new(400, "invalid_request_error", "invalid_value", message.to_owned());
        e.param = Some(param.to_owned());
        e
    }
    pub fn bad_json(message: String) -> Self {
        Self::new(400, "invalid_request_error", "invalid_json", message)
    }
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            413,
            "invalid_request_error",
            "request_too_large",
            format!("request body is larger than the limit of {limit} bytes (--max-body-bytes)"),
        )
    }
    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            404,
            "not_found_error",
            "model_not_found",
            format!("no worker behind this gateway serves the model {model:?} (see GET /v1/models)"),
        );
        e.param = Some("model".into());
        e
    }
    pub fn no_worker(model: &str) -> Self {
        let mut e = Self::new(
            503,
            "server_error",
            "no_healthy_worker",
            format!("no healthy worker serves the model {model:?} right now; retry later"),
        );
        e.retry_after_s = Some(1);
        e
    }
    /// Over a class budget: 429 with Retry-After.
    pub fn rejected(r: crate::admission::Rejection) -> Self {
        use crate::admission::Rejection;
        let (class, retry, why) = match r {
            Rejection::QueueFull { class, retry_after_s } => (class, retry_after_s, "its wait queue is full"),
            Rejection::Timeout { class, retry_after_s } => {
                (class, retry_after_s, "the request waited its maximum")
            }
        };
        let mut e = Self::new(
            429,
            "rate_limit_error",
            "class_budget_exceeded",
            format!("the {class:?} class is over its token budget and {why}; retry after {retry} s"),
        );
        e.retry_after_s = Some(retry);
        e
    }
    /// The prompt plus the output does not fit the model (the worker's own code and wording).
    pub fn context_length(message: String) -> Self {
        let mut e = Self::new(400, "invalid_request_error", "context_length_exceeded", message);
        e.param = Some("max_tokens".into());
        e
    }
    /// No known API key and the gateway requires one.
    pub fn unauthorized() -> Self {
        Self::new(
            401,
            "authentication_error",
            "invalid_api_key",
            "a known API key is required (Authorization: Bearer <key>)".into(),
        )
    }
    /// The caller named a class it may not choose.
    pub fn class_not_allowed(class: &str) -> Self {
        let mut e = Self::new(
            403,
            "permission_error",
            "class_not_allowed",
            format!("this caller may not choose the class {class:?} (x-kvgate-class); omit the header to be classified"),
        );
        e.param = Some("x-kvgate-class".into());
        e
    }
    pub fn unknown_class(class: &str) -> Self {
        let mut e = Self::new(400, "invalid_request_error", "unknown_class", format!("no class {class:?}"));
        e.param = Some("x-kvgate-class".into());
        e
    }
    /// Every prompt-preparation thread is busy and the queue is full.
    pub fn tokenizer_busy() -> Self {
        let mut e = Self::new(
            503,
            "server_error",
            "tokenizer_busy",
            "the gateway's tokenize queue is full (--tokenize-queue); retry later".into(),
        );
        e.retry_after_s = Some(1);
        e
    }
    /// The request body did not arrive within `--request-read-timeout`.
    pub fn read_timeout(limit: std::time::Duration) -> Self {
        Self::new(
            408,
            "invalid_request_error",
            "request_timeout",
            format!("the request body did not arrive within {limit:?} (--request-read-timeout)"),
        )
    }
    /// No response header from the worker in time.
    pub fn upstream_timeout(worker: &str, after: std::time::Duration) -> Self {
        Self::new(
            504,
            "server_error",
            "upstream_timeout",
            format!("worker {worker} sent no response within {after:.1?} (first-byte timeout)"),
        )
    }
    /// Every worker tried refused (busy, loading, shutting down).
    pub fn all_refused(model: &str, retry_after_s: u32) -> Self {
        let mut e = Self::new(
            503,
            "server_error",
            "workers_busy",
            format!("every worker tried for the model {model:?} refused the request (busy, loading or shutting down)"),
        );
        e.retry_after_s = Some(retry_after_s.max(1));
        e
    }
    pub fn not_found_route(path: &str) -> Self {
        Self::new(404, "not_found_error", "route_not_found", format!("no route {path}"))
    }
    pub fn bad_gateway(worker: &str, message: &str) -> Self {
        Self::new(502, "server_error", "upstream_error", format!("worker {worker}: {message}"))
    }
    pub fn internal(message: String) -> Self {
        Self::new(500, "server_error", "internal_error", message)
    }
    /// A prompt that cannot be rendered or tokenized.
    pub fn prompt(e: PromptError, param: &str) -> Self {
        if e.is_client_error() {
            Self::invalid(param, &e.to_string())
        } else {
            Self::internal(e.to_string())
        }
    }
    pub fn body(&self) -> ErrorBody {
        ErrorBody::new(self.kind, self.code, self.message.clone(), self.param.as_deref())
    }
}

/// Deserializes a request, naming the offending field (`param`) on error.
pub fn typed<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.inner().to_string();
        let param = if path == "." { msg.split('`').nth(1).unwrap_or("body").to_owned() } else { path };
        ApiError::invalid(&param, &format!("invalid request: {param}: {msg}"))
    })
}
