//! The SSD tier (`--disk-kv-path`, `--disk-kv-bytes`): blocks the host tier lets go (or, without one, the device
//! pool evicts; or, write-through, every completed block), appended to segment files (`segment.rs`) by one IO
//! thread, so the engine never waits on a disk write; read back on a prefix hit.
//!
//! - The index ([`TierIndex`] of [`Location`]s) is rebuilt from the files at start: a restarted worker keeps its
//!   disk tier (a warm restart) and reports it. A torn or corrupt record, or one of another hash scheme or KV layout,
//!   is never served: it is skipped at start, and a block whose bytes fail their checks when read is forgotten.
//! - Writes are staged in a bounded queue ([`MAX_STAGED_BYTES`]); when it is full a block is not written (counted),
//!   never waited for.
//! - Capacity: the index's leaves-first LRU bounds the live blocks; a segment with no live block left is deleted,
//!   and when the files hold more than the capacity plus two segments, the sealed segment with the least live data
//!   is compacted (its live records appended anew, the file deleted).
//! - The rebuild reads headers and token ids only (`segment::scan`), so a restart's memory is the index's, not the
//!   tier's: a worker whose tier is larger than its memory limit restarts like any other.
//! - A write that fails (a full disk) is cut off the segment again (truncated to its last whole record) and the
//!   next write starts a new segment: no torn record is left mid-file and no later offset shifts.
//! - Reads run on the IO thread (a read-ahead, [`DiskTier::request`]) into a bounded buffer the engine takes
//!   bytes from ([`DiskTier::take`]); the engine never reads a file, and never waits on the disk while holding a
//!   lock of the pool or host tier. A request the IO queue cannot take is counted (`dropped_reads`) and asked
//!   again at the next claim; the inline tier (the simulator's) reads on the caller's thread instead.
//! - Compaction copies one record at a time, taking the files' lock only to append it.
//! - The directory is the worker's alone: created 0700, segments 0600 (they hold token ids in clear), and an
//!   exclusive lock on `LOCK` for as long as the tier is open; a second worker on the same directory fails to start,
//!   naming it.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard};

use kvgate_shared::hashing::BlockHash;

use super::host::{HostInsert, Stored, TierIndex};
use super::segment::{scan, Meta, Record, HEADER_BYTES};

/// The lock file that keeps a second worker off the directory.
pub const LOCK_FILE: &str = "LOCK";
/// Longest wait for the directory's lock before opening fails.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Bytes of one segment file before a new one is started.
pub const SEGMENT_BYTES: u64 = 64 << 20;
/// Most bytes waiting for the IO thread.
pub const MAX_STAGED_BYTES: usize = 256 << 20;
/// Most bytes read ahead for queued requests ([`DiskTier::prefetch`]); the oldest go first.
pub const MAX_PREFETCH_BYTES: usize = 1 << 30;
/// Most blocks one prefetch asks for.
pub const MAX_PREFETCH_BLOCKS: usize = 4096;
/// Most blocks asked of the IO thread and not read yet; a request past it is dropped (counted) and asked again.
pub const MAX_PENDING_READS: usize = 65_536;

/// Where a block's record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub segment: u32,
    pub offset: u64,
    pub len: u32,
}

/// Counters since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskCounters {
    pub written_blocks: u64,
    pub written_bytes: u64,
    /// Writes not made because the staging queue was full.
    pub dropped_writes: u64,
    pub read_blocks: u64,
    /// Records skipped at start or blocks forgotten at a read because their bytes failed their checks.
    pub corrupt_blocks: u64,
    /// Blocks found in the files at start.
    pub recovered_blocks: u64,
    /// Blocks read ahead for queued requests, and of those, the ones a request then took.
    pub prefetched_blocks: u64,
    pub prefetch_hits: u64,
    /// Read requests the IO queue could not take (asked again later).
    pub dropped_reads: u64,
}

#[derive(Default)]
struct Counters {
    written_blocks: AtomicU64,
    written_bytes: AtomicU64,
    dropped_writes: AtomicU64,
    read_blocks: AtomicU64,
    corrupt_blocks: AtomicU64,
    recovered_blocks: AtomicU64,
    prefetched_blocks: AtomicU64,
    prefetch_hits: AtomicU64,
    dropped_reads: AtomicU64,
}

/// A block a queued request will want: read it ahead.
#[derive(Clone, Debug)]
pub struct Want {
    pub hash: BlockHash,
    pub check: u64,
    pub index: u32,
    pub tokens: Box<[u32]>,
}

/// Blocks read ahead, oldest first out, and those asked of the IO thread and not read yet.
#[derive(Default)]
struct Ready {
    map: HashMap<BlockHash, Arc<[u8]>>,
    order: std::collections::VecDeque<BlockHash>,
    bytes: usize,
    pending: std::collections::HashSet<BlockHash>,
}

impl Ready {
    fn put(&mut self, hash: BlockHash, payload: Arc<[u8]>) {
        self.bytes += payload.len();
        if self.map.insert(hash, payload).is_none() {
            self.order.push_back(hash);
        }
        while self.bytes > MAX_PREFETCH_BYTES {
            let Some(old) = self.order.pop_front() else { break };
            if let Some(p) = self.map.remove(&old) {
                self.bytes -= p.len();
            }
        }
    }

    fn take(&mut self, hash: BlockHash) -> Option<Arc<[u8]>> {
        let p = self.map.remove(&hash)?;
        self.bytes -= p.len();
        Some(p)
    }
}

/// The segment files.
struct Files {
    dir: PathBuf,
    current: u32,
    file: File,
    len: u64,
    /// Live record bytes and file size per segment.
    live: HashMap<u32, u64>,
    size: HashMap<u32, u64>,
    /// The directory's lock, held while the tier is open.
    _lock: File,
    /// Tests: the next write stops after this many bytes and fails.
    #[cfg(test)]
    fail_after: Option<usize>,
}

fn seg_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("seg-{n:08}.kvd"))
}

/// Opens a segment for appending, readable and writable by this user only.
fn open_segment(dir: &Path, n: u32) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).mode(0o600).open(seg_path(dir, n))
}

impl Files {
    /// Seals the current segment and appends to a new one from now on (nothing changes if it cannot be opened).
    fn start_segment(&mut self) -> std::io::Result<()> {
        let next = open_segment(&self.dir, self.current + 1)?;
        let _ = self.file.sync_all();
        self.current += 1;
        self.file = next;
        self.len = 0;
        self.size.insert(self.current, 0);
        Ok(())
    }

    /// Appends a record; its location. A failed write is cut off the file again (it may have written part of the
    /// record) and, if the segment holds records, the next write goes to a new one.
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<Location> {
        if self.len > 0 && self.len + bytes.len() as u64 > SEGMENT_BYTES {
            self.start_segment()?;
        }
        if let Err(e) = self.write(bytes) {
            let cut = self.file.set_len(self.len);
            tracing::warn!(error = %e, segment = self.current, truncated = cut.is_ok(), "SSD KV tier: a write failed");
            if self.len > 0 || cut.is_err() {
                let _ = self.start_segment();
            }
            return Err(e);
        }
        let at = Location { segment: self.current, offset: self.len, len: bytes.len() as u32 };
        self.len += bytes.len() as u64;
        self.size.insert(self.current, self.len);
        Ok(at)
    }

    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        #[cfg(test)]
        if let Some(n) = self.fail_after.take() {
            // A disk that fills up part-way through this record.
            self.file.write_all(&bytes[..n.min(bytes.len())])?;
            return Err(std::io::Error::new(std::io::ErrorKind::StorageFull, "test: no space left"));
        }
        self.file.write_all(bytes)
    }

    fn dead(&mut self, loc: Location) {
        let live = self.live.entry(loc.segment).or_default();
        *live = live.saturating_sub(u64::from(loc.len));
        if *live == 0 && loc.segment != self.current {
            self.live.remove(&loc.segment);
            self.size.remove(&loc.segment);
            let _ = std::fs::remove_file(seg_path(&self.dir, loc.segment));
        }
    }
}

/// Makes `dir` (0700) if needed and takes its exclusive lock (`LOCK`, 0600): one worker per directory.
fn lock_dir(dir: &Path) -> Result<File, String> {
    let shown = dir.display();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("{shown}: {e}"))?;
    // A directory made by an earlier version (or by hand) is closed to others too; one this user cannot change
    // (another owner) is used as it is, with a warning.
    if let Err(e) = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)) {
        tracing::warn!(dir = %shown, error = %e, "SSD KV tier: cannot make the directory 0700");
    }
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(dir.join(LOCK_FILE))
        .map_err(|e| format!("{shown}/{LOCK_FILE}: {e}"))?;
    // A tier just closed in this process (its IO thread finishing) or a process just gone may still hold it for
    // a moment: wait for it that long, no longer.
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match lock.try_lock() {
            Ok(()) => return Ok(lock),
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(format!(
                    "{shown} is in use by another worker (it holds {LOCK_FILE}): give each worker its own \
                     --disk-kv-path"
                ))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(format!("{shown}/{LOCK_FILE}: cannot lock: {e}"))
            }
        }
    }
}

struct Shared {
    dir: PathBuf,
    index: Mutex<TierIndex<Location>>,
    ready: Mutex<Ready>,
    /// Signalled when a block read ahead arrives (or a read ends without it).
    arrived: std::sync::Condvar,
    /// Tests: request calls left to drop as if the IO queue were full.
    #[cfg(test)]
    drop_requests: AtomicUsize,
    files: Mutex<Files>,
    fingerprint: u64,
    capacity_bytes: u64,
    staged: AtomicUsize,
    counters: Counters,
    /// Moving average of seconds per byte of timed reads (f64 bits; 0: none yet; not kept inline).
    read_s_per_byte: AtomicU64,
    inline: AtomicBool,
}

/// Work for the IO thread.
enum Job {
    /// A block, and whether its parent is in a tier above (device or host) as it is sent.
    Write { block: HostInsert<Arc<[u8]>>, parent_above: bool },
    /// Answer once everything before is written.
    Flush(SyncSender<()>),
    /// Read these blocks ahead.
    Prefetch(Vec<Want>),
}

/// The SSD tier.
#[derive(Clone)]
pub struct DiskTier {
    shared: Arc<Shared>,
    tx: SyncSender<Job>,
    /// Writes on the caller's thread, no read-ahead ([`DiskTier::inline`]): the virtual-time simulator, whose
    /// results must not depend on how fast a thread runs.
    inline: bool,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier").field("counters", &self.counters()).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl DiskTier {
    /// Opens (or creates) the tier in `dir`: rebuilds the index from the segment files written for `fingerprint`
    /// (the hash scheme and KV layout), deletes segments with nothing live, starts the IO thread. `block_bytes`:
    /// one block's K/V bytes.
    pub fn open(
        dir: &Path,
        capacity_bytes: u64,
        block_bytes: usize,
        block_size: usize,
        fingerprint: u64,
    ) -> Result<Self, String> {
        let lock = lock_dir(dir)?;
        let record_bytes = HEADER_BYTES + 4 * block_size + block_bytes;
        let mut index = TierIndex::new(capacity_bytes as usize, record_bytes);
        index.set_spill(true);
        let counters = Counters::default();
        let mut segments: Vec<u32> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_prefix("seg-")?.strip_suffix(".kvd")?.parse().ok()
            })
            .collect();
        segments.sort_unstable();
        // The newest record of each hash wins.
        let mut found: HashMap<BlockHash, (Location, Meta)> = HashMap::new();
        let mut size = HashMap::new();
        for &n in &segments {
            let path = seg_path(dir, n);
            let file = File::open(&path).map_err(|e| format!("segment {n}: {e}"))?;
            let _ = file.set_permissions(std::fs::Permissions::from_mode(0o600));
            let len = file.metadata().map_err(|e| format!("segment {n}: {e}"))?.len();
            let (records, bad) = scan(file, len, fingerprint).map_err(|e| format!("segment {n}: {e}"))?;
            counters.corrupt_blocks.fetch_add(bad, Ordering::Relaxed);
            if bad > 0 {
                tracing::warn!(segment = n, skipped = bad, "SSD KV tier: damaged records skipped");
            }
            size.insert(n, len);
            for (offset, len, r) in records {
                found.insert(r.hash, (Location { segment: n, offset, len: len as u32 }, r));
            }
        }
        let mut records: Vec<(Location, Meta)> = found.into_values().collect();
        records.sort_by_key(|(l, r)| (r.index, l.segment, l.offset));
        for (loc, r) in records {
            let b = HostInsert {
                hash: r.hash,
                check: r.check,
                index: r.index,
                tokens: r.tokens.into(),
                payload: loc,
                parent: r.parent,
            };
            if index.insert(b, false) == Stored::New {
                counters.recovered_blocks.fetch_add(1, Ordering::Relaxed);
            }
        }
        index.take_spilled();
        let mut live: HashMap<u32, u64> = HashMap::new();
        for (_, loc) in index.payloads() {
            *live.entry(loc.segment).or_default() += u64::from(loc.len);
        }
        for &n in &segments {
            if !live.contains_key(&n) {
                let _ = std::fs::remove_file(seg_path(dir, n));
                size.remove(&n);
            }
        }
        let current = segments.last().copied().unwrap_or(0) + 1;
        let file = open_segment(dir, current).map_err(|e| format!("{}: {e}", dir.display()))?;
        size.insert(current, 0);
        let files = Files {
            dir: dir.to_owned(),
            current,
            file,
            len: 0,
            live,
            size,
            _lock: lock,
            #[cfg(test)]
            fail_after: None,
        };
        let shared = Arc::new(Shared {
            dir: dir.to_owned(),
            index: Mutex::new(index),
            ready: Mutex::new(Ready::default()),
            arrived: std::sync::Condvar::new(),
            #[cfg(test)]
            drop_requests: AtomicUsize::new(0),
            files: Mutex::new(files),
            fingerprint,
            capacity_bytes,
            staged: AtomicUsize::new(0),
            counters,
            read_s_per_byte: AtomicU64::new(0),
            inline: AtomicBool::new(false),
        });
        let (tx, rx) = sync_channel(4096);
        let s = shared.clone();
        std::thread::Builder::new()
            .name("kv-disk-io".into())
            .spawn(move || io_loop(s, rx))
            .map_err(|e| format!("SSD KV tier IO thread: {e}"))?;
        let recovered = shared.counters.recovered_blocks.load(Ordering::Relaxed);
        tracing::info!(dir = %dir.display(), recovered, "SSD KV tier open");
        Ok(Self { shared, tx, inline: false })
    }

    /// The same tier writing on the caller's thread, without read-ahead (deterministic; for the simulator).
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self.shared.inline.store(true, Ordering::Relaxed);
        self
    }

    /// Seconds per byte of this tier's reads, a moving average of the timed ones (`None` before the first).
    pub fn read_s_per_byte(&self) -> Option<f64> {
        let v = f64::from_bits(self.shared.read_s_per_byte.load(Ordering::Relaxed));
        (v > 0.0).then_some(v)
    }

    pub fn counters(&self) -> DiskCounters {
        let c = &self.shared.counters;
        DiskCounters {
            written_blocks: c.written_blocks.load(Ordering::Relaxed),
            written_bytes: c.written_bytes.load(Ordering::Relaxed),
            dropped_writes: c.dropped_writes.load(Ordering::Relaxed),
            read_blocks: c.read_blocks.load(Ordering::Relaxed),
            corrupt_blocks: c.corrupt_blocks.load(Ordering::Relaxed),
            recovered_blocks: c.recovered_blocks.load(Ordering::Relaxed),
            prefetched_blocks: c.prefetched_blocks.load(Ordering::Relaxed),
            prefetch_hits: c.prefetch_hits.load(Ordering::Relaxed),
            dropped_reads: c.dropped_reads.load(Ordering::Relaxed),
        }
    }

    /// The index (for lookups, reports and tests).
    pub fn index(&self) -> MutexGuard<'_, TierIndex<Location>> {
        lock(&self.shared.index)
    }

    /// Bytes of every segment file.
    pub fn file_bytes(&self) -> u64 {
        lock(&self.shared.files).size.values().sum()
    }

    /// Queues a block for writing; never waits (a full queue drops it, counted).
    pub fn write(&self, block: HostInsert<Arc<[u8]>>, parent_above: bool) {
        let bytes = block.payload.len() + HEADER_BYTES;
        if self.index().contains(block.hash) {
            return;
        }
        if self.inline {
            write_one(&self.shared, block, parent_above);
            compact_if_needed(&self.shared);
            return;
        }
        if self.shared.staged.fetch_add(bytes, Ordering::AcqRel) + bytes > MAX_STAGED_BYTES
            || self.tx.try_send(Job::Write { block, parent_above }).is_err()
        {
            self.shared.staged.fetch_sub(bytes, Ordering::AcqRel);
            self.shared.counters.dropped_writes.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits until every write queued so far is on disk (tests, and before a planned shutdown).
    pub fn flush(&self) {
        let (done_tx, done_rx) = sync_channel(1);
        if self.tx.send(Job::Flush(done_tx)).is_ok() {
            let _ = done_rx.recv();
        }
    }

    /// Tests: the next record written stops after `bytes` bytes and fails (a disk that fills up mid-write).
    #[cfg(test)]
    pub fn fail_next_write_after(&self, bytes: usize) {
        lock(&self.shared.files).fail_after = Some(bytes);
    }

    /// Whether the tier holds exactly this block (see `TierIndex::holds`).
    pub fn holds(&self, hash: BlockHash, check: u64, index: u32, tokens: &[u32]) -> bool {
        self.index().holds(hash, check, index, tokens)
    }

    /// Asks for these blocks to be read into memory (a queued request's prefix, or a claim waiting for it): the
    /// IO thread reads them ahead; the inline tier reads them now, on this thread. Never waits on the IO queue (a
    /// full one drops the request, counted; the caller asks again). True when they are all in memory now.
    pub fn request(&self, mut wants: Vec<Want>) -> bool {
        if self.inline {
            for w in &wants {
                if lock(&self.shared.ready).map.contains_key(&w.hash) {
                    continue;
                }
                let loc = self.index().peek(w.hash, w.check, w.index, &w.tokens).copied();
                let payload = loc.and_then(|l| read_at(&self.shared, l, w.hash, w.check, w.index, &w.tokens));
                match payload {
                    Some(p) => lock(&self.shared.ready).put(w.hash, p),
                    None => return false,
                }
            }
            return true;
        }
        let mut ready = lock(&self.shared.ready);
        wants.retain(|w| !ready.map.contains_key(&w.hash) && !ready.pending.contains(&w.hash));
        if wants.is_empty() {
            return false;
        }
        #[cfg(test)]
        let refused = self
            .shared
            .drop_requests
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        #[cfg(not(test))]
        let refused = false;
        if refused || ready.pending.len() + wants.len() > MAX_PENDING_READS {
            self.shared.counters.dropped_reads.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        // In jobs of at most MAX_PREFETCH_BLOCKS; what the queue cannot take is asked again next time.
        while !wants.is_empty() {
            let rest = wants.split_off(wants.len().min(MAX_PREFETCH_BLOCKS));
            let hashes: Vec<BlockHash> = wants.iter().map(|w| w.hash).collect();
            if self.tx.try_send(Job::Prefetch(wants)).is_err() {
                self.shared.counters.dropped_reads.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            ready.pending.extend(hashes);
            wants = rest;
        }
        false
    }

    /// Whether reads happen on the caller's thread (the simulator's tier).
    pub fn is_inline(&self) -> bool {
        self.inline
    }

    /// Tests: the next `n` requests are dropped as if the IO queue were full.
    #[cfg(test)]
    pub fn drop_next_requests(&self, n: usize) {
        self.shared.drop_requests.store(n, Ordering::Release);
    }

    /// Whether a block's bytes are in memory (read ahead).
    pub fn in_memory(&self, hash: BlockHash) -> bool {
        lock(&self.shared.ready).map.contains_key(&hash)
    }

    /// Waits until each of `wants` is in memory or no read of it is under way, at most `timeout`. Holds no lock
    /// of the caller's: for a claim with nothing else to let run.
    pub fn wait_in_memory(&self, wants: &[Want], timeout: std::time::Duration) {
        let deadline = std::time::Instant::now() + timeout;
        let mut ready = lock(&self.shared.ready);
        loop {
            let done =
                wants.iter().all(|w| ready.map.contains_key(&w.hash) || !ready.pending.contains(&w.hash));
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if done || left.is_zero() {
                return;
            }
            ready = match self.shared.arrived.wait_timeout(ready, left) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }

    /// Takes a block's bytes read ahead, if it holds exactly this block and they are in memory (never reads).
    pub fn take(&self, hash: BlockHash, check: u64, index: u32, tokens: &[u32]) -> Option<Arc<[u8]>> {
        self.index().get(hash, check, index, tokens)?;
        let p = lock(&self.shared.ready).take(hash)?;
        if !self.inline {
            self.shared.counters.prefetch_hits.fetch_add(1, Ordering::Relaxed);
        }
        self.shared.counters.read_blocks.fetch_add(1, Ordering::Relaxed);
        Some(p)
    }

    /// Reads a block's K/V bytes now, on this thread (taken from what was read ahead when it was); a block whose
    /// record fails its checks is forgotten (with its descendants). Tests and tools: the engine takes bytes read
    /// ahead ([`Self::take`]) instead.
    pub fn read(&self, hash: BlockHash, check: u64, index: u32, tokens: &[u32]) -> Option<Vec<u8>> {
        let loc = self.index().get(hash, check, index, tokens)?;
        if let Some(p) = lock(&self.shared.ready).take(hash) {
            self.shared.counters.prefetch_hits.fetch_add(1, Ordering::Relaxed);
            self.shared.counters.read_blocks.fetch_add(1, Ordering::Relaxed);
            return Some(p.to_vec());
        }
        let payload = read_at(&self.shared, loc, hash, check, index, tokens);
        if payload.is_some() {
            self.shared.counters.read_blocks.fetch_add(1, Ordering::Relaxed);
        }
        payload.map(|p| p.to_vec())
    }
}

/// Reads and checks one record (its payload copied once, out of the read buffer); forgets the block when it
/// fails its checks.
fn read_at(
    s: &Shared,
    loc: Location,
    hash: BlockHash,
    check: u64,
    index: u32,
    tokens: &[u32],
) -> Option<Arc<[u8]>> {
    let started = std::time::Instant::now();
    let result = File::open(seg_path(&s.dir, loc.segment)).and_then(|f| {
        let mut buf = vec![0u8; loc.len as usize];
        f.read_exact_at(&mut buf, loc.offset)?;
        Ok(buf)
    });
    if result.is_ok() && !s.inline.load(Ordering::Relaxed) {
        // Real reads keep load-vs-recompute's SSD speed current (`costs::observe`; a race between two readers
        // loses one sample, no more).
        let avg = f64::from_bits(s.read_s_per_byte.load(Ordering::Relaxed));
        let avg = super::costs::observe(avg, loc.len as usize, started.elapsed().as_secs_f64());
        s.read_s_per_byte.store(avg.to_bits(), Ordering::Relaxed);
    }
    let good = result.ok().and_then(|buf| {
        let (m, payload, _) = Record::verify(&buf, s.fingerprint).ok()?;
        let same = m.hash == hash && m.check == check && m.index == index && m.tokens == tokens;
        same.then(|| Arc::<[u8]>::from(&buf[payload]))
    });
    if good.is_none() {
        tracing::warn!(?hash, segment = loc.segment, "SSD KV tier: a block failed its checks, forgotten");
        s.counters.corrupt_blocks.fetch_add(1, Ordering::Relaxed);
        lock(&s.index).forget(hash);
    }
    good
}

fn prefetch(s: &Shared, wants: Vec<Want>) {
    let mut done = 0;
    for w in &wants {
        if lock(&s.ready).map.contains_key(&w.hash) {
            lock(&s.ready).pending.remove(&w.hash);
            done += 1;
            continue;
        }
        // Where it is now (no use counted: the request has not taken it yet).
        let loc = lock(&s.index).peek(w.hash, w.check, w.index, &w.tokens).copied();
        let Some(loc) = loc else { break }; // the prefix ends here
        let Some(payload) = read_at(s, loc, w.hash, w.check, w.index, &w.tokens) else { break };
        let mut ready = lock(&s.ready);
        ready.pending.remove(&w.hash);
        ready.put(w.hash, payload);
        drop(ready);
        s.arrived.notify_all();
        s.counters.prefetched_blocks.fetch_add(1, Ordering::Relaxed);
        done += 1;
    }
    // What was not read (the prefix ended, a record failed) is no longer under way.
    let mut ready = lock(&s.ready);
    for w in &wants[done..] {
        ready.pending.remove(&w.hash);
    }
    drop(ready);
    s.arrived.notify_all();
}

fn io_loop(s: Arc<Shared>, rx: Receiver<Job>) {
    while let Ok(job) = rx.recv() {
        match job {
            Job::Prefetch(wants) => prefetch(&s, wants),
            Job::Flush(reply) => {
                let _ = lock(&s.files).file.sync_data();
                let _ = reply.send(());
            }
            Job::Write { block, parent_above } => {
                let staged = block.payload.len() + HEADER_BYTES;
                write_one(&s, block, parent_above);
                s.staged.fetch_sub(staged, Ordering::AcqRel);
                compact_if_needed(&s);
            }
        }
    }
}

fn write_one(s: &Shared, b: HostInsert<Arc<[u8]>>, parent_above: bool) {
    let record = Record {
        fingerprint: s.fingerprint,
        hash: b.hash,
        parent: b.parent,
        check: b.check,
        index: b.index,
        tokens: b.tokens.to_vec(),
        payload: b.payload.to_vec(),
    };
    let bytes = record.encode();
    let mut files = lock(&s.files);
    let loc = match files.append(&bytes) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "SSD KV tier: write failed");
            s.counters.dropped_writes.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    s.counters.written_blocks.fetch_add(1, Ordering::Relaxed);
    s.counters.written_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
    let mut index = lock(&s.index);
    let insert = HostInsert {
        hash: b.hash,
        check: b.check,
        index: b.index,
        tokens: b.tokens,
        payload: loc,
        parent: b.parent,
    };
    if index.insert(insert, parent_above) == Stored::New {
        *files.live.entry(loc.segment).or_default() += u64::from(loc.len);
    }
    for gone in index.take_spilled() {
        files.dead(gone.payload);
    }
}

/// Compacts the sealed segment with the least live data when the files exceed the capacity by two segments.
fn compact_if_needed(s: &Shared) {
    let victim = {
        let files = lock(&s.files);
        let total: u64 = files.size.values().sum();
        if total <= s.capacity_bytes + 2 * SEGMENT_BYTES {
            return;
        }
        files
            .size
            .iter()
            .filter(|(n, _)| **n != files.current)
            .min_by(|a, b| {
                let ra = files.live.get(a.0).copied().unwrap_or(0) as f64 / (*a.1).max(1) as f64;
                let rb = files.live.get(b.0).copied().unwrap_or(0) as f64 / (*b.1).max(1) as f64;
                ra.total_cmp(&rb)
            })
            .map(|(n, _)| *n)
    };
    let Some(seg) = victim else { return };
    let moving: Vec<(BlockHash, Location)> =
        lock(&s.index).payloads().filter(|(_, l)| l.segment == seg).map(|(h, l)| (h, *l)).collect();
    let old = seg_path(&s.dir, seg);
    // One record at a time: the files' lock is held only to append it.
    for (hash, loc) in moving {
        let mut buf = vec![0u8; loc.len as usize];
        let ok = File::open(&old).and_then(|f| f.read_exact_at(&mut buf, loc.offset)).is_ok()
            && Record::verify(&buf, s.fingerprint).is_ok();
        if !ok {
            s.counters.corrupt_blocks.fetch_add(1, Ordering::Relaxed);
            lock(&s.index).forget(hash);
            continue;
        }
        let mut files = lock(&s.files);
        let appended = files.append(&buf);
        let mut index = lock(&s.index);
        match appended {
            // Still the block's record (not forgotten or rewritten while it was copied).
            Ok(new) if index.payloads_of(hash) == Some(loc) => {
                index.set_payload(hash, new);
                *files.live.entry(new.segment).or_default() += u64::from(new.len);
            }
            Ok(_) => {}
            Err(_) => index.forget(hash),
        }
    }
    let mut files = lock(&s.files);
    files.live.remove(&seg);
    files.size.remove(&seg);
    let _ = std::fs::remove_file(old);
}
