//! The HTTP route table ([`router`]: which path goes to which handler, which routes only gateways may call, the
//! `x-kvgate-worker` header on every answer) and the small handlers that read the server's state directly: probes,
//! `/v1/models`, the tokenizer description. Runtime LoRA loading is in `adapters`, behind `admin_only` (the admin
//! token, or a gateway's credential for that call: never the gateway's static token). The OpenAI endpoints live in `api`, vLLM's tokenize endpoints in
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
/// (`kvgate_shared::handoff::gateway_token` of the report secret) or a per-request credential that verifies for
/// this path, body and salt header (`kvgate_shared::credential`: what an endpoint picker's proxy carries).
async fn gateway_only(
    State(state): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (true, Some(secret)) = (state.cfg.require_gateway_token, state.cfg.report_secret.as_deref()) else {
        return next.run(req).await;
    };
    let auth = req.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    if kvgate_shared::handoff::check_gateway_token(secret, auth) {
        return next.run(req).await;
    }
    let refused = |why: &str| {
        metrics::counter!("kvgate_worker_unauthorized_requests_total").increment(1);
        ApiError::unauthorized(
            "gateway_token_required",
            format!(
                "this worker answers only kvgate gateways (--require-gateway-token): send requests through a \
                 gateway{why}"
            ),
        )
        .into_response()
    };
    match with_request_credential(&state, secret, req).await {
        Credential::Verified(req) => next.run(req).await,
        Credential::Refused(why) => refused(&why),
        Credential::Failed(r) => r,
    }
}

/// What a request credential said.
enum Credential {
    /// It verifies: the request, its body read back in.
    Verified(axum::extract::Request),
    /// None, or one that does not verify: why (for the 401's message).
    Refused(String),
    /// The body could not be read (its error answer).
    Failed(Response),
}

/// Checks the request's per-request credential (`kvgate_shared::credential`) against its path, body (read, at
/// most `--max-body-bytes`) and salt header.
async fn with_request_credential(state: &AppState, secret: &str, req: axum::extract::Request) -> Credential {
    let auth = req.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    if !kvgate_shared::credential::is_request_credential(auth) {
        return Credential::Refused(String::new());
    }
    let token = auth.and_then(|a| a.strip_prefix("Bearer ")).unwrap_or("").to_owned();
    let (parts, body) = req.into_parts();
    let body = match super::api::read_body(body, state.cfg.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return Credential::Failed(e.into_response()),
    };
    let salt = parts.headers.get(kvgate_shared::prompt::CACHE_SALT_HEADER).map(|v| v.as_bytes());
    let r = kvgate_shared::credential::RequestFor { path: parts.uri.path(), body: &body, salt_header: salt };
    if let Err(e) = kvgate_shared::credential::verify_request(
        Some(secret),
        &token,
        &r,
        kvgate_shared::credential::now_ms(),
    ) {
        return Credential::Refused(match e {
            kvgate_shared::handoff::AssertionError::Expired { skew_ms } => {
                format!(" (the per-request credential was issued {skew_ms} ms away from this worker's clock)")
            }
            _ => " (the per-request credential does not verify: it serves only the request it was made for)"
                .into(),
        });
    }
    Credential::Verified(axum::extract::Request::from_parts(parts, axum::body::Body::from(body)))
}

/// The worker's admin calls (runtime LoRA loading): `Authorization: Bearer` the `--admin-token`, or a gateway's
/// per-request credential for this very call (`kvgate_shared::credential`: a gateway loading an adapter of its
/// catalogue signs the call's body, name and path, with the report secret). The gateway's static token is not an
/// admin credential: whoever holds it can call the API, not load files. With neither `--admin-token` nor
/// `--report-secret` the calls are off (403 `runtime_lora_disabled`); else 401 `admin_token_required`.
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
            "runtime LoRA loading is off on this worker: give it --admin-token (or --report-secret, for gateways' \
             catalogue loads)",
        )
        .into_response();
    }
    let auth = req.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    if admin.is_some_and(|t| kvgate_shared::handoff::bearer_is(t, auth)) {
        return next.run(req).await;
    }
    let refused = || {
        metrics::counter!("kvgate_worker_unauthorized_requests_total").increment(1);
        ApiError::unauthorized(
            "admin_token_required",
            "this call needs the worker's admin token (or a gateway's credential for this call)",
        )
        .into_response()
    };
    let Some(secret) = secret else { return refused() };
    match with_request_credential(&state, secret, req).await {
        Credential::Verified(req) => next.run(req).await,
        Credential::Refused(_) => refused(),
        Credential::Failed(r) => r,
    }
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
