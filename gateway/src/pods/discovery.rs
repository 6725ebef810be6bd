//! DNS discovery of a pool's pods (`[[models]]` `discover = "NAME:PORT"`): every [`DISCOVERY_INTERVAL`] the
//! name's A/AAAA records (a Kubernetes headless Service lists one per ready pod) become the pool's pods,
//! `http://<address>:<PORT>`: new ones are enrolled like static workers (with their metrics scrape and KV events
//! tasks), vanished ones taken out. A lookup that fails or finds nothing changes nothing (a DNS hiccup must not
//! empty the pool); counted in `kvgate_gateway_discovery_total{result}`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::PodsHost;
use crate::config::ModelSpec;

/// Time between two lookups of one name.
pub const DISCOVERY_INTERVAL: Duration = Duration::from_secs(5);
/// Longest one lookup may take.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);
/// Most pods one name may bring (the rest are ignored, counted).
pub const MAX_DISCOVERED: usize = 1024;

/// The pods' base URLs for resolved addresses.
pub fn urls_of(addrs: impl IntoIterator<Item = SocketAddr>) -> BTreeSet<String> {
    addrs
        .into_iter()
        .map(|a| match a {
            SocketAddr::V4(v4) => format!("http://{}:{}", v4.ip(), v4.port()),
            SocketAddr::V6(v6) => format!("http://[{}]:{}", v6.ip(), v6.port()),
        })
        .take(MAX_DISCOVERED)
        .collect()
}

/// (added, removed) going from `known` to `found`.
pub fn diff(known: &BTreeSet<String>, found: &BTreeSet<String>) -> (Vec<String>, Vec<String>) {
    (found.difference(known).cloned().collect(), known.difference(found).cloned().collect())
}

fn count(result: &'static str) {
    metrics::counter!("kvgate_gateway_discovery_total", "result" => result).increment(1);
}

/// Keeps every discovered pool up to date, forever (on the calling runtime).
pub fn spawn_all<H: PodsHost>(state: &Arc<H>) {
    for m in state.cfg().models.iter().filter(|m| m.discover.is_some()) {
        tokio::spawn(run(state.clone(), m.clone()));
    }
}

async fn run<H: PodsHost>(state: Arc<H>, m: ModelSpec) {
    let Some(name) = m.discover.clone() else { return };
    // A pod's background tasks (scrape, KV events), aborted when it leaves.
    let mut pods: BTreeMap<String, Vec<tokio::task::JoinHandle<()>>> = BTreeMap::new();
    let mut tick = tokio::time::interval(DISCOVERY_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let found = match tokio::time::timeout(LOOKUP_TIMEOUT, tokio::net::lookup_host(name.as_str())).await {
            Ok(Ok(addrs)) => urls_of(addrs),
            Ok(Err(e)) => {
                tracing::warn!(%name, error = %e, "discovery: lookup failed; the pool is kept as it is");
                count("error");
                continue;
            }
            Err(_) => {
                tracing::warn!(%name, "discovery: lookup timed out; the pool is kept as it is");
                count("timeout");
                continue;
            }
        };
        if found.is_empty() {
            count("empty");
            continue;
        }
        count("ok");
        let known: BTreeSet<String> = pods.keys().cloned().collect();
        let (added, removed) = diff(&known, &found);
        for url in removed {
            tracing::info!(%name, %url, "discovery: pod gone");
            state.registry().remove_static(&url);
            for task in pods.remove(&url).unwrap_or_default() {
                task.abort();
            }
        }
        for url in added {
            tracing::info!(%name, %url, "discovery: pod found");
            state.enroll(&m, &url);
            if m.kind == crate::config::WorkerKind::Kvgate {
                state.fetch_tokenizer(url.clone());
            }
            let tasks = [
                crate::pods::scrape::spawn_pod(&state, &m, &url),
                crate::pods::vllm_subscriber::spawn_pod(&state, &m, &url),
            ];
            pods.insert(url, tasks.into_iter().flatten().collect());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_become_urls_and_changes_are_diffs() {
        let urls = urls_of(["10.0.0.2:8000".parse().expect("v4"), "[fd00::5]:8000".parse().expect("v6")]);
        assert_eq!(
            urls,
            BTreeSet::from(["http://10.0.0.2:8000".to_owned(), "http://[fd00::5]:8000".to_owned()])
        );
        let known = BTreeSet::from(["http://a:1".to_owned(), "http://b:1".to_owned()]);
        let found = BTreeSet::from(["http://b:1".to_owned(), "http://c:1".to_owned()]);
        assert_eq!(diff(&known, &found), (vec!["http://c:1".to_owned()], vec!["http://a:1".to_owned()]));
        let many =
            (0..5000u32).map(|i| SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 80)));
        assert_eq!(urls_of(many).len(), MAX_DISCOVERED);
    }
}
