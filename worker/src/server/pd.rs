//! The decode side of a prefill/decode split at the API: a request naming a prefill peer (with the gateway's
//! grant) allocates its blocks here and fetches the prompt's KV from the peer (`crate::transfer::import`) while
//! the response waits for its first token; when the fetch fails, the prompt is computed here instead.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use kvgate_shared::handoff::{self, PREFILL_GRANT_HEADER, PREFILL_PEER_HEADER};
use kvgate_shared::report::Role;
use tokio::sync::{mpsc, oneshot};

use super::engine_thread::Refusal;
use super::errors::{ApiError, Refusal as SharedRefusal};
use super::{AppState, ServingModel};
use crate::engine::{EngineRequest, StepOutput};
use crate::transfer::import::{fetch, Want};

/// A split's decode leg: the prefill peer and the gateway's grant (which the peer checks again).
#[derive(Clone, Debug)]
pub struct Split {
    pub peer: String,
    pub grant: String,
}

/// The prefill peer a request names, once its grant verifies for this worker and `prompt` (the tokens it will
/// compute); `None` without [`PREFILL_PEER_HEADER`], and for a grant made for another prompt (this worker
/// tokenized otherwise than the gateway: the request is computed whole here, counted in
/// `kvgate_worker_prefill_grants_total{result="other_prompt"}`). Refused: a prefill worker (it imports nothing, 400
/// `invalid_request_error`), a worker that cannot transfer (no report secret, or a simulated engine: 400), a
/// missing or invalid grant (401 `invalid_prefill_grant`).
pub fn prefill_peer(
    state: &AppState,
    l: &ServingModel,
    headers: &HeaderMap,
    model: &str,
    prompt: &[u32],
) -> Result<Option<Split>, ApiError> {
    match granted_peer(state, l, headers, (model, &l.worker_id, prompt))? {
        Some((peer, grant, Ok(()))) => Ok(Some(Split { peer, grant })),
        Some((_, _, Err(()))) => Ok(None),
        None => Ok(None),
    }
}

/// The peer and grant of a request's headers, checked for `(model, decode worker, prompt)`: `Ok(None)` without
/// the peer header; the inner `Err(())` for a valid grant made for another prompt.
#[allow(clippy::type_complexity)]
fn granted_peer(
    state: &AppState,
    l: &ServingModel,
    headers: &HeaderMap,
    (model, decode, prompt): (&str, &str, &[u32]),
) -> Result<Option<(String, String, Result<(), ()>)>, ApiError> {
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
    let count = |result: &'static str| {
        metrics::counter!("kvgate_worker_prefill_grants_total", "result" => result).increment(1);
    };
    let g = handoff::GrantFor { model, peer: &peer, decode, prompt };
    match handoff::verify_prefill_grant(state.cfg.report_secret.as_deref(), &grant, &g, now_ms) {
        Ok(_) => {
            count("ok");
            Ok(Some((peer, grant, Ok(()))))
        }
        Err(handoff::GrantError::OtherPrompt) => {
            count("other_prompt");
            tracing::warn!(%peer, "a prefill grant for another prompt: computing the request here");
            Ok(Some((peer, grant, Err(()))))
        }
        Err(e) => {
            count("invalid");
            metrics::counter!("kvgate_worker_unauthorized_requests_total").increment(1);
            Err(ApiError::unauthorized("invalid_prefill_grant", e.to_string()))
        }
    }
}

/// Allocates the request's blocks and starts fetching its KV from `peer`; its outputs arrive on the receiver
/// (after the fetch, or after a local prefill if the fetch fails). Dropping the sender cancels the fetch.
pub async fn start_import(
    l: &ServingModel,
    req: EngineRequest,
    split: Split,
) -> Result<(mpsc::UnboundedReceiver<StepOutput>, oneshot::Sender<()>), Refusal> {
    let Some(t) = l.transfer.clone() else { return Err(Refusal::EngineGone) };
    let (id, prompt, params) = (req.id, req.prompt.clone(), req.params.clone());
    // The prefill peer keys (and computes) the blocks as this worker will: the adapter's key travels in the keys.
    let mut keys = req.extra_keys.clone();
    if let Some(a) = &req.adapter {
        keys.push(kvgate_shared::hashing::ExtraKey::LoraAdapter(a.key.clone()));
    }
    let (plan, rx) = l.engine.start_import(req).await?;
    let (cancel, cancelled) = oneshot::channel();
    tokio::spawn(async move {
        let want =
            Want { id, prompt: &prompt, extra_keys: &keys, params: &params, plan, grant: &split.grant };
        fetch(&t, &split.peer, want, cancelled).await;
    });
    Ok((rx, cancel))
}

/// Bytes a link probe asks the prefill peer for: enough that the link's rate, not its round trip, sets the time
/// on the links the cost model cares about (16 MiB take 1.3 ms at 100 Gb/s).
pub const PROBE_BYTES: u32 = 16 << 20;

/// One probe at a time per worker: a second gets 503 `probe_busy`.
static PROBING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `POST /kvgate/v1/kv-probe` with the prefill peer and the gateway's grant as a split carries them: times
/// [`PROBE_BYTES`] from the peer into the import log, so the next report carries the pair's rate before its first
/// transfer. Answers `{"peer", "bytes", "seconds", "bytes_per_s"}`; refused like a split's decode leg (400, 401),
/// 503 `probe_busy` while another runs, 502 `probe_failed` when the peer refuses or the link fails.
pub async fn probe(
    axum::extract::State(state): axum::extract::State<std::sync::Arc<AppState>>,
    headers: HeaderMap,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let Some(l) = state.loaded() else {
        return ApiError::refused(SharedRefusal::ModelLoading, "the model is still loading").into_response();
    };
    // A probe's grant names no prompt and no decode worker (`link_probe` in the gateway).
    let peer = match granted_peer(&state, &l, &headers, (&l.model_id, "", &[])) {
        Ok(Some((p, _, Ok(())))) => p,
        Ok(Some((_, _, Err(())))) => {
            return ApiError::unauthorized("invalid_prefill_grant", "a split's grant is not a probe's")
                .into_response()
        }
        Ok(None) => return ApiError::invalid(PREFILL_PEER_HEADER, "is required").into_response(),
        Err(e) => return e.into_response(),
    };
    let Some(t) = l.transfer.clone() else { return ApiError::internal("no transfers").into_response() };
    if PROBING.swap(true, std::sync::atomic::Ordering::AcqRel) {
        return ApiError::unavailable("probe_busy", "another link probe is running").into_response();
    }
    // Cleared however the probe ends, a caller that hangs up (the future dropped) included.
    struct Probing;
    impl Drop for Probing {
        fn drop(&mut self) {
            PROBING.store(false, std::sync::atomic::Ordering::Release);
        }
    }
    let _probing = Probing;
    let result = crate::transfer::import::probe(&t, &peer, PROBE_BYTES).await;
    match result {
        Ok((bytes, seconds)) => {
            let rate = if seconds > 0.0 { bytes as f64 / seconds } else { 0.0 };
            axum::Json(
                serde_json::json!({"peer": peer, "bytes": bytes, "seconds": seconds, "bytes_per_s": rate}),
            )
            .into_response()
        }
        Err(e) => {
            let mut err = ApiError::internal(format!("probing {peer}: {e}"));
            err.status = 502;
            err.code = "probe_failed";
            err.into_response()
        }
    }
}
