//! The block pool: which KV blocks are free, referenced or cached, and the prefix cache's hash -> block map.
//!
//! Pure bookkeeping (no tensors): the compute backend owns the memory a block id points at.
//!
//! - A block is **referenced** (`ref_count > 0`: part of at least one live sequence) or **free**. A free block may
//!   still be **cached**: it keeps its hash and tokens, sits in the LRU free queue, and is taken back out on a hit.
//! - Allocation takes the free queue's head (least recently freed); if that block was cached it is evicted
//!   (its hash leaves the map). Releasing a sequence appends its blocks tail-first, so a finished sequence's tail is
//!   evicted before its head (the head is the part other requests share).
//! - A lookup succeeds only when the hash maps to a block **and** the whole chain matches: the block's tokens equal
//!   the request's, and its parent is the request's parent ([`Parent`]: the identity of the cached block it extended,
//!   or for a first block a second, independent 64-bit digest of the request's root). A collision of the 64-bit chained hash, even
//!   between two prefixes with the same last block (two tenants' salts), costs a recompute, never a wrong block.
//! - Every cached content gets a fresh `uid` (never reused), so a parent identity cannot point at a block that was
//!   evicted and refilled.
//! - With a lower tier below the pool ([`BlockPool::set_record_evictions`]), every eviction of cached content is
//!   recorded ([`Evicted`]: block, hash, chain check, position, tokens) for the engine to copy the block down before
//!   its memory is written again (write-back).

use std::collections::HashMap;

use kvgate_shared::hashing::BlockHash;

/// Index of a KV block in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// What a cached block extends: the request's root (its second digest, `BlockHasher::root_id`) for a first block,
/// else the cached content of the block before it (that block's `uid`). 16 bytes: the pool's metadata stays compact.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parent {
    Root(u64),
    Block(u64),
}

#[derive(Clone, Debug)]
struct BlockMeta {
    ref_count: u32,
    hash: Option<BlockHash>,
    /// Identity of the cached content (0 while uncached).
    uid: u64,
    /// What the cached content extends (meaningful while cached).
    parent: Parent,
    /// The block's tokens, kept while it is cached, for verification on a hit.
    tokens: Box<[u32]>,
    /// The cached content's chain check (`super::chain_check`) and its parent's chained hash (`None`: a first
    /// block), kept for the lower tiers.
    check: u64,
    parent_hash: Option<BlockHash>,
    prev: u32,
    next: u32,
    in_free_queue: bool,
}

/// Counters of the pool since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounters {
    /// Cached blocks whose content was dropped to make room.
    pub evictions: u64,
    /// Blocks served from the cache.
    pub hit_blocks: u64,
    /// Blocks looked up.
    pub queried_blocks: u64,
    /// Lookups or registrations whose hash matched a block of another chain (other tokens or another parent).
    pub collisions: u64,
}

/// What names a block's content across tiers: its chained hash, its chain check, its parent's chained hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockKey {
    pub hash: BlockHash,
    pub check: u64,
    pub parent_hash: Option<BlockHash>,
}

/// What [`BlockPool::register`] did with a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registered {
    /// The block caches the content now (or did already); its identity.
    New(u64),
    /// Another block caches the same content: the sequence should hold that one instead.
    Duplicate { block: BlockId, uid: u64 },
}

impl Registered {
    /// The identity of the content in the cache (the parent of the sequence's next block).
    pub fn uid(self) -> u64 {
        match self {
            Registered::New(uid) | Registered::Duplicate { uid, .. } => uid,
        }
    }
}

/// Cached content the pool just evicted, for a lower tier to keep (its memory is intact until the next forward).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub id: BlockId,
    pub hash: BlockHash,
    pub check: u64,
    pub parent_hash: Option<BlockHash>,
    /// The block's position in its sequence (0: first).
    pub index: u32,
    pub tokens: Box<[u32]>,
}

/// The pool of KV blocks.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<BlockMeta>,
    head: u32,
    tail: u32,
    free_len: usize,
    /// The prefix cache: hash -> the block holding it and the block's index in its sequence (0 = first block; reports
    /// sample by position, and keeping it here lets them walk the map without touching the block metadata).
    cached: HashMap<BlockHash, (BlockId, u32)>,
    counters: PoolCounters,
    next_uid: u64,
    /// Evictions since the last [`BlockPool::take_evicted`] (recorded only when a lower tier wants them).
    evicted: Vec<Evicted>,
    record_evictions: bool,
    /// Registrations since the last [`BlockPool::take_registered`] (recorded only for write-through).
    registered: Vec<Evicted>,
    record_registrations: bool,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens, all free.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let n = num_blocks.min(NIL as usize - 1);
        let blocks = (0..n)
            .map(|i| BlockMeta {
                ref_count: 0,
                hash: None,
                uid: 0,
                parent: Parent::Root(0),
                tokens: Box::new([]),
                check: 0,
                parent_hash: None,
                prev: if i == 0 { NIL } else { i as u32 - 1 },
                next: if i + 1 == n { NIL } else { i as u32 + 1 },
                in_free_queue: true,
            })
            .collect();
        Self {
            block_size,
            blocks,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n as u32 - 1 },
            free_len: n,
            cached: HashMap::new(),
            counters: PoolCounters::default(),
            next_uid: 1,
            evicted: Vec::new(),
            record_evictions: false,
            registered: Vec::new(),
            record_registrations: false,
        }
    }

    /// Records every new registration for [`Self::take_registered`] (write-through: each completed block is
    /// copied down at once).
    pub fn set_record_registrations(&mut self, on: bool) {
        self.record_registrations = on;
        if !on {
            self.registered.clear();
        }
    }

    /// The blocks registered since the last call (their memory holds their K/V now).
    pub fn take_registered(&mut self) -> Vec<Evicted> {
        std::mem::take(&mut self.registered)
    }

    /// Records evictions of cached content for [`Self::take_evicted`] (a lower tier is configured).
    pub fn set_record_evictions(&mut self, on: bool) {
        self.record_evictions = on;
        if !on {
            self.evicted.clear();
        }
    }

    /// The evictions since the last call.
    pub fn take_evicted(&mut self) -> Vec<Evicted> {
        std::mem::take(&mut self.evicted)
    }

    /// The identity of a block's cached content (0: uncached); it changes when the block is evicted.
    pub fn uid(&self, id: BlockId) -> u64 {
        self.blocks[id as usize].uid
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }
    /// Blocks no live sequence references (cached or not).
    pub fn num_free(&self) -> usize {
        self.free_len
    }
    /// Blocks whose content is in the prefix cache.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }
    pub fn counters(&self) -> PoolCounters {
        self.counters
    }
    /// Reference count of a block (tests and invariants).
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_count
    }

    /// Every hash the prefix cache holds (the worker's report summarises these).
    pub fn cached_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.cached.keys().copied()
    }

    /// Every cached hash with its block's index in its sequence.
    pub fn cached_entries(&self) -> impl Iterator<Item = (BlockHash, u32)> + '_ {
        self.cached.iter().map(|(h, (_, index))| (*h, *index))
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            debug_assert!(b.in_free_queue);
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free_queue = false;
        self.free_len -= 1;
    }

    fn push_back(&mut self, id: BlockId) {
        let tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
            b.in_free_queue = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.free_len += 1;
    }

    /// Takes `n` blocks for new content (evicting cached ones, least recently freed first); `None` (and nothing
    /// taken) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free_len {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let b = &mut self.blocks[id as usize];
            if let Some(h) = b.hash.take() {
                let tokens = std::mem::take(&mut b.tokens);
                b.uid = 0;
                let index = match self.cached.get(&h) {
                    Some((c, index)) if *c == id => {
                        let index = *index;
                        self.cached.remove(&h);
                        Some(index)
                    }
                    _ => None,
                };
                if let (true, Some(index)) = (self.record_evictions, index) {
                    let e =
                        Evicted { id, hash: h, check: b.check, parent_hash: b.parent_hash, index, tokens };
                    self.evicted.push(e);
                }
                self.counters.evictions += 1;
            }
            b.ref_count = 1;
            out.push(id);
        }
        Some(out)
    }

    /// The cached block for `hash` that extends `parent` with exactly `tokens`, referenced for the caller, and the
    /// identity of its content (the parent of the next block); `None` on a miss or a collision.
    pub fn lookup(&mut self, hash: BlockHash, parent: Parent, tokens: &[u32]) -> Option<(BlockId, u64)> {
        self.counters.queried_blocks += 1;
        let (id, _) = *self.cached.get(&hash)?;
        let b = &self.blocks[id as usize];
        if b.parent != parent || &*b.tokens != tokens {
            self.counters.collisions += 1;
            return None;
        }
        let uid = b.uid;
        if b.ref_count == 0 {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_count += 1;
        self.counters.hit_blocks += 1;
        Some((id, uid))
    }

    /// The content identity of the cached block for `hash` extending `parent` with exactly `tokens` (the parent of
    /// the next block), without referencing it or counting a query: for estimates such as load reports.
    pub fn probe(&self, hash: BlockHash, parent: Parent, tokens: &[u32]) -> Option<u64> {
        let (id, _) = *self.cached.get(&hash)?;
        let b = &self.blocks[id as usize];
        (b.parent == parent && &*b.tokens == tokens).then_some(b.uid)
    }

    /// The block caching `hash`, if any (tests and tier checks).
    pub fn block_of(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).map(|(id, _)| *id)
    }

    /// Whether some block caches `hash` (no verification: the lower tiers' "is the parent on the device" test).
    pub fn is_cached(&self, hash: BlockHash) -> bool {
        self.cached.contains_key(&hash)
    }

    /// Drops block `id`'s cached content without counting an eviction (its memory could not be filled).
    pub fn invalidate(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if let Some(h) = b.hash.take() {
            b.tokens = Box::new([]);
            b.uid = 0;
            if self.cached.get(&h).is_some_and(|(c, _)| *c == id) {
                self.cached.remove(&h);
            }
        }
    }

    /// Whether `hash` is cached as the block extending `parent` with these tokens (no reference, no counters).
    pub fn contains(&self, hash: BlockHash, parent: Parent, tokens: &[u32]) -> bool {
        self.cached.get(&hash).is_some_and(|(id, _)| {
            let b = &self.blocks[*id as usize];
            b.parent == parent && &*b.tokens == tokens
        })
    }

    /// Records that referenced block `id`, block number `index` of its sequence, now holds the full block
    /// `tokens` extending `parent`, with chained hash `hash`. [`Registered::New`]: the content's identity in the
    /// cache (the parent of the sequence's next block). [`Registered::Duplicate`]: another block already caches the
    /// same chain (two requests prefilled one prefix at once); the caller moves its sequence onto that block
    /// ([`Self::share`]) and releases its own, so the sequence's later blocks chain to a block it holds. `None`
    /// when another chain holds the hash (a collision): this block stays uncached, and so must the sequence's
    /// later blocks.
    pub fn register(
        &mut self,
        id: BlockId,
        index: usize,
        key: BlockKey,
        parent: Parent,
        tokens: &[u32],
    ) -> Option<Registered> {
        let hash = key.hash;
        debug_assert_eq!(tokens.len(), self.block_size);
        if let Some(&(other, _)) = self.cached.get(&hash) {
            let o = &self.blocks[other as usize];
            if o.parent == parent && &*o.tokens == tokens {
                return Some(match other == id {
                    true => Registered::New(o.uid),
                    false => Registered::Duplicate { block: other, uid: o.uid },
                });
            }
            self.counters.collisions += 1;
            return None;
        }
        let b = &mut self.blocks[id as usize];
        if b.hash.is_some() {
            // Already cached under another hash: never move a block between chains.
            return None;
        }
        let uid = self.next_uid;
        self.next_uid += 1;
        b.hash = Some(hash);
        b.uid = uid;
        b.parent = parent;
        b.check = key.check;
        b.parent_hash = key.parent_hash;
        b.tokens = tokens.into();
        if self.record_registrations {
            let index = index.min(u32::MAX as usize) as u32;
            let r = Evicted {
                id,
                hash,
                check: key.check,
                parent_hash: key.parent_hash,
                index,
                tokens: tokens.into(),
            };
            self.registered.push(r);
        }
        self.cached.insert(hash, (id, index.min(u32::MAX as usize) as u32));
        Some(Registered::New(uid))
    }

    /// One more reference to cached block `id` (a sequence moving onto the cached copy of content it computed
    /// again: [`Registered::Duplicate`]).
    pub fn share(&mut self, id: BlockId) {
        if self.blocks[id as usize].ref_count == 0 {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_count += 1;
    }

    /// Drops one reference to each block, last block first (so tails are evicted before heads).
    pub fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.ref_count > 0, "double release of block {id}");
            if b.ref_count == 0 {
                continue;
            }
            b.ref_count -= 1;
            if b.ref_count == 0 {
                if b.hash.is_none() {
                    // Uncached content is worthless: reuse it before any cached block.
                    self.push_front(id);
                } else {
                    self.push_back(id);
                }
            }
        }
    }

    fn push_front(&mut self, id: BlockId) {
        let head = self.head;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = NIL;
            b.next = head;
            b.in_free_queue = true;
        }
        if head == NIL {
            self.tail = id;
        } else {
            self.blocks[head as usize].prev = id;
        }
        self.head = id;
        self.free_len += 1;
    }

    /// Checks the pool's invariants (tests): the free queue holds exactly the unreferenced blocks, and every
    /// cached hash points at a block that carries it.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = 0usize;
        let mut cur = self.head;
        let mut prev = NIL;
        while cur != NIL {
            let b = &self.blocks[cur as usize];
            if b.ref_count != 0 || !b.in_free_queue || b.prev != prev {
                return Err(format!("free queue corrupt at block {cur}"));
            }
            seen += 1;
            if seen > self.blocks.len() {
                return Err("free queue has a cycle".into());
            }
            prev = cur;
            cur = b.next;
        }
        if seen != self.free_len || prev != self.tail {
            return Err(format!("free queue length {seen} != {}", self.free_len));
        }
        let unreferenced = self.blocks.iter().filter(|b| b.ref_count == 0).count();
        if unreferenced != self.free_len {
            return Err(format!("{unreferenced} unreferenced blocks but {} free", self.free_len));
        }
        for (h, (id, _)) in &self.cached {
            if self.blocks[*id as usize].hash != Some(*h) {
                return Err(format!("cached hash {h:?} points at block {id} without it"));
            }
        }
        Ok(())
    }
}
