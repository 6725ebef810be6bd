//! `round_robin`: each request to the next healthy worker in turn; ignores caches and load (a baseline).

use super::{Decision, RequestView, Ring, RouteReason, RoutingPolicy, WorkerView};

/// Stateless: the turn is the request's `seq`.
#[derive(Default)]
pub struct RoundRobin;

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn choose(
        &self,
        req: &RequestView<'_>,
        workers: &[WorkerView<'_>],
        _ring: &Ring,
        block_size: usize,
    ) -> Option<Decision> {
        let healthy = super::healthy_indices(workers);
        if healthy.is_empty() {
            return None;
        }
        let start = (req.seq % healthy.len() as u64) as usize;
        let ranked: Vec<usize> = healthy[start..].iter().chain(&healthy[..start]).copied().collect();
        let predicted = workers[ranked[0]].tier_match(req.hashes).through_disk * block_size;
        Some(Decision {
            ranked,
            reason: RouteReason::RoundRobin,
            predicted_cached_tokens: predicted,
            terms: vec![],
        })
    }
}
