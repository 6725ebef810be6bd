//! Picking the next token from logits: greedy, or temperature with top-k and top-p, from a per-request seeded
//! stream (so a request with a `seed` is reproducible whatever else is in its batch).

use kvgate_shared::prompt::SplitMix64;

use super::request::SamplingParams;

/// Index of the largest logit (the lowest index among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// Temperatures below this sample greedily (arg-max, lowest id on ties).
pub const GREEDY_BELOW: f32 = 1e-5;

/// Samples one token.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut SplitMix64) -> u32 {
    if params.temperature < GREEDY_BELOW || logits.len() <= 1 {
        return argmax(logits);
    }
    let inv_t = 1.0 / params.temperature;
    // Candidates sorted by logit, descending; cut to top_k first (cheap partial selection).
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let k = if params.top_k > 0 { (params.top_k as usize).min(idx.len()) } else { idx.len() };
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_logit);
        idx.truncate(k);
    }
    idx.sort_unstable_by(by_logit);
    let max = logits[idx[0] as usize] * inv_t;
    let mut probs: Vec<f64> =
        idx.iter().map(|&i| f64::from((logits[i as usize] * inv_t - max).exp())).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    // Nucleus: the smallest prefix whose mass reaches top_p (always at least one token).
    let mut keep = probs.len();
    if params.top_p < 1.0 {
        let mut mass = 0.0;
        for (n, p) in probs.iter().enumerate() {
            mass += p;
            if mass >= f64::from(params.top_p) {
                keep = n + 1;
                break;
            }
        }
    }
    let kept: f64 = probs[..keep].iter().sum();
    let mut r = rng.unit() * kept;
    for (n, p) in probs[..keep].iter().enumerate() {
        r -= p;
        if r <= 0.0 {
            return idx[n];
        }
    }
    idx[keep - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, ..SamplingParams::default() }
    }

    #[test]
    fn greedy_takes_the_max_and_the_lowest_tie() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut rng = SplitMix64::new(1);
        assert_eq!(sample(&[0.1, 3.0, 2.0], &SamplingParams::greedy(1), &mut rng), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_cuts_the_tail() {
        let logits = [1.0, 5.0, 4.9, -3.0];
        let mut rng = SplitMix64::new(9);
        for _ in 0..200 {
            assert_eq!(sample(&logits, &params(1.0, 1, 1.0), &mut rng), 1);
            let t = sample(&logits, &params(1.0, 0, 0.6), &mut rng);
            assert!(t == 1 || t == 2, "top_p 0.6 keeps the two near-equal leaders, got {t}");
        }
    }

    #[test]
    fn temperature_sampling_follows_the_distribution_and_the_seed() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
        let mut rng = SplitMix64::new(42);
        let ones = (0..20_000).filter(|_| sample(&logits, &params(1.0, 0, 1.0), &mut rng) == 1).count();
        let frac = ones as f64 / 20_000.0;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
        let draw = |seed| {
            let mut r = SplitMix64::new(seed);
            (0..50).map(|_| sample(&[0.0, 0.1, 0.2, 0.3], &params(1.0, 0, 1.0), &mut r)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }
}
