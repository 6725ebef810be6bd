//! Follows the KV events of vLLM (or SGLang) pods (`[[models]]` entries with `kv-events-port`): one task per pod
//! holds a ZMQ SUB connection (`zmtp`, frames bounded) to `tcp://<pod host>:<port>`, decodes each batch (`vllm_events`), applies it to the
//! pod's exact index (`vllm_index`) and hands the change to the registry, whose exact set then gives the pod's
//! prefix match instead of the approximate index. A gap in the sequence numbers or a lost connection clears the
//! pod's index (what it missed might have been removals) unless the pod's replay socket (`kv-events-replay-port`)
//! returns every missed batch; a frame that does not decode is counted and skipped.
//! Metric: `kvgate_gateway_kv_events_total{result}` (`ok`, `stale`, `replayed`, `gap`, `reconnect`, and the decode
//! errors' kinds).

use std::sync::Arc;
use std::time::Duration;

use kvgate_shared::hashing::HashScheme;

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

/// Follows one pod of `model`'s pool until the task is aborted (`None`: the pool has no events port, or the URL
/// no host).
pub fn spawn_pod<H: super::PodsHost>(
    state: &Arc<H>,
    model: &crate::config::ModelSpec,
    url: &str,
) -> Option<tokio::task::JoinHandle<()>> {
    let port = model.kv_events_port?;
    let scheme = state.scheme(&model.name)?;
    let Some(ep) = endpoint(url, port) else {
        tracing::error!(%url, "KV events: no host in the worker URL");
        return None;
    };
    let replay = model.kv_events_replay_port.and_then(|p| endpoint(url, p));
    let (s, url, topic) = (state.clone(), url.to_owned(), model.kv_events_topic.clone());
    Some(tokio::spawn(follow(ep, replay, topic, scheme, move |d: Delta| {
        s.registry().apply_exact(&url, d.cleared, &d.changes);
    })))
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
