//! Fault injection, upstream side: real worker processes killed, stopped, terminated and restarted under a real
//! gateway, and clients that leave early. Every test is bounded in time and stops what it started.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97)) % 500).collect()
}

fn sim_args(profile: &std::path::Path) -> Vec<String> {
    vec!["--engine".into(), "sim".into(), "--sim-profile".into(), profile.display().to_string()]
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[tokio::test]
async fn sigkill_after_three_chunks_ends_the_stream_with_an_error_event_and_the_next_request_goes_elsewhere()
{
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let profile = sim_profile(dir.path(), "slow-decode", 0.02, 0.0);
    let (g, control) = gateway(&[]);
    let sim = sim_args(&profile);
    let mut workers: HashMap<String, Proc> = ["a", "b"]
        .iter()
        .map(|id| (id.to_string(), worker(id, &synth, Some(&control), &strs(&sim))))
        .collect();
    wait_healthy(&control, 2).await;
    let prompt = ids(64, 1);
    let body =
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": true, "stream": true});
    let resp = open_stream(&format!("{}/v1/completions", g.base), &body).await;
    assert_eq!(resp.status(), 200);
    let serving = resp.headers()["x-kvgate-worker"].to_str().expect("id").to_owned();
    let mut body = resp.into_body();
    read_until(&mut body, "\"text\"", 3, Duration::from_secs(5)).await;
    signal(&workers[&serving], libc::SIGKILL);
    let killed_at = Instant::now();
    // The rest of the stream: an SSE error event, then EOF, within 2 s.
    let rest = read_rest(&mut body, Duration::from_secs(2)).await;
    let error_event =
        rest.lines().find(|l| l.starts_with("data: {\"error\"")).unwrap_or_else(|| panic!("{rest}"));
    let err: serde_json::Value = serde_json::from_str(&error_event["data: ".len()..]).expect("json");
    assert_eq!(err["error"]["code"], "upstream_error");
    eprintln!("stream ended {:?} after the SIGKILL", killed_at.elapsed());
    workers.get_mut(&serving).expect("proc").kill();
    // The same request again goes to the other worker.
    let again = post(
        &format!("{}/v1/completions", g.base),
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 3}),
        &[],
    )
    .await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_ne!(again.header("x-kvgate-worker"), serving);
}

#[tokio::test]
async fn sigstop_mid_request_gives_504_within_the_first_byte_timeout_and_sigcont_brings_the_worker_back() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let profile = sim_profile(dir.path(), "slow-decode", 0.02, 0.0);
    let (g, control) = gateway(&[
        "--first-byte-timeout",
        "2s",
        "--first-byte-per-prompt-token",
        "0s",
        "--first-byte-per-output-token",
        "0s",
        "--probe-interval",
        "200ms",
    ]);
    let w = worker("w", &synth, Some(&control), &strs(&sim_args(&profile)));
    wait_healthy(&control, 1).await;
    let url = format!("{}/v1/completions", g.base);
    // 200 tokens x 20 ms = 4 s of decoding, not streamed: no byte comes before the end.
    let long = json!({"model": MODEL, "prompt": ids(32, 2), "max_tokens": 200, "ignore_eos": true});
    let started = Instant::now();
    let pending = tokio::spawn({
        let url = url.clone();
        async move { post(&url, &long, &[]).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&w, libc::SIGSTOP);
    let r = pending.await.expect("join");
    let took = started.elapsed();
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "upstream_timeout");
    assert!(took >= Duration::from_secs(2) && took < Duration::from_millis(3500), "504 after {took:?}");
    let state = worker_state(&control, "w").await.expect("w");
    assert_eq!(state["inflight"], 0, "{state}");
    assert_eq!(state["suspect"], true, "{state}");
    assert_eq!(state["healthy"], false, "{state}");
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(metric(&m, "kvgate_gateway_upstream_timeouts_total{worker=\"w\"}"), Some(1.0), "{m}");
    signal(&w, libc::SIGCONT);
    wait_worker(&control, "w", Duration::from_secs(5), |s| s["healthy"] == true && s["suspect"] == false)
        .await;
    let r = post(&url, &json!({"model": MODEL, "prompt": ids(32, 3), "max_tokens": 2}), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test]
async fn sigterm_of_one_of_two_workers_during_50_concurrent_requests_costs_no_client_an_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let profile = sim_profile(dir.path(), "steady", 0.005, 0.0);
    let (g, control) = gateway(&[]);
    let sim = sim_args(&profile);
    let a = worker("a", &synth, Some(&control), &strs(&sim));
    let _b = worker("b", &synth, Some(&control), &strs(&sim));
    wait_healthy(&control, 2).await;
    let url = format!("{}/v1/completions", g.base);
    let mut tasks = Vec::new();
    for i in 0..50u32 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(u64::from(i) * 6)).await;
            let body =
                json!({"model": MODEL, "prompt": ids(40, 100 + i), "max_tokens": 20, "ignore_eos": true});
            post(&url, &body, &[("x-session-id", &format!("s{i}"))]).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    signal(&a, libc::SIGTERM);
    let mut served: HashMap<String, usize> = HashMap::new();
    for t in tasks {
        let r = t.await.expect("join");
        assert_eq!(r.status, 200, "a client saw an error: {}", r.body);
        *served.entry(r.header("x-kvgate-worker")).or_default() += 1;
    }
    eprintln!("served: {served:?}");
    assert!(served.get("b").is_some_and(|n| *n > 0));
    // The draining report reached the gateway: a is out of the ring (or already gone and dead).
    let s = worker_state(&control, "a").await.expect("a");
    assert_eq!(s["healthy"], false, "{s}");
}

#[tokio::test]
async fn a_client_leaving_before_the_first_byte_aborts_the_request_on_the_worker_and_pays_its_price() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let profile = sim_profile(dir.path(), "slow-decode", 0.02, 0.0);
    let (g, control) = gateway(&[]);
    let w = worker("w", &synth, Some(&control), &strs(&sim_args(&profile)));
    wait_healthy(&control, 1).await;
    let worker_metrics = || async { get(&format!("{}/metrics", w.base)).await.body };
    let before = worker_metrics().await;
    let aborted = |m: &str| metric(m, "kvgate_worker_aborted_requests_total").unwrap_or(0.0);
    let used = |m: &str| metric(m, "kvgate_worker_kv_blocks{state=\"used\"}").unwrap_or(0.0);
    let (aborted0, used0) = (aborted(&before), used(&before));
    // A long non-streamed request (10 s of decoding) whose client gives up after 500 ms.
    let long = json!({"model": MODEL, "prompt": ids(200, 4), "max_tokens": 500, "ignore_eos": true});
    let url = format!("{}/v1/completions", g.base);
    let gave_up = tokio::time::timeout(Duration::from_millis(500), post(&url, &long, &[])).await;
    assert!(gave_up.is_err(), "the request was still running");
    let left_at = Instant::now();
    // Within 1 s: the worker counted the abort and its KV usage is back where it was.
    loop {
        let m = worker_metrics().await;
        if aborted(&m) == aborted0 + 1.0 && used(&m) == used0 {
            break;
        }
        assert!(
            left_at.elapsed() < Duration::from_secs(1),
            "aborted {} (was {aborted0}), used blocks {} (was {used0})",
            aborted(&m),
            used(&m)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("worker aborted and freed its blocks {:?} after the client left", left_at.elapsed());
    // The worker had it, and a whole (not streamed) answer may have been all but computed when the client left: the
    // price reserved (200 prompt tokens + 500 max_tokens) is charged; nothing is refunded.
    let m = get(&format!("{control}/metrics")).await.body;
    assert!(!m.contains("kvgate_gateway_class_refunds_total"), "refunded in full: {m}");
    let charged: f64 = m
        .lines()
        .filter(|l| l.starts_with("kvgate_gateway_class_tokens_charged_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(charged, 700.0, "{m}");
    let s = worker_state(&control, "w").await.expect("w");
    assert_eq!(s["inflight"], 0, "{s}");
}

#[tokio::test]
async fn a_worker_refusing_with_queue_full_is_skipped_and_left_alone_for_its_retry_after() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let profile = sim_profile(dir.path(), "slow-decode", 0.02, 0.0);
    let (g, control) = gateway(&["--policy", "round_robin"]);
    let mut busy_args = sim_args(&profile);
    busy_args.extend(["--max-num-seqs", "1", "--max-waiting-requests", "1"].map(String::from));
    let busy = worker("busy", &synth, Some(&control), &strs(&busy_args));
    let _free = worker("free", &synth, Some(&control), &strs(&sim_args(&profile)));
    wait_healthy(&control, 2).await;
    // Fill the busy worker directly: one running, then one waiting (each 4 s of decoding).
    let direct = format!("{}/v1/completions", busy.base);
    let mut hogs = Vec::new();
    for i in 0..2u32 {
        let direct = direct.clone();
        hogs.push(tokio::spawn(async move {
            let body =
                json!({"model": MODEL, "prompt": ids(16, 50 + i), "max_tokens": 200, "ignore_eos": true});
            post(&direct, &body, &[]).await
        }));
        // Until the worker holds it (running, then waiting).
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let m = get(&format!("{}/metrics", busy.base)).await.body;
            let q = |s: &str| {
                metric(&m, &format!("kvgate_worker_queue_requests{{state=\"{s}\"}}")).unwrap_or(0.0)
            };
            if q("running") + q("waiting") >= f64::from(i + 1) {
                break;
            }
            assert!(Instant::now() < deadline, "the worker never held hog {i}: {m}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let probe = post(&direct, &json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 1}), &[]).await;
    assert_eq!(probe.status, 503, "{}", probe.body);
    assert_eq!(probe.json()["error"]["code"], "queue_full");
    // Round robin sends one of the next two requests to the busy worker first: it refuses, the other serves.
    let url = format!("{}/v1/completions", g.base);
    let mut routes = Vec::new();
    for i in 0..2u32 {
        let r = post(&url, &json!({"model": MODEL, "prompt": ids(16, 60 + i), "max_tokens": 2}), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        routes.push((r.header("x-kvgate-worker"), r.header("x-kvgate-route")));
    }
    assert!(routes.iter().all(|(w, _)| w == "free"), "{routes:?}");
    assert!(routes.iter().any(|(_, r)| r == "fallback"), "{routes:?}");
    let s = worker_state(&control, "busy").await.expect("busy");
    assert_eq!(s["healthy"], false, "left alone for its Retry-After: {s}");
    assert!(s["counters"]["refusals"].as_u64() >= Some(1), "{s}");
    // Its Retry-After (1 s) over, it is back in the ring.
    wait_worker(&control, "busy", Duration::from_secs(3), |s| s["healthy"] == true).await;
    for h in hogs {
        h.abort();
    }
}

#[tokio::test]
async fn a_static_worker_out_after_a_refused_connect_comes_back_when_it_answers_and_restarts_are_accepted_at_once(
) {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let port = free_port();
    let mut w = worker_on(port, "s", &synth, None, &[], &[]);
    let (g, control) = gateway(&["--worker", &w.base, "--probe-interval", "200ms"]);
    wait_worker(&control, "s", Duration::from_secs(10), |s| s["healthy"] == true).await;
    let url = format!("{}/v1/completions", g.base);
    let body = json!({"model": MODEL, "prompt": ids(16, 7), "max_tokens": 2});
    assert_eq!(post(&url, &body, &[]).await.status, 200);
    w.kill();
    let r = post(&url, &body, &[]).await;
    assert_eq!(r.status, 503, "{}", r.body);
    let s = worker_state(&control, "s").await.expect("s");
    assert!(s["refused"] == true && s["healthy"] == false, "{s}");
    // Back on the same address: the probe finds it.
    let _w2 = worker_on(port, "s", &synth, None, &[], &[]);
    let back_at = Instant::now();
    wait_worker(&control, "s", Duration::from_secs(3), |s| s["healthy"] == true).await;
    eprintln!("static worker back {:?} after it answered", back_at.elapsed());
    assert_eq!(post(&url, &body, &[]).await.status, 200);

    // A reporting worker restarted (its seq starts again) is taken at its first report, not after dead_after.
    let rport = free_port();
    let mut r1 = worker_on(rport, "r", &synth, Some(&control), &[], &[]);
    wait_worker(&control, "r", Duration::from_secs(10), |s| s["healthy"] == true).await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // a few reports: seq well above 1
    r1.kill();
    let _r2 = worker_on(rport, "r", &synth, Some(&control), &[], &[]);
    let restarted = Instant::now();
    wait_worker(&control, "r", Duration::from_secs(3), |s| {
        s["report_age_s"].as_f64().is_some_and(|a| a < 0.5)
    })
    .await;
    assert!(restarted.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn a_stream_queued_past_the_idle_timeout_is_not_cut_off_before_its_first_token() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    // 5 ms per prompt token: a 400-token prompt takes 2 s of prefill before the first token; the worker sends the
    // stream's headers at once.
    let profile = sim_profile(dir.path(), "slow-prefill", 0.001, 0.005);
    let (g, control) = gateway(&[
        "--stream-idle-timeout",
        "500ms",
        "--first-byte-timeout",
        "10s",
        "--first-byte-per-prompt-token",
        "0s",
    ]);
    let _w = worker("w", &synth, Some(&control), &strs(&sim_args(&profile)));
    wait_healthy(&control, 1).await;
    let started = Instant::now();
    let r = post(
        &format!("{}/v1/completions", g.base),
        &json!({"model": MODEL, "prompt": ids(400, 7), "max_tokens": 3, "stream": true}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(started.elapsed() >= Duration::from_millis(1500), "the prefill took {:?}", started.elapsed());
    assert!(!r.body.contains("\"error\""), "the stream ended with an error: {}", r.body);
    assert!(r.body.contains("[DONE]"), "{}", r.body);
    let state = worker_state(&control, "w").await.expect("w");
    assert_eq!(state["suspect"], false, "{state}");
}
