//! The control listener: `POST /kvgate/v1/report` (worker reports), `GET /metrics` (Prometheus), `GET
//! /kvgate/v1/workers` (worker states), `/health`, `/ready` and the admin API. It runs on its own thread and tokio
//! runtime, apart from pingora's, so a flood of public traffic cannot starve report ingest.
//!
//! Hostile-input rules here:
//! - credentials are checked from the headers **before** any body byte is read (the report secret for reports,
//!   the admin token for `/admin`); a declared `content-length` over the route's limit is refused before reading;
//! - each route has its own body limit: reports [`MAX_REPORT_BYTES`], admin writes [`ADMIN_BODY_LIMIT`], route
//!   explain the public `--max-body-bytes`;
//! - decoding and ingesting a report (and the advertise-URL check, which may resolve a name) runs on its own thread
//!   with a bounded queue ([`INGEST_QUEUE`]; full: 503), so admin calls cannot delay reports and reports cannot pile
//!   up memory.

//!
//! The rest of the room: `admin` (the admin REST API), `auth` (bearer tokens, constant-time comparison, control-port
//! errors), `keys` (API keys -> tenant, classes a caller may choose, forced cache salt), `trust` (which
//! `advertise_url`s a report may register), `persist` (the admin state file).

pub mod admin;
pub mod auth;
pub mod keys;
pub mod persist;
pub mod trust;

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use kvgate_shared::report::{WorkerReport, MAX_REPORT_BYTES};
use tokio::sync::oneshot;

use crate::control::auth::{bearer, error_response as err, secrets_equal};
use crate::control::trust::AdvertiseCheck;
use crate::registry::Ingest;
use crate::state::GatewayState;

/// Largest body of an admin write (weights, budgets).
pub const ADMIN_BODY_LIMIT: usize = 1 << 20;
/// Reports waiting for the ingest thread.
pub const INGEST_QUEUE: usize = 64;

/// 413 if the request declares a body over `limit`.
fn declared_too_large(headers: &HeaderMap, limit: usize) -> Option<Response> {
    let len = headers.get("content-length")?.to_str().ok()?.parse::<u64>().ok()?;
    (len > limit as u64).then(|| {
        err(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("body over the limit of {limit} bytes"),
        )
    })
}

/// Report auth, before the body: the secret (unless `--insecure-reports`), and the declared size.
async fn report_gate(State(state): State<Arc<GatewayState>>, req: Request, next: Next) -> Response {
    if let Some(secret) = &state.cfg.report_secret {
        if !bearer(req.headers()).is_some_and(|g| secrets_equal(g.as_bytes(), secret.as_bytes())) {
            metrics::counter!("kvgate_gateway_reports_total", "result" => "unauthorized").increment(1);
            return err(StatusCode::UNAUTHORIZED, "unauthorized", "missing or wrong report secret".into());
        }
    }
    if let Some(r) = declared_too_large(req.headers(), MAX_REPORT_BYTES) {
        return r;
    }
    next.run(req).await
}

/// Admin auth, before the body.
async fn admin_gate(State(state): State<Arc<GatewayState>>, req: Request, next: Next) -> Response {
    if let Err(r) = crate::control::admin::authorize(&state, req.headers()) {
        return r;
    }
    let limit = if req.uri().path() == "/admin/v1/route/explain" {
        state.cfg.max_body_bytes
    } else {
        ADMIN_BODY_LIMIT
    };
    if let Some(r) = declared_too_large(req.headers(), limit) {
        return r;
    }
    next.run(req).await
}

/// What the ingest thread answers (the error response boxed: axum's `Response` is large).
type IngestReply = Result<Option<String>, Box<Response>>;

struct IngestJob {
    body: Bytes,
    peer: IpAddr,
    reply: oneshot::Sender<IngestReply>,
}

/// The report-ingest thread's queue.
#[derive(Clone)]
pub struct IngestQueue(SyncSender<IngestJob>);

impl IngestQueue {
    /// Starts the ingest thread.
    pub fn spawn(state: Arc<GatewayState>) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<IngestJob>(INGEST_QUEUE);
        std::thread::Builder::new().name("kvgate-ingest".into()).spawn(move || {
            let mut check = AdvertiseCheck::new(&state.cfg.advertise_allow);
            while let Ok(job) = rx.recv() {
                let out = ingest(&state, &mut check, &job.body, job.peer);
                let _ = job.reply.send(out);
            }
        })?;
        Ok(Self(tx))
    }
}

/// Decodes, checks and ingests one report; `Ok(Some(url))` when the model's tokenizer is still to be fetched.
fn ingest(state: &GatewayState, check: &mut AdvertiseCheck, body: &[u8], peer: IpAddr) -> IngestReply {
    let count = |result: &'static str| {
        metrics::counter!("kvgate_gateway_reports_total", "result" => result).increment(1)
    };
    let report = WorkerReport::decode(body).map_err(|e| {
        count("invalid");
        Box::new(err(StatusCode::BAD_REQUEST, "invalid_report", e.to_string()))
    })?;
    let now = Instant::now();
    check.check(&report.advertise_url, peer, now).map_err(|e| {
        count("advertise_refused");
        tracing::warn!(worker = %report.worker_id, %peer, "report refused: {e}");
        Box::new(err(StatusCode::FORBIDDEN, "advertise_url_not_allowed", e))
    })?;
    // The KV transfer address is where decode workers are told to connect (in the gateway's signed grant): the
    // same rule as the advertise URL, so a report cannot point them at another host.
    if !report.pd.transfer_addr.is_empty() {
        let as_url = format!("http://{}/", report.pd.transfer_addr);
        check.check(&as_url, peer, now).map_err(|e| {
            count("transfer_addr_refused");
            tracing::warn!(worker = %report.worker_id, %peer, "report refused: transfer address: {e}");
            Box::new(err(StatusCode::FORBIDDEN, "transfer_addr_not_allowed", e))
        })?;
    }
    let expected = state.tokenizer(&report.model_id).map(|t| t.scheme.fingerprint());
    if expected.is_some_and(|f| f != report.fingerprint) && state.cfg.is_configured(&report.model_id) {
        // Its hashes would never match this gateway's: not registered (a [[models]] entry is the truth here).
        count("model_mismatch");
        tracing::warn!(worker = %report.worker_id, model = %report.model_id, "report refused: hash scheme differs from the [[models]] entry");
        return Err(Box::new(err(
            StatusCode::CONFLICT,
            "model_scheme_mismatch",
            format!(
                "model {:?} is configured at this gateway with another tokenizer or block size (fingerprint {:016x}, \
                 the report's {:016x})",
                report.model_id,
                expected.unwrap_or(0),
                report.fingerprint
            ),
        )));
    }
    let url = report.advertise_url.clone();
    let id = report.worker_id.clone();
    match state.registry().ingest(report, expected, now) {
        Ingest::Accepted => count("ok"),
        Ingest::OutOfOrder => count("out_of_order"),
        Ingest::IdConflict { holder_url } => {
            count("id_conflict");
            tracing::warn!(worker = %id, %url, %holder_url, "report refused: the id is held by a live worker");
            return Err(Box::new(err(
                StatusCode::CONFLICT,
                "worker_id_conflict",
                format!("worker id {id:?} is held by the live worker at {holder_url}"),
            )));
        }
        Ingest::Full => {
            count("registry_full");
            let msg = "the gateway holds --max-workers".into();
            return Err(Box::new(err(StatusCode::SERVICE_UNAVAILABLE, "registry_full", msg)));
        }
    }
    Ok(expected.is_none().then_some(url))
}

async fn report(
    State(state): State<Arc<GatewayState>>,
    Extension(queue): Extension<IngestQueue>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    body: Bytes,
) -> Response {
    let (reply, answer) = oneshot::channel();
    match queue.0.try_send(IngestJob { body, peer: peer.ip(), reply }) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            metrics::counter!("kvgate_gateway_reports_total", "result" => "busy").increment(1);
            return err(
                StatusCode::SERVICE_UNAVAILABLE,
                "ingest_busy",
                "report queue full; next interval".into(),
            );
        }
        Err(TrySendError::Disconnected(_)) => {
            return err(StatusCode::INTERNAL_SERVER_ERROR, "ingest_stopped", "report ingest stopped".into())
        }
    }
    match answer.await {
        Ok(Ok(fetch)) => {
            if let Some(url) = fetch {
                // First sight of this model: learn its tokenizer from the worker.
                state.fetch_tokenizer_in_background(url);
            }
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(Err(r)) => *r,
        Err(_) => err(StatusCode::INTERNAL_SERVER_ERROR, "ingest_stopped", "report ingest stopped".into()),
    }
}

async fn metrics_text(State(state): State<Arc<GatewayState>>) -> Response {
    let t = state.tracer.counters();
    for (outcome, n) in [("exported", &t.exported), ("dropped", &t.dropped), ("failed", &t.failed)] {
        metrics::counter!("kvgate_gateway_trace_spans_total", "outcome" => outcome)
            .absolute(n.load(std::sync::atomic::Ordering::Relaxed));
    }
    let mut text = state.prometheus.render();
    text.push_str(&state.registry().render_metrics(Instant::now()));
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

async fn workers(State(state): State<Arc<GatewayState>>) -> Response {
    Json(state.registry().status(Instant::now())).into_response()
}

/// Readiness: 200 once at least one worker is healthy (in the ring) and its model's tokenizer is loaded here,
/// else 503, so an orchestrator sends no traffic to a gateway that could only answer "no worker" or "unknown
/// model".
async fn ready(State(state): State<Arc<GatewayState>>) -> Response {
    let (healthy, serving) = state.readiness();
    let status = match (healthy, serving) {
        (0, _) => "no healthy worker",
        (_, 0) => "no tokenizer loaded yet",
        _ => "ready",
    };
    let body =
        Json(serde_json::json!({"status": status, "healthy_workers": healthy, "serving_workers": serving}));
    if serving > 0 {
        body.into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

/// The control routes.
pub fn router(state: Arc<GatewayState>, queue: IngestQueue) -> Router {
    let reports = Router::new()
        .route("/kvgate/v1/report", post(report))
        .layer(DefaultBodyLimit::max(MAX_REPORT_BYTES))
        .route_layer(middleware::from_fn_with_state(state.clone(), report_gate))
        .layer(Extension(queue));
    let explain_limit = state.cfg.max_body_bytes;
    let admin = crate::control::admin::router(explain_limit)
        .layer(DefaultBodyLimit::max(ADMIN_BODY_LIMIT))
        .route_layer(middleware::from_fn_with_state(state.clone(), admin_gate));
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/kvgate/v1/workers", get(workers))
        .route("/health", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
        .route("/ready", get(ready))
        .merge(reports)
        .merge(admin)
        .with_state(state)
}

/// Background upkeep on the control runtime: every `--probe-interval`, probe workers with an open fault
/// (`GET /health`, 1 s timeout) so a worker that answers again comes back, have decode workers probe the P->D
/// links no transfer has measured yet (`link_probe`), and forget workers silent for `--forget-after`.
pub async fn upkeep(state: Arc<GatewayState>) {
    let mut links = crate::pods::link_probe::LinkProbes::default();
    let mut tick = tokio::time::interval(state.cfg.probe_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let targets = state.registry().probe_targets();
        for (wref, url) in targets {
            let s = state.clone();
            tokio::spawn(async move {
                let Ok(req) = hyper::Request::get(format!("{}/health", crate::pods::dp_rank::base(&url)))
                    .body(http_body_util::Full::new(bytes::Bytes::new()))
                else {
                    return;
                };
                let probe =
                    tokio::time::timeout(std::time::Duration::from_secs(1), s.client.request(req)).await;
                if matches!(probe, Ok(Ok(ref r)) if probe_answered(r.status())) {
                    tracing::info!(%url, "worker answers its probe again");
                    s.registry().record_probe_ok(wref, Instant::now());
                }
            });
        }
        crate::pods::link_probe::start(&state, &mut links);
        state.registry().sweep(Instant::now());
    }
}

/// Whether a probe's answer brings a worker back: a success, or a client error from a server that has no
/// `/health` route (llama-cpp-python's server answers 404 there) but is up. A 5xx (a kvgate worker's 503 while it
/// loads or drains) is not.
fn probe_answered(status: hyper::StatusCode) -> bool {
    status.is_success() || status.is_client_error()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_without_a_health_route_answers_its_probe() {
        assert!(probe_answered(hyper::StatusCode::OK));
        assert!(probe_answered(hyper::StatusCode::NOT_FOUND));
        assert!(!probe_answered(hyper::StatusCode::SERVICE_UNAVAILABLE));
        assert!(!probe_answered(hyper::StatusCode::BAD_GATEWAY));
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(secrets_equal(b"abc", b"abc"));
        assert!(!secrets_equal(b"abc", b"abd") && !secrets_equal(b"abc", b"ab"));
    }
}
