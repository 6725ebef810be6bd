//! Load of pods that send no reports, scraped from their Prometheus endpoints once a second (`[[models]]` pools
//! of kind `vllm` or `sglang`, `scrape-metrics`): requests waiting and running, summed over the series of every
//! engine and rank. vLLM: `vllm:num_requests_waiting`, `vllm:num_requests_running`; SGLang: `sglang:num_queue_reqs`,
//! `sglang:num_running_reqs`. The registry takes them like a report's queue (`Registry::set_scraped`), so the
//! load term sees the pod's whole queue (other clients' requests too) plus what this gateway sent since.
//! A scrape that fails or finds none of the series changes nothing (counted: `kvgate_gateway_scrapes_total{result}`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};

use crate::config::WorkerKind;
use crate::state::GatewayState;

/// Time between two scrapes of one pod.
pub const SCRAPE_INTERVAL: Duration = Duration::from_secs(1);
/// Longest a scrape may take, body included.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_millis(800);
/// Largest metrics page read.
pub const MAX_METRICS_BYTES: usize = 4 << 20;

/// A pod's queue as its metrics say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScrapedQueue {
    pub waiting: u32,
    pub running: u32,
}

/// The metric names of a kind: (waiting, running); `None` for kinds without known metrics.
pub fn metric_names(kind: WorkerKind) -> Option<(&'static str, &'static str)> {
    match kind {
        WorkerKind::Vllm => Some(("vllm:num_requests_waiting", "vllm:num_requests_running")),
        WorkerKind::Sglang => Some(("sglang:num_queue_reqs", "sglang:num_running_reqs")),
        WorkerKind::Kvgate | WorkerKind::Openai => None,
    }
}

/// Sums the series of `waiting` and `running` in a Prometheus text page; `None` if neither appears.
pub fn parse(text: &str, (waiting, running): (&str, &str)) -> Option<ScrapedQueue> {
    let (mut w, mut r, mut seen) = (0f64, 0f64, false);
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        // `name{labels} value [timestamp]` or `name value`.
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => (&line[..i], &line[i..]),
            None => continue,
        };
        let target = if name == waiting {
            &mut w
        } else if name == running {
            &mut r
        } else {
            continue;
        };
        let value = rest.rsplit_once('}').map_or(rest, |(_, v)| v).split_whitespace().next();
        if let Some(v) = value.and_then(|v| v.parse::<f64>().ok()).filter(|v| v.is_finite() && *v >= 0.0) {
            *target += v;
            seen = true;
        }
    }
    let clamp = |v: f64| v.min(f64::from(u32::MAX)) as u32;
    seen.then(|| ScrapedQueue { waiting: clamp(w), running: clamp(r) })
}

fn count(result: &'static str) {
    metrics::counter!("kvgate_gateway_scrapes_total", "result" => result).increment(1);
}

async fn scrape_once(
    state: &GatewayState,
    url: &str,
    names: (&str, &str),
) -> Result<ScrapedQueue, &'static str> {
    let uri = format!("{}/metrics", url.trim_end_matches('/'));
    let req = hyper::Request::get(&uri).body(Full::new(Bytes::new())).map_err(|_| "request")?;
    let fetch = async {
        let resp = state.client.request(req).await.map_err(|_| "connect")?;
        if !resp.status().is_success() {
            return Err("status");
        }
        let body = Limited::new(resp.into_body(), MAX_METRICS_BYTES).collect().await.map_err(|_| "body")?;
        Ok(body.to_bytes())
    };
    let body = tokio::time::timeout(SCRAPE_TIMEOUT, fetch).await.map_err(|_| "timeout")??;
    let text = std::str::from_utf8(&body).map_err(|_| "not_text")?;
    parse(text, names).ok_or("no_series")
}

/// Scrapes every configured static pod with known metrics, forever (on the calling runtime).
pub fn spawn_all(state: &Arc<GatewayState>) {
    for m in &state.cfg.models {
        for url in &m.workers {
            spawn_pod(state, m, url);
        }
    }
}

/// Scrapes one pod of `model`'s pool once a second until the task is aborted (`None`: nothing to scrape).
pub fn spawn_pod(
    state: &Arc<GatewayState>,
    model: &crate::config::ModelSpec,
    url: &str,
) -> Option<tokio::task::JoinHandle<()>> {
    let names = metric_names(model.kind).filter(|_| model.scrape_metrics)?;
    let (s, url) = (state.clone(), url.to_owned());
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(SCRAPE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match scrape_once(&s, &url, names).await {
                Ok(q) => {
                    s.registry().set_scraped(&url, q.waiting, q.running);
                    count("ok");
                }
                Err(why) => {
                    tracing::debug!(%url, why, "metrics scrape failed");
                    count(why);
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_sglang_pages_are_summed_over_their_series() {
        let vllm = "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
                    # TYPE vllm:num_requests_waiting gauge\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"llama\"} 3.0\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"llama\"} 2.0\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"llama\"} 7.0\n\
                    vllm:num_requests_running_total 99\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.42\n";
        let names = metric_names(WorkerKind::Vllm).expect("vllm");
        assert_eq!(parse(vllm, names), Some(ScrapedQueue { waiting: 5, running: 7 }));
        let sglang = "sglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:num_running_reqs{model_name=\"m\"} 1 1700000000\n";
        let names = metric_names(WorkerKind::Sglang).expect("sglang");
        assert_eq!(parse(sglang, names), Some(ScrapedQueue { waiting: 4, running: 1 }));
        // Nothing known, a hostile value, a label with a brace-like string: nothing taken, or only sane values.
        assert_eq!(parse("up 1\n", names), None);
        assert_eq!(parse("sglang:num_queue_reqs NaN\nsglang:num_queue_reqs -3\n", names), None);
        assert_eq!(
            parse("sglang:num_queue_reqs{a=\"}\"} 2\n", names),
            Some(ScrapedQueue { waiting: 2, running: 0 })
        );
        assert_eq!(
            parse("sglang:num_queue_reqs 1e30\n", names),
            Some(ScrapedQueue { waiting: u32::MAX, running: 0 })
        );
        assert_eq!(metric_names(WorkerKind::Openai), None);
    }
}
