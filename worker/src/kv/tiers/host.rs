//! The host DRAM tier under the device pool (`--host-kv-bytes`): cached blocks the pool evicted, copied down at
//! eviction (write-back), served back up on a prefix hit. Its index ([`TierIndex`]) serves the SSD tier too, which
//! keeps places in its segment files where this one keeps bytes.
//!
//! - A block is kept by its chained hash with its chain check (`super::chain_check`, an independent 64-bit digest
//!   of the whole prefix), position and tokens: a hit needs all three to match the request's, so a collision of
//!   the chained hash costs a recompute, never a wrong block (as in the device pool).
//! - Blocks of a prefix stay together: a block is stored only if its parent is here or in the device pool, a block
//!   is evicted only when none of its children are here (leaves first, least recently used first), and dropping a
//!   block that cannot be kept drops its children here too ([`HostTier::insert`]).
//! - Capacity is in bytes (`block_bytes` per block: the backend's K/V bytes of one block); a tier of 0 bytes holds
//!   nothing. A hit leaves the copy here (the device copy may be evicted again without a new write).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvgate_shared::hashing::BlockHash;

/// One block of a tier: `P` is where its K/V bytes are (in host memory: the bytes; on SSD: their place).
#[derive(Clone, Debug)]
struct HostBlock<P> {
    check: u64,
    index: u32,
    tokens: Box<[u32]>,
    /// The K/V bytes or their place (empty bytes for a backend without KV memory: the simulator counts
    /// `block_bytes` all the same).
    payload: P,
    /// The chained hash of the block before it (`None`: a first block), here or not.
    parent: Option<BlockHash>,
    /// Last use (insertion or hit).
    tick: u64,
}

/// Counters since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCounters {
    /// Blocks copied down from the device pool.
    pub stored_blocks: u64,
    pub stored_bytes: u64,
    /// Blocks dropped for room.
    pub evicted_blocks: u64,
    /// Blocks served back to the device pool.
    pub hit_blocks: u64,
    /// Blocks refused or dropped because their parent was in no tier (no lookup could reach them).
    pub orphans: u64,
}

/// What [`HostTier::insert`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    New,
    /// Already here (a copy kept when it was promoted): only its use time moved.
    Present,
    /// Not kept (the tier is off, or the block's parent is in no tier).
    Refused,
}

/// A block to keep ([`TierIndex::insert`]), or one a full tier let go ([`TierIndex::take_spilled`]).
#[derive(Clone, Debug)]
pub struct HostInsert<P = Arc<[u8]>> {
    pub hash: BlockHash,
    pub check: u64,
    pub index: u32,
    pub tokens: Box<[u32]>,
    pub payload: P,
    /// The chained hash of the block before it (`None` for a first block).
    pub parent: Option<BlockHash>,
}

/// The host DRAM tier: its index holds the bytes themselves.
pub type HostTier = TierIndex<Arc<[u8]>>;

/// A lower tier's index: blocks by chained hash, the prefix tree, the leaves-first LRU, the capacity.
#[derive(Debug)]
pub struct TierIndex<P> {
    capacity_bytes: usize,
    block_bytes: usize,
    blocks: HashMap<BlockHash, HostBlock<P>>,
    /// Parent hash -> its children held here (whether the parent is here or in the device pool).
    kids: HashMap<BlockHash, Vec<BlockHash>>,
    /// Blocks without children here, by last use: the eviction order.
    leaves: BTreeMap<u64, BlockHash>,
    tick: u64,
    counters: HostCounters,
    /// Blocks evicted for room, kept for the tier below ([`Self::set_spill`]).
    spilled: Vec<HostInsert<P>>,
    spill: bool,
}

impl<P: Clone> TierIndex<P> {
    /// A tier of `capacity_bytes`, each block counting `block_bytes`.
    pub fn new(capacity_bytes: usize, block_bytes: usize) -> Self {
        Self {
            capacity_bytes,
            block_bytes: block_bytes.max(1),
            blocks: HashMap::new(),
            kids: HashMap::new(),
            leaves: BTreeMap::new(),
            tick: 0,
            counters: HostCounters::default(),
            spilled: Vec::new(),
            spill: false,
        }
    }

    /// Keeps the blocks evicted for room for [`Self::take_spilled`] (a tier below wants them).
    pub fn set_spill(&mut self, on: bool) {
        self.spill = on;
    }

    /// The blocks evicted for room since the last call.
    pub fn take_spilled(&mut self) -> Vec<HostInsert<P>> {
        std::mem::take(&mut self.spilled)
    }

    /// Blocks the tier can hold.
    pub fn capacity_blocks(&self) -> usize {
        self.capacity_bytes / self.block_bytes
    }
    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes
    }
    pub fn len(&self) -> usize {
        self.blocks.len()
    }
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
    pub fn used_bytes(&self) -> usize {
        self.blocks.len() * self.block_bytes
    }
    pub fn counters(&self) -> HostCounters {
        self.counters
    }
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Every block with its position (the report summarises these).
    pub fn entries(&self) -> impl Iterator<Item = (BlockHash, u32)> + '_ {
        self.blocks.iter().map(|(h, b)| (*h, b.index))
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn is_leaf(&self, hash: &BlockHash) -> bool {
        self.kids.get(hash).is_none_or(Vec::is_empty)
    }

    /// Keeps a block the device pool evicted. `parent_on_device`: whether the device pool holds its parent. A
    /// block whose parent is in neither tier is refused (no lookup could reach it); when a block is refused, its
    /// children here are dropped with it for the same reason.
    pub fn insert(&mut self, b: HostInsert<P>, parent_on_device: bool) -> Stored {
        if self.blocks.contains_key(&b.hash) {
            self.touch(b.hash);
            return Stored::Present;
        }
        let reachable = b.parent.is_none_or(|p| parent_on_device || self.blocks.contains_key(&p));
        if self.capacity_blocks() == 0 || !reachable {
            if !reachable {
                self.counters.orphans += 1;
            }
            self.drop_descendants(b.hash);
            return Stored::Refused;
        }
        while self.blocks.len() >= self.capacity_blocks() {
            if !self.evict_one(b.parent) {
                self.drop_descendants(b.hash);
                return Stored::Refused;
            }
        }
        let tick = self.next_tick();
        if let Some(p) = b.parent {
            if let Some(pb) = self.blocks.get(&p) {
                if self.is_leaf(&p) {
                    self.leaves.remove(&pb.tick);
                }
            }
            self.kids.entry(p).or_default().push(b.hash);
        }
        if self.is_leaf(&b.hash) {
            self.leaves.insert(tick, b.hash);
        }
        let bytes = self.block_bytes as u64;
        let block = HostBlock {
            check: b.check,
            index: b.index,
            tokens: b.tokens,
            payload: b.payload,
            parent: b.parent,
            tick,
        };
        self.blocks.insert(b.hash, block);
        self.counters.stored_blocks += 1;
        self.counters.stored_bytes += bytes;
        Stored::New
    }

    /// Evicts the least recently used leaf (never `protect`); false when there is none.
    fn evict_one(&mut self, protect: Option<BlockHash>) -> bool {
        let victim = self.leaves.values().copied().find(|h| Some(*h) != protect);
        let Some(hash) = victim else { return false };
        if let (true, Some(b)) = (self.spill, self.blocks.get(&hash)) {
            let out = HostInsert {
                hash,
                check: b.check,
                index: b.index,
                tokens: b.tokens.clone(),
                payload: b.payload.clone(),
                parent: b.parent,
            };
            self.spilled.push(out);
        }
        self.remove(hash);
        self.counters.evicted_blocks += 1;
        true
    }

    /// Removes a block that has no children here (its parent may become a leaf).
    fn remove(&mut self, hash: BlockHash) {
        let Some(b) = self.blocks.remove(&hash) else { return };
        self.leaves.remove(&b.tick);
        self.kids.remove(&hash);
        if let Some(p) = b.parent {
            if let Some(list) = self.kids.get_mut(&p) {
                list.retain(|h| *h != hash);
                if list.is_empty() {
                    self.kids.remove(&p);
                    if let Some(pb) = self.blocks.get(&p) {
                        self.leaves.insert(pb.tick, p);
                    }
                }
            }
        }
    }

    /// Drops one block that cannot be served (its bytes are lost), with its descendants here.
    pub fn forget(&mut self, hash: BlockHash) {
        self.drop_descendants(hash);
        self.remove(hash);
    }

    /// Every block's payload (the SSD tier's compaction looks for the places in one file).
    pub fn payloads(&self) -> impl Iterator<Item = (BlockHash, &P)> + '_ {
        self.blocks.iter().map(|(h, b)| (*h, &b.payload))
    }

    /// A block's payload by its hash alone (the SSD tier's compaction checks a record is still the block's).
    pub fn payloads_of(&self, hash: BlockHash) -> Option<P> {
        self.blocks.get(&hash).map(|b| b.payload.clone())
    }

    /// A block's payload if it holds exactly this content, without counting a use (a read-ahead).
    pub fn peek(&self, hash: BlockHash, check: u64, index: u32, tokens: &[u32]) -> Option<&P> {
        self.holds(hash, check, index, tokens).then(|| self.blocks.get(&hash).map(|b| &b.payload)).flatten()
    }

    /// Replaces a block's payload (the SSD tier moved its bytes).
    pub fn set_payload(&mut self, hash: BlockHash, payload: P) {
        if let Some(b) = self.blocks.get_mut(&hash) {
            b.payload = payload;
        }
    }

    /// Drops every block here that descends from `hash` (it left every tier: they are unreachable).
    pub fn drop_descendants(&mut self, hash: BlockHash) {
        let mut stack: Vec<BlockHash> = self.kids.get(&hash).cloned().unwrap_or_default();
        let mut order = Vec::new();
        while let Some(h) = stack.pop() {
            order.push(h);
            stack.extend(self.kids.get(&h).into_iter().flatten().copied());
        }
        // Children before parents, so every removal is of a leaf.
        for h in order.into_iter().rev() {
            if self.blocks.contains_key(&h) {
                self.remove(h);
                self.counters.orphans += 1;
            }
        }
    }

    /// Marks a held block used (the device evicted its copy again: nothing to write). False if it is not here.
    pub fn refresh(&mut self, hash: BlockHash) -> bool {
        let here = self.blocks.contains_key(&hash);
        if here {
            self.touch(hash);
        }
        here
    }

    fn touch(&mut self, hash: BlockHash) {
        let tick = self.next_tick();
        let leaf = self.is_leaf(&hash);
        if let Some(b) = self.blocks.get_mut(&hash) {
            if leaf {
                self.leaves.remove(&b.tick);
                self.leaves.insert(tick, hash);
            }
            b.tick = tick;
        }
    }

    /// The K/V bytes of the block `hash` if it holds exactly this content (same chain check, position and tokens);
    /// counts a hit and marks it used.
    pub fn get(&mut self, hash: BlockHash, check: u64, index: u32, tokens: &[u32]) -> Option<P> {
        if !self.holds(hash, check, index, tokens) {
            return None;
        }
        let payload = self.blocks.get(&hash)?.payload.clone();
        self.touch(hash);
        self.counters.hit_blocks += 1;
        Some(payload)
    }

    /// Whether [`Self::get`] would serve the block (nothing counted or touched).
    pub fn holds(&self, hash: BlockHash, check: u64, index: u32, tokens: &[u32]) -> bool {
        self.blocks.get(&hash).is_some_and(|b| b.check == check && b.index == index && &*b.tokens == tokens)
    }

    /// Checks the invariants (tests): within capacity; the children index and the leaf set agree with the
    /// blocks; every block's parent is here or (`on_device`) in the device pool.
    pub fn check_invariants(&self, on_device: impl Fn(BlockHash) -> bool) -> Result<(), String> {
        if self.blocks.len() > self.capacity_blocks() {
            return Err(format!(
                "{} blocks over a capacity of {}",
                self.blocks.len(),
                self.capacity_blocks()
            ));
        }
        let mut kids = 0;
        for (h, b) in &self.blocks {
            if let Some(p) = b.parent {
                if !self.blocks.contains_key(&p) && !on_device(p) {
                    return Err(format!("{h:?}: parent {p:?} in no tier"));
                }
                if !self.kids.get(&p).is_some_and(|l| l.contains(h)) {
                    return Err(format!("{h:?} missing from its parent's children"));
                }
                kids += 1;
            }
            let in_leaves = self.leaves.get(&b.tick) == Some(h);
            if in_leaves != self.is_leaf(h) {
                return Err(format!("{h:?}: leaf set says {in_leaves}"));
            }
        }
        if kids != self.kids.values().map(Vec::len).sum::<usize>() {
            return Err("children index holds blocks that are not here".into());
        }
        if self.leaves.len() != self.blocks.keys().filter(|h| self.is_leaf(h)).count() {
            return Err("leaf set holds blocks it should not".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u64) -> BlockHash {
        BlockHash(1000 + i)
    }

    /// Block `i` of a chain rooted at block 0 (parent `i - 1`).
    fn block(i: u64, parent: Option<u64>) -> HostInsert {
        HostInsert {
            hash: h(i),
            check: i * 7,
            index: parent.map_or(0, |_| 1),
            tokens: vec![i as u32; 4].into(),
            payload: Arc::from(vec![i as u8; 8]),
            parent: parent.map(h),
        }
    }

    #[test]
    fn leaves_go_first_and_parents_stay_while_their_children_are_here() {
        let mut t = HostTier::new(3 * 8, 8);
        // A chain 0 <- 1 <- 2, stored children first (the device evicts tails first) while each parent is still
        // on the device.
        assert_eq!(t.insert(block(2, Some(1)), true), Stored::New);
        assert_eq!(t.insert(block(1, Some(0)), true), Stored::New);
        assert_eq!(t.insert(block(0, None), false), Stored::New);
        t.check_invariants(|_| false).expect("invariants");
        // Full: a new root evicts the only leaf, block 2 (never a block whose child is here).
        assert_eq!(t.insert(block(5, None), false), Stored::New);
        assert!(!t.contains(h(2)) && t.contains(h(1)) && t.contains(h(0)));
        t.check_invariants(|_| false).expect("invariants");
        // Now 1 is a leaf and older than 5: it goes next.
        assert_eq!(t.insert(block(6, None), false), Stored::New);
        assert!(!t.contains(h(1)) && t.contains(h(0)));
        assert_eq!(t.counters().evicted_blocks, 2);
    }

    #[test]
    fn a_block_whose_parent_is_in_no_tier_is_refused_and_so_are_its_children() {
        let mut t = HostTier::new(10 * 8, 8);
        assert_eq!(t.insert(block(1, Some(0)), false), Stored::Refused, "parent nowhere");
        assert_eq!(t.counters().orphans, 1);
        // A child kept while its parent was on the device; then the parent leaves the device unkept.
        assert_eq!(t.insert(block(2, Some(1)), true), Stored::New);
        assert_eq!(t.insert(block(3, Some(2)), false), Stored::New);
        assert_eq!(t.insert(block(1, Some(0)), false), Stored::Refused);
        assert!(t.is_empty(), "its descendants are unreachable: dropped");
        t.check_invariants(|_| false).expect("invariants");
        assert_eq!(
            HostTier::new(4, 8).insert(block(0, None), false),
            Stored::Refused,
            "a tier under one block"
        );
    }

    #[test]
    fn a_hit_needs_the_same_check_position_and_tokens() {
        let mut t = HostTier::new(10 * 8, 8);
        t.insert(block(0, None), false);
        let tokens = [0u32; 4];
        assert!(t.get(h(0), 0, 0, &tokens).is_some());
        assert!(t.get(h(0), 1, 0, &tokens).is_none(), "another chain check: a hash collision");
        assert!(t.get(h(0), 0, 1, &tokens).is_none(), "another position");
        assert!(t.get(h(0), 0, 0, &[1, 0, 0, 0]).is_none(), "other tokens");
        assert_eq!(t.counters().hit_blocks, 1);
        assert_eq!(t.insert(block(0, None), false), Stored::Present);
    }
}
