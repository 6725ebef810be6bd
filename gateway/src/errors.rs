//! The gateway's API errors: kvgate's one `ApiError` (`kvgate_shared::errors`; written to clients by
//! `serve::proxy::write_error`, counted in `kvgate_gateway_errors_total{code}`) and the constructors only the gateway
//! uses ([`GatewayErrors`]).

use serde::de::DeserializeOwned;

pub use kvgate_shared::errors::ApiError;

/// Errors only the gateway answers (call them as `ApiError::no_worker(..)` with this trait in scope).
pub trait GatewayErrors {
    /// 404: no worker behind this gateway serves the model.
    fn model_not_found(model: &str) -> ApiError {
        ApiError::unknown_model(format!(
            "no worker behind this gateway serves the model {model:?} (see GET /v1/models)"
        ))
    }
    fn no_worker(model: &str) -> ApiError {
        ApiError::unavailable(
            "no_healthy_worker",
            format!("no healthy worker serves the model {model:?} right now; retry later"),
        )
    }
    /// Over a class budget: 429 with Retry-After.
    fn rejected(r: crate::admission::Rejection) -> ApiError {
        use crate::admission::Rejection;
        let (class, retry, why) = match r {
            Rejection::QueueFull { class, retry_after_s } => (class, retry_after_s, "its wait queue is full"),
            Rejection::Timeout { class, retry_after_s } => {
                (class, retry_after_s, "the request waited its maximum")
            }
        };
        let mut e = ApiError::new(
            429,
            "rate_limit_error",
            "class_budget_exceeded",
            format!("the {class:?} class is over its token budget and {why}; retry after {retry} s"),
        );
        e.retry_after_s = Some(retry);
        e
    }
    /// No known API key and the gateway requires one.
    fn missing_api_key() -> ApiError {
        ApiError::unauthorized("invalid_api_key", "a known API key is required (Authorization: Bearer <key>)")
    }
    /// The caller named a class it may not choose.
    /// 403: the caller's key names the models it may use, and not this one.
    fn model_not_allowed(model: &str) -> ApiError {
        ApiError::new(
            403,
            "permission_error",
            "model_not_allowed",
            format!("this API key may not use the model {model:?} (its key names the models it may use)"),
        )
        .with_param("model")
    }
    fn class_not_allowed(class: &str) -> ApiError {
        ApiError::new(
            403,
            "permission_error",
            "class_not_allowed",
            format!("this caller may not choose the class {class:?} (x-kvgate-class); omit the header to be classified"),
        )
        .with_param("x-kvgate-class")
    }
    fn unknown_class(class: &str) -> ApiError {
        ApiError::new(400, "invalid_request_error", "unknown_class", format!("no class {class:?}"))
            .with_param("x-kvgate-class")
    }
    /// Every prompt-preparation thread is busy and the queue is full.
    fn tokenizer_busy() -> ApiError {
        ApiError::unavailable(
            "tokenizer_busy",
            "the gateway's tokenize queue is full (--tokenize-queue); retry later",
        )
    }
    /// The request body did not arrive within `--request-read-timeout`.
    fn read_timeout(limit: std::time::Duration) -> ApiError {
        ApiError::new(
            408,
            "invalid_request_error",
            "request_timeout",
            format!("the request body did not arrive within {limit:?} (--request-read-timeout)"),
        )
    }
    /// No response header from the worker in time.
    fn upstream_timeout(worker: &str, after: std::time::Duration) -> ApiError {
        ApiError::new(
            504,
            "server_error",
            "upstream_timeout",
            format!("worker {worker} sent no response within {after:.1?} (first-byte timeout)"),
        )
    }
    /// Every worker tried refused (busy, loading, shutting down).
    fn all_refused(model: &str, retry_after_s: u32) -> ApiError {
        let mut e = ApiError::new(
            503,
            "server_error",
            "workers_busy",
            format!("every worker tried for the model {model:?} refused the request (busy, loading or shutting down)"),
        );
        e.retry_after_s = Some(retry_after_s.max(1));
        e
    }
    fn bad_gateway(worker: &str, message: &str) -> ApiError {
        ApiError::new(502, "server_error", "upstream_error", format!("worker {worker}: {message}"))
    }
}

impl GatewayErrors for ApiError {}

/// Deserializes a request, naming the offending field (`param`) on error.
pub fn typed<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.inner().to_string();
        let param = if path == "." { msg.split('`').nth(1).unwrap_or("body").to_owned() } else { path };
        ApiError::invalid(&param, format!("invalid request: {param}: {msg}"))
    })
}
