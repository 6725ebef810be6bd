//! The simulator on hand-built traces: timing, cache reuse through reports, pacing and errors.

use kvgate_worker::engine::timing::{SimProfile, TimingModel};

use super::workload::request_work_s;
use super::*;

fn profile() -> SimProfile {
    SimProfile {
        name: "test".into(),
        source: "test".into(),
        max_model_len: 65_536,
        timing: TimingModel {
            prefill_base_s: 0.01,
            prefill_per_token_s: 1e-5,
            prefill_attention_s: 1e-9,
            decode_base_s: 0.005,
            decode_per_seq_s: 1e-4,
            decode_per_kv_token_s: 1e-8,
        },
    }
}

fn trace(rows: &[(u64, usize, usize, &[u64])]) -> Trace {
    crate::trace::from_rows(rows)
}

#[test]
fn a_lone_request_takes_exactly_the_timing_models_prefill() {
    let t = trace(&[(0, 5000, 3, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10])]);
    let cfg = SimConfig::new(2, 65_536, profile());
    let prep = prepare(&t, &cfg, Pace::TimeScale(1.0)).expect("prepare");
    let r = simulate(&t, &cfg, &prep, "round_robin").expect("runs");
    assert_eq!((r.completed, r.rejected), (1, 0));
    // 5000 tokens in chunks of 2048: three prefill steps; the last one samples the first token.
    let want = request_work_s(&cfg.profile.timing, 2048, 5000, 0, 0);
    assert!((r.ttft_p50_ms / 1000.0 - want).abs() < 1e-9, "{} vs {want}", r.ttft_p50_ms);
    assert_eq!(r.hit_rate, 0.0);
}

#[test]
fn a_follow_up_turn_finds_its_prefix_through_the_reports() {
    // Turn 2 arrives 10 s later (overlay expired, so only the Bloom summaries can say where turn 1 is).
    let t = trace(&[(0, 2000, 2, &[1, 2, 3, 4]), (10_000, 3000, 2, &[1, 2, 3, 4, 5, 6])]);
    let cfg = SimConfig::new(4, 65_536, profile());
    let prep = prepare(&t, &cfg, Pace::TimeScale(1.0)).expect("prepare");
    assert!((prep.oracle.hit_rate - 2000.0 / 5000.0).abs() < 1e-9, "{}", prep.oracle.hit_rate);
    let ca = simulate(&t, &cfg, &prep, "cache_aware").expect("runs");
    assert_eq!(ca.completed, 2);
    // All of turn 1's 2000 tokens (125 worker blocks; id 4 expands to the same tokens in both) come from cache.
    assert!((ca.hit_rate - 2000.0 / 5000.0).abs() < 1e-9, "{}", ca.hit_rate);
    assert_eq!(ca.routes.get("prefix"), Some(&1));
    let rr = simulate(&t, &cfg, &prep, "round_robin").expect("runs");
    assert_eq!(rr.hit_rate, 0.0, "round robin sends turn 2 to another worker");
}

#[test]
fn target_load_scales_arrivals_and_oversized_requests_are_refused() {
    let t = trace(&[(0, 1000, 1, &[1, 2]), (1000, 1000, 1, &[3, 4]), (2000, 100_000, 1, &[5; 196])]);
    let cfg = SimConfig::new(2, 65_536, profile());
    let prep = prepare(&t, &cfg, Pace::TargetLoad(0.5)).expect("prepare");
    assert!((prep.offered_load - 0.5).abs() < 1e-9);
    let work: f64 = [(1000, 1), (1000, 1), (100_000, 1)]
        .iter()
        .map(|(n, o)| request_work_s(&cfg.profile.timing, 2048, *n, 0, *o))
        .sum();
    assert!((prep.time_scale - work / (2.0 * 2.0 * 0.5)).abs() < 1e-9);
    let r = simulate(&t, &cfg, &prep, "least_load").expect("runs");
    // The 100K-token prompt is longer than the profile's max_model_len: refused, counted, not lost.
    assert_eq!((r.completed, r.rejected), (2, 1));
    assert!(prepare(&t, &cfg, Pace::TargetLoad(0.0)).is_err());
    assert!(prepare(&t, &cfg, Pace::TimeScale(f64::NAN)).is_err());
    assert!(simulate(&t, &cfg, &prep, "fastest").expect_err("unknown").contains("cache_aware"));
    let bad = SimConfig::new(0, 8, profile());
    let err = prepare(&t, &bad, Pace::TimeScale(1.0)).expect_err("invalid");
    assert!(err.contains("workers") && err.contains("kv-tokens-per-worker"), "{err}");
}
