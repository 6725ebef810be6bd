//! Who may register a worker: the report secret is required to start, a report may only advertise its own address
//! (or an allowed one), a live worker's id cannot be taken over, and silent workers are forgotten with their metric
//! series. Real gateway and worker processes on loopback; forged reports built with the shared protocol crate.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use kvgate_shared::hashing::HashScheme;
use kvgate_shared::report::{QueueStats, Throughput, WorkerReport};

fn forged(id: &str, url: &str, seq: u64) -> Vec<u8> {
    let scheme = HashScheme::new(16, 1);
    WorkerReport {
        pd: Default::default(),
        lora: Default::default(),
        worker_id: id.into(),
        advertise_url: url.into(),
        model_id: MODEL.into(),
        scheme,
        fingerprint: scheme.fingerprint(),
        seq,
        timestamp_ms: 0,
        instance_id: 77,
        max_model_len: 2048,
        draining: false,
        queue: QueueStats::default(),
        throughput: Throughput::default(),
        tiers: Vec::new(),
    }
    .encode()
}

async fn send_report(control: &str, body: Vec<u8>, secret: Option<&str>) -> Resp {
    let bearer = secret.map(|s| format!("Bearer {s}"));
    let mut headers = vec![("content-type", "application/x-kvgate-report")];
    if let Some(b) = &bearer {
        headers.push(("authorization", b.as_str()));
    }
    // The body is binary: sent through the byte-level helper.
    request_bytes("POST", &format!("{control}/kvgate/v1/report"), body, &headers).await
}

#[test]
fn the_gateway_refuses_to_start_without_a_report_secret() {
    let out = Command::new(bin("kvgate-gateway"))
        .args(["--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0"])
        .env_remove("KVGATE_REPORT_SECRET")
        .stdout(Stdio::null())
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("report secret") && err.contains("--insecure-reports"), "{err}");
}

#[tokio::test]
async fn reports_may_only_advertise_their_own_address_and_not_take_a_live_workers_id() {
    let dir = tempfile::tempdir().expect("tmp");
    let (_g, control) = gateway(&[]);
    let _w = worker("w", &dir.path().join("tiny"), Some(&control), &[]);
    wait_healthy(&control, 1).await;
    // Anyone on the control port without the secret: 401.
    let r = send_report(&control, forged("x", "http://127.0.0.1:9", 1), None).await;
    assert_eq!(r.status, 401);
    // With the secret, pointing the gateway at another address: 403.
    let r = send_report(&control, forged("x", "http://10.1.2.3:8000", 1), Some("test-secret")).await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "advertise_url_not_allowed");
    // Its own address, but a KV transfer address on another host (where decode workers would be sent): 403.
    let mut pd =
        kvgate_shared::report::WorkerReport::decode(&forged("x", "http://127.0.0.1:9", 1)).expect("decode");
    pd.pd.transfer_addr = "10.1.2.3:9100".into();
    let r = send_report(&control, pd.encode(), Some("test-secret")).await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "transfer_addr_not_allowed");
    // Taking over the live worker w's id from another URL: 409.
    let r = send_report(
        &control,
        forged("w", &format!("http://127.0.0.1:{}", free_port()), 1),
        Some("test-secret"),
    )
    .await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "worker_id_conflict");
    let state = worker_state(&control, "w").await.expect("w");
    assert!(state["url"].as_str().is_some_and(|u| u.starts_with("http://127.0.0.1:")), "{state}");
    assert!(worker_state(&control, "x").await.is_none(), "nothing registered");
}

#[tokio::test]
async fn an_allowlist_admits_other_hosts_and_silent_workers_are_forgotten_with_their_series() {
    let (_g, control) = gateway(&[
        "--advertise-allow",
        "10.0.0.0/8",
        "--dead-after",
        "1s",
        "--stale-after",
        "1s",
        "--forget-after",
        "2s",
        "--probe-interval",
        "200ms",
    ]);
    let r = send_report(&control, forged("far", "http://10.1.2.3:8000", 1), Some("test-secret")).await;
    assert_eq!(r.status, 204, "{}", r.body);
    let r = send_report(&control, forged("near", "http://127.0.0.1:9", 1), Some("test-secret")).await;
    assert_eq!(r.status, 403, "with an allowlist the source address alone is not enough: {}", r.body);
    let m = get(&format!("{control}/metrics")).await.body;
    assert!(m.contains("kvgate_gateway_worker_healthy{worker=\"far\"} 1"), "{m}");
    // Silent for forget_after: gone, and so are its series.
    wait_until(Duration::from_secs(6), || async { worker_state(&control, "far").await.is_none() }).await;
    let m = get(&format!("{control}/metrics")).await.body;
    assert!(!m.contains("worker=\"far\""), "{m}");
}

#[tokio::test]
async fn insecure_reports_is_an_explicit_choice() {
    let (port, cport) = (free_port(), free_port());
    let mut cmd = Command::new(bin("kvgate-gateway"));
    cmd.args([
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--control-listen",
        &format!("127.0.0.1:{cport}"),
        "--insecure-reports",
    ])
    .env_remove("KVGATE_REPORT_SECRET");
    let g = start(cmd, "listening on").on_port(port);
    let control = format!("http://127.0.0.1:{cport}");
    let r = send_report(&control, forged("open", "http://127.0.0.1:9", 1), None).await;
    assert_eq!(r.status, 204, "{}", r.body);
    drop(g);
}

#[tokio::test]
async fn a_workers_tokenizer_is_fetched_within_a_byte_limit() {
    // A "worker" serving a real worker's tokenizer padded with 4 MiB: taken under the default limit (64 MiB),
    // refused under a 64 KiB one.
    let dir = tempfile::tempdir().expect("tmp");
    let w = worker("w", &dir.path().join("tiny"), None, &[]);
    let mut tok = get(&format!("{}/kvgate/v1/tokenizer", w.base)).await.json();
    tok["junk"] = serde_json::Value::String("x".repeat(4 << 20));
    let padded = tok.to_string();
    let app =
        axum::Router::new().route("/kvgate/v1/tokenizer", axum::routing::get(move || async move { padded }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    let url = format!("http://{addr}");
    let (_small, small_control) = gateway(&["--worker", &url, "--max-tokenizer-bytes", "65536"]);
    let (_big, big_control) = gateway(&["--worker", &url]);
    wait_until(Duration::from_secs(10), || async {
        get(&format!("{big_control}/kvgate/v1/workers")).await.json()[0]["model"] == MODEL
    })
    .await;
    let ws = get(&format!("{small_control}/kvgate/v1/workers")).await.json();
    assert_eq!(ws[0]["model"], serde_json::Value::Null, "the oversized tokenizer was refused: {ws}");
}
