//! The public listener's request handling as a pingora `ProxyHttp` service.
//!
//! Routing needs the whole request body (the prompt) before an upstream is chosen, and pingora 0.9 can only forward
//! a body consumed in `request_filter` through its 64 KiB retry buffer (cloudflare/pingora #349, #780; early body
//! buffering is an unmerged PR). Long-context prompts are megabytes, so the gateway buffers the body itself and
//! forwards it in `request_filter` with its own pooled client (`upstream.rs`), streaming the response back through
//! pingora's downstream session; `request_filter` then answers `true` (response sent) and pingora's upstream phases
//! are not used. Connections reach this service through `listener.rs` (connection cap, header deadline, keep-alive
//! idle timeout).
//!
//! A completion request's path is the staged pipeline of `pipeline.rs` (prepared -> priced -> admitted -> routed
//! -> forwarded, each step with its limit and error); this file holds the pingora service, the other routes
//! (`/v1/models`, `/health`) and what the stages share: the caller and class, the charge, the headers for workers.
//!
//! Charging: a request reserves its price at admission. It is then charged what the workers computed for it:
//! - a completed response: its `usage` (uncached prompt + completion tokens; a response without usage: the price);
//! - a stream that ended early (the client left, the worker failed or went silent): the uncached prompt (the
//!   prefill ran) plus every completion token sent, counted from the stream (`meter.rs`); a whole answer whose
//!   client left mid-body: its price (it was computed before it was sent);
//! - a request a worker accepted but that never answered: on the first-byte timeout, and for a stream whose
//!   client left before the first token, the uncached prompt (the gateway cannot see whether prefill began, so it
//!   assumes it did); a whole (not streamed) answer whose client left: its price (it may have been all but done);
//! - a fallback worker's uncached prompt is its own prefix match's, at the fallback (`Router::record_fallback`);
//! - a pod's usage is believed up to the prompt plus the output the request may have had;
//! - refunded in full only when no worker computed anything: refusals, connection failures, error answers, and
//!   every refusal before a worker was tried (admission, validation, no worker).
//!
//! Streams are asked for their usage (`stream_options.include_usage`) even when the client did not ask, so even a
//! pod that does not report is charged its real output; the usage chunk is then taken out of what the client sees.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use kvgate_shared::handoff;
use kvgate_shared::openai::{ModelCard, ModelList};
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::{ProxyHttp, Session};

use crate::admission::ClassInput;
use crate::control::keys::Caller;
use crate::errors::{ApiError, GatewayErrors};
use crate::serve::prepare::{prepare, PrepHeaders, PreparedRequest, CACHE_SALT_HEADER, SESSION_HEADER};
use crate::serve::tokenize::PoolError;
use crate::serve::upstream::UsageSeen;
use crate::state::GatewayState;

/// Status logged for a request whose client went away before its answer (nginx's convention).
pub const CLIENT_CLOSED: u16 = 499;

/// The pingora service.
pub struct Gateway {
    pub state: Arc<GatewayState>,
}

/// Per-request context.
pub struct Ctx {
    started: Instant,
    pub(crate) status: u16,
    pub(crate) route: &'static str,
    pub(crate) class: String,
    /// Time spent waiting for the class budget.
    pub(crate) admission_wait: Duration,
    /// The request's trace, when traced (`spans.rs`).
    pub(crate) trace: Option<crate::serve::spans::RequestTrace>,
    /// The worker that answered (traces).
    pub(crate) worker: Option<String>,
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            started: Instant::now(),
            status: 0,
            route: "none",
            class: String::new(),
            admission_wait: Duration::ZERO,
            trace: None,
            worker: None,
        }
    }

    /// Never reached: every request is answered in `request_filter` (see the module docs).
    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        Err(Error::explain(ErrorType::InternalError, "kvgate answers every request in request_filter"))
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let traceparent = session.req_header().headers.get(kvgate_shared::trace::TRACEPARENT);
        ctx.trace = crate::serve::spans::RequestTrace::begin(
            &self.state.tracer,
            traceparent.and_then(|v| v.to_str().ok()),
        );
        let result = handle(&self.state, session, ctx).await;
        if let Err(e) = result {
            ctx.status = e.status;
            write_error(session, &e).await?;
        }
        Ok(true)
    }

    async fn logging(&self, session: &mut Session, _e: Option<&pingora::Error>, ctx: &mut Ctx) {
        if let Some(t) = &ctx.trace {
            let path = session.req_header().uri.path();
            t.end(&self.state.tracer, path, ctx.status, ctx.route, &ctx.class, ctx.worker.as_deref());
        }
        metrics::counter!("kvgate_gateway_requests_total", "policy" => self.state.router.policy().name(),
            "route" => ctx.route, "status" => ctx.status.to_string(), "class" => ctx.class.clone())
        .increment(1);
        metrics::histogram!("kvgate_gateway_request_seconds").record(ctx.started.elapsed().as_secs_f64());
    }
}

async fn write_error(session: &mut Session, e: &ApiError) -> Result<()> {
    let body = Bytes::from(e.body().to_json());
    let mut h = ResponseHeader::build(e.status, Some(4))?;
    h.insert_header("content-type", "application/json")?;
    h.insert_header("content-length", body.len().to_string())?;
    if let Some(s) = e.retry_after_s {
        h.insert_header("retry-after", s.to_string())?;
    }
    metrics::counter!("kvgate_gateway_errors_total", "code" => e.code).increment(1);
    session.write_response_header(Box::new(h), false).await?;
    session.write_response_body(Some(body), true).await
}

pub(crate) async fn read_body(session: &mut Session, limit: usize) -> Result<Bytes, ApiError> {
    if let Some(len) = session.req_header().headers.get("content-length") {
        if len.to_str().ok().and_then(|v| v.parse::<usize>().ok()).is_some_and(|n| n > limit) {
            return Err(ApiError::too_large(limit));
        }
    }
    let mut buf = bytes::BytesMut::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if buf.len() + chunk.len() > limit {
                    return Err(ApiError::too_large(limit));
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(None) => break,
            Err(e) => return Err(ApiError::bad_json(format!("cannot read the request body: {e}"))),
        }
    }
    Ok(buf.freeze())
}

/// The caller behind a request's `Authorization` header (shared, not copied per request).
pub fn caller_of(state: &GatewayState, authorization: Option<&str>) -> Result<Arc<Caller>, ApiError> {
    static ANONYMOUS: std::sync::OnceLock<Arc<Caller>> = std::sync::OnceLock::new();
    match state.keys.identify(authorization) {
        Some(c) => Ok(c),
        None if state.cfg.require_api_key => Err(ApiError::missing_api_key()),
        None => Ok(ANONYMOUS.get_or_init(|| Arc::new(Caller::anonymous())).clone()),
    }
}

/// A request's class: the server's rules, or the one named in `x-kvgate-class` if the caller may choose it.
pub fn choose_class(
    state: &GatewayState,
    input: &ClassInput<'_>,
    caller: &Caller,
    header_class: Option<&str>,
) -> Result<(usize, String, u64), ApiError> {
    match header_class.map(str::trim).filter(|h| !h.is_empty()) {
        Some(name) if caller.classes.iter().any(|c| c == name) => {
            state.admission.class_by_name(name).ok_or_else(|| ApiError::unknown_class(name))
        }
        Some(name) => Err(ApiError::class_not_allowed(name)),
        None => Ok(state.admission.classify(input)),
    }
}

/// Parses, tokenizes and hashes a request on the tokenize pool. `learn`: teach the ring-key sketch this prompt
/// (requests that are routed; explain's dry runs pass false).
pub async fn prepare_on_pool(
    state: &Arc<GatewayState>,
    chat: bool,
    body: Bytes,
    headers: PrepHeaders,
    caller: Arc<Caller>,
    learn: bool,
) -> Result<PreparedRequest, ApiError> {
    let s = state.clone();
    match state.tokenize.run(move || prepare(&s, chat, body, &headers, &caller, learn)).await {
        Ok(r) => r,
        Err(PoolError::Busy) => Err(ApiError::tokenizer_busy()),
        Err(PoolError::Failed) => Err(ApiError::internal("preparing the request failed")),
    }
}

async fn handle(state: &Arc<GatewayState>, session: &mut Session, ctx: &mut Ctx) -> Result<(), ApiError> {
    let method = session.req_header().method.clone();
    let path = session.req_header().uri.path().to_owned();
    match (method.as_str(), path.as_str()) {
        ("POST", "/v1/chat/completions") | ("POST", "/v1/completions") => {
            crate::serve::pipeline::serve(state, session, ctx, &path).await
        }
        ("GET", "/v1/models") => models(state, session, ctx).await,
        ("GET", p) if p.starts_with(MODEL_PATH) => {
            model_card(state, session, ctx, &p[MODEL_PATH.len()..]).await
        }
        ("POST", p) if crate::serve::passthrough::PATHS.contains(&p) => {
            crate::serve::passthrough::serve(state, session, ctx, &path).await
        }
        ("GET", "/health") => plain_json(session, ctx, 200, "{\"status\":\"ok\"}").await,
        _ => Err(ApiError::not_found_route(&path)),
    }
}

/// Counts a considered split by outcome and logs its terms.
pub(crate) fn count_split(state: &GatewayState, routed: &kvgate_router::route::Routed) {
    let Some(s) = &routed.split else { return };
    let d = &s.decision;
    metrics::counter!("kvgate_gateway_split_decisions_total", "policy" => state.split.name(),
        "choice" => d.choice.as_str(), "reason" => d.reason)
    .increment(1);
    if routed.is_split() {
        metrics::counter!("kvgate_gateway_split_transfer_bytes_total")
            .increment(d.terms.transfer_bytes as u64);
    }
    tracing::debug!(policy = state.split.name(), choice = d.choice.as_str(), reason = d.reason,
        prefill = %s.prefill_worker, decode = %s.decode_worker, peer = %s.peer, bandwidth_measured = s.bandwidth_measured,
        terms = ?d.terms, input = ?s.input, "split considered");
}

/// The decode worker's headers of a split: the prefill peer and the gateway's grant for it (for this prompt and
/// this decode worker, one use: `kvgate_shared::handoff::PREFILL_GRANT_HEADER`).
pub(crate) fn split_headers(secret: &str, g: &handoff::GrantFor<'_>) -> Vec<(HeaderName, HeaderValue)> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let nonce = u64::from_le_bytes(kvgate_shared::trace::new_id::<8>());
    let grant = handoff::sign_prefill_grant(secret, now_ms, nonce, g);
    [(handoff::PREFILL_PEER_HEADER, g.peer.to_owned()), (handoff::PREFILL_GRANT_HEADER, grant)]
        .into_iter()
        .filter_map(|(n, v)| Some((HeaderName::from_static(n), HeaderValue::from_str(&v).ok()?)))
        .collect()
}

/// What a request that a worker answered with a 2xx is charged (module docs, "Charging"): its `usage` when the
/// response carried one; else a `completed` response the `price` reserved, and one cut short the predicted
/// `uncached` prompt plus the completion tokens it `sent`.
///
/// What a pod says is bounded by `cap` (the prompt plus the output the request may have: a pod's numbers are input
/// like any other, and an absurd usage must not put the class in debt for ever).
pub fn charge(
    price: f64,
    uncached: u64,
    usage: Option<UsageSeen>,
    sent: u64,
    completed: bool,
    cap: u64,
) -> f64 {
    let sent = sent.min(cap);
    let tokens = match usage {
        Some(u) => u.prompt.saturating_sub(u.cached).saturating_add(u.completion.max(sent)),
        None if completed => return price,
        None => uncached.saturating_add(sent),
    };
    tokens.min(cap) as f64
}

/// The body with the handoff field, and the field's value, when the handoff is on (`--prompt-handoff`), the
/// gateway has a report secret (shared with its workers), the prompt was tokenized here (chat or text) and the
/// body stays within `--max-body-bytes` (workers are expected to allow at least as much). Used only for kvgate
/// workers whose reported fingerprint is the gateway's.
pub(crate) fn handoff(state: &GatewayState, p: &PreparedRequest) -> Option<(Bytes, String)> {
    state.cfg.report_secret.as_deref()?;
    if !state.cfg.prompt_handoff || !p.tokenized || p.ids.is_empty() {
        return None;
    }
    let encoded = handoff::encode_ids(&p.ids);
    if p.body.len() + encoded.len() + 32 > state.cfg.max_body_bytes {
        return None;
    }
    let body = handoff::with_ids_field(&p.body, &encoded)?;
    Some((Bytes::from(body), encoded))
}

/// What a gateway adds for a kvgate worker: its token, and its assertion (`kvgate_shared::handoff`) of the
/// request's tenant scope, salt, model, fingerprint and handed-off ids (`ids`: the field's value), issued now.
pub(crate) fn gateway_headers(
    secret: &str,
    p: &PreparedRequest,
    ids: Option<&str>,
) -> Vec<(HeaderName, HeaderValue)> {
    let issued_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let assertion = handoff::Assertion {
        issued_ms,
        fingerprint: p.fingerprint,
        scope: p.scope.as_ref(),
        model: &p.fields.model,
        salt: p.salt.as_deref(),
        ids,
    };
    let mut out = Vec::with_capacity(2);
    if let Ok(v) = HeaderValue::from_str(&format!("Bearer {}", handoff::gateway_token(secret))) {
        out.push((hyper::header::AUTHORIZATION, v));
    }
    if let Ok(v) = HeaderValue::from_str(&handoff::sign(secret, &assertion)) {
        out.push((HeaderName::from_static(handoff::ASSERTION_HEADER), v));
    }
    out
}

/// The client headers workers get: the session id, the cache salt (unless a keyed caller's tenant salt replaced
/// it; the body carries that), `accept`, and `authorization` only with `--forward-authorization` to pods that are
/// not kvgate workers (`foreign`).
pub(crate) fn forwarded_headers(
    state: &GatewayState,
    session: &Session,
    salt_rewritten: bool,
    foreign: bool,
) -> Vec<(HeaderName, HeaderValue)> {
    let mut names = vec![SESSION_HEADER, "accept"];
    if !salt_rewritten {
        names.push(CACHE_SALT_HEADER);
    }
    if state.cfg.forward_authorization && foreign {
        names.push("authorization");
    }
    names
        .into_iter()
        .filter_map(|n| {
            let v = session.req_header().headers.get(n)?;
            Some((HeaderName::from_static(n), v.clone()))
        })
        .collect()
}

/// Gives the worker's in-flight slot back on every path.
pub(crate) struct InflightGuard {
    pub(crate) state: Arc<GatewayState>,
    pub(crate) ticket: crate::registry::SentTicket,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.state.registry().record_done(self.ticket);
    }
}

pub(crate) async fn plain_json(
    session: &mut Session,
    ctx: &mut Ctx,
    status: u16,
    body: &str,
) -> Result<(), ApiError> {
    ctx.status = status;
    let io = |e: Box<pingora::Error>| ApiError::internal(e.to_string());
    let mut h = ResponseHeader::build(status, Some(2)).map_err(io)?;
    h.insert_header("content-type", "application/json").map_err(io)?;
    h.insert_header("content-length", body.len().to_string()).map_err(io)?;
    session.write_response_header(Box::new(h), false).await.map_err(io)?;
    session.write_response_body(Some(Bytes::from(body.to_owned())), true).await.map_err(io)
}

/// `GET /v1/models/{id}` (an id may hold slashes).
const MODEL_PATH: &str = "/v1/models/";

/// The cards of the models some healthy worker serves now.
fn model_cards(state: &GatewayState) -> Vec<ModelCard> {
    let reg = state.registry();
    reg.models(Instant::now())
        .into_iter()
        .map(|id| ModelCard {
            max_model_len: reg.max_model_len(&id),
            id,
            object: "model".into(),
            created: 0,
            owned_by: "kvgate".into(),
            device: None,
            role: None,
        })
        .collect()
}

async fn models(state: &GatewayState, session: &mut Session, ctx: &mut Ctx) -> Result<(), ApiError> {
    let list = ModelList { object: "list".into(), data: model_cards(state) };
    let body = serde_json::to_string(&list).map_err(|e| ApiError::internal(e.to_string()))?;
    plain_json(session, ctx, 200, &body).await
}

/// `GET /v1/models/{id}`: the gateway answers it (it knows the pools), 404 `model_not_found` for a model no
/// healthy worker serves.
async fn model_card(
    state: &GatewayState,
    session: &mut Session,
    ctx: &mut Ctx,
    id: &str,
) -> Result<(), ApiError> {
    let card =
        model_cards(state).into_iter().find(|c| c.id == id).ok_or_else(|| ApiError::model_not_found(id))?;
    let body = serde_json::to_string(&card).map_err(|e| ApiError::internal(e.to_string()))?;
    plain_json(session, ctx, 200, &body).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_charged_what_was_computed() {
        let usage = UsageSeen { prompt: 1000, completion: 40, cached: 600 };
        // Completed: its usage (uncached prompt + completion); without one, the price reserved.
        let cap = 3000;
        assert_eq!(charge(2400.0, 400, Some(usage), 40, true, cap), 440.0);
        assert_eq!(charge(2400.0, 400, None, 40, true, cap), 2400.0);
        // Cut short: the predicted uncached prompt and what was sent; a usage seen wins (never below what was sent).
        assert_eq!(charge(2400.0, 400, None, 50, false, cap), 450.0);
        assert_eq!(
            charge(2400.0, 400, None, 0, false, cap),
            400.0,
            "left before the first token: the prefill"
        );
        assert_eq!(charge(2400.0, 400, Some(usage), 55, false, cap), 455.0);
        // A hostile pod's numbers: no overflow, no charge past the cap.
        let absurd = UsageSeen { prompt: u64::MAX, completion: u64::MAX, cached: 0 };
        assert_eq!(charge(2400.0, 400, Some(absurd), u64::MAX, true, cap), 3000.0);
        assert_eq!(charge(2400.0, u64::MAX, None, u64::MAX, false, cap), 3000.0);
    }
}
