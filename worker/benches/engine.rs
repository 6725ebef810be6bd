//! Engine benchmark, side by side in one run with candle-transformers' dense llama on the same `small` weights:
//! prefill tokens/s, decode tokens/s at batch 1/8/32, and TTFT of a 2K-token prompt with 0/50/90% of it cached.
//!
//! `cargo bench -p kvgate-worker --bench engine` (add `-- --quick` for fewer repetitions).

mod common;

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama;
use common::request;
use kvgate_shared::hashing::HashScheme;
use kvgate_worker::engine::{CpuBackend, Engine, EngineConfig, SchedulerConfig};
use kvgate_worker::model::llama::LlamaModel;
use kvgate_worker::model::synth::{synth_model, Preset, SynthSpec};

struct Reference {
    model: llama::Llama,
    cfg: llama::Config,
}

impl Reference {
    fn load(dir: &std::path::Path) -> Self {
        let files = [dir.join("model.safetensors")];
        #[allow(unsafe_code)]
        // SAFETY: the benchmark's own model file, not modified while mapped.
        let vb =
            unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu).expect("vb") };
        let text = std::fs::read_to_string(dir.join("config.json")).expect("config");
        let cfg = serde_json::from_str::<llama::LlamaConfig>(&text).expect("cfg").into_config(false);
        Self { model: llama::Llama::load(vb, &cfg).expect("load"), cfg }
    }
    fn cache(&self) -> llama::Cache {
        llama::Cache::new(true, DType::F32, &self.cfg, &Device::Cpu).expect("cache")
    }
    /// Seconds for one prefill of `n` tokens.
    fn prefill(&self, tokens: &[u32]) -> f64 {
        let mut cache = self.cache();
        let input = Tensor::new(tokens, &Device::Cpu).expect("t").unsqueeze(0).expect("u");
        let t = Instant::now();
        let _ = self.model.forward(&input, 0, &mut cache).expect("forward");
        t.elapsed().as_secs_f64()
    }
    /// Decode tokens/s at `batch` with `ctx`-token prompts, over `steps` steps.
    fn decode(&self, batch: usize, ctx: usize, steps: usize) -> f64 {
        let mut cache = self.cache();
        let prompt: Vec<u32> = (0..batch * ctx).map(|i| (i as u32 * 31 + 7) % 8000).collect();
        let input = Tensor::from_vec(prompt, (batch, ctx), &Device::Cpu).expect("t");
        let _ = self.model.forward(&input, 0, &mut cache).expect("prefill");
        let t = Instant::now();
        for s in 0..steps {
            let next =
                Tensor::from_vec(vec![(s as u32 * 13) % 8000; batch], (batch, 1), &Device::Cpu).expect("t");
            let _ = self.model.forward(&next, ctx + s, &mut cache).expect("decode");
        }
        (batch * steps) as f64 / t.elapsed().as_secs_f64()
    }
}

fn engine(dir: &std::path::Path, num_blocks: usize) -> Engine<CpuBackend> {
    let model = LlamaModel::load(dir).expect("model");
    let backend = CpuBackend::new(model, num_blocks * 16);
    let cfg =
        EngineConfig { num_blocks, scheme: HashScheme::new(16, 1), scheduler: SchedulerConfig::default() };
    Engine::new(cfg, backend, None)
}

/// Seconds until the request's first token (its whole prefill, chunked by the scheduler).
fn ttft(e: &mut Engine<CpuBackend>, id: u64, prompt: Vec<u32>) -> f64 {
    e.add_request(request(id, prompt, 1)).expect("admit");
    let t = Instant::now();
    loop {
        if e.step().iter().any(|o| o.id == id && o.token.is_some()) {
            break t.elapsed().as_secs_f64();
        }
    }
}

/// Decode tokens/s of `batch` concurrent sequences with `ctx`-token prompts (prefill excluded).
fn engine_decode(dir: &std::path::Path, batch: usize, ctx: usize, steps: usize) -> f64 {
    let mut e = engine(dir, 4096);
    for b in 0..batch {
        let prompt: Vec<u32> = (0..ctx).map(|i| ((i * 31 + b * 977 + 7) % 8000) as u32).collect();
        e.add_request(request(b as u64, prompt, steps as u32 + 1)).expect("admit");
    }
    // Prefill everything (all prompts fit one 2048-token step for the sizes used here) and take the first token.
    let mut produced = 0;
    while produced < batch {
        produced += e.step().iter().filter(|o| o.token.is_some()).count();
    }
    let t = Instant::now();
    let mut tokens = 0;
    while e.has_work() {
        tokens += e.step().iter().filter(|o| o.token.is_some()).count();
    }
    tokens as f64 / t.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 1 } else { 3 };
    let dir = std::env::temp_dir().join("kvgate-bench-small");
    if !dir.join("model.safetensors").exists() {
        synth_model(&dir, &SynthSpec::new(Preset::Small, 0)).expect("synth");
    }
    let reference = Reference::load(&dir);
    println!("kvgate-worker engine benchmark: preset small (hidden 256, 6 layers, 8/4 heads, vocab 8192), {} threads",
        std::thread::available_parallelism().map_or(1, |n| n.get()));

    println!("\n## Prefill (one prompt, cold cache)\n| tokens | reference s | kvgate s | reference tok/s | kvgate tok/s | kvgate / reference |\n|---|---|---|---|---|---|");
    for n in [512usize, 1024, 2048] {
        let prompt: Vec<u32> = (0..n).map(|i| ((i * 7919 + 13) % 8000) as u32).collect();
        let r = median((0..reps).map(|_| reference.prefill(&prompt)).collect());
        let k = median(
            (0..reps)
                .map(|i| {
                    let mut e = engine(&dir, 1024);
                    ttft(&mut e, i as u64, prompt.clone())
                })
                .collect(),
        );
        println!("| {n} | {r:.3} | {k:.3} | {:.0} | {:.0} | {:.2}x |", n as f64 / r, n as f64 / k, r / k);
    }

    println!("\n## Decode (128-token prompts, 32 steps)\n| batch | reference tok/s | kvgate tok/s | kvgate / reference | kvgate vs its batch 1 |\n|---|---|---|---|---|");
    let mut base = 0.0;
    for batch in [1usize, 8, 32] {
        let r = median((0..reps).map(|_| reference.decode(batch, 128, 32)).collect());
        let k = median((0..reps).map(|_| engine_decode(&dir, batch, 128, 32)).collect());
        if batch == 1 {
            base = k;
        }
        println!("| {batch} | {r:.0} | {k:.0} | {:.2}x | {:.2}x |", k / r, k / base);
    }

    println!("\n## TTFT of a 2048-token prompt by cached fraction\n| cached | cached tokens | TTFT s | vs cold |\n|---|---|---|---|");
    let prompt: Vec<u32> = (0..2048).map(|i| ((i * 7919 + 13) % 8000) as u32).collect();
    let mut cold = 0.0;
    for frac in [0.0f64, 0.5, 0.9] {
        let cached = ((2048.0 * frac) as usize / 16) * 16;
        let t = median(
            (0..reps)
                .map(|i| {
                    let mut e = engine(&dir, 1024);
                    if cached > 0 {
                        // Warm the cache with the prefix (a different continuation so only the prefix is shared).
                        let mut warm = prompt[..cached].to_vec();
                        warm.push(1);
                        ttft(&mut e, 1000 + i as u64, warm);
                        while e.has_work() {
                            e.step();
                        }
                    }
                    ttft(&mut e, i as u64, prompt.clone())
                })
                .collect(),
        );
        if frac == 0.0 {
            cold = t;
        }
        println!("| {:.0}% | {cached} | {t:.3} | {:.2}x |", frac * 100.0, t / cold);
    }
}
