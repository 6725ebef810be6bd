//! kvgate-testkit: what the workspace's tests and benches share to drive real processes, written once.
//!
//! - [`process`]: one launcher: start a binary, wait for its ready line (bounded), keep draining its output, kill
//!   it on drop; find the workspace's binaries (never builds them: the workspace test command has built them);
//! - [`http`]: one HTTP helper: whole responses, streams read piece by piece, timed requests, SSE payloads,
//!   Prometheus series;
//! - [`percentile`]: the workspace's one percentile (`kvgate_shared::stats`).
//!
//! A dev-dependency only: nothing here ships in a binary.

pub mod http;
pub mod process;

pub use kvgate_shared::stats::percentile;
