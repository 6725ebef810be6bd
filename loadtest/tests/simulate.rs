//! The simulator on real traffic: a shortened replay of the Mooncake trace (a regression test for routing
//! quality), and the `kvgate-loadtest simulate` command line.

use std::path::PathBuf;
use std::process::Command;

use kvgate_loadtest::sim::{prepare, simulate, Pace, SimConfig};
use kvgate_loadtest::trace::{Trace, TRACE_BLOCK_TOKENS};
use kvgate_router::routing::DEFAULT_POLICY;
use kvgate_worker::engine::timing::SimProfile;

fn trace_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("traces/mooncake-synthetic.jsonl")
}

/// The default policy and the token-threshold baseline must each keep at least this multiple of round_robin's hit
/// rate on the shortened replay (cache_aware measured 5.2x when this test was written; see
/// docs/benchmarks/routing.md for the full trace).
const MIN_HIT_FACTOR_OVER_ROUND_ROBIN: f64 = 3.0;

#[test]
fn cache_aware_keeps_its_lead_on_a_shortened_mooncake_replay() {
    let mut trace = Trace::load(&trace_path()).expect("trace");
    assert_eq!(trace.requests.len(), 3993);
    // 600 requests from the trace's busy, reuse-heavy second half; 4 workers whose KV holds a quarter of the
    // window's distinct blocks; arrivals paced to 70% offered load.
    trace.window(3000, Some(600));
    let workers = 4;
    let kv = (trace.distinct_blocks() * TRACE_BLOCK_TOKENS / 4 / workers).next_multiple_of(16);
    let profile = SimProfile::named_or_file("gpu-h100-llama3-8b").expect("profile");
    let cfg = SimConfig::new(workers, kv, profile);
    let prep = prepare(&trace, &cfg, Pace::TargetLoad(0.7)).expect("prepare");
    let rr = simulate(&trace, &cfg, &prep, "round_robin").expect("round_robin");
    assert_eq!((rr.completed, rr.rejected), (600, 0), "{rr:?}");
    for policy in [DEFAULT_POLICY, "cache_aware"] {
        let ca = simulate(&trace, &cfg, &prep, policy).expect(policy);
        assert_eq!((ca.completed, ca.rejected), (600, 0), "{policy}: {ca:?}");
        assert!(
            ca.hit_rate >= MIN_HIT_FACTOR_OVER_ROUND_ROBIN * rr.hit_rate,
            "{policy} hit rate {:.3} is under {MIN_HIT_FACTOR_OVER_ROUND_ROBIN}x round_robin's {:.3}",
            ca.hit_rate,
            rr.hit_rate
        );
        assert!(
            ca.hit_rate >= 0.8 * ca.oracle_hit_rate,
            "{policy}: {:.3} vs oracle {:.3}",
            ca.hit_rate,
            ca.oracle_hit_rate
        );
        assert!(
            ca.ttft_p99_ms < rr.ttft_p99_ms,
            "{policy}: p99 TTFT {} vs round_robin {}",
            ca.ttft_p99_ms,
            rr.ttft_p99_ms
        );
        assert!(ca.max_mean_load <= 1.5, "{policy}: max/mean load {}", ca.max_mean_load);
    }
}

fn loadtest(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate-loadtest")).args(args).output().expect("runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_command_prints_one_json_object_per_policy_and_refuses_bad_input() {
    let trace = trace_path();
    let trace = trace.to_str().expect("utf-8 path");
    let (ok, stdout, stderr) = loadtest(&[
        "simulate",
        "--trace",
        trace,
        "--limit",
        "60",
        "--workers",
        "3",
        "--policy",
        "all",
        "--time-scale",
        "0.5",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let rows: Vec<serde_json::Value> =
        stdout.lines().map(|l| serde_json::from_str(l).expect("one JSON object a line")).collect();
    let policies: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().expect("policy")).collect();
    assert_eq!(
        policies,
        ["cache_aware", "cache_aware_measured", "goodput", "round_robin", "least_load", "consistent_hash"]
    );
    for r in &rows {
        for field in [
            "requests",
            "hit_rate",
            "oracle_hit_rate",
            "ttft_p50_ms",
            "tpot_p50_ms",
            "goodput_tokens_per_s",
            "ttft_p99_ms",
            "max_mean_load",
            "offered_load",
        ] {
            assert!(r[field].is_number(), "{field} missing in {r}");
        }
        assert_eq!(r["requests"], 60);
        assert_eq!(r["time_scale"], 0.5);
    }
    // The human table.
    let (ok, stdout, _) =
        loadtest(&["simulate", "--trace", trace, "--limit", "20", "--policy", "least_load"]);
    assert!(ok && stdout.contains("least_load") && stdout.contains("oracle hit rate"), "{stdout}");
    // Bad input: a clear message and a failing exit status.
    let dir = tempfile::tempdir().expect("tmp");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 900, \"output_length\": 1, \"hash_ids\": [1]}\n",
    )
    .expect("write");
    let bad = bad.to_str().expect("path");
    let cases: [(&[&str], &str); 5] = [
        (&["simulate", "--trace", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
        (&["simulate", "--trace", bad], "line 1: input_length 900 needs 2 hash_ids"),
        (&["simulate", "--trace", trace, "--policy", "fastest"], "unknown policy \"fastest\""),
        (&["simulate", "--trace", trace, "--weight", "w_typo=1"], "w_typo"),
        (&["simulate", "--trace", trace, "--time-scale", "1", "--target-load", "0.5"], "cannot be used with"),
    ];
    for (args, want) in cases {
        let (ok, _, stderr) = loadtest(args);
        assert!(!ok, "{args:?} should fail");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}
