//! Split routing on a registry fed real reports: pools by role, both tickets recorded, the policy's choice.

use std::time::Instant;

use kvgate_shared::hashing::{BlockHash, BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::report::{
    BlockBloom, CacheSummary, PdInfo, PeerImport, QueueStats, Role, StepTiming, Throughput, Tier, TierReport,
    WorkerReport,
};

use super::plan::{SplitAsk, SplitSettings};
use super::{rules, CostModel, SplitPolicy};
use crate::registry::{Registry, RegistryConfig};
use crate::route::{RouteInput, Router};
use crate::routing::{policy_by_name, Weights};

fn scheme() -> HashScheme {
    HashScheme::new(16, 1)
}

fn report(id: &str, role: Role, stall: f64, imports: Vec<PeerImport>) -> WorkerReport {
    // The `both` worker looks idle (the local pick); the others are busy.
    let (running, queued) = if role == Role::Both { (0, 0) } else { (8, 40_000) };
    WorkerReport {
        lora: Default::default(),
        pd: PdInfo {
            role,
            // The `both` worker of these tests cannot transfer (no listener, an engine that copies no KV).
            transfer_addr: if role == Role::Both { String::new() } else { format!("{id}:9100") },
            kv_bytes_per_token: if role == Role::Both { 0 } else { 131_072 },
            export_groups: 8,
            timing: StepTiming {
                prefill_tokens_per_s: 40_000.0,
                decode_step_s: 0.006,
                stall_ratio: stall,
                ..StepTiming::default()
            },
            imports,
        },
        worker_id: id.into(),
        advertise_url: format!("http://{id}:8000"),
        model_id: "m".into(),
        scheme: scheme(),
        fingerprint: scheme().fingerprint(),
        seq: 1,
        timestamp_ms: 0,
        instance_id: 1,
        max_model_len: 1 << 20,
        draining: false,
        queue: QueueStats {
            waiting_requests: 0,
            prefill_tokens: queued,
            running_requests: running,
            prefill_area: 0,
            prefilling_requests: 0,
        },
        throughput: Throughput::default(),
        tiers: vec![TierReport {
            tier: Tier::Device,
            blocks_total: 1000,
            blocks_free: 1000,
            blocks_cached: 0,
            summary: Some(CacheSummary {
                granularity: 1,
                entries: 0,
                bloom: BlockBloom::with_capacity(1, 0.01),
            }),
        }],
    }
}

fn prompt() -> Vec<BlockHash> {
    BlockHasher::new(&scheme(), &ExtraKeys::none()).hash_blocks(&(0..1024).collect::<Vec<u32>>())
}

fn input(hashes: &[BlockHash]) -> RouteInput<'_> {
    RouteInput {
        model: "m",
        hashes,
        prompt_tokens: 1024,
        session_key: 7,
        shared_blocks: 0,
        block_size: 16,
        only: None,
        adapter: None,
        output_tokens: 0,
        slo: crate::routing::Slo::default(),
    }
}

/// A prefill worker, a decode worker, and an idle-looking `both` worker (the local pick) whose decodes
/// co-located prefill stalls 90% (TPOT 60 ms > 50 ms).
fn fleet(now: Instant) -> Registry {
    let mut reg = Registry::new(RegistryConfig::default());
    let fp = Some(scheme().fingerprint());
    let link = PeerImport { peer: "p:9100".into(), bytes: 4_000_000_000, seconds: 1.0, transfers: 2 };
    reg.ingest(report("p", Role::Prefill, 0.0, vec![]), fp, now);
    reg.ingest(report("d", Role::Decode, 0.0, vec![link]), fp, now);
    reg.ingest(report("b", Role::Both, 0.9, vec![]), fp, now);
    reg
}

fn ask(policy: &dyn SplitPolicy) -> SplitAsk<'_> {
    SplitAsk { policy, settings: SplitSettings::default(), expected_output: 256 }
}

#[test]
fn a_split_goes_to_the_decode_worker_and_charges_the_prefill_to_the_prefill_worker() {
    let now = Instant::now();
    let mut reg = fleet(now);
    let router = Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy"));
    let hashes = prompt();
    let cost = CostModel;
    let r = router.route_split(&mut reg, &input(&hashes), 3, Some(&ask(&cost)), now).expect("routed");
    let plan = r.split.as_ref().expect("considered");
    assert_eq!((plan.decision.choice, plan.decision.reason), (super::Choice::Split, "slo"), "{plan:?}");
    assert!(plan.bandwidth_measured && (plan.input.bandwidth_bytes_per_s - 4e9).abs() < 1.0);
    assert!(plan.speed_measured);
    assert_eq!(
        (plan.prefill_worker.as_str(), plan.decode_worker.as_str(), plan.peer.as_str()),
        ("p", "d", "p:9100")
    );
    assert_eq!(r.candidates[0].id, "d", "the decode worker first");
    assert_eq!(r.prefill.as_ref().map(|p| p.id.as_str()), Some("p"));
    assert_eq!(r.uncached_tokens, 1024, "the prefill worker computes the prompt");
    // Both sends are recorded: the prefill's tokens to P, no prefill tokens to D.
    let (p, d) = (&reg.workers()[0], &reg.workers()[1]);
    assert_eq!((p.sent_tokens_since_report, d.sent_tokens_since_report), (1024, 0));
    assert_eq!((p.inflight, d.inflight), (1, 1));
    reg.record_done(r.ticket.expect("ticket"));
    reg.record_done(r.prefill_ticket.expect("prefill ticket"));
    assert_eq!((reg.workers()[0].inflight, reg.workers()[1].inflight), (0, 0));
}

#[test]
fn comparison_policies_and_a_fleet_without_a_pair_stay_local() {
    let now = Instant::now();
    let router = Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy"));
    let hashes = prompt();
    let mut reg = fleet(now);
    let agg = rules::Aggregated;
    let r = router.route_split(&mut reg, &input(&hashes), 3, Some(&ask(&agg)), now).expect("routed");
    assert!(!r.is_split() && r.split.is_some());
    // Whole requests go to the other workers first; the prefill worker is only a fallback.
    assert_eq!(r.candidates.last().map(|c| c.id.as_str()), Some("p"));
    assert_eq!(r.candidates[0].id, "b");
    // Only one transfer-capable worker: nothing to consider.
    let mut one = Registry::new(RegistryConfig::default());
    one.ingest(report("d", Role::Decode, 0.9, vec![]), Some(scheme().fingerprint()), now);
    let cost = CostModel;
    let r = router.route_split(&mut one, &input(&hashes), 3, Some(&ask(&cost)), now).expect("routed");
    assert!(r.split.is_none() && !r.is_split());
    // A dry run decides the same and records nothing.
    let mut reg = fleet(now);
    let dry = router.dry_run_split(&reg, &input(&hashes), 3, Some(&ask(&cost)), now).expect("dry");
    assert!(dry.is_split() && dry.ticket.is_none());
    assert_eq!(reg.workers()[0].inflight, 0);
    let real = router.route_split(&mut reg, &input(&hashes), 3, Some(&ask(&cost)), now).expect("routed");
    assert_eq!(real.candidates, dry.candidates);
}

#[test]
fn a_prefill_worker_stalls_no_streams_and_reports_how_busy_it_is() {
    let now = Instant::now();
    let mut reg = Registry::new(RegistryConfig::default());
    let fp = Some(scheme().fingerprint());
    // Its 8 running requests are exports (they end at their first token): no stream to stall. It computed
    // 10,000 prompt tokens a second over the interval at 40,000 a second while computing: busy a quarter.
    let mut p = report("p", Role::Prefill, 0.0, vec![]);
    p.throughput.prefill_tokens_per_s = 10_000.0;
    reg.ingest(p, fp, now);
    reg.ingest(report("d", Role::Decode, 0.0, vec![]), fp, now);
    let router = Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy"));
    let hashes = prompt();
    let cost = CostModel;
    let r = router.dry_run_split(&reg, &input(&hashes), 3, Some(&ask(&cost)), now).expect("routed");
    let plan = r.split.as_ref().expect("considered");
    assert_eq!(plan.input.prefill.running, 0, "{plan:?}");
    assert!((plan.input.prefill.prefill_busy - 0.25).abs() < 1e-9, "{plan:?}");
    // The decode worker's requests are streams.
    assert_eq!((plan.input.decode.running, plan.input.decode.prefill_busy), (8, 0.0));
    // The imports a decode worker retries a split on: decode and both workers with KV, never a prefill worker.
    let refs: Vec<_> = (0..2).map(|i| reg.worker_ref(i).expect("ref")).collect();
    assert!(!super::plan::can_import(&reg, refs[0]) && super::plan::can_import(&reg, refs[1]));
}

#[test]
fn the_pairs_no_transfer_measured_are_named_for_a_probe() {
    let now = Instant::now();
    let mut reg = fleet(now);
    // d measured its link from p; b cannot import (no KV layout of its own): nothing to probe.
    assert!(reg.unmeasured_links(now, 8).is_empty());
    let fp = Some(scheme().fingerprint());
    reg.ingest(report("d2", Role::Decode, 0.0, vec![]), fp, now);
    let links = reg.unmeasured_links(now, 8);
    assert_eq!(links.len(), 1, "{links:?}");
    assert_eq!((links[0].peer.as_str(), links[0].decode_url.as_str()), ("p:9100", "http://d2:8000"));
    assert_eq!(links[0].model, "m");
    assert!(reg.unmeasured_links(now, 0).is_empty(), "at most max");
    // Once d2's report carries a transfer from p, the pair is measured.
    let link = PeerImport { peer: "p:9100".into(), bytes: 1_000_000, seconds: 0.01, transfers: 1 };
    let mut r = report("d2", Role::Decode, 0.0, vec![link]);
    r.seq = 2;
    reg.ingest(r, fp, now);
    assert!(reg.unmeasured_links(now, 8).is_empty());
}

#[test]
fn a_plan_before_any_measured_prefill_speed_says_so() {
    // Freshly started workers have reported no prefill yet: every prefill is priced at the cost model's slowest
    // belief, and the plan says its prediction is none (the gateway does not score it against the outcome).
    let now = Instant::now();
    let mut reg = Registry::new(RegistryConfig::default());
    let fp = Some(scheme().fingerprint());
    for (id, role) in [("p", Role::Prefill), ("d", Role::Decode), ("b", Role::Both)] {
        let mut r = report(id, role, 0.0, vec![]);
        r.pd.timing.prefill_tokens_per_s = 0.0;
        reg.ingest(r, fp, now);
    }
    let router = Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy"));
    let hashes = prompt();
    let r = router.route_split(&mut reg, &input(&hashes), 3, Some(&ask(&CostModel)), now).expect("routed");
    let plan = r.split.as_ref().expect("considered");
    assert!(!plan.speed_measured);
    assert!(plan.decision.terms.local.ttft_s >= 1024.0, "the floor belief, 1 token/s: {plan:?}");
}

#[test]
fn a_fit_of_the_prefill_cost_prices_the_prompt_by_its_attention_and_stands_for_a_worker_without_one() {
    // P measured its fit (at start, before any prompt): 0.1 ms a token and 1e-7 s per unit of attention area;
    // the others report none. Every side prices the 1,024-token prompt by P's fit, not by the 40K tokens/s rate.
    let now = Instant::now();
    let mut reg = Registry::new(RegistryConfig::default());
    let fp = Some(scheme().fingerprint());
    for (id, role) in [("p", Role::Prefill), ("d", Role::Decode), ("b", Role::Both)] {
        let mut r = report(id, role, 0.0, vec![]);
        if id == "p" {
            (r.pd.timing.prefill_per_token_s, r.pd.timing.prefill_attention_s) = (1e-4, 1e-7);
        }
        reg.ingest(r, fp, now);
    }
    let router = Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy"));
    let hashes = prompt();
    let r = router.route_split(&mut reg, &input(&hashes), 3, Some(&ask(&CostModel)), now).expect("routed");
    let plan = r.split.as_ref().expect("considered");
    assert!(plan.speed_measured);
    for side in [&plan.input.prefill, &plan.input.decode, &plan.input.local] {
        assert_eq!((side.prefill_per_token_s, side.prefill_attention_s), (1e-4, 1e-7), "{plan:?}");
        assert_eq!(side.held_tokens, 0);
    }
    // P's own prefill: 1,024 x 1e-4 + 1e-7 x 1,024 x 512 = 0.1548 s after its queue (40,000 tokens at 40K/s).
    let want = 1.0 + 1024.0 * 1e-4 + 1e-7 * 1024.0 * 512.0;
    let p = &plan.input.prefill;
    let split = plan.decision.terms.split.ttft_s - plan.decision.terms.exposed_transfer_s - p.decode_step_s;
    assert!((split - want).abs() < 1e-9, "{split} vs {want}");
}
