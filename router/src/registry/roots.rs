//! Root holders: which workers hold a prompt's root block, so that a large fleet's decision looks into the caches of
//! those workers only, not of every worker (`Registry::views` with a focus, past
//! `RegistryConfig::full_scan_workers`).
//!
//! A prompt's **root** is the first block the policy credits a match for (past a shared system prompt the policy
//! does not credit: `RoutingPolicy::prefix_root`), moved up to the next overlay point (every [`Overlay::STRIDE`]th
//! block, the points sends are shared by between replicas), or to the prompt's last block. Chained hashes make it a
//! prefix: a worker without the root holds nothing past it that the policy would credit. When the policy credits a
//! prefix other conversations share, the prompt has a second root, the first block past that prefix
//! (`route.rs`'s `root_starts`): most workers hold a shared prompt, and a root keeps at most [`MAX_HOLDERS`].
//!
//! A worker is entered under a root when a request with it is sent there (by this gateway, or by another replica
//! through shared sends), and when one of its reports' summaries (any tier) holds the root: every report is checked
//! against the most recent roots, up to a budget; a report whose summaries do not hold a root takes the worker out
//! of it. A root first seen now has no holders until the next reports (within a report interval) or a send.
//!
//! Bounds: at most `capacity` roots (two generations of half each: a root seen again is promoted; when the newer
//! fills, the older is dropped), each with at most [`MAX_HOLDERS`] workers (the most recent first) and the hashes of
//! the [`PROBE_BLOCKS`] blocks from the root on (so that a summary of granularity up to that many blocks is probed
//! at a block it represents); the order roots were last sent in, as at most `capacity` keys (a report checks the
//! newest). Holders are worker uids: a forgotten worker's are skipped, never reused.

use std::collections::{HashMap, HashSet, VecDeque};

use kvgate_shared::hashing::BlockHash;
use kvgate_shared::report::CacheSummary;

use super::Overlay;

/// Most workers kept under one root.
pub const MAX_HOLDERS: usize = 16;
/// Hashes kept from a root on, for summaries of coarser granularity.
pub const PROBE_BLOCKS: usize = 8;

/// The block a root moves to from the first credited block `first` of a prompt of `n` blocks (`None`: past it).
pub fn root_block(first: usize, n: usize) -> Option<usize> {
    (first < n).then(|| ((first + 1).next_multiple_of(Overlay::STRIDE) - 1).min(n - 1))
}

#[derive(Clone, Debug)]
struct Root {
    /// The root's block number in its prompt.
    at: usize,
    /// The hashes from the root on.
    probe: Box<[BlockHash]>,
    holders: Vec<u64>,
}

/// Roots and their holders.
#[derive(Debug)]
pub struct RootIndex {
    new: HashMap<BlockHash, Root>,
    old: HashMap<BlockHash, Root>,
    /// Roots in the order they were last sent (a key may recur; the newest at the back).
    recent: VecDeque<BlockHash>,
    capacity: usize,
}

impl RootIndex {
    pub fn new(capacity: usize) -> Self {
        Self { new: HashMap::new(), old: HashMap::new(), recent: VecDeque::new(), capacity: capacity.max(2) }
    }

    /// Roots held now (both generations).
    pub fn len(&self) -> usize {
        self.new.len() + self.old.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The workers entered under the root whose hash is `key`, most recent first.
    pub fn holders(&self, key: BlockHash) -> &[u64] {
        self.new.get(&key).or_else(|| self.old.get(&key)).map_or(&[], |r| &r.holders)
    }

    /// The entry of the root whose hashes from the root on are `probe` (created, or promoted to the newer
    /// generation).
    fn entry(&mut self, at: usize, probe: &[BlockHash]) -> Option<&mut Root> {
        let key = *probe.first()?;
        if !self.new.contains_key(&key) {
            let root = self.old.remove(&key).unwrap_or_else(|| Root {
                at,
                probe: probe.iter().take(PROBE_BLOCKS).copied().collect(),
                holders: Vec::new(),
            });
            if self.new.len() >= self.capacity / 2 {
                self.old = std::mem::take(&mut self.new);
            }
            self.new.insert(key, root);
        }
        if self.recent.back() != Some(&key) {
            if self.recent.len() >= self.capacity {
                self.recent.pop_front();
            }
            self.recent.push_back(key);
        }
        self.new.get_mut(&key)
    }

    /// Enters worker `uid` under the root at block `at` of `hashes` (a request with it was sent there).
    pub fn add(&mut self, hashes: &[BlockHash], at: usize, uid: u64) {
        if let Some(r) = self.entry(at, hashes.get(at..).unwrap_or_default()) {
            put_first(&mut r.holders, uid);
        }
    }

    /// Enters worker `uid` under every known root among `points` (another replica's send).
    pub fn add_points(&mut self, points: &[BlockHash], uid: u64) {
        for p in points {
            if let Some(r) = self.new.get_mut(p).or_else(|| self.old.get_mut(p)) {
                put_first(&mut r.holders, uid);
            }
        }
    }

    /// Checks the most recently sent roots (at most `budget` of them) against a report's summaries: worker `uid` is
    /// entered under those a summary holds and taken out of the others.
    pub fn discover(&mut self, uid: u64, summaries: &[&CacheSummary], budget: usize) {
        // A summary holds the root if it holds the first block from the root on that it represents.
        let held = |r: &Root| {
            summaries.iter().any(|s| {
                (0..r.probe.len())
                    .find(|j| s.covers_block(r.at + j))
                    .is_some_and(|j| s.bloom.contains(r.probe[j]))
            })
        };
        let mut checked: HashSet<BlockHash> = HashSet::with_capacity(budget.min(self.recent.len()));
        for key in self.recent.iter().rev() {
            if checked.len() >= budget {
                break;
            }
            if !checked.insert(*key) {
                continue;
            }
            let Some(r) = self.new.get_mut(key).or_else(|| self.old.get_mut(key)) else { continue };
            if held(r) {
                put_first(&mut r.holders, uid);
            } else {
                r.holders.retain(|h| *h != uid);
            }
        }
    }
}

/// Puts `uid` first in `holders` (at most [`MAX_HOLDERS`]).
fn put_first(holders: &mut Vec<u64>, uid: u64) {
    holders.retain(|h| *h != uid);
    holders.insert(0, uid);
    holders.truncate(MAX_HOLDERS);
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::report::BlockBloom;

    fn summary(hashes: &[BlockHash], granularity: u32) -> CacheSummary {
        let mut bloom = BlockBloom::with_capacity(1_024, 0.001);
        hashes.iter().for_each(|h| bloom.insert(*h));
        CacheSummary { granularity, entries: hashes.len() as u64, bloom }
    }

    fn prompt(seed: u64) -> Vec<BlockHash> {
        (0..32u64).map(|i| BlockHash(seed << 20 | i)).collect()
    }

    #[test]
    fn reports_check_the_newest_roots_within_their_budget_and_take_a_worker_out_of_what_it_lost() {
        let mut idx = RootIndex::new(1_000);
        let prompts: Vec<Vec<BlockHash>> = (1..=10).map(prompt).collect();
        for p in &prompts {
            idx.add(p, 7, 1);
        }
        // Worker 2 holds prompts 1..=10 at granularity 4 (it represents block 7: (7 + 1) % 4 == 0).
        let all: Vec<BlockHash> = prompts.iter().flatten().copied().collect();
        idx.discover(2, &[&summary(&all, 4)], 3);
        let has = |idx: &RootIndex, p: &[BlockHash], uid: u64| idx.holders(p[7]).contains(&uid);
        let found: Vec<bool> = prompts.iter().map(|p| has(&idx, p, 2)).collect();
        assert_eq!(
            found,
            [false, false, false, false, false, false, false, true, true, true],
            "the 3 newest"
        );
        // A report without them takes it out again; worker 1 (entered by sends) stays where its report is silent.
        idx.discover(2, &[&summary(&[], 4)], 100);
        assert!(prompts.iter().all(|p| !has(&idx, p, 2) && has(&idx, p, 1)));
        // A summary of granularity 3 is probed at the first block from the root it represents (block 8).
        idx.discover(3, &[&summary(&prompts[0][8..9], 3)], 100);
        assert!(has(&idx, &prompts[0], 3));
    }

    #[test]
    fn the_index_is_bounded_and_shared_sends_enter_known_roots_only() {
        let mut idx = RootIndex::new(8);
        for s in 0..100 {
            idx.add(&prompt(s), 7, s);
        }
        assert!(idx.len() <= 8 && idx.recent.len() <= 8, "{} roots", idx.len());
        for uid in 0..40 {
            idx.add(&prompt(99), 7, 1_000 + uid);
        }
        assert_eq!(idx.holders(prompt(99)[7]).len(), MAX_HOLDERS);
        assert_eq!(idx.holders(prompt(99)[7])[0], 1_039, "the most recent first");
        idx.add_points(&[prompt(98)[7], BlockHash(12345)], 5);
        assert!(idx.holders(prompt(98)[7]).contains(&5));
        assert!(idx.holders(BlockHash(12345)).is_empty(), "no root is made from a peer's points");
    }
}
