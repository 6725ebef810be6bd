//! `kvgate-loadtest chaos`: the whole system under load and a seeded schedule of faults, checked against the
//! promises an operator relies on (issue #45). `deploy` starts the deployment (Redis, gateway replicas, workers with
//! KV tiers, tenants with budgets), `drive` its clients, `schedule` the faults, `ledger` the request invariants,
//! `run` the executor, the resource checks and the summary.
//!
//! What it checks: every request ended within its limit, errors only of documented kinds and none outside a
//! fault's window, no tenant's first send of a shared document found anything cached (its salt's blocks are its
//! own), each tenant and class charged what its requests computed within the bound `charges.rs` states (summed
//! over both replicas and every life of each) and the workers' computed tokens within that bound of the charges;
//! after a quiet period every worker's KV blocks free, its queue empty and no transfer lease, import or export
//! staging left, no gateway in-flight count or admission permit held, fds and memory flat; and each fault's
//! recovery time. Faults: kill, stop, restart (a worker, the prefill worker while it holds a transfer, Redis, a
//! replica), a full SSD directory, slow clients, a budget burst (`schedule.rs`).

pub mod charges;
pub mod deploy;
pub mod drive;
pub mod execute;
pub mod ledger;
pub mod run;
pub mod schedule;
