//! Root holders: which workers hold a prompt's root block, so that a large fleet's decision looks into the caches of
//! those workers only, not of every worker (`Registry::views` with a focus, past
//! `RegistryConfig::full_scan_workers`).
//!
//! A prompt's **root** is the first block the policy credits a match for (past a cheap shared system prompt:
//! `RoutingPolicy::prefix_root`), moved up to the next overlay point (every [`Overlay::STRIDE`]th block, the points
//! sends are shared by between replicas), or to the prompt's last block. Chained hashes make it a prefix: a worker
//! without the root holds nothing past the shared prompt that the policy would credit.
//!
//! A worker is entered under a root when a request with it is sent there (by this gateway, or by another replica
//! through shared sends), and when one of its reports' summaries (any tier) holds the root: every report is checked
//! against the most recent roots, up to a budget; a report whose summaries do not hold a root takes the worker out
//! of it. A root first seen now has no holders until the next reports (within a report interval) or a send.
//!
//! Bounds: at most `capacity` roots (two generations of half each: a root seen again is promoted; when the newer
//! fills, the older is dropped), each with at most [`MAX_HOLDERS`] workers (the most recent first) and the hashes of
//! the [`PROBE_BLOCKS`] blocks from the root on (so that a summary of granularity up to that many blocks is probed
//! at a block it represents). Holders are worker uids: a forgotten worker's are skipped, never reused.

use std::collections::HashMap;

use kvgate_shared::hashing::BlockHash;
use kvgate_shared::report::CacheSummary;

use super::Overlay;

/// Most workers kept under one root.
pub const MAX_HOLDERS: usize = 16;
/// Hashes kept from a root on, for summaries of coarser granularity.
pub const PROBE_BLOCKS: usize = 16;

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
    capacity: usize,
}

impl RootIndex {
    pub fn new(capacity: usize) -> Self {
        Self { new: HashMap::new(), old: HashMap::new(), capacity: capacity.max(2) }
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
        self.new.get_mut(&key)
    }

    /// Notes a request's root (block `at` of `hashes`): it is checked at the next reports.
    pub fn see(&mut self, hashes: &[BlockHash], at: usize) {
        self.entry(at, hashes.get(at..).unwrap_or_default());
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

    /// Checks the most recent roots (at most `budget`) against a report's summaries: worker `uid` is entered under
    /// those a summary holds and taken out of the others.
    pub fn discover(&mut self, uid: u64, summaries: &[&CacheSummary], budget: usize) {
        // A summary holds the root if it holds the first block from the root on that it represents.
        let held = |r: &Root| {
            summaries.iter().any(|s| {
                (0..r.probe.len())
                    .find(|j| s.covers_block(r.at + j))
                    .is_some_and(|j| s.bloom.contains(r.probe[j]))
            })
        };
        let mut left = budget;
        for gen in [&mut self.new, &mut self.old] {
            for r in gen.values_mut() {
                if left == 0 {
                    return;
                }
                left -= 1;
                if held(r) {
                    put_first(&mut r.holders, uid);
                } else {
                    r.holders.retain(|h| *h != uid);
                }
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
