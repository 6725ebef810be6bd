//! The worker server as users run it: a real `kvgate-worker serve` process on an ephemeral port, driven over HTTP.

mod common;

use std::time::{Duration, Instant};

use common::*;
use http_body_util::BodyExt;
use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::prompt::{PromptInput, Prompter, TokenizerFiles};
use kvgate_shared::report::{Tier, WorkerReport};
use serde_json::{json, Value};

const MODEL: &str = "kvgate-tiny";

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 31 + seed * 7) % 500).collect()
}

#[tokio::test]
async fn endpoints_answer() {
    let w = start_worker(&[]);
    let health = get(&format!("{}/health", w.base)).await;
    assert_eq!(health.status, 200);
    assert!(health.headers.get("x-kvgate-worker").is_some());
    assert_eq!(get(&format!("{}/ready", w.base)).await.status, 200);
    let models = get(&format!("{}/v1/models", w.base)).await.json();
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["object"], "list");
    // `--device auto` (the default) on a machine without a CUDA GPU serves on the CPU, and says so.
    if kvgate_worker::cuda::gpu::driver_gpu_count() == 0 {
        assert_eq!(models["data"][0]["device"], "cpu");
    }
    let tok = get(&format!("{}/kvgate/v1/tokenizer", w.base)).await.json();
    let files: TokenizerFiles = serde_json::from_value(tok.clone()).expect("tokenizer files");
    let prompter = Prompter::from_files(files).expect("prompter");
    let scheme: HashScheme = serde_json::from_value(tok["scheme"].clone()).expect("scheme");
    assert_eq!(
        scheme.tokenizer_digest,
        prompter.digest(),
        "a gateway rebuilds the same digest from what is served"
    );
    assert_eq!(tok["fingerprint"].as_u64(), Some(scheme.fingerprint()));
    // A request so the metrics have samples.
    let r = post(
        &format!("{}/v1/completions", w.base),
        &json!({"model": MODEL, "prompt": "ka ri", "max_tokens": 3}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200);
    let m = get(&format!("{}/metrics", w.base)).await.body;
    for name in [
        "kvgate_worker_requests_total",
        "kvgate_worker_ttft_seconds_bucket",
        "kvgate_worker_kv_blocks",
        "kvgate_worker_prompt_tokens_total",
        "kvgate_worker_cached_prompt_tokens_total",
        "kvgate_worker_queue_requests",
        "kvgate_worker_kv_evictions",
        "kvgate_worker_preemptions",
        "kvgate_worker_device_info",
    ] {
        assert!(m.contains(name), "metrics lack {name}");
    }
    let missing = get(&format!("{}/nope", w.base)).await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["code"], "route_not_found");
}

#[tokio::test]
async fn completions_chat_streaming_and_usage() {
    let w = start_worker(&[]);
    let url = format!("{}/v1/completions", w.base);
    // Token-id prompt, greedy: deterministic text.
    let body =
        json!({"model": MODEL, "prompt": ids(40, 1), "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let full = post(&url, &body, &[]).await;
    assert_eq!(full.status, 200, "{}", full.body);
    let fj = full.json();
    assert_eq!(fj["object"], "text_completion");
    assert_eq!(fj["usage"]["prompt_tokens"], 40);
    assert_eq!(fj["usage"]["completion_tokens"], 8);
    assert_eq!(fj["usage"]["total_tokens"], 48);
    assert_eq!(fj["choices"][0]["finish_reason"], "length");
    let text = fj["choices"][0]["text"].as_str().expect("text").to_owned();
    // Same request streamed: the chunks add up to the same text.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let s = post(&url, &sbody, &[]).await;
    assert_eq!(s.headers.get("content-type").and_then(|v| v.to_str().ok()), Some("text/event-stream"));
    let events = sse_events(&s.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("json")).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(streamed, text);
    let usage = chunks.last().expect("usage chunk");
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    assert!(chunks.iter().any(|c| c["choices"][0]["finish_reason"] == "length"));

    // Chat, non-streamed and streamed.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "ka ri to ne"}], "max_tokens": 6,
        "temperature": 0});
    let curl = format!("{}/v1/chat/completions", w.base);
    let c = post(&curl, &chat, &[]).await;
    assert_eq!(c.status, 200, "{}", c.body);
    let cj = c.json();
    assert_eq!(cj["object"], "chat.completion");
    assert_eq!(cj["choices"][0]["message"]["role"], "assistant");
    let content = cj["choices"][0]["message"]["content"].as_str().expect("content").to_owned();
    let mut schat = chat.clone();
    schat["stream"] = json!(true);
    let cs = post(&curl, &schat, &[]).await;
    let events = sse_events(&cs.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("json")).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert!(chunks.iter().all(|c| c.get("usage").is_none()), "no usage field unless asked for");
    let streamed: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, content);
    assert!(chunks.last().expect("last")["choices"][0]["finish_reason"].is_string());
}

#[tokio::test]
async fn shared_prefix_is_cached_exactly_by_full_blocks_and_salts_isolate() {
    let w = start_worker(&[]);
    let url = format!("{}/v1/completions", w.base);
    let shared = ids(70, 3);
    let a: Vec<u32> = shared.iter().copied().chain([1, 2, 3]).collect();
    let b: Vec<u32> = shared.iter().copied().chain([9, 8]).collect();
    let run = |prompt: Vec<u32>, salt: Option<&str>| {
        let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        let url = url.clone();
        async move {
            let r = post(&url, &body, &[]).await;
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens")
        }
    };
    assert_eq!(run(a.clone(), None).await, 0);
    assert_eq!(run(b.clone(), None).await, 64, "the four shared full 16-token blocks");
    // Tenants: a new salt shares nothing, the same salt shares its own blocks.
    assert_eq!(run(a.clone(), Some("tenant-1")).await, 0);
    assert_eq!(run(b.clone(), Some("tenant-2")).await, 0);
    assert_eq!(run(b.clone(), Some("tenant-1")).await, 64);
    // Chat with a shared system prompt: cached tokens are whole blocks.
    let curl = format!("{}/v1/chat/completions", w.base);
    let system = kvgate_shared::prompt::synth_text(4, 120);
    let mut cached = 0;
    for q in ["ka", "ri"] {
        let r = post(
            &curl,
            &json!({"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": q}]}),
            &[],
        )
        .await
        .json();
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached");
    }
    assert!(cached > 0 && cached % 16 == 0, "second chat reuses whole blocks, got {cached}");
}

#[tokio::test]
async fn bad_input_gets_openai_errors() {
    let w = start_worker(&["--max-body-bytes", "4096"]);
    let chat = format!("{}/v1/chat/completions", w.base);
    let comp = format!("{}/v1/completions", w.base);
    let check = |r: Resp, status: u16, code: &str, param: Option<&str>| {
        assert_eq!(r.status, status, "{}", r.body);
        let j = r.json();
        assert_eq!(j["error"]["code"], code, "{}", r.body);
        assert!(j["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert!(j["error"]["type"].is_string());
        if let Some(p) = param {
            assert_eq!(j["error"]["param"], p, "{}", r.body);
        }
    };
    check(request("POST", &chat, Some("{not json".into()), &[]).await, 400, "invalid_json", None);
    check(post(&chat, &json!({"model": MODEL}), &[]).await, 400, "invalid_value", Some("messages"));
    check(
        post(&chat, &json!({"model": MODEL, "messages": "hi"}), &[]).await,
        400,
        "invalid_value",
        Some("messages"),
    );
    check(
        post(
            &chat,
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1}),
            &[],
        )
        .await,
        400,
        "invalid_value",
        Some("temperature"),
    );
    check(
        post(&chat, &json!({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), &[]).await,
        400,
        "invalid_value",
        Some("messages"),
    );
    check(
        post(&chat, &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}), &[])
            .await,
        400,
        "invalid_value",
        Some("n"),
    );
    // Parameters a kvgate worker does not implement are refused by name, never ignored; their neutral values pass.
    let chat_with = |field: &str, value: serde_json::Value| {
        let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1});
        b[field] = value;
        b
    };
    for (field, value) in [
        ("prompt_logprobs", json!(2)),
        ("response_format", json!({"type": "json_object"})),
        ("tool_choice", json!("required")),
        ("best_of", json!(2)),
    ] {
        check(post(&chat, &chat_with(field, value), &[]).await, 400, "unsupported_parameter", Some(field));
    }
    let neutral = post(&chat, &chat_with("logprobs", json!(false)), &[]).await;
    assert_eq!(neutral.status, 200, "{}", neutral.body);
    // The logit controls a worker implements are checked like the typed fields.
    for (field, value) in [
        ("presence_penalty", json!(3)),
        ("frequency_penalty", json!("a lot")),
        ("repetition_penalty", json!(0)),
        ("min_p", json!(1.5)),
        ("logit_bias", json!({"5": 101})),
        ("logit_bias", json!({"five": 1})),
        ("logit_bias", json!([1, 2])),
        ("logit_bias", json!({"999999": 1})),
        ("logprobs", json!(1)),
        ("top_logprobs", json!(3)),
        ("top_logprobs", json!(21)),
    ] {
        check(post(&chat, &chat_with(field, value), &[]).await, 400, "invalid_value", Some(field));
    }
    check(
        post(&comp, &json!({"model": MODEL, "prompt": [1, 2], "logprobs": 2}), &[]).await,
        400,
        "unsupported_parameter",
        Some("logprobs"),
    );
    check(
        post(&comp, &json!({"model": MODEL, "prompt": [1, 2], "suffix": "end"}), &[]).await,
        400,
        "unsupported_parameter",
        Some("suffix"),
    );
    check(
        post(&comp, &json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 5000}), &[]).await,
        400,
        "context_length_exceeded",
        None,
    );
    check(
        post(&comp, &json!({"model": MODEL, "prompt": [100000]}), &[]).await,
        400,
        "invalid_value",
        Some("prompt"),
    );
    check(
        post(&comp, &json!({"model": MODEL, "prompt": []}), &[]).await,
        400,
        "invalid_value",
        Some("prompt"),
    );
    check(
        post(&comp, &json!({"model": "gpt-4", "prompt": "x"}), &[]).await,
        404,
        "model_not_found",
        Some("model"),
    );
    let big = json!({"model": MODEL, "prompt": "x".repeat(5000)});
    check(post(&comp, &big, &[]).await, 413, "request_too_large", None);
    // Still healthy, nothing leaked.
    let r = post(&comp, &json!({"model": MODEL, "prompt": "ka", "max_tokens": 2}), &[]).await;
    assert_eq!(r.status, 200);
    let m = get(&format!("{}/metrics", w.base)).await.body;
    assert_eq!(metric(&m, "kvgate_worker_kv_blocks{state=\"used\"}"), Some(0.0));
}

#[tokio::test]
async fn logit_bias_changes_what_is_sampled() {
    let w = start_worker(&[]);
    let comp = format!("{}/v1/completions", w.base);
    let text = |r: &common::Resp| {
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().expect("text").to_owned()
    };
    let ask = |prompt: Vec<u32>, extra: serde_json::Value| {
        let mut b =
            json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true});
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b
    };
    // Greedy with +100 on one token: that token, whatever the prompt.
    let bias = json!({"logit_bias": {"77": 100}});
    let a = text(&post(&comp, &ask(ids(12, 1), bias.clone()), &[]).await);
    let b = text(&post(&comp, &ask(ids(12, 2), bias), &[]).await);
    assert_eq!(a, b, "the bias decides");
    let plain = text(&post(&comp, &ask(ids(12, 1), json!({})), &[]).await);
    assert_ne!(a, plain);
    // (The penalties' formula is checked in the sampler's tests.)
    assert_eq!(
        text(&post(&comp, &ask(ids(12, 1), json!({})), &[]).await),
        plain,
        "deterministic without a bias"
    );
}

#[tokio::test]
async fn chat_logprobs_report_each_token_and_its_alternatives() {
    let w = start_worker(&[]);
    let chat = format!("{}/v1/chat/completions", w.base);
    let ask = |stream: bool, extra: Value| {
        let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "count to ten"}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 3,
            "stream": stream});
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b
    };
    let entries = |r: &common::Resp| {
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["logprobs"]["content"].as_array().expect("content").clone()
    };
    let content = entries(&post(&chat, &ask(false, json!({})), &[]).await);
    assert_eq!(content.len(), 6, "one entry per completion token: {content:?}");
    for e in &content {
        let top = e["top_logprobs"].as_array().expect("top");
        assert_eq!(top.len(), 3);
        assert!(e["logprob"].as_f64().expect("logprob") <= 0.0);
        let tops: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().expect("lp")).collect();
        assert!(tops.windows(2).all(|w| w[0] >= w[1]), "most likely first: {tops:?}");
        assert!(tops.iter().map(|l| l.exp()).sum::<f64>() <= 1.0 + 1e-4);
        // Greedy: the sampled token is the most likely one.
        assert_eq!((&e["token"], e["logprob"].as_f64()), (&top[0]["token"], top[0]["logprob"].as_f64()));
        let bytes: Vec<u8> = serde_json::from_value(e["bytes"].clone()).expect("bytes");
        assert_eq!(bytes, e["token"].as_str().expect("token").as_bytes());
    }
    // Streamed: the same entries, spread over the chunks.
    let r = post(&chat, &ask(true, json!({})), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let mut streamed = Vec::new();
    for ev in sse_events(&r.body).iter().filter(|e| e.as_str() != "[DONE]") {
        let c: Value = serde_json::from_str(ev).expect("chunk");
        if let Some(a) = c["choices"][0]["logprobs"]["content"].as_array() {
            streamed.extend(a.iter().cloned());
        }
    }
    assert_eq!(streamed, content);
    // The log-probabilities are the model's, before the bias: a token forced by a bias keeps its own.
    let forced =
        entries(&post(&chat, &ask(false, json!({"logit_bias": {"77": 100}, "top_logprobs": 0})), &[]).await);
    assert!(forced.iter().all(|e| e["top_logprobs"].as_array().is_some_and(Vec::is_empty)));
    let first = forced[0]["logprob"].as_f64().expect("lp");
    assert!(first < content[0]["logprob"].as_f64().expect("lp"), "{first} is not the most likely token's");
    // Without logprobs, none.
    let r = post(&chat, &ask(false, json!({"logprobs": false, "top_logprobs": 0})), &[]).await;
    assert!(r.json()["choices"][0]["logprobs"].is_null(), "{}", r.body);
}

#[tokio::test]
async fn a_worker_with_an_fp8_kv_cache_serves_and_cuda_refuses_it_by_name() {
    // The CPU engine's FP8 reference cache serves like any other (its accuracy: tests/kv_fp8.rs).
    let w = start_worker(&["--kv-cache-dtype", "fp8"]);
    let r = post(
        &format!("{}/v1/completions", w.base),
        &json!({"model": MODEL, "prompt": ids(40, 3), "max_tokens": 4, "ignore_eos": true}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["completion_tokens"], 4);
    // CUDA has no FP8 kernels yet: refused at start, by name, before touching a GPU.
    let dir = tempfile::tempdir().expect("tmp");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
        .args(["serve", "--synth", "tiny", "--synth-dir"])
        .arg(dir.path().join("tiny"))
        .args(["--host", "127.0.0.1", "--port", "0", "--device", "cuda:0", "--kv-cache-dtype", "fp8"])
        .env("RUST_LOG", "warn")
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--kv-cache-dtype fp8 on cuda:0"), "{stderr}");
}

#[tokio::test]
async fn full_queue_is_503_with_retry_after() {
    let w = start_worker(&["--max-num-seqs", "1", "--max-waiting-requests", "1"]);
    let url = format!("{}/v1/completions", w.base);
    // Long enough (1,000 tokens) that the first request is still running when the others arrive.
    let long = json!({"model": MODEL, "prompt": ids(30, 1), "max_tokens": 1000, "ignore_eos": true});
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (u, b) = (url.clone(), long.clone());
        tasks.push(tokio::spawn(async move { post(&u, &b, &[]).await }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut statuses = Vec::new();
    let mut retry_after = false;
    for t in tasks {
        let r = t.await.expect("join");
        if r.status == 503 {
            retry_after |= r.headers.get("retry-after").is_some();
            assert_eq!(r.json()["error"]["code"], "queue_full");
        }
        statuses.push(r.status);
    }
    assert!(statuses.contains(&503), "{statuses:?}");
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(retry_after);
}

#[tokio::test]
async fn client_disconnect_mid_stream_frees_blocks() {
    let w = start_worker(&[]);
    let body =
        json!({"model": MODEL, "prompt": ids(60, 2), "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let req = hyper::Request::post(format!("{}/v1/completions", w.base))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body.to_string())))
        .expect("req");
    let resp = client().request(req).await.expect("resp");
    let mut body = resp.into_body();
    let first = body.frame().await.expect("a chunk").expect("ok");
    assert!(first.is_data());
    let metrics_url = format!("{}/metrics", w.base);
    // The first chunk can arrive before the engine publishes its next stats: wait for them.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let used =
            metric(&get(&metrics_url).await.body, "kvgate_worker_kv_blocks{state=\"used\"}").unwrap_or(0.0);
        if used > 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the running stream holds blocks");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(body);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = get(&metrics_url).await.body;
        if metric(&m, "kvgate_worker_kv_blocks{state=\"used\"}") == Some(0.0) {
            break;
        }
        assert!(Instant::now() < deadline, "blocks still used after the client left");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What the abandoned stream cost is counted as a finished request's usage is: its whole prompt (it generated)
    // and the tokens generated before the abort (at least the one the client read).
    let m = get(&metrics_url).await.body;
    assert_eq!(metric(&m, "kvgate_worker_prompt_tokens_total"), Some(60.0), "{m}");
    assert_eq!(metric(&m, "kvgate_worker_cached_prompt_tokens_total"), Some(0.0), "{m}");
    let generated = metric(&m, "kvgate_worker_completion_tokens_total").unwrap_or(0.0);
    assert!((1.0..3000.0).contains(&generated), "{generated}");
}

#[tokio::test]
async fn reports_reach_a_listener_and_carry_the_requests_blocks() {
    // A test gateway: collects report bodies and their Authorization headers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Option<String>, Vec<u8>)>();
    let app = axum::Router::new().route(
        "/kvgate/v1/report",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let tx = tx.clone();
            async move {
                let auth = headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned);
                let _ = tx.send((auth, body.to_vec()));
                "ok"
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    let gateway = format!("http://{addr}");
    let w = start_worker(&[
        "--report-to",
        &gateway,
        "--report-interval",
        "200ms",
        "--report-secret",
        "s3cret",
        "--summary-granularity",
        "1",
    ]);
    let prompt = ids(100, 5);
    let r = post(
        &format!("{}/v1/completions", w.base),
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200);
    // The request's block hashes, computed like a gateway would.
    let tok = get(&format!("{}/kvgate/v1/tokenizer", w.base)).await.json();
    let scheme: HashScheme = serde_json::from_value(tok["scheme"].clone()).expect("scheme");
    let prompter = Prompter::from_files(serde_json::from_value(tok).expect("files")).expect("prompter");
    let tokens = prompter.tokenize(&PromptInput::TokenIds(&prompt)).expect("ids");
    let hashes = BlockHasher::new(&scheme, &ExtraKeys::none()).hash_blocks(&tokens);
    assert_eq!(hashes.len(), 6);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last_seq = 0;
    loop {
        let (auth, bytes) =
            tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("a report").expect("open");
        assert_eq!(auth.as_deref(), Some("Bearer s3cret"));
        let report = WorkerReport::decode(&bytes).expect("decodes");
        assert!(report.seq > last_seq, "sequence numbers increase");
        last_seq = report.seq;
        assert_eq!(report.fingerprint, scheme.fingerprint());
        assert_eq!(report.advertise_url, w.base);
        let summary = report.tier(Tier::Device).and_then(|t| t.summary.clone()).expect("summary");
        if summary.matched_blocks(&hashes) == 6 {
            break;
        }
        assert!(Instant::now() < deadline, "no report carried the request's blocks");
    }
}

#[tokio::test]
async fn sigterm_drains_then_exits() {
    let mut w = start_worker(&["--shutdown-grace", "1s"]);
    let body =
        json!({"model": MODEL, "prompt": ids(20, 9), "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let url = format!("{}/v1/completions", w.base);
    let stream = tokio::spawn(async move { post(&url, &body, &[]).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = w.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let r = stream.await.expect("join");
    let events = sse_events(&r.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "the stream ends cleanly");
    assert!(r.body.contains("\"code\":\"aborted\""), "aborted at the end of the grace period: {}", r.body);
    assert!(!r.body.contains("\"finish_reason\":\"abort\""), "an error event, not a made-up finish reason");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = w.child.try_wait().expect("wait") {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(Instant::now() < deadline, "worker did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_dead_engine_fails_both_probes_and_the_worker_exits_non_zero() {
    let mut w = start_worker_env(&[], &[("KVGATE_FAULT_ENGINE_PANIC_AFTER_STEPS", "3")]);
    assert_eq!(get(&format!("{}/health", w.base)).await.status, 200);
    let url = format!("{}/v1/completions", w.base);
    let body = json!({"model": MODEL, "prompt": ids(20, 11), "max_tokens": 50, "ignore_eos": true});
    let r = post(&url, &body, &[]).await;
    assert_ne!(r.status, 200, "the engine died under this request: {}", r.body);
    // Both probes fail before the process goes.
    let (mut health, mut ready) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while (health != 503 || ready != 503) && Instant::now() < deadline {
        let h = request("GET", &format!("{}/health", w.base), None, &[]).await;
        health = h.status;
        if h.status == 503 {
            assert_eq!(h.json()["status"], "engine_dead");
            ready = get(&format!("{}/ready", w.base)).await.status;
        }
    }
    assert_eq!((health, ready), (503, 503), "a dead engine fails /health and /ready");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(status) = w.child.try_wait().expect("wait") {
            assert_eq!(status.code(), Some(70), "{status}");
            break;
        }
        assert!(Instant::now() < deadline, "the worker did not exit after its engine died");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn sigterm_reports_draining_at_once() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    let app = axum::Router::new().route(
        "/kvgate/v1/report",
        axum::routing::post(move |body: axum::body::Bytes| {
            let tx = tx.clone();
            async move {
                let draining = WorkerReport::decode(&body).map(|r| r.draining).unwrap_or(false);
                let _ = tx.send(body.to_vec());
                if !draining {
                    // A slow gateway: the first report is still in flight when SIGTERM arrives, and the
                    // draining report must not be skipped for it.
                    tokio::time::sleep(Duration::from_secs(6)).await;
                }
                "ok"
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    // Reports every 10 s: the draining one must not wait for the next interval.
    let w = start_worker(&[
        "--report-to",
        &format!("http://{addr}"),
        "--report-interval",
        "10s",
        "--report-timeout",
        "10s",
    ]);
    let first = WorkerReport::decode(
        &tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("report").expect("open"),
    )
    .expect("decodes");
    assert!(!first.draining);
    assert!(
        first.instance_id != 0 && first.max_model_len > 0,
        "{} {}",
        first.instance_id,
        first.max_model_len
    );
    let pid = w.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let sent = Instant::now();
    let next = WorkerReport::decode(
        // Well under the 10 s interval and the 6 s the first report is held; loose enough for a loaded 2-core
        // machine (NVRTC compiles alongside).
        &tokio::time::timeout(Duration::from_secs(4), rx.recv()).await.expect("at once").expect("open"),
    )
    .expect("decodes");
    assert!(next.draining, "the report after SIGTERM says draining");
    assert_eq!(next.instance_id, first.instance_id);
    assert!(sent.elapsed() < Duration::from_secs(4));
}

#[test]
fn device_cuda_without_a_gpu_exits_with_a_clear_error() {
    if kvgate_worker::cuda::gpu::driver_gpu_count() > 0 {
        eprintln!("skipped: this machine has a CUDA GPU");
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
        .args(["serve", "--synth", "tiny", "--synth-dir"])
        .arg(dir.path().join("tiny"))
        .args(["--host", "127.0.0.1", "--port", "0", "--device", "cuda:0"])
        .env("RUST_LOG", "warn")
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served without a GPU: {stderr}");
    assert!(stderr.contains("--device cuda:0") && stderr.contains("no CUDA GPU"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
        .args(["serve", "--synth", "tiny", "--device", "gpu"])
        .output()
        .expect("runs");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--device"));
}
