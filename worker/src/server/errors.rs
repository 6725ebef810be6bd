//! API errors as OpenAI-style JSON bodies (`{"error": {"message", "type", "param", "code"}}`) with their HTTP
//! status; `code` doubles as the metric label.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kvgate_shared::openai::ErrorBody;

/// An error answer.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, code, message: message.into(), param: None, retry_after_s: None }
    }
    /// 400 for a field (`param` names it).
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_value", message);
        e.param = Some(param.into());
        e
    }
    /// 400 for a field kvgate workers do not implement (`kvgate_shared::openai::UNSUPPORTED_PARAMETERS`).
    pub fn unsupported(param: &str) -> Self {
        let message =
            format!("{param} is not supported by kvgate workers (leave it out, or send its neutral value)");
        let mut e =
            Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "unsupported_parameter", message);
        e.param = Some(param.into());
        e
    }
    pub fn bad_json(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_json", message)
    }
    pub fn context_length(message: impl Into<String>) -> Self {
        let mut e =
            Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "context_length_exceeded", message);
        e.param = Some("messages".into());
        e
    }
    pub fn model_not_found(model: &str, served: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            "model_not_found",
            format!("the model {model:?} does not exist on this worker (it serves {served:?})"),
        );
        e.param = Some("model".into());
        e
    }
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("request body is larger than the limit of {limit} bytes (--max-body-bytes)"),
        )
    }
    pub fn overloaded(waiting: usize) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "queue_full",
            format!("the worker's waiting queue is full ({waiting} requests, --max-waiting-requests); retry later"),
        );
        e.retry_after_s = Some(1);
        e
    }
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", code, message);
        e.retry_after_s = Some(1);
        e
    }
    /// 401: the caller is not a gateway (`--require-gateway-token`) or its assertion does not verify.
    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", code, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message)
    }
    pub fn body(&self) -> ErrorBody {
        ErrorBody::new(self.kind, self.code, self.message.clone(), self.param.as_deref())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        metrics::counter!("kvgate_worker_errors_total", "code" => self.code).increment(1);
        let mut resp = (self.status, [(header::CONTENT_TYPE, "application/json")], self.body().to_json())
            .into_response();
        if let Some(s) = self.retry_after_s {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}
