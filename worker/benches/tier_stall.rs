//! Does a prefix read from the SSD tier stall the running decodes? The CPU engine (`small` weights) decodes 8
//! streams while 6 requests arrive, one every 25 steps, whose 4,096-token prefixes are cached: in the SSD tier only,
//! read-ahead off, always loaded (`ssd`), or in the device pool (`device`: the same arrivals and the same compute,
//! no SSD traffic). Every block of the pool is written once before (the CPU KV store's pages are mapped lazily).
//! Every step is timed; the table gives p50, p99 and max of the step time, side by side in one run.
//!
//! `cargo bench -p kvgate-worker --bench tier_stall` (add `-- --quick` for one repetition instead of three;
//! `TIER_STALL_DEBUG=1` prints each run's ten slowest steps).

mod common;

use std::time::Instant;

use common::request;
use kvgate_shared::hashing::HashScheme;
use kvgate_worker::engine::{CpuBackend, Engine, EngineConfig, SchedulerConfig};
use kvgate_worker::kv::{LoadCosts, LoadPolicy, WritePolicy};
use kvgate_worker::model::llama::LlamaModel;
use kvgate_worker::model::synth::{synth_model, Preset, SynthSpec};

const PREFIX: usize = 4096;
const ARRIVALS: usize = 6;
const STREAMS: usize = 8;
const EVERY: usize = 25;
const STREAM_TOKENS: u32 = 300;

fn prefix(k: usize) -> Vec<u32> {
    (0..PREFIX).map(|i| ((i * 7919 + k * 104_729 + 13) % 8000) as u32).collect()
}

fn drain(e: &mut Engine<CpuBackend>) {
    while e.has_work() {
        e.step();
    }
}

/// Step seconds of one run, and the cached tokens each arrival was served.
fn run(model: &std::path::Path, ssd: bool) -> (Vec<f64>, Vec<usize>) {
    let num_blocks = 2048;
    let backend = CpuBackend::new(LlamaModel::load(model).expect("model"), num_blocks * 16);
    let cfg =
        EngineConfig { num_blocks, scheme: HashScheme::new(16, 1), scheduler: SchedulerConfig::default() };
    let dir = tempfile::tempdir().expect("tmp");
    let mut e = Engine::new(cfg, backend, None);
    if ssd {
        e = e.with_disk_tier(dir.path(), 8 << 30, WritePolicy::WriteThrough, 0).expect("ssd");
        e.scheduler().kv().set_read_ahead(false);
        e.set_load_costs(LoadCosts { policy: LoadPolicy::AlwaysLoad, ..LoadCosts::default() });
    }
    // Touch every block of the pool first (the KV store's pages are mapped lazily: a load into a block never
    // written would pay page faults the device run does not), then cache the prefixes.
    for k in 0..num_blocks * 16 / PREFIX {
        e.add_request(request(500 + k as u64, prefix(100 + k), 1)).expect("admit");
        drain(&mut e);
    }
    for k in 0..ARRIVALS {
        e.add_request(request(1000 + k as u64, prefix(k), 1)).expect("admit");
        drain(&mut e);
    }
    if ssd {
        e.scheduler().kv().disk().expect("ssd").flush();
        // Only the SSD copy is left.
        let mut pool = e.scheduler().kv().pool().lock();
        let hashes: Vec<_> = pool.cached_hashes().collect();
        for h in hashes {
            if let Some(id) = pool.block_of(h) {
                pool.invalidate(id);
            }
        }
    }
    for s in 0..STREAMS {
        let prompt: Vec<u32> = (0..64).map(|i| ((i * 31 + s * 977 + 7) % 8000) as u32).collect();
        e.add_request(request(s as u64, prompt, STREAM_TOKENS)).expect("admit");
    }
    let mut steps = Vec::new();
    let mut cached = Vec::new();
    let mut arrived = 0;
    let mut n = 0;
    while e.has_work() {
        n += 1;
        if n % EVERY == 0 && arrived < ARRIVALS {
            let mut p = prefix(arrived);
            p.extend((0..16).map(|i| 8000 + i as u32 + arrived as u32));
            e.add_request(request(2000 + arrived as u64, p, 1)).expect("admit");
            arrived += 1;
        }
        let t = Instant::now();
        let out = e.step();
        if n > 1 {
            // (The first step prefills the streams' prompts.)
            steps.push(t.elapsed().as_secs_f64());
        }
        cached.extend(out.iter().filter(|o| o.id >= 2000 && o.finished.is_some()).map(|o| o.cached_tokens));
    }
    (steps, cached)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 1 } else { 3 };
    let model = std::env::temp_dir().join("kvgate-bench-small");
    if !model.join("model.safetensors").exists() {
        synth_model(&model, &SynthSpec::new(Preset::Small, 0)).expect("synth");
    }
    println!(
        "kvgate-worker tier stall: {STREAMS} decoding streams, {ARRIVALS} arrivals with a {PREFIX}-token cached prefix \
         one every {EVERY} steps; step time in ms (the worst of {reps} runs' p50/p99/max)"
    );
    println!("\n| prefix from | steps | step p50 ms | step p99 ms | step max ms | arrivals' cached tokens |\n|---|---|---|---|---|---|");
    let debug = std::env::var_os("TIER_STALL_DEBUG").is_some();
    for ssd in [false, true] {
        let mut worst = [0f64; 3];
        let mut steps_n = 0;
        let mut cached = Vec::new();
        for _ in 0..reps {
            let (steps, c) = run(&model, ssd);
            if debug {
                let mut top: Vec<(usize, f64)> = steps.iter().copied().enumerate().collect();
                top.sort_by(|a, b| b.1.total_cmp(&a.1));
                let top: Vec<String> =
                    top[..10].iter().map(|(i, t)| format!("{}:{:.1}", i + 2, t * 1e3)).collect();
                eprintln!("ssd={ssd} slowest steps (step:ms): {}", top.join(" "));
            }
            steps_n = steps.len();
            cached = c;
            for (w, p) in worst.iter_mut().zip([0.5, 0.99, 1.0]) {
                *w = w.max(kvgate_testkit::percentile(&steps, p) * 1e3);
            }
        }
        let from = if ssd { "SSD tier, read-ahead off" } else { "device pool" };
        println!("| {from} | {steps_n} | {:.2} | {:.2} | {:.2} | {cached:?} |", worst[0], worst[1], worst[2]);
    }
}
