//! Host sampling cost over a Llama-3-sized vocabulary (128,256 logits), side by side in one run: greedy (arg-max),
//! the sampler (`engine::sampler::sample`: linear unless a cut needs an order) and the full-sort sampler it
//! replaced (#31: "a request without `temperature` gets 1.0 and sorts the whole vocabulary on the host every
//! token"), for the default request (temperature 1, no cuts) and for top-p 0.9. Prints microseconds per token and
//! each sampler's ratio to greedy.
//!
//!   cargo bench -p kvgate-worker --bench sampler

use std::time::Instant;

use kvgate_shared::prompt::SplitMix64;
use kvgate_worker::engine::sampler::{argmax, sample};
use kvgate_worker::engine::SamplingParams;

/// The replaced sampler: every token sorted by logit, then top-k, min-p and top-p cuts over the sorted list.
fn full_sort(logits: &[f32], p: &SamplingParams, rng: &mut SplitMix64) -> u32 {
    let inv_t = 1.0 / p.temperature;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    idx.sort_unstable_by(by);
    let max = logits[idx[0] as usize] * inv_t;
    let mut probs: Vec<f64> =
        idx.iter().map(|&i| f64::from((logits[i as usize] * inv_t - max).exp())).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|q| *q /= total);
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut mass = 0.0;
        for (n, q) in probs.iter().enumerate() {
            mass += q;
            if mass >= f64::from(p.top_p) {
                keep = n + 1;
                break;
            }
        }
    }
    let kept: f64 = probs[..keep].iter().sum();
    let mut r = rng.unit() * kept;
    for (n, q) in probs[..keep].iter().enumerate() {
        r -= q;
        if r <= 0.0 {
            return idx[n];
        }
    }
    idx[keep - 1]
}

fn per_token_us(n: usize, mut f: impl FnMut() -> u32) -> f64 {
    let mut sink = 0u64;
    for _ in 0..3 {
        sink = sink.wrapping_add(u64::from(f()));
    }
    let t = Instant::now();
    for _ in 0..n {
        sink = sink.wrapping_add(u64::from(f()));
    }
    std::hint::black_box(sink);
    t.elapsed().as_secs_f64() * 1e6 / n as f64
}

fn main() {
    let mut g = SplitMix64::new(1);
    // Logits shaped like a model's: most tokens far below a few likely ones.
    let logits: Vec<f32> = (0..128_256)
        .map(|_| {
            let u = g.unit() as f32;
            -8.0 * u * u + if u > 0.9999 { 14.0 } else { 0.0 }
        })
        .collect();
    let n = 200;
    let greedy = per_token_us(n, || argmax(&logits));
    println!("vocab {}: greedy (arg-max) {greedy:.1} us/token", logits.len());
    for (name, p) in [
        ("default (temperature 1)", SamplingParams { temperature: 1.0, ..SamplingParams::default() }),
        ("top_p 0.9", SamplingParams { temperature: 1.0, top_p: 0.9, ..SamplingParams::default() }),
    ] {
        let mut r1 = SplitMix64::new(2);
        let ours = per_token_us(n, || sample(&logits, &p, &mut r1));
        let mut r2 = SplitMix64::new(2);
        let old = per_token_us(n, || full_sort(&logits, &p, &mut r2));
        println!(
            "{name:<24} sampler {ours:>8.1} us ({:.2}x greedy)   full sort {old:>8.1} us ({:.2}x greedy)   speed-up {:.1}x",
            ours / greedy,
            old / greedy,
            old / ours
        );
    }
}
