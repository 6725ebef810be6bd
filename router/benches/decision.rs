//! Decision cost at fleet scale: hash a 32K-token prompt and route it (`Router::route`: the registry's views, the
//! ring, the policy's scores, the send recorded), through 16, 64, 256 and 1,024 reporting workers, for the default
//! policy (`DEFAULT_POLICY`), the measured guard (`cache_aware_measured`) and the token-threshold baseline
//! (`cache_aware`).
//!
//! Every worker reports a device Bloom summary of 25K entries at granularity 4 (its own conversations), all of them
//! hold the fleet's shared 1K-token system prompt, and two hold this request's conversation (one 50% of the prompt,
//! one 90%); the request's ring key is its conversation's. The ring is the registry's (64 virtual nodes a worker).
//!
//! `cargo bench -p kvgate-router --bench decision`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvgate_router::registry::{Registry, RegistryConfig};
use kvgate_router::route::{RouteInput, Router};
use kvgate_router::routing::{policy_by_name, Weights, DEFAULT_POLICY};
use kvgate_shared::hashing::{BlockHash, BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::report::{
    BlockBloom, CacheSummary, QueueStats, Throughput, Tier, TierReport, WorkerReport,
};

const SHARED_BLOCKS: usize = 64;
const FINGERPRINT: u64 = 7;

fn report(k: usize, hashes: &[BlockHash], holds: usize) -> WorkerReport {
    let mut bloom = BlockBloom::with_capacity(25_000, 0.01);
    // The shared system prompt, this request's first `holds` blocks, then the worker's own conversations.
    let upto = holds.max(SHARED_BLOCKS);
    for (i, h) in hashes.iter().enumerate().take(upto) {
        if (i + 1) % 4 == 0 {
            bloom.insert(*h);
        }
    }
    for j in 0..(25_000 - upto / 4) as u64 {
        bloom.insert(BlockHash(j.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((k as u64) << 40)));
    }
    WorkerReport {
        pd: Default::default(),
        lora: Default::default(),
        worker_id: format!("worker-{k}"),
        advertise_url: format!("http://10.0.{}.{}:8000", k / 256, k % 256),
        model_id: "m".into(),
        scheme: HashScheme::new(16, 1),
        fingerprint: FINGERPRINT,
        seq: 1,
        timestamp_ms: 0,
        instance_id: 1,
        max_model_len: 131_072,
        draining: false,
        queue: QueueStats {
            waiting_requests: (k % 3) as u32,
            prefill_tokens: (k as u64 % 7) * 512,
            running_requests: 4,
            prefill_area: 0,
            prefilling_requests: 0,
        },
        throughput: Throughput::default(),
        tiers: vec![TierReport {
            tier: Tier::Device,
            blocks_total: 100_000,
            blocks_free: 10_000,
            blocks_cached: 90_000,
            summary: Some(CacheSummary { granularity: 4, entries: 25_000, bloom }),
        }],
    }
}

fn bench(c: &mut Criterion) {
    let scheme = HashScheme::new(16, 1);
    let tokens: Vec<u32> = (0..32_768u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_000).collect();
    let hasher = BlockHasher::new(&scheme, &ExtraKeys::none());
    let hashes = hasher.hash_blocks(&tokens);
    let mut group = c.benchmark_group("hash_32k_and_route");
    // The default policy and the token-threshold baseline side by side (the measured guard prices every candidate).
    let mut policies = vec![DEFAULT_POLICY, "cache_aware_measured", "cache_aware"];
    policies.dedup();
    for (policy, n) in
        policies.into_iter().flat_map(|p| [16usize, 64, 256, 1024].into_iter().map(move |n| (p, n)))
    {
        // Built on first use, not before: a filtered run (`-- goodput/1024`) builds only the fleet it times
        // (criterion calls the closure once per sample batch).
        let mut fleet: Option<(Registry, Router, Instant)> = None;
        group.bench_with_input(BenchmarkId::new(policy, n), &n, |b, _| {
            let (reg, router, at) = fleet.get_or_insert_with(|| {
                let mut reg =
                    Registry::new(RegistryConfig { max_workers: 4096, ..RegistryConfig::default() });
                let now = Instant::now();
                for k in 0..n {
                    let holds = match k {
                        3 => hashes.len() / 2,
                        7 => hashes.len() * 9 / 10,
                        _ => 0,
                    };
                    reg.ingest(report(k, &hashes, holds), Some(FINGERPRINT), now);
                }
                let router = Router::new(policy_by_name(policy, Weights::default()).expect("policy"));
                (reg, router, now + Duration::from_millis(100))
            });
            b.iter(|| {
                let hashes = hasher.hash_blocks(black_box(&tokens));
                let input = RouteInput {
                    model: "m",
                    hashes: &hashes,
                    prompt_tokens: tokens.len(),
                    session_key: hashes[SHARED_BLOCKS].0,
                    shared_blocks: SHARED_BLOCKS,
                    block_size: 16,
                    only: None,
                    adapter: None,
                    output_tokens: 256,
                    slo: kvgate_router::routing::Slo::default(),
                };
                let routed = router.route(reg, &input, 3, *at).expect("routed");
                let pick = routed.candidates[0].id.clone();
                if let Some(t) = routed.ticket {
                    reg.record_done(t);
                }
                pick
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
