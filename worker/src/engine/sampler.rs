//! Picking the next token from logits: greedy, or temperature with top-k, top-p and min-p, from a per-request
//! seeded stream (so a request with a `seed` is reproducible whatever else is in its batch). Before either, the
//! logits are adjusted (`adjust`): repetition penalty (vLLM: a token seen in the prompt or the output has a positive
//! logit divided by it, a negative one multiplied), frequency and presence penalties (OpenAI: minus `count *
//! frequency + presence` for a token generated `count > 0` times), then `logit_bias` added.

use kvgate_shared::prompt::SplitMix64;

use super::request::{SamplingParams, TokenLogprobs};

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

/// Applies the penalties and the bias to `logits` (`tokens`: the sequence so far, of which the first
/// `prompt_len` are the prompt).
pub fn adjust(logits: &mut [f32], params: &SamplingParams, tokens: &[u32], prompt_len: usize) {
    let vocab = logits.len();
    if params.repetition_penalty != 1.0 {
        let mut seen = vec![false; vocab];
        for &t in tokens {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        let r = params.repetition_penalty;
        for (l, _) in logits.iter_mut().zip(&seen).filter(|(_, s)| **s) {
            *l = if *l > 0.0 { *l / r } else { *l * r };
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &t in tokens.get(prompt_len..).unwrap_or_default() {
            *counts.entry(t).or_default() += 1;
        }
        for (t, n) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= n as f32 * params.frequency_penalty + params.presence_penalty;
            }
        }
    }
    for &(t, b) in &params.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}

/// Samples one token after adjusting the logits ([`adjust`]) when the request asks for it.
pub fn sample_seq(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut SplitMix64,
    tokens: &[u32],
    prompt_len: usize,
) -> u32 {
    if !params.modifies_logits() {
        return sample(logits, params, rng);
    }
    let mut adjusted = logits.to_vec();
    adjust(&mut adjusted, params, tokens, prompt_len);
    sample(&adjusted, params, rng)
}

/// The log-probability of `token` under `logits` (log-softmax) and the `top` most likely tokens with theirs.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let lp = |t: u32| logits.get(t as usize).map_or(f32::NEG_INFINITY, |l| l - lse);
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let top = top.min(logits.len());
    let mut idx: Vec<u32> = Vec::new();
    if top > 0 {
        idx = (0..logits.len() as u32).collect();
        idx.select_nth_unstable_by(top - 1, by_logit);
        idx.truncate(top);
        idx.sort_unstable_by(by_logit);
    }
    TokenLogprobs { logprob: lp(token), top: idx.into_iter().map(|t| (t, lp(t))).collect() }
}

/// Bins of the logit histogram that finds the top-p cut without sorting every candidate.
const NUCLEUS_BINS: usize = 4096;

/// Samples one token from logits as they are (no penalties or bias: [`sample_seq`] applies those).
///
/// Linear in the vocabulary: the weights (`exp((logit - max) / T)`) are computed once; top-k selects its k
/// candidates (partial selection); min-p keeps the candidates over its floor; top-p finds its cut from a histogram
/// of the candidates' logits and sorts only the boundary bin; the draw is over the kept candidates in any order.
/// The kept set is exactly what sorting everything would keep (the tests check the distribution against that
/// definition); a given seed draws a different token than the full-sort version this replaced did.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut SplitMix64) -> u32 {
    if params.temperature < GREEDY_BELOW || logits.len() <= 1 {
        return argmax(logits);
    }
    let inv_t = 1.0 / params.temperature;
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f32> = logits.iter().map(|&l| ((l - max) * inv_t).exp()).collect();
    // Candidates: every token (`None`), or the top k.
    let mut cand: Option<Vec<u32>> = None;
    if params.top_k > 0 && (params.top_k as usize) < logits.len() {
        let k = params.top_k as usize;
        let mut c: Vec<u32> = (0..logits.len() as u32).collect();
        c.select_nth_unstable_by(k - 1, by_logit);
        c.truncate(k);
        cand = Some(c);
    }
    let total: f64 = match &cand {
        None => w.iter().map(|&x| f64::from(x)).sum(),
        Some(c) => c.iter().map(|&i| f64::from(w[i as usize])).sum(),
    };
    // Min-p: only tokens at least min_p times as likely as the most likely one (whose weight is 1).
    if params.min_p > 0.0 {
        let keep = |i: &u32| w[*i as usize] >= params.min_p;
        cand = Some(match cand {
            None => (0..logits.len() as u32).filter(keep).collect(),
            Some(mut c) => {
                c.retain(keep);
                c
            }
        });
    }
    if params.top_p < 1.0 {
        let c = cand.unwrap_or_else(|| (0..logits.len() as u32).collect());
        cand = Some(nucleus(c, logits, &w, f64::from(params.top_p) * total, by_logit));
    }
    let mut draw = |ids: &mut dyn Iterator<Item = u32>, mass: f64| -> Option<u32> {
        let mut r = rng.unit() * mass;
        let mut last = None;
        for i in ids {
            r -= f64::from(w[i as usize]);
            last = Some(i);
            if r <= 0.0 {
                return Some(i);
            }
        }
        last
    };
    let picked = match &cand {
        None => draw(&mut (0..logits.len() as u32), total),
        Some(c) => {
            let kept: f64 = c.iter().map(|&i| f64::from(w[i as usize])).sum();
            draw(&mut c.iter().copied(), kept)
        }
    };
    picked.unwrap_or_else(|| argmax(logits))
}

/// The top-p cut of `cand`: the smallest set of the most likely candidates whose weight reaches `need`, found from a
/// histogram of their logits (every bin above the boundary kept, the boundary bin sorted); the order of the result
/// is not the candidates' order by logit.
fn nucleus(
    mut cand: Vec<u32>,
    logits: &[f32],
    w: &[f32],
    need: f64,
    by_logit: impl Fn(&u32, &u32) -> std::cmp::Ordering,
) -> Vec<u32> {
    let (lo, hi) = cand.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &i| {
        (lo.min(logits[i as usize]), hi.max(logits[i as usize]))
    });
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
        cand.sort_unstable_by(&by_logit);
        return cut_sorted(cand, w, need, 0.0);
    }
    let scale = (NUCLEUS_BINS - 1) as f32 / (hi - lo);
    let bin = |i: u32| (((hi - logits[i as usize]) * scale) as usize).min(NUCLEUS_BINS - 1);
    let mut mass = vec![0f64; NUCLEUS_BINS];
    for &i in &cand {
        mass[bin(i)] += f64::from(w[i as usize]);
    }
    let mut above = 0.0;
    let mut boundary = NUCLEUS_BINS - 1;
    for (b, m) in mass.iter().enumerate() {
        if above + m >= need {
            boundary = b;
            break;
        }
        above += m;
    }
    let mut kept: Vec<u32> = cand.iter().copied().filter(|&i| bin(i) < boundary).collect();
    let mut edge: Vec<u32> = cand.into_iter().filter(|&i| bin(i) == boundary).collect();
    edge.sort_unstable_by(&by_logit);
    kept.extend(cut_sorted(edge, w, need, above));
    kept
}

/// The prefix of `sorted` that takes the weight from `have` to `need` (at least one element; all if it never does).
fn cut_sorted(mut sorted: Vec<u32>, w: &[f32], need: f64, have: f64) -> Vec<u32> {
    let mut mass = have;
    if let Some(n) = sorted.iter().position(|&i| {
        mass += f64::from(w[i as usize]);
        mass >= need
    }) {
        sorted.truncate(n + 1);
    }
    sorted
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

    #[test]
    fn penalties_and_bias_move_the_logits_as_documented() {
        // Prompt [0, 1], output [1, 2, 2].
        let tokens = [0u32, 1, 1, 2, 2];
        let base = [2.0f32, 2.0, -2.0, 1.0];
        let run = |p: SamplingParams| {
            let mut l = base;
            adjust(&mut l, &p, &tokens, 2);
            l
        };
        let rep = run(SamplingParams { repetition_penalty: 2.0, ..SamplingParams::default() });
        assert_eq!(rep, [1.0, 1.0, -4.0, 1.0], "seen tokens (prompt or output) penalised, token 3 not");
        let freq = run(SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..SamplingParams::default()
        });
        assert_eq!(freq, [2.0, 2.0 - 0.75, -2.0 - 1.25, 1.0], "generated tokens only, by count");
        let bias = run(SamplingParams { logit_bias: vec![(3, 5.0), (99, 1.0)], ..SamplingParams::default() });
        assert_eq!(bias, [2.0, 2.0, -2.0, 6.0], "(admission refuses a token past the vocabulary)");
        // Greedy follows the adjusted logits.
        let mut rng = SplitMix64::new(1);
        let p = SamplingParams { logit_bias: vec![(3, 5.0)], ..SamplingParams::greedy(1) };
        assert_eq!(sample_seq(&base, &p, &mut rng, &tokens, 2), 3);
        assert_eq!(sample_seq(&base, &SamplingParams::greedy(1), &mut rng, &tokens, 2), 0);
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_tokens_in_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let got = logprobs(&logits, 2, 3);
        let lse = logits.iter().map(|l| f64::from(*l).exp()).sum::<f64>().ln() as f32;
        assert!((got.logprob - (2.0 - lse)).abs() < 1e-6);
        let top: Vec<u32> = got.top.iter().map(|(t, _)| *t).collect();
        assert_eq!(top, [1, 3, 2], "most likely first, the lower id first among equals");
        assert!((got.top[0].1 - (3.0 - lse)).abs() < 1e-6);
        let total: f64 = logits.iter().map(|l| f64::from(l - lse).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(logprobs(&logits, 0, 99).top.len(), 4);
    }

    /// The exact distribution of a draw, by sorting everything (the definition the sampler must follow).
    fn expected(logits: &[f32], p: &SamplingParams) -> Vec<f64> {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
        if p.top_k > 0 {
            idx.truncate(p.top_k as usize);
        }
        let max = logits[idx[0]] / p.temperature;
        let w: Vec<f64> = idx.iter().map(|&i| f64::from((logits[i] / p.temperature - max).exp())).collect();
        let total: f64 = w.iter().sum();
        let probs: Vec<f64> = w.iter().map(|x| x / total).collect();
        let mut keep = probs.iter().take_while(|q| **q >= probs[0] * f64::from(p.min_p)).count().max(1);
        if p.top_p < 1.0 {
            let mut mass = 0.0;
            if let Some(n) = probs[..keep].iter().position(|q| {
                mass += q;
                mass >= f64::from(p.top_p)
            }) {
                keep = n + 1;
            }
        }
        let kept: f64 = probs[..keep].iter().sum();
        let mut out = vec![0.0; logits.len()];
        for n in 0..keep {
            out[idx[n]] = probs[n] / kept;
        }
        out
    }

    #[test]
    fn every_cut_draws_the_distribution_sorting_everything_defines() {
        let mut g = SplitMix64::new(5);
        let logits: Vec<f32> = (0..60).map(|_| (g.unit() as f32 - 0.5) * 6.0).collect();
        for (t, k, tp, mp) in [
            (1.0, 0, 1.0, 0.0),
            (0.7, 0, 0.9, 0.0),
            (1.3, 0, 0.5, 0.0),
            (1.0, 15, 1.0, 0.0),
            (1.0, 15, 0.8, 0.0),
            (1.0, 0, 1.0, 0.2),
            (1.0, 0, 0.9, 0.05),
            (2.0, 30, 0.95, 0.01),
        ] {
            let p = SamplingParams { min_p: mp, ..params(t, k, tp) };
            let want = expected(&logits, &p);
            let n = 10_000;
            let mut got = vec![0.0f64; logits.len()];
            let mut rng = SplitMix64::new(11);
            for _ in 0..n {
                got[sample(&logits, &p, &mut rng) as usize] += 1.0 / n as f64;
            }
            let tv: f64 = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).sum::<f64>() / 2.0;
            assert!(tv < 0.05, "t {t} top_k {k} top_p {tp} min_p {mp}: total variation {tv:.4}");
            assert!(
                got.iter().zip(&want).all(|(g, w)| *w > 0.0 || *g == 0.0),
                "a token outside the cut was drawn"
            );
        }
    }

    #[test]
    fn min_p_keeps_only_tokens_near_the_most_likely() {
        // Probabilities about 0.64, 0.24, 0.09, 0.03: min_p 0.3 keeps the first two.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let p = SamplingParams { min_p: 0.3, ..params(1.0, 0, 1.0) };
        let mut rng = SplitMix64::new(7);
        let drawn: std::collections::HashSet<u32> = (0..500).map(|_| sample(&logits, &p, &mut rng)).collect();
        assert_eq!(drawn, [0u32, 1].into_iter().collect());
        let all: std::collections::HashSet<u32> =
            (0..2000).map(|_| sample(&logits, &params(1.0, 0, 1.0), &mut rng)).collect();
        assert_eq!(all.len(), 4);
    }
}
