//! kvgate-loadtest: load generation against OpenAI-compatible endpoints, local fleets, the demo, trace replay and the
//! virtual-time fleet simulator.
//!
//! - [`workload`]: the workloads (multi-turn, shared prefix, long bursts, ...); [`client`]: the streaming client;
//!   [`runner`]: runs a workload against a target; [`fleet`]: local gateway + worker processes;
//!   [`commands`]: `run`, `compare`, `up`, `demo`; [`report`]: the HTML report with plots;
//! - [`trace`]: Mooncake traces and their expansion into token ids;
//! - [`sim`]: `simulate`: the virtual-time fleet over the real routing, scheduler and prefix-cache code;
//! - [`stats`]: percentiles for the reports.

pub mod chaos;
pub mod client;
pub mod commands;
pub mod ending;
pub mod fleet;
pub mod report;
pub mod runner;
pub mod sim;
pub mod stats;
pub mod trace;
pub mod trace_gen;
pub mod trace_shapes;
pub mod tune;
pub mod workload;
