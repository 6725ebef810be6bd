//! Prefill/decode splits through the gateway, on real processes: a prefill worker with a KV transfer listener and a
//! decode worker, both reporting their roles. A split request answers exactly as the same request computed whole;
//! the decisions are counted by outcome and shown by explain; a dead prefill worker is recomputed on the decode
//! worker, a dead decode worker falls back to a whole request elsewhere, or to another decode worker that imports
//! from the same prefill worker.

mod common;

use common::*;
use serde_json::{json, Value};

fn pool(dir: &std::path::Path, control: &str) -> (Proc, Proc) {
    let synth = dir.join("tiny");
    let p = worker("p0", &synth, Some(control), &["--role", "prefill", "--kv-transfer-port", "0"]);
    let d = worker("d0", &synth, Some(control), &["--role", "decode"]);
    (p, d)
}

fn body(stream: bool) -> Value {
    let prompt: Vec<u32> = (0..150u32).map(|i| (i * 37 + 11) % 500 + 1).collect();
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true,
           "stream": stream})
}

fn decisions(metrics: &str, policy: &str, choice: &str, reason: &str) -> f64 {
    let series = format!(
        "kvgate_gateway_split_decisions_total{{policy=\"{policy}\",choice=\"{choice}\",reason=\"{reason}\"}}"
    );
    metric(metrics, &series).unwrap_or(0.0)
}

/// The text of a streamed answer (its content chunks, in order).
fn streamed_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn a_split_request_answers_as_a_whole_one_and_is_counted() {
    let dir = tempfile::tempdir().expect("tmp");
    let (g, control) = gateway(&["--split-policy", "always", "--admin-token", "test-admin"]);
    let (p, d) = pool(dir.path(), &control);
    wait_healthy(&control, 2).await;

    let via = post(&format!("{}/v1/completions", g.base), &body(false), &[]).await;
    assert_eq!(via.status, 200, "{}", via.body);
    assert_eq!(via.header("x-kvgate-route"), "split");
    assert_eq!(via.header("x-kvgate-worker"), "d0", "the decode worker answers");
    // The same request computed whole on a worker of its own.
    let whole = post(&format!("{}/v1/completions", p.base), &body(false), &[]).await;
    assert_eq!(whole.status, 200, "{}", whole.body);
    assert_eq!(via.json()["choices"][0]["text"], whole.json()["choices"][0]["text"]);
    assert_eq!(via.json()["usage"]["prompt_tokens"], whole.json()["usage"]["prompt_tokens"]);
    assert_eq!(via.json()["usage"]["completion_tokens"], 12);
    // Streamed: the same text.
    let s = post(&format!("{}/v1/completions", g.base), &body(true), &[]).await;
    assert_eq!(s.status, 200, "{}", s.body);
    assert_eq!(s.header("x-kvgate-route"), "split");
    assert_eq!(streamed_text(&s.body), via.json()["choices"][0]["text"].as_str().expect("text"));

    let gm = get(&format!("{control}/metrics")).await.body;
    assert_eq!(decisions(&gm, "always", "split", "always"), 2.0, "{gm}");
    let dm = get(&format!("{}/metrics", d.base)).await.body;
    let imports = metric(&dm, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"ok\"}");
    assert_eq!(imports, Some(2.0), "{dm}");
    let pm = get(&format!("{}/metrics", p.base)).await.body;
    assert_eq!(metric(&pm, "kvgate_worker_kv_transfers_total{side=\"export\",outcome=\"ok\"}"), Some(2.0));

    // Explain shows the plan the next request gets, with every term.
    let admin = [("authorization", "Bearer test-admin")];
    let e = post(&format!("{control}/admin/v1/route/explain"), &body(false), &admin).await;
    assert_eq!(e.status, 200, "{}", e.body);
    let v = e.json();
    assert_eq!(v["split_policy"], "always");
    assert_eq!(v["prefill"], "p0");
    assert_eq!(v["pick"], "d0");
    assert_eq!(v["split"]["decision"]["choice"], "split");
    assert!(v["split"]["decision"]["terms"]["transfer_bytes"].as_f64().expect("bytes") > 0.0, "{v}");
    assert!(v["split"]["input"]["kv_bytes_per_token"].as_f64().expect("kv") > 0.0, "{v}");
}

#[tokio::test]
async fn the_cost_model_keeps_an_unstalled_fleet_local() {
    let dir = tempfile::tempdir().expect("tmp");
    let (g, control) = gateway(&[]);
    let (_p, _d) = pool(dir.path(), &control);
    wait_healthy(&control, 2).await;
    let r = post(&format!("{}/v1/completions", g.base), &body(false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_ne!(r.header("x-kvgate-route"), "split");
    assert_eq!(
        r.header("x-kvgate-worker"),
        "d0",
        "whole requests go to the decode worker, not the prefill one"
    );
    let gm = get(&format!("{control}/metrics")).await.body;
    let local: f64 = ["both_meet", "slo", "neither_meets"]
        .iter()
        .map(|reason| decisions(&gm, "cost_model", "local", reason))
        .sum();
    assert_eq!(local, 1.0, "{gm}");
}

#[tokio::test]
async fn a_dead_leg_never_holds_the_request() {
    let dir = tempfile::tempdir().expect("tmp");
    let (g, control) = gateway(&["--split-policy", "always"]);
    let (mut p, d) = pool(dir.path(), &control);
    wait_healthy(&control, 2).await;
    let want = post(&format!("{}/v1/completions", d.base), &body(false), &[]).await;
    assert_eq!(want.status, 200, "{}", want.body);

    // The prefill worker dies; the gateway still believes it for a report interval or two: the decode worker's
    // fetch fails to connect and it computes the prompt itself.
    p.kill();
    let started = std::time::Instant::now();
    let r = post(&format!("{}/v1/completions", g.base), &body(false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["text"], want.json()["choices"][0]["text"]);
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "{:?}", started.elapsed());
    let dm = get(&format!("{}/metrics", d.base)).await.body;
    assert_eq!(
        metric(&dm, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"fallback\"}"),
        Some(1.0)
    );
}

#[tokio::test]
async fn a_dead_decode_worker_falls_back_to_a_whole_request() {
    let dir = tempfile::tempdir().expect("tmp");
    let (g, control) = gateway(&["--split-policy", "always"]);
    let (p, mut d) = pool(dir.path(), &control);
    wait_healthy(&control, 2).await;
    d.kill();
    let r = post(&format!("{}/v1/completions", g.base), &body(false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvgate-worker"), "p0");
    assert_eq!(r.header("x-kvgate-route"), "fallback");
    let want = post(&format!("{}/v1/completions", p.base), &body(false), &[]).await;
    assert_eq!(r.json()["choices"][0]["text"], want.json()["choices"][0]["text"]);
}

#[tokio::test]
async fn a_failed_decode_leg_is_retried_on_another_decode_worker_with_the_same_prefill_peer() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway(&["--split-policy", "always"]);
    // d0's engine dies at its first step: the split's decode leg fails before any byte reaches the client.
    let p = worker("p0", &synth, Some(&control), &["--role", "prefill", "--kv-transfer-port", "0"]);
    let d0 = worker_on(
        free_port(),
        "d0",
        &synth,
        Some(&control),
        &["--role", "decode"],
        &[("KVGATE_FAULT_ENGINE_PANIC_AFTER_STEPS", "0")],
    );
    wait_healthy(&control, 2).await; // d0 first in the registry: the first decode pick
    let d1 = worker("d1", &synth, Some(&control), &["--role", "decode"]);
    wait_healthy(&control, 3).await;
    let want = post(&format!("{}/v1/completions", p.base), &body(false), &[]).await;
    assert_eq!(want.status, 200, "{}", want.body);

    let r = post(&format!("{}/v1/completions", g.base), &body(false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvgate-worker"), "d1");
    assert_eq!(r.json()["choices"][0]["text"], want.json()["choices"][0]["text"]);
    // d1 imported the prompt's KV from the same prefill worker rather than computing the request whole.
    let dm = get(&format!("{}/metrics", d1.base)).await.body;
    let imports = metric(&dm, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"ok\"}");
    assert_eq!(imports, Some(1.0), "{dm}");
    drop(d0);
}

#[tokio::test]
async fn a_new_pair_is_probed_before_its_first_split() {
    let dir = tempfile::tempdir().expect("tmp");
    let (_g, control) = gateway(&["--probe-interval", "200ms", "--admin-token", "test-admin"]);
    let (p, d) = pool(dir.path(), &control);
    wait_healthy(&control, 2).await;
    // No request was sent: the gateway has the decode worker time a sample of the link from the prefill worker,
    // and the decode worker's next report carries it.
    let admin = [("authorization", "Bearer test-admin")];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let measured = loop {
        let e = post(&format!("{control}/admin/v1/route/explain"), &body(false), &admin).await;
        assert_eq!(e.status, 200, "{}", e.body);
        let v = e.json();
        if v["split"]["bandwidth_measured"] == true || std::time::Instant::now() > deadline {
            break v;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    let gm = get(&format!("{control}/metrics")).await.body;
    let pm = get(&format!("{}/metrics", p.base)).await.body;
    assert_eq!(measured["split"]["bandwidth_measured"], true, "{measured}\n{gm}");
    assert!(measured["split"]["input"]["bandwidth_bytes_per_s"].as_f64().expect("rate") > 0.0, "{measured}");
    assert!(metric(&gm, "kvgate_gateway_link_probes_total{outcome=\"ok\"}").unwrap_or(0.0) >= 1.0, "{gm}");
    let probes = metric(&pm, "kvgate_worker_kv_transfers_total{side=\"probe\",outcome=\"ok\"}");
    assert!(probes.unwrap_or(0.0) >= 1.0, "{pm}");
    // A probe without the gateway's grant is refused.
    let r = post(
        &format!("{}/kvgate/v1/kv-probe", d.base),
        &json!({}),
        &[("x-kvgate-prefill-peer", "127.0.0.1:1")],
    )
    .await;
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "invalid_prefill_grant");
}

async fn wait_metric(base: &str, series: &str, want: f64, within: std::time::Duration) -> f64 {
    let deadline = std::time::Instant::now() + within;
    loop {
        let m = get(&format!("{base}/metrics")).await.body;
        let v = metric(&m, series).unwrap_or(0.0);
        if v == want || std::time::Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_client_leaving_a_split_request_cancels_both_legs() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway(&["--split-policy", "always"]);
    // The prefill worker stalls its export after 2 blocks for 3 s: the client leaves meanwhile.
    let p_flags = ["--role", "prefill", "--kv-transfer-port", "0", "--kv-transfer-lease", "1s"];
    let p = worker_on(
        free_port(),
        "p0",
        &synth,
        Some(&control),
        &p_flags,
        &[("KVGATE_FAULT_EXPORT_PAUSE", "2:3000")],
    );
    let d = worker("d0", &synth, Some(&control), &["--role", "decode", "--kv-transfer-lease", "1s"]);
    wait_healthy(&control, 2).await;
    let url = format!("{}/v1/completions", g.base);
    let left =
        tokio::time::timeout(std::time::Duration::from_millis(400), post(&url, &body(true), &[])).await;
    assert!(left.is_err(), "the answer waited on the stalled export");
    // Both legs end within the lease and a second, not at the export's stall or the request timeout.
    let import = "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"client_left\"}";
    assert_eq!(wait_metric(&d.base, import, 1.0, std::time::Duration::from_secs(2)).await, 1.0);
    let leases =
        wait_metric(&p.base, "kvgate_worker_kv_transfer_leases", 0.0, std::time::Duration::from_secs(5));
    assert_eq!(leases.await, 0.0);
    let gm = get(&format!("{control}/metrics")).await.body;
    // The stream was cut short: charged what was computed (a partial charge), not a whole answer.
    assert_eq!(metric(&gm, "kvgate_gateway_class_partial_charges_total{class=\"short\"}"), Some(1.0), "{gm}");
    let split = format!(
        "kvgate_gateway_requests_total{{policy=\"{}\",route=\"split\",status=\"200\",class=\"short\"}}",
        kvgate_gateway::routing::DEFAULT_POLICY
    );
    assert_eq!(metric(&gm, &split), Some(1.0), "{gm}");
    // The fleet serves the next request as usual.
    let r = post(&url, &body(false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// The sequence of #41, on this harness's workers: a prefill and a decode worker the gateway knows, a `both` worker
/// it does not; the request is answered by the `both` worker directly first, then through the gateway, under each
/// split policy. Every answer comes well inside the first-byte timeout and equals the direct one.
#[tokio::test]
async fn a_request_answered_directly_first_is_answered_through_the_gateway_under_every_split_policy() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let b = worker("b0", &synth, None, &[]);
    let prompt: Vec<u32> = (0..80u32).map(|i| (i * 53 + 7) % 500 + 1).collect();
    let req =
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 192, "temperature": 0, "ignore_eos": true});
    for policy in ["cost_model", "always", "aggregated"] {
        let (g, control) = gateway(&["--split-policy", policy]);
        let (_p, _d) = pool(dir.path(), &control);
        wait_healthy(&control, 2).await;
        let direct = post(&format!("{}/v1/completions", b.base), &req, &[]).await;
        assert_eq!(direct.status, 200, "{}", direct.body);
        let started = std::time::Instant::now();
        let via = post(&format!("{}/v1/completions", g.base), &req, &[]).await;
        let took = started.elapsed();
        assert_eq!(via.status, 200, "{policy}: {}", via.body);
        assert!(took < std::time::Duration::from_secs(10), "{policy}: {took:?}");
        assert_eq!(via.json()["choices"][0]["text"], direct.json()["choices"][0]["text"], "{policy}");
        drop(g);
    }
}

/// A prefill worker that accepts a split and then sends no KV while it renews the lease (its prefill queued or
/// stuck) holds the request only for the decode worker's stall timeout: the decode worker computes the prompt
/// itself, the client is answered long before the gateway's first-byte timeout, and the export is dropped.
#[tokio::test]
async fn a_split_whose_prefill_sends_nothing_is_answered_within_the_stall_timeout() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway(&["--split-policy", "always"]);
    let p_flags = ["--role", "prefill", "--kv-transfer-port", "0", "--kv-transfer-lease", "1s"];
    let p = worker_on(
        free_port(),
        "p0",
        &synth,
        Some(&control),
        &p_flags,
        &[("KVGATE_FAULT_EXPORT_HOLD", "60000")],
    );
    let d_flags = ["--role", "decode", "--kv-transfer-lease", "1s", "--kv-transfer-stall-timeout", "1s"];
    let d = worker("d0", &synth, Some(&control), &d_flags);
    wait_healthy(&control, 2).await;
    let started = std::time::Instant::now();
    let r = post(&format!("{}/v1/completions", g.base), &body(false), &[]).await;
    let took = started.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvgate-route"), "split");
    assert!(took < std::time::Duration::from_secs(5), "held for {took:?} (the first-byte timeout is 30 s)");
    let want = post(&format!("{}/v1/completions", d.base), &body(false), &[]).await;
    assert_eq!(r.json()["choices"][0]["text"], want.json()["choices"][0]["text"]);
    let stalled = "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"stalled\"}";
    assert_eq!(wait_metric(&d.base, stalled, 1.0, std::time::Duration::from_secs(1)).await, 1.0);
    let leases = "kvgate_worker_kv_transfer_leases";
    assert_eq!(wait_metric(&p.base, leases, 0.0, std::time::Duration::from_secs(3)).await, 0.0);
}

/// A prompt the workers measurably need longer for than the first-byte formula gives is waited for: each worker
/// measured its prefill cost before it served (here 3 ms a token, slowed on purpose), the split decision predicted
/// the request's time from it, and the first-byte bound stretches to twice that (at most its cap). Before, the
/// formula's 500 ms cut the request off with 504 while the workers were still computing it.
#[tokio::test]
async fn a_prompt_the_workers_measurably_need_longer_for_is_not_cut_off_by_the_formula() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway(&["--first-byte-timeout", "500ms", "--first-byte-per-prompt-token", "0ms"]);
    let slow = [("KVGATE_FAULT_SLOW_FORWARD_US", "3000")];
    let p_flags = ["--role", "prefill", "--kv-transfer-port", "0", "--kv-cache-tokens", "1024"];
    let _p = worker_on(free_port(), "p0", &synth, Some(&control), &p_flags, &slow);
    let d_flags = ["--role", "decode", "--kv-cache-tokens", "1024"];
    let _d = worker_on(free_port(), "d0", &synth, Some(&control), &d_flags, &slow);
    wait_healthy(&control, 2).await;
    // 400 prompt tokens: at least 1.2 s of prefill wherever it runs.
    let prompt: Vec<u32> = (0..400u32).map(|i| (i * 41 + 7) % 500 + 1).collect();
    let body =
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let started = std::time::Instant::now();
    let r = post(&format!("{}/v1/completions", g.base), &body, &[]).await;
    let took = started.elapsed();
    assert_eq!(r.status, 200, "after {took:?}: {}", r.body);
    assert!(took > std::time::Duration::from_millis(1_200), "the prefill was slowed: {took:?}");
    assert_eq!(r.json()["usage"]["completion_tokens"], 4);
}
