//! `least_load`: the healthy worker with the least pending work (reported waiting prefill tokens and requests,
//! plus what this gateway sent since); ignores caches (the pure-load baseline).

use super::{by_load, Decision, RequestView, Ring, RouteReason, RoutingPolicy, WorkerView};

pub struct LeastLoad {
    per_request_tokens: u64,
}

impl LeastLoad {
    pub fn new(per_request_tokens: u64) -> Self {
        Self { per_request_tokens }
    }
}

impl RoutingPolicy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn choose(
        &self,
        req: &RequestView<'_>,
        workers: &[WorkerView<'_>],
        _ring: &Ring,
        block_size: usize,
    ) -> Option<Decision> {
        let mut ranked = by_load(workers, self.per_request_tokens);
        if ranked.is_empty() {
            return None;
        }
        // Rotate among equally loaded workers so ties spread.
        let best = workers[ranked[0]].load.cost(self.per_request_tokens);
        let ties =
            ranked.iter().take_while(|i| workers[**i].load.cost(self.per_request_tokens) == best).count();
        ranked[..ties].rotate_left((req.nonce() % ties as u64) as usize);
        let predicted = workers[ranked[0]].tier_match(req.hashes).through_disk * block_size;
        Some(Decision {
            ranked,
            reason: RouteReason::Load,
            predicted_cached_tokens: predicted,
            terms: vec![],
        })
    }
}
