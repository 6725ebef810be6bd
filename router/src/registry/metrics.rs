//! Per-worker metric series, rendered from the registry at scrape time (Prometheus text format), so a forgotten
//! worker's series disappear with it instead of living in the global recorder forever.

use std::fmt::Write;
use std::time::Instant;

use super::{Registry, WorkerStatus};

/// A series: name, help text, and the value of one worker.
type Series<T> = (&'static str, &'static str, fn(&WorkerStatus) -> T);

/// Escapes a label value (backslash, double quote, newline).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Registry {
    /// The `kvgate_gateway_worker_*` series of every registered worker.
    pub fn render_metrics(&self, now: Instant) -> String {
        let status = self.status(now);
        let mut out = String::new();
        let gauges: [Series<f64>; 6] = [
            ("kvgate_gateway_worker_healthy", "1 if the worker is in the ring", |w| {
                f64::from(u8::from(w.healthy))
            }),
            ("kvgate_gateway_worker_inflight", "requests in flight through this gateway", |w| {
                w.inflight as f64
            }),
            ("kvgate_gateway_worker_pending_tokens", "prefill tokens waiting (reported + sent since)", |w| {
                w.load.pending_tokens as f64
            }),
            (
                "kvgate_gateway_worker_queue_requests",
                "requests waiting or running (reported + sent since)",
                |w| w.load.requests as f64,
            ),
            ("kvgate_gateway_worker_draining", "1 if the worker is draining", |w| {
                f64::from(u8::from(w.draining))
            }),
            ("kvgate_gateway_worker_suspect", "1 after a timeout nothing answered since", |w| {
                f64::from(u8::from(w.suspect))
            }),
        ];
        for (name, help, f) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for w in &status {
                let _ = writeln!(out, "{name}{{worker=\"{}\"}} {}", label(&w.id), f(w));
            }
        }
        let _ = writeln!(
            out,
            "# HELP kvgate_gateway_worker_report_age_seconds seconds since the worker's latest report\n\
             # TYPE kvgate_gateway_worker_report_age_seconds gauge"
        );
        for w in &status {
            if let Some(age) = w.report_age_s {
                let _ = writeln!(
                    out,
                    "kvgate_gateway_worker_report_age_seconds{{worker=\"{}\"}} {age}",
                    label(&w.id)
                );
            }
        }
        let counters: [Series<u64>; 4] = [
            (
                "kvgate_gateway_connect_failures_total",
                "connections to the worker that failed before any byte",
                |w| w.counters.connect_failures,
            ),
            ("kvgate_gateway_upstream_timeouts_total", "first-byte and stream-idle timeouts", |w| {
                w.counters.timeouts
            }),
            (
                "kvgate_gateway_worker_refusals_total",
                "queue_full / model_loading / shutting_down answers",
                |w| w.counters.refusals,
            ),
            (
                "kvgate_gateway_fingerprint_mismatch_total",
                "reports whose hash scheme differs from this gateway's",
                |w| w.counters.fingerprint_mismatches,
            ),
        ];
        for (name, help, f) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for w in &status {
                let _ = writeln!(out, "{name}{{worker=\"{}\"}} {}", label(&w.id), f(w));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::RegistryConfig;

    #[test]
    fn series_escape_labels_and_vanish_with_the_worker() {
        let mut r = Registry::new(RegistryConfig::default());
        r.add_static("http://a\"b:1");
        let text = r.render_metrics(Instant::now());
        assert!(text.contains("kvgate_gateway_worker_healthy{worker=\"http://a\\\"b:1\"} 1"), "{text}");
        assert!(text.contains("# TYPE kvgate_gateway_connect_failures_total counter"));
        let empty = Registry::new(RegistryConfig::default()).render_metrics(Instant::now());
        assert!(!empty.contains("worker=\""));
    }
}
