//! The PD comparison table (`kvgate-loadtest simulate-pd`): per workload and link bandwidth, the same requests
//! through every split policy: `aggregated` on a fleet of `both` workers, the others on the P+D layout, and the
//! cost model also on the `both` fleet (it may split between any two workers there).

use kvgate_router::split::{split_policy_by_name, SplitPolicy};

use super::{
    rate_for_load, replay, shape_workload, with_max_tokens, Knowledge, PdConfig, PdRequest, PdResult,
    BLOCK_TOKENS,
};
use crate::trace::Trace;

/// The seed's four shapes and a RAG-like mix (prompt, output, TTFT SLO override: a 32K prefill alone takes 2.8 s
/// on the H200 profile, so that row is judged at TTFT <= 10 s).
pub const SHAPES: [(&str, usize, usize, Option<f64>); 5] = [
    ("512/1024", 512, 1024, None),
    ("4096/512", 4096, 512, None),
    ("4096/4096", 4096, 4096, None),
    ("32768/128", 32768, 128, Some(10.0)),
    ("RAG 8K/200", 8192, 200, None),
];

/// A named workload.
pub struct Workload {
    pub name: String,
    pub requests: Vec<PdRequest>,
    /// The TTFT SLO of this workload's row, when not the config's.
    pub ttft_slo_s: Option<f64>,
}

/// The shapes' workloads: `n` requests each, Poisson at the rate that keeps an aggregated fleet `load` busy.
pub fn shape_workloads(cfg: &PdConfig, n: usize, load: f64, seed: u64) -> Vec<Workload> {
    SHAPES
        .iter()
        .map(|&(name, prompt, output, ttft_slo_s)| {
            let rate = rate_for_load(&cfg.timing, cfg.workers, prompt, output, load);
            let mut requests = shape_workload(n, prompt, output, rate, seed);
            with_max_tokens(&mut requests, seed);
            Workload { name: name.into(), requests, ttft_slo_s }
        })
        .collect()
}

/// A Mooncake trace as a workload, its arrivals multiplied by `time_scale` (< 1: faster); `max_tokens` as real
/// clients send it (`with_max_tokens`, seeded by `seed`).
pub fn trace_workload(name: &str, trace: &Trace, time_scale: f64, seed: u64) -> Workload {
    let mut requests: Vec<PdRequest> = trace
        .requests
        .iter()
        .map(|r| PdRequest {
            arrival_s: r.timestamp_ms as f64 / 1000.0 * time_scale,
            prompt: r.input_length,
            output: r.output_length.max(1),
            blocks: super::worker::block_keys(&r.hash_ids[..r.input_length.div_ceil(BLOCK_TOKENS)]),
            max_tokens: None,
        })
        .collect();
    with_max_tokens(&mut requests, seed);
    Workload { name: name.into(), requests, ttft_slo_s: None }
}

/// One row of the table.
pub struct Row {
    pub workload: String,
    pub ttft_slo_s: f64,
    pub bandwidth_gbps: f64,
    pub result: PdResult,
}

/// Every policy on every workload at every bandwidth.
pub fn run(cfg: &PdConfig, workloads: &[Workload], bandwidths_gbps: &[f64]) -> Vec<Row> {
    let mut rows = Vec::new();
    for w in workloads {
        for &gbps in bandwidths_gbps {
            let mut c = PdConfig { bandwidth_bytes_per_s: gbps * 1e9 / 8.0, ..cfg.clone() };
            if let Some(t) = w.ttft_slo_s {
                c.slo.ttft_s = t;
            }
            // Every policy with what the gateway can know; the cost model also with the truth (the oracle rows:
            // what not knowing the output and the link costs).
            use Knowledge::{Oracle, Predicted};
            let runs: [(&str, bool, Knowledge); 8] = [
                ("aggregated", true, Predicted),
                ("always", false, Predicted),
                ("dynamo", false, Predicted),
                ("llm_d", false, Predicted),
                ("cost_model", false, Predicted),
                ("cost_model", false, Oracle),
                ("cost_model", true, Predicted),
                ("cost_model", true, Oracle),
            ];
            for (name, all_both, knowledge) in runs {
                let policy: Box<dyn SplitPolicy> = split_policy_by_name(name).expect("a known policy");
                let c = PdConfig { knowledge, ..c.clone() };
                let result = replay(&w.requests, &c, policy.as_ref(), all_both);
                rows.push(Row {
                    workload: w.name.clone(),
                    ttft_slo_s: c.slo.ttft_s,
                    bandwidth_gbps: gbps,
                    result,
                });
            }
        }
    }
    rows
}

/// Markdown rows (docs/benchmarks/pd.md).
pub fn markdown(rows: &[Row]) -> String {
    let mut s = String::from(
        "| workload | TTFT SLO s | Gb/s | policy | layout | knows | goodput tok/s | SLO met | TTFT p50 / p99 s | TPOT p50 / p99 ms | split | TTFT error p50 / p99 s | TPOT error p50 / p99 ms | output error p50 |\n\
         |---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let p = &r.result;
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.0} | {:.1}% | {:.2} / {:.2} | {:.1} / {:.1} | {:.0}% | {:.2} / {:.2} | {:.1} / {:.1} | {:.0}% |\n",
            r.workload,
            r.ttft_slo_s,
            r.bandwidth_gbps,
            p.policy,
            p.layout,
            p.knowledge.as_str(),
            p.goodput_tokens_per_s,
            p.slo_met_share * 100.0,
            p.ttft_p50_s,
            p.ttft_p99_s,
            p.tpot_p50_s * 1000.0,
            p.tpot_p99_s * 1000.0,
            p.split_share * 100.0,
            p.ttft_error_p50_s,
            p.ttft_error_p99_s,
            p.tpot_error_p50_s * 1000.0,
            p.tpot_error_p99_s * 1000.0,
            p.output_error_p50 * 100.0
        ));
    }
    s
}
