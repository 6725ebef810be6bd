//! The 1 s cache summary: every interval, a `WorkerReport` (queue and KV stats, measured throughput, and a Bloom
//! filter of the block hashes the prefix cache holds now, so evicted blocks disappear) is POSTed to each gateway's
//! `POST /kvgate/v1/report`, authenticated by the shared secret.
//!
//! Each gateway has its own task and a short timeout; a gateway whose previous POST is still in flight is skipped
//! for that interval, so a slow or dead gateway never delays the engine or the other gateways.
//!
//! A `--report-to` host that resolves to several addresses (a Kubernetes headless Service in front of several gateway
//! replicas) gets the report at every address, re-resolved each interval, so every replica keeps its own registry.
//!
//! What a report holds (the Bloom summary at `--summary-granularity`, queue and KV figures) is built by the pure
//! `report` module (next to `kv`, not in the server), which the fleet simulator uses too.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvgate_shared::report::{StepTiming, Throughput, WorkerReport, REPORT_CONTENT_TYPE};

use super::engine_thread::{EngineHandle, EngineSnapshot};
pub use crate::report::{summarise, summarise_tiers, ReportSource};

/// Where and how often reports go, and what can make one go at once.
pub struct ReportPlan {
    /// Gateway control base URLs.
    pub targets: Vec<String>,
    pub interval: Duration,
    /// Timeout of one POST.
    pub timeout: Duration,
    pub secret: Option<String>,
    /// Set on SIGTERM: reports say `draining`.
    pub draining: Arc<AtomicBool>,
    /// Notified for an immediate report (draining started).
    pub report_now: Arc<tokio::sync::Notify>,
    /// Notified once a draining report has been delivered (or failed) at every destination.
    pub draining_reported: Arc<tokio::sync::Notify>,
    /// The KV transfers whose imports each report samples (`None`: this worker cannot transfer).
    pub transfers: Option<Arc<crate::transfer::Transfers>>,
    /// The LoRA adapters each report names.
    pub adapters: Arc<super::adapters::AdapterStore>,
}

impl ReportSource {
    /// One report from the engine's current state; throughput over `dt` since `prev`.
    pub fn build(
        &self,
        engine: &EngineHandle,
        seq: u64,
        prev: &EngineSnapshot,
        now: &EngineSnapshot,
        dt: Duration,
        draining: bool,
    ) -> WorkerReport {
        let secs = dt.as_secs_f64().max(1e-3);
        let throughput = Throughput {
            prefill_tokens_per_s: now.prefill_tokens.saturating_sub(prev.prefill_tokens) as f64 / secs,
            decode_tokens_per_s: now.decode_tokens.saturating_sub(prev.decode_tokens) as f64 / secs,
        };
        let summaries = summarise_tiers(engine.kv(), self.granularity, self.fp_rate);
        let timestamp_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let mut r = self.assemble(seq, timestamp_ms, &now.stats, throughput, summaries, draining);
        r.pd.timing = step_timing(prev, now);
        r
    }
}

/// The step timings of the interval between two snapshots (0 where nothing of that kind ran).
pub fn step_timing(prev: &EngineSnapshot, now: &EngineSnapshot) -> StepTiming {
    let prefill_s = now.prefill_step_s - prev.prefill_step_s;
    let prefill_tokens = now.prefill_tokens.saturating_sub(prev.prefill_tokens) as f64;
    let carrying = now.decode_carrying_s - prev.decode_carrying_s;
    let stalled = now.stalled_s - prev.stalled_s;
    let ratio = |a: f64, b: f64| if b > 0.0 && a.is_finite() { (a / b).max(0.0) } else { 0.0 };
    let (prefill_per_token_s, prefill_attention_s) = now.prefill_fit.coefficients();
    let decode = now.decode_fit.cost();
    StepTiming {
        decode_base_s: decode.base_s,
        decode_per_seq_s: decode.per_seq_s,
        decode_per_kv_token_s: decode.per_kv_token_s,
        prefill_per_token_s,
        prefill_attention_s,
        prefill_tokens_per_s: ratio(prefill_tokens, prefill_s),
        decode_step_s: if now.decode_step_s.is_finite() { now.decode_step_s.max(0.0) } else { 0.0 },
        stall_ratio: ratio(stalled, carrying).min(1.0),
    }
}

/// Where one report goes: the gateway's URL, or one of the addresses its host resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Destination {
    /// `http://host:port/kvgate/v1/report` with the host or one resolved address.
    pub url: String,
    /// The original host (and port), sent as `Host` when the URL names an address.
    pub host_header: Option<String>,
}

/// The destinations of a `--report-to` base URL: one per address its host resolves to (a Kubernetes headless
/// Service resolves to every gateway replica, and each keeps its own registry), or the URL itself when it names
/// an IP, resolves to a single address or only to loopback addresses, or cannot be resolved now (the POST then
/// fails and is counted).
pub async fn destinations(target: &str) -> Vec<Destination> {
    let base = target.trim_end_matches('/');
    let plain = vec![Destination { url: format!("{base}/kvgate/v1/report"), host_header: None }];
    let Ok(uri) = base.parse::<hyper::Uri>() else { return plain };
    let (Some(host), Some(scheme)) = (uri.host(), uri.scheme_str()) else { return plain };
    if host.parse::<std::net::IpAddr>().is_ok() || host.starts_with('[') {
        return plain;
    }
    let port = uri.port_u16().unwrap_or(if scheme == "https" { 443 } else { 80 });
    let lookup =
        tokio::time::timeout(Duration::from_millis(500), tokio::net::lookup_host((host, port))).await;
    let addrs: Vec<std::net::SocketAddr> = match lookup {
        Ok(Ok(a)) => a.collect(),
        _ => return plain,
    };
    fan_out(&uri, addrs).unwrap_or(plain)
}

/// One destination per address (`None` when that is not several gateways: one address, or loopback only).
fn fan_out(uri: &hyper::Uri, mut addrs: Vec<std::net::SocketAddr>) -> Option<Vec<Destination>> {
    addrs.sort();
    addrs.dedup();
    // One host on several loopback addresses (`localhost` as 127.0.0.1 and ::1) is one gateway.
    if addrs.len() <= 1 || addrs.iter().all(|a| a.ip().is_loopback()) {
        return None;
    }
    let scheme = uri.scheme_str().unwrap_or("http");
    let path = uri.path().trim_end_matches('/');
    let authority = uri.authority().map(|a| a.as_str().to_owned());
    Some(
        addrs
            .into_iter()
            .map(|a| Destination {
                url: format!("{scheme}://{a}{path}/kvgate/v1/report"),
                host_header: authority.clone(),
            })
            .collect(),
    )
}

/// Runs forever: builds a report each interval (or at once when `plan.report_now` is notified) and sends it to
/// every gateway (every address of each `--report-to` host).
pub async fn run(source: ReportSource, engine: EngineHandle, plan: ReportPlan) {
    let ReportPlan {
        targets,
        interval,
        timeout,
        secret,
        draining,
        report_now,
        draining_reported,
        transfers,
        adapters,
    } = plan;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut busy: HashMap<String, Arc<AtomicBool>> = HashMap::new();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut prev = engine.snapshot();
    let mut prev_at = Instant::now();
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = report_now.notified() => {}
        }
        let now = engine.snapshot();
        seq += 1;
        let draining = draining.load(Ordering::Acquire);
        let mut report = source.build(&engine, seq, &prev, &now, prev_at.elapsed(), draining);
        report.lora = adapters.info();
        if let Some(t) = &transfers {
            report.pd.imports = t.imports.lock().unwrap_or_else(|e| e.into_inner()).take();
        }
        prev = now;
        prev_at = Instant::now();
        let body = Bytes::from(report.encode());
        metrics::gauge!("kvgate_worker_report_bytes").set(body.len() as f64);
        let mut dests = Vec::new();
        for target in &targets {
            dests.extend(destinations(target).await);
        }
        let mut sent = Vec::new();
        for dest in dests {
            let flag =
                busy.entry(dest.url.clone()).or_insert_with(|| Arc::new(AtomicBool::new(false))).clone();
            // A draining report is sent even while an older one is still in flight to a slow gateway: skipping
            // it would let the worker exit without saying so (gateways keep the report with the highest `seq`).
            if flag.swap(true, Ordering::AcqRel) && !draining {
                metrics::counter!("kvgate_worker_reports_total", "result" => "skipped_in_flight")
                    .increment(1);
                continue;
            }
            let url = dest.url;
            let mut req = hyper::Request::post(&url).header(hyper::header::CONTENT_TYPE, REPORT_CONTENT_TYPE);
            if let Some(h) = &dest.host_header {
                req = req.header(hyper::header::HOST, h);
            }
            if let Some(s) = &secret {
                req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {s}"));
            }
            let Ok(req) = req.body(Full::new(body.clone())) else {
                flag.store(false, Ordering::Release);
                continue;
            };
            let client = client.clone();
            sent.push(tokio::spawn(async move {
                let result = match tokio::time::timeout(timeout, client.request(req)).await {
                    Ok(Ok(resp)) if resp.status().is_success() => "ok",
                    Ok(Ok(resp)) => {
                        tracing::debug!(%url, status = %resp.status(), "gateway refused the report");
                        "refused"
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(%url, error = %e, "report not delivered");
                        "error"
                    }
                    Err(_) => "timeout",
                };
                metrics::counter!("kvgate_worker_reports_total", "result" => result).increment(1);
                flag.store(false, Ordering::Release);
            }));
        }
        if draining {
            // Shutdown waits for this report before it closes the listener.
            for s in sent {
                let _ = s.await;
            }
            draining_reported.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::engine_thread::{time_step, StepWork};

    fn work(decodes: u64, computed: u64, area: u64) -> StepWork {
        StepWork { decodes, computed, area, context: decodes * 1_000 }
    }

    #[test]
    fn step_timings_measure_what_prefill_chunks_add_to_decode_steps() {
        let mut t = EngineSnapshot::default();
        let start = t;
        // Decode-only steps of 10 ms, then mixed steps of 40 ms (30 ms of prefill chunk each) with 2,000 prompt
        // tokens computed in each, and a prefill-only step of 50 ms with 2,048.
        for _ in 0..4 {
            time_step(&mut t, work(8, 8, 0), 0.010);
        }
        for _ in 0..2 {
            time_step(&mut t, work(8, 2008, 2000 * 1000), 0.040);
            t.prefill_tokens += 2000;
        }
        time_step(&mut t, work(0, 2048, 2048 * 30_000), 0.050);
        t.prefill_tokens += 2048;
        let s = step_timing(&start, &t);
        assert!((s.decode_step_s - 0.010).abs() < 1e-12, "{s:?}");
        // The decode fit sees only the decode-only steps (one batch size: no slope to tell).
        assert!((s.decode_base_s - 0.010).abs() < 1e-12 && s.decode_per_seq_s == 0.0, "{s:?}");
        // 2 x 30 ms stalled of 4 x 10 + 2 x 40 = 120 ms carrying decodes.
        assert!((s.stall_ratio - 0.5).abs() < 1e-9, "{s:?}");
        assert!((s.prefill_tokens_per_s - 6048.0 / 0.130).abs() < 1e-6, "{s:?}");
        // The fit: 40 ms for 2,000 tokens at a short context, 50 ms for 2,048 at a long one: both terms priced.
        assert!(s.prefill_per_token_s > 0.0 && s.prefill_attention_s > 0.0, "{s:?}");
        let predicted = s.prefill_per_token_s * 2048.0 + s.prefill_attention_s * (2048.0 * 30_000.0);
        assert!((predicted - 0.050).abs() < 1e-3, "{s:?}");
        // An idle interval: nothing measured (the gateway keeps what it had).
        let idle = step_timing(&t, &t);
        assert_eq!((idle.prefill_tokens_per_s, idle.stall_ratio), (0.0, 0.0));
    }

    #[tokio::test]
    async fn destinations_fan_out_only_over_several_addresses() {
        let one = destinations("http://127.0.0.1:8081/").await;
        assert_eq!(
            one,
            vec![Destination { url: "http://127.0.0.1:8081/kvgate/v1/report".into(), host_header: None }]
        );
        // `localhost` (127.0.0.1 and maybe ::1) is one gateway: the URL as given.
        let local = destinations("http://localhost:8081").await;
        assert_eq!(
            local,
            vec![Destination { url: "http://localhost:8081/kvgate/v1/report".into(), host_header: None }]
        );
        // A headless Service over three gateway pods: one report each, with the Service's name as Host.
        let uri: hyper::Uri = "http://kv-control.serving.svc:8081".parse().expect("uri");
        let addrs = ["10.0.0.7:8081", "10.0.0.5:8081", "10.0.0.7:8081", "[fd00::9]:8081"]
            .map(|a| a.parse().expect("addr"))
            .to_vec();
        let d = fan_out(&uri, addrs).expect("several gateways");
        let urls: Vec<&str> = d.iter().map(|x| x.url.as_str()).collect();
        assert_eq!(
            urls,
            [
                "http://10.0.0.5:8081/kvgate/v1/report",
                "http://10.0.0.7:8081/kvgate/v1/report",
                "http://[fd00::9]:8081/kvgate/v1/report"
            ]
        );
        assert!(d.iter().all(|x| x.host_header.as_deref() == Some("kv-control.serving.svc:8081")));
        let unresolvable = destinations("http://no-such-host.invalid:8081").await;
        assert_eq!(unresolvable.len(), 1);
        assert_eq!(unresolvable[0].url, "http://no-such-host.invalid:8081/kvgate/v1/report");
    }
}
