//! kvgate-gateway: the OpenAI-compatible front door that routes each request to the worker holding its KV cache.
//!
//! - [`listener`]: the public accept loop (connection cap, header deadline, keep-alive idle timeout) in front of
//!   pingora's HTTP handling;
//! - [`proxy`]: the pingora `ProxyHttp` service (body, caller, prepare, route, admit, forward); [`upstream`]: one
//!   attempt at one worker (first-byte and idle timeouts, refusals, streaming back);
//! - [`request`]: the lean, bounded request parser; [`prepare`]: parse + tokenize + hash + context check;
//!   [`tokenize`]: the bounded pool that runs it off the proxy threads;
//! - [`keys`]: API keys -> tenant, classes a caller may choose, forced cache salt;
//! - [`admission`]: per-class token budgets with bounded, tenant-fair wait queues;
//! - [`routing`]: the policies (pure; shared with the simulator) and the ring;
//! - [`registry`]: worker states from the config and from reports (health, faults, staleness, overlay, load);
//! - [`trust`]: which `advertise_url`s a report may register;
//! - [`state`]: shared state (registry, per-model tokenizers fetched from workers, policy, client, metrics);
//! - [`control`]: the control listener (report ingest on its own thread, metrics, worker states, upkeep);
//! - [`admin`]: the admin REST API (weights, budgets, drain, route/explain; bearer auth, ETags);
//! - [`persist`]: the admin state file; [`auth`]: bearer tokens, constant-time comparison, control-port errors;
//! - [`config`], [`errors`].

pub mod admin;
pub mod admission;
pub mod auth;
pub mod config;
pub mod control;
pub mod errors;
pub mod keys;
pub mod listener;
pub mod persist;
pub mod prepare;
pub mod proxy;
pub mod registry;
pub mod request;
pub mod routing;
pub mod state;
pub mod tokenize;
pub mod trust;
pub mod upstream;
