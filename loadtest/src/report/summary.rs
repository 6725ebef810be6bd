//! One run's figures from its request records.
//!
//! ```text
//! hit_rate        = sum cached_tokens / sum prompt_tokens                  (successful requests, from `usage`)
//! tpot(r)         = (e2e(r) - ttft(r)) / (completion_tokens(r) - 1)
//! throughput      = sum completion_tokens / wall time
//! goodput         = sum completion_tokens of requests with ttft <= slo_ttft and tpot <= slo_tpot / wall time
//! max_mean_worker = requests of the busiest worker / mean requests per worker (over the fleet's workers when
//!                   known, idle ones included; else over the workers that served any)
//! ```

use std::collections::BTreeMap;

use serde::Serialize;

use crate::client::RequestRecord;
use crate::stats::percentile;

/// Service-level objectives for goodput.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

/// Whether a request's tokens count towards goodput: its TTFT and (when it has one) its TPOT within the SLOs.
pub fn meets_slo(r: &RequestRecord, slo: Slo) -> bool {
    r.ttft_ms.is_some_and(|t| t <= slo.ttft_ms) && r.tpot_ms().is_none_or(|t| t <= slo.tpot_ms)
}

/// A run's summary (a row of the table).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub label: String,
    pub requests: usize,
    pub ok: usize,
    pub errors: usize,
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub tpot_p50_ms: f64,
    pub tpot_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub throughput_tokens_per_s: f64,
    pub goodput_tokens_per_s: f64,
    pub slo: Slo,
    pub requests_per_worker: BTreeMap<String, u64>,
    pub max_mean_worker: f64,
    pub wall_s: f64,
    /// Up to five distinct error messages.
    pub sample_errors: Vec<String>,
}

impl Summary {
    /// `fleet_workers`: how many workers could have served (None: count those that did).
    pub fn of(
        label: &str,
        records: &[RequestRecord],
        wall_s: f64,
        slo: Slo,
        fleet_workers: Option<usize>,
    ) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
        let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
        let tpot: Vec<f64> = ok.iter().filter_map(|r| r.tpot_ms()).collect();
        let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
        let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
        let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
        let completion: u64 = ok.iter().map(|r| r.completion_tokens).sum();
        let good: u64 = ok.iter().filter(|r| meets_slo(r, slo)).map(|r| r.completion_tokens).sum();
        let mut per_worker: BTreeMap<String, u64> = BTreeMap::new();
        for r in &ok {
            *per_worker.entry(r.worker.clone().unwrap_or_else(|| "(direct)".into())).or_default() += 1;
        }
        let max = per_worker.values().copied().max().unwrap_or(0) as f64;
        let n_workers = fleet_workers.unwrap_or(0).max(per_worker.len());
        let mean = if n_workers == 0 { 0.0 } else { ok.len() as f64 / n_workers as f64 };
        let mut sample_errors: Vec<String> = Vec::new();
        for r in records.iter().filter(|r| !r.ok()) {
            let e = format!("{}: {}", r.status, r.error.as_deref().unwrap_or("?"));
            if sample_errors.len() < 5 && !sample_errors.contains(&e) {
                sample_errors.push(e);
            }
        }
        let per_s = |n: u64| if wall_s > 0.0 { n as f64 / wall_s } else { 0.0 };
        Self {
            label: label.to_owned(),
            requests: records.len(),
            ok: ok.len(),
            errors: records.len() - ok.len(),
            hit_rate: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
            ttft_p50_ms: percentile(&ttft, 0.5),
            ttft_p90_ms: percentile(&ttft, 0.9),
            ttft_p99_ms: percentile(&ttft, 0.99),
            tpot_p50_ms: percentile(&tpot, 0.5),
            tpot_p99_ms: percentile(&tpot, 0.99),
            e2e_p50_ms: percentile(&e2e, 0.5),
            throughput_tokens_per_s: per_s(completion),
            goodput_tokens_per_s: per_s(good),
            slo,
            requests_per_worker: per_worker,
            max_mean_worker: if mean > 0.0 { max / mean } else { 0.0 },
            wall_s,
            sample_errors,
        }
    }
}

impl Summary {
    /// The table's cells, in column order (the text table and the HTML report share them).
    pub fn cells(&self) -> [String; 9] {
        [
            self.label.clone(),
            self.requests.to_string(),
            self.errors.to_string(),
            format!("{:.3}", self.hit_rate),
            format!("{:.0}", self.ttft_p50_ms),
            format!("{:.0}", self.ttft_p99_ms),
            format!("{:.1}", self.tpot_p50_ms),
            format!("{:.1}", self.goodput_tokens_per_s),
            format!("{:.2}", self.max_mean_worker),
        ]
    }
}

/// Column titles of [`Summary::cells`].
pub const COLUMNS: [&str; 9] = [
    "run",
    "requests",
    "errors",
    "hit_rate",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "goodput_t/s",
    "max/mean",
];

/// The summary table (plain text, one row per run).
pub fn table(rows: &[Summary]) -> String {
    // The first column fits the longest run label (a policy name such as `cache_aware_measured`), at least 16.
    let first = rows.iter().map(|r| r.label.len()).max().unwrap_or(0).max(16);
    let widths = [first, 8, 6, 9, 11, 11, 11, 12, 9];
    let line = |cells: &[String]| -> String {
        let mut l = format!("{:<w$}", cells[0], w = widths[0]);
        for (c, w) in cells.iter().zip(widths).skip(1) {
            l.push_str(&format!(" {c:>w$}"));
        }
        l + "\n"
    };
    let mut out = line(&COLUMNS.map(String::from));
    for s in rows {
        out.push_str(&line(&s.cells()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(worker: &str, ttft: f64, e2e: f64, completion: u64, prompt: u64, cached: u64) -> RequestRecord {
        RequestRecord {
            status: 200,
            worker: Some(worker.into()),
            ttft_ms: Some(ttft),
            e2e_ms: e2e,
            completion_tokens: completion,
            prompt_tokens: prompt,
            cached_tokens: cached,
            ..Default::default()
        }
    }

    #[test]
    fn figures_follow_their_definitions() {
        let records = vec![
            rec("a", 100.0, 1000.0, 10, 1000, 500), // tpot 100
            rec("a", 3000.0, 4000.0, 11, 1000, 0),  // ttft misses the SLO
            rec("b", 50.0, 250.0, 5, 2000, 1500),   // tpot 50
            RequestRecord { status: 429, error: Some("budget".into()), ..Default::default() },
        ];
        let slo = Slo { ttft_ms: 2000.0, tpot_ms: 150.0 };
        let s = Summary::of("x", &records, 2.0, slo, None);
        assert_eq!((s.requests, s.ok, s.errors), (4, 3, 1));
        assert!((s.hit_rate - 2000.0 / 4000.0).abs() < 1e-12);
        assert_eq!(s.ttft_p50_ms, 100.0);
        assert_eq!(s.tpot_p50_ms, 100.0);
        assert!((s.throughput_tokens_per_s - 13.0).abs() < 1e-12);
        assert!((s.goodput_tokens_per_s - 7.5).abs() < 1e-12);
        assert_eq!(s.requests_per_worker.get("a"), Some(&2));
        assert!((s.max_mean_worker - 2.0 / 1.5).abs() < 1e-12);
        assert_eq!(s.sample_errors, vec!["429: budget".to_string()]);
        // A fleet of 4 where two served nothing: mean 0.75 requests per worker.
        let fleet = Summary::of("x", &records, 2.0, slo, Some(4));
        assert!((fleet.max_mean_worker - 2.0 / 0.75).abs() < 1e-12);
        assert!(table(std::slice::from_ref(&s)).lines().nth(1).is_some_and(|l| l.starts_with('x')));
        // A label longer than the column widens it: every line keeps its columns aligned.
        let long = Summary::of("cache_aware_measured", &records, 2.0, slo, None);
        let t = table(&[s, long]);
        let lens: Vec<usize> = t.lines().map(str::len).collect();
        assert!(lens.windows(2).all(|w| w[0] == w[1]), "{t}");
    }
}
