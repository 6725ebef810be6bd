//! Loading a model's weights from `model.safetensors` or a sharded `model.safetensors.index.json`, by their
//! Hugging Face names, converted to f32 on the CPU, with every shape checked against the config.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::{ModelConfig, ModelError};

/// One decoder layer's tensors, in Hugging Face layout (`Linear` weights are `[out, in]`).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub input_layernorm: Tensor,
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub q_bias: Option<Tensor>,
    pub k_bias: Option<Tensor>,
    pub v_bias: Option<Tensor>,
    pub o_proj: Tensor,
    pub post_attention_layernorm: Tensor,
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
}

/// All of a model's tensors (f32, CPU).
#[derive(Clone, Debug)]
pub struct ModelWeights {
    pub embed_tokens: Tensor,
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,
    /// `lm_head.weight`, or the embedding matrix when embeddings are tied.
    pub lm_head: Tensor,
}

/// The safetensors files of a model directory: `model.safetensors`, or the shards `model.safetensors.index.json`
/// names (plain file names only).
pub fn model_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.exists() {
        let file = index.display().to_string();
        let text = std::fs::read_to_string(&index)
            .map_err(|e| ModelError::File { file: file.clone(), reason: e.to_string() })?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::File { file: file.clone(), reason: format!("not valid JSON: {e}") })?;
        let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelError::Field {
            file: file.clone(),
            field: "weight_map".into(),
            reason: "missing or not an object".into(),
        })?;
        let mut names: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_owned)).collect();
        names.sort();
        names.dedup();
        if names.iter().any(|n| n.contains('/') || n.contains("..")) {
            return Err(ModelError::Field {
                file,
                field: "weight_map".into(),
                reason: "shard names must be plain file names".into(),
            });
        }
        names.into_iter().map(|n| dir.join(n)).collect()
    } else if single.exists() {
        vec![single]
    } else {
        return Err(ModelError::File {
            file: single.display().to_string(),
            reason: "missing (and no model.safetensors.index.json either)".into(),
        });
    };
    Ok(files)
}

/// The tensors of every safetensors file of a model directory, and which file each came from.
struct TensorFiles {
    tensors: HashMap<String, (Tensor, PathBuf)>,
}

impl TensorFiles {
    fn open(dir: &Path) -> Result<Self, ModelError> {
        let files = model_files(dir)?;
        let mut tensors = HashMap::new();
        for path in files {
            let loaded =
                candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| ModelError::File {
                    file: path.display().to_string(),
                    reason: format!("cannot read safetensors: {e}"),
                })?;
            for (name, t) in loaded {
                tensors.insert(name, (t, path.clone()));
            }
        }
        Ok(Self { tensors })
    }

    fn file_of(&self, name: &str) -> String {
        self.tensors.get(name).map(|(_, p)| p.display().to_string()).unwrap_or_else(|| "model".into())
    }

    /// The tensor `name` as f32 with exactly `shape`.
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        let (t, path) = self.tensors.get(name).ok_or_else(|| ModelError::Tensor {
            file: "model.safetensors".into(),
            tensor: name.to_owned(),
            reason: "missing".into(),
        })?;
        if t.dims() != shape {
            return Err(ModelError::Tensor {
                file: path.display().to_string(),
                tensor: name.to_owned(),
                reason: format!("shape {:?}, config says {:?}", t.dims(), shape),
            });
        }
        match t.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => {}
            other => {
                return Err(ModelError::Tensor {
                    file: self.file_of(name),
                    tensor: name.to_owned(),
                    reason: format!("dtype {other:?} (expected f32, bf16 or f16)"),
                })
            }
        }
        Ok(t.to_dtype(DType::F32)?)
    }
}

impl ModelWeights {
    /// Loads every tensor the config calls for from `dir`.
    pub fn load(dir: &Path, cfg: &ModelConfig) -> Result<Self, ModelError> {
        let files = TensorFiles::open(dir)?;
        let h = cfg.hidden_size;
        let q = cfg.num_attention_heads * cfg.head_dim;
        let kv = cfg.kv_dim();
        let i = cfg.intermediate_size;
        let embed_tokens = files.get("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let bias = |s: &str, n: usize| -> Result<Option<Tensor>, ModelError> {
                if cfg.attention_bias {
                    Ok(Some(files.get(&p(s), &[n])?))
                } else {
                    Ok(None)
                }
            };
            layers.push(LayerWeights {
                input_layernorm: files.get(&p("input_layernorm.weight"), &[h])?,
                q_proj: files.get(&p("self_attn.q_proj.weight"), &[q, h])?,
                k_proj: files.get(&p("self_attn.k_proj.weight"), &[kv, h])?,
                v_proj: files.get(&p("self_attn.v_proj.weight"), &[kv, h])?,
                q_bias: bias("self_attn.q_proj.bias", q)?,
                k_bias: bias("self_attn.k_proj.bias", kv)?,
                v_bias: bias("self_attn.v_proj.bias", kv)?,
                o_proj: files.get(&p("self_attn.o_proj.weight"), &[h, q])?,
                post_attention_layernorm: files.get(&p("post_attention_layernorm.weight"), &[h])?,
                gate_proj: files.get(&p("mlp.gate_proj.weight"), &[i, h])?,
                up_proj: files.get(&p("mlp.up_proj.weight"), &[i, h])?,
                down_proj: files.get(&p("mlp.down_proj.weight"), &[h, i])?,
            });
        }
        let norm = files.get("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            files.get("lm_head.weight", &[cfg.vocab_size, h])?
        };
        Ok(Self { embed_tokens, layers, norm, lm_head })
    }
}
