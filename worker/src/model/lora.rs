//! LoRA adapters in PEFT's on-disk format (`adapter_config.json` + `adapter_model.safetensors`), read and checked
//! against the base model ([`LoraAdapter::load`]), and synthesized for tests ([`synth_lora`], as `synth-model`
//! synthesizes models). The CPU engine applies them in `model::llama` ([`LoraAdapter::delta`]), the CUDA engine in
//! `cuda::lora` (packed for its fused projections).
//!
//! What an adapter changes: each targeted projection `y = x W^T` becomes `y = x W^T + s (x A^T) B^T`, with `A`
//! `[r, in]`, `B` `[out, r]` (PEFT's `lora_A.weight` / `lora_B.weight`) and `s = lora_alpha / r` (`lora_alpha /
//! sqrt(r)` with `use_rslora`). Targets: the attention projections `q_proj`, `k_proj`, `v_proj`, `o_proj` and the
//! MLP's `gate_proj`, `up_proj`, `down_proj`, in every layer or those the file has tensors for.
//!
//! Invariants: everything an adapter file says is input (an adapter may come from a client's load call): a field
//! this code does not implement (`fan_in_fan_out`, a `bias` other than `none`, `modules_to_save`,
//! `layers_to_transform`, `rank_pattern`, `alpha_pattern`, `use_dora`, `lora_bias`, `layer_replication`,
//! `use_qalora`, `alora_invocation_tokens`, `trainable_token_indices`, `target_parameters`, a regex
//! `target_modules`, a target outside the seven) is refused by name, never ignored (what matters only in training,
//! such as `lora_dropout` or `init_lora_weights`, is not read); a rank past the limit, a tensor of the wrong shape, a key that
//! names no known layer and module, or a file past [`MAX_ADAPTER_BYTES`] is refused before anything is kept; only
//! regular files are read, within their bound as read ([`read_regular`]).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use kvgate_shared::prompt::SplitMix64;
use serde_json::{json, Value};

use super::{ModelConfig, ModelError};

/// Default of the largest rank an adapter may have (vLLM's `--max-lora-rank` default is 16; kvgate's is wider).
pub const DEFAULT_MAX_LORA_RANK: usize = 64;
/// Largest adapter weights file read.
pub const MAX_ADAPTER_BYTES: u64 = 2 << 30;
/// The prefix PEFT writes before a Llama model's tensor names.
const KEY_PREFIX: &str = "base_model.model.model.layers.";

/// A projection an adapter may target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] =
        [Target::Q, Target::K, Target::V, Target::O, Target::Gate, Target::Up, Target::Down];

    /// PEFT's module name.
    pub fn module(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// Its path under a layer (`self_attn.q_proj`, `mlp.up_proj`).
    fn path(self) -> String {
        match self {
            Target::Q | Target::K | Target::V | Target::O => format!("self_attn.{}", self.module()),
            _ => format!("mlp.{}", self.module()),
        }
    }

    fn of_module(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.module() == name)
    }

    /// `(in, out)` features of this projection in `cfg`.
    pub fn features(self, cfg: &ModelConfig) -> (usize, usize) {
        let (h, q, kv, i) =
            (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.kv_dim(), cfg.intermediate_size);
        match self {
            Target::Q => (h, q),
            Target::K | Target::V => (h, kv),
            Target::O => (q, h),
            Target::Gate | Target::Up => (h, i),
            Target::Down => (i, h),
        }
    }
}

/// One projection's low-rank update: `A` `[r, in]`, `B` `[out, r]` (f32, CPU).
#[derive(Clone, Debug)]
pub struct LoraPair {
    pub a: Tensor,
    pub b: Tensor,
}

/// A loaded adapter.
#[derive(Clone, Debug)]
pub struct LoraAdapter {
    pub name: String,
    /// What keys its KV blocks (`ExtraKey::LoraAdapter`): its name and a digest of its files, `name@<16 hex>`, so
    /// an adapter loaded again under the same name with other weights never reads the old one's blocks (the SSD
    /// tier keeps blocks across restarts).
    pub key: String,
    pub rank: usize,
    /// `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA).
    pub scaling: f32,
    /// The base model the file says it was trained on (`base_model_name_or_path`), as written.
    pub base_model: Option<String>,
    /// Per layer, the targeted projections.
    pub layers: Vec<HashMap<Target, LoraPair>>,
}

fn field(file: &str, f: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Field { file: file.into(), field: f.into(), reason: reason.into() }
}

/// The checked `adapter_config.json`: (rank, scaling, targets, base model).
fn parse_config(
    text: &str,
    file: &str,
    max_rank: usize,
) -> Result<(usize, f32, Vec<Target>, Option<String>), ModelError> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| ModelError::File { file: file.into(), reason: format!("not valid JSON: {e}") })?;
    let peft_type = v.get("peft_type").and_then(Value::as_str).unwrap_or("LORA");
    if peft_type != "LORA" {
        return Err(field(file, "peft_type", format!("{peft_type:?}: only LORA adapters are served")));
    }
    let r = v
        .get("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| field(file, "r", "missing or not a positive integer"))?;
    let r = usize::try_from(r).unwrap_or(usize::MAX);
    if r == 0 || r > max_rank {
        return Err(field(file, "r", format!("rank {r} is outside 1..={max_rank} (--max-lora-rank)")));
    }
    let alpha = v.get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
    if !alpha.is_finite() {
        return Err(field(file, "lora_alpha", "not a finite number"));
    }
    let rslora = v.get("use_rslora").and_then(Value::as_bool).unwrap_or(false);
    let scaling = if rslora { alpha / (r as f64).sqrt() } else { alpha / r as f64 } as f32;
    // What this code does not implement is refused by name.
    let truthy = |k: &str| match v.get(k) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    for k in [
        "fan_in_fan_out",
        "modules_to_save",
        "layers_to_transform",
        "rank_pattern",
        "alpha_pattern",
        "use_dora",
        "lora_bias",
        "layer_replication",
        "use_qalora",
        "alora_invocation_tokens",
        "trainable_token_indices",
        "target_parameters",
    ] {
        if truthy(k) {
            return Err(field(file, k, "not supported by kvgate's LoRA (refused, not ignored)"));
        }
    }
    match v.get("bias").and_then(Value::as_str) {
        None | Some("none") => {}
        Some(b) => return Err(field(file, "bias", format!("{b:?}: only \"none\" is supported"))),
    }
    let targets: Vec<Target> = match v.get("target_modules") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|m| {
                let name = m.as_str().unwrap_or("");
                Target::of_module(name).ok_or_else(|| {
                    field(
                        file,
                        "target_modules",
                        format!("{name:?} is not one of q/k/v/o_proj, gate/up/down_proj"),
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        Some(Value::String(s)) => {
            return Err(field(
                file,
                "target_modules",
                format!("a pattern ({s:?}) is not supported: list the modules"),
            ))
        }
        _ => return Err(field(file, "target_modules", "missing: list the targeted modules")),
    };
    let base = v.get("base_model_name_or_path").and_then(Value::as_str).map(str::to_owned);
    Ok((r, scaling, targets, base))
}

/// The first 16 hex digits of BLAKE3 over the config's bytes and the weights file (streamed).
fn digest(config: &[u8], weights: &[u8]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&(config.len() as u64).to_le_bytes());
    h.update(config);
    h.update(weights);
    h.finalize().to_hex()[..16].to_owned()
}

/// Largest `adapter_config.json` read.
pub const MAX_ADAPTER_CONFIG_BYTES: u64 = 1 << 20;

/// The bytes of `path`, a regular file, at most `limit` of them (counted as read, not as `stat` says: a file that
/// grows, or a device that never ends, stops at the bound). The path is opened without following a link at its
/// last component (callers pass a canonical path: no link anywhere in it) and without blocking (a FIFO is refused,
/// not waited on); anything but a regular file is refused.
pub fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = f.metadata().map_err(|e| e.to_string())?;
    let t = meta.file_type();
    if !t.is_file() {
        let what = if t.is_fifo() {
            "a FIFO"
        } else if t.is_char_device() || t.is_block_device() {
            "a device"
        } else if t.is_symlink() {
            "a link"
        } else {
            "not a regular file"
        };
        return Err(format!("{what}: only regular files are read"));
    }
    if meta.len() > limit {
        return Err(format!("{} bytes, past the limit of {limit}", meta.len()));
    }
    let mut out = Vec::with_capacity(meta.len() as usize);
    f.take(limit + 1).read_to_end(&mut out).map_err(|e| e.to_string())?;
    if out.len() as u64 > limit {
        return Err(format!("more than the limit of {limit} bytes"));
    }
    Ok(out)
}

/// `(layer, target, is_a)` of a PEFT tensor name.
fn parse_key(key: &str) -> Option<(usize, Target, bool)> {
    let rest = key.strip_prefix(KEY_PREFIX)?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (path, ab) = if let Some(p) = rest.strip_suffix(".lora_A.weight") {
        (p, true)
    } else {
        (rest.strip_suffix(".lora_B.weight")?, false)
    };
    let t = Target::ALL.into_iter().find(|t| t.path() == path)?;
    Some((layer, t, ab))
}

impl LoraAdapter {
    /// Reads and checks an adapter against the base model `cfg`.
    /// Each file is read by [`read_regular`] from `files(name)`, the canonical path the caller vouches for (a
    /// `--lora-root` check: `server::adapters`); [`LoraAdapter::load`] reads `dir`'s files as they are.
    pub fn load_files(
        files: &dyn Fn(&str) -> Result<std::path::PathBuf, String>,
        name: &str,
        cfg: &ModelConfig,
        max_rank: usize,
    ) -> Result<Self, ModelError> {
        let read = |f: &str, limit: u64| -> Result<(String, Vec<u8>), ModelError> {
            let path = files(f).map_err(|reason| ModelError::File { file: f.to_owned(), reason })?;
            let file = path.display().to_string();
            let bytes = read_regular(&path, limit)
                .map_err(|reason| ModelError::File { file: file.clone(), reason })?;
            Ok((file, bytes))
        };
        let (cfg_file, cfg_bytes) = read("adapter_config.json", MAX_ADAPTER_CONFIG_BYTES)?;
        let text = String::from_utf8(cfg_bytes)
            .map_err(|_| ModelError::File { file: cfg_file.clone(), reason: "not UTF-8".into() })?;
        let (rank, scaling, targets, base_model) = parse_config(&text, &cfg_file, max_rank)?;
        let (file, weights) = read("adapter_model.safetensors", MAX_ADAPTER_BYTES)?;
        let tensors = candle_core::safetensors::load_buffer(&weights, &Device::Cpu)
            .map_err(|e| ModelError::File { file: file.clone(), reason: e.to_string() })?;
        let tensor_err =
            |t: &str, reason: String| ModelError::Tensor { file: file.clone(), tensor: t.into(), reason };
        let mut halves: HashMap<(usize, Target), (Option<Tensor>, Option<Tensor>)> = HashMap::new();
        for (key, t) in tensors {
            let Some((layer, target, is_a)) = parse_key(&key) else {
                return Err(tensor_err(&key, "not a LoRA tensor of a known layer and projection".into()));
            };
            if layer >= cfg.num_hidden_layers || !targets.contains(&target) {
                return Err(tensor_err(
                    &key,
                    "names a layer the model lacks or a module the config does not target".into(),
                ));
            }
            let (fin, fout) = target.features(cfg);
            let want = if is_a { [rank, fin] } else { [fout, rank] };
            if t.dims() != want {
                return Err(tensor_err(&key, format!("shape {:?}, expected {want:?}", t.dims())));
            }
            let t = t.to_dtype(DType::F32)?;
            let slot = halves.entry((layer, target)).or_default();
            if is_a {
                slot.0 = Some(t)
            } else {
                slot.1 = Some(t)
            }
        }
        let mut layers: Vec<HashMap<Target, LoraPair>> = vec![HashMap::new(); cfg.num_hidden_layers];
        for ((layer, target), pair) in halves {
            match pair {
                (Some(a), Some(b)) => {
                    layers[layer].insert(target, LoraPair { a, b });
                }
                _ => {
                    let key = format!("{KEY_PREFIX}{layer}.{}", target.path());
                    return Err(tensor_err(&key, "has lora_A or lora_B but not both".into()));
                }
            }
        }
        if layers.iter().all(HashMap::is_empty) {
            return Err(ModelError::File { file, reason: "no LoRA tensors".into() });
        }
        let key = format!("{name}@{}", digest(text.as_bytes(), &weights));
        Ok(Self { name: name.to_owned(), key, rank, scaling, base_model, layers })
    }

    /// Reads and checks the adapter in `dir` against the base model `cfg` (its files as they are: links
    /// followed).
    pub fn load(dir: &Path, name: &str, cfg: &ModelConfig, max_rank: usize) -> Result<Self, ModelError> {
        let files = |f: &str| dir.join(f).canonicalize().map_err(|e| e.to_string());
        Self::load_files(&files, name, cfg, max_rank)
    }

    /// The update of `target` in `layer` applied to `x` (`[n, in]`): `s (x A^T) B^T` (`[n, out]`); `None` when the
    /// adapter does not target it.
    pub fn delta(&self, layer: usize, target: Target, x: &Tensor) -> Result<Option<Tensor>, ModelError> {
        let Some(p) = self.layers.get(layer).and_then(|l| l.get(&target)) else { return Ok(None) };
        let low = x.matmul(&p.a.t()?)?;
        Ok(Some((low.matmul(&p.b.t()?)? * f64::from(self.scaling))?))
    }
}

/// What [`synth_lora`] writes.
#[derive(Clone, Copy, Debug)]
pub struct LoraSpec<'a> {
    /// What `base_model_name_or_path` says.
    pub base: &'a str,
    pub rank: usize,
    pub alpha: f64,
    /// Targeted in every layer.
    pub targets: &'a [Target],
    pub seed: u64,
    /// Every `B` is 0: the adapter changes nothing (as a fresh PEFT adapter).
    pub zero: bool,
}

/// Writes a PEFT LoRA adapter for the model `cfg` into `out`, deterministic for its seed.
pub fn synth_lora(out: &Path, cfg: &ModelConfig, spec: &LoraSpec<'_>) -> Result<(), ModelError> {
    let LoraSpec { base, rank, alpha, targets, seed, zero } = *spec;
    let io = |p: &Path, e: std::io::Error| ModelError::File {
        file: p.display().to_string(),
        reason: e.to_string(),
    };
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let mut rng = SplitMix64::new(seed ^ 0x6C6F_7261);
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for layer in 0..cfg.num_hidden_layers {
        for &t in targets {
            let (fin, fout) = t.features(cfg);
            // A ~ N(0, 1/sqrt(in)) as PEFT's kaiming init is of that order; B small but not zero unless asked.
            let mut sample = |n: usize, std: f64| -> Vec<f32> {
                (0..n).map(|_| ((rng.unit() * 2.0 - 1.0) * std * 3f64.sqrt()) as f32).collect()
            };
            let a = sample(rank * fin, 1.0 / (fin as f64).sqrt());
            let b =
                if zero { vec![0.0; fout * rank] } else { sample(fout * rank, 0.5 / (rank as f64).sqrt()) };
            let key = |ab: &str| format!("{KEY_PREFIX}{layer}.{}.lora_{ab}.weight", t.path());
            tensors.insert(key("A"), Tensor::from_vec(a, (rank, fin), &Device::Cpu)?);
            tensors.insert(key("B"), Tensor::from_vec(b, (fout, rank), &Device::Cpu)?);
        }
    }
    let path = out.join("adapter_model.safetensors");
    candle_core::safetensors::save(&tensors, &path)
        .map_err(|e| ModelError::File { file: path.display().to_string(), reason: e.to_string() })?;
    let modules: Vec<&str> = targets.iter().map(|t| t.module()).collect();
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "modules_to_save": null,
        "use_rslora": false,
        "kvgate_synthetic": {"seed": seed, "zero": zero},
    });
    let cpath = out.join("adapter_config.json");
    std::fs::write(&cpath, serde_json::to_string_pretty(&config).unwrap_or_default())
        .map_err(|e| io(&cpath, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synth::{synth_model, Preset, SynthSpec};

    fn tiny() -> (tempfile::TempDir, ModelConfig) {
        let dir = tempfile::tempdir().expect("tmp");
        synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 1)).expect("synth");
        let cfg = ModelConfig::from_dir(dir.path()).expect("config");
        (dir, cfg)
    }

    #[test]
    fn a_synthesized_adapter_loads_with_its_rank_scaling_and_targets_and_a_zero_one_changes_nothing() {
        let (dir, cfg) = tiny();
        let out = dir.path().join("lora-a");
        let spec = |rank, alpha, targets, zero| LoraSpec {
            base: "kvgate-tiny",
            rank,
            alpha,
            targets,
            seed: 7,
            zero,
        };
        synth_lora(&out, &cfg, &spec(8, 16.0, &Target::ALL, false)).expect("synth-lora");
        let a = LoraAdapter::load(&out, "a", &cfg, DEFAULT_MAX_LORA_RANK).expect("load");
        assert_eq!((a.rank, a.scaling, a.layers.len()), (8, 2.0, cfg.num_hidden_layers));
        assert!(a.key.starts_with("a@") && a.key.len() == 2 + 16, "{}", a.key);
        // The same name over other weights keys other blocks.
        let other = dir.path().join("lora-a2");
        synth_lora(&other, &cfg, &spec(8, 16.0, &Target::ALL, false)).expect("same files");
        let same = LoraAdapter::load(&other, "a", &cfg, DEFAULT_MAX_LORA_RANK).expect("load");
        assert_eq!(same.key, a.key, "the same files, the same key");
        synth_lora(&other, &cfg, &LoraSpec { seed: 8, ..spec(8, 16.0, &Target::ALL, false) }).expect("other");
        let changed = LoraAdapter::load(&other, "a", &cfg, DEFAULT_MAX_LORA_RANK).expect("load");
        assert_ne!(changed.key, a.key);
        assert!(a.layers.iter().all(|l| l.len() == 7));
        let x = Tensor::ones((3, cfg.hidden_size), DType::F32, &Device::Cpu).expect("x");
        let d = a.delta(0, Target::Q, &x).expect("delta").expect("targeted");
        assert_eq!(d.dims(), &[3, cfg.num_attention_heads * cfg.head_dim]);
        assert!(d.abs().expect("abs").sum_all().expect("sum").to_scalar::<f32>().expect("f32") > 0.0);
        let zero = dir.path().join("lora-zero");
        synth_lora(&zero, &cfg, &spec(4, 8.0, &[Target::Q, Target::V], true)).expect("synth");
        let z = LoraAdapter::load(&zero, "z", &cfg, DEFAULT_MAX_LORA_RANK).expect("load");
        let d = z.delta(1, Target::V, &x).expect("delta").expect("targeted");
        assert_eq!(d.abs().expect("abs").sum_all().expect("sum").to_scalar::<f32>().expect("f32"), 0.0);
        assert!(z.delta(1, Target::O, &x).expect("delta").is_none(), "not targeted");
    }

    #[test]
    fn what_the_adapter_code_does_not_implement_is_refused_by_name() {
        let base = json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none"});
        let with = |k: &str, v: Value| {
            let mut c = base.clone();
            c[k] = v;
            parse_config(&c.to_string(), "adapter_config.json", 64).map(|_| ()).map_err(|e| e.to_string())
        };
        assert!(with("r", json!(8)).is_ok());
        for (k, v) in [
            ("fan_in_fan_out", json!(true)),
            ("modules_to_save", json!(["lm_head"])),
            ("layers_to_transform", json!([0])),
            ("rank_pattern", json!({"q_proj": 4})),
            ("use_dora", json!(true)),
            ("lora_bias", json!(true)),
            ("layer_replication", json!([[0, 1]])),
            ("alora_invocation_tokens", json!([1, 2])),
            ("bias", json!("all")),
            ("target_modules", json!(".*proj")),
            ("target_modules", json!(["embed_tokens"])),
            ("r", json!(512)),
            ("r", json!(0)),
            ("peft_type", json!("IA3")),
        ] {
            let e = with(k, v.clone()).expect_err("refused");
            assert!(e.contains(k), "{k}={v}: {e}");
        }
        // rsLoRA scales by sqrt(r).
        let (_, s, _, _) = parse_config(
            &json!({"r": 16, "lora_alpha": 8, "target_modules": ["q_proj"], "use_rslora": true}).to_string(),
            "f",
            64,
        )
        .expect("ok");
        assert_eq!(s, 2.0);
    }

    #[test]
    fn tensors_of_the_wrong_shape_layer_or_module_are_refused() {
        let (dir, cfg) = tiny();
        let out = dir.path().join("lora-bad");
        let spec = LoraSpec {
            base: "kvgate-tiny",
            rank: 4,
            alpha: 8.0,
            targets: &[Target::Q],
            seed: 1,
            zero: false,
        };
        synth_lora(&out, &cfg, &spec).expect("synth");
        // The config targets only k_proj now: the file's q_proj tensors name an untargeted module.
        let c = out.join("adapter_config.json");
        let text = std::fs::read_to_string(&c).expect("read").replace("\"q_proj\"", "\"k_proj\"");
        std::fs::write(&c, text).expect("write");
        let e = LoraAdapter::load(&out, "bad", &cfg, 64).expect_err("refused").to_string();
        assert!(e.contains("q_proj.lora_"), "{e}");
        // A rank the file's tensors do not have.
        synth_lora(&out, &cfg, &spec).expect("synth");
        let text = std::fs::read_to_string(&c).expect("read").replace("\"r\": 4", "\"r\": 8");
        std::fs::write(&c, text).expect("write");
        let e = LoraAdapter::load(&out, "bad", &cfg, 64).expect_err("refused").to_string();
        assert!(e.contains("expected [8,") || e.contains("expected ["), "{e}");
        assert_eq!(
            parse_key("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"),
            Some((1, Target::Down, false))
        );
        assert_eq!(parse_key("base_model.model.lm_head.lora_A.weight"), None);
        assert_eq!(parse_key("base_model.model.model.layers.x.self_attn.q_proj.lora_A.weight"), None);
    }
}
