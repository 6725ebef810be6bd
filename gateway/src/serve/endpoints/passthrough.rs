//! OpenAI and vLLM endpoints the gateway does not route by prefix ([`PATHS`]: embeddings, responses, rerank,
//! score, tokenize, detokenize), passed through to a healthy worker of the body's model, so a client of a vLLM,
//! SGLang or llama.cpp pool loses nothing by pointing at the gateway.
//!
//! Such a request walks the same exchange as a completion (`exchange.rs`); its prepare stage is this file, and
//! the later stages treat it as a prompt not tokenized here: the body limit and read timeout, the caller's API key, its tenant's salt (a keyed caller's `cache_salt` is
//! replaced like a completion's, and a client may not send a tenant salt's form), its class and budget, the
//! first-byte and idle timeouts, fallbacks on a refusal or a connection failure, the charging rules (`charge.rs`),
//! and the request metrics (`route="load"`, `"fallback"` for a fallback, plus
//! `kvgate_gateway_passthrough_requests_total{path}`). What differs:
//! - the worker is chosen by load alone (`Router::route_by_load`), whatever the policy: the gateway does not read
//!   these bodies' prompts, so it has no prefix to match (and embeddings, rerank and tokenize keep no KV worth
//!   following);
//! - the price is an estimate: `body bytes / BYTES_PER_TOKEN` prompt tokens (a score or rerank body: per
//!   (query, document) pair, `sizing.rs`) plus `max_output_tokens` (or the class's expected output) for
//!   `/v1/responses`, settled by the response's `usage` when it has one
//!   (`prompt_tokens` / `input_tokens`, `completion_tokens` / `output_tokens`), else by the charging rules of
//!   `charge.rs` (a completed answer: as priced);
//! - a body without `model` goes to the only model served, or is refused (400, param `model`) when there are
//!   several.
//!
//! `GET /v1/models/{id}` is answered by the gateway itself (`models.rs`).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvgate_shared::handoff::TENANT_SALT_PREFIX;
use serde::Deserialize;

use crate::control::keys::Caller;
use crate::errors::{ApiError, GatewayErrors};
use crate::serve::endpoints::sizing;
use crate::serve::exchange::Endpoint;
use crate::serve::host::ServeHost;
use crate::serve::prepare::{salt_for, unknown_model};
use crate::serve::request::set_members;
use crate::serve::stages::{Incoming, Prepared};

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

/// The model a body names, else the only one served.
fn model_of(host: &dyn ServeHost, named: Option<String>) -> Result<String, ApiError> {
    let served = host.registry().models(Instant::now());
    match named {
        Some(m) if served.contains(&m) || host.cfg().is_configured(&m) => Ok(m),
        Some(m) => Err(unknown_model(host, &m)),
        None => match served.as_slice() {
            [only] => Ok(only.clone()),
            _ => Err(ApiError::invalid("model", "model is required (this gateway serves several, or none)")),
        },
    }
}

/// Reads and checks the body; rewrites a keyed caller's salt; estimates its prompt from its size.
fn read(
    host: &dyn ServeHost,
    caller: &Caller,
    path: &str,
    body: Bytes,
    header_salt: Option<&str>,
) -> Result<Prepared, ApiError> {
    let f: Fields = serde_json::from_slice(&body).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            ApiError::bad_json(format!("the body is not valid JSON: {e}"))
        } else {
            ApiError::invalid("body", format!("invalid request: {e}"))
        }
    })?;
    let model = model_of(host, f.model)?;
    if !caller.allows(&model) {
        return Err(ApiError::model_not_allowed(&model));
    }
    let had_salt = f.cache_salt.is_some();
    let client_salt = f.cache_salt.as_ref().and_then(|s| s.as_deref()).or(header_salt);
    if client_salt.is_some_and(|s| s.starts_with(TENANT_SALT_PREFIX)) {
        let m =
            format!("a cache salt may not start with {TENANT_SALT_PREFIX:?} (reserved for tenants' salts)");
        return Err(ApiError::invalid("cache_salt", &m));
    }
    let (salt, _, salt_rewritten) = match NO_KV.contains(&path) {
        true => (None, None, false),
        false => salt_for(caller, client_salt, host.cfg().report_secret.as_deref()),
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
    let max_model_len = host.registry().max_model_len(&model);
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
        let limit = max_model_len.map_or(MAX_OUTPUT_TOKENS, u64::from);
        if f.max_output_tokens.is_some_and(|n| n > limit) {
            return Err(ApiError::invalid(
                "max_output_tokens",
                format!(
                    "max_output_tokens may be at most {limit} (the model's context, or MAX_OUTPUT_TOKENS)"
                ),
            ));
        }
    }
    let size = sizing::pairs(path, &body, max_model_len).unwrap_or_else(|| sizing::whole(body.len() as u64));
    Ok(Prepared {
        model,
        stream: f.stream.unwrap_or(false),
        prompt_tokens: size.estimate,
        prompt_cap: size.cap,
        choices: 1,
        reasoning: false,
        // 0 names no limit (the class's expected output prices it), as before the one exchange.
        max_output: f.max_output_tokens.filter(|n| generates && *n > 0),
        generates,
        max_model_len,
        strip_usage: false,
        prompt: None,
        body,
        salt_rewritten,
    })
}

/// The pass-through endpoints ([`PATHS`]).
pub struct PassThrough;

impl Endpoint for PassThrough {
    async fn prepare(
        &self,
        host: &Arc<dyn ServeHost>,
        incoming: &Incoming,
        body: Bytes,
    ) -> Result<Prepared, ApiError> {
        let path = incoming.path.as_str();
        let p = read(host.as_ref(), &incoming.caller, path, body, incoming.cache_salt.as_deref())?;
        let label = PATHS.iter().copied().find(|p| *p == path).unwrap_or("other");
        metrics::counter!("kvgate_gateway_passthrough_requests_total", "path" => label).increment(1);
        Ok(p)
    }
}
