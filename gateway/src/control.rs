//! The control listener: `POST /kvgate/v1/report` (worker reports, shared-secret authenticated), `GET /metrics`
//! (Prometheus) and `GET /kvgate/v1/workers` (worker states). Runs on its own thread and tokio runtime, apart from
//! pingora's, so a flood of public traffic cannot starve report ingest.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvgate_shared::report::{WorkerReport, MAX_REPORT_BYTES};

use crate::state::GatewayState;

fn err(status: StatusCode, code: &str, msg: String) -> Response {
    let body = kvgate_shared::openai::ErrorBody::new("invalid_request_error", code, msg, None);
    (status, [("content-type", "application/json")], body.to_json()).into_response()
}

/// Constant-time comparison of secrets.
pub fn secrets_equal(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn report(State(state): State<Arc<GatewayState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(secret) = &state.cfg.report_secret {
        let given = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| secrets_equal(g.as_bytes(), secret.as_bytes())) {
            metrics::counter!("kvgate_gateway_reports_total", "result" => "unauthorized").increment(1);
            return err(StatusCode::UNAUTHORIZED, "unauthorized", "missing or wrong report secret".into());
        }
    }
    let report = match WorkerReport::decode(&body) {
        Ok(r) => r,
        Err(e) => {
            metrics::counter!("kvgate_gateway_reports_total", "result" => "invalid").increment(1);
            return err(StatusCode::BAD_REQUEST, "invalid_report", e.to_string());
        }
    };
    let expected = state.tokenizer(&report.model_id).map(|t| t.scheme.fingerprint());
    let url = report.advertise_url.clone();
    let fresh = state.registry().ingest(report, expected, Instant::now());
    if expected.is_none() {
        // First sight of this model: learn its tokenizer from the worker.
        state.fetch_tokenizer_in_background(url);
    }
    metrics::counter!("kvgate_gateway_reports_total", "result" => if fresh { "ok" } else { "out_of_order" })
        .increment(1);
    StatusCode::NO_CONTENT.into_response()
}

async fn metrics_text(State(state): State<Arc<GatewayState>>) -> Response {
    let now = Instant::now();
    for w in state.registry().status(now) {
        let id = w.id.clone();
        metrics::gauge!("kvgate_gateway_worker_inflight", "worker" => id.clone()).set(w.inflight as f64);
        metrics::gauge!("kvgate_gateway_worker_healthy", "worker" => id.clone())
            .set(f64::from(u8::from(w.healthy)));
        metrics::gauge!("kvgate_gateway_worker_pending_tokens", "worker" => id.clone())
            .set(w.load.pending_tokens as f64);
        metrics::gauge!("kvgate_gateway_worker_queue_requests", "worker" => id.clone())
            .set(w.load.requests as f64);
        if let Some(age) = w.report_age_s {
            metrics::gauge!("kvgate_gateway_worker_report_age_seconds", "worker" => id).set(age);
        }
    }
    ([("content-type", "text/plain; version=0.0.4")], state.prometheus.render()).into_response()
}

async fn workers(State(state): State<Arc<GatewayState>>) -> Response {
    Json(state.registry().status(Instant::now())).into_response()
}

/// Readiness: 200 once at least one worker is healthy (in the ring), else 503, so an orchestrator sends no traffic
/// to a gateway that could only answer "no worker".
async fn ready(State(state): State<Arc<GatewayState>>) -> Response {
    let healthy = state.registry().status(Instant::now()).iter().filter(|w| w.healthy).count();
    let body = Json(
        serde_json::json!({"status": if healthy > 0 { "ready" } else { "no healthy worker" }, "healthy_workers": healthy}),
    );
    if healthy > 0 {
        body.into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

/// The control routes.
pub fn router(state: Arc<GatewayState>) -> Router {
    Router::new()
        .route("/kvgate/v1/report", post(report))
        .route("/metrics", get(metrics_text))
        .route("/kvgate/v1/workers", get(workers))
        .route("/health", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
        .route("/ready", get(ready))
        .merge(crate::admin::router())
        .layer(DefaultBodyLimit::max(MAX_REPORT_BYTES))
        .with_state(state)
}
