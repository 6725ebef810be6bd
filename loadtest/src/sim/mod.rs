//! `kvgate-loadtest simulate`: replays a Mooncake trace in virtual time through the gateway's real routing code
//! and each worker's real scheduler, block manager and prefix cache, with a timing model for the math. A whole
//! trace takes seconds. Also computes the oracle (one global LRU of the fleet's capacity) and the offered load.
//!
//! A step costs what the profile's timing model says of what it carries (prefill chunks beside decodes, as the
//! engine schedules them; `kvgate_worker::engine::timing`); the real scheduler decides batches, KV occupancy,
//! preemption and recompute. Each request's TTFT, TPOT (after its first token) and E2E are measured, and goodput
//! is the completion tokens per second of the requests that met the SLOs (`SimConfig::slo`). The workers report
//! as real ones do, their prefill and decode fits included, so the policies see only what the gateway sees; the
//! output a request will produce is shown to them as the gateway learns it (a moving mean of completed outputs),
//! never the trace's own.
//!
//! - `fleet`: the event loop (arrivals, admission, step ends, 1 s reports);
//! - `admission`: the gateway's class budgets in virtual time (with `SimConfig::classes`);
//! - `oracle`: the global-LRU upper bound;
//! - `workload`: offered work per request (what `--target-load` scales by).

pub mod adapters;
mod admission;
pub mod fleet;
pub mod oracle;
pub mod pd;
pub mod workload;

use std::collections::BTreeMap;

use kvgate_router::admission::ClassConfig;
use kvgate_router::registry::RegistryConfig;
use kvgate_router::routing::{policy_by_name, Slo, Weights, POLICIES};
use kvgate_shared::hashing::HashScheme;
use kvgate_worker::engine::timing::SimProfile;
use kvgate_worker::engine::SchedulerConfig;
use serde::Serialize;

use crate::stats::percentile;
use crate::trace::Trace;
use oracle::Oracle;

/// The tokenizer digest of the simulated fleet's hash scheme (workers and gateway agree on it).
pub const SIM_TOKENIZER_DIGEST: u64 = 0x6B76_6761_7465_5349; // "kvgateSI"

/// Everything a replay needs besides the trace and the policy.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub workers: usize,
    pub kv_tokens_per_worker: usize,
    pub profile: SimProfile,
    pub scheduler: SchedulerConfig,
    /// Routing weights (`cache_aware`; `least_load` uses `per_request_tokens`).
    pub weights: Weights,
    /// The gateway's registry timing (defaults: the gateway's).
    pub registry: RegistryConfig,
    pub report_interval_s: f64,
    pub summary_granularity: u32,
    pub bloom_fp_rate: f64,
    pub block_size: u32,
    /// Token ids the expanded prompts use.
    pub vocab: u32,
    /// The gateway's admission classes (empty: no admission, every request routed on arrival).
    pub classes: Vec<ClassConfig>,
    /// The gateway's ring-key sketch (`--ring-hub-fanout`, `--ring-sketch-entries`; defaults: the gateway's).
    pub ring_hub_fanout: usize,
    pub ring_sketch_entries: usize,
    /// Gateway replicas (`--gateway-replicas`, default 1): request `i` goes to replica `i mod n`, each with its own
    /// registry (load and overlay of its own sends) and ring-key sketch; every worker reports to every replica.
    pub gateway_replicas: usize,
    /// Replicas share their sends as the gateway's `--share-sends` does (`--share-sends`): each send, as a
    /// `SharedSend` (overlay points, uncached tokens, ring key), reaches the other replicas `share_delay_s` later
    /// and counts there until the worker's next report.
    pub share_sends: bool,
    /// How long a shared send takes to reach the other replicas (`--share-delay-ms`, default 1 ms: what the
    /// gateway's shared_state test measures between real replicas and a local Redis).
    pub share_delay_s: f64,
    /// Each worker's host DRAM tier in tokens (`--host-kv-tokens-per-worker`, default 0: none), at the backend's
    /// 131,072 bytes a token; loads cost the profile's `host_load_s_per_byte`.
    pub host_kv_tokens_per_worker: usize,
    /// When blocks go down to the host tier (`--kv-write-policy`, default write-back).
    pub kv_write_policy: kvgate_worker::kv::WritePolicy,
    /// Each worker's SSD tier in tokens (`--disk-kv-tokens-per-worker`, default 0: none; segment files in a
    /// temporary directory); loads cost the profile's `disk_load_s_per_byte`.
    pub disk_kv_tokens_per_worker: usize,
    /// Load vs recompute (`--kv-load-policy`, default auto: costs from the profile).
    pub kv_load_policy: kvgate_worker::kv::LoadPolicy,
    /// Workers of different KV sizes (`--kv-spread`, default 0: all equal): worker `i` of `n` holds
    /// `kv_tokens_per_worker x (1 + kv_spread x (2i / (n - 1) - 1))`, the same total (0..1).
    pub kv_spread: f64,
    /// Workers of different speeds (`--speed-spread`, default 0: all the profile's): worker `i` of `n` computes
    /// `1 + speed_spread x (2i / (n - 1) - 1)` times as fast as the profile (every compute term of its timing
    /// divided by that; the tiers' load costs kept), the same total speed (0..1). Mixed accelerator generations.
    pub speed_spread: f64,
    /// LoRA adapters (`--adapters`, `--adapter-*`; default none): which requests name one, what workers hold and
    /// where the gateway places them (`adapters.rs`).
    pub adapters: Option<adapters::AdapterSim>,
    /// The SLOs a completed request's tokens must meet to count as goodput (`--slo-*`; default [`Slo::default`]), and
    /// that every request is routed to meet: with admission classes too (their own `slo` tables are not read here).
    pub slo: Slo,
}

impl SimConfig {
    /// Defaults of the worker (block size 16, summary every 4th block at 1% false positives, scheduler 2048
    /// batched tokens / 64 sequences) and of the gateway (stale after 3 s, dead after 10 s, overlay 3 s, 64
    /// vnodes, default weights), with 1 s reports.
    pub fn new(workers: usize, kv_tokens_per_worker: usize, profile: SimProfile) -> Self {
        Self {
            workers,
            kv_tokens_per_worker,
            profile,
            scheduler: SchedulerConfig::default(),
            weights: Weights::default(),
            registry: RegistryConfig {
                stale_after: std::time::Duration::from_secs(3),
                dead_after: std::time::Duration::from_secs(10),
                overlay_ttl: std::time::Duration::from_secs(3),
                vnodes: 64,
                ..RegistryConfig::default()
            },
            report_interval_s: 1.0,
            summary_granularity: 4,
            bloom_fp_rate: 0.01,
            block_size: 16,
            vocab: 32_000,
            classes: Vec::new(),
            ring_hub_fanout: kvgate_router::routing::ring_key::DEFAULT_HUB_FANOUT,
            ring_sketch_entries: kvgate_router::routing::ring_key::DEFAULT_SKETCH_ENTRIES,
            gateway_replicas: 1,
            share_sends: false,
            share_delay_s: 0.001,
            host_kv_tokens_per_worker: 0,
            kv_write_policy: kvgate_worker::kv::WritePolicy::WriteBack,
            disk_kv_tokens_per_worker: 0,
            kv_load_policy: kvgate_worker::kv::LoadPolicy::Auto,
            kv_spread: 0.0,
            speed_spread: 0.0,
            adapters: None,
            slo: Slo::default(),
        }
    }

    /// `1 + spread x (2i / (n - 1) - 1)`: worker `i`'s share of a spread that keeps the fleet's total.
    fn spread_of(&self, spread: f64, i: usize) -> f64 {
        if self.workers > 1 {
            1.0 + spread * (2.0 * i as f64 / (self.workers - 1) as f64 - 1.0)
        } else {
            1.0
        }
    }

    /// Worker `i`'s timing (`speed_spread`): the profile's compute terms over its speed.
    pub fn timing_of(&self, i: usize) -> kvgate_worker::engine::timing::TimingModel {
        let t = self.profile.timing;
        let s = self.spread_of(self.speed_spread, i);
        kvgate_worker::engine::timing::TimingModel {
            prefill_base_s: t.prefill_base_s / s,
            prefill_per_token_s: t.prefill_per_token_s / s,
            prefill_attention_s: t.prefill_attention_s / s,
            decode_base_s: t.decode_base_s / s,
            decode_per_seq_s: t.decode_per_seq_s / s,
            decode_per_kv_token_s: t.decode_per_kv_token_s / s,
            ..t
        }
    }

    /// KV tokens worker `i` holds (`kv_spread`), a whole number of blocks.
    pub fn kv_tokens_of(&self, i: usize) -> usize {
        let scale = self.spread_of(self.kv_spread, i);
        let b = self.block_size.max(1) as usize;
        ((self.kv_tokens_per_worker as f64 * scale) as usize / b).max(1) * b
    }

    pub fn scheme(&self) -> HashScheme {
        HashScheme::new(self.block_size, SIM_TOKENIZER_DIGEST)
    }

    /// Every problem with the values.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.workers == 0 {
            p.push("workers must be at least 1".into());
        }
        if !(1..=64).contains(&self.gateway_replicas) {
            p.push(format!("gateway-replicas {} is not in 1..=64", self.gateway_replicas));
        }
        if !(self.share_delay_s >= 0.0 && self.share_delay_s <= 60.0) {
            p.push(format!("share delay {} s is not in 0..=60 s", self.share_delay_s));
        }
        if self.kv_tokens_per_worker < self.block_size as usize {
            p.push(format!("kv-tokens-per-worker {} holds less than one block", self.kv_tokens_per_worker));
        }
        if !(0.0..1.0).contains(&self.kv_spread) {
            p.push(format!("kv-spread {} is not in 0..1", self.kv_spread));
        }
        if !(0.0..1.0).contains(&self.speed_spread) {
            p.push(format!("speed-spread {} is not in 0..1", self.speed_spread));
        }
        if !(self.report_interval_s > 0.0 && self.report_interval_s.is_finite()) {
            p.push("report interval must be > 0".into());
        }
        p.extend(self.weights.validate());
        p.extend(self.slo.validate());
        if !(2..=kvgate_router::routing::ring_key::MAX_HUB_FANOUT).contains(&self.ring_hub_fanout) {
            p.push(format!("ring-hub-fanout {} is not in 2..=8", self.ring_hub_fanout));
        }
        if !self.classes.is_empty() {
            p.extend(kvgate_router::admission::classes::validate(&self.classes));
        }
        p.extend(self.profile.timing.validate());
        p.extend(self.adapters.as_ref().map(adapters::AdapterSim::validate).unwrap_or_default());
        p
    }
}

/// How arrivals are paced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pace {
    /// Arrival times are multiplied by this (0.5 = twice as fast as recorded).
    TimeScale(f64),
    /// Arrival times are scaled so that the offered load (see `workload`) is this fraction of the fleet.
    TargetLoad(f64),
}

/// What every policy's replay shares: the oracle, the offered work and the resolved pace.
#[derive(Clone, Debug)]
pub struct ReplayPlan {
    pub oracle: Oracle,
    pub offered_work_s: f64,
    pub time_scale: f64,
    pub offered_load: f64,
}

/// Computes the oracle and resolves the pace.
pub fn prepare(trace: &Trace, cfg: &SimConfig, pace: Pace) -> Result<ReplayPlan, String> {
    let problems = cfg.validate();
    if !problems.is_empty() {
        return Err(problems.join("; "));
    }
    let capacity: usize = (0..cfg.workers).map(|i| cfg.kv_tokens_of(i)).sum();
    let oracle = oracle::run(trace, capacity, &cfg.scheme(), cfg.vocab);
    let timing = &cfg.profile.timing;
    let offered_work_s: f64 = trace
        .requests
        .iter()
        .zip(&oracle.cached)
        .map(|(r, c)| {
            let max_batched = cfg.scheduler.max_num_batched_tokens;
            workload::request_work_s(timing, max_batched, r.input_length, *c, r.output_length.max(1))
        })
        .sum();
    let span = trace.span_s();
    let fleet_s = cfg.workers as f64 * span;
    let time_scale = match pace {
        Pace::TimeScale(x) if x > 0.0 && x.is_finite() => x,
        Pace::TimeScale(x) => return Err(format!("time-scale must be a number > 0, got {x}")),
        Pace::TargetLoad(f) if !(f > 0.0 && f.is_finite()) => {
            return Err(format!("target-load must be a number > 0, got {f}"))
        }
        Pace::TargetLoad(_) if span <= 0.0 => {
            return Err("target-load needs a trace whose arrivals span some time".into())
        }
        Pace::TargetLoad(f) => offered_work_s / (fleet_s * f),
    };
    let offered_load = if fleet_s > 0.0 { offered_work_s / (fleet_s * time_scale) } else { f64::INFINITY };
    Ok(ReplayPlan { oracle, offered_work_s, time_scale, offered_load })
}

/// One policy's figures (`--json` prints these).
#[derive(Clone, Debug, Default, Serialize)]
pub struct SimResult {
    pub policy: String,
    pub profile: String,
    pub workers: usize,
    pub kv_tokens_per_worker: usize,
    pub requests: usize,
    pub completed: u64,
    pub rejected: u64,
    /// Cached prompt tokens / prompt tokens, over completed requests.
    pub hit_rate: f64,
    pub oracle_hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_mean_ms: f64,
    /// Time per output token after the first, over completed requests of two tokens or more.
    pub tpot_p50_ms: f64,
    pub tpot_p99_ms: f64,
    /// Arrival to last token.
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    /// Completion tokens per virtual second of the requests that met the SLOs (`slo`), all workers.
    pub goodput_tokens_per_s: f64,
    /// Completion tokens per virtual second, all completed requests.
    pub throughput_tokens_per_s: f64,
    /// Completed requests that met the SLOs, over completed requests.
    pub slo_attainment: f64,
    /// The SLOs goodput counts by.
    pub slo: Slo,
    /// Busiest worker's busy time / mean busy time.
    pub max_mean_load: f64,
    /// Offered work (with the oracle's hits) / fleet time.
    pub offered_load: f64,
    /// Measured: mean busy time / virtual duration.
    pub busy_fraction: f64,
    pub time_scale: f64,
    pub virtual_duration_s: f64,
    pub preemptions: u64,
    pub evictions: u64,
    /// Host DRAM tier per worker, in tokens (0: none).
    pub host_kv_tokens_per_worker: usize,
    /// Bytes copied down to the host tiers, all workers.
    pub host_stored_bytes: u64,
    /// Blocks loaded back from the host tiers, all workers.
    pub host_hit_blocks: u64,
    /// SSD tier: per worker in tokens, blocks read back, all workers.
    pub disk_kv_tokens_per_worker: usize,
    pub disk_read_blocks: u64,
    /// Lower-tier tokens computed again by choice (load vs recompute).
    pub recomputed_tokens: u64,
    /// Requests per route reason.
    pub routes: BTreeMap<String, u64>,
    /// How well the measured guard predicted TTFT on its picks (`cache_aware_measured` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_prediction: Option<PredictionError>,
    /// Per admission class (empty without `SimConfig::classes`).
    pub classes: BTreeMap<String, ClassResult>,
    /// The LoRA adapter placement rule (`None`: no adapters), adapters loaded and unloaded for another.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter_placement: Option<String>,
    pub adapter_loads: u64,
    pub adapter_evictions: u64,
}

/// One admission class's figures.
#[derive(Clone, Debug, Serialize)]
pub struct ClassResult {
    pub completed: u64,
    /// Refused at arrival (queue full).
    pub refused: u64,
    /// Waited `max_wait` without budget.
    pub timed_out: u64,
    /// From arrival, admission wait included.
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub wait_p99_ms: f64,
}

/// Predicted against actual TTFT on the measured guard's picks, in ms.
#[derive(Clone, Debug, Serialize)]
pub struct PredictionError {
    pub requests: usize,
    /// Mean of actual - predicted (positive: the guard predicts too little).
    pub bias_ms: f64,
    /// Mean |actual - predicted|.
    pub mean_abs_ms: f64,
    /// 90th percentile of |actual - predicted|.
    pub p90_abs_ms: f64,
    /// Pearson correlation of predicted and actual.
    pub correlation: f64,
}

impl PredictionError {
    /// From (predicted, actual) seconds; `None` without pairs.
    pub fn of(pairs: &[(f64, f64)]) -> Option<Self> {
        if pairs.is_empty() {
            return None;
        }
        let n = pairs.len() as f64;
        let abs: Vec<f64> = pairs.iter().map(|(p, a)| (a - p).abs()).collect();
        let (mp, ma) =
            (pairs.iter().map(|x| x.0).sum::<f64>() / n, pairs.iter().map(|x| x.1).sum::<f64>() / n);
        let cov = pairs.iter().map(|(p, a)| (p - mp) * (a - ma)).sum::<f64>();
        let vp = pairs.iter().map(|(p, _)| (p - mp).powi(2)).sum::<f64>();
        let va = pairs.iter().map(|(_, a)| (a - ma).powi(2)).sum::<f64>();
        Some(Self {
            requests: pairs.len(),
            bias_ms: (ma - mp) * 1000.0,
            mean_abs_ms: abs.iter().sum::<f64>() / n * 1000.0,
            p90_abs_ms: percentile(&abs, 0.90) * 1000.0,
            correlation: ratio(cov, (vp * va).sqrt()),
        })
    }
}

/// Replays the trace under one policy.
pub fn simulate(
    trace: &Trace,
    cfg: &SimConfig,
    prep: &ReplayPlan,
    policy: &str,
) -> Result<SimResult, String> {
    let p = policy_by_name(policy, cfg.weights)
        .ok_or_else(|| format!("unknown policy {policy:?}; expected one of {}", POLICIES.join(", ")))?;
    let o = fleet::replay(trace, cfg, prep.time_scale, p);
    let mean_busy = o.busy_s.iter().sum::<f64>() / o.busy_s.len().max(1) as f64;
    let max_busy = o.busy_s.iter().copied().fold(0.0, f64::max);
    let ms = |q: f64| percentile(&o.ttft_s, q) * 1000.0;
    Ok(SimResult {
        policy: policy.to_owned(),
        profile: cfg.profile.name.clone(),
        workers: cfg.workers,
        kv_tokens_per_worker: cfg.kv_tokens_per_worker,
        requests: trace.requests.len(),
        completed: o.completed,
        rejected: o.rejected,
        hit_rate: ratio(o.cached_tokens as f64, o.prompt_tokens as f64),
        oracle_hit_rate: prep.oracle.hit_rate,
        ttft_p50_ms: ms(0.50),
        ttft_p90_ms: ms(0.90),
        ttft_p99_ms: ms(0.99),
        ttft_mean_ms: ratio(o.ttft_s.iter().sum::<f64>(), o.ttft_s.len() as f64) * 1000.0,
        tpot_p50_ms: percentile(&o.tpot_s, 0.50) * 1000.0,
        tpot_p99_ms: percentile(&o.tpot_s, 0.99) * 1000.0,
        e2e_p50_ms: percentile(&o.e2e_s, 0.50) * 1000.0,
        e2e_p99_ms: percentile(&o.e2e_s, 0.99) * 1000.0,
        goodput_tokens_per_s: ratio(o.good_tokens as f64, o.end_s),
        throughput_tokens_per_s: ratio(o.completion_tokens as f64, o.end_s),
        slo_attainment: ratio(o.slo_met as f64, o.completed as f64),
        slo: cfg.slo,
        max_mean_load: ratio(max_busy, mean_busy),
        offered_load: prep.offered_load,
        busy_fraction: ratio(mean_busy, o.end_s),
        time_scale: prep.time_scale,
        virtual_duration_s: o.end_s,
        preemptions: o.preemptions,
        evictions: o.evictions,
        host_kv_tokens_per_worker: cfg.host_kv_tokens_per_worker,
        host_stored_bytes: o.host_stored_bytes,
        host_hit_blocks: o.host_hit_blocks,
        disk_kv_tokens_per_worker: cfg.disk_kv_tokens_per_worker,
        disk_read_blocks: o.disk_read_blocks,
        recomputed_tokens: o.recomputed_tokens,
        routes: o.routes,
        ttft_prediction: PredictionError::of(&o.ttft_predicted),
        adapter_placement: cfg.adapters.as_ref().map(|a| a.rule.name().to_owned()),
        adapter_loads: o.adapter_loads,
        adapter_evictions: o.adapter_evictions,
        classes: o
            .classes
            .into_iter()
            .map(|(name, c)| {
                let ms = |v: &[f64], q: f64| percentile(v, q) * 1000.0;
                let r = ClassResult {
                    completed: c.completed,
                    refused: c.refused,
                    timed_out: c.timed_out,
                    ttft_p50_ms: ms(&c.ttft_s, 0.50),
                    ttft_p99_ms: ms(&c.ttft_s, 0.99),
                    wait_p99_ms: ms(&c.wait_s, 0.99),
                };
                (name, r)
            })
            .collect(),
    })
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests;
