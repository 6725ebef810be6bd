//! The cost model deciding through real processes (#43): a prefill worker with a KV transfer listener and a decode
//! worker (the tiny model on the real CPU engine), the default split policy, and the three situations an operator
//! must be able to trust: where it must split, where it must not, and where the prefill worker stops answering
//! (it must stop splitting, and split again once it is back). Each asserts the decision and its reason as
//! `route/explain` gives them, the request's route, and the prediction-error metric of the requests it served.
//!
//! The SLOs are generous (TTFT 1,000 s, TPOT 10 s), so both options meet them whatever this machine's speed and
//! the choice turns on slack alone, which the formula fixes: a prompt computed on the decode worker stalls the
//! streams running there (`others_tpot` above their TPOT) by its compute over its output, a far larger share of
//! the TPOT target than its TTFT is of the TTFT target; one computed on a dedicated prefill worker stalls none, so
//! with streams on the decode worker the split leaves more slack (`more_slack`). A prompt the decode worker holds
//! costs it next to nothing locally, while a split computes it all on the prefill worker: it stays (`both_meet`).

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const ADMIN: (&str, &str) = ("authorization", "Bearer test-admin");

fn gateway_with_slos() -> (Proc, String) {
    gateway(&[
        "--admin-token",
        "test-admin",
        "--split-slo-ttft",
        "1000s",
        "--split-slo-tpot",
        "10s",
        "--stale-after",
        "1s",
        "--dead-after",
        "30s",
    ])
}

/// A prompt of `n` tokens (distinct per `seed`) asking for `max_tokens`.
fn body(n: u32, seed: u32, max_tokens: u32, stream: bool) -> Value {
    let prompt: Vec<u32> = (0..n).map(|i| (i * 37 + seed * 101 + 11) % 500 + 1).collect();
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
           "stream": stream})
}

async fn explain(control: &str, b: &Value) -> Value {
    let e = post(&format!("{control}/admin/v1/route/explain"), b, &[ADMIN]).await;
    assert_eq!(e.status, 200, "{}", e.body);
    e.json()
}

/// The decision explain shows: (choice, reason), or None when no split was considered.
fn decision(e: &Value) -> Option<(String, String)> {
    let d = &e["split"]["decision"];
    Some((d["choice"].as_str()?.to_owned(), d["reason"].as_str()?.to_owned()))
}

#[tokio::test]
async fn the_cost_model_splits_where_it_must_keeps_local_where_it_must_and_stops_when_the_prefill_worker_does(
) {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway_with_slos();
    let p = worker("p0", &synth, Some(&control), &["--role", "prefill", "--kv-transfer-port", "0"]);
    let d = worker("d0", &synth, Some(&control), &["--role", "decode", "--kv-cache-tokens", "32768"]);
    wait_healthy(&control, 2).await;
    // Both report their step timings once they have run something (the cost model's measured speeds).
    for (w, seed) in [(&p, 1), (&d, 2)] {
        let r = post(&format!("{}/v1/completions", w.base), &body(512, seed, 4, false), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // Each reports its fit of what its prefill costs (seconds per token, per unit of attention area; measured at
    // start, then on its prompts), which the admin API shows with its token rate (once it has computed one).
    for id in ["p0", "d0"] {
        let w = wait_worker(&control, id, Duration::from_secs(10), |w| {
            w["speed"]["prefill_tokens_per_s"].as_f64() > Some(0.0)
        })
        .await;
        let s = &w["speed"];
        let fitted =
            s["prefill_per_token_s"].as_f64() > Some(0.0) || s["prefill_attention_s"].as_f64() > Some(0.0);
        assert!(fitted && s["prefill_attention_s"].as_f64() >= Some(0.0), "{w}");
    }

    // 1. A follow-up whose prompt the decode worker holds (it answered the same prompt before): local costs it
    //    next to nothing, a split would compute the whole prompt on the prefill worker. It must stay local.
    let q = body(1500, 3, 8, false);
    let first = post(&format!("{}/v1/completions", d.base), &q, &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let e = wait_explained(&control, &q, |e| {
        e["split"]["decode_worker"] == "d0" && e["predicted_cached_tokens"].as_u64() > Some(1400)
    })
    .await;
    assert_eq!(decision(&e), Some(("local".into(), "both_meet".into())), "{e}");
    let terms = &e["split"]["decision"]["terms"];
    assert!(terms["split"]["ttft_s"].as_f64() > terms["local"]["ttft_s"].as_f64(), "{e}");
    assert!(terms["local"]["slack"].as_f64() >= terms["split"]["slack"].as_f64(), "{e}");
    let r = post(&format!("{}/v1/completions", g.base), &q, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_ne!(r.header("x-kvgate-route"), "split");
    assert_eq!(r.header("x-kvgate-worker"), "d0");
    assert!(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(1400), "{}", r.body);

    // 2. Streams decoding on the decode worker: a prompt computed there would stall every one of them; on the
    //    dedicated prefill worker, none. It must split, for more slack.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let streams: Vec<_> = (10..13u32)
        .map(|seed| {
            let (url, stop) = (format!("{}/v1/completions", d.base), stop.clone());
            // Three streams on the decode worker for the rest of the test: each starts again when it ends.
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = post(&url, &body(64, seed, 2000, true), &[]).await;
                    assert_eq!(r.status, 200, "{}", r.body);
                }
            })
        })
        .collect();
    wait_worker(&control, "d0", Duration::from_secs(10), |w| w["load"]["requests"].as_u64() >= Some(3)).await;
    let q = body(1500, 4, 8, true);
    let e = wait_explained(&control, &q, |e| decision(e).is_some_and(|d| d.0 == "split")).await;
    assert_eq!(decision(&e), Some(("split".into(), "more_slack".into())), "{e}");
    let terms = &e["split"]["decision"]["terms"];
    assert!(terms["local"]["others_tpot_s"].as_f64() > terms["local"]["tpot_s"].as_f64(), "{e}");
    assert_eq!(terms["split"]["others_tpot_s"], 0.0, "{e}");
    assert!(terms["split"]["slack"].as_f64() > terms["local"]["slack"].as_f64(), "{e}");
    assert_eq!(
        e["split"]["input"]["expected_output"], 8,
        "priced with max_tokens until the class has learned"
    );
    let r = post(&format!("{}/v1/completions", g.base), &q, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvgate-route"), "split");
    assert_eq!(r.header("x-kvgate-worker"), "d0");
    assert!(r.body.contains("[DONE]"), "{}", r.body);
    // The prediction of the split it served is compared with what the gateway saw.
    let gm = get(&format!("{control}/metrics")).await.body;
    let count = |term: &str| {
        metric(&gm, &format!("kvgate_gateway_split_prediction_error_seconds_count{{term=\"{term}\"}}"))
            .unwrap_or(0.0)
    };
    assert!(count("ttft") >= 1.0 && count("tpot") >= 1.0, "{gm}");

    // 3. The prefill worker stops answering (SIGSTOP): once its reports are stale it is no candidate, and the
    //    requests are served whole on the decode worker; after SIGCONT it splits again.
    signal(&p, libc::SIGSTOP);
    let e = wait_explained(&control, &q, |e| e["split"].is_null()).await;
    assert_eq!(e["prefill"], Value::Null, "{e}");
    assert_eq!(e["pick"], "d0", "{e}");
    let r = post(&format!("{}/v1/completions", g.base), &body(1500, 5, 8, false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_ne!(r.header("x-kvgate-route"), "split");
    signal(&p, libc::SIGCONT);
    // A prompt no worker holds (the decode worker imported the last one).
    let q = body(1500, 6, 8, true);
    let e = wait_explained(&control, &q, |e| decision(e).is_some_and(|d| d.0 == "split")).await;
    assert_eq!(decision(&e), Some(("split".into(), "more_slack".into())), "{e}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for s in streams {
        s.await.expect("a background stream failed");
    }
}

/// Explains `b` until `cond` holds (reports arrive every 200 ms; panics after 15 s with the last answer).
async fn wait_explained(control: &str, b: &Value, cond: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let e = explain(control, b).await;
        if cond(&e) {
            return e;
        }
        assert!(std::time::Instant::now() < deadline, "explain never showed it: {e}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
