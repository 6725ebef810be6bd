//! The OpenAI endpoints: `POST /v1/completions` and `POST /v1/chat/completions`, streamed (SSE in OpenAI's chunk
//! format, ending with `data: [DONE]`) or not. Parsing and validation turn every bad input into an [`ApiError`];
//! a dropped response (client gone) aborts the request in the engine.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use kvgate_shared::handoff::{self, TenantScope};
use kvgate_shared::hashing::ExtraKeys;
use kvgate_shared::openai::{
    sse_data, unsupported_parameter, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatMessage, CompletionChoice, CompletionRequest, CompletionResponse,
    FinishReason as ApiFinish, SamplingFields, SinglePrompt, Usage, SSE_DONE,
};
use kvgate_shared::prompt::{chat_options, PromptError, PromptInput, RequestPrompt, CACHE_SALT_HEADER};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::engine_thread::{EngineHandle, Refusal};
use super::errors::{ApiError, Refusal as SharedRefusal, WorkerErrors};
use super::logprobs::{self, Collector};
use super::spans::RequestSpans;
use super::text::TextStream;
use super::{AppState, ServingModel};
use crate::engine::request::MAX_LOGIT_BIAS;
use crate::engine::{AdmitError, EngineRequest, FinishReason, RequestId, SamplingParams, StepOutput};

/// Most stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;

#[derive(Clone, Copy, PartialEq)]
enum Endpoint {
    Completion,
    Chat,
}

/// Reads the body within the limit and parses it, naming the offending field on error.
pub async fn parse_body<T: DeserializeOwned>(body: Body, limit: usize) -> Result<T, ApiError> {
    parse_json(&read_body(body, limit).await?)
}

/// The whole body, at most `limit` bytes (past it: 413).
pub async fn read_body(body: Body, limit: usize) -> Result<bytes::Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
            || e.to_string().contains("length limit");
        if too_large {
            ApiError::too_large(limit)
        } else {
            ApiError::bad_json(format!("cannot read the request body: {e}"))
        }
    })
}

/// Parses straight into the typed request (no intermediate JSON tree): malformed JSON is `invalid_json`, a well-formed
/// body of the wrong shape names the field.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if matches!(inner.classify(), serde_json::error::Category::Syntax | serde_json::error::Category::Eof)
        {
            return ApiError::bad_json(format!("the body is not valid JSON: {inner}"));
        }
        let msg = inner.to_string();
        // "missing field `x`" at the top level: the field is the param.
        let param =
            if path == "." { msg.split('`').nth(1).unwrap_or("body").to_string() } else { path.clone() };
        ApiError::invalid(param.clone(), format!("invalid request: {param}: {msg}"))
    })?;
    de.end().map_err(|e| ApiError::bad_json(format!("the body is not valid JSON: {e}")))?;
    Ok(value)
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The cache salt header's value; a header that is not text is refused (the salt keys the KV blocks).
fn header_salt(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    headers
        .get(CACHE_SALT_HEADER)
        .map(|v| {
            v.to_str().map_err(|_| ApiError::invalid(CACHE_SALT_HEADER, "the cache salt header is not text"))
        })
        .transpose()
}

/// A number field of `extra` (`None`: absent or null).
fn number(extra: &Map<String, Value>, field: &str) -> Result<Option<f32>, ApiError> {
    match extra.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| ApiError::invalid(field, format!("{field} must be a number"))),
    }
}

/// `logit_bias`: token id (as a string, OpenAI's form) -> bias.
fn logit_bias(extra: &Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(Value::Object(m)) = extra.get("logit_bias") else {
        return match extra.get("logit_bias") {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(_) => {
                Err(ApiError::invalid("logit_bias", "logit_bias must be an object of token id -> bias"))
            }
        };
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid("logit_bias", format!("at most {MAX_LOGIT_BIAS} tokens")));
    }
    let bad =
        |k: &str| ApiError::invalid("logit_bias", format!("{k:?} is not a token id with a numeric bias"));
    m.iter()
        .map(|(k, v)| Ok((k.parse::<u32>().map_err(|_| bad(k))?, v.as_f64().ok_or_else(|| bad(k))? as f32)))
        .collect()
}

/// OpenAI sampling fields (the typed ones, and the logit controls among the untyped `extra`) -> engine parameters.
fn sampling(
    f: &SamplingFields,
    extra: &Map<String, Value>,
    default_max: u32,
    logprobs: Option<u32>,
) -> Result<SamplingParams, ApiError> {
    if f.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("n", "only n = 1 is supported"));
    }
    let max_tokens = f.max_output_tokens().unwrap_or(default_max);
    if max_tokens == 0 {
        return Err(ApiError::invalid("max_tokens", "max_tokens must be at least 1"));
    }
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as u32,
        Some(k) => return Err(ApiError::invalid("top_k", format!("{k} is not -1, 0 or positive"))),
    };
    let stop = f.stop.as_ref().map(|s| s.to_vec()).unwrap_or_default();
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid("stop", format!("at most {MAX_STOP_STRINGS} stop strings")));
    }
    let p = SamplingParams {
        max_tokens,
        temperature: f.temperature.unwrap_or(1.0),
        top_p: f.top_p.unwrap_or(1.0),
        top_k,
        seed: f.seed,
        stop_token_ids: f.stop_token_ids.clone().unwrap_or_default(),
        stop,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        presence_penalty: number(extra, "presence_penalty")?.unwrap_or(0.0),
        frequency_penalty: number(extra, "frequency_penalty")?.unwrap_or(0.0),
        repetition_penalty: number(extra, "repetition_penalty")?.unwrap_or(1.0),
        min_p: number(extra, "min_p")?.unwrap_or(0.0),
        logit_bias: logit_bias(extra)?,
        logprobs,
    };
    p.validate().map_err(|(field, m)| ApiError::invalid(field, m))?;
    Ok(p)
}

fn prompt_error(e: PromptError, param: &str) -> ApiError {
    if e.is_client_error() {
        ApiError::invalid(param, e.to_string())
    } else {
        ApiError::internal(e.to_string())
    }
}

pub(super) fn loaded(state: &AppState) -> Result<Arc<ServingModel>, ApiError> {
    if state.draining() {
        return Err(ApiError::refused(SharedRefusal::ShuttingDown, "the worker is shutting down"));
    }
    state.loaded().ok_or_else(|| ApiError::refused(SharedRefusal::ModelLoading, "the model is still loading"))
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let result = async {
        let l = loaded(&state)?;
        let req: CompletionRequest = parse_body(body, state.cfg.max_body_bytes).await?;
        let adapter = l.resolve(&req.model).await?;
        if req.echo == Some(true) || req.logprobs.is_some() {
            return Err(ApiError::unsupported(if req.logprobs.is_some() { "logprobs" } else { "echo" }));
        }
        if let Some(p) = unsupported_parameter(&req.extra) {
            return Err(ApiError::unsupported(p));
        }
        let input = match req.prompt.single().map_err(|m| ApiError::invalid("prompt", m))? {
            SinglePrompt::Text(t) => PromptInput::Text(t),
            SinglePrompt::TokenIds(ids) => PromptInput::TokenIds(ids),
        };
        let mut prompt = RequestPrompt {
            input,
            body_salt: req.sampling.cache_salt.as_deref(),
            header_salt: header_salt(&headers)?,
            scope: None,
        };
        let v = vouched(&state, &l, &headers, &req.model, prompt.salt(), req.kvgate_prompt_ids.as_deref())?;
        prompt.scope = v.scope.as_ref();
        let ids = prompt.token_ids(&l.prompter, v.ids).map_err(|e| prompt_error(e, prompt.param()))?;
        let extra = prompt.extra_keys();
        let params = sampling(&req.sampling, &req.extra, 16, None)?;
        let peer = super::pd::prefill_peer(&state, &l, &headers, &req.model, &ids)?;
        Ok((l, ids, params, extra, req.sampling, peer, adapter))
    }
    .await;
    match result {
        Ok((l, ids, params, extra, fields, peer, adapter)) => {
            let spans = RequestSpans::begin(&state.tracer, &headers, &l.worker_id, &l.model_id);
            run(l, Endpoint::Completion, ids, params, extra, &fields, started, (peer, adapter), spans).await
        }
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let result = async {
        let l = loaded(&state)?;
        let mut req: ChatCompletionRequest = parse_body(body, state.cfg.max_body_bytes).await?;
        let adapter = l.resolve(&req.model).await?;
        let logprobs = logprobs::take_chat_fields(&mut req.extra)?;
        if let Some(p) = unsupported_parameter(&req.extra) {
            return Err(ApiError::unsupported(p));
        }
        let options =
            chat_options(req.add_generation_prompt, req.tools.clone(), req.chat_template_kwargs.clone());
        let mut prompt = RequestPrompt {
            input: PromptInput::Chat { messages: &req.messages, options: &options },
            body_salt: req.sampling.cache_salt.as_deref(),
            header_salt: header_salt(&headers)?,
            scope: None,
        };
        let v = vouched(&state, &l, &headers, &req.model, prompt.salt(), req.kvgate_prompt_ids.as_deref())?;
        prompt.scope = v.scope.as_ref();
        let ids = prompt.token_ids(&l.prompter, v.ids).map_err(|e| prompt_error(e, prompt.param()))?;
        let extra = prompt.extra_keys();
        // Without max_tokens a chat may use the rest of the context, up to --default-max-tokens.
        let room = l.max_model_len.saturating_sub(ids.len()).max(1) as u32;
        let params = sampling(&req.sampling, &req.extra, state.cfg.default_max_tokens.min(room), logprobs)?;
        let peer = super::pd::prefill_peer(&state, &l, &headers, &req.model, &ids)?;
        Ok((l, ids, params, extra, req.sampling, peer, adapter))
    }
    .await;
    match result {
        Ok((l, ids, params, extra, fields, peer, adapter)) => {
            let spans = RequestSpans::begin(&state.tracer, &headers, &l.worker_id, &l.model_id);
            run(l, Endpoint::Chat, ids, params, extra, &fields, started, (peer, adapter), spans).await
        }
        Err(e) => e.into_response(),
    }
}

/// What the gateway vouched for in its assertion (`kvgate_shared::handoff`).
struct Vouched {
    /// The tenant scope of the request's salt.
    scope: Option<TenantScope>,
    /// The token ids handed over, when they were and the gateway's fingerprint is this worker's.
    ids: Option<Vec<u32>>,
}

/// Checks the gateway's assertion, if the request carries one, against the request as read here (`model`, `salt`,
/// the ids `field`): a verified one gives the tenant scope and the ids (only for this worker's own fingerprint);
/// one that does not verify is refused (401 `invalid_gateway_assertion`), never served in another namespace.
/// Without one (or on a worker without `--report-secret`, which cannot check it and never scopes), the request is
/// a plain client's and handed-off ids are ignored.
fn vouched(
    state: &AppState,
    l: &ServingModel,
    headers: &HeaderMap,
    model: &str,
    salt: Option<&str>,
    field: Option<&str>,
) -> Result<Vouched, ApiError> {
    let count = |result: &'static str| {
        metrics::counter!("kvgate_worker_prompt_handoff_total", "result" => result).increment(1);
    };
    let none = Vouched { scope: None, ids: None };
    let Some(header) = headers.get(handoff::ASSERTION_HEADER) else {
        if field.is_some() {
            count("unverified");
        }
        return Ok(none);
    };
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let header = header.to_str().map_err(|_| {
        ApiError::unauthorized(
            "invalid_gateway_assertion",
            format!("{} is not text", handoff::ASSERTION_HEADER),
        )
    })?;
    let v = match handoff::verify(state.cfg.report_secret.as_deref(), header, model, salt, field, now_ms) {
        Ok(v) => v,
        Err(handoff::AssertionError::NoSecret) => {
            if field.is_some() {
                count("unverified");
            }
            return Ok(none);
        }
        Err(e) => {
            metrics::counter!("kvgate_worker_unauthorized_requests_total").increment(1);
            return Err(ApiError::unauthorized("invalid_gateway_assertion", e.to_string()));
        }
    };
    let ids = match field {
        None => None,
        Some(_) if v.fingerprint != l.scheme.fingerprint() => {
            count("other_fingerprint");
            None
        }
        Some(enc) => {
            let ids = handoff::decode_ids(enc).filter(|ids| !ids.is_empty());
            count(if ids.is_some() { "used" } else { "invalid" });
            ids
        }
    };
    Ok(Vouched { scope: v.scope, ids })
}

pub(super) fn refusal(r: Refusal) -> ApiError {
    match r {
        Refusal::QueueFull { waiting } => ApiError::overloaded(waiting),
        Refusal::EngineGone => ApiError::refused(SharedRefusal::EngineStopped, "the engine has stopped"),
        Refusal::Invalid(e) => match e {
            AdmitError::ContextTooLong { .. } | AdmitError::ExceedsKvCapacity { .. } => {
                ApiError::context_length(e.to_string(), "messages")
            }
            AdmitError::EmptyPrompt | AdmitError::TokenOutOfRange(..) => {
                ApiError::invalid("prompt", e.to_string())
            }
            AdmitError::InvalidParam(field, m) => ApiError::invalid(field, m),
            AdmitError::DuplicateId(_) => ApiError::internal(e.to_string()),
            AdmitError::NoRoom(_) => ApiError::refused(SharedRefusal::KvImportNoRoom, e.to_string()),
            AdmitError::AdapterUnsupported(_) => ApiError::invalid("model", e.to_string()),
        },
    }
}

/// Aborts the request in the engine unless it finished (dropped with the response when a client goes away), and
/// cancels its KV import if one still runs.
struct AbortGuard {
    engine: EngineHandle,
    id: RequestId,
    done: bool,
    _import: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            self.engine.abort(self.id);
            metrics::counter!("kvgate_worker_aborted_requests_total").increment(1);
        }
    }
}

/// Per-request measurements reported when it ends (metrics, and spans when traced).
struct Timing {
    started: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    /// Seconds from arrival to admission (engine clock), once admitted.
    queued: Option<f64>,
    spans: Option<RequestSpans>,
}

impl Timing {
    fn saw(&mut self, o: &StepOutput) {
        if self.queued.is_none() {
            self.queued = o.queued_s;
        }
        if o.token.is_some() {
            self.token();
        }
    }

    fn token(&mut self) {
        let now = Instant::now();
        if self.first.is_none() {
            self.first = Some(now);
            metrics::histogram!("kvgate_worker_ttft_seconds").record((now - self.started).as_secs_f64());
        }
        self.last = Some(now);
    }
    fn finish(&self, out: &StepOutput, kind: Endpoint, status: &'static str) {
        let endpoint = if kind == Endpoint::Chat { "chat" } else { "completions" };
        metrics::counter!("kvgate_worker_requests_total", "endpoint" => endpoint, "status" => status)
            .increment(1);
        metrics::counter!("kvgate_worker_prompt_tokens_total").increment(out.prompt_tokens as u64);
        metrics::counter!("kvgate_worker_cached_prompt_tokens_total").increment(out.cached_tokens as u64);
        metrics::counter!("kvgate_worker_completion_tokens_total").increment(out.completion_tokens as u64);
        if let (Some(f), Some(l)) = (self.first, self.last) {
            if out.completion_tokens > 1 {
                let tpot = (l - f).as_secs_f64() / (out.completion_tokens - 1) as f64;
                metrics::histogram!("kvgate_worker_tpot_seconds").record(tpot);
            }
        }
        metrics::histogram!("kvgate_worker_e2e_seconds").record(self.started.elapsed().as_secs_f64());
        if let Some(s) = &self.spans {
            s.finish(self.started, self.queued, self.first, out, status);
        }
    }
}

/// OpenAI's finish reason of a request that ended normally (an abort or an error ends with an error instead).
fn api_finish(r: &FinishReason) -> ApiFinish {
    match r {
        FinishReason::Length => ApiFinish::Length,
        FinishReason::Stop(_) | FinishReason::Abort | FinishReason::Error(_) => ApiFinish::Stop,
    }
}

/// A request the engine ended before its finish (the worker is shutting down, or the request was cancelled).
fn aborted() -> ApiError {
    ApiError::refused(
        SharedRefusal::Aborted,
        "the request was aborted before it finished (the worker is shutting down)",
    )
}

/// Ends a stream with an error event (`data: {"error": ...}`) and `[DONE]`.
fn error_event(out: &mut String, err: &ApiError) {
    out.push_str(&sse_data(&err.body().to_json()));
    out.push_str(SSE_DONE);
}

#[allow(clippy::too_many_arguments)]
async fn run(
    l: Arc<ServingModel>,
    kind: Endpoint,
    ids: Vec<u32>,
    params: SamplingParams,
    extra_keys: ExtraKeys,
    fields: &SamplingFields,
    started: Instant,
    (peer, adapter): (Option<super::pd::Split>, Option<Arc<crate::model::lora::LoraAdapter>>),
    mut spans: Option<RequestSpans>,
) -> Response {
    let id = l.engine.next_id();
    let stops = params.stop.clone();
    // A prefill worker samples the first token from a fixed frame (temperature, top-p, top-k, seed): a request
    // whose logits are adjusted first (penalties, bias, min-p) or reported (logprobs) is served whole here instead.
    let peer = peer.filter(|_| !params.needs_logits());
    if let Some(s) = &mut spans {
        s.split = peer.is_some();
    }
    let collector = params.logprobs.map(|_| Collector::new(l.prompter.clone()));
    let req = EngineRequest { id, prompt: ids, params, extra_keys, adapter };
    let started_leg = match peer {
        None => l.engine.submit(req).await.map(|rx| (rx, None)),
        Some(peer) => super::pd::start_import(&l, req, peer).await.map(|(rx, c)| (rx, Some(c))),
    };
    let (rx, import) = match started_leg {
        Ok(x) => x,
        Err(r) => return refusal(r).into_response(),
    };
    let guard = AbortGuard { engine: l.engine.clone(), id, done: false, _import: import };
    let text = TextStream::new(l.prompter.clone(), stops);
    let timing = Timing { started, first: None, last: None, queued: None, spans };
    let prefix = if kind == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
    let ctx = Ctx {
        kind,
        id: format!("{prefix}-{}-{id}", l.worker_id),
        model: l.model_id.clone(),
        created: unix_now(),
    };
    if fields.stream {
        let include_usage = fields.stream_options.as_ref().is_some_and(|o| o.include_usage);
        stream_response(ctx, rx, guard, text, timing, include_usage, collector)
    } else {
        full_response(ctx, rx, guard, text, timing, collector).await
    }
}

struct Ctx {
    kind: Endpoint,
    id: String,
    model: String,
    created: u64,
}

impl Ctx {
    fn chunk(
        &self,
        delta: Option<String>,
        role: bool,
        finish: Option<ApiFinish>,
        usage_null: bool,
        logprobs: Option<Value>,
    ) -> String {
        let json = match self.kind {
            Endpoint::Chat => serde_json::to_string(&ChatCompletionChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk".into(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChatChunkChoice {
                    index: 0,
                    delta: ChatDelta { role: role.then(|| "assistant".into()), content: delta },
                    logprobs,
                    finish_reason: finish,
                }],
                usage: None,
            }),
            Endpoint::Completion => serde_json::to_string(&CompletionResponse {
                id: self.id.clone(),
                object: "text_completion".into(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![CompletionChoice {
                    index: 0,
                    text: delta.unwrap_or_default(),
                    logprobs: None,
                    finish_reason: finish,
                }],
                usage: None,
            }),
        }
        .unwrap_or_default();
        // Completions chunks carry `usage` only when asked for; keep `"usage": null` off otherwise.
        if !usage_null && self.kind == Endpoint::Chat {
            return json.replacen(",\"usage\":null", "", 1);
        }
        json
    }

    fn usage_chunk(&self, usage: Usage) -> String {
        let object = if self.kind == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
        serde_json::json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [], "usage": usage})
        .to_string()
    }
}

fn usage_of(o: &StepOutput) -> Usage {
    Usage::new(o.prompt_tokens as u32, o.completion_tokens as u32, o.cached_tokens as u32)
}

struct StreamState {
    ctx: Ctx,
    rx: UnboundedReceiver<StepOutput>,
    guard: AbortGuard,
    text: TextStream,
    timing: Timing,
    include_usage: bool,
    logprobs: Option<Collector>,
    sent_role: bool,
    done: bool,
}

fn stream_response(
    ctx: Ctx,
    rx: UnboundedReceiver<StepOutput>,
    guard: AbortGuard,
    text: TextStream,
    timing: Timing,
    include_usage: bool,
    logprobs: Option<Collector>,
) -> Response {
    let st =
        StreamState { ctx, rx, guard, text, timing, include_usage, logprobs, sent_role: false, done: false };
    let events = stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let mut out = String::new();
        if !st.sent_role && st.ctx.kind == Endpoint::Chat {
            st.sent_role = true;
            out.push_str(&sse_data(&st.ctx.chunk(Some(String::new()), true, None, st.include_usage, None)));
        }
        loop {
            let Some(o) = st.rx.recv().await else {
                // The engine dropped the request (shutdown): an error event, not a made-up finish reason.
                error_event(&mut out, &aborted());
                st.done = true;
                break;
            };
            st.timing.saw(&o);
            if let (Some(c), Some(t), Some(lp)) = (&mut st.logprobs, o.token, &o.logprobs) {
                c.push(t, lp);
            }
            let last = o.finished.is_some();
            let delta = st.text.push(o.token, last);
            if !delta.is_empty() {
                let lp = st.logprobs.as_mut().map(Collector::take);
                out.push_str(&sse_data(&st.ctx.chunk(Some(delta), false, None, st.include_usage, lp)));
            }
            if let Some(reason) = &o.finished {
                st.guard.done = true;
                st.done = true;
                let failed = match reason {
                    FinishReason::Error(e) => Some(ApiError::generation_failed(e)),
                    FinishReason::Abort => Some(aborted()),
                    FinishReason::Stop(_) | FinishReason::Length => None,
                };
                if let Some(err) = failed {
                    error_event(&mut out, &err);
                    st.timing.finish(&o, st.ctx.kind, "error");
                    break;
                }
                out.push_str(&sse_data(&st.ctx.chunk(
                    Some(String::new()),
                    false,
                    Some(api_finish(reason)),
                    st.include_usage,
                    st.logprobs.as_mut().map(Collector::take),
                )));
                if st.include_usage {
                    out.push_str(&sse_data(&st.ctx.usage_chunk(usage_of(&o))));
                }
                out.push_str(SSE_DONE);
                st.timing.finish(&o, st.ctx.kind, "ok");
                break;
            }
            if !out.is_empty() {
                break;
            }
        }
        Some((Ok::<Bytes, std::convert::Infallible>(Bytes::from(out)), st))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|e| ApiError::internal(e.to_string()).into_response())
}

async fn full_response(
    ctx: Ctx,
    mut rx: UnboundedReceiver<StepOutput>,
    mut guard: AbortGuard,
    mut text: TextStream,
    mut timing: Timing,
    mut logprobs: Option<Collector>,
) -> Response {
    let mut body = String::new();
    let last = loop {
        let Some(o) = rx.recv().await else {
            return aborted().into_response();
        };
        timing.saw(&o);
        if let (Some(c), Some(t), Some(lp)) = (&mut logprobs, o.token, &o.logprobs) {
            c.push(t, lp);
        }
        body.push_str(&text.push(o.token, o.finished.is_some()));
        if o.finished.is_some() {
            break o;
        }
    };
    guard.done = true;
    let reason = last.finished.clone().unwrap_or(FinishReason::Abort);
    match &reason {
        FinishReason::Error(e) => {
            timing.finish(&last, ctx.kind, "error");
            return ApiError::generation_failed(e).into_response();
        }
        FinishReason::Abort => {
            timing.finish(&last, ctx.kind, "error");
            return aborted().into_response();
        }
        FinishReason::Stop(_) | FinishReason::Length => {}
    }
    timing.finish(&last, ctx.kind, "ok");
    let usage = Some(usage_of(&last));
    let finish_reason = Some(api_finish(&reason));
    let json = match ctx.kind {
        Endpoint::Chat => serde_json::to_string(&ChatCompletionResponse {
            id: ctx.id,
            object: "chat.completion".into(),
            created: ctx.created,
            model: ctx.model,
            choices: vec![ChatChoice {
                index: 0,
                message: ChatMessage { role: "assistant".into(), content: Some(body) },
                logprobs: logprobs.as_mut().map(Collector::take),
                finish_reason,
            }],
            usage,
        }),
        Endpoint::Completion => serde_json::to_string(&CompletionResponse {
            id: ctx.id,
            object: "text_completion".into(),
            created: ctx.created,
            model: ctx.model,
            choices: vec![CompletionChoice { index: 0, text: body, logprobs: None, finish_reason }],
            usage,
        }),
    };
    match json {
        Ok(j) => ([(header::CONTENT_TYPE, "application/json")], j).into_response(),
        Err(e) => ApiError::internal(e.to_string()).into_response(),
    }
}

#[cfg(test)]
#[path = "api_tests.rs"]
mod tests;
