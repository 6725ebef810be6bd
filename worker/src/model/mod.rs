//! The model: its Hugging Face configuration, its weights, the Llama-family forward pass over paged KV, and the
//! synthetic models used by tests and demos.
//!
//! - `config`: `config.json` parsing and validation (`ModelConfig`);
//! - `weights`: safetensors loading by Hugging Face tensor names into `ModelWeights` (f32 on the CPU);
//! - `synth`: `kvgate-worker synth-model`: random-weight models in the real HF format;
//! - `identity`: a digest of a model directory's weights (what the SSD tier's records are valid for);
//! - `lora`: PEFT LoRA adapters read and checked against the model, and synthesized (not applied yet: #47);
//! - `llama`: the forward pass (Llama 2/3, Qwen2, Mistral) reading and writing the paged KV pool.

pub mod config;
pub mod fp8;
pub mod identity;
pub mod llama;
pub mod lora;
pub mod stored;
pub mod synth;
pub mod weights;

pub use config::{Architecture, ModelConfig, RopeScaling};
pub use weights::{LayerWeights, ModelWeights};

/// Why a model could not be loaded: always names the file and, where it applies, the field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{file}: {reason}")]
    File { file: String, reason: String },
    #[error("{file}: field `{field}`: {reason}")]
    Field { file: String, field: String, reason: String },
    #[error("{file}: tensor `{tensor}`: {reason}")]
    Tensor { file: String, tensor: String, reason: String },
    #[error(
        "unsupported architecture {0:?} (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"
    )]
    UnsupportedArchitecture(String),
    #[error("tensor math failed: {0}")]
    Candle(#[from] candle_core::Error),
}
