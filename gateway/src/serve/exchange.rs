//! One exchange: a proxied request's walk through the gateway, written once for every endpoint it serves. Each
//! stage is a function from one typed value (`stages.rs`) to the next, with its limit and its error:
//!
//! 1. **read**: the body within `--max-body-bytes` (413) and `--request-read-timeout` (408);
//! 2. **identify** -> [`Incoming`]: the caller from its API key (401 with `--require-api-key`), the headers the later
//!    stages read (a cache salt header that is not text is refused here, as a worker would refuse it; explain runs
//!    this stage too, so it refuses the same);
//! 3. **prepare** -> [`Prepared`]: the [`Endpoint`]'s own step: completions and chat are parsed, rendered,
//!    tokenized and hashed on the tokenize pool (routed by prefix); the pass-through endpoints are parsed for their
//!    model and priced from their size (routed by load);
//! 4. **price** -> [`Priced`]: the class (server rules, or `x-kvgate-class` for callers allowed to choose it), the
//!    expected output, the split the request may get, and the price, from a dry run of the routing decision for a
//!    prefix-routed request (explain runs stages 2 to 4 and shows the dry run);
//! 5. **admit** -> [`Admitted`]: the class budget's permit (429), noticing a client that leaves meanwhile;
//! 6. **place** (`adapters.rs`, LoRA adapter requests only): the adapter loaded first where placement says, the
//!    request then pinned to that worker;
//! 7. **route** -> [`RoutedRequest`]: decided again on the registry as it is after the wait, the send recorded under
//!    one lock (`kvgate_router::route`), local or split (the split policy's choice), guards that give the in-flight
//!    slots back on every path;
//! 8. **attempts** (`attempts.rs`): the candidates in rank order until one answers (`upstream/`);
//! 9. **settle** (`charge.rs`): each outcome reconciles the permit with what was computed.
//!
//! An endpoint differs in its prepare stage; after it, the stages branch on one thing only, whether the prepared
//! prompt was tokenized here (`Prepared::prompt`): then it is priced by a dry run, routed by prefix (a split
//! possible), its sends shared with the other replicas and its answer taught to the registry and the class's
//! learned output; else it is priced from its size and routed by load.
//!
//! A new endpoint is one [`Endpoint`] implementation; a new front end is one `Client` (`downstream.rs`) and a
//! `ServeHost` (`host.rs`), and may stop after **route** (an endpoint picker answers with the pick); one that
//! forwards is a `Downstream` and runs the attempts too (`serve`).

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvgate_router::split::plan::SplitAsk;
use kvgate_shared::trace::Value;

use crate::admission::ClassInput;
use crate::admission::CLASS_HEADER;
use crate::config::WorkerKind;
use crate::control::keys::Caller;
use crate::errors::{ApiError, GatewayErrors};
use crate::routing::RouteReason;
use crate::serve::adapters;
use crate::serve::attempts::Walk;
use crate::serve::downstream::{unless_client_leaves, Client, Downstream};
use crate::serve::host::{InflightGuard, ServeHost};
use crate::serve::outbound::FORWARDABLE;
use crate::serve::prepare::{CACHE_SALT_HEADER, SESSION_HEADER};
use crate::serve::stages::{Admitted, Ctx, Incoming, Prepared, Priced, RoutedRequest, CLIENT_CLOSED};

/// Output tokens a pod's usage is believed up to when neither the request nor the model's context bounds it.
pub const UNBOUNDED_OUTPUT_CAP: u64 = 1 << 24;

/// What one kind of request adds to the exchange: its prepare stage.
pub trait Endpoint: Sync {
    /// Stage 3: the body made ready for the stages after it (parse, check, price inputs; tokenize and hash if it is
    /// routed by prefix).
    fn prepare(
        &self,
        host: &Arc<dyn ServeHost>,
        incoming: &Incoming,
        body: Bytes,
    ) -> impl Future<Output = Result<Prepared, ApiError>> + Send;
}

/// Stage 2 (explain runs it with its own authorization header): who asked and the headers the stages read.
/// `header`: a request header's value.
pub fn identify<'h>(
    host: &dyn ServeHost,
    path: &str,
    authorization: Option<&str>,
    header: impl Fn(&str) -> Option<&'h hyper::header::HeaderValue>,
) -> Result<Incoming, ApiError> {
    static ANONYMOUS: std::sync::OnceLock<Arc<Caller>> = std::sync::OnceLock::new();
    let caller = match host.identify(authorization) {
        Some(c) => c,
        None if host.cfg().require_api_key => return Err(ApiError::missing_api_key()),
        None => ANONYMOUS.get_or_init(|| Arc::new(Caller::anonymous())).clone(),
    };
    let text = |name| header(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let cache_salt = match header(CACHE_SALT_HEADER) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| ApiError::invalid(CACHE_SALT_HEADER, "the cache salt header is not text"))?
                .to_owned(),
        ),
    };
    Ok(Incoming {
        path: path.to_owned(),
        caller,
        cache_salt,
        session: text(SESSION_HEADER),
        class: text(CLASS_HEADER),
        forwardable: FORWARDABLE.iter().filter_map(|n| Some((*n, header(n)?.clone()))).collect(),
        subset: None,
    })
}

/// Stages 1 and 2.
pub async fn read<C: Client>(
    host: &dyn ServeHost,
    down: &mut C,
    path: &str,
) -> Result<(Incoming, Bytes), ApiError> {
    let cfg = host.cfg();
    let body = tokio::time::timeout(cfg.request_read_timeout, down.read_body(cfg.max_body_bytes))
        .await
        .map_err(|_| ApiError::read_timeout(cfg.request_read_timeout))??;
    let incoming = identify(host, path, down.header_str("authorization"), |n| down.header(n))?;
    Ok((incoming, body))
}

/// A request's class: the server's rules, or the one named in `x-kvgate-class` if the caller may choose it.
fn choose_class(
    host: &dyn ServeHost,
    input: &ClassInput<'_>,
    caller: &Caller,
    header_class: Option<&str>,
) -> Result<(usize, String, u64), ApiError> {
    match header_class.map(str::trim).filter(|h| !h.is_empty()) {
        Some(name) if caller.classes.iter().any(|c| c == name) => {
            host.admission().class_by_name(name).ok_or_else(|| ApiError::unknown_class(name))
        }
        Some(name) => Err(ApiError::class_not_allowed(name)),
        None => Ok(host.admission().classify(input)),
    }
}

/// Stage 4 (explain runs it too, with `max_candidates` for the whole ranking).
pub fn price<'s>(
    host: &'s dyn ServeHost,
    prep: &Prepared,
    incoming: &Incoming,
    max_candidates: usize,
) -> Result<Priced<'s>, ApiError> {
    let cfg = host.cfg();
    let choices = prep.choices.max(1);
    let input = ClassInput {
        prompt_tokens: prep.prompt_tokens,
        // All choices' output: `n` cannot make a long request look short.
        max_tokens: prep.max_output.map(|m| m.saturating_mul(choices)),
        model: &prep.model,
        reasoning: prep.reasoning,
    };
    let (class, class_name, configured) =
        choose_class(host, &input, &incoming.caller, incoming.class.as_deref())?;
    let learned = host.learned_outputs();
    // The budget reserves what the request may produce (its max_tokens); the split is priced with what it
    // probably will (the class's learned output, capped by max_tokens).
    let per_choice = match prep.max_output {
        Some(m) => m,
        None if prep.generates => learned.expected(&class_name, None, configured),
        None => 0,
    };
    let output = per_choice.saturating_mul(choices);
    let kvgate_pool = cfg.pool_kind(prep.route_input().model) == WorkerKind::Kvgate;
    let tokenized = prep.prompt.is_some();
    // An adapter request may be split too: its candidates are the adapter's holders (`route.rs`), so both sides
    // hold it, and its key travels in the transfer's keys.
    let adapter = prep.prompt.as_ref().and_then(|p| p.adapter.as_ref());
    let likely = learned.expected(&class_name, prep.max_output, configured);
    let likely_output = likely.saturating_mul(choices);
    let slo = host.admission().class_slo(class);
    let ask = cfg.report_secret.as_ref().filter(|_| kvgate_pool && tokenized).map(|_| SplitAsk {
        policy: host.split_policy(),
        settings: cfg.split,
        expected_output: likely,
    });
    let (uncached, dry) = match tokenized {
        false => (prep.prompt_tokens, None),
        true => {
            let dry = {
                let reg = host.registry();
                host.router().dry_run_split(
                    &reg,
                    &incoming.within(prep.route_input()).with_goal(likely_output, slo),
                    max_candidates,
                    ask.as_ref(),
                    Instant::now(),
                )
            };
            match dry {
                Some(dry) => (dry.uncached_tokens, Some(dry)),
                // An adapter no healthy worker holds yet: the placement stage loads it (a fresh load holds no
                // prefix), or answers why it cannot.
                None if adapter.is_some() => (prep.prompt_tokens, None),
                None => return Err(ApiError::no_worker(&prep.model)),
            }
        }
    };
    let cost = uncached.saturating_add(output) as f64;
    let output_cap = match prep.generates {
        true => prep.max_output.or(prep.max_model_len.map(u64::from)).unwrap_or(UNBOUNDED_OUTPUT_CAP),
        false => 0,
    };
    let cap = prep.prompt_cap.saturating_add(output_cap.saturating_mul(choices));
    Ok(Priced {
        class,
        class_name,
        output,
        output_cap,
        choices,
        cost,
        likely_output,
        slo,
        cap,
        kvgate_pool,
        ask,
        dry,
    })
}

/// Stage 5: `None` when the client left while waiting.
pub async fn admit<'s, C: Client>(
    host: &dyn ServeHost,
    down: &mut C,
    caller: &Caller,
    priced: Priced<'s>,
) -> Result<Option<Admitted<'s>>, ApiError> {
    let waiting = host.admission().admit(priced.class, Some(&caller.tenant), priced.cost);
    let Some(permit) = unless_client_leaves(down, waiting).await else { return Ok(None) };
    let permit = permit.map_err(ApiError::rejected)?;
    Ok(Some(Admitted { priced, permit }))
}

/// Stage 6.
pub fn route(
    host: &Arc<dyn ServeHost>,
    incoming: &Incoming,
    prep: &Prepared,
    a: &Admitted<'_>,
) -> Result<RoutedRequest, ApiError> {
    let input = incoming.within(prep.route_input()).with_goal(a.priced.likely_output, a.priced.slo);
    let max = host.cfg().max_attempts;
    let decided_at = Instant::now();
    let routed = {
        let mut reg = host.registry();
        match prep.prompt {
            Some(_) => {
                host.router().route_split(&mut reg, &input, max, a.priced.ask.as_ref(), Instant::now())
            }
            None => host.router().route_by_load(&mut reg, &input, max, Instant::now()),
        }
    };
    if prep.prompt.is_some() {
        metrics::histogram!("kvgate_gateway_decision_seconds").record(decided_at.elapsed().as_secs_f64());
    }
    let routed = routed.ok_or_else(|| ApiError::no_worker(&prep.model))?;
    if prep.prompt.is_some() {
        count_split(host.as_ref(), &routed);
        if let Some(t) = routed.candidates.first() {
            let tokens = if routed.is_split() { 0 } else { routed.uncached_tokens };
            host.share_send(&t.id, input.hashes, tokens, input.session_key);
        }
        if let Some(pf) = &routed.prefill {
            host.share_send(&pf.id, input.hashes, routed.uncached_tokens, input.session_key);
        }
    }
    let first = routed.ticket.map(|t| InflightGuard::new(host, t));
    let prefill = routed.prefill_ticket.map(|t| InflightGuard::new(host, t));
    Ok(RoutedRequest { routed, first, prefill })
}

/// Counts a considered split by outcome and logs its terms.
fn count_split(host: &dyn ServeHost, routed: &kvgate_router::route::Routed) {
    let Some(s) = &routed.split else { return };
    let d = &s.decision;
    let policy = host.split_policy().name();
    metrics::counter!("kvgate_gateway_split_decisions_total", "policy" => policy,
        "choice" => d.choice.as_str(), "reason" => d.reason)
    .increment(1);
    if routed.is_split() {
        metrics::counter!("kvgate_gateway_split_transfer_bytes_total")
            .increment(d.terms.transfer_bytes as u64);
    }
    tracing::debug!(policy, choice = d.choice.as_str(), reason = d.reason,
        prefill = %s.prefill_worker, decode = %s.decode_worker, peer = %s.peer, bandwidth_measured = s.bandwidth_measured,
        terms = ?d.terms, input = ?s.input, "split considered");
}

/// The whole exchange of one request at `path` for `endpoint` (stages 1 to 9).
pub async fn serve<D: Downstream, E: Endpoint>(
    host: &Arc<dyn ServeHost>,
    down: &mut D,
    ctx: &mut Ctx,
    endpoint: &E,
    path: &str,
) -> Result<(), ApiError> {
    // Stage spans, built only when the request is traced (no per-request cost otherwise).
    let stage = |ctx: &Ctx, name, start, attrs: &dyn Fn() -> Vec<(&'static str, Value)>| {
        if let Some(t) = &ctx.trace {
            t.stage(host.tracer(), name, start, attrs);
        }
    };
    let t0 = Instant::now();
    let (mut incoming, body) = read(host.as_ref(), down, path).await?;
    let prep = endpoint.prepare(host, &incoming, body).await?;
    stage(ctx, "prepare", t0, &|| {
        vec![
            ("gen_ai.request.model", Value::from(prep.model.as_str())),
            ("kvgate.prompt_tokens", Value::from(prep.prompt_tokens)),
        ]
    });
    let t1 = Instant::now();
    let priced = price(host.as_ref(), &prep, &incoming, 1)?;
    ctx.class = priced.class_name.clone();
    let Some(admitted) = admit(host.as_ref(), down, &incoming.caller, priced).await? else {
        ctx.status = CLIENT_CLOSED;
        return Ok(());
    };
    ctx.admission_wait = admitted.permit.waited;
    stage(ctx, "admit", t1, &|| vec![("kvgate.class", Value::from(ctx.class.as_str()))]);
    let t2 = Instant::now();
    adapters::place(host, &prep, &mut incoming).await?;
    let routed = route(host, &incoming, &prep, &admitted)?;
    stage(ctx, "route", t2, &|| {
        let r = &routed.routed;
        let picked = r.candidates.first().map_or("", |c| c.id.as_str());
        let reason = if r.is_split() { RouteReason::Split } else { r.reason };
        vec![("kvgate.worker", Value::from(picked)), ("kvgate.route", Value::from(reason.as_str()))]
    });
    Walk { host, incoming: &incoming, prep: &prep }.run(down, ctx, admitted, routed).await
}
