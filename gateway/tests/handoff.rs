//! What a gateway vouches for, on real processes: the gateway passes the token ids it computed to the kvgate worker
//! under an assertion keyed by the shared report secret (bound to the model, the scheme fingerprint, the salt, the
//! tenant scope and the time), the worker uses them instead of tokenizing again, and nobody else can hand a worker
//! ids or a scope: a client body carrying the field is refused by the gateway, a forged, stale or re-targeted
//! assertion sent to a worker directly is refused, and a worker started with `--require-gateway-token` answers its
//! API only to callers holding the gateway token.

mod common;

use common::*;
use kvgate_shared::handoff::{self, Assertion, TenantScope, ASSERTION_HEADER};
use kvgate_shared::hashing::HashScheme;
use serde_json::json;

fn handoffs(metrics: &str, result: &str) -> f64 {
    metric(metrics, &format!("kvgate_worker_prompt_handoff_total{{result=\"{result}\"}}")).unwrap_or(0.0)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64
}

/// The worker's scheme fingerprint, from its tokenizer endpoint.
async fn fingerprint(w: &Proc, headers: &[(&str, &str)]) -> u64 {
    let r = request("GET", &format!("{}/kvgate/v1/tokenizer", w.base), None, headers).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let scheme: HashScheme = serde_json::from_value(r.json()["scheme"].clone()).expect("scheme");
    scheme.fingerprint()
}

#[tokio::test]
async fn the_worker_uses_the_gateways_ids_and_only_those() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway(&[]);
    let w = worker("w0", &synth, Some(&control), &[]);
    wait_healthy(&control, 1).await;
    let chat = json!({"model": MODEL, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": "ka ri to ne sa lo mi du ve po"},
                     {"role": "user", "content": "mi du ve po ka ri"}]});
    let text =
        json!({"model": MODEL, "max_tokens": 2, "temperature": 0, "prompt": "ka ri to ne sa lo mi du"});

    // Through the gateway: same answer and usage as direct, and the worker took the handed-off ids.
    for (path, body) in [("/v1/chat/completions", &chat), ("/v1/completions", &text)] {
        let via = post(&format!("{}{path}", g.base), body, &[]).await;
        assert_eq!(via.status, 200, "{}", via.body);
        let direct = post(&format!("{}{path}", w.base), body, &[]).await;
        assert_eq!(direct.status, 200, "{}", direct.body);
        assert_eq!(via.json()["choices"], direct.json()["choices"], "{path}");
        assert_eq!(via.json()["usage"]["prompt_tokens"], direct.json()["usage"]["prompt_tokens"], "{path}");
    }
    let m = get(&format!("{}/metrics", w.base)).await.body;
    assert_eq!(handoffs(&m, "used"), 2.0, "{m}");
    assert_eq!(handoffs(&m, "unverified"), 0.0);

    // A client cannot send the field through the gateway.
    let mut forged = chat.clone();
    forged["kvgate_prompt_ids"] = json!(handoff::encode_ids(&[1, 2, 3]));
    let r = post(&format!("{}/v1/chat/completions", g.base), &forged, &[]).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "kvgate_prompt_ids");

    // Sent to the worker directly without an assertion, the field is ignored: the worker tokenizes the messages
    // itself. With a made-up assertion the request is refused.
    let want = post(&format!("{}/v1/chat/completions", w.base), &chat, &[]).await.json();
    let r = post(&format!("{}/v1/chat/completions", w.base), &forged, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["prompt_tokens"], want["usage"]["prompt_tokens"]);
    assert_eq!(r.json()["choices"], want["choices"]);
    let made_up = format!("v1.{}.{:016x}.-.-.{}", now_ms(), 1, "00".repeat(32));
    let r = post(&format!("{}/v1/chat/completions", w.base), &forged, &[(ASSERTION_HEADER, &made_up)]).await;
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "invalid_gateway_assertion");
    let m = get(&format!("{}/metrics", w.base)).await.body;
    assert_eq!(handoffs(&m, "unverified"), 1.0, "{m}");
    assert_eq!(handoffs(&m, "used"), 2.0);
}

#[tokio::test]
async fn only_an_assertion_for_this_request_under_the_workers_secret_now_is_honoured() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (_g, control) = gateway(&[]);
    // The worker's secret is `test-secret` (it reports with it).
    let w = worker("w0", &synth, Some(&control), &[]);
    wait_healthy(&control, 1).await;
    let fp = fingerprint(&w, &[]).await;
    let enc = handoff::encode_ids(&[5, 6, 7]);
    let mut forged =
        json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "ka ri to"}]});
    forged["kvgate_prompt_ids"] = json!(enc);
    let url = format!("{}/v1/chat/completions", w.base);
    let good = Assertion {
        issued_ms: now_ms(),
        fingerprint: fp,
        scope: None,
        model: MODEL,
        salt: None,
        ids: Some(&enc),
    };
    let send = |header: String| {
        let (url, forged) = (url.clone(), forged.clone());
        async move { post(&url, &forged, &[(ASSERTION_HEADER, &header)]).await }
    };
    // Signed with the right secret the worker takes the ids as given (3 tokens).
    let r = send(handoff::sign("test-secret", &good)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["prompt_tokens"], 3);
    // Another secret, another model, a salt the request does not carry, other ids, or an old assertion: refused.
    let scope = TenantScope::new("team-a", true);
    let other_ids = handoff::encode_ids(&[5, 6]);
    for (what, a, secret) in [
        ("secret", good.clone(), "not-the-secret"),
        ("model", Assertion { model: "another-model", ..good.clone() }, "test-secret"),
        ("salt", Assertion { salt: Some("s"), ..good.clone() }, "test-secret"),
        ("ids", Assertion { ids: Some(&other_ids), ..good.clone() }, "test-secret"),
        ("scope", Assertion { scope: Some(&scope), salt: Some("s"), ..good.clone() }, "test-secret"),
        (
            "time",
            Assertion { issued_ms: now_ms() - handoff::ASSERTION_WINDOW_MS - 5_000, ..good.clone() },
            "test-secret",
        ),
    ] {
        let r = send(handoff::sign(secret, &a)).await;
        assert_eq!(r.status, 401, "{what}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "invalid_gateway_assertion", "{what}");
    }
    // A valid assertion made for another tokenizer: the request is served, the ids are not used.
    let r = send(handoff::sign("test-secret", &Assertion { fingerprint: fp ^ 1, ..good.clone() })).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_ne!(r.json()["usage"]["prompt_tokens"], 3);
    let m = get(&format!("{}/metrics", w.base)).await.body;
    assert_eq!(handoffs(&m, "other_fingerprint"), 1.0, "{m}");
}

#[tokio::test]
async fn a_worker_that_requires_the_gateway_token_answers_only_gateways() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway(&[]);
    let w = worker("w0", &synth, Some(&control), &["--require-gateway-token"]);
    wait_healthy(&control, 1).await;
    let body =
        json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "ka ri to"}]});
    // Directly: refused, with or without a made-up or a client's bearer; probes and metrics stay open.
    for auth in [None, Some("Bearer sk-a-client-key"), Some("Bearer 0123")] {
        let headers: Vec<(&str, &str)> = auth.map(|a| vec![("authorization", a)]).unwrap_or_default();
        for (method, path, b) in [
            ("POST", "/v1/chat/completions", Some(body.to_string())),
            ("GET", "/v1/models", None),
            ("GET", "/kvgate/v1/tokenizer", None),
        ] {
            let r = request(method, &format!("{}{path}", w.base), b, &headers).await;
            assert_eq!(r.status, 401, "{path} {auth:?}: {}", r.body);
            assert_eq!(r.json()["error"]["code"], "gateway_token_required");
        }
    }
    for path in ["/health", "/ready", "/metrics"] {
        assert_eq!(get(&format!("{}{path}", w.base)).await.status, 200, "{path}");
    }
    // Through the gateway (which fetched the tokenizer with its token): served, ids handed off.
    let r = post(&format!("{}/v1/chat/completions", g.base), &body, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let token = format!("Bearer {}", handoff::gateway_token("test-secret"));
    assert!(fingerprint(&w, &[("authorization", &token)]).await > 0);
    let m = get(&format!("{}/metrics", w.base)).await.body;
    assert_eq!(handoffs(&m, "used"), 1.0, "{m}");
    assert_eq!(metric(&m, "kvgate_worker_unauthorized_requests_total"), Some(9.0), "{m}");
}
