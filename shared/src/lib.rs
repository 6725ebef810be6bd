//! kvgate-shared: everything the gateway and the workers must agree on bit for bit.
//!
//! - [`hashing`]: the chained block hashes that key the prefix cache (pinned by golden vectors);
//! - [`report`]: the summary a worker pushes to gateways every second, with its Bloom filter of cached blocks;
//! - [`prompt`]: chat-template rendering and tokenization, identical on both sides;
//! - [`openai`]: the OpenAI API types and error body; [`errors`]: the one `ApiError` (axum adapter with feature
//!   `axum`);
//! - [`handoff`]: token ids the gateway computed, passed to the worker (authenticated) so it skips tokenizing;
//! - [`credential`]: the per-request credential an endpoint picker's proxy carries to a worker (never the token);
//! - [`duration`]: configuration durations (`1s`, `500ms`); [`settings`]: defaults written once (clap), the
//!   flags > environment > TOML > default layering, and the generated configuration references.
//! - [`trace`]: W3C `traceparent`, spans and their OTLP/HTTP export (bounded, never blocking a request);
//! - [`ports`]: free loopback ports for local fleets (tests, benches, the load tester's fleet);
//! - [`stats`]: the one percentile of every report, bench and test.

pub mod credential;
pub mod decode_fit;
pub mod duration;
pub mod errors;
pub mod handoff;
pub mod hashing;
pub mod openai;
pub mod ports;
pub mod prompt;
pub mod report;
pub mod settings;
pub mod stats;
#[cfg(any(test, feature = "test-strategies"))]
pub mod testing;
pub mod trace;
