//! Paged KV bookkeeping: the block pool with its prefix cache ([`pool`]), the host DRAM tier under it ([`host`]),
//! and per-sequence block tables that give their blocks back when dropped, so every path that ends a sequence
//! (finish, abort, preempt, error) frees them. What reports say of the pool is `crate::report`.
//!
//! Tiers: a prefix lookup ([`KvManager::start`]) walks the request's blocks from the first through the device pool,
//! then the host tier; host hits are promoted (device blocks allocated and registered at once, their K/V bytes
//! queued as [`PendingLoad`]s that the engine writes before the next forward). Evictions from the pool are copied
//! down by the engine between scheduling and the forward (write-back), while the evicted memory is intact.

pub mod costs;
pub mod disk;
pub mod host;
pub mod pool;
pub mod read_ahead;
pub mod segment;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kvgate_shared::hashing::{BlockHash, BlockHasher};
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use costs::{LoadCosts, LoadPolicy, Source};
pub use disk::{DiskCounters, DiskTier, Want};
pub use host::{HostCounters, HostInsert, HostTier, Stored, TierIndex};
pub use pool::{BlockId, BlockKey, BlockPool, Evicted, Parent, PoolCounters, Registered};
pub use read_ahead::ReadAhead;

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

/// A host block promoted into the device pool, to be written before the next forward.
#[derive(Clone, Debug)]
pub struct PendingLoad {
    pub id: BlockId,
    /// The tier it comes from.
    pub source: Source,
    /// The block's content identity at promotion: the write is skipped if the block was evicted since.
    pub uid: u64,
    pub payload: Arc<[u8]>,
}

/// The host tier, shared like the pool.
#[derive(Clone, Debug)]
pub struct SharedHost(Arc<Mutex<HostTier>>);

impl SharedHost {
    pub fn lock(&self) -> MutexGuard<'_, HostTier> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
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
    host: Option<SharedHost>,
    disk: Option<DiskTier>,
    loads: Arc<Mutex<Vec<PendingLoad>>>,
    /// What load-vs-recompute weighs, the engine work queued ahead of a new request (seconds, f64 bits; set by the
    /// engine), and what it chose.
    costs: Arc<Mutex<LoadCosts>>,
    ahead: Arc<AtomicU64>,
    /// Requests running (a read not done at admission stalls the step for all of them).
    running: Arc<AtomicUsize>,
    decisions: Arc<Decisions>,
    /// The engine's clock (seconds, f64 bits; set before scheduling), the SSD read channel's schedule, and the
    /// longest SSD wait of the loads queued since the engine last took them.
    now: Arc<AtomicU64>,
    read_ahead: Arc<Mutex<ReadAhead>>,
    load_wait: Arc<Mutex<f64>>,
}

/// Load-vs-recompute choices since start: runs of lower-tier blocks loaded (wholly or partly) or not, and tokens.
#[derive(Debug, Default)]
pub struct Decisions {
    pub loads: AtomicU64,
    pub recomputes: AtomicU64,
    pub loaded_tokens: AtomicU64,
    pub recomputed_tokens: AtomicU64,
}

impl Decisions {
    fn record(&self, run: usize, loaded: usize, block_size: usize) {
        if run == 0 {
            return;
        }
        if loaded > 0 {
            self.loads.fetch_add(1, Ordering::Relaxed);
            self.loaded_tokens.fetch_add((loaded * block_size) as u64, Ordering::Relaxed);
        }
        if loaded < run {
            self.recomputes.fetch_add(1, Ordering::Relaxed);
            self.recomputed_tokens.fetch_add(((run - loaded) * block_size) as u64, Ordering::Relaxed);
        }
    }
}

impl KvManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            pool: SharedPool::new(BlockPool::new(num_blocks, block_size)),
            block_size,
            host: None,
            disk: None,
            loads: Arc::new(Mutex::new(Vec::new())),
            costs: Arc::new(Mutex::new(LoadCosts::default())),
            ahead: Arc::new(AtomicU64::new(0f64.to_bits())),
            running: Arc::new(AtomicUsize::new(0)),
            decisions: Arc::new(Decisions::default()),
            now: Arc::new(AtomicU64::new(0f64.to_bits())),
            read_ahead: Arc::new(Mutex::new(ReadAhead::default())),
            load_wait: Arc::new(Mutex::new(0.0)),
        }
    }

    /// Adds a host tier under the pool (the pool then records its evictions for the engine to copy down).
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
        let mut host = host;
        host.set_spill(self.disk.is_some());
        self.host = Some(SharedHost(Arc::new(Mutex::new(host))));
    }

    /// Adds the SSD tier under the host tier (or, without one, under the pool), with a write policy.
    pub fn set_disk(&mut self, disk: DiskTier, policy: WritePolicy) {
        let mut pool = self.pool.lock();
        pool.set_record_evictions(true);
        if policy == WritePolicy::WriteThrough {
            pool.set_record_registrations(true);
        }
        drop(pool);
        if let Some(h) = &self.host {
            h.lock().set_spill(true);
        }
        self.disk = Some(disk);
    }

    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
    }

    /// Sets what load-vs-recompute weighs (`costs.rs`).
    pub fn set_costs(&self, costs: LoadCosts) {
        *self.costs.lock().unwrap_or_else(|e| e.into_inner()) = costs;
    }

    /// What load-vs-recompute weighs now: the set costs, with the SSD tier's measured read speed once it has one.
    pub fn costs(&self) -> LoadCosts {
        let mut c = *self.costs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = self.disk.as_ref().and_then(DiskTier::read_s_per_byte) {
            c.disk_s_per_byte = s;
        }
        c
    }

    /// Folds a timed copy of `bytes` from host memory into the device pool into the host tier's speed.
    pub fn observe_host_load(&self, bytes: usize, secs: f64) {
        let mut c = self.costs.lock().unwrap_or_else(|e| e.into_inner());
        c.host_s_per_byte = costs::observe(c.host_s_per_byte, bytes, secs);
    }

    /// Records the engine work (seconds) queued ahead of a request being added (the engine, before it adds one).
    pub fn set_ahead_s(&self, s: f64) {
        self.ahead.store(s.to_bits(), Ordering::Relaxed);
    }

    /// Seconds until an SSD read of a request arriving now would have to be done: the read overlaps the engine
    /// work queued ahead of it.
    fn ahead_s(&self) -> f64 {
        f64::from_bits(self.ahead.load(Ordering::Relaxed))
    }

    /// Requests running now (set by the scheduler before each admission).
    pub fn set_running(&self, n: usize) {
        self.running.store(n, Ordering::Relaxed);
    }

    /// The load-vs-recompute choices so far.
    /// The engine's clock now, in seconds (the SSD channel's schedule is kept in it).
    pub fn set_now(&self, now: f64) {
        self.now.store(now.to_bits(), Ordering::Relaxed);
    }

    pub fn now(&self) -> f64 {
        f64::from_bits(self.now.load(Ordering::Relaxed))
    }

    /// The longest wait for SSD reads among the loads queued since the last call (a simulated step pays it).
    pub fn take_load_wait(&self) -> f64 {
        std::mem::take(&mut *self.load_wait.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Seconds until each block of a lower-tier run is in memory: SSD blocks by the read channel's schedule, 0
    /// for host blocks (their copy is costed by `LoadCosts`).
    fn waits(&self, hashes: &[BlockHash], sources: &[Source], costs: &LoadCosts) -> Vec<f64> {
        if !sources.contains(&Source::Disk) {
            return vec![0.0; sources.len()];
        }
        let disk: Vec<BlockHash> =
            hashes.iter().zip(sources).filter(|(_, s)| **s == Source::Disk).map(|(h, _)| *h).collect();
        let ra = self.read_ahead.lock().unwrap_or_else(|e| e.into_inner());
        let mut disk_waits = ra.waits(&disk, self.now(), costs.disk_block_s(self.block_size)).into_iter();
        sources
            .iter()
            .map(|s| if *s == Source::Disk { disk_waits.next().unwrap_or(0.0) } else { 0.0 })
            .collect()
    }

    pub fn decisions(&self) -> &Decisions {
        &self.decisions
    }

    pub fn pool(&self) -> &SharedPool {
        &self.pool
    }

    pub fn host(&self) -> Option<&SharedHost> {
        self.host.as_ref()
    }

    /// The promotions queued since the last call (the engine writes them before the next forward).
    pub fn take_loads(&self) -> Vec<PendingLoad> {
        std::mem::take(&mut *self.loads.lock().unwrap_or_else(|e| e.into_inner()))
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
        let bs = self.block_size;
        let hashes = hasher.hash_blocks(tokens);
        let mut checks = Vec::new();
        extend_checks(hasher.root_id(), &mut checks, tokens, bs, hashes.len());
        let max_hit = tokens.len().saturating_sub(1) / bs;
        let mut blocks = Vec::new();
        let mut chain = Vec::new();
        let mut host_blocks = 0;
        let mut disk_blocks = 0;
        {
            let mut pool = self.pool.lock();
            for (i, h) in hashes.iter().enumerate().take(max_hit) {
                let block_tokens = &tokens[i * bs..(i + 1) * bs];
                let parent = chain.last().map_or(Parent::Root(hasher.root_id()), |u| Parent::Block(*u));
                match pool.lookup(*h, parent, block_tokens) {
                    Some((id, uid)) => {
                        blocks.push(id);
                        chain.push(uid);
                    }
                    None => break,
                }
            }
            if self.host.is_some() || self.disk.is_some() {
                // The prefix continues in host DRAM, then on SSD: promote what the pool has room for.
                let mut host = self.host.as_ref().map(SharedHost::lock);
                let from = blocks.len();
                let source = |i: usize, host: &Option<MutexGuard<'_, HostTier>>| {
                    let t = &tokens[i * bs..(i + 1) * bs];
                    if host.as_ref().is_some_and(|h| h.holds(hashes[i], checks[i], i as u32, t)) {
                        Some(Source::Host)
                    } else if self.disk.as_ref().is_some_and(|d| d.holds(hashes[i], checks[i], i as u32, t)) {
                        Some(Source::Disk)
                    } else {
                        None
                    }
                };
                let sources: Vec<Source> = (from..max_hit).map_while(|i| source(i, &host)).collect();
                // Load what saves time, recompute the rest (costs.rs).
                let costs = self.costs();
                // A read not done yet stalls this step for every running request (one read ahead is not).
                let stall = (1 + self.running.load(Ordering::Relaxed)) as f64;
                let mut waits = self.waits(&hashes[from..from + sources.len()], &sources, &costs);
                waits.iter_mut().for_each(|w| *w *= stall);
                let found = costs.choose(&sources, &waits, from, bs).load_blocks;
                self.decisions.record(sources.len(), found, bs);
                let room = found.min(pool.num_free());
                let ids = pool.allocate(room).unwrap_or_default();
                let mut loads = self.loads.lock().unwrap_or_else(|e| e.into_inner());
                let mut read_now = Vec::new();
                for (k, id) in ids.iter().enumerate() {
                    let i = from + k;
                    let block_tokens = &tokens[i * bs..(i + 1) * bs];
                    let from_host =
                        host.as_mut().and_then(|h| h.get(hashes[i], checks[i], i as u32, block_tokens));
                    let payload = match from_host {
                        Some(p) => Some((p, Source::Host)),
                        None => self
                            .disk
                            .as_ref()
                            .and_then(|d| d.read(hashes[i], checks[i], i as u32, block_tokens))
                            .map(|v| {
                                disk_blocks += 1;
                                read_now.push(hashes[i]);
                                (Arc::<[u8]>::from(v), Source::Disk)
                            }),
                    };
                    let Some((payload, source)) = payload else {
                        pool.release(&ids[k..]);
                        break;
                    };
                    let parent = chain.last().map_or(Parent::Root(hasher.root_id()), |u| Parent::Block(*u));
                    let key = BlockKey {
                        hash: hashes[i],
                        check: checks[i],
                        parent_hash: i.checked_sub(1).map(|j| hashes[j]),
                    };
                    match pool.register(*id, i, key, parent, block_tokens) {
                        Some(Registered::New(uid)) => {
                            loads.push(PendingLoad { id: *id, source, uid: pool.uid(*id), payload });
                            blocks.push(*id);
                            chain.push(uid);
                            host_blocks += 1;
                        }
                        Some(Registered::Duplicate { block, uid }) => {
                            // Cached on the device after all: hold that copy, nothing to load.
                            pool.share(block);
                            pool.release(&[*id]);
                            blocks.push(block);
                            chain.push(uid);
                        }
                        None => {
                            // A collision in the pool: stop here, give back what is left.
                            pool.release(&ids[k..]);
                            break;
                        }
                    }
                }
                if !read_now.is_empty() {
                    let block_s = costs.disk_block_s(bs);
                    let wait = self.read_ahead.lock().unwrap_or_else(|e| e.into_inner()).take(
                        &read_now,
                        self.now(),
                        block_s,
                    );
                    let mut w = self.load_wait.lock().unwrap_or_else(|e| e.into_inner());
                    *w = w.max(wait);
                }
            }
        }
        let n = blocks.len();
        BlockTable {
            pool: self.pool.clone(),
            block_size: bs,
            hasher,
            blocks,
            hashes,
            checks,
            committed: n,
            chain,
            cached_tokens: n * bs,
            host_tokens: host_blocks * bs,
            disk_tokens: disk_blocks * bs,
        }
    }

    /// Prompt tokens `start` would find cached now (the same whole-block, token-verified walk, read-only: nothing
    /// referenced, no counters).
    pub fn cached_prefix_tokens(&self, hasher: &BlockHasher, tokens: &[u32]) -> usize {
        let bs = self.block_size;
        let hashes = hasher.hash_blocks(tokens);
        let max_hit = tokens.len().saturating_sub(1) / bs;
        let pool = self.pool.lock();
        let mut parent = Parent::Root(hasher.root_id());
        let mut n = 0;
        for (i, h) in hashes.iter().enumerate().take(max_hit) {
            match pool.probe(*h, parent, &tokens[i * bs..(i + 1) * bs]) {
                Some(uid) => {
                    parent = Parent::Block(uid);
                    n += 1;
                }
                None => break,
            }
        }
        if self.host.is_some() || self.disk.is_some() {
            // A lower-tier hit is a load, not a prefill: it does not count as work ahead.
            let host = self.host.as_ref().map(SharedHost::lock);
            let mut checks = Vec::new();
            extend_checks(hasher.root_id(), &mut checks, tokens, bs, max_hit);
            let mut sources = Vec::new();
            for i in n..max_hit {
                let t = &tokens[i * bs..(i + 1) * bs];
                if host.as_ref().is_some_and(|h| h.holds(hashes[i], checks[i], i as u32, t)) {
                    sources.push(Source::Host);
                } else if self.disk.as_ref().is_some_and(|d| d.holds(hashes[i], checks[i], i as u32, t)) {
                    sources.push(Source::Disk);
                } else {
                    break;
                }
            }
            // Only what would be loaded is not work ahead (what would be computed again is): the choice `prefetch`
            // makes for a request added now.
            let costs = self.costs();
            let ahead = self.ahead_s();
            let mut waits = self.waits(&hashes[n..n + sources.len()], &sources, &costs);
            waits.iter_mut().for_each(|w| *w = (*w - ahead).max(0.0));
            n += costs.choose(&sources, &waits, n, bs).load_blocks;
        }
        n * bs
    }

    /// Asks the SSD tier to read ahead the part of `tokens`' cached prefix that only it holds (after what the pool
    /// and the host tier hold) and that load-vs-recompute would load if read from now, so the request finds it in
    /// memory when it is admitted. Returns when (engine clock) the last of it will be in memory; 0 when nothing is
    /// read (no SSD tier, nothing there, or computing it again is cheaper).
    pub fn prefetch(&self, hasher: &BlockHasher, tokens: &[u32]) -> f64 {
        let Some(disk) = &self.disk else { return 0.0 };
        let bs = self.block_size;
        let hashes = hasher.hash_blocks(tokens);
        let max_hit = tokens.len().saturating_sub(1) / bs;
        let mut checks = Vec::new();
        extend_checks(hasher.root_id(), &mut checks, tokens, bs, max_hit);
        let mut n = 0;
        {
            let pool = self.pool.lock();
            let mut parent = Parent::Root(hasher.root_id());
            while n < max_hit {
                match pool.probe(hashes[n], parent, &tokens[n * bs..(n + 1) * bs]) {
                    Some(uid) => parent = Parent::Block(uid),
                    None => break,
                }
                n += 1;
            }
        }
        if let Some(host) = &self.host {
            let host = host.lock();
            while n < max_hit && host.holds(hashes[n], checks[n], n as u32, &tokens[n * bs..(n + 1) * bs]) {
                n += 1;
            }
        }
        let mut wants: Vec<Want> = (n..max_hit)
            .map(|i| Want {
                hash: hashes[i],
                check: checks[i],
                index: i as u32,
                tokens: tokens[i * bs..(i + 1) * bs].into(),
            })
            .take_while(|w| disk.holds(w.hash, w.check, w.index, &w.tokens))
            .take(disk::MAX_PREFETCH_BLOCKS)
            .collect();
        if wants.is_empty() {
            return 0.0;
        }
        // At most what the read-ahead memory holds, and only what would be loaded: reading the rest would delay
        // other requests' reads for nothing.
        let costs = self.costs();
        let block_bytes = bs as f64 * costs.kv_bytes_per_token;
        let cap = match block_bytes > 0.0 {
            true => ((disk::MAX_PREFETCH_BYTES as f64 / block_bytes) as usize).max(1),
            false => disk::MAX_PREFETCH_BLOCKS,
        };
        wants.truncate(cap);
        let sources = vec![Source::Disk; wants.len()];
        let run: Vec<BlockHash> = wants.iter().map(|w| w.hash).collect();
        // The read overlaps the work queued ahead of the request: only what is left of it costs.
        let ahead = self.ahead_s();
        let mut waits = self.waits(&run, &sources, &costs);
        waits.iter_mut().for_each(|w| *w = (*w - ahead).max(0.0));
        wants.truncate(costs.choose(&sources, &waits, n, bs).load_blocks);
        if wants.is_empty() {
            return 0.0;
        }
        // The read channel's schedule.
        let hashes: Vec<BlockHash> = wants.iter().map(|w| w.hash).collect();
        let mut ra = self.read_ahead.lock().unwrap_or_else(|e| e.into_inner());
        ra.prefetch(&hashes, self.now(), costs.disk_block_s(bs), cap);
        let ready = ra.waits(&hashes, self.now(), costs.disk_block_s(bs)).into_iter().fold(0.0, f64::max);
        drop(ra);
        disk.prefetch(wants);
        self.now() + ready
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
mod disk_tests;
#[cfg(test)]
mod tests;
