//! The fit of what a decode step costs: a kvgate worker's, from the decode-only steps it runs, for its reports
//! (`StepTiming`'s `decode_*` terms); and the gateway's of a pod that sends no reports, from the inter-token latency
//! its metrics page gives each scrape interval against the requests it was running (`router::registry`). The
//! gateway predicts from it the TPOT of a stream that joins that batch and the time that stream adds to each step
//! of the others (`router::routing::goodput`).
//!
//! ```text
//! step seconds = base + per_seq x batch + per_kv x context      (batch: sequences decoding in the step;
//!                                                                 context: the KV tokens they attend to)
//! ```
//! Least squares over the recent steps (exponential forgetting, about [`WINDOW_STEPS`] steps), solved on the
//! centred sums (so `base` is the intercept). A slope the data cannot tell apart (the batch or the context never
//! varied, or the two moved together) is fitted without the other; a negative slope is refitted as 0.
//!
//! Invariants: every coefficient is finite and >= 0; steps with a non-finite or non-positive time, or no batch,
//! are not observed; the state is nine numbers whatever the worker runs.

/// Steps the forgetting spans (a step's weight halves in about 0.7 of this).
pub const WINDOW_STEPS: f64 = 512.0;
/// Least relative spread of a regressor (its variance over its mean square) for its slope to be fitted.
const MIN_SPREAD: f64 = 1e-3;

/// The running sums of the fit.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeFit {
    n: f64,
    sb: f64,
    sk: f64,
    sy: f64,
    sbb: f64,
    sbk: f64,
    skk: f64,
    sby: f64,
    sky: f64,
}

/// A decode step's cost: seconds = `base_s + per_seq_s x batch + per_kv_token_s x context`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeCost {
    pub base_s: f64,
    pub per_seq_s: f64,
    pub per_kv_token_s: f64,
}

impl DecodeFit {
    /// Adds one decode-only step: its batch, the KV tokens its sequences attend to, and its seconds.
    pub fn observe(&mut self, batch: f64, context: f64, secs: f64) {
        self.observe_in(WINDOW_STEPS, batch, context, secs)
    }

    /// [`DecodeFit::observe`] with forgetting over about `window` observations (at least 1).
    pub fn observe_in(&mut self, window: f64, batch: f64, context: f64, secs: f64) {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !(batch >= 1.0 && ok(batch) && ok(context) && secs > 0.0 && secs.is_finite()) {
            return;
        }
        let k = 1.0 - 1.0 / window.max(1.0);
        self.n = k * self.n + 1.0;
        self.sb = k * self.sb + batch;
        self.sk = k * self.sk + context;
        self.sy = k * self.sy + secs;
        self.sbb = k * self.sbb + batch * batch;
        self.sbk = k * self.sbk + batch * context;
        self.skk = k * self.skk + context * context;
        self.sby = k * self.sby + batch * secs;
        self.sky = k * self.sky + context * secs;
    }

    /// The fitted cost (all zero before any step).
    pub fn cost(&self) -> DecodeCost {
        if self.n <= 0.0 {
            return DecodeCost::default();
        }
        let n = self.n;
        let (mb, mk, my) = (self.sb / n, self.sk / n, self.sy / n);
        // Centred (co)variances, per step.
        let cbb = (self.sbb / n - mb * mb).max(0.0);
        let ckk = (self.skk / n - mk * mk).max(0.0);
        let cbk = self.sbk / n - mb * mk;
        let cby = self.sby / n - mb * my;
        let cky = self.sky / n - mk * my;
        let varies = |c: f64, m: f64| c > MIN_SPREAD * (m * m).max(f64::MIN_POSITIVE);
        let (vb, vk) = (varies(cbb, mb), varies(ckk, mk));
        let det = cbb * ckk - cbk * cbk;
        let one = |c: f64, cy: f64| (cy / c).max(0.0);
        let (mut per_seq, mut per_kv) = (0.0, 0.0);
        if vb && vk && det > MIN_SPREAD * cbb * ckk {
            per_seq = (ckk * cby - cbk * cky) / det;
            per_kv = (cbb * cky - cbk * cby) / det;
            if per_seq < 0.0 {
                (per_seq, per_kv) = (0.0, one(ckk, cky));
            } else if per_kv < 0.0 {
                (per_seq, per_kv) = (one(cbb, cby), 0.0);
            }
        } else if vb {
            per_seq = one(cbb, cby);
        } else if vk {
            per_kv = one(ckk, cky);
        }
        let base = (my - per_seq * mb - per_kv * mk).max(0.0);
        let c = DecodeCost { base_s: base, per_seq_s: per_seq, per_kv_token_s: per_kv };
        let finite = [c.base_s, c.per_seq_s, c.per_kv_token_s].iter().all(|v| v.is_finite());
        if finite {
            c
        } else {
            DecodeCost::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps of the cpu-small profile's decode cost at a spread of batches and contexts.
    fn cpu_small(b: f64, k: f64) -> f64 {
        0.000_945 + 0.000_534 * b + 0.000_004_92 * k
    }

    #[test]
    fn the_fit_recovers_the_three_terms_from_steps_that_vary() {
        let mut f = DecodeFit::default();
        for i in 0..2_000u64 {
            let b = (1 + i % 16) as f64;
            let k = b * (128 + (i * 37) % 2_048) as f64;
            f.observe(b, k, cpu_small(b, k));
        }
        let c = f.cost();
        assert!((c.base_s - 0.000_945).abs() < 1e-6, "{c:?}");
        assert!((c.per_seq_s - 0.000_534).abs() < 1e-7, "{c:?}");
        assert!((c.per_kv_token_s - 0.000_004_92).abs() < 1e-9, "{c:?}");
    }

    #[test]
    fn a_batch_that_never_varies_fits_no_slope_and_bad_steps_are_ignored() {
        let mut f = DecodeFit::default();
        assert_eq!(f.cost(), DecodeCost::default());
        for _ in 0..100 {
            f.observe(4.0, 4_000.0, 0.01);
            f.observe(0.0, 0.0, 5.0);
            f.observe(4.0, 4_000.0, f64::NAN);
            f.observe(4.0, 4_000.0, -1.0);
        }
        let c = f.cost();
        assert!((c.base_s - 0.01).abs() < 1e-12 && c.per_seq_s == 0.0 && c.per_kv_token_s == 0.0, "{c:?}");
        // Only the batch varies, at a fixed context: the batch's slope alone.
        let mut f = DecodeFit::default();
        for b in [1.0, 2.0, 4.0, 8.0].repeat(50) {
            f.observe(b, 1_000.0, 0.005 + 0.001 * b);
        }
        let c = f.cost();
        assert!((c.per_seq_s - 0.001).abs() < 1e-9 && (c.base_s - 0.005).abs() < 1e-9, "{c:?}");
    }
}
