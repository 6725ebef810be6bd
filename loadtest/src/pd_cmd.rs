//! `kvgate-loadtest simulate-pd`: the arguments and the printout of the PD simulator (`sim::pd`).

use std::path::PathBuf;

use clap::Args;
use kvgate_loadtest::sim::pd::{table, PdConfig};
use kvgate_loadtest::trace::Trace;
use kvgate_router::split::Slo;
use kvgate_worker::engine::timing::SimProfile;

#[derive(Args)]
pub struct SimulatePdArgs {
    /// Timing profile (a name in worker/profiles or a file).
    #[arg(long, default_value = "gpu-h200-llama3-8b-measured")]
    profile: String,
    /// Workers in every fleet.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Of them, workers of role prefill in the split layouts (the rest decode).
    #[arg(long, default_value_t = 1)]
    prefill_workers: usize,
    /// P->D link bandwidths to compare, Gb/s.
    #[arg(long, value_delimiter = ',', default_value = "25,100,400")]
    bandwidth_gbps: Vec<f64>,
    /// Requests per shape.
    #[arg(long, default_value_t = 600)]
    requests: usize,
    /// Offered load of the shapes, as the share of the aggregated fleet's time their work takes
    /// (`sim::pd::rate_for_load`).
    #[arg(long, default_value_t = 0.9)]
    load: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Mooncake traces to add as workloads (their own arrivals, times --time-scale).
    #[arg(long)]
    trace: Vec<PathBuf>,
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Only the traces (no shapes).
    #[arg(long)]
    traces_only: bool,
    /// Layer groups P sends while it computes (1: the whole KV after the prefill).
    #[arg(long, default_value_t = 8)]
    export_groups: u32,
    /// K+V bytes per token (Llama-3-8B in bf16: 2 x 32 layers x 8 KV heads x 128 x 2 bytes).
    #[arg(long, default_value_t = 131_072.0)]
    kv_bytes_per_token: f64,
    /// Prefix cache per worker, in 512-token blocks.
    #[arg(long, default_value_t = 1_600)]
    cache_blocks: usize,
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// The SLOs goodput counts (TTFT seconds, TPOT milliseconds).
    #[arg(long, default_value_t = 2.0)]
    slo_ttft_s: f64,
    #[arg(long, default_value_t = 50.0)]
    slo_tpot_ms: f64,
}

pub fn simulate_pd(a: SimulatePdArgs) -> Result<(), String> {
    let profile = SimProfile::named_or_file(&a.profile)?;
    if a.workers < 2 || a.prefill_workers == 0 || a.prefill_workers >= a.workers {
        return Err("--prefill-workers must leave at least one of --workers to decode".into());
    }
    if a.bandwidth_gbps.iter().any(|b| !b.is_finite() || *b <= 0.0) {
        return Err("--bandwidth-gbps: every value must be > 0".into());
    }
    let cfg = PdConfig {
        workers: a.workers,
        prefill_workers: a.prefill_workers,
        timing: profile.timing,
        max_batched_tokens: a.max_num_batched_tokens,
        max_seqs: a.max_num_seqs,
        cache_blocks: a.cache_blocks,
        kv_bytes_per_token: a.kv_bytes_per_token,
        bandwidth_bytes_per_s: 0.0,
        export_groups: a.export_groups,
        slo: Slo { ttft_s: a.slo_ttft_s, tpot_s: a.slo_tpot_ms / 1000.0 },
        report_interval_s: 1.0,
        knowledge: kvgate_loadtest::sim::pd::Knowledge::Predicted,
        bandwidth_prior_bytes_per_s: kvgate_router::split::plan::DEFAULT_BANDWIDTH_PRIOR_GBPS * 1e9 / 8.0,
        configured_output: kvgate_router::admission::classes::DEFAULT_EXPECTED_OUTPUT_TOKENS,
    };
    let mut workloads =
        if a.traces_only { Vec::new() } else { table::shape_workloads(&cfg, a.requests, a.load, a.seed) };
    for path in &a.trace {
        let trace = Trace::load(path)?;
        let name = path.file_stem().map_or("trace".into(), |s| s.to_string_lossy().into_owned());
        workloads.push(table::trace_workload(&name, &trace, a.time_scale, a.seed));
    }
    let rows = table::run(&cfg, &workloads, &a.bandwidth_gbps);
    println!(
        "profile {}, {} workers ({}P+{}D in split layouts), load {}, {} requests a shape, seed {}, {} layer groups, \
         SLO TTFT <= {} s and TPOT <= {} ms",
        profile.name,
        a.workers,
        a.prefill_workers,
        a.workers - a.prefill_workers,
        a.load,
        a.requests,
        a.seed,
        a.export_groups,
        a.slo_ttft_s,
        a.slo_tpot_ms
    );
    print!("{}", table::markdown(&rows));
    Ok(())
}
