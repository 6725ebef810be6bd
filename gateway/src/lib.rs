//! kvgate-gateway: the OpenAI-compatible front door that routes each request to the worker holding its KV cache.
//! Grouped by role, so a change finds its room:
//!
//! - [`serve`]: a client request's path: the listener, the pingora adapter (`proxy`), the one staged exchange every
//!   proxied request walks (`exchange`: read, identify, prepare, price, admit, route, then `attempts` and `charge`),
//!   the endpoints (`endpoints`: completions, pass-through), one attempt at one worker (`upstream`), what a worker
//!   gets (`outbound`), the bounded parser (`request`), tokenizing and hashing (`prepare` on the `tokenize` pool),
//!   usage metering (`meter`), the request's trace (`spans`); it reaches the gateway through `host::ServeHost`;
//! - [`control`]: the control listener (report ingest, metrics, worker states, upkeep), the admin REST API, API keys,
//!   which `advertise_url`s a report may register (`trust`), the admin state file (`persist`), bearer checks (`auth`);
//! - [`epp`]: the endpoint picker (`--epp-listen`): the same stages behind an Envoy `ext_proc` stream, answered
//!   with the pick instead of forwarded;
//! - [`pods`]: what the gateway learns from pods by itself: DNS discovery, metric scrapes, vLLM/SGLang KV events
//!   (`vllm_events` decoding, `vllm_subscriber` over the bounded ZeroMQ client `zmtp`), P->D link probes;
//! - [`replicas`]: the state gateway replicas share through Redis (budgets, admin state, sends, drains);
//! - [`admission`], [`registry`], [`routing`], [`route`]: the pure routing core, re-exported from the
//!   `kvgate-router` crate (the simulator links it without the HTTP stack; the vLLM event index lives there too);
//! - [`tokenizers`]: how each model is tokenized and hashed (from `[[models]]` directories or fetched from workers);
//! - [`state`]: the shared state, held whole only by `main` and `control`; the other rooms take narrow host traits;
//!   [`config`], [`errors`].

pub mod config;
pub mod control;
pub mod epp;
pub mod errors;
pub mod pods;
pub mod replicas;
pub mod serve;
pub mod state;
pub mod tokenizers;

pub use kvgate_router::{admission, registry, route, routing};

/// The HTTP client to workers and pods (pooled; one per gateway).
pub type HttpClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;
