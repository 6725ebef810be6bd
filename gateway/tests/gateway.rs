//! The gateway in front of real `kvgate-worker` processes (tiny synthetic model), over real HTTP.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::*;
use http_body_util::BodyExt;
use serde_json::json;

fn prompt_ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97)) % 500).collect()
}

struct Fleet {
    _dir: tempfile::TempDir,
    workers: Vec<Proc>,
    gateway: Proc,
    #[allow(dead_code)]
    control: String,
}

async fn fleet(n: usize, gateway_flags: &[&str]) -> Fleet {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (gateway, control) = gateway(gateway_flags);
    let workers: Vec<Proc> = (0..n).map(|i| worker(&format!("w{i}"), &synth, Some(&control), &[])).collect();
    wait_healthy(&control, n).await;
    Fleet { _dir: dir, workers, gateway, control }
}

async fn complete(g: &str, prompt: &[u32], session: &str) -> Resp {
    post(
        &format!("{g}/v1/completions"),
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}),
        &[("x-session-id", session)],
    )
    .await
}

#[tokio::test]
async fn same_prefix_sticks_to_one_worker_and_hits_its_cache() {
    let f = fleet(3, &[]).await;
    let shared = prompt_ids(160, 1);
    let mut served = Vec::new();
    for i in 0..8u32 {
        let p: Vec<u32> = shared.iter().copied().chain([i, i + 1, i + 2]).collect();
        let r = complete(&f.gateway.base, &p, &format!("session-{i}")).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(!r.header("x-kvgate-route").is_empty());
        let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached");
        served.push((r.header("x-kvgate-worker"), r.header("x-kvgate-route"), cached));
    }
    let first = served[0].0.clone();
    assert!(served.iter().all(|s| s.0 == first), "one worker for one prefix: {served:?}");
    assert!(served[1..].iter().all(|s| s.1 == "prefix" && s.2 >= 144), "{served:?}");
}

#[tokio::test]
async fn different_sessions_spread_and_a_dead_workers_sessions_move_to_their_backups() {
    let mut f = fleet(3, &[]).await;
    let g = f.gateway.base.clone();
    let mut owner: HashMap<String, String> = HashMap::new();
    for s in 0..24u32 {
        // Short prompts (no full block shared): the ring decides.
        let r = complete(&g, &prompt_ids(10, 1000 + s), &format!("s{s}")).await;
        assert_eq!(r.status, 200, "{}", r.body);
        eprintln!("s{s} -> {} ({})", r.header("x-kvgate-worker"), r.header("x-kvgate-route"));
        owner.insert(format!("s{s}"), r.header("x-kvgate-worker"));
    }
    let used: HashSet<&String> = owner.values().collect();
    assert!(used.len() >= 2, "sessions spread over workers: {owner:?}");
    // The same sessions again land on the same workers.
    for (s, w) in owner.iter().take(6) {
        let n: u32 = s[1..].parse().expect("n");
        let r = complete(&g, &prompt_ids(10, 2000 + n), s).await;
        eprintln!("again {s} -> {} ({})", r.header("x-kvgate-worker"), r.header("x-kvgate-route"));
        assert_eq!(&r.header("x-kvgate-worker"), w);
    }
    // Kill w1: its sessions move (retry before any byte), nobody else's.
    let victim = "w1".to_string();
    f.workers[1].kill();
    for (s, w) in &owner {
        let n: u32 = s[1..].parse().expect("n");
        let r = complete(&g, &prompt_ids(10, 3000 + n), s).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let now = r.header("x-kvgate-worker");
        eprintln!("after kill {s}: {w} -> {now} ({})", r.header("x-kvgate-route"));
        if *w == victim {
            assert_ne!(now, victim);
        } else {
            assert_eq!(&now, w, "session {s} moved although its worker lives");
        }
    }
}

#[tokio::test]
async fn streaming_passes_through_chunk_by_chunk() {
    let f = fleet(1, &[]).await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "ka ri"}], "max_tokens": 150,
        "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    let req = hyper::Request::post(format!("{}/v1/chat/completions", f.gateway.base))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body.to_string())))
        .expect("req");
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let started = Instant::now();
    let resp = client.request(req).await.expect("resp");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()), Some("w0"));
    assert!(resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream")));
    let mut body = resp.into_body();
    let mut first_at = None;
    let mut text = String::new();
    let mut frames = 0;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("frame").into_data() {
            frames += 1;
            first_at.get_or_insert_with(|| started.elapsed());
            text.push_str(&String::from_utf8_lossy(&data));
        }
    }
    let total = started.elapsed();
    assert!(frames > 5, "many chunks, not one buffered body ({frames})");
    let first_at = first_at.expect("data");
    assert!(first_at * 3 < total, "first chunk at {first_at:?} of {total:?}: not buffered");
    assert!(text.trim_end().ends_with("data: [DONE]"));
    assert!(text.contains("\"completion_tokens\":150"));
}

#[tokio::test]
async fn error_cases_are_openai_errors() {
    let mut f = fleet(1, &["--max-body-bytes", "4096"]).await;
    let g = &f.gateway.base.clone();
    let check = |r: Resp, status: u16, code: &str| {
        assert_eq!(r.status, status, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], code, "{}", r.body);
    };
    check(
        request("POST", &format!("{g}/v1/chat/completions"), Some("{oops".into()), &[]).await,
        400,
        "invalid_json",
    );
    check(
        post(&format!("{g}/v1/chat/completions"), &json!({"model": "nope", "messages": []}), &[]).await,
        404,
        "model_not_found",
    );
    check(
        post(&format!("{g}/v1/chat/completions"), &json!({"messages": []}), &[]).await,
        400,
        "invalid_value",
    );
    check(
        post(&format!("{g}/v1/chat/completions"), &json!({"model": MODEL, "messages": "x"}), &[]).await,
        400,
        "invalid_value",
    );
    check(
        post(&format!("{g}/v1/completions"), &json!({"model": MODEL, "prompt": "x".repeat(5000)}), &[]).await,
        413,
        "request_too_large",
    );
    check(get(&format!("{g}/nowhere")).await, 404, "route_not_found");
    // Worker errors pass through unchanged (with the worker header).
    let r = post(
        &format!("{g}/v1/completions"),
        &json!({"model": MODEL, "prompt": [1], "max_tokens": 100000}),
        &[],
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.header("x-kvgate-worker"), "w0");
    let models = get(&format!("{g}/v1/models")).await.json();
    assert_eq!(models["data"][0]["id"], MODEL);
    // No healthy worker: 503 with Retry-After.
    f.workers[0].kill();
    let r = post(
        &format!("{g}/v1/completions"),
        &json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 1}),
        &[],
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "no_healthy_worker");
    assert_eq!(r.header("retry-after"), "1");
}

#[tokio::test]
async fn reports_need_the_secret_and_stale_or_foreign_summaries_get_no_score() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    // A static worker defines the model's tokenizer; reports go stale after 1 s.
    let (g, control) = gateway(&["--stale-after", "1s", "--dead-after", "30s"]);
    let a = worker("a", &synth, Some(&control), &[]);
    wait_healthy(&control, 1).await;
    // A worker of the same model with another block size: its fingerprint differs.
    let _b = worker("b", &synth, Some(&control), &["--block-size", "32"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ws = get(&format!("{control}/kvgate/v1/workers")).await.json();
        let b = ws.as_array().and_then(|a| a.iter().find(|w| w["id"] == "b").cloned());
        if let Some(b) = b {
            if b["fingerprint_ok"] == false {
                assert_eq!(b["summary_fresh"], false);
                assert_eq!(b["healthy"], true, "still routable, only without a cache score");
                break;
            }
        }
        assert!(Instant::now() < deadline, "fingerprint mismatch not detected: {ws}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let m = get(&format!("{control}/metrics")).await.body;
    assert!(m.contains("kvgate_gateway_fingerprint_mismatch_total"));
    // Unauthenticated and malformed reports are refused.
    let r = request("POST", &format!("{control}/kvgate/v1/report"), Some("x".into()), &[]).await;
    assert_eq!(r.status, 401);
    let r = request(
        "POST",
        &format!("{control}/kvgate/v1/report"),
        Some("x".into()),
        &[("authorization", "Bearer test-secret")],
    )
    .await;
    assert_eq!(r.status, 400);
    // Stop a's reports (SIGSTOP) and its summary goes stale.
    let pid = a.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-STOP", &pid]).status().expect("kill").success());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let ws = get(&format!("{control}/kvgate/v1/workers")).await.json();
    let a_state = ws.as_array().and_then(|x| x.iter().find(|w| w["id"] == "a").cloned()).expect("a");
    assert_eq!(a_state["summary_fresh"], false, "{a_state}");
    assert_eq!(a_state["healthy"], true);
    let _ = std::process::Command::new("kill").args(["-CONT", &pid]).status();
    drop(g);
}

#[tokio::test]
async fn an_exhausted_class_gets_429_while_another_class_flows() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("gateway.toml");
    std::fs::write(
        &cfg,
        r#"
[[classes]]
name = "short"
refill_tokens_per_s = 1000000
burst_tokens = 1000000
[classes.match]
max_prompt_tokens = 64

[[classes]]
name = "long"
refill_tokens_per_s = 1
burst_tokens = 300
max_queued_requests = 4
max_wait_ms = 300
"#,
    )
    .expect("write");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway(&["--config", cfg.to_str().expect("path")]);
    let _w = worker("w0", &synth, Some(&control), &[]);
    wait_healthy(&control, 1).await;
    let long = |seed| json!({"model": MODEL, "prompt": prompt_ids(200, seed), "max_tokens": 2});
    let first = post(&format!("{}/v1/completions", g.base), &long(5), &[]).await;
    assert_eq!(first.status, 200, "the first long request fits the burst: {}", first.body);
    // Another long prompt (no cache hit, so it costs its full 202 tokens) finds the class budget spent.
    let second = post(&format!("{}/v1/completions", g.base), &long(6), &[]).await;
    assert_eq!(second.status, 429, "{}", second.body);
    assert_eq!(second.json()["error"]["code"], "class_budget_exceeded");
    assert_eq!(second.json()["error"]["type"], "rate_limit_error");
    assert!(second.header("retry-after").parse::<u32>().is_ok_and(|s| s >= 1));
    for i in 0..5 {
        let short = json!({"model": MODEL, "prompt": prompt_ids(20, 50 + i), "max_tokens": 2});
        assert_eq!(post(&format!("{}/v1/completions", g.base), &short, &[]).await.status, 200, "short flows");
    }
    // An explicit class header wins over the rules.
    let tagged = json!({"model": MODEL, "prompt": prompt_ids(20, 99), "max_tokens": 150});
    let r = post(&format!("{}/v1/completions", g.base), &tagged, &[("x-kvgate-class", "long")]).await;
    assert_eq!(r.status, 429, "{}", r.body);
    let m = get(&format!("{control}/metrics")).await.body;
    assert!(m.contains("kvgate_gateway_class_rejected_total"), "per-class metrics");
}
