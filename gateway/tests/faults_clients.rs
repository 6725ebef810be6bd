//! Fault injection, client side: idle and trickling connections, a connection flood, huge unauthenticated report
//! bodies, huge prompts being tokenized, slow bodies, against a real gateway and worker on loopback. Every test is
//! bounded in time and count.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn addr(base: &str) -> String {
    base.trim_start_matches("http://").to_owned()
}

/// Reads from `s` until EOF (or an error); returns what was read and when it ended.
async fn read_to_close(s: &mut TcpStream, within: Duration) -> Option<(String, Instant)> {
    let mut buf = Vec::new();
    let read = tokio::time::timeout(within, async {
        let mut chunk = [0u8; 4096];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    read.ok().map(|_| (String::from_utf8_lossy(&buf).into_owned(), Instant::now()))
}

/// Latencies (ms) of `n` small completions, one after another.
async fn small_requests(g: &str, n: u32, seed: u32) -> Vec<f64> {
    let url = format!("{g}/v1/completions");
    let mut out = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        let prompt: Vec<u32> = (0..8).map(|k| (k * 31 + i * 7 + seed) % 500).collect();
        let r = post(&url, &json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        out.push(t.elapsed().as_secs_f64() * 1e3);
    }
    out
}

/// Opens `n` keep-alive connections that each made one request and then sit idle.
async fn idle_connections(g: &str, n: usize) -> Vec<TcpStream> {
    let mut idle = Vec::new();
    for _ in 0..n {
        let mut s = TcpStream::connect(addr(g)).await.expect("connect");
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await.expect("write");
        let mut buf = [0u8; 512];
        let n = s.read(&mut buf).await.expect("read");
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        idle.push(s);
    }
    idle
}

/// Starts `n` clients trickling a request header one byte every 5 s; each returns (what the gateway answered,
/// when it closed, bytes sent).
fn tricklers(g: &str, n: usize) -> Vec<tokio::task::JoinHandle<(String, Duration, usize)>> {
    (0..n)
        .map(|_| {
            let a = addr(g);
            tokio::spawn(async move {
                let mut s = TcpStream::connect(a).await.expect("connect");
                let started = Instant::now();
                let header = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n";
                let mut i = 0;
                let mut answer = String::new();
                // Write a byte, then wait up to 5 s for the connection to answer or close.
                while i < header.len() {
                    if s.write_all(&header[i..i + 1]).await.is_err() {
                        break;
                    }
                    i += 1;
                    let mut buf = [0u8; 1024];
                    match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
                        Err(_) => continue,
                        Ok(Ok(n)) if n > 0 => {
                            answer.push_str(&String::from_utf8_lossy(&buf[..n]));
                            if let Some((rest, _)) = read_to_close(&mut s, Duration::from_secs(2)).await {
                                answer.push_str(&rest);
                            }
                            break;
                        }
                        Ok(_) => break,
                    }
                }
                (answer, started.elapsed(), i)
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_trickling_connections_are_closed_in_time_and_cost_normal_requests_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let profile = sim_profile(dir.path(), "instant", 0.0, 0.0);
    let (g, control) = gateway(&["--keepalive-timeout", "4s", "--header-read-timeout", "4s"]);
    let sim = ["--engine", "sim", "--sim-profile", profile.to_str().expect("p")];
    let _w = worker("w", &synth, Some(&control), &sim);
    wait_healthy(&control, 1).await;
    small_requests(&g.base, 50, 0).await; // warm the pools

    // Latency: rounds of quiet and attacked batches, interleaved so that drift in the machine's load hits both.
    // An attacked batch runs while 200 idle keep-alive connections and 50 tricklers are open.
    let (mut quiet, mut attacked) = (Vec::new(), Vec::new());
    for round in 0..5u32 {
        quiet.extend(small_requests(&g.base, 200, 10 * round).await);
        let idle = idle_connections(&g.base, 200).await;
        let slow = tricklers(&g.base, 50);
        tokio::time::sleep(Duration::from_millis(20)).await;
        attacked.extend(small_requests(&g.base, 200, 10 * round + 5).await);
        drop(idle);
        for t in slow {
            t.abort();
        }
    }
    let (q, a) = (percentile(&quiet, 0.99), percentile(&attacked, 0.99));
    eprintln!(
        "normal requests p99: quiet {q:.2} ms, with 200 idle + 50 trickling connections open {a:.2} ms \
         (medians {:.2} / {:.2} ms; 1000 requests each, 5 interleaved rounds)",
        percentile(&quiet, 0.5),
        percentile(&attacked, 0.5)
    );
    // A regression guard, not the measurement: a gateway that let slow clients hold its threads would add
    // hundreds of ms. The precise ratio (target: within 10%) is measured side by side by `--bench hostile`
    // (docs/benchmarks/gateway.md); on 2 shared cores a ~1 ms p99 moves by +-50% from run to run.
    assert!(a <= q * 2.0 + 2.0, "p99 {a:.2} ms under attack vs {q:.2} ms quiet");

    // Timeouts: the gateway closes idle connections after the keep-alive timeout and answers tricklers 408 after
    // the header timeout.
    let opened = Instant::now();
    let idle = idle_connections(&g.base, 200).await;
    let slow = tricklers(&g.base, 50);
    for mut s in idle {
        let (_, closed_at) =
            read_to_close(&mut s, Duration::from_secs(8)).await.expect("idle connection closed");
        let after = closed_at.duration_since(opened);
        assert!(
            after >= Duration::from_secs(4) && after < Duration::from_millis(6500),
            "closed after {after:?}"
        );
    }
    for t in slow {
        let (answer, took, bytes) = t.await.expect("join");
        assert!(answer.starts_with("HTTP/1.1 408"), "a trickler got {answer:?} after {bytes} bytes");
        assert!(answer.contains("request_timeout"), "{answer}");
        assert!(
            took >= Duration::from_secs(4) && took < Duration::from_millis(5500),
            "closed after {took:?}"
        );
    }
}

#[tokio::test]
async fn past_the_connection_cap_new_connections_get_503() {
    let (g, _control) = gateway(&["--max-connections", "4", "--header-read-timeout", "10s"]);
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(addr(&g.base)).await.expect("connect"));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut extra = TcpStream::connect(addr(&g.base)).await.expect("connect");
    let (answer, _) = read_to_close(&mut extra, Duration::from_secs(2)).await.expect("answered and closed");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("too_many_connections"), "{answer}");
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(get(&format!("{}/health", g.base)).await.status, 200, "a slot freed up");
}

#[tokio::test]
async fn huge_unauthenticated_report_posts_get_401_at_once_and_cost_no_memory() {
    let (g, control) = gateway(&[]);
    let pid = g.child.id();
    let rss0 = rss_kib(pid);
    let body_len: usize = 90 << 20;
    let mut clients = Vec::new();
    for _ in 0..4 {
        let a = addr(&control);
        clients.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(a).await.expect("connect");
            let head = format!(
                "POST /kvgate/v1/report HTTP/1.1\r\nhost: x\r\ncontent-type: application/x-kvgate-report\r\n\
                 content-length: {body_len}\r\n\r\n"
            );
            let sent = Instant::now();
            s.write_all(head.as_bytes()).await.expect("head");
            let (mut rd, mut wr) = s.into_split();
            // Keep sending the body while waiting for the answer.
            let writer = tokio::spawn(async move {
                let chunk = vec![0u8; 1 << 20];
                let mut n = 0;
                while n < body_len {
                    if wr.write_all(&chunk).await.is_err() {
                        break;
                    }
                    n += chunk.len();
                }
                n
            });
            let mut buf = [0u8; 1024];
            let got = tokio::time::timeout(Duration::from_secs(5), rd.read(&mut buf))
                .await
                .expect("answer")
                .expect("read");
            let took = sent.elapsed();
            let answer = String::from_utf8_lossy(&buf[..got]).into_owned();
            writer.abort();
            (answer, took)
        }));
    }
    let mut worst = Duration::ZERO;
    for c in clients {
        let (answer, took) = c.await.expect("join");
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
        assert!(took < Duration::from_millis(100), "401 after {took:?}");
        worst = worst.max(took);
    }
    let grown = rss_kib(pid).saturating_sub(rss0);
    eprintln!("4 x 90 MiB unauthenticated reports: 401 within {worst:?}; gateway RSS grew {grown} KiB");
    assert!(grown < 16 * 1024, "RSS grew {grown} KiB");
    // With the secret but an over-limit declared size: 413 before reading.
    let mut s = TcpStream::connect(addr(&control)).await.expect("connect");
    s.write_all(
        b"POST /kvgate/v1/report HTTP/1.1\r\nhost: x\r\nauthorization: Bearer test-secret\r\ncontent-length: 999999999999\r\n\r\n",
    )
    .await
    .expect("write");
    let mut buf = [0u8; 512];
    let n =
        tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await.expect("answer").expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 413"));
    // Admin routes check the token before the body too: the answer comes with no body byte sent.
    let mut s = TcpStream::connect(addr(&control)).await.expect("connect");
    s.write_all(b"PUT /admin/v1/weights HTTP/1.1\r\nhost: x\r\ncontent-length: 2097152\r\n\r\n")
        .await
        .expect("write");
    let n =
        tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await.expect("answer").expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 404"), "admin is off without a token");
}

#[tokio::test]
async fn health_stays_fast_while_8_mib_prompts_are_tokenized() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway(&[]);
    let _w = worker("w", &synth, Some(&control), &[]);
    wait_healthy(&control, 1).await;
    // 8,000,000 bytes of text each, every word drawn anew and each prompt its own (a repeated phrase would come
    // from the tokenizer's word and chunk caches): a fraction of a second of tokenization or more each, then
    // refused (far over the model's context).
    let mut heavy = Vec::new();
    for seed in 0..3u64 {
        let text = kvgate_shared::prompt::synth_text(1_000 + seed, 1_300_000);
        let big = json!({"model": MODEL, "prompt": text, "max_tokens": 1}).to_string();
        let (url, body) = (format!("{}/v1/completions", g.base), big);
        heavy.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = request("POST", &url, Some(body), &[]).await;
            (r.status, r.json()["error"]["code"].clone(), t.elapsed())
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut lat = Vec::new();
    while !heavy.iter().all(|h| h.is_finished()) && lat.len() < 2000 {
        let t = Instant::now();
        assert_eq!(get(&format!("{}/health", g.base)).await.status, 200);
        lat.push(t.elapsed().as_secs_f64() * 1e3);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut busy_for = Duration::ZERO;
    for h in heavy {
        let (status, code, took) = h.await.expect("join");
        assert_eq!((status, code), (400, json!("context_length_exceeded")));
        busy_for = busy_for.max(took);
    }
    assert!(lat.len() >= 20, "tokenization was too quick to measure ({busy_for:?})");
    let p = percentile(&lat, 0.99);
    eprintln!(
        "/health p99 {p:.2} ms over {} probes while 3 x 8 MB prompts were tokenized for {busy_for:?}",
        lat.len()
    );
    // A regression guard (tokenizing on the proxy threads stalls /health for seconds); the 10 ms target is
    // measured by `--bench hostile` (docs/benchmarks/gateway.md).
    assert!(p < 50.0, "/health p99 {p:.2} ms");
}

#[tokio::test]
async fn a_body_slower_than_the_read_deadline_gets_408() {
    let (g, _control) = gateway(&["--request-read-timeout", "1s"]);
    let mut s = TcpStream::connect(addr(&g.base)).await.expect("connect");
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
        .await
        .expect("write");
    let started = Instant::now();
    let (answer, _) = read_to_close(&mut s, Duration::from_secs(4)).await.expect("closed");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"));
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn a_cache_salt_header_that_is_not_text_gets_400_from_the_gateway() {
    let (g, _control) = gateway(&[]);
    let mut s = TcpStream::connect(addr(&g.base)).await.expect("connect");
    let body = br#"{"model":"m","prompt":[1,2,3],"max_tokens":1}"#;
    let mut req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\nx-kvgate-cache-salt: ",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(b"\xff\xfe\r\n\r\n");
    req.extend_from_slice(body);
    s.write_all(&req).await.expect("write");
    let (resp, _) = read_to_close(&mut s, Duration::from_secs(10)).await.expect("an answer");
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(resp.contains("x-kvgate-cache-salt") && resp.contains("invalid_request_error"), "{resp}");
}

/// HTTP/1.1 pipelining (RFC 9112 §9.3.2): a request sent on a keep-alive connection before the answer to the one
/// before it, behind a stream and behind a whole answer. Each gets its answer, in order (the gateway watching the
/// client for its leaving used to read the next request's first byte, take it for a client that sent data after
/// its body, and drop both).
#[tokio::test]
async fn a_request_pipelined_behind_a_stream_or_a_whole_answer_gets_its_answer() {
    let dir = tempfile::tempdir().expect("tmp");
    let (g, control) = gateway(&[]);
    let _w = worker("w0", &dir.path().join("tiny"), Some(&control), &[]);
    wait_healthy(&control, 1).await;
    let host = addr(&g.base);
    let req = |path: &str, body: serde_json::Value, last: bool| {
        let b = body.to_string();
        let close = if last { "connection: close\r\n" } else { "" };
        format!(
            "POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{close}\r\n{b}",
            b.len()
        )
    };
    let chat = |stream: bool| {
        json!({"model": MODEL, "max_tokens": 16, "stream": stream, "temperature": 0,
            "messages": [{"role": "user", "content": "pipelined requests each get an answer"}]})
    };
    for (first_streams, label) in [(true, "behind a stream"), (false, "behind a whole answer")] {
        let mut s = TcpStream::connect(&host).await.expect("connect");
        // Both requests in one write: the second is on the wire before the first is answered.
        let both = format!(
            "{}{}",
            req("/v1/chat/completions", chat(first_streams), false),
            req("/v1/chat/completions", chat(!first_streams), true)
        );
        s.write_all(both.as_bytes()).await.expect("write");
        let (text, _) = read_to_close(&mut s, Duration::from_secs(60)).await.expect("both answers in time");
        let heads = text.matches("HTTP/1.1 200").count();
        assert_eq!(heads, 2, "{label}: two answers, got {heads}:\n{text}");
        assert!(text.contains("data: [DONE]"), "{label}: the stream ran to its end:\n{text}");
        assert!(text.contains("\"object\":\"chat.completion\""), "{label}: the whole answer came:\n{text}");
    }
    // Both second requests were parsed from the bytes read with the first (`listener.rs`).
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(metric(&m, "kvgate_gateway_pipelined_requests_total"), Some(2.0), "{m}");
}
