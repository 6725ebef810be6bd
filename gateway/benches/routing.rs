//! Decision cost of the gateway: hash a 32K-token prompt and score 16 workers (the default policy,
//! `cache_aware_measured`), the work done per
//! request before forwarding.

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_gateway::routing::{
    policy_by_name, ring, Load, PrefixSignal, RequestView, Ring, Weights, WorkerView, DEFAULT_POLICY,
};
use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::report::{BlockBloom, CacheSummary};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let scheme = HashScheme::new(16, 1);
    let tokens: Vec<u32> = (0..32_768u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_000).collect();
    let hasher = BlockHasher::new(&scheme, &ExtraKeys::none());
    let hashes = hasher.hash_blocks(&tokens);
    // 16 workers, each caching 100K blocks at granularity 4; worker k holds the first k/16 of this prompt.
    let ids: Vec<String> = (0..16).map(|i| format!("worker-{i}")).collect();
    let summaries: Vec<CacheSummary> = (0..16)
        .map(|k| {
            let mut bloom = BlockBloom::with_capacity(25_000, 0.01);
            let upto = hashes.len() * k / 16;
            for (i, h) in hashes.iter().enumerate().take(upto) {
                if (i + 1) % 4 == 0 {
                    bloom.insert(*h);
                }
            }
            for j in 0..(25_000 - upto / 4) as u64 {
                bloom.insert(kvgate_shared::hashing::BlockHash(
                    j.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ k as u64,
                ));
            }
            CacheSummary { granularity: 4, entries: 25_000, bloom }
        })
        .collect();
    let ring = Ring::new(ids.iter().map(String::as_str), ring::DEFAULT_VNODES);
    let policy = policy_by_name(DEFAULT_POLICY, Weights::default()).expect("the default policy");
    c.bench_function("hash_32k_and_score_16_workers", |b| {
        b.iter(|| {
            let hashes = hasher.hash_blocks(black_box(&tokens));
            let views: Vec<WorkerView<'_>> = ids
                .iter()
                .zip(&summaries)
                .enumerate()
                .map(|(i, (id, s))| WorkerView {
                    id,
                    slot: i,
                    healthy: true,
                    summary: Some(s),
                    host_summary: None,
                    disk_summary: None,
                    overlay_matched_blocks: 0,
                    prefix_signal: PrefixSignal::Report,
                    load: Load {
                        pending_tokens: i as u64 * 100,
                        requests: 1,
                        waiting: 0,
                        pending_area: 0,
                        prefilling: 0,
                    },
                    sessions: 0,
                    holds_session: false,
                    speed: Default::default(),
                })
                .collect();
            let req = RequestView {
                hashes: &hashes,
                prompt_tokens: tokens.len(),
                session_key: 42,
                shared_blocks: 0,
                seq: 7,
                output_tokens: 256,
                slo: kvgate_router::routing::Slo::default(),
            };
            policy.choose(&req, &views, &ring, 16).map(|d| d.ranked[0])
        })
    });
    let views: Vec<WorkerView<'_>> = ids
        .iter()
        .zip(&summaries)
        .enumerate()
        .map(|(slot, (id, s))| WorkerView {
            id,
            slot,
            healthy: true,
            summary: Some(s),
            host_summary: None,
            disk_summary: None,
            overlay_matched_blocks: 0,
            prefix_signal: PrefixSignal::Report,
            load: Load::default(),
            sessions: 0,
            holds_session: false,
            speed: Default::default(),
        })
        .collect();
    c.bench_function("score_16_workers_only", |b| {
        b.iter(|| {
            let req = RequestView {
                hashes: black_box(&hashes),
                prompt_tokens: tokens.len(),
                session_key: 42,
                shared_blocks: 0,
                seq: 7,
                output_tokens: 256,
                slo: kvgate_router::routing::Slo::default(),
            };
            policy.choose(&req, &views, &ring, 16).map(|d| d.ranked[0])
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
