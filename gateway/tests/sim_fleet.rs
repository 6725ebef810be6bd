//! Sixteen simulated workers (`kvgate-worker serve --engine sim`, GPU profile, real time) side by side on this
//! machine behind one real gateway: all register through their reports, multi-turn sessions spread over them and
//! come back to their caches.

mod common;

use std::collections::{HashMap, HashSet};

use common::*;
use serde_json::json;

const WORKERS: usize = 16;

#[tokio::test]
async fn sixteen_sim_workers_serve_side_by_side_behind_one_gateway() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (gateway, control) = gateway(&[]);
    let sim = ["--engine", "sim", "--sim-profile", "gpu-h100-llama3-8b"];
    let workers: Vec<Proc> =
        (0..WORKERS).map(|i| worker(&format!("sim{i:02}"), &synth, Some(&control), &sim)).collect();
    wait_healthy(&control, WORKERS).await;

    // 16 sessions x 3 turns; each turn's requests go out concurrently. Turn k = the session's 320-token history
    // plus 40 new tokens per earlier turn.
    let session_prompt = |s: u32, turn: u32| -> Vec<u32> {
        (0..320 + 40 * turn).map(|i| (i.wrapping_mul(2_654_435_761) ^ s.wrapping_mul(7919)) % 500).collect()
    };
    let mut home: HashMap<u32, String> = HashMap::new();
    for turn in 0..3u32 {
        let calls: Vec<_> = (0..16u32)
            .map(|s| {
                let url = format!("{}/v1/completions", gateway.base);
                let body = json!({"model": MODEL, "prompt": session_prompt(s, turn), "max_tokens": 4});
                tokio::spawn(async move {
                    let r = post(&url, &body, &[("x-session-id", &format!("session-{s}"))]).await;
                    (s, r)
                })
            })
            .collect();
        for call in calls {
            let (s, r) = call.await.expect("request task");
            assert_eq!(r.status, 200, "session {s} turn {turn}: {}", r.body);
            let worker = r.header("x-kvgate-worker");
            let cached =
                r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached");
            if turn == 0 {
                home.insert(s, worker);
            } else {
                assert_eq!(home[&s], worker, "session {s} turn {turn} left its worker");
                // Everything the last turn sent, in whole 16-token blocks.
                let previous = 320 + 40 * (turn - 1);
                assert!(cached >= u64::from(previous / 16 * 16), "session {s} turn {turn}: {cached} cached");
            }
        }
    }
    let used: HashSet<&String> = home.values().collect();
    assert!(used.len() >= 6, "16 sessions used only {} of 16 workers: {home:?}", used.len());
    let listed = get(&format!("{control}/kvgate/v1/workers")).await.json();
    assert_eq!(listed.as_array().map_or(0, |a| a.len()), WORKERS);
    let rss: u64 = workers.iter().map(|w| rss_kib(w.child.id())).sum();
    eprintln!("{WORKERS} sim workers: {} MiB resident in total", rss / 1024);
}
