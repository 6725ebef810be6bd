//! The CUDA backend: the same engine (scheduler, block manager, prefix cache, reports, OpenAI API) computing on an
//! NVIDIA GPU. Nothing CUDA is needed at build time: cudarc loads `libcuda`, `libnvrtc` and `libcublas` at run
//! time, so one binary serves CPU and GPU (`--device auto|cpu|cuda[:N]`).
//!
//! - `compile`: kernel sources (`kernels/*.cu`, one file per family) and NVRTC compilation to cached CUBIN;
//! - `gpu`: context, stream, cuBLAS, device buffers, launches, GEMM shapes;
//! - `weights`: the model's tensors on the device (loaded from safetensors, or random for benchmarks);
//! - `attention`: split-K paged decode and GEMM-based causal prefill over the pool;
//! - `forward`: the Llama-family forward pass over the paged KV pool in device memory;
//! - `lora`: LoRA adapters' updates of the fused projections and their device cache (unverified on a GPU yet);
//! - `backend`: [`CudaBackend`], the engine's `Backend` on a GPU, and KV pool sizing;
//! - `selftest`: every kernel against its CPU reference (`kvgate-worker gpu-selftest`);
//! - `check`: logits against the CPU engine and benchmarks (`kvgate-worker gpu-logits`, `gpu-bench`).

pub mod attention;
pub mod backend;
pub mod check;
pub mod compile;
pub mod forward;
pub mod gpu;
pub mod lora;
pub mod selftest;
pub mod weights;

pub use backend::CudaBackend;

use cudarc::cublas::sys::cudaDataType;

/// Storage type of weights, activations and KV on the GPU (math is f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The kernel-name suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    pub(crate) fn cuda(self) -> cudaDataType {
        match self {
            DType::F32 => cudaDataType::CUDA_R_32F,
            DType::BF16 => cudaDataType::CUDA_R_16BF,
            DType::F16 => cudaDataType::CUDA_R_16F,
        }
    }

    /// `float32`, `bfloat16` / `bf16`, `float16` / `f16` / `half`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "float32" | "f32" | "fp32" => Some(DType::F32),
            "bfloat16" | "bf16" => Some(DType::BF16),
            "float16" | "f16" | "fp16" | "half" => Some(DType::F16),
            _ => None,
        }
    }

    /// The Hugging Face name.
    pub fn hf_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        }
    }
}

/// `--device`: where the model engine computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// CUDA GPU 0 when a driver and a GPU are found, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

impl DeviceChoice {
    /// `auto`, `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("device {s:?} is not auto, cpu, cuda or cuda:N")),
        }
    }

    /// Resolves `auto` by probing for a driver and a GPU.
    pub fn resolve(self) -> Self {
        match self {
            Self::Auto if gpu::driver_gpu_count() > 0 => Self::Cuda(0),
            Self::Auto => Self::Cpu,
            other => other,
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => write!(f, "auto"),
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_choices_parse() {
        assert_eq!(DeviceChoice::parse("auto"), Ok(DeviceChoice::Auto));
        assert_eq!(DeviceChoice::parse("cuda"), Ok(DeviceChoice::Cuda(0)));
        assert_eq!(DeviceChoice::parse("cuda:3"), Ok(DeviceChoice::Cuda(3)));
        assert!(DeviceChoice::parse("gpu").is_err());
        assert!(DeviceChoice::parse("cuda:x").is_err());
        assert_eq!(DType::parse("bf16"), Some(DType::BF16));
        assert_eq!(DType::parse("int8"), None);
    }
}
