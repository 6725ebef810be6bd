//! `kvgate-worker serve`: the process users deploy on each GPU pod. It listens at once (so `/health` answers while
//! the model loads), loads the model on a blocking thread, runs the engine on its own thread, serves the OpenAI
//! API, and pushes cache summaries to gateways.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, vLLM's `POST /tokenize` and
//! `POST /detokenize`, `GET /health` (alive: the engine thread runs), `GET /ready` (model loaded, engine alive, not
//! draining), `GET /metrics` (Prometheus), `GET /kvgate/v1/tokenizer` (what a gateway needs to tokenize and hash
//! exactly like this worker), `POST /kvgate/v1/kv-probe` (a decode worker's timed sample of a link, `pd.rs`).
//!
//! Shutdown on SIGTERM/SIGINT: `/ready` turns 503, new requests are refused (`shutting_down`) and a report saying
//! `draining` goes to every gateway at once; running requests get `shutdown_grace` to finish, then are aborted;
//! the process exits when the last connection closes.
//!
//! A dead engine thread (a panic in a step) fails `/health` and `/ready` with 503 and the process exits with
//! status 70 half a second later, so the orchestrator restarts it rather than routing to a worker that can only
//! refuse.
//!
//! Modules: `boot` (start-up order, shutdown), `routes` (the route table), `assemble` (the engine builder, once for
//! every device) over `device` (the one device-specific step: the backend) and `load_costs` (the start-up tier
//! measurement), `state` (what handlers share), `telemetry` (metrics); the handlers in `api`, `tokens`, `pd`; the
//! engine thread in `engine_thread`; cache-summary reports in `reporter`.

pub mod adapters;
pub mod api;
mod assemble;
mod boot;
pub mod config;
mod device;
pub mod engine_thread;
pub mod errors;
mod load_costs;
pub mod logprobs;
pub mod pd;
pub mod prefill_fit;
pub mod reporter;
mod routes;
pub mod spans;
mod state;
mod telemetry;
pub mod text;
pub mod tokens;

pub use boot::serve;
pub use routes::router;
pub use state::{AppState, ServingModel, EXIT_ENGINE_DEAD};
