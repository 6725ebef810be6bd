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
        let view_of = super::views_by_slot(workers, ring);
        let (primary, backup) = ring.primary_backup_slots(req.session_key, |s| {
            view_of.get(s).and_then(|v| *v).is_some_and(|v| workers[v].healthy)
        });
        let pos = |slot: Option<usize>| slot.and_then(|s| view_of.get(s).copied().flatten());
        let mut ranked: Vec<usize> = [pos(primary), pos(backup)].into_iter().flatten().collect();
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
