//! Prefill/decode split: whether a request runs whole on one worker (**local**) or has its prompt computed on a
//! prefill worker P whose KV a decode worker D imports (**split**). Pure functions of measured inputs (no clocks,
//! no sockets): the gateway, `route/explain` and the PD simulator call the same [`SplitPolicy`].
//!
//! One policy per file:
//! - `cost_model` (default): predicted TTFT and TPOT of both options from measured inputs, judged by the SLOs
//!   (the formula is at the top of its file);
//! - `rules`: the anchors' rules, kept as comparisons: `aggregated` (never split), `always` (SGLang router / SMG
//!   in PD mode), `dynamo` (Dynamo's conditional disaggregation), `llm_d` (llm-d's uncached-token decider).
//!
//! Invariants: every input is clamped before use (a hostile or absent measurement cannot produce NaN, infinity or
//! a negative time); a policy that cannot decide (no prefill candidate, no transfer path) is never asked: the
//! caller serves the request locally.

pub mod cost_model;
pub mod plan;
pub mod predict;
pub mod rules;

use serde::Serialize;

pub use cost_model::CostModel;

/// Measured state of one worker, as the gateway sees it (its last report plus this gateway's sends since).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Side {
    /// Prompt tokens this request would compute there (its prompt less the prefix the worker holds in any tier).
    pub uncached_tokens: u64,
    /// Prefill tokens queued ahead of it (reported, plus uncached tokens sent since).
    pub queue_tokens: u64,
    /// Streams running there (running requests reported; the pool picks weigh it).
    pub running: u64,
    /// Measured prefill speed (tokens per second; the last non-idle interval's).
    pub prefill_tokens_per_s: f64,
    /// Its fit of a prefill step's seconds (`StepTiming::prefill_per_token_s`, `prefill_attention_s`): per prompt
    /// token and per unit of attention area. Both 0: not measured (the token rate is used alone).
    pub prefill_per_token_s: f64,
    pub prefill_attention_s: f64,
    /// Prompt tokens it holds already: the tokens it computes attend to these too.
    pub held_tokens: u64,
    /// Measured seconds per decode step without co-located prefill.
    pub decode_step_s: f64,
    /// Share of its decode-carrying step time that prefill chunks took (0..1): what co-located prefill costs
    /// every stream there.
    pub stall_ratio: f64,
    /// Share of the last interval it spent computing prompt tokens (0..1): how close its prefill is to
    /// saturation, so how many later prompts a prompt queued there will delay.
    pub prefill_busy: f64,
}

/// The latency targets a request is judged by (goodput counts requests meeting both).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_s: f64,
    pub tpot_s: f64,
}

/// Defaults of the SLOs the split optimises for (the benchmark's: TTFT <= 2 s, TPOT <= 50 ms).
pub const DEFAULT_SLO: Slo = Slo { ttft_s: 2.0, tpot_s: 0.050 };

/// Everything a split decision weighs, for one request and one candidate triple: the best worker to run it whole
/// (`local`), the best prefill worker and the best decode worker.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SplitInput {
    pub prompt_tokens: u64,
    /// The predicted output (`predict.rs`: the class's learned mean output capped by `max_tokens`; never the truth).
    pub expected_output: u64,
    pub local: Side,
    pub prefill: Side,
    pub decode: Side,
    /// Prompt tokens D already holds: only the rest crosses the link.
    pub decode_cached_tokens: u64,
    /// K and V bytes per token across layers (the workers' report).
    pub kv_bytes_per_token: f64,
    /// Measured P->D bandwidth of this pair (bytes per second; the moving average of real transfers, seeded by
    /// the configured prior until the first one).
    pub bandwidth_bytes_per_s: f64,
    /// Layer groups P sends while it computes (1: the whole KV after the prefill).
    pub export_groups: u32,
    pub slo: Slo,
}

/// Whether a request is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Choice {
    Local,
    Split,
}

impl Choice {
    pub fn as_str(self) -> &'static str {
        match self {
            Choice::Local => "local",
            Choice::Split => "split",
        }
    }
}

/// Predicted latencies of one option.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Prediction {
    pub ttft_s: f64,
    pub tpot_s: f64,
    /// TTFT + (output - 1) x TPOT.
    pub e2e_s: f64,
    /// TPOT of the streams already on the worker that computes the prompt, while it does (0: it runs none).
    pub others_tpot_s: f64,
    /// The delay the streams already on the computing worker take in all: running x its compute time.
    pub harm_s: f64,
    /// e2e + harm: what the option costs everyone (the choice when both options meet the SLOs).
    pub cost_s: f64,
    /// The headroom left under the tighter target: min(1 - ttft / TTFT target, 1 - max(tpot, others) / TPOT
    /// target) (below 0: missed).
    pub slack: f64,
    pub meets_slo: bool,
}

/// Every term of a decision (logged at debug, shown by explain, counted by outcome).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SplitTerms {
    pub local: Prediction,
    pub split: Prediction,
    /// Bytes that cross P->D: (prompt - decode_cached) x kv_bytes_per_token.
    pub transfer_bytes: f64,
    /// transfer_bytes / bandwidth.
    pub transfer_s: f64,
    /// The part of it not hidden behind P's compute.
    pub exposed_transfer_s: f64,
    /// The design's split gain: decode time x the share co-located prefill stalls it - exposed transfer time.
    pub gain_s: f64,
}

/// A policy's answer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SplitDecision {
    pub choice: Choice,
    /// Why, in a word (a metric label).
    pub reason: &'static str,
    pub terms: SplitTerms,
}

/// A split policy.
pub trait SplitPolicy: Send + Sync {
    /// The name used in config, metrics and the simulator's tables.
    fn name(&self) -> &'static str;

    /// Local or split, with the terms of the prediction (every policy fills them, so a comparison policy's
    /// choices can be judged by the same numbers).
    fn decide(&self, input: &SplitInput) -> SplitDecision;
}

/// Names accepted by `--split-policy`.
pub const SPLIT_POLICIES: [&str; 5] = ["cost_model", "aggregated", "always", "dynamo", "llm_d"];

/// The default split policy.
pub const DEFAULT_SPLIT_POLICY: &str = "cost_model";

/// Builds a split policy by name.
pub fn split_policy_by_name(name: &str) -> Option<Box<dyn SplitPolicy>> {
    match name {
        "cost_model" => Some(Box::new(CostModel)),
        "aggregated" => Some(Box::new(rules::Aggregated)),
        "always" => Some(Box::new(rules::Always)),
        "dynamo" => Some(Box::new(rules::Dynamo::default())),
        "llm_d" => Some(Box::new(rules::LlmD::default())),
        _ => None,
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod plan_tests;
