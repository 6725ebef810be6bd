//! OpenAI and vLLM endpoints the gateway does not route by prefix ([`PATHS`]: embeddings, responses, rerank,
//! score, tokenize, detokenize), passed through to a healthy worker of the body's model, so a client of a vLLM,
//! SGLang or llama.cpp pool loses nothing by pointing at the gateway.
//!
//! Such a request gets what a completion gets except the prompt's tokenization: the body limit and read timeout,
//! the caller's API key, its tenant's salt (a keyed caller's `cache_salt` is replaced like a completion's, and a
//! client may not send a tenant salt's form), its class and budget, the first-byte and idle timeouts, fallbacks on
//! a refusal or a connection failure, and the request metrics (`route="load"`, plus
//! `kvgate_gateway_passthrough_requests_total{path}`). What differs:
//! - the worker is chosen by load alone (`Router::route_by_load`), whatever the policy: the gateway does not read
//!   these bodies' prompts, so it has no prefix to match (and embeddings, rerank and tokenize keep no KV worth
//!   following);
//! - the price is an estimate: `body bytes / BYTES_PER_TOKEN` prompt tokens plus `max_output_tokens` (or the
//!   class's expected output) for `/v1/responses`, settled by the response's `usage` when it has one
//!   (`prompt_tokens` / `input_tokens`, `completion_tokens` / `output_tokens`), else charged as priced;
//! - a body without `model` goes to the only model served, or is refused (400, param `model`) when there are
//!   several.
//!
//! `GET /v1/models/{id}` is answered by the gateway itself (`proxy.rs`).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use kvgate_shared::handoff::{self, TENANT_SALT_PREFIX};
use pingora::proxy::Session;
use serde::Deserialize;

use crate::admission::{ClassInput, CLASS_HEADER};
use crate::config::WorkerKind;
use crate::errors::{ApiError, GatewayErrors};
use crate::registry::Fault;
use crate::route::RouteInput;
use crate::serve::pipeline::header;
use crate::serve::prepare::salt_for;
use crate::serve::proxy::{self, Ctx, InflightGuard, CLIENT_CLOSED};
use crate::serve::request::set_members;
use crate::serve::upstream::{unless_client_leaves, Attempt, Outcome};
use crate::state::GatewayState;

/// The POST paths passed through.
pub const PATHS: &[&str] =
    &["/v1/embeddings", "/v1/responses", "/v1/rerank", "/v1/score", "/tokenize", "/detokenize"];

/// Most `max_output_tokens` a `/v1/responses` body may ask for when no worker told the model's context length
/// (with one, the context length is the limit): past it, 400 on `max_output_tokens`.
pub const MAX_OUTPUT_TOKENS: u64 = 1 << 20;

/// 400 `unsupported_parameter` for a Responses member the gateway cannot price.
fn unpriced(param: &str) -> ApiError {
    let m = format!("{param} is not supported through the gateway: it stands for work the body does not show, which the class budget cannot price");
    ApiError::new(400, "invalid_request_error", "unsupported_parameter", m).with_param(param)
}

/// Bytes of body counted as one prompt token when pricing a request the gateway does not tokenize.
pub const BYTES_PER_TOKEN: u64 = 4;

/// What the gateway reads of a passed-through body (every other member is forwarded as sent).
#[derive(Deserialize)]
struct Fields {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    /// Responses members that let a small body stand for a large or detached computation: refused by name.
    #[serde(default)]
    previous_response_id: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    conversation: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    background: Option<bool>,
    /// `Some(None)`: the member is there as `null` (it is still replaced, never left after the tenant's salt).
    #[serde(default, deserialize_with = "present")]
    cache_salt: Option<Option<String>>,
}

/// A member that may be `null`: `Some(None)` when present as `null`, `None` (the default) when absent.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

/// Paths whose worker keeps no KV: a tenant's salt is not added to their bodies (a kvgate worker refuses a
/// `cache_salt` there by name).
const NO_KV: &[&str] = &["/tokenize", "/detokenize"];

/// A passed-through request, read and priced.
struct Passed {
    model: String,
    body: Bytes,
    stream: bool,
    /// Estimated prompt tokens (the send's uncached tokens and the first-byte budget).
    prompt: u64,
    /// Expected output tokens.
    output: u64,
    salt_rewritten: bool,
}

/// The model a body names, else the only one served.
fn model_of(state: &GatewayState, named: Option<String>) -> Result<String, ApiError> {
    let served = state.registry().models(Instant::now());
    match named {
        Some(m) if served.contains(&m) || state.is_configured(&m) => Ok(m),
        Some(m) => Err(ApiError::model_not_found(&m)),
        None => match served.as_slice() {
            [only] => Ok(only.clone()),
            _ => Err(ApiError::invalid("model", "model is required (this gateway serves several, or none)")),
        },
    }
}

/// Reads, checks and prices the body; rewrites a keyed caller's salt.
fn read(
    state: &GatewayState,
    caller: &crate::control::keys::Caller,
    path: &str,
    body: Bytes,
    header_salt: Option<&str>,
) -> Result<Passed, ApiError> {
    let f: Fields = serde_json::from_slice(&body).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            ApiError::bad_json(format!("the body is not valid JSON: {e}"))
        } else {
            ApiError::invalid("body", format!("invalid request: {e}"))
        }
    })?;
    let model = model_of(state, f.model)?;
    let had_salt = f.cache_salt.is_some();
    let client_salt = f.cache_salt.as_ref().and_then(|s| s.as_deref()).or(header_salt);
    if client_salt.is_some_and(|s| s.starts_with(TENANT_SALT_PREFIX)) {
        let m =
            format!("a cache salt may not start with {TENANT_SALT_PREFIX:?} (reserved for tenants' salts)");
        return Err(ApiError::invalid("cache_salt", &m));
    }
    let (salt, _, salt_rewritten) = match NO_KV.contains(&path) {
        true => (None, None, false),
        false => salt_for(caller, client_salt, state.cfg.report_secret.as_deref()),
    };
    let body = match salt_rewritten {
        false => body,
        true => {
            let v = serde_json::to_string(&salt.unwrap_or_default())
                .map_err(|e| ApiError::internal(e.to_string()))?;
            Bytes::from(set_members(&body, had_salt, &[("cache_salt", v)])?)
        }
    };
    let generates = path == "/v1/responses";
    if generates {
        // The price is the body's size plus the output asked for: a member that makes the worker read a stored
        // conversation, or run on after the answer, is a computation the body does not show.
        if f.previous_response_id.is_some() {
            return Err(unpriced("previous_response_id"));
        }
        if f.conversation.is_some() {
            return Err(unpriced("conversation"));
        }
        if f.background == Some(true) {
            return Err(unpriced("background"));
        }
        let limit = state.registry().max_model_len(&model).map_or(MAX_OUTPUT_TOKENS, u64::from);
        if f.max_output_tokens.is_some_and(|n| n > limit) {
            return Err(ApiError::invalid(
                "max_output_tokens",
                format!(
                    "max_output_tokens may be at most {limit} (the model's context, or MAX_OUTPUT_TOKENS)"
                ),
            ));
        }
    }
    Ok(Passed {
        model,
        stream: f.stream.unwrap_or(false),
        prompt: body.len() as u64 / BYTES_PER_TOKEN,
        output: if generates { f.max_output_tokens.unwrap_or(0) } else { 0 },
        body,
        salt_rewritten,
    })
}

/// The headers a worker gets: a kvgate worker the gateway's token, any other pod the client's headers
/// (`authorization` with `--forward-authorization`).
fn headers(state: &GatewayState, session: &Session, p: &Passed) -> Vec<(HeaderName, HeaderValue)> {
    let kvgate = state.pool_kind(&p.model) == WorkerKind::Kvgate;
    let mut h = proxy::forwarded_headers(state, session, p.salt_rewritten, !kvgate);
    if let (true, Some(secret)) = (kvgate, state.cfg.report_secret.as_deref()) {
        if let Ok(v) = HeaderValue::from_str(&format!("Bearer {}", handoff::gateway_token(secret))) {
            h.push((hyper::header::AUTHORIZATION, v));
        }
    }
    h
}

/// `POST` one of [`PATHS`].
pub async fn serve(
    state: &Arc<GatewayState>,
    session: &mut Session,
    ctx: &mut Ctx,
    path: &str,
) -> Result<(), ApiError> {
    let (body, caller, header_salt) = crate::serve::pipeline::read_request(state, session).await?;
    let p = read(state, &caller, path, body, header_salt.as_deref())?;
    let label = PATHS.iter().copied().find(|p| *p == path).unwrap_or("other");
    metrics::counter!("kvgate_gateway_passthrough_requests_total", "path" => label).increment(1);
    // Class and budget, as a completion's.
    let input = ClassInput { prompt_tokens: p.prompt, max_tokens: None, model: &p.model, reasoning: false };
    let (class, class_name, configured) =
        proxy::choose_class(state, &input, &caller, header(session, CLASS_HEADER))?;
    ctx.class = class_name.clone();
    let output = match path {
        "/v1/responses" if p.output == 0 => state.expected_output(&class_name, None, configured),
        _ => p.output,
    };
    let price = p.prompt.saturating_add(output) as f64;
    let waiting = state.admission.admit(class, Some(&caller.tenant), price);
    let Some(permit) = unless_client_leaves(session, waiting).await else {
        ctx.status = CLIENT_CLOSED;
        return Ok(());
    };
    let mut permit = Some(permit.map_err(ApiError::rejected)?);
    ctx.admission_wait = permit.as_ref().map(|p| p.waited).unwrap_or_default();
    let route_input = RouteInput {
        model: &p.model,
        hashes: &[],
        prompt_tokens: p.prompt as usize,
        session_key: 0,
        shared_blocks: 0,
        block_size: 1,
    };
    let routed = {
        let mut reg = state.registry();
        state.router.route_by_load(&mut reg, &route_input, state.cfg.max_attempts, Instant::now())
    };
    let routed = routed.ok_or_else(|| ApiError::no_worker(&p.model))?;
    let hdrs = headers(state, session, &p);
    let first_byte = state.cfg.first_byte.for_request(p.prompt, output, p.stream);
    let cap = p.prompt.saturating_add(output.max(1 << 20));
    let mut first = routed.ticket.map(|ticket| InflightGuard { state: state.clone(), ticket });
    let mut refused_for = None;
    for (attempt, t) in routed.candidates.iter().enumerate() {
        let guard = if attempt == 0 {
            first.take()
        } else {
            let mut reg = state.registry();
            let fallback = state.router.record_fallback(&mut reg, t, &route_input, Instant::now());
            fallback.map(|(ticket, _)| InflightGuard { state: state.clone(), ticket })
        };
        let Some(guard) = guard else { continue };
        ctx.route = routed.reason.as_str();
        let trace = ctx.trace.as_ref().map(|r| r.attempt());
        let mut hdrs = hdrs.clone();
        hdrs.extend(trace.as_ref().and_then(|t| t.header()));
        let a = Attempt {
            url: &t.url,
            path,
            body: &p.body,
            headers: &hdrs,
            worker_id: &t.id,
            reason: routed.reason,
            class: &class_name,
            admission_wait: ctx.admission_wait,
            first_byte_timeout: first_byte,
            idle_timeout: state.cfg.stream_idle_timeout,
            strip_usage: false,
            trace: trace.as_ref(),
            predicted: None,
        };
        let outcome = crate::serve::upstream::forward(state, session, &a).await;
        drop(guard);
        if let Some(tr) = trace {
            tr.finish(&state.tracer, &t.id, routed.reason.as_str(), outcome.name(), outcome.status());
        }
        ctx.worker = Some(t.id.clone());
        match outcome {
            Outcome::Responded { status, usage, tokens_sent, whole, completed, stalled } => {
                ctx.status = status;
                if stalled {
                    state.registry().record_fault(t.wref, Fault::Timeout, Instant::now());
                }
                if let (Some(permit), true) = (permit.take(), (200..300).contains(&status)) {
                    permit.reconcile(proxy::charge(
                        price,
                        p.prompt,
                        usage,
                        tokens_sent,
                        completed || whole,
                        cap,
                    ));
                    if !completed {
                        metrics::counter!("kvgate_gateway_class_partial_charges_total", "class" => class_name.clone())
                            .increment(1);
                    }
                }
                return Ok(());
            }
            Outcome::ConnectFailed(e) => {
                tracing::warn!(worker = %t.id, error = %e, "no response; trying the next worker");
                state.registry().record_fault(t.wref, Fault::Refused, Instant::now());
            }
            Outcome::Refused { code, retry_after } => {
                tracing::info!(worker = %t.id, %code, ?retry_after, "worker refused; trying the next worker");
                state.registry().record_busy(t.wref, Instant::now() + retry_after);
                refused_for =
                    Some(refused_for.map_or(retry_after, |r: std::time::Duration| r.min(retry_after)));
            }
            Outcome::TimedOut => {
                state.registry().record_fault(t.wref, Fault::Timeout, Instant::now());
                if let Some(permit) = permit.take() {
                    permit.reconcile(p.prompt as f64);
                }
                return Err(ApiError::upstream_timeout(&t.id, first_byte));
            }
            Outcome::ClientGone => {
                ctx.status = CLIENT_CLOSED;
                if let Some(permit) = permit.take() {
                    permit.reconcile(price);
                }
                return Ok(());
            }
            Outcome::Failed(e) => return Err(e),
        }
    }
    match refused_for {
        Some(r) => Err(ApiError::all_refused(&p.model, r.as_secs_f64().ceil() as u32)),
        None => Err(ApiError::no_worker(&p.model)),
    }
}
