//! The ring key of a request: which session the consistent-hash ring (and `cache_aware`'s ring term) places it by.
//!
//! An explicit session (`x-session-id`, else the body's `user`) wins. Otherwise the key is a block of the prompt
//! chosen where prompts *diverge*: the block right after the last "hub" on the prompt's chain, a hub being a block
//! that has been followed by at least `hub_fanout` distinct next blocks recently (the end of a system prompt shared
//! by every conversation, or of a common first question). Chained hashes make every block stand for its whole
//! prefix, so the block after the last hub names the conversation: it is the same for all of the conversation's
//! turns (they extend the same prefix) and differs between conversations. Before any hub is known (a cold gateway)
//! the key is the prompt's 4th full block (or its last, if shorter), the rule that co-locates a conversation's
//! turns when prompts share less than 4 blocks; prompts under one block hash their tokens.
//!
//! The sketch is bounded: at most `2 x entries` blocks are remembered (two generations; when the current one is
//! full it becomes the old one and the oldest is dropped), each with at most `hub_fanout` continuation
//! fingerprints. Learning is O(prompt blocks) map operations per request, at most [`MAX_LEARN_BLOCKS`]; explain-style
//! dry runs do not learn.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use kvgate_shared::hashing::BlockHash;
use xxhash_rust::xxh3::xxh3_64;

/// Largest `hub_fanout` (continuations kept per block).
pub const MAX_HUB_FANOUT: usize = 8;

/// The gateway's defaults (`--ring-hub-fanout`, `--ring-sketch-entries`), which the simulator uses too.
pub const DEFAULT_HUB_FANOUT: usize = 2;
pub const DEFAULT_SKETCH_ENTRIES: usize = 65_536;

/// Blocks of one prompt the sketch learns (its first 64K tokens at 16 tokens a block): bounds the work and the lock
/// time of one request, and how much of the sketch one huge prompt can push out.
pub const MAX_LEARN_BLOCKS: usize = 4096;

/// Continuation fingerprints seen after one block.
#[derive(Clone, Copy, Debug, Default)]
struct Fanout {
    next: [u32; MAX_HUB_FANOUT],
    n: u8,
}

/// A request's ring key and the length of the prefix it shares with other conversations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingKey {
    pub key: u64,
    /// Leading blocks up to and including the prompt's last hub (0: none known).
    pub shared_blocks: usize,
}

/// Block hash -> fan-out. The keys are xxh3 hashes of client-chosen tokens, so the map is seeded per process
/// (foldhash's `RandomState`: a few times faster than SipHash on a u64, and not predictable from outside).
type Map = HashMap<u64, Fanout, RandomState>;

/// The ring-key chooser with its fan-out sketch.
#[derive(Debug)]
pub struct RingKeys {
    cur: Map,
    old: Map,
    entries: usize,
    hub_fanout: usize,
}

impl RingKeys {
    /// A sketch of at most `2 x entries` blocks; a block with `hub_fanout` (2..=8) distinct continuations is a hub.
    pub fn new(entries: usize, hub_fanout: usize) -> Self {
        Self {
            cur: Map::default(),
            old: Map::default(),
            entries: entries.max(1),
            hub_fanout: hub_fanout.clamp(2, MAX_HUB_FANOUT),
        }
    }

    /// The ring key of a request (see the module doc). `learn`: record the prompt's block chain (the real path;
    /// dry runs such as explain pass false).
    pub fn key(&mut self, explicit: Option<&str>, hashes: &[BlockHash], ids: &[u32], learn: bool) -> u64 {
        self.route_key(explicit, hashes, ids, learn).key
    }

    /// [`RingKeys::key`] and how many leading blocks of the prompt other conversations share (up to and including
    /// its last hub; 0 when none is known), which `cache_aware` does not credit when they are cheap to recompute.
    pub fn route_key(
        &mut self,
        explicit: Option<&str>,
        hashes: &[BlockHash],
        ids: &[u32],
        learn: bool,
    ) -> RingKey {
        let last_hub = self.last_hub(hashes);
        let shared_blocks = last_hub.map_or(0, |i| i + 1);
        let key = if let Some(s) = explicit {
            xxh3_64(s.as_bytes())
        } else if hashes.is_empty() {
            xxh3_64(&ids.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>())
        } else {
            hashes[last_hub.map_or(hashes.len().min(4) - 1, |i| i + 1)].0
        };
        if learn && !hashes.is_empty() {
            self.learn(hashes);
        }
        RingKey { key, shared_blocks }
    }

    /// Index of the prompt's last hub block that is not its last block.
    fn last_hub(&self, hashes: &[BlockHash]) -> Option<usize> {
        (0..hashes.len().saturating_sub(1)).rev().find(|i| self.fanout(hashes[*i].0) >= self.hub_fanout)
    }

    /// Index of the key block: right after the last hub, else the 4th block (or the last, if fewer).
    pub fn key_block(&self, hashes: &[BlockHash]) -> usize {
        match self.last_hub(hashes) {
            Some(i) => i + 1,
            None => hashes.len().min(4) - 1,
        }
    }

    /// Distinct continuations seen after `block` (capped at `hub_fanout`).
    pub fn fanout(&self, block: u64) -> usize {
        let n = |m: &Map| m.get(&block).map_or(0, |f| f.n as usize);
        n(&self.cur).max(n(&self.old))
    }

    /// Blocks remembered (both generations).
    pub fn len(&self) -> usize {
        self.cur.len() + self.old.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn learn(&mut self, hashes: &[BlockHash]) {
        for pair in hashes[..hashes.len().min(MAX_LEARN_BLOCKS)].windows(2) {
            self.add(pair[0].0, pair[1].0 as u32);
        }
    }

    fn add(&mut self, block: u64, next: u32) {
        if !self.cur.contains_key(&block) {
            if self.cur.len() >= self.entries {
                self.old = std::mem::take(&mut self.cur);
            }
            let carried = self.old.get(&block).copied().unwrap_or_default();
            self.cur.insert(block, carried);
        }
        let hub = self.hub_fanout;
        if let Some(f) = self.cur.get_mut(&block) {
            let n = f.n as usize;
            if n < hub && !f.next[..n].contains(&next) {
                f.next[n] = next;
                f.n += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(blocks: &[u64]) -> Vec<BlockHash> {
        // Chained like the real hasher: each hash depends on everything before it.
        let mut h = 0u64;
        blocks
            .iter()
            .map(|b| {
                h = xxh3_64(&[h.to_le_bytes(), b.to_le_bytes()].concat());
                BlockHash(h)
            })
            .collect()
    }

    /// A conversation's prompt at `turn`: a shared prefix of `shared` blocks, then its own blocks.
    fn prompt(shared: usize, conv: u64, turn: usize) -> Vec<BlockHash> {
        let mut b: Vec<u64> = (0..shared as u64).collect();
        b.extend((0..(2 + 3 * turn) as u64).map(|i| 1_000_000 * (conv + 1) + i));
        chain(&b)
    }

    #[test]
    fn a_shared_system_prompt_does_not_collapse_the_ring_and_turns_stay_together() {
        let mut rk = RingKeys::new(65_536, 4);
        // Warm up: a handful of conversations' first turns teach the sketch the hub at the prefix's end.
        for c in 0..6 {
            rk.key(None, &prompt(32, c, 0), &[], true);
        }
        let mut keys = std::collections::HashSet::new();
        for c in 100..140 {
            let k0 = rk.key(None, &prompt(32, c, 0), &[], true);
            for turn in 1..4 {
                assert_eq!(
                    rk.key(None, &prompt(32, c, turn), &[], true),
                    k0,
                    "conversation {c} turn {turn} moved"
                );
            }
            keys.insert(k0);
        }
        assert_eq!(keys.len(), 40, "every conversation gets its own key");
        // The old rule (4th block) would have given all 40 the same key.
        let old_rule = prompt(32, 100, 0)[3].0;
        assert!(!keys.contains(&old_rule));
    }

    #[test]
    fn explicit_sessions_win_short_prompts_hash_tokens_and_dry_runs_learn_nothing() {
        let mut rk = RingKeys::new(1024, 4);
        let p = prompt(8, 1, 0);
        assert_eq!(rk.key(Some("s1"), &p, &[], true), xxh3_64(b"s1"));
        assert_ne!(rk.key(None, &[], &[1, 2], false), rk.key(None, &[], &[1, 3], false));
        let before = rk.len();
        for c in 0..10 {
            rk.key(None, &prompt(8, c, 0), &[], false);
        }
        assert_eq!(rk.len(), before, "a dry run changed the sketch");
        // Cold: no hub yet, the 4th block.
        assert_eq!(rk.key_block(&prompt(8, 1, 0)), 3);
        assert_eq!(rk.key_block(&chain(&[1, 2])), 1);
    }

    #[test]
    fn the_sketch_stays_bounded_and_keeps_hubs_that_stay_in_use() {
        let mut rk = RingKeys::new(500, 3);
        for c in 0..2_000u64 {
            rk.key(None, &prompt(16, c, 1), &[], true);
            assert!(rk.len() <= 1_000, "{} entries", rk.len());
        }
        // The prefix's last block keeps being touched by every request: still a hub after many rotations.
        let p = prompt(16, 5_000, 0);
        assert!(rk.fanout(p[15].0) >= 3);
        assert_eq!(rk.key_block(&p), 16);
    }
}
