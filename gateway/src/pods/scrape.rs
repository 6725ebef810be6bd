//! Load and KV cache of pods that send no reports, scraped from their Prometheus endpoints once a second
//! (`[[models]]` pools of kind `vllm` or `sglang`, `scrape-metrics`):
//! - requests waiting and running, summed over the series of every engine and rank (vLLM:
//!   `vllm:num_requests_waiting`, `vllm:num_requests_running`; SGLang: `sglang:num_queue_reqs`,
//!   `sglang:num_running_reqs`). The registry takes them like a report's queue (`Registry::set_scraped`), so the
//!   load term sees the pod's whole queue (other clients' requests too) plus what this gateway sent since;
//! - the fraction of the KV cache in use (vLLM `vllm:kv_cache_usage_perc`, before 0.10 `vllm:gpu_cache_usage_perc`;
//!   SGLang `sglang:token_usage`; the mean over engines), shown per worker;
//! - the KV cache's size, which replaces the configured `kv-tokens` as the pod's approximate index capacity: vLLM's
//!   `vllm:cache_config_info` labels (`num_gpu_blocks` x `block_size`; the largest series: vLLM's front end puts
//!   the total over its data-parallel engines on each engine's series); SGLang's `sglang:num_used_tokens` /
//!   `sglang:token_usage` (only while usage is at least [`MIN_USAGE_FOR_CAPACITY`]: SGLang rounds the usage to two
//!   decimals, so below that the ratio is too rough).
//! - the inter-token latency histogram's sum and count (vLLM `vllm:inter_token_latency_seconds`, in older releases
//!   `vllm:time_per_output_token_seconds`; SGLang `sglang:inter_token_latency_seconds`), from which the registry
//!   fits the pod's decode cost against its running requests (`PodDecode`): the goodput objective's decode terms.
//!
//! - the model's context length, from the pod's `/v1/models` (`max_model_len` of the model's card, as vLLM and
//!   SGLang serve it) every [`MODELS_EVERY`] scrapes, the smaller of it and the `[[models]]` entry's
//!   `max-model-len` (`Registry::set_max_model_len`): the gateway then refuses over-long requests itself; and the
//!   LoRA adapters it holds (the cards whose `parent` is the model; `Registry::set_pod_adapters`), every
//!   [`MODELS_EVERY_WITH_LORA`] scrapes when the gateway has a `--lora` catalogue.
//!
//! A vLLM pod's data-parallel rank listed as a worker of its own (`dp_rank`) reads only its engine's series
//! (`engine="<rank>"`) and its share of the pod's KV capacity (`parse_rank`).
//!
//! A scrape that fails or finds none of the queue series changes nothing (counted:
//! `kvgate_gateway_scrapes_total{result}`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use kvgate_router::registry::Scraped;

use super::PodsHost;
use crate::config::WorkerKind;

/// Time between two scrapes of one pod.
pub const SCRAPE_INTERVAL: Duration = Duration::from_secs(1);
/// Longest a scrape may take, body included.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_millis(800);
/// Largest metrics page read.
pub const MAX_METRICS_BYTES: usize = 4 << 20;
/// Least SGLang usage from which its capacity is computed (the rounding error is then under 2.5%).
pub const MIN_USAGE_FOR_CAPACITY: f64 = 0.2;
/// Largest KV capacity taken from a page, in tokens (a bigger figure is not believed).
pub const MAX_SCRAPED_KV_TOKENS: u64 = 1 << 34;
/// `/v1/models` is read at the first scrape and then every this many.
pub const MODELS_EVERY: u32 = 30;
/// With a `--lora` catalogue, `/v1/models` (the adapters a pod holds) is read every this many scrapes.
pub const MODELS_EVERY_WITH_LORA: u32 = 2;
/// Largest `/v1/models` body read.
pub const MAX_MODELS_BYTES: usize = 1 << 20;

/// What a pod's `/v1/models` says of `model`: its context length and its LoRA adapters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodModels {
    /// `max_model_len` of the model's card; `None` if absent or not a positive integer that fits a u32.
    pub max_model_len: Option<u32>,
    /// The ids of the cards whose `parent` is the model (vLLM lists its LoRA adapters so), at most
    /// `MAX_REPORT_ADAPTERS`, each at most `MAX_ADAPTER_NAME_BYTES` bytes.
    pub adapters: Vec<String>,
}

/// What a `/v1/models` body (vLLM, SGLang) says of `model`; `None` if it is not a model list.
pub fn parse_models(body: &[u8], model: &str) -> Option<PodModels> {
    #[derive(serde::Deserialize)]
    struct Card {
        id: String,
        #[serde(default)]
        max_model_len: Option<serde_json::Value>,
        #[serde(default)]
        parent: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<Card>,
    }
    use kvgate_shared::report::{MAX_ADAPTER_NAME_BYTES, MAX_REPORT_ADAPTERS};
    let list: List = serde_json::from_slice(body).ok()?;
    let max_model_len = list
        .data
        .iter()
        .find(|c| c.id == model)
        .and_then(|c| c.max_model_len.as_ref()?.as_u64())
        .filter(|n| *n > 0)
        .and_then(|n| u32::try_from(n).ok());
    let adapters = list
        .data
        .into_iter()
        .filter(|c| c.parent.as_deref() == Some(model) && c.id != model)
        .filter(|c| !c.id.is_empty() && c.id.len() <= MAX_ADAPTER_NAME_BYTES)
        .map(|c| c.id)
        .take(MAX_REPORT_ADAPTERS)
        .collect();
    Some(PodModels { max_model_len, adapters })
}

async fn models_once(state: &impl PodsHost, url: &str, model: &str) -> Option<PodModels> {
    let uri = format!("{}/v1/models", super::dp_rank::base(url));
    let req = hyper::Request::get(&uri).body(Full::new(Bytes::new())).ok()?;
    let fetch = async {
        let resp = state.client().request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        Limited::new(resp.into_body(), MAX_MODELS_BYTES).collect().await.ok().map(|b| b.to_bytes())
    };
    let body = tokio::time::timeout(SCRAPE_TIMEOUT, fetch).await.ok()??;
    parse_models(&body, model)
}

/// How a kind's page is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricNames {
    pub waiting: &'static str,
    pub running: &'static str,
    /// KV usage gauges (a fraction), any of them.
    pub usage: &'static [&'static str],
    pub capacity: Capacity,
    /// Inter-token latency histograms (seconds), newest name first: the first whose `_count` the page has is read.
    pub itl: &'static [&'static str],
}

/// Where a kind's KV capacity comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capacity {
    /// `vllm:cache_config_info{num_gpu_blocks="N",block_size="B",..} 1`: N x B tokens (the largest series).
    VllmCacheConfig,
    /// This gauge of tokens in use divided by the usage fraction.
    UsedOverUsage(&'static str),
}

/// The metric names of a kind; `None` for kinds without known metrics.
pub fn metric_names(kind: WorkerKind) -> Option<MetricNames> {
    match kind {
        WorkerKind::Vllm => Some(MetricNames {
            waiting: "vllm:num_requests_waiting",
            running: "vllm:num_requests_running",
            usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
            capacity: Capacity::VllmCacheConfig,
            itl: &["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"],
        }),
        WorkerKind::Sglang => Some(MetricNames {
            waiting: "sglang:num_queue_reqs",
            running: "sglang:num_running_reqs",
            usage: &["sglang:token_usage"],
            capacity: Capacity::UsedOverUsage("sglang:num_used_tokens"),
            itl: &["sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"],
        }),
        WorkerKind::Kvgate | WorkerKind::Openai => None,
    }
}

/// The value of a label in a `{...}` label set (no unescaping: the labels read here are numbers).
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = labels;
    while let Some(i) = rest.find(name) {
        let after = &rest[i + name.len()..];
        let boundary = i == 0 || matches!(rest.as_bytes()[i - 1], b'{' | b',' | b' ');
        if boundary {
            if let Some(v) = after.strip_prefix("=\"") {
                return v.split('"').next();
            }
        }
        rest = after;
    }
    None
}

/// Reads a Prometheus text page (the KV capacity in the model's blocks of `block_size` tokens); `None` if neither
/// queue series appears.
pub fn parse(text: &str, names: &MetricNames, block_size: u32) -> Option<Scraped> {
    parse_rank(text, names, block_size, None)
}

/// [`parse`] for one data-parallel rank of a vLLM pod (`dp_rank`): only the series labelled `engine="<rank>"`
/// count, and the KV capacity (each engine's `cache_config_info` carries the pod's total) is split evenly over the
/// engines the page names.
pub fn parse_rank(text: &str, names: &MetricNames, block_size: u32, rank: Option<u32>) -> Option<Scraped> {
    let rank = rank.map(|r| r.to_string());
    let mut engines = std::collections::BTreeSet::new();
    let (mut w, mut r, mut seen) = (0f64, 0f64, false);
    let (mut usage_sum, mut usage_n) = (0f64, 0u32);
    let (mut config_tokens, mut used_tokens) = (None::<f64>, None::<f64>);
    // Per inter-token latency family: its sum and count, summed over the series read.
    let mut itl = [(0f64, None::<f64>); 2];
    let sane = |v: &str| v.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0);
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
        let (labels, value) = match rest.rsplit_once('}') {
            Some((l, v)) => (l, v),
            None => ("", rest),
        };
        let Some(v) = value.split_whitespace().next().and_then(sane) else { continue };
        if let Some(want) = &rank {
            let engine = label(labels, "engine");
            if name == "vllm:cache_config_info" && engines.len() < 64 {
                engines.insert(engine.unwrap_or("").to_owned());
            }
            if engine != Some(want.as_str()) {
                continue;
            }
        }
        if name == names.waiting {
            w += v;
            seen = true;
        } else if name == names.running {
            r += v;
            seen = true;
        } else if names.usage.contains(&name) {
            usage_sum += v.min(1.0);
            usage_n += 1;
        } else if names.capacity == Capacity::VllmCacheConfig && name == "vllm:cache_config_info" {
            let num = |n: &str| label(labels, n).and_then(sane);
            if let (Some(blocks), Some(size)) = (num("num_gpu_blocks"), num("block_size")) {
                let t = config_tokens.get_or_insert(0.0);
                *t = t.max(blocks * size);
            }
        } else if matches!(names.capacity, Capacity::UsedOverUsage(g) if g == name) {
            *used_tokens.get_or_insert(0.0) += v;
        } else if let Some((family, part)) = name.rsplit_once('_') {
            if let Some(f) = names.itl.iter().take(itl.len()).position(|n| *n == family) {
                match part {
                    "sum" => itl[f].0 += v,
                    "count" => *itl[f].1.get_or_insert(0.0) += v,
                    _ => {}
                }
            }
        }
    }
    let clamp = |v: f64| v.min(f64::from(u32::MAX)) as u32;
    let kv_usage = (usage_n > 0).then(|| usage_sum / f64::from(usage_n));
    let capacity = match names.capacity {
        Capacity::VllmCacheConfig if rank.is_some() => config_tokens.map(|t| t / engines.len().max(1) as f64),
        Capacity::VllmCacheConfig => config_tokens,
        Capacity::UsedOverUsage(_) => match (used_tokens, kv_usage) {
            (Some(used), Some(u)) if u >= MIN_USAGE_FOR_CAPACITY => Some(used / u),
            _ => None,
        },
    };
    let kv_capacity_blocks = capacity
        .filter(|c| *c >= 1.0 && *c <= MAX_SCRAPED_KV_TOKENS as f64)
        .map(|c| (c.round() as u64 / u64::from(block_size.max(1))) as usize);
    let kv_capacity_tokens =
        capacity.filter(|c| *c >= 1.0 && *c <= MAX_SCRAPED_KV_TOKENS as f64).map(|c| c.round() as u64);
    let itl_sum_count = itl.iter().find_map(|(sum, count)| count.map(|c| (*sum, c)));
    seen.then(|| Scraped {
        waiting: clamp(w),
        running: clamp(r),
        kv_usage,
        kv_capacity_blocks,
        kv_capacity_tokens,
        itl_sum_count,
    })
}

fn count(result: &'static str) {
    metrics::counter!("kvgate_gateway_scrapes_total", "result" => result).increment(1);
}

async fn scrape_once(
    state: &impl PodsHost,
    url: &str,
    names: &MetricNames,
    block_size: u32,
) -> Result<Scraped, &'static str> {
    let uri = format!("{}/metrics", super::dp_rank::base(url));
    let req = hyper::Request::get(&uri).body(Full::new(Bytes::new())).map_err(|_| "request")?;
    let fetch = async {
        let resp = state.client().request(req).await.map_err(|_| "connect")?;
        if !resp.status().is_success() {
            return Err("status");
        }
        let body = Limited::new(resp.into_body(), MAX_METRICS_BYTES).collect().await.map_err(|_| "body")?;
        Ok(body.to_bytes())
    };
    let body = tokio::time::timeout(SCRAPE_TIMEOUT, fetch).await.map_err(|_| "timeout")??;
    let text = std::str::from_utf8(&body).map_err(|_| "not_text")?;
    parse_rank(text, names, block_size, super::dp_rank::split(url).1).ok_or("no_series")
}

/// Scrapes every configured static pod with known metrics, forever (on the calling runtime).
pub fn spawn_all<H: PodsHost>(state: &Arc<H>) {
    for m in &state.cfg().models {
        for url in &m.workers {
            spawn_pod(state, m, url);
        }
    }
}

/// Scrapes one pod of `model`'s pool once a second until the task is aborted (`None`: nothing to scrape).
pub fn spawn_pod<H: PodsHost>(
    state: &Arc<H>,
    model: &crate::config::ModelSpec,
    url: &str,
) -> Option<tokio::task::JoinHandle<()>> {
    let names = metric_names(model.kind).filter(|_| model.scrape_metrics)?;
    let (s, url, block_size) = (state.clone(), url.to_owned(), model.block_size);
    let (name, configured) = (model.name.clone(), model.max_model_len);
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(SCRAPE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n: u32 = 0;
        // With a `--lora` catalogue the adapters a pod holds change at run time: read them more often.
        let every = if s.cfg().lora.is_empty() { MODELS_EVERY } else { MODELS_EVERY_WITH_LORA };
        loop {
            tick.tick().await;
            n = n.wrapping_add(1);
            if n % every == 1 || every == 1 {
                if let Some(m) = models_once(s.as_ref(), &url, &name).await {
                    let mut reg = s.registry();
                    if let Some(len) = m.max_model_len {
                        reg.set_max_model_len(&url, configured.map_or(len, |c| c.min(len)));
                    }
                    reg.set_pod_adapters(&url, &m.adapters, None);
                }
            }
            match scrape_once(s.as_ref(), &url, &names, block_size).await {
                Ok(page) => {
                    s.registry().set_scraped(&url, &page);
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
    fn a_pods_context_length_is_read_from_its_model_card() {
        let vllm = br#"{"object":"list","data":[{"id":"other","max_model_len":1},
            {"id":"llama","object":"model","owned_by":"vllm","root":"/m","max_model_len":131072}]}"#;
        let len = |b: &[u8], m: &str| parse_models(b, m).and_then(|p| p.max_model_len);
        assert_eq!(len(vllm, "llama"), Some(131_072));
        assert_eq!(len(vllm, "absent"), None);
        for bad in [
            &br#"{"data":[{"id":"llama"}]}"#[..],
            br#"{"data":[{"id":"llama","max_model_len":0}]}"#,
            br#"{"data":[{"id":"llama","max_model_len":-5}]}"#,
            br#"{"data":[{"id":"llama","max_model_len":1e300}]}"#,
            br#"{"data":[{"id":"llama","max_model_len":"4096"}]}"#,
            br#"{"data":[{"id":"llama","max_model_len":99999999999}]}"#,
            b"not json",
        ] {
            assert_eq!(len(bad, "llama"), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_pods_lora_adapters_are_the_cards_whose_parent_is_the_model() {
        // As vLLM 0.11+ lists `--lora-modules` and runtime-loaded adapters.
        let vllm = br#"{"object":"list","data":[
            {"id":"llama","object":"model","root":"/m","parent":null,"max_model_len":4096},
            {"id":"sql","object":"model","root":"/loras/sql","parent":"llama","max_model_len":4096},
            {"id":"other-base-lora","object":"model","root":"/x","parent":"mistral"},
            {"id":"llama","object":"model","parent":"llama"}]}"#;
        let p = parse_models(vllm, "llama").expect("a list");
        assert_eq!((p.max_model_len, p.adapters), (Some(4096), vec!["sql".to_owned()]));
        let long = format!(r#"{{"data":[{{"id":"{}","parent":"llama"}}]}}"#, "n".repeat(300));
        assert!(
            parse_models(long.as_bytes(), "llama").expect("list").adapters.is_empty(),
            "an overlong name"
        );
        let many: Vec<String> = (0..300).map(|i| format!(r#"{{"id":"a{i}","parent":"llama"}}"#)).collect();
        let many = format!(r#"{{"data":[{}]}}"#, many.join(","));
        assert_eq!(parse_models(many.as_bytes(), "llama").expect("list").adapters.len(), 256);
    }

    #[test]
    fn the_inter_token_latency_histogram_is_summed_over_engines_newest_name_first() {
        let names = metric_names(WorkerKind::Vllm).expect("vllm");
        let page = "vllm:num_requests_running{engine=\"0\"} 2\n\
                    vllm:num_requests_running{engine=\"1\"} 1\n\
                    vllm:inter_token_latency_seconds_bucket{engine=\"0\",le=\"0.01\"} 5.0\n\
                    vllm:inter_token_latency_seconds_sum{engine=\"0\",model_name=\"m\"} 1.5\n\
                    vllm:inter_token_latency_seconds_count{engine=\"0\",model_name=\"m\"} 100.0\n\
                    vllm:inter_token_latency_seconds_sum{engine=\"1\",model_name=\"m\"} 0.5\n\
                    vllm:inter_token_latency_seconds_count{engine=\"1\",model_name=\"m\"} 50.0\n\
                    vllm:inter_token_latency_seconds_created{engine=\"0\"} 1.7e9\n\
                    vllm:time_per_output_token_seconds_sum{engine=\"0\"} 99.0\n\
                    vllm:time_per_output_token_seconds_count{engine=\"0\"} 99.0\n\
                    vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1.0\n";
        let s = parse(page, &names, 16).expect("parsed");
        assert_eq!(s.itl_sum_count, Some((2.0, 150.0)), "both engines, the newer name only");
        assert_eq!((s.kv_capacity_tokens, s.kv_capacity_blocks), (Some(1_600), Some(100)));
        let rank1 = parse_rank(page, &names, 16, Some(1)).expect("rank 1");
        assert_eq!(rank1.itl_sum_count, Some((0.5, 50.0)), "a rank reads its engine's series only");
        // An older vLLM's name, when the newer is absent; a page without either says nothing.
        let old = "vllm:num_requests_running 1\nvllm:time_per_output_token_seconds_sum 3.0\n\
                   vllm:time_per_output_token_seconds_count 60\n";
        assert_eq!(parse(old, &names, 16).expect("old").itl_sum_count, Some((3.0, 60.0)));
        assert_eq!(parse("vllm:num_requests_running 1\n", &names, 16).expect("bare").itl_sum_count, None);
        // Nonsense figures are not read (a negative or non-finite value is skipped like any other series).
        let bad = "vllm:num_requests_running 1\nvllm:inter_token_latency_seconds_sum -4\n\
                   vllm:inter_token_latency_seconds_count NaN\n";
        assert_eq!(parse(bad, &names, 16).expect("bad").itl_sum_count, None);
    }

    fn queue(waiting: u32, running: u32) -> Scraped {
        Scraped { waiting, running, ..Scraped::default() }
    }

    #[test]
    fn vllm_and_sglang_pages_are_summed_over_their_series() {
        let vllm = "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
                    # TYPE vllm:num_requests_waiting gauge\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"llama\"} 3.0\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"llama\"} 2.0\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"llama\"} 7.0\n\
                    vllm:num_requests_running_total 99\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.42\n\
                    vllm:kv_cache_usage_perc{engine=\"1\"} 0.58\n\
                    vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"27000\",num_cpu_blocks=\"0\"} 1.0\n\
                    vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"27000\"} 1.0\n";
        let names = metric_names(WorkerKind::Vllm).expect("vllm");
        let page = parse(vllm, &names, 16).expect("page");
        assert_eq!((page.waiting, page.running), (5, 7));
        assert!((page.kv_usage.expect("usage") - 0.5).abs() < 1e-12);
        // Each engine's series carries the pod's total: taken once.
        assert_eq!(page.kv_capacity_blocks, Some(27_000));
        // In the model's blocks of 32 tokens.
        assert_eq!(parse(vllm, &names, 32).and_then(|p| p.kv_capacity_blocks), Some(13_500));
        // One data-parallel rank: its engine's series only, and half the pod's KV (two engines).
        let rank1 = parse_rank(vllm, &names, 16, Some(1)).expect("rank 1");
        assert_eq!((rank1.waiting, rank1.running, rank1.kv_usage), (2, 0, Some(0.58)));
        assert_eq!(rank1.kv_capacity_blocks, Some(13_500));
        assert_eq!(parse_rank(vllm, &names, 16, Some(2)), None, "no series of an engine the pod lacks");
        // vLLM before 0.10 named its usage gauge differently.
        let old = "vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.9\n";
        assert_eq!(parse(old, &names, 16).and_then(|p| p.kv_usage), Some(0.9));

        let sglang = "sglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:num_running_reqs{model_name=\"m\"} 1 1700000000\n\
                      sglang:token_usage{model_name=\"m\"} 0.25\nsglang:num_used_tokens{model_name=\"m\"} 50000\n";
        let names = metric_names(WorkerKind::Sglang).expect("sglang");
        let page = parse(sglang, &names, 16).expect("page");
        assert_eq!((page.waiting, page.running, page.kv_usage), (4, 1, Some(0.25)));
        assert_eq!(page.kv_capacity_blocks, Some(12_500));
        // A lightly used SGLang pod's capacity is not read from its rounded usage.
        let idle = "sglang:num_queue_reqs 0\nsglang:token_usage 0.02\nsglang:num_used_tokens 3000\n";
        assert_eq!(parse(idle, &names, 16).map(|p| p.kv_capacity_blocks), Some(None));

        // Nothing known, hostile values, a label with a brace-like string: nothing taken, or only sane values.
        assert_eq!(parse("up 1\n", &names, 16), None);
        assert_eq!(parse("sglang:num_queue_reqs NaN\nsglang:num_queue_reqs -3\n", &names, 16), None);
        assert_eq!(parse("sglang:num_queue_reqs{a=\"}\"} 2\n", &names, 16), Some(queue(2, 0)));
        assert_eq!(parse("sglang:num_queue_reqs 1e30\n", &names, 16), Some(queue(u32::MAX, 0)));
        let huge = "sglang:num_queue_reqs 0\nsglang:token_usage 0.5\nsglang:num_used_tokens 1e300\n";
        assert_eq!(parse(huge, &names, 16).map(|p| p.kv_capacity_blocks), Some(None));
        let vnames = metric_names(WorkerKind::Vllm).expect("vllm");
        let forged = "vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 40\n\
                      vllm:cache_config_info{xnum_gpu_blocks=\"5\",block_size=\"16\"} 1\n";
        let page = parse(forged, &vnames, 16).expect("page");
        assert_eq!((page.kv_usage, page.kv_capacity_blocks), (Some(1.0), None));
        assert_eq!(metric_names(WorkerKind::Openai), None);
    }
}
