//! The prompt handoff on real processes: the gateway passes the token ids it computed to the kvgate worker
//! (authenticated with the shared report secret), the worker uses them instead of tokenizing again, and nobody
//! else can hand a worker ids: a client body carrying the field is refused by the gateway, and a forged field sent
//! to a worker directly is ignored.

mod common;

use common::*;
use serde_json::json;

fn handoffs(metrics: &str, result: &str) -> f64 {
    metric(metrics, &format!("kvgate_worker_prompt_handoff_total{{result=\"{result}\"}}")).unwrap_or(0.0)
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
    forged["kvgate_prompt_ids"] = json!(kvgate_shared::handoff::encode_ids(&[1, 2, 3]));
    let r = post(&format!("{}/v1/chat/completions", g.base), &forged, &[]).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "kvgate_prompt_ids");

    // Sent to the worker directly, with or without a made-up code, the field is ignored: the worker tokenizes the
    // messages itself.
    let want = post(&format!("{}/v1/chat/completions", w.base), &chat, &[]).await.json();
    for auth in [None, Some("00".repeat(32))] {
        let headers: Vec<(&str, &str)> = auth
            .as_deref()
            .map(|a| vec![(kvgate_shared::handoff::PROMPT_AUTH_HEADER, a)])
            .unwrap_or_default();
        let r = post(&format!("{}/v1/chat/completions", w.base), &forged, &headers).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["usage"]["prompt_tokens"], want["usage"]["prompt_tokens"]);
        assert_eq!(r.json()["choices"], want["choices"]);
    }
    let m = get(&format!("{}/metrics", w.base)).await.body;
    assert_eq!(handoffs(&m, "unverified"), 2.0, "{m}");
    assert_eq!(handoffs(&m, "used"), 2.0);
}

#[tokio::test]
async fn only_a_code_under_the_workers_own_secret_is_honoured() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (_g, control) = gateway(&[]);
    // The worker's secret is `test-secret` (it reports with it).
    let w = worker("w0", &synth, Some(&control), &[]);
    wait_healthy(&control, 1).await;
    let body =
        json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "ka ri to"}]});
    let enc = kvgate_shared::handoff::encode_ids(&[5, 6, 7]);
    let mut forged = body.clone();
    forged["kvgate_prompt_ids"] = json!(enc);
    let wrong = kvgate_shared::handoff::sign("not-the-secret", &enc);
    let r = post(
        &format!("{}/v1/chat/completions", w.base),
        &forged,
        &[(kvgate_shared::handoff::PROMPT_AUTH_HEADER, wrong.as_str())],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let right = kvgate_shared::handoff::sign("test-secret", &enc);
    let r2 = post(
        &format!("{}/v1/chat/completions", w.base),
        &forged,
        &[(kvgate_shared::handoff::PROMPT_AUTH_HEADER, right.as_str())],
    )
    .await;
    assert_eq!(r2.status, 200, "{}", r2.body);
    // Signed with the right secret the worker takes the ids as given (3 tokens); with the wrong one it tokenized
    // the message.
    assert_eq!(r2.json()["usage"]["prompt_tokens"], 3);
    assert_ne!(r.json()["usage"]["prompt_tokens"], 3);
}
