//! `cost_model`: split or not by the predicted TTFT, TPOT and cost of both options, judged by the SLOs.
//!
//! ```text
//! prefill_s(W, n)  = W.queue_tokens / W.prefill_tokens_per_s + compute_s(W, n)   (the queue ahead, then its own)
//! compute_s(W, n)  = a x n + b x n x (W.held + n/2)     a, b = W's fit of its prefill steps (per token, per unit of
//!                                                      attention area: causal attention over what it holds and
//!                                                      the tokens before), where measured;
//!                  = n / W.prefill_tokens_per_s        otherwise (a token rate alone under-prices long prompts:
//!                                                      a 14K-token prompt on a CPU worker of `small`, predicted
//!                                                      6.7 s from its rate, took ~80 s)
//! tpot(W)          = W.decode_step_s / (1 - W.stall_ratio)                 (stall ratio capped at MAX_STALL)
//!
//! local on L:  ttft = prefill_s(L, L.uncached) + L.decode_step_s
//!              tpot = tpot(L)
//! split P->D:  bytes = (prompt - D.cached) x kv_bytes_per_token;  transfer_s = bytes / bandwidth
//!              exposed = transfer_s                                     if P sends the KV after its prefill
//!                      = max(transfer_s / groups, transfer_s - compute_s(P, P.uncached))   if it sends layer groups
//!              ttft = prefill_s(P, P.uncached) + exposed + D.decode_step_s
//!              tpot = tpot(D)
//! others(W, n) = tpot(W) + compute_s(W, n) / output   if W runs streams, else 0
//!              (the TPOT of the streams already on the worker that computes the prompt: its chunks stall each
//!               of them for compute_s, spread over about this request's output length)
//! harm(W, n)   = W.running x compute_s(W, n)                    (the delay those streams take in all)
//!              + compute_s(W, n) x busy / (1 - busy)           (and the prompts that queue behind it there:
//!                                                                busy = W.prefill_busy, capped at MAX_BUSY)
//! e2e = ttft + (output - 1) x tpot;   cost = e2e + harm(computing worker)
//! slack = min(1 - ttft / TTFT target, 1 - max(tpot, others) / TPOT target)      (the headroom left; < 0: missed)
//! an option meets the SLOs iff ttft <= TTFT target, tpot <= TPOT target and others <= TPOT target
//! choice: split iff the split meets the SLOs and local does not.
//!         When both meet: split iff P is dedicated (no streams of its own) and the split leaves more slack:
//!         the request counts for goodput either way, so the option that keeps furthest from a target (a
//!         prediction error, the next burst) is the better bet. A prompt computed beside many streams eats TPOT
//!         headroom; one queued on a busy P eats TTFT headroom, so the share sent to P settles where the two
//!         meet (the PD simulator: ranking by cost instead ran the one prefill worker at the edge of the TTFT
//!         target, 5,472 vs 6,244 tokens/s on 4096/512). Onto a `both` worker, local (its prefill stalls P's
//!         streams just the same, and it costs link time).
//!         When neither meets: split iff P is dedicated and the split costs less, else local. D's measured
//!         stall comes from the prompts it computes itself, so without this a fleet whose decode workers already
//!         stall would never move a prompt off them. Onto a `both` worker the PD simulator showed splitting an
//!         overloaded fleet's misses costs goodput (94 vs 113 tokens/s on the Mooncake trace at its own pace): its
//!         prefill stalls P's streams instead.
//! gain (reported) = (output - 1) x tpot(L) x L.stall_ratio - exposed     (the design's split gain)
//! ```
//! With equal queues and speeds, `e2e(local) - e2e(split)` is the design's gain: it grows with output length
//! (more decode steps to stall) and shrinks with input length (more bytes to move), so long-prompt short-answer
//! traffic stays local and short-prompt long-answer traffic splits once co-located prefills measurably stall
//! decodes; the SLOs turn it into a choice: a split is worth its bytes when it is what lets the request meet them.

use super::{Choice, Prediction, Side, SplitDecision, SplitInput, SplitPolicy, SplitTerms};

/// The largest stall ratio believed (a worker reporting 1.0 would otherwise make TPOT infinite).
pub const MAX_STALL: f64 = 0.95;
/// The slowest prefill speed believed (tokens/s): a worker reporting 0 must not make prefill free or infinite.
pub const MIN_PREFILL_TOKENS_PER_S: f64 = 1.0;
/// The busiest prefill believed (a worker reporting 1.0 would otherwise make every queued prompt infinitely dear).
pub const MAX_BUSY: f64 = 0.95;
/// The slowest link believed (bytes/s).
pub const MIN_BANDWIDTH: f64 = 1.0;
/// The dearest attention cost believed (seconds per unit of attention area), as `MIN_PREFILL_TOKENS_PER_S` bounds
/// the per-token cost: a worker's fit above it is taken at it, so no reported value makes a time infinite (the
/// routing's cost takes the same bound).
pub const MAX_ATTENTION_S: f64 = 1.0;

/// A worker's own fit of its prefill cost (seconds per prompt token, per unit of attention area), from its report
/// of it and of its token rate: it counts once the worker has computed prompts (a token rate), not on what it
/// measured at start alone, which does not set identical workers apart; `None` before then, or for a value that
/// is not finite and non-negative. The split plan and the hot-spot guard both price a worker by it.
pub fn own_fit(per_token_s: f64, attention_s: f64, tokens_per_s: f64) -> Option<(f64, f64)> {
    let ok = |v: f64| v.is_finite() && v >= 0.0;
    let has_fit = per_token_s > 0.0 || attention_s > 0.0;
    let has_rate = tokens_per_s.is_finite() && tokens_per_s > 0.0;
    (has_fit && has_rate && ok(per_token_s) && ok(attention_s)).then_some((per_token_s, attention_s))
}

pub struct CostModel;

/// A finite, non-negative value (NaN, infinities and negatives read as `floor`).
fn sane(v: f64, floor: f64) -> f64 {
    if v.is_finite() && v >= floor {
        v
    } else {
        floor
    }
}

fn rate(w: &Side) -> f64 {
    sane(w.prefill_tokens_per_s, MIN_PREFILL_TOKENS_PER_S)
}

fn prefill_s(w: &Side, n: u64) -> f64 {
    w.queue_tokens as f64 / rate(w) + compute_s(w, n)
}

fn compute_s(w: &Side, n: u64) -> f64 {
    let (a, b) = (sane(w.prefill_per_token_s, 0.0), sane(w.prefill_attention_s, 0.0));
    if a == 0.0 && b == 0.0 {
        return n as f64 / rate(w);
    }
    let n_f = n as f64;
    let a = a.min(1.0 / MIN_PREFILL_TOKENS_PER_S);
    a * n_f + b.min(MAX_ATTENTION_S) * n_f * (w.held_tokens as f64 + n_f / 2.0)
}

fn tpot(w: &Side) -> f64 {
    sane(w.decode_step_s, 0.0) / (1.0 - sane(w.stall_ratio, 0.0).min(MAX_STALL))
}

/// A dedicated prefill worker: no streams of its own, so its compute stalls no one.
fn dedicated(p: &Side) -> bool {
    p.running == 0
}

/// The TPOT of the streams on `w` while it computes `n` prompt tokens (0 when it runs none).
fn others(w: &Side, n: u64, output: u64) -> f64 {
    if w.running == 0 {
        return 0.0;
    }
    tpot(w) + compute_s(w, n) / output.max(1) as f64
}

/// The delay others take in all while `w` computes `n` prompt tokens: each stream there waits out the chunks,
/// and so does each prompt that arrives behind them before the queue drains (busy / (1 - busy) of them, as in a
/// single queue at that utilisation).
fn harm(w: &Side, n: u64) -> f64 {
    let busy = sane(w.prefill_busy, 0.0).min(MAX_BUSY);
    compute_s(w, n) * (w.running as f64 + busy / (1.0 - busy))
}

fn finish(ttft_s: f64, tpot_s: f64, on: (&Side, u64), output: u64, input: &SplitInput) -> Prediction {
    let (w, n) = on;
    let e2e_s = ttft_s + output.saturating_sub(1) as f64 * tpot_s;
    let others_tpot_s = others(w, n, output);
    let harm_s = harm(w, n);
    Prediction {
        ttft_s,
        tpot_s,
        others_tpot_s,
        e2e_s,
        harm_s,
        cost_s: e2e_s + harm_s,
        slack: slack(ttft_s, tpot_s.max(others_tpot_s), &input.slo),
        meets_slo: ttft_s <= input.slo.ttft_s
            && tpot_s <= input.slo.tpot_s
            && others_tpot_s <= input.slo.tpot_s,
    }
}

/// The headroom an option leaves under the tighter of its targets (1: none of it used; below 0: missed).
fn slack(ttft_s: f64, tpot_s: f64, slo: &super::Slo) -> f64 {
    let share = |v: f64, target: f64| if target > 0.0 { 1.0 - v / target } else { f64::NEG_INFINITY };
    share(ttft_s, slo.ttft_s).min(share(tpot_s, slo.tpot_s))
}

/// The predictions of both options and the transfer terms (every policy reports these).
pub fn predict(input: &SplitInput) -> SplitTerms {
    let (l, p, d) = (&input.local, &input.prefill, &input.decode);
    let out = input.expected_output;
    let local_ttft = prefill_s(l, l.uncached_tokens) + sane(l.decode_step_s, 0.0);
    let local = finish(local_ttft, tpot(l), (l, l.uncached_tokens), out, input);
    let moved = input.prompt_tokens.saturating_sub(input.decode_cached_tokens);
    let transfer_bytes = moved as f64 * sane(input.kv_bytes_per_token, 0.0);
    let transfer_s = transfer_bytes / sane(input.bandwidth_bytes_per_s, MIN_BANDWIDTH);
    let p_compute = compute_s(p, p.uncached_tokens);
    let exposed_transfer_s = match input.export_groups {
        0 | 1 => transfer_s,
        g => (transfer_s / g as f64).max(transfer_s - p_compute),
    };
    let split = finish(
        prefill_s(p, p.uncached_tokens) + exposed_transfer_s + sane(d.decode_step_s, 0.0),
        tpot(d),
        (p, p.uncached_tokens),
        out,
        input,
    );
    let gain_s = out.saturating_sub(1) as f64 * local.tpot_s * sane(l.stall_ratio, 0.0).min(MAX_STALL)
        - exposed_transfer_s;
    SplitTerms { local, split, transfer_bytes, transfer_s, exposed_transfer_s, gain_s }
}

impl SplitPolicy for CostModel {
    fn name(&self) -> &'static str {
        "cost_model"
    }

    fn decide(&self, input: &SplitInput) -> SplitDecision {
        let terms = predict(input);
        let (l, s) = (&terms.local, &terms.split);
        let (choice, reason) = match (l.meets_slo, s.meets_slo) {
            (false, true) => (Choice::Split, "slo"),
            (true, false) => (Choice::Local, "slo"),
            (true, true) if dedicated(&input.prefill) && s.slack > l.slack => (Choice::Split, "more_slack"),
            (true, true) => (Choice::Local, "both_meet"),
            (false, false) if dedicated(&input.prefill) && s.cost_s < l.cost_s => {
                (Choice::Split, "lower_cost")
            }
            (false, false) => (Choice::Local, "neither_meets"),
        };
        tracing::debug!(
            choice = choice.as_str(),
            reason,
            local_ttft_s = l.ttft_s,
            local_tpot_s = l.tpot_s,
            split_ttft_s = s.ttft_s,
            split_tpot_s = s.tpot_s,
            local_harm_s = l.harm_s,
            split_harm_s = s.harm_s,
            local_slack = l.slack,
            split_slack = s.slack,
            transfer_bytes = terms.transfer_bytes,
            transfer_s = terms.transfer_s,
            exposed_transfer_s = terms.exposed_transfer_s,
            gain_s = terms.gain_s,
            prompt = input.prompt_tokens,
            output = input.expected_output,
            local_uncached = input.local.uncached_tokens,
            prefill_uncached = input.prefill.uncached_tokens,
            decode_cached = input.decode_cached_tokens,
            bandwidth = input.bandwidth_bytes_per_s,
            local_stall = input.local.stall_ratio,
            decode_stall = input.decode.stall_ratio,
            "split decision"
        );
        SplitDecision { choice, reason, terms }
    }
}
