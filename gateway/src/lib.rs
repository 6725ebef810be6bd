//! kvgate-gateway: the OpenAI-compatible front door that routes each request to the worker holding its KV cache.
//!
//! - [`admission`]: per-class token budgets with bounded, tenant-fair wait queues;
//! - [`routing`]: the policies (pure; shared with the simulator) and the ring;
//! - [`registry`]: worker states from the config and from reports (health, staleness, overlay, load);
//! - [`state`]: shared state (registry, per-model tokenizers fetched from workers, policy, client, metrics);
//! - [`proxy`]: the pingora `ProxyHttp` service (parse, tokenize, hash, route, forward, stream back);
//! - [`control`]: the control listener (report ingest, metrics, worker states);
//! - [`admin`]: the admin REST API (weights, budgets, drain, route/explain; bearer auth, ETags, state file);
//! - [`config`], [`errors`].

pub mod admin;
pub mod admission;
pub mod config;
pub mod control;
pub mod errors;
pub mod proxy;
pub mod registry;
pub mod routing;
pub mod state;
