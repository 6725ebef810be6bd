//! The oracle: the hit rate one global LRU cache holding the whole fleet's KV capacity would reach on the trace,
//! requests taken one at a time in arrival order. It is the worker's own block manager (same block size, same
//! hashing, same "at least one token left to compute" rule, same LRU eviction) sized to the fleet, so it bounds
//! what any routing policy could get from the same memory.

use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
use kvgate_worker::kv::KvManager;

use crate::trace::{expand_prompt, Trace};

/// What the oracle found.
#[derive(Clone, Debug, PartialEq)]
pub struct Oracle {
    /// Cached prompt tokens / prompt tokens.
    pub hit_rate: f64,
    /// Cached prompt tokens of each request, in trace order.
    pub cached: Vec<usize>,
}

/// Replays the prompts through one block manager of `capacity_tokens`.
pub fn run(trace: &Trace, capacity_tokens: usize, scheme: &HashScheme, vocab: u32) -> Oracle {
    let bs = scheme.block_size as usize;
    let kv = KvManager::new((capacity_tokens / bs).max(1), bs);
    let hasher = BlockHasher::new(scheme, &ExtraKeys::none());
    let (mut hit, mut total) = (0u64, 0u64);
    let mut cached = Vec::with_capacity(trace.requests.len());
    for r in &trace.requests {
        let tokens = expand_prompt(r, vocab);
        let mut table = kv.start(hasher, &tokens);
        let c = table.cached_tokens();
        if kv.reserve(&mut table, tokens.len()) {
            kv.commit(&mut table, &tokens, tokens.len());
        }
        drop(table);
        hit += c as u64;
        total += tokens.len() as u64;
        cached.push(c);
    }
    Oracle { hit_rate: if total == 0 { 0.0 } else { hit as f64 / total as f64 }, cached }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(rows: &[(usize, &[u64])]) -> Trace {
        let rows: Vec<(u64, usize, usize, &[u64])> =
            rows.iter().map(|(len, ids)| (0, *len, 1, *ids)).collect();
        crate::trace::from_rows(&rows)
    }

    #[test]
    fn counts_shared_prefixes_and_forgets_under_pressure() {
        let scheme = HashScheme::new(16, 1);
        // Second request shares its first 512-token block with the first.
        let t = trace(&[(1024, &[1, 2]), (1024, &[1, 3])]);
        let big = run(&t, 1 << 20, &scheme, 1000);
        assert_eq!(big.cached, vec![0, 512]);
        assert!((big.hit_rate - 512.0 / 2048.0).abs() < 1e-12);
        // The same request twice: everything but the last block (one token must be computed).
        let again = run(&trace(&[(1024, &[1, 2]), (1024, &[1, 2])]), 1 << 20, &scheme, 1000);
        assert_eq!(again.cached, vec![0, 1024 - 16]);
        // A cache of one request's size: the third request's prefix (block 1) was evicted by block 4's request.
        let small = run(&trace(&[(1024, &[1, 2]), (1024, &[4, 5]), (1024, &[1, 6])]), 1024, &scheme, 1000);
        assert_eq!(small.cached, vec![0, 0, 0]);
    }
}
