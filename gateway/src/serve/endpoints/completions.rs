//! `POST /v1/completions` and `/v1/chat/completions`: the prompt parsed, rendered, tokenized and hashed exactly
//! like the workers will (`prepare.rs`), on the tokenize pool (503 `tokenizer_busy` when its queue is full), so the
//! request is routed by its prefix and priced by its uncached part.

use std::sync::Arc;

use bytes::Bytes;

use crate::control::keys::Caller;
use crate::errors::{ApiError, GatewayErrors};
use crate::serve::exchange::Endpoint;
use crate::serve::host::ServeHost;
use crate::serve::prepare::{prepare, PrepHeaders, PreparedRequest};
use crate::serve::stages::{Incoming, Prepared};
use crate::serve::tokenize::PoolError;

/// The completions endpoints.
pub struct Completions {
    /// `/v1/chat/completions` (messages), else `/v1/completions` (a prompt).
    pub chat: bool,
    /// Teach the ring-key sketch this prompt (requests that are routed; explain's dry runs pass false).
    pub learn: bool,
}

impl Completions {
    /// The endpoint of a routed request at `path`, if it is one of these.
    pub fn at(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Self { chat: true, learn: true }),
            "/v1/completions" => Some(Self { chat: false, learn: true }),
            _ => None,
        }
    }

    /// Parses, tokenizes and hashes a request on the tokenize pool.
    pub async fn on_pool(
        &self,
        host: &Arc<dyn ServeHost>,
        body: Bytes,
        headers: PrepHeaders,
        caller: Arc<Caller>,
    ) -> Result<PreparedRequest, ApiError> {
        let (h, chat, learn) = (host.clone(), self.chat, self.learn);
        match host
            .tokenize_pool()
            .run(move || prepare(h.as_ref(), chat, body, &headers, &caller, learn))
            .await
        {
            Ok(r) => r,
            Err(PoolError::Busy) => Err(ApiError::tokenizer_busy()),
            Err(PoolError::Failed) => Err(ApiError::internal("preparing the request failed")),
        }
    }
}

impl Endpoint for Completions {
    async fn prepare(
        &self,
        host: &Arc<dyn ServeHost>,
        incoming: &Incoming,
        body: Bytes,
    ) -> Result<Prepared, ApiError> {
        let headers =
            PrepHeaders { session: incoming.session.clone(), cache_salt: incoming.cache_salt.clone() };
        let p = self.on_pool(host, body, headers, incoming.caller.clone()).await?;
        Ok(Prepared {
            model: p.fields.model.clone(),
            body: p.body.clone(),
            stream: p.fields.stream,
            salt_rewritten: p.salt_rewritten,
            prompt_tokens: p.ids.len() as u64,
            prompt_cap: p.ids.len() as u64,
            choices: u64::from(p.fields.choices),
            reasoning: p.fields.reasoning,
            max_output: p.fields.max_tokens.map(u64::from),
            generates: true,
            max_model_len: p.max_model_len,
            strip_usage: p.strip_usage,
            prompt: Some(p),
        })
    }
}
