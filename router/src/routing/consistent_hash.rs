//! `consistent_hash`: the session's ring primary, else its backup (the pure-affinity baseline); ignores load.

use super::{by_load, Decision, RequestView, Ring, RouteReason, RoutingPolicy, WorkerView};

pub struct ConsistentHash;

impl RoutingPolicy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn choose(
        &self,
        req: &RequestView<'_>,
        workers: &[WorkerView<'_>],
        ring: &Ring,
        block_size: usize,
    ) -> Option<Decision> {
        let healthy = |id: &str| workers.iter().any(|w| w.healthy && w.id == id);
        let (primary, backup) = ring.primary_backup(req.session_key, healthy);
        let pos = |id: &Option<std::sync::Arc<str>>| {
            id.as_ref().and_then(|id| workers.iter().position(|w| w.id == &**id))
        };
        let mut ranked: Vec<usize> = [pos(&primary), pos(&backup)].into_iter().flatten().collect();
        for i in by_load(workers, 0) {
            if !ranked.contains(&i) {
                ranked.push(i);
            }
        }
        if ranked.is_empty() {
            return None;
        }
        let predicted = workers[ranked[0]].tier_match(req.hashes).through_disk * block_size;
        Some(Decision {
            ranked,
            reason: RouteReason::Primary,
            predicted_cached_tokens: predicted,
            terms: vec![],
        })
    }
}
