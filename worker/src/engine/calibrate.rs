//! `kvgate-worker calibrate`: measures a real engine (the CPU one, or the CUDA one with `--device cuda`) and fits the simulated engine's timing model to it
//! (least squares on the formula of `timing.rs`), producing a profile file.

use std::time::Instant;

use super::timing::{SimProfile, TimingModel};
use super::{Backend, BackendError, BatchItem};

/// One measurement: the regressors and the seconds it took.
#[derive(Clone, Debug)]
struct Sample {
    x: [f64; 3],
    secs: f64,
}

/// Solves the 3x3 least-squares problem in relative error, `min sum ((x.w - y) / y)^2` (normal equations, Gaussian
/// elimination), so that millisecond steps weigh as much as second-long prefills; coefficients that come out
/// negative are refitted as zero.
fn fit(samples: &[Sample]) -> [f64; 3] {
    let samples: Vec<Sample> = samples
        .iter()
        .map(|s| {
            let w = 1.0 / s.secs.max(1e-9);
            Sample { x: [s.x[0] * w, s.x[1] * w, s.x[2] * w], secs: 1.0 }
        })
        .collect();
    let samples = &samples[..];
    let solve = |cols: &[usize]| -> Vec<f64> {
        let k = cols.len();
        let mut a = vec![vec![0.0; k + 1]; k];
        for s in samples {
            for (i, &ci) in cols.iter().enumerate() {
                for (j, &cj) in cols.iter().enumerate() {
                    a[i][j] += s.x[ci] * s.x[cj];
                }
                a[i][k] += s.x[ci] * s.secs;
            }
        }
        for col in 0..k {
            let pivot = (col..k).max_by(|&p, &q| a[p][col].abs().total_cmp(&a[q][col].abs())).unwrap_or(col);
            a.swap(col, pivot);
            if a[col][col].abs() < 1e-300 {
                continue;
            }
            let pivot_row = a[col].clone();
            for (r, row) in a.iter_mut().enumerate() {
                if r != col {
                    let f = row[col] / pivot_row[col];
                    for (x, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                        *x -= f * p;
                    }
                }
            }
        }
        (0..k).map(|i| if a[i][i].abs() < 1e-300 { 0.0 } else { a[i][k] / a[i][i] }).collect()
    };
    let mut cols: Vec<usize> = vec![0, 1, 2];
    loop {
        let w = solve(&cols);
        match w.iter().position(|v| *v < 0.0) {
            Some(i) if cols.len() > 1 => {
                cols.remove(i);
            }
            _ => {
                let mut out = [0.0; 3];
                for (i, c) in cols.iter().enumerate() {
                    out[*c] = w[i].max(0.0);
                }
                return out;
            }
        }
    }
}

fn tokens(n: usize, seed: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + seed * 104_729) % 4000) as u32).collect()
}

/// Measurement points: (start, new tokens) of prefill chunks and (batch, context) of decode steps.
#[derive(Clone, Debug)]
pub struct Points {
    pub prefills: Vec<(usize, usize)>,
    pub decodes: Vec<(usize, usize)>,
}

impl Points {
    /// The CPU engine's points (`quick`: small ones for tests).
    pub fn cpu(quick: bool) -> Self {
        if quick {
            Self {
                prefills: vec![(0, 32), (0, 64), (64, 64), (0, 128)],
                decodes: vec![(1, 32), (2, 64), (4, 32)],
            }
        } else {
            Self {
                prefills: vec![
                    (0, 256),
                    (0, 512),
                    (0, 1024),
                    (0, 2048),
                    (1024, 512),
                    (2048, 512),
                    (2048, 1024),
                ],
                decodes: vec![(1, 128), (1, 1024), (8, 128), (8, 1024), (16, 512), (32, 128)],
            }
        }
    }

    /// A GPU engine's points (serving-sized batches and contexts).
    pub fn gpu(quick: bool) -> Self {
        if quick {
            Self {
                prefills: vec![(0, 256), (0, 1024), (1024, 512)],
                decodes: vec![(1, 512), (8, 512), (32, 256)],
            }
        } else {
            Self {
                prefills: vec![(0, 512), (0, 2048), (0, 8192), (8192, 2048), (16_384, 4096), (4096, 4096)],
                decodes: vec![(1, 1024), (1, 8192), (8, 2048), (64, 2048), (128, 1024), (256, 2048)],
            }
        }
    }

    /// KV slots the points need at once.
    pub fn slots(&self) -> usize {
        let p = self.prefills.iter().map(|(s, n)| s + n).max().unwrap_or(1);
        let d = self.decodes.iter().map(|(b, c)| b * (c + 1)).max().unwrap_or(1);
        p.max(d)
    }
}

/// Measures `backend` (KV memory of at least `points.slots()` positions, block-ordered slots) and fits a profile
/// named `name`. KV contents do not change a step's time, so decode points run over unwritten contexts.
pub fn calibrate(
    backend: &mut dyn Backend,
    points: &Points,
    reps: usize,
    name: &str,
    source_note: &str,
) -> Result<SimProfile, BackendError> {
    let vocab = backend.vocab_size() as u32;
    let tok = |n, s| tokens(n, s).into_iter().map(|t| t % vocab).collect::<Vec<u32>>();
    let mut pre = Vec::new();
    for (i, &(start, n)) in points.prefills.iter().enumerate() {
        let all = tok(start + n, i);
        let slots: Vec<usize> = (0..start + n).collect();
        let item = |s: usize, len: usize, want: bool| BatchItem {
            tokens: &all,
            start: s,
            len,
            slots: slots.clone(),
            want_next: want,
            greedy: true,
            adapter: None,
        };
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            if start > 0 {
                backend.forward(&[item(0, start, false)])?;
            }
            let t = Instant::now();
            backend.forward(&[item(start, n, true)])?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        pre.push(prefill_sample(start, n, best));
    }
    let mut dec = Vec::new();
    for (i, &(batch, ctx)) in points.decodes.iter().enumerate() {
        let seqs: Vec<Vec<u32>> = (0..batch).map(|b| tok(ctx + 1, 100 + i * 64 + b)).collect();
        let slots: Vec<Vec<usize>> =
            (0..batch).map(|b| (b * (ctx + 1)..(b + 1) * (ctx + 1)).collect()).collect();
        let step: Vec<BatchItem<'_>> = (0..batch)
            .map(|b| BatchItem {
                tokens: &seqs[b],
                start: ctx,
                len: 1,
                slots: slots[b].clone(),
                want_next: true,
                greedy: true,
                adapter: None,
            })
            .collect();
        backend.forward(&step)?; // warm-up
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = Instant::now();
            backend.forward(&step)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        dec.push(decode_sample(batch, ctx, best));
    }
    let timing = fit_model(&pre, &dec);
    let described: Vec<String> = points
        .prefills
        .iter()
        .zip(&pre)
        .map(|((s, n), m)| format!("prefill {n}@{s}: {:.4}s", m.secs))
        .chain(points.decodes.iter().zip(&dec).map(|((b, c), m)| format!("decode b{b}@{c}: {:.5}s", m.secs)))
        .collect();
    Ok(SimProfile {
        name: name.into(),
        source: format!("kvgate-worker calibrate, {source_note}; best of {reps}: {}", described.join(", ")),
        max_model_len: backend.max_model_len(),
        timing,
    })
}

fn prefill_sample(start: usize, n: usize, secs: f64) -> Sample {
    Sample { x: [1.0, n as f64, n as f64 * (start as f64 + n as f64 / 2.0)], secs }
}

fn decode_sample(batch: usize, ctx: usize, secs: f64) -> Sample {
    Sample { x: [1.0, batch as f64, (batch * (ctx + 1)) as f64], secs }
}

fn fit_model(pre: &[Sample], dec: &[Sample]) -> TimingModel {
    let p = fit(pre);
    let d = fit(dec);
    TimingModel {
        prefill_base_s: p[0],
        prefill_per_token_s: p[1],
        prefill_attention_s: p[2],
        decode_base_s: d[0],
        decode_per_seq_s: d[1],
        decode_per_kv_token_s: d[2],
        host_load_s_per_byte: 0.0,
        disk_load_s_per_byte: 0.0,
    }
}

/// Fits a timing model to recorded measurements, in the format a profile's `source` lists them
/// (`prefill 2048@0: 0.0595s, decode b8@2048: 0.00653s, ...`; `calibrate --points`): a profile can be refitted
/// from what a GPU machine measured without the machine.
pub fn fit_points(text: &str) -> Result<TimingModel, String> {
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let bad = || format!("point {item:?} is not `prefill N@START: SECSs` or `decode bBATCH@CTX: SECSs`");
        let (what, secs) = item.split_once(':').ok_or_else(bad)?;
        let secs: f64 = secs.trim().trim_end_matches('s').parse().map_err(|_| bad())?;
        let (kind, at) = what.trim().split_once(' ').ok_or_else(bad)?;
        let (a, b) = at.trim().trim_start_matches('b').split_once('@').ok_or_else(bad)?;
        let (a, b): (usize, usize) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
        if !(secs.is_finite() && secs > 0.0) {
            return Err(bad());
        }
        match kind {
            "prefill" => pre.push(prefill_sample(b, a, secs)),
            "decode" => dec.push(decode_sample(a, b, secs)),
            _ => return Err(bad()),
        }
    }
    if pre.len() < 3 || dec.len() < 3 {
        return Err("need at least 3 prefill and 3 decode points".into());
    }
    Ok(fit_model(&pre, &dec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_refit_the_model_they_came_from() {
        let truth = TimingModel {
            prefill_base_s: 0.002,
            prefill_per_token_s: 3e-5,
            prefill_attention_s: 2e-9,
            decode_base_s: 0.005,
            decode_per_seq_s: 2e-5,
            decode_per_kv_token_s: 4e-8,
            host_load_s_per_byte: 0.0,
            disk_load_s_per_byte: 0.0,
        };
        let mut items = Vec::new();
        for (s, n) in [(0usize, 512usize), (0, 2048), (0, 8192), (4096, 4096)] {
            items.push(format!("prefill {n}@{s}: {:.9}s", truth.prefill(s, n)));
        }
        for (b, c) in [(1usize, 1024usize), (8, 2048), (64, 2048), (256, 2048)] {
            let secs = truth.decode_base_s
                + truth.decode_per_seq_s * b as f64
                + truth.decode_per_kv_token_s * (b * (c + 1)) as f64;
            items.push(format!("decode b{b}@{c}: {secs:.9}s"));
        }
        let got = fit_points(&items.join(", ")).expect("fits");
        for (a, b) in [
            (got.prefill_base_s, truth.prefill_base_s),
            (got.prefill_per_token_s, truth.prefill_per_token_s),
            (got.decode_per_kv_token_s, truth.decode_per_kv_token_s),
        ] {
            assert!((a - b).abs() <= b * 1e-3, "{got:?}");
        }
        assert!(fit_points("prefill 1@0: 1s").is_err());
        assert!(fit_points("prefill x@0: 1s, a, b").is_err());
    }

    #[test]
    fn least_squares_recovers_a_known_model() {
        let truth = [0.01, 2e-4, 3e-7];
        let samples: Vec<Sample> = [(0usize, 100usize), (0, 400), (400, 200), (1000, 1000), (0, 2000)]
            .iter()
            .map(|&(s, n)| {
                let x = [1.0, n as f64, n as f64 * (s as f64 + n as f64 / 2.0)];
                Sample { x, secs: truth[0] + truth[1] * x[1] + truth[2] * x[2] }
            })
            .collect();
        let w = fit(&samples);
        for (a, b) in w.iter().zip(truth) {
            assert!((a - b).abs() <= b * 1e-6, "{w:?}");
        }
        // A negative intercept is refitted as zero.
        let neg: Vec<Sample> =
            (1..5).map(|i| Sample { x: [1.0, i as f64, 0.0], secs: i as f64 - 0.5 }).collect();
        assert_eq!(fit(&neg)[0], 0.0);
    }

    #[test]
    fn calibrating_the_tiny_model_gives_a_usable_profile() {
        let dir = tempfile::tempdir().expect("tmp");
        crate::model::synth::synth_model(
            dir.path(),
            &crate::model::synth::SynthSpec::new(crate::model::synth::Preset::Tiny, 1),
        )
        .expect("synth");
        let model = crate::model::llama::LlamaModel::load(dir.path()).expect("model");
        let points = Points::cpu(true);
        let mut backend = super::super::CpuBackend::new(model, points.slots());
        let p = calibrate(&mut backend, &points, 1, "calibrated-cpu", "test").expect("calibrates");
        assert!(p.timing.validate().is_empty(), "{:?}", p.timing);
        assert!(p.timing.prefill(0, 128) > 0.0);
        let path = dir.path().join("p.toml");
        std::fs::write(&path, toml::to_string(&p).expect("toml")).expect("write");
        assert_eq!(SimProfile::load(&path).expect("loads"), p);
    }
}
