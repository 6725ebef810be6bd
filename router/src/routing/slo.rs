//! Service-level objectives: the bounds a request's time to first token and time per output token must meet for
//! its tokens to count as goodput. They come from configuration (the gateway's `--slo-*` flags, a class's `slo`
//! table, the simulator's trace sets), never from a client.
//!
//! ```text
//! ttft_bound(prompt) = ttft_ms + ttft_ms_per_1k_tokens x prompt_tokens / 1000
//! met(request)       = ttft <= ttft_bound(prompt) and (tpot <= tpot_ms, when it generated two tokens or more)
//! ```
//! Invariants: every bound is finite and positive ([`Slo::validate`]); a request without a first token never meets.

use serde::{Deserialize, Serialize};

/// The bounds one request must meet.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Slo {
    /// Time to first token, ms (for a prompt of no tokens).
    pub ttft_ms: f64,
    /// Time to first token added per 1,000 prompt tokens, ms (0: one bound for every length).
    pub ttft_ms_per_1k_tokens: f64,
    /// Time per output token after the first, ms.
    pub tpot_ms: f64,
}

impl Default for Slo {
    /// An interactive chat's: first token within 1 s, then at least 5 tokens a second.
    fn default() -> Self {
        Self { ttft_ms: 1000.0, ttft_ms_per_1k_tokens: 0.0, tpot_ms: 200.0 }
    }
}

impl Slo {
    /// The TTFT bound of a prompt of `prompt_tokens`, in seconds.
    pub fn ttft_bound_s(&self, prompt_tokens: usize) -> f64 {
        (self.ttft_ms + self.ttft_ms_per_1k_tokens * prompt_tokens as f64 / 1000.0) / 1000.0
    }

    /// The TPOT bound, in seconds.
    pub fn tpot_bound_s(&self) -> f64 {
        self.tpot_ms / 1000.0
    }

    /// Whether a request with this TTFT and TPOT (`None`: fewer than two tokens) meets the bounds.
    pub fn met(&self, prompt_tokens: usize, ttft_s: f64, tpot_s: Option<f64>) -> bool {
        ttft_s <= self.ttft_bound_s(prompt_tokens) && tpot_s.is_none_or(|t| t <= self.tpot_bound_s())
    }

    /// Every problem with the values.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        for (name, v, zero_ok) in [
            ("ttft_ms", self.ttft_ms, false),
            ("ttft_ms_per_1k_tokens", self.ttft_ms_per_1k_tokens, true),
            ("tpot_ms", self.tpot_ms, false),
        ] {
            let ok = v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0)) && v <= 3_600_000.0;
            if !ok {
                let want = if zero_ok { ">= 0" } else { "> 0" };
                p.push(format!("slo.{name} must be a number {want} and at most an hour, got {v}"));
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ttft_bound_grows_with_the_prompt_and_tpot_binds_only_streams_of_two_tokens() {
        let s = Slo { ttft_ms: 1000.0, ttft_ms_per_1k_tokens: 100.0, tpot_ms: 50.0 };
        assert!((s.ttft_bound_s(20_000) - 3.0).abs() < 1e-12);
        assert!(s.met(20_000, 3.0, Some(0.05)));
        assert!(!s.met(20_000, 3.01, Some(0.01)));
        assert!(!s.met(0, 0.5, Some(0.051)));
        assert!(s.met(0, 0.5, None), "one token: no TPOT to bound");
    }

    #[test]
    fn bad_bounds_are_refused_by_name() {
        assert!(Slo::default().validate().is_empty());
        let bad = Slo { ttft_ms: 0.0, ttft_ms_per_1k_tokens: -1.0, tpot_ms: f64::NAN };
        let p = bad.validate().join("; ");
        for name in ["slo.ttft_ms ", "slo.ttft_ms_per_1k_tokens", "slo.tpot_ms"] {
            assert!(p.contains(name), "{p}");
        }
    }
}
