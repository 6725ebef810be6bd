//! Report size and build cost against summary granularity, for a worker holding a million tokens of KV, and
//! what granularity costs in matched-length precision.
//!
//! `cargo bench -p kvgate-worker --bench report`

use std::time::Instant;

use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::report::{QueueStats, Throughput, Tier, TierReport, WorkerReport};
use kvgate_worker::kv::{BlockKey, BlockPool, Parent, SharedPool};
use kvgate_worker::report::summarise;

fn main() {
    let block = 16usize;
    let kv_tokens = 1_000_000usize;
    let num_blocks = kv_tokens / block;
    // 31 cached conversations of ~32K tokens (2,016 blocks each) fill the pool.
    let scheme = HashScheme::new(block as u32, 1);
    let mut pool = BlockPool::new(num_blocks, block);
    let mut seqs = Vec::new();
    let per_seq = 2016;
    for s in 0..num_blocks / per_seq {
        let tokens: Vec<u32> =
            (0..(per_seq * block) as u32).map(|t| t.wrapping_mul(2_654_435_761) ^ s as u32).collect();
        let hasher = BlockHasher::new(&scheme, &ExtraKeys::none());
        let hashes = hasher.hash_blocks(&tokens);
        let ids = pool.allocate(per_seq).expect("room");
        let mut parent = Parent::Root(hasher.root_id());
        for (i, (id, h)) in ids.iter().zip(&hashes).enumerate() {
            let key = BlockKey { hash: *h, check: 0, parent_hash: i.checked_sub(1).map(|j| hashes[j]) };
            let uid = pool
                .register(*id, i, key, parent, &tokens[i * block..(i + 1) * block])
                .expect("no collision");
            parent = Parent::Block(uid.uid());
        }
        seqs.push(hashes);
    }
    let cached = pool.num_cached();
    let shared = SharedPool::new(pool);
    println!("worker KV: {kv_tokens} tokens, {cached} cached blocks of {block} tokens; Bloom at 1% false positives\n");
    println!(
        "| granularity k | entries | report bytes | bytes/s at 1 report/s | build ms | matched-length loss |"
    );
    println!("|---|---|---|---|---|---|");
    for k in [1u32, 2, 4, 8, 16, 32] {
        let t = Instant::now();
        let summary = summarise(&shared, k, 0.01);
        let build_ms = t.elapsed().as_secs_f64() * 1e3;
        let entries = summary.entries;
        // Precision: for random true prefix lengths, how many blocks the summary under-reports.
        let mut lost = 0usize;
        let mut trials = 0usize;
        for (s, hashes) in seqs.iter().enumerate() {
            for cut in [1usize, 7, 63, 500, 1001, 2015] {
                let true_len = (cut + s) % per_seq + 1;
                lost += true_len - summary.matched_blocks(&hashes[..true_len]).min(true_len);
                trials += 1;
            }
        }
        let report = WorkerReport {
            pd: Default::default(),
            lora: Default::default(),
            worker_id: "w".into(),
            advertise_url: "http://10.0.0.1:8000".into(),
            model_id: "m".into(),
            scheme,
            fingerprint: scheme.fingerprint(),
            seq: 1,
            timestamp_ms: 0,
            instance_id: 1,
            max_model_len: 131_072,
            draining: false,
            queue: QueueStats::default(),
            throughput: Throughput::default(),
            tiers: vec![TierReport {
                tier: Tier::Device,
                blocks_total: num_blocks as u64,
                blocks_free: 0,
                blocks_cached: cached as u64,
                summary: Some(summary),
            }],
        };
        let bytes = report.encode().len();
        println!(
            "| {k} | {entries} | {bytes} | {:.1} KB/s | {build_ms:.1} | {:.1} blocks ({:.0} tokens) on average |",
            bytes as f64 / 1024.0,
            lost as f64 / trials as f64,
            lost as f64 / trials as f64 * block as f64
        );
    }
}
