//! Where a LoRA adapter request runs: on a worker that holds its adapter, or on one that loads it first. The
//! gateway asks before routing an adapter request ([`place`]); the routing policy then chooses among the holders
//! (its prefix, ring and load terms, `route.rs` keeping the candidates to the holders), or the gateway loads the
//! adapter on the worker chosen here and sends the request there.
//!
//! # The cost of running the request on worker `w` (seconds, a time-to-first-token estimate)
//! ```text
//! cost(w)   = queue(w) + prefill(w) + load(w) + evict(w)
//! queue(w)  = load.cost(per_request_tokens) / rate(w)          the work ahead of it
//! prefill(w)= (prompt - cached(w)) / rate(w)                    cached: the prefix w holds *for this adapter*
//!                                                               (whether or not its weights are resident now)
//! load(w)   = 0 if w holds the adapter, else its measured load seconds (the fleet's mean before it has one,
//!             `PlaceConfig::default_load_s` before any)
//! evict(w)  = load(w) if w does not hold it and every adapter slot of w is taken (the adapter it unloads will
//!             cost a load again), else 0
//! rate(w)   = its measured prefill tokens/s, else `PlaceConfig::default_prefill_tokens_per_s`
//! ```
//! The cheapest worker wins, except that a copy beside holders must save at least `PlaceConfig::spread_gain_s`
//! (a copy takes a slot for as long as it is used, so a passing queue of a request or two is not worth one). A
//! holder winning: [`Choice::Holders`] (the policy routes among the holders). A worker that must load winning:
//! [`Choice::Load`], `cold` when nobody holds the adapter, `hot` when its holders are so busy that a copy elsewhere
//! is cheaper by that margin, load included (spreading a hot adapter); only adapters the gateway knows how to load
//! (its catalogue) are loaded. A cold adapter that cannot be loaded: [`Choice::Nowhere`].
//! Cold adapters are unloaded by the workers themselves, least recently used first, when a load needs the slot;
//! `evict` prices that.
//!
//! Candidates: healthy workers of the base model that hold the adapter or may load it (slots not 0, no failed load
//! of it within `FAILED_LOAD_BACKOFF`), within the request's subset. Every term is in the result (explain shows
//! them; the gateway logs them at debug).

use std::time::Instant;

use serde::Serialize;

use crate::input::RouteInput;
use crate::registry::{Registry, WorkerRef};

/// Knobs of the cost (the gateway's `--lora-*` settings).
#[derive(Clone, Copy, Debug)]
pub struct PlaceConfig {
    /// Load seconds assumed before any load was measured.
    pub default_load_s: f64,
    /// Prefill rate assumed for a worker that never measured one (a pod without reports).
    pub default_prefill_tokens_per_s: f64,
    /// Tokens a queued or running request counts for (`Load::cost`).
    pub per_request_tokens: u64,
    /// Least a copy of an adapter beside its holders must save on the request's cost, seconds.
    pub spread_gain_s: f64,
}

impl Default for PlaceConfig {
    /// 0.5 s a load (a PEFT adapter of a 7-8B model read from local disk), 4,096 tokens/s, 256 tokens a request,
    /// a copy when it saves 1 s.
    fn default() -> Self {
        Self {
            default_load_s: DEFAULT_LOAD_S,
            default_prefill_tokens_per_s: DEFAULT_PREFILL_TOKENS_PER_S,
            per_request_tokens: crate::routing::Load::DEFAULT_PER_REQUEST_TOKENS,
            spread_gain_s: DEFAULT_SPREAD_GAIN_S,
        }
    }
}

/// Load seconds assumed before any load was measured.
pub const DEFAULT_LOAD_S: f64 = 0.5;
/// Prefill tokens per second assumed for a worker that never measured its own.
pub const DEFAULT_PREFILL_TOKENS_PER_S: f64 = 4096.0;
/// Least a copy beside the holders must save, seconds (chosen from the cost's units, a load's order of magnitude;
/// not tuned on the benchmark workloads).
pub const DEFAULT_SPREAD_GAIN_S: f64 = 1.0;

/// One candidate's terms.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlaceTerms {
    pub worker: String,
    pub holds: bool,
    /// Every adapter slot is taken: a load unloads another adapter.
    pub full: bool,
    pub queue_s: f64,
    pub prefill_s: f64,
    pub load_s: f64,
    pub evict_s: f64,
    pub cost_s: f64,
}

/// What [`place`] chose.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "choice", rename_all = "snake_case")]
pub enum Choice {
    /// Route among the workers holding the adapter.
    Holders,
    /// Load the adapter on this worker, then send the request there.
    Load {
        #[serde(skip)]
        wref: WorkerRef,
        worker: String,
        url: String,
        /// `cold` (no worker holds it) or `hot` (a copy beside busy holders).
        reason: &'static str,
    },
    /// No worker holds it and none may load it.
    Nowhere,
}

/// The choice and every candidate's terms, cheapest first.
#[derive(Clone, Debug, Serialize)]
pub struct Placement {
    pub adapter: String,
    #[serde(flatten)]
    pub choice: Choice,
    pub terms: Vec<PlaceTerms>,
}

/// Where the adapter request `input` (`input.adapter` set) runs; `loadable`: the gateway can load the adapter
/// (its catalogue names it). `None` for a request without an adapter.
pub fn place(
    reg: &Registry,
    input: &RouteInput<'_>,
    loadable: bool,
    cfg: &PlaceConfig,
    now: Instant,
) -> Option<Placement> {
    let adapter = input.adapter?;
    let (views, index) = reg.views(input.model, input.hashes, Some(input.session_key), now);
    let default_load = reg.fleet_load_s().unwrap_or(cfg.default_load_s);
    let mut scored: Vec<(usize, PlaceTerms)> = Vec::new();
    for (v, &i) in views.iter().zip(&index) {
        let w = &reg.workers()[i];
        let holds = w.lora.holds(adapter, now);
        let in_subset = input.allows(&w.url);
        if !v.healthy || !in_subset || !(holds || (loadable && w.lora.may_load(adapter, now))) {
            continue;
        }
        let rate = match v.speed.prefill_tokens_per_s {
            r if r > 0.0 && r.is_finite() => r,
            _ => cfg.default_prefill_tokens_per_s,
        };
        // The prefix held for this adapter counts on a worker whose adapter weights were unloaded too: its blocks
        // stay cached under the adapter's key, so loading the adapter there again may beat computing elsewhere.
        let cached = v.tier_match(input.hashes).through_disk * input.block_size;
        let full = !holds && w.lora.full(now);
        let load_s = if holds { 0.0 } else { w.lora.load_s.unwrap_or(default_load) };
        let evict_s = if full { load_s } else { 0.0 };
        let queue_s = v.load.cost(cfg.per_request_tokens) as f64 / rate;
        let prefill_s = input.prompt_tokens.saturating_sub(cached) as f64 / rate;
        let cost_s = queue_s + prefill_s + load_s + evict_s;
        let terms =
            PlaceTerms { worker: w.id.clone(), holds, full, queue_s, prefill_s, load_s, evict_s, cost_s };
        tracing::debug!(adapter, ?terms, "adapter placement terms");
        scored.push((i, terms));
    }
    scored.sort_by(|a, b| a.1.cost_s.total_cmp(&b.1.cost_s).then(b.1.holds.cmp(&a.1.holds)));
    let best_holder = scored.iter().find(|(_, t)| t.holds).map(|(_, t)| t.cost_s);
    let any_holder = best_holder.is_some();
    let spread_pays = |t: &PlaceTerms| best_holder.is_none_or(|h| t.cost_s + cfg.spread_gain_s < h);
    let choice = match scored.first() {
        None => Choice::Nowhere,
        Some((_, t)) if t.holds || !spread_pays(t) => Choice::Holders,
        Some(&(i, ref t)) => match reg.worker_ref(i) {
            Some(wref) => Choice::Load {
                wref,
                worker: t.worker.clone(),
                url: reg.workers()[i].url.clone(),
                reason: if any_holder { "hot" } else { "cold" },
            },
            None => Choice::Nowhere,
        },
    };
    Some(Placement {
        adapter: adapter.to_owned(),
        choice,
        terms: scored.into_iter().map(|(_, t)| t).collect(),
    })
}

#[cfg(test)]
#[path = "placement_tests.rs"]
mod tests;
