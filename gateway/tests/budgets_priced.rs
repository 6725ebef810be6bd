//! What a body asks a vLLM pool to compute is what its class is charged, however the body asks (issue #65): `n`
//! choices each of up to `max_tokens`, a whole answer whose `usage` sits before megabytes of `prompt_logprobs`,
//! a score request of one query against 2,000 documents; and one tenant's `n` cannot teach the class an output
//! length that prices another tenant's ordinary chat out. A stand-in pod (Python's standard library, vLLM does
//! not run on every machine this runs on) answers with vLLM's response members in vLLM's order.

mod common;

use common::*;
use serde_json::{json, Value};

/// A stand-in for a vLLM pod: chat answers with `n` choices of `max_tokens` tokens (without it 20, or 3,000 when
/// `prompt_logprobs` is asked for), usage before a large `prompt_logprobs` when asked for; score answers with one pair per document, each the query's words
/// plus the document's and 2.
fn pod(py: &std::ffi::OsStr) -> (Proc, String) {
    let port = free_port();
    let script = format!(
        r#"
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def reply(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_GET(self):
        if self.path == "/v1/models":
            self.reply({{"object": "list", "data": [{{"id": "{MODEL}", "object": "model", "max_model_len": 4096}}]}})
        else:
            self.reply({{"status": "ok"}})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{{}}")
        if self.path == "/v1/score":
            q = len(req["text_1"].split())
            docs = req["text_2"] if isinstance(req["text_2"], list) else [req["text_2"]]
            p = sum(q + len(d.split()) + 2 for d in docs)
            self.reply({{"id": "s", "object": "list", "created": 0, "model": req["model"],
                "data": [{{"index": i, "object": "score", "score": 0.5}} for i in range(len(docs))],
                "usage": {{"prompt_tokens": p, "total_tokens": p, "completion_tokens": 0}}}})
            return
        n, m = req.get("n") or 1, req.get("max_tokens") or (3000 if req.get("prompt_logprobs") else 20)
        out = {{"id": "c", "object": "chat.completion", "created": 0, "model": req["model"],
            "choices": [{{"index": i, "message": {{"role": "assistant", "content": "ok " * m}},
                "logprobs": None, "finish_reason": "length", "stop_reason": None}} for i in range(n)],
            "service_tier": None, "system_fingerprint": None,
            "usage": {{"prompt_tokens": 12, "total_tokens": 12 + n * m, "completion_tokens": n * m,
                "prompt_tokens_details": None}},
            "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None}}
        if req.get("prompt_logprobs"):
            out["prompt_logprobs"] = [None] + [{{str(t): {{"logprob": -1.25, "rank": 1, "decoded_token": "tok"}}
                for t in range(5)}} for _ in range(8000)]
        self.reply(out)
ThreadingHTTPServer(("127.0.0.1", {port}), H).serve_forever()
"#
    );
    let child = std::process::Command::new(py).arg("-c").arg(script).spawn().expect("python pod");
    (Proc::adopt(child), format!("http://127.0.0.1:{port}"))
}

const ADMIN: &str = "budgets-admin-token";

fn charged(m: &str) -> f64 {
    m.lines()
        .filter(|l| l.starts_with("kvgate_gateway_class_tokens_charged_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sends `body` to `path` and returns (status, answer, tokens charged for it).
async fn charged_for(base: &str, control: &str, path: &str, body: &Value) -> (u16, Value, f64) {
    let before = charged(&get(&format!("{control}/metrics")).await.body);
    let r = post(&format!("{base}{path}"), body, &[]).await;
    let answer = serde_json::from_str(&r.body).unwrap_or(Value::Null);
    let after = charged(&get(&format!("{control}/metrics")).await.body);
    (r.status, answer, after - before)
}

#[tokio::test]
async fn n_prompt_logprobs_and_score_pairs_are_charged_what_the_pod_computed() {
    let Some(py) = common::python("a stand-in vLLM pod") else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    drop(worker("warm", &synth, None, &[])); // writes the model's tokenizer
    let (_pod, url) = pod(&py);
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "[[models]]\nname = {MODEL:?}\ntokenizer = {:?}\nkind = \"vllm\"\nworkers = [{url:?}]\n",
            synth.display().to_string()
        ),
    )
    .expect("config");
    let (g, control) = gateway(&["--config", &config.display().to_string(), "--admin-token", ADMIN]);
    let hello = json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]});
    wait_until(std::time::Duration::from_secs(20), || async {
        post(&format!("{}/v1/chat/completions", g.base), &hello, &[]).await.status == 200
    })
    .await;
    let chat = |extra: Value| {
        let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}]});
        b.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        b
    };

    // First, while the class has learned nothing else: eight chats of n = 100 without max_tokens (20 tokens per
    // choice). The class learns 20 per choice, and a plain chat without max_tokens is priced at about its prompt
    // plus 20, not plus 2,000.
    for _ in 0..8 {
        let (status, _, _) =
            charged_for(&g.base, &control, "/v1/chat/completions", &chat(json!({"n": 100}))).await;
        assert_eq!(status, 200);
    }
    let auth = format!("Bearer {ADMIN}");
    let explained =
        post(&format!("{control}/admin/v1/route/explain"), &chat(json!({})), &[("authorization", &auth)])
            .await;
    assert_eq!(explained.status, 200, "{}", explained.body);
    let cost = explained.json()["cost_tokens"].as_f64().expect("cost");
    assert!(cost < 200.0, "a plain chat priced at {cost} tokens after n = 100 chats");

    // n = 50 choices of 100 tokens: 5,000 output tokens computed, 5,000 charged (plus the prompt).
    let (status, a, c) =
        charged_for(&g.base, &control, "/v1/chat/completions", &chat(json!({"n": 50, "max_tokens": 100})))
            .await;
    assert_eq!((status, a["choices"].as_array().map(Vec::len)), (200, Some(50)), "{a}");
    assert!((5000.0..=5100.0).contains(&c), "charged {c} for 5,000 output tokens");
    // Past the limit on choices: refused by name, before any pod computes.
    let r = post(&format!("{}/v1/chat/completions", g.base), &chat(json!({"n": 200})), &[]).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        (r.json()["error"]["param"].clone(), r.json()["error"]["code"].clone()),
        (json!("n"), json!("invalid_value"))
    );

    // A chat without max_tokens that generates 3,000 tokens, its usage before 1 MB of prompt_logprobs: found by
    // structure, 3,000 output tokens charged (not the price, which the class's learned 20 made small).
    let (status, a, c) =
        charged_for(&g.base, &control, "/v1/chat/completions", &chat(json!({"prompt_logprobs": 5}))).await;
    assert_eq!(status, 200);
    assert!(a["prompt_logprobs"].as_array().is_some_and(|l| l.len() > 1000), "the big answer came through");
    assert!((3000.0..=3100.0).contains(&c), "charged {c} for 3,000 output tokens");

    // One 400-word query against 2,000 documents: 2,000 pairs, each holding the query.
    let query: String = (0..400).map(|i| format!("w{i} ")).collect();
    let docs: Vec<String> = (0..2000).map(|i| format!("document {i}")).collect();
    let (status, a, c) = charged_for(
        &g.base,
        &control,
        "/v1/score",
        &json!({"model": MODEL, "text_1": query, "text_2": docs}),
    )
    .await;
    assert_eq!(status, 200, "{a}");
    let computed = a["usage"]["prompt_tokens"].as_f64().expect("usage");
    assert!(computed > 800_000.0, "{computed}");
    assert_eq!(c, computed, "charged what the pod computed, not a bound from the body's size");
}
