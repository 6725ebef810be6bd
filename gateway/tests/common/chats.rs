//! Growing multi-turn chats against an OpenAI endpoint, for the tests and the `epp` bench: users share a system
//! prompt, each turn carries the conversation so far; the hit rate the workers report and who served each turn.
#![allow(dead_code)]

use serde_json::{json, Value};

/// The tiny model the test fleets serve.
const TINY: &str = "kvgate-tiny";

/// Users x turns of a conversation that grows (a shared system prompt, each user's own history) against `base`;
/// the hit rate the workers report (cached over prompt tokens) and who served each user's turns.
pub async fn conversations(base: &str, tag: &str, users: usize, turns: usize) -> (f64, Vec<Vec<String>>) {
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
            let r = kvgate_testkit::http::post(
                &format!("{base}/v1/chat/completions"),
                &json!({"model": TINY, "messages": h, "max_tokens": 4, "temperature": 0}),
                &[],
            )
            .await;
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
