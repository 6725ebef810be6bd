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
//! `cargo bench -p kvgate-worker --bench transfer` (`-- --quick`: one repetition; `-- --only-wire`: the wire table). Both engines share this
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

/// The secret the bench's grants are made under.
const SECRET: &str = "bench";

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// What a transfer of this engine's KV is valid for: fingerprint, block bytes, layers.
fn parts(e: &Engine<CpuBackend>) -> (u64, usize, usize) {
    let block_bytes = e.backend().kv_block_bytes(BS).expect("bytes");
    (e.tier_fingerprint(0, block_bytes), block_bytes, e.backend().kv_layers())
}

/// Starts an engine thread for `e` and its transfer state; a prefill side also gets a listener (its address).
async fn side(e: Engine<CpuBackend>, layer_group: u16, listen: bool) -> (Arc<Transfers>, String) {
    let (fingerprint, block_bytes, layers) = parts(&e);
    let engine = EngineHandle::spawn(e, 256, std::time::Duration::from_secs(5));
    let t = Arc::new(Transfers {
        key: [7; 32],
        grant_key: kvgate_shared::handoff::grant_key(SECRET),
        model: "bench".into(),
        worker_id: "bench".into(),
        fingerprint,
        block_bytes,
        layers,
        block_size: BS,
        lease: Duration::from_secs(30),
        stall: Duration::from_secs(30),
        export_backlog: 64 << 20,
        layer_group,
        frame_bytes: 8 << 20,
        max_prompt_tokens: 40_000,
        engine,
        transport: Default::default(),
        imports: Default::default(),
        adapters: kvgate_worker::transfer::no_adapters(),
    });
    let mut addr = String::new();
    if listen {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        addr = l.local_addr().expect("addr").to_string();
        tokio::spawn(kvgate_worker::transfer::export::serve(l, t.clone(), addr.clone()));
    }
    (t, addr)
}

fn prompt(n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13 + salt * 104_729) % 8000) as u32).collect()
}

fn req(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
    EngineRequest { id, prompt, params, extra_keys: ExtraKeys::none(), adapter: None }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds to move `bytes` through one loopback link in 8 MiB Blocks frames, to memcpy them, and to MAC them as
/// one side of the link seals (keyed BLAKE3 per 8 MiB frame, one thread; the receiver checks the same MAC).
async fn wire(bytes: usize) -> (f64, f64, f64) {
    let payload = vec![3u8; bytes];
    let mut dst = vec![1u8; bytes];
    let t = Instant::now();
    dst.copy_from_slice(&payload);
    std::hint::black_box(&dst);
    let memcpy = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for part in payload.chunks(8 << 20) {
        std::hint::black_box(blake3::keyed_hash(&[7; 32], part));
    }
    let mac = t.elapsed().as_secs_f64();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let limits = Limits { max_prompt_tokens: 16, max_payload: 8 << 20 };
    let rx = tokio::spawn(async move {
        let (s, _) = listener.accept().await.expect("accept");
        let mut link = TcpLink::accept(s, "bench".into(), limits, &[7; 32]).await.expect("handshake");
        let mut got = 0;
        while got < bytes {
            match link.recv().await.expect("frame") {
                Frame::Blocks(b) => got += b.payload.len(),
                other => panic!("{other:?}"),
            }
        }
    });
    let s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut link = TcpLink::dial(s, "bench".into(), limits, &[7; 32]).await.expect("handshake");
    let t = Instant::now();
    for (i, part) in payload.chunks(8 << 20).enumerate() {
        link.send_blocks(1, i as u32, 1, (0, 6), part).await.expect("send");
    }
    rx.await.expect("receiver");
    (t.elapsed().as_secs_f64(), memcpy, mac)
}

/// Seconds from a decode engine's import request to its first token, with the prompt prefilled by `p`.
async fn handed(peer: &str, d: &Transfers, prompt: &[u32]) -> f64 {
    let t = Instant::now();
    let id = d.engine.next_id();
    let r = req(id, prompt.to_vec(), 1);
    let (plan, mut rx) = d.engine.start_import(r.clone()).await.expect("import");
    let (_cancel, cancelled) = tokio::sync::oneshot::channel();
    let g = kvgate_shared::handoff::GrantFor { model: "bench", peer, decode: "bench", prompt };
    let grant = kvgate_shared::handoff::sign_prefill_grant(SECRET, unix_ms(), id, &g);
    let want = Want { id, prompt, extra_keys: &r.extra_keys, params: &r.params, plan, grant: &grant };
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
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let reps = if quick { 1 } else { 5 };
    let flag = |name: &str, default: usize| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    // `--itl-tokens 32768 --itl-prompts 1 --only-itl`: the long-prompt run.
    let (itl_tokens, itl_prompts) = (flag("--itl-tokens", 4096), flag("--itl-prompts", 2));
    let only_itl = args.iter().any(|a| a == "--only-itl");
    let dir = std::env::temp_dir().join("kvgate-bench-small");
    if !dir.join("model.safetensors").exists() {
        synth_model(&dir, &SynthSpec::new(Preset::Small, 0)).expect("synth");
    }
    println!(
        "kvgate KV transfer benchmark: preset small (6 layers, 4 KV heads x 32, 6 KiB a token), {} threads",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );

    if !only_itl {
        wire_table(reps).await;
        // `--only-wire`: the wire table alone (seconds, not minutes).
        if args.iter().any(|a| a == "--only-wire") {
            return;
        }
        handed_table(&dir, reps).await;
    }
    println!("\n## Inter-token latency of 8 running streams while {itl_prompts} {itl_tokens}-token prompt(s) arrive");
    println!("| prompts | ITL p50 ms | ITL p99 ms | ITL max ms | window s |\n|---|---|---|---|---|");
    for mode in ["none", "aggregated", "disaggregated"] {
        let (p50, p99, max, window) = itl(&dir, itl_tokens, itl_prompts, mode).await;
        println!("| {mode} | {p50:.1} | {p99:.1} | {max:.1} | {window:.1} |");
    }
}

/// Keeps 8 streams decoding on a decode engine (each a 128-token prompt and 64 tokens, resubmitted as it ends)
/// while `prompts` prompts of `tokens` arrive one after the other: prefilled on the decode engine (`aggregated`),
/// imported from a prefill engine (`disaggregated`) or not at all (`none`: a 3 s window). The inter-token gaps in
/// the window: p50, p99, max (ms) and the window (s).
async fn itl(dir: &std::path::Path, tokens: usize, prompts: usize, mode: &str) -> (f64, f64, f64, f64) {
    let (p, peer) = side(engine(dir, tokens + 4096, 2048), 0, true).await;
    let (d, _) = side(engine(dir, tokens + 8 * 4096, 2048), 0, false).await;
    local(&p.engine, &prompt(tokens.min(8192), 900)).await;
    local(&d.engine, &prompt(tokens.min(8192), 950)).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut streams = Vec::new();
    for k in 0..8usize {
        let (d, stop) = (d.clone(), stop.clone());
        streams.push(tokio::spawn(async move {
            let mut at = Vec::new();
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += 1;
                let mut rx = d
                    .engine
                    .submit(req(d.engine.next_id(), prompt(128, 1000 + k * 97 + n), 64))
                    .await
                    .expect("stream");
                let mut last = None;
                while let Some(o) = rx.recv().await {
                    if o.token.is_some() {
                        let now = Instant::now();
                        if let Some(l) = last {
                            at.push((l, now));
                        }
                        last = Some(now);
                    }
                    if o.finished.is_some() {
                        break;
                    }
                }
            }
            at
        }));
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let window = Instant::now();
    for k in 0..prompts {
        let pr = prompt(tokens, 5000 + k);
        match mode {
            "aggregated" => {
                local(&d.engine, &pr).await;
            }
            "disaggregated" => {
                handed(&peer, &d, &pr).await;
            }
            _ => tokio::time::sleep(Duration::from_secs(3)).await,
        }
    }
    let end = Instant::now();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut gaps = Vec::new();
    for s in streams {
        for (a, b) in s.await.expect("stream") {
            if b > window && a < end {
                gaps.push((b - a).as_secs_f64() * 1e3);
            }
        }
    }
    gaps.sort_by(f64::total_cmp);
    let q = |f: f64| {
        gaps.get(((gaps.len() as f64 * f) as usize).min(gaps.len().saturating_sub(1))).copied().unwrap_or(0.0)
    };
    (q(0.5), q(0.99), gaps.last().copied().unwrap_or(0.0), (end - window).as_secs_f64())
}

/// The first two tables.
async fn wire_table(reps: usize) {
    println!("\n## The wire: one loopback TCP link vs memcpy\n| tokens | bytes | memcpy GB/s | MAC GB/s | link GB/s | link / memcpy |\n|---|---|---|---|---|---|");
    for tokens in [4096usize, 32_768] {
        let bytes = tokens * 6144;
        let runs: Vec<(f64, f64, f64)> = {
            let mut v = Vec::new();
            for _ in 0..reps {
                v.push(wire(bytes).await);
            }
            v
        };
        let link = median(runs.iter().map(|r| r.0).collect());
        let memcpy = median(runs.iter().map(|r| r.1).collect());
        let mac = median(runs.iter().map(|r| r.2).collect());
        let gb = |s: f64| bytes as f64 / s / 1e9;
        println!(
            "| {tokens} | {:.0} MiB | {:.2} | {:.2} | {:.2} | {:.3}x |",
            bytes as f64 / (1 << 20) as f64,
            gb(memcpy),
            gb(mac),
            gb(link),
            memcpy / link
        );
    }
}

async fn handed_table(dir: &std::path::Path, reps: usize) {
    println!("\n## A prompt handed from a prefill engine to a decode engine (time to the decode side's first token)");
    println!("| tokens | chunk | KV sent | prefill alone s | handed s | handed - alone s (median of pairs) | transfer alone s |\n|---|---|---|---|---|---|---|");
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
        let (p, peer) = side(engine(dir, 3 * tokens, chunk), group, true).await;
        let (d, _) = side(engine(dir, 3 * tokens, 2048), 0, false).await;
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
        let diffs: Vec<f64> = handed_s.iter().zip(&alone).map(|(h, a)| h - a).collect();
        let spread = diffs.iter().fold(0f64, |m, d| m.max(d.abs()));
        let (a, h, exposed) = (median(alone), median(handed_s), median(diffs));
        let sent = match (group, chunk >= tokens) {
            (0, true) => "whole, after the forward",
            (0, false) => "per chunk, after each",
            _ => "per layer, during the forward",
        };
        println!("| {tokens} | {chunk} | {sent} | {a:.3} | {h:.3} | {exposed:.3} (max abs {spread:.3}) | {transfer_alone:.3} |");
    }
}
