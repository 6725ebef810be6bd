//! Gateway configuration: flags with environment fallbacks (`KVGATE_GATEWAY_*`) over a TOML file (`--config`)
//! over defaults; precedence defaults < TOML < environment < flags. `validate()` runs at start and lists every
//! problem. Every field's default is in its doc comment (`kvgate-gateway --help`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

use kvgate_shared::settings::Layers;

use crate::admission::{default_classes, ClassConfig};
use crate::routing::{Weights, POLICIES};

mod epp;
mod models;

pub use epp::{EppAuth, DEFAULT_EPP_MAX_BUFFERED_BYTES, MIN_EPP_TOKEN_CHARS};
pub use models::{ModelSpec, PodEvents, WorkerKind};

/// Flags (and environment) of `kvgate-gateway`. `None` = not given here.
#[derive(Parser, Debug, Default, Clone, Deserialize)]
#[command(
    name = "kvgate-gateway",
    version,
    about = "kvgate: an OpenAI-compatible gateway that routes by KV cache"
)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct GatewayArgs {
    /// TOML file with any of these settings (kebab-case keys; weights under `[weights]`).
    #[arg(long, env = "KVGATE_GATEWAY_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Which values clap took from their defaults (they lose to the TOML file).
    #[arg(skip)]
    #[serde(skip)]
    pub layers: Layers,
    /// Public listener (OpenAI API).
    #[arg(long, env = "KVGATE_GATEWAY_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: Option<String>,
    /// Control listener (metrics, report ingest, admin).
    #[arg(long, env = "KVGATE_GATEWAY_CONTROL_LISTEN", default_value = "0.0.0.0:8081")]
    pub control_listen: Option<String>,
    /// Endpoint picker listener: Envoy's ext_proc gRPC service (h2c) and the gRPC health service, for an
    /// Envoy-based Kubernetes inference gateway (docs/operating/epp.md). Default none: off.
    #[arg(long, env = "KVGATE_GATEWAY_EPP_LISTEN")]
    pub epp_listen: Option<String>,
    /// Most ext_proc streams (requests) the endpoint picker holds at once; beyond it a request is answered 503
    /// `epp_overloaded` through the proxy.
    #[arg(long, env = "KVGATE_GATEWAY_EPP_MAX_STREAMS", default_value = kvgate_shared::default_text!(DEFAULT_EPP_MAX_STREAMS))]
    pub epp_max_streams: Option<usize>,
    /// Most request body bytes the endpoint picker holds across all its streams at once (each stream's body is
    /// buffered until the pick); past it a stream is answered 503 `epp_overloaded` through the proxy, so memory
    /// does not grow to `--epp-max-streams` x `--max-body-bytes`.
    #[arg(long, env = "KVGATE_GATEWAY_EPP_MAX_BUFFERED_BYTES", default_value = kvgate_shared::default_text!(DEFAULT_EPP_MAX_BUFFERED_BYTES))]
    pub epp_max_buffered_bytes: Option<usize>,
    /// PEM certificate (chain) the endpoint picker serves TLS with, with `--epp-tls-key`. Default none: HTTP/2
    /// cleartext. Envoy Gateway (through Envoy AI Gateway) dials a pool's picker over TLS without verifying it.
    #[arg(long, env = "KVGATE_GATEWAY_EPP_TLS_CERT")]
    pub epp_tls_cert: Option<PathBuf>,
    /// PEM private key of `--epp-tls-cert`.
    #[arg(long, env = "KVGATE_GATEWAY_EPP_TLS_KEY")]
    pub epp_tls_key: Option<PathBuf>,
    /// A shared credential the proxy must present to drive the endpoint picker: gRPC metadata `authorization:
    /// Bearer <token>` on each ext_proc stream (Envoy: the ext_proc `grpc_service`'s `initial_metadata`), checked
    /// before the stream's first message; a stream without it ends UNAUTHENTICATED. At least 16 characters.
    /// Default none.
    #[arg(long, env = "KVGATE_GATEWAY_EPP_TOKEN", hide_env_values = true)]
    pub epp_token: Option<String>,
    /// PEM CA certificate(s) the proxy's client certificate must chain to (mutual TLS on the picker's port; needs
    /// `--epp-tls-cert`): a connection without such a certificate is refused in the handshake. Default none.
    #[arg(long, env = "KVGATE_GATEWAY_EPP_CLIENT_CA")]
    pub epp_client_ca: Option<PathBuf>,
    /// Let the endpoint picker listen on an address that is not loopback without `--epp-token` or
    /// `--epp-client-ca`: the network alone must keep everyone but the proxies out (a NetworkPolicy, as the Helm
    /// chart writes by default). Without it such a picker refuses to start.
    #[arg(long, env = "KVGATE_GATEWAY_EPP_TRUST_NETWORK", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub epp_trust_network: Option<bool>,
    /// Static worker base URL (repeatable; env: comma-separated). Workers also register by reporting.
    #[arg(long = "worker", env = "KVGATE_GATEWAY_WORKERS", value_delimiter = ',')]
    pub workers: Option<Vec<String>>,
    /// Routing policy: goodput (the default: the measured guard plus the decode batch, the KV headroom and the classes' SLOs, the tuning protocol's pick of #66: docs/benchmarks/routing.md), cache_aware_measured (the hot-spot guard in measured seconds alone), cache_aware (the same score with token thresholds), round_robin, least_load, consistent_hash.
    #[arg(long, env = "KVGATE_GATEWAY_POLICY", default_value = kvgate_router::routing::DEFAULT_POLICY)]
    pub policy: Option<String>,
    /// Prefill/decode split policy, asked per request when a prefill worker and a decode worker that transfer KV
    /// are reporting: cost_model, aggregated (never split), always, dynamo, llm_d.
    #[arg(long, env = "KVGATE_GATEWAY_SPLIT_POLICY", default_value = kvgate_router::split::DEFAULT_SPLIT_POLICY)]
    pub split_policy: Option<String>,
    /// The TTFT target the split policy judges by.
    #[arg(long, env = "KVGATE_GATEWAY_SPLIT_SLO_TTFT", default_value = "2s")]
    pub split_slo_ttft: Option<String>,
    /// The TPOT target the split policy judges by.
    #[arg(long, env = "KVGATE_GATEWAY_SPLIT_SLO_TPOT", default_value = "50ms")]
    pub split_slo_tpot: Option<String>,
    /// The P->D rate believed before a pair's first measured probe or transfer, Gb/s.
    #[arg(long, env = "KVGATE_GATEWAY_SPLIT_BANDWIDTH_PRIOR_GBPS", default_value = kvgate_shared::default_text!(kvgate_router::split::plan::DEFAULT_BANDWIDTH_PRIOR_GBPS))]
    pub split_bandwidth_prior_gbps: Option<f64>,
    /// Shared secret workers send with reports (`Authorization: Bearer`). Required: without it the gateway refuses
    /// to start unless `--insecure-reports` is given.
    #[arg(long, env = "KVGATE_REPORT_SECRET", hide_env_values = true)]
    pub report_secret: Option<String>,
    /// Accept reports without a secret (anyone who reaches the control port can then register a worker). Only for
    /// closed test setups.
    #[arg(long, env = "KVGATE_GATEWAY_INSECURE_REPORTS", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub insecure_reports: Option<bool>,
    /// Where reported workers may live: an `advertise_url` host must match one entry: an IP, a CIDR
    /// (`10.0.0.0/8`), a host name, or a `*.suffix` pattern (`*.kvgate-worker.serving.svc.cluster.local`).
    /// Repeatable (env: comma-separated). Default none: the host must be the report's source address (or a name
    /// that resolves to it).
    #[arg(long = "advertise-allow", env = "KVGATE_GATEWAY_ADVERTISE_ALLOW", value_delimiter = ',')]
    pub advertise_allow: Option<Vec<String>>,
    /// Forward the client's `Authorization` header to pods that are not kvgate workers (off: it is the client's
    /// key to this gateway, not to the pods; with a report secret kvgate workers get the gateway's token instead).
    #[arg(long, env = "KVGATE_GATEWAY_FORWARD_AUTHORIZATION", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub forward_authorization: Option<bool>,
    /// Hand the prompt's token ids to kvgate workers (body field `kvgate_prompt_ids`, authenticated with the
    /// report secret) so they do not tokenize again. Needs `--report-secret`.
    #[arg(long, env = "KVGATE_GATEWAY_PROMPT_HANDOFF", num_args = 0..=1, default_missing_value = "true", default_value = "true")]
    pub prompt_handoff: Option<bool>,
    /// API key table (TOML `[[keys]]`: `key` or `key_sha256`, `tenant`, `classes`, `cache_salt`; see keys.rs).
    /// Default none: every caller is the anonymous tenant and no caller may choose its class.
    #[arg(long, env = "KVGATE_GATEWAY_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Refuse requests without a known API key (401).(unknown callers share the anonymous tenant).
    #[arg(long, env = "KVGATE_GATEWAY_REQUIRE_API_KEY", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub require_api_key: Option<bool>,
    /// No report for this long: the worker's cache summary is ignored.
    #[arg(long, env = "KVGATE_GATEWAY_STALE_AFTER", default_value = "3s")]
    pub stale_after: Option<String>,
    /// No report for this long (or refused connections): the worker leaves the ring until it reports again.
    #[arg(long, env = "KVGATE_GATEWAY_DEAD_AFTER", default_value = "10s")]
    pub dead_after: Option<String>,
    /// How long what this gateway routed to a worker counts as cached there (the overlay).
    #[arg(long, env = "KVGATE_GATEWAY_OVERLAY_TTL", default_value = "3s")]
    pub overlay_ttl: Option<String>,
    /// Virtual nodes per worker on the ring.
    #[arg(long, env = "KVGATE_GATEWAY_VNODES", default_value = "64")]
    pub vnodes: Option<u32>,
    /// Largest request body in bytes; beyond it 413. The worker's default is the same (a body a worker would refuse
    /// is refused here first).
    #[arg(long, env = "KVGATE_GATEWAY_MAX_BODY_BYTES", default_value = kvgate_shared::default_text!(kvgate_shared::openai::DEFAULT_MAX_BODY_BYTES))]
    pub max_body_bytes: Option<usize>,
    /// Most JSON values in a chat request's `messages`, `tools` and `chat_template_kwargs` together; beyond it 400.
    #[arg(long, env = "KVGATE_GATEWAY_MAX_CHAT_JSON_VALUES", default_value = "200000")]
    pub max_chat_json_values: Option<usize>,
    /// Ring key: a prompt block followed by this many distinct next blocks recently is a hub (a shared system
    /// prompt's end); the key is the block after a prompt's last hub (2..=8).
    #[arg(long, env = "KVGATE_GATEWAY_RING_HUB_FANOUT", default_value = kvgate_shared::default_text!(crate::routing::ring_key::DEFAULT_HUB_FANOUT))]
    pub ring_hub_fanout: Option<usize>,
    /// Blocks the ring-key sketch remembers per generation (two generations; about 40 bytes each).
    #[arg(long, env = "KVGATE_GATEWAY_RING_SKETCH_ENTRIES", default_value = kvgate_shared::default_text!(crate::routing::ring_key::DEFAULT_SKETCH_ENTRIES))]
    pub ring_sketch_entries: Option<usize>,
    /// Most open client connections; beyond it a new connection gets 503 and is closed.
    #[arg(long, env = "KVGATE_GATEWAY_MAX_CONNECTIONS", default_value = "4096")]
    pub max_connections: Option<usize>,
    /// A request's header must arrive whole within this long of its first byte (and a new connection must send
    /// its first byte within it); else 408 and the connection closes.
    #[arg(long, env = "KVGATE_GATEWAY_HEADER_READ_TIMEOUT", default_value = "10s")]
    pub header_read_timeout: Option<String>,
    /// An idle keep-alive connection is closed after this long.
    #[arg(long, env = "KVGATE_GATEWAY_KEEPALIVE_TIMEOUT", default_value = "60s")]
    pub keepalive_timeout: Option<String>,
    /// The whole request body must arrive within this long; else 408.
    #[arg(long, env = "KVGATE_GATEWAY_REQUEST_READ_TIMEOUT", default_value = "60s")]
    pub request_read_timeout: Option<String>,
    /// Threads that parse and tokenize prompts (off the proxy threads). Default: the number of CPUs.
    #[arg(long, env = "KVGATE_GATEWAY_TOKENIZE_THREADS")]
    pub tokenize_threads: Option<usize>,
    /// Requests waiting for a tokenize thread; beyond it 503 `tokenizer_busy`.
    #[arg(long, env = "KVGATE_GATEWAY_TOKENIZE_QUEUE", default_value = "256")]
    pub tokenize_queue: Option<usize>,
    /// Token ids of recent chat messages kept per model, so a conversation's history is tokenized once (pieces
    /// between special tokens; exact). 0 turns the cache off. (4 bytes a token: the default is about 16 MiB per model).
    #[arg(long, env = "KVGATE_GATEWAY_TOKENIZE_CACHE_TOKENS", default_value = kvgate_shared::default_text!(kvgate_shared::prompt::segments::DEFAULT_CACHE_TOKENS))]
    pub tokenize_cache_tokens: Option<usize>,
    /// Timeout to connect to a worker.
    #[arg(long, env = "KVGATE_GATEWAY_CONNECT_TIMEOUT", default_value = "1s")]
    pub connect_timeout: Option<String>,
    /// Least time a worker gets to send its response header (first byte).
    #[arg(long, env = "KVGATE_GATEWAY_FIRST_BYTE_TIMEOUT", default_value = "30s")]
    pub first_byte_timeout: Option<String>,
    /// Added to the first-byte timeout per uncached prompt token (prefill).
    #[arg(long, env = "KVGATE_GATEWAY_FIRST_BYTE_PER_PROMPT_TOKEN", default_value = "1ms")]
    pub first_byte_per_prompt_token: Option<String>,
    /// Added per `max_tokens` for a non-streamed request (its header comes after the last token).
    #[arg(long, env = "KVGATE_GATEWAY_FIRST_BYTE_PER_OUTPUT_TOKEN", default_value = "100ms")]
    pub first_byte_per_output_token: Option<String>,
    /// Most the first-byte timeout can grow to.
    #[arg(long, env = "KVGATE_GATEWAY_FIRST_BYTE_TIMEOUT_CAP", default_value = "600s")]
    pub first_byte_timeout_cap: Option<String>,
    /// Longest silence between two chunks of a response; then the stream ends with an error event.
    #[arg(long, env = "KVGATE_GATEWAY_STREAM_IDLE_TIMEOUT", default_value = "60s")]
    pub stream_idle_timeout: Option<String>,
    /// Workers tried per request when they refuse before any byte (connect failure, queue_full, model_loading,
    /// shutting_down, engine_stopped, aborted).
    #[arg(long, env = "KVGATE_GATEWAY_MAX_ATTEMPTS", default_value = "3")]
    pub max_attempts: Option<usize>,
    /// A LoRA adapter this gateway may load on pods (`NAME=PATH`, repeatable; env: comma-separated): `PATH` is its
    /// directory as the pods see it (the `lora_path` of their `POST /v1/load_lora_adapter`). A request naming an
    /// adapter no healthy pod holds, or one whose holders are busier than a load costs, loads it where the placement
    /// cost is least (docs/operating/lora.md). Default none: adapter requests go to the pods that hold them, and an
    /// adapter no pod holds is 404.
    #[arg(long = "lora", env = "KVGATE_GATEWAY_LORA", value_delimiter = ',')]
    pub lora: Option<Vec<String>>,
    /// The base model of the `--lora` adapters. Default: the one model the fleet serves (with several, a request
    /// for a `--lora` adapter nobody holds is 404 until this is set).
    #[arg(long, env = "KVGATE_GATEWAY_LORA_BASE")]
    pub lora_base: Option<String>,
    /// Longest an adapter load on a pod may take; past it (or on a refusal) the request goes to the adapter's
    /// holders, or, with none, is answered 503 `adapter_load_failed` (retryable), and that pod is not asked to load
    /// that adapter again for 30 s.
    #[arg(long, env = "KVGATE_GATEWAY_LORA_LOAD_TIMEOUT", default_value = "30s")]
    pub lora_load_timeout: Option<String>,
    /// Where an adapter request runs: `cost` (a worker holding the adapter, or the one where loading it costs least,
    /// `kvgate_router::placement`) or `anywhere` (the policy's pick among all the model's workers, the adapter
    /// loaded there when it lacks it: what a router that does not know adapters does, for comparisons).
    #[arg(long, env = "KVGATE_GATEWAY_LORA_PLACEMENT", default_value = "cost", value_parser = ["cost", "anywhere"])]
    pub lora_placement: Option<String>,
    /// Bearer token of adapter loads on pods that are not kvgate workers (vLLM's `--api-key`); kvgate workers get
    /// the gateway's token (with `--report-secret`). Default none.
    #[arg(long, env = "KVGATE_GATEWAY_LORA_LOAD_TOKEN", hide_env_values = true)]
    pub lora_load_token: Option<String>,
    /// A reported worker silent this long is forgotten (with its metric series).
    #[arg(long, env = "KVGATE_GATEWAY_FORGET_AFTER", default_value = "300s")]
    pub forget_after: Option<String>,
    /// How often a worker out of the ring for a refused connection or a timeout is probed (`GET /health`) to bring
    /// it back (a 2xx, or a 4xx from a server without that route, brings it back); also how often the P->D pairs
    /// no transfer has measured are probed (`link_probe`).
    #[arg(long, env = "KVGATE_GATEWAY_PROBE_INTERVAL", default_value = "2s")]
    pub probe_interval: Option<String>,
    /// Most workers in the registry; reports from further workers get 503.
    #[arg(long, env = "KVGATE_GATEWAY_MAX_WORKERS", default_value = "4096")]
    pub max_workers: Option<usize>,
    /// Largest tokenizer a worker may serve to this gateway, in bytes. (64 MiB).
    #[arg(long, env = "KVGATE_GATEWAY_MAX_TOKENIZER_BYTES", default_value = "67108864")]
    pub max_tokenizer_bytes: Option<usize>,
    /// Worker threads of the proxy.
    #[arg(long, env = "KVGATE_GATEWAY_THREADS", default_value = "2")]
    pub threads: Option<usize>,
    /// On SIGTERM, how long requests in flight get to finish before the proxy exits.
    #[arg(long, env = "KVGATE_GATEWAY_SHUTDOWN_GRACE", default_value = "10s")]
    pub shutdown_grace: Option<String>,
    /// Scoring weights of cache_aware (TOML `[weights]`; see routing/cache_aware.rs for the formula).
    #[arg(skip)]
    pub weights: Option<Weights>,
    /// cache_aware prefix weight, over `[weights]` (whose defaults are `Weights::default()`, routing/cache_aware.rs).
    #[arg(long, env = "KVGATE_GATEWAY_W_PREFIX")]
    #[serde(skip)]
    pub w_prefix: Option<f64>,
    /// cache_aware ring weight, over `[weights]` (whose defaults are `Weights::default()`, routing/cache_aware.rs).
    #[arg(long, env = "KVGATE_GATEWAY_W_RING")]
    #[serde(skip)]
    pub w_ring: Option<f64>,
    /// cache_aware load weight, over `[weights]` (whose defaults are `Weights::default()`, routing/cache_aware.rs).
    #[arg(long, env = "KVGATE_GATEWAY_W_LOAD")]
    #[serde(skip)]
    pub w_load: Option<f64>,
    /// Logs as JSON lines.
    #[arg(long, env = "KVGATE_GATEWAY_LOG_JSON", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub log_json: Option<bool>,
    /// Bearer token of the admin API (control listener). Default none: the admin routes are off (404).
    #[arg(long, env = "KVGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// File where admin changes (weights, budgets) are kept across restarts, written before a change takes effect.
    /// Default, when the admin API is on: `gateway-state.json` under `$KVGATE_DATA_DIR`, else
    /// `$XDG_STATE_HOME/kvgate`, else `~/.local/state/kvgate`. `off`: changes last until restart. A file that
    /// cannot be used at start is moved aside (`.corrupt-<time>`) and the gateway starts from this configuration.
    #[arg(long, env = "KVGATE_GATEWAY_STATE_FILE")]
    pub state_file: Option<PathBuf>,
    /// Redis shared by the gateway replicas (`redis://[:password@]host:port[/db]`; `rediss://` for TLS): admin
    /// state is kept and announced there (see replicas/). Default none: one replica, state in the state file.
    #[arg(long, env = "KVGATE_GATEWAY_REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// User name for Redis (an ACL user, e.g. the chart's `kvgate`), instead of one in `--redis-url`. Default none.
    #[arg(long, env = "KVGATE_GATEWAY_REDIS_USERNAME")]
    pub redis_username: Option<String>,
    /// Password for Redis, instead of one in `--redis-url` (keeps it out of the URL; the chart passes it from a
    /// Secret). When both are given this one wins. Default none.
    #[arg(long, env = "KVGATE_GATEWAY_REDIS_PASSWORD", hide_env_values = true)]
    pub redis_password: Option<String>,
    /// Prefix of every Redis key and channel (gateways of different fleets can share one Redis).
    #[arg(long, env = "KVGATE_GATEWAY_REDIS_PREFIX", default_value = "kvgate")]
    pub redis_prefix: Option<String>,
    /// This replica's name in Redis heartbeats and audit lines. Default: `$HOSTNAME` (the pod name), else
    /// `gateway-<pid>`.
    #[arg(long, env = "KVGATE_GATEWAY_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// With `--redis-url`: publish every send (worker, the prompt's overlay points, uncached tokens, ring key) to
    /// the other replicas, which count it as load and overlay until the worker's next report (see
    /// replicas/sends.rs).
    #[arg(long, env = "KVGATE_GATEWAY_SHARE_SENDS", num_args = 0..=1, default_missing_value = "true", default_value = "true")]
    pub share_sends: Option<bool>,
    /// Export request traces (spans: request, prepare, admit, route, forward, first byte) to this OpenTelemetry
    /// collector's OTLP/HTTP receiver, e.g. `http://otel-collector:4318` (protobuf to `/v1/traces`). A client's W3C
    /// `traceparent` is the request's parent, and workers get one naming the forward attempt. None: no tracing.
    #[arg(long, env = "KVGATE_GATEWAY_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Share of requests without a sampled `traceparent` that are traced ([0, 1]).
    #[arg(long, env = "KVGATE_GATEWAY_TRACE_SAMPLE_RATIO", default_value = "1")]
    pub trace_sample_ratio: Option<f64>,
    /// Trace every request whose client `traceparent` says sampled, past `--trace-sample-ratio` (for a gateway
    /// behind a tier that samples, such as an ingress that traces). Off: a client's sampled flag is drawn by the
    /// ratio like any other request, so no client can make all of its requests traced.
    #[arg(long, env = "KVGATE_GATEWAY_TRUST_TRACE_SAMPLING", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub trust_trace_sampling: Option<bool>,
    /// Request classes and their token budgets (TOML `[[classes]]`; default: short / long / reasoning, see
    /// admission/classes.rs).
    #[arg(skip)]
    pub classes: Option<Vec<ClassConfig>>,
    /// A model this gateway tokenizes itself, `NAME=DIR` (repeatable; env: comma-separated): DIR is a local Hugging
    /// Face directory (`tokenizer.json`, and `tokenizer_config.json` and/or `chat_template.jinja`). TOML
    /// `[[models]]` entries also take `block-size` (default 16), `kind` (what the pool runs: `kvgate`, `vllm`,
    /// `sglang` or `openai`; default `kvgate`) and `workers` (the pool's static URLs). Pods that are not kvgate
    /// workers are routed with this tokenizer; a kvgate worker serving the model with another tokenizer or block
    /// size is refused. Default none (tokenizers are fetched from kvgate workers).
    #[arg(long = "model", env = "KVGATE_GATEWAY_MODELS", value_delimiter = ',')]
    pub models: Option<Vec<ModelSpec>>,
}

/// Default of `--epp-max-streams` (the endpoint picker, `epp/`).
pub const DEFAULT_EPP_MAX_STREAMS: usize = 4096;
/// The resolved configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayConfig {
    pub listen: String,
    pub control_listen: String,
    pub epp_listen: Option<String>,
    pub epp_max_streams: usize,
    pub epp_max_buffered_bytes: usize,
    /// (certificate, key) PEM files of the picker's TLS.
    pub epp_tls: Option<(PathBuf, PathBuf)>,
    /// Who may drive the picker.
    pub epp_auth: EppAuth,
    pub workers: Vec<String>,
    pub policy: String,
    pub split_policy: String,
    pub split: kvgate_router::split::plan::SplitSettings,
    pub report_secret: Option<String>,
    pub insecure_reports: bool,
    pub advertise_allow: Vec<String>,
    pub forward_authorization: bool,
    pub prompt_handoff: bool,
    pub api_keys_file: Option<PathBuf>,
    pub require_api_key: bool,
    pub stale_after: Duration,
    pub dead_after: Duration,
    pub overlay_ttl: Duration,
    pub vnodes: u32,
    pub max_body_bytes: usize,
    pub max_chat_json_values: usize,
    pub ring_hub_fanout: usize,
    pub ring_sketch_entries: usize,
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub keepalive_timeout: Duration,
    pub request_read_timeout: Duration,
    pub tokenize_threads: usize,
    pub tokenize_queue: usize,
    pub tokenize_cache_tokens: usize,
    pub connect_timeout: Duration,
    pub first_byte: FirstByteTimeout,
    pub stream_idle_timeout: Duration,
    pub max_attempts: usize,
    /// `--lora` adapters: (name, path on the pods).
    pub lora: Vec<(String, String)>,
    pub lora_base: Option<String>,
    pub lora_load_timeout: Duration,
    pub lora_load_token: Option<String>,
    /// `--lora-placement anywhere`: adapter requests routed as if the adapter did not matter.
    pub lora_anywhere: bool,
    pub forget_after: Duration,
    pub probe_interval: Duration,
    pub max_workers: usize,
    pub max_tokenizer_bytes: usize,
    pub threads: usize,
    pub shutdown_grace: Duration,
    pub weights: Weights,
    pub log_json: bool,
    pub classes: Vec<ClassConfig>,
    pub models: Vec<ModelSpec>,
    pub admin_token: Option<String>,
    pub state_file: Option<PathBuf>,
    pub redis_url: Option<String>,
    pub redis_username: Option<String>,
    pub redis_password: Option<String>,
    pub redis_prefix: String,
    pub replica_id: String,
    pub share_sends: bool,
    pub otlp_endpoint: Option<String>,
    pub trace_sample_ratio: f64,
    pub trust_trace_sampling: bool,
}

/// Whether a `redis://` URL carries a password (`scheme://[user]:password@host...`).
fn url_has_password(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    authority
        .rsplit_once('@')
        .is_some_and(|(info, _)| info.split_once(':').is_some_and(|(_, pw)| !pw.is_empty()))
}

/// The first-byte timeout of a request: `floor + uncached prompt tokens x per_prompt_token` (+ `max_tokens x
/// per_output_token` when not streamed, since the header then follows the last token), at most `cap`; where the
/// route's prediction from measured speeds says the header comes later, [`PREDICTED_MARGIN`] times that (still at
/// most `cap`): a worker that measurably needs 80 s for a prompt is not cut off at 44 s (and the work wasted).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirstByteTimeout {
    pub floor: Duration,
    pub per_prompt_token: Duration,
    pub per_output_token: Duration,
    pub cap: Duration,
}

/// How many times its predicted time a request's first byte may take (`FirstByteTimeout::stretched`).
pub const PREDICTED_MARGIN: f64 = 2.0;

impl FirstByteTimeout {
    /// `base` (from [`Self::for_request`]), or [`PREDICTED_MARGIN`] x `predicted_s` (the predicted seconds to the
    /// response header) if longer, at most `cap`. A prediction that is not a finite positive number is ignored.
    pub fn stretched(&self, base: Duration, predicted_s: Option<f64>) -> Duration {
        let Some(p) = predicted_s.filter(|p| p.is_finite() && *p > 0.0) else { return base };
        let want = (p * PREDICTED_MARGIN).min(self.cap.as_secs_f64());
        base.max(Duration::from_secs_f64(want))
    }

    pub fn for_request(&self, uncached_prompt_tokens: u64, max_tokens: u64, stream: bool) -> Duration {
        let prefill = self.per_prompt_token.as_secs_f64() * uncached_prompt_tokens as f64;
        let decode = if stream { 0.0 } else { self.per_output_token.as_secs_f64() * max_tokens as f64 };
        let t = self.floor.as_secs_f64() + prefill + decode;
        Duration::from_secs_f64(
            t.min(self.cap.as_secs_f64()).max(self.floor.as_secs_f64().min(self.cap.as_secs_f64())),
        )
    }
}

/// The `--lora` entries as (name, path): each `NAME=PATH`, names distinct and at most
/// `MAX_ADAPTER_NAME_BYTES` bytes without whitespace.
fn lora_catalogue(entries: Vec<String>) -> Result<Vec<(String, String)>, String> {
    let mut out: Vec<(String, String)> = Vec::new();
    for e in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
        let Some((n, p)) = e.split_once('=').map(|(n, p)| (n.trim(), p.trim())) else {
            return Err(format!("--lora {e:?} is not NAME=PATH"));
        };
        let max = kvgate_shared::report::MAX_ADAPTER_NAME_BYTES;
        if n.is_empty() || p.is_empty() || n.len() > max || n.chars().any(char::is_whitespace) {
            return Err(format!(
                "--lora {e:?}: NAME (1 to {max} bytes, no whitespace) and PATH are both needed"
            ));
        }
        if out.iter().any(|(o, _)| o == n) {
            return Err(format!("--lora {n}: given twice"));
        }
        out.push((n.to_owned(), p.to_owned()));
    }
    Ok(out)
}

fn duration(v: String, name: &str) -> Result<Duration, String> {
    kvgate_shared::duration::parse_duration(&v).map_err(|e| format!("--{name}: {e}"))
}

impl GatewayArgs {
    /// The flags and environment of this process (exits with clap's message on bad flags or `--help`).
    pub fn from_command_line() -> Self {
        Self::from_iter_args(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }

    /// Parses `args` (the first is the program name), remembering which values are clap's defaults.
    pub fn from_iter_args<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::{CommandFactory, FromArgMatches};
        let m = Self::command().try_get_matches_from(args)?;
        let mut a = Self::from_arg_matches(&m)?;
        a.layers = Layers::from_matches(&m);
        Ok(a)
    }

    /// The configuration reference (`docs/reference/gateway.md`), generated from the flags.
    pub fn reference() -> String {
        kvgate_shared::settings::reference_markdown(
            &<Self as clap::CommandFactory>::command(),
            "kvgate-gateway configuration",
            "Every setting is a flag, an environment variable and a key of the TOML file given with `--config` \
             (precedence: flags > environment > file > default). `[[models]]`, `[[classes]]` and `[weights]` are \
             TOML tables: see docs/operating/gateway.md.",
        )
    }

    /// Merges flags/env over the TOML file over defaults and validates.
    pub fn resolve(self) -> Result<GatewayConfig, String> {
        let file = match &self.config {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
                toml::from_str::<GatewayArgs>(&text).map_err(|e| format!("{}: {e}", p.display()))?
            }
            None => GatewayArgs::default(),
        };
        let cmd = <GatewayArgs as clap::CommandFactory>::command();
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
        let mut weights = pick!(weights).unwrap_or_default();
        if let Some(v) = self.w_prefix {
            weights.w_prefix = v;
        }
        if let Some(v) = self.w_ring {
            weights.w_ring = v;
        }
        if let Some(v) = self.w_load {
            weights.w_load = v;
        }
        let mut cfg = GatewayConfig {
            listen: set!(listen),
            control_listen: set!(control_listen),
            epp_listen: pick!(epp_listen).filter(|a| !a.is_empty()),
            epp_max_streams: set!(epp_max_streams),
            epp_max_buffered_bytes: set!(epp_max_buffered_bytes),
            epp_tls: match (pick!(epp_tls_cert), pick!(epp_tls_key)) {
                (Some(c), Some(k)) => Some((c, k)),
                (None, None) => None,
                _ => return Err("--epp-tls-cert and --epp-tls-key go together".into()),
            },
            epp_auth: EppAuth {
                token: pick!(epp_token).filter(|t| !t.is_empty()),
                client_ca: pick!(epp_client_ca),
                trust_network: set!(epp_trust_network),
            },
            workers: pick!(workers).unwrap_or_default().into_iter().filter(|w| !w.is_empty()).collect(),
            policy: set!(policy),
            split_policy: set!(split_policy),
            split: kvgate_router::split::plan::SplitSettings {
                slo: kvgate_router::split::Slo {
                    ttft_s: duration(set!(split_slo_ttft), "split-slo-ttft")?.as_secs_f64(),
                    tpot_s: duration(set!(split_slo_tpot), "split-slo-tpot")?.as_secs_f64(),
                },
                bandwidth_prior_bytes_per_s: set!(split_bandwidth_prior_gbps) * 1e9 / 8.0,
            },
            report_secret: pick!(report_secret).filter(|s| !s.is_empty()),
            insecure_reports: set!(insecure_reports),
            advertise_allow: pick!(advertise_allow)
                .unwrap_or_default()
                .into_iter()
                .filter(|a| !a.is_empty())
                .collect(),
            forward_authorization: set!(forward_authorization),
            prompt_handoff: set!(prompt_handoff),
            api_keys_file: pick!(api_keys_file),
            require_api_key: set!(require_api_key),
            stale_after: duration(set!(stale_after), "stale-after")?,
            dead_after: duration(set!(dead_after), "dead-after")?,
            overlay_ttl: duration(set!(overlay_ttl), "overlay-ttl")?,
            vnodes: set!(vnodes),
            max_body_bytes: set!(max_body_bytes),
            max_chat_json_values: set!(max_chat_json_values),
            ring_hub_fanout: set!(ring_hub_fanout),
            ring_sketch_entries: set!(ring_sketch_entries),
            max_connections: set!(max_connections),
            header_read_timeout: duration(set!(header_read_timeout), "header-read-timeout")?,
            keepalive_timeout: duration(set!(keepalive_timeout), "keepalive-timeout")?,
            request_read_timeout: duration(set!(request_read_timeout), "request-read-timeout")?,
            tokenize_threads: pick!(tokenize_threads)
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())),
            tokenize_queue: set!(tokenize_queue),
            tokenize_cache_tokens: set!(tokenize_cache_tokens),
            connect_timeout: duration(set!(connect_timeout), "connect-timeout")?,
            first_byte: FirstByteTimeout {
                floor: duration(set!(first_byte_timeout), "first-byte-timeout")?,
                per_prompt_token: duration(set!(first_byte_per_prompt_token), "first-byte-per-prompt-token")?,
                per_output_token: duration(set!(first_byte_per_output_token), "first-byte-per-output-token")?,
                cap: duration(set!(first_byte_timeout_cap), "first-byte-timeout-cap")?,
            },
            stream_idle_timeout: duration(set!(stream_idle_timeout), "stream-idle-timeout")?,
            max_attempts: set!(max_attempts),
            lora: lora_catalogue(pick!(lora).unwrap_or_default())?,
            lora_base: pick!(lora_base).filter(|b| !b.is_empty()),
            lora_load_timeout: duration(set!(lora_load_timeout), "lora-load-timeout")?,
            lora_load_token: pick!(lora_load_token).filter(|t| !t.is_empty()),
            lora_anywhere: set!(lora_placement) == "anywhere",
            forget_after: duration(set!(forget_after), "forget-after")?,
            probe_interval: duration(set!(probe_interval), "probe-interval")?,
            max_workers: set!(max_workers),
            max_tokenizer_bytes: set!(max_tokenizer_bytes),
            shutdown_grace: duration(set!(shutdown_grace), "shutdown-grace")?,
            threads: set!(threads),
            weights,
            log_json: set!(log_json),
            classes: pick!(classes).unwrap_or_else(default_classes),
            models: pick!(models).unwrap_or_default(),
            admin_token: pick!(admin_token).filter(|t| !t.is_empty()),
            state_file: None,
            redis_url: pick!(redis_url).filter(|u| !u.is_empty()),
            redis_username: pick!(redis_username).filter(|u| !u.is_empty()),
            redis_password: pick!(redis_password).filter(|p| !p.is_empty()),
            redis_prefix: set!(redis_prefix),
            replica_id: pick!(replica_id)
                .or_else(|| std::env::var("HOSTNAME").ok())
                .filter(|r| !r.is_empty())
                .unwrap_or_else(|| format!("gateway-{}", std::process::id())),
            share_sends: set!(share_sends),
            otlp_endpoint: pick!(otlp_endpoint).filter(|e| !e.is_empty()),
            trace_sample_ratio: set!(trace_sample_ratio),
            trust_trace_sampling: set!(trust_trace_sampling),
        };
        cfg.state_file = state_file(pick!(state_file), cfg.admin_token.is_some());
        cfg.validate()?;
        Ok(cfg)
    }
}

/// The state file: the one given (`off`: none), else the default path when the admin API is on (without it nothing
/// changes at run time, so there is nothing to keep, and no file from an earlier run overrides the configuration).
fn state_file(given: Option<PathBuf>, admin_on: bool) -> Option<PathBuf> {
    match given {
        Some(p) if p.as_os_str() == "off" || p.as_os_str().is_empty() => None,
        Some(p) => Some(p),
        None if admin_on => Some(default_data_dir().join("gateway-state.json")),
        None => None,
    }
}

/// `$KVGATE_DATA_DIR`, else `$XDG_STATE_HOME/kvgate`, else `~/.local/state/kvgate`, else `./kvgate-state`.
pub fn default_data_dir() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("KVGATE_DATA_DIR")
        .or_else(|| env("XDG_STATE_HOME").map(|d| d.join("kvgate")))
        .or_else(|| env("HOME").map(|h| h.join(".local/state/kvgate")))
        .unwrap_or_else(|| PathBuf::from("kvgate-state"))
}

impl GatewayConfig {
    /// Whether `model` has a `[[models]]` entry (its tokenizer and block size are this gateway's, not a worker's).
    pub fn is_configured(&self, model: &str) -> bool {
        self.models.iter().any(|m| m.name == model)
    }

    /// What the pool of `model` runs: its `[[models]]` entry's kind, else kvgate workers (whose tokenizers the
    /// gateway fetches).
    pub fn pool_kind(&self, model: &str) -> WorkerKind {
        self.models.iter().find(|m| m.name == model).map_or(WorkerKind::Kvgate, |m| m.kind)
    }

    /// Every problem at once.
    pub fn validate(&self) -> Result<(), String> {
        let mut p = Vec::new();
        if !(0.0..=1.0).contains(&self.trace_sample_ratio) {
            p.push(format!("trace-sample-ratio {} is not in [0, 1]", self.trace_sample_ratio));
        }
        if let (Some(url), Some(_), None) = (&self.redis_url, &self.redis_username, &self.redis_password) {
            if !url_has_password(url) {
                p.push(
                    "redis-username needs a password (--redis-password, or one in --redis-url): a user name alone \
                     would connect unauthenticated"
                        .into(),
                );
            }
        }
        if !POLICIES.contains(&self.policy.as_str()) {
            p.push(format!("policy {:?} is not one of {}", self.policy, POLICIES.join(", ")));
        }
        let epp = self.epp_listen.iter().map(|a| ("epp-listen", a));
        for (name, addr) in
            [("listen", &self.listen), ("control-listen", &self.control_listen)].into_iter().chain(epp)
        {
            if addr.parse::<std::net::SocketAddr>().is_err() {
                p.push(format!("{name} {addr:?} is not an address like 0.0.0.0:8080"));
            }
        }
        epp::problems(self, &mut p);
        models::problems(&self.models, &mut p);
        for w in &self.workers {
            if !w.starts_with("http://") {
                p.push(format!("worker {w:?} is not an http:// URL"));
            }
        }
        if self.stale_after > self.dead_after {
            p.push("stale-after must not exceed dead-after".into());
        }
        if self.vnodes == 0 || self.threads == 0 {
            p.push("vnodes and threads must be at least 1".into());
        }
        if let Some(url) = &self.redis_url {
            if !["redis://", "rediss://", "redis+unix://", "unix://"].iter().any(|p| url.starts_with(p)) {
                p.push("redis-url must start with redis://, rediss:// or unix://".into());
            }
        }
        let prefix_ok = |s: &str| {
            !s.is_empty() && s.len() <= 64 && s.chars().all(|c| c.is_ascii_graphic() && c != '*' && c != '?')
        };
        if !prefix_ok(&self.redis_prefix) {
            p.push("redis-prefix must be 1-64 printable characters without spaces, * or ?".into());
        }
        if !prefix_ok(&self.replica_id) || self.replica_id.len() > 64 {
            p.push("replica-id must be 1-64 printable characters without spaces, * or ?".into());
        }
        if self.max_body_bytes < 1024 {
            p.push("max-body-bytes must be at least 1024".into());
        }
        if self.report_secret.is_none() && !self.insecure_reports {
            p.push(
                "no report secret (--report-secret / KVGATE_REPORT_SECRET): anyone reaching the control port could \
                 register a worker; set one, or --insecure-reports for a closed test setup"
                    .into(),
            );
        }
        for a in &self.advertise_allow {
            if let Err(e) = crate::control::trust::AllowEntry::parse(a) {
                p.push(format!("advertise-allow {a:?}: {e}"));
            }
        }
        for (name, v) in [
            ("max-connections", self.max_connections),
            ("epp-max-streams", self.epp_max_streams),
            ("epp-max-buffered-bytes", self.epp_max_buffered_bytes),
            ("tokenize-threads", self.tokenize_threads),
            ("tokenize-queue", self.tokenize_queue),
            ("max-attempts", self.max_attempts),
            ("max-workers", self.max_workers),
            ("max-chat-json-values", self.max_chat_json_values),
            ("ring-sketch-entries", self.ring_sketch_entries),
        ] {
            if v == 0 {
                p.push(format!("{name} must be at least 1"));
            }
        }
        for (name, d) in [
            ("header-read-timeout", self.header_read_timeout),
            ("keepalive-timeout", self.keepalive_timeout),
            ("request-read-timeout", self.request_read_timeout),
            ("first-byte-timeout", self.first_byte.floor),
            ("stream-idle-timeout", self.stream_idle_timeout),
            ("probe-interval", self.probe_interval),
            ("connect-timeout", self.connect_timeout),
        ] {
            if d.is_zero() {
                p.push(format!("{name} must be more than 0"));
            }
        }
        if !(2..=crate::routing::ring_key::MAX_HUB_FANOUT).contains(&self.ring_hub_fanout) {
            p.push(format!("ring-hub-fanout {} is not in 2..=8", self.ring_hub_fanout));
        }
        if kvgate_router::split::split_policy_by_name(&self.split_policy).is_none() {
            p.push(format!(
                "split-policy {:?}: expected one of {}",
                self.split_policy,
                kvgate_router::split::SPLIT_POLICIES.join(", ")
            ));
        }
        let bw = self.split.bandwidth_prior_bytes_per_s;
        if !bw.is_finite() || bw <= 0.0 {
            p.push("split-bandwidth-prior-gbps must be a number above 0".into());
        }
        if self.split.slo.ttft_s <= 0.0 || self.split.slo.tpot_s <= 0.0 {
            p.push("split-slo-ttft and split-slo-tpot must be more than 0".into());
        }
        if self.first_byte.cap < self.first_byte.floor {
            p.push("first-byte-timeout-cap must not be below first-byte-timeout".into());
        }
        if self.forget_after < self.dead_after {
            p.push("forget-after must not be below dead-after".into());
        }
        if self.max_tokenizer_bytes < 1024 {
            p.push("max-tokenizer-bytes must be at least 1024".into());
        }
        p.extend(self.weights.validate());
        p.extend(crate::admission::classes::validate(&self.classes));
        if p.is_empty() {
            Ok(())
        } else {
            Err(format!("invalid configuration: {}", p.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests;
