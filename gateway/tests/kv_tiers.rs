//! KV tiers end to end, real processes: a worker with a host DRAM tier under a small KV pool, a gateway in front.
//! A prompt pushed out of the pool by other prompts is reported in the host tier's Bloom summary, the gateway's
//! explain shows the match by tier, and the next turn is served from host memory (`cached_tokens`).

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

const TOKEN: &str = "admin-t0ken";

/// The first worker's matched blocks by tier, as the gateway's route/explain gives them for `body`.
async fn explain_tiers(control: &str, body: &serde_json::Value) -> serde_json::Value {
    let auth = format!("Bearer {TOKEN}");
    let ex = request(
        "POST",
        &format!("{control}/admin/v1/route/explain"),
        Some(body.to_string()),
        &[("authorization", auth.as_str())],
    )
    .await;
    ex.json()["terms"][0]["tiers"].clone()
}

#[tokio::test]
async fn a_prompt_evicted_to_host_dram_is_reported_routed_and_served_from_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway(&["--admin-token", TOKEN]);
    // 16 blocks of 16 tokens on the device; 64 MiB of host DRAM below.
    let w =
        worker("w0", &synth, Some(&control), &["--kv-cache-tokens", "256", "--host-kv-bytes", "67108864"]);
    wait_healthy(&control, 1).await;
    let url = format!("{}/v1/completions", g.base);
    let first: Vec<u32> = (0..200).map(|i| (i * 13 + 5) % 400 + 1).collect();
    let r = post(&url, &json!({"model": MODEL, "prompt": first, "max_tokens": 2}), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Three other 200-token prompts: the pool holds 16 blocks, so the first prompt's 12 leave it.
    for k in 0..3u32 {
        let other: Vec<u32> = (0..200).map(|i| (i * 7 + k * 101) % 400 + 1).collect();
        let r = post(&url, &json!({"model": MODEL, "prompt": other, "max_tokens": 2}), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let mut next = first.clone();
    next.extend([7, 8, 9, 10, 11, 12, 13, 14]);
    let body = json!({"model": MODEL, "prompt": next, "max_tokens": 2});
    // Once a report after the flood arrived: the prefix is in the host tier, not on the device.
    wait_until(Duration::from_secs(5), || {
        let (control, body) = (control.clone(), body.clone());
        async move {
            let t = explain_tiers(&control, &body).await;
            t["through_host"].as_u64().is_some_and(|h| h >= 12)
                && t["device"].as_u64().is_some_and(|d| d < 12)
        }
    })
    .await;
    eprintln!("explain: {}", explain_tiers(&control, &body).await);
    let r = post(&url, &body, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached >= 192, "served from host DRAM: {cached} cached tokens, {}", r.body);
    let m = get(&format!("{}/metrics", w.base)).await.body;
    assert!(metric(&m, "kvgate_worker_host_kv_hit_blocks").unwrap_or(0.0) >= 12.0, "{m}");
    assert!(metric(&m, "kvgate_worker_host_kv_stored_blocks").unwrap_or(0.0) >= 12.0, "{m}");
}

#[tokio::test]
async fn a_worker_killed_and_restarted_serves_from_its_ssd_tier_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let ssd = dir.path().join("ssd");
    let ssd_arg = ssd.display().to_string();
    let (g, control) = gateway(&["--admin-token", TOKEN]);
    // Write-through: every completed block reaches the SSD tier at once (the crash-warm setting).
    let args = [
        "--disk-kv-path",
        ssd_arg.as_str(),
        "--disk-kv-bytes",
        "67108864",
        "--kv-write-policy",
        "write-through",
    ];
    let port = free_port();
    let mut w = worker_on(port, "w0", &synth, Some(&control), &args, &[]);
    wait_healthy(&control, 1).await;
    let url = format!("{}/v1/completions", g.base);
    let first: Vec<u32> = (0..200).map(|i| (i * 11 + 3) % 400 + 1).collect();
    let r = post(&url, &json!({"model": MODEL, "prompt": first, "max_tokens": 2}), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let metrics = format!("{}/metrics", w.base);
    wait_until(Duration::from_secs(5), || {
        let metrics = metrics.clone();
        async move {
            let m = get(&metrics).await.body;
            metric(&m, "kvgate_worker_disk_kv_written_blocks").unwrap_or(0.0) >= 12.0
        }
    })
    .await;
    // SIGKILL: no shutdown, no flush beyond what the IO thread already wrote.
    w.kill();
    let w = worker_on(port, "w0", &synth, Some(&control), &args, &[]);
    let metrics = format!("{}/metrics", w.base);
    wait_until(Duration::from_secs(5), || {
        let metrics = metrics.clone();
        async move {
            let m = get(&metrics).await.body;
            metric(&m, "kvgate_worker_disk_kv_recovered_blocks").unwrap_or(0.0) >= 12.0
        }
    })
    .await;
    let mut next = first.clone();
    next.extend([5, 6, 7, 8]);
    let body = json!({"model": MODEL, "prompt": next, "max_tokens": 2});
    // The restarted worker's first report carries its SSD tier: the gateway sees the prefix there.
    wait_until(Duration::from_secs(5), || {
        let (control, body) = (control.clone(), body.clone());
        async move { explain_tiers(&control, &body).await["through_disk"].as_u64().is_some_and(|d| d >= 12) }
    })
    .await;
    let r = post(&url, &body, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached >= 192, "the first request after the restart is served from the SSD tier: {}", r.body);
}
