use kvgate_router::split::{rules, split_policy_by_name, CostModel, DEFAULT_SLO};
use kvgate_worker::engine::timing::SimProfile;

use super::*;

fn cfg(bandwidth_gbps: f64, groups: u32) -> PdConfig {
    let profile = SimProfile::named_or_file("gpu-h200-llama3-8b-measured").expect("profile");
    PdConfig {
        workers: 2,
        prefill_workers: 1,
        timing: profile.timing,
        max_batched_tokens: 2048,
        max_seqs: 256,
        cache_blocks: 4096,
        kv_bytes_per_token: 131_072.0,
        bandwidth_bytes_per_s: bandwidth_gbps * 1e9 / 8.0,
        export_groups: groups,
        slo: DEFAULT_SLO,
        report_interval_s: 1.0,
        knowledge: Knowledge::Oracle,
        bandwidth_prior_bytes_per_s: 10e9 / 8.0,
        configured_output: 256,
    }
}

fn lone(prompt: usize, output: usize) -> Vec<PdRequest> {
    vec![PdRequest {
        arrival_s: 0.0,
        prompt,
        output,
        blocks: super::worker::block_keys(&[1, 2, 3, 4]),
        max_tokens: Some(output),
    }]
}

#[test]
fn a_lone_local_request_takes_the_timing_models_steps() {
    let c = cfg(100.0, 1);
    let r = replay(&lone(2048, 3), &c, &rules::Aggregated, true);
    let t = &c.timing;
    let prefill = t.prefill(0, 2048);
    let decode = t.decode(1, 2049) + t.decode(1, 2050);
    assert!((r.ttft_p50_s - prefill).abs() < 1e-9, "{r:?}");
    assert!((r.makespan_s - prefill - decode).abs() < 1e-9, "{r:?}");
    assert_eq!(r.split_share, 0.0);
}

#[test]
fn a_split_adds_the_exposed_transfer_and_ds_first_step() {
    let c = cfg(25.0, 1);
    let r = replay(&lone(2048, 2), &c, &rules::Always, false);
    let t = &c.timing;
    let transfer = 2048.0 * 131_072.0 / c.bandwidth_bytes_per_s;
    let want = t.prefill(0, 2048) + transfer + t.decode(1, 2048);
    assert!((r.ttft_p50_s - want).abs() < 1e-9, "{} vs {want}", r.ttft_p50_s);
    assert_eq!(r.split_share, 1.0);
    // With 8 layer groups over a 2,048-token prefill, only what the link cannot keep up with shows.
    let g = replay(&lone(2048, 2), &cfg(25.0, 8), &rules::Always, false);
    assert!(g.ttft_p50_s < r.ttft_p50_s);
    assert!(g.ttft_p50_s >= t.prefill(0, 2048) + transfer / 8.0 - 1e-9);
}

#[test]
fn splitting_decode_heavy_traffic_keeps_tpot_under_the_slo() {
    let c = PdConfig { workers: 4, prefill_workers: 1, ..cfg(100.0, 8) };
    let rate = rate_for_load(&c.timing, 4, 4096, 512, 0.6);
    let reqs = shape_workload(300, 4096, 512, rate, 7);
    let agg = replay(&reqs, &c, &rules::Aggregated, true);
    let split = replay(&reqs, &c, &rules::Always, false);
    let cost = replay(&reqs, &c, &CostModel, true);
    assert!(split.tpot_p99_s < agg.tpot_p99_s, "{agg:?}\n{split:?}");
    // On a fleet of `both` workers the cost model splits only what local serving would miss the SLOs for.
    assert!(cost.goodput_tokens_per_s >= 0.99 * agg.goodput_tokens_per_s, "{agg:?}\n{cost:?}");
    for r in [&agg, &split, &cost] {
        assert_eq!((r.requests, r.finished), (300, 300));
        assert!(r.makespan_s.is_finite() && r.makespan_s > 0.0);
    }
}

#[test]
fn every_policy_finishes_every_request_and_a_workload_is_seeded() {
    let a = shape_workload(50, 512, 64, 5.0, 1);
    assert_eq!(
        a.iter().map(|r| r.arrival_s).collect::<Vec<_>>(),
        shape_workload(50, 512, 64, 5.0, 1).iter().map(|r| r.arrival_s).collect::<Vec<_>>()
    );
    let c = PdConfig { workers: 3, ..cfg(25.0, 8) };
    for name in kvgate_router::split::SPLIT_POLICIES {
        let p = split_policy_by_name(name).expect(name);
        let r = replay(&a, &c, p.as_ref(), name == "aggregated");
        assert_eq!(r.finished, 50, "{name}: {r:?}");
        assert!(r.slo_met_share > 0.0, "{name}: {r:?}");
        assert!(r.ttft_p99_s.is_finite(), "{name}: {r:?}");
    }
}

#[test]
fn the_gateways_knowledge_is_a_prediction_and_its_error_is_measured() {
    let c = PdConfig { workers: 4, prefill_workers: 1, ..cfg(100.0, 8) };
    let rate = rate_for_load(&c.timing, c.workers, 4096, 512, 0.8);
    let mut reqs = shape_workload(300, 4096, 512, rate, 3);
    with_max_tokens(&mut reqs, 3);
    let none = reqs.iter().filter(|r| r.max_tokens.is_none()).count();
    assert!((30..90).contains(&none), "about a fifth send no max_tokens: {none}");
    assert!(reqs.iter().filter_map(|r| r.max_tokens).all(|m| (1024..=5120).contains(&m)), "2-10x the output");
    let oracle = replay(&reqs, &c, &CostModel, false);
    let predicted =
        replay(&reqs, &PdConfig { knowledge: Knowledge::Predicted, ..c.clone() }, &CostModel, false);
    assert_eq!((oracle.finished, predicted.finished), (300, 300));
    assert_eq!(oracle.output_error_p50, 0.0, "the oracle prices the true output");
    // Every output is 512: once 8 finished, the learned mean is exact; before, max_tokens (2-10x) or the configured
    // 256 priced them.
    assert!(predicted.output_error_p50 < 0.01, "{}", predicted.output_error_p50);
    assert!(predicted.ttft_error_p50_s.is_finite() && predicted.tpot_error_p99_s.is_finite());
    assert!(predicted.ttft_error_p50_s > 0.0, "a prediction is never exact under load");
}
