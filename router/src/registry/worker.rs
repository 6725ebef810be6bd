//! One worker as the registry holds it: its latest report, what this gateway did since (requests in flight, the
//! overlay of routed prefixes), and its troubles (a refused connection or a timeout, a refusal with Retry-After).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use foldhash::fast::RandomState;

use kvgate_shared::decode_fit::{DecodeCost, DecodeFit};
use kvgate_shared::hashing::BlockHash;
use kvgate_shared::report::WorkerReport;
use serde::Serialize;

use crate::routing::Load;

/// Conversations (ring keys) routed to a worker recently: the load that bounded-load ring placement counts
/// (`cache_aware`'s `ring_session_bound`).
///
/// The keys are hashes of client-chosen values, so the map is seeded per process (foldhash's `RandomState`: a few
/// times faster than SipHash on a u64, which every decision pays once per worker, and not predictable from outside).
#[derive(Debug, Default)]
pub struct Sessions {
    last: HashMap<u64, Instant, RandomState>,
    touches: u32,
}

impl Sessions {
    /// Most conversations kept per worker (expired ones are dropped first; past it the map is cleared).
    pub const MAX_ENTRIES: usize = 65_536;
    /// A conversation counts for this long after its latest request.
    pub const WINDOW: Duration = Duration::from_secs(120);

    pub fn touch(&mut self, key: u64, now: Instant) {
        self.touches = self.touches.wrapping_add(1);
        if self.touches.is_multiple_of(256) || self.last.len() >= Self::MAX_ENTRIES {
            self.last.retain(|_, t| now.saturating_duration_since(*t) < Self::WINDOW);
            if self.last.len() >= Self::MAX_ENTRIES {
                self.last.clear();
            }
        }
        self.last.insert(key, now);
    }

    /// Conversations counted now (those expired since the last pruning included, at most 255 touches old).
    pub fn active(&self) -> usize {
        self.last.len()
    }

    /// Whether conversation `key` was routed here within the window.
    pub fn holds(&self, key: u64, now: Instant) -> bool {
        self.last.get(&key).is_some_and(|t| now.saturating_duration_since(*t) < Self::WINDOW)
    }
}

/// Block hashes routed to a worker recently, with their expiry, kept sparse: a chained hash stands for its whole
/// prefix, so a prompt is remembered by its hashes at every [`Overlay::STRIDE`]th block plus its last one, and a
/// match is found by walking those points (then the few blocks past the last one that matched). The result is
/// exact at the remembered points; between them it undercounts by less than a stride, never overcounts. The same
/// points are what replicas share of each other's sends ([`super::SharedSend`]). Seeded per process like
/// [`Sessions`] (the keys are hashes of client-chosen tokens).
#[derive(Debug, Default)]
pub struct Overlay {
    entries: HashMap<BlockHash, Instant, RandomState>,
}

impl Overlay {
    /// Most entries kept per worker (expired ones dropped first; past it the map is cleared).
    pub const MAX_ENTRIES: usize = 200_000;
    /// Blocks between two remembered points.
    pub const STRIDE: usize = 8;

    /// The remembered points of a prompt's chained `hashes`: every [`Self::STRIDE`]th block's hash and the last.
    pub fn points(hashes: &[BlockHash]) -> Vec<BlockHash> {
        let mut p: Vec<BlockHash> =
            hashes.iter().skip(Self::STRIDE - 1).step_by(Self::STRIDE).copied().collect();
        if !hashes.len().is_multiple_of(Self::STRIDE) {
            p.extend(hashes.last());
        }
        p
    }

    /// Remembers a prompt routed here until `expires`.
    pub fn insert(&mut self, hashes: &[BlockHash], expires: Instant, now: Instant) {
        self.insert_points(&Self::points(hashes), expires, now);
    }

    /// Remembers the points of a prompt (from [`Self::points`], possibly another replica's) until `expires`.
    pub fn insert_points(&mut self, points: &[BlockHash], expires: Instant, now: Instant) {
        if self.entries.len() + points.len() > Self::MAX_ENTRIES {
            self.entries.retain(|_, e| *e > now);
            if self.entries.len() + points.len() > Self::MAX_ENTRIES {
                self.entries.clear();
            }
        }
        for h in points.iter().take(Self::MAX_ENTRIES) {
            self.entries.insert(*h, expires);
        }
    }

    fn holds(&self, h: &BlockHash, now: Instant) -> bool {
        self.entries.get(h).is_some_and(|e| *e > now)
    }

    /// Leading blocks of `hashes` routed here and unexpired: `len/STRIDE + STRIDE` lookups at most.
    pub fn matched(&self, hashes: &[BlockHash], now: Instant) -> usize {
        if self.entries.is_empty() {
            return 0;
        }
        let mut m = 0;
        while m + Self::STRIDE <= hashes.len() && self.holds(&hashes[m + Self::STRIDE - 1], now) {
            m += Self::STRIDE;
        }
        // A prompt that ended between two points was remembered by its last block.
        let end = (m + Self::STRIDE - 1).min(hashes.len());
        (m..end).rev().find(|&j| self.holds(&hashes[j], now)).map_or(m, |j| j + 1)
    }
}

/// What went wrong with a worker most recently.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// A connection was refused or failed before any response byte.
    Refused,
    /// No response header within the first-byte timeout, or a stream went silent: the worker is suspect.
    Timeout,
}

/// Per-worker event counts (rendered as metric series that disappear with the worker).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct WorkerCounters {
    pub connect_failures: u64,
    pub timeouts: u64,
    pub refusals: u64,
    pub fingerprint_mismatches: u64,
}

/// One worker.
#[derive(Debug)]
pub struct Worker {
    /// Registry-wide unique key (never reused): tickets and probes name a worker by it.
    pub uid: u64,
    pub id: String,
    pub url: String,
    pub model: Option<String>,
    pub is_static: bool,
    pub report: Option<WorkerReport>,
    pub report_at: Option<Instant>,
    /// Whether the latest report's fingerprint matches the model's tokenizer at this gateway (None: unknown yet).
    pub fingerprint_ok: Option<bool>,
    /// The latest fault and when; the worker is out of the ring until a report or a probe comes after it.
    pub fault: Option<(Fault, Instant)>,
    /// The latest successful probe.
    pub probe_ok_at: Option<Instant>,
    /// It refused work (a 503 refusal code: `queue_full`, `shutting_down`, ...) and asked to be left alone until then.
    pub busy_until: Option<Instant>,
    /// Drained by an operator (admin API).
    pub admin_draining: bool,
    /// Context length the worker serves (0: unknown).
    pub max_model_len: u32,
    pub inflight: u64,
    /// Bumped by every accepted report: requests sent before it are in the report's queue figures.
    pub epoch: u64,
    /// Requests sent since the latest report and not finished yet.
    pub sent_requests_since_report: u64,
    /// Their uncached prompt tokens.
    pub sent_tokens_since_report: u64,
    /// And those tokens' attention area.
    pub sent_area_since_report: u64,
    /// What other replicas sent it since the latest report (their shared sends), for a while.
    pub shared_load: SharedLoad,
    pub overlay: Overlay,
    /// For a pod that sends no reports: what this gateway sent it, as its LRU would keep it (`approx.rs`).
    pub approx: Option<super::approx::ApproxIndex>,
    /// For a pod whose KV events this gateway follows: the kvgate hashes it holds, exactly (replaces `approx`).
    pub exact: Option<std::collections::HashSet<kvgate_shared::hashing::BlockHash>>,
    /// For a pod that sends no reports: its queue as last scraped from its metrics (`Registry::set_scraped`).
    pub scraped: Option<kvgate_shared::report::QueueStats>,
    /// For a pod that sends no reports: the fraction of its KV cache in use, as last scraped (0..=1).
    pub kv_usage: Option<f64>,
    /// Moving average of the uncached prompt tokens of the requests sent here (prices a scraped queue in tokens).
    pub mean_sent_tokens: f64,
    pub sessions: Sessions,
    pub counters: WorkerCounters,
    /// What its reports say for prefill/decode splits (step timings, P->D rates).
    pub pd: super::pd::PdState,
    /// The LoRA adapters it holds and what loading one costs there (`adapters.rs`).
    pub lora: super::adapters::WorkerAdapters,
    /// For a pod that sends no reports: its decode cost, from its scraped inter-token latency.
    pub pod_decode: PodDecode,
    /// The device pool in tokens: total, free, cached (set with `report`; read by every decision, so kept here
    /// rather than found among the report's tiers each time). A pod's from its scrape: its capacity, the share its
    /// usage leaves free, and 0 cached (unknown; vLLM counts evictable cached blocks as free).
    pub device_kv: [u64; 3],
}

impl Worker {
    pub(super) fn new(uid: u64, id: String, url: String, is_static: bool) -> Self {
        Self {
            uid,
            id,
            url,
            model: None,
            is_static,
            report: None,
            report_at: None,
            fingerprint_ok: None,
            fault: None,
            probe_ok_at: None,
            busy_until: None,
            admin_draining: false,
            max_model_len: 0,
            inflight: 0,
            device_kv: [0; 3],
            pod_decode: PodDecode::default(),
            epoch: 0,
            sent_requests_since_report: 0,
            sent_tokens_since_report: 0,
            sent_area_since_report: 0,
            shared_load: SharedLoad::default(),
            overlay: Overlay::default(),
            approx: None,
            exact: None,
            scraped: None,
            kv_usage: None,
            mean_sent_tokens: 0.0,
            sessions: Sessions::default(),
            counters: WorkerCounters::default(),
            pd: Default::default(),
            lora: Default::default(),
        }
    }

    /// The worker said it is shutting down.
    pub fn reported_draining(&self) -> bool {
        self.report.as_ref().is_some_and(|r| r.draining)
    }

    /// A fault that no report or probe has answered since.
    pub fn open_fault(&self) -> Option<Fault> {
        let (fault, at) = self.fault?;
        let last_ok = self.report_at.max(self.probe_ok_at);
        last_ok.is_none_or(|ok| ok <= at).then_some(fault)
    }

    /// The share of its last report interval it spent computing prompt tokens: that interval's prefill
    /// throughput over its speed while computing (0 when either is unknown).
    pub fn prefill_busy(&self) -> f64 {
        let done = self.report.as_ref().map_or(0.0, |r| r.throughput.prefill_tokens_per_s);
        let speed = self.pd.prefill_tokens_per_s;
        if done.is_finite() && done > 0.0 && speed > 0.0 {
            (done / speed).min(1.0)
        } else {
            0.0
        }
    }

    /// Its measured prefill: speed while prefilling, and the share of its last report interval spent at it (that
    /// interval's prefill throughput over the speed; 0 when either is unknown).
    pub fn speed(&self, now: Instant) -> crate::routing::Speed {
        self.speed_aged(self.report_age(now).map_or(0.0, |a| a.as_secs_f64()))
    }

    /// Time since its latest report (`None`: none yet).
    pub fn report_age(&self, now: Instant) -> Option<Duration> {
        self.report_at.map(|at| now.saturating_duration_since(at))
    }

    /// [`Worker::speed`], its report's age given (seconds; 0: no report): a decision reads the age once a worker.
    pub(super) fn speed_aged(&self, report_age_s: f64) -> crate::routing::Speed {
        let (speed, busy) = (self.pd.prefill_tokens_per_s, self.prefill_busy());
        let report = self.report.as_ref();
        let q = report.map(|r| r.queue).or(self.scraped).unwrap_or_default();
        let [total, free, cached] = self.device_kv;
        // A kvgate worker's reported fit, else a pod's scraped one.
        let (base, per_seq, per_kv) = match report {
            Some(_) => (self.pd.decode_base_s, self.pd.decode_per_seq_s, self.pd.decode_per_kv_token_s),
            None => {
                let c = self.pod_decode.cost;
                (c.base_s, c.per_seq_s, c.per_kv_token_s)
            }
        };
        crate::routing::Speed {
            prefill_tokens_per_s: speed,
            prefill_busy: busy,
            report_age_s,
            prefill_per_token_s: self.pd.prefill_per_token_s,
            prefill_attention_s: self.pd.prefill_attention_s,
            decode_base_s: base,
            decode_per_seq_s: per_seq,
            decode_per_kv_token_s: per_kv,
            stall_ratio: self.pd.stall_ratio,
            decoding: u64::from(q.running_requests.saturating_sub(q.prefilling_requests)),
            kv_total_tokens: total,
            kv_free_tokens: free,
            kv_cached_tokens: cached,
        }
    }

    /// A report's device pool in tokens: total, free, cached (its blocks times its block size; saturating: a
    /// report may state any u64).
    pub(super) fn device_kv_of(r: &WorkerReport) -> [u64; 3] {
        let b = u64::from(r.scheme.block_size);
        r.tier(kvgate_shared::report::Tier::Device).map_or([0; 3], |t| {
            [
                t.blocks_total.saturating_mul(b),
                t.blocks_free.saturating_mul(b),
                t.blocks_cached.saturating_mul(b),
            ]
        })
    }

    /// Load as this gateway sees it at `now`: the last report plus the sends since (this replica's, and the other
    /// replicas' that have not expired).
    pub fn load(&self, now: Instant) -> Load {
        let q = self.report.as_ref().map(|r| r.queue).or(self.scraped).unwrap_or_default();
        let (shared_tokens, shared_requests) = self.shared_load.total(now);
        let waiting = u64::from(q.waiting_requests) + self.sent_requests_since_report + shared_requests;
        // Other replicas' sends: their mean size each, from context 0 (what they held is not shared).
        let shared_area = match shared_tokens.checked_div(shared_requests) {
            Some(mean) => shared_requests.saturating_mul(kvgate_shared::report::attention_area(0, mean)),
            None => 0,
        };
        Load {
            pending_tokens: q
                .prefill_tokens
                .saturating_add(self.sent_tokens_since_report)
                .saturating_add(shared_tokens),
            requests: waiting.saturating_add(u64::from(q.running_requests)),
            waiting,
            prefilling: u64::from(q.prefilling_requests.min(q.running_requests)),
            pending_area: q
                .prefill_area
                .saturating_add(self.sent_area_since_report)
                .saturating_add(shared_area),
        }
    }
}

/// How long another replica's send counts as load on a worker at most (its next report or scrape ends it sooner).
pub const SHARED_LOAD_TTL: std::time::Duration = std::time::Duration::from_secs(5);
/// Most entries a worker's shared load keeps; past it the oldest is merged into the next.
pub const MAX_SHARED_LOAD_ENTRIES: usize = 256;

/// Load other replicas sent a worker: each send counts for [`SHARED_LOAD_TTL`], or until the worker's next report
/// or scrape (which counts it itself): a pod that never reports does not collect every replica's sends forever.
/// Bounded in entries whatever the peers send.
#[derive(Clone, Debug, Default)]
pub struct SharedLoad {
    /// (expires, uncached tokens, requests), in expiry order.
    entries: std::collections::VecDeque<(Instant, u64, u64)>,
}

impl SharedLoad {
    /// Counts a send of `tokens` received at `now`.
    pub fn add(&mut self, now: Instant, tokens: u64) {
        while self.entries.front().is_some_and(|e| e.0 <= now) {
            self.entries.pop_front();
        }
        if self.entries.len() >= MAX_SHARED_LOAD_ENTRIES {
            if let Some((_, t, r)) = self.entries.pop_front() {
                if let Some(next) = self.entries.front_mut() {
                    next.1 = next.1.saturating_add(t);
                    next.2 = next.2.saturating_add(r);
                }
            }
        }
        self.entries.push_back((now + SHARED_LOAD_TTL, tokens, 1));
    }

    /// (tokens, requests) that still count at `now`.
    pub fn total(&self, now: Instant) -> (u64, u64) {
        self.entries
            .iter()
            .filter(|e| e.0 > now)
            .fold((0, 0), |(t, r), e| (t.saturating_add(e.1), r.saturating_add(e.2)))
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// What a pod that sends no reports says in its Prometheus metrics (`Registry::set_scraped`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Scraped {
    /// Requests waiting, summed over its engines.
    pub waiting: u32,
    /// Requests running.
    pub running: u32,
    /// Fraction of its KV cache in use (0..=1), if it says.
    pub kv_usage: Option<f64>,
    /// Its KV cache's size in this model's blocks, if it says.
    pub kv_capacity_blocks: Option<usize>,
    /// The same in tokens.
    pub kv_capacity_tokens: Option<u64>,
    /// Its inter-token latency histogram's running sum (seconds) and count (tokens), summed over its engines
    /// (vLLM `vllm:inter_token_latency_seconds`, SGLang `sglang:inter_token_latency_seconds`), if it says.
    pub itl_sum_count: Option<(f64, f64)>,
}

/// Observations a pod's decode fit forgets over: scrape intervals (about two minutes at one a second).
pub const POD_DECODE_WINDOW: f64 = 120.0;
/// Largest mean inter-token latency of an interval believed, seconds (a larger one is not observed).
pub const MAX_POD_TPOT_S: f64 = 10.0;

/// A pod's decode cost, fitted from its scraped inter-token latency (pods send no `StepTiming`): each scrape
/// interval in which it produced tokens is one observation, the interval's mean time per token (the histogram's
/// sum and count, differenced) against the requests it ran (the mean of the two scrapes' `running`). Its context
/// is not known, so the fit has no per-token term; chunked prefill's stalls are in the latency, so in `base`.
/// Invariants: a counter that went back (a restart) starts a new baseline and is not an observation; the state
/// is the fit's nine sums and the last pair, whatever the page says.
#[derive(Clone, Copy, Debug, Default)]
pub struct PodDecode {
    last: Option<(f64, f64)>,
    fit: DecodeFit,
    /// The fitted cost (all zero before the first observation).
    pub cost: DecodeCost,
    /// Intervals observed.
    pub samples: u64,
}

impl PodDecode {
    /// One scrape: the histogram's sum and count (`None`: the page has none), and the requests running at the
    /// previous scrape and at this one.
    pub fn scrape(&mut self, itl: Option<(f64, f64)>, running_before: u32, running_now: u32) {
        let Some((sum, count)) =
            itl.filter(|(s, c)| s.is_finite() && c.is_finite() && *s >= 0.0 && *c >= 0.0)
        else {
            return;
        };
        if let Some((s0, c0)) = self.last {
            let (ds, dc) = (sum - s0, count - c0);
            if dc >= 1.0 && ds > 0.0 && ds / dc <= MAX_POD_TPOT_S {
                let batch = (f64::from(running_before) + f64::from(running_now)) / 2.0;
                self.fit.observe_in(POD_DECODE_WINDOW, batch.max(1.0), 0.0, ds / dc);
                self.cost = self.fit.cost();
                self.samples += 1;
            }
        }
        self.last = Some((sum, count));
    }
}

/// A worker's state for `GET /admin/v1/workers`, `GET /kvgate/v1/workers` and logs.
#[derive(Debug, Serialize)]
pub struct WorkerStatus {
    pub id: String,
    pub url: String,
    pub model: Option<String>,
    pub healthy: bool,
    pub summary_fresh: bool,
    pub fingerprint_ok: Option<bool>,
    pub report_age_s: Option<f64>,
    /// The worker reported it is shutting down, or an operator drained it.
    pub draining: bool,
    /// A timeout nobody answered since (first byte or stream idle).
    pub suspect: bool,
    /// A refused connection nobody answered since.
    pub refused: bool,
    /// Seconds it asked to be left alone for (Retry-After), if still running.
    pub busy_for_s: Option<f64>,
    pub max_model_len: u32,
    pub inflight: u64,
    pub load: Load,
    pub cached_blocks: Option<u64>,
    /// A pod without reports: its queue as its metrics state it (waiting and running requests; `prefill_tokens`
    /// is the waiting requests priced at the mean uncached prompt this gateway sent it).
    pub scraped: Option<kvgate_shared::report::QueueStats>,
    /// A pod without reports: the fraction of its KV cache in use, from its metrics.
    pub kv_usage: Option<f64>,
    /// A pod without reports: blocks its approximate index holds, and at most (from config or its metrics).
    pub approx_blocks: Option<[usize; 2]>,
    /// Its measured prefill (token rate, busy share, report age, and its fit of cost against context): what
    /// `cache_aware_measured` prices it by.
    pub speed: crate::routing::Speed,
    pub counters: WorkerCounters,
}
