//! Paged KV bookkeeping: the block pool with its prefix cache ([`pool`]), the tiers under it ([`tiers`]: host
//! DRAM, SSD, read-ahead, load-vs-recompute, write-back), and per-sequence block tables that give their blocks back
//! when dropped, so every path that ends a sequence (finish, abort, preempt, error) frees them. What reports say
//! of the pool is `crate::report`.
//!
//! [`KvManager`] is the scheduler's front door: [`KvManager::claim`] walks a prompt's blocks from the first
//! through the device pool (referencing the hits), then hands the rest of the walk to the tiers; [`KvManager::commit`]
//! registers completed blocks. A sequence that computed content another request cached first moves onto the
//! cached block (`pool::Registered::Duplicate`), so its later blocks always chain to blocks it holds.

pub mod pool;
pub mod tiers;

use std::sync::{Arc, Mutex, MutexGuard};

use kvgate_shared::hashing::{BlockHash, BlockHasher};
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use pool::{BlockId, BlockKey, BlockPool, Evicted, Parent, PoolCounters, Registered};
pub use tiers::disk::{self, DiskCounters, DiskTier, Want};
pub use tiers::host::{self, HostCounters, HostInsert, HostTier, Stored, TierIndex};
pub use tiers::{costs, read_ahead, segment};
pub use tiers::{
    Clock, Decisions, LoadCosts, LoadPlan, LoadPolicy, Loaded, PendingLoad, ReadAhead, ReadWait, SharedHost,
    Source, Tiers,
};

/// Seed of the chain check (any constant other than the block hash's).
const CHECK_SEED: u64 = 0x6b76_6761_7465_2d63;

/// The chain check of a block: an independent 64-bit digest of the whole prefix (`prev`: the previous block's
/// check, or the request's `BlockHasher::root_id` for a first block). The lower tiers serve a block only if its
/// chained hash **and** this check match, so a wrong block needs two independent 64-bit collisions.
pub fn chain_check(prev: u64, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(8 + tokens.len() * 4);
    bytes.extend_from_slice(&prev.to_le_bytes());
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    xxh3_64_with_seed(&bytes, CHECK_SEED)
}

/// Chain checks of `tokens`' first `n_blocks` full blocks, after `checks` already computed.
fn extend_checks(root: u64, checks: &mut Vec<u64>, tokens: &[u32], block_size: usize, n_blocks: usize) {
    while checks.len() < n_blocks {
        let i = checks.len();
        let prev = checks.last().copied().unwrap_or(root);
        checks.push(chain_check(prev, &tokens[i * block_size..(i + 1) * block_size]));
    }
}

/// When blocks are copied down to the host tier (`--kv-write-policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WritePolicy {
    /// Only when the pool evicts it (the default: a block that is reused before it is evicted is never written).
    #[default]
    WriteBack,
    /// Every completed block at once (more bytes written; the tier holds everything, kept for comparison).
    WriteThrough,
}

impl WritePolicy {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "write-back" => Ok(WritePolicy::WriteBack),
            "write-through" => Ok(WritePolicy::WriteThrough),
            o => Err(format!("kv-write-policy {o}: expected write-back or write-through")),
        }
    }
}

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
    /// Their chain checks ([`chain_check`]), as far as computed.
    checks: Vec<u64>,
    /// Leading blocks already registered in (or served from) the prefix cache.
    committed: usize,
    /// Cache identities of the leading blocks whose chain is in the cache (the parent of the next block). Shorter
    /// than `committed` only after a hash collision: later blocks are then never cached.
    chain: Vec<u64>,
    /// Prompt tokens served from the cache when the sequence started.
    cached_tokens: usize,
    host_tokens: usize,
    disk_tokens: usize,
}

impl BlockTable {
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }
    /// Positions the table can hold.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * self.block_size
    }
    /// Prompt tokens whose KV came from the prefix cache (device pool or host tier).
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }
    /// Of those, the tokens promoted from a lower tier (host DRAM or SSD).
    pub fn lower_tier_tokens(&self) -> usize {
        self.host_tokens
    }
    /// Of those, the tokens read from the SSD tier.
    pub fn disk_tokens(&self) -> usize {
        self.disk_tokens
    }
    /// Pool slot of a position (`block * block_size + offset`).
    pub fn slot(&self, pos: usize) -> usize {
        self.blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }
    /// Tokens of the leading blocks whose chain is in the prefix cache (what a later request can find).
    pub fn chained_tokens(&self) -> usize {
        self.chain.len() * self.block_size
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

/// A prompt as the walk sees it: its blocks' chained hashes and chain checks, computed once.
#[derive(Debug)]
pub struct Prompt<'a> {
    pub root: u64,
    pub tokens: &'a [u32],
    pub hashes: Vec<BlockHash>,
    pub checks: Vec<u64>,
    /// Blocks that may be served from a cache (at least one token is always left to compute).
    pub max_hit: usize,
    pub bs: usize,
}

impl<'a> Prompt<'a> {
    /// `with_checks`: compute the chain checks (the lower tiers and the table need them; the pool does not).
    pub fn new(hasher: &BlockHasher, tokens: &'a [u32], bs: usize, with_checks: bool) -> Self {
        let hashes = hasher.hash_blocks(tokens);
        let mut checks = Vec::new();
        if with_checks {
            extend_checks(hasher.root_id(), &mut checks, tokens, bs, hashes.len());
        }
        Self {
            root: hasher.root_id(),
            tokens,
            hashes,
            checks,
            max_hit: tokens.len().saturating_sub(1) / bs,
            bs,
        }
    }

    pub fn block(&self, i: usize) -> &'a [u32] {
        &self.tokens[i * self.bs..(i + 1) * self.bs]
    }

    /// Block `i` as a read the SSD tier can serve.
    pub fn want(&self, i: usize) -> Want {
        Want { hash: self.hashes[i], check: self.checks[i], index: i as u32, tokens: self.block(i).into() }
    }

    /// The parent of block `i` given the chain identities of the blocks before it.
    fn parent(&self, chain: &[u64]) -> Parent {
        chain.last().map_or(Parent::Root(self.root), |u| Parent::Block(*u))
    }
}

/// What [`KvManager::claim`] gives admission.
#[derive(Debug)]
pub enum Claim {
    /// The sequence's table, holding its cached prefix.
    Table(BlockTable),
    /// SSD blocks to read first (nothing held): ask for them ([`KvManager::request_reads`]) and claim again.
    Read(ReadWait),
}

/// Front door of the KV bookkeeping for the scheduler: the pool and the tiers under it.
#[derive(Clone, Debug)]
pub struct KvManager {
    pool: SharedPool,
    block_size: usize,
    tiers: Tiers,
}

impl KvManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            pool: SharedPool::new(BlockPool::new(num_blocks, block_size)),
            block_size,
            tiers: Tiers::default(),
        }
    }

    /// Adds a host tier under the pool (the pool then records its evictions for the tiers to copy down).
    pub fn with_host(mut self, host: HostTier) -> Self {
        self.set_host(host, WritePolicy::WriteBack);
        self
    }

    /// [`Self::with_host`] in place, with a write policy.
    pub fn set_host(&mut self, host: HostTier, policy: WritePolicy) {
        let mut pool = self.pool.lock();
        pool.set_record_evictions(true);
        pool.set_record_registrations(policy == WritePolicy::WriteThrough);
        drop(pool);
        self.tiers.set_host(host);
    }

    /// Adds the SSD tier under the host tier (or, without one, under the pool), with a write policy.
    pub fn set_disk(&mut self, disk: DiskTier, policy: WritePolicy) {
        let mut pool = self.pool.lock();
        pool.set_record_evictions(true);
        if policy == WritePolicy::WriteThrough {
            pool.set_record_registrations(true);
        }
        drop(pool);
        self.tiers.set_disk(disk);
    }

    pub fn tiers(&self) -> &Tiers {
        &self.tiers
    }

    pub fn disk(&self) -> Option<&DiskTier> {
        self.tiers.disk()
    }

    pub fn host(&self) -> Option<&SharedHost> {
        self.tiers.host()
    }

    /// Turns the SSD read-ahead of queued requests on or off (benchmarks of the path without it).
    pub fn set_read_ahead(&self, on: bool) {
        self.tiers.set_read_ahead(on);
    }

    /// Sets what load-vs-recompute weighs (`costs.rs`).
    pub fn set_costs(&self, costs: LoadCosts) {
        self.tiers.set_costs(costs);
    }

    /// What load-vs-recompute weighs now.
    pub fn costs(&self) -> LoadCosts {
        self.tiers.costs()
    }

    /// Folds a timed copy of `bytes` from host memory into the device pool into the host tier's speed.
    pub fn observe_host_load(&self, bytes: usize, secs: f64) {
        self.tiers.observe_host_load(bytes, secs);
    }

    /// The load-vs-recompute choices so far.
    pub fn decisions(&self) -> &Decisions {
        self.tiers.decisions()
    }

    pub fn pool(&self) -> &SharedPool {
        &self.pool
    }

    /// The promotions queued since the last call that are still wanted, and the longest SSD wait among them.
    pub fn take_loads(&self) -> (Vec<PendingLoad>, f64) {
        self.tiers.take_loads(&self.pool.lock())
    }

    /// Copies blocks down to the tiers ([`Tiers::write_back`]); `read` reads their bytes off the device.
    pub fn write_back(&self, blocks: Vec<Evicted>, through: bool, read: &mut tiers::ReadBlocks<'_>) {
        self.tiers.write_back(&self.pool, blocks, through, read);
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks needed to hold `n` positions.
    pub fn blocks_for(&self, n: usize) -> usize {
        n.div_ceil(self.block_size)
    }

    /// The device pool's part of the walk, read-only: how many leading blocks it holds, chain-verified.
    fn device_run(&self, pool: &BlockPool, p: &Prompt<'_>) -> usize {
        let mut parent = Parent::Root(p.root);
        let mut n = 0;
        while n < p.max_hit {
            match pool.probe(p.hashes[n], parent, p.block(n)) {
                Some(uid) => parent = Parent::Block(uid),
                None => break,
            }
            n += 1;
        }
        n
    }

    /// Admission: a table holding the longest cached prefix of `tokens` (whole blocks, token-verified) that the
    /// device pool holds and the tiers would load, or [`Claim::Read`] when SSD blocks must be read first
    /// (never when `give_up`: what is not in memory is then computed again).
    pub fn claim(&self, hasher: BlockHasher, tokens: &[u32], at: &Clock, give_up: bool) -> Claim {
        let p = Prompt::new(&hasher, tokens, self.block_size, true);
        let mut pool = self.pool.lock();
        let device = self.device_run(&pool, &p);
        let plan = match self.tiers.plan(&pool, &p, device, at, give_up) {
            Ok(plan) => plan,
            Err(w) => return Claim::Read(w),
        };
        // The device hits, referenced (and counted: the walk stops at a lookup that misses, as `device_run` did).
        let mut blocks = Vec::new();
        let mut chain = Vec::new();
        for i in 0..p.max_hit {
            match pool.lookup(p.hashes[i], p.parent(&chain), p.block(i)) {
                Some((id, uid)) => {
                    blocks.push(id);
                    chain.push(uid);
                }
                None => break,
            }
        }
        debug_assert_eq!(blocks.len(), device);
        let loaded = self.tiers.load(&mut pool, &p, (blocks.len(), p.parent(&chain)), plan, at);
        let (lower, disk_blocks) = (loaded.blocks.len(), loaded.disk_blocks);
        blocks.extend(loaded.blocks);
        chain.extend(loaded.chain);
        drop(pool);
        let bs = self.block_size;
        let n = blocks.len();
        let Prompt { hashes, checks, .. } = p;
        Claim::Table(BlockTable {
            pool: self.pool.clone(),
            block_size: bs,
            hasher,
            blocks,
            hashes,
            checks,
            committed: n,
            chain,
            cached_tokens: n * bs,
            host_tokens: lower * bs,
            disk_tokens: disk_blocks * bs,
        })
    }

    /// [`Self::claim`] that never waits for a read (tests, and a sequence that cannot wait).
    pub fn start(&self, hasher: BlockHasher, tokens: &[u32]) -> BlockTable {
        self.start_at(hasher, tokens, &Clock::default())
    }

    /// [`Self::claim`] for a sequence that cannot be passed over (a decode worker starting an import): SSD blocks
    /// not in memory are asked for and waited for here, holding no lock, until the read's deadline at most; what
    /// has not arrived by then is left to compute (or to import).
    pub fn claim_waiting(&self, hasher: BlockHasher, tokens: &[u32], at: &Clock) -> BlockTable {
        let w = match self.claim(hasher, tokens, at, false) {
            Claim::Table(t) => return t,
            Claim::Read(w) => w,
        };
        if !self.request_reads(&w) {
            let left = std::time::Duration::from_secs_f64((w.until - at.now).clamp(0.0, 60.0));
            self.wait_reads(&w, left);
        }
        self.start_at(hasher, tokens, at)
    }

    /// [`Self::claim`] that never waits: what is not in memory is computed again.
    pub fn start_at(&self, hasher: BlockHasher, tokens: &[u32], at: &Clock) -> BlockTable {
        match self.claim(hasher, tokens, at, true) {
            Claim::Table(t) => t,
            Claim::Read(_) => unreachable!("a claim that gives up never asks for reads"),
        }
    }

    /// Asks the SSD tier for what a claim waits for; true when it is all in memory now.
    pub fn request_reads(&self, w: &ReadWait) -> bool {
        self.tiers.request_reads(w)
    }

    /// Waits, holding no lock, until a claim's reads are done or `timeout` passes.
    pub fn wait_reads(&self, w: &ReadWait, timeout: std::time::Duration) {
        self.tiers.wait_reads(w, timeout);
    }

    /// A request added now: the prompt tokens it would find cached (the same walk as a claim, read-only: nothing
    /// referenced, no counters; a lower-tier hit counts only where it would be loaded), and when (engine clock) the
    /// part only the SSD tier holds and would be loaded, asked of it now ([`Tiers::prefetch`]), will be in memory
    /// (0: nothing read). The prompt is hashed once for both; its chain checks only when there are tiers.
    pub fn arrive(&self, hasher: &BlockHasher, tokens: &[u32], at: &Clock) -> (usize, f64) {
        let p = Prompt::new(hasher, tokens, self.block_size, !self.tiers.is_empty());
        let device = self.device_run(&self.pool.lock(), &p);
        let cached = (device + self.tiers.probe(device, &p, at)) * self.block_size;
        (cached, self.tiers.prefetch(device, &p, at))
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
        extend_checks(table.hasher.root_id(), &mut table.checks, tokens, self.block_size, full);
        let mut pool = self.pool.lock();
        for i in table.committed..full {
            if table.chain.len() != i {
                break; // a collision broke the chain: nothing after it is cached
            }
            let parent =
                table.chain.last().map_or(Parent::Root(table.hasher.root_id()), |u| Parent::Block(*u));
            let block_tokens = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let key = BlockKey {
                hash: table.hashes[i],
                check: table.checks[i],
                parent_hash: i.checked_sub(1).map(|j| table.hashes[j]),
            };
            match pool.register(table.blocks[i], i, key, parent, block_tokens) {
                Some(Registered::New(uid)) => table.chain.push(uid),
                Some(Registered::Duplicate { block, uid }) => {
                    // Another request cached this content first: hold its block and free ours, so the blocks
                    // after this one chain to a block this sequence holds (never to one evicted under it).
                    pool.share(block);
                    let own = std::mem::replace(&mut table.blocks[i], block);
                    pool.release(&[own]);
                    table.chain.push(uid);
                }
                None => {}
            }
        }
        table.committed = full;
    }
}

#[cfg(test)]
mod tests;
