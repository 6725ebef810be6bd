//! `kvgate-worker serve` configuration: flags, each with an environment fallback (`KVGATE_WORKER_*`), over an
//! optional TOML file (`--config`), over defaults. Precedence: defaults < TOML < environment < flags.
//! Every field, its default (written once, as the flag's clap `default_value`) and its meaning are in the `ServeArgs`
//! docs (`kvgate-worker serve --help`, docs/reference/worker.md, generated from them).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::Deserialize;

use kvgate_shared::report::Role;
use kvgate_shared::settings::Layers;

use crate::cuda::{DType, DeviceChoice};
use crate::kv::{LoadPolicy, WritePolicy};
use crate::model::fp8::KvCacheDtype;
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
    /// Which values clap took from their defaults (they lose to the TOML file).
    #[arg(skip)]
    #[serde(skip)]
    pub layers: Layers,
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
    /// A LoRA adapter in PEFT's format to serve as `NAME` (`NAME=DIR`, repeatable; env: comma-separated): a request
    /// whose `model` is `NAME` runs with it (on the CPU engine and on CUDA). Default none.
    #[arg(long = "lora", env = "KVGATE_WORKER_LORA", value_delimiter = ',')]
    pub lora: Option<Vec<String>>,
    /// Largest LoRA rank an adapter may have.
    #[arg(long, env = "KVGATE_WORKER_MAX_LORA_RANK", default_value = kvgate_shared::default_text!(crate::model::lora::DEFAULT_MAX_LORA_RANK))]
    pub max_lora_rank: Option<usize>,
    /// Most LoRA adapters held at once (`--lora` ones included): loading one more at run time unloads the least
    /// recently used adapter that was loaded at run time (`--lora` adapters stay until unloaded by name). 0: no
    /// adapters.
    #[arg(long, env = "KVGATE_WORKER_MAX_LORAS", default_value = kvgate_shared::default_text!(crate::server::adapters::DEFAULT_MAX_LORAS))]
    pub max_loras: Option<usize>,
    /// CUDA: LoRA adapters kept in device memory at once (least recently used evicted; a batch naming more runs
    /// as several). Device memory for this many adapters of `--max-lora-rank` on every projection is kept out of
    /// the KV pool at start. Default: one per `--lora` adapter, and none without `--lora` (no device memory kept:
    /// CUDA then serves the base model only and refuses adapter requests and runtime loads; give a number to load
    /// adapters at run time). No effect on the CPU engine, whose adapters live in host memory.
    #[arg(long, env = "KVGATE_WORKER_MAX_GPU_LORAS")]
    pub max_gpu_loras: Option<usize>,
    /// The directory runtime loads (`POST /v1/load_lora_adapter`) may read adapters from: a `lora_path` outside it
    /// (after resolving links) is refused (403 `lora_path_forbidden`). Default: none, any directory this process
    /// can read (the caller is already authenticated).
    #[arg(long, env = "KVGATE_WORKER_LORA_ROOT")]
    pub lora_root: Option<PathBuf>,
    /// Bearer token of the worker's admin calls (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`); a
    /// kvgate gateway's token (from `--report-secret`) is accepted too. With neither, runtime loading is off (403
    /// `runtime_lora_disabled`).
    #[arg(long, env = "KVGATE_WORKER_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Seed of `--synth`.
    #[arg(long, env = "KVGATE_WORKER_SYNTH_SEED", default_value = "0")]
    pub synth_seed: Option<u64>,
    /// Compute engine: `cpu` (the model's real math) or `sim` (deterministic tokens, time from --sim-profile;
    /// the tokenizer still comes from --model / --synth).
    #[arg(long, env = "KVGATE_WORKER_ENGINE", default_value = "cpu")]
    pub engine: Option<String>,
    /// Where `--engine cpu` (the model's real math) computes: `auto` (CUDA GPU 0 when a driver and a GPU are
    /// found, else the CPU; the choice is logged and shown in /v1/models and /metrics), `cpu`, `cuda` or `cuda:N`.
    #[arg(long, env = "KVGATE_WORKER_DEVICE", default_value = "auto")]
    pub device: Option<String>,
    /// Storage dtype of weights, activations and KV on CUDA: `bfloat16`, `float16` or `float32` (the CPU engine
    /// always computes in float32).
    #[arg(long, env = "KVGATE_WORKER_DTYPE", default_value = "bfloat16")]
    pub dtype: Option<String>,
    /// On CUDA, without --kv-cache-tokens: the fraction of the GPU memory free after loading the weights that the
    /// KV pool and the step scratch may take (like vLLM's).
    #[arg(long, env = "KVGATE_WORKER_GPU_MEMORY_UTILIZATION", default_value = "0.9")]
    pub gpu_memory_utilization: Option<f64>,
    /// Timing-model profile of `--engine sim`: a TOML file, or the name of a shipped one (`gpu-h100-llama3-8b`,
    /// `cpu-small`; see worker/profiles/).
    #[arg(long, env = "KVGATE_WORKER_SIM_PROFILE")]
    pub sim_profile: Option<PathBuf>,
    /// Listen address.
    #[arg(long, env = "KVGATE_WORKER_HOST", default_value = "0.0.0.0")]
    pub host: Option<String>,
    /// Listen port (0 = any free port; the chosen one is logged).
    #[arg(long, env = "KVGATE_WORKER_PORT", default_value = "8000")]
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
    /// Report interval (`1s`, `500ms`).
    #[arg(long, env = "KVGATE_WORKER_REPORT_INTERVAL", default_value = "1s")]
    pub report_interval: Option<String>,
    /// Timeout of one report POST.
    #[arg(long, env = "KVGATE_WORKER_REPORT_TIMEOUT", default_value = "500ms")]
    pub report_timeout: Option<String>,
    /// Shared secret sent as `Authorization: Bearer` with reports. Default none (gateways may refuse).
    #[arg(long, env = "KVGATE_REPORT_SECRET", hide_env_values = true)]
    pub report_secret: Option<String>,
    /// Answer the OpenAI API (`/v1/*`) and the tokenizer endpoint only to gateways: callers must present
    /// `Authorization: Bearer <the gateway token>`, derived from `--report-secret` (which it then needs); others get
    /// 401. `/health`, `/ready` and `/metrics` stay open.
    #[arg(long, env = "KVGATE_WORKER_REQUIRE_GATEWAY_TOKEN", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub require_gateway_token: Option<bool>,
    /// Summarise every k-th cached block in reports (size / k, matched length rounded down to k blocks).
    #[arg(long, env = "KVGATE_WORKER_SUMMARY_GRANULARITY", default_value = "4")]
    pub summary_granularity: Option<u32>,
    /// False-positive rate of the report's Bloom filter.
    #[arg(long, env = "KVGATE_WORKER_BLOOM_FP_RATE", default_value = "0.01")]
    pub bloom_fp_rate: Option<f64>,
    /// KV cache size in tokens. Default: 65536 on the CPU; on CUDA, what --gpu-memory-utilization leaves.
    #[arg(long, env = "KVGATE_WORKER_KV_CACHE_TOKENS")]
    pub kv_cache_tokens: Option<usize>,
    /// Host DRAM tier under the KV pool, in bytes: blocks evicted from the pool are copied here and served back on
    /// a prefix hit. 0 is off.
    #[arg(long, env = "KVGATE_WORKER_HOST_KV_BYTES", default_value = "0")]
    pub host_kv_bytes: Option<usize>,
    /// SSD tier under the host tier (or under the pool without one), in bytes: segment files in
    /// --disk-kv-path, kept across restarts. 0 is off.
    #[arg(long, env = "KVGATE_WORKER_DISK_KV_BYTES", default_value = "0")]
    pub disk_kv_bytes: Option<u64>,
    /// Directory of the SSD tier's segment files (a local NVMe path). Required with --disk-kv-bytes.
    #[arg(long, env = "KVGATE_WORKER_DISK_KV_PATH")]
    pub disk_kv_path: Option<PathBuf>,
    /// When blocks are copied to the lower tiers: `write-back` (when the tier above lets them go) or
    /// `write-through` (every completed block at once, to every tier).
    #[arg(long, env = "KVGATE_WORKER_KV_WRITE_POLICY", default_value = "write-back")]
    pub kv_write_policy: Option<String>,
    /// Whether a prefix found in a lower tier is loaded or computed again: `auto` (whichever is faster, from the
    /// tiers' measured bandwidths and the engine's measured prefill speed), `load` or `recompute`.
    #[arg(long, env = "KVGATE_WORKER_KV_LOAD_POLICY", default_value = "auto")]
    pub kv_load_policy: Option<String>,
    /// Tokens per KV block (must equal the gateway's).
    #[arg(long, env = "KVGATE_WORKER_BLOCK_SIZE", default_value = "16")]
    pub block_size: Option<u32>,
    /// Most tokens computed per engine step.
    #[arg(long, env = "KVGATE_WORKER_MAX_NUM_BATCHED_TOKENS", default_value = "2048")]
    pub max_num_batched_tokens: Option<usize>,
    /// Most sequences running at once.
    #[arg(long, env = "KVGATE_WORKER_MAX_NUM_SEQS", default_value = "64")]
    pub max_num_seqs: Option<usize>,
    /// Most requests waiting for admission; beyond it 503 with Retry-After.
    #[arg(long, env = "KVGATE_WORKER_MAX_WAITING_REQUESTS", default_value = "256")]
    pub max_waiting_requests: Option<usize>,
    /// Largest request body in bytes; beyond it 413.
    #[arg(long, env = "KVGATE_WORKER_MAX_BODY_BYTES", default_value = kvgate_shared::default_text!(kvgate_shared::openai::DEFAULT_MAX_BODY_BYTES))]
    pub max_body_bytes: Option<usize>,
    /// `max_tokens` of chat requests that give none (capped by the context).
    #[arg(long, env = "KVGATE_WORKER_DEFAULT_MAX_TOKENS", default_value = "1024")]
    pub default_max_tokens: Option<u32>,
    /// Token ids of recent chat pieces kept (text between special tokens tokenizes independently, so earlier
    /// messages are tokenized once and reused exactly). 0 turns the cache off.
    #[arg(long, env = "KVGATE_WORKER_TOKENIZE_CACHE_TOKENS", default_value = kvgate_shared::default_text!(kvgate_shared::prompt::segments::DEFAULT_CACHE_TOKENS))]
    pub tokenize_cache_tokens: Option<usize>,
    /// After SIGTERM: time running requests get to finish before they are aborted.
    #[arg(long, env = "KVGATE_WORKER_SHUTDOWN_GRACE", default_value = "30s")]
    pub shutdown_grace: Option<String>,
    /// Logs as JSON lines instead of text.
    #[arg(long, env = "KVGATE_WORKER_LOG_JSON", default_value = "false")]
    pub log_json: Option<bool>,
    /// Part in prefill/decode disaggregation: `both` (whole requests, and either side of a split), `prefill`
    /// (exports prompts' KV; still serves whole requests) or `decode` (imports KV; exports none). In reports,
    /// /v1/models and /metrics.
    #[arg(long, env = "KVGATE_WORKER_ROLE", default_value = "both")]
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
    /// the prompt itself) when its peer has shown no sign of life for this long.
    #[arg(long, env = "KVGATE_WORKER_KV_TRANSFER_LEASE", default_value = "30s")]
    pub kv_transfer_lease: Option<String>,
    /// Longest a decode worker waits for its prefill peer to move (from its Hello to the Accept, then between two
    /// steps of the prefill, frames of blocks or the Done); a step the peer announces adds twice the time the peer
    /// expects it to take (at most a lease). Then it gives the transfer up and computes the prompt itself, keeping
    /// the blocks that arrived. A peer's Renew (it is alive, its prefill is queued or stuck) does not reset it; it
    /// is meant to be far shorter than a gateway's first-byte timeout.
    /// It is also the longest a decode worker's import waits for room (a sequence slot, free blocks) before it is
    /// refused with 503 `kv_import_no_room`, which gateways take as a refusal.
    #[arg(long, env = "KVGATE_WORKER_KV_TRANSFER_STALL_TIMEOUT", default_value = "5s")]
    pub kv_transfer_stall_timeout: Option<String>,
    /// Layers per transfer frame while a prompt computes (0: whole blocks once each prefill chunk is done).
    #[arg(long, env = "KVGATE_WORKER_KV_TRANSFER_LAYER_GROUP", default_value = "0")]
    pub kv_transfer_layer_group: Option<u16>,
    /// Largest payload of one transfer frame in bytes (a chunk's blocks are split to fit). (8 MiB by default).
    #[arg(long, env = "KVGATE_WORKER_KV_TRANSFER_FRAME_BYTES", default_value = "8388608")]
    pub kv_transfer_frame_bytes: Option<usize>,
    /// Most KV bytes a prefill worker's export holds in host memory that its link has not sent yet; past it the
    /// export's prefill waits for the decode worker to read (back-pressure; at most one prefill chunk over it).
    /// (64 MiB by default).
    #[arg(long, env = "KVGATE_WORKER_KV_EXPORT_BACKLOG_BYTES", default_value = "67108864")]
    pub kv_export_backlog_bytes: Option<usize>,
    /// What the KV cache stores: `auto` (the engine's own: f32 on the CPU, the `--dtype` on CUDA) or `fp8` (E4M3,
    /// a scale per token and KV head: on the CPU engine as reference math, each row rounded as it is written, for
    /// checking device kernels and accuracy; CUDA refuses it until its FP8 kernels exist).
    #[arg(long, env = "KVGATE_WORKER_KV_CACHE_DTYPE", default_value = "auto")]
    pub kv_cache_dtype: Option<String>,
    /// Export request traces (spans: request, queue, prefill or transfer, decode) to this OpenTelemetry
    /// collector's OTLP/HTTP receiver, e.g. `http://otel-collector:4318` (protobuf to `/v1/traces`). A request's
    /// W3C `traceparent` (the gateway sends one) is its parent. None: no tracing.
    #[arg(long, env = "KVGATE_WORKER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Share of requests without a sampled `traceparent` that are traced ([0, 1]).
    #[arg(long, env = "KVGATE_WORKER_TRACE_SAMPLE_RATIO", default_value = "1")]
    pub trace_sample_ratio: Option<f64>,
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
    /// LoRA adapters served: (name, directory).
    pub lora: Vec<(String, PathBuf)>,
    pub max_lora_rank: usize,
    pub max_loras: usize,
    /// `None`: one slot per `--lora` adapter (`ServeConfig::gpu_lora_slots`).
    pub max_gpu_loras: Option<usize>,
    pub lora_root: Option<PathBuf>,
    pub admin_token: Option<String>,
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
    pub kv_transfer_stall_timeout: Duration,
    pub kv_transfer_layer_group: u16,
    pub kv_transfer_frame_bytes: usize,
    pub kv_export_backlog_bytes: usize,
    pub otlp_endpoint: Option<String>,
    pub trace_sample_ratio: f64,
    pub kv_cache_dtype: KvCacheDtype,
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
    /// `serve`'s clap command (its flags, defaults and help).
    pub fn command() -> clap::Command {
        <Self as Args>::augment_args(clap::Command::new("serve"))
    }

    /// The configuration reference (`docs/reference/worker.md`), generated from the flags.
    pub fn reference() -> String {
        kvgate_shared::settings::reference_markdown(
            &Self::command(),
            "kvgate-worker serve configuration",
            "Every setting of `kvgate-worker serve` is a flag, an environment variable and a key of the TOML file \
             given with `--config` (precedence: flags > environment > file > default).",
        )
    }

    /// Merges flags/env over the TOML file over defaults, then validates.
    pub fn resolve(self) -> Result<ServeConfig, String> {
        let file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
                toml::from_str::<ServeArgs>(&text).map_err(|e| format!("{}: {e}", path.display()))?
            }
            None => ServeArgs::default(),
        };
        let cmd = ServeArgs::command();
        // A setting without a declared default: flags/env (unless clap filled them in), else the file.
        macro_rules! pick {
            ($f:ident) => {
                self.layers.value(stringify!($f), &self.$f, &file.$f)
            };
        }
        // A setting with a declared default (`default_value`): the default written once, on the flag.
        macro_rules! set {
            ($f:ident) => {
                self.layers.setting(&cmd, stringify!($f), &self.$f, &file.$f).map_err(|e| e.to_string())?
            };
        }
        let model = match (pick!(model), pick!(synth)) {
            (Some(_), Some(_)) => return Err("give either --model or --synth, not both".into()),
            (Some(dir), None) => ModelSource::Dir(dir),
            (None, Some(preset)) => {
                let seed = set!(synth_seed);
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
        let dur = |v: String, name: &str| parse_duration(&v).map_err(|e| format!("--{name}: {e}"));
        let engine = match (set!(engine).as_str(), pick!(sim_profile)) {
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
            host: set!(host),
            port: set!(port),
            worker_id: pick!(worker_id),
            advertise_url: pick!(advertise_url),
            model_id: pick!(model_id),
            report_to: pick!(report_to).unwrap_or_default().into_iter().filter(|u| !u.is_empty()).collect(),
            report_interval: dur(set!(report_interval), "report-interval")?,
            report_timeout: dur(set!(report_timeout), "report-timeout")?,
            report_secret: pick!(report_secret).filter(|s| !s.is_empty()),
            require_gateway_token: set!(require_gateway_token),
            summary_granularity: set!(summary_granularity),
            bloom_fp_rate: set!(bloom_fp_rate),
            kv_cache_tokens: pick!(kv_cache_tokens),
            lora: pick!(lora)
                .unwrap_or_default()
                .into_iter()
                .filter(|l| !l.is_empty())
                .map(|l| match l.split_once('=') {
                    Some((n, d)) if !n.trim().is_empty() && !d.trim().is_empty() => {
                        Ok((n.trim().to_owned(), PathBuf::from(d.trim())))
                    }
                    _ => Err(format!("--lora {l:?} is not NAME=DIR")),
                })
                .collect::<Result<_, _>>()?,
            max_lora_rank: set!(max_lora_rank),
            max_loras: set!(max_loras),
            max_gpu_loras: pick!(max_gpu_loras),
            lora_root: pick!(lora_root),
            admin_token: pick!(admin_token).filter(|t| !t.is_empty()),
            host_kv_bytes: set!(host_kv_bytes),
            disk_kv_bytes: set!(disk_kv_bytes),
            disk_kv_path: pick!(disk_kv_path),
            kv_write_policy: WritePolicy::parse(set!(kv_write_policy).as_str())?,
            kv_load_policy: LoadPolicy::parse(set!(kv_load_policy).as_str())?,
            device: DeviceChoice::parse(set!(device).as_str()).map_err(|e| format!("--device: {e}"))?,
            dtype: {
                let d = set!(dtype);
                DType::parse(&d)
                    .ok_or_else(|| format!("--dtype {d:?} is not bfloat16, float16 or float32"))?
            },
            gpu_memory_utilization: set!(gpu_memory_utilization),
            block_size: set!(block_size),
            max_num_batched_tokens: set!(max_num_batched_tokens),
            max_num_seqs: set!(max_num_seqs),
            max_waiting_requests: set!(max_waiting_requests),
            max_body_bytes: set!(max_body_bytes),
            default_max_tokens: set!(default_max_tokens),
            tokenize_cache_tokens: set!(tokenize_cache_tokens),
            shutdown_grace: dur(set!(shutdown_grace), "shutdown-grace")?,
            log_json: set!(log_json),
            role: Role::parse(set!(role).as_str()).map_err(|e| format!("--{e}"))?,
            kv_transfer_port: pick!(kv_transfer_port),
            kv_transfer_advertise: pick!(kv_transfer_advertise),
            kv_transfer_lease: dur(set!(kv_transfer_lease), "kv-transfer-lease")?,
            kv_transfer_stall_timeout: dur(set!(kv_transfer_stall_timeout), "kv-transfer-stall-timeout")?,
            kv_transfer_layer_group: set!(kv_transfer_layer_group),
            kv_transfer_frame_bytes: set!(kv_transfer_frame_bytes),
            kv_export_backlog_bytes: set!(kv_export_backlog_bytes),
            otlp_endpoint: pick!(otlp_endpoint).filter(|e| !e.is_empty()),
            trace_sample_ratio: set!(trace_sample_ratio),
            kv_cache_dtype: KvCacheDtype::parse(&set!(kv_cache_dtype)).map_err(|e| format!("--{e}"))?,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

impl ServeConfig {
    /// Adapters a CUDA engine keeps in device memory: `--max-gpu-loras`, or one per `--lora` adapter; never more
    /// than `--max-loras` (the adapters the worker may hold at all).
    pub fn gpu_lora_slots(&self) -> usize {
        self.max_gpu_loras.unwrap_or(self.lora.len()).min(self.max_loras)
    }

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
        if self.kv_transfer_stall_timeout < Duration::from_millis(100) {
            problems.push("kv-transfer-stall-timeout must be at least 100ms".into());
        }
        if self.kv_export_backlog_bytes == 0 {
            problems.push("kv-export-backlog-bytes must be at least 1".into());
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
        if self.kv_cache_dtype == KvCacheDtype::Fp8 && matches!(self.engine, EngineKind::Sim { .. }) {
            problems.push(
                "kv-cache-dtype fp8 needs --engine cpu (the simulated engine keeps no KV values)".into(),
            );
        }
        if !(0.0..=1.0).contains(&self.trace_sample_ratio) {
            problems.push(format!("trace-sample-ratio {} is not in [0, 1]", self.trace_sample_ratio));
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
    fn the_kv_cache_dtype_is_checked() {
        let with = |dtype: &str, engine: Option<&str>| {
            ServeArgs {
                synth: Some(Preset::Tiny),
                kv_cache_dtype: Some(dtype.into()),
                engine: engine.map(str::to_owned),
                sim_profile: engine.map(|_| PathBuf::from("cpu-small")),
                ..ServeArgs::default()
            }
            .resolve()
        };
        assert_eq!(with("fp8", None).expect("cpu").kv_cache_dtype, KvCacheDtype::Fp8);
        assert_eq!(with("auto", None).expect("cpu").kv_cache_dtype, KvCacheDtype::Auto);
        assert!(with("int4", None).expect_err("unknown").contains("kv-cache-dtype"));
        assert!(with("fp8", Some("sim")).expect_err("sim keeps no KV").contains("kv-cache-dtype fp8"));
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

#[cfg(test)]
mod reference_tests {
    use super::*;

    #[test]
    fn the_file_beats_a_default_clap_filled_in_and_a_flag_beats_the_file() {
        use clap::FromArgMatches;
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("w.toml");
        std::fs::write(&path, "synth = \"tiny\"\nport = 9000\nreport-interval = \"2s\"\n").expect("write");
        let parse = |args: &[&str]| {
            let m = ServeArgs::command().try_get_matches_from(args).expect("flags");
            let mut a = ServeArgs::from_arg_matches(&m).expect("args");
            a.layers = Layers::from_matches(&m);
            a.resolve().expect("ok")
        };
        let p = path.to_str().expect("path");
        let cfg = parse(&["serve", "--config", p]);
        assert_eq!((cfg.port, cfg.report_interval), (9000, Duration::from_secs(2)));
        assert_eq!(cfg.max_num_seqs, 64, "the declared default");
        assert_eq!(parse(&["serve", "--config", p, "--port", "9100"]).port, 9100);
    }

    #[test]
    fn cuda_keeps_device_slots_for_the_lora_adapters_given_or_as_many_as_asked_never_past_max_loras() {
        use clap::FromArgMatches;
        let slots = |args: &[&str]| {
            let mut all = vec!["serve", "--synth", "tiny"];
            all.extend_from_slice(args);
            let m = ServeArgs::command().try_get_matches_from(&all).expect("flags");
            let mut a = ServeArgs::from_arg_matches(&m).expect("args");
            a.layers = Layers::from_matches(&m);
            a.resolve().expect("ok").gpu_lora_slots()
        };
        assert_eq!(slots(&[]), 0, "no adapters: no device memory kept");
        assert_eq!(slots(&["--lora", "a=/x", "--lora", "b=/y"]), 2);
        assert_eq!(slots(&["--max-gpu-loras", "3"]), 3, "runtime loads");
        assert_eq!(slots(&["--lora", "a=/x", "--max-gpu-loras", "0"]), 0);
        assert_eq!(slots(&["--max-gpu-loras", "5", "--max-loras", "2"]), 2);
        assert_eq!(slots(&["--lora", "a=/x", "--max-loras", "0"]), 0);
    }

    #[test]
    fn the_committed_configuration_reference_is_what_the_flags_declare() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference/worker.md");
        kvgate_shared::settings::check_reference(&path, &ServeArgs::reference())
            .unwrap_or_else(|e| panic!("{e}"));
    }
}
