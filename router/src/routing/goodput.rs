//! The goodput guard of `cache_aware` (`goodput`, #66): the measured guard's seconds (`hotspot.rs`), plus what a
//! request costs the decode batch it joins and the KV of the sessions that live where it goes, and whether it
//! meets its class's SLOs there. The score (prefix + ring - load) names a winner; this guard moves the request
//! when another worker serves it, and the requests it affects, at a lower cost.
//!
//! ```text
//! out        = the output it will probably produce (RequestView::output_tokens: the class's learned output,
//!              capped by max_tokens), at most decode_horizon_tokens, at least 1
//! ctx        = prompt_tokens + out / 2                   (its mean context while it decodes)
//! b(w)       = requests at w (waiting, running, sent since its report): the batch it decodes in
//! d(w)       = w's decoding sequences (its last report): the streams its prefill stalls
//! K(w)       = KV tokens w's pool holds for running sequences (total - free), else b(w) x ctx
//! step(w)    = base + per_seq x (b + 1) + per_kv x (K + ctx)        w's decode fit (StepTiming::decode_*, or a
//!                                                                    pod's scraped one), else the fleet's mean
//!                                                                    fit, else no decode terms
//! tpot(w)    = step(w) / (1 - stall(w))                 stall: the share prefill chunks add to w's decode steps
//! delta(w)   = (per_seq + per_kv x ctx) / (1 - stall)   what it adds to each other stream's token time there
//! decode(w)  = out x tpot(w) + b(w) x out x delta(w)    its own decode time, and the time it adds to the others
//! stall_s(w) = d(w) x own(w)                            its prefill (own, hotspot.rs) delays each decoding stream
//! need(w)    = uncached(w) + out                        KV tokens it takes there
//! room(w)    = min(free, total - cached)                tokens free and holding no cached prefix (an estimate:
//!                                                       free includes cached-but-unused blocks)
//! evict(w)   = price x max(0, need - room) / (1 - util_fleet)^2
//!              price: the fleet's seconds per token of computing this prompt from scratch; the prefixes it
//!              displaces are computed again when their sessions come back, at the fleet's utilisation (the
//!              measured guard's copy term, for the evictions the target and the winner both cause)
//! cost(w)    = J(w) + w_decode x (decode(w) + stall_s(w)) + w_evict x evict(w)   (J: TTFT + delay, hotspot.rs)
//! total(w)   = cost(w) + w_copy x copy(w)               copy: the measured guard's price of the copy a move from
//!                                                       the winner leaves (hotspot.rs); 0 at the winner
//! meets(w)   = ttft(w) <= slo.ttft_bound(prompt) and tpot(w) <= slo.tpot_ms
//! ```
//! The request moves from the score's winner to the worker of least `total` when that is strictly less than the
//! winner's `cost`. With `slo_filter` the candidates are first narrowed to those that meet the SLOs (when any
//! does) and a winner that misses them always gives way; the tune set chose it off (docs/benchmarks/routing.md:
//! a hard filter moves requests off their cache whenever the holder is predicted to miss, and the prefill that
//! costs makes the fleet miss more). The pool's free KV is a cost (`evict`), never a filter: a request that does
//! not fit waits there, it does not preempt. A pod that sends no reports has the gateway's fit of its scraped inter-token
//! latency against its running requests (`registry::PodDecode`: no per-KV-token term; its prefill stalls are in
//! `base`, so `stall` is 0) and its scraped capacity and usage as its pool (nothing counted cached); a worker with
//! neither is priced by the fleet's mean fit and taken to have room.
//!
//! Invariants: every term is finite and >= 0 whatever a report says (fits clamped like the prefill's); only
//! healthy workers are targets; every term is logged at debug and shown by explain (`ScoreTerms`).

use kvgate_shared::report::attention_area;

use super::hotspot::{Inputs, Predicted};

/// Largest decode-fit coefficients believed (seconds): a step's base, per sequence, per KV token. A report past
/// them is clamped (a hostile worker cannot make every other worker look free).
const MAX_DECODE_BASE_S: f64 = 10.0;
const MAX_DECODE_PER_SEQ_S: f64 = 1.0;
const MAX_DECODE_PER_KV_S: f64 = 1e-3;
/// Most of a decode step's time prefill chunks are believed to add.
const MAX_STALL: f64 = 0.9;

/// A decode step's cost: seconds = base + per_seq x batch + per_kv x context tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Decode {
    base: f64,
    per_seq: f64,
    per_kv: f64,
}

/// The goodput guard's figures for one view (explain shows them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Goodput {
    /// Its predicted time per output token there, s (0: no decode fit known).
    pub tpot_s: f64,
    /// `cost(w)`, s.
    pub cost_s: f64,
    /// It meets the request's SLOs there (TTFT and TPOT, as predicted).
    pub meets: bool,
    /// What the guard filters by: `meets`, or true without `slo_filter`.
    pub fits: bool,
}

impl Inputs<'_> {
    /// A view's decode fit, clamped (`None`: it reports none).
    fn decode_of(&self, i: usize) -> Option<Decode> {
        let s = &self.workers[i].speed;
        let ok = |v: f64, max: f64| if v.is_finite() && v > 0.0 { v.min(max) } else { 0.0 };
        let d = Decode {
            base: ok(s.decode_base_s, MAX_DECODE_BASE_S),
            per_seq: ok(s.decode_per_seq_s, MAX_DECODE_PER_SEQ_S),
            per_kv: ok(s.decode_per_kv_token_s, MAX_DECODE_PER_KV_S),
        };
        (d != Decode::default()).then_some(d)
    }

    /// Each view's decode fit (`None`: unhealthy, or it reports none) and the fleet's mean over the healthy views
    /// that report one.
    fn decodes(&self) -> (Vec<Option<Decode>>, Option<Decode>) {
        self.per_view_and_mean(
            |i| self.decode_of(i),
            |d| [d.base, d.per_seq, d.per_kv],
            |[base, per_seq, per_kv]| Decode { base, per_seq, per_kv },
        )
    }

    /// Every view's measured seconds ([`Inputs::predicted_s`]) and goodput figures (formula above; defaults for
    /// unhealthy views), in one pass.
    pub fn goodput(&self) -> (Vec<Predicted>, Vec<Goodput>) {
        let w = self.w;
        let (fits, fleet) = self.decodes();
        let out = (self.output_tokens.min(w.decode_horizon_tokens)).max(1) as f64;
        let ctx = self.prompt_tokens as f64 + out / 2.0;
        let prompt = self.prompt_tokens.max(1);
        let price = self.fleet_cost().secs(prompt, attention_area(0, prompt)) / prompt as f64;
        let busy = self.fleet_util();
        let evict_price = price / ((1.0 - busy) * (1.0 - busy));
        let (ttft_bound, tpot_bound) =
            (self.slo.ttft_bound_s(self.prompt_tokens as usize), self.slo.tpot_bound_s());
        let n = self.workers.len();
        let (mut ps, mut gs) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n {
            let p = self.predicted_one(i);
            ps.push(p);
            let wk = &self.workers[i];
            if !wk.healthy {
                gs.push(Goodput::default());
                continue;
            }
            let s = &wk.speed;
            let b = wk.load.requests as f64;
            let (total, free, cached) =
                (s.kv_total_tokens, s.kv_free_tokens.min(s.kv_total_tokens), s.kv_cached_tokens);
            let known_kv = total > 0;
            let held = if known_kv { (total - free) as f64 } else { b * ctx };
            let stall = if s.stall_ratio.is_finite() { s.stall_ratio.clamp(0.0, MAX_STALL) } else { 0.0 };
            let (tpot, decode) = match fits[i].or(fleet) {
                Some(d) => {
                    let tpot = (d.base + d.per_seq * (b + 1.0) + d.per_kv * (held + ctx)) / (1.0 - stall);
                    let delta = (d.per_seq + d.per_kv * ctx) / (1.0 - stall);
                    (tpot, out * tpot + b * out * delta)
                }
                None => (0.0, 0.0),
            };
            let stall_s = s.decoding as f64 * p.own_s;
            let need = self.uncached[i] as f64 + out;
            let evict = if known_kv {
                let room = free.min(total.saturating_sub(cached)) as f64;
                evict_price * (need - room).max(0.0)
            } else {
                0.0
            };
            let cost = p.j_s + w.w_decode * (decode + stall_s) + w.w_evict * evict;
            let meets = p.ttft_s <= ttft_bound && tpot <= tpot_bound;
            let fits = meets || !w.slo_filter;
            tracing::debug!(
                worker = wk.id,
                out,
                batch = b,
                decoding = s.decoding,
                tpot,
                decode,
                stall_s,
                evict,
                cost,
                meets,
                "goodput guard"
            );
            gs.push(Goodput {
                tpot_s: tpot,
                cost_s: if cost.is_finite() { cost } else { f64::MAX },
                meets,
                fits,
            });
        }
        (ps, gs)
    }

    /// The goodput guard's target (`g`: [`Inputs::goodput`]): the least `total` (among the views that meet the SLOs
    /// under `slo_filter`), when it beats the winner (see the module docs).
    pub fn goodput_target(&self, winner: usize, g: &[Goodput]) -> Option<usize> {
        let any_fits = self.healthy.iter().any(|i| g[*i].fits);
        let pool = self.healthy.iter().copied().filter(|i| g[*i].fits || !any_fits);
        let copy = self.copy_from(winner);
        let (total_target, target) = self.least_among(pool, |i| g[i].cost_s + self.w.w_copy * copy(i))?;
        let moves =
            target != winner && ((g[target].fits && !g[winner].fits) || total_target < g[winner].cost_s);
        tracing::debug!(
            winner = self.workers[winner].id,
            target = self.workers[target].id,
            cost_winner = g[winner].cost_s,
            cost_target = g[target].cost_s,
            meets_winner = g[winner].meets,
            moves,
            "goodput guard"
        );
        moves.then_some(target)
    }
}

#[cfg(test)]
#[path = "goodput_tests.rs"]
mod tests;
