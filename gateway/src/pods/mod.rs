//! What the gateway learns from pods by itself rather than from kvgate reports: `discovery` (a pool's pods from a
//! headless Service's DNS records), `scrape` (queue metrics of vLLM/SGLang pods), `vllm_events` and
//! `vllm_subscriber` (their KV event streams, decoded and followed into the exact index of
//! `kvgate_router::registry::event_index`, over the bounded ZeroMQ client `zmtp`), and `link_probe` (timed samples
//! of each prefill -> decode link before its first split).

pub mod discovery;
pub mod dp_rank;
pub mod event_sources;
pub mod link_probe;
pub mod scrape;
pub mod vllm_events;
pub mod vllm_subscriber;
pub mod zmtp;

use std::sync::{Arc, MutexGuard};

use kvgate_shared::hashing::HashScheme;

use crate::config::{GatewayConfig, ModelSpec};
use crate::registry::Registry;
use crate::HttpClient;

/// What the pods' tasks touch, and nothing else of the gateway (`state::GatewayState` implements it; this room
/// imports nothing from the state): the configuration, the registry, the client to pods, a model's hash scheme,
/// and the split policy's name.
pub trait PodsHost: Send + Sync + 'static {
    fn cfg(&self) -> &GatewayConfig;
    fn registry(&self) -> MutexGuard<'_, Registry>;
    fn client(&self) -> &HttpClient;
    /// The hash scheme the gateway tokenizes `model` with, once known.
    fn scheme(&self, model: &str) -> Option<HashScheme>;
    /// Adds a discovered pod of `m`'s pool to the registry (`state::enroll`).
    fn enroll(&self, m: &ModelSpec, url: &str);
    /// Starts fetching a kvgate worker's tokenizer in the background.
    fn fetch_tokenizer(self: &Arc<Self>, url: String);
    fn split_policy(&self) -> &'static str;
}
