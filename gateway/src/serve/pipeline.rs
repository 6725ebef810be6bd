//! A completion request's path through the gateway as a staged pipeline of types, each stage short and named for
//! what it adds, so a second leg or a new check is a stage's choice rather than another branch in one function:
//!
//! 1. [`prepare`] -> [`Prepared`]: the body within `--max-body-bytes` (413) and `--request-read-timeout` (408), the
//!    caller from its API key, the prompt parsed, rendered, tokenized and hashed on the tokenize pool;
//! 2. [`price`] -> [`Priced`]: the class (server rules, or `x-kvgate-class` for callers allowed to choose it), the
//!    expected output (`max_tokens`, else the class's learned estimate), the split the request may get, and the
//!    price from a dry run of the routing decision (explain runs stages 1 and 2 and shows the dry run);
//! 3. [`admit`] -> [`Admitted`]: the class budget's permit (429), noticing a client that leaves meanwhile;
//! 4. [`route`] -> [`RoutedRequest`]: decided again on the registry as it is after the wait, the send recorded
//!    under one lock (`kvgate_router::route`), local or split (the split policy's choice), guards that give the
//!    in-flight slots back on every path;
//! 5. [`forward`]: the candidates in rank order (a split's decode worker, then fallbacks, each recorded through the
//!    router, `Router::record_fallback`, with its own uncached count: its first-byte budget and charge) until one
//!    answers; a fallback that can import keeps the split's prefill peer (P's prefix cache holds the prompt by
//!    then), any other serves the request whole; the answer settles the permit (`proxy::charge`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use kvgate_router::route::{Candidate, Routed};
use kvgate_router::split::plan::{can_import, SplitAsk};
use kvgate_shared::handoff;
use kvgate_shared::trace::Value;
use pingora::proxy::Session;

use crate::admission::{ClassInput, Permit, CLASS_HEADER};
use crate::config::WorkerKind;
use crate::control::keys::Caller;
use crate::errors::{ApiError, GatewayErrors};
use crate::registry::Fault;
use crate::routing::RouteReason;
use crate::serve::meter::UsageSeen;
use crate::serve::prepare::{PrepHeaders, PreparedRequest, CACHE_SALT_HEADER, SESSION_HEADER};
use crate::serve::proxy::{self, Ctx, InflightGuard, CLIENT_CLOSED};
use crate::serve::upstream::{unless_client_leaves, Attempt, Outcome};
use crate::state::GatewayState;

/// Stage 1: a request read and prepared.
pub struct Prepared {
    pub p: PreparedRequest,
    pub caller: Arc<Caller>,
    pub path: String,
}

/// Stage 2: its class, expected output, price and the split it may get.
pub struct Priced<'s> {
    pub class: usize,
    pub class_name: String,
    pub max_tokens: Option<u64>,
    /// `max_tokens`, else the class's expected output.
    pub output: u64,
    /// What admission reserves: predicted uncached prompt + output.
    pub cost: f64,
    /// The most a pod's usage is believed: the prompt and the output the request may have had.
    pub cap: u64,
    pub kvgate_pool: bool,
    pub ask: Option<SplitAsk<'s>>,
    /// The dry run that priced it.
    pub dry: Routed,
}

/// Stage 3: admitted.
pub struct Admitted<'s> {
    pub priced: Priced<'s>,
    pub permit: Permit,
}

/// Stage 4: routed, with the guards of the sends it recorded.
pub struct RoutedRequest {
    pub routed: Routed,
    first: Option<InflightGuard>,
    prefill: Option<InflightGuard>,
}

pub(crate) fn header<'a>(session: &'a Session, name: &str) -> Option<&'a str> {
    session.req_header().headers.get(name).and_then(|v| v.to_str().ok())
}

/// Stage 1.
pub async fn prepare(
    state: &Arc<GatewayState>,
    session: &mut Session,
    path: &str,
) -> Result<Prepared, ApiError> {
    let (body, caller, cache_salt) = read_request(state, session).await?;
    let headers = PrepHeaders { session: header(session, SESSION_HEADER).map(str::to_owned), cache_salt };
    let chat = path == "/v1/chat/completions";
    let p = proxy::prepare_on_pool(state, chat, body, headers, caller.clone(), true).await?;
    Ok(Prepared { p, caller, path: path.to_owned() })
}

/// What every request the proxy serves reads first: its body (within `--max-body-bytes` and
/// `--request-read-timeout`), its caller (from its API key) and its cache salt header. The salt keys the KV blocks:
/// a header that is not text is refused here, as the worker would refuse it, rather than routed unsalted and refused
/// after admission.
pub(crate) async fn read_request(
    state: &Arc<GatewayState>,
    session: &mut Session,
) -> Result<(Bytes, Arc<Caller>, Option<String>), ApiError> {
    let read_limit = state.cfg.request_read_timeout;
    let body = tokio::time::timeout(read_limit, proxy::read_body(session, state.cfg.max_body_bytes))
        .await
        .map_err(|_| ApiError::read_timeout(read_limit))??;
    let caller = proxy::caller_of(state, header(session, "authorization"))?;
    let cache_salt = match session.req_header().headers.get(CACHE_SALT_HEADER) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| ApiError::invalid(CACHE_SALT_HEADER, "the cache salt header is not text"))?
                .to_owned(),
        ),
    };
    Ok((body, caller, cache_salt))
}

/// Stage 2 (explain runs it too, with `max_candidates` for the whole ranking). `header_class`: the
/// `x-kvgate-class` header.
pub fn price<'s>(
    state: &'s GatewayState,
    p: &PreparedRequest,
    caller: &Caller,
    header_class: Option<&str>,
    max_candidates: usize,
) -> Result<Priced<'s>, ApiError> {
    let input = ClassInput {
        prompt_tokens: p.ids.len() as u64,
        max_tokens: p.fields.max_tokens.map(u64::from),
        model: &p.fields.model,
        reasoning: p.fields.reasoning,
    };
    let (class, class_name, configured) = proxy::choose_class(state, &input, caller, header_class)?;
    let max_tokens = p.fields.max_tokens.map(u64::from);
    // The budget reserves what the request may produce (its max_tokens); the split is priced with what it
    // probably will (the class's learned output, capped by max_tokens).
    let output = max_tokens.unwrap_or_else(|| state.expected_output(&class_name, None, configured));
    let kvgate_pool = state.pool_kind(&p.fields.model) == WorkerKind::Kvgate;
    let ask = state.cfg.report_secret.as_ref().filter(|_| kvgate_pool).map(|_| SplitAsk {
        policy: state.split.as_ref(),
        settings: state.cfg.split,
        expected_output: state.expected_output(&class_name, max_tokens, configured),
    });
    let dry = {
        let reg = state.registry();
        state.router.dry_run_split(&reg, &p.route_input(), max_candidates, ask.as_ref(), Instant::now())
    };
    let dry = dry.ok_or_else(|| ApiError::no_worker(&p.fields.model))?;
    let cost = (dry.uncached_tokens + output) as f64;
    let output_cap = max_tokens.or(p.max_model_len.map(u64::from)).unwrap_or(1 << 24);
    let cap = (p.ids.len() as u64).saturating_add(output_cap);
    Ok(Priced { class, class_name, max_tokens, output, cost, cap, kvgate_pool, ask, dry })
}

/// Stage 3: `None` when the client left while waiting.
pub async fn admit<'s>(
    state: &GatewayState,
    session: &mut Session,
    caller: &Caller,
    priced: Priced<'s>,
) -> Result<Option<Admitted<'s>>, ApiError> {
    let waiting = state.admission.admit(priced.class, Some(&caller.tenant), priced.cost);
    let Some(permit) = unless_client_leaves(session, waiting).await else { return Ok(None) };
    let permit = permit.map_err(ApiError::rejected)?;
    Ok(Some(Admitted { priced, permit }))
}

/// Stage 4.
pub fn route(
    state: &Arc<GatewayState>,
    prep: &Prepared,
    a: &Admitted<'_>,
) -> Result<RoutedRequest, ApiError> {
    let p = &prep.p;
    let decided_at = Instant::now();
    let routed = {
        let mut reg = state.registry();
        let input = p.route_input();
        state.router.route_split(
            &mut reg,
            &input,
            state.cfg.max_attempts,
            a.priced.ask.as_ref(),
            Instant::now(),
        )
    };
    metrics::histogram!("kvgate_gateway_decision_seconds").record(decided_at.elapsed().as_secs_f64());
    let routed = routed.ok_or_else(|| ApiError::no_worker(&p.fields.model))?;
    proxy::count_split(state, &routed);
    if let Some(t) = routed.candidates.first() {
        let tokens = if routed.is_split() { 0 } else { routed.uncached_tokens };
        state.share_send(&t.id, &p.hashes, tokens, p.session_key);
    }
    if let Some(pf) = &routed.prefill {
        state.share_send(&pf.id, &p.hashes, routed.uncached_tokens, p.session_key);
    }
    let guard = |ticket| InflightGuard { state: state.clone(), ticket };
    let first = routed.ticket.map(guard);
    let prefill = routed.prefill_ticket.map(guard);
    Ok(RoutedRequest { routed, first, prefill })
}

/// What every attempt of one request shares: its headers for kvgate workers and for other pods, the handoff.
struct Outbound {
    forwarded: Vec<(HeaderName, HeaderValue)>,
    to_kvgate: Vec<(HeaderName, HeaderValue)>,
    handoff: Option<(Bytes, String)>,
}

impl Outbound {
    fn new(state: &GatewayState, session: &Session, p: &PreparedRequest) -> Self {
        // Pods that are not kvgate workers get the client's headers (and `authorization` with
        // --forward-authorization); kvgate workers get the gateway's token and assertion instead, and the ids
        // computed here when their tokenizer is the gateway's.
        Self {
            forwarded: proxy::forwarded_headers(state, session, p.salt_rewritten, true),
            to_kvgate: proxy::forwarded_headers(state, session, p.salt_rewritten, false),
            handoff: proxy::handoff(state, p),
        }
    }

    /// The body and headers for candidate `t`; `split_peer`: the prefill peer of a split's decode worker.
    fn for_candidate<'a>(
        &'a self,
        state: &GatewayState,
        p: &'a PreparedRequest,
        t: &Candidate,
        kvgate_pool: bool,
        split_peer: Option<&str>,
    ) -> (&'a Bytes, Vec<(HeaderName, HeaderValue)>) {
        let ids = self.handoff.as_ref().filter(|_| t.reports && t.fingerprint_ok);
        let body = ids.map_or(&p.body, |(body, _)| body);
        let headers = match state.cfg.report_secret.as_deref() {
            Some(secret) if kvgate_pool => {
                let mut h = self.to_kvgate.clone();
                h.extend(proxy::gateway_headers(secret, p, ids.map(|(_, enc)| enc.as_str())));
                h.extend(split_peer.map_or_else(Vec::new, |peer| {
                    let g = handoff::GrantFor { model: &p.fields.model, peer, decode: &t.id, prompt: &p.ids };
                    proxy::split_headers(secret, &g)
                }));
                h
            }
            _ => self.forwarded.clone(),
        };
        (body, headers)
    }
}

/// Records a fallback's send through the router (its own uncached tokens, from its own prefix match) and shares
/// it; `None`: forgotten since the decision.
fn record_fallback(
    state: &Arc<GatewayState>,
    p: &PreparedRequest,
    t: &Candidate,
) -> Option<(InflightGuard, u64)> {
    let (ticket, uncached) = {
        let mut reg = state.registry();
        state.router.record_fallback(&mut reg, t, &p.route_input(), Instant::now())
    }?;
    state.share_send(&t.id, &p.hashes, uncached, p.session_key);
    Some((InflightGuard { state: state.clone(), ticket }, uncached))
}

/// Stage 5.
pub async fn forward(
    state: &Arc<GatewayState>,
    session: &mut Session,
    ctx: &mut Ctx,
    prep: &Prepared,
    a: Admitted<'_>,
    mut r: RoutedRequest,
) -> Result<(), ApiError> {
    let (p, priced) = (&prep.p, &a.priced);
    let mut permit = Some(a.permit);
    let out = Outbound::new(state, session, p);
    let routed = &r.routed;
    let split = routed.split.as_ref().filter(|_| routed.is_split());
    // What the split decision predicted for the option taken (the first attempt's; a fallback is not it), when
    // it had measured speeds to predict with.
    let predicted = routed.split.as_ref().filter(|s| s.speed_measured).map(|s| {
        let o = if routed.is_split() { s.decision.terms.split } else { s.decision.terms.local };
        (o.ttft_s, o.tpot_s)
    });
    let mut reason = if routed.is_split() { RouteReason::Split } else { routed.reason };
    let mut refused_for: Option<Duration> = None;
    for (attempt, t) in routed.candidates.iter().enumerate() {
        let guard = if attempt == 0 {
            r.first.take().map(|g| (g, routed.uncached_tokens))
        } else {
            // A fallback: a split's prefill share is given back (P has done it, or failed). Its uncached tokens
            // (its first-byte budget and charge) are its own, not the first pick's.
            r.prefill.take();
            reason = RouteReason::Fallback;
            record_fallback(state, p, t)
        };
        let Some((guard, uncached)) = guard else {
            continue; // forgotten since the decision
        };
        ctx.route = reason.as_str();
        let first_byte = state.cfg.first_byte.for_request(uncached, priced.output, p.fields.stream);
        // A split's decode leg retried on another worker that imports keeps the prefill peer: P holds the
        // prompt's KV in its prefix cache now, so the new decode worker fetches it instead of recomputing it (and
        // computes it itself if P has lost it meanwhile). Any other fallback serves the request whole.
        let peer = split
            .filter(|s| attempt == 0 || (t.id != s.prefill_worker && can_import(&state.registry(), t.wref)))
            .map(|s| s.peer.as_str());
        let (body, mut headers) = out.for_candidate(state, p, t, priced.kvgate_pool, peer);
        let trace = ctx.trace.as_ref().map(|r| r.attempt());
        headers.extend(trace.as_ref().and_then(|t| t.header()));
        let attempt_req = Attempt {
            url: &t.url,
            path: &prep.path,
            body,
            headers: &headers,
            worker_id: &t.id,
            reason,
            class: &priced.class_name,
            admission_wait: ctx.admission_wait,
            first_byte_timeout: first_byte,
            idle_timeout: state.cfg.stream_idle_timeout,
            strip_usage: p.strip_usage,
            trace: trace.as_ref(),
            predicted: predicted.filter(|_| attempt == 0),
        };
        let outcome = crate::serve::upstream::forward(state, session, &attempt_req).await;
        drop(guard);
        if let Some(tr) = trace {
            tr.finish(&state.tracer, &t.id, reason.as_str(), outcome.name(), outcome.status());
        }
        ctx.worker = Some(t.id.clone());
        let s =
            Settle { state, p, priced, t, uncached, first_byte, predicted: routed.predicted_cached_tokens };
        if let Some(done) = s.settle(ctx, outcome, &mut permit, &mut refused_for) {
            return done;
        }
    }
    let model = &p.fields.model;
    match refused_for {
        Some(r) => Err(ApiError::all_refused(model, r.as_secs_f64().ceil() as u32)),
        None => Err(ApiError::no_worker(model)),
    }
}

/// Longest silence between two logged prompt-length mismatches (`kvgate_gateway_prompt_token_mismatches_total`
/// counts every one).
pub const MISMATCH_LOG_EVERY: Duration = Duration::from_secs(60);

/// The prompt the gateway tokenized against the prompt tokens the worker says it computed: a difference means the
/// gateway's chat template or tokenizer drifted from the pod's, and so its block hashes (a template change on the
/// pods, a tokenizer directory that is not theirs). Counted per model; logged at most every [`MISMATCH_LOG_EVERY`].
fn check_prompt_length(p: &PreparedRequest, usage: &UsageSeen, worker: &str) {
    if !p.tokenized || usage.prompt == p.ids.len() as u64 {
        return;
    }
    metrics::counter!("kvgate_gateway_prompt_token_mismatches_total", "model" => p.fields.model.clone())
        .increment(1);
    static LAST_LOG: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
    let mut last = LAST_LOG.lock().unwrap_or_else(|e| e.into_inner());
    if last.is_none_or(|t| t.elapsed() >= MISMATCH_LOG_EVERY) {
        *last = Some(Instant::now());
        tracing::warn!(model = %p.fields.model, %worker, gateway = p.ids.len(), worker_reported = usage.prompt,
            "prompt token count differs from the worker's: the gateway's chat template or tokenizer is not the pod's");
    }
}

/// One attempt's answer, settled: the permit reconciled with what was computed (module docs of `proxy`,
/// "Charging"), the worker's faults recorded.
struct Settle<'a> {
    state: &'a GatewayState,
    p: &'a PreparedRequest,
    priced: &'a Priced<'a>,
    t: &'a Candidate,
    uncached: u64,
    first_byte: Duration,
    predicted: usize,
}

impl Settle<'_> {
    /// `Some`: the request is over (the permit taken); `None`: try the next candidate (the permit kept).
    fn settle(
        &self,
        ctx: &mut Ctx,
        outcome: Outcome,
        permit: &mut Option<Permit>,
        refused_for: &mut Option<Duration>,
    ) -> Option<Result<(), ApiError>> {
        let (state, t, priced) = (self.state, self.t, self.priced);
        let partial = || {
            metrics::counter!("kvgate_gateway_class_partial_charges_total", "class" => priced.class_name.clone())
                .increment(1)
        };
        match outcome {
            Outcome::Responded { status, usage, tokens_sent, whole, completed, stalled } => {
                ctx.status = status;
                if stalled {
                    state.registry().record_fault(t.wref, Fault::Timeout, Instant::now());
                }
                if let Some(u) = &usage {
                    metrics::counter!("kvgate_gateway_reported_cached_tokens_total").increment(u.cached);
                    metrics::counter!("kvgate_gateway_predicted_cached_tokens_total")
                        .increment(self.predicted as u64);
                    check_prompt_length(self.p, u, &t.id);
                }
                let permit = permit.take()?;
                if (200..300).contains(&status) {
                    // The pod has the prompt's KV now (an approximate index credits it only on success).
                    state.registry().record_served(t.wref, &self.p.hashes);
                    if let (Some(u), true) = (&usage, completed) {
                        state.learn_output(&priced.class_name, u.completion);
                    }
                    // A whole (not streamed) answer was computed before it was sent, however it ended.
                    let computed = completed || whole;
                    permit.reconcile(proxy::charge(
                        priced.cost,
                        self.uncached,
                        usage,
                        tokens_sent,
                        computed,
                        priced.cap,
                    ));
                    if !completed {
                        partial();
                    }
                }
                // An error answer drops the permit: a full refund (the worker computed nothing).
                Some(Ok(()))
            }
            Outcome::ConnectFailed(e) => {
                tracing::warn!(worker = %t.id, error = %e, "no response; trying the next worker");
                state.registry().record_fault(t.wref, Fault::Refused, Instant::now());
                None
            }
            Outcome::Refused { code, retry_after } => {
                tracing::info!(worker = %t.id, %code, ?retry_after, "worker refused; trying the next worker");
                state.registry().record_busy(t.wref, Instant::now() + retry_after);
                *refused_for = Some(refused_for.map_or(retry_after, |r| r.min(retry_after)));
                None
            }
            Outcome::TimedOut => {
                tracing::warn!(worker = %t.id, after = ?self.first_byte, "first-byte timeout: worker suspect");
                state.registry().record_fault(t.wref, Fault::Timeout, Instant::now());
                // The worker had the request: its prefill is charged.
                permit.take()?.reconcile(self.uncached as f64);
                Some(Err(ApiError::upstream_timeout(&t.id, self.first_byte)))
            }
            Outcome::ClientGone => {
                ctx.status = CLIENT_CLOSED;
                // A stream's first token was not out yet: its prefill. A whole answer may have been all but done
                // when the client left: its price.
                let charge = if self.p.fields.stream { self.uncached as f64 } else { priced.cost };
                permit.take()?.reconcile(charge);
                partial();
                Some(Ok(()))
            }
            Outcome::Failed(e) => Some(Err(e)),
        }
    }
}

/// The whole path of a completion request (stages 1 to 5).
pub async fn serve(
    state: &Arc<GatewayState>,
    session: &mut Session,
    ctx: &mut Ctx,
    path: &str,
) -> Result<(), ApiError> {
    // Stage spans, built only when the request is traced (no per-request cost otherwise).
    let stage = |ctx: &Ctx, name, start, attrs: &dyn Fn() -> Vec<(&'static str, Value)>| {
        if let Some(t) = &ctx.trace {
            t.stage(&state.tracer, name, start, attrs);
        }
    };
    let t0 = Instant::now();
    let prep = prepare(state, session, path).await?;
    stage(ctx, "prepare", t0, &|| {
        vec![
            ("gen_ai.request.model", Value::from(prep.p.fields.model.as_str())),
            ("kvgate.prompt_tokens", Value::from(prep.p.ids.len() as u64)),
        ]
    });
    let t1 = Instant::now();
    let priced = price(state, &prep.p, &prep.caller, header(session, CLASS_HEADER), 1)?;
    ctx.class = priced.class_name.clone();
    let Some(admitted) = admit(state, session, &prep.caller, priced).await? else {
        ctx.status = CLIENT_CLOSED;
        return Ok(());
    };
    ctx.admission_wait = admitted.permit.waited;
    stage(ctx, "admit", t1, &|| vec![("kvgate.class", Value::from(ctx.class.as_str()))]);
    let t2 = Instant::now();
    let routed = route(state, &prep, &admitted)?;
    stage(ctx, "route", t2, &|| {
        let r = &routed.routed;
        let picked = r.candidates.first().map_or("", |c| c.id.as_str());
        let reason = if r.is_split() { RouteReason::Split } else { r.reason };
        vec![("kvgate.worker", Value::from(picked)), ("kvgate.route", Value::from(reason.as_str()))]
    });
    forward(state, session, ctx, &prep, admitted, routed).await
}
