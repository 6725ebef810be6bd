//! Long multi-turn chats, direct vs through the gateway, side by side in one run: what the gateway's
//! tokenization costs a conversation's turns, and what the segment cache and the prompt handoff give back.
//!
//! One simulated worker (`--engine sim`, GPU timing profile, real time; the synthetic tokenizer and chat template),
//! called directly, and three gateways in front of it: `plain` (no segment cache, no handoff: every turn renders and tokenizes the
//! whole conversation, and the worker does it again), `cached` (segment cache only) and `handoff` (segment cache +
//! the token ids handed to the worker, the default). A second worker without its own segment cache (as workers were
//! before it) is called directly too, for reference. Each path runs its own conversations (its own texts, so no
//! path finds another's pieces in a cache); turns are sent path after path in rotating order, with `max_tokens` 1,
//! and the time to the whole answer is recorded (prefill of the new message + one token, as in TTFT). Turns 2..
//! are measured: the history is in the worker's KV cache on every path.
//!
//! The peer router SMG (PyPI `smg`, `smg launch --policy cache_aware`) in front of the same worker is a path too when
//! its binary is found: `$KVGATE_SMG`, else `target/peer-bench/venv/bin/smg` (where `scripts/peer-bench.sh` installs
//! it); without it the table says so.
//!
//! `cargo bench -p kvgate-gateway --bench chat_latency` (builds the release binaries it needs).

mod common;

use std::time::{Duration, Instant};

use common::{http, percentile, port, release_bins, start, timed, Proc};
use kvgate_shared::prompt::{synth_text, ChatOptions, PromptInput, Prompter};
use serde_json::json;

const TURNS: usize = 12;
const CONVERSATIONS: u64 = 6;

fn gateway(bin: &str, extra: &[&str]) -> (Proc, String, String) {
    let (gp, cp) = (port(), port());
    let mut args: Vec<String> = vec![
        "--listen".into(),
        format!("127.0.0.1:{gp}"),
        "--control-listen".into(),
        format!("127.0.0.1:{cp}"),
        "--report-secret".into(),
        "bench-secret".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    (start(bin, &args, "listening on"), format!("http://127.0.0.1:{gp}"), format!("http://127.0.0.1:{cp}"))
}

/// The messages of turn `turn` of conversation `conv` on path `path`: a system prompt of `system_words` words,
/// then `turn` exchanges of 30-word messages, then a 40-word question.
fn messages(path: u64, conv: u64, turn: usize, system_words: usize) -> Vec<serde_json::Value> {
    let seed = path * 1_000_000 + conv * 1_000;
    let mut m = vec![json!({"role": "system", "content": synth_text(seed, system_words)})];
    for t in 0..turn as u64 {
        m.push(json!({"role": "user", "content": synth_text(seed + 2 * t + 1, 30)}));
        m.push(json!({"role": "assistant", "content": synth_text(seed + 2 * t + 2, 30)}));
    }
    m.push(json!({"role": "user", "content": synth_text(seed + 999, 40)}));
    m
}

/// SMG (cache_aware) in front of `worker`, when its binary is found.
fn smg(worker: &str) -> Option<(Proc, String)> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let bin =
        std::env::var("KVGATE_SMG").unwrap_or_else(|_| format!("{root}/target/peer-bench/venv/bin/smg"));
    if !std::path::Path::new(&bin).exists() {
        println!("SMG not found at {bin} (set KVGATE_SMG or run scripts/peer-bench.sh once): no SMG path\n");
        return None;
    }
    let (p, mp) = (port(), port());
    // Wrapped in `Proc` (killed and reaped on drop) at once.
    #[allow(clippy::zombie_processes)]
    let child = std::process::Command::new(bin)
        .args([
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            &p.to_string(),
            "--prometheus-port",
            &mp.to_string(),
        ])
        .args(["--policy", "cache_aware", "--worker-urls", worker])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn smg");
    let child = Proc::adopt(child);
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", p)).is_err() {
        assert!(Instant::now() < deadline, "SMG never listened");
        std::thread::sleep(Duration::from_millis(100));
    }
    Some((child, format!("http://127.0.0.1:{p}")))
}

fn main() {
    let bin = release_bins();
    let dir = std::env::temp_dir().join("kvgate-chat-latency-bench");
    let gw_bin = bin("kvgate-gateway");
    let paths = [
        ("plain", gateway(&gw_bin, &["--tokenize-cache-tokens", "0", "--prompt-handoff", "false"])),
        ("cached", gateway(&gw_bin, &["--prompt-handoff", "false"])),
        ("handoff", gateway(&gw_bin, &[])),
    ];
    let report_to: Vec<String> = paths.iter().map(|(_, (_, _, control))| control.clone()).collect();
    let worker = |extra: &[String]| -> (Proc, String) {
        let p = port();
        let mut args: Vec<String> = [
            "serve",
            "--synth",
            "tiny",
            "--engine",
            "sim",
            "--sim-profile",
            "gpu-h100-llama3-8b",
            "--kv-cache-tokens",
            "1048576",
            "--host",
            "127.0.0.1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(["--synth-dir".into(), dir.display().to_string(), "--port".into(), p.to_string()]);
        args.extend(extra.iter().cloned());
        (start(&bin("kvgate-worker"), &args, " ready "), format!("http://127.0.0.1:{p}"))
    };
    let (_w, direct) = worker(&[
        "--max-body-bytes".into(),
        (32 << 20).to_string(),
        "--report-to".into(),
        report_to.join(","),
        "--report-interval".into(),
        "200ms".into(),
        "--report-secret".into(),
        "bench-secret".into(),
    ]);
    // The same worker without its own segment cache, as workers were before it (no reports: no gateway uses it).
    let (_u, uncached) = worker(&["--tokenize-cache-tokens".into(), "0".into()]);
    let peer = smg(&direct);
    let prompter = Prompter::from_dir(&dir).expect("the worker wrote its synthetic model");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("rt");
    rt.block_on(async move {
        let client = http();
        let send = |base: String, body: String| {
            let client = client.clone();
            async move { timed(&client, "POST", &format!("{base}/v1/chat/completions"), body).await }
        };
        let probe = json!({"model": "kvgate-tiny", "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}]})
        .to_string();
        let proxies = paths.iter().map(|(_, (_, base, _))| base).chain(peer.iter().map(|(_, base)| base));
        for base in proxies {
            let deadline = Instant::now() + Duration::from_secs(60);
            while send(base.clone(), probe.clone()).await.0 != 200 {
                assert!(Instant::now() < deadline, "gateway never became ready");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let bases: Vec<(&str, String)> =
            [("direct, worker without segment cache", uncached), ("direct", direct.clone())]
                .into_iter()
                .chain(paths.iter().map(|(name, (_, base, _))| (*name, base.clone())))
                .chain(peer.iter().map(|(_, base)| ("SMG cache_aware", base.clone())))
                .collect();
        println!(
            "{CONVERSATIONS} conversations x {TURNS} turns per path and size, max_tokens 1, one sim worker \
             (gpu-h100-llama3-8b timing), turns 2..{TURNS} measured\n"
        );
        println!("| prompt at the last turn | path | p50 ms | p90 ms | added vs direct (p50) ms |");
        println!("|---|---|---|---|---|");
        for (label, system_words) in [("2K class", 170usize), ("16K class", 6_300)] {
            let mut times: Vec<Vec<f64>> = vec![Vec::new(); bases.len()];
            let mut tokens = 0usize;
            for conv in 0..CONVERSATIONS {
                for turn in 0..TURNS {
                    for k in 0..bases.len() {
                        // Rotate the order so no path always goes first.
                        let p = (k + turn + conv as usize) % bases.len();
                        let conv_id = conv + 100 * system_words as u64;
                        let body = json!({"model": "kvgate-tiny", "max_tokens": 1, "temperature": 0,
                            "messages": messages(p as u64, conv_id, turn, system_words)})
                        .to_string();
                        let (status, ms) = send(bases[p].1.clone(), body.clone()).await;
                        assert_eq!(status, 200, "{}", bases[p].0);
                        if turn > 0 {
                            times[p].push(ms);
                        }
                        if turn == TURNS - 1 && p == 0 {
                            let m = messages(p as u64, conv_id, turn, system_words);
                            let options =
                                ChatOptions { add_generation_prompt: true, ..ChatOptions::default() };
                            let ids = prompter
                                .tokenize(&PromptInput::Chat { messages: &m, options: &options })
                                .expect("tokenizes");
                            tokens = tokens.max(ids.len());
                        }
                    }
                }
            }
            let d50 = percentile(&times[1], 0.5);
            for (k, (name, _)) in bases.iter().enumerate() {
                let (p50, p90) = (percentile(&times[k], 0.5), percentile(&times[k], 0.9));
                let added = if k == 1 { "-".to_owned() } else { format!("{:+.2}", p50 - d50) };
                println!("| {tokens} tokens ({label}) | {name} | {p50:.2} | {p90:.2} | {added} |");
            }
        }
    });
}
