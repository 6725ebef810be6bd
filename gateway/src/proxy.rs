//! The public listener as a pingora `ProxyHttp` service.
//!
//! Routing needs the whole request body (the prompt) before an upstream is chosen, and pingora 0.9 can only forward
//! a body consumed in `request_filter` through its 64 KiB retry buffer (cloudflare/pingora #349, #780; early body
//! buffering is an unmerged PR). Long-context prompts are megabytes, so the gateway buffers the body itself and
//! forwards it in `request_filter` with its own pooled client, streaming the response back through pingora's
//! downstream session chunk by chunk; `request_filter` then answers `true` (response sent) and pingora's upstream
//! phases are not used. This also gives exact control over the retry rule: a connection failure before any byte
//! went upstream is retried once on the next-ranked worker; after the first byte reached the client, an error
//! becomes an SSE error event and the stream ends.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvgate_shared::hashing::{BlockHasher, ExtraKeys};
use kvgate_shared::openai::{ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SinglePrompt};
use kvgate_shared::prompt::{ChatOptions, PromptInput};
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::{ProxyHttp, Session};

use crate::admission::{ClassInput, CLASS_HEADER};
use crate::errors::ApiError;
use crate::routing::{RequestView, RouteReason};
use crate::state::GatewayState;

/// Header carrying a session id for the ring.
pub const SESSION_HEADER: &str = "x-session-id";
/// Header carrying the tenant's cache salt (also accepted in the body as `cache_salt`).
pub const CACHE_SALT_HEADER: &str = "x-kvgate-cache-salt";
/// Header naming the tenant for fair queueing inside a class (else the cache salt, if any).
pub const TENANT_HEADER: &str = "x-kvgate-tenant";

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
    admission_wait: std::time::Duration,
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
            admission_wait: std::time::Duration::ZERO,
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
        metrics::counter!("kvgate_gateway_requests_total", "policy" => self.state.policy.name(),
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

async fn handle(state: &Arc<GatewayState>, session: &mut Session, ctx: &mut Ctx) -> Result<(), ApiError> {
    let method = session.req_header().method.clone();
    let path = session.req_header().uri.path().to_owned();
    match (method.as_str(), path.as_str()) {
        ("POST", "/v1/chat/completions") | ("POST", "/v1/completions") => {}
        ("GET", "/v1/models") => return models(state, session, ctx).await,
        ("GET", "/health") => return plain_json(session, ctx, 200, "{\"status\":\"ok\"}").await,
        _ => return Err(ApiError::not_found_route(&path)),
    }
    let decided_at = Instant::now();
    let body = read_body(session, state.cfg.max_body_bytes).await?;
    let chat = path == "/v1/chat/completions";
    let p = prepare(state, chat, &body, &|name| header(session, name).map(str::to_owned))?;
    let (model, ids, hashes, session_key, fields, reasoning, salt) =
        (&p.model, &p.ids, &p.hashes, p.session_key, &p.fields, p.reasoning, &p.salt);
    let model = model.clone();
    let nonce = state.nonce.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let block_size = p.block_size;
    let now = Instant::now();
    // Decide and record under one short lock.
    let (targets, reason, predicted) = {
        let reg = state.registry();
        let (views, idx) = reg.views(&model, hashes, now);
        let req = RequestView { hashes, prompt_tokens: ids.len(), session_key, nonce };
        let Some(d) = state.policy.choose(&req, &views, reg.ring(), block_size) else {
            return Err(ApiError::no_worker(&model));
        };
        let targets: Vec<(usize, String, String)> = d
            .ranked
            .iter()
            .take(2)
            .map(|r| (idx[*r], views[*r].id.to_owned(), reg.workers()[idx[*r]].url.clone()))
            .collect();
        (targets, d.reason, d.predicted_cached_tokens)
    };
    metrics::histogram!("kvgate_gateway_decision_seconds").record(decided_at.elapsed().as_secs_f64());
    // Admission: cost = predicted uncached prompt tokens + max_tokens (or the class's expected output).
    let max_tokens = fields.max_output_tokens().map(u64::from);
    let class_input = ClassInput {
        prompt_tokens: ids.len() as u64,
        max_tokens,
        model: &model,
        header_class: header(session, CLASS_HEADER),
        reasoning,
    };
    let (class, class_name, expected_output) = state.admission.classify(&class_input);
    let uncached = ids.len().saturating_sub(predicted) as u64;
    let cost = (uncached + max_tokens.unwrap_or(expected_output)) as f64;
    let tenant = header(session, TENANT_HEADER).map(str::to_owned).or_else(|| salt.clone());
    ctx.class = class_name.clone();
    let permit = state.admission.admit(class, tenant.as_deref(), cost).await.map_err(ApiError::rejected)?;
    ctx.admission_wait = permit.waited;
    let first_ticket = state.registry().record_sent(targets[0].0, hashes, uncached, Instant::now());
    let mut reason = reason;
    for (attempt, (reg_idx, id, url)) in targets.iter().enumerate() {
        let ticket = if attempt == 0 {
            first_ticket
        } else {
            reason = RouteReason::Fallback;
            let uncached = ids.len().saturating_sub(predicted) as u64;
            state.registry().record_sent(*reg_idx, hashes, uncached, Instant::now())
        };
        let guard = InflightGuard { state: state.clone(), ticket };
        ctx.route = reason.as_str();
        match forward(state, session, ctx, url, &path, &body, id, reason, predicted).await {
            Ok(usage) => {
                drop(guard);
                // Reconcile the reservation with what the request really cost (unknown usage: as charged).
                let actual =
                    usage.map_or(cost, |u| (u.prompt.saturating_sub(u.cached) + u.completion) as f64);
                permit.reconcile(actual);
                return Ok(());
            }
            Err(Forward::Connect(e)) => {
                tracing::warn!(worker = %id, error = %e, "connect failed; trying the next worker");
                state.registry().record_refused(*reg_idx, Instant::now());
                metrics::counter!("kvgate_gateway_connect_failures_total", "worker" => id.clone())
                    .increment(1);
            }
            Err(Forward::Other(e)) => return Err(e),
        }
    }
    Err(ApiError::no_worker(&model))
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

enum Forward {
    /// Nothing reached the worker: safe to retry elsewhere.
    Connect(String),
    Other(ApiError),
}

#[allow(clippy::too_many_arguments)]
async fn forward(
    state: &GatewayState,
    session: &mut Session,
    ctx: &mut Ctx,
    url: &str,
    path: &str,
    body: &Bytes,
    worker_id: &str,
    reason: RouteReason,
    predicted_cached: usize,
) -> Result<Option<UsageSeen>, Forward> {
    let mut req = hyper::Request::post(format!("{url}{path}")).header("content-type", "application/json");
    for name in ["authorization", CACHE_SALT_HEADER, SESSION_HEADER, "accept"] {
        if let Some(v) = session.req_header().headers.get(name) {
            req = req.header(name, v.clone());
        }
    }
    let req =
        req.body(Full::new(body.clone())).map_err(|e| Forward::Other(ApiError::internal(e.to_string())))?;
    let sent_at = Instant::now();
    let resp = match state.client.request(req).await {
        Ok(r) => r,
        Err(e) if e.is_connect() => return Err(Forward::Connect(e.to_string())),
        Err(e) => return Err(Forward::Other(ApiError::bad_gateway(worker_id, &e.to_string()))),
    };
    metrics::histogram!("kvgate_gateway_upstream_first_byte_seconds").record(sent_at.elapsed().as_secs_f64());
    let status = resp.status().as_u16();
    ctx.status = status;
    let sse = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let io = |e: Box<pingora::Error>| Forward::Other(ApiError::internal(e.to_string()));
    let mut h = ResponseHeader::build(status, Some(resp.headers().len() + 2)).map_err(io)?;
    for (name, value) in resp.headers() {
        if !matches!(name.as_str(), "connection" | "keep-alive" | "x-kvgate-worker") {
            h.append_header(name.clone(), value.clone()).map_err(io)?;
        }
    }
    h.insert_header("x-kvgate-worker", worker_id).map_err(io)?;
    h.insert_header("x-kvgate-route", reason.as_str()).map_err(io)?;
    h.insert_header("x-kvgate-class", ctx.class.as_str()).map_err(io)?;
    h.insert_header("x-kvgate-admission-wait-ms", format!("{:.3}", ctx.admission_wait.as_secs_f64() * 1e3))
        .map_err(io)?;
    session.write_response_header(Box::new(h), false).await.map_err(io)?;
    // From here on bytes reached the client: no retry.
    let mut body = resp.into_body();
    let mut tail: Vec<u8> = Vec::new();
    loop {
        match body.frame().await {
            None => break,
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    tail.extend_from_slice(&data);
                    if tail.len() > 16_384 {
                        tail.drain(..tail.len() - 8_192);
                    }
                    if session.write_response_body(Some(data), false).await.is_err() {
                        // The client went away: dropping the upstream body closes that connection, and the
                        // worker aborts the request.
                        return Ok(None);
                    }
                }
            }
            Some(Err(e)) => {
                tracing::warn!(worker = %worker_id, error = %e, "upstream failed mid-response");
                if sse {
                    let err = ApiError::bad_gateway(worker_id, &format!("the worker failed mid-stream: {e}"));
                    let event = Bytes::from(format!("data: {}\n\n", err.body().to_json()));
                    let _ = session.write_response_body(Some(event), false).await;
                }
                break;
            }
        }
    }
    let _ = session.write_response_body(None, true).await;
    let usage = UsageSeen::parse(&tail);
    if let Some(u) = &usage {
        metrics::counter!("kvgate_gateway_reported_cached_tokens_total").increment(u.cached);
        metrics::counter!("kvgate_gateway_predicted_cached_tokens_total").increment(predicted_cached as u64);
    }
    Ok(usage)
}

/// The `usage` numbers found at the end of a response.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UsageSeen {
    pub prompt: u64,
    pub completion: u64,
    pub cached: u64,
}

impl UsageSeen {
    fn parse(tail: &[u8]) -> Option<Self> {
        Some(Self {
            prompt: last_number_after(tail, "\"prompt_tokens\":")?,
            completion: last_number_after(tail, "\"completion_tokens\":")?,
            cached: last_number_after(tail, "\"cached_tokens\":").unwrap_or(0),
        })
    }
}

/// The last integer following `key` in `buf` (usage is at the end of both response shapes).
fn last_number_after(buf: &[u8], key: &str) -> Option<u64> {
    let text = String::from_utf8_lossy(buf);
    let at = text.rfind(key)? + key.len();
    let digits: String = text[at..].trim_start().chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
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
    let names = state.registry().models(Instant::now());
    let list = ModelList {
        object: "list".into(),
        data: names
            .into_iter()
            .map(|id| ModelCard {
                id,
                object: "model".into(),
                created: 0,
                owned_by: "kvgate".into(),
                max_model_len: None,
            })
            .collect(),
    };
    let body = serde_json::to_string(&list).map_err(|e| ApiError::internal(e.to_string()))?;
    plain_json(session, ctx, 200, &body).await
}

/// A request parsed, tokenized and hashed exactly like the worker will (shared by the proxy and route/explain).
pub struct Prepared {
    pub model: String,
    pub ids: Vec<u32>,
    pub hashes: Vec<kvgate_shared::hashing::BlockHash>,
    pub session_key: u64,
    pub fields: kvgate_shared::openai::SamplingFields,
    pub reasoning: bool,
    pub salt: Option<String>,
    pub block_size: usize,
}

/// Parses a chat (`chat`) or completions body; `header` reads request headers.
pub fn prepare(
    state: &GatewayState,
    chat: bool,
    body: &[u8],
    header: &dyn Fn(&str) -> Option<String>,
) -> Result<Prepared, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_json(format!("the body is not valid JSON: {e}")))?;
    let model = value
        .get("model")
        .and_then(|m| m.as_str())
        .ok_or_else(|| ApiError::invalid("model", "`model` is required"))?
        .to_owned();
    let Some(tok) = state.tokenizer(&model) else {
        return Err(ApiError::model_not_found(&model));
    };
    let (ids, fields, reasoning) = if chat {
        let req: ChatCompletionRequest = crate::errors::typed(value)?;
        let reasoning = req.reasoning_effort.is_some();
        let options = ChatOptions {
            add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
            tools: req.tools.clone(),
            extra: req.chat_template_kwargs.clone(),
        };
        let ids = tok.prompter.tokenize(&PromptInput::Chat { messages: &req.messages, options: &options });
        (ids.map_err(|e| ApiError::prompt(e, "messages"))?, req.sampling, reasoning)
    } else {
        let req: CompletionRequest = crate::errors::typed(value)?;
        let input = match req.prompt.single().map_err(|m| ApiError::invalid("prompt", &m))? {
            SinglePrompt::Text(t) => PromptInput::Text(t),
            SinglePrompt::TokenIds(ids) => PromptInput::TokenIds(ids),
        };
        let ids = tok.prompter.tokenize(&input);
        (ids.map_err(|e| ApiError::prompt(e, "prompt"))?, req.sampling, false)
    };
    let salt = fields.cache_salt.clone().or_else(|| header(CACHE_SALT_HEADER)).filter(|s| !s.is_empty());
    let hashes = BlockHasher::new(&tok.scheme, &ExtraKeys::from_salt(salt.as_deref())).hash_blocks(&ids);
    let explicit = header(SESSION_HEADER).or_else(|| fields.user.clone());
    let session_key = crate::routing::session_key(explicit.as_deref(), &hashes, &ids);
    Ok(Prepared {
        model,
        ids,
        hashes,
        session_key,
        fields,
        reasoning,
        salt,
        block_size: tok.scheme.block_size as usize,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn usage_is_found_at_the_end() {
        let tail = br#"{"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        assert_eq!(super::last_number_after(tail, "\"cached_tokens\":"), Some(64));
        assert_eq!(super::last_number_after(b"data: [DONE]", "\"cached_tokens\":"), None);
    }
}
