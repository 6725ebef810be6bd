//! Block hashing and Bloom lookups at the sizes the gateway sees per request (32K-token prompt). `hash_blocks_streamed`
//! is the same digest through xxh3's streaming state, as `chain_hash` computed it before #66's profile: the ratio of
//! the two rows, in one run, is what hashing each block in one call saves.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvgate_shared::hashing::{BlockHash, BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::report::BlockBloom;
use std::hint::black_box;

fn hashing(c: &mut Criterion) {
    let mut group = c.benchmark_group("hash_blocks");
    for n in [2_048usize, 32_768, 131_072] {
        let tokens: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_000).collect();
        let hasher = BlockHasher::new(&HashScheme::new(16, 1), &ExtraKeys::from_salt(Some("tenant")));
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &tokens, |b, t| {
            b.iter(|| hasher.hash_blocks(black_box(t)))
        });
    }
    group.finish();
    // The streaming form (the digest is the same: `one_shot_and_streamed_blocks_hash_alike`).
    fn streamed(parent: BlockHash, block: &[u32]) -> BlockHash {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(&parent.0.to_le_bytes());
        let mut buf = [0u8; 256];
        for chunk in block.chunks(64) {
            for (i, t) in chunk.iter().enumerate() {
                buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..chunk.len() * 4]);
        }
        BlockHash(h.digest())
    }
    let tokens: Vec<u32> = (0..32_768u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_000).collect();
    let extra = ExtraKeys::from_salt(Some("tenant"));
    let old = BlockHasher::with_fn(&HashScheme::new(16, 1), &extra, streamed);
    assert_eq!(
        old.hash_blocks(&tokens),
        BlockHasher::new(&HashScheme::new(16, 1), &extra).hash_blocks(&tokens)
    );
    c.bench_function("hash_blocks_streamed/32768", |b| b.iter(|| old.hash_blocks(black_box(&tokens))));

    // The gateway's per-worker prefix check: 2,048 block hashes against a 100K-entry filter (all hits: worst case).
    let hasher = BlockHasher::new(&HashScheme::new(16, 1), &ExtraKeys::none());
    let tokens: Vec<u32> = (0..32_768u32).collect();
    let hashes = hasher.hash_blocks(&tokens);
    let mut bloom = BlockBloom::with_capacity(100_000, 0.01);
    hashes.iter().for_each(|h| bloom.insert(*h));
    c.bench_function("bloom_check_2048_blocks", |b| {
        b.iter(|| black_box(&hashes).iter().take_while(|h| bloom.contains(**h)).count())
    });
    let summary = kvgate_shared::report::CacheSummary { granularity: 1, entries: 2048, bloom };
    c.bench_function("matched_blocks_fast_2048_blocks", |b| {
        b.iter(|| summary.matched_blocks_fast(black_box(&hashes)))
    });
}

criterion_group!(benches, hashing);
criterion_main!(benches);
