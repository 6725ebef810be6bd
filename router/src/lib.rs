//! kvgate-router: the pure routing core. The gateway's proxy, its `route/explain` endpoint and the loadtest
//! simulator all link this crate and nothing of the HTTP stack, so a decision in virtual time is the decision the
//! gateway makes.
//!
//! - [`route`]: the one entry point: [`route::Router::route`] (build the views, choose, record the send, under the
//!   caller's registry lock, after admission) and [`route::Router::dry_run`] (the same decision, nothing recorded:
//!   admission pricing and explain);
//! - [`input`]: what routing needs to know about one request;
//! - [`routing`]: the policies behind one trait, the consistent-hash ring, the ring-key chooser;
//! - [`registry`]: worker states from the config and from reports (health, faults, staleness, overlay, load);
//! - [`admission`]: per-class token budgets with bounded, tenant-fair wait queues;
//! - [`placement`]: where a LoRA adapter request runs (its holders, or a worker that loads it first);
//! - [`split`]: whether a request runs whole on one worker or is split between a prefill and a decode worker.
//!
//! No function here reads a clock: every one that needs the time takes `now`.

pub mod admission;
pub mod input;
pub mod placement;
pub mod registry;
pub mod route;
pub mod routing;
pub mod split;
