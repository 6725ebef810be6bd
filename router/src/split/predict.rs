//! The output length a split decision is priced with: what the gateway can know before the answer, never the
//! truth. Clients send a `max_tokens` far above what they get, or none, so the prediction is the class's learned
//! mean output (a moving average of what its completed requests produced), capped by the request's `max_tokens`;
//! before the class has [`LEARNED_OUTPUT_MIN`] completions, `max_tokens`, else the configured estimate.
//!
//! Invariants: the estimate is bounded (one `f64` and a count per class; the caller bounds the classes); a
//! prediction never exceeds `max_tokens`; a hostile completion count cannot make it NaN or infinite.

use serde::Serialize;

/// Completed requests of a class before their output length replaces `max_tokens` or the configured estimate.
pub const LEARNED_OUTPUT_MIN: u64 = 8;
/// The learned output length averages over about this many recent requests.
pub const LEARNED_OUTPUT_WINDOW: u64 = 64;

/// One class's learned output length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct OutputEstimate {
    mean: f64,
    n: u64,
}

impl OutputEstimate {
    /// Takes a completed request's output length.
    pub fn learn(&mut self, tokens: u64) {
        let t = tokens as f64;
        self.mean = if self.n == 0 {
            t
        } else {
            self.mean + (t - self.mean) / (self.n.min(LEARNED_OUTPUT_WINDOW) + 1) as f64
        };
        self.n = self.n.saturating_add(1);
    }

    /// The learned mean, once [`LEARNED_OUTPUT_MIN`] requests completed.
    pub fn learned(&self) -> Option<u64> {
        (self.n >= LEARNED_OUTPUT_MIN && self.mean.is_finite()).then(|| self.mean.round().max(1.0) as u64)
    }

    /// The output to price a request with: the learned mean capped by `max_tokens`; before it is learned,
    /// `max_tokens`, else `configured`.
    pub fn predict(&self, max_tokens: Option<u64>, configured: u64) -> u64 {
        let base = self.learned().or(max_tokens).unwrap_or(configured);
        max_tokens.map_or(base, |m| base.min(m)).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prediction_is_the_learned_mean_capped_by_max_tokens() {
        let mut e = OutputEstimate::default();
        assert_eq!(e.predict(Some(4096), 256), 4096, "nothing learned: max_tokens");
        assert_eq!(e.predict(None, 256), 256, "nothing learned, no max_tokens: the configured estimate");
        for _ in 0..LEARNED_OUTPUT_MIN {
            e.learn(300);
        }
        assert_eq!(e.learned(), Some(300));
        assert_eq!(e.predict(Some(4096), 256), 300, "a max_tokens far above what requests get");
        assert_eq!(e.predict(Some(100), 256), 100, "capped");
        assert_eq!(e.predict(None, 256), 300);
        // A moving average over about the window: a shift shows within a few windows.
        for _ in 0..4 * LEARNED_OUTPUT_WINDOW {
            e.learn(1000);
        }
        assert!(e.learned().expect("learned") > 980);
        e.learn(u64::MAX);
        assert!(e.predict(Some(10), 1) <= 10 && e.predict(None, 1) >= 1);
    }
}
