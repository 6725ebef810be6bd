//! An exact index of one vLLM pod's device KV cache, kept from its KV events (`kv_events`, decoded by the
//! gateway's `pods::vllm_events`): which of kvgate's own
//! chained block hashes the pod holds. A `BlockStored` event carries its blocks' token ids, so each block's kvgate
//! hash is rebuilt from its parent's (found by the parent's vLLM hash) and its tokens, exactly as a kvgate worker
//! would hash it; the gateway can then summarise the pod like a kvgate worker's report. Pure: no sockets, no clocks.
//!
//! A LoRA adapter's blocks are indexed under its name (`ExtraKey::LoraAdapter(name)`: the chain's root is the
//! adapter's), as the gateway hashes a request for that adapter on a pod.
//!
//! What is not indexed (counted in [`IndexCounters`]): blocks hashed with other extra keys (multimodal, cache salt)
//! and those chained after them in the same event, blocks of a KV cache group other than full attention (a hybrid
//! model's sliding-window or Mamba groups: their removals are ignored too, as the group is learned from its stores,
//! at most [`MAX_OTHER_GROUPS`] of them), blocks of another block size, blocks whose parent the index never saw (it joined mid-stream or missed a batch),
//! blocks stored outside device memory (`medium` other than `GPU`), and anything past [`MAX_INDEXED_BLOCKS`]. A
//! gap in the sequence numbers means removals may have been missed: [`EventIndex::apply`] reports it and the
//! caller replays the missing batches or, failing that, calls [`EventIndex::clear`] (forgetting is safe: a block
//! wrongly remembered would route requests to a pod that must compute them).

use std::collections::{HashMap, HashSet};

use kvgate_shared::hashing::{BlockHash, BlockHasher, ExtraKeys, HashScheme};

use super::kv_events::{CacheGroup, EventBatch, ExternalHash, KvEvent};

/// Most blocks indexed per pod (a pod with 1M tokens of KV in blocks of 16 has 65,536).
pub const MAX_INDEXED_BLOCKS: usize = 1 << 22;
/// Most KV cache groups of another kind remembered per pod (a hybrid model has a handful).
pub const MAX_OTHER_GROUPS: usize = 64;

/// What the index saw and skipped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexCounters {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub clears: u64,
    pub gaps: u64,
    pub keyed_blocks: u64,
    pub other_group_blocks: u64,
    pub other_block_size: u64,
    pub unchained_blocks: u64,
    pub other_medium_blocks: u64,
    pub over_capacity_blocks: u64,
}

/// The outcome of applying one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Applied in order.
    InOrder,
    /// Applied, but the batches `expected..got` were missed: replay them or clear the index.
    Gap { expected: i64, got: i64 },
    /// Already applied (a replayed batch overlapping the live stream): ignored.
    Stale,
}

/// One pod's index.
#[derive(Debug)]
pub struct EventIndex {
    scheme: HashScheme,
    hasher: BlockHasher,
    block_size: usize,
    /// vLLM hash -> kvgate hash of every indexed block.
    by_external: HashMap<ExternalHash, BlockHash>,
    /// kvgate hashes held, with how many vLLM blocks map to each (two vLLM hashes of the same tokens can exist).
    held: HashMap<BlockHash, u32>,
    last_seq: Option<i64>,
    /// `group_idx` of the groups seen storing blocks of another kind than full attention.
    other_groups: HashSet<i64>,
    counters: IndexCounters,
    /// kvgate hashes that became held or were let go since [`EventIndex::take_delta`], and whether everything was.
    delta: Delta,
}

/// What changed in the set of kvgate hashes held (for the registry's copy of it), in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Everything was dropped first (a clear); `changes` then lists what came after.
    pub cleared: bool,
    /// A hash now held (`true`) or let go (`false`), in the order it happened.
    pub changes: Vec<(BlockHash, bool)>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        !self.cleared && self.changes.is_empty()
    }
}

impl EventIndex {
    /// An index for a pod serving `scheme`'s model (its tokenizer and block size).
    pub fn new(scheme: &HashScheme) -> Self {
        Self {
            scheme: *scheme,
            hasher: BlockHasher::new(scheme, &ExtraKeys::none()),
            block_size: scheme.block_size as usize,
            by_external: HashMap::new(),
            held: HashMap::new(),
            last_seq: None,
            other_groups: HashSet::new(),
            counters: IndexCounters::default(),
            delta: Delta::default(),
        }
    }

    pub fn counters(&self) -> IndexCounters {
        self.counters
    }

    /// Blocks indexed.
    pub fn len(&self) -> usize {
        self.by_external.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_external.is_empty()
    }

    /// Whether the pod holds a block of this kvgate hash.
    pub fn holds(&self, hash: BlockHash) -> bool {
        self.held.contains_key(&hash)
    }

    /// The kvgate hashes the pod holds (for its summary).
    pub fn hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.held.keys().copied()
    }

    /// The sequence number of the last batch applied.
    pub fn last_seq(&self) -> Option<i64> {
        self.last_seq
    }

    /// Forgets everything (after a gap that could not be replayed, or a pod restart); the next batch starts anew.
    pub fn clear(&mut self) {
        self.drop_all();
        self.last_seq = None;
    }

    fn drop_all(&mut self) {
        self.by_external.clear();
        self.held.clear();
        self.delta = Delta { cleared: true, ..Delta::default() };
    }

    /// The changes since the last call.
    pub fn take_delta(&mut self) -> Delta {
        std::mem::take(&mut self.delta)
    }

    /// The first sequence number missing before batch `seq` (`None`: `seq` follows the last one, or nothing was
    /// applied yet, or it was applied already).
    pub fn missing_before(&self, seq: i64) -> Option<i64> {
        self.last_seq.filter(|last| seq > last + 1).map(|last| last + 1)
    }

    /// Applies batch `seq`.
    pub fn apply(&mut self, seq: i64, batch: &EventBatch) -> Applied {
        let outcome = match self.last_seq {
            Some(last) if seq <= last => return Applied::Stale,
            Some(last) if seq != last + 1 => {
                self.counters.gaps += 1;
                Applied::Gap { expected: last + 1, got: seq }
            }
            _ => Applied::InOrder,
        };
        self.last_seq = Some(seq);
        for e in &batch.events {
            self.apply_event(e);
        }
        outcome
    }

    /// The root of adapter `name`'s chains (a first block of it chains from here).
    fn lora_root(&self, name: &str) -> BlockHash {
        let keys = ExtraKeys::none().with(kvgate_shared::hashing::ExtraKey::LoraAdapter(name.to_owned()));
        BlockHasher::new(&self.scheme, &keys).root()
    }

    /// A removal from a group of another kind: the same vLLM hash may name a full-attention block still held.
    fn is_other_group(&self, group: &CacheGroup) -> bool {
        group.full_attention == Some(false) || group.idx.is_some_and(|g| self.other_groups.contains(&g))
    }

    fn apply_event(&mut self, e: &KvEvent) {
        match e {
            KvEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                medium,
                keyed_from,
                lora,
                group,
            } => {
                let n = block_hashes.len() as u64;
                if group.full_attention == Some(false) {
                    if let Some(g) = group.idx {
                        if self.other_groups.len() < MAX_OTHER_GROUPS {
                            self.other_groups.insert(g);
                        }
                    }
                    self.counters.other_group_blocks += n;
                    return;
                }
                if *block_size != self.block_size {
                    self.counters.other_block_size += n;
                    return;
                }
                if medium.as_deref().is_some_and(|m| m != "GPU") {
                    self.counters.other_medium_blocks += n;
                    return;
                }
                let mut prev = match parent {
                    // An adapter's first block chains from the adapter's root.
                    None if lora.is_some() => Some(self.lora_root(lora.as_deref().unwrap_or_default())),
                    None => None,
                    Some(p) => match self.by_external.get(p) {
                        Some(k) => Some(*k),
                        None => {
                            self.counters.unchained_blocks += n;
                            return;
                        }
                    },
                };
                let plain = keyed_from.unwrap_or(block_hashes.len()).min(block_hashes.len());
                self.counters.keyed_blocks += (block_hashes.len() - plain) as u64;
                for (h, tokens) in block_hashes[..plain].iter().zip(token_ids.chunks_exact(self.block_size)) {
                    let k = self.hasher.next(prev, tokens);
                    prev = Some(k);
                    if self.by_external.contains_key(h) {
                        continue;
                    }
                    if self.by_external.len() >= MAX_INDEXED_BLOCKS {
                        self.counters.over_capacity_blocks += 1;
                        continue;
                    }
                    self.by_external.insert(h.clone(), k);
                    let c = self.held.entry(k).or_insert(0);
                    *c += 1;
                    if *c == 1 {
                        self.delta.changes.push((k, true));
                    }
                    self.counters.stored_blocks += 1;
                }
            }
            KvEvent::Removed { block_hashes, medium, group } => {
                if medium.as_deref().is_some_and(|m| m != "GPU") || self.is_other_group(group) {
                    return;
                }
                for h in block_hashes {
                    let Some(k) = self.by_external.remove(h) else { continue };
                    self.counters.removed_blocks += 1;
                    if let Some(c) = self.held.get_mut(&k) {
                        *c -= 1;
                        if *c == 0 {
                            self.held.remove(&k);
                            self.delta.changes.push((k, false));
                        }
                    }
                }
            }
            KvEvent::AllCleared => {
                self.counters.clears += 1;
                self.drop_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheme() -> HashScheme {
        HashScheme::new(4, 99)
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
        KvEvent::Stored {
            block_hashes: hashes.iter().map(|h| ExternalHash::Int(*h)).collect(),
            parent: parent.map(ExternalHash::Int),
            token_ids: tokens.to_vec(),
            block_size: 4,
            medium: Some("GPU".into()),
            keyed_from: None,
            lora: None,
            group: CacheGroup::default(),
        }
    }

    fn removed(hash: u64, group: CacheGroup) -> KvEvent {
        KvEvent::Removed { block_hashes: vec![ExternalHash::Int(hash)], medium: None, group }
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch { ts: 0.0, events, data_parallel_rank: None, unknown: 0 }
    }

    #[test]
    fn stored_blocks_get_the_hashes_a_kvgate_worker_would_give_them() {
        let s = scheme();
        let tokens: Vec<u32> = (1..=16).collect();
        let want = BlockHasher::new(&s, &ExtraKeys::none()).hash_blocks(&tokens);
        let mut ix = EventIndex::new(&s);
        // Two events: blocks 0-1, then 2-3 chained to block 1 by its vLLM hash.
        let b = batch(vec![
            stored(&[100, 101], None, &tokens[..8]),
            stored(&[102, 103], Some(101), &tokens[8..]),
        ]);
        assert_eq!(ix.apply(1, &b), Applied::InOrder);
        assert!(want.iter().all(|h| ix.holds(*h)), "every block under kvgate's own hash");
        let added: Vec<(BlockHash, bool)> = want.iter().map(|h| (*h, true)).collect();
        assert_eq!(ix.take_delta(), Delta { cleared: false, changes: added });
        assert!(ix.take_delta().is_empty());
        assert_eq!(ix.len(), 4);
        // Removing the last block, then a replayed (stale) batch changes nothing more.
        assert_eq!(ix.apply(2, &batch(vec![removed(103, CacheGroup::default())])), Applied::InOrder);
        assert!(!ix.holds(want[3]) && ix.holds(want[2]));
        assert_eq!(ix.take_delta().changes, vec![(want[3], false)]);
        assert_eq!(ix.apply(2, &b), Applied::Stale);
        assert_eq!(ix.len(), 3);
        // A gap is reported (and the batch still applied); a clear forgets everything.
        assert_eq!(ix.apply(5, &batch(vec![KvEvent::AllCleared])), Applied::Gap { expected: 3, got: 5 });
        assert!(ix.is_empty());
        assert!(ix.take_delta().cleared);
        assert_eq!(ix.counters().gaps, 1);
        assert_eq!(ix.counters().clears, 1);
    }

    #[test]
    fn what_cannot_be_rebuilt_is_skipped_and_counted() {
        let s = scheme();
        let tokens: Vec<u32> = (1..=8).collect();
        let mut ix = EventIndex::new(&s);
        let keyed = KvEvent::Stored {
            block_hashes: vec![ExternalHash::Int(1)],
            parent: None,
            token_ids: tokens[..4].to_vec(),
            block_size: 4,
            medium: None,
            keyed_from: Some(0),
            lora: None,
            group: CacheGroup::default(),
        };
        let other_size = KvEvent::Stored {
            block_hashes: vec![ExternalHash::Int(2)],
            parent: None,
            token_ids: tokens.clone(),
            block_size: 8,
            medium: None,
            keyed_from: None,
            lora: None,
            group: CacheGroup::default(),
        };
        let on_cpu = KvEvent::Stored {
            block_hashes: vec![ExternalHash::Int(3)],
            parent: None,
            token_ids: tokens[..4].to_vec(),
            block_size: 4,
            medium: Some("CPU".into()),
            keyed_from: None,
            lora: None,
            group: CacheGroup::default(),
        };
        // A child whose parent was never seen (the index joined mid-stream).
        let orphan = stored(&[5], Some(4), &tokens[4..]);
        ix.apply(1, &batch(vec![keyed, other_size, on_cpu, orphan]));
        let c = ix.counters();
        assert!(ix.is_empty());
        assert_eq!(
            (c.keyed_blocks, c.other_block_size, c.other_medium_blocks, c.unchained_blocks),
            (1, 1, 1, 1)
        );
        // The same tokens stored under two vLLM hashes are held until both are removed.
        ix.apply(2, &batch(vec![stored(&[10], None, &tokens[..4]), stored(&[11], None, &tokens[..4])]));
        let h = BlockHasher::new(&s, &ExtraKeys::none()).hash_blocks(&tokens[..4])[0];
        ix.apply(3, &batch(vec![removed(10, CacheGroup::default())]));
        assert!(ix.holds(h));
        ix.apply(4, &batch(vec![removed(11, CacheGroup::default())]));
        assert!(!ix.holds(h));
        ix.clear();
        assert_eq!(ix.last_seq(), None);
        assert_eq!(ix.apply(100, &batch(vec![])), Applied::InOrder);
    }

    #[test]
    fn a_keyed_block_stops_its_event_and_other_groups_are_left_out() {
        let s = scheme();
        let tokens: Vec<u32> = (1..=12).collect();
        let want = BlockHasher::new(&s, &ExtraKeys::none()).hash_blocks(&tokens);
        let mut ix = EventIndex::new(&s);
        // Block 1 of three carries an extra key: block 0 is indexed, blocks 1 and 2 (chained through it) are not.
        let mut e = stored(&[1, 2, 3], None, &tokens);
        if let KvEvent::Stored { keyed_from, .. } = &mut e {
            *keyed_from = Some(1);
        }
        ix.apply(1, &batch(vec![e]));
        assert!(ix.holds(want[0]) && !ix.holds(want[1]) && !ix.holds(want[2]));
        assert_eq!(ix.counters().keyed_blocks, 2);
        // A sliding-window group stores the same vLLM hash: not indexed, and its removal (by group_idx alone)
        // leaves the full-attention block held.
        let window = CacheGroup { idx: Some(1), full_attention: Some(false) };
        let mut w = stored(&[1], None, &tokens[..4]);
        if let KvEvent::Stored { group, .. } = &mut w {
            *group = window.clone();
        }
        ix.apply(2, &batch(vec![w, removed(1, CacheGroup { idx: Some(1), full_attention: None })]));
        assert!(ix.holds(want[0]));
        assert_eq!(ix.counters().other_group_blocks, 1);
        // The full-attention group's removal lets it go.
        ix.apply(3, &batch(vec![removed(1, CacheGroup { idx: Some(0), full_attention: None })]));
        assert!(!ix.holds(want[0]));
    }
}
