//! Routing: which worker serves a request. Pure functions of (request block hashes, worker states, config): no
//! sockets, no clocks, so the gateway and the simulator run the same code.
//!
//! One policy per file behind [`RoutingPolicy`]:
//! - `goodput`, `cache_aware_measured`, `cache_aware` (`cache_aware.rs`; which is [`DEFAULT_POLICY`] says there):
//!   prefix match + ring affinity - load, then a guard: `goodput` counts the decode batch, the KV headroom and the
//!   class's SLOs beside the measured prefill seconds (`goodput.rs`); `cache_aware_measured` the measured prefill
//!   seconds alone (`hotspot.rs`, #43's pick); `cache_aware` #28's token thresholds; the last two are kept as named
//!   baselines;
//! - `round_robin`, `least_load`, `consistent_hash`: the baselines it is compared against.

pub mod cache_aware;
pub mod consistent_hash;
pub mod goodput;
pub mod hotspot;
pub mod least_load;
pub mod ring;
pub mod ring_key;
pub mod round_robin;
pub mod slo;

use kvgate_shared::hashing::BlockHash;
use kvgate_shared::report::CacheSummary;
use serde::{Deserialize, Serialize};

pub use cache_aware::{CacheAware, Weights};
pub use ring::Ring;
pub use ring_key::{RingKey, RingKeys};
pub use slo::Slo;

/// What the policies know about a request.
#[derive(Clone, Debug)]
pub struct RequestView<'a> {
    /// Chained hashes of the prompt's full blocks.
    pub hashes: &'a [BlockHash],
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Session key for the ring (`x-session-id`, `user`, or the block where prompts diverge: `ring_key.rs`).
    pub session_key: u64,
    /// Leading blocks other conversations share (a common system prompt; `ring_key.rs`), 0 if none known.
    pub shared_blocks: usize,
    /// The request's number at this router ([`crate::route::Router`] counts them): round robin's turn, and hashed
    /// for tie-breaks ([`RequestView::nonce`]), so a dry run that peeks at the next number decides as the request
    /// routed next will.
    pub seq: u64,
    /// The tokens it may generate (its `max_tokens`, or its class's expected output when it names none; 0:
    /// unknown): how long it will hold a place in a decode batch.
    pub output_tokens: u64,
    /// The SLOs its class gives it (configuration, never the client).
    pub slo: Slo,
}

impl RequestView<'_> {
    /// Per-request entropy for tie-breaking, a pure function of `seq`.
    pub fn nonce(&self) -> u64 {
        self.seq.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

/// Load as the gateway sees it: the worker's last report plus what this gateway sent since.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Load {
    /// Prefill tokens reported (waiting less cached, and running still in prefill) + uncached prompt tokens sent
    /// since the report.
    pub pending_tokens: u64,
    /// Waiting + running requests reported + requests in flight through this gateway since the report.
    pub requests: u64,
    /// The queue a new prompt joins: waiting requests reported (for a batch slot or KV memory) + requests sent
    /// since the report.
    pub waiting: u64,
    /// Running requests the last report counted still computing their prompt: with `waiting`, the requests ahead
    /// of a new one that have not produced a first token (the prefill's number in system).
    pub prefilling: u64,
    /// The attention area of `pending_tokens` (`kvgate_shared::report::attention_area`): reported, plus this
    /// gateway's sends since (other replicas' shared sends at their mean size, as if their context began at 0).
    pub pending_area: u64,
}

impl Load {
    /// Tokens one queued or running request counts for, by default (`Weights::per_request_tokens`).
    pub const DEFAULT_PER_REQUEST_TOKENS: u64 = 256;

    /// One number for comparisons: tokens plus a request-count term (a request costs at least `per_request`).
    pub fn cost(&self, per_request_tokens: u64) -> u64 {
        // Saturating: a report may state any u64 queue.
        self.pending_tokens.saturating_add(self.requests.saturating_mul(per_request_tokens))
    }
}

/// One candidate worker.
#[derive(Clone, Debug)]
pub struct WorkerView<'a> {
    pub id: &'a str,
    /// The worker's slot on the ring the decision uses ([`Ring::id`]): the registry's index of the worker.
    pub slot: usize,
    /// Fresh enough to be in the ring and receive traffic.
    pub healthy: bool,
    /// The latest cache summary of the device tier, if fresh and of the same hash scheme.
    pub summary: Option<&'a CacheSummary>,
    /// The same of the lower tiers the worker reports: host DRAM, SSD (`None`: no such tier, or no summary).
    pub host_summary: Option<&'a CacheSummary>,
    pub disk_summary: Option<&'a CacheSummary>,
    /// Leading blocks this gateway routed to the worker since its last report (the overlay), or, for a pod that
    /// sends no reports, what its approximate index or its KV events say it holds.
    pub overlay_matched_blocks: usize,
    /// Where the prefix term's knowledge of this worker comes from (explain shows it).
    pub prefix_signal: PrefixSignal,
    pub load: Load,
    /// Conversations routed here recently (`registry::Sessions`).
    pub sessions: usize,
    /// The request's conversation is one of them.
    pub holds_session: bool,
    /// What its reports measure of its prefill (zeros: never measured, e.g. a pod that sends no reports).
    pub speed: Speed,
}

/// A worker's measured prefill, from its reports (`registry::pd`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Speed {
    /// Prompt tokens per second while it computes prompts (moving average; 0: never measured).
    pub prefill_tokens_per_s: f64,
    /// Share of its last report interval spent computing prompt tokens (0..=1; 0 when unknown).
    pub prefill_busy: f64,
    /// Seconds since its last report (0: none): how long it has drained its reported queue unseen.
    pub report_age_s: f64,
    /// Its fit of a prefill-carrying step's seconds: this per prompt token plus `prefill_attention_s` per unit of
    /// attention area (`kvgate_shared::report::attention_area`). 0: not measured (then the token rate prices).
    pub prefill_per_token_s: f64,
    pub prefill_attention_s: f64,
    /// Its fit of a decode-only step's seconds: `decode_base_s + decode_per_seq_s x batch + decode_per_kv_token_s x
    /// context tokens` (all 0: not measured; `StepTiming::decode_*`).
    pub decode_base_s: f64,
    pub decode_per_seq_s: f64,
    pub decode_per_kv_token_s: f64,
    /// Share of its decode-carrying steps' time that prefill chunks added (0..=1).
    pub stall_ratio: f64,
    /// Decoding sequences its last report counted (running, past their prompt).
    pub decoding: u64,
    /// Its device KV pool in tokens, as its last report says: the whole, the free part (cached-but-unused blocks
    /// included: they can be evicted), and the part holding cached content (in use or not). All 0: unknown.
    pub kv_total_tokens: u64,
    pub kv_free_tokens: u64,
    pub kv_cached_tokens: u64,
}

/// Where a worker's prefix match comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixSignal {
    /// A kvgate worker's report (Bloom summaries), plus what this gateway routed since.
    Report,
    /// A pod's KV events (an exact set of its blocks).
    Events,
    /// This gateway's approximate index of what it sent the pod.
    Approximate,
    /// Only what this gateway routed within `--overlay-ttl` (no fresh report, no index).
    #[default]
    Overlay,
}

/// Leading blocks of a request a worker holds, by the tier they would come from (cumulative: `device <=
/// through_host <= through_disk`). A block is taken from the highest tier that holds it; blocks past the device
/// prefix found in the host tier are loaded from host DRAM, and so on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierMatch {
    /// In the device pool (Bloom summary or this gateway's overlay).
    pub device: usize,
    /// In device or host DRAM.
    pub through_host: usize,
    /// In any tier (the prefix the worker need not recompute).
    pub through_disk: usize,
}

impl TierMatch {
    /// Blocks from host DRAM.
    pub fn host(&self) -> usize {
        self.through_host - self.device
    }

    /// Blocks from SSD.
    pub fn disk(&self) -> usize {
        self.through_disk - self.through_host
    }
}

/// Extends a matched prefix `from` through the tiers in `tiers`: block `i` is held if some tier whose summary
/// represents block `i` (its granularity) has it; a block no summary represents is taken on trust, and kept only if
/// a later represented block confirms the run. Stops at the first represented block no tier has.
fn extend_through(hashes: &[BlockHash], from: usize, tiers: [Option<&CacheSummary>; 3]) -> usize {
    let mut confirmed = from;
    for (i, h) in hashes.iter().enumerate().skip(from) {
        let (mut covered, mut held) = (false, false);
        for t in tiers.iter().flatten().filter(|t| t.covers_block(i)) {
            covered = true;
            if t.bloom.contains(*h) {
                held = true;
                break;
            }
        }
        if !covered {
            continue;
        }
        if !held {
            break;
        }
        confirmed = i + 1;
    }
    confirmed
}

impl WorkerView<'_> {
    /// Leading blocks of the request this worker is believed to hold in its device pool (Bloom summary or
    /// overlay).
    pub fn matched_blocks(&self, hashes: &[BlockHash]) -> usize {
        let bloom = self.summary.map_or(0, |s| s.matched_blocks_fast(hashes));
        bloom.max(self.overlay_matched_blocks).min(hashes.len())
    }

    /// Leading blocks of the request this worker holds, by tier ([`TierMatch`]). Without lower-tier summaries
    /// every figure is the device match (no walk); with them, one Bloom lookup per represented block past it.
    pub fn tier_match(&self, hashes: &[BlockHash]) -> TierMatch {
        let device = self.matched_blocks(hashes);
        let through_host = match self.host_summary {
            Some(_) => extend_through(hashes, device, [self.summary, self.host_summary, None]),
            None => device,
        };
        let through_disk = match self.disk_summary {
            Some(_) => {
                extend_through(hashes, through_host, [self.summary, self.host_summary, self.disk_summary])
            }
            None => through_host,
        };
        TierMatch { device, through_host, through_disk }
    }
}

/// Why a worker was chosen (the `x-kvgate-route` header and a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteReason {
    /// The prefix match decided.
    Prefix,
    /// The session's ring primary.
    Primary,
    /// The session's ring backup (primary unhealthy or outscored).
    Backup,
    /// Load decided (least loaded, or the hot-spot guard fired).
    Load,
    /// Round robin.
    RoundRobin,
    /// A retry on the next best worker after a connection failure.
    Fallback,
    /// The split policy chose a prefill/decode split: the decode worker imports the prompt's KV.
    Split,
}

impl RouteReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteReason::Prefix => "prefix",
            RouteReason::Primary => "primary",
            RouteReason::Backup => "backup",
            RouteReason::Load => "load",
            RouteReason::RoundRobin => "round_robin",
            RouteReason::Fallback => "fallback",
            RouteReason::Split => "split",
        }
    }
}

/// Every term of one worker's score (logged at debug, returned by route/explain).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScoreTerms {
    pub worker: String,
    pub healthy: bool,
    /// Leading blocks held in any tier (`tiers.through_disk`).
    pub matched_blocks: usize,
    /// The same by tier.
    pub tiers: TierMatch,
    /// Where the match comes from.
    pub prefix_signal: PrefixSignal,
    /// Credited blocks (tier credits applied, a cheap shared prefix taken off) over the request's blocks.
    pub matched_fraction: f64,
    /// 1 primary, 0.5 backup, 0 otherwise.
    pub ring: f64,
    pub load: Load,
    pub normalized_load: f64,
    pub score: f64,
    /// The measured hot-spot guard's predicted seconds here (`cache_aware_measured`, `hotspot.rs`: TTFT plus the
    /// delay it adds; 0 when unhealthy or under another guard).
    pub predicted_s: f64,
    /// Its TTFT part: the queue ahead and this prompt's prefill (0 when unhealthy or under another guard).
    pub predicted_ttft_s: f64,
    /// The goodput guard's predicted time per output token here, and its cost in seconds (`goodput.rs`; 0 under
    /// another guard).
    pub predicted_tpot_s: f64,
    pub goodput_cost_s: f64,
    /// Whether the request meets its SLOs here, as the goodput guard predicts (`None`: another guard).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub meets_slo: Option<bool>,
}

/// A policy's answer: candidates best first (the first is the pick; the rest are fallbacks).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// Indices into the workers slice, best first; only healthy workers.
    pub ranked: Vec<usize>,
    pub reason: RouteReason,
    /// Predicted cached prompt tokens on the pick.
    pub predicted_cached_tokens: usize,
    pub terms: Vec<ScoreTerms>,
}

/// A routing policy.
pub trait RoutingPolicy: Send + Sync {
    /// The name used in config and metrics.
    fn name(&self) -> &'static str;

    /// Takes new weights live (policies without weights ignore them).
    fn set_weights(&self, _weights: Weights) {}

    /// The first block of the request whose match the policy credits (`None`: it credits no prefix; default). In
    /// a large fleet only the workers that hold that block (its root, `registry/roots.rs`), the ring's first
    /// workers for the request and the least loaded have their caches looked into (the others' views carry no
    /// summary); below `RegistryConfig::full_scan_workers` every worker's is.
    fn prefix_root(&self, _req: &RequestView<'_>, _block_size: usize) -> Option<usize> {
        None
    }

    /// Ranks the healthy workers for a request; `None` when none is healthy.
    fn choose(
        &self,
        req: &RequestView<'_>,
        workers: &[WorkerView<'_>],
        ring: &Ring,
        block_size: usize,
    ) -> Option<Decision>;
}

/// The policy a gateway, the simulator and the load generator's fleets route by unless told otherwise: the
/// tuning protocol's pick on #66's tune set (`kvgate-loadtest tune --tune-only --policy goodput --grid
/// w_decode=0.1,0.3 --grid w_evict=1 --grid w_copy=1 --grid slo_filter=false`: summed loss -84.593 against
/// `cache_aware_measured`'s -80.507, the default before it since b6aab73; docs/benchmarks/routing.md#routing-for-goodput-66).
pub const DEFAULT_POLICY: &str = "goodput";

/// Policy names accepted by `--policy`.
pub const POLICIES: [&str; 6] =
    ["cache_aware", "cache_aware_measured", "goodput", "round_robin", "least_load", "consistent_hash"];

/// Builds a policy by name.
pub fn policy_by_name(name: &str, weights: Weights) -> Option<Box<dyn RoutingPolicy>> {
    match name {
        "cache_aware" => Some(Box::new(CacheAware::new(weights))),
        "cache_aware_measured" => {
            Some(Box::new(CacheAware::with_guard(weights, hotspot::GuardKind::Measured)))
        }
        "goodput" => Some(Box::new(CacheAware::with_guard(weights, hotspot::GuardKind::Goodput))),
        "round_robin" => Some(Box::new(round_robin::RoundRobin)),
        "least_load" => Some(Box::new(least_load::LeastLoad::new(weights.per_request_tokens))),
        "consistent_hash" => Some(Box::new(consistent_hash::ConsistentHash)),
        _ => None,
    }
}

/// For each ring slot, the view of that worker (`None`: not a candidate of this request, e.g. another model's).
pub(crate) fn views_by_slot(workers: &[WorkerView<'_>], ring: &Ring) -> Vec<Option<usize>> {
    let mut of = vec![None; ring.len()];
    for (i, w) in workers.iter().enumerate() {
        if let Some(o) = of.get_mut(w.slot) {
            *o = Some(i);
        }
    }
    of
}

/// Indices of the healthy workers, in order.
pub(crate) fn healthy_indices(workers: &[WorkerView<'_>]) -> Vec<usize> {
    (0..workers.len()).filter(|i| workers[*i].healthy).collect()
}

/// Indices of healthy workers ordered by load, lightest first (ties by index).
pub(crate) fn by_load(workers: &[WorkerView<'_>], per_request_tokens: u64) -> Vec<usize> {
    let mut order = healthy_indices(workers);
    order.sort_by_key(|i| (workers[*i].load.cost(per_request_tokens), *i));
    order
}

#[cfg(test)]
mod tests;
