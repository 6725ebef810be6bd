//! `kvgate-worker serve` configuration: flags, each with an environment fallback (`KVGATE_WORKER_*`), over an
//! optional TOML file (`--config`), over defaults. Precedence: defaults < TOML < environment < flags.
//! Every field, its default and its meaning are in the `ServeArgs` docs (`kvgate-worker serve --help`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::Deserialize;

use kvgate_shared::report::Role;

use crate::cuda::{DType, DeviceChoice};
use crate::kv::{LoadPolicy, WritePolicy};
use crate::model::synth::Preset;

/// KV cache tokens of the CPU engine when none are configured.
pub const CPU_KV_CACHE_TOKENS: usize = 65_536;

/// Flags (and environment) of `serve`. `None` means "not given here": the TOML file or the default applies.
#[derive(Args, Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ServeArgs {
    /// TOML file with any of these settings (kebab-case keys, e.g. `kv-cache-tokens = 65536`).
    #[arg(long, env = "KVGATE_WORKER_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json, tokenizer_config.json).
    #[arg(long, env = "KVGATE_WORKER_MODEL")]
    pub model: Option<PathBuf>,
    /// Serve a synthesized model instead (`tiny` or `small`), written once to `--synth-dir`.
    #[arg(long, env = "KVGATE_WORKER_SYNTH", value_enum)]
    pub synth: Option<Preset>,
    /// Where `--synth` writes its model. Default: `$KVGATE_CACHE_DIR` or `~/.cache/kvgate`, then
    /// `models/<preset>-<seed>`.
    #[arg(long, env = "KVGATE_WORKER_SYNTH_DIR")]
    pub synth_dir: Option<PathBuf>,
    /// Seed of `--synth`. Default 0.
    #[arg(long, env = "KVGATE_WORKER_SYNTH_SEED")]
    pub synth_seed: Option<u64>,
    /// Compute engine: `cpu` (the model's real math) or `sim` (deterministic tokens, time from --sim-profile;
    /// the tokenizer still comes from --model / --synth). Default cpu.
    #[arg(long, env = "KVGATE_WORKER_ENGINE")]
    pub engine: Option<String>,
    /// Where `--engine cpu` (the model's real math) computes: `auto` (CUDA GPU 0 when a driver and a GPU are
    /// found, else the CPU; the choice is logged and shown in /v1/models and /metrics), `cpu`, `cuda` or `cuda:N`.
    /// Default auto.
    #[arg(long, env = "KVGATE_WORKER_DEVICE")]
    pub device: Option<String>,
    /// Storage dtype of weights, activations and KV on CUDA: `bfloat16`, `float16` or `float32` (the CPU engine
    /// always computes in float32). Default bfloat16.
    #[arg(long, env = "KVGATE_WORKER_DTYPE")]
    pub dtype: Option<String>,
    /// On CUDA, without --kv-cache-tokens: the fraction of the GPU memory free after loading the weights that the
    /// KV pool and the step scratch may take (like vLLM's). Default 0.9.
    #[arg(long, env = "KVGATE_WORKER_GPU_MEMORY_UTILIZATION")]
    pub gpu_memory_utilization: Option<f64>,
    /// Timing-model profile of `--engine sim`: a TOML file, or the name of a shipped one (`gpu-h100-llama3-8b`,
    /// `cpu-small`; see worker/profiles/).
    #[arg(long, env = "KVGATE_WORKER_SIM_PROFILE")]
    pub sim_profile: Option<PathBuf>,
    /// Listen address. Default 0.0.0.0.
    #[arg(long, env = "KVGATE_WORKER_HOST")]
    pub host: Option<String>,
    /// Listen port (0 = any free port; the chosen one is logged). Default 8000.
    #[arg(long, env = "KVGATE_WORKER_PORT")]
    pub port: Option<u16>,
    /// Id in reports and `x-kvgate-worker`. Default `worker-<port>`.
    #[arg(long, env = "KVGATE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// URL gateways proxy to. Default `http://127.0.0.1:<port>`.
    #[arg(long, env = "KVGATE_WORKER_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// Model name served in the API. Default: the model directory's name (`kvgate-<preset>` for synth).
    #[arg(long, env = "KVGATE_WORKER_MODEL_ID")]
    pub model_id: Option<String>,
    /// Gateway control base URL to push reports to (repeatable; env: comma-separated). Default none.
    #[arg(long = "report-to", env = "KVGATE_WORKER_REPORT_TO", value_delimiter = ',')]
    pub report_to: Option<Vec<String>>,
    /// Report interval (`1s`, `500ms`). Default 1s.
    #[arg(long, env = "KVGATE_WORKER_REPORT_INTERVAL")]
    pub report_interval: Option<String>,
    /// Timeout of one report POST. Default 500ms.
    #[arg(long, env = "KVGATE_WORKER_REPORT_TIMEOUT")]
    pub report_timeout: Option<String>,
    /// Shared secret sent as `Authorization: Bearer` with reports. Default none (gateways may refuse).
    #[arg(long, env = "KVGATE_REPORT_SECRET", hide_env_values = true)]
    pub report_secret: Option<String>,
    /// Answer the OpenAI API (`/v1/*`) and the tokenizer endpoint only to gateways: callers must present
    /// `Authorization: Bearer <the gateway token>`, derived from `--report-secret` (which it then needs); others get
    /// 401. `/health`, `/ready` and `/metrics` stay open. Default false.
    #[arg(long, env = "KVGATE_WORKER_REQUIRE_GATEWAY_TOKEN", num_args = 0..=1, default_missing_value = "true")]
    pub require_gateway_token: Option<bool>,
    /// Summarise every k-th cached block in reports (size / k, matched length rounded down to k blocks). Default 4.
    #[arg(long, env = "KVGATE_WORKER_SUMMARY_GRANULARITY")]
    pub summary_granularity: Option<u32>,
    /// False-positive rate of the report's Bloom filter. Default 0.01.
    #[arg(long, env = "KVGATE_WORKER_BLOOM_FP_RATE")]
    pub bloom_fp_rate: Option<f64>,
    /// KV cache size in tokens. Default: 65536 on the CPU; on CUDA, what --gpu-memory-utilization leaves.
    #[arg(long, env = "KVGATE_WORKER_KV_CACHE_TOKENS")]
    pub kv_cache_tokens: Option<usize>,
    /// Host DRAM tier under the KV pool, in bytes: blocks evicted from the pool are copied here and served back on
    /// a prefix hit. Default 0 (off).
    #[arg(long, env = "KVGATE_WORKER_HOST_KV_BYTES")]
    pub host_kv_bytes: Option<usize>,
    /// SSD tier under the host tier (or under the pool without one), in bytes: segment files in
    /// --disk-kv-path, kept across restarts. Default 0 (off).
    #[arg(long, env = "KVGATE_WORKER_DISK_KV_BYTES")]
    pub disk_kv_bytes: Option<u64>,
    /// Directory of the SSD tier's segment files (a local NVMe path). Required with --disk-kv-bytes.
    #[arg(long, env = "KVGATE_WORKER_DISK_KV_PATH")]
    pub disk_kv_path: Option<PathBuf>,
    /// When blocks are copied to the lower tiers: `write-back` (when the tier above lets them go) or
    /// `write-through` (every completed block at once, to every tier). Default write-back.
    #[arg(long, env = "KVGATE_WORKER_KV_WRITE_POLICY")]
    pub kv_write_policy: Option<String>,
    /// Whether a prefix found in a lower tier is loaded or computed again: `auto` (whichever is faster, from the
    /// tiers' measured bandwidths and the engine's measured prefill speed), `load` or `recompute`. Default auto.
    #[arg(long, env = "KVGATE_WORKER_KV_LOAD_POLICY")]
    pub kv_load_policy: Option<String>,
    /// Tokens per KV block (must equal the gateway's). Default 16.
    #[arg(long, env = "KVGATE_WORKER_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// Most tokens computed per engine step. Default 2048.
    #[arg(long, env = "KVGATE_WORKER_MAX_NUM_BATCHED_TOKENS")]
    pub max_num_batched_tokens: Option<usize>,
    /// Most sequences running at once. Default 64.
    #[arg(long, env = "KVGATE_WORKER_MAX_NUM_SEQS")]
    pub max_num_seqs: Option<usize>,
    /// Most requests waiting for admission; beyond it 503 with Retry-After. Default 256.
    #[arg(long, env = "KVGATE_WORKER_MAX_WAITING_REQUESTS")]
    pub max_waiting_requests: Option<usize>,
    /// Largest request body in bytes; beyond it 413. Default 8 MiB.
    #[arg(long, env = "KVGATE_WORKER_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// `max_tokens` of chat requests that give none (capped by the context). Default 1024.
    #[arg(long, env = "KVGATE_WORKER_DEFAULT_MAX_TOKENS")]
    pub default_max_tokens: Option<u32>,
    /// Token ids of recent chat pieces kept (text between special tokens tokenizes independently, so earlier
    /// messages are tokenized once and reused exactly). 0 turns the cache off. Default 4194304.
    #[arg(long, env = "KVGATE_WORKER_TOKENIZE_CACHE_TOKENS")]
    pub tokenize_cache_tokens: Option<usize>,
    /// After SIGTERM: time running requests get to finish before they are aborted. Default 30s.
    #[arg(long, env = "KVGATE_WORKER_SHUTDOWN_GRACE")]
    pub shutdown_grace: Option<String>,
    /// Logs as JSON lines instead of text.
    #[arg(long, env = "KVGATE_WORKER_LOG_JSON")]
    pub log_json: Option<bool>,
    /// Part in prefill/decode disaggregation: `both` (whole requests, and either side of a split), `prefill`
    /// (exports prompts' KV; still serves whole requests) or `decode` (imports KV; exports none). In reports,
    /// /v1/models and /metrics. Default both.
    #[arg(long, env = "KVGATE_WORKER_ROLE")]
    pub role: Option<String>,
    /// Port of the KV transfer listener decode workers fetch prompts' KV from (0: any free port, logged). Needs
    /// --report-secret (transfers are authenticated with a key derived from it); not with --role decode. Default
    /// none (no listener).
    #[arg(long, env = "KVGATE_WORKER_KV_TRANSFER_PORT")]
    pub kv_transfer_port: Option<u16>,
    /// `host:port` decode workers reach the KV transfer listener at (in reports). Default: the host of
    /// --advertise-url (127.0.0.1 without one) and the listener's port.
    #[arg(long, env = "KVGATE_WORKER_KV_TRANSFER_ADVERTISE")]
    pub kv_transfer_advertise: Option<String>,
    /// Lease of a transfer: a prefill worker drops an export (and a decode worker gives up an import and computes
    /// the prompt itself) when its peer has shown no sign of life for this long. Default 30s.
    #[arg(long, env = "KVGATE_WORKER_KV_TRANSFER_LEASE")]
    pub kv_transfer_lease: Option<String>,
    /// Layers per transfer frame while a prompt computes (0: whole blocks once each prefill chunk is done).
    /// Default 0.
    #[arg(long, env = "KVGATE_WORKER_KV_TRANSFER_LAYER_GROUP")]
    pub kv_transfer_layer_group: Option<u16>,
    /// Largest payload of one transfer frame in bytes (a chunk's blocks are split to fit). Default 8 MiB.
    #[arg(long, env = "KVGATE_WORKER_KV_TRANSFER_FRAME_BYTES")]
    pub kv_transfer_frame_bytes: Option<usize>,
}

/// The resolved configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeConfig {
    pub model: ModelSource,
    pub engine: EngineKind,
    pub host: String,
    pub port: u16,
    pub worker_id: Option<String>,
    pub advertise_url: Option<String>,
    pub model_id: Option<String>,
    pub report_to: Vec<String>,
    pub report_interval: Duration,
    pub report_timeout: Duration,
    pub report_secret: Option<String>,
    pub require_gateway_token: bool,
    pub summary_granularity: u32,
    pub bloom_fp_rate: f64,
    /// `None`: the device's default (65536 on the CPU, sized from memory on CUDA).
    pub kv_cache_tokens: Option<usize>,
    pub host_kv_bytes: usize,
    pub disk_kv_bytes: u64,
    pub disk_kv_path: Option<PathBuf>,
    pub kv_write_policy: WritePolicy,
    pub kv_load_policy: LoadPolicy,
    pub device: DeviceChoice,
    pub dtype: DType,
    pub gpu_memory_utilization: f64,
    pub block_size: u32,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_waiting_requests: usize,
    pub max_body_bytes: usize,
    pub default_max_tokens: u32,
    pub tokenize_cache_tokens: usize,
    pub shutdown_grace: Duration,
    pub log_json: bool,
    pub role: Role,
    pub kv_transfer_port: Option<u16>,
    pub kv_transfer_advertise: Option<String>,
    pub kv_transfer_lease: Duration,
    pub kv_transfer_layer_group: u16,
    pub kv_transfer_frame_bytes: usize,
}

/// Which compute engine runs.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineKind {
    Cpu,
    Sim { profile: PathBuf },
}

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    Dir(PathBuf),
    Synth { preset: Preset, seed: u64, dir: PathBuf },
}

pub use kvgate_shared::duration::parse_duration;

fn default_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVGATE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache").join("kvgate"),
        None => std::env::temp_dir().join("kvgate"),
    }
}

impl ServeArgs {
    /// Merges flags/env over the TOML file over defaults, then validates.
    pub fn resolve(self) -> Result<ServeConfig, String> {
        let file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
                toml::from_str::<ServeArgs>(&text).map_err(|e| format!("{}: {e}", path.display()))?
            }
            None => ServeArgs::default(),
        };
        macro_rules! pick {
            ($f:ident) => {
                self.$f.clone().or(file.$f.clone())
            };
        }
        let model = match (pick!(model), pick!(synth)) {
            (Some(_), Some(_)) => return Err("give either --model or --synth, not both".into()),
            (Some(dir), None) => ModelSource::Dir(dir),
            (None, Some(preset)) => {
                let seed = pick!(synth_seed).unwrap_or(0);
                let name = format!("{}-{seed}", format!("{preset:?}").to_lowercase());
                let dir = pick!(synth_dir).unwrap_or_else(|| default_cache_dir().join("models").join(name));
                ModelSource::Synth { preset, seed, dir }
            }
            (None, None) => {
                return Err(
                    "no model: pass --model DIR (a Hugging Face model directory) or --synth tiny|small \
                            (a synthesized model, written once to the cache directory)"
                        .into(),
                )
            }
        };
        let dur = |v: Option<String>, default: &str, name: &str| {
            parse_duration(v.as_deref().unwrap_or(default)).map_err(|e| format!("--{name}: {e}"))
        };
        let engine = match (pick!(engine).as_deref().unwrap_or("cpu"), pick!(sim_profile)) {
            ("cpu", None) => EngineKind::Cpu,
            ("cpu", Some(_)) => return Err("--sim-profile needs --engine sim".into()),
            ("sim", Some(profile)) => EngineKind::Sim { profile },
            ("sim", None) => {
                return Err("--engine sim needs --sim-profile FILE (see worker/profiles/)".into())
            }
            (other, _) => return Err(format!("--engine {other:?} is not cpu or sim")),
        };
        let cfg = ServeConfig {
            model,
            engine,
            host: pick!(host).unwrap_or_else(|| "0.0.0.0".into()),
            port: pick!(port).unwrap_or(8000),
            worker_id: pick!(worker_id),
            advertise_url: pick!(advertise_url),
            model_id: pick!(model_id),
            report_to: pick!(report_to).unwrap_or_default().into_iter().filter(|u| !u.is_empty()).collect(),
            report_interval: dur(pick!(report_interval), "1s", "report-interval")?,
            report_timeout: dur(pick!(report_timeout), "500ms", "report-timeout")?,
            report_secret: pick!(report_secret).filter(|s| !s.is_empty()),
            require_gateway_token: pick!(require_gateway_token).unwrap_or(false),
            summary_granularity: pick!(summary_granularity).unwrap_or(4),
            bloom_fp_rate: pick!(bloom_fp_rate).unwrap_or(0.01),
            kv_cache_tokens: pick!(kv_cache_tokens),
            host_kv_bytes: pick!(host_kv_bytes).unwrap_or(0),
            disk_kv_bytes: pick!(disk_kv_bytes).unwrap_or(0),
            disk_kv_path: pick!(disk_kv_path),
            kv_write_policy: WritePolicy::parse(pick!(kv_write_policy).as_deref().unwrap_or("write-back"))?,
            kv_load_policy: LoadPolicy::parse(pick!(kv_load_policy).as_deref().unwrap_or("auto"))?,
            device: DeviceChoice::parse(pick!(device).as_deref().unwrap_or("auto"))
                .map_err(|e| format!("--device: {e}"))?,
            dtype: match pick!(dtype) {
                None => DType::BF16,
                Some(d) => DType::parse(&d)
                    .ok_or_else(|| format!("--dtype {d:?} is not bfloat16, float16 or float32"))?,
            },
            gpu_memory_utilization: pick!(gpu_memory_utilization).unwrap_or(0.9),
            block_size: pick!(block_size).unwrap_or(16),
            max_num_batched_tokens: pick!(max_num_batched_tokens).unwrap_or(2048),
            max_num_seqs: pick!(max_num_seqs).unwrap_or(64),
            max_waiting_requests: pick!(max_waiting_requests).unwrap_or(256),
            max_body_bytes: pick!(max_body_bytes).unwrap_or(8 << 20),
            default_max_tokens: pick!(default_max_tokens).unwrap_or(1024),
            tokenize_cache_tokens: pick!(tokenize_cache_tokens)
                .unwrap_or(kvgate_shared::prompt::segments::DEFAULT_CACHE_TOKENS),
            shutdown_grace: dur(pick!(shutdown_grace), "30s", "shutdown-grace")?,
            log_json: pick!(log_json).unwrap_or(false),
            role: Role::parse(pick!(role).as_deref().unwrap_or("both")).map_err(|e| format!("--{e}"))?,
            kv_transfer_port: pick!(kv_transfer_port),
            kv_transfer_advertise: pick!(kv_transfer_advertise),
            kv_transfer_lease: dur(pick!(kv_transfer_lease), "30s", "kv-transfer-lease")?,
            kv_transfer_layer_group: pick!(kv_transfer_layer_group).unwrap_or(0),
            kv_transfer_frame_bytes: pick!(kv_transfer_frame_bytes).unwrap_or(8 << 20),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

impl ServeConfig {
    /// Checks every field; the error lists each problem.
    pub fn validate(&self) -> Result<(), String> {
        let mut problems = Vec::new();
        if self.block_size == 0 || self.block_size > kvgate_shared::hashing::MAX_BLOCK_SIZE {
            problems.push(format!("block-size {} is not in 1..=4096", self.block_size));
        }
        if self.require_gateway_token && self.report_secret.is_none() {
            problems.push(
                "require-gateway-token needs report-secret (the gateway token is derived from it)".into(),
            );
        }
        if self.kv_transfer_port.is_some() && self.report_secret.is_none() {
            problems
                .push("kv-transfer-port needs report-secret (transfers are authenticated with it)".into());
        }
        if self.kv_transfer_port.is_some() && self.role == Role::Decode {
            problems.push("kv-transfer-port: a decode worker exports no KV (--role prefill or both)".into());
        }
        if self.kv_transfer_lease < Duration::from_millis(100) {
            problems.push("kv-transfer-lease must be at least 100ms".into());
        }
        if self.kv_transfer_frame_bytes < 4096 {
            problems.push("kv-transfer-frame-bytes must be at least 4096".into());
        }
        if self.disk_kv_bytes > 0 && self.disk_kv_path.is_none() {
            problems.push("disk-kv-bytes needs disk-kv-path (the directory of the SSD tier)".into());
        }
        if let Some(t) = self.kv_cache_tokens.filter(|t| *t < self.block_size as usize) {
            problems.push(format!("kv-cache-tokens {t} holds less than one block"));
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            problems.push(format!("gpu-memory-utilization {} is not in (0, 1]", self.gpu_memory_utilization));
        }
        if self.max_num_batched_tokens == 0 || self.max_num_seqs == 0 {
            problems.push("max-num-batched-tokens and max-num-seqs must be at least 1".into());
        }
        if self.summary_granularity == 0 {
            problems.push("summary-granularity must be at least 1".into());
        }
        if !(self.bloom_fp_rate > 0.0 && self.bloom_fp_rate < 0.5) {
            problems.push(format!("bloom-fp-rate {} is not in (0, 0.5)", self.bloom_fp_rate));
        }
        if self.report_interval < Duration::from_millis(10) {
            problems.push("report-interval must be at least 10ms".into());
        }
        if self.max_body_bytes < 1024 {
            problems.push("max-body-bytes must be at least 1024".into());
        }
        if self.default_max_tokens == 0 {
            problems.push("default-max-tokens must be at least 1".into());
        }
        for u in &self.report_to {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                problems.push(format!("report-to {u:?} is not an http(s) URL"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(format!("invalid configuration: {}", problems.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needs_a_model_and_lists_every_problem() {
        let err = ServeArgs::default().resolve().expect_err("no model");
        assert!(err.contains("--model") && err.contains("--synth"));
        let args = ServeArgs {
            synth: Some(Preset::Tiny),
            block_size: Some(0),
            summary_granularity: Some(0),
            ..ServeArgs::default()
        };
        let err = args.resolve().expect_err("invalid");
        assert!(err.contains("block-size") && err.contains("summary-granularity"), "{err}");
    }

    #[test]
    fn flags_override_the_toml_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("w.toml");
        std::fs::write(
            &path,
            "synth = \"tiny\"\nport = 9000\nkv-cache-tokens = 4096\nreport-to = [\"http://g:8081\"]\n",
        )
        .expect("write");
        let cfg = ServeArgs { config: Some(path.clone()), port: Some(9100), ..ServeArgs::default() }
            .resolve()
            .expect("ok");
        assert_eq!(cfg.port, 9100);
        assert_eq!(cfg.kv_cache_tokens, Some(4096));
        assert_eq!(cfg.device, DeviceChoice::Auto);
        assert_eq!(cfg.report_to, vec!["http://g:8081".to_string()]);
        std::fs::write(&path, "synth = \"tiny\"\nbogus = 1\n").expect("write");
        assert!(ServeArgs { config: Some(path), ..ServeArgs::default() }
            .resolve()
            .expect_err("unknown")
            .contains("bogus"));
    }
}
