//! `kvgate-worker serve`: the process users deploy on each GPU pod. It listens at once (so `/health` answers while
//! the model loads), loads the model on a blocking thread, runs the engine on its own thread, serves the OpenAI
//! API, and pushes cache summaries to gateways.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, vLLM's `POST /tokenize` and
//! `POST /detokenize`, `GET /health` (alive: the engine thread runs), `GET /ready` (model loaded, engine alive, not
//! draining), `GET /metrics` (Prometheus), `GET /kvgate/v1/tokenizer` (what a gateway needs to tokenize and hash
//! exactly like this worker), `POST /kvgate/v1/kv-probe` (a decode worker's timed sample of a link, `pd.rs`).
//!
//! Shutdown on SIGTERM/SIGINT: `/ready` turns 503, new requests are refused (`shutting_down`) and a report saying
//! `draining` goes to every gateway at once; running requests get `shutdown_grace` to finish, then are aborted;
//! the process exits when the last connection closes.
//!
//! A dead engine thread (a panic in a step) fails `/health` and `/ready` with 503 and the process exits with
//! status 70 half a second later, so the orchestrator restarts it rather than routing to a worker that can only
//! refuse.

pub mod api;
pub mod config;
pub mod engine_thread;
pub mod errors;
pub mod logprobs;
pub mod pd;
pub mod prefill_fit;
pub mod reporter;
pub mod spans;
pub mod text;
pub mod tokens;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvgate_shared::hashing::HashScheme;
use kvgate_shared::openai::{ModelCard, ModelList};
use kvgate_shared::prompt::Prompter;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use self::config::{EngineKind, ModelSource, ServeConfig};
use self::engine_thread::EngineHandle;
use self::errors::{ApiError, Refusal};
use crate::cuda::DeviceChoice;
use crate::engine::sim::{SimBackend, SimClock};
use crate::engine::timing::SimProfile;
use crate::engine::{CpuBackend, Engine, EngineConfig, SchedulerConfig};
use crate::model::fp8::KvCacheDtype;
use crate::model::llama::LlamaModel;
use crate::model::synth::{synth_model, SynthSpec};

/// Everything that exists once the model is loaded.
pub struct ServingModel {
    pub engine: EngineHandle,
    pub prompter: Arc<Prompter>,
    pub model_id: String,
    pub worker_id: String,
    pub max_model_len: usize,
    pub scheme: HashScheme,
    /// Where the engine computes: `cpu`, `cuda:0 (NVIDIA H200, sm_90, bfloat16)`, or `sim`.
    pub device: String,
    /// Its role and KV transfer listener, as reports say (the listener's address once it is bound).
    pub pd_info: kvgate_shared::report::PdInfo,
    /// What KV transfers need (`None`: this worker has no report secret, so it neither exports nor imports).
    pub transfer: Option<Arc<crate::transfer::Transfers>>,
}

/// Exit status of a worker whose engine thread died (EX_SOFTWARE).
pub const EXIT_ENGINE_DEAD: i32 = 70;

/// Shared by every handler.
pub struct AppState {
    pub cfg: ServeConfig,
    pub worker_id: String,
    loaded: OnceLock<Arc<ServingModel>>,
    draining: Arc<AtomicBool>,
    /// Wakes the reporter for an immediate report (draining started).
    report_now: Arc<tokio::sync::Notify>,
    /// Notified by the reporter once a report saying `draining` has been delivered (or has failed) everywhere.
    draining_reported: Arc<tokio::sync::Notify>,
    prometheus: PrometheusHandle,
    created: u64,
    /// Request spans to an OTLP collector (`--otlp-endpoint`; off without one).
    pub tracer: kvgate_shared::trace::Tracer,
}

impl AppState {
    pub fn loaded(&self) -> Option<Arc<ServingModel>> {
        self.loaded.get().cloned()
    }
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
    /// Whether the engine thread is dead (false while the model loads).
    pub fn engine_dead(&self) -> bool {
        self.loaded.get().is_some_and(|l| !l.engine.is_alive())
    }
}

/// A random id for this process (a restart gets a new one; gateways accept its reports from `seq` 1 again).
fn instance_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
    );
    h.finish().max(1)
}

fn install_metrics() -> Result<PrometheusHandle, String> {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let buckets = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &buckets)
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())?;
    Ok(HANDLE.get_or_init(|| handle).clone())
}

/// Builds the model directory for `--synth` once (written beside, then renamed, so concurrent workers are safe).
fn ensure_model_dir(src: &ModelSource) -> Result<std::path::PathBuf, String> {
    match src {
        ModelSource::Dir(d) => Ok(d.clone()),
        ModelSource::Synth { preset, seed, dir } => {
            if dir.join("config.json").exists() && dir.join("tokenizer.json").exists() {
                return Ok(dir.clone());
            }
            let tmp = dir.with_extension(format!("tmp-{}", std::process::id()));
            synth_model(&tmp, &SynthSpec::new(*preset, *seed)).map_err(|e| e.to_string())?;
            if let Some(parent) = dir.parent() {
                std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
            }
            if std::fs::rename(&tmp, dir).is_err() {
                // Another worker won the race; use its copy.
                let _ = std::fs::remove_dir_all(&tmp);
            }
            Ok(dir.clone())
        }
    }
}

fn load(cfg: &ServeConfig, worker_id: &str) -> Result<ServingModel, String> {
    let dir = ensure_model_dir(&cfg.model)?;
    let prompter = Prompter::from_dir(&dir)
        .map_err(|e| e.to_string())?
        .with_segment_cache_tokens(cfg.tokenize_cache_tokens);
    if let Some(why) = prompter.segment_cache_off() {
        tracing::info!(%why, "chat prompts are tokenized whole (no segment cache)");
    }
    if let Some(why) = prompter.long_text_off() {
        tracing::info!(%why, "long text is tokenized whole (no cached chunks)");
    }
    let prompter = Arc::new(prompter);
    let scheme = HashScheme::new(cfg.block_size, prompter.digest());
    let bs = cfg.block_size as usize;
    let scheduler = SchedulerConfig {
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        max_num_seqs: cfg.max_num_seqs,
    };
    let engine_cfg = |num_blocks| EngineConfig { num_blocks, scheme, scheduler: scheduler.clone() };
    let disk_dir = cfg.disk_kv_path.clone().unwrap_or_default();
    // What the SSD tier's records are valid for besides the scheme and layout: these weights (a simulated engine
    // has none: its profile's name).
    let weights = match &cfg.engine {
        _ if cfg.disk_kv_bytes == 0 && cfg.report_secret.is_none() => 0,
        EngineKind::Cpu => crate::model::identity::weights_digest(&dir)?,
        EngineKind::Sim { profile } => xxhash_rust::xxh3::xxh3_64(profile.to_string_lossy().as_bytes()),
    };
    let (handle, max_model_len, device, kv) = match &cfg.engine {
        EngineKind::Cpu => match cfg.device.resolve() {
            DeviceChoice::Cuda(ordinal) => {
                if cfg.kv_cache_dtype == KvCacheDtype::Fp8 {
                    return Err(format!(
                        "--kv-cache-dtype fp8 on cuda:{ordinal}: the CUDA FP8 KV kernels are not built yet (only the CPU \
                         engine's reference math is); use --kv-cache-dtype auto"
                    ));
                }
                let l = crate::cuda::backend::GpuModel::from_dir(&dir, ordinal, cfg.dtype)
                    .map_err(|e| format!("--device cuda:{ordinal}: {e} (--device cpu serves on the CPU)"))?;
                let slots = crate::cuda::backend::kv_slots_for(
                    &l,
                    cfg.gpu_memory_utilization,
                    cfg.kv_cache_tokens,
                    cfg.max_num_batched_tokens,
                    cfg.max_num_seqs,
                    bs,
                )?;
                let max_model_len = l.cfg.max_position_embeddings;
                let backend = crate::cuda::CudaBackend::new(l, slots, bs)?;
                let device = backend.describe();
                tracing::info!(device = %device, kv_cache_tokens = slots, "CUDA engine");
                let engine = Engine::new(engine_cfg(slots / bs), backend, Some(prompter.clone()));
                let engine = with_tiers(engine, cfg, &disk_dir, weights)?;
                let engine = with_load_costs(engine, cfg);
                let kv = transfer_parts(&engine, weights);
                (
                    EngineHandle::spawn(engine, cfg.max_waiting_requests, cfg.kv_transfer_stall_timeout),
                    max_model_len,
                    device,
                    kv,
                )
            }
            _ => {
                let tokens = cfg.kv_cache_tokens.unwrap_or(config::CPU_KV_CACHE_TOKENS);
                let model = LlamaModel::load(&dir).map_err(|e| e.to_string())?;
                let max_model_len = model.config().max_position_embeddings;
                let backend = CpuBackend::with_kv_dtype(model, tokens / bs * bs, cfg.kv_cache_dtype);
                tracing::info!(device = "cpu", requested = %cfg.device, kv_cache_tokens = tokens / bs * bs,
                    kv_cache_dtype = ?cfg.kv_cache_dtype, "CPU engine");
                let engine = Engine::new(engine_cfg(tokens / bs), backend, Some(prompter.clone()));
                let engine = with_tiers(engine, cfg, &disk_dir, weights)?;
                let engine = with_load_costs(engine, cfg);
                let kv = transfer_parts(&engine, weights);
                (
                    EngineHandle::spawn(engine, cfg.max_waiting_requests, cfg.kv_transfer_stall_timeout),
                    max_model_len,
                    "cpu".to_string(),
                    kv,
                )
            }
        },
        EngineKind::Sim { profile } => {
            let profile = SimProfile::named_or_file(&profile.to_string_lossy())?;
            let eos: Vec<u32> = prompter.eos_token_id().into_iter().collect();
            let backend = SimBackend::new(prompter.vocab_size(), profile.max_model_len, eos)
                .with_timing(profile.timing, SimClock::RealTime);
            tracing::info!(profile = %profile.name, "simulated engine");
            let tokens = cfg.kv_cache_tokens.unwrap_or(config::CPU_KV_CACHE_TOKENS);
            let engine = Engine::new(engine_cfg(tokens / bs), backend, Some(prompter.clone()));
            let mut engine = with_tiers(engine, cfg, &disk_dir, weights)?;
            // A simulated engine loads and computes at its profile's speeds: weigh those, not this machine's.
            engine.set_load_costs(profile.timing.load_costs(cfg.kv_load_policy));
            (
                EngineHandle::spawn(engine, cfg.max_waiting_requests, cfg.kv_transfer_stall_timeout),
                profile.max_model_len,
                "sim".to_string(),
                None,
            )
        }
    };
    metrics::gauge!("kvgate_worker_device_info", "device" => device.clone()).set(1.0);
    let model_id = cfg.model_id.clone().unwrap_or_else(|| match &cfg.model {
        ModelSource::Synth { preset, .. } => format!("kvgate-{}", format!("{preset:?}").to_lowercase()),
        ModelSource::Dir(d) => d.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned()),
    });
    metrics::gauge!("kvgate_worker_role", "role" => cfg.role.as_str()).set(1.0);
    let transfer = match (cfg.report_secret.as_deref(), kv) {
        (Some(secret), Some(parts)) => Some(Arc::new(crate::transfer::Transfers {
            key: kvgate_shared::handoff::transfer_key(secret),
            grant_key: kvgate_shared::handoff::grant_key(secret),
            model: model_id.clone(),
            worker_id: worker_id.to_owned(),
            fingerprint: parts.fingerprint,
            block_bytes: parts.block_bytes,
            layers: parts.layers,
            block_size: bs,
            lease: cfg.kv_transfer_lease,
            stall: cfg.kv_transfer_stall_timeout,
            layer_group: cfg.kv_transfer_layer_group,
            frame_bytes: cfg.kv_transfer_frame_bytes,
            export_backlog: cfg.kv_export_backlog_bytes,
            max_prompt_tokens: max_model_len,
            engine: handle.clone(),
            transport: Default::default(),
            imports: Default::default(),
        })),
        _ => None,
    };
    let pd_info = kvgate_shared::report::PdInfo {
        role: cfg.role,
        transfer_addr: String::new(),
        kv_bytes_per_token: kv.map_or(0, |p| (p.block_bytes / bs) as u32),
        export_groups: kv.map_or(0, |p| p.export_groups(cfg.kv_transfer_layer_group)),
        ..Default::default()
    };
    Ok(ServingModel {
        engine: handle,
        prompter,
        model_id,
        worker_id: worker_id.to_owned(),
        max_model_len,
        scheme,
        device,
        pd_info,
        transfer,
    })
}

/// What KV transfers of this engine are valid for (the SSD tier's fingerprint: scheme, weights, layout, block
/// bytes), a block's bytes and its layers; `None` for a backend that cannot copy blocks.
/// What KV transfers need of the engine: the KV fingerprint, bytes a block, layers, and whether its forward
/// pass lets exports read layers as they are written. `None`: it copies no KV blocks (the simulated engine).
fn transfer_parts<B: crate::engine::Backend>(engine: &Engine<B>, weights: u64) -> Option<TransferParts> {
    let b = engine.backend();
    let block_bytes = b.kv_block_bytes(engine.scheme().block_size as usize)?;
    Some(TransferParts {
        fingerprint: engine.tier_fingerprint(weights, block_bytes),
        block_bytes,
        layers: b.kv_layers(),
        taps_layers: b.taps_layers() && b.kv_layers() >= 2,
    })
}

#[derive(Clone, Copy)]
struct TransferParts {
    fingerprint: u64,
    block_bytes: usize,
    layers: usize,
    taps_layers: bool,
}

impl TransferParts {
    /// Layer groups an export sends while the prefill computes (1: whole blocks after it).
    fn export_groups(&self, layer_group: u16) -> u16 {
        match (self.taps_layers, layer_group) {
            (true, g) if g > 0 => self.layers.div_ceil(g as usize).min(u16::MAX as usize) as u16,
            _ => 1,
        }
    }
}

/// Binds the KV transfer listener (`--kv-transfer-port`) and serves it; returns the address decode workers reach
/// it at.
async fn start_transfer_listener(
    cfg: &ServeConfig,
    l: &ServingModel,
    advertise: &str,
) -> Result<Option<String>, String> {
    let (Some(port), Some(t)) = (cfg.kv_transfer_port, l.transfer.clone()) else {
        if cfg.kv_transfer_port.is_some() {
            return Err("--kv-transfer-port: this engine cannot copy KV blocks (the simulated engine)".into());
        }
        return Ok(None);
    };
    let addr = format!("{}:{port}", cfg.host);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen for KV transfers on {addr}: {e}"))?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let host = advertise
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|hp| hp.rsplit_once(':').map(|(h, _)| h.to_owned()).or(Some(hp.to_owned())))
        .unwrap_or_else(|| "127.0.0.1".into());
    let reach = cfg.kv_transfer_advertise.clone().unwrap_or(format!("{host}:{port}"));
    tokio::spawn(crate::transfer::export::serve(listener, t, reach.clone()));
    println!("kvgate-worker {} kv transfer listening on {reach}", l.worker_id);
    tracing::info!(%reach, "KV transfer listener");
    Ok(Some(reach))
}

/// An engine with the lower KV tiers the flags ask for (`model`: what the SSD tier's records are valid for besides
/// the scheme and KV layout).
fn with_tiers<B: crate::engine::Backend>(
    engine: Engine<B>,
    cfg: &ServeConfig,
    disk_dir: &std::path::Path,
    model: u64,
) -> Result<Engine<B>, String> {
    engine.with_host_tier(cfg.host_kv_bytes, cfg.kv_write_policy)?.with_disk_tier(
        disk_dir,
        cfg.disk_kv_bytes,
        cfg.kv_write_policy,
        model,
    )
}

/// The HTTP routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let worker = HeaderValue::from_str(&state.worker_id).unwrap_or(HeaderValue::from_static("worker"));
    // The API and the tokenizer: only to gateways when --require-gateway-token (probes and metrics stay open).
    let gated = Router::new()
        .route("/v1/completions", post(api::completions))
        .route("/v1/chat/completions", post(api::chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .route("/kvgate/v1/tokenizer", get(tokenizer))
        .route("/kvgate/v1/kv-probe", post(pd::probe))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), gateway_only));
    Router::new()
        .merge(gated)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .fallback(|uri: axum::http::Uri| async move { ApiError::not_found_route(uri.path()) })
        .layer(axum::middleware::map_response(move |mut r: Response| {
            let worker = worker.clone();
            async move {
                r.headers_mut().insert("x-kvgate-worker", worker);
                r
            }
        }))
        .with_state(state)
}

/// With `--require-gateway-token`, refuses (401 `gateway_token_required`) a request without the gateway token
/// (`kvgate_shared::handoff::gateway_token` of the report secret).
async fn gateway_only(
    State(state): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let (true, Some(secret)) = (state.cfg.require_gateway_token, state.cfg.report_secret.as_deref()) {
        let auth = req.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if !kvgate_shared::handoff::check_gateway_token(secret, auth) {
            metrics::counter!("kvgate_worker_unauthorized_requests_total").increment(1);
            return ApiError::unauthorized(
                "gateway_token_required",
                "this worker answers only kvgate gateways (--require-gateway-token): send requests through a gateway",
            )
            .into_response();
        }
    }
    next.run(req).await
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let Some(l) = state.loaded() else {
        return ApiError::refused(Refusal::ModelLoading, "the model is still loading").into_response();
    };
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: l.model_id.clone(),
            object: "model".into(),
            created: state.created,
            owned_by: "kvgate".into(),
            max_model_len: Some(l.max_model_len as u32),
            device: Some(l.device.clone()),
            role: Some(l.pd_info.role.as_str().to_owned()),
        }],
    })
    .into_response()
}

fn engine_dead_response() -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": "engine_dead"}))).into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.engine_dead() {
        return engine_dead_response();
    }
    Json(serde_json::json!({"status": "ok"})).into_response()
}

async fn ready(State(state): State<Arc<AppState>>) -> Response {
    if state.engine_dead() {
        return engine_dead_response();
    }
    match (state.loaded(), state.draining()) {
        (Some(_), false) => Json(serde_json::json!({"status": "ready"})).into_response(),
        (_, true) => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": "draining"}))).into_response()
        }
        (None, _) => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": "loading"}))).into_response()
        }
    }
}

/// Measures what load-vs-recompute needs at start (`kv::costs`): the host tier's copy speed (a 64 MiB copy) and
/// the SSD tier's write speed (32 MiB written and synced in its directory; reads are at least as fast on NVMe), and
/// sets the policy. The engine's prefill speed is measured as it runs (`Engine::observe_prefill`).
fn with_load_costs<B: crate::engine::Backend>(mut engine: Engine<B>, cfg: &config::ServeConfig) -> Engine<B> {
    let kv = engine.scheduler().kv().clone();
    let mut costs = crate::kv::LoadCosts { policy: cfg.kv_load_policy, ..Default::default() };
    if kv.host().is_some() {
        // Both buffers touched first (no page faults in the timing); the best of three copies.
        let src = vec![7u8; 64 << 20];
        let mut dst = vec![1u8; 64 << 20];
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = std::time::Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
            best = best.min(t.elapsed().as_secs_f64());
        }
        costs.host_s_per_byte = best / src.len() as f64;
    }
    if let (Some(_), Some(dir)) = (kv.disk(), &cfg.disk_kv_path) {
        let path = dir.join(".probe");
        let t = std::time::Instant::now();
        let wrote = std::fs::File::create(&path).and_then(|mut f| {
            use std::io::Write;
            f.write_all(&vec![7u8; 32 << 20])?;
            f.sync_all()
        });
        let _ = std::fs::remove_file(&path);
        if wrote.is_ok() {
            costs.disk_s_per_byte = t.elapsed().as_secs_f64() / (32 << 20) as f64;
        }
    }
    if kv.host().is_some() || kv.disk().is_some() {
        tracing::info!(
            host_gb_per_s = 1e-9 / costs.host_s_per_byte.max(1e-15),
            disk_gb_per_s = 1e-9 / costs.disk_s_per_byte.max(1e-15),
            policy = ?costs.policy,
            "KV tiers: measured load speeds"
        );
    }
    engine.set_load_costs(costs);
    engine
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    let t = state.tracer.counters();
    for (outcome, n) in [("exported", &t.exported), ("dropped", &t.dropped), ("failed", &t.failed)] {
        metrics::counter!("kvgate_worker_trace_spans_total", "outcome" => outcome)
            .absolute(n.load(Ordering::Relaxed));
    }
    if let Some(l) = state.loaded() {
        let p = l.engine.snapshot();
        let s = p.stats;
        metrics::gauge!("kvgate_worker_kv_blocks", "state" => "total").set(s.blocks_total as f64);
        metrics::gauge!("kvgate_worker_kv_blocks", "state" => "free").set(s.blocks_free as f64);
        metrics::gauge!("kvgate_worker_kv_blocks", "state" => "used")
            .set((s.blocks_total - s.blocks_free) as f64);
        metrics::gauge!("kvgate_worker_kv_blocks", "state" => "cached").set(s.blocks_cached as f64);
        metrics::gauge!("kvgate_worker_kv_evictions").set(s.evictions as f64);
        metrics::gauge!("kvgate_worker_preemptions").set(s.preemptions as f64);
        metrics::gauge!("kvgate_worker_queue_requests", "state" => "waiting").set(s.waiting_requests as f64);
        metrics::gauge!("kvgate_worker_queue_requests", "state" => "running").set(s.running_requests as f64);
        metrics::gauge!("kvgate_worker_prefill_tokens").set(s.prefill_tokens as f64);
        metrics::gauge!("kvgate_worker_prefix_cache_hit_blocks").set(s.hit_blocks as f64);
        metrics::gauge!("kvgate_worker_prefix_cache_queried_blocks").set(s.queried_blocks as f64);
        if s.host_blocks_total > 0 {
            let h = s.host;
            metrics::gauge!("kvgate_worker_host_kv_blocks", "state" => "total")
                .set(s.host_blocks_total as f64);
            metrics::gauge!("kvgate_worker_host_kv_blocks", "state" => "cached")
                .set(s.host_blocks_cached as f64);
            metrics::gauge!("kvgate_worker_host_kv_stored_blocks").set(h.stored_blocks as f64);
            metrics::gauge!("kvgate_worker_host_kv_stored_bytes").set(h.stored_bytes as f64);
            metrics::gauge!("kvgate_worker_host_kv_hit_blocks").set(h.hit_blocks as f64);
            metrics::gauge!("kvgate_worker_host_kv_evicted_blocks").set(h.evicted_blocks as f64);
            metrics::gauge!("kvgate_worker_host_kv_orphan_blocks").set(h.orphans as f64);
        }
        let d = l.engine.kv().decisions();
        let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed) as f64;
        metrics::gauge!("kvgate_worker_kv_tier_decisions", "choice" => "load").set(get(&d.loads));
        metrics::gauge!("kvgate_worker_kv_tier_decisions", "choice" => "recompute").set(get(&d.recomputes));
        metrics::gauge!("kvgate_worker_kv_tier_decision_tokens", "choice" => "load")
            .set(get(&d.loaded_tokens));
        metrics::gauge!("kvgate_worker_kv_tier_decision_tokens", "choice" => "recompute")
            .set(get(&d.recomputed_tokens));
        if let Some(disk) = l.engine.kv().disk() {
            // Live: the SSD tier's IO thread moves these between engine steps.
            let d = disk.counters();
            let cached = disk.index().len();
            metrics::gauge!("kvgate_worker_disk_kv_blocks", "state" => "total")
                .set(s.disk_blocks_total as f64);
            metrics::gauge!("kvgate_worker_disk_kv_blocks", "state" => "cached").set(cached as f64);
            metrics::gauge!("kvgate_worker_disk_kv_written_blocks").set(d.written_blocks as f64);
            metrics::gauge!("kvgate_worker_disk_kv_written_bytes").set(d.written_bytes as f64);
            metrics::gauge!("kvgate_worker_disk_kv_read_blocks").set(d.read_blocks as f64);
            metrics::gauge!("kvgate_worker_disk_kv_dropped_writes").set(d.dropped_writes as f64);
            metrics::gauge!("kvgate_worker_disk_kv_corrupt_blocks").set(d.corrupt_blocks as f64);
            metrics::gauge!("kvgate_worker_disk_kv_recovered_blocks").set(d.recovered_blocks as f64);
            metrics::gauge!("kvgate_worker_disk_kv_prefetched_blocks").set(d.prefetched_blocks as f64);
            metrics::gauge!("kvgate_worker_disk_kv_prefetch_hits").set(d.prefetch_hits as f64);
            // Reads the IO queue could not take (asked again at the next claim).
            metrics::gauge!("kvgate_worker_disk_kv_dropped_reads").set(d.dropped_reads as f64);
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.prometheus.render()).into_response()
}

async fn tokenizer(State(state): State<Arc<AppState>>) -> Response {
    let Some(l) = state.loaded() else {
        return ApiError::refused(Refusal::ModelLoading, "the model is still loading").into_response();
    };
    let files = l.prompter.files();
    Json(serde_json::json!({
        "model": l.model_id,
        "worker_id": l.worker_id,
        "tokenizer_json": files.tokenizer_json,
        "chat_template": files.chat_template,
        "bos_token": files.bos_token,
        "eos_token": files.eos_token,
        "scheme": l.scheme,
        "fingerprint": l.scheme.fingerprint(),
        "max_model_len": l.max_model_len,
        "summary_granularity": state.cfg.summary_granularity,
    }))
    .into_response()
}

/// Runs the server until SIGTERM/SIGINT and the end of the drain.
pub async fn serve(cfg: ServeConfig) -> Result<(), String> {
    let prometheus = install_metrics()?;
    kvgate_shared::errors::set_error_metric("kvgate_worker_errors_total");
    let addr: SocketAddr = format!("{}:{}", cfg.host, cfg.port)
        .parse()
        .map_err(|e| format!("listen address {}:{}: {e}", cfg.host, cfg.port))?;
    let listener =
        tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let worker_id = cfg.worker_id.clone().unwrap_or_else(|| format!("worker-{port}"));
    let advertise = cfg.advertise_url.clone().unwrap_or_else(|| format!("http://127.0.0.1:{port}"));
    // One line tests and scripts can wait for.
    println!("kvgate-worker {worker_id} listening on http://{}:{port}", cfg.host);
    tracing::info!(%worker_id, port, "listening; loading the model");
    let state = Arc::new(AppState {
        cfg: cfg.clone(),
        worker_id: worker_id.clone(),
        loaded: OnceLock::new(),
        draining: Arc::new(AtomicBool::new(false)),
        report_now: Arc::new(tokio::sync::Notify::new()),
        draining_reported: Arc::new(tokio::sync::Notify::new()),
        prometheus,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        tracer: kvgate_shared::trace::Tracer::from_flags(
            cfg.otlp_endpoint.as_deref(),
            "kvgate-worker",
            &worker_id,
            cfg.trace_sample_ratio,
        )
        .map_err(|e| e.to_string())?,
    });

    let loader_state = state.clone();
    tokio::spawn(async move {
        let cfg = loader_state.cfg.clone();
        let wid = loader_state.worker_id.clone();
        let started = std::time::Instant::now();
        match tokio::task::spawn_blocking(move || load(&cfg, &wid)).await {
            Ok(Ok(mut l)) => {
                match start_transfer_listener(&loader_state.cfg, &l, &advertise).await {
                    Ok(reach) => l.pd_info.transfer_addr = reach.unwrap_or_default(),
                    Err(e) => {
                        eprintln!("kvgate-worker: {e}");
                        std::process::exit(1);
                    }
                }
                let l = Arc::new(l);
                tracing::info!(model = %l.model_id, secs = started.elapsed().as_secs_f64(), "model loaded");
                let _ = loader_state.loaded.set(l.clone());
                let watched = l.clone();
                tokio::spawn(async move {
                    watched.engine.died().await;
                    tracing::error!("the engine thread died: failing probes and exiting");
                    eprintln!(
                        "kvgate-worker: the engine thread died; exiting with status {EXIT_ENGINE_DEAD}"
                    );
                    // Long enough for requests in flight to get their error and a probe to see 503.
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    std::process::exit(EXIT_ENGINE_DEAD);
                });
                // Only once requests are served: scripts and tests wait for this line.
                println!("kvgate-worker {} ready (model {})", l.worker_id, l.model_id);
                if !loader_state.cfg.report_to.is_empty() {
                    let c = &loader_state.cfg;
                    let source = reporter::ReportSource {
                        worker_id: l.worker_id.clone(),
                        advertise_url: advertise.clone(),
                        model_id: l.model_id.clone(),
                        scheme: l.scheme,
                        granularity: c.summary_granularity,
                        fp_rate: c.bloom_fp_rate,
                        instance_id: instance_id(),
                        max_model_len: l.max_model_len.min(u32::MAX as usize) as u32,
                        pd: l.pd_info.clone(),
                    };
                    let plan = reporter::ReportPlan {
                        targets: c.report_to.clone(),
                        interval: c.report_interval,
                        timeout: c.report_timeout,
                        secret: c.report_secret.clone(),
                        draining: loader_state.draining.clone(),
                        report_now: loader_state.report_now.clone(),
                        draining_reported: loader_state.draining_reported.clone(),
                        transfers: l.transfer.clone(),
                    };
                    tokio::spawn(reporter::run(source, l.engine.clone(), plan));
                }
            }
            Ok(Err(e)) => {
                eprintln!("kvgate-worker: cannot load the model: {e}");
                std::process::exit(1);
            }
            Err(e) => {
                eprintln!("kvgate-worker: model loader failed: {e}");
                std::process::exit(1);
            }
        }
    });

    let shutdown_state = state.clone();
    let shutdown = async move {
        wait_for_signal().await;
        tracing::info!(grace_s = shutdown_state.cfg.shutdown_grace.as_secs_f64(), "shutting down: draining");
        shutdown_state.draining.store(true, Ordering::Release);
        // Tell the gateways now rather than at the next interval, and before the listener closes (an idle worker
        // exits as soon as it does): new requests meanwhile get `shutting_down`.
        if shutdown_state.loaded().is_some() && !shutdown_state.cfg.report_to.is_empty() {
            let reported = shutdown_state.draining_reported.notified();
            shutdown_state.report_now.notify_one();
            let wait = shutdown_state.cfg.report_timeout + Duration::from_millis(200);
            if tokio::time::timeout(wait, reported).await.is_err() {
                tracing::warn!("the draining report did not go out in time");
            }
        }
        let s = shutdown_state.clone();
        tokio::spawn(async move {
            tokio::time::sleep(s.cfg.shutdown_grace).await;
            if let Some(l) = s.loaded() {
                tracing::warn!("shutdown grace over: aborting running requests");
                l.engine.abort_all();
            }
        });
    };
    // Streamed tokens are small writes: without TCP_NODELAY, Nagle + delayed ACKs hold them for ~40 ms.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await.map_err(|e| e.to_string())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
