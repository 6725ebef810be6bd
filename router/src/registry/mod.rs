//! Worker states: static workers from the config and workers that registered by reporting. A worker's latest
//! report (Bloom summary, queue, KV stats, fingerprint, draining) is its state, plus what this gateway did since:
//! requests in flight, tokens sent, the overlay of block hashes it routed there, and the faults it saw.
//!
//! Health (pure functions of `now`): a worker is **in the ring** unless it is draining (its report says so, or an
//! operator drained it), it asked to be left alone (a refusal with Retry-After, until then), it has a fault (a
//! refused connection or a timeout) that no report or successful probe has answered since, or it has been silent
//! for `dead_after`; a static worker that never reported counts as healthy until a fault. Its **summary counts**
//! only if younger than `stale_after` and of the expected hash-scheme fingerprint (a mismatch is logged and
//! counted, never silently used).
//!
//! Identity: a worker id is held by one URL while that worker is alive; another URL claiming it is refused. A
//! report with a new `instance_id` is a restart and is accepted whatever its `seq`. A reported worker silent for
//! `forget_after` is removed, with its metric series. The registry holds at most `max_workers` workers.

pub mod adapters;
pub mod approx;
pub mod event_index;
mod focus;
pub use focus::RootStarts;
pub mod kv_events;
mod metrics;
pub mod pd;
pub mod roots;
mod worker;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvgate_shared::hashing::BlockHash;
use kvgate_shared::report::{CacheSummary, QueueStats, Tier, WorkerReport};

use crate::routing::{Ring, WorkerView};

pub use worker::{
    Fault, Overlay, Scraped, Sessions, SharedLoad, Worker, WorkerCounters, WorkerStatus,
    MAX_SHARED_LOAD_ENTRIES, SHARED_LOAD_TTL,
};

/// Timing and size knobs.
#[derive(Clone, Copy, Debug)]
pub struct RegistryConfig {
    pub stale_after: Duration,
    pub dead_after: Duration,
    pub overlay_ttl: Duration,
    pub vnodes: u32,
    /// A reported worker silent this long is removed.
    pub forget_after: Duration,
    pub max_workers: usize,
    /// Up to this many workers of a model, a decision looks into every worker's cache; past it only into the
    /// focus: the root's holders (`roots.rs`), the first `focus_ring` workers on the request's ring walk, the
    /// `focus_least_loaded` least loaded, and those holding its conversation.
    pub full_scan_workers: usize,
    pub focus_ring: usize,
    pub focus_least_loaded: usize,
    /// Roots remembered (`roots.rs`).
    pub root_capacity: usize,
    /// Roots each report is checked against.
    pub root_discovery_budget: usize,
}

impl Default for RegistryConfig {
    /// The gateway's defaults (3 s, 10 s, 3 s, 64 virtual nodes, 300 s, 4096 workers; a full scan up to 32
    /// workers, else a focus of 8 on the ring and 8 least loaded; 32,768 roots, 1,024 checked a report).
    fn default() -> Self {
        Self {
            stale_after: Duration::from_secs(3),
            dead_after: Duration::from_secs(10),
            overlay_ttl: Duration::from_secs(3),
            vnodes: 64,
            forget_after: Duration::from_secs(300),
            max_workers: 4096,
            full_scan_workers: 32,
            focus_ring: 8,
            focus_least_loaded: 8,
            root_capacity: 32_768,
            root_discovery_budget: 1_024,
        }
    }
}

/// A send another gateway replica made, as the replicas share them (the gateway's `--share-sends`, over Redis):
/// which worker, the prompt's overlay points ([`Overlay::points`]), its uncached tokens and its ring key. A replica
/// that applies it counts the send as load on the worker until the worker's next report (whose queue figures
/// include it) and the points in the worker's overlay; the sender's own completion is not shared, so a request that
/// finishes before that report is counted a little too long, at most one report interval.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SharedSend {
    pub worker: String,
    pub points: Vec<BlockHash>,
    pub uncached_tokens: u64,
    pub session: Option<u64>,
}

impl SharedSend {
    /// Most points one send carries (4,096 points x 8 blocks: 512K tokens at 16 tokens a block); longer prompts
    /// are shared by their first points.
    pub const MAX_POINTS: usize = 4096;
    /// Longest worker id accepted.
    pub const MAX_WORKER_ID: usize = 256;
    /// Largest uncached-token count accepted (more is a corrupt or hostile message).
    pub const MAX_TOKENS: u64 = 1 << 24;

    pub fn new(worker: &str, hashes: &[BlockHash], uncached_tokens: u64, session: Option<u64>) -> Self {
        let mut points = Overlay::points(hashes);
        points.truncate(Self::MAX_POINTS);
        Self { worker: worker.to_owned(), points, uncached_tokens, session }
    }

    /// Whether it is within the limits above (a received message is checked before it is applied).
    pub fn valid(&self) -> bool {
        self.points.len() <= Self::MAX_POINTS
            && !self.worker.is_empty()
            && self.worker.len() <= Self::MAX_WORKER_ID
            && self.uncached_tokens <= Self::MAX_TOKENS
    }
}

/// What [`Registry::record_sent`] returns, for [`Registry::record_done`].
#[derive(Clone, Copy, Debug)]
pub struct SentTicket {
    pub idx: usize,
    pub uid: u64,
    pub epoch: u64,
    pub uncached_tokens: u64,
    /// Their attention area (after the prompt's cached part).
    pub area: u64,
}

/// Where a worker is: its index now and its unique key (an index can shift when workers are forgotten).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerRef {
    pub idx: usize,
    pub uid: u64,
}

/// The outcome of [`Registry::ingest`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ingest {
    Accepted,
    /// Older than the latest report of the same process: ignored.
    OutOfOrder,
    /// The worker id is held by another URL whose worker is alive.
    IdConflict {
        holder_url: String,
    },
    /// The registry holds `max_workers` already.
    Full,
}

/// All workers.
#[derive(Debug)]
pub struct Registry {
    cfg: RegistryConfig,
    workers: Vec<Worker>,
    ring: Ring,
    next_uid: u64,
    /// Workers by uid and by id (rebuilt with the ring, whenever workers come, go or change id).
    by_uid: HashMap<u64, usize>,
    by_id: HashMap<String, usize>,
    roots: roots::RootIndex,
    /// Every LoRA adapter name some worker holds or was loaded with (a superset; `adapters.rs`): a request naming
    /// anything else is answered without a scan.
    adapter_names: std::collections::HashSet<String>,
}

impl Registry {
    pub fn new(cfg: RegistryConfig) -> Self {
        Self {
            cfg,
            workers: Vec::new(),
            ring: Ring::new([], cfg.vnodes),
            next_uid: 1,
            by_uid: HashMap::new(),
            by_id: HashMap::new(),
            roots: roots::RootIndex::new(cfg.root_capacity),
            adapter_names: Default::default(),
        }
    }

    pub fn workers(&self) -> &[Worker] {
        &self.workers
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    fn rebuild_ring(&mut self) {
        self.ring = Ring::new(self.workers.iter().map(|w| w.id.as_str()), self.cfg.vnodes);
        self.by_uid = self.workers.iter().enumerate().map(|(i, w)| (w.uid, i)).collect();
        self.by_id = self.workers.iter().enumerate().map(|(i, w)| (w.id.clone(), i)).collect();
        self.rebuild_adapter_names();
    }

    pub fn config(&self) -> &RegistryConfig {
        &self.cfg
    }

    fn push(&mut self, id: String, url: String, is_static: bool) -> usize {
        let uid = self.next_uid;
        self.next_uid += 1;
        self.workers.push(Worker::new(uid, id, url, is_static));
        self.workers.len() - 1
    }

    /// The worker `r` names, if it still exists.
    fn find_mut(&mut self, r: WorkerRef) -> Option<&mut Worker> {
        match self.workers.get(r.idx) {
            Some(w) if w.uid == r.uid => self.workers.get_mut(r.idx),
            _ => self.workers.iter_mut().find(|w| w.uid == r.uid),
        }
    }

    /// The current index of the worker `r` names, if it still exists.
    pub fn find(&self, r: WorkerRef) -> Option<usize> {
        match self.workers.get(r.idx) {
            Some(w) if w.uid == r.uid => Some(r.idx),
            _ => self.workers.iter().position(|w| w.uid == r.uid),
        }
    }

    /// A reference to worker `idx` (valid as long as the worker exists).
    pub fn worker_ref(&self, idx: usize) -> Option<WorkerRef> {
        self.workers.get(idx).map(|w| WorkerRef { idx, uid: w.uid })
    }

    /// Adds a static worker (id = URL until it tells its id).
    pub fn add_static(&mut self, url: &str) {
        let url = url.trim_end_matches('/').to_owned();
        if self.workers.iter().any(|w| w.url == url) {
            return;
        }
        self.push(url.clone(), url, true);
        self.rebuild_ring();
    }

    /// Learns a worker's id, model and context length (from its tokenizer endpoint).
    pub fn identify(&mut self, url: &str, id: &str, model: &str, max_model_len: u32) {
        let url = url.trim_end_matches('/');
        if let Some(i) = self.workers.iter().position(|w| w.url == url) {
            // Another live entry already holds this id (its reports came first): keep that one.
            if self.workers.iter().enumerate().any(|(j, w)| j != i && w.id == id) {
                return;
            }
            let changed = self.workers[i].id != id;
            self.workers[i].id = id.to_owned();
            self.workers[i].model = Some(model.to_owned());
            if max_model_len > 0 {
                self.workers[i].max_model_len = max_model_len;
            }
            if changed {
                self.rebuild_ring();
            }
        }
    }

    fn alive(&self, w: &Worker, now: Instant) -> bool {
        match w.report_at {
            Some(r) => now.duration_since(r) < self.cfg.dead_after,
            None => w.is_static,
        }
    }

    /// Takes a report. `expected_fingerprint` is the model's fingerprint at this gateway, if its tokenizer is
    /// loaded.
    pub fn ingest(
        &mut self,
        report: WorkerReport,
        expected_fingerprint: Option<u64>,
        now: Instant,
    ) -> Ingest {
        let url = report.advertise_url.trim_end_matches('/').to_owned();
        let by_id = self.workers.iter().position(|w| w.id == report.worker_id);
        let by_url = self.workers.iter().position(|w| w.url == url);
        if let Some(i) = by_id {
            let holder = &self.workers[i];
            if holder.url != url && self.alive(holder, now) && holder.report_at.is_some() {
                return Ingest::IdConflict { holder_url: holder.url.clone() };
            }
        }
        let mut ring_changed = false;
        let i = match (by_id, by_url) {
            (Some(i), Some(j)) if i != j => {
                // The id's old entry is dead (checked above) and this URL has its own entry: keep the URL's.
                self.workers.remove(i);
                ring_changed = true;
                if j > i {
                    j - 1
                } else {
                    j
                }
            }
            (_, Some(j)) => j,
            (Some(i), None) => i,
            (None, None) => {
                if self.workers.len() >= self.cfg.max_workers {
                    return Ingest::Full;
                }
                ring_changed = true;
                self.push(report.worker_id.clone(), url.clone(), false)
            }
        };
        let dead_after = self.cfg.dead_after;
        let w = &mut self.workers[i];
        if let (Some(prev), Some(at)) = (&w.report, w.report_at) {
            let same_process = prev.instance_id == report.instance_id;
            let restarted =
                !same_process || (report.instance_id == 0 && now.duration_since(at) >= dead_after);
            if !restarted && report.seq <= prev.seq {
                return Ingest::OutOfOrder;
            }
            if !same_process {
                tracing::info!(worker = %report.worker_id, "worker restarted (new instance id)");
            }
        }
        if report.draining && !w.reported_draining() {
            tracing::info!(worker = %report.worker_id, "worker reports draining: out of the ring");
        }
        ring_changed |= w.id != report.worker_id;
        w.id = report.worker_id.clone();
        w.url = url;
        w.model = Some(report.model_id.clone());
        if report.max_model_len > 0 {
            w.max_model_len = report.max_model_len;
        }
        w.fingerprint_ok = expected_fingerprint.map(|f| f == report.fingerprint);
        if w.fingerprint_ok == Some(false) {
            tracing::warn!(worker = %w.id, "report fingerprint differs from this gateway's tokenizer: no cache score");
            w.counters.fingerprint_mismatches += 1;
        }
        w.pd.ingest(&report.pd);
        let adapters_changed = w.lora.held != report.lora.held;
        w.lora.set(&report.lora);
        if w.fingerprint_ok == Some(true) {
            let summaries: Vec<&CacheSummary> =
                report.tiers.iter().filter_map(|t| t.summary.as_ref()).collect();
            self.roots.discover(w.uid, &summaries, self.cfg.root_discovery_budget);
        }
        let w = &mut self.workers[i];
        w.device_kv = Worker::device_kv_of(&report);
        w.report = Some(report);
        w.report_at = Some(now);
        w.epoch += 1;
        w.sent_requests_since_report = 0;
        w.sent_tokens_since_report = 0;
        w.sent_area_since_report = 0;
        w.shared_load.clear();
        if ring_changed {
            self.rebuild_ring();
        } else if adapters_changed {
            self.rebuild_adapter_names();
        }
        Ingest::Accepted
    }

    fn healthy(&self, w: &Worker, now: Instant) -> bool {
        self.healthy_aged(w, now, w.report_age(now))
    }

    /// [`Registry::healthy`], the report's age given (`Worker::report_age`: a decision reads it once a worker).
    fn healthy_aged(&self, w: &Worker, now: Instant, age: Option<Duration>) -> bool {
        if w.admin_draining || w.reported_draining() || w.busy_until.is_some_and(|u| now < u) {
            return false;
        }
        if w.open_fault().is_some() {
            return false;
        }
        match age {
            Some(a) => a < self.cfg.dead_after,
            None => w.is_static,
        }
    }

    /// The summary of a worker's `tier`, if its report is fresh and of the expected hash scheme.
    fn summary<'a>(&self, w: &'a Worker, tier: Tier, now: Instant) -> Option<&'a CacheSummary> {
        self.summary_aged(w, tier, w.report_age(now))
    }

    /// [`Registry::summary`], the report's age given.
    fn summary_aged<'a>(&self, w: &'a Worker, tier: Tier, age: Option<Duration>) -> Option<&'a CacheSummary> {
        let fresh = age.is_some_and(|a| a < self.cfg.stale_after);
        if !fresh || w.fingerprint_ok != Some(true) {
            return None;
        }
        w.report.as_ref()?.tier(tier)?.summary.as_ref()
    }

    /// The candidates for a model (workers whose model is unknown yet are candidates too), and for each view the
    /// worker's index in the registry (a decision's `ranked` indexes the views; this maps them back).
    /// `session`: the request's ring key, to say which worker holds its conversation.
    pub fn views(
        &self,
        model: &str,
        hashes: &[BlockHash],
        session: Option<u64>,
        now: Instant,
    ) -> (Vec<WorkerView<'_>>, Vec<usize>) {
        let mut views = Vec::new();
        let mut registry_index = Vec::new();
        for (i, w) in self.workers.iter().enumerate() {
            if w.model.as_deref().is_some_and(|m| m != model) {
                continue;
            }
            views.push(self.view_aged(i, w, hashes, session, now, w.report_age(now)));
            registry_index.push(i);
        }
        (views, registry_index)
    }

    /// The context length of a model: the smallest any of its workers reported (`None`: none known).
    pub fn max_model_len(&self, model: &str) -> Option<u32> {
        self.workers
            .iter()
            .filter(|w| w.model.as_deref() == Some(model) && w.max_model_len > 0)
            .map(|w| w.max_model_len)
            .min()
    }

    /// Records a request sent to worker `i`.
    pub fn record_sent(
        &mut self,
        i: usize,
        hashes: &[BlockHash],
        uncached_tokens: u64,
        now: Instant,
    ) -> SentTicket {
        let ttl = self.cfg.overlay_ttl;
        let w = &mut self.workers[i];
        w.inflight += 1;
        w.sent_requests_since_report += 1;
        w.sent_tokens_since_report += uncached_tokens;
        // The prompt is at least its full blocks; what it holds is computed first (a pod without reports: none).
        let block = w.report.as_ref().map_or(0, |r| u64::from(r.scheme.block_size));
        let prompt = (hashes.len() as u64).saturating_mul(block).max(uncached_tokens);
        let area = kvgate_shared::report::attention_area(prompt - uncached_tokens, uncached_tokens);
        w.sent_area_since_report = w.sent_area_since_report.saturating_add(area);
        w.overlay.insert(hashes, now + ttl, now);
        let t = uncached_tokens as f64;
        w.mean_sent_tokens = if w.mean_sent_tokens == 0.0 { t } else { 0.9 * w.mean_sent_tokens + 0.1 * t };
        SentTicket { idx: i, uid: w.uid, epoch: w.epoch, uncached_tokens, area }
    }

    /// Applies another replica's send ([`SharedSend`]); false if no worker has its id here.
    pub fn record_shared_send(&mut self, s: &SharedSend, now: Instant) -> bool {
        let ttl = self.cfg.overlay_ttl;
        let Some(w) =
            self.by_id.get(&s.worker).and_then(|&i| self.workers.get_mut(i)).filter(|w| w.id == s.worker)
        else {
            return false;
        };
        w.shared_load.add(now, s.uncached_tokens.min(SharedSend::MAX_TOKENS));
        w.overlay.insert_points(&s.points, now + ttl, now);
        self.roots.add_points(&s.points, w.uid);
        if let Some(k) = s.session {
            w.sessions.touch(k, now);
        }
        true
    }

    /// Records that conversation `session` (a ring key) was routed to worker `i`.
    pub fn record_session(&mut self, i: usize, session: u64, now: Instant) {
        if let Some(w) = self.workers.get_mut(i) {
            w.sessions.touch(session, now);
        }
    }

    /// Records that worker `r` served a prompt (it answered with a success, so it computed or found the prompt's
    /// KV): a pod without reports is then believed to hold its blocks ([`approx::ApproxIndex`]). Only then: a
    /// request the pod refused (over its context, a bad parameter) or never answered is not in its cache, and
    /// crediting it at send would push real conversations out of the index. Until the answer, the send's overlay
    /// credits the prefix.
    pub fn record_served(&mut self, r: WorkerRef, hashes: &[BlockHash]) {
        if let Some(a) = self.find_mut(r).and_then(|w| w.approx.as_mut()) {
            a.touch(hashes);
        }
    }

    /// Records the end of a request: it no longer counts as load (if no report has counted it since).
    pub fn record_done(&mut self, t: SentTicket) {
        if let Some(w) = self.find_mut(WorkerRef { idx: t.idx, uid: t.uid }) {
            w.inflight = w.inflight.saturating_sub(1);
            if w.epoch == t.epoch {
                w.sent_requests_since_report = w.sent_requests_since_report.saturating_sub(1);
                w.sent_tokens_since_report = w.sent_tokens_since_report.saturating_sub(t.uncached_tokens);
                w.sent_area_since_report = w.sent_area_since_report.saturating_sub(t.area);
            }
        }
    }

    /// Records a fault: the worker leaves the ring until it reports or answers a probe again.
    pub fn record_fault(&mut self, r: WorkerRef, fault: Fault, now: Instant) {
        if let Some(w) = self.find_mut(r) {
            match fault {
                Fault::Refused => w.counters.connect_failures += 1,
                Fault::Timeout => w.counters.timeouts += 1,
            }
            w.fault = Some((fault, now));
        }
    }

    /// Records a refusal (a 503 refusal code: `queue_full`, `shutting_down`, ...): out of the ring until `until`.
    pub fn record_busy(&mut self, r: WorkerRef, until: Instant) {
        if let Some(w) = self.find_mut(r) {
            w.counters.refusals += 1;
            w.busy_until = Some(w.busy_until.map_or(until, |u| u.max(until)));
        }
    }

    /// Workers with an open fault, to probe: (reference, URL).
    pub fn probe_targets(&self) -> Vec<(WorkerRef, String)> {
        self.workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.open_fault().is_some())
            .map(|(idx, w)| (WorkerRef { idx, uid: w.uid }, w.url.clone()))
            .collect()
    }

    /// Records a probe that found the worker answering: its fault is closed.
    pub fn record_probe_ok(&mut self, r: WorkerRef, now: Instant) {
        if let Some(w) = self.find_mut(r) {
            w.probe_ok_at = Some(now);
        }
    }

    /// Removes reported workers silent for `forget_after` with nothing in flight; returns their ids.
    pub fn sweep(&mut self, now: Instant) -> Vec<String> {
        let forget = self.cfg.forget_after;
        let mut gone = Vec::new();
        self.workers.retain(|w| {
            let stale = !w.is_static && w.report_at.is_some_and(|r| now.duration_since(r) >= forget);
            if stale && w.inflight == 0 {
                gone.push(w.id.clone());
                false
            } else {
                true
            }
        });
        if !gone.is_empty() {
            tracing::info!(workers = ?gone, "forgot silent workers");
            self.rebuild_ring();
        }
        gone
    }

    /// Keeps an approximate index of what this gateway sends the worker at `url` (a pod that sends no reports),
    /// `capacity_blocks` large (`approx.rs`); `false` if no worker has this URL.
    pub fn track_sends(&mut self, url: &str, capacity_blocks: usize) -> bool {
        let url = url.trim_end_matches('/');
        match self.workers.iter_mut().find(|w| w.url == url) {
            Some(w) => {
                w.approx = Some(approx::ApproxIndex::new(capacity_blocks));
                true
            }
            None => false,
        }
    }

    /// Applies a change to the exact set of blocks the worker at `url` holds (from its KV events; `cleared`: drop
    /// everything first, then each `(hash, held)` in order); the set then replaces the approximate index. `false`
    /// if no worker has this URL.
    pub fn apply_exact(&mut self, url: &str, cleared: bool, changes: &[(BlockHash, bool)]) -> bool {
        /// Most blocks one exact set holds (as the event index).
        const MAX_EXACT_BLOCKS: usize = 1 << 22;
        let url = url.trim_end_matches('/');
        let Some(w) = self.workers.iter_mut().find(|w| w.url == url) else { return false };
        let set = w.exact.get_or_insert_with(Default::default);
        if cleared {
            set.clear();
        }
        for (h, held) in changes {
            if !held {
                set.remove(h);
            } else if set.len() < MAX_EXACT_BLOCKS {
                set.insert(*h);
            }
        }
        true
    }

    /// Takes what was scraped from the metrics of the pod at `url` (one that sends no reports). The queue, like a
    /// report's, replaces what this gateway counted as sent since the last one; its waiting requests are priced at
    /// the mean uncached tokens of the requests sent there. The KV capacity the pod states (in blocks) becomes its
    /// approximate index's capacity, where it has one, when it differs from it by more than 1/16 (an estimate that
    /// jitters evicts nothing). `false` if no worker has this URL, or it reports.
    pub fn set_scraped(&mut self, url: &str, s: &Scraped) -> bool {
        let url = url.trim_end_matches('/');
        let Some(w) = self.workers.iter_mut().find(|w| w.url == url && w.report.is_none()) else {
            return false;
        };
        let running_before = w.scraped.map_or(0, |q| q.running_requests);
        w.pod_decode.scrape(s.itl_sum_count, running_before, s.running);
        w.scraped = Some(QueueStats {
            waiting_requests: s.waiting,
            prefill_tokens: (f64::from(s.waiting) * w.mean_sent_tokens) as u64,
            running_requests: s.running,
            prefill_area: 0,
            prefilling_requests: 0,
        });
        w.kv_usage = s.kv_usage.filter(|u| u.is_finite()).map(|u| u.clamp(0.0, 1.0));
        w.device_kv = match (s.kv_capacity_tokens.filter(|t| *t > 0), w.kv_usage) {
            (Some(total), Some(used)) => [total, (total as f64 * (1.0 - used)) as u64, 0],
            _ => [0; 3],
        };
        if let (Some(approx), Some(blocks)) = (w.approx.as_mut(), s.kv_capacity_blocks) {
            if blocks > 0 && blocks.abs_diff(approx.capacity()) > approx.capacity() / 16 {
                approx.set_capacity(blocks);
            }
        }
        w.epoch += 1;
        w.sent_requests_since_report = 0;
        w.sent_tokens_since_report = 0;
        w.sent_area_since_report = 0;
        w.shared_load.clear();
        true
    }

    /// Sets the context length of a worker that sends no reports (a pod's own `/v1/models`, or its `[[models]]`
    /// entry); `false` if no such worker has this URL or `len` is 0.
    pub fn set_max_model_len(&mut self, url: &str, len: u32) -> bool {
        let url = url.trim_end_matches('/');
        match self.workers.iter_mut().find(|w| w.url == url && w.report.is_none()) {
            Some(w) if len > 0 => {
                w.max_model_len = len;
                true
            }
            _ => false,
        }
    }

    /// Takes a static worker out (refused when identified: it must never serve); `false` if none has this URL.
    pub fn remove_static(&mut self, url: &str) -> bool {
        let url = url.trim_end_matches('/');
        let before = self.workers.len();
        self.workers.retain(|w| !(w.is_static && w.url == url));
        let removed = self.workers.len() != before;
        if removed {
            self.rebuild_ring();
        }
        removed
    }

    /// Sets or clears draining; `false` if no such worker.
    pub fn set_draining(&mut self, id: &str, draining: bool) -> bool {
        match self.workers.iter_mut().find(|w| w.id == id) {
            Some(w) => {
                w.admin_draining = draining;
                true
            }
            None => false,
        }
    }

    /// Models served by healthy workers.
    pub fn models(&self, now: Instant) -> Vec<String> {
        let mut m: Vec<String> =
            self.workers.iter().filter(|w| self.healthy(w, now)).filter_map(|w| w.model.clone()).collect();
        m.sort();
        m.dedup();
        m
    }

    pub fn status(&self, now: Instant) -> Vec<WorkerStatus> {
        self.workers
            .iter()
            .map(|w| WorkerStatus {
                id: w.id.clone(),
                url: w.url.clone(),
                model: w.model.clone(),
                healthy: self.healthy(w, now),
                summary_fresh: self.summary(w, Tier::Device, now).is_some(),
                fingerprint_ok: w.fingerprint_ok,
                report_age_s: w.report_at.map(|r| now.duration_since(r).as_secs_f64()),
                draining: w.admin_draining || w.reported_draining(),
                suspect: w.open_fault() == Some(Fault::Timeout),
                refused: w.open_fault() == Some(Fault::Refused),
                busy_for_s: w.busy_until.filter(|u| *u > now).map(|u| u.duration_since(now).as_secs_f64()),
                max_model_len: w.max_model_len,
                inflight: w.inflight,
                load: w.load(now),
                cached_blocks: w.report.as_ref().and_then(|r| r.tier(Tier::Device)).map(|t| t.blocks_cached),
                scraped: w.scraped,
                kv_usage: w.kv_usage,
                approx_blocks: w.approx.as_ref().map(|a| [a.len(), a.capacity()]),
                speed: w.speed(now),
                counters: w.counters,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
