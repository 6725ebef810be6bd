//! kvgate-worker: the inference engine behind each kvgate worker process.
//!
//! - [`model`]: Hugging Face Llama-family models (config, safetensors weights, synthetic models) and the forward
//!   pass over paged KV;
//! - [`kv`]: block pool, prefix cache and per-sequence block tables (pure bookkeeping);
//! - [`engine`]: requests, the continuous-batching scheduler with chunked prefill and preemption, sampling, and the
//!   compute `Backend` trait (the CPU model, the CUDA model in [`cuda`], the timing-model simulation);
//! - [`cuda`]: the CUDA backend (NVRTC kernels, cuBLAS; loaded at run time);
//! - [`server`]: `kvgate-worker serve`: the OpenAI HTTP API, the engine thread, cache-summary reports, metrics.

// FFI to the CUDA driver, NVRTC and cuBLAS lives here and nowhere else.
#[allow(unsafe_code)]
pub mod cuda;
pub mod engine;
pub mod kv;
pub mod model;
pub mod report;
pub mod server;
pub mod transfer;
