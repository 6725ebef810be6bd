//! The decode side of a prefill/decode split at the API: a request naming a prefill peer (with the gateway's
//! grant) allocates its blocks here and fetches the prompt's KV from the peer (`crate::transfer::import`) while
//! the response waits for its first token; when the fetch fails, the prompt is computed here instead.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use kvgate_shared::handoff::{self, PREFILL_GRANT_HEADER, PREFILL_PEER_HEADER};
use kvgate_shared::report::Role;
use tokio::sync::{mpsc, oneshot};

use super::engine_thread::Refusal;
use super::errors::ApiError;
use super::{AppState, ServingModel};
use crate::engine::{EngineRequest, StepOutput};
use crate::transfer::import::{fetch, Want};

/// The prefill peer a request names, once its grant verifies; `None` without [`PREFILL_PEER_HEADER`]. Refused:
/// a prefill worker (it imports nothing, 400 `invalid_request_error`), a worker that cannot transfer (no report
/// secret, or a simulated engine: 400), a missing or invalid grant (401 `invalid_prefill_grant`).
pub fn prefill_peer(
    state: &AppState,
    l: &ServingModel,
    headers: &HeaderMap,
    model: &str,
) -> Result<Option<String>, ApiError> {
    let Some(peer) = headers.get(PREFILL_PEER_HEADER) else { return Ok(None) };
    let text = |v: &axum::http::HeaderValue, name: &'static str| {
        v.to_str().map(str::to_owned).map_err(|_| ApiError::invalid(name, "is not text"))
    };
    let peer = text(peer, PREFILL_PEER_HEADER)?;
    if state.cfg.role == Role::Prefill {
        return Err(ApiError::invalid(
            PREFILL_PEER_HEADER,
            "this worker's role is prefill: it imports no KV",
        ));
    }
    if l.transfer.is_none() {
        return Err(ApiError::invalid(
            PREFILL_PEER_HEADER,
            "this worker cannot import KV (it needs --report-secret and an engine that copies KV blocks)",
        ));
    }
    let grant =
        headers.get(PREFILL_GRANT_HEADER).map(|g| text(g, PREFILL_GRANT_HEADER)).transpose()?.ok_or_else(
            || {
                ApiError::unauthorized(
                    "invalid_prefill_grant",
                    format!("{PREFILL_PEER_HEADER} needs {PREFILL_GRANT_HEADER}"),
                )
            },
        )?;
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    handoff::verify_prefill_grant(state.cfg.report_secret.as_deref(), &grant, model, &peer, now_ms).map_err(
        |e| {
            metrics::counter!("kvgate_worker_unauthorized_requests_total").increment(1);
            ApiError::unauthorized("invalid_prefill_grant", e.to_string())
        },
    )?;
    Ok(Some(peer))
}

/// Allocates the request's blocks and starts fetching its KV from `peer`; its outputs arrive on the receiver
/// (after the fetch, or after a local prefill if the fetch fails). Dropping the sender cancels the fetch.
pub async fn start_import(
    l: &ServingModel,
    req: EngineRequest,
    peer: String,
) -> Result<(mpsc::UnboundedReceiver<StepOutput>, oneshot::Sender<()>), Refusal> {
    let Some(t) = l.transfer.clone() else { return Err(Refusal::EngineGone) };
    let (id, prompt, keys, params) = (req.id, req.prompt.clone(), req.extra_keys.clone(), req.params.clone());
    let (plan, rx) = l.engine.start_import(req).await?;
    let (cancel, cancelled) = oneshot::channel();
    tokio::spawn(async move {
        let want = Want { id, prompt: &prompt, extra_keys: &keys, params: &params, plan };
        fetch(&t, &peer, want, cancelled).await;
    });
    Ok((rx, cancel))
}
