//! Traces (#30): a request through the gateway to a real worker, both exporting to a real OTLP receiver
//! (`scripts/otlp_receiver.py`: OpenTelemetry's own protobuf messages decode what arrives). The client's
//! `traceparent` is the root's parent, every span of the request is in its trace, linked gateway -> forward ->
//! worker, with the worker and the route as attributes; a request that says "not sampled" leaves no span.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

struct Receiver_ {
    child: Child,
    port: u16,
    spans: Receiver<Value>,
}

impl Drop for Receiver_ {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn receiver(py: std::ffi::OsString) -> Receiver_ {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/otlp_receiver.py");
    let mut child = Command::new(py)
        .arg(script)
        .args(["--seconds", "120"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("the receiver starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next().expect("a line").expect("read");
    let port = first.strip_prefix("listening ").and_then(|p| p.parse().ok()).expect("listening PORT");
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for l in lines.map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&l) {
                let _ = tx.send(v);
            }
        }
    });
    Receiver_ { child, port, spans: rx }
}

/// Every span the request should leave.
const NAMES: [&str; 10] = [
    "gateway.request",
    "prepare",
    "admit",
    "route",
    "forward",
    "first_byte",
    "worker.request",
    "queue",
    "prefill",
    "decode",
];

/// Spans of `trace` until every one of [`NAMES`] arrived (or `within` passed).
fn collect(r: &Receiver_, trace: &str, within: Duration) -> Vec<Value> {
    let deadline = Instant::now() + within;
    let mut out: Vec<Value> = Vec::new();
    while Instant::now() < deadline {
        if let Ok(s) = r.spans.recv_timeout(Duration::from_millis(100)) {
            if s["trace_id"] == trace {
                out.push(s);
            }
        }
        if NAMES.iter().all(|n| out.iter().any(|s| s["name"] == *n)) {
            break;
        }
    }
    out
}

#[tokio::test]
async fn a_request_leaves_one_linked_trace_across_the_gateway_and_the_worker() {
    let Some(py) = python("opentelemetry-proto") else { return };
    let r = receiver(py);
    let endpoint = format!("http://127.0.0.1:{}", r.port);
    let dir = tempfile::tempdir().expect("tmp");
    let (g, control) = gateway(&["--otlp-endpoint", &endpoint]);
    let _w = worker("w0", &dir.path().join("tiny"), Some(&control), &["--otlp-endpoint", &endpoint]);
    wait_healthy(&control, 1).await;

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4});
    let header = format!("00-{trace}-{client_span}-01");
    let resp = post(&format!("{}/v1/chat/completions", g.base), &body, &[("traceparent", &header)]).await;
    assert_eq!(resp.status, 200, "{}", resp.body);
    let spans = collect(&r, trace, Duration::from_secs(15));
    let find = |name: &str| {
        spans.iter().find(|s| s["name"] == name).unwrap_or_else(|| panic!("no {name}: {spans:#?}"))
    };

    let root = find("gateway.request");
    assert_eq!(root["parent"], client_span, "the client's span is the root's parent");
    assert_eq!((root["service"].as_str(), root["kind"].as_i64()), (Some("kvgate-gateway"), Some(2)));
    assert_eq!(root["attributes"]["http.response.status_code"], 200);
    for stage in ["prepare", "admit", "route", "forward"] {
        assert_eq!(find(stage)["parent"], root["span_id"], "{stage} under the root");
    }
    let fwd = find("forward");
    assert_eq!((fwd["attributes"]["kvgate.worker"].as_str(), fwd["kind"].as_i64()), (Some("w0"), Some(3)));
    assert!(fwd["attributes"]["kvgate.route"].is_string(), "{fwd}");
    assert_eq!(find("route")["attributes"]["kvgate.worker"], "w0");
    assert_eq!(find("first_byte")["parent"], fwd["span_id"]);

    let w = find("worker.request");
    assert_eq!(w["parent"], fwd["span_id"], "the worker's span hangs under the attempt that reached it");
    assert_eq!((w["service"].as_str(), w["instance"].as_str()), (Some("kvgate-worker"), Some("w0")));
    assert_eq!(w["attributes"]["kvgate.worker"], "w0");
    assert_eq!(w["attributes"]["gen_ai.usage.output_tokens"], 4);
    for stage in ["queue", "prefill", "decode"] {
        let s = find(stage);
        assert_eq!(s["parent"], w["span_id"], "{stage} under the worker's span");
        assert!(s["end"].as_u64() >= s["start"].as_u64());
    }
    // The worker's stages lie inside the gateway's root.
    let (r0, r1) = (root["start"].as_u64().expect("start"), root["end"].as_u64().expect("end"));
    assert!(w["start"].as_u64().expect("s") >= r0 && w["end"].as_u64().expect("e") <= r1 + 5_000_000);

    // Not sampled: nothing recorded, on either side.
    let quiet = "5bf92f3577b34da6a3ce929d0e0e4736";
    let header = format!("00-{quiet}-{client_span}-00");
    let resp = post(&format!("{}/v1/chat/completions", g.base), &body, &[("traceparent", &header)]).await;
    assert_eq!(resp.status, 200);
    assert!(collect(&r, quiet, Duration::from_secs(2)).is_empty());

    let m = get(&format!("{control}/metrics")).await.body;
    assert!(
        metric(&m, "kvgate_gateway_trace_spans_total{outcome=\"exported\"}").is_some_and(|n| n >= 6.0),
        "{m}"
    );
}
