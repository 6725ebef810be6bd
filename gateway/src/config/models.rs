//! The pools of pods the gateway tokenizes for itself: a `[[models]]` entry (or `--model NAME=DIR`), what its pods
//! run, where their KV events are, and the checks each entry must pass (`GatewayConfig::validate` lists them with
//! the rest). Defaults are written once, here, on the fields.

use std::path::PathBuf;

use serde::Deserialize;

/// What a pool of inference pods runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerKind {
    /// `kvgate-worker`: reports, a tokenizer endpoint, the prompt handoff.
    #[default]
    Kvgate,
    /// A vLLM OpenAI server.
    Vllm,
    /// An SGLang server.
    Sglang,
    /// Any other OpenAI-compatible server (llama.cpp, TGI, ...).
    Openai,
}

/// One `[[models]]` entry (or `--model NAME=DIR`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ModelSpec {
    /// The model name clients ask for and the pods serve.
    pub name: String,
    /// The local tokenizer directory.
    pub tokenizer: PathBuf,
    /// Tokens per KV block of the pods' engine. Default 16.
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// What the pool runs. Default kvgate.
    #[serde(default)]
    pub kind: WorkerKind,
    /// The pool's static base URLs. Default none.
    #[serde(default)]
    pub workers: Vec<String>,
    /// KV tokens each pod of a pool that is not kvgate holds: the capacity of this gateway's approximate index of
    /// what it sent each pod (`router/src/registry/approx.rs`); for `vllm` and `sglang` pools whose metrics are
    /// scraped, the KV size a pod's metrics state replaces it (`scrape.rs`). 0 turns the index off (only the
    /// overlay's `--overlay-ttl` memory is left). Default 65,536.
    #[serde(default = "default_kv_tokens")]
    pub kv_tokens: usize,
    /// For `vllm` and `sglang` pools: the port each pod publishes its KV events on (vLLM `--kv-events-config`
    /// `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}`); the gateway connects to
    /// `tcp://<pod host>:<port>` and keeps an exact index of each pod's blocks. Default none (the approximate index).
    #[serde(default)]
    pub kv_events_port: Option<u16>,
    /// The port of each pod's replay socket (vLLM's `replay_endpoint`, off by default there): after a gap in the
    /// sequence numbers the missed batches are asked for there, and the index is cleared only if they cannot be
    /// had. Default none (a gap clears the pod's index).
    #[serde(default)]
    pub kv_events_replay_port: Option<u16>,
    /// The topic to subscribe to (vLLM's `topic`). Default "" (all).
    #[serde(default)]
    pub kv_events_topic: String,
    /// For `vllm` pools without `kv-events-port`: ask each pod where it publishes (`GET /kv_event_sources`, retried
    /// until the pod answers): a wildcard endpoint (`tcp://*:PORT`) is followed at the pod's own host, its replay
    /// endpoint and topic too, so pods on one host can each use their own port (`pods/event_sources.rs`). Default
    /// true.
    #[serde(default = "default_true")]
    pub kv_events_sources: bool,
    /// Per pod, where its events are, over `kv-events-port` and the pod's own answer:
    /// `[[models.kv-events-pods]]` with `worker` (the pod's URL as in `workers`), `endpoint` (`tcp://HOST:PORT`),
    /// optional `replay` and `topic`. Default none.
    #[serde(default)]
    pub kv_events_pods: Vec<PodEvents>,
    /// For `vllm` and `sglang` pools: read each pod's queue from its `/metrics` once a second (`scrape.rs`).
    /// Default true.
    #[serde(default = "default_true")]
    pub scrape_metrics: bool,
    /// `NAME:PORT` of a headless Service (or any name): its A/AAAA records, resolved every 5 s
    /// (`discovery.rs`), are the pool's pods, `http://<address>:<PORT>`, besides `workers`. Default none.
    #[serde(default)]
    pub discover: Option<String>,
    /// The context length of the pods' model, for pools that do not report it (every kind but `kvgate`): requests
    /// over it are refused here (400 `context_length_exceeded`) before anything is charged. For `vllm` pools the
    /// `max_model_len` in a pod's `/v1/models` is read too (the smaller wins). Default none (read from the pods
    /// where they say it, else unchecked).
    #[serde(default)]
    pub max_model_len: Option<u32>,
}

/// One pod's event endpoints, set by the operator (`[[models.kv-events-pods]]`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PodEvents {
    pub worker: String,
    pub endpoint: String,
    #[serde(default)]
    pub replay: Option<String>,
    #[serde(default)]
    pub topic: Option<String>,
}

fn default_true() -> bool {
    true
}

fn default_kv_tokens() -> usize {
    65_536
}

fn default_block_size() -> u32 {
    16
}

impl std::str::FromStr for ModelSpec {
    type Err = String;

    /// `NAME=DIR`: a kvgate pool's model with block size 16 (the other fields only in the TOML file).
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, dir) = s.split_once('=').ok_or_else(|| format!("model {s:?}: expected NAME=DIR"))?;
        Ok(ModelSpec {
            name: name.trim().to_owned(),
            tokenizer: PathBuf::from(dir.trim()),
            block_size: default_block_size(),
            kind: WorkerKind::Kvgate,
            workers: Vec::new(),
            kv_tokens: default_kv_tokens(),
            kv_events_port: None,
            kv_events_replay_port: None,
            kv_events_topic: String::new(),
            kv_events_sources: true,
            kv_events_pods: Vec::new(),
            scrape_metrics: true,
            discover: None,
            max_model_len: None,
        })
    }
}

/// Every problem of the `[[models]]` entries, appended to `p`.
pub(super) fn problems(models: &[ModelSpec], p: &mut Vec<String>) {
    let mut names = std::collections::HashSet::new();
    for m in models {
        if m.name.is_empty() || !names.insert(m.name.as_str()) {
            p.push(format!("model {:?}: names must be non-empty and unique", m.name));
        }
        if !(1..=4096).contains(&m.block_size) {
            p.push(format!("model {:?}: block-size {} is not in 1..=4096", m.name, m.block_size));
        }
        for w in &m.workers {
            if !w.starts_with("http://") {
                p.push(format!("model {:?}: worker {w:?} is not an http:// URL", m.name));
            }
            if w.contains('#') && (m.kind != WorkerKind::Vllm || crate::pods::dp_rank::malformed(w)) {
                p.push(format!(
                    "model {:?}: worker {w:?}: a URL may end in #dp<rank> (0..=63, a vLLM pod's data-parallel \
                     rank) only in a vllm pool, and in no other fragment",
                    m.name
                ));
            }
        }
        let follows = m.kv_events_port.is_some() || !m.kv_events_pods.is_empty();
        if follows && !matches!(m.kind, WorkerKind::Vllm | WorkerKind::Sglang) {
            p.push(format!("model {:?}: kv-events-port and kv-events-pods need kind vllm or sglang", m.name));
        }
        for e in &m.kv_events_pods {
            let tcp = |a: &str| a.starts_with("tcp://") && a.len() <= 512;
            if !e.worker.starts_with("http://") || !tcp(&e.endpoint) || !e.replay.as_deref().is_none_or(tcp) {
                p.push(format!(
                    "model {:?}: kv-events-pods entry for {:?} needs an http:// worker and tcp:// endpoints",
                    m.name, e.worker
                ));
            }
        }
        if let Some(d) = &m.discover {
            if d.rsplit_once(':')
                .and_then(|(h, p)| (!h.is_empty()).then_some(p))
                .and_then(|p| p.parse::<u16>().ok())
                .is_none()
            {
                p.push(format!("model {:?}: discover {d:?} is not NAME:PORT", m.name));
            }
        }
        if m.kv_tokens > 16 << 20 {
            p.push(format!("model {:?}: kv-tokens {} is over 16,777,216", m.name, m.kv_tokens));
        }
    }
}
