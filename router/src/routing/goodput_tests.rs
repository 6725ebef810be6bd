//! The goodput guard on hand-built worker states: a decode pile-up, an SLO the winner would miss, a pool too full
//! for the request, and hostile fits.

use kvgate_shared::hashing::{BlockHash, BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::report::{BlockBloom, CacheSummary};

use crate::routing::{
    hotspot::GuardKind, CacheAware, Load, PrefixSignal, RequestView, Ring, RoutingPolicy, Slo, Speed,
    Weights, WorkerView,
};

const IDS: [&str; 3] = ["w0", "w1", "w2"];

fn hashes(n_blocks: usize) -> Vec<BlockHash> {
    let tokens: Vec<u32> = (0..16 * n_blocks as u32).map(|t| t * 7 + 3).collect();
    BlockHasher::new(&HashScheme::new(16, 1), &ExtraKeys::none()).hash_blocks(&tokens)
}

fn summary_of(hashes: &[BlockHash]) -> CacheSummary {
    let mut bloom = BlockBloom::with_capacity(hashes.len().max(1), 0.001);
    hashes.iter().for_each(|h| bloom.insert(*h));
    CacheSummary { granularity: 1, entries: hashes.len() as u64, bloom }
}

/// The CPU worker's fits (worker/profiles/cpu-small.toml, prefill per token taken as 1e-4 s), idle, a pool of
/// 64K tokens mostly free.
fn cpu_speed() -> Speed {
    Speed {
        prefill_tokens_per_s: 10_000.0,
        prefill_per_token_s: 1e-4,
        prefill_attention_s: 4.8e-7,
        decode_base_s: 0.000_945,
        decode_per_seq_s: 0.000_534,
        decode_per_kv_token_s: 0.000_004_92,
        kv_total_tokens: 65_536,
        kv_free_tokens: 60_000,
        kv_cached_tokens: 2_000,
        ..Speed::default()
    }
}

fn views(summaries: &[Option<CacheSummary>]) -> Vec<WorkerView<'_>> {
    IDS.iter()
        .enumerate()
        .map(|(i, id)| WorkerView {
            id,
            slot: i,
            healthy: true,
            summary: summaries[i].as_ref(),
            host_summary: None,
            disk_summary: None,
            overlay_matched_blocks: 0,
            prefix_signal: PrefixSignal::Report,
            load: Load::default(),
            sessions: 0,
            holds_session: false,
            speed: cpu_speed(),
        })
        .collect()
}

fn req(h: &[BlockHash], output_tokens: u64) -> RequestView<'_> {
    RequestView {
        hashes: h,
        prompt_tokens: h.len() * 16,
        session_key: 11,
        shared_blocks: 0,
        seq: 1,
        output_tokens,
        slo: Slo::default(),
    }
}

fn pick(guard: GuardKind, r: &RequestView<'_>, ws: &[WorkerView<'_>]) -> &'static str {
    let d = CacheAware::with_guard(Weights::default(), guard)
        .choose(r, ws, &Ring::new(IDS, 64), 16)
        .expect("decision");
    IDS[d.ranked[0]]
}

/// w1 holds the prompt's first 48 of 64 blocks and decodes for `streams` users.
fn crowded(summaries: &[Option<CacheSummary>], streams: u64) -> Vec<WorkerView<'_>> {
    let mut ws = views(summaries);
    ws[1].load = Load { requests: streams, ..Load::default() };
    ws[1].speed.decoding = streams;
    ws[1].speed.kv_free_tokens = 60_000u64.saturating_sub(streams.saturating_mul(1_500));
    ws
}

#[test]
fn a_conversation_is_not_parked_where_its_answer_would_crawl() {
    let h = hashes(64);
    let summaries = vec![None, Some(summary_of(&h[..48])), None];
    // Eight streams at w1: the prefix there saves 768 tokens of prefill (about 0.3 s), but 256 tokens decoded in a
    // batch of nine cost it and the eight others several seconds. The measured guard sees only the prefill.
    let ws = crowded(&summaries, 8);
    assert_eq!(pick(GuardKind::Measured, &req(&h, 256), &ws), "w1");
    assert_ne!(pick(GuardKind::Goodput, &req(&h, 256), &ws), "w1");
    // One stream there and a short answer: the prefix is worth more than a batch of two costs. It stays.
    let ws = crowded(&summaries, 1);
    assert_eq!(pick(GuardKind::Goodput, &req(&h, 64), &ws), "w1");
    // A request that generates one token joins no batch for long: the cache decides.
    let ws = crowded(&summaries, 8);
    assert_eq!(pick(GuardKind::Goodput, &req(&h, 1), &ws), "w1");
}

#[test]
fn a_worker_that_would_miss_the_tpot_slo_loses_to_one_that_meets_it() {
    let h = hashes(64);
    let summaries = vec![None, Some(summary_of(&h[..64])), None];
    let mut ws = crowded(&summaries, 2);
    // w1's steps are slow (its prefill chunks stall them 80%); its TPOT is past the 200 ms bound.
    ws[1].speed.decode_base_s = 0.05;
    ws[1].speed.stall_ratio = 0.8;
    let w = Weights { w_decode: 0.0, slo_filter: true, ..Weights::default() };
    let d = CacheAware::with_guard(w, GuardKind::Goodput)
        .choose(&req(&h, 16), &ws, &Ring::new(IDS, 64), 16)
        .expect("decision");
    let w1 = &d.terms[1];
    assert!(w1.predicted_tpot_s > 0.2 && w1.meets_slo == Some(false), "{w1:?}");
    assert_ne!(IDS[d.ranked[0]], "w1", "the SLO, not the decode cost (weighted 0 here), moved it");
    assert!(d.terms[d.ranked[0]].meets_slo == Some(true));
}

#[test]
fn a_pool_full_of_other_sessions_prefixes_is_priced_by_what_it_would_evict() {
    let h = hashes(64);
    let summaries = vec![None, None, None];
    let mut ws = views(&summaries);
    // No worker holds the prompt. w0 and w1 are full of cached prefixes (their free blocks all hold some); w2's
    // free blocks hold none.
    for w in &mut ws[..2] {
        w.speed.kv_cached_tokens = 65_536;
    }
    let p = CacheAware::with_guard(Weights::default(), GuardKind::Goodput);
    let d = p.choose(&req(&h, 256), &ws, &Ring::new(IDS, 64), 16).expect("decision");
    assert_eq!(IDS[d.ranked[0]], "w2", "{:?}", d.terms);
    assert!(d.terms[0].goodput_cost_s > d.terms[2].goodput_cost_s, "{:?}", d.terms);
    // Without the eviction term the three are alike: the score decides, and the terms say so.
    let p = CacheAware::with_guard(Weights { w_evict: 0.0, ..Weights::default() }, GuardKind::Goodput);
    let d = p.choose(&req(&h, 256), &ws, &Ring::new(IDS, 64), 16).expect("decision");
    assert!((d.terms[0].goodput_cost_s - d.terms[2].goodput_cost_s).abs() < 1e-9, "{:?}", d.terms);
}

#[test]
fn hostile_fits_and_pools_give_finite_terms() {
    let h = hashes(64);
    let summaries = vec![None, Some(summary_of(&h[..48])), None];
    for v in [f64::NAN, f64::INFINITY, -1.0, 1e300] {
        let mut ws = crowded(&summaries, u64::MAX);
        for w in &mut ws {
            w.speed.decode_base_s = v;
            w.speed.decode_per_seq_s = v;
            w.speed.decode_per_kv_token_s = v;
            w.speed.stall_ratio = v;
            w.speed.decoding = u64::MAX;
            w.speed.kv_total_tokens = u64::MAX;
            w.speed.kv_cached_tokens = u64::MAX;
        }
        let d = CacheAware::with_guard(Weights::default(), GuardKind::Goodput)
            .choose(&req(&h, u64::MAX), &ws, &Ring::new(IDS, 64), 16)
            .expect("decision");
        for t in &d.terms {
            assert!(t.goodput_cost_s.is_finite() && t.goodput_cost_s >= 0.0, "{v}: {t:?}");
            assert!(t.predicted_tpot_s.is_finite() && t.predicted_tpot_s >= 0.0, "{v}: {t:?}");
        }
    }
}
