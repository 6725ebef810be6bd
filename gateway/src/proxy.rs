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
//! A request's path, each step with its limit and error:
//! 1. the body, within `--max-body-bytes` (413) and `--request-read-timeout` (408);
//! 2. the caller, from its API key (`keys.rs`; unknown: the anonymous tenant, or 401 with `--require-api-key`);
//! 3. parse, render, tokenize and hash on the tokenize pool (`prepare.rs`; 400, 404 `model_not_found`, 503
//!    `tokenizer_busy`), refusing over-long requests (400 `context_length_exceeded`) before anything is charged;
//! 4. pick the class (server rules; `x-kvgate-class` only for callers allowed to choose it, else 403), price the
//!    request with a dry run of the routing decision and wait for the class budget (429), noticing a client that
//!    leaves meanwhile; then route on the state as it is after the wait (`kvgate_router::route`: decide and record
//!    the send under one lock);
//! 5. up to `--max-attempts` workers in rank order: a worker that refuses before any byte is skipped (and left alone
//!    for its Retry-After); a first-byte timeout is 504 and the worker turns suspect.
//!
//! Charging: a request reserves its price at admission. It is then charged what the workers computed for it:
//! - a completed response: its `usage` (uncached prompt + completion tokens; a response without usage: the price);
//! - a stream that ended early (the client left, the worker failed or went silent): the uncached prompt (the
//!   prefill ran) plus every completion token sent, counted from the stream (`meter.rs`); a whole answer whose
//!   client left mid-body: its price (it was computed before it was sent);
//! - a request a worker accepted but that never answered: on the first-byte timeout, and for a stream whose
//!   client left before the first token, the uncached prompt (the gateway cannot see whether prefill began, so it
//!   assumes it did); a whole (not streamed) answer whose client left: its price (it may have been all but done);
//! - a fallback worker's uncached prompt is not predicted: its whole prompt stands for it;
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

use crate::admission::{ClassInput, CLASS_HEADER};
use crate::config::WorkerKind;
use crate::errors::ApiError;
use crate::keys::Caller;
use crate::prepare::{prepare, PrepHeaders, PreparedRequest, CACHE_SALT_HEADER, SESSION_HEADER};
use crate::registry::Fault;
use crate::routing::RouteReason;
use crate::state::GatewayState;
use crate::tokenize::PoolError;
use crate::upstream::{forward, unless_client_leaves, Attempt, Outcome, UsageSeen};
use kvgate_router::split::plan::SplitAsk;

/// Status logged for a request whose client went away before its answer (nginx's convention).
pub const CLIENT_CLOSED: u16 = 499;

/// The pingora service.
pub struct Gateway {
    pub state: Arc<GatewayState>,
}

/// Per-request context.
pub struct Ctx {
    started: Instant,
    status: u16,
    route: &'static str,
    class: String,
    /// Time spent waiting for the class budget.
    admission_wait: Duration,
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
        }
    }

    /// Never reached: every request is answered in `request_filter` (see the module docs).
    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        Err(Error::explain(ErrorType::InternalError, "kvgate answers every request in request_filter"))
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let result = handle(&self.state, session, ctx).await;
        if let Err(e) = result {
            ctx.status = e.status;
            write_error(session, &e).await?;
        }
        Ok(true)
    }

    async fn logging(&self, _session: &mut Session, _e: Option<&pingora::Error>, ctx: &mut Ctx) {
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

async fn read_body(session: &mut Session, limit: usize) -> Result<Bytes, ApiError> {
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

fn header<'a>(session: &'a Session, name: &str) -> Option<&'a str> {
    session.req_header().headers.get(name).and_then(|v| v.to_str().ok())
}

/// The caller behind a request's `Authorization` header (shared, not copied per request).
pub fn caller_of(state: &GatewayState, authorization: Option<&str>) -> Result<Arc<Caller>, ApiError> {
    static ANONYMOUS: std::sync::OnceLock<Arc<Caller>> = std::sync::OnceLock::new();
    match state.keys.identify(authorization) {
        Some(c) => Ok(c),
        None if state.cfg.require_api_key => Err(ApiError::unauthorized()),
        None => Ok(ANONYMOUS.get_or_init(|| Arc::new(Caller::anonymous())).clone()),
    }
}

/// A request's class: the server's rules, or the one named in `x-kvgate-class` if the caller may choose it.
pub fn choose_class(
    state: &GatewayState,
    p: &PreparedRequest,
    caller: &Caller,
    header_class: Option<&str>,
) -> Result<(usize, String, u64), ApiError> {
    match header_class.map(str::trim).filter(|h| !h.is_empty()) {
        Some(name) if caller.classes.iter().any(|c| c == name) => {
            state.admission.class_by_name(name).ok_or_else(|| ApiError::unknown_class(name))
        }
        Some(name) => Err(ApiError::class_not_allowed(name)),
        None => Ok(state.admission.classify(&ClassInput {
            prompt_tokens: p.ids.len() as u64,
            max_tokens: p.fields.max_tokens.map(u64::from),
            model: &p.fields.model,
            reasoning: p.fields.reasoning,
        })),
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
        Err(PoolError::Failed) => Err(ApiError::internal("preparing the request failed".into())),
    }
}

async fn handle(state: &Arc<GatewayState>, session: &mut Session, ctx: &mut Ctx) -> Result<(), ApiError> {
    let method = session.req_header().method.clone();
    let path = session.req_header().uri.path().to_owned();
    match (method.as_str(), path.as_str()) {
        ("POST", "/v1/chat/completions") | ("POST", "/v1/completions") => {}
        ("GET", "/v1/models") => return models(state, session, ctx).await,
        ("GET", "/health") => return plain_json(session, ctx, 200, "{\"status\":\"ok\"}").await,
        _ => return Err(ApiError::not_found_route(&path)),
    }
    let read_limit = state.cfg.request_read_timeout;
    let body = tokio::time::timeout(read_limit, read_body(session, state.cfg.max_body_bytes))
        .await
        .map_err(|_| ApiError::read_timeout(read_limit))??;
    let caller = caller_of(state, header(session, "authorization"))?;
    let chat = path == "/v1/chat/completions";
    // The salt keys the KV blocks: a header that is not text is refused here, as the worker would refuse it,
    // rather than routed unsalted and refused after admission.
    let cache_salt = match session.req_header().headers.get(CACHE_SALT_HEADER) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| ApiError::invalid(CACHE_SALT_HEADER, "the cache salt header is not text"))?
                .to_owned(),
        ),
    };
    let prep_headers =
        PrepHeaders { session: header(session, SESSION_HEADER).map(str::to_owned), cache_salt };
    let p = prepare_on_pool(state, chat, body, prep_headers, caller.clone(), true).await?;
    let model = p.fields.model.clone();
    let (class, class_name, configured_output) =
        choose_class(state, &p, &caller, header(session, CLASS_HEADER))?;
    let expected_output = state.expected_output(&class_name, configured_output);
    // Admission prices the request with a dry run of the routing decision: cost = predicted uncached prompt
    // tokens + max_tokens (or the class's expected output).
    let max_tokens = p.fields.max_tokens.map(u64::from);
    let kvgate_pool = state.pool_kind(&model) == WorkerKind::Kvgate;
    let ask = split_ask(state, kvgate_pool, max_tokens.unwrap_or(expected_output));
    let priced = {
        let reg = state.registry();
        state.router.dry_run_split(&reg, &p.route_input(), 1, ask.as_ref(), Instant::now())
    };
    let Some(priced) = priced else {
        return Err(ApiError::no_worker(&model));
    };
    let cost = (priced.uncached_tokens + max_tokens.unwrap_or(expected_output)) as f64;
    // The most a pod's usage is believed: the prompt and the output the request may have had (the context left
    // without max_tokens, where the context length is known).
    let output_cap = max_tokens.or(p.max_model_len.map(u64::from)).unwrap_or(1 << 24);
    let cap = (p.ids.len() as u64).saturating_add(output_cap);
    ctx.class = class_name.clone();
    let admitted =
        unless_client_leaves(session, state.admission.admit(class, Some(&caller.tenant), cost)).await;
    let Some(permit) = admitted else {
        ctx.status = CLIENT_CLOSED;
        return Ok(());
    };
    let permit = permit.map_err(ApiError::rejected)?;
    ctx.admission_wait = permit.waited;
    // Decide on the registry as it is after the wait, and record the send to the pick, under one short lock.
    let decided_at = Instant::now();
    let routed = {
        let mut reg = state.registry();
        let input = p.route_input();
        state.router.route_split(&mut reg, &input, state.cfg.max_attempts, ask.as_ref(), Instant::now())
    };
    metrics::histogram!("kvgate_gateway_decision_seconds").record(decided_at.elapsed().as_secs_f64());
    let Some(routed) = routed else {
        return Err(ApiError::no_worker(&model));
    };
    count_split(state, &routed);
    if let Some(t) = routed.candidates.first() {
        let tokens = if routed.is_split() { 0 } else { routed.uncached_tokens };
        state.share_send(&t.id, &p.hashes, tokens, p.session_key);
    }
    if let Some(pf) = &routed.prefill {
        state.share_send(&pf.id, &p.hashes, routed.uncached_tokens, p.session_key);
    }
    // The pick's in-flight slot (and a split's prefill share) is given back on every path from here on.
    let mut first_guard = routed.ticket.map(|ticket| InflightGuard { state: state.clone(), ticket });
    let mut prefill_guard =
        routed.prefill_ticket.map(|ticket| InflightGuard { state: state.clone(), ticket });
    let split_peer = routed.split.as_ref().filter(|_| routed.is_split()).map(|s| s.peer.clone());
    let (uncached, predicted) = (routed.uncached_tokens, routed.predicted_cached_tokens);
    // Pods that are not kvgate workers get the client's headers (and `authorization` with
    // --forward-authorization); kvgate workers get the gateway's token and assertion instead.
    let forwarded = forwarded_headers(state, session, p.salt_rewritten, true);
    let to_kvgate = forwarded_headers(state, session, p.salt_rewritten, false);
    // The prompt handoff for kvgate workers whose tokenizer is the gateway's: the ids computed here, so the worker
    // does not tokenize again.
    let handoff = handoff(state, &p);
    let output = max_tokens.unwrap_or(expected_output);
    let mut reason = if routed.is_split() { RouteReason::Split } else { routed.reason };
    let mut refused_for: Option<Duration> = None;
    for (attempt, t) in routed.candidates.iter().enumerate() {
        let guard = if attempt == 0 {
            first_guard.take()
        } else {
            // A fallback serves the request whole: a split's prefill share is given back.
            prefill_guard.take();
            reason = RouteReason::Fallback;
            let mut reg = state.registry();
            let ticket = reg.find(t.wref).map(|i| reg.record_sent(i, &p.hashes, uncached, Instant::now()));
            drop(reg);
            if ticket.is_some() {
                state.share_send(&t.id, &p.hashes, uncached, p.session_key);
            }
            ticket.map(|ticket| InflightGuard { state: state.clone(), ticket })
        };
        let Some(guard) = guard else {
            continue; // forgotten since the decision
        };
        ctx.route = reason.as_str();
        // The pick's uncached prompt was predicted; a fallback's is not known: its whole prompt (and its
        // first-byte budget is the whole prompt's, not the pick's).
        let uncached_here = if attempt == 0 { uncached } else { p.ids.len() as u64 };
        let first_byte = state.cfg.first_byte.for_request(uncached_here, output, p.fields.stream);
        let split_here = split_peer.as_deref().filter(|_| attempt == 0);
        let ids = handoff.as_ref().filter(|_| t.reports && t.fingerprint_ok);
        let body = ids.map_or(&p.body, |(body, _)| body);
        let headers = match state.cfg.report_secret.as_deref() {
            Some(secret) if kvgate_pool => {
                let mut h = to_kvgate.clone();
                h.extend(gateway_headers(secret, &p, ids.map(|(_, enc)| enc.as_str())));
                h.extend(split_here.map_or_else(Vec::new, |peer| split_headers(secret, &model, peer)));
                h
            }
            _ => forwarded.clone(),
        };
        let a = Attempt {
            url: &t.url,
            path: &path,
            body,
            headers: &headers,
            worker_id: &t.id,
            reason,
            class: &class_name,
            admission_wait: ctx.admission_wait,
            first_byte_timeout: first_byte,
            idle_timeout: state.cfg.stream_idle_timeout,
            strip_usage: p.strip_usage,
        };
        let outcome = forward(state, session, &a).await;
        drop(guard);
        match outcome {
            Outcome::Responded { status, usage, tokens_sent, whole, completed, stalled } => {
                ctx.status = status;
                if stalled {
                    state.registry().record_fault(t.wref, Fault::Timeout, Instant::now());
                }
                if let Some(u) = &usage {
                    metrics::counter!("kvgate_gateway_reported_cached_tokens_total").increment(u.cached);
                    metrics::counter!("kvgate_gateway_predicted_cached_tokens_total")
                        .increment(predicted as u64);
                }
                if (200..300).contains(&status) {
                    if let (Some(u), true, None) = (&usage, completed, max_tokens) {
                        state.learn_output(&class_name, u.completion);
                    }
                    // A whole (not streamed) answer was computed before it was sent, however it ended.
                    let computed = completed || whole;
                    permit.reconcile(charge(cost, uncached_here, usage, tokens_sent, computed, cap));
                    if !completed {
                        metrics::counter!("kvgate_gateway_class_partial_charges_total", "class" => class_name.clone())
                            .increment(1);
                    }
                }
                // An error answer drops the permit: a full refund (the worker computed nothing).
                return Ok(());
            }
            Outcome::ConnectFailed(e) => {
                tracing::warn!(worker = %t.id, error = %e, "no response; trying the next worker");
                state.registry().record_fault(t.wref, Fault::Refused, Instant::now());
            }
            Outcome::Refused { code, retry_after } => {
                tracing::info!(worker = %t.id, %code, ?retry_after, "worker refused; trying the next worker");
                state.registry().record_busy(t.wref, Instant::now() + retry_after);
                refused_for = Some(refused_for.map_or(retry_after, |r| r.min(retry_after)));
            }
            Outcome::TimedOut => {
                tracing::warn!(worker = %t.id, after = ?first_byte, "first-byte timeout: worker suspect");
                state.registry().record_fault(t.wref, Fault::Timeout, Instant::now());
                // The worker had the request: its prefill is charged.
                permit.reconcile(uncached_here as f64);
                return Err(ApiError::upstream_timeout(&t.id, first_byte));
            }
            Outcome::ClientGone => {
                ctx.status = CLIENT_CLOSED;
                // A stream's first token was not out yet: its prefill. A whole answer may have been all but done
                // when the client left: its price.
                permit.reconcile(if p.fields.stream { uncached_here as f64 } else { cost });
                metrics::counter!("kvgate_gateway_class_partial_charges_total", "class" => class_name.clone())
                    .increment(1);
                return Ok(());
            }
            Outcome::Failed(e) => return Err(e),
        }
    }
    match refused_for {
        Some(r) => Err(ApiError::all_refused(&model, r.as_secs_f64().ceil() as u32)),
        None => Err(ApiError::no_worker(&model)),
    }
}

/// What a request may be split by: the split policy and settings, when the model's pool is kvgate workers and
/// the gateway holds the report secret (the grant is signed with it). `output`: the expected output tokens.
fn split_ask(state: &GatewayState, kvgate_pool: bool, output: u64) -> Option<SplitAsk<'_>> {
    state.cfg.report_secret.as_ref()?;
    kvgate_pool.then(|| SplitAsk {
        policy: state.split.as_ref(),
        settings: state.cfg.split,
        expected_output: output,
    })
}

/// Counts a considered split by outcome and logs its terms.
fn count_split(state: &GatewayState, routed: &kvgate_router::route::Routed) {
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

/// The decode worker's headers of a split: the prefill peer and the gateway's grant for it.
fn split_headers(secret: &str, model: &str, peer: &str) -> Vec<(HeaderName, HeaderValue)> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let grant = handoff::sign_prefill_grant(secret, now_ms, model, peer);
    [(handoff::PREFILL_PEER_HEADER, peer.to_owned()), (handoff::PREFILL_GRANT_HEADER, grant)]
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
fn handoff(state: &GatewayState, p: &PreparedRequest) -> Option<(Bytes, String)> {
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
fn gateway_headers(secret: &str, p: &PreparedRequest, ids: Option<&str>) -> Vec<(HeaderName, HeaderValue)> {
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
fn forwarded_headers(
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
struct InflightGuard {
    state: Arc<GatewayState>,
    ticket: crate::registry::SentTicket,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.state.registry().record_done(self.ticket);
    }
}

async fn plain_json(session: &mut Session, ctx: &mut Ctx, status: u16, body: &str) -> Result<(), ApiError> {
    ctx.status = status;
    let io = |e: Box<pingora::Error>| ApiError::internal(e.to_string());
    let mut h = ResponseHeader::build(status, Some(2)).map_err(io)?;
    h.insert_header("content-type", "application/json").map_err(io)?;
    h.insert_header("content-length", body.len().to_string()).map_err(io)?;
    session.write_response_header(Box::new(h), false).await.map_err(io)?;
    session.write_response_body(Some(Bytes::from(body.to_owned())), true).await.map_err(io)
}

async fn models(state: &GatewayState, session: &mut Session, ctx: &mut Ctx) -> Result<(), ApiError> {
    let (names, reg_lens): (Vec<String>, Vec<Option<u32>>) = {
        let reg = state.registry();
        let names = reg.models(Instant::now());
        let lens = names.iter().map(|m| reg.max_model_len(m)).collect();
        (names, lens)
    };
    let list = ModelList {
        object: "list".into(),
        data: names
            .into_iter()
            .zip(reg_lens)
            .map(|(id, max_model_len)| ModelCard {
                id,
                object: "model".into(),
                created: 0,
                owned_by: "kvgate".into(),
                max_model_len,
                device: None,
                role: None,
            })
            .collect(),
    };
    let body = serde_json::to_string(&list).map_err(|e| ApiError::internal(e.to_string()))?;
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
