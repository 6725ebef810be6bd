//! `kvgate-loadtest chaos`: the whole system under load and a seeded schedule of faults, checked against the
//! promises an operator relies on (issue #45). `deploy` starts the deployment (Redis, gateway replicas, workers with
//! KV tiers, tenants with budgets), `drive` its clients, `schedule` the faults, `ledger` the request invariants,
//! `run` the executor, the resource checks and the summary.
//!
//! What this first version checks: every request ended within its limit, errors only of documented kinds and none
//! outside a fault's window, and after a quiet period every worker's KV blocks free and queue empty, no gateway
//! in-flight count, fds and memory flat. Not yet: a prefill/decode pair and a kill mid-transfer, a full SSD
//! directory, charges against computed usage across replicas, cross-tenant cache reads, recovery times.

pub mod deploy;
pub mod drive;
pub mod ledger;
pub mod run;
pub mod schedule;
