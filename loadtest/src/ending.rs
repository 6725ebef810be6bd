//! How a request's generation ends, and so what the gateway is told about its length.
//!
//! - [`Ending::Exact`] (the default): `max_tokens` is the workload's output length and `ignore_eos` is set, so every
//!   request generates exactly that many tokens and the gateway is handed the true length. Good for measuring a
//!   server at a fixed shape; wrong for judging a router that predicts lengths.
//! - [`Ending::Model`]: the model ends the request, as real traffic does. Each request samples (a fixed seed per
//!   request, at `temperature`) and carries a stop set of `stop_token_ids`, about `vocab / output` ids drawn per
//!   request, so it ends where its sampled token first falls in the set: lengths spread roughly geometrically around
//!   the workload's output length (the synthetic models' logits are peaked; at a high temperature their samples spread
//!   over the vocabulary, which is what makes the stop set a length control). `max_tokens` is the output length times
//!   a factor drawn from `over` (real clients ask for several times what they get), and a share of requests send none.
//!   The gateway sees the stop set as any client's `stop_token_ids`; it does not read a length from it.
//!
//! Invariants: a pure function of the request's key (its prompt) and the workload's output length, so the same
//! request gets the same fields in every run and behind every router; the stop set never exceeds
//! [`MAX_STOP_IDS`] and never is empty; `max_tokens`, when sent, is at least the output length.

use kvgate_shared::prompt::SplitMix64;
use serde_json::{json, Value};

/// The most stop ids a request carries (the worker's `MAX_STOP_TOKEN_IDS` is above this).
pub const MAX_STOP_IDS: usize = 1024;

/// How requests end.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Ending {
    /// `max_tokens` = the output length, `ignore_eos`: the gateway knows the true length.
    #[default]
    Exact,
    /// The model ends each request; the gateway knows only a loose cap, or none.
    Model(ModelEnding),
}

/// [`Ending::Model`]'s shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelEnding {
    /// The model's vocabulary size (stop ids are drawn below it).
    pub vocab: u32,
    /// Sampling temperature (the synthetic models need a high one for their samples to spread).
    pub temperature: f32,
    /// `max_tokens` = output x a factor uniform in [lo, hi].
    pub over: (f64, f64),
    /// The share of requests that send no `max_tokens` at all.
    pub no_max_share: f64,
}

impl ModelEnding {
    /// The defaults of `kvgate-loadtest run --model-ends VOCAB`: temperature 16, max_tokens 2-10x, a tenth send none.
    pub fn new(vocab: u32) -> Self {
        Self { vocab, temperature: 16.0, over: (2.0, 10.0), no_max_share: 0.1 }
    }

    /// Refuses shapes that cannot work, naming the flag.
    pub fn validate(&self) -> Result<(), EndingError> {
        if self.vocab < 2 {
            return Err(EndingError::Vocab(self.vocab));
        }
        let (lo, hi) = self.over;
        if !(lo.is_finite() && hi.is_finite() && 1.0 <= lo && lo <= hi) {
            return Err(EndingError::Over(lo, hi));
        }
        if !(0.0..=1.0).contains(&self.no_max_share) {
            return Err(EndingError::NoMaxShare(self.no_max_share));
        }
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(EndingError::Temperature(self.temperature));
        }
        Ok(())
    }
}

/// A [`ModelEnding`] that cannot work (a usage error: fix the flag and run again).
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum EndingError {
    #[error("--model-ends {0}: the vocabulary must have at least 2 tokens")]
    Vocab(u32),
    #[error("--max-tokens-over {0},{1}: expected 1 <= LO <= HI")]
    Over(f64, f64),
    #[error("--no-max-tokens-share {0}: expected a share in [0, 1]")]
    NoMaxShare(f64),
    #[error("--model-ends-temperature {0}: expected > 0")]
    Temperature(f32),
}

/// A stable 64-bit key of a request body's prompt (FNV-1a over its JSON).
pub fn prompt_key(prompt: &Value) -> u64 {
    prompt
        .to_string()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

impl Ending {
    /// Sets the length fields of `body` for a request of planned `output` tokens whose prompt has `key`.
    pub fn apply(&self, body: &mut Value, key: u64, output: u32) {
        let output = output.max(1);
        let m = match self {
            Ending::Exact => {
                body["max_tokens"] = json!(output);
                body["temperature"] = json!(0.0);
                body["ignore_eos"] = json!(true);
                return;
            }
            Ending::Model(m) => m,
        };
        let mut rng = SplitMix64::new(key ^ (output as u64).rotate_left(32));
        if rng.unit() >= m.no_max_share {
            let (lo, hi) = m.over;
            let factor = lo + (hi - lo) * rng.unit();
            body["max_tokens"] = json!(((output as f64 * factor).ceil() as u32).max(output));
        }
        let want =
            ((m.vocab as f64 / output as f64).round() as usize).clamp(1, MAX_STOP_IDS.min(m.vocab as usize));
        let (mut stops, mut seen) =
            (Vec::with_capacity(want), std::collections::HashSet::with_capacity(want));
        while stops.len() < want {
            let id = rng.below(m.vocab as u64) as u32;
            if seen.insert(id) {
                stops.push(id);
            }
        }
        body["stop_token_ids"] = json!(stops);
        body["temperature"] = json!(m.temperature);
        body["seed"] = json!(rng.next_u64() >> 1);
        body["ignore_eos"] = json!(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(e: &Ending, key: u64, output: u32) -> Value {
        let mut b = json!({"prompt": [1, 2, 3]});
        e.apply(&mut b, key, output);
        b
    }

    #[test]
    fn exact_tells_the_true_length() {
        let b = fields(&Ending::Exact, 7, 48);
        assert_eq!((b["max_tokens"].as_u64(), b["ignore_eos"].as_bool()), (Some(48), Some(true)));
        assert!(b.get("stop_token_ids").is_none());
    }

    #[test]
    fn the_model_ends_requests_under_a_loose_cap_or_none() {
        let e = Ending::Model(ModelEnding::new(8192));
        let (mut none, mut ratios) = (0, Vec::new());
        for key in 0..2000u64 {
            let b = fields(&e, key.wrapping_mul(0x9e37_79b9_7f4a_7c15), 48);
            assert_eq!(b["ignore_eos"], json!(false));
            let stops = b["stop_token_ids"].as_array().expect("a stop set");
            assert_eq!(stops.len(), 171, "about vocab / output ids");
            let mut ids: Vec<u64> = stops.iter().filter_map(Value::as_u64).collect();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), 171, "distinct");
            assert!(ids.iter().all(|&i| i < 8192));
            match b["max_tokens"].as_u64() {
                None => none += 1,
                Some(m) => ratios.push(m as f64 / 48.0),
            }
        }
        assert!((150..250).contains(&none), "about a tenth send no max_tokens: {none}");
        assert!(ratios.iter().all(|r| (2.0..=10.05).contains(r)));
        let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
        assert!((5.5..6.5).contains(&mean), "uniform in 2-10x: mean {mean}");
    }

    #[test]
    fn the_same_request_gets_the_same_fields_and_another_gets_others() {
        let e = Ending::Model(ModelEnding::new(8192));
        assert_eq!(fields(&e, 11, 32), fields(&e, 11, 32));
        assert_ne!(fields(&e, 11, 32)["stop_token_ids"], fields(&e, 12, 32)["stop_token_ids"]);
        let key = prompt_key(&json!([1, 2, 3]));
        assert_eq!(key, prompt_key(&json!([1, 2, 3])));
        assert_ne!(key, prompt_key(&json!([1, 2, 4])));
    }

    #[test]
    fn the_stop_set_is_bounded_and_never_empty() {
        let e = Ending::Model(ModelEnding::new(1 << 20));
        assert_eq!(fields(&e, 1, 1)["stop_token_ids"].as_array().map_or(0, Vec::len), MAX_STOP_IDS);
        let e = Ending::Model(ModelEnding::new(100));
        assert_eq!(fields(&e, 1, 4000)["stop_token_ids"].as_array().map_or(0, Vec::len), 1);
    }

    #[test]
    fn bad_shapes_are_refused_by_flag() {
        let bad = |f: fn(&mut ModelEnding), flag: &str| {
            let mut m = ModelEnding::new(8192);
            f(&mut m);
            assert!(m.validate().expect_err(flag).to_string().contains(flag));
        };
        bad(|m| m.over = (0.5, 2.0), "--max-tokens-over");
        bad(|m| m.over = (3.0, 2.0), "--max-tokens-over");
        bad(|m| m.no_max_share = 1.5, "--no-max-tokens-share");
        bad(|m| m.temperature = 0.0, "--model-ends-temperature");
        bad(|m| m.vocab = 1, "--model-ends");
        assert!(ModelEnding::new(8192).validate().is_ok());
    }
}
