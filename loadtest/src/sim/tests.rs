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
            host_load_s_per_byte: 0.0,
            disk_load_s_per_byte: 0.0,
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
fn the_measured_guard_s_predictions_are_scored_against_the_ttft_it_got() {
    let t = trace(&[(0, 2000, 2, &[1, 2, 3, 4]), (10_000, 3000, 2, &[1, 2, 3, 4, 5, 6])]);
    let cfg = SimConfig::new(4, 65_536, profile());
    let prep = prepare(&t, &cfg, Pace::TimeScale(1.0)).expect("prepare");
    // Turn 1 arrives before any report: no speed is measured, so no TTFT in seconds is predicted; turn 2's is.
    let m = simulate(&t, &cfg, &prep, "cache_aware_measured").expect("runs");
    let e = m.ttft_prediction.expect("turn 2 was predicted");
    assert_eq!(e.requests, 1);
    assert!((e.mean_abs_ms - e.bias_ms.abs()).abs() < 1e-9, "{e:?}");
    assert!(e.bias_ms.abs() < m.ttft_p99_ms, "a prediction in seconds, not in tokens: {e:?}");
    let ca = simulate(&t, &cfg, &prep, "cache_aware").expect("runs");
    assert!(ca.ttft_prediction.is_none(), "the thresholds guard predicts no seconds");
}

#[test]
fn prediction_error_figures() {
    // Predicted 1, 2, 3 s; actual 2, 3, 5: errors +1, +1, +2.
    let e = PredictionError::of(&[(1.0, 2.0), (2.0, 3.0), (3.0, 5.0)]).expect("pairs");
    assert_eq!(e.requests, 3);
    assert!((e.bias_ms - 4000.0 / 3.0).abs() < 1e-6 && (e.mean_abs_ms - 4000.0 / 3.0).abs() < 1e-6, "{e:?}");
    assert!((e.p90_abs_ms - 2000.0).abs() < 1e-9, "{e:?}");
    // Nearly linear (a perfectly linear relation would give exactly 1).
    assert!(e.correlation > 0.98 && e.correlation <= 1.0, "{e:?}");
    assert!(PredictionError::of(&[]).is_none());
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

/// A multi-turn trace whose every request starts with the same `shared` 512-token blocks (a system prompt):
/// `convs` conversations of `turns` turns, each turn one more 512-token block of the conversation's own.
fn shared_prefix_trace(shared: u64, convs: u64, turns: u64) -> Trace {
    let mut ids: Vec<Vec<u64>> = Vec::new();
    let mut rows_meta = Vec::new();
    for turn in 0..turns {
        for c in 0..convs {
            let mut h: Vec<u64> = (0..shared).collect();
            h.extend((0..=turn).map(|t| 1_000_000 + c * 1_000 + t));
            rows_meta.push((turn * convs + c) * 50);
            ids.push(h);
        }
    }
    let rows: Vec<(u64, usize, usize, &[u64])> =
        ids.iter().zip(&rows_meta).map(|(h, ts)| (*ts, h.len() * 512, 16, h.as_slice())).collect();
    trace(&rows)
}

#[test]
fn a_shared_system_prompt_does_not_collapse_the_ring() {
    // 512, 2K and 8K shared tokens; 8 workers with room for every distinct block; paced to 70% offered load.
    for shared in [1u64, 4, 16] {
        let t = shared_prefix_trace(shared, 256, 3);
        let kv = (t.distinct_blocks() * 512 / 8 * 2).next_multiple_of(16);
        let mut cfg =
            SimConfig::new(8, kv, SimProfile::named_or_file("gpu-h100-llama3-8b").expect("profile"));
        cfg.profile.max_model_len = 65_536;
        let prep = prepare(&t, &cfg, Pace::TargetLoad(0.7)).expect("prepare");
        let ch = simulate(&t, &cfg, &prep, "consistent_hash").expect("consistent_hash");
        assert_eq!((ch.completed, ch.rejected), (768, 0), "{ch:?}");
        eprintln!(
            "shared {shared}: consistent_hash max/mean {:.2} hit {:.3} oracle {:.3}; the cache-aware policies follow",
            ch.max_mean_load, ch.hit_rate, ch.oracle_hit_rate
        );
        assert!(ch.max_mean_load <= 1.3, "shared {shared}: consistent_hash max/mean {:.2}", ch.max_mean_load);
        // Turns of a conversation stay together: later turns hit their own history (the oracle's rate is the
        // best any placement gets).
        assert!(
            ch.hit_rate >= 0.9 * ch.oracle_hit_rate,
            "shared {shared}: hit rate {:.3} vs oracle {:.3}",
            ch.hit_rate,
            ch.oracle_hit_rate
        );
        for policy in [kvgate_router::routing::DEFAULT_POLICY, "cache_aware"] {
            let ca = simulate(&t, &cfg, &prep, policy).expect(policy);
            eprintln!(
                "shared {shared}: {policy} max/mean {:.2} hit {:.3} p99 {:.0} ms",
                ca.max_mean_load, ca.hit_rate, ca.ttft_p99_ms
            );
            assert!(ca.max_mean_load <= 1.3, "shared {shared}: {policy} max/mean {:.2}", ca.max_mean_load);
            assert!(ca.hit_rate >= 0.9 * ca.oracle_hit_rate, "shared {shared}: {policy} {ca:?}");
        }
    }
}

/// Steady short requests (1K tokens, one every 50 ms) and, every 10 s, a burst of `burst` long ones (48K tokens,
/// each its own document), for 60 s.
fn long_burst_trace(burst: u64) -> Trace {
    let mut rows: Vec<(u64, Vec<u64>)> = Vec::new();
    for i in 0..1200u64 {
        rows.push((i * 50, vec![10_000_000 + i * 2, 10_000_000 + i * 2 + 1]));
    }
    for b in 0..6u64 {
        for j in 0..burst {
            let doc = 20_000_000 + (b * burst + j) * 1_000;
            rows.push((b * 10_000 + 1_000 + j, (doc..doc + 94).collect()));
        }
    }
    rows.sort_by_key(|r| r.0);
    let rows: Vec<(u64, usize, usize, &[u64])> =
        rows.iter().map(|(ts, h)| (*ts, h.len() * 512, 16, h.as_slice())).collect();
    trace(&rows)
}

fn class(name: &str, max_prompt: Option<u64>, rate: f64, burst: f64) -> ClassConfig {
    ClassConfig {
        name: name.into(),
        rule: kvgate_router::admission::MatchRule { max_prompt_tokens: max_prompt, ..Default::default() },
        refill_tokens_per_s: rate,
        burst_tokens: burst,
        max_queued_requests: 1024,
        max_queued_tokens: 1e9,
        max_wait_ms: 60_000,
        expected_output_tokens: 16,
        borrow_idle: false,
        max_tenant_queues: 1024,
        slo: Default::default(),
    }
}

#[test]
fn class_budgets_keep_a_long_burst_from_starving_short_requests() {
    use kvgate_router::routing::DEFAULT_POLICY;
    let t = long_burst_trace(16);
    let mut cfg =
        SimConfig::new(4, 262_144, SimProfile::named_or_file("gpu-h100-llama3-8b").expect("profile"));
    cfg.profile.max_model_len = 65_536;
    let prep = prepare(&t, &cfg, Pace::TimeScale(1.0)).expect("prepare");
    assert!(simulate(&t, &cfg, &prep, DEFAULT_POLICY).expect("no admission").classes.is_empty());
    // The same two classes, first with budgets nothing exceeds (figures per class, no gating), then with a
    // long-class budget of 60K tokens/s.
    cfg.classes = vec![class("short", Some(8192), 1e9, 1e9), class("long", None, 1e9, 1e9)];
    let open = simulate(&t, &cfg, &prep, DEFAULT_POLICY).expect("open");
    cfg.classes = vec![class("short", Some(8192), 1e6, 1e6), class("long", None, 60_000.0, 100_000.0)];
    let gated = simulate(&t, &cfg, &prep, DEFAULT_POLICY).expect("gated");
    let (short0, long0) = (&open.classes["short"], &open.classes["long"]);
    let (short, long) = (&gated.classes["short"], &gated.classes["long"]);
    eprintln!("open: short {short0:?}, long {long0:?}\ngated: short {short:?}, long {long:?}");
    for r in [&open, &gated] {
        assert_eq!((r.completed, r.rejected), (1296, 0), "{r:?}");
        assert_eq!((r.classes["short"].completed, r.classes["long"].completed), (1200, 96));
    }
    assert!(long0.wait_p99_ms < 1.0 && short0.wait_p99_ms < 1.0, "open budgets never make anyone wait");
    assert!(long.wait_p99_ms > 1000.0, "the long class waited for its budget: {long:?}");
    assert!(short.wait_p99_ms < 1.0, "short requests never wait: {short:?}");
    // The burst, spread over time by its budget, no longer stalls the short requests behind it.
    assert!(
        short.ttft_p99_ms < 0.5 * short0.ttft_p99_ms,
        "short p99 {:.0} ms with the long budget vs {:.0} ms without",
        short.ttft_p99_ms,
        short0.ttft_p99_ms
    );
}

#[test]
fn a_replica_knows_another_replicas_sends_only_when_they_are_shared() {
    // Turn 2 arrives 0.5 s after turn 1: no report since registration at t = 0, so only the sending replica's
    // overlay knows where turn 1 went. Request i goes to replica i mod n: with two replicas, turn 2 reaches the
    // replica that did not send turn 1.
    let t = trace(&[(0, 2000, 2, &[1, 2, 3, 4]), (500, 3000, 2, &[1, 2, 3, 4, 5, 6])]);
    let prefix_routes = |replicas: usize, share: bool| {
        let mut cfg = SimConfig::new(4, 65_536, profile());
        cfg.gateway_replicas = replicas;
        cfg.share_sends = share;
        let prep = prepare(&t, &cfg, Pace::TimeScale(1.0)).expect("prepare");
        let r = simulate(&t, &cfg, &prep, "cache_aware").expect("runs");
        assert_eq!((r.completed, r.rejected), (2, 0));
        r.routes.get("prefix").copied().unwrap_or(0)
    };
    assert_eq!(prefix_routes(1, false), 1, "one replica: its overlay routes turn 2 to turn 1's worker");
    assert_eq!(prefix_routes(2, false), 0, "the other replica has not heard of turn 1");
    assert_eq!(prefix_routes(2, true), 1, "with sends shared it has");
    let mut bad = SimConfig::new(4, 65_536, profile());
    bad.gateway_replicas = 0;
    assert!(bad.validate().iter().any(|p| p.contains("gateway-replicas")));
}

#[test]
fn workers_of_different_kv_sizes_keep_the_fleets_total() {
    let profile = SimProfile::named_or_file("gpu-h100-llama3-8b").expect("profile");
    let mut cfg = SimConfig::new(8, 100_000, profile);
    cfg.kv_spread = 0.5;
    let sizes: Vec<usize> = (0..8).map(|i| cfg.kv_tokens_of(i)).collect();
    assert_eq!((sizes[0], sizes[7]), (50_000, 150_000), "{sizes:?}");
    assert!(sizes.windows(2).all(|w| w[0] < w[1]) && sizes.iter().all(|s| s % 16 == 0), "{sizes:?}");
    let total: usize = sizes.iter().sum();
    assert!(total.abs_diff(800_000) <= 8 * 16, "{total}");
    cfg.kv_spread = 1.0;
    assert!(cfg.validate().iter().any(|p| p.contains("kv-spread")), "a worker of no KV is refused");
}

#[test]
fn workers_of_different_speeds_keep_the_fleets_total_speed() {
    let profile = SimProfile::named_or_file("gpu-h100-llama3-8b").expect("profile");
    let t = profile.timing;
    let mut cfg = SimConfig::new(5, 100_000, profile);
    assert_eq!(cfg.timing_of(3), t, "no spread: the profile's");
    cfg.speed_spread = 0.5;
    // Speeds 0.5, 0.75, 1, 1.25, 1.5 x the profile's: compute terms divided by them, load costs kept.
    let speeds: Vec<f64> =
        (0..5).map(|i| t.prefill_per_token_s / cfg.timing_of(i).prefill_per_token_s).collect();
    assert!(speeds.iter().zip([0.5, 0.75, 1.0, 1.25, 1.5]).all(|(s, e)| (s - e).abs() < 1e-12), "{speeds:?}");
    let slow = cfg.timing_of(0);
    assert!((slow.decode_per_kv_token_s - 2.0 * t.decode_per_kv_token_s).abs() < 1e-18);
    assert_eq!(
        (slow.host_load_s_per_byte, slow.disk_load_s_per_byte),
        (t.host_load_s_per_byte, t.disk_load_s_per_byte)
    );
    cfg.speed_spread = 1.0;
    assert!(cfg.validate().iter().any(|p| p.contains("speed-spread")), "a worker of no speed is refused");
}

/// A trace whose rows name their adapter: (arrival ms, input length, hash ids, adapter).
fn adapter_trace(rows: &[(u64, usize, &[u64], &str)]) -> Trace {
    let text: String = rows
        .iter()
        .map(|(ts, len, ids, lora)| {
            format!(
                r#"{{"timestamp": {ts}, "input_length": {len}, "output_length": 2, "hash_ids": {ids:?}, "lora": "{lora}"}}"#
            ) + "\n"
        })
        .collect();
    Trace::parse(&text).expect("trace")
}

fn with_adapters(cfg: &SimConfig, rule: adapters::Rule, slots: usize, load_s: f64) -> SimConfig {
    let a = adapters::AdapterSim { rule, slots, load_s, assign: None };
    SimConfig { adapters: Some(a), ..cfg.clone() }
}

#[test]
fn two_adapters_on_one_prompt_never_share_a_block_and_an_adapter_finds_its_own() {
    // The same prompt for adapters a, b, then a again (10 s later: through the reports).
    let t = adapter_trace(&[
        (0, 2000, &[1, 2, 3, 4], "a"),
        (5000, 2000, &[1, 2, 3, 4], "b"),
        (10_000, 3000, &[1, 2, 3, 4, 5, 6], "a"),
    ]);
    let base = SimConfig::new(1, 65_536, profile());
    let cfg = with_adapters(&base, adapters::Rule::Cost, 4, 0.25);
    let prep = prepare(&t, &cfg, Pace::TimeScale(1.0)).expect("prepare");
    let r = simulate(&t, &cfg, &prep, "cache_aware").expect("runs");
    assert_eq!(r.completed, 3);
    // One worker: b's request finds nothing of a's; a's second finds all of its first (2000 of 7000 tokens).
    assert!((r.hit_rate - 2000.0 / 7000.0).abs() < 1e-9, "{}", r.hit_rate);
    assert_eq!((r.adapter_loads, r.adapter_evictions), (2, 0), "a and b once each");
    assert_eq!(r.adapter_placement.as_deref(), Some("cost"));
    // A lone request of a cold adapter waits for its load: the load is in its TTFT.
    let lone = adapter_trace(&[(0, 5000, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a")]);
    let prep = prepare(&lone, &cfg, Pace::TimeScale(1.0)).expect("prepare");
    let r = simulate(&lone, &cfg, &prep, "cache_aware").expect("runs");
    let want = 0.25 + request_work_s(&cfg.profile.timing, 2048, 5000, 0, 0);
    assert!((r.ttft_p50_ms / 1000.0 - want).abs() < 1e-9, "{} vs {want}", r.ttft_p50_ms);
}

#[test]
fn the_gateways_placement_keeps_an_adapter_on_its_holder_where_blind_rules_load_it_again() {
    // Three adapters asked in turn, 1 s apart, on 4 workers of 2 slots (round robin puts each on every worker);
    // every request is short, so the fleet is idle and loads dominate.
    let mut rows: Vec<(u64, usize, Vec<u64>, String)> = Vec::new();
    for i in 0..24u64 {
        let k = i % 3;
        rows.push((i * 1000, 600, vec![100 * k + 1, 1000 + i], format!("lora-{k}")));
    }
    let rows: Vec<(u64, usize, &[u64], &str)> =
        rows.iter().map(|(t, l, ids, a)| (*t, *l, ids.as_slice(), a.as_str())).collect();
    let t = adapter_trace(&rows);
    let base = SimConfig::new(4, 65_536, profile());
    let loads = |rule| {
        let cfg = with_adapters(&base, rule, 2, 0.5);
        let prep = prepare(&t, &cfg, Pace::TimeScale(1.0)).expect("prepare");
        let r = simulate(&t, &cfg, &prep, "round_robin").expect("runs");
        assert_eq!(r.completed, 24, "{rule:?}");
        r.adapter_loads
    };
    assert_eq!(loads(adapters::Rule::Cost), 3, "each adapter loaded once, then its holder serves it");
    assert!(loads(adapters::Rule::Anywhere) >= 12, "round robin ignores where the adapters are");
    assert_eq!(loads(adapters::Rule::RandomHolder), 3, "a holder whenever there is one");
}
