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
