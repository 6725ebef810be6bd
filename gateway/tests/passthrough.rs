//! Endpoints the gateway passes through to a worker by load (`serve/endpoints/passthrough.rs`): vLLM's `/tokenize` and
//! `/detokenize` on real kvgate workers, `GET /v1/models/{id}`, and the same keys and limits as a completion.
//! (Embeddings against a real llama.cpp server: `drop_in_llama_cpp.rs`.)

mod common;

use std::collections::HashSet;

use common::*;
use serde_json::json;

#[tokio::test]
async fn tokenize_and_detokenize_pass_through_by_load_with_the_callers_key_and_limits() {
    let dir = tempfile::tempdir().expect("tmp");
    let keys = keys_file(
        dir.path(),
        &[],
        "[[keys]]\nkey = \"salted-tenant-key-0123456789\"\ntenant = \"salted\"\ncache_salt = \"salt-s\"\n",
    );
    let (g, control) = gateway(&[
        "--api-keys-file",
        keys.to_str().expect("path"),
        "--require-api-key",
        "--max-body-bytes",
        "8192",
    ]);
    let synth = dir.path().join("tiny");
    let workers: Vec<Proc> = (0..2).map(|i| worker(&format!("w{i}"), &synth, Some(&control), &[])).collect();
    wait_healthy(&control, 2).await;
    let auth = format!("Bearer {TRUSTED_KEY}");
    let key = [("authorization", auth.as_str())];
    let url = |p: &str| format!("{}{p}", g.base);

    // No key: 401, as a completion.
    let r = post(&url("/tokenize"), &json!({"prompt": "hello"}), &[]).await;
    assert_eq!(r.status, 401, "{}", r.body);

    // Text: the worker's own answer (no model named: the only one served), spread over both workers by load.
    let text = "The quick brown fox jumps over the lazy dog.";
    let direct = post(&format!("{}/tokenize", workers[0].base), &json!({"prompt": text}), &[]).await.json();
    let mut served = HashSet::new();
    for _ in 0..6 {
        let r = post(&url("/tokenize"), &json!({"prompt": text}), &key).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["tokens"], direct["tokens"]);
        served.insert(r.header("x-kvgate-worker"));
    }
    assert_eq!(served.len(), 2, "by load, not by prefix: {served:?}");
    let tokens = direct["tokens"].clone();
    assert_eq!(direct["count"], tokens.as_array().expect("tokens").len());

    // Chat: the same tokens a chat completion's prompt is (its usage through the gateway says how many).
    let messages = json!([{"role": "user", "content": text}]);
    let r = post(&url("/tokenize"), &json!({"model": MODEL, "messages": messages}), &key).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let chat = post(
        &url("/v1/chat/completions"),
        &json!({"model": MODEL, "messages": messages, "max_tokens": 1}),
        &key,
    )
    .await;
    assert_eq!(r.json()["count"], chat.json()["usage"]["prompt_tokens"], "{}", chat.body);

    // Detokenize: back to the text.
    let r = post(&url("/detokenize"), &json!({"model": MODEL, "tokens": tokens}), &key).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["prompt"].as_str().expect("prompt").ends_with(text), "{}", r.body);

    // The gateway's limits and errors: an unknown model, a body over --max-body-bytes, bad JSON, a bad token.
    let r = post(&url("/tokenize"), &json!({"model": "nope", "prompt": "x"}), &key).await;
    assert_eq!((r.status, r.json()["error"]["code"].clone()), (404, json!("model_not_found")));
    let big = "word ".repeat(2000);
    let r = post(&url("/tokenize"), &json!({"prompt": big}), &key).await;
    assert_eq!((r.status, r.json()["error"]["code"].clone()), (413, json!("request_too_large")));
    let r = request("POST", &url("/tokenize"), Some("{nope".into()), &key).await;
    assert_eq!((r.status, r.json()["error"]["code"].clone()), (400, json!("invalid_json")));
    // A field the worker does not implement: refused by name, never ignored.
    for (body, param) in [
        (json!({"prompt": "x", "continue_final_message": true}), "continue_final_message"),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": true}),
            "add_special_tokens",
        ),
        (json!({"prompt": "x", "add_generation_prompt": true}), "add_generation_prompt"),
        (json!({"tokens": [1], "skip_special_tokens": true}), "skip_special_tokens"),
    ] {
        let path = if body.get("tokens").is_some() { "/detokenize" } else { "/tokenize" };
        let r = post(&url(path), &body, &key).await;
        assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!(param)), "{}", r.body);
    }
    let r = post(&url("/detokenize"), &json!({"tokens": [99_999_999]}), &key).await;
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("tokens")), "the worker's 400");
    // A path the pool does not serve (kvgate workers have no embeddings): the worker's own 404, passed on.
    let r = post(&url("/v1/embeddings"), &json!({"model": MODEL, "input": "x"}), &key).await;
    assert_eq!((r.status, r.json()["error"]["code"].clone()), (404, json!("route_not_found")), "{}", r.body);
    assert!(!r.header("x-kvgate-worker").is_empty());

    // A tenant with a forced salt: tokenize and detokenize keep no KV, so no salt is added (was 400 cache_salt).
    let salted = [("authorization", "Bearer salted-tenant-key-0123456789")];
    let r = post(&url("/tokenize"), &json!({"prompt": text}), &salted).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["tokens"], direct["tokens"]);
    let r = post(&url("/detokenize"), &json!({"tokens": tokens}), &salted).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // A body the gateway rewrites for that tenant may not repeat a member (a pod's parser might read the other
    // copy), and `"cache_salt": null` is replaced, not left after the tenant's salt.
    let dup = r#"{"model":"kvgate-tiny","input":"x","cache_salt":null,"input":"y"}"#;
    let r = request("POST", &url("/v1/embeddings"), Some(dup.into()), &salted).await;
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("input")), "{}", r.body);
    // Responses: what the body cannot show is refused by name; an output past the context is refused.
    for (body, param) in [
        (json!({"model": MODEL, "input": "x", "previous_response_id": "resp_1"}), "previous_response_id"),
        (json!({"model": MODEL, "input": "x", "conversation": "conv_1"}), "conversation"),
        (json!({"model": MODEL, "input": "x", "background": true}), "background"),
        (json!({"model": MODEL, "input": "x", "max_output_tokens": u64::MAX}), "max_output_tokens"),
    ] {
        let r = post(&url("/v1/responses"), &body, &key).await;
        assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!(param)), "{}", r.body);
    }

    // GET /v1/models/{id}: answered by the gateway.
    let r = request("GET", &url(&format!("/v1/models/{MODEL}")), None, &key).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["id"], MODEL);
    let r = request("GET", &url("/v1/models/gpt-4"), None, &key).await;
    assert_eq!((r.status, r.json()["error"]["code"].clone()), (404, json!("model_not_found")));

    // Every attempt gave its in-flight slot back, the refused and the failed ones too.
    for w in ["w0", "w1"] {
        let st = worker_state(&control, w).await.expect("worker");
        assert_eq!(st["inflight"], 0, "{st}");
    }

    // Counted by path: the requests the gateway read and passed on (6 texts, a chat, the 3 the worker refused and
    // the salted tenant's; not the ones the gateway refused itself).
    let m = get(&format!("{control}/metrics")).await.body;
    let n = metric(&m, "kvgate_gateway_passthrough_requests_total{path=\"/tokenize\"}").expect("counted");
    assert_eq!(n, 11.0);
}

/// Whole answers (a `content-length` body: `/tokenize`, a completion that is not streamed) on one keep-alive
/// connection, each request sent the moment the answer before it is read. The gateway used to watch the client
/// until the worker's body ended, after the client had the whole answer: that watch read one byte of the client's
/// next request off the connection, which then arrived as `OST /v1/...` and was answered 404 `route_not_found`
/// (10 of 3,000 in the field, found by the chaos run, `docs/benchmarks/reliability.md`).
#[tokio::test]
async fn the_next_request_on_a_connection_arrives_whole_after_a_whole_answer() {
    use http_body_util::{BodyExt, Full};
    let dir = tempfile::tempdir().expect("tmp");
    let (g, control) = gateway(&[]);
    let _w = worker("w0", &dir.path().join("tiny"), Some(&control), &[]);
    wait_healthy(&control, 1).await;
    let authority = g.base.trim_start_matches("http://").to_owned();
    let stream = tokio::net::TcpStream::connect(&authority).await.expect("connect");
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(conn);
    let bodies = [
        ("/tokenize", json!({"model": MODEL, "prompt": "the next request arrives whole"})),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "the next request arrives whole", "max_tokens": 1}),
        ),
    ];
    let mut failed = Vec::new();
    for i in 0..1600 {
        let (path, body) = &bodies[i % 2];
        let req = hyper::Request::post(*path)
            .header("host", &authority)
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(body.to_string())))
            .expect("request");
        if let Err(e) = send.ready().await {
            panic!("before request {i}: the gateway closed the connection ({e}); failed so far: {failed:?}");
        }
        let resp = send.send_request(req).await.unwrap_or_else(|e| panic!("request {i}: {e}"));
        let status = resp.status().as_u16();
        let text = resp.into_body().collect().await.expect("body").to_bytes();
        if status != 200 {
            failed.push((i, status, String::from_utf8_lossy(&text).into_owned()));
        }
    }
    assert!(failed.is_empty(), "{} of 1600 failed: {:?}", failed.len(), &failed[..failed.len().min(3)]);
}
