//! vLLM's `POST /tokenize` and `POST /detokenize`, so tools written for a vLLM pool work on a kvgate one (through
//! the gateway, which passes them through). `/tokenize` takes a text `prompt` (`add_special_tokens`, default true)
//! or chat `messages` (`add_generation_prompt`, default true; `tools`, `chat_template_kwargs`), rendered and
//! tokenized exactly as a completion's prompt, and answers `{"count", "max_model_len", "tokens", "token_strs"}`
//! (`token_strs` with `return_token_strs: true`, else null). `/detokenize` takes `tokens` and answers `{"prompt"}`.
//! Both read the body within `--max-body-bytes`, and a `model` that is not this worker's is 404, as a completion.
//! A field these endpoints do not implement is refused by name (400 `unsupported_parameter`: vLLM's
//! `continue_final_message`, `mm_processor_kwargs`, `add_special_tokens: true` with messages, ...), and a chat-only
//! field sent with a text prompt is 400 on that field; none is ignored.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvgate_shared::prompt::{chat_options, PromptInput};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::api::parse_body;
use super::errors::{ApiError, WorkerErrors};
use super::AppState;

#[derive(Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<Value>>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Map<String, Value>>,
    #[serde(default)]
    return_token_strs: bool,
    /// Anything else (vLLM's `continue_final_message`, `mm_processor_kwargs`, ...): refused by name.
    #[serde(flatten)]
    extra: Map<String, Value>,
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

/// The first field of `extra`, refused by name (400 `unsupported_parameter`).
fn refuse_extra(extra: &Map<String, Value>) -> Result<(), ApiError> {
    match extra.keys().next() {
        Some(k) => Err(ApiError::unsupported(k)),
        None => Ok(()),
    }
}

fn check_model(named: Option<&str>, served: &str) -> Result<(), ApiError> {
    match named {
        Some(m) if m != served => Err(ApiError::model_not_found(m, served)),
        _ => Ok(()),
    }
}

/// `POST /tokenize`.
pub async fn tokenize(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let result = async {
        let l = super::api::loaded(&state)?;
        let req: TokenizeRequest = parse_body(body, state.cfg.max_body_bytes).await?;
        check_model(req.model.as_deref(), &l.model_id)?;
        let client = |e: kvgate_shared::prompt::PromptError, param: &str| {
            if e.is_client_error() {
                ApiError::invalid(param, e.to_string())
            } else {
                ApiError::internal(e.to_string())
            }
        };
        refuse_extra(&req.extra)?;
        let ids = match (&req.prompt, &req.messages) {
            (Some(_), None) if req.add_generation_prompt.is_some() || req.tools.is_some() => {
                let field = if req.tools.is_some() { "tools" } else { "add_generation_prompt" };
                return Err(ApiError::invalid(
                    field,
                    format!("{field} applies to messages, not to a prompt"),
                ));
            }
            (Some(_), None) if req.chat_template_kwargs.is_some() => {
                let m = "chat_template_kwargs applies to messages, not to a prompt";
                return Err(ApiError::invalid("chat_template_kwargs", m));
            }
            (None, Some(_)) if req.add_special_tokens == Some(true) => {
                // The chat template writes the special tokens itself (vLLM's default for messages is false).
                return Err(ApiError::unsupported("add_special_tokens"));
            }
            (Some(text), None) => l
                .prompter
                .encode(text, req.add_special_tokens.unwrap_or(true))
                .map_err(|e| client(e, "prompt"))?,
            (None, Some(messages)) => {
                let options = chat_options(req.add_generation_prompt, req.tools, req.chat_template_kwargs);
                let input = PromptInput::Chat { messages, options: &options };
                l.prompter.tokenize(&input).map_err(|e| client(e, "messages"))?
            }
            _ => return Err(ApiError::invalid("prompt", "give either prompt or messages")),
        };
        let strs = req.return_token_strs.then(|| {
            ids.iter().map(|t| l.prompter.decode(&[*t], false).unwrap_or_default()).collect::<Vec<_>>()
        });
        Ok(json!({"count": ids.len(), "max_model_len": l.max_model_len, "tokens": ids, "token_strs": strs}))
    }
    .await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize`.
pub async fn detokenize(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let result = async {
        let l = super::api::loaded(&state)?;
        let req: DetokenizeRequest = parse_body(body, state.cfg.max_body_bytes).await?;
        check_model(req.model.as_deref(), &l.model_id)?;
        refuse_extra(&req.extra)?;
        let vocab = l.prompter.vocab_size();
        if let Some(t) = req.tokens.iter().find(|t| **t as usize >= vocab) {
            return Err(ApiError::invalid(
                "tokens",
                format!("token {t} is not in the vocabulary of {vocab}"),
            ));
        }
        let text = l.prompter.decode(&req.tokens, false).map_err(|e| ApiError::internal(e.to_string()))?;
        Ok(json!({ "prompt": text }))
    }
    .await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
