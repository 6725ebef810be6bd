//! The hot-spot guard of `cache_aware`: whether the score's winner is too busy to take the request, and where it
//! goes instead. Two guards, chosen by policy name. The tuning protocol (`kvgate-loadtest tune`, the tune set of
//! loadtest/traces/sets.toml; figures in docs/benchmarks/routing.md#the-tuning-protocol-43) picks `measured` since
//! 59863c4 (summed tune-set loss -28.140 against -27.612; on the test set -26.237 against -25.200, 2026-12-06), and
//! `cache_aware_measured` is the default policy since 28b45d8 (`DEFAULT_POLICY`).
//!
//! **`measured`** (`cache_aware_measured`): the request goes where the fleet predicts it is served soonest, in
//! seconds, from what the workers measure, counting what the choice costs the requests after it:
//! ```text
//! cost(w, n, A) = a(w) x n + b(w) x A          seconds to prefill n tokens of attention area A
//!                                              (A of n tokens after s held = n x (s + n/2): causal attention)
//!             a, b = w's fit of its prefill-carrying steps (StepTiming::prefill_per_token_s, _attention_s),
//!             else (1 / its measured token rate, 0), else the fleet's mean of those, else (1, 0) (every term is
//!             then in tokens: same choice when speeds are equal)
//! util(w)   = L(w) / (1 + L(w)), capped at MAX_BUSY   L(w) = requests at w with no first token yet: reported
//!                                                       waiting and running still in prefill, plus sent since.
//!                                                       A single queue (M/M/1) at utilisation rho holds
//!                                                       rho / (1 - rho) requests in system, so L says rho is
//!                                                       L / (1 + L). (The busy share of the last interval is
//!                                                       not a utilisation in that sense: one long prompt keeps
//!                                                       a worker busy for the whole interval with nothing
//!                                                       behind it.)
//! age(w)    = seconds since w's last report
//! own(w)    = cost(w, uncached(w), area of those tokens after what w holds)   (this request's prefill there;
//!                                                       uncached counts lower-tier blocks at their credit, and a
//!                                                       cheap shared prefix as held)
//! queue(w)  = max(0, cost(w, pending_tokens(w), pending_area(w)) - age(w))   (the prefill queued ahead of it:
//!                                                       reported plus sent since, less what w drained since)
//! delay(w)  = own(w) x util(w) / (1 - util(w))         (what it adds to the prompts that queue behind it while
//!                                                       it computes: a single queue at that utilisation; the
//!                                                       ones already queued run first and lose nothing)
//! J(w)      = queue(w) + own(w) + delay(w)             (its predicted TTFT there, queue + own, plus that delay;
//!                                                       explain shows both)
//! copy(w)   = cost_fleet(waste(w), its area) / (1 - util_fleet)^2
//!             waste(w) = max(0, uncached(w) - uncached(winner)), the same tokens at the same positions
//!             util_fleet = L / (1 + L) for L the fleet's mean queue, capped; cost_fleet: the fleet's mean a, b
//!             (a move that gives up cached tokens leaves a second copy: as many tokens of other prefixes are
//!              displaced at w and computed again when next asked for, priced as if they will be. That work
//!              cannot be routed around (it follows its prefix's cache), so it costs what a unit of added work
//!              costs a queue at the fleet's mean utilisation: 1 / (1 - util)^2 seconds of waiting, summed over
//!              all requests, per second of work (M/M/1: the mean number in system rho / (1 - rho) grows by
//!              1 / (1 - rho)^2 per unit of load). `delay` keeps the snapshot form: the requests that would arrive
//!              behind this prefill later are routed elsewhere while w is busy with it. The fleet's figures are
//!              the means over healthy workers)
//! ```
//! The request moves from the score's winner to the worker of least `J + copy` when that is strictly less than the
//! winner's `J` (ties stay). There is no threshold: recomputing is cheap on an idle fleet and dear on a busy one
//! because the queues say so. Running decode streams are not in `queue` (chunked prefill runs beside them; the
//! split decision weighs their stall). A worker that has measured nothing gets the fleet's mean cost, so a pod
//! without reports is judged by its queue in tokens at the fleet's speed.
//!
//! **`thresholds`** (`cache_aware`, the named baseline: the guard of #28): work ahead in tokens,
//! `ahead(w) = cost(w) + uncached(w)`, `waste(w) = max(0, uncached(w) - uncached(winner))`, `k =
//! hotspot_waste_factor x (1 + min cost / load_floor_tokens)`, target = least `ahead + k x waste`, `gain =
//! ahead(winner) - ahead(target)`; it moves when the move gives up cached tokens and `gain > hotspot_abs_tokens +
//! k x waste + hotspot_copy_tokens`; gives up none after a shared prefix and `gain > hotspot_abs_tokens`; gives up
//! none otherwise and `cost(winner) > hotspot_ratio x cost(target) + hotspot_abs_tokens`. Its four parameters
//! were swept on the Mooncake synthetic and conversation traces (docs/benchmarks/log.md), which are tune-set
//! traces now.
//!
//! Invariants: only healthy workers are targets; every measured input is clamped (a hostile or absent speed
//! cannot make a time NaN, infinite or negative); every term is logged at debug.

use serde::{Deserialize, Serialize};

use kvgate_shared::report::attention_area;

use super::{Weights, WorkerView};
pub use crate::split::cost_model::MAX_ATTENTION_S;
use crate::split::cost_model::{own_fit, MAX_BUSY, MIN_PREFILL_TOKENS_PER_S};

/// The utilisation at which a single queue (M/M/1) holds `waiting` requests on average: `L / (1 + L)`.
fn queue_util(waiting: f64) -> f64 {
    if waiting.is_finite() && waiting > 0.0 {
        waiting / (1.0 + waiting)
    } else {
        0.0
    }
}

/// A measured prefill cost: seconds per prompt token and per unit of attention area.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Cost {
    per_token_s: f64,
    attention_s: f64,
}

impl Cost {
    /// Seconds to prefill `tokens` whose attention area is `area`.
    pub(super) fn secs(&self, tokens: u64, area: u64) -> f64 {
        self.per_token_s * tokens as f64 + self.attention_s * area as f64
    }
}

/// The measured guard's seconds for one view.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Predicted {
    /// The request's TTFT there: the queue ahead and its own prefill (0 while no worker has measured a speed).
    pub ttft_s: f64,
    /// `J`: that TTFT plus the delay it adds to the prompts behind it (in tokens while no speed is measured).
    pub j_s: f64,
    /// `own`: its own prefill there (the TTFT's part after the queue; in tokens while no speed is measured).
    pub own_s: f64,
}

/// Which guard `cache_aware` runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardKind {
    /// The token thresholds of #28 (`hotspot_*` weights): `cache_aware`.
    #[default]
    Thresholds,
    /// Least predicted seconds from measured speeds (no thresholds): `cache_aware_measured`.
    Measured,
    /// The measured guard's seconds plus the decode batch, the KV headroom and the SLOs (`goodput.rs`): `goodput`.
    Goodput,
}

/// What either guard weighs, per view.
pub(super) struct Inputs<'a> {
    pub w: &'a Weights,
    pub workers: &'a [WorkerView<'a>],
    pub healthy: &'a [usize],
    /// Prompt tokens each view would still prefill (lower tiers at their credit, a cheap shared prefix as held).
    pub uncached: &'a [u64],
    /// The request's prompt tokens.
    pub prompt_tokens: u64,
    /// The prompt begins with a prefix other conversations share: its ring key names this conversation only.
    pub hub_shared: bool,
    /// The output it will probably produce (`RequestView::output_tokens`) and its SLOs (the goodput guard's).
    pub output_tokens: u64,
    pub slo: super::Slo,
    /// Each view's measured cost and the fleet's mean cost and utilisation, computed once per decision (every
    /// guard term reads them).
    pub fleet: std::cell::OnceCell<Fleet>,
}

/// What the guards read of the whole fleet, once per decision ([`Inputs::fleet`]).
#[derive(Debug, Default)]
pub(super) struct Fleet {
    /// Each view's measured prefill cost (`None`: never measured, or unhealthy).
    costs: Vec<Option<Cost>>,
    /// The mean over the healthy views that measured one (1 s a token when none did: the terms are then tokens).
    mean_cost: Cost,
    /// Some healthy view measured a cost: the guards' figures are seconds.
    seconds: bool,
    /// The fleet's utilisation: what its mean number in prefill implies (capped).
    util: f64,
}

impl Inputs<'_> {
    fn cost(&self, i: usize) -> u64 {
        self.workers[i].load.cost(self.w.per_request_tokens)
    }

    /// A view's measured prefill speed (`None`: never measured, or not a usable number).
    fn speed_of(&self, i: usize) -> Option<f64> {
        let s = self.workers[i].speed.prefill_tokens_per_s;
        (s.is_finite() && s > 0.0).then_some(s)
    }

    /// A view's measured prefill cost: its fit (seconds per token, per unit of attention area) when it reports
    /// one, else `(1 / its token rate, 0)`; `None` when it measured neither.
    fn cost_of(&self, i: usize) -> Option<Cost> {
        let s = &self.workers[i].speed;
        if let Some((a, b)) = own_fit(s.prefill_per_token_s, s.prefill_attention_s, s.prefill_tokens_per_s) {
            return Some(Cost {
                per_token_s: a.min(1.0 / MIN_PREFILL_TOKENS_PER_S),
                attention_s: b.min(MAX_ATTENTION_S),
            });
        }
        self.speed_of(i)
            .map(|r| Cost { per_token_s: 1.0 / r.max(MIN_PREFILL_TOKENS_PER_S), attention_s: 0.0 })
    }

    /// The fleet's mean measured cost (1 s a token when none is measured: the terms are then tokens).
    pub(super) fn fleet_cost(&self) -> Cost {
        self.fleet().mean_cost
    }

    /// Each view's cost and the fleet's means, once per decision.
    fn fleet(&self) -> &Fleet {
        self.fleet.get_or_init(|| {
            let (costs, mean) = self.per_view_and_mean(
                |i| self.cost_of(i),
                |c| [c.per_token_s, c.attention_s],
                |[per_token_s, attention_s]| Cost { per_token_s, attention_s },
            );
            let n = self.healthy.len().max(1) as f64;
            let util =
                queue_util(self.healthy.iter().map(|i| self.in_prefill(*i)).sum::<f64>() / n).min(MAX_BUSY);
            Fleet {
                costs,
                mean_cost: mean.unwrap_or(Cost { per_token_s: 1.0, attention_s: 0.0 }),
                seconds: mean.is_some(),
                util,
            }
        })
    }

    /// Each healthy view's `of(i)` (`None` for the others) and the mean of those that are `Some`, field by field
    /// (`parts` and `whole` take a fit apart and put it together; `None` when no view has one): the guards' per-view
    /// fits and the fleet's mean fit, in one pass over the healthy views, in their order.
    pub(super) fn per_view_and_mean<T: Copy, const N: usize>(
        &self,
        of: impl Fn(usize) -> Option<T>,
        parts: impl Fn(T) -> [f64; N],
        whole: impl Fn([f64; N]) -> T,
    ) -> (Vec<Option<T>>, Option<T>) {
        let mut each = vec![None; self.workers.len()];
        let (mut sum, mut n) = ([0.0; N], 0usize);
        for &i in self.healthy {
            let v = of(i);
            if let Some(v) = v {
                for (s, p) in sum.iter_mut().zip(parts(v)) {
                    *s += p;
                }
                n += 1;
            }
            each[i] = v;
        }
        (each, (n > 0).then(|| whole(sum.map(|s| s / n as f64))))
    }

    /// The attention area of what view `i` would still prefill of this prompt (after what it holds).
    fn own_area(&self, i: usize) -> u64 {
        let u = self.uncached[i];
        attention_area(self.prompt_tokens.max(u) - u, u)
    }

    /// `L(w)`: the requests at view `i` that have not produced a first token (waiting, sent since its report, and
    /// running still in prefill): the prefill's number in system.
    fn in_prefill(&self, i: usize) -> f64 {
        let l = &self.workers[i].load;
        l.waiting.saturating_add(l.prefilling) as f64
    }

    /// A view's utilisation (0..=MAX_BUSY) as its queue implies: `L / (1 + L)` (M/M/1 holds `rho / (1 - rho)`
    /// requests in system at utilisation `rho`).
    fn util(&self, i: usize) -> f64 {
        queue_util(self.in_prefill(i)).min(MAX_BUSY)
    }

    /// The fleet's utilisation: what its mean number in prefill implies (capped).
    pub(super) fn fleet_util(&self) -> f64 {
        self.fleet().util
    }

    /// TTFT(w) and J(w) of every view in seconds (formula above; zeros for unhealthy views, which are never
    /// targets). TTFT is 0 too while no worker has measured a speed: the terms are then tokens, not seconds.
    pub fn predicted_s(&self) -> Vec<Predicted> {
        (0..self.workers.len()).map(|i| self.predicted_one(i)).collect()
    }

    /// [`Inputs::predicted_s`] of view `i`.
    pub(super) fn predicted_one(&self, i: usize) -> Predicted {
        let wk = &self.workers[i];
        if !wk.healthy {
            return Predicted::default();
        }
        let Fleet { costs, mean_cost: fleet, seconds, .. } = self.fleet();
        let cost = costs[i].unwrap_or(*fleet);
        let busy = self.util(i);
        let own = cost.secs(self.uncached[i], self.own_area(i));
        // The reported queue less what the worker drained since (at most its age of prefill), plus what
        // this gateway sent since (counted in pending_tokens, not drained yet as far as it knows).
        let age = if wk.speed.report_age_s.is_finite() { wk.speed.report_age_s.max(0.0) } else { 0.0 };
        let queue = (cost.secs(wk.load.pending_tokens, wk.load.pending_area) - age).max(0.0);
        let ttft = queue + own;
        let delay = own * busy / (1.0 - busy);
        tracing::debug!(
            worker = wk.id,
            per_token_s = cost.per_token_s,
            attention_s = cost.attention_s,
            busy,
            own,
            ttft,
            delay,
            "measured guard"
        );
        Predicted { ttft_s: if *seconds { ttft } else { 0.0 }, j_s: ttft + delay, own_s: own }
    }

    /// The measured guard: the view of least `J` plus the fleet's price of the cached tokens a move gives up,
    /// when that beats the winner's (`p`: [`Inputs::predicted_s`]).
    pub fn measured_target(&self, winner: usize, p: &[Predicted]) -> Option<usize> {
        let j = |i: usize| p[i].j_s;
        let copy = self.copy_from(winner);
        let (total_target, target) = self.least(|i| j(i) + copy(i))?;
        let moves = target != winner && total_target < j(winner);
        tracing::debug!(
            winner = self.workers[winner].id,
            target = self.workers[target].id,
            j_winner = j(winner),
            j_target = j(target),
            copy_target = copy(target),
            moves,
            "measured guard"
        );
        moves.then_some(target)
    }

    /// The healthy view of least `f` (ties: the lower index) and its value; `f` is evaluated once a view.
    pub(super) fn least(&self, f: impl Fn(usize) -> f64) -> Option<(f64, usize)> {
        self.least_among(self.healthy.iter().copied(), f)
    }

    /// [`Inputs::least`] among `views`.
    pub(super) fn least_among(
        &self,
        views: impl Iterator<Item = usize>,
        f: impl Fn(usize) -> f64,
    ) -> Option<(f64, usize)> {
        views.map(|i| (f(i), i)).min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
    }

    /// `copy(i)`: the copy a move from `winner` to view `i` leaves: as many tokens of other prefixes displaced at
    /// `i` (the same tokens at the same positions), computed again when next asked for (priced as if they will
    /// be), delaying the fleet at its utilisation. The fleet's figures are read once.
    pub(super) fn copy_from(&self, winner: usize) -> impl Fn(usize) -> f64 + '_ {
        let (fleet, busy) = (self.fleet_cost(), self.fleet_util());
        let (won, won_area) = (self.uncached[winner], self.own_area(winner));
        let slow = (1.0 - busy) * (1.0 - busy);
        move |i: usize| {
            let waste = self.uncached[i].saturating_sub(won);
            let area = self.own_area(i).saturating_sub(won_area);
            fleet.secs(waste, area) / slow
        }
    }

    /// The thresholds guard (#28; formula above).
    pub fn thresholds_target(&self, winner: usize) -> Option<usize> {
        let w = self.w;
        let ahead = |i: usize| (self.cost(i) + self.uncached[i]) as f64;
        let waste = |i: usize| self.uncached[i].saturating_sub(self.uncached[winner]) as f64;
        let min_cost = self.healthy.iter().map(|i| self.cost(*i)).min().unwrap_or(0);
        let k = w.hotspot_waste_factor * (1.0 + min_cost as f64 / w.load_floor_tokens.max(1) as f64);
        let target = *self.healthy.iter().min_by(|a, b| {
            (ahead(**a) + k * waste(**a)).total_cmp(&(ahead(**b) + k * waste(**b))).then(a.cmp(b))
        })?;
        if target == winner {
            return None;
        }
        let (gain, lost, abs) = (ahead(winner) - ahead(target), waste(target), w.hotspot_abs_tokens as f64);
        let moves = if lost > 0.0 {
            gain > abs + k * lost + w.hotspot_copy_tokens as f64
        } else if self.hub_shared {
            gain > abs
        } else {
            self.cost(winner) as f64 > w.hotspot_ratio * self.cost(target) as f64 + abs
        };
        tracing::debug!(
            winner = self.workers[winner].id,
            target = self.workers[target].id,
            ahead_winner = ahead(winner),
            ahead_target = ahead(target),
            gain,
            waste = lost,
            k,
            moves,
            "hot-spot guard (thresholds)"
        );
        moves.then_some(target)
    }
}
