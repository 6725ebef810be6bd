//! The self-contained HTML report: the summary table and its SVG plots, all inline: the TTFT and TPOT CDFs of every
//! run side by side (a pile-up that wins TTFT shows as the TPOT it costs), hit rate and goodput over time, and
//! requests per worker over time (one chart per run).

use std::collections::BTreeMap;

use super::summary::meets_slo;
use super::svg::{line_chart, Series};
use super::{Report, Slo};
use crate::client::RequestRecord;

/// A plot's points from one run's records.
type Points<'a> = dyn Fn(&[RequestRecord]) -> Vec<(f64, f64)> + 'a;

/// Time buckets of the over-time plots.
const BUCKETS: usize = 20;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The CDF of one per-request figure over the successful requests that have it.
fn cdf(records: &[RequestRecord], figure: fn(&RequestRecord) -> Option<f64>) -> Vec<(f64, f64)> {
    let mut t: Vec<f64> = records.iter().filter(|r| r.ok()).filter_map(figure).collect();
    t.sort_by(f64::total_cmp);
    let n = t.len() as f64;
    t.iter().enumerate().map(|(i, v)| (*v, (i + 1) as f64 / n)).collect()
}

fn ttft_cdf(records: &[RequestRecord]) -> Vec<(f64, f64)> {
    cdf(records, |r| r.ttft_ms)
}

fn tpot_cdf(records: &[RequestRecord]) -> Vec<(f64, f64)> {
    cdf(records, RequestRecord::tpot_ms)
}

fn bucket_width(records: &[RequestRecord]) -> f64 {
    let end = records.iter().map(|r| r.start_s).fold(0.0, f64::max);
    (end / BUCKETS as f64).max(1e-3)
}

fn hit_rate_over_time(records: &[RequestRecord]) -> Vec<(f64, f64)> {
    let w = bucket_width(records);
    let mut b = vec![(0u64, 0u64); BUCKETS + 1];
    for r in records.iter().filter(|r| r.ok()) {
        let i = ((r.start_s / w) as usize).min(BUCKETS);
        b[i].0 += r.cached_tokens;
        b[i].1 += r.prompt_tokens;
    }
    b.iter()
        .enumerate()
        .filter(|(_, (_, p))| *p > 0)
        .map(|(i, (c, p))| ((i as f64 + 0.5) * w, *c as f64 / *p as f64))
        .collect()
}

/// Goodput per time bucket: the completion tokens of the requests that ended in it within the SLOs
/// ([`meets_slo`], the summary's definition), per second.
fn goodput_over_time(records: &[RequestRecord], slo: Slo) -> Vec<(f64, f64)> {
    let end_s = |r: &RequestRecord| r.start_s + r.e2e_ms / 1e3;
    // Buckets over the run's end times, the last ending with the last request.
    let w = (records.iter().map(end_s).fold(0.0, f64::max) / BUCKETS as f64).max(1e-3);
    let mut b = [0u64; BUCKETS];
    for r in records.iter().filter(|r| r.ok() && meets_slo(r, slo)) {
        b[((end_s(r) / w) as usize).min(BUCKETS - 1)] += r.completion_tokens;
    }
    b.iter().enumerate().map(|(i, t)| ((i as f64 + 0.5) * w, *t as f64 / w)).collect()
}

fn requests_per_worker_over_time(records: &[RequestRecord]) -> Vec<Series> {
    let w = bucket_width(records);
    let mut per: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.ok()) {
        let name = r.worker.clone().unwrap_or_else(|| "(direct)".into());
        let i = ((r.start_s / w) as usize).min(BUCKETS);
        per.entry(name).or_insert_with(|| vec![0.0; BUCKETS + 1])[i] += 1.0;
    }
    per.into_iter()
        .map(|(name, counts)| Series {
            name,
            points: counts.iter().enumerate().map(|(i, c)| ((i as f64 + 0.5) * w, *c)).collect(),
        })
        .collect()
}

/// The whole page.
pub fn render(report: &Report) -> String {
    let mut html = format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>kvgate load test: {w}</title>\n<style>\
         body{{font-family:sans-serif;margin:24px;max-width:1000px}} table{{border-collapse:collapse}} \
         td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}} td:first-child{{text-align:left}} \
         code{{background:#f4f4f4}}</style></head><body>\n<h1>kvgate load test: {w}</h1>\n<p><code>{c}</code></p>\n",
        w = esc(&report.workload),
        c = esc(&report.command)
    );
    html += "<table><tr>";
    for c in super::summary::COLUMNS {
        html += &format!("<th>{}</th>", esc(c));
    }
    html += "</tr>\n";
    for r in &report.runs {
        html += "<tr>";
        for c in r.summary.cells() {
            html += &format!("<td>{}</td>", esc(&c));
        }
        html += "</tr>\n";
    }
    if let Some(s) = report.runs.first().map(|r| r.summary.slo) {
        html += &format!(
            "</table>\n<p>Goodput: completion tokens per second of requests with TTFT &le; {} ms and TPOT &le; {} ms.</p>\n",
            s.ttft_ms, s.tpot_ms
        );
    } else {
        html += "</table>\n";
    }
    let per_run = |f: &Points<'_>| -> Vec<Series> {
        report.runs.iter().map(|r| Series { name: r.label.clone(), points: f(&r.records) }).collect()
    };
    html += &line_chart("TTFT CDF", "TTFT (ms)", "fraction of requests", &per_run(&|r| ttft_cdf(r)));
    html += &line_chart("TPOT CDF", "TPOT (ms)", "fraction of requests", &per_run(&|r| tpot_cdf(r)));
    html += &line_chart(
        "Prefix-cache hit rate over time",
        "time since start (s)",
        "cached / prompt tokens",
        &per_run(&|r| hit_rate_over_time(r)),
    );
    if let Some(slo) = report.runs.first().map(|r| r.summary.slo) {
        html += &line_chart(
            "Goodput over time (requests within the SLOs, by when they ended)",
            "time since start (s)",
            "completion tokens / s",
            &per_run(&|r| goodput_over_time(r, slo)),
        );
    }
    for r in &report.runs {
        html += &line_chart(
            &format!("Requests per worker over time: {}", r.label),
            "time since start (s)",
            "requests started",
            &requests_per_worker_over_time(&r.records),
        );
    }
    html + "</body></html>\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{RunReport, Slo, Summary};

    #[test]
    fn page_holds_the_table_and_every_plot() {
        let records: Vec<RequestRecord> = (0..40)
            .map(|i| RequestRecord {
                id: i,
                status: 200,
                start_s: i as f64 * 0.5,
                ttft_ms: Some(10.0 + i as f64),
                e2e_ms: 100.0,
                prompt_tokens: 100,
                cached_tokens: i,
                completion_tokens: 4,
                worker: Some(format!("w{}", i % 3)),
                ..Default::default()
            })
            .collect();
        let slo = Slo { ttft_ms: 1000.0, tpot_ms: 100.0 };
        let run = |label: &str| RunReport {
            label: label.into(),
            summary: Summary::of(label, &records, 20.0, slo, None),
            records: records.clone(),
        };
        let page =
            render(&Report { workload: "w".into(), command: "x <y>".into(), runs: vec![run("a"), run("b")] });
        assert_eq!(
            page.matches("<svg").count(),
            6,
            "TTFT and TPOT CDFs, hit rate, goodput, and one per-worker chart per run"
        );
        assert!(page.contains("TPOT CDF") && page.contains("Goodput over time"));
        // e2e 100 ms, ttft 10 + i: tpot (90 - i) / 3 ms, decreasing with i.
        let tpot = tpot_cdf(&records);
        assert_eq!(
            (tpot.len(), tpot.first().map(|p| p.0), tpot.last().map(|p| p.0)),
            (40, Some(17.0), Some(30.0))
        );
        // Every request ends within the SLOs: goodput over time adds up to every completion token.
        let g = goodput_over_time(&records, slo);
        let w = g[0].0 * 2.0;
        assert!((g.iter().map(|p| p.1 * w).sum::<f64>() - 160.0).abs() < 1e-9);
        let strict = Slo { ttft_ms: 1000.0, tpot_ms: 20.0 };
        let kept: f64 = goodput_over_time(&records, strict).iter().map(|p| p.1 * w).sum();
        // tpot <= 20 ms: (90 - i) / 3 <= 20, i >= 30: ten requests of 4 tokens.
        assert!((kept - 40.0).abs() < 1e-9, "{kept}");
        assert!(page.contains("x &lt;y&gt;") && page.contains("<td>a</td>") && page.contains("w2"));
        assert_eq!(ttft_cdf(&records).last().map(|p| p.1), Some(1.0));
        let h = hit_rate_over_time(&records);
        assert!(h.windows(2).all(|w| w[0].1 <= w[1].1), "cached grows with i");
    }
}
