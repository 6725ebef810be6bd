//! The Grafana dashboard the chart ships (`helm/kvgate/dashboards/kvgate.json`) asks only for series that a live
//! gateway and worker really export: every metric name in every panel's PromQL is found in their `/metrics` after
//! some traffic (requests admitted at once, after waiting, and refused with 429).

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// Metric names (`kvgate_...`) in a PromQL expression.
fn names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("kvgate_") {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        out.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// Whether a Prometheus text exposition has a series named exactly `name`.
fn exported(text: &str, name: &str) -> bool {
    text.lines().any(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{') || r.starts_with(' ')))
}

const SMALL_CLASS: &str = r#"
[[classes]]
name = "all"
refill_tokens_per_s = 300
burst_tokens = 400
max_wait_ms = 1000
max_queued_requests = 2
"#;

#[tokio::test]
async fn every_panel_queries_series_that_are_exported() {
    let board: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../helm/kvgate/dashboards/kvgate.json"
        ))
        .expect("the chart's dashboard"),
    )
    .expect("JSON");
    let mut wanted = BTreeSet::new();
    for p in board["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().expect("targets") {
            wanted.extend(names(t["expr"].as_str().expect("expr")));
        }
    }
    assert!(wanted.len() >= 12, "{wanted:?}");

    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("gateway.toml");
    std::fs::write(&cfg, SMALL_CLASS).expect("write");
    // Every request is split (the prefill/decode panels need their series): w0 decodes, p0 computes the prompts.
    let (g, control) = gateway(&["--config", cfg.to_str().expect("p"), "--split-policy", "always"]);
    let w = worker("w0", &dir.path().join("tiny"), Some(&control), &[]);
    let pf = worker(
        "p0",
        &dir.path().join("tiny"),
        Some(&control),
        &["--role", "prefill", "--kv-transfer-port", "0"],
    );
    wait_healthy(&control, 2).await;
    // Traffic: two admitted at once (300 of the 400-token burst), the rest wait (one is admitted after waiting)
    // or are refused (a full queue, or a wait past 1 s): 200s and 429s both.
    let url = format!("{}/v1/completions", g.base);
    let mut sends = Vec::new();
    for i in 0..8u32 {
        let url = url.clone();
        sends.push(tokio::spawn(async move {
            let prompt: Vec<u32> = (0..50).map(|j| (i * 50 + j) % 500).collect();
            post(&url, &json!({"model": "kvgate-tiny", "prompt": prompt, "max_tokens": 100}), &[])
                .await
                .status
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut statuses = Vec::new();
    for s in sends {
        statuses.push(s.await.expect("send"));
    }
    assert!(statuses.contains(&200) && statuses.contains(&429), "{statuses:?}");
    let chat =
        json!({"model": "kvgate-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(post(&format!("{}/v1/chat/completions", g.base), &chat, &[]).await.status, 200);
    // A stream: the TPOT-by-path panel's series.
    let stream = json!({"model": "kvgate-tiny", "prompt": [1, 2, 3], "max_tokens": 4, "stream": true});
    assert_eq!(post(&url, &stream, &[]).await.status, 200);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let scraped = format!(
        "{}\n{}\n{}",
        get(&format!("{control}/metrics")).await.body,
        get(&format!("{}/metrics", w.base)).await.body,
        get(&format!("{}/metrics", pf.base)).await.body
    );
    let missing: Vec<&String> = wanted.iter().filter(|n| !exported(&scraped, n)).collect();
    assert!(missing.is_empty(), "the dashboard queries series nobody exports: {missing:?}");
}

#[test]
fn metric_names_are_found_in_promql() {
    assert_eq!(
        names(
            "histogram_quantile(0.5, sum by (le) (rate(kvgate_worker_ttft_seconds_bucket[5m]))) / kvgate_x"
        ),
        ["kvgate_worker_ttft_seconds_bucket", "kvgate_x"]
    );
    assert!(exported("kvgate_a{x=\"1\"} 2\nkvgate_ab 3", "kvgate_a"));
    assert!(!exported("kvgate_ab 3", "kvgate_a"));
}
