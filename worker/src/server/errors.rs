//! The worker's API errors: kvgate's one `ApiError` (`kvgate_shared::errors`, answered through its axum adapter,
//! counted in `kvgate_worker_errors_total{code}`) and the constructors only a worker uses ([`WorkerErrors`]).

pub use kvgate_shared::errors::{ApiError, Refusal};

use crate::engine::BackendError;

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
    /// 500 `internal_error` "generation failed: ...": the backend failed on the request's batch (the request ended
    /// with `FinishReason::Error`). Every kind answers the same: the error that ends a request is the engine's fault
    /// ([`BackendError::fault`]; the engine takes the blame for arguments it built, `BackendError::blame_engine`,
    /// and a decode worker's imported KV is refused as an `ImportError` before the request runs), and none is a
    /// refusal the gateway may retry elsewhere (`Refusal`): the request may have streamed tokens already.
    fn generation_failed(e: &BackendError) -> ApiError {
        ApiError::internal(format!("generation failed: {e}"))
    }
}

impl WorkerErrors for ApiError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_backend_error_answers_500_generation_failed_with_its_message() {
        let m = || "synchronize: \"CUDA_ERROR_ILLEGAL_ADDRESS\"".to_owned();
        for e in crate::engine::backend_error::every(&m()) {
            let a = ApiError::generation_failed(&e);
            // What the handlers answered when the error was a `String`.
            let before = ApiError::internal(format!("generation failed: {}", m()));
            assert_eq!((a.status, a.kind, a.code), (500, "server_error", "internal_error"), "{e:?}");
            assert_eq!(a, before, "{e:?}");
            assert_eq!(Refusal::from_code(a.code), None, "never a refusal the gateway retries elsewhere");
        }
    }
}
