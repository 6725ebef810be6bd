//! What this worker's prefill costs as a function of context, fitted to its own steps, for the reports.
//!
//! ```text
//! step seconds ~= a x tokens + b x area        area of a chunk of n prompt tokens after `start` = n x (start + n/2)
//! ```
//! (`tokens`: the step's prompt tokens; causal attention makes each token cost in proportion to what it attends
//! to, so a token rate alone under-prices long prompts: on the H100 profile a 128K-token prompt is 3.1 s of
//! per-token work and 9 s of attention.) Least squares without an intercept over the prefill-carrying steps, each
//! step weighted `(1 - 1/WINDOW_STEPS)^age`. `b` is taken from the fit only when the window's steps spread enough
//! in context to tell `a` from `b` (`MIN_SPREAD`); otherwise the last identified `b` stays (0 before one) and `a` is
//! fitted given it. A fit that would make a term negative falls back to the other term alone.
//!
//! Invariants: the coefficients are finite and non-negative; (0, 0) until a prefill step is observed; a step with
//! a non-finite or non-positive time, or no prompt tokens, changes nothing.

/// Steps of memory: each older step weighs `1 - 1/WINDOW_STEPS` less.
pub const WINDOW_STEPS: f64 = 256.0;
/// Least `1 - r^2` of tokens and area over the window (r: their uncentered correlation) at which `b` is fitted.
pub const MIN_SPREAD: f64 = 0.02;

/// The decayed normal-equation sums and the last identified attention coefficient.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillFit {
    snn: f64,
    sna: f64,
    saa: f64,
    sny: f64,
    say: f64,
    attention_s: f64,
}

impl PrefillFit {
    /// Adds one prefill-carrying step: its prompt tokens, their attention area, and its seconds.
    pub fn observe(&mut self, tokens: f64, area: f64, secs: f64) {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !(tokens > 0.0 && ok(tokens) && ok(area) && secs > 0.0 && secs.is_finite()) {
            return;
        }
        let k = 1.0 - 1.0 / WINDOW_STEPS;
        self.snn = k * self.snn + tokens * tokens;
        self.sna = k * self.sna + tokens * area;
        self.saa = k * self.saa + area * area;
        self.sny = k * self.sny + tokens * secs;
        self.say = k * self.say + area * secs;
        let det = self.snn * self.saa - self.sna * self.sna;
        if self.saa > 0.0 && det > MIN_SPREAD * self.snn * self.saa {
            let a = (self.saa * self.sny - self.sna * self.say) / det;
            let b = (self.snn * self.say - self.sna * self.sny) / det;
            self.attention_s = if a < 0.0 { self.say / self.saa } else { b.max(0.0) };
        }
    }

    /// `(a, b)`: seconds per prompt token and per unit of attention area ((0, 0) before any prefill step).
    pub fn coefficients(&self) -> (f64, f64) {
        if self.snn <= 0.0 {
            return (0.0, 0.0);
        }
        let b = self.attention_s;
        let a = ((self.sny - b * self.sna) / self.snn).max(0.0);
        if a.is_finite() && b.is_finite() {
            (a, b)
        } else {
            (0.0, 0.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::report::attention_area as area;

    /// Steps of the H100 profile's cost (per token 2.35e-5 s, attention 1.05e-9 s) at a spread of contexts.
    fn profile_steps(fit: &mut PrefillFit, starts: &[u64]) {
        for s in starts {
            let n = 2048;
            let area = area(*s, n) as f64;
            fit.observe(n as f64, area, 2.35e-5 * n as f64 + 1.05e-9 * area);
        }
    }

    #[test]
    fn the_fit_recovers_a_profile_s_two_terms() {
        let mut fit = PrefillFit::default();
        assert_eq!(fit.coefficients(), (0.0, 0.0), "nothing measured");
        profile_steps(&mut fit, &[0, 8_192, 65_536, 2_048, 120_000, 30_000]);
        let (a, b) = fit.coefficients();
        assert!((a / 2.35e-5 - 1.0).abs() < 1e-6, "{a}");
        assert!((b / 1.05e-9 - 1.0).abs() < 1e-6, "{b}");
    }

    #[test]
    fn without_spread_in_context_the_last_attention_term_stays() {
        let mut fit = PrefillFit::default();
        // Short prompts only: tokens and area move together, b is not identified (0), a takes all.
        profile_steps(&mut fit, &[0; 50]);
        let (a, b) = fit.coefficients();
        assert_eq!(b, 0.0);
        assert!(a > 2.35e-5 && a < 2.5e-5, "{a}");
        // Once contexts spread, b is fitted, and kept through a later run of short prompts.
        profile_steps(&mut fit, &[0, 100_000, 50_000, 150_000, 10_000, 80_000]);
        let b1 = fit.coefficients().1;
        assert!(b1 > 0.5e-9, "{b1}");
        profile_steps(&mut fit, &[0; 2000]);
        let (a2, b2) = fit.coefficients();
        assert!(b2 > 0.5e-9, "{b2}");
        assert!(a2 > 0.0 && a2 < 2.5e-5, "{a2}");
    }

    #[test]
    fn hostile_or_empty_steps_change_nothing_and_terms_stay_non_negative() {
        let mut fit = PrefillFit::default();
        for (n, area, secs) in [
            (0.0, 0.0, 1.0),
            (f64::NAN, 1.0, 1.0),
            (10.0, -1.0, 1.0),
            (10.0, 1.0, 0.0),
            (10.0, 1.0, f64::INFINITY),
        ] {
            fit.observe(n, area, secs);
        }
        assert_eq!(fit, PrefillFit::default());
        // Longer contexts that are cheaper (negative b): b falls to 0.
        fit.observe(1000.0, 1e6, 1.0);
        fit.observe(1000.0, 1e9, 0.5);
        let (a, b) = fit.coefficients();
        assert!(a >= 0.0 && b >= 0.0 && a.is_finite() && b.is_finite(), "{a} {b}");
    }
}
