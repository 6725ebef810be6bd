//! [`BackendError`]: why a [`super::Backend`] call failed, by what failed (device memory, a kernel, the device, the
//! model's shapes, the arguments, a capability the backend lacks, anything else), and whose fault that is
//! ([`Fault`]): the request's (what the call was handed was refused) or the engine's (the backend or its device
//! failed). Every backend (CPU, CUDA in `crate::cuda`, the simulator) speaks it; `crate::cuda::gpu` maps its
//! `GpuError` onto it, and the CPU model's `ModelError` maps here.
//!
//! A backend judges a call alone: arguments it refuses are [`BackendError::InvalidInput`], the request's fault. The
//! engine knows better where it built the arguments itself (a batch from admitted requests and its own slots, its
//! block ids, its tiers' payloads) and takes the blame ([`BackendError::blame_engine`]), so an error that ends a
//! request (`FinishReason::Error`) is always the engine's; only a decode worker's imported KV (another worker's bytes
//! for this request, `ImportError::Backend`) stays the request's.
//!
//! Invariants: a variant's `Display` is its message exactly as the backend wrote it (what the `String` errors of
//! the trait said before the type existed, so HTTP answers, logs and transfer frames read the same);
//! [`BackendError::context`] prefixes the message and keeps the variant (and so the fault);
//! [`BackendError::blame_engine`] changes the fault, never the text.

use crate::model::ModelError;

/// Whose fault a backend failure is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// What the call was handed was refused before the device did anything wrong (a KV payload of the wrong size,
    /// blocks, layers or a token outside what the backend holds): the same arguments fail the same way.
    Request,
    /// The backend or its device failed (memory, a kernel, the driver, the model's math): the arguments may be
    /// fine.
    Engine,
}

/// A failed [`super::Backend`] call. Each variant holds the message as written (see the module's invariants).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The device could not allocate (the driver's or cuBLAS's out-of-memory).
    #[error("{0}")]
    OutOfDeviceMemory(String),
    /// A kernel failed to compile, load or launch.
    #[error("{0}")]
    Kernel(String),
    /// The device or its driver failed otherwise (no usable device, a failed copy or synchronisation).
    #[error("{0}")]
    Device(String),
    /// The model's weights or configuration do not have the shapes the backend needs.
    #[error("{0}")]
    Shape(String),
    /// The arguments were refused: KV bytes of the wrong size, blocks or layers outside the pool, a token outside
    /// the vocabulary. The only [`Fault::Request`] variant.
    #[error("{0}")]
    InvalidInput(String),
    /// Arguments the engine built itself were refused (an [`BackendError::InvalidInput`] it took the blame for,
    /// [`BackendError::blame_engine`]): a bug in the engine's bookkeeping.
    #[error("{0}")]
    Internal(String),
    /// The backend cannot do this at all (copy KV blocks, copy part of a block's layers).
    #[error("{0}")]
    Unsupported(String),
    /// Anything else (the CPU model's tensor math, a backend that broke its contract).
    #[error("{0}")]
    Other(String),
}

impl BackendError {
    /// Whose fault it is.
    pub fn fault(&self) -> Fault {
        match self {
            Self::InvalidInput(_) => Fault::Request,
            Self::OutOfDeviceMemory(_)
            | Self::Kernel(_)
            | Self::Device(_)
            | Self::Shape(_)
            | Self::Internal(_)
            | Self::Unsupported(_)
            | Self::Other(_) => Fault::Engine,
        }
    }

    /// The message (what `Display` writes).
    pub fn message(&self) -> &str {
        match self {
            Self::OutOfDeviceMemory(m)
            | Self::Kernel(m)
            | Self::Device(m)
            | Self::Shape(m)
            | Self::InvalidInput(m)
            | Self::Internal(m)
            | Self::Unsupported(m)
            | Self::Other(m) => m,
        }
    }

    /// The same error from a call whose arguments the engine built itself: refused arguments
    /// ([`BackendError::InvalidInput`]) become [`BackendError::Internal`], the engine's fault; every other variant,
    /// and the text, stay.
    pub fn blame_engine(self) -> Self {
        match self {
            Self::InvalidInput(m) => Self::Internal(m),
            other => other,
        }
    }

    /// The same error with `what` before its message (`"{what}: {message}"`): a caller saying what it was doing.
    pub fn context(self, what: impl std::fmt::Display) -> Self {
        self.map_message(|m| format!("{what}: {m}"))
    }

    fn map_message(self, f: impl FnOnce(String) -> String) -> Self {
        match self {
            Self::OutOfDeviceMemory(m) => Self::OutOfDeviceMemory(f(m)),
            Self::Kernel(m) => Self::Kernel(f(m)),
            Self::Device(m) => Self::Device(f(m)),
            Self::Shape(m) => Self::Shape(f(m)),
            Self::InvalidInput(m) => Self::InvalidInput(f(m)),
            Self::Internal(m) => Self::Internal(f(m)),
            Self::Unsupported(m) => Self::Unsupported(f(m)),
            Self::Other(m) => Self::Other(f(m)),
        }
    }
}

/// The CPU model's errors: its tensor math failing is [`BackendError::Other`]; files, fields and tensors that do
/// not fit the model are [`BackendError::Shape`].
impl From<ModelError> for BackendError {
    fn from(e: ModelError) -> Self {
        let message = e.to_string();
        match e {
            ModelError::Candle(_) => Self::Other(message),
            ModelError::File { .. }
            | ModelError::Field { .. }
            | ModelError::Tensor { .. }
            | ModelError::UnsupportedArchitecture(_) => Self::Shape(message),
        }
    }
}

/// One error of every kind, each with `message` (tests of what each kind becomes).
#[cfg(test)]
pub(crate) fn every(message: &str) -> Vec<BackendError> {
    let m = || message.to_owned();
    vec![
        BackendError::OutOfDeviceMemory(m()),
        BackendError::Kernel(m()),
        BackendError::Device(m()),
        BackendError::Shape(m()),
        BackendError::InvalidInput(m()),
        BackendError::Internal(m()),
        BackendError::Unsupported(m()),
        BackendError::Other(m()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_the_message_as_written_and_only_refused_arguments_are_the_requests_fault() {
        for e in every("allocate 512 MiB: CUDA_ERROR_OUT_OF_MEMORY") {
            assert_eq!(e.to_string(), "allocate 512 MiB: CUDA_ERROR_OUT_OF_MEMORY", "{e:?}");
            assert_eq!(e.message(), e.to_string());
            let want =
                if matches!(e, BackendError::InvalidInput(_)) { Fault::Request } else { Fault::Engine };
            assert_eq!(e.fault(), want, "{e:?}");
        }
    }

    #[test]
    fn context_prefixes_the_message_and_keeps_the_variant() {
        for e in every("slots 0..16 past 8") {
            let c = e.clone().context("loading KV blocks from host");
            assert_eq!(c.to_string(), "loading KV blocks from host: slots 0..16 past 8");
            assert_eq!(std::mem::discriminant(&c), std::mem::discriminant(&e));
            assert_eq!(c.fault(), e.fault());
        }
    }

    #[test]
    fn the_engine_takes_the_blame_for_refused_arguments_it_built_and_nothing_else_changes() {
        for e in every("slots 0..16 past 8") {
            let blamed = e.clone().blame_engine();
            assert_eq!(blamed.fault(), Fault::Engine, "{e:?}");
            assert_eq!(blamed.to_string(), e.to_string());
            match e {
                BackendError::InvalidInput(m) => assert_eq!(blamed, BackendError::Internal(m)),
                other => assert_eq!(blamed, other),
            }
        }
    }

    #[test]
    fn model_errors_map_by_what_failed() {
        let math = ModelError::Candle(candle_core::Error::Msg("matmul".into()));
        let text = math.to_string();
        assert_eq!(BackendError::from(math), BackendError::Other(text));
        let tensor =
            ModelError::Tensor { file: "m.safetensors".into(), tensor: "w".into(), reason: "shape".into() };
        let text = tensor.to_string();
        assert_eq!(BackendError::from(tensor), BackendError::Shape(text));
    }
}
