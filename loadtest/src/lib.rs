//! kvgate-loadtest: trace replay and the virtual-time fleet simulator (load generation and the demo: issue #8).
//!
//! - [`trace`]: Mooncake traces and their expansion into token ids;
//! - [`sim`]: `simulate`: the virtual-time fleet over the real routing, scheduler and prefix-cache code;
//! - [`stats`]: percentiles for the reports.

pub mod client;
pub mod commands;
pub mod fleet;
pub mod report;
pub mod runner;
pub mod sim;
pub mod stats;
pub mod trace;
pub mod workload;
