//! Normal traffic next to hostile clients, measured side by side in one run (release binaries, real processes on
//! loopback, a simulated worker that answers at once so the figures are the gateway's):
//!
//! 1. small completions, quiet vs while 200 idle keep-alive connections and 50 clients trickling a header one byte
//!    every 5 s are open (interleaved rounds, so drift in the machine's load hits both sides);
//! 2. `GET /health`, quiet vs while three 8 MB text prompts are being tokenized (interleaved rounds).
//!
//! `cargo bench -p kvgate-gateway --bench hostile` (builds the release binaries it needs).

mod common;

use std::time::{Duration, Instant};

use common::{http, percentile, port, release_bins, small_body, start, timed, Http};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ROUNDS: u32 = 10;
const PER_ROUND: u32 = 500;

async fn small(client: &Http, gw: &str, i: u32) -> f64 {
    let (status, ms) = timed(client, "POST", &format!("{gw}/v1/completions"), small_body(i)).await;
    assert_eq!(status, 200);
    ms
}

async fn hostile_connections(addr: &str) -> (Vec<TcpStream>, Vec<tokio::task::JoinHandle<()>>) {
    let mut idle = Vec::new();
    for _ in 0..200 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await.expect("write");
        let mut buf = [0u8; 512];
        let _ = s.read(&mut buf).await.expect("read");
        idle.push(s);
    }
    let trickle = (0..50)
        .map(|_| {
            let addr = addr.to_owned();
            tokio::spawn(async move {
                let mut s = TcpStream::connect(addr).await.expect("connect");
                for b in b"POST /v1/completions HTTP/1.1\r\n" {
                    if s.write_all(&[*b]).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            })
        })
        .collect();
    (idle, trickle)
}

fn row(name: &str, v: &mut [f64]) -> (f64, f64) {
    let (p50, p99) = (percentile(v, 0.5), percentile(v, 0.99));
    println!("| {name} | {} | {p50:.3} | {p99:.3} |", v.len());
    (p50, p99)
}

fn main() {
    let bin = release_bins();
    let dir = std::env::temp_dir().join("kvgate-hostile-bench");
    std::fs::create_dir_all(&dir).expect("dir");
    let profile = dir.join("instant.toml");
    std::fs::write(
        &profile,
        "name = \"instant\"\nsource = \"bench\"\nmax_model_len = 8192\n[timing]\nprefill_base_s = 0.0\n\
         prefill_per_token_s = 0.0\nprefill_attention_s = 0.0\ndecode_base_s = 0.0\ndecode_per_seq_s = 0.0\n\
         decode_per_kv_token_s = 0.0\n",
    )
    .expect("profile");
    let (wp, gp, cp) = (port(), port(), port());
    let s = |v: &str| v.to_string();
    let _g = start(
        &bin("kvgate-gateway"),
        &[
            s("--listen"),
            format!("127.0.0.1:{gp}"),
            s("--control-listen"),
            format!("127.0.0.1:{cp}"),
            s("--report-secret"),
            s("bench-secret"),
            // Long enough that the hostile connections stay open through a round.
            s("--keepalive-timeout"),
            s("60s"),
            s("--header-read-timeout"),
            s("60s"),
        ],
        "listening on",
    );
    let _w = start(
        &bin("kvgate-worker"),
        &[
            s("serve"),
            s("--synth"),
            s("tiny"),
            s("--synth-dir"),
            dir.join("tiny").display().to_string(),
            s("--engine"),
            s("sim"),
            s("--sim-profile"),
            profile.display().to_string(),
            s("--host"),
            s("127.0.0.1"),
            s("--port"),
            wp.to_string(),
            s("--report-to"),
            format!("http://127.0.0.1:{cp}"),
            s("--report-interval"),
            s("200ms"),
            s("--report-secret"),
            s("bench-secret"),
        ],
        " ready ",
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("rt");
    rt.block_on(async move {
        let client: Http = http();
        let gw = format!("http://127.0.0.1:{gp}");
        let addr = format!("127.0.0.1:{gp}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let body = "{\"model\":\"kvgate-tiny\",\"prompt\":[1,2],\"max_tokens\":1}".to_string();
            if timed(&client, "POST", &format!("{gw}/v1/completions"), body).await.0 == 200 {
                break;
            }
            assert!(Instant::now() < deadline, "gateway never became ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for i in 0..200 {
            small(&client, &gw, i).await;
        }

        // 1. Slow and idle clients.
        let (mut quiet, mut attacked) = (Vec::new(), Vec::new());
        for r in 0..ROUNDS {
            for i in 0..PER_ROUND {
                quiet.push(small(&client, &gw, r * 1000 + i).await);
            }
            let (idle, trickle) = hostile_connections(&addr).await;
            for i in 0..PER_ROUND {
                attacked.push(small(&client, &gw, r * 1000 + 500 + i).await);
            }
            drop(idle);
            trickle.iter().for_each(|t| t.abort());
        }
        println!(
            "{} small completions per side ({ROUNDS} interleaved rounds), sequential, through the gateway\n",
            ROUNDS * PER_ROUND
        );
        println!("| condition | requests | p50 ms | p99 ms |\n|---|---|---|---|");
        let (q50, q99) = row("quiet", &mut quiet);
        let (a50, a99) = row("200 idle keep-alive + 50 trickling connections open", &mut attacked);
        println!("| ratio (hostile / quiet) | | {:.3} | {:.3} |\n", a50 / q50, a99 / q99);

        // 2. Huge prompts on the tokenize pool.
        let text = "lorem ipsum dolor sit amet, consectetur adipiscing elit ".repeat(8_000_000 / 56);
        let big = format!("{{\"model\":\"kvgate-tiny\",\"prompt\":{},\"max_tokens\":1}}", serde_json::json!(text));
        let (mut hq, mut hb) = (Vec::new(), Vec::new());
        let mut busy_for = Duration::ZERO;
        for _ in 0..3 {
            for _ in 0..300 {
                hq.push(timed(&client, "GET", &format!("{gw}/health"), String::new()).await.1);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let started = Instant::now();
            let heavy: Vec<_> = (0..3)
                .map(|_| {
                    let (client, url, body) = (client.clone(), format!("{gw}/v1/completions"), big.clone());
                    tokio::spawn(async move { timed(&client, "POST", &url, body).await.0 })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(100)).await;
            while !heavy.iter().all(|h| h.is_finished()) {
                hb.push(timed(&client, "GET", &format!("{gw}/health"), String::new()).await.1);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            busy_for += started.elapsed();
            for h in heavy {
                assert_eq!(h.await.expect("join"), 400, "refused after tokenizing: over the context");
            }
        }
        println!("GET /health (3 interleaved rounds): quiet, and while three 8 MB text prompts are tokenized ({busy_for:.1?} in all)\n");
        println!("| condition | probes | p50 ms | p99 ms |\n|---|---|---|---|");
        let (h50, h99) = row("quiet", &mut hq);
        let (b50, b99) = row("3 x 8 MB prompts tokenizing", &mut hb);
        println!("| ratio (tokenizing / quiet) | | {:.3} | {:.3} |", b50 / h50, b99 / h99);
    });
}
