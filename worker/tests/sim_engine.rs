//! `kvgate-worker serve --engine sim`: the same HTTP API, block manager, prefix cache and reports, with a timing
//! model in place of the math. Prompts as long as the traces' longest (~200K tokens) are served.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

#[tokio::test]
async fn sim_worker_serves_a_200k_token_prompt_and_caches_its_prefix() {
    let dir = tempfile::tempdir().expect("tmp");
    let profile = dir.path().join("fast.toml");
    std::fs::write(
        &profile,
        r#"
name = "test-fast"
source = "test fixture: 1 us per prefill token, 1 ms per decode step"
max_model_len = 262144
[timing]
prefill_base_s = 0.0
prefill_per_token_s = 1e-6
prefill_attention_s = 0.0
decode_base_s = 0.001
decode_per_seq_s = 0.0
decode_per_kv_token_s = 0.0
"#,
    )
    .expect("write");
    let w = start_worker(&[
        "--engine",
        "sim",
        "--sim-profile",
        profile.to_str().expect("path"),
        "--kv-cache-tokens",
        "262144",
        "--max-body-bytes",
        "4000000",
    ]);
    let prompt: Vec<u32> = (0..200_000u32).map(|i| (i * 7 + 3) % 500).collect();
    let url = format!("{}/v1/completions", w.base);
    let t = Instant::now();
    let r = post(
        &url,
        &json!({"model": "kvgate-tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": true}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let first = t.elapsed();
    let j = r.json();
    assert_eq!(j["usage"]["prompt_tokens"], 200_000);
    assert_eq!(j["usage"]["completion_tokens"], 4);
    // The timing model was applied: 200K prefill tokens at 1 us each take at least 0.2 s.
    assert!(first >= Duration::from_millis(200), "{first:?}");
    // Same prefix, new tail: served from the prefix cache.
    let mut second = prompt[..199_000].to_vec();
    second.extend([1, 2, 3]);
    let r = post(&url, &json!({"model": "kvgate-tiny", "prompt": second, "max_tokens": 1}), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        198_992,
        "every full block of the 199,000 shared tokens"
    );
    // Misconfiguration is refused with a clear message.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
        .args(["serve", "--synth", "tiny", "--engine", "sim"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--sim-profile"));
}
