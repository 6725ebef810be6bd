//! Golden vectors of the placement cost: which worker an adapter request runs on, and every term.

use std::time::{Duration, Instant};

use kvgate_shared::hashing::{BlockHash, BlockHasher, ExtraKey, ExtraKeys, HashScheme};
use kvgate_shared::report::{
    BlockBloom, CacheSummary, HeldAdapter, LoraInfo, QueueStats, Throughput, Tier, TierReport, WorkerReport,
};

use super::*;
use crate::registry::RegistryConfig;

const FP: u64 = 7;

fn key(name: &str) -> String {
    format!("{name}@{:016x}", name.len())
}

fn hashes(adapter: &str) -> Vec<BlockHash> {
    let keys = ExtraKeys::none().with(ExtraKey::LoraAdapter(key(adapter)));
    BlockHasher::new(&HashScheme::new(16, 1), &keys).hash_blocks(&(0..4096).collect::<Vec<u32>>())
}

/// A worker reporting `waiting` queued prefill tokens, holding `held` adapters of `slots`, with `cached` blocks of
/// the adapter `a`'s prompt in its cache.
fn report(id: &str, waiting: u64, slots: u16, held: &[&str], cached: usize) -> WorkerReport {
    let mut bloom = BlockBloom::with_capacity(1024, 0.0001);
    hashes("a")[..cached].iter().for_each(|h| bloom.insert(*h));
    WorkerReport {
        pd: Default::default(),
        lora: LoraInfo {
            slots,
            held: held.iter().map(|n| HeldAdapter { name: (*n).into(), key: key(n) }).collect(),
        },
        worker_id: id.into(),
        advertise_url: format!("http://{id}:8000"),
        model_id: "m".into(),
        scheme: HashScheme::new(16, 1),
        fingerprint: FP,
        seq: 1,
        timestamp_ms: 0,
        instance_id: 1,
        max_model_len: 8192,
        draining: false,
        queue: QueueStats { prefill_tokens: waiting, ..Default::default() },
        throughput: Throughput::default(),
        tiers: vec![TierReport {
            tier: Tier::Device,
            blocks_total: 1000,
            blocks_free: 500,
            blocks_cached: cached as u64,
            summary: Some(CacheSummary { granularity: 1, entries: cached as u64, bloom }),
        }],
    }
}

fn registry(reports: Vec<WorkerReport>, now: Instant) -> Registry {
    let mut reg = Registry::new(RegistryConfig::default());
    for r in reports {
        reg.ingest(r, Some(FP), now);
    }
    reg
}

fn input<'a>(h: &'a [BlockHash], adapter: &'a str) -> RouteInput<'a> {
    RouteInput {
        model: "m",
        hashes: h,
        prompt_tokens: h.len() * 16,
        session_key: 1,
        shared_blocks: 0,
        block_size: 16,
        only: None,
        adapter: Some(adapter),
        output_tokens: 0,
        slo: crate::routing::Slo::default(),
    }
}

const CFG: PlaceConfig = PlaceConfig {
    default_load_s: 0.5,
    default_prefill_tokens_per_s: 4096.0,
    per_request_tokens: 256,
    spread_gain_s: 1.0,
};

#[test]
fn a_cold_adapter_loads_on_the_cheapest_worker_with_a_free_slot() {
    let now = Instant::now();
    // w1 idle but full (evict term), w2 a little busy with a free slot, w3 busy.
    let reg = registry(
        vec![
            report("w1", 0, 2, &["x", "y"], 0),
            report("w2", 1024, 2, &["x"], 0),
            report("w3", 8192, 2, &[], 0),
        ],
        now,
    );
    let h = hashes("a");
    let p = place(&reg, &input(&h, "a"), true, &CFG, now).expect("an adapter request");
    let Choice::Load { worker, reason, .. } = &p.choice else { panic!("{p:?}") };
    assert_eq!((worker.as_str(), *reason), ("w2", "cold"), "{:#?}", p.terms);
    // Golden terms: prompt 4096 tokens at 4096 tokens/s = 1 s; w2 queue 1024/4096; load 0.5 s; w1 evicts.
    let w1 = p.terms.iter().find(|t| t.worker == "w1").expect("w1");
    assert_eq!(
        (w1.queue_s, w1.prefill_s, w1.load_s, w1.evict_s, w1.cost_s, w1.full),
        (0.0, 1.0, 0.5, 0.5, 2.0, true)
    );
    let w2 = &p.terms[0];
    assert_eq!((w2.worker.as_str(), w2.queue_s, w2.cost_s), ("w2", 0.25, 1.75));
    // Not in the catalogue: nowhere to run it.
    assert_eq!(place(&reg, &input(&h, "a"), false, &CFG, now).expect("asked").choice, Choice::Nowhere);
    // No adapter: nothing to place.
    assert!(place(&reg, &RouteInput { adapter: None, ..input(&h, "a") }, true, &CFG, now).is_none());
}

#[test]
fn holders_are_kept_while_they_are_cheaper_and_a_hot_adapter_spreads_when_they_are_not() {
    let now = Instant::now();
    let h = hashes("a");
    // The holder is somewhat busy but holds half the prompt: cheaper than loading elsewhere.
    let reg = registry(vec![report("h", 2048, 4, &["a"], 128), report("o", 0, 4, &[], 0)], now);
    let p = place(&reg, &input(&h, "a"), true, &CFG, now).expect("placed");
    assert_eq!(p.choice, Choice::Holders, "{:#?}", p.terms);
    assert_eq!(p.terms[0].prefill_s, 0.5, "the holder's prefix for this adapter counts");
    // Busier, a copy would be cheaper, but not by the spread gain (holder 1.0 + 0.5 s vs 1.5 s): the holder.
    let reg = registry(vec![report("h", 4096 + 2048, 4, &["a"], 128), report("o", 0, 4, &[], 0)], now);
    let p = place(&reg, &input(&h, "a"), true, &CFG, now).expect("placed");
    assert_eq!(p.choice, Choice::Holders, "{:#?}", p.terms);
    let (copy, holder) = (&p.terms[0], &p.terms[1]);
    assert!(!copy.holds && holder.holds && holder.cost_s - copy.cost_s < 1.0, "{:#?}", p.terms);
    assert!(holder.cost_s > copy.cost_s, "cheaper elsewhere, by less than the gain");
    // The holder drowning: a copy on the idle worker is cheaper, load included, by more than the gain.
    let reg = registry(vec![report("h", 40_000, 4, &["a"], 128), report("o", 0, 4, &[], 0)], now);
    let p = place(&reg, &input(&h, "a"), true, &CFG, now).expect("placed");
    assert!(matches!(&p.choice, Choice::Load { worker, reason: "hot", .. } if worker == "o"), "{p:?}");
    // Not loadable: the holders, however busy.
    assert_eq!(place(&reg, &input(&h, "a"), false, &CFG, now).expect("placed").choice, Choice::Holders);
}

#[test]
fn measured_loads_and_failed_ones_change_the_choice() {
    let now = Instant::now();
    let h = hashes("a");
    let mut reg = registry(
        vec![report("w1", 0, 4, &[], 0), report("w2", 1024, 4, &[], 0), report("w3", 100_000, 4, &[], 0)],
        now,
    );
    let (w1, w2ref) = (reg.worker_ref(0).expect("w1"), reg.worker_ref(1).expect("w2"));
    // w1 measured slow loads (3 s), w2 fast ones: w2's queue is cheaper than w1's load.
    reg.record_adapter_load(w1, "other", Ok(None), 3.0, now);
    reg.record_adapter_load(w2ref, "other", Ok(None), 0.2, now);
    let p = place(&reg, &input(&h, "a"), true, &CFG, now).expect("placed");
    assert!(matches!(&p.choice, Choice::Load { worker, .. } if worker == "w2"), "{:#?}", p.terms);
    let w3 = p.terms.iter().find(|t| t.worker == "w3").expect("w3");
    assert!((w3.load_s - 1.6).abs() < 1e-9, "a worker without a measure of its own takes the fleet's mean");
    // A failed load of `a` on w2: not asked again within the backoff, so w1 despite its slow loads.
    reg.record_adapter_load(w2ref, "a", Err(()), 0.1, now);
    let p = place(&reg, &input(&h, "a"), true, &CFG, now).expect("placed");
    assert!(matches!(&p.choice, Choice::Load { worker, .. } if worker == "w1"), "{p:?}");
    let later = now + crate::registry::adapters::FAILED_LOAD_BACKOFF + Duration::from_secs(1);
    assert!(!reg.workers()[1].lora.holds("a", later));
    assert!(reg.workers()[1].lora.may_load("a", later), "the backoff ends");
    // A successful load is believed at once (before any report lists it) and its key is the worker's.
    reg.record_adapter_load(w1, "a", Ok(Some(key("a"))), 0.2, now);
    assert!(reg.workers()[0].lora.holds("a", now));
    assert_eq!(reg.adapter_key("a").as_deref(), Some(key("a").as_str()));
    assert_eq!(place(&reg, &input(&h, "a"), true, &CFG, now).expect("placed").choice, Choice::Holders);
}

#[test]
fn zero_slots_a_subset_and_unhealthy_workers_are_never_candidates() {
    let now = Instant::now();
    let h = hashes("a");
    let reg = registry(vec![report("none", 0, 0, &[], 0), report("w", 9000, 2, &[], 0)], now);
    let p = place(&reg, &input(&h, "a"), true, &CFG, now).expect("placed");
    assert_eq!(p.terms.len(), 1, "a worker without slots loads nothing");
    let only = vec!["none:8000".to_owned()];
    let p =
        place(&reg, &RouteInput { only: Some(&only), ..input(&h, "a") }, true, &CFG, now).expect("placed");
    assert_eq!(p.choice, Choice::Nowhere);
    let dead = now + Duration::from_secs(60);
    assert_eq!(place(&reg, &input(&h, "a"), true, &CFG, dead).expect("placed").choice, Choice::Nowhere);
}

#[test]
fn an_adapter_request_is_routed_only_to_its_holders_and_scored_by_their_prefix_for_it() {
    use crate::route::Router;
    use crate::routing::{policy_by_name, Weights};
    let now = Instant::now();
    let h = hashes("a");
    // w0 idle without `a`; w1 and w2 hold it, w2 with the prompt's prefix for it.
    let reg = registry(
        vec![
            report("w0", 0, 4, &["b"], 0),
            report("w1", 500, 4, &["a"], 0),
            report("w2", 500, 4, &["a"], 200),
        ],
        now,
    );
    for policy in ["cache_aware", "least_load", "round_robin"] {
        let router = Router::new(policy_by_name(policy, Weights::default()).expect("policy"));
        let r = router.dry_run(&reg, &input(&h, "a"), 8, now).expect("routed");
        let ids: Vec<&str> = r.candidates.iter().map(|c| c.id.as_str()).collect();
        assert!(!ids.contains(&"w0"), "{policy}: {ids:?}");
        if policy == "cache_aware" {
            assert_eq!(ids[0], "w2", "the prefix held for this adapter wins");
        }
    }
    let router = Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy"));
    assert!(router.dry_run(&reg, &input(&h, "c"), 8, now).is_none(), "nobody holds c");
    let base = router.dry_run(&reg, &RouteInput { adapter: None, ..input(&h, "a") }, 8, now).expect("base");
    assert_eq!(base.candidates.len(), 3, "the base model runs anywhere");
}

#[test]
fn a_worker_that_still_caches_the_adapters_prefix_is_credited_though_its_weights_left() {
    let now = Instant::now();
    let h = hashes("a");
    // `a` is held by a busy worker; w2 no longer holds it but still caches 200 of its 256 blocks.
    let reg = registry(vec![report("h", 12_000, 4, &["a"], 0), report("w2", 0, 4, &["x"], 200)], now);
    let p = place(&reg, &input(&h, "a"), true, &CFG, now).expect("placed");
    let w2 = p.terms.iter().find(|t| t.worker == "w2").expect("w2");
    assert_eq!(w2.prefill_s, (4096.0 - 3200.0) / 4096.0, "its blocks for `a` count");
    assert!(matches!(&p.choice, Choice::Load { worker, .. } if worker == "w2"), "{:#?}", p.terms);
}
