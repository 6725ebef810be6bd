//! A request made ready for routing: parsed (see `request.rs`), rendered and tokenized exactly like the worker
//! will, its full blocks hashed, its session key found, and its context checked against the model's length. The
//! completions endpoint runs this on the tokenize pool (`endpoints/completions.rs`); `POST /admin/v1/route/explain` runs the same function, so what it
//! explains is what the proxy does.
//!
//! Salts and tenants: an anonymous caller's salt (body `cache_salt`, else the `x-kvgate-cache-salt` header) keys
//! its blocks as sent. A keyed caller's salt, the one its key forces or else the one it sent, is replaced by
//! `handoff::tenant_salt` (opaque, keyed by the report secret, the tenant and whether the key forced it) in the
//! body every pod gets, and keyed under its tenant scope (`RequestPrompt::extra_keys`), which kvgate workers learn
//! from the gateway's assertion: no body or header of another caller can reach those blocks.
//!
//! Streams are asked for usage (`stream_options.include_usage`) when the client did not ask, so the end of every
//! stream says what it cost (`charge.rs`); `strip_usage` tells the proxy to take it out again.

use std::time::Instant;

use bytes::Bytes;
use kvgate_shared::handoff::{tenant_salt, TenantScope, TENANT_SALT_PREFIX};
use kvgate_shared::hashing::{BlockHash, BlockHasher};
use kvgate_shared::prompt::RequestPrompt;

use crate::control::keys::Caller;
use crate::errors::{ApiError, GatewayErrors};
use crate::route::RouteInput;
use crate::serve::host::ServeHost;
use crate::serve::lora_catalog::AdapterRef;
use crate::serve::request::{parse, set_members, stream_options_with_usage, PromptBody, RoutingFields};

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
    /// The salt the worker will read (a keyed caller's tenant salt, else the body's, else the header's).
    pub salt: Option<String>,
    /// The salt was replaced by a keyed caller's tenant salt (in the body): the salt header is not forwarded.
    pub salt_rewritten: bool,
    /// The tenant scope the blocks are keyed under (kvgate workers learn it from the gateway's assertion).
    pub scope: Option<TenantScope>,
    /// The gateway asked the stream for usage the client did not ask for.
    pub strip_usage: bool,
    /// The scheme fingerprint the prompt was tokenized and hashed with.
    pub fingerprint: u64,
    /// The body to forward (rewritten for a keyed caller's salt, or to ask a stream for its usage).
    pub body: Bytes,
    /// The model's context length, when a worker told it.
    pub max_model_len: Option<u32>,
    /// The gateway rendered and tokenized the prompt (chat or text; a prompt of token ids was given as ids).
    pub tokenized: bool,
    /// The LoRA adapter its `model` names (tokenized as its base model, its blocks keyed by the adapter's key).
    pub adapter: Option<AdapterRef>,
}

impl PreparedRequest {
    /// What the router needs to know about this request.
    pub fn route_input(&self) -> RouteInput<'_> {
        RouteInput {
            model: self.adapter.as_ref().map_or(&self.fields.model, |a| &a.base),
            hashes: &self.hashes,
            prompt_tokens: self.ids.len(),
            session_key: self.session_key,
            shared_blocks: self.shared_blocks,
            block_size: self.block_size,
            only: None,
            adapter: self.adapter.as_ref().map(|a| a.name.as_str()),
            output_tokens: 0,
            slo: kvgate_router::routing::Slo::default(),
        }
    }
}

/// A caller's salt as it keys the blocks: (the salt sent to pods, the tenant scope, whether it replaced the body's
/// and header's). `secret`: the report secret (keys the tenant salt; without it no scope reaches the workers, so
/// none is used here either).
pub fn salt_for(
    caller: &Caller,
    client_salt: Option<&str>,
    secret: Option<&str>,
) -> (Option<String>, Option<TenantScope>, bool) {
    if !caller.known {
        return (client_salt.map(str::to_owned), None, false);
    }
    let (salt, forced) = match (caller.cache_salt.as_deref(), client_salt) {
        (Some(f), _) => (f, true),
        (None, Some(c)) => (c, false),
        (None, None) => return (None, None, false),
    };
    let scope = secret.map(|_| TenantScope::new(&caller.tenant, forced));
    (Some(tenant_salt(secret, &caller.tenant, forced, salt)), scope, true)
}

/// Parses a chat (`chat`) or completions body, tokenizes and hashes it for `caller` (its tenant and forced salt);
/// `learn`: record the prompt in the ring-key sketch (false for dry runs).
pub fn prepare(
    host: &dyn ServeHost,
    chat: bool,
    body: Bytes,
    headers: &PrepHeaders,
    caller: &Caller,
    learn: bool,
) -> Result<PreparedRequest, ApiError> {
    let (fields, prompt) = parse(chat, &body, host.cfg().max_chat_json_values)?;
    if !caller.allows(&fields.model) {
        return Err(ApiError::model_not_allowed(&fields.model));
    }
    let adapter = resolve_adapter(host, &fields.model)?;
    let base = adapter.as_ref().map_or(fields.model.as_str(), |a| a.base.as_str());
    let Some(tok) = host.tokenizer(base) else {
        return Err(unknown_model(host, &fields.model));
    };
    let tokenized = !matches!(prompt, PromptBody::TokenIds(_));
    let client = RequestPrompt {
        input: prompt.input(),
        body_salt: fields.cache_salt.as_deref(),
        header_salt: headers.cache_salt.as_deref(),
        scope: None,
    };
    if client.salt().is_some_and(|s| s.starts_with(TENANT_SALT_PREFIX)) {
        // The form of the salts the gateway derives for tenants: no client may send one (without a report secret
        // the derivation is public, so this is what keeps a tenant's namespace its own).
        return Err(ApiError::invalid(
            "cache_salt",
            format!("a cache salt may not start with {TENANT_SALT_PREFIX:?} (reserved for tenants' salts)"),
        ));
    }
    let (tenant_salt, scope, salt_rewritten) =
        salt_for(caller, client.salt(), host.cfg().report_secret.as_deref());
    let mut members = Vec::new();
    if salt_rewritten {
        let s = tenant_salt.as_deref().unwrap_or_default();
        members
            .push(("cache_salt", serde_json::to_string(s).map_err(|e| ApiError::internal(e.to_string()))?));
    }
    let strip_usage = fields.stream && !fields.include_usage;
    if strip_usage {
        let opts = match fields.body_keys.stream_options {
            true => stream_options_with_usage(&body)?,
            false => r#"{"include_usage":true}"#.to_owned(),
        };
        members.push(("stream_options", opts));
    }
    // A body with none of the keys gets them in front (a copy); one that has some is rewritten member by member.
    let keys = fields.body_keys;
    let body = match members.is_empty() {
        true => body,
        false => Bytes::from(set_members(&body, keys.cache_salt || keys.stream_options, &members)?),
    };
    let request = if salt_rewritten {
        RequestPrompt {
            body_salt: tenant_salt.as_deref(),
            header_salt: None,
            scope: scope.as_ref(),
            ..client
        }
    } else {
        client
    };
    let ids = request.token_ids(&tok.prompter, None).map_err(|e| ApiError::prompt(e, request.param()))?;
    let salt = request.salt().map(str::to_owned);
    let mut extra = request.extra_keys();
    if let Some(a) = &adapter {
        // As the worker keys an adapter's blocks (`Engine::new_sequence`): never the base model's or another's.
        extra = extra.with(kvgate_shared::hashing::ExtraKey::LoraAdapter(a.key.clone()));
    }
    drop(prompt);
    let max_model_len = host.registry().max_model_len(base);
    if let Some(limit) = max_model_len {
        check_context(ids.len(), fields.max_tokens, limit)?;
    }
    let hashes = BlockHasher::new(&tok.scheme, &extra).hash_blocks(&ids);
    let explicit = headers.session.clone().or_else(|| fields.user.clone());
    let ring = host.ring_keys().route_key(explicit.as_deref(), &hashes, &ids, learn);
    Ok(PreparedRequest {
        fields,
        ids,
        hashes,
        session_key: ring.key,
        shared_blocks: ring.shared_blocks,
        block_size: tok.scheme.block_size as usize,
        salt,
        salt_rewritten,
        scope,
        strip_usage,
        fingerprint: tok.scheme.fingerprint(),
        body,
        max_model_len,
        tokenized,
        adapter,
    })
}

/// The adapter `model` names: `None` for a model with a tokenizer here (a base model) or a name that is neither
/// held nor in the catalogue (the caller answers 404). An adapter of the catalogue nobody holds has the base
/// `--lora-base`, else the fleet's one model; with several and no `--lora-base` it is 404 with that said.
pub fn resolve_adapter(host: &dyn ServeHost, model: &str) -> Result<Option<AdapterRef>, ApiError> {
    if host.tokenizer(model).is_some() {
        return Ok(None);
    }
    let now = Instant::now();
    let reg = host.registry();
    let key = || reg.adapter_key(model).unwrap_or_else(|| model.to_owned());
    if let Some(base) = reg.adapter_base(model, now) {
        return Ok(Some(AdapterRef { name: model.to_owned(), base, key: key() }));
    }
    if host.adapter_loads().path(model).is_none() {
        return Ok(None);
    }
    let base = match host.cfg().lora_base.clone() {
        Some(b) => b,
        None => match reg.models(now).as_slice() {
            [one] => one.clone(),
            [] => return Err(ApiError::no_worker(model)),
            _ => {
                return Err(ApiError::unknown_model(format!(
                    "no pod holds the adapter {model:?} and the fleet serves several models: set --lora-base to load it"
                )))
            }
        },
    };
    Ok(Some(AdapterRef { name: model.to_owned(), base, key: key() }))
}

/// A model this gateway has no tokenizer for: 404 `model_not_found`, or, while the gateway may not know every model
/// yet (`ServeHost::warming_up`: no tokenizer yet, or a worker's on its way), 503 `no_healthy_worker`, which
/// a client retries (a replica restarted under load answered 404 for its first second, found by the chaos run).
pub fn unknown_model(host: &dyn ServeHost, model: &str) -> ApiError {
    match host.warming_up() {
        true => ApiError::no_worker(model),
        false => ApiError::model_not_found(model),
    }
}

/// Refuses what the worker would refuse for its length, before anything is charged: `max_tokens` over the context
/// length, or a prompt that leaves no room for the output (at least one token).
pub fn check_context(prompt_tokens: usize, max_tokens: Option<u32>, limit: u32) -> Result<(), ApiError> {
    if let Some(m) = max_tokens.filter(|m| *m > limit) {
        return Err(ApiError::context_length(
            format!("max_tokens is {m}, more than the model's context length of {limit} tokens"),
            "max_tokens",
        ));
    }
    let out = u64::from(max_tokens.unwrap_or(1).max(1));
    if prompt_tokens as u64 + out > u64::from(limit) {
        return Err(ApiError::context_length(format!(
            "the prompt has {prompt_tokens} tokens and asks for {out} more; the model's context length is {limit}"
        ), "max_tokens"));
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
