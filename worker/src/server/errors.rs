//! The worker's API errors: kvgate's one `ApiError` (`kvgate_shared::errors`, answered through its axum adapter,
//! counted in `kvgate_worker_errors_total{code}`) and the constructors only a worker uses ([`WorkerErrors`]).

pub use kvgate_shared::errors::{ApiError, Refusal};

/// Errors only a worker answers.
pub trait WorkerErrors {
    /// 404: the request names another model than the one this worker serves.
    fn model_not_found(model: &str, served: &str) -> ApiError {
        ApiError::unknown_model(format!(
            "the model {model:?} does not exist on this worker (it serves {served:?})"
        ))
    }
    /// 503 with Retry-After: the waiting queue is full.
    fn overloaded(waiting: usize) -> ApiError {
        ApiError::refused(
            Refusal::QueueFull,
            format!("the worker's waiting queue is full ({waiting} requests, --max-waiting-requests); retry later"),
        )
    }
}

impl WorkerErrors for ApiError {}
