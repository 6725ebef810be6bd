//! Follows the KV events of vLLM (or SGLang) pods: one task per pod finds where they are published (the pool's
//! `kv-events-pods` entry for the pod, else `kv-events-port` at the pod's host, else, for `vllm` pools, the pod's
//! own `GET /kv_event_sources`: `event_sources`, retried until the pod answers; metric
//! `kvgate_gateway_kv_event_sources_total{result}`; a pod that answers nothing to follow is asked again every
//! minute), holds a ZMQ SUB connection (`zmtp`, frames bounded) there,
//! decodes each batch (`vllm_events`), applies it to the
//! pod's exact index (`vllm_index`) and hands the change to the registry, whose exact set then gives the pod's
//! prefix match instead of the approximate index. A gap in the sequence numbers or a lost connection clears the
//! pod's index (what it missed might have been removals) unless the pod's replay socket (`kv-events-replay-port`)
//! returns every missed batch; a frame that does not decode is counted and skipped.
//! Metric: `kvgate_gateway_kv_events_total{result}` (`ok`, `stale`, `replayed`, `gap`, `reconnect`, and the decode
//! errors' kinds).

use std::sync::Arc;
use std::time::Duration;

use kvgate_shared::hashing::HashScheme;

use crate::config::{ModelSpec, WorkerKind};
use crate::pods::event_sources::{self, EventSource};
use crate::pods::vllm_events::decode_frames;
use crate::pods::zmtp::{Kind, Socket};
use kvgate_router::registry::event_index::{Applied, Delta, EventIndex};

/// How long to wait before connecting again after a failure.
pub const RECONNECT_DELAY: Duration = Duration::from_secs(1);

fn count(result: &'static str) {
    metrics::counter!("kvgate_gateway_kv_events_total", "result" => result).increment(1);
}

/// `tcp://<host of base_url>:<port>`, or `None` for a URL without a host.
pub fn endpoint(base_url: &str, port: u16) -> Option<String> {
    let host = crate::control::trust::url_host(base_url)?;
    Some(match host.contains(':') {
        true => format!("tcp://[{host}]:{port}"),
        false => format!("tcp://{host}:{port}"),
    })
}

/// Longest a replay may take.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Most batches one replay may bring.
pub const MAX_REPLAYED: usize = 10_000;

/// A replay socket's reply as [topic, sequence, payload]: `[empty delimiter, topic, sequence, payload]` (vLLM
/// 0.33), or `[empty delimiter, sequence, payload]` (earlier vLLM releases, SGLang), read with an empty topic. The
/// end of a replay is sequence -1.
fn replay_parts(msg: &[bytes::Bytes]) -> Option<[&[u8]; 3]> {
    match msg {
        [delim, topic, seq, payload] if delim.is_empty() => Some([topic, seq, payload]),
        [delim, seq, payload] if delim.is_empty() => Some([b"", seq, payload]),
        _ => None,
    }
}

/// Asks `replay` for batches `first..until` and applies them; `true` if every one came, in order.
async fn replay_into(ix: &mut EventIndex, replay: &str, first: i64, until: i64) -> bool {
    let work = async {
        let mut sock = Socket::connect(replay, Kind::Dealer).await.ok()?;
        sock.send(&[b"", &first.to_be_bytes()]).await.ok()?;
        let mut batches = Vec::new();
        loop {
            let msg = sock.recv().await.ok()?;
            let parts = replay_parts(&msg)?;
            let seq = crate::pods::vllm_events::sequence(parts[1]).ok()?;
            if seq < 0 {
                return Some(batches);
            }
            if batches.len() >= MAX_REPLAYED {
                return None;
            }
            if seq < until {
                batches.push(decode_frames(&parts).ok()?);
            }
        }
    };
    let Ok(Some(batches)) = tokio::time::timeout(REPLAY_TIMEOUT, work).await else { return false };
    let complete = batches.iter().map(|(s, _)| *s).eq(first..until);
    if complete {
        for (s, b) in &batches {
            ix.apply(*s, b);
        }
    }
    complete
}

/// Follows one pod's events forever (`replay`: its replay endpoint, if any): `on_change` gets every change of its
/// exact set (a clear first when the index was reset). Returns only if the endpoint is invalid.
pub async fn follow(
    endpoint: String,
    replay: Option<String>,
    topic: String,
    scheme: HashScheme,
    mut on_change: impl FnMut(Delta),
) {
    let mut ix = EventIndex::new(&scheme);
    loop {
        let connected = async {
            let mut sock = Socket::connect(&endpoint, Kind::Sub).await?;
            sock.subscribe(topic.as_bytes()).await?;
            Ok::<_, std::io::Error>(sock)
        };
        let mut sock = match connected.await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(%endpoint, error = %e, "KV events: cannot connect yet");
                tokio::time::sleep(RECONNECT_DELAY).await;
                continue;
            }
        };
        tracing::info!(%endpoint, "following KV events");
        loop {
            let msg = match sock.recv().await {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(%endpoint, error = %e, "KV events: connection lost; the pod's index is cleared");
                    count("reconnect");
                    ix.clear();
                    on_change(ix.take_delta());
                    break;
                }
            };
            let parts: Vec<&[u8]> = msg.iter().map(|b| b.as_ref()).collect();
            let (seq, batch) = match decode_frames(&parts) {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(%endpoint, error = %e, "KV events: a frame skipped");
                    count(e.kind());
                    continue;
                }
            };
            if let Some(first) = ix.missing_before(seq) {
                // Ask the pod's replay socket for what was missed; without all of it, removals may have been lost:
                // start again from this batch.
                let replayed = match &replay {
                    Some(r) => replay_into(&mut ix, r, first, seq).await,
                    None => false,
                };
                if replayed {
                    count("replayed");
                } else {
                    tracing::warn!(%endpoint, first, seq, "KV events: batches missed; the pod's index is cleared");
                    count("gap");
                    ix.clear();
                }
            }
            match ix.apply(seq, &batch) {
                Applied::Stale => count("stale"),
                _ => count("ok"),
            }
            let delta = ix.take_delta();
            if !delta.is_empty() {
                on_change(delta);
            }
        }
        tokio::time::sleep(RECONNECT_DELAY).await;
    }
}

/// Starts following every configured static pod's events (on the calling runtime).
pub fn spawn_all<H: super::PodsHost>(state: &Arc<H>) {
    for m in &state.cfg().models {
        for url in &m.workers {
            spawn_pod(state, m, url);
        }
    }
}

/// Where one pod's events are: set by the operator (`kv-events-pods`, then `kv-events-port`), or asked of the pod.
enum Source {
    Set(EventSource),
    Ask,
}

fn source_of(model: &ModelSpec, url: &str) -> Option<Source> {
    let same = |a: &str| a.trim_end_matches('/') == url.trim_end_matches('/');
    if let Some(e) = model.kv_events_pods.iter().find(|e| same(&e.worker)) {
        return Some(Source::Set(EventSource {
            rank: 0,
            endpoint: e.endpoint.clone(),
            replay: e.replay.clone(),
            topic: e.topic.clone().unwrap_or_else(|| model.kv_events_topic.clone()),
        }));
    }
    if let Some(port) = model.kv_events_port {
        // A data-parallel rank publishes on the configured port plus its rank (vLLM's offset).
        let (base, rank) = super::dp_rank::split(url);
        let rank = rank.unwrap_or(0);
        let at = |p: u16| u16::try_from(u32::from(p) + rank).ok().and_then(|p| endpoint(base, p));
        let Some(ep) = at(port) else {
            tracing::error!(%url, "KV events: no host in the worker URL, or its rank's port is past 65535");
            return None;
        };
        return Some(Source::Set(EventSource {
            rank: i64::from(rank),
            endpoint: ep,
            replay: model.kv_events_replay_port.and_then(at),
            topic: model.kv_events_topic.clone(),
        }));
    }
    (model.kind == WorkerKind::Vllm && model.kv_events_sources).then_some(Source::Ask)
}

/// How long one `/kv_event_sources` request may take.
pub const SOURCES_TIMEOUT: Duration = Duration::from_secs(2);
/// How long to wait before asking a pod that did not answer again (a vLLM pod takes minutes to start).
pub const SOURCES_RETRY: Duration = Duration::from_secs(5);

/// How long to wait before asking again a pod that answered nothing to follow.
pub const SOURCES_RECHECK: Duration = Duration::from_secs(60);

fn count_sources(result: &'static str) {
    metrics::counter!("kvgate_gateway_kv_event_sources_total", "result" => result).increment(1);
}

/// The pod's answer: `Err(None)` when it did not answer (yet), `Err(Some(kind))` when it answered nothing to follow.
async fn ask(state: &impl super::PodsHost, url: &str) -> Result<Vec<EventSource>, Option<&'static str>> {
    use http_body_util::{BodyExt, Full, Limited};
    let uri = format!("{}/kv_event_sources", super::dp_rank::base(url));
    let req = hyper::Request::get(&uri).body(Full::new(bytes::Bytes::new())).map_err(|_| Some("request"))?;
    let fetch = async {
        let resp = state.client().request(req).await.map_err(|_| None)?;
        if !resp.status().is_success() {
            // An older vLLM (no such route) or a pod that is not vLLM: nothing to follow.
            return Err(Some("status"));
        }
        let body = Limited::new(resp.into_body(), event_sources::MAX_SOURCES_BYTES).collect().await;
        Ok(body.map_err(|_| Some("body"))?.to_bytes())
    };
    let body = tokio::time::timeout(SOURCES_TIMEOUT, fetch).await.map_err(|_| None)??;
    event_sources::parse(&body, super::dp_rank::base(url)).map_err(|e| {
        tracing::warn!(%url, error = %e, "KV events: not followed; the pod is routed on the approximate index");
        Some(e.kind())
    })
}

/// Follows one pod of `model`'s pool until the task is aborted (`None`: the pool's events are not followed, or
/// the URL has no host).
pub fn spawn_pod<H: super::PodsHost>(
    state: &Arc<H>,
    model: &ModelSpec,
    url: &str,
) -> Option<tokio::task::JoinHandle<()>> {
    let source = source_of(model, url)?;
    let scheme = state.scheme(&model.name)?;
    let (s, url) = (state.clone(), url.to_owned());
    Some(tokio::spawn(async move {
        let src = match source {
            Source::Set(src) => src,
            Source::Ask => loop {
                let wanted = super::dp_rank::split(&url).1;
                match ask(s.as_ref(), &url).await {
                    // A worker that names its rank follows that rank's stream.
                    Ok(ranks) if wanted.is_some() => {
                        match ranks.into_iter().find(|r| Some(r.rank) == wanted.map(i64::from)) {
                            Some(src) => {
                                count_sources("ok");
                                break src;
                            }
                            None => {
                                tracing::warn!(%url, "KV events: the pod lists no such data-parallel rank");
                                count_sources("no_such_rank");
                                tokio::time::sleep(SOURCES_RECHECK).await;
                            }
                        }
                    }
                    Ok(mut ranks) if ranks.len() == 1 => {
                        count_sources("ok");
                        break ranks.remove(0);
                    }
                    Ok(ranks) => {
                        // One cache per rank: a set merged over ranks would claim hits a request's rank lacks.
                        tracing::warn!(%url, ranks = ranks.len(), "KV events: a pod with several data-parallel \
                            ranks is followed only when the pool lists each rank (URL#dp<rank>); it is routed on \
                            the approximate index");
                        count_sources("several_ranks");
                        tokio::time::sleep(SOURCES_RECHECK).await;
                    }
                    Err(Some(kind)) => {
                        // Asked again later: a pod restarted with events on (or past a proxy's warm-up answer).
                        count_sources(kind);
                        tokio::time::sleep(SOURCES_RECHECK).await;
                    }
                    Err(None) => {
                        count_sources("unanswered");
                        tokio::time::sleep(SOURCES_RETRY).await;
                    }
                }
            },
        };
        let on_change = move |d: Delta| {
            s.registry().apply_exact(&url, d.cleared, &d.changes);
        };
        follow(src.endpoint, src.replay, src.topic, scheme, on_change).await
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_with_and_without_a_topic_frame_are_read() {
        use bytes::Bytes;
        let b = |s: &'static [u8]| Bytes::from_static(s);
        let seq = 5i64.to_be_bytes();
        let with = [b(b""), b(b"kv"), Bytes::copy_from_slice(&seq), b(b"p")];
        assert_eq!(replay_parts(&with), Some([b"kv".as_slice(), seq.as_slice(), b"p".as_slice()]));
        let without = [b(b""), Bytes::copy_from_slice(&seq), b(b"p")];
        assert_eq!(replay_parts(&without), Some([b"".as_slice(), seq.as_slice(), b"p".as_slice()]));
        assert_eq!(replay_parts(&[b(b"x"), b(b"kv"), b(b"s"), b(b"p")]), None);
        assert_eq!(replay_parts(&[b(b"")]), None);
    }

    #[test]
    fn the_endpoint_is_the_pods_host_at_the_events_port() {
        assert_eq!(endpoint("http://10.0.0.7:8000", 5557).as_deref(), Some("tcp://10.0.0.7:5557"));
        assert_eq!(endpoint("http://vllm-0.vllm:8000/", 5557).as_deref(), Some("tcp://vllm-0.vllm:5557"));
        assert_eq!(endpoint("http://[::1]:8000", 5557).as_deref(), Some("tcp://[::1]:5557"));
        assert_eq!(endpoint("http://host", 1).as_deref(), Some("tcp://host:1"));
        assert_eq!(endpoint("http://", 1), None);
    }
}
