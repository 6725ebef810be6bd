//! The admin REST API on the control listener, for operators tuning a live gateway.
//!
//! - Bearer-token auth on every route (`--admin-token` / `KVGATE_ADMIN_TOKEN`), compared in constant time; with no
//!   token configured the routes answer 404 (and the gateway says so at start); a missing or wrong token is 401.
//! - `GET/PUT /admin/v1/weights` (cache_aware weights and thresholds), `GET/PUT /admin/v1/budgets` (the whole class
//!   set), `GET /admin/v1/workers`, `POST /admin/v1/workers/{id}/drain` and `/undrain`,
//!   `POST /admin/v1/route/explain` (a chat or completions body in; every worker's score terms, the pick, its class
//!   and cost out; nothing is sent upstream).
//! - Changes are validated (400 listing every problem), versioned (`ETag`; a PUT whose `If-Match` names another
//!   version gets 412), persisted to the state file (`--state-file`) **before** they take effect (written to a
//!   temporary file, fsynced, renamed over the old one, directory fsynced: a crash leaves the old or the new state,
//!   never a torn one, and a change that could not be saved is not applied: 500), then applied at once and written
//!   to the log as an audit line.
//! - With `--redis-url` a change is a compare-and-set in Redis instead (one version order across all replicas; a
//!   stale `If-Match` on any replica is 412; 503 `shared_state_unavailable` while Redis is unreachable), applied
//!   here at once and by the other replicas within a second (`replicas/`); the state file keeps this replica's
//!   copy.
//! - The token is checked by the control listener before any body byte is read (`control.rs`).

// Handlers return `Result<_, Response>` so an early answer (401, 412, 400) reads as `?`; axum's Response is large.
#![allow(clippy::result_large_err)]

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;

use crate::admission::ClassConfig;
use crate::control::auth::secrets_equal;
use crate::control::persist::{save_state, Persisted};
use crate::replicas::{Commit, IfMatch, RedisStore, Resource};
use crate::routing::Weights;
use crate::serve::endpoints::completions::Completions;
use crate::serve::exchange::{self, Endpoint};
use crate::serve::host::ServeHost;
use crate::state::GatewayState;

/// 503 `shared_state_version_exhausted`: the resource's version in Redis is the last one below the cap, which no
/// fleet reaches by its own writes; an operator deletes the key (the replicas seed it again) to go on.
fn exhausted(r: Resource, current: u64) -> Response {
    tracing::error!(
        resource = r.name(),
        current,
        "admin change refused: the resource's version in Redis is exhausted"
    );
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "shared_state_version_exhausted",
        format!(
            "the change was not applied: the version of {} in Redis is {current}, the last below the cap (no \
             replica wrote that); delete the key {{prefix}}:admin:{} and the replicas seed it again",
            r.name(),
            r.name()
        ),
    )
}

fn error(status: StatusCode, code: &'static str, message: String) -> Response {
    crate::control::auth::error_response(status, code, message)
}

/// Checks the bearer token; `Err` is the response to send.
pub fn authorize(state: &GatewayState, headers: &HeaderMap) -> Result<(), Response> {
    let Some(token) = &state.cfg.admin_token else {
        return Err(error(
            StatusCode::NOT_FOUND,
            "admin_disabled",
            "the admin API is off (no --admin-token)".into(),
        ));
    };
    let given =
        headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| secrets_equal(g.as_bytes(), token.as_bytes())) {
        Ok(())
    } else {
        Err(error(StatusCode::UNAUTHORIZED, "unauthorized", "missing or wrong admin token".into()))
    }
}

fn etag(version: u64) -> String {
    format!("\"v{version}\"")
}

fn versioned<T: Serialize>(value: &T, version: u64) -> Response {
    let mut r = Json(value).into_response();
    if let Ok(v) = etag(version).parse() {
        r.headers_mut().insert("etag", v);
    }
    r
}

/// 412 unless `If-Match` is absent or names the current version.
fn check_if_match(headers: &HeaderMap, version: u64) -> Result<(), Response> {
    match headers.get("if-match").and_then(|v| v.to_str().ok()) {
        None => Ok(()),
        Some(v) if v.trim() == "*" || v.trim() == etag(version) => Ok(()),
        Some(v) => Err(error(
            StatusCode::PRECONDITION_FAILED,
            "version_mismatch",
            format!("If-Match {v} does not match the current version {}; GET it again", etag(version)),
        )),
    }
}

/// Saves `next` (the state as it will be) before it is applied; `Err` (500) means nothing changes.
fn persist(state: &GatewayState, next: &Persisted) -> Result<(), Response> {
    let Some(path) = &state.cfg.state_file else { return Ok(()) };
    // fsync may take a while: off the control runtime's only worker thread meanwhile.
    tokio::task::block_in_place(|| save_state(path, next)).map_err(|e| {
        tracing::error!(error = %e, "cannot save the admin state: change not applied");
        error(StatusCode::INTERNAL_SERVER_ERROR, "state_file", format!("the change was not applied: {e}"))
    })
}

/// With Redis: the change as a compare-and-set there, so every replica sees one order of versions; `Ok` is the new
/// version (then applied here; the others apply it from Redis), `Err` the response: 412 for a stale `If-Match`
/// (from whichever replica), 503 while Redis is unreachable (nothing changed anywhere).
async fn commit_shared(
    state: &GatewayState,
    store: &RedisStore,
    r: Resource,
    headers: &HeaderMap,
    value: String,
) -> Result<u64, Response> {
    let given = headers.get("if-match").map(|v| v.to_str().unwrap_or("?"));
    let mismatch = |current: String| {
        error(
            StatusCode::PRECONDITION_FAILED,
            "version_mismatch",
            format!(
                "If-Match {} does not match the current version {current}; GET it again",
                given.unwrap_or("")
            ),
        )
    };
    let expected = match IfMatch::parse(given) {
        IfMatch::Any => None,
        IfMatch::Version(v) => Some(v),
        IfMatch::Invalid => return Err(mismatch("(not comparable: that is not an ETag of this API)".into())),
    };
    let audit = serde_json::json!({
        "replica": state.shared.replica_id(),
        "resource": r.name(),
        "expected": expected,
        "value": serde_json::from_str::<serde_json::Value>(&value).unwrap_or_default(),
    })
    .to_string();
    match store.commit(r, expected, state.resource_json(r).0, &value, &audit).await {
        Ok(Commit::Done(v)) => Ok(v),
        Ok(Commit::Stale(current)) => Err(mismatch(etag(current))),
        Ok(Commit::Exhausted(current)) => Err(exhausted(r, current)),
        Err(e) => {
            state.shared.lost();
            tracing::error!(error = %e, resource = r.name(), "admin change refused: Redis is unreachable");
            Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "shared_state_unavailable",
                format!("the change was not applied: the replicas' shared state (Redis) is unreachable ({e}); retry"),
            ))
        }
    }
}

async fn get_weights(State(state): State<Arc<GatewayState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&state, &headers) {
        return r;
    }
    let (w, v) = state.weights();
    versioned(&w, v)
}

async fn put_weights(State(state): State<Arc<GatewayState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = authorize(&state, &headers) {
        return r;
    }
    let w: Weights = match serde_json::from_slice(&body) {
        Ok(w) => w,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_value", format!("weights: {e}")),
    };
    let problems = w.validate();
    if !problems.is_empty() {
        return error(StatusCode::BAD_REQUEST, "invalid_value", problems.join("; "));
    }
    if let Some(store) = state.shared.store() {
        let old = state.weights().0;
        let value = serde_json::to_string(&w).unwrap_or_default();
        let version = match commit_shared(&state, store, Resource::Weights, &headers, value).await {
            Ok(v) => v,
            Err(r) => return r,
        };
        state.apply_weights(w, version);
        state.save_local_copy();
        let replica = state.shared.replica_id();
        tracing::info!(target: "audit", resource = "weights", old = ?old, new = ?w, version, replica, "admin change");
        return versioned(&w, version);
    }
    let version = {
        let _guard = state.admin_lock();
        let (old, v) = state.weights();
        if let Err(r) = check_if_match(&headers, v) {
            return r;
        }
        let next = Persisted { weights: w, weights_version: v + 1, ..state.persisted() };
        if let Err(r) = persist(&state, &next) {
            return r;
        }
        let version = state.set_weights(w);
        tracing::info!(target: "audit", resource = "weights", old = ?old, new = ?w, version, "admin change");
        version
    };
    versioned(&w, version)
}

async fn get_budgets(State(state): State<Arc<GatewayState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&state, &headers) {
        return r;
    }
    let (c, v) = state.classes();
    versioned(&c, v)
}

async fn put_budgets(State(state): State<Arc<GatewayState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = authorize(&state, &headers) {
        return r;
    }
    let classes: Vec<ClassConfig> = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_value", format!("budgets: {e}")),
    };
    let problems = crate::admission::classes::validate(&classes);
    if !problems.is_empty() {
        return error(StatusCode::BAD_REQUEST, "invalid_value", problems.join("; "));
    }
    if let Some(store) = state.shared.store() {
        let old = state.classes().0;
        let value = serde_json::to_string(&classes).unwrap_or_default();
        let version = match commit_shared(&state, store, Resource::Budgets, &headers, value).await {
            Ok(v) => v,
            Err(r) => return r,
        };
        state.apply_classes(classes.clone(), version);
        state.save_local_copy();
        let replica = state.shared.replica_id();
        tracing::info!(target: "audit", resource = "budgets", old = ?old, new = ?classes, version, replica, "admin change");
        return versioned(&classes, version);
    }
    let version = {
        let _guard = state.admin_lock();
        let (old, v) = state.classes();
        if let Err(r) = check_if_match(&headers, v) {
            return r;
        }
        let next = Persisted { classes: classes.clone(), classes_version: v + 1, ..state.persisted() };
        if let Err(r) = persist(&state, &next) {
            return r;
        }
        let version = state.set_classes(classes.clone());
        tracing::info!(target: "audit", resource = "budgets", old = ?old, new = ?classes, version, "admin change");
        version
    };
    versioned(&classes, version)
}

async fn workers(State(state): State<Arc<GatewayState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&state, &headers) {
        return r;
    }
    Json(state.registry().status(Instant::now())).into_response()
}

async fn drain(state: Arc<GatewayState>, headers: HeaderMap, id: String, draining: bool) -> Response {
    if let Err(r) = authorize(&state, &headers) {
        return r;
    }
    if !state.registry().set_draining(&id, draining) {
        return error(StatusCode::NOT_FOUND, "worker_not_found", format!("no worker {id:?}"));
    }
    if let Some(store) = state.shared.store() {
        // Every replica drains it: a compare-and-set of the shared drain set, retried when another replica changed
        // it in between (its version moved).
        let mut attempt = 0;
        loop {
            let (mut ids, version) = state.drains();
            ids.retain(|i| *i != id);
            if draining {
                ids.push(id.clone());
            }
            ids.sort();
            let value = serde_json::to_string(&ids).unwrap_or_default();
            let audit = serde_json::json!({"replica": state.shared.replica_id(), "resource": "drains",
                "worker": id, "draining": draining})
            .to_string();
            match store.commit(Resource::Drains, Some(version), version, &value, &audit).await {
                Ok(Commit::Done(v)) => {
                    state.set_drains(ids, v);
                    break;
                }
                Ok(Commit::Stale(_)) if attempt < 5 => {
                    attempt += 1;
                    if let Ok(crate::replicas::redis_store::Stored::Valid(v, value)) =
                        store.get(Resource::Drains).await
                    {
                        crate::replicas::sync::apply_remote(state.as_ref(), Resource::Drains, v, &value);
                    }
                }
                Ok(Commit::Exhausted(current)) => return exhausted(Resource::Drains, current),
                Ok(Commit::Stale(_)) => {
                    return error(
                        StatusCode::CONFLICT,
                        "version_mismatch",
                        "drained here, but the shared drain set kept changing under this call; retry".into(),
                    );
                }
                Err(e) => {
                    state.shared.lost();
                    return error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "shared_state_unavailable",
                        format!("drained here, but the other replicas could not be told (Redis unreachable: {e}); retry"),
                    );
                }
            }
        }
    }
    tracing::info!(target: "audit", resource = "worker", worker = %id, draining, "admin change");
    Json(serde_json::json!({"worker": id, "draining": draining})).into_response()
}

async fn explain(State(state): State<Arc<GatewayState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = authorize(&state, &headers) {
        return r;
    }
    let api_error = |e: crate::errors::ApiError| {
        (
            StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST),
            [("content-type", "application/json")],
            e.body().to_json(),
        )
            .into_response()
    };
    let chat = serde_json::from_slice::<serde_json::Value>(&body).is_ok_and(|v| v.get("messages").is_some());
    let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
    let endpoint = Completions { chat, learn: false };
    let host: Arc<dyn ServeHost> = state.clone();
    // The caller being explained is named by `x-kvgate-explain-authorization` (the admin token is in Authorization).
    let authorization = headers.get("x-kvgate-explain-authorization").and_then(|v| v.to_str().ok());
    // Stages 2 to 4 of the exchange: what the request would be priced at, and the decision it would get.
    let incoming = match exchange::identify(host.as_ref(), path, authorization, |n| headers.get(n)) {
        Ok(i) => i,
        Err(e) => return api_error(e),
    };
    let prep = match endpoint.prepare(&host, &incoming, body).await {
        Ok(p) => p,
        Err(e) => return api_error(e),
    };
    let priced = match exchange::price(host.as_ref(), &prep, &incoming, usize::MAX) {
        Ok(v) => v,
        Err(e) => return api_error(e),
    };
    let Some(p) = &prep.prompt else {
        return api_error(crate::errors::ApiError::internal("a completion is tokenized"));
    };
    let caller = &incoming.caller;
    let decision = priced.dry.as_ref();
    let (class, cost) = (&priced.class_name, priced.cost as u64);
    let predicted = decision.map(|d| d.predicted_cached_tokens);
    // An adapter request: where it would run (its holders, or the worker that would load it) and every term.
    let placement = p.adapter.as_ref().and_then(|a| {
        let loadable = host.adapter_loads().path(&a.name).is_some();
        let reg = host.registry();
        let input = incoming.within(prep.route_input());
        kvgate_router::placement::place(
            &reg,
            &input,
            loadable,
            &host.adapter_loads().place,
            std::time::Instant::now(),
        )
    });
    let adapter = p
        .adapter
        .as_ref()
        .map(|a| serde_json::json!({"name": a.name, "base": a.base, "key": a.key, "placement": placement}));
    Json(serde_json::json!({
        "adapter": adapter,
        "model": p.fields.model,
        "policy": state.router.policy().name(),
        "prompt_tokens": p.ids.len(),
        "blocks": p.hashes.len(),
        "pick": decision.as_ref().and_then(|d| d.candidates.first()).map(|c| c.id.as_str()),
        "reason": decision.as_ref().map(|d| d.reason),
        "ranked": decision.as_ref().map(|d| d.candidates.iter().map(|c| c.id.as_str()).collect::<Vec<_>>()),
        "predicted_cached_tokens": predicted,
        "class": class,
        "tenant": caller.tenant,
        "cost_tokens": cost,
        "max_model_len": p.max_model_len,
        "split_policy": state.split.name(),
        "split": decision.as_ref().and_then(|d| d.split.as_ref()),
        "prefill": decision.as_ref().and_then(|d| d.prefill.as_ref()).map(|c| c.id.as_str()),
        "terms": decision.map(|d| &d.terms),
    }))
    .into_response()
}

/// The admin routes (`explain_limit`: the body limit of route/explain, which takes a public request body).
pub fn router(explain_limit: usize) -> Router<Arc<GatewayState>> {
    let explain = Router::new()
        .route("/admin/v1/route/explain", post(explain))
        .layer(DefaultBodyLimit::max(explain_limit));
    Router::new()
        .route("/admin/v1/weights", get(get_weights).put(put_weights))
        .route("/admin/v1/budgets", get(get_budgets).put(put_budgets))
        .route("/admin/v1/workers", get(workers))
        .route(
            "/admin/v1/workers/{id}/drain",
            post(|State(s): State<Arc<GatewayState>>, h: HeaderMap, UrlPath(id): UrlPath<String>| {
                drain(s, h, id, true)
            }),
        )
        .route(
            "/admin/v1/workers/{id}/undrain",
            post(|State(s): State<Arc<GatewayState>>, h: HeaderMap, UrlPath(id): UrlPath<String>| {
                drain(s, h, id, false)
            }),
        )
        .merge(explain)
}
