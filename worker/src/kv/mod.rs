//! Paged KV bookkeeping: the block pool with its prefix cache ([`pool`]) and per-sequence block tables that give
//! their blocks back when dropped, so every path that ends a sequence (finish, abort, preempt, error) frees them.
//! What reports say of the pool is `crate::report`.

pub mod pool;

use std::sync::{Arc, Mutex, MutexGuard};

use kvgate_shared::hashing::{BlockHash, BlockHasher};

pub use pool::{BlockId, BlockPool, Parent, PoolCounters};

/// The pool, shared between the engine loop and readers (the reporter lists cached hashes once a second).
#[derive(Clone, Debug)]
pub struct SharedPool(Arc<Mutex<BlockPool>>);

impl SharedPool {
    pub fn new(pool: BlockPool) -> Self {
        Self(Arc::new(Mutex::new(pool)))
    }

    /// Locks the pool. A panic elsewhere while holding the lock cannot corrupt the counts it guards, so a poisoned
    /// lock is taken over rather than propagated.
    pub fn lock(&self) -> MutexGuard<'_, BlockPool> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The blocks of one sequence, in position order. Dropping it releases them.
#[derive(Debug)]
pub struct BlockTable {
    pool: SharedPool,
    block_size: usize,
    hasher: BlockHasher,
    blocks: Vec<BlockId>,
    /// Chained hashes of the sequence's full blocks known so far (may run ahead of `blocks`).
    hashes: Vec<BlockHash>,
    /// Leading blocks already registered in (or served from) the prefix cache.
    committed: usize,
    /// Cache identities of the leading blocks whose chain is in the cache (the parent of the next block). Shorter
    /// than `committed` only after a hash collision: later blocks are then never cached.
    chain: Vec<u64>,
    /// Prompt tokens served from the cache when the sequence started.
    cached_tokens: usize,
}

impl BlockTable {
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }
    /// Positions the table can hold.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * self.block_size
    }
    /// Prompt tokens whose KV came from the prefix cache.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }
    /// Pool slot of a position (`block * block_size + offset`).
    pub fn slot(&self, pos: usize) -> usize {
        self.blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }
    /// Hashes of the full blocks known so far.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        let blocks = std::mem::take(&mut self.blocks);
        self.pool.lock().release(&blocks);
    }
}

/// Front door of the KV bookkeeping for the scheduler.
#[derive(Clone, Debug)]
pub struct KvManager {
    pool: SharedPool,
    block_size: usize,
}

impl KvManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self { pool: SharedPool::new(BlockPool::new(num_blocks, block_size)), block_size }
    }

    pub fn pool(&self) -> &SharedPool {
        &self.pool
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks needed to hold `n` positions.
    pub fn blocks_for(&self, n: usize) -> usize {
        n.div_ceil(self.block_size)
    }

    /// A table for a new (or recomputed) sequence, holding the longest cached prefix of `tokens` (whole blocks,
    /// token-verified). At least one token is always left to compute, so the model produces logits.
    pub fn start(&self, hasher: BlockHasher, tokens: &[u32]) -> BlockTable {
        let hashes = hasher.hash_blocks(tokens);
        let max_hit = tokens.len().saturating_sub(1) / self.block_size;
        let mut blocks = Vec::new();
        let mut chain = Vec::new();
        {
            let mut pool = self.pool.lock();
            for (i, h) in hashes.iter().enumerate().take(max_hit) {
                let block_tokens = &tokens[i * self.block_size..(i + 1) * self.block_size];
                let parent = chain.last().map_or(Parent::Root(hasher.root_id()), |u| Parent::Block(*u));
                match pool.lookup(*h, parent, block_tokens) {
                    Some((id, uid)) => {
                        blocks.push(id);
                        chain.push(uid);
                    }
                    None => break,
                }
            }
        }
        let n = blocks.len();
        BlockTable {
            pool: self.pool.clone(),
            block_size: self.block_size,
            hasher,
            blocks,
            hashes,
            committed: n,
            chain,
            cached_tokens: n * self.block_size,
        }
    }

    /// Prompt tokens `start` would find cached now (the same whole-block, token-verified walk, read-only: nothing
    /// referenced, no counters).
    pub fn cached_prefix_tokens(&self, hasher: &BlockHasher, tokens: &[u32]) -> usize {
        let hashes = hasher.hash_blocks(tokens);
        let max_hit = tokens.len().saturating_sub(1) / self.block_size;
        let pool = self.pool.lock();
        let mut parent = Parent::Root(hasher.root_id());
        let mut n = 0;
        for (i, h) in hashes.iter().enumerate().take(max_hit) {
            match pool.probe(*h, parent, &tokens[i * self.block_size..(i + 1) * self.block_size]) {
                Some(uid) => {
                    parent = Parent::Block(uid);
                    n += 1;
                }
                None => break,
            }
        }
        n * self.block_size
    }

    /// Grows `table` to hold `n_positions`; `false` (and no change) when the pool lacks free blocks.
    pub fn reserve(&self, table: &mut BlockTable, n_positions: usize) -> bool {
        let need = self.blocks_for(n_positions).saturating_sub(table.blocks.len());
        if need == 0 {
            return true;
        }
        match self.pool.lock().allocate(need) {
            Some(new) => {
                table.blocks.extend(new);
                true
            }
            None => false,
        }
    }

    /// Blocks `reserve(table, n_positions)` would take from the pool.
    pub fn blocks_needed(&self, table: &BlockTable, n_positions: usize) -> usize {
        self.blocks_for(n_positions).saturating_sub(table.blocks.len())
    }

    /// Registers in the prefix cache every full block among the first `n_computed` positions of `tokens` (the
    /// sequence's prompt + output so far) whose KV is now written.
    pub fn commit(&self, table: &mut BlockTable, tokens: &[u32], n_computed: usize) {
        let full = (n_computed.min(tokens.len()) / self.block_size).min(table.blocks.len());
        if full <= table.committed {
            return;
        }
        if table.hashes.len() < full {
            let start = table.hashes.len() * self.block_size;
            let hasher = table.hasher;
            hasher.extend_hashes(&mut table.hashes, &tokens[start..full * self.block_size]);
        }
        let mut pool = self.pool.lock();
        for i in table.committed..full {
            if table.chain.len() != i {
                break; // a collision broke the chain: nothing after it is cached
            }
            let parent =
                table.chain.last().map_or(Parent::Root(table.hasher.root_id()), |u| Parent::Block(*u));
            let block_tokens = &tokens[i * self.block_size..(i + 1) * self.block_size];
            if let Some(uid) = pool.register(table.blocks[i], i, table.hashes[i], parent, block_tokens) {
                table.chain.push(uid);
            }
        }
        table.committed = full;
    }
}

#[cfg(test)]
mod tests;
