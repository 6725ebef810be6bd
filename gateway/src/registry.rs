//! Worker states: static workers from the config and workers that registered by reporting. A worker's latest
//! report (Bloom summary, queue, KV stats, fingerprint) is its state, plus what this gateway did since: requests in
//! flight, tokens sent, and the overlay of block hashes it routed there.
//!
//! Health (pure functions of `now`): a worker is **in the ring** unless draining, refused a connection after its
//! latest report, or silent for `dead_after`; a static worker that never reported counts as healthy until a
//! connection is refused. Its **summary counts** only if younger than `stale_after` and of the expected hash-scheme
//! fingerprint (a mismatch is logged and counted, never silently used).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvgate_shared::hashing::BlockHash;
use kvgate_shared::report::{CacheSummary, Tier, WorkerReport};
use serde::Serialize;

use crate::routing::{Load, Ring, WorkerView};

/// Timing knobs.
#[derive(Clone, Copy, Debug)]
pub struct RegistryConfig {
    pub stale_after: Duration,
    pub dead_after: Duration,
    pub overlay_ttl: Duration,
    pub vnodes: u32,
}

/// Block hashes routed to a worker recently, with their expiry.
#[derive(Debug, Default)]
pub struct Overlay {
    entries: HashMap<BlockHash, Instant>,
}

impl Overlay {
    /// Most entries kept per worker (oldest dropped first when exceeded).
    pub const MAX_ENTRIES: usize = 200_000;

    pub fn insert(&mut self, hashes: &[BlockHash], expires: Instant, now: Instant) {
        if self.entries.len() + hashes.len() > Self::MAX_ENTRIES {
            self.entries.retain(|_, e| *e > now);
        }
        for h in hashes.iter().take(Self::MAX_ENTRIES) {
            self.entries.insert(*h, expires);
        }
    }

    /// Leading hashes present and unexpired.
    pub fn matched(&self, hashes: &[BlockHash], now: Instant) -> usize {
        hashes.iter().take_while(|h| self.entries.get(h).is_some_and(|e| *e > now)).count()
    }
}

/// One worker.
#[derive(Debug)]
pub struct Worker {
    pub id: String,
    pub url: String,
    pub model: Option<String>,
    pub is_static: bool,
    pub report: Option<WorkerReport>,
    pub report_at: Option<Instant>,
    /// Whether the latest report's fingerprint matches the model's tokenizer at this gateway (None: unknown yet).
    pub fingerprint_ok: Option<bool>,
    pub refused_at: Option<Instant>,
    pub draining: bool,
    pub inflight: u64,
    /// Bumped by every accepted report: requests sent before it are in the report's queue figures.
    pub epoch: u64,
    /// Requests sent since the latest report and not finished yet.
    pub sent_requests_since_report: u64,
    /// Their uncached prompt tokens.
    pub sent_tokens_since_report: u64,
    pub overlay: Overlay,
}

/// What [`Registry::record_sent`] returns, for [`Registry::record_done`].
#[derive(Clone, Copy, Debug)]
pub struct SentTicket {
    pub idx: usize,
    pub epoch: u64,
    pub uncached_tokens: u64,
}

impl Worker {
    fn new(id: String, url: String, is_static: bool) -> Self {
        Self {
            id,
            url,
            model: None,
            is_static,
            report: None,
            report_at: None,
            fingerprint_ok: None,
            refused_at: None,
            draining: false,
            inflight: 0,
            epoch: 0,
            sent_requests_since_report: 0,
            sent_tokens_since_report: 0,
            overlay: Overlay::default(),
        }
    }
}

/// A worker's state for `GET /admin/v1/workers` and logs.
#[derive(Debug, Serialize)]
pub struct WorkerStatus {
    pub id: String,
    pub url: String,
    pub model: Option<String>,
    pub healthy: bool,
    pub summary_fresh: bool,
    pub fingerprint_ok: Option<bool>,
    pub report_age_s: Option<f64>,
    pub inflight: u64,
    pub load: Load,
    pub cached_blocks: Option<u64>,
}

/// All workers.
#[derive(Debug)]
pub struct Registry {
    cfg: RegistryConfig,
    workers: Vec<Worker>,
    ring: Ring,
}

impl Registry {
    pub fn new(cfg: RegistryConfig) -> Self {
        Self { cfg, workers: Vec::new(), ring: Ring::new([], cfg.vnodes) }
    }

    pub fn workers(&self) -> &[Worker] {
        &self.workers
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    fn rebuild_ring(&mut self) {
        self.ring = Ring::new(self.workers.iter().map(|w| w.id.as_str()), self.cfg.vnodes);
    }

    /// Adds a static worker (id = URL until it tells its id).
    pub fn add_static(&mut self, url: &str) {
        let url = url.trim_end_matches('/').to_owned();
        if self.workers.iter().any(|w| w.url == url) {
            return;
        }
        self.workers.push(Worker::new(url.clone(), url, true));
        self.rebuild_ring();
    }

    /// Learns a worker's id and model (from its tokenizer endpoint or a report).
    pub fn identify(&mut self, url: &str, id: &str, model: &str) {
        let url = url.trim_end_matches('/');
        // A report may have registered the same id under another URL form: keep one entry.
        if let Some(i) = self.workers.iter().position(|w| w.url == url) {
            let changed = self.workers[i].id != id;
            self.workers[i].id = id.to_owned();
            self.workers[i].model = Some(model.to_owned());
            if changed {
                self.rebuild_ring();
            }
        }
    }

    /// Takes a report. `expected_fingerprint` is the model's fingerprint at this gateway, if its tokenizer is
    /// loaded. Returns `false` for an out-of-order (older) report, which is ignored.
    pub fn ingest(&mut self, report: WorkerReport, expected_fingerprint: Option<u64>, now: Instant) -> bool {
        let url = report.advertise_url.trim_end_matches('/').to_owned();
        let pos = self.workers.iter().position(|w| w.id == report.worker_id || w.url == url);
        let i = match pos {
            Some(i) => i,
            None => {
                self.workers.push(Worker::new(report.worker_id.clone(), url.clone(), false));
                self.workers.len() - 1
            }
        };
        let w = &mut self.workers[i];
        // A restarted worker starts its sequence again: accept a lower seq only after a silence.
        if let (Some(prev), Some(at)) = (&w.report, w.report_at) {
            if report.seq <= prev.seq && now.duration_since(at) < self.cfg.dead_after {
                return false;
            }
        }
        let id_changed = w.id != report.worker_id;
        w.id = report.worker_id.clone();
        w.url = url;
        w.model = Some(report.model_id.clone());
        w.fingerprint_ok = expected_fingerprint.map(|f| f == report.fingerprint);
        if w.fingerprint_ok == Some(false) {
            tracing::warn!(worker = %w.id, "report fingerprint differs from this gateway's tokenizer: no cache score");
            metrics::counter!("kvgate_gateway_fingerprint_mismatch_total", "worker" => w.id.clone())
                .increment(1);
        }
        w.report = Some(report);
        w.report_at = Some(now);
        w.epoch += 1;
        w.sent_requests_since_report = 0;
        w.sent_tokens_since_report = 0;
        if id_changed || pos.is_none() {
            self.rebuild_ring();
        }
        true
    }

    fn healthy(&self, w: &Worker, now: Instant) -> bool {
        if w.draining {
            return false;
        }
        match (w.report_at, w.refused_at) {
            (Some(r), Some(f)) if f > r => false,
            (None, Some(_)) => false,
            (Some(r), _) => now.duration_since(r) < self.cfg.dead_after,
            (None, None) => w.is_static,
        }
    }

    fn summary<'a>(&self, w: &'a Worker, now: Instant) -> Option<&'a CacheSummary> {
        let fresh = w.report_at.is_some_and(|r| now.duration_since(r) < self.cfg.stale_after);
        if !fresh || w.fingerprint_ok != Some(true) {
            return None;
        }
        w.report.as_ref()?.tier(Tier::Device)?.summary.as_ref()
    }

    fn load(w: &Worker) -> Load {
        let q = w.report.as_ref().map(|r| r.queue).unwrap_or_default();
        Load {
            pending_tokens: q.waiting_prefill_tokens + w.sent_tokens_since_report,
            requests: u64::from(q.waiting_requests)
                + u64::from(q.running_requests)
                + w.sent_requests_since_report,
        }
    }

    /// The candidates for a model (workers whose model is unknown yet are candidates too), and their indices.
    pub fn views(
        &self,
        model: &str,
        hashes: &[BlockHash],
        now: Instant,
    ) -> (Vec<WorkerView<'_>>, Vec<usize>) {
        let mut views = Vec::new();
        let mut idx = Vec::new();
        for (i, w) in self.workers.iter().enumerate() {
            if w.model.as_deref().is_some_and(|m| m != model) {
                continue;
            }
            views.push(WorkerView {
                id: &w.id,
                healthy: self.healthy(w, now),
                summary: self.summary(w, now),
                overlay_matched_blocks: w.overlay.matched(hashes, now),
                load: Self::load(w),
            });
            idx.push(i);
        }
        (views, idx)
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
        w.overlay.insert(hashes, now + ttl, now);
        SentTicket { idx: i, epoch: w.epoch, uncached_tokens }
    }

    /// Records the end of a request: it no longer counts as load (if no report has counted it since).
    pub fn record_done(&mut self, t: SentTicket) {
        if let Some(w) = self.workers.get_mut(t.idx) {
            w.inflight = w.inflight.saturating_sub(1);
            if w.epoch == t.epoch {
                w.sent_requests_since_report = w.sent_requests_since_report.saturating_sub(1);
                w.sent_tokens_since_report = w.sent_tokens_since_report.saturating_sub(t.uncached_tokens);
            }
        }
    }

    /// Records a refused connection: the worker leaves the ring until it reports again.
    pub fn record_refused(&mut self, i: usize, now: Instant) {
        if let Some(w) = self.workers.get_mut(i) {
            w.refused_at = Some(now);
        }
    }

    /// Sets or clears draining; `false` if no such worker.
    pub fn set_draining(&mut self, id: &str, draining: bool) -> bool {
        match self.workers.iter_mut().find(|w| w.id == id) {
            Some(w) => {
                w.draining = draining;
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
                summary_fresh: self.summary(w, now).is_some(),
                fingerprint_ok: w.fingerprint_ok,
                report_age_s: w.report_at.map(|r| now.duration_since(r).as_secs_f64()),
                inflight: w.inflight,
                load: Self::load(w),
                cached_blocks: w.report.as_ref().and_then(|r| r.tier(Tier::Device)).map(|t| t.blocks_cached),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
    use kvgate_shared::report::{BlockBloom, QueueStats, Throughput, TierReport};

    fn cfg() -> RegistryConfig {
        RegistryConfig {
            stale_after: Duration::from_secs(3),
            dead_after: Duration::from_secs(10),
            overlay_ttl: Duration::from_secs(3),
            vnodes: 16,
        }
    }

    fn report(id: &str, seq: u64, hashes: &[BlockHash], fingerprint: u64) -> WorkerReport {
        let mut bloom = BlockBloom::with_capacity(64, 0.001);
        hashes.iter().for_each(|h| bloom.insert(*h));
        WorkerReport {
            worker_id: id.into(),
            advertise_url: format!("http://{id}:8000"),
            model_id: "m".into(),
            scheme: HashScheme::new(16, 1),
            fingerprint,
            seq,
            timestamp_ms: 0,
            queue: QueueStats { waiting_requests: 1, waiting_prefill_tokens: 100, running_requests: 2 },
            throughput: Throughput::default(),
            tiers: vec![TierReport {
                tier: Tier::Device,
                blocks_total: 100,
                blocks_free: 50,
                blocks_cached: 10,
                summary: Some(CacheSummary { granularity: 1, entries: hashes.len() as u64, bloom }),
            }],
        }
    }

    fn hashes() -> Vec<BlockHash> {
        BlockHasher::new(&HashScheme::new(16, 1), &ExtraKeys::none())
            .hash_blocks(&(0..64).collect::<Vec<u32>>())
    }

    #[test]
    fn stale_reports_stop_prefix_scoring_and_silence_removes_from_the_ring() {
        let mut r = Registry::new(cfg());
        let t0 = Instant::now();
        let h = hashes();
        assert!(r.ingest(report("a", 1, &h, 7), Some(7), t0));
        let (v, _) = r.views("m", &h, t0 + Duration::from_secs(1));
        assert!(v[0].healthy);
        assert_eq!(v[0].matched_blocks(&h), 4);
        let (v, _) = r.views("m", &h, t0 + Duration::from_secs(4));
        assert!(v[0].healthy && v[0].summary.is_none(), "stale: no prefix score, still routable");
        assert_eq!(v[0].matched_blocks(&h), 0);
        let (v, _) = r.views("m", &h, t0 + Duration::from_secs(11));
        assert!(!v[0].healthy, "silent past dead_after: out of the ring");
        // Reporting again brings it back.
        assert!(r.ingest(report("a", 2, &h, 7), Some(7), t0 + Duration::from_secs(12)));
        assert!(r.views("m", &h, t0 + Duration::from_secs(12)).0[0].healthy);
    }

    #[test]
    fn fingerprint_mismatch_gets_no_cache_score() {
        let mut r = Registry::new(cfg());
        let t0 = Instant::now();
        let h = hashes();
        r.ingest(report("a", 1, &h, 8), Some(7), t0);
        let (v, _) = r.views("m", &h, t0);
        assert!(v[0].healthy && v[0].summary.is_none());
        assert_eq!(r.status(t0)[0].fingerprint_ok, Some(false));
    }

    #[test]
    fn refusals_overlay_order_and_load() {
        let mut r = Registry::new(cfg());
        let t0 = Instant::now();
        let h = hashes();
        r.ingest(report("a", 5, &[], 7), Some(7), t0);
        assert!(!r.ingest(report("a", 4, &[], 7), Some(7), t0), "older reports are ignored");
        let ticket = r.record_sent(0, &h, 300, t0);
        let (v, _) = r.views("m", &h, t0);
        assert_eq!(v[0].overlay_matched_blocks, 4, "what this gateway routed counts before the next report");
        assert_eq!(v[0].load, Load { pending_tokens: 400, requests: 4 });
        r.record_done(ticket);
        assert_eq!(
            r.views("m", &h, t0).0[0].load,
            Load { pending_tokens: 100, requests: 3 },
            "finished: no load"
        );
        assert_eq!(
            r.views("m", &h, t0 + Duration::from_secs(4)).0[0].overlay_matched_blocks,
            0,
            "overlay expires"
        );
        r.record_refused(0, t0 + Duration::from_millis(10));
        assert!(!r.views("m", &h, t0 + Duration::from_millis(20)).0[0].healthy);
        r.ingest(report("a", 6, &[], 7), Some(7), t0 + Duration::from_millis(30));
        assert!(r.views("m", &h, t0 + Duration::from_millis(40)).0[0].healthy);
        assert!(r.views("other-model", &h, t0).0.is_empty());
        r.add_static("http://s:1");
        assert!(
            r.views("m", &h, t0).0.iter().any(|w| w.id == "http://s:1" && w.healthy),
            "unknown model: candidate"
        );
        assert!(r.set_draining("a", true));
        assert!(!r.views("m", &h, t0 + Duration::from_millis(40)).0[0].healthy);
    }
}
