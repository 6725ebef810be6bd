//! The anchors' split rules, kept as comparison policies (`--split-policy`; the simulator's PD table). Each fills
//! the same prediction terms as the cost model (`cost_model::predict`) so explain and the metrics show what its
//! choice costs.
//!
//! - `aggregated`: never split (every request whole on one worker);
//! - `always`: split every request (SGLang's router and SMG in PD mode);
//! - `dynamo`: Dynamo's conditional disaggregation: with `eff = prompt - tokens the decode worker holds`, stay
//!   local iff `eff < 2048` and `eff / prompt < 0.7`, or when the prefill worker is busy (its queue over
//!   `busy_tokens`: Dynamo's `router_queue_threshold x max_num_batched_tokens`, here 2 x 2048);
//! - `llm_d`: llm-d's prefix-based decider: split iff the decode pod's uncached tokens reach `threshold`.

use super::cost_model::predict;
use super::{Choice, SplitDecision, SplitInput, SplitPolicy};

pub struct Aggregated;

impl SplitPolicy for Aggregated {
    fn name(&self) -> &'static str {
        "aggregated"
    }
    fn decide(&self, input: &SplitInput) -> SplitDecision {
        SplitDecision { choice: Choice::Local, reason: "never", terms: predict(input) }
    }
}

pub struct Always;

impl SplitPolicy for Always {
    fn name(&self) -> &'static str {
        "always"
    }
    fn decide(&self, input: &SplitInput) -> SplitDecision {
        SplitDecision { choice: Choice::Split, reason: "always", terms: predict(input) }
    }
}

pub struct Dynamo {
    /// Uncached tokens below which a request may stay local (Dynamo's 2048).
    pub max_local_tokens: u64,
    /// ... if they are also under this share of the prompt (Dynamo's 0.7).
    pub max_local_share: f64,
    /// A prefill worker with more queued prefill tokens than this is busy: the request stays local.
    pub busy_tokens: u64,
}

impl Default for Dynamo {
    fn default() -> Self {
        Self { max_local_tokens: 2048, max_local_share: 0.7, busy_tokens: 2 * 2048 }
    }
}

impl SplitPolicy for Dynamo {
    fn name(&self) -> &'static str {
        "dynamo"
    }
    fn decide(&self, input: &SplitInput) -> SplitDecision {
        let eff = input.prompt_tokens.saturating_sub(input.decode_cached_tokens);
        let share = eff as f64 / input.prompt_tokens.max(1) as f64;
        let (choice, reason) = if eff < self.max_local_tokens && share < self.max_local_share {
            (Choice::Local, "short")
        } else if input.prefill.queue_tokens > self.busy_tokens {
            (Choice::Local, "prefill_busy")
        } else {
            (Choice::Split, "long")
        };
        SplitDecision { choice, reason, terms: predict(input) }
    }
}

pub struct LlmD {
    /// Uncached tokens on the decode pod from which a request is split.
    pub threshold: u64,
}

impl Default for LlmD {
    fn default() -> Self {
        Self { threshold: 512 }
    }
}

impl SplitPolicy for LlmD {
    fn name(&self) -> &'static str {
        "llm_d"
    }
    fn decide(&self, input: &SplitInput) -> SplitDecision {
        let eff = input.prompt_tokens.saturating_sub(input.decode_cached_tokens);
        let (choice, reason) =
            if eff >= self.threshold { (Choice::Split, "uncached") } else { (Choice::Local, "cached") };
        SplitDecision { choice, reason, terms: predict(input) }
    }
}
