//! `config.json` of a Hugging Face Llama-family model: parsed, defaulted like `transformers`, and validated, with
//! errors that name the file and the field.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::ModelError;

/// The decoder families this engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    /// Llama 2 / 3.x (`LlamaForCausalLM`).
    Llama,
    /// Mistral (`MistralForCausalLM`): Llama's math; sliding window unsupported (refused when smaller than the
    /// context).
    Mistral,
    /// Qwen2 / 2.5 (`Qwen2ForCausalLM`): Llama's math plus q/k/v biases.
    Qwen2,
}

impl Architecture {
    /// The `architectures[0]` name in `config.json`.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    fn from_hf_name(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" => Some(Architecture::Llama),
            "MistralForCausalLM" => Some(Architecture::Mistral),
            "Qwen2ForCausalLM" => Some(Architecture::Qwen2),
            _ => None,
        }
    }
}

/// Llama 3.x RoPE scaling (`rope_scaling` with `rope_type: "llama3"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// The fields of `config.json` the engine uses, after defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2, or `attention_bias: true`).
    pub attention_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// `torch_dtype` of the stored weights (`float32`, `bfloat16`, `float16`); compute is f32 on the CPU.
    pub torch_dtype: String,
}

/// Raw `config.json` as written by `transformers`.
#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f32>,
    rope_scaling: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    sliding_window: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let file = path.display().to_string();
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ModelError::File { file: file.clone(), reason: e.to_string() })?;
        Self::from_json(&text, &file)
    }

    /// Parses a `config.json` text (`file` names it in errors).
    pub fn from_json(text: &str, file: &str) -> Result<Self, ModelError> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| ModelError::File {
            file: file.to_owned(),
            reason: format!("not valid JSON: {e}"),
        })?;
        let field = |name: &str, reason: &str| ModelError::Field {
            file: file.to_owned(),
            field: name.to_owned(),
            reason: reason.to_owned(),
        };
        let arch_name = raw
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .ok_or_else(|| field("architectures", "missing"))?;
        let architecture =
            Architecture::from_hf_name(&arch_name).ok_or(ModelError::UnsupportedArchitecture(arch_name))?;
        let req = |v: Option<usize>, name: &str| v.ok_or_else(|| field(name, "missing"));
        let hidden_size = req(raw.hidden_size, "hidden_size")?;
        let num_attention_heads = req(raw.num_attention_heads, "num_attention_heads")?;
        if num_attention_heads == 0 {
            return Err(field("num_attention_heads", "must be at least 1"));
        }
        let rope_scaling = match &raw.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => parse_rope_scaling(v).map_err(|r| field("rope_scaling", &r))?,
        };
        let ids = |v: &Option<serde_json::Value>, name: &str| -> Result<Vec<u32>, ModelError> {
            match v {
                None | Some(serde_json::Value::Null) => Ok(vec![]),
                Some(v) => serde_json::from_value::<TokenIds>(v.clone())
                    .map(TokenIds::into_vec)
                    .map_err(|_| field(name, "must be a token id or a list of token ids")),
            }
        };
        let max_position_embeddings = req(raw.max_position_embeddings, "max_position_embeddings")?;
        let sliding = raw.sliding_window.as_ref().and_then(serde_json::Value::as_u64);
        if let Some(w) = sliding {
            let active = raw.use_sliding_window.unwrap_or(architecture == Architecture::Mistral);
            if active && (w as usize) < max_position_embeddings {
                return Err(field("sliding_window", "sliding-window attention is not supported"));
            }
        }
        let cfg = ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: req(raw.intermediate_size, "intermediate_size")?,
            num_hidden_layers: req(raw.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(num_attention_heads),
            head_dim: raw.head_dim.unwrap_or(hidden_size / num_attention_heads),
            vocab_size: req(raw.vocab_size, "vocab_size")?,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            attention_bias: raw.attention_bias.unwrap_or(architecture == Architecture::Qwen2),
            bos_token_id: ids(&raw.bos_token_id, "bos_token_id")?.first().copied(),
            eos_token_ids: ids(&raw.eos_token_id, "eos_token_id")?,
            torch_dtype: raw.torch_dtype.or(raw.dtype).unwrap_or_else(|| "float32".into()),
        };
        cfg.validate().map_err(|(name, reason)| field(name, &reason))?;
        Ok(cfg)
    }

    /// Checks the shapes fit together.
    #[allow(clippy::neg_cmp_op_on_partial_ord)] // `!(x > 0)` on purpose: NaN must fail too.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err((name, "must be at least 1".into()));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err((
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(("head_dim", format!("{} must be even for RoPE", self.head_dim)));
        }
        if !matches!(self.torch_dtype.as_str(), "float32" | "bfloat16" | "float16") {
            return Err((
                "torch_dtype",
                format!("{:?} is not float32, bfloat16 or float16", self.torch_dtype),
            ));
        }
        if !(self.rms_norm_eps > 0.0) || !(self.rope_theta > 0.0) {
            return Err(("rms_norm_eps", "rms_norm_eps and rope_theta must be positive".into()));
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Floats of K (or V) per token per layer.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Parameters (embeddings counted once when tied).
    pub fn num_params(&self) -> usize {
        let q = self.num_attention_heads * self.head_dim;
        let attn = self.hidden_size * q * 2 + self.hidden_size * self.kv_dim() * 2;
        let mlp = 3 * self.hidden_size * self.intermediate_size;
        let layer = attn + mlp + 2 * self.hidden_size;
        let embed = self.vocab_size * self.hidden_size;
        embed * if self.tie_word_embeddings { 1 } else { 2 }
            + layer * self.num_hidden_layers
            + self.hidden_size
    }

    /// The RoPE inverse frequencies, with Llama 3 scaling applied (as `transformers` computes them).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f32> =
            (0..d).step_by(2).map(|i| 1.0 / self.rope_theta.powf(i as f32 / d as f32)).collect();
        let Some(s) = &self.rope_scaling else { return base };
        let low_wavelen = s.original_max_position_embeddings as f32 / s.low_freq_factor;
        let high_wavelen = s.original_max_position_embeddings as f32 / s.high_freq_factor;
        base.into_iter()
            .map(|freq| {
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                if wavelen < high_wavelen {
                    freq
                } else if wavelen > low_wavelen {
                    freq / s.factor
                } else {
                    let smooth = (s.original_max_position_embeddings as f32 / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * freq / s.factor + smooth * freq
                }
            })
            .collect()
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            TokenIds::One(x) => vec![x],
            TokenIds::Many(v) => v,
        }
    }
}

#[allow(clippy::neg_cmp_op_on_partial_ord)] // `!(x > 0)` on purpose: NaN must fail too.
fn parse_rope_scaling(v: &serde_json::Value) -> Result<Option<RopeScaling>, String> {
    let kind =
        v.get("rope_type").or_else(|| v.get("type")).and_then(serde_json::Value::as_str).unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let num = |k: &str| {
                v.get(k).and_then(serde_json::Value::as_f64).ok_or(format!("llama3 scaling needs `{k}`"))
            };
            let s = RopeScaling {
                factor: num("factor")? as f32,
                low_freq_factor: num("low_freq_factor")? as f32,
                high_freq_factor: num("high_freq_factor")? as f32,
                original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
            };
            if !(s.factor > 0.0)
                || !(s.high_freq_factor > s.low_freq_factor)
                || s.original_max_position_embeddings == 0
            {
                return Err("llama3 scaling needs factor > 0, high_freq_factor > low_freq_factor".into());
            }
            Ok(Some(s))
        }
        other => Err(format!("rope_type {other:?} is not supported (default, llama3)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA3: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096, "tie_word_embeddings": true,
        "bos_token_id": 1, "eos_token_id": [2, 3], "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 1024}}"#;

    #[test]
    fn parses_llama3_with_defaults() {
        let c = ModelConfig::from_json(LLAMA3, "config.json").expect("parses");
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.group_size(), 2);
        assert_eq!(c.eos_token_ids, vec![2, 3]);
        assert!(!c.attention_bias);
        assert!(c.rope_scaling.is_some());
        let f = c.rope_inv_freq();
        assert_eq!(f.len(), 8);
        assert_eq!(f[0], 1.0);
    }

    #[test]
    fn qwen2_has_bias_and_errors_name_file_and_field() {
        let q = LLAMA3.replace("LlamaForCausalLM", "Qwen2ForCausalLM");
        assert!(ModelConfig::from_json(&q, "config.json").expect("parses").attention_bias);
        let gpt = LLAMA3.replace("LlamaForCausalLM", "GPT2LMHeadModel");
        assert!(matches!(ModelConfig::from_json(&gpt, "x"), Err(ModelError::UnsupportedArchitecture(_))));
        let missing = LLAMA3.replace("\"vocab_size\": 300,", "");
        let err = ModelConfig::from_json(&missing, "/m/config.json").expect_err("missing");
        assert_eq!(err.to_string(), "/m/config.json: field `vocab_size`: missing");
        let bad_kv = LLAMA3.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3");
        assert!(ModelConfig::from_json(&bad_kv, "c")
            .expect_err("kv")
            .to_string()
            .contains("num_key_value_heads"));
        let bad_rope = LLAMA3.replace("\"llama3\"", "\"yarn\"");
        assert!(ModelConfig::from_json(&bad_rope, "c")
            .expect_err("rope")
            .to_string()
            .contains("rope_scaling"));
        assert!(ModelConfig::from_json("{", "c").expect_err("json").to_string().contains("not valid JSON"));
        let sliding = LLAMA3
            .replace("LlamaForCausalLM", "MistralForCausalLM")
            .replace("\"vocab_size\"", "\"sliding_window\": 128, \"vocab_size\"");
        assert!(ModelConfig::from_json(&sliding, "c")
            .expect_err("sw")
            .to_string()
            .contains("sliding_window"));
    }
}
