//! `goodput`, `cache_aware_measured` and `cache_aware`: send a request where its prefix is cached, keep sessions on
//! their ring primary, and stay away from overloaded workers; the three differ only in their guard (which policy
//! is the default, and which tune run chose it: `DEFAULT_POLICY`).
//!
//! # Formula
//! For each healthy worker `w` serving the model:
//! ```text
//! matched_fraction(w) = credited(w) / request_blocks                (0 when the prompt has no full block)
//!     device:         longest run of the request's block hashes, from the first, in w's latest device-tier Bloom
//!                     summary (at its granularity) or in this gateway's overlay of what it routed to w since that
//!                     report
//!     host, disk:     the blocks after that run which w reports in its host DRAM tier, then its SSD tier (the run
//!                     continues through any tier that holds each block; `TierMatch`); matched_blocks = all three
//!     credited:       device + credit_host * host + credit_disk * disk (a block loaded from a lower tier is
//!                     worth less than one in the device pool: loading takes time), less the prompt's shared
//!                     prefix when that prefix is cheap: if the leading
//!                     blocks other conversations share (a common system prompt, found by the ring-key sketch)
//!                     are at most free_shared_tokens long, they earn no credit (default 0: every shared prefix
//!                     is credited, and the load term keeps new conversations from piling onto the first worker
//!                     that cached a system prompt; a positive value spreads such prompts on purpose).
//! ring(w)             = 1 if w is the session's primary, 0.5 if its backup, else 0
//!     primary/backup: the first two workers on the ring walk from the session key that are healthy and either
//!                     hold the conversation already or have fewer than
//!                     cap = ceil(ring_session_bound * (conversations routed recently over all workers + 1) / workers)
//!                     (consistent hashing with bounded loads: a few unlucky keys cannot pile conversations on one
//!                     worker); a conversation routed recently keeps that worker as its primary while it is
//!                     healthy
//! cost(w)             = pending_tokens(w) + per_request_tokens * requests(w)
//!     pending_tokens: reported prefill tokens (uncomputed prompt tokens of waiting sequences, less what the
//!                     worker's cache holds for them, and of running ones still in prefill) + uncached prompt tokens
//!                     this gateway sent since the report
//!     requests:       reported waiting + running + sent since the report
//! normalized_load(w)  = cost(w) / max(max cost over healthy workers, load_floor_tokens)
//!     (the floor keeps a few hundred queued tokens from outweighing a session's ring affinity)
//! score(w)            = w_prefix * matched_fraction(w) + w_ring * ring(w) - w_load * normalized_load(w)
//! ```
//! The best score wins; exact ties are broken by the request's nonce (a hash of its number at the router).
//!
//! **Hot-spot guard** (`hotspot.rs`, formulas there): the score's winner gives the request up when another
//! worker serves it sooner by the fleet's own measurements. `uncached(w)` = prompt_tokens - saved_blocks(w) *
//! block_size, saved_blocks = device + credit_host * host + credit_disk * disk (also the predicted cached tokens
//! that price the request), here at least the cheap shared prefix's blocks (`free_shared_tokens`: counted as held
//! everywhere, since each worker computes it once; a move neither chases it nor is held back by it).
//! - `cache_aware`: #28's token thresholds (`hotspot_*` weights), the named baseline;
//! - `goodput` (#66, `goodput.rs`): the measured guard's seconds plus the decode batch the request joins, the time it
//!   adds to the streams already there, the KV it would evict, and its class's SLOs: it goes where it and the
//!   requests it affects meet their SLOs at the least cost;
//! - `cache_aware_measured`: the **measured** guard, the tuning protocol's pick of #43:
//!   predicted TTFT in seconds (the queue and its own prefill at the
//!   worker's measured cost by context, less what it drained since its report), plus the delay that prefill adds
//!   to the prompts behind it, plus the price of the cached copy a move gives up, at the utilisation the waiting
//!   queues measure; no thresholds.
//!
//! No prefix is worth queueing behind a hot spot, and a cached prefix counts for what it saves.
//!
//! Knobs ([`Weights`], live-changeable): `w_prefix` 1.0, `w_ring` 0.3, `w_load` 1.0 (chosen by the tuning
//! protocol's sweep of `w_ring` x `w_load` on the tune set, `kvgate-loadtest tune --grid w_ring=0.15,0.3,0.6 --grid
//! w_load=0.25,0.5,1.0`, docs/benchmarks/routing.md#the-tuning-protocol-43; it was 0.5), `per_request_tokens` 256,
//! `load_floor_tokens` 8192, `hotspot_abs_tokens` 1024, `hotspot_ratio` 3.0, `hotspot_waste_factor` 3.0,
//! `hotspot_copy_tokens` 24576 (only the thresholds guard reads the four `hotspot_*`: chosen by a sweep on
//! the conversation trace and the synthetic one, docs/benchmarks/log.md, which is why both are now tune-set
//! traces, loadtest/traces/sets.toml), `free_shared_tokens` 0 (every shared prefix is credited; with `w_load` the
//! joint pick of the tuning protocol, `kvgate-loadtest tune --grid free_shared_tokens=0,4096 --grid
//! w_load=0.5,0.75,1.0,1.25`; it was 4096, which kept the pile-up of new conversations on the first worker to cache a
//! short system prompt in check under `w_load` 0.5; under 1.0 the load term does that: the shared-system-prompt
//! test's max/mean is 1.02 at 2K shared tokens with 0),
//! the goodput guard's (`goodput.rs`): `w_decode` 0.3, `w_evict` 1.0, `w_copy` 1.0, `slo_filter` false (the tuning
//! protocol's pick of #66, `kvgate-loadtest tune --tune-only --policy goodput --grid w_decode=0.1,0.3 --grid
//! w_evict=1 --grid w_copy=1 --grid slo_filter=false` after the forms in docs/benchmarks/routing.md), and
//! `decode_horizon_tokens` 1024 (not tuned),
//! `credit_host` 0.7, `credit_disk` 0.3 (the tier credits: roughly what a load from that tier saves against a
//! device hit, before the load-vs-recompute measurements of the KV tiers tune them), `ring_session_bound` 1.1 (chosen on the Mooncake replay and the
//! multi-turn demo, docs/benchmarks/log.md: with 16384 / 4.0 users sharing a system prompt all piled onto the first worker that
//! cached it). Every term is logged at debug.

use serde::{Deserialize, Serialize};

use super::goodput::Goodput;
use super::hotspot::{GuardKind, Inputs, Predicted};
use super::{Decision, RequestView, Ring, RouteReason, RoutingPolicy, ScoreTerms, TierMatch, WorkerView};

/// Scoring weights and thresholds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Weights {
    pub w_prefix: f64,
    pub w_ring: f64,
    pub w_load: f64,
    /// Tokens one queued or running request counts for in `cost`.
    pub per_request_tokens: u64,
    /// Smallest denominator of the load normalisation.
    pub load_floor_tokens: u64,
    /// Wait a hot-spot move must save at least, in tokens.
    pub hotspot_abs_tokens: u64,
    /// A move that gives up no cached tokens and may split a prompt family: the winner's queue over the target's.
    pub hotspot_ratio: f64,
    /// Tokens of wait a hot-spot move must save per cached token it gives up, on an idle fleet (>= 0).
    pub hotspot_waste_factor: f64,
    /// Wait a hot-spot move that gives up cached tokens must save beyond that, in tokens.
    pub hotspot_copy_tokens: u64,
    /// A prefix shared by other conversations earns no prefix credit up to this many tokens (0: always credited).
    pub free_shared_tokens: u64,
    /// A ring primary holds at most this times the mean number of recent conversations (>= 1; a large value turns
    /// the bound off).
    pub ring_session_bound: f64,
    /// What a matched block in the worker's host DRAM tier counts for, against 1 in its device pool (0..=1).
    pub credit_host: f64,
    /// The same for its SSD tier (0..=1).
    pub credit_disk: f64,
    /// The goodput guard's weight of the decode terms (its decode time, what it adds to the others' and its
    /// prefill's stall of theirs) against the prefill terms (>= 0; `goodput.rs`).
    pub w_decode: f64,
    /// The most output tokens the goodput guard prices a request's decode by (>= 1).
    pub decode_horizon_tokens: u64,
    /// The goodput guard's weights of the KV it would evict where it goes (>= 0), and of the copy a move leaves
    /// (the measured guard's term; >= 0).
    pub w_evict: f64,
    pub w_copy: f64,
    /// The goodput guard moves a request off a winner that misses its SLOs to a worker that meets them, whatever
    /// the cost (false: by cost alone).
    pub slo_filter: bool,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            w_prefix: 1.0,
            w_ring: 0.3,
            w_load: 1.0,
            per_request_tokens: super::Load::DEFAULT_PER_REQUEST_TOKENS,
            load_floor_tokens: 8192,
            hotspot_abs_tokens: 1024,
            hotspot_ratio: 3.0,
            hotspot_waste_factor: 3.0,
            hotspot_copy_tokens: 24576,
            free_shared_tokens: 0,
            ring_session_bound: 1.1,
            credit_host: 0.7,
            credit_disk: 0.3,
            w_decode: 0.3,
            decode_horizon_tokens: 1024,
            w_evict: 1.0,
            w_copy: 1.0,
            slo_filter: false,
        }
    }
}

impl Weights {
    /// Every problem with the values.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        let non_negative = [
            ("w_prefix", self.w_prefix),
            ("w_ring", self.w_ring),
            ("w_load", self.w_load),
            ("hotspot_waste_factor", self.hotspot_waste_factor),
            ("w_decode", self.w_decode),
            ("w_evict", self.w_evict),
            ("w_copy", self.w_copy),
        ];
        for (name, v) in non_negative {
            if !v.is_finite() || v < 0.0 {
                p.push(format!("{name} must be a finite number >= 0, got {v}"));
            }
        }
        for (name, v) in [("credit_host", self.credit_host), ("credit_disk", self.credit_disk)] {
            if !(0.0..=1.0).contains(&v) {
                p.push(format!("{name} must be a number in 0..=1, got {v}"));
            }
        }
        if self.decode_horizon_tokens == 0 {
            p.push("decode_horizon_tokens must be at least 1".into());
        }
        if !self.hotspot_ratio.is_finite() || self.hotspot_ratio < 1.0 {
            p.push(format!("hotspot_ratio must be >= 1, got {}", self.hotspot_ratio));
        }
        if !self.ring_session_bound.is_finite() || self.ring_session_bound < 1.0 {
            p.push(format!(
                "ring_session_bound must be a finite number >= 1, got {}",
                self.ring_session_bound
            ));
        }
        p
    }
}

/// Blocks of a cheap shared prefix: matched, but not credited (see the formula).
fn free_blocks(req: &RequestView<'_>, w: &Weights, block_size: usize) -> usize {
    if req.shared_blocks * block_size <= w.free_shared_tokens as usize {
        req.shared_blocks
    } else {
        0
    }
}

/// The default policy.
pub struct CacheAware {
    weights: std::sync::RwLock<Weights>,
    guard: GuardKind,
}

impl CacheAware {
    /// With the thresholds guard (`cache_aware`).
    pub fn new(weights: Weights) -> Self {
        Self::with_guard(weights, GuardKind::Thresholds)
    }

    /// With either guard (`GuardKind::Measured`: `cache_aware_measured`).
    pub fn with_guard(weights: Weights, guard: GuardKind) -> Self {
        Self { weights: std::sync::RwLock::new(weights), guard }
    }

    pub fn weights(&self) -> Weights {
        *self.weights.read().unwrap_or_else(|e| e.into_inner())
    }
}

impl RoutingPolicy for CacheAware {
    fn name(&self) -> &'static str {
        match self.guard {
            GuardKind::Thresholds => "cache_aware",
            GuardKind::Measured => "cache_aware_measured",
            GuardKind::Goodput => "goodput",
        }
    }

    fn set_weights(&self, w: Weights) {
        *self.weights.write().unwrap_or_else(|e| e.into_inner()) = w;
    }

    fn prefix_root(&self, req: &RequestView<'_>, block_size: usize) -> Option<usize> {
        let free = free_blocks(req, &self.weights(), block_size);
        (free < req.hashes.len()).then_some(free)
    }

    fn choose(
        &self,
        req: &RequestView<'_>,
        workers: &[WorkerView<'_>],
        ring: &Ring,
        block_size: usize,
    ) -> Option<Decision> {
        let w = self.weights();
        let healthy = super::healthy_indices(workers);
        if healthy.is_empty() {
            return None;
        }
        // Bounded loads: a primary or backup holds the conversation already or has room under the cap.
        let conversations: usize = healthy.iter().map(|i| workers[*i].sessions).sum();
        let cap = (w.ring_session_bound * (conversations + 1) as f64 / healthy.len() as f64).ceil() as usize;
        let view_of = super::views_by_slot(workers, ring);
        let view = |slot: usize| view_of.get(slot).copied().flatten().map(|v| &workers[v]);
        let (bounded, next) = ring.primary_backup_slots(req.session_key, |s| {
            view(s).is_some_and(|x| x.healthy && (x.holds_session || x.sessions < cap))
        });
        // A conversation keeps its home while that worker is healthy, even where the cap has since moved the
        // ring walk's first choice elsewhere.
        // (Only when some worker holds it: a ring walk for a new conversation would visit every node.)
        let holds = |i: &&usize| workers[**i].holds_session;
        let held = ring.first_held(
            req.session_key,
            healthy.iter().filter(holds).count(),
            healthy.iter().filter(holds).map(|i| workers[*i].slot),
            |s| view(s).is_some_and(|x| x.healthy && x.holds_session),
        );
        let (primary, backup) = match held {
            Some(h) if bounded != Some(h) => (Some(h), bounded),
            _ => (bounded, next),
        };
        let max_cost = healthy
            .iter()
            .map(|i| workers[*i].load.cost(w.per_request_tokens))
            .max()
            .unwrap_or(0)
            .max(w.load_floor_tokens);
        let n_blocks = req.hashes.len();
        let free_blocks = free_blocks(req, &w, block_size);
        // What a match saves, in blocks: a lower tier's blocks count at their credit (a worker may load them
        // slowly, or compute them again when that is faster).
        let saved_blocks = |t: &TierMatch| {
            t.device as f64 + w.credit_host * t.host() as f64 + w.credit_disk * t.disk() as f64
        };
        let mut rows: Vec<Row> = Vec::with_capacity(workers.len());
        // The prompt tokens each view would still prefill, a cheap shared prefix counted as held (the guards').
        let mut uncached_of: Vec<u64> = Vec::with_capacity(workers.len());
        let mut scored: Vec<(f64, u64, usize)> = Vec::with_capacity(healthy.len());
        for (i, wk) in workers.iter().enumerate() {
            let tiers = if wk.healthy { wk.tier_match(req.hashes) } else { TierMatch::default() };
            // Blocks of [from, to) past the free shared prefix.
            let past_free = |from: usize, to: usize| to.saturating_sub(from.max(free_blocks)) as f64;
            let credited = past_free(0, tiers.device)
                + w.credit_host * past_free(tiers.device, tiers.through_host)
                + w.credit_disk * past_free(tiers.through_host, tiers.through_disk);
            let matched_fraction = if n_blocks == 0 { 0.0 } else { credited / n_blocks as f64 };
            let ring_term = if primary == Some(wk.slot) {
                1.0
            } else if backup == Some(wk.slot) {
                0.5
            } else {
                0.0
            };
            let cost = wk.load.cost(w.per_request_tokens);
            let normalized_load = if max_cost == 0 { 0.0 } else { cost as f64 / max_cost as f64 };
            let score = w.w_prefix * matched_fraction + w.w_ring * ring_term - w.w_load * normalized_load;
            tracing::debug!(
                worker = wk.id,
                healthy = wk.healthy,
                matched = tiers.through_disk,
                device = tiers.device,
                host = tiers.host(),
                disk = tiers.disk(),
                matched_fraction,
                ring = ring_term,
                cost,
                normalized_load,
                score,
                "cache_aware score"
            );
            if wk.healthy {
                // Tie-break key: a per-request permutation of workers.
                let tie = (i as u64 ^ req.nonce()).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                scored.push((score, tie, i));
            }
            // The prefill the request would still need here, for the hot-spot guard: a cheap shared prefix counts
            // as held everywhere (each worker computes it once, and the score does not credit it), so that no move
            // chases it and none is held back by it.
            let saved = saved_blocks(&tiers).max(free_blocks as f64);
            let uncached = req.prompt_tokens.saturating_sub((saved * block_size as f64) as usize) as u64;
            rows.push(Row { tiers, matched_fraction, ring: ring_term, normalized_load, score });
            uncached_of.push(uncached);
        }
        let mut ranked = rank(scored);
        let winner = ranked[0];
        let row = &rows[winner];
        let mut reason =
            if row.matched_fraction > 0.0 && row.matched_fraction * w.w_prefix >= row.ring * w.w_ring {
                RouteReason::Prefix
            } else if row.ring == 1.0 {
                RouteReason::Primary
            } else if row.ring == 0.5 {
                RouteReason::Backup
            } else {
                RouteReason::Load
            };
        let guard = Inputs {
            w: &w,
            workers,
            healthy: &healthy,
            uncached: &uncached_of,
            prompt_tokens: req.prompt_tokens as u64,
            hub_shared: req.shared_blocks > 0,
            output_tokens: req.output_tokens,
            slo: req.slo,
            fleet: Default::default(),
        };
        let (target, predicted, goodput) = guard_target(self.guard, &guard, winner);
        if let Some(target) = target {
            ranked.retain(|i| *i != target);
            ranked.insert(0, target);
            reason = RouteReason::Load;
        }
        let predicted_cached_tokens =
            (saved_blocks(&rows[ranked[0]].tiers) * block_size as f64).round() as usize;
        // Every worker's terms, in view order; past FULL_RANK workers only the ranked best's, best first.
        let shown: Vec<usize> = if workers.len() <= FULL_RANK {
            (0..workers.len()).collect()
        } else {
            ranked.iter().copied().take(RANKED).collect()
        };
        let terms = shown
            .into_iter()
            .map(|i| {
                let (wk, r) = (&workers[i], &rows[i]);
                ScoreTerms {
                    worker: wk.id.to_owned(),
                    healthy: wk.healthy,
                    matched_blocks: r.tiers.through_disk,
                    tiers: r.tiers,
                    prefix_signal: wk.prefix_signal,
                    matched_fraction: r.matched_fraction,
                    ring: r.ring,
                    load: wk.load,
                    normalized_load: r.normalized_load,
                    score: r.score,
                    predicted_s: predicted.as_ref().map_or(0.0, |p| p[i].j_s),
                    predicted_ttft_s: predicted.as_ref().map_or(0.0, |p| p[i].ttft_s),
                    predicted_tpot_s: goodput.as_ref().map_or(0.0, |g| g[i].tpot_s),
                    goodput_cost_s: goodput.as_ref().map_or(0.0, |g| g[i].cost_s),
                    meets_slo: goodput.as_ref().map(|g| g[i].meets),
                }
            })
            .collect();
        Some(Decision { ranked, reason, predicted_cached_tokens, terms })
    }
}

/// The guard's move, if any, with the seconds it predicted per view (measured and goodput guards) and the goodput
/// guard's figures.
fn guard_target(
    kind: GuardKind,
    guard: &Inputs<'_>,
    winner: usize,
) -> (Option<usize>, Option<Vec<Predicted>>, Option<Vec<Goodput>>) {
    match kind {
        GuardKind::Thresholds => (guard.thresholds_target(winner), None, None),
        GuardKind::Measured => {
            let p = guard.predicted_s();
            (guard.measured_target(winner, &p), Some(p), None)
        }
        GuardKind::Goodput => {
            let (p, g) = guard.goodput();
            (guard.goodput_target(winner, &g), Some(p), Some(g))
        }
    }
}

/// Fleets up to this many workers get every worker ranked and every worker's terms.
const FULL_RANK: usize = 64;
/// Past [`FULL_RANK`], the best this many are ranked in order (the rest follow unordered) and shown.
const RANKED: usize = 16;

/// One worker's terms while deciding.
struct Row {
    tiers: TierMatch,
    matched_fraction: f64,
    ring: f64,
    normalized_load: f64,
    score: f64,
}

/// Best first: (score, tie-break, view) ordered by score, then tie-break; in full up to [`FULL_RANK`], else the best
/// [`RANKED`] in order and the rest after them.
fn rank(mut scored: Vec<(f64, u64, usize)>) -> Vec<usize> {
    let cmp = |a: &(f64, u64, usize), b: &(f64, u64, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if scored.len() > FULL_RANK {
        scored.select_nth_unstable_by(RANKED - 1, cmp);
        scored[..RANKED].sort_by(cmp);
    } else {
        scored.sort_by(cmp);
    }
    scored.into_iter().map(|s| s.2).collect()
}
