//! Policies and the ring, on hand-built worker states.

use std::collections::HashMap;

use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::report::{BlockBloom, CacheSummary};

use super::*;

const IDS: [&str; 5] = ["w0", "w1", "w2", "w3", "w4"];

fn ring() -> Ring {
    Ring::new(IDS, ring::DEFAULT_VNODES)
}

fn hashes(n_blocks: usize, seed: u32) -> Vec<BlockHash> {
    let tokens: Vec<u32> = (0..16 * n_blocks as u32).map(|t| t * 7 + seed).collect();
    BlockHasher::new(&HashScheme::new(16, 1), &ExtraKeys::none()).hash_blocks(&tokens)
}

fn summary_of(hashes: &[BlockHash]) -> CacheSummary {
    let mut bloom = BlockBloom::with_capacity(hashes.len().max(1), 0.001);
    hashes.iter().for_each(|h| bloom.insert(*h));
    CacheSummary { granularity: 1, entries: hashes.len() as u64, bloom }
}

/// `cache_aware_measured`.
fn measured_guard(w: Weights) -> CacheAware {
    CacheAware::with_guard(w, hotspot::GuardKind::Measured)
}

fn views<'a>(summaries: &'a [Option<CacheSummary>], loads: &[u64], healthy: &[bool]) -> Vec<WorkerView<'a>> {
    IDS.iter()
        .enumerate()
        .map(|(i, id)| WorkerView {
            id,
            slot: i,
            healthy: healthy[i],
            summary: summaries[i].as_ref(),
            host_summary: None,
            disk_summary: None,
            overlay_matched_blocks: 0,
            prefix_signal: PrefixSignal::Report,
            load: Load { pending_tokens: loads[i], ..Load::default() },
            sessions: 0,
            holds_session: false,
            speed: Default::default(),
        })
        .collect()
}

#[test]
fn ring_moves_only_the_dead_workers_keys_to_their_backups() {
    let r = ring();
    let all = |_: &str| true;
    let without_w2 = |id: &str| id != "w2";
    let mut moved = 0;
    let mut spread: HashMap<String, usize> = HashMap::new();
    for key in 0..2000u64 {
        let (p, b) = r.primary_backup(key.wrapping_mul(0x9E37_79B9_7F4A_7C15), all);
        let (p, b) = (p.expect("primary"), b.expect("backup"));
        assert_ne!(p, b);
        *spread.entry(p.to_string()).or_default() += 1;
        let (p2, _) = r.primary_backup(key.wrapping_mul(0x9E37_79B9_7F4A_7C15), without_w2);
        let p2 = p2.expect("primary");
        if &*p == "w2" {
            assert_eq!(p2, b, "a dead worker's key goes to its backup");
            moved += 1;
        } else {
            assert_eq!(p2, p, "other keys do not move");
        }
    }
    assert!(moved > 200, "{moved}");
    assert!(spread.values().all(|n| *n > 200), "keys spread over workers: {spread:?}");
    // Same ids, another order: same ring.
    let other = Ring::new(["w4", "w3", "w2", "w1", "w0"], ring::DEFAULT_VNODES);
    assert_eq!(other.primary_backup(42, all), r.primary_backup(42, all));
}

#[test]
fn cache_aware_follows_the_prefix() {
    let req_hashes = hashes(40, 1);
    let mut summaries: Vec<Option<CacheSummary>> = vec![None; 5];
    summaries[3] = Some(summary_of(&req_hashes[..30]));
    let ws = views(&summaries, &[0, 0, 0, 0, 0], &[true; 5]);
    let p = CacheAware::new(Weights::default());
    let d = p
        .choose(
            &RequestView {
                hashes: &req_hashes,
                prompt_tokens: 640,
                session_key: 7,
                shared_blocks: 0,
                seq: 1,
                output_tokens: 0,
                slo: Slo::default(),
            },
            &ws,
            &ring(),
            16,
        )
        .expect("decision");
    assert_eq!(ws[d.ranked[0]].id, "w3");
    assert_eq!(d.reason, RouteReason::Prefix);
    assert_eq!(d.predicted_cached_tokens, 30 * 16);
    assert_eq!(d.terms[3].matched_blocks, 30);
    assert_eq!(d.ranked.len(), 5);
}

#[test]
fn cache_aware_uses_the_ring_without_a_prefix_and_skips_unhealthy_workers() {
    let req_hashes = hashes(4, 2);
    let summaries: Vec<Option<CacheSummary>> = vec![None; 5];
    let p = CacheAware::new(Weights::default());
    let r = ring();
    for key in 0..50u64 {
        let req = RequestView {
            hashes: &req_hashes,
            prompt_tokens: 64,
            session_key: key,
            shared_blocks: 0,
            seq: key,
            output_tokens: 0,
            slo: Slo::default(),
        };
        let ws = views(&summaries, &[0; 5], &[true; 5]);
        let (primary, backup) = r.primary_backup(key, |_| true);
        let d = p.choose(&req, &ws, &r, 16).expect("decision");
        assert_eq!(Some(ws[d.ranked[0]].id), primary.as_deref());
        assert_eq!(d.reason, RouteReason::Primary);
        // Primary down: its backup, and the dead one is never ranked.
        let pi = IDS.iter().position(|i| Some(*i) == primary.as_deref()).expect("pos");
        let mut healthy = [true; 5];
        healthy[pi] = false;
        let ws = views(&summaries, &[0; 5], &healthy);
        let d = p.choose(&req, &ws, &r, 16).expect("decision");
        assert_eq!(Some(ws[d.ranked[0]].id), backup.as_deref());
        assert!(!d.ranked.contains(&pi));
    }
    let none = views(&summaries, &[0; 5], &[false; 5]);
    assert!(p
        .choose(
            &RequestView {
                hashes: &req_hashes,
                prompt_tokens: 64,
                session_key: 1,
                shared_blocks: 0,
                seq: 1,
                output_tokens: 0,
                slo: Slo::default()
            },
            &none,
            &r,
            16
        )
        .is_none());
}

/// The guard's tests score with #28's load weight (0.5) and shared-prefix threshold (4096), under which the score's
/// winner is the worker that holds the prefix however long its queue, so what they check is the guard's decision. Under the default (1.0) the score
/// itself leaves a worker whose queue dwarfs the prompt: `the_default_score_leaves_a_queue_that_dwarfs_the_prompt`.
const GUARD_TEST_WEIGHTS: Weights = Weights {
    w_prefix: 1.0,
    w_ring: 0.3,
    w_load: 0.5,
    per_request_tokens: crate::routing::Load::DEFAULT_PER_REQUEST_TOKENS,
    load_floor_tokens: 8192,
    hotspot_abs_tokens: 1024,
    hotspot_ratio: 3.0,
    hotspot_waste_factor: 3.0,
    hotspot_copy_tokens: 24576,
    free_shared_tokens: 4096,
    ring_session_bound: 1.1,
    credit_host: 0.7,
    credit_disk: 0.3,
    w_decode: 0.3,
    decode_horizon_tokens: 1024,
    w_evict: 1.0,
    w_copy: 1.0,
    slo_filter: false,
};

#[test]
fn the_default_score_leaves_a_queue_that_dwarfs_the_prompt() {
    // 24,000-token prompt, 20,000 of them cached on w1, which has 100K tokens queued; the others are idle. Waiting
    // there is 104K tokens of work against 24K anywhere else: the default score sends it elsewhere before the guard
    // is asked, and keeps it on w1 when the queue is moderate.
    let req_hashes = hashes(1500, 5);
    let mut summaries: Vec<Option<CacheSummary>> = vec![None; IDS.len()];
    summaries[1] = Some(summary_of(&req_hashes[..1250]));
    let p = CacheAware::new(Weights::default());
    assert_eq!(Weights { w_load: 0.5, free_shared_tokens: 4096, ..Weights::default() }, GUARD_TEST_WEIGHTS);
    let req = RequestView {
        hashes: &req_hashes,
        prompt_tokens: 24_000,
        session_key: 9,
        shared_blocks: 0,
        seq: 1,
        output_tokens: 0,
        slo: Slo::default(),
    };
    let pick = |w1_queue: u64| {
        let ws = views(&summaries, &[0, w1_queue, 0, 0, 0], &[true; 5]);
        let d = p.choose(&req, &ws, &ring(), 16).expect("decision");
        (ws[d.ranked[0]].id, d.reason)
    };
    let (to, reason) = pick(100_000);
    assert_ne!(to, "w1");
    assert_ne!(reason, RouteReason::Load, "the score moved it, not the guard");
    assert_eq!(pick(4_000), ("w1", RouteReason::Prefix));
}

#[test]
fn hot_spot_guard_overrides_the_prefix() {
    let req_hashes = hashes(40, 3);
    let mut summaries: Vec<Option<CacheSummary>> = vec![None; 5];
    summaries[1] = Some(summary_of(&req_hashes));
    let p = CacheAware::new(GUARD_TEST_WEIGHTS);
    // w1 has the prefix but 100K tokens queued; the others are nearly idle.
    let ws = views(&summaries, &[100, 100_000, 200, 300, 100], &[true; 5]);
    let d = p
        .choose(
            &RequestView {
                hashes: &req_hashes,
                prompt_tokens: 640,
                session_key: 9,
                shared_blocks: 0,
                seq: 2,
                output_tokens: 0,
                slo: Slo::default(),
            },
            &ws,
            &ring(),
            16,
        )
        .expect("decision");
    assert_eq!(d.reason, RouteReason::Load);
    assert!(["w0", "w4"].contains(&ws[d.ranked[0]].id));
    // A moderate queue does not trigger it: 1,500 queued tokens vs 740 of work (100 queued + 640 to prefill)
    // elsewhere is under the 3x ratio.
    let ws = views(&summaries, &[100, 1_500, 200, 300, 100], &[true; 5]);
    let d = p
        .choose(
            &RequestView {
                hashes: &req_hashes,
                prompt_tokens: 640,
                session_key: 9,
                shared_blocks: 0,
                seq: 2,
                output_tokens: 0,
                slo: Slo::default(),
            },
            &ws,
            &ring(),
            16,
        )
        .expect("decision");
    assert_eq!(ws[d.ranked[0]].id, "w1");
    // The guard weighs what the cache saves: a 100K-token queue is worth waiting behind when the request's
    // 200K-token prompt is cached there and would have to be prefilled anywhere else.
    let long = hashes(12_500, 3);
    let mut summaries: Vec<Option<CacheSummary>> = vec![None; 5];
    summaries[1] = Some(summary_of(&long));
    let ws = views(&summaries, &[100, 100_000, 200, 300, 100], &[true; 5]);
    let req = RequestView {
        hashes: &long,
        prompt_tokens: 200_000,
        session_key: 9,
        shared_blocks: 0,
        seq: 2,
        output_tokens: 0,
        slo: Slo::default(),
    };
    let d = p.choose(&req, &ws, &ring(), 16).expect("decision");
    assert_eq!((ws[d.ranked[0]].id, d.reason), ("w1", RouteReason::Prefix));
}

#[test]
fn a_move_that_costs_no_cache_follows_the_queue_unless_the_ring_may_gather_a_family() {
    let summaries: Vec<Option<CacheSummary>> = vec![None; IDS.len()];
    let req_hashes = hashes(4, 11);
    let key = (0u64..)
        .find(|k| ring().primary_backup(*k, |_| true).0.as_deref() == Some(IDS[0]))
        .expect("some key lands on the first worker");
    let p = CacheAware::new(GUARD_TEST_WEIGHTS);
    // Every worker is busy, the ring primary most: the score still picks the primary (its ring term outweighs
    // 0.5 x its 23% higher load), and nothing is cached anywhere.
    let ws = views(&summaries, &[130_000, 100_000, 100_000, 100_000, 100_000], &[true; 5]);
    let pick = |shared_blocks: usize| {
        let req = RequestView {
            hashes: &req_hashes,
            prompt_tokens: 64,
            session_key: key,
            shared_blocks,
            seq: 1,
            output_tokens: 0,
            slo: Slo::default(),
        };
        let d = p.choose(&req, &ws, &ring(), 16).expect("decision");
        (ws[d.ranked[0]].id, d.reason)
    };
    // A prompt family's first request (no shared prefix: its ring key may be its family's): 130K queued is under
    // 3 x 100K + 1,024, so it stays where the family will meet.
    assert_eq!(pick(0), ("w0", RouteReason::Primary));
    // A new conversation after a shared system prompt (its ring key is its own): 30K tokens less wait elsewhere
    // is over hotspot_abs_tokens, and the move gives up nothing.
    let (to, reason) = pick(1);
    assert_ne!(to, "w0");
    assert_eq!(reason, RouteReason::Load);
}

#[test]
fn a_move_that_gives_up_cached_tokens_must_save_more_the_busier_the_fleet() {
    // 24,000-token prompt, 20,000 of them cached on w1 only: a move elsewhere gives up 20,000 cached tokens.
    let req_hashes = hashes(1500, 5);
    let mut summaries: Vec<Option<CacheSummary>> = vec![None; IDS.len()];
    summaries[1] = Some(summary_of(&req_hashes[..1250]));
    let p = CacheAware::new(Weights { w_ring: 0.0, ..GUARD_TEST_WEIGHTS });
    let req = RequestView {
        hashes: &req_hashes,
        prompt_tokens: 24_000,
        session_key: 9,
        shared_blocks: 0,
        seq: 1,
        output_tokens: 0,
        slo: Slo::default(),
    };
    let pick = |w1_queue: u64, others: u64| {
        let mut loads = [others; 5];
        loads[1] = w1_queue;
        let ws = views(&summaries, &loads, &[true; 5]);
        let d = p.choose(&req, &ws, &ring(), 16).expect("decision");
        (ws[d.ranked[0]].id, d.reason)
    };
    // An idle fleet (k = 3): a move must save 1,024 + 3 x 20,000 + 24,576 = 85,600 tokens of wait. Behind 100K
    // queued tokens it saves 100,000 + 4,000 - 24,000 = 80,000: it stays.
    assert_eq!(pick(100_000, 0), ("w1", RouteReason::Prefix));
    // Behind 120K it saves 100,000: it moves.
    let (to, reason) = pick(120_000, 0);
    assert_ne!(to, "w1");
    assert_eq!(reason, RouteReason::Load);
    // The same queue on a busy fleet (16,000 tokens queued on every other worker: k = 3 x (1 + 16,000 / 8,192)):
    // recomputing 20,000 tokens there delays everyone queued behind them, and it stays.
    assert_eq!(pick(120_000, 16_000), ("w1", RouteReason::Prefix));
}

#[test]
fn baselines() {
    let req_hashes = hashes(2, 4);
    let summaries: Vec<Option<CacheSummary>> = vec![None; 5];
    let ws = views(&summaries, &[50, 10, 30, 40, 20], &[true, true, true, false, true]);
    let req = RequestView {
        hashes: &req_hashes,
        prompt_tokens: 32,
        session_key: 3,
        shared_blocks: 0,
        seq: 0,
        output_tokens: 0,
        slo: Slo::default(),
    };
    let ll = least_load::LeastLoad::new(256);
    assert_eq!(ws[ll.choose(&req, &ws, &ring(), 16).expect("d").ranked[0]].id, "w1");
    let rr = round_robin::RoundRobin;
    let picks: Vec<&str> = (0..8)
        .map(|seq| {
            ws[rr.choose(&RequestView { seq, ..req.clone() }, &ws, &ring(), 16).expect("d").ranked[0]].id
        })
        .collect();
    assert_eq!(picks, ["w0", "w1", "w2", "w4", "w0", "w1", "w2", "w4"]);
    let ch = consistent_hash::ConsistentHash;
    let (p, _) = ring().primary_backup(3, |id| id != "w3");
    assert_eq!(Some(ws[ch.choose(&req, &ws, &ring(), 16).expect("d").ranked[0]].id), p.as_deref());
    for name in POLICIES {
        assert_eq!(policy_by_name(name, Weights::default()).expect("policy").name(), name);
    }
    assert!(policy_by_name("random", Weights::default()).is_none());
}

#[test]
fn weights_validation_lists_problems() {
    let w = Weights { w_prefix: -1.0, hotspot_ratio: 0.5, hotspot_waste_factor: -1.0, ..Weights::default() };
    assert_eq!(w.validate().len(), 3);
    assert!(Weights::default().validate().is_empty());
}

#[test]
fn a_ring_primary_with_more_than_its_share_of_conversations_passes_new_ones_on() {
    let summaries: Vec<Option<CacheSummary>> = vec![None; IDS.len()];
    let healthy = vec![true; IDS.len()];
    let policy = CacheAware::new(Weights::default());
    let req_hashes = hashes(2, 9);
    // Find a key whose primary is IDS[0], then give that worker 10 recent conversations and the others none.
    let key = (0u64..)
        .find(|k| ring().primary_backup(*k, |_| true).0.as_deref() == Some(IDS[0]))
        .expect("some key lands on the first worker");
    let req = RequestView {
        hashes: &req_hashes,
        prompt_tokens: 32,
        session_key: key,
        shared_blocks: 0,
        seq: 1,
        output_tokens: 0,
        slo: Slo::default(),
    };
    let mut ws = views(&summaries, &vec![0; IDS.len()], &healthy);
    let d = policy.choose(&req, &ws, &ring(), 16).expect("decision");
    assert_eq!(ws[d.ranked[0]].id, IDS[0], "an even fleet: the ring primary");
    ws[0].sessions = 10;
    let d = policy.choose(&req, &ws, &ring(), 16).expect("decision");
    assert_ne!(
        ws[d.ranked[0]].id, IDS[0],
        "over its cap: a new conversation goes to the next worker on the ring"
    );
    assert_eq!(d.reason, RouteReason::Primary);
    // A conversation it already holds stays.
    ws[0].holds_session = true;
    let d = policy.choose(&req, &ws, &ring(), 16).expect("decision");
    assert_eq!(ws[d.ranked[0]].id, IDS[0]);
    // A bound large enough turns it off.
    let off = CacheAware::new(Weights { ring_session_bound: 1e9, ..Weights::default() });
    ws[0].holds_session = false;
    assert_eq!(ws[off.choose(&req, &ws, &ring(), 16).expect("decision").ranked[0]].id, IDS[0]);
}

/// A summary of `hashes` at granularity `g` (every g-th block's hash).
fn summary_at(hashes: &[BlockHash], g: u32) -> CacheSummary {
    let mut bloom = BlockBloom::with_capacity(hashes.len().max(1), 0.001);
    let mut entries = 0;
    for (i, h) in hashes.iter().enumerate() {
        if (i + 1) % g as usize == 0 {
            bloom.insert(*h);
            entries += 1;
        }
    }
    CacheSummary { granularity: g, entries, bloom }
}

#[test]
fn lower_tiers_extend_the_match_and_earn_their_credit() {
    // 32 blocks. w0: blocks 0..8 on device. w1: 0..24 in host DRAM only. w2: all 32 on SSD only. w3: 0..8 device,
    // 8..16 host, 16..32 SSD. Summaries at granularity 4, as workers send them.
    let h = hashes(32, 9);
    let (dev, host, disk) = (vec![summary_at(&h[..8], 4)], summary_at(&h[..24], 4), summary_at(&h, 4));
    let w3_host = summary_at(&h[..16], 4);
    let mut ws = views(&[None, None, None, None, None], &[0; 5], &[true; 5]);
    ws[0].summary = Some(&dev[0]);
    ws[1].host_summary = Some(&host);
    ws[2].disk_summary = Some(&disk);
    ws[3].summary = Some(&dev[0]);
    ws[3].host_summary = Some(&w3_host);
    ws[3].disk_summary = Some(&disk);
    let m = |i: usize| ws[i].tier_match(&h);
    assert_eq!(m(0), TierMatch { device: 8, through_host: 8, through_disk: 8 });
    assert_eq!(m(1), TierMatch { device: 0, through_host: 24, through_disk: 24 });
    assert_eq!(m(2), TierMatch { device: 0, through_host: 0, through_disk: 32 });
    assert_eq!(m(3), TierMatch { device: 8, through_host: 16, through_disk: 32 });
    assert_eq!((m(3).host(), m(3).disk()), (8, 16));
    // A block past the last represented one is not taken on trust: 30 blocks at granularity 4 match 28.
    assert_eq!(ws[2].tier_match(&h[..30]).through_disk, 28);

    let req = RequestView {
        hashes: &h,
        prompt_tokens: 512,
        session_key: 5,
        shared_blocks: 0,
        seq: 3,
        output_tokens: 0,
        slo: Slo::default(),
    };
    let score = |weights: Weights| {
        let d = CacheAware::new(weights).choose(&req, &ws, &ring(), 16).expect("decision");
        let fractions: Vec<f64> = d.terms.iter().map(|t| t.matched_fraction).collect();
        (ws[d.ranked[0]].id, fractions, d)
    };
    // Golden values with the default credits (0.7 host, 0.3 SSD) and the ring off: credited blocks 8, 16.8, 9.6,
    // 8 + 5.6 + 4.8 = 18.4 of 32.
    let (pick, f, d) = score(Weights { w_ring: 0.0, ..Weights::default() });
    for (got, want) in f.iter().zip([8.0 / 32.0, 16.8 / 32.0, 9.6 / 32.0, 18.4 / 32.0, 0.0]) {
        assert!((got - want).abs() < 1e-12, "{f:?}");
    }
    assert_eq!(pick, "w3");
    assert_eq!(d.reason, RouteReason::Prefix);
    // Predicted cached tokens count lower tiers at their credit (a slow tier may be computed again instead).
    assert_eq!(d.predicted_cached_tokens, (18.4f64 * 16.0).round() as usize);
    assert_eq!(d.terms[3].tiers, m(3));
    // Device-only credit (lower tiers worth nothing): the device copy wins.
    let (pick, ..) = score(Weights { w_ring: 0.0, credit_host: 0.0, credit_disk: 0.0, ..Weights::default() });
    assert_eq!(pick, "w0");
    // With a positive `free_shared_tokens` a cheap shared prefix of 8 blocks earns nothing in any tier (the
    // default, 0, credits every shared prefix).
    let shared = RequestView { shared_blocks: 8, ..req.clone() };
    let d = CacheAware::new(Weights { w_ring: 0.0, free_shared_tokens: 4096, ..Weights::default() })
        .choose(&shared, &ws, &ring(), 16)
        .expect("decision");
    assert!((d.terms[3].matched_fraction - (5.6 + 4.8) / 32.0).abs() < 1e-12, "{:?}", d.terms[3]);
    assert!((d.terms[1].matched_fraction - 16.0 * 0.7 / 32.0).abs() < 1e-12);
    let bad = Weights { credit_host: 1.5, credit_disk: f64::NAN, ..Weights::default() };
    let problems = bad.validate();
    assert!(
        problems.iter().any(|p| p.contains("credit_host"))
            && problems.iter().any(|p| p.contains("credit_disk"))
    );
}

/// Views with measured speeds: every worker prefills 10,000 tokens/s (no fit of its context cost), `waiting`
/// requests wait at each, reported `age` seconds ago.
fn measured<'a>(
    summaries: &'a [Option<CacheSummary>],
    loads: &[u64],
    waiting: u64,
    age: f64,
) -> Vec<WorkerView<'a>> {
    let mut ws = views(summaries, loads, &[true; 5]);
    for w in &mut ws {
        w.speed = Speed { prefill_tokens_per_s: 10_000.0, report_age_s: age, ..Speed::default() };
        w.load.waiting = waiting;
    }
    ws
}

/// The measured guard's case: a 24,000-token prompt (1,500 blocks of 16) whose first 20,000 tokens only w1 holds,
/// and the guard without ring affinity.
fn guard_case() -> (Vec<BlockHash>, Vec<Option<CacheSummary>>, CacheAware) {
    let req_hashes = hashes(1500, 5);
    let mut summaries: Vec<Option<CacheSummary>> = vec![None; IDS.len()];
    summaries[1] = Some(summary_of(&req_hashes[..1250]));
    (req_hashes, summaries, measured_guard(Weights { w_ring: 0.0, ..GUARD_TEST_WEIGHTS }))
}

#[test]
fn the_measured_guard_moves_when_the_predicted_seconds_say_so() {
    // 24,000-token prompt, 20,000 cached on w1 only: own(w1) = 0.4 s, own(elsewhere) = 2.4 s, waste 2 s.
    let (req_hashes, summaries, p) = guard_case();
    let req = RequestView {
        hashes: &req_hashes,
        prompt_tokens: 24_000,
        session_key: 9,
        shared_blocks: 0,
        seq: 1,
        output_tokens: 0,
        slo: Slo::default(),
    };
    let pick = |w1_queue: u64, waiting: u64, age: f64| {
        let mut loads = [0; 5];
        loads[1] = w1_queue;
        let ws = measured(&summaries, &loads, waiting, age);
        let d = p.choose(&req, &ws, &ring(), 16).expect("decision");
        let j: Vec<f64> = d.terms.iter().map(|t| t.predicted_s).collect();
        (ws[d.ranked[0]].id, d.reason, j)
    };
    // An idle fleet (no queues): J(w1) = queue + 0.4; a move costs J = 2.4 plus copy = 2.0 (the displaced tokens
    // at 1 / (1 - 0)): it moves once w1's queue passes 4.0 s = 40,000 tokens.
    let (to, reason, j) = pick(39_000, 0, 0.0);
    assert_eq!((to, reason), ("w1", RouteReason::Prefix));
    assert!((j[1] - 4.3).abs() < 1e-9 && (j[0] - 2.4).abs() < 1e-9, "{j:?}");
    // On an idle fleet J is the predicted TTFT itself: the queue and the prompt's own prefill.
    let ttft: Vec<f64> = p
        .choose(&req, &measured(&summaries, &[0, 39_000, 0, 0, 0], 0, 0.0), &ring(), 16)
        .expect("decision")
        .terms
        .iter()
        .map(|t| t.predicted_ttft_s)
        .collect();
    assert_eq!(ttft, j);
    let (to, reason, _) = pick(41_000, 0, 0.0);
    assert_ne!(to, "w1");
    assert_eq!(reason, RouteReason::Load);
    // One request waiting at every worker: utilisation 1 / (1 + 1) = 0.5 by the queues (M/M/1). Own counts twice
    // (the prompts behind it wait it out), the copy four times (a second of work added to a fleet at utilisation
    // 0.5 costs 1 / 0.5^2 seconds of waiting): J(w1) = queue + 0.8; a move: 2.4 x 2 + 2.0 x 4 = 12.8; it stays
    // behind 119,000 tokens and moves past 121,000.
    assert_eq!(pick(119_000, 1, 0.0).0, "w1");
    assert_ne!(pick(121_000, 1, 0.0).0, "w1");
    // The same 121,000 tokens reported 0.5 s ago: w1 has drained 5,000 of them since, and the request stays.
    assert_eq!(pick(121_000, 1, 0.5).0, "w1");
    // The pick with w1's queue and every view set by `set`.
    let with = |w1_queue: u64, set: &dyn Fn(&mut WorkerView)| {
        let mut ws = measured(&summaries, &[0, w1_queue, 0, 0, 0], 0, 0.0);
        ws.iter_mut().for_each(set);
        ws[p.choose(&req, &ws, &ring(), 16).expect("decision").ranked[0]].id
    };
    // A busy share is not a utilisation here: a fleet that reads busy the whole interval with nothing waiting
    // prices the move as the idle fleet does.
    let busy = |w: &mut WorkerView| w.speed.prefill_busy = 1.0;
    assert_eq!(with(39_000, &busy), "w1");
    assert_ne!(with(41_000, &busy), "w1");
    // A request still computing its prompt counts as one waiting does (it has no first token yet either).
    let prefilling = |w: &mut WorkerView| w.load.prefilling = 1;
    assert_eq!(with(119_000, &prefilling), "w1");
    assert_ne!(with(121_000, &prefilling), "w1");
}

#[test]
fn the_measured_guard_prices_long_contexts_by_the_workers_fit() {
    // The same request on workers that report a fit of their prefill: a = 2.35e-5 s a token, b = 1.05e-9 s a unit
    // of attention area (the H100 profile's). own(w1) = a 4,000 + b 4,000 x (20,000 + 2,000) = 0.18640 s;
    // own(elsewhere) = a 24,000 + b 24,000 x 12,000 = 0.86640 s; copy = a 20,000 + b (2.88e8 - 8.8e7) = 0.68 s.
    // w1's queue: Q tokens of area A; the request moves when a Q + b A + 0.1864 > 0.8664 + 0.68.
    let (req_hashes, summaries, p) = guard_case();
    let req = RequestView {
        hashes: &req_hashes,
        prompt_tokens: 24_000,
        session_key: 9,
        shared_blocks: 0,
        seq: 1,
        output_tokens: 0,
        slo: Slo::default(),
    };
    let (a, b) = (2.35e-5, 1.05e-9);
    let pick = |queue: u64, area: u64| {
        let mut ws = views(&summaries, &[0, queue, 0, 0, 0], &[true; 5]);
        for w in &mut ws {
            // Workers that have computed prompts (a token rate): their fit is their own.
            w.speed = Speed {
                prefill_tokens_per_s: 1.0 / a,
                prefill_per_token_s: a,
                prefill_attention_s: b,
                ..Speed::default()
            };
        }
        ws[1].load.pending_area = area;
        let d = p.choose(&req, &ws, &ring(), 16).expect("decision");
        (ws[d.ranked[0]].id, d.terms[1].predicted_ttft_s, d.terms[0].predicted_ttft_s)
    };
    // 40,000 queued tokens of short prompts (area 40,000 x 1,000): 0.94 + 0.042 s ahead; the request stays.
    let (to, w1, w0) = pick(40_000, 40_000 * 1_000);
    assert_eq!(to, "w1");
    assert!((w1 - (a * 40_000.0 + b * 4e7 + 0.1864)).abs() < 1e-9, "{w1}");
    assert!((w0 - 0.8664).abs() < 1e-9, "{w0}");
    // The same 40,000 tokens as the tail of a 140,000-token prompt (area 40,000 x 120,000): 5.98 s ahead; a token
    // rate alone would not see the difference. The request moves.
    let (to, w1, _) = pick(40_000, 40_000 * 120_000);
    assert_ne!(to, "w1");
    assert!((w1 - (a * 40_000.0 + b * 4.8e9 + 0.1864)).abs() < 1e-9, "{w1}");
}

#[test]
fn the_measured_guard_survives_hostile_or_missing_speeds() {
    let req_hashes = hashes(64, 2);
    let summaries: Vec<Option<CacheSummary>> = vec![None; IDS.len()];
    let p = measured_guard(Weights::default());
    let req = RequestView {
        hashes: &req_hashes,
        prompt_tokens: 1024,
        session_key: 3,
        shared_blocks: 0,
        seq: 4,
        output_tokens: 0,
        slo: Slo::default(),
    };
    for (rate, busy, age) in [
        (f64::NAN, f64::NAN, f64::NAN),
        (f64::INFINITY, f64::INFINITY, f64::INFINITY),
        (-5.0, -1.0, -3.0),
        (0.0, 1.0, 0.0),
    ] {
        let mut ws = views(&summaries, &[5_000, 0, 70_000, 0, 1], &[true; 5]);
        ws[2].speed = Speed {
            prefill_tokens_per_s: rate,
            prefill_busy: busy,
            report_age_s: age,
            prefill_per_token_s: 1.0 / rate,
            prefill_attention_s: busy,
            ..Speed::default()
        };
        let d = p.choose(&req, &ws, &ring(), 16).expect("decision");
        assert!(d.terms.iter().all(|t| t.predicted_s.is_finite() && t.predicted_s >= 0.0), "{:?}", d.terms);
        assert_ne!(ws[d.ranked[0]].id, "w2", "the worker with 70K queued is never the pick");
    }
    // A fit that is finite but absurd (the decoder takes any finite non-negative value): bounded, never infinite.
    let mut ws = views(&summaries, &[5_000, 0, 70_000, 0, 1], &[true; 5]);
    for w in &mut ws {
        w.speed = Speed { prefill_per_token_s: 1e300, prefill_attention_s: 1e300, ..Speed::default() };
        w.load = Load {
            pending_tokens: u64::MAX,
            pending_area: u64::MAX,
            waiting: u64::MAX,
            requests: u64::MAX,
            ..w.load
        };
    }
    let d = p.choose(&req, &ws, &ring(), 16).expect("decision");
    assert!(
        d.terms.iter().all(|t| t.predicted_s.is_finite() && t.predicted_ttft_s.is_finite()),
        "{:?}",
        d.terms
    );
}
