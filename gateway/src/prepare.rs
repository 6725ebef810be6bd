//! A request made ready for routing: parsed (see `request.rs`), rendered and tokenized exactly like the worker
//! will, its full blocks hashed, its session key found, and its context checked against the model's length. The
//! proxy runs this on the tokenize pool; `POST /admin/v1/route/explain` runs the same function, so what it
//! explains is what the proxy does.

use bytes::Bytes;
use kvgate_shared::hashing::{BlockHash, BlockHasher};
use kvgate_shared::prompt::RequestPrompt;

use crate::errors::ApiError;
use crate::request::{parse, with_cache_salt, PromptBody, RoutingFields};
use crate::route::RouteInput;
use crate::state::GatewayState;

/// Header carrying a session id for the ring.
pub const SESSION_HEADER: &str = "x-session-id";
pub use kvgate_shared::prompt::CACHE_SALT_HEADER;

/// The request headers preparation reads.
#[derive(Clone, Debug, Default)]
pub struct PrepHeaders {
    pub session: Option<String>,
    pub cache_salt: Option<String>,
}

/// A request parsed, tokenized and hashed exactly like the worker will.
#[derive(Debug)]
pub struct PreparedRequest {
    pub fields: RoutingFields,
    pub ids: Vec<u32>,
    pub hashes: Vec<BlockHash>,
    pub session_key: u64,
    /// Leading blocks other conversations share (`RingKey::shared_blocks`).
    pub shared_blocks: usize,
    pub block_size: usize,
    /// The salt the worker will use (a caller's forced salt, else the body's, else the header's; `RequestPrompt`).
    pub salt: Option<String>,
    /// The body to forward (rewritten when a forced salt replaced the caller's).
    pub body: Bytes,
    /// The model's context length, when a worker told it.
    pub max_model_len: Option<u32>,
    /// The gateway rendered and tokenized the prompt (chat or text; a prompt of token ids was given as ids).
    pub tokenized: bool,
}

impl PreparedRequest {
    /// What the router needs to know about this request.
    pub fn route_input(&self) -> RouteInput<'_> {
        RouteInput {
            model: &self.fields.model,
            hashes: &self.hashes,
            prompt_tokens: self.ids.len(),
            session_key: self.session_key,
            shared_blocks: self.shared_blocks,
            block_size: self.block_size,
        }
    }
}

/// Parses a chat (`chat`) or completions body, tokenizes and hashes it. `forced_salt` is the caller's key's salt;
/// `learn`: record the prompt in the ring-key sketch (false for dry runs).
pub fn prepare(
    state: &GatewayState,
    chat: bool,
    body: Bytes,
    headers: &PrepHeaders,
    forced_salt: Option<&str>,
    learn: bool,
) -> Result<PreparedRequest, ApiError> {
    let (fields, prompt) = parse(chat, &body, state.cfg.max_chat_json_values)?;
    let Some(tok) = state.tokenizer(&fields.model) else {
        return Err(ApiError::model_not_found(&fields.model));
    };
    let tokenized = !matches!(prompt, PromptBody::TokenIds(_));
    // A caller key's forced salt replaces the body's: the body is rewritten to carry it.
    let body = match forced_salt {
        Some(s) => Bytes::from(with_cache_salt(&body, s)?),
        None => body,
    };
    let request = RequestPrompt {
        input: prompt.input(),
        body_salt: forced_salt.or(fields.cache_salt.as_deref()),
        header_salt: headers.cache_salt.as_deref(),
    };
    let ids = request.token_ids(&tok.prompter, None).map_err(|e| ApiError::prompt(e, request.param()))?;
    let salt = request.salt().map(str::to_owned);
    let extra = request.extra_keys();
    drop(prompt);
    let max_model_len = state.registry().max_model_len(&fields.model);
    if let Some(limit) = max_model_len {
        check_context(ids.len(), fields.max_tokens, limit)?;
    }
    let hashes = BlockHasher::new(&tok.scheme, &extra).hash_blocks(&ids);
    let explicit = headers.session.clone().or_else(|| fields.user.clone());
    let ring = state.ring_keys().route_key(explicit.as_deref(), &hashes, &ids, learn);
    Ok(PreparedRequest {
        fields,
        ids,
        hashes,
        session_key: ring.key,
        shared_blocks: ring.shared_blocks,
        block_size: tok.scheme.block_size as usize,
        salt,
        body,
        max_model_len,
        tokenized,
    })
}

/// Refuses what the worker would refuse for its length, before anything is charged: `max_tokens` over the context
/// length, or a prompt that leaves no room for the output (at least one token).
pub fn check_context(prompt_tokens: usize, max_tokens: Option<u32>, limit: u32) -> Result<(), ApiError> {
    if let Some(m) = max_tokens.filter(|m| *m > limit) {
        return Err(ApiError::context_length(format!(
            "max_tokens is {m}, more than the model's context length of {limit} tokens"
        )));
    }
    let out = u64::from(max_tokens.unwrap_or(1).max(1));
    if prompt_tokens as u64 + out > u64::from(limit) {
        return Err(ApiError::context_length(format!(
            "the prompt has {prompt_tokens} tokens and asks for {out} more; the model's context length is {limit}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_checks_match_the_workers() {
        assert!(check_context(100, Some(100), 200).is_ok());
        assert!(check_context(100, Some(101), 200).is_err());
        let e = check_context(1, Some(u32::MAX), 4096).expect_err("poison");
        assert_eq!((e.status, e.code), (400, "context_length_exceeded"));
        assert!(check_context(199, None, 200).is_ok());
        assert!(check_context(200, None, 200).is_err(), "no room for one token");
    }
}
