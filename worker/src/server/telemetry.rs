//! The worker's Prometheus metrics: the recorder ([`install_metrics`], once a process) and the `GET /metrics` page
//! ([`metrics_text`]), which sets the gauges read from the engine's latest snapshot, its KV tiers and the tracer
//! before rendering.
//!
//! Invariants: every gauge is set from a snapshot at render time (no background task keeps them); the recorder is
//! installed at most once a process (a second `serve` in the same process, as tests run, gets the same handle).

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::state::AppState;

/// The process's Prometheus recorder, installed on the first call (`_seconds` histograms get the worker's buckets).
pub(super) fn install_metrics() -> Result<PrometheusHandle, String> {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let buckets = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &buckets)
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())?;
    Ok(HANDLE.get_or_init(|| handle).clone())
}

/// `GET /metrics`: the gauges set from the engine's snapshot, then the recorder's text.
pub(super) async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    let t = state.tracer.counters();
    for (outcome, n) in [("exported", &t.exported), ("dropped", &t.dropped), ("failed", &t.failed)] {
        metrics::counter!("kvgate_worker_trace_spans_total", "outcome" => outcome)
            .absolute(n.load(Ordering::Relaxed));
    }
    if let Some(l) = state.loaded() {
        let p = l.engine.snapshot();
        let s = p.stats;
        metrics::gauge!("kvgate_worker_kv_blocks", "state" => "total").set(s.blocks_total as f64);
        metrics::gauge!("kvgate_worker_kv_blocks", "state" => "free").set(s.blocks_free as f64);
        metrics::gauge!("kvgate_worker_kv_blocks", "state" => "used")
            .set((s.blocks_total - s.blocks_free) as f64);
        metrics::gauge!("kvgate_worker_kv_blocks", "state" => "cached").set(s.blocks_cached as f64);
        metrics::gauge!("kvgate_worker_kv_evictions").set(s.evictions as f64);
        metrics::gauge!("kvgate_worker_preemptions").set(s.preemptions as f64);
        metrics::gauge!("kvgate_worker_queue_requests", "state" => "waiting").set(s.waiting_requests as f64);
        metrics::gauge!("kvgate_worker_queue_requests", "state" => "running").set(s.running_requests as f64);
        metrics::gauge!("kvgate_worker_prefill_tokens").set(s.prefill_tokens as f64);
        metrics::gauge!("kvgate_worker_prefix_cache_hit_blocks").set(s.hit_blocks as f64);
        metrics::gauge!("kvgate_worker_prefix_cache_queried_blocks").set(s.queried_blocks as f64);
        if s.host_blocks_total > 0 {
            let h = s.host;
            metrics::gauge!("kvgate_worker_host_kv_blocks", "state" => "total")
                .set(s.host_blocks_total as f64);
            metrics::gauge!("kvgate_worker_host_kv_blocks", "state" => "cached")
                .set(s.host_blocks_cached as f64);
            metrics::gauge!("kvgate_worker_host_kv_stored_blocks").set(h.stored_blocks as f64);
            metrics::gauge!("kvgate_worker_host_kv_stored_bytes").set(h.stored_bytes as f64);
            metrics::gauge!("kvgate_worker_host_kv_hit_blocks").set(h.hit_blocks as f64);
            metrics::gauge!("kvgate_worker_host_kv_evicted_blocks").set(h.evicted_blocks as f64);
            metrics::gauge!("kvgate_worker_host_kv_orphan_blocks").set(h.orphans as f64);
        }
        let d = l.engine.kv().decisions();
        let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed) as f64;
        metrics::gauge!("kvgate_worker_kv_tier_decisions", "choice" => "load").set(get(&d.loads));
        metrics::gauge!("kvgate_worker_kv_tier_decisions", "choice" => "recompute").set(get(&d.recomputes));
        metrics::gauge!("kvgate_worker_kv_tier_decision_tokens", "choice" => "load")
            .set(get(&d.loaded_tokens));
        metrics::gauge!("kvgate_worker_kv_tier_decision_tokens", "choice" => "recompute")
            .set(get(&d.recomputed_tokens));
        if let Some(disk) = l.engine.kv().disk() {
            // Live: the SSD tier's IO thread moves these between engine steps.
            let d = disk.counters();
            let cached = disk.index().len();
            metrics::gauge!("kvgate_worker_disk_kv_blocks", "state" => "total")
                .set(s.disk_blocks_total as f64);
            metrics::gauge!("kvgate_worker_disk_kv_blocks", "state" => "cached").set(cached as f64);
            metrics::gauge!("kvgate_worker_disk_kv_written_blocks").set(d.written_blocks as f64);
            metrics::gauge!("kvgate_worker_disk_kv_written_bytes").set(d.written_bytes as f64);
            metrics::gauge!("kvgate_worker_disk_kv_read_blocks").set(d.read_blocks as f64);
            metrics::gauge!("kvgate_worker_disk_kv_dropped_writes").set(d.dropped_writes as f64);
            metrics::gauge!("kvgate_worker_disk_kv_corrupt_blocks").set(d.corrupt_blocks as f64);
            metrics::gauge!("kvgate_worker_disk_kv_recovered_blocks").set(d.recovered_blocks as f64);
            metrics::gauge!("kvgate_worker_disk_kv_prefetched_blocks").set(d.prefetched_blocks as f64);
            metrics::gauge!("kvgate_worker_disk_kv_prefetch_hits").set(d.prefetch_hits as f64);
            // Reads the IO queue could not take (asked again at the next claim).
            metrics::gauge!("kvgate_worker_disk_kv_dropped_reads").set(d.dropped_reads as f64);
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.prometheus.render()).into_response()
}
