//! What a request's exchange needs from the gateway around it, and nothing more: [`ServeHost`]. `GatewayState`
//! implements it (`state.rs`); `serve/` never names the state itself, so a stage's reach is written in this trait's
//! signatures, and a second front end (an endpoint picker that runs the same stages and answers with a destination)
//! holds the same host.
//!
//! Invariants: every lock a method hands out is short and never held across an await (the registry's, the ring
//! keys'); nothing here blocks or does I/O.

use std::sync::{Arc, MutexGuard};

use kvgate_shared::hashing::{BlockHash, HashScheme};
use kvgate_shared::prompt::Prompter;
use kvgate_shared::trace::Tracer;

use crate::admission::Admission;
use crate::config::GatewayConfig;
use crate::control::keys::Caller;
use crate::registry::{Registry, SentTicket};
use crate::route::Router;
use crate::routing::RingKeys;
use crate::serve::learned::LearnedOutputs;
use crate::serve::tokenize::TokenizePool;
use crate::HttpClient;
use kvgate_router::split::SplitPolicy;

/// How this gateway tokenizes and hashes one model.
pub struct ModelTokenizer {
    pub prompter: Prompter,
    pub scheme: HashScheme,
}

/// The gateway as the exchange's stages see it.
pub trait ServeHost: Send + Sync + 'static {
    /// The flags (read-only: limits, timeouts, the report secret).
    fn cfg(&self) -> &GatewayConfig;
    /// The worker registry (held briefly, never across an await).
    fn registry(&self) -> MutexGuard<'_, Registry>;
    /// The routing policy behind the one `route()`.
    fn router(&self) -> &Router;
    /// The prefill/decode split policy (`--split-policy`).
    fn split_policy(&self) -> &dyn SplitPolicy;
    /// The class budgets.
    fn admission(&self) -> &Admission;
    /// The caller behind an `Authorization` header value, when its key is known.
    fn identify(&self, authorization: Option<&str>) -> Option<Arc<Caller>>;
    /// The pool prompts are tokenized on.
    fn tokenize_pool(&self) -> &TokenizePool;
    /// How `model` is tokenized and hashed, once known.
    fn tokenizer(&self, model: &str) -> Option<Arc<ModelTokenizer>>;
    /// The gateway may not know every model yet: no model has a tokenizer here yet, or a worker's tokenizer is
    /// being fetched. Constant time (a client may send unknown models at will). A model unknown meanwhile is answered 503
    /// `no_healthy_worker` (retry), not 404 `model_not_found`.
    fn warming_up(&self) -> bool;
    /// The ring-key chooser (held briefly: one prompt's block chain).
    fn ring_keys(&self) -> MutexGuard<'_, RingKeys>;
    /// What each class's completed requests produced.
    fn learned_outputs(&self) -> &LearnedOutputs;
    /// Tells the other replicas of a send (with `--share-sends` and Redis; never waits).
    fn share_send(&self, worker: &str, hashes: &[BlockHash], uncached_tokens: u64, session: u64);
    /// The pooled client to workers.
    fn client(&self) -> &HttpClient;
    /// Request spans (`--otlp-endpoint`).
    fn tracer(&self) -> &Tracer;
    /// The `--lora` catalogue and its loads.
    fn adapter_loads(&self) -> &crate::serve::lora_catalog::AdapterLoads;
}

/// Gives a worker's in-flight slot back on every path (the send was recorded by the router).
pub struct InflightGuard {
    host: Arc<dyn ServeHost>,
    ticket: SentTicket,
}

impl InflightGuard {
    pub fn new(host: &Arc<dyn ServeHost>, ticket: SentTicket) -> Self {
        Self { host: host.clone(), ticket }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.host.registry().record_done(self.ticket);
    }
}
