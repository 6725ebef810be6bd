//! The KV tiers under the device pool, owned by one [`Tiers`]: host DRAM ([`host`]), SSD ([`disk`], its files
//! [`segment`]), the SSD read channel's schedule ([`read_ahead`]) and load-vs-recompute ([`costs`]). The engine
//! only moves bytes (`Backend::read_kv_blocks` / `write_kv_blocks`) and passes the time in ([`Clock`]).
//!
//! # One walk, three uses
//! A prompt's blocks are looked up from the first: the device pool (chain-verified, `pool.rs`), then host DRAM,
//! then SSD, stopping at the first block no tier holds ([`Tiers::lower_run`] for the part under the pool). Then
//! load-vs-recompute ([`costs::LoadCosts::choose`]) decides how much of the lower run to load. The same walk and
//! choice serve:
//! - **probe** ([`Tiers::probe`]): the tokens a request added now would find cached (load reports, queue
//!   estimates); read-only, nothing counted;
//! - **prefetch** ([`Tiers::prefetch`]): asks the SSD tier's IO thread to read ahead what only it holds and would
//!   be loaded, while the request queues; returns when it will be in memory (engine clock);
//! - **claim** ([`Tiers::plan`], then [`Tiers::load`] once the device hits are referenced): admission; references the device hits, allocates device blocks for the lower
//!   run, queues their bytes as [`PendingLoad`]s for the engine to write before the next forward. An SSD block
//!   not in memory yet is never read here: the claim answers [`Claimed::Read`] (nothing held) with the blocks to
//!   read, the caller asks for them ([`Tiers::request_reads`], a read-ahead) and comes back; after the read's
//!   deadline, or when it cannot wait (`give_up`), what is not in memory is computed again.
//!
//! # Write-back
//! One entry point, [`Tiers::write_back`]: blocks the pool evicted (or, write-through, just completed) while their
//! device memory still holds their K/V go to the host tier, or to the SSD tier without one; what the host tier lets
//! go for room goes on to the SSD tier (queued for its IO thread, never waited for). Parents before children.
//!
//! # Invariants
//! - A lower tier never holds a block whose parent it lacks unless a higher tier (or the device pool) has it: the
//!   host tier refuses such a block and drops its descendants (`TierIndex::insert`); the SSD tier is told whether
//!   the parent is above as the block is queued.
//! - Nothing here blocks on the disk while the pool or host lock is held: SSD reads run on the tier's IO thread
//!   (or, for the deterministic simulator's inline tier, on the caller's thread from [`Tiers::request_reads`],
//!   with no lock held); a claim takes only bytes already in memory.
//! - Lock order: pool -> host -> the SSD index -> the SSD read-ahead buffer. The IO thread takes the segment
//!   files' lock, then the index, never the pool or host lock.
//! - No clocks: the engine's time, the work queued ahead and the running count come in as a [`Clock`].

pub mod costs;
pub mod disk;
#[cfg(test)]
mod disk_tests;
pub mod host;
pub mod read_ahead;
pub mod segment;
mod write_back;

pub use write_back::ReadBlocks;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kvgate_shared::hashing::BlockHash;

use super::pool::{BlockId, BlockKey, BlockPool, Parent, Registered};
use super::Prompt;
pub use costs::{LoadCosts, LoadPolicy, Source};
pub use disk::{DiskCounters, DiskTier, Want};
pub use host::{HostCounters, HostInsert, HostTier, Stored, TierIndex};
pub use read_ahead::ReadAhead;

/// The shortest time a claim waits for an SSD read it asked for before computing the blocks instead (the rest
/// of the deadline is twice what the read channel's schedule expects the read to take).
pub const MIN_READ_WAIT_S: f64 = 0.05;

/// What the engine knows of time when it asks: its clock, the work queued ahead of a request being added
/// (seconds; a read ahead overlaps it) and the requests running (a read not done at admission stalls them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Clock {
    pub now: f64,
    pub ahead_s: f64,
    pub running: usize,
}

/// A lower-tier block promoted into the device pool, to be written before the next forward.
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

/// SSD blocks a claim needs in memory first, and until when (engine clock) it waits for them.
#[derive(Clone, Debug)]
pub struct ReadWait {
    pub wants: Vec<Want>,
    pub until: f64,
}

/// What [`Tiers::plan`] decided: where each block of the lower-tier run is, and how many of it to load.
#[derive(Clone, Debug, Default)]
pub struct LoadPlan {
    pub run: Vec<Source>,
    pub load: usize,
}

/// What [`Tiers::load`] did: device blocks allocated and registered for the loaded run (in order), the chain
/// identity of each (their bytes are queued as [`PendingLoad`]s), and how many came from the SSD.
#[derive(Debug, Default)]
pub struct Loaded {
    pub blocks: Vec<BlockId>,
    pub chain: Vec<u64>,
    pub disk_blocks: usize,
}

/// How a wait from the read channel's schedule is weighed ([`costs`]' formula).
#[derive(Clone, Copy, Debug)]
enum Weigh {
    /// A request being added: the read overlaps the work queued ahead of it.
    Queued,
    /// A request being admitted: a read not done yet stalls every running request.
    Admitted,
}

/// The tiers under the pool (none configured: every walk stops at the pool).
#[derive(Clone, Debug)]
pub struct Tiers {
    host: Option<SharedHost>,
    disk: Option<DiskTier>,
    costs: Arc<Mutex<LoadCosts>>,
    decisions: Arc<Decisions>,
    /// The SSD read channel's schedule in time (what the choice weighs; a simulated step pays it).
    schedule: Arc<Mutex<ReadAhead>>,
    /// The longest SSD wait of the loads queued since the engine last took them.
    load_wait: Arc<Mutex<f64>>,
    loads: Arc<Mutex<Vec<PendingLoad>>>,
    /// Whether queued requests' SSD blocks are read ahead (on; off to measure the path without it).
    read_ahead: Arc<AtomicBool>,
}

impl Default for Tiers {
    fn default() -> Self {
        Self {
            host: None,
            disk: None,
            costs: Arc::default(),
            decisions: Arc::default(),
            schedule: Arc::default(),
            load_wait: Arc::default(),
            loads: Arc::default(),
            read_ahead: Arc::new(AtomicBool::new(true)),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Tiers {
    pub fn is_empty(&self) -> bool {
        self.host.is_none() && self.disk.is_none()
    }

    pub fn host(&self) -> Option<&SharedHost> {
        self.host.as_ref()
    }

    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
    }

    /// Adds the host tier (it spills to the SSD tier when there is one).
    pub fn set_host(&mut self, mut host: HostTier) {
        host.set_spill(self.disk.is_some());
        self.host = Some(SharedHost(Arc::new(Mutex::new(host))));
    }

    /// Adds the SSD tier under the host tier (or under the pool without one).
    pub fn set_disk(&mut self, disk: DiskTier) {
        if let Some(h) = &self.host {
            h.lock().set_spill(true);
        }
        self.disk = Some(disk);
    }

    /// Turns the SSD read-ahead of queued requests on or off.
    pub fn set_read_ahead(&self, on: bool) {
        self.read_ahead.store(on, Ordering::Relaxed);
    }

    pub fn set_costs(&self, costs: LoadCosts) {
        *lock(&self.costs) = costs;
    }

    /// What load-vs-recompute weighs now: the set costs, with the SSD tier's measured read speed once it has one.
    pub fn costs(&self) -> LoadCosts {
        let mut c = *lock(&self.costs);
        if let Some(s) = self.disk.as_ref().and_then(DiskTier::read_s_per_byte) {
            c.disk_s_per_byte = s;
        }
        c
    }

    /// Folds a timed copy of `bytes` from host memory into the device pool into the host tier's speed.
    pub fn observe_host_load(&self, bytes: usize, secs: f64) {
        let mut c = lock(&self.costs);
        c.host_s_per_byte = costs::observe(c.host_s_per_byte, bytes, secs);
    }

    pub fn decisions(&self) -> &Decisions {
        &self.decisions
    }

    /// The loads queued since the last call that are still wanted (their device block not evicted since), and
    /// the longest SSD wait among them (a simulated step pays it).
    pub fn take_loads(&self, pool: &BlockPool) -> (Vec<PendingLoad>, f64) {
        let loads = std::mem::take(&mut *lock(&self.loads));
        let wait = std::mem::take(&mut *lock(&self.load_wait));
        (loads.into_iter().filter(|l| pool.uid(l.id) == l.uid).collect(), wait)
    }

    /// Where block `i` of the prompt is below the pool: host DRAM first, then SSD.
    fn source(&self, host: Option<&HostTier>, p: &Prompt<'_>, i: usize) -> Option<Source> {
        let (hash, check, tokens) = (p.hashes[i], p.checks[i], p.block(i));
        if host.is_some_and(|h| h.holds(hash, check, i as u32, tokens)) {
            Some(Source::Host)
        } else if self.disk.as_ref().is_some_and(|d| d.holds(hash, check, i as u32, tokens)) {
            Some(Source::Disk)
        } else {
            None
        }
    }

    /// The walk under the pool: where each block from `from` is, up to the first that no lower tier holds (the
    /// last block of a prompt is never a hit).
    fn lower_run(&self, host: Option<&HostTier>, p: &Prompt<'_>, from: usize) -> Vec<Source> {
        (from..p.max_hit).map_while(|i| self.source(host, p, i)).collect()
    }

    /// Seconds until each block of a lower-tier run is in memory: SSD blocks by the read channel's schedule, 0
    /// for host blocks (their copy is costed by `LoadCosts`).
    fn waits(
        &self,
        hashes: &[BlockHash],
        sources: &[Source],
        costs: &LoadCosts,
        bs: usize,
        now: f64,
    ) -> Vec<f64> {
        if !sources.contains(&Source::Disk) {
            return vec![0.0; sources.len()];
        }
        let disk: Vec<BlockHash> =
            hashes.iter().zip(sources).filter(|(_, s)| **s == Source::Disk).map(|(h, _)| *h).collect();
        let mut disk_waits = lock(&self.schedule).waits(&disk, now, costs.disk_block_s(bs)).into_iter();
        sources
            .iter()
            .map(|s| if *s == Source::Disk { disk_waits.next().unwrap_or(0.0) } else { 0.0 })
            .collect()
    }

    /// How many blocks of the run `sources` (blocks `from..` of the prompt) load-vs-recompute would load.
    fn choose(&self, p: &Prompt<'_>, from: usize, sources: &[Source], at: &Clock, weigh: Weigh) -> usize {
        if sources.is_empty() {
            return 0;
        }
        let costs = self.costs();
        let mut waits = self.waits(&p.hashes[from..from + sources.len()], sources, &costs, p.bs, at.now);
        match weigh {
            Weigh::Queued => waits.iter_mut().for_each(|w| *w = (*w - at.ahead_s).max(0.0)),
            Weigh::Admitted => waits.iter_mut().for_each(|w| *w *= (1 + at.running) as f64),
        }
        costs.choose(sources, &waits, from, p.bs).load_blocks
    }

    /// Of the prompt's blocks past the `device` the pool holds, how many a request added now would find in a
    /// lower tier and load (what would be computed again is not counted: it is work ahead).
    pub fn probe(&self, device: usize, p: &Prompt<'_>, at: &Clock) -> usize {
        if self.is_empty() {
            return 0;
        }
        let run = {
            let host = self.host.as_ref().map(SharedHost::lock);
            self.lower_run(host.as_deref(), p, device)
        };
        self.choose(p, device, &run, at, Weigh::Queued)
    }

    /// Asks the SSD tier to read ahead the part of the prompt's cached prefix past the `device` blocks and the
    /// host tier's that only it holds and load-vs-recompute would load if read from now. Returns when (engine
    /// clock) the last of it will be in memory; 0 when nothing is read.
    pub fn prefetch(&self, device: usize, p: &Prompt<'_>, at: &Clock) -> f64 {
        let Some(disk) = &self.disk else { return 0.0 };
        if !self.read_ahead.load(Ordering::Relaxed) {
            return 0.0;
        }
        let (start, mut run) = {
            let host = self.host.as_ref().map(SharedHost::lock);
            let lower = self.lower_run(host.as_deref(), p, device);
            let hosted = lower.iter().take_while(|s| **s == Source::Host).count();
            let disk_run = lower[hosted..].iter().take_while(|s| **s == Source::Disk).count();
            (device + hosted, vec![Source::Disk; disk_run.min(disk::MAX_PREFETCH_BLOCKS)])
        };
        // At most what the read-ahead memory holds, and only what would be loaded: reading the rest would delay
        // other requests' reads for nothing.
        let costs = self.costs();
        let cap = self.read_ahead_cap(p.bs);
        run.truncate(cap);
        let n = self.choose(p, start, &run, at, Weigh::Queued);
        if n == 0 {
            return 0.0;
        }
        let hashes = &p.hashes[start..start + n];
        let block_s = costs.disk_block_s(p.bs);
        let ready = {
            let mut schedule = lock(&self.schedule);
            schedule.prefetch(hashes, at.now, block_s, cap);
            schedule.waits(hashes, at.now, block_s).into_iter().fold(0.0, f64::max)
        };
        disk.request((start..start + n).map(|i| p.want(i)).collect());
        at.now + ready
    }

    /// Blocks the read-ahead memory holds ([`disk::MAX_PREFETCH_BYTES`]; [`disk::MAX_PREFETCH_BLOCKS`] when a
    /// block's bytes are unknown).
    fn read_ahead_cap(&self, bs: usize) -> usize {
        let block_bytes = bs as f64 * self.costs().kv_bytes_per_token;
        match block_bytes > 0.0 {
            true => ((disk::MAX_PREFETCH_BYTES as f64 / block_bytes) as usize).max(1),
            false => disk::MAX_PREFETCH_BLOCKS,
        }
    }

    /// Admission's part below the pool, first half (read-only, called with the pool locked): the lower-tier run
    /// after the `device` blocks the pool holds and how much of it is worth loading. An SSD block of that part
    /// that is not in memory makes it answer the reads to wait for, unless `give_up`, when the load stops before
    /// it.
    pub fn plan(
        &self,
        pool: &BlockPool,
        p: &Prompt<'_>,
        device: usize,
        at: &Clock,
        give_up: bool,
    ) -> Result<LoadPlan, ReadWait> {
        if self.is_empty() {
            return Ok(LoadPlan::default());
        }
        let run = {
            let host = self.host.as_ref().map(SharedHost::lock);
            self.lower_run(host.as_deref(), p, device)
        };
        let mut load = self.choose(p, device, &run, at, Weigh::Admitted);
        if let Some(disk) = &self.disk {
            if !disk.is_inline() {
                // What the IO thread reads must fit the read-ahead memory at once: past it, computed again.
                let cap = self.read_ahead_cap(p.bs);
                if let Some((k, _)) = run.iter().enumerate().filter(|(_, s)| **s == Source::Disk).nth(cap) {
                    load = load.min(k);
                }
            }
            let room = load.min(pool.num_free());
            let missing: Vec<usize> = (0..room)
                .filter(|k| run[*k] == Source::Disk && !disk.in_memory(p.hashes[device + k]))
                .collect();
            if let Some(&first) = missing.first() {
                if !give_up {
                    return Err(self.read_wait(p, device, &missing, at));
                }
                load = first;
            }
        }
        Ok(LoadPlan { run, load })
    }

    /// Second half: allocates device blocks for the planned run (as many as the pool has free), registers them
    /// after the device hits (the last with identity `parent`) and queues their bytes as [`PendingLoad`]s.
    pub fn load(
        &self,
        pool: &mut BlockPool,
        p: &Prompt<'_>,
        (device, parent): (usize, Parent),
        plan: LoadPlan,
        at: &Clock,
    ) -> Loaded {
        let LoadPlan { run, load } = plan;
        let mut out = Loaded::default();
        if run.is_empty() {
            return out;
        }
        self.decisions.record(run.len(), load, p.bs);
        let Some(ids) = pool.allocate(load.min(pool.num_free())) else { return out };
        let mut host = self.host.as_ref().map(SharedHost::lock);
        let mut from_disk = Vec::new();
        let mut loads = lock(&self.loads);
        for (k, id) in ids.iter().enumerate() {
            let i = device + k;
            let (hash, check, tokens) = (p.hashes[i], p.checks[i], p.block(i));
            let payload = match run[k] {
                Source::Host => host.as_mut().and_then(|h| h.get(hash, check, i as u32, tokens)),
                Source::Disk => {
                    let taken = self.disk.as_ref().and_then(|d| d.take(hash, check, i as u32, tokens));
                    if taken.is_some() {
                        from_disk.push(hash);
                    }
                    taken
                }
            };
            let Some(payload) = payload else {
                pool.release(&ids[k..]);
                break;
            };
            let parent = out.chain.last().map_or(parent, |u| Parent::Block(*u));
            let key = BlockKey { hash, check, parent_hash: i.checked_sub(1).map(|j| p.hashes[j]) };
            match pool.register(*id, i, key, parent, tokens) {
                Some(Registered::New(uid)) => {
                    loads.push(PendingLoad { id: *id, source: run[k], uid: pool.uid(*id), payload });
                    out.blocks.push(*id);
                    out.chain.push(uid);
                }
                Some(Registered::Duplicate { block, uid }) => {
                    // Cached on the device after all: hold that copy, nothing to load.
                    pool.share(block);
                    pool.release(&[*id]);
                    out.blocks.push(block);
                    out.chain.push(uid);
                }
                None => {
                    // A collision in the pool: stop here, give back what is left.
                    pool.release(&ids[k..]);
                    break;
                }
            }
        }
        drop(loads);
        out.disk_blocks = from_disk.len();
        if !from_disk.is_empty() {
            let block_s = self.costs().disk_block_s(p.bs);
            let wait = lock(&self.schedule).take(&from_disk, at.now, block_s);
            let mut w = lock(&self.load_wait);
            *w = w.max(wait);
        }
        out
    }

    /// The reads a claim waits for (blocks `device + k` for each `k` of `missing`) and its deadline: twice what
    /// the read channel's schedule expects, at least [`MIN_READ_WAIT_S`].
    fn read_wait(&self, p: &Prompt<'_>, device: usize, missing: &[usize], at: &Clock) -> ReadWait {
        let hashes: Vec<BlockHash> = missing.iter().map(|k| p.hashes[device + k]).collect();
        let block_s = self.costs().disk_block_s(p.bs);
        let expected = lock(&self.schedule).waits(&hashes, at.now, block_s).into_iter().fold(0.0, f64::max);
        ReadWait {
            wants: missing.iter().map(|k| p.want(device + k)).collect(),
            until: at.now + (2.0 * expected).max(MIN_READ_WAIT_S),
        }
    }

    /// Asks the SSD tier for the blocks a claim waits for (a read-ahead: never waits, never under a lock of the
    /// pool or host). True when they are all in memory now (the inline tier reads them on this thread).
    pub fn request_reads(&self, w: &ReadWait) -> bool {
        match &self.disk {
            Some(d) => d.request(w.wants.clone()),
            None => true,
        }
    }

    /// Waits (no lock held) until the blocks are in memory or no read of them is under way, at most `timeout`:
    /// for a claim that has nothing else to let run meanwhile.
    pub fn wait_reads(&self, w: &ReadWait, timeout: std::time::Duration) {
        if let Some(d) = &self.disk {
            d.wait_in_memory(&w.wants, timeout);
        }
    }
}
