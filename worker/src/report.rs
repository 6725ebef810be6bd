//! What a worker report says, built from pure parts: the Bloom summary of the prefix cache at a granularity, and the
//! report assembled from engine statistics. The server's reporter sends these every interval; the fleet simulator
//! builds its reports with the same functions (so it links no server code).
//!
//! Size: only every `granularity`-th block's chained hash is summarised (block `i` iff `(i + 1) % k == 0`). Because
//! hashes chain, the k-th block's hash stands for the whole prefix up to it; the gateway matches at the same
//! granularity and loses at most `k - 1` blocks of predicted match. Measured trade-off in
//! docs/benchmarks/engine.md.

use kvgate_shared::hashing::HashScheme;
use kvgate_shared::report::{
    BlockBloom, CacheSummary, PdInfo, QueueStats, Throughput, Tier, TierReport, WorkerReport,
};

use crate::engine::EngineStats;
use crate::kv::{KvManager, SharedHost, SharedPool};

/// What a report is built from.
pub struct ReportSource {
    pub worker_id: String,
    pub advertise_url: String,
    pub model_id: String,
    pub scheme: HashScheme,
    pub granularity: u32,
    pub fp_rate: f64,
    /// Random per process (see `WorkerReport::instance_id`).
    pub instance_id: u64,
    /// The model's context length.
    pub max_model_len: u32,
    /// Its role and KV transfer listener.
    pub pd: PdInfo,
}

/// The Bloom summaries of a report: the device pool's, and the lower tiers' when there are some.
pub struct Summaries {
    pub device: CacheSummary,
    pub host: Option<CacheSummary>,
    pub disk: Option<CacheSummary>,
}

/// Builds the Bloom summary of the pool's cached blocks at a granularity.
pub fn summarise(pool: &SharedPool, granularity: u32, fp_rate: f64) -> CacheSummary {
    let g = granularity.max(1);
    let hashes: Vec<_> = {
        let pool = pool.lock();
        pool.cached_entries().filter(|(_, i)| (i + 1) % g == 0).map(|(h, _)| h).collect()
    };
    bloom_of(hashes, g, fp_rate)
}

/// The same for the host tier's blocks.
pub fn summarise_host(host: &SharedHost, granularity: u32, fp_rate: f64) -> CacheSummary {
    let g = granularity.max(1);
    let hashes: Vec<_> = host.lock().entries().filter(|(_, i)| (i + 1) % g == 0).map(|(h, _)| h).collect();
    bloom_of(hashes, g, fp_rate)
}

/// The summaries of a pool and its lower tiers.
pub fn summarise_tiers(kv: &KvManager, granularity: u32, fp_rate: f64) -> Summaries {
    let g = granularity.max(1);
    Summaries {
        device: summarise(kv.pool(), granularity, fp_rate),
        host: kv.host().map(|h| summarise_host(h, granularity, fp_rate)),
        disk: kv.disk().map(|d| {
            let hashes: Vec<_> =
                d.index().entries().filter(|(_, i)| (i + 1) % g == 0).map(|(h, _)| h).collect();
            bloom_of(hashes, g, fp_rate)
        }),
    }
}

fn bloom_of(hashes: Vec<kvgate_shared::hashing::BlockHash>, g: u32, fp_rate: f64) -> CacheSummary {
    let mut bloom = BlockBloom::with_capacity(hashes.len(), fp_rate);
    for h in &hashes {
        bloom.insert(*h);
    }
    CacheSummary { granularity: g, entries: hashes.len() as u64, bloom }
}

impl ReportSource {
    /// A report from its parts (pure: the fleet simulator builds its reports with this too).
    pub fn assemble(
        &self,
        seq: u64,
        timestamp_ms: u64,
        s: &EngineStats,
        throughput: Throughput,
        summaries: Summaries,
        draining: bool,
    ) -> WorkerReport {
        let mut tiers = vec![TierReport {
            tier: Tier::Device,
            blocks_total: s.blocks_total as u64,
            blocks_free: s.blocks_free as u64,
            blocks_cached: s.blocks_cached as u64,
            summary: Some(summaries.device),
        }];
        // A lower tier holds only cached blocks: what it does not hold is free.
        let lower = |tier, total: usize, cached: usize, summary| TierReport {
            tier,
            blocks_total: total as u64,
            blocks_free: total.saturating_sub(cached) as u64,
            blocks_cached: cached as u64,
            summary: Some(summary),
        };
        tiers.extend(summaries.host.map(|h| lower(Tier::Host, s.host_blocks_total, s.host_blocks_cached, h)));
        tiers.extend(summaries.disk.map(|d| lower(Tier::Disk, s.disk_blocks_total, s.disk_blocks_cached, d)));
        WorkerReport {
            pd: self.pd.clone(),
            worker_id: self.worker_id.clone(),
            advertise_url: self.advertise_url.clone(),
            model_id: self.model_id.clone(),
            scheme: self.scheme,
            fingerprint: self.scheme.fingerprint(),
            seq,
            timestamp_ms,
            instance_id: self.instance_id,
            max_model_len: self.max_model_len,
            draining,
            queue: QueueStats {
                waiting_requests: s.waiting_requests as u32,
                prefill_tokens: s.prefill_tokens,
                running_requests: s.running_requests as u32,
                prefill_area: s.prefill_area,
                prefilling_requests: s.prefilling_requests.min(s.running_requests) as u32,
            },
            throughput,
            tiers,
            // The server sets what it holds (`server::adapters`); the simulator's workers hold none.
            lora: Default::default(),
        }
    }
}
