//! Boot: the process's way from a resolved configuration to a serving worker ([`serve`]). In order: install the
//! metrics recorder, bind the HTTP listener and print "listening on" (so `/health` answers while the model loads),
//! assemble the model on a blocking thread (`assemble::load`), then bind the KV transfer listener, publish the
//! model to the handlers, watch the engine thread, print "ready", and start the reporter; meanwhile serve HTTP until
//! SIGTERM/SIGINT and the end of the drain.
//!
//! Invariants: the two lines scripts and tests wait for are printed on stdout exactly as
//! "kvgate-worker <id> listening on http://<host>:<port>" (before the model loads) and
//! "kvgate-worker <id> ready (model <model>)" (only once requests are served); a model that cannot be loaded, or
//! a transfer listener that cannot be bound, ends the process with status 1 and one line on stderr; a dead engine
//! thread ends it with [`EXIT_ENGINE_DEAD`] half a second later.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::assemble;
use super::config::ServeConfig;
use super::reporter;
use super::routes::router;
use super::state::{AppState, ServingModel, EXIT_ENGINE_DEAD};
use super::telemetry::install_metrics;

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
    tokio::spawn(load_in_background(state.clone(), advertise));
    let shutdown = drain_on_signal(state.clone());
    // Streamed tokens are small writes: without TCP_NODELAY, Nagle + delayed ACKs hold them for ~40 ms.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await.map_err(|e| e.to_string())
}

/// Assembles the model on a blocking thread and starts serving it; exits the process (status 1) if it cannot.
async fn load_in_background(state: Arc<AppState>, advertise: String) {
    let cfg = state.cfg.clone();
    let wid = state.worker_id.clone();
    let started = Instant::now();
    match tokio::task::spawn_blocking(move || assemble::load(&cfg, &wid)).await {
        Ok(Ok(l)) => start_serving(&state, l, &advertise, started).await,
        Ok(Err(e)) => {
            eprintln!("kvgate-worker: cannot load the model: {e}");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("kvgate-worker: model loader failed: {e}");
            std::process::exit(1);
        }
    }
}

/// A loaded model goes live: its KV transfer listener, the handlers, the engine watchdog, the "ready" line, the
/// reporter (in that order).
async fn start_serving(state: &AppState, mut l: ServingModel, advertise: &str, started: Instant) {
    match start_transfer_listener(&state.cfg, &l, advertise).await {
        Ok(reach) => l.pd_info.transfer_addr = reach.unwrap_or_default(),
        Err(e) => {
            eprintln!("kvgate-worker: {e}");
            std::process::exit(1);
        }
    }
    let l = Arc::new(l);
    tracing::info!(model = %l.model_id, secs = started.elapsed().as_secs_f64(), "model loaded");
    let _ = state.loaded.set(l.clone());
    tokio::spawn(exit_when_the_engine_dies(l.clone()));
    // Only once requests are served: scripts and tests wait for this line.
    println!("kvgate-worker {} ready (model {})", l.worker_id, l.model_id);
    if !state.cfg.report_to.is_empty() {
        start_reporter(state, &l, advertise);
    }
}

/// Fails the process once the engine thread has died ([`EXIT_ENGINE_DEAD`]).
async fn exit_when_the_engine_dies(l: Arc<ServingModel>) {
    l.engine.died().await;
    tracing::error!("the engine thread died: failing probes and exiting");
    eprintln!("kvgate-worker: the engine thread died; exiting with status {EXIT_ENGINE_DEAD}");
    // Long enough for requests in flight to get their error and a probe to see 503.
    tokio::time::sleep(Duration::from_millis(500)).await;
    std::process::exit(EXIT_ENGINE_DEAD);
}

/// Pushes cache summaries of `l` to every `--report-to` gateway.
fn start_reporter(state: &AppState, l: &ServingModel, advertise: &str) {
    let c = &state.cfg;
    let source = reporter::ReportSource {
        worker_id: l.worker_id.clone(),
        advertise_url: advertise.to_owned(),
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
        draining: state.draining.clone(),
        report_now: state.report_now.clone(),
        draining_reported: state.draining_reported.clone(),
        transfers: l.transfer.clone(),
        adapters: l.adapters.clone(),
    };
    tokio::spawn(reporter::run(source, l.engine.clone(), plan));
}

/// Resolves on SIGTERM/SIGINT once the drain has started: `/ready` turns 503 and new requests are refused
/// (`draining`), the gateways hear `draining` at once (before the listener closes: an idle worker exits as soon as
/// it does), and running requests are aborted after `--shutdown-grace`.
async fn drain_on_signal(state: Arc<AppState>) {
    wait_for_signal().await;
    tracing::info!(grace_s = state.cfg.shutdown_grace.as_secs_f64(), "shutting down: draining");
    state.draining.store(true, Ordering::Release);
    // Tell the gateways now rather than at the next interval, and before the listener closes (an idle worker
    // exits as soon as it does): new requests meanwhile get `shutting_down`.
    if state.loaded().is_some() && !state.cfg.report_to.is_empty() {
        let reported = state.draining_reported.notified();
        state.report_now.notify_one();
        let wait = state.cfg.report_timeout + Duration::from_millis(200);
        if tokio::time::timeout(wait, reported).await.is_err() {
            tracing::warn!("the draining report did not go out in time");
        }
    }
    let s = state.clone();
    tokio::spawn(async move {
        tokio::time::sleep(s.cfg.shutdown_grace).await;
        if let Some(l) = s.loaded() {
            tracing::warn!("shutdown grace over: aborting running requests");
            l.engine.abort_all();
        }
    });
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
