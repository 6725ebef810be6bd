//! The approximate index of a pod that sends no reports (a vLLM, SGLang or llama.cpp pod in front of which this
//! gateway has no cache signal of its own): the prompt blocks this gateway sent it, kept the way the pod's LRU
//! keeps them. Capacity in blocks (the pod's KV tokens / block size); the least recently sent go first; within one
//! prompt its last blocks go before its first ones (an engine frees a sequence's blocks from the tail, so a prefix
//! outlives its continuations). Right for a pod that serves only this gateway and evicts LRU; never holds more
//! than the capacity. Pure: no clocks.

use std::collections::{BTreeMap, HashMap};

use kvgate_shared::hashing::BlockHash;

/// Most blocks one index holds, whatever the capacity asked (16M tokens in blocks of 16).
pub const MAX_APPROX_BLOCKS: usize = 1 << 20;

/// The blocks a pod is believed to hold.
#[derive(Clone, Debug, Default)]
pub struct ApproxIndex {
    capacity: usize,
    stamp: u64,
    at: HashMap<BlockHash, u64>,
    order: BTreeMap<u64, BlockHash>,
}

impl ApproxIndex {
    /// An index of at most `capacity_blocks` (capped at [`MAX_APPROX_BLOCKS`]).
    pub fn new(capacity_blocks: usize) -> Self {
        Self { capacity: capacity_blocks.min(MAX_APPROX_BLOCKS), ..Self::default() }
    }

    /// Records a prompt sent to the pod (its blocks' chained hashes, in order).
    pub fn touch(&mut self, hashes: &[BlockHash]) {
        // The first block is the most recently used, so it is the last to go.
        for h in hashes.iter().rev() {
            self.stamp += 1;
            if let Some(old) = self.at.insert(*h, self.stamp) {
                self.order.remove(&old);
            }
            self.order.insert(self.stamp, *h);
        }
        self.evict();
    }

    /// A new capacity (the pod's metrics said how many blocks it has): the least recently sent go if it shrank.
    pub fn set_capacity(&mut self, capacity_blocks: usize) {
        self.capacity = capacity_blocks.min(MAX_APPROX_BLOCKS);
        self.evict();
    }

    fn evict(&mut self) {
        while self.at.len() > self.capacity {
            match self.order.pop_first() {
                Some((_, h)) => {
                    self.at.remove(&h);
                }
                None => break,
            }
        }
    }

    /// Leading blocks of `hashes` the pod is believed to hold.
    pub fn matched(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.at.contains_key(h)).count()
    }

    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(family: u64, n: u64) -> Vec<BlockHash> {
        (0..n).map(|i| BlockHash(family * 1000 + i)).collect()
    }

    #[test]
    fn the_least_recently_sent_go_first_and_a_prefix_outlives_its_tails() {
        let mut ix = ApproxIndex::new(10);
        let a = prompt(1, 6);
        ix.touch(&a);
        assert_eq!(ix.matched(&a), 6);
        // Six more blocks: two of a's go, its tail first, so a's first four blocks are still a prefix match.
        let b = prompt(2, 6);
        ix.touch(&b);
        assert_eq!(ix.len(), 10);
        assert_eq!(ix.matched(&a), 4);
        assert_eq!(ix.matched(&b), 6);
        // Sending a again makes it the most recent: b loses its tail.
        ix.touch(&a);
        assert_eq!(ix.matched(&a), 6);
        assert_eq!(ix.matched(&b), 4);
        assert_eq!(ix.matched(&prompt(3, 4)), 0);
        // Never past the capacity, and a zero capacity holds nothing.
        let mut none = ApproxIndex::new(0);
        none.touch(&a);
        assert!(none.is_empty());
        assert_eq!(ApproxIndex::new(usize::MAX).capacity(), MAX_APPROX_BLOCKS);
    }

    #[test]
    fn a_smaller_capacity_forgets_the_least_recently_sent_at_once() {
        let mut ix = ApproxIndex::new(10);
        let (a, b) = (prompt(1, 5), prompt(2, 5));
        ix.touch(&a);
        ix.touch(&b);
        ix.set_capacity(6);
        assert_eq!((ix.len(), ix.capacity()), (6, 6));
        assert_eq!((ix.matched(&a), ix.matched(&b)), (1, 5));
        ix.set_capacity(usize::MAX);
        assert_eq!(ix.capacity(), MAX_APPROX_BLOCKS);
    }
}
