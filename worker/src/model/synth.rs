//! `kvgate-worker synth-model`: random-initialised models written in exactly the Hugging Face format
//! (`config.json`, `model.safetensors` or shards + index, `tokenizer.json`, `tokenizer_config.json`,
//! `generation_config.json`), deterministic for a seed. No model hub is reachable here, so tests and demos use these.
//!
//! Presets (measured figures in docs/benchmarks/engine.md):
//! - `tiny`: unit tests. hidden 64, 2 layers, 4 heads / 2 KV heads (GQA), vocab 512, llama3 RoPE scaling.
//! - `small`: the embedded default for demos. hidden 256, 6 layers, 8 heads / 4 KV heads, intermediate 768,
//!   vocab 8192, tied embeddings (6.8M parameters): a 2K-token prefill takes about a second on 2 cores, so
//!   prefix-cache hits are visibly worth it.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use kvgate_shared::prompt::{synth_tokenizer, SplitMix64};
use serde_json::json;

use super::{Architecture, ModelError};

/// A named size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    Tiny,
    Small,
}

/// What to synthesise.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub preset: Preset,
    pub seed: u64,
    pub architecture: Architecture,
    /// Stored dtype: `float32`, `bfloat16` or `float16`.
    pub dtype: String,
    /// Write `n` shards plus `model.safetensors.index.json` instead of one file (n > 1).
    pub shards: usize,
}

impl SynthSpec {
    pub fn new(preset: Preset, seed: u64) -> Self {
        Self { preset, seed, architecture: Architecture::Llama, dtype: "float32".into(), shards: 1 }
    }
}

struct Dims {
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
    max_pos: usize,
    tied: bool,
    llama3_rope: bool,
}

fn dims(p: Preset) -> Dims {
    match p {
        Preset::Tiny => Dims {
            hidden: 64,
            inter: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            vocab: 512,
            max_pos: 4096,
            tied: false,
            llama3_rope: true,
        },
        Preset::Small => Dims {
            hidden: 256,
            inter: 768,
            layers: 6,
            heads: 8,
            kv_heads: 4,
            vocab: 8192,
            max_pos: 32_768,
            tied: true,
            llama3_rope: false,
        },
    }
}

/// Normal(0, std) samples from a seeded stream (Box-Muller).
fn normal(rng: &mut SplitMix64, n: usize, std: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1 = rng.unit().max(1e-12);
        let u2 = rng.unit();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        out.push((r * t.cos()) as f32 * std);
        out.push((r * t.sin()) as f32 * std);
    }
    out.truncate(n);
    out
}

/// Writes a model directory; returns its `config.json` values as JSON.
pub fn synth_model(out: &Path, spec: &SynthSpec) -> Result<serde_json::Value, ModelError> {
    let d = dims(spec.preset);
    let io = |file: &Path, e: std::io::Error| ModelError::File {
        file: file.display().to_string(),
        reason: e.to_string(),
    };
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let tok = synth_tokenizer(d.vocab, spec.seed);
    let head_dim = d.hidden / d.heads;
    let bias = spec.architecture == Architecture::Qwen2;
    let dtype = match spec.dtype.as_str() {
        "float32" => DType::F32,
        "bfloat16" => DType::BF16,
        "float16" => DType::F16,
        other => {
            return Err(ModelError::Field {
                file: "synth-model".into(),
                field: "dtype".into(),
                reason: format!("{other:?} is not float32, bfloat16 or float16"),
            })
        }
    };
    let mut config = json!({
        "architectures": [spec.architecture.hf_name()],
        "model_type": match spec.architecture { Architecture::Llama => "llama", Architecture::Mistral => "mistral", Architecture::Qwen2 => "qwen2" },
        "hidden_size": d.hidden,
        "intermediate_size": d.inter,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": head_dim,
        "vocab_size": d.vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": d.max_pos,
        "tie_word_embeddings": d.tied,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "torch_dtype": spec.dtype,
        "hidden_act": "silu",
        "kvgate_synthetic": {"preset": format!("{:?}", spec.preset).to_lowercase(), "seed": spec.seed},
    });
    if d.llama3_rope && spec.architecture == Architecture::Llama {
        config["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024});
    }
    match spec.architecture {
        Architecture::Mistral => config["sliding_window"] = serde_json::Value::Null,
        Architecture::Qwen2 => {
            config["sliding_window"] = json!(d.max_pos);
            config["max_window_layers"] = json!(d.layers);
            config["use_sliding_window"] = json!(false);
        }
        Architecture::Llama => {}
    }

    // Weights: projections ~ N(0, 1/sqrt(fan_in)) so activations and logits stay O(1); norms ~ 1 + N(0, 0.1).
    let mut rng = SplitMix64::new(spec.seed ^ 0x6B76_6761_7465);
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    let mut add = |name: String, shape: &[usize], std: f32, offset: f32| -> Result<(), ModelError> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = normal(&mut rng, n, std).into_iter().map(|x| x + offset).collect();
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(dtype)?;
        tensors.push((name, t));
        Ok(())
    };
    let (h, q, kv, i) = (d.hidden, d.heads * head_dim, d.kv_heads * head_dim, d.inter);
    let inv = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    add("model.embed_tokens.weight".into(), &[d.vocab, h], 1.0, 0.0)?;
    for l in 0..d.layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        add(p("input_layernorm.weight"), &[h], 0.1, 1.0)?;
        add(p("self_attn.q_proj.weight"), &[q, h], inv(h), 0.0)?;
        add(p("self_attn.k_proj.weight"), &[kv, h], inv(h), 0.0)?;
        add(p("self_attn.v_proj.weight"), &[kv, h], inv(h), 0.0)?;
        if bias {
            add(p("self_attn.q_proj.bias"), &[q], 0.1, 0.0)?;
            add(p("self_attn.k_proj.bias"), &[kv], 0.1, 0.0)?;
            add(p("self_attn.v_proj.bias"), &[kv], 0.1, 0.0)?;
        }
        add(p("self_attn.o_proj.weight"), &[h, q], inv(q), 0.0)?;
        add(p("post_attention_layernorm.weight"), &[h], 0.1, 1.0)?;
        add(p("mlp.gate_proj.weight"), &[i, h], inv(h), 0.0)?;
        add(p("mlp.up_proj.weight"), &[i, h], inv(h), 0.0)?;
        add(p("mlp.down_proj.weight"), &[h, i], inv(i), 0.0)?;
    }
    add("model.norm.weight".into(), &[h], 0.1, 1.0)?;
    if !d.tied {
        add("lm_head.weight".into(), &[d.vocab, h], inv(h), 0.0)?;
    }
    write_safetensors(out, tensors, spec.shards.max(1))?;

    let write = |name: &str, text: &str| {
        let path = out.join(name);
        std::fs::write(&path, text).map_err(|e| io(&path, e))
    };
    write("config.json", &serde_json::to_string_pretty(&config).unwrap_or_default())?;
    write("tokenizer.json", &tok.tokenizer_json)?;
    write("tokenizer_config.json", &tok.tokenizer_config_json)?;
    let generation =
        json!({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "do_sample": false});
    write("generation_config.json", &serde_json::to_string_pretty(&generation).unwrap_or_default())?;
    Ok(config)
}

fn write_safetensors(out: &Path, tensors: Vec<(String, Tensor)>, shards: usize) -> Result<(), ModelError> {
    let err = |file: &Path, e: candle_core::Error| ModelError::File {
        file: file.display().to_string(),
        reason: e.to_string(),
    };
    if shards == 1 {
        let path = out.join("model.safetensors");
        let map: HashMap<String, Tensor> = tensors.into_iter().collect();
        return candle_core::safetensors::save(&map, &path).map_err(|e| err(&path, e));
    }
    let per = tensors.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (k, chunk) in tensors.chunks(per).enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", k + 1, shards);
        let path = out.join(&name);
        let mut map = HashMap::new();
        for (tname, t) in chunk {
            weight_map.insert(tname.clone(), json!(name));
            total += t.elem_count() * t.dtype().size_in_bytes();
            map.insert(tname.clone(), t.clone());
        }
        candle_core::safetensors::save(&map, &path).map_err(|e| err(&path, e))?;
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let path = out.join("model.safetensors.index.json");
    std::fs::write(&path, serde_json::to_string_pretty(&index).unwrap_or_default())
        .map_err(|e| ModelError::File { file: path.display().to_string(), reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ModelConfig, ModelWeights};

    #[test]
    fn tiny_round_trips_and_is_deterministic() {
        let a = tempfile::tempdir().expect("tmp");
        let b = tempfile::tempdir().expect("tmp");
        synth_model(a.path(), &SynthSpec::new(Preset::Tiny, 3)).expect("synth");
        synth_model(b.path(), &SynthSpec::new(Preset::Tiny, 3)).expect("synth");
        for f in ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"] {
            assert_eq!(
                std::fs::read(a.path().join(f)).expect("a"),
                std::fs::read(b.path().join(f)).expect("b"),
                "{f}"
            );
        }
        let cfg = ModelConfig::from_dir(a.path()).expect("config");
        assert_eq!(cfg.vocab_size, 512);
        let w = ModelWeights::load(a.path(), &cfg).expect("weights");
        assert_eq!(w.layers.len(), 2);
        assert_eq!(w.lm_head.dims(), &[512, 64]);
        let prompter = kvgate_shared::prompt::Prompter::from_dir(a.path()).expect("tokenizer");
        assert!(prompter.vocab_size() <= cfg.vocab_size);
        assert_eq!(prompter.eos_token_id(), cfg.eos_token_ids.first().copied());
    }

    #[test]
    fn sharded_bf16_qwen2_loads() {
        let dir = tempfile::tempdir().expect("tmp");
        let spec = SynthSpec {
            architecture: Architecture::Qwen2,
            dtype: "bfloat16".into(),
            shards: 3,
            ..SynthSpec::new(Preset::Tiny, 1)
        };
        synth_model(dir.path(), &spec).expect("synth");
        assert!(dir.path().join("model.safetensors.index.json").exists());
        assert!(!dir.path().join("model.safetensors").exists());
        let cfg = ModelConfig::from_dir(dir.path()).expect("config");
        assert!(cfg.attention_bias);
        let w = ModelWeights::load(dir.path(), &cfg).expect("weights");
        assert!(w.layers[0].q_bias.is_some());
        assert_eq!(w.embed_tokens.dtype(), DType::F32);
    }

    #[test]
    fn broken_models_name_the_file_and_tensor() {
        let dir = tempfile::tempdir().expect("tmp");
        synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 2)).expect("synth");
        let cfg = ModelConfig::from_dir(dir.path()).expect("config");
        // A config that disagrees with the tensors.
        let mut wrong = cfg.clone();
        wrong.intermediate_size = 100;
        let err = ModelWeights::load(dir.path(), &wrong).expect_err("shape");
        assert!(
            err.to_string().contains("model.layers.0.mlp.gate_proj.weight")
                && err.to_string().contains("shape"),
            "{err}"
        );
        // A config that needs a tensor the file lacks.
        let mut bias = cfg.clone();
        bias.attention_bias = true;
        let err = ModelWeights::load(dir.path(), &bias).expect_err("missing");
        assert!(
            err.to_string().contains("self_attn.q_proj.bias") && err.to_string().contains("missing"),
            "{err}"
        );
        // A corrupt file.
        std::fs::write(dir.path().join("model.safetensors"), b"garbage").expect("write");
        let err = ModelWeights::load(dir.path(), &cfg).expect_err("corrupt");
        assert!(err.to_string().contains("model.safetensors"), "{err}");
        // No weights at all.
        std::fs::remove_file(dir.path().join("model.safetensors")).expect("rm");
        let err = ModelWeights::load(dir.path(), &cfg).expect_err("absent");
        assert!(err.to_string().contains("missing"), "{err}");
    }
}
