//! KV transfer benchmark, side by side in one run on the `small` synthetic model (6 layers, 4 KV heads of 32: 6 KiB
//! of K/V a token):
//! 1. the wire: a prompt's KV through one loopback TCP link (Blocks frames, the real codec and link) vs a plain
//!    memcpy of the same bytes, for 4K and 32K tokens;
//! 2. a prompt handed from a prefill engine to a decode engine (two engine threads, the real export listener and
//!    import fetch over loopback): time to the decode side's first token, vs the prefill alone, with the KV sent
//!    whole after the forward, per layer during it, and per 1K-token chunk; the share of the transfer hidden
//!    behind compute;
//! 3. inter-token latency of 8 running streams on a decode engine while long prompts arrive, prefilled there
//!    (aggregated) vs imported from a prefill engine (disaggregated).
//!
//! `cargo bench -p kvgate-worker --bench transfer` (`-- --quick`: one repetition). Both engines share this
//! machine's cores, so on 2 cores the prefill engine's compute also slows the decode engine's steps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_shared::hashing::{ExtraKeys, HashScheme};
use kvgate_worker::engine::{
    Backend, CpuBackend, Engine, EngineConfig, EngineRequest, SamplingParams, SchedulerConfig,
};
use kvgate_worker::model::llama::LlamaModel;
use kvgate_worker::model::synth::{synth_model, Preset, SynthSpec};
use kvgate_worker::server::engine_thread::EngineHandle;
use kvgate_worker::transfer::frame::{Frame, Limits};
use kvgate_worker::transfer::import::{fetch, Fetched, Want};
use kvgate_worker::transfer::link::{KvLink, TcpLink};
use kvgate_worker::transfer::Transfers;

const BS: usize = 16;

fn engine(dir: &std::path::Path, tokens: usize, chunk: usize) -> Engine<CpuBackend> {
    let model = LlamaModel::load(dir).expect("model");
    let cfg = EngineConfig {
        num_blocks: tokens / BS,
        scheme: HashScheme::new(BS as u32, 9),
        scheduler: SchedulerConfig { max_num_batched_tokens: chunk, max_num_seqs: 64 },
    };
    Engine::new(cfg, CpuBackend::new(model, tokens), None)
}

/// What a transfer of this engine's KV is valid for: fingerprint, block bytes, layers.
fn parts(e: &Engine<CpuBackend>) -> (u64, usize, usize) {
    let block_bytes = e.backend().kv_block_bytes(BS).expect("bytes");
    (e.tier_fingerprint(0, block_bytes), block_bytes, e.backend().kv_layers())
}

/// Starts an engine thread for `e` and its transfer state; a prefill side also gets a listener (its address).
async fn side(e: Engine<CpuBackend>, layer_group: u16, listen: bool) -> (Arc<Transfers>, String) {
    let (fingerprint, block_bytes, layers) = parts(&e);
    let engine = EngineHandle::spawn(e, 256);
    let t = Arc::new(Transfers {
        key: [7; 32],
        fingerprint,
        block_bytes,
        layers,
        block_size: BS,
        lease: Duration::from_secs(30),
        layer_group,
        frame_bytes: 8 << 20,
        max_prompt_tokens: 40_000,
        engine,
        transport: Default::default(),
    });
    let mut addr = String::new();
    if listen {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        addr = l.local_addr().expect("addr").to_string();
        tokio::spawn(kvgate_worker::transfer::export::serve(l, t.clone()));
    }
    (t, addr)
}

fn prompt(n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13 + salt * 104_729) % 8000) as u32).collect()
}

fn req(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
    EngineRequest { id, prompt, params, extra_keys: ExtraKeys::none() }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds to move `bytes` through one loopback link in 8 MiB Blocks frames, and to memcpy them.
async fn wire(bytes: usize) -> (f64, f64) {
    let payload = vec![3u8; bytes];
    let mut dst = vec![1u8; bytes];
    let t = Instant::now();
    dst.copy_from_slice(&payload);
    std::hint::black_box(&dst);
    let memcpy = t.elapsed().as_secs_f64();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let limits = Limits { max_prompt_tokens: 16, max_payload: 8 << 20 };
    let rx = tokio::spawn(async move {
        let (s, _) = listener.accept().await.expect("accept");
        let mut link = TcpLink::new(s, "bench".into(), limits);
        let mut got = 0;
        while got < bytes {
            match link.recv().await.expect("frame") {
                Frame::Blocks(b) => got += b.payload.len(),
                other => panic!("{other:?}"),
            }
        }
    });
    let s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut link = TcpLink::new(s, "bench".into(), limits);
    let t = Instant::now();
    for (i, part) in payload.chunks(8 << 20).enumerate() {
        link.send_blocks(1, i as u32, 1, (0, 6), part).await.expect("send");
    }
    rx.await.expect("receiver");
    (t.elapsed().as_secs_f64(), memcpy)
}

/// Seconds from a decode engine's import request to its first token, with the prompt prefilled by `p`.
async fn handed(peer: &str, d: &Transfers, prompt: &[u32]) -> f64 {
    let t = Instant::now();
    let id = d.engine.next_id();
    let r = req(id, prompt.to_vec(), 1);
    let (plan, mut rx) = d.engine.start_import(r.clone()).await.expect("import");
    let (_cancel, cancelled) = tokio::sync::oneshot::channel();
    let want = Want { id, prompt, extra_keys: &r.extra_keys, params: &r.params, plan };
    let fetched = fetch(d, peer, want, cancelled).await;
    assert!(matches!(fetched, Fetched::Done { .. }), "{fetched:?}");
    while let Some(o) = rx.recv().await {
        if o.token.is_some() {
            break;
        }
    }
    t.elapsed().as_secs_f64()
}

/// Seconds to the first token of `prompt` computed by `e` alone.
async fn local(e: &EngineHandle, prompt: &[u32]) -> f64 {
    let t = Instant::now();
    let mut rx = e.submit(req(e.next_id(), prompt.to_vec(), 1)).await.expect("submit");
    while let Some(o) = rx.recv().await {
        if o.token.is_some() {
            break;
        }
    }
    t.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 1 } else { 3 };
    let dir = std::env::temp_dir().join("kvgate-bench-small");
    if !dir.join("model.safetensors").exists() {
        synth_model(&dir, &SynthSpec::new(Preset::Small, 0)).expect("synth");
    }
    println!(
        "kvgate KV transfer benchmark: preset small (6 layers, 4 KV heads x 32, 6 KiB a token), {} threads",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );

    println!("\n## The wire: one loopback TCP link vs memcpy\n| tokens | bytes | memcpy GB/s | link GB/s | link / memcpy |\n|---|---|---|---|---|");
    for tokens in [4096usize, 32_768] {
        let bytes = tokens * 6144;
        let runs: Vec<(f64, f64)> = {
            let mut v = Vec::new();
            for _ in 0..reps {
                v.push(wire(bytes).await);
            }
            v
        };
        let link = median(runs.iter().map(|r| r.0).collect());
        let memcpy = median(runs.iter().map(|r| r.1).collect());
        let gb = |s: f64| bytes as f64 / s / 1e9;
        println!(
            "| {tokens} | {:.0} MiB | {:.2} | {:.2} | {:.3}x |",
            bytes as f64 / (1 << 20) as f64,
            gb(memcpy),
            gb(link),
            memcpy / link
        );
    }

    println!("\n## A prompt handed from a prefill engine to a decode engine (time to the decode side's first token)");
    println!("| tokens | chunk | KV sent | prefill alone s | handed s | exposed transfer s | transfer alone s |\n|---|---|---|---|---|---|---|");
    let tokens = 4096;
    let transfer_alone = median({
        let mut v = Vec::new();
        for _ in 0..reps {
            v.push(wire(tokens * 6144).await.0);
        }
        v
    });
    let mut salt = 0;
    for (chunk, group) in [(4096usize, 0u16), (4096, 1), (1024, 0), (1024, 1)] {
        // Pools of 3 prompts, every page touched first (a fresh pool's first writes fault its pages in).
        let (p, peer) = side(engine(&dir, 3 * tokens, chunk), group, true).await;
        let (d, _) = side(engine(&dir, 3 * tokens, 2048), 0, false).await;
        for k in 0..3 {
            local(&p.engine, &prompt(tokens, 900 + k)).await;
            local(&d.engine, &prompt(tokens, 950 + k)).await;
        }
        let (mut alone, mut handed_s) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            salt += 1;
            alone.push(local(&p.engine, &prompt(tokens, salt)).await);
            salt += 1;
            handed_s.push(handed(&peer, &d, &prompt(tokens, salt)).await);
        }
        let (a, h) = (median(alone), median(handed_s));
        let sent = match (group, chunk >= tokens) {
            (0, true) => "whole, after the forward",
            (0, false) => "per chunk, after each",
            _ => "per layer, during the forward",
        };
        println!("| {tokens} | {chunk} | {sent} | {a:.3} | {h:.3} | {:.3} | {transfer_alone:.3} |", h - a);
    }

    println!("\n## Inter-token latency of 8 running streams while two {tokens}-token prompts arrive");
    println!("| prompts | ITL p50 ms | ITL p99 ms | ITL max ms |\n|---|---|---|---|");
    for mode in ["none", "aggregated", "disaggregated"] {
        let (p, peer) = side(engine(&dir, 3 * tokens, 2048), 0, true).await;
        let (d, _) = side(engine(&dir, 4 * tokens, 2048), 0, false).await;
        for k in 0..3 {
            local(&p.engine, &prompt(tokens, 900 + k)).await;
            local(&d.engine, &prompt(tokens, 950 + k)).await;
        }
        let mut streams = Vec::new();
        for k in 0..8u64 {
            let mut rx = d
                .engine
                .submit(req(d.engine.next_id(), prompt(128, 1000 + k as usize), 300))
                .await
                .expect("stream");
            streams.push(tokio::spawn(async move {
                let mut at = Vec::new();
                while let Some(o) = rx.recv().await {
                    if o.token.is_some() {
                        at.push(Instant::now());
                    }
                    if o.finished.is_some() {
                        break;
                    }
                }
                at
            }));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let window = Instant::now();
        for k in 0..2 {
            salt += 1;
            let pr = prompt(tokens, salt);
            match mode {
                "aggregated" => {
                    local(&d.engine, &pr).await;
                }
                "disaggregated" => {
                    handed(&peer, &d, &pr).await;
                }
                _ => tokio::time::sleep(Duration::from_millis(if k == 0 { 2500 } else { 0 })).await,
            }
        }
        let end = Instant::now();
        let mut gaps = Vec::new();
        for s in streams {
            let at = s.await.expect("stream");
            for w in at.windows(2) {
                if w[1] > window && w[0] < end {
                    gaps.push((w[1] - w[0]).as_secs_f64() * 1e3);
                }
            }
        }
        gaps.sort_by(f64::total_cmp);
        let q = |f: f64| {
            gaps.get(((gaps.len() as f64 * f) as usize).min(gaps.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0)
        };
        println!("| {mode} | {:.1} | {:.1} | {:.1} |", q(0.5), q(0.99), gaps.last().copied().unwrap_or(0.0));
        drop((p, d));
    }
}
