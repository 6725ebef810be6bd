//! A large fleet's decisions look into the focus only (`focus.rs`), and pick what a full scan picks once the roots
//! are known: from sends, and from reports checked against the roots.

use std::time::{Duration, Instant};

use kvgate_shared::hashing::{BlockHash, BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::report::{
    BlockBloom, CacheSummary, QueueStats, Throughput, Tier, TierReport, WorkerReport,
};

use crate::registry::{roots, Registry, RegistryConfig};
use crate::route::{RouteInput, Router};
use crate::routing::{policy_by_name, Weights};

const SHARED: usize = 16;

fn registry(full_scan_workers: usize) -> Registry {
    Registry::new(RegistryConfig { full_scan_workers, max_workers: 512, ..RegistryConfig::default() })
}

/// Conversation `c`'s prompt of `blocks` blocks: a shared 256-token system prompt, then its own.
fn prompt(c: u32, blocks: usize) -> Vec<BlockHash> {
    let tokens: Vec<u32> = (0..16 * blocks as u32)
        .map(|t| if (t as usize) < 16 * SHARED { t } else { t * 31 + c * 100_003 })
        .collect();
    BlockHasher::new(&HashScheme::new(16, 1), &ExtraKeys::none()).hash_blocks(&tokens)
}

/// Worker `k`'s report: its summary holds the shared prompt and the prompts in `holds`.
fn report(k: usize, seq: u64, holds: &[&[BlockHash]]) -> WorkerReport {
    let mut bloom = BlockBloom::with_capacity(4_096, 0.001);
    holds.iter().flat_map(|h| h.iter()).for_each(|h| bloom.insert(*h));
    prompt(0, SHARED).iter().for_each(|h| bloom.insert(*h));
    WorkerReport {
        pd: Default::default(),
        lora: Default::default(),
        worker_id: format!("w{k}"),
        advertise_url: format!("http://10.0.0.{k}:8000"),
        model_id: "m".into(),
        scheme: HashScheme::new(16, 1),
        fingerprint: 7,
        seq,
        timestamp_ms: 0,
        instance_id: 1,
        max_model_len: 65_536,
        draining: false,
        queue: QueueStats {
            waiting_requests: 0,
            prefill_tokens: (k as u64 % 5) * 100,
            running_requests: 1,
            prefill_area: 0,
            prefilling_requests: 0,
        },
        throughput: Throughput::default(),
        tiers: vec![TierReport {
            tier: Tier::Device,
            blocks_total: 10_000,
            blocks_free: 1_000,
            blocks_cached: 9_000,
            summary: Some(CacheSummary { granularity: 1, entries: 4_096, bloom }),
        }],
    }
}

fn input(hashes: &[BlockHash], session: u64) -> RouteInput<'_> {
    RouteInput {
        model: "m",
        hashes,
        prompt_tokens: hashes.len() * 16,
        session_key: session,
        shared_blocks: SHARED,
        block_size: 16,
        only: None,
        adapter: None,
        output_tokens: 0,
        slo: crate::routing::Slo::default(),
    }
}

#[test]
fn roots_move_to_the_next_overlay_point() {
    assert_eq!(roots::root_block(0, 100), Some(7));
    assert_eq!(roots::root_block(7, 100), Some(7));
    assert_eq!(roots::root_block(8, 100), Some(15));
    assert_eq!(roots::root_block(16, 20), Some(19), "the last block when no point follows");
    assert_eq!(roots::root_block(20, 20), None);
}

#[test]
fn a_report_that_holds_a_root_puts_its_worker_in_the_focus_and_the_pick_is_the_full_scans() {
    let now = Instant::now();
    let conv = prompt(9, 64);
    let (mut big, mut full) = (registry(8), registry(1_000));
    for reg in [&mut big, &mut full] {
        for k in 0..40 {
            reg.ingest(report(k, 1, &[]), Some(7), now);
        }
    }
    // A worker out of the focus while the root is unknown (not on the ring's first workers nor least loaded).
    let (views, index) = big.focused_views("m", &conv, 5, [Some(0), Some(SHARED)], now);
    let with_summary = views.iter().filter(|v| v.summary.is_some()).count();
    assert!(with_summary <= 8 + 2 + 8, "{with_summary} views have summaries");
    let h = index[views.iter().position(|v| v.summary.is_none()).expect("one out of focus")];
    let id = big.workers()[h].id.clone();
    let k: usize = id[1..].parse().expect("wN");
    for reg in [&mut big, &mut full] {
        reg.ingest(report(k, 2, &[&conv]), Some(7), now);
    }
    let router = Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy"));
    // The full scan finds it at once.
    let want = router.dry_run(&full, &input(&conv, 5), 3, now).expect("routed");
    assert_eq!(want.candidates[0].id, id);
    // The focused fleet has never seen this root: the first request goes by ring and load; the roots are learnt
    // with its pick: the credited shared prompt's (every worker holds it, so it names no conversation's holder) and
    // the conversation's own, past the shared prompt.
    let first = router.route(&mut big, &input(&conv, 5), 3, now).expect("routed");
    assert_ne!(first.candidates[0].id, id);
    assert_eq!(big.roots_len(), 2);
    // The holder's next report is checked against the root: from then on the pick is the full scan's.
    let later = now + Duration::from_secs(4);
    big.ingest(report(k, 3, &[&conv]), Some(7), later);
    for j in (0..40).filter(|j| *j != k) {
        big.ingest(report(j, 3, &[]), Some(7), later);
    }
    full.ingest(report(k, 3, &[&conv]), Some(7), later);
    let got = router.route(&mut big, &input(&conv, 5), 3, later).expect("routed");
    assert_eq!(got.candidates[0].id, id, "first pick {}", first.candidates[0].id);
}

#[test]
fn over_many_conversations_the_focused_picks_are_the_full_scans() {
    // 48 workers, each holding two of 96 conversations in its reports; every conversation routed once (its root
    // is learnt), a report round, then every conversation again on both registries.
    let now = Instant::now();
    let convs: Vec<Vec<BlockHash>> = (0..96).map(|c| prompt(c, 24 + (c as usize % 40))).collect();
    let (mut big, mut full) = (registry(8), registry(1_000));
    let holdings = |k: usize| -> Vec<&[BlockHash]> { vec![&convs[2 * k], &convs[2 * k + 1]] };
    for reg in [&mut big, &mut full] {
        for k in 0..48 {
            reg.ingest(report(k, 1, &holdings(k)), Some(7), now);
        }
    }
    let router = Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy"));
    for (c, h) in convs.iter().enumerate() {
        let r = router.route(&mut big, &input(h, c as u64), 2, now).expect("routed");
        big.record_done(r.ticket.expect("ticket"));
    }
    let later = now + Duration::from_secs(5);
    for reg in [&mut big, &mut full] {
        for k in 0..48 {
            reg.ingest(report(k, 2, &holdings(k)), Some(7), later);
        }
    }
    let (dry_big, dry_full) = (
        Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy")),
        Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy")),
    );
    for (c, h) in convs.iter().enumerate() {
        let a = dry_big.dry_run(&big, &input(h, c as u64), 1, later).expect("routed");
        let b = dry_full.dry_run(&full, &input(h, c as u64), 1, later).expect("routed");
        assert_eq!(a.candidates[0].id, format!("w{}", c / 2), "conversation {c}: its holder");
        assert_eq!(a.candidates[0].id, b.candidates[0].id, "conversation {c}");
        assert_eq!(a.predicted_cached_tokens, b.predicted_cached_tokens, "conversation {c}");
    }
}
