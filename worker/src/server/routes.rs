//! The HTTP route table ([`router`]: which path goes to which handler, which routes only gateways may call, the
//! `x-kvgate-worker` header on every answer) and the small handlers that read the server's state directly: probes,
//! `/v1/models`, the tokenizer description. Runtime LoRA loading is in `adapters`, behind `admin_only`. The OpenAI endpoints live in `api`, vLLM's tokenize endpoints in
//! `tokens`, the KV probe in `pd`, the metrics page in `telemetry`.
//!
//! Invariants: `/health`, `/ready` and `/metrics` are never behind `--require-gateway-token` (orchestrators and
//! scrapers call them); a path no route names answers the API's 404 (`ApiError::not_found_route`), not axum's.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvgate_shared::openai::{ModelCard, ModelList};

use super::errors::{ApiError, Refusal};
use super::state::AppState;
use super::telemetry::metrics_text;
use super::{adapters, api, pd, tokens};

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
    // Runtime adapter loading: the admin token or a gateway's (`admin_only`).
    let admin = Router::new()
        .route("/v1/load_lora_adapter", post(adapters::load))
        .route("/v1/unload_lora_adapter", post(adapters::unload))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), admin_only));
    Router::new()
        .merge(gated)
        .merge(admin)
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

/// The worker's admin calls: `Authorization: Bearer` the `--admin-token`, or a kvgate gateway's token (from
/// `--report-secret`); with neither configured they are off (403 `runtime_lora_disabled`), else 401
/// `admin_token_required`.
async fn admin_only(
    State(state): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (admin, secret) = (state.cfg.admin_token.as_deref(), state.cfg.report_secret.as_deref());
    if admin.is_none() && secret.is_none() {
        return ApiError::new(
            403,
            "permission_error",
            "runtime_lora_disabled",
            "runtime LoRA loading is off on this worker: give it --admin-token (or --report-secret, for gateways)",
        )
        .into_response();
    }
    let auth = req.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let ok = admin.is_some_and(|t| kvgate_shared::handoff::bearer_is(t, auth))
        || secret.is_some_and(|s| kvgate_shared::handoff::check_gateway_token(s, auth));
    if !ok {
        metrics::counter!("kvgate_worker_unauthorized_requests_total").increment(1);
        return ApiError::unauthorized("admin_token_required", "this call needs the worker's admin token")
            .into_response();
    }
    next.run(req).await
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let Some(l) = state.loaded() else {
        return ApiError::refused(Refusal::ModelLoading, "the model is still loading").into_response();
    };
    let card = |id: &str, parent: Option<String>| ModelCard {
        id: id.to_owned(),
        object: "model".into(),
        created: state.created,
        owned_by: "kvgate".into(),
        max_model_len: Some(l.max_model_len as u32),
        device: Some(l.device.clone()),
        role: Some(l.pd_info.role.as_str().to_owned()),
        parent,
    };
    let mut data = vec![card(&l.model_id, None)];
    let mut names = l.adapters.names();
    names.sort();
    data.extend(names.iter().map(|a| card(a, Some(l.model_id.clone()))));
    Json(ModelList { object: "list".into(), data }).into_response()
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
