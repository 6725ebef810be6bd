//! kvgate-gateway: the OpenAI-compatible front door that routes each request to the worker holding its KV cache.
//!
//! - [`listener`]: the public accept loop (connection cap, header deadline, keep-alive idle timeout) in front of
//!   pingora's HTTP handling;
//! - [`proxy`]: the pingora `ProxyHttp` service (body, caller, prepare, route, admit, forward); [`upstream`]: one
//!   attempt at one worker (first-byte and idle timeouts, refusals, streaming back); [`passthrough`]: the
//!   endpoints passed to a worker by load (embeddings, responses, rerank, score, tokenize);
//! - [`request`]: the lean, bounded request parser; [`prepare`]: parse + tokenize + hash + context check;
//!   [`tokenize`]: the bounded pool that runs it off the proxy threads;
//! - [`spans`]: a request's trace (stages and forward attempts) for the OTLP exporter;
//! - [`keys`]: API keys -> tenant, classes a caller may choose, forced cache salt;
//! - [`admission`], [`registry`], [`routing`], [`route`]: the pure routing core, re-exported from the
//!   `kvgate-router` crate (the simulator links it without the HTTP stack);
//! - [`trust`]: which `advertise_url`s a report may register;
//! - [`state`]: shared state (registry, per-model tokenizers fetched from workers, policy, client, metrics);
//! - [`control`]: the control listener (report ingest on its own thread, metrics, worker states, upkeep);
//!   [`link_probe`]: the decode workers' timed samples of each P->D link before its first split;
//! - [`admin`]: the admin REST API (weights, budgets, drain, route/explain; bearer auth, ETags);
//! - [`persist`]: the admin state file; [`auth`]: bearer tokens, constant-time comparison, control-port errors;
//! - pods that are not kvgate workers (`[[models]]`): [`discovery`] (DNS), [`scrape`] (their metrics),
//!   [`vllm_events`], [`vllm_index`], [`vllm_subscriber`] (their KV events), [`zmtp`] (the bounded ZeroMQ client);
//! - [`config`], [`errors`].

pub mod admin;
pub mod auth;
pub mod config;
pub mod control;
pub mod discovery;
pub mod errors;
pub mod keys;
pub mod link_probe;
pub mod listener;
pub mod meter;
pub mod passthrough;
pub mod persist;
pub mod pipeline;
pub mod prepare;
pub mod proxy;
pub mod request;
pub mod scrape;
pub mod shared_state;
pub mod spans;
pub mod state;
pub mod tokenize;
pub mod trust;
pub mod upstream;
pub mod vllm_events;
pub mod vllm_index;
pub mod vllm_subscriber;
pub mod zmtp;

pub use kvgate_router::{admission, registry, route, routing};
