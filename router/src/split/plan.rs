//! The two workers of a split and the policy's choice, from the registry as it is: the decode worker D (the
//! fewest streams and queued tokens: decode load), the prefill worker P (the least prefill work: queued tokens
//! plus what it lacks of the prompt, through its tiers), and the measured inputs of both and of the local pick.
//!
//! Eligible for either side: a healthy kvgate worker whose last report is fresh (under `stale_after`: one that
//! stopped reporting is not split to, though it stays in the ring until `dead_after`), whose fingerprint is the
//! gateway's, with a known KV size a token (its engine copies KV blocks; the same on P and D). P also needs a KV transfer listener
//! (`pd.transfer_addr`); D imports with the report secret it reports with. D: role `decode` or `both`; P: role
//! `prefill` or `both`; never the same worker. A worker that has not measured a speed yet is
//! given the mean of the eligible workers that have (none: 0, which the cost model reads as its slowest belief).

use serde::Serialize;

use super::cost_model::own_fit;
use super::{Side, Slo, SplitDecision, SplitInput, SplitPolicy, DEFAULT_SLO};
use crate::input::RouteInput;
use crate::registry::{Registry, Worker, WorkerRef};
use crate::routing::WorkerView;
use kvgate_shared::report::Role;

/// The P->D rate believed before a pair's first measured transfer (`--split-bandwidth-prior`), in Gb/s.
pub const DEFAULT_BANDWIDTH_PRIOR_GBPS: f64 = 10.0;

/// The gateway's split settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SplitSettings {
    pub slo: Slo,
    pub bandwidth_prior_bytes_per_s: f64,
}

impl Default for SplitSettings {
    fn default() -> Self {
        Self { slo: DEFAULT_SLO, bandwidth_prior_bytes_per_s: DEFAULT_BANDWIDTH_PRIOR_GBPS * 1e9 / 8.0 }
    }
}

/// What a routing decision needs to consider a split.
#[derive(Clone, Copy)]
pub struct SplitAsk<'a> {
    pub policy: &'a dyn SplitPolicy,
    pub settings: SplitSettings,
    /// `max_tokens`, else the class's expected output.
    pub expected_output: u64,
}

/// A considered split (chosen or not: explain shows both).
#[derive(Clone, Debug, Serialize)]
pub struct SplitPlan {
    /// Indices into the views.
    #[serde(skip)]
    pub prefill_view: usize,
    #[serde(skip)]
    pub decode_view: usize,
    pub prefill_worker: String,
    pub decode_worker: String,
    /// P's transfer address (the decode worker's `x-kvgate-prefill-peer`).
    pub peer: String,
    /// The pair's rate was measured (false: the prior).
    pub bandwidth_measured: bool,
    /// Some eligible worker has measured a prefill speed, so every side's is measured or the fleet's mean (false:
    /// none has yet, and every prefill is priced at the cost model's slowest belief: its predicted TTFT is no
    /// prediction, and `kvgate_gateway_split_prediction_error_seconds` leaves it out).
    pub speed_measured: bool,
    pub input: SplitInput,
    pub decision: SplitDecision,
}

fn transfer_ready<'a>(
    reg: &'a Registry,
    views: &[WorkerView<'_>],
    index: &[usize],
    v: usize,
) -> Option<&'a Worker> {
    let w = &reg.workers()[index[v]];
    let r = w.report.as_ref()?;
    // Its figures must be fresh: a worker that stopped reporting (stopped, partitioned, overloaded) stays in the
    // ring until `dead_after`, but a split priced on its old queue and speed would wait on it.
    let fresh = views[v].speed.report_age_s < reg.config().stale_after.as_secs_f64();
    let ok = views[v].healthy && fresh && w.fingerprint_ok == Some(true) && r.pd.kv_bytes_per_token > 0;
    ok.then_some(w)
}

/// Whether the worker `r` names can be a decode side now (a retry of a split's decode leg goes only to one that
/// can: any other would refuse the prefill peer).
pub fn can_import(reg: &Registry, r: WorkerRef) -> bool {
    reg.find(r).map(|i| &reg.workers()[i]).is_some_and(|w| {
        w.fingerprint_ok == Some(true)
            && w.report.as_ref().is_some_and(|r| r.pd.role != Role::Prefill && r.pd.kv_bytes_per_token > 0)
    })
}

fn exports(w: &Worker) -> bool {
    w.report.as_ref().is_some_and(|r| !r.pd.transfer_addr.is_empty())
}

fn mean_nonzero(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.filter(|v| *v > 0.0).fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}

/// The split `ask` would consider for `req`, with `local_view` the routing policy's pick; `None` when no pair of
/// eligible workers exists.
pub fn plan(
    reg: &Registry,
    views: &[WorkerView<'_>],
    index: &[usize],
    local_view: usize,
    req: &RouteInput<'_>,
    ask: &SplitAsk<'_>,
) -> Option<SplitPlan> {
    let ready: Vec<(usize, &Worker)> =
        (0..views.len()).filter_map(|v| transfer_ready(reg, views, index, v).map(|w| (v, w))).collect();
    let role = |w: &Worker| w.report.as_ref().map_or(Role::Both, |r| r.pd.role);
    // What each eligible worker lacks of the prompt, walked once per worker (Bloom lookups per block).
    let lacks: Vec<(usize, u64)> = ready
        .iter()
        .map(|&(v, _)| {
            let held = views[v].tier_match(req.hashes).through_disk * req.block_size;
            (v, req.prompt_tokens.saturating_sub(held) as u64)
        })
        .collect();
    let uncached = |v: usize| lacks.iter().find(|(u, _)| *u == v).map_or(req.prompt_tokens as u64, |l| l.1);
    let (decode_view, d) = ready
        .iter()
        .filter(|(_, w)| role(w) != Role::Prefill)
        .min_by_key(|(v, _)| (views[*v].load.requests, views[*v].load.pending_tokens, *v))
        .copied()?;
    let (prefill_view, p) = ready
        .iter()
        .filter(|(v, w)| role(w) != Role::Decode && *v != decode_view && exports(w))
        .min_by_key(|(v, _)| (views[*v].load.pending_tokens.saturating_add(uncached(*v)), *v))
        .copied()?;
    let (p_report, d_report) = (p.report.as_ref()?, d.report.as_ref()?);
    if p_report.pd.kv_bytes_per_token != d_report.pd.kv_bytes_per_token {
        return None;
    }
    let rate_prior = mean_nonzero(ready.iter().map(|(_, w)| w.pd.prefill_tokens_per_s));
    let step_prior = mean_nonzero(ready.iter().map(|(_, w)| w.pd.decode_step_s));
    // A worker's fit of its prefill cost (per token, per unit of attention area) is its own once it has computed
    // prompts (it has a token rate); before, what it measured at start joins the fleet's mean (the same model's),
    // which stands for it: identical workers are priced alike, not by the noise of their start-up timings. One
    // with no attention term yet takes the fleet's.
    let has_fit = |w: &Worker| w.pd.prefill_per_token_s > 0.0 || w.pd.prefill_attention_s > 0.0;
    let fitted = |w: &Worker| {
        own_fit(w.pd.prefill_per_token_s, w.pd.prefill_attention_s, w.pd.prefill_tokens_per_s).is_some()
    };
    let fits: Vec<&Worker> = ready.iter().map(|(_, w)| *w).filter(|w| has_fit(w)).collect();
    let mean = |f: fn(&Worker) -> f64| match fits.len() {
        0 => 0.0,
        n => fits.iter().map(|w| f(w)).sum::<f64>() / n as f64,
    };
    let fit_prior = (mean(|w| w.pd.prefill_per_token_s), mean(|w| w.pd.prefill_attention_s));
    let side = |v: usize| {
        let w = &reg.workers()[index[v]];
        let or = |own: f64, prior: f64| if own > 0.0 { own } else { prior };
        let (per_token_s, attention_s) = match fitted(w) {
            true => (w.pd.prefill_per_token_s, or(w.pd.prefill_attention_s, fit_prior.1)),
            false => fit_prior,
        };
        // The queue ahead is priced by the token rate; a worker with a fit and no rate yet, by its per-token cost.
        let rate = or(w.pd.prefill_tokens_per_s, rate_prior);
        let rate = if rate == 0.0 && per_token_s > 0.0 { 1.0 / per_token_s } else { rate };
        Side {
            prefill_per_token_s: per_token_s,
            prefill_attention_s: attention_s,
            held_tokens: (req.prompt_tokens as u64).saturating_sub(uncached(v)),
            uncached_tokens: uncached(v),
            queue_tokens: views[v].load.pending_tokens,
            // The streams a prefill here would stall. A prefill worker's requests are exports that end at their
            // first token (and the whole requests it serves as a last fallback are rare): none.
            running: if role(w) == Role::Prefill { 0 } else { views[v].load.requests },
            prefill_tokens_per_s: rate,
            decode_step_s: or(w.pd.decode_step_s, step_prior),
            stall_ratio: w.pd.stall_ratio,
            prefill_busy: w.prefill_busy(),
        }
    };
    let peer = p_report.pd.transfer_addr.clone();
    let measured = d.pd.link_rate(&peer);
    let input = SplitInput {
        prompt_tokens: req.prompt_tokens as u64,
        expected_output: ask.expected_output,
        local: side(local_view),
        prefill: side(prefill_view),
        decode: side(decode_view),
        decode_cached_tokens: req.prompt_tokens as u64 - uncached(decode_view),
        kv_bytes_per_token: f64::from(p_report.pd.kv_bytes_per_token),
        bandwidth_bytes_per_s: measured.unwrap_or(ask.settings.bandwidth_prior_bytes_per_s),
        export_groups: u32::from(p_report.pd.export_groups.max(1)),
        slo: ask.settings.slo,
    };
    let decision = ask.policy.decide(&input);
    Some(SplitPlan {
        prefill_view,
        decode_view,
        prefill_worker: p.id.clone(),
        decode_worker: d.id.clone(),
        peer,
        bandwidth_measured: measured.is_some(),
        speed_measured: rate_prior > 0.0 || !fits.is_empty(),
        input,
        decision,
    })
}
