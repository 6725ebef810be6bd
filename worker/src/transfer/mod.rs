//! Prefill/decode disaggregation between workers: a decode worker fetches one request's KV from a prefill worker.
//!
//! The flow (the shape vLLM's NIXL connector, SGLang's disaggregation and Dynamo converged on, with the decode side
//! driving):
//! 1. The decode worker gets an ordinary OpenAI request naming a prefill peer (`x-kvgate-prefill-peer`, honoured
//!    only with the gateway's grant, `kvgate_shared::handoff::PREFILL_GRANT_HEADER`). It matches the prompt against
//!    its own cache (all tiers), allocates blocks for the rest (`Engine::start_import`), and dials the peer's
//!    transfer listener.
//! 2. Hello (authenticated: keyed BLAKE3 under `handoff::transfer_key` of the report secret) says which blocks it
//!    lacks, with the prompt, its cache keys and how to sample the first token. The prefill worker checks it (MAC,
//!    model fingerprint, layout, bounds), answers Accept (its own MAC: the decode worker knows it is talking to a
//!    holder of the key) and runs the prompt as an export (`Engine::add_export`, using its own prefix cache).
//! 3. As each prefill chunk is written, its blocks leave in Blocks frames (gathered by slot from the paged pool,
//!    split to the decode worker's frame limit), then Done with the first token. The decode worker writes each
//!    frame into its pre-allocated blocks as it arrives (`Engine::write_import`), finishes (`finish_import`) and
//!    decodes; it answers Ack and the link goes back to the pool.
//!
//! Lifecycle: the prefill side holds an export under a lease (`--kv-transfer-lease`, default 30 s) that either
//! side's Renew frames (every third of it) extend; it is dropped, and its engine request aborted, when the transfer
//! completes, the lease lapses, either side sends Cancel, or the link breaks. The decode side gives up when its peer
//! is silent for a lease, refuses, cancels or breaks the link: it then computes the prompt itself (its blocks freed
//! and the request requeued, `Engine::import_to_local`). A client that leaves cancels both legs. No state outlives
//! a transfer, so nothing sticks to a peer after it recovers.
//!
//! Bounds: every frame's length is checked from its header against what the reader declared before anything is
//! allocated (`frame::Limits`); Blocks must fall inside the declared range, once each, at the declared size.
//!
//! - `frame`: the wire format (pure); `link`: the transport boundary and TCP; `export`: the prefill side;
//!   `import`: the decode side.

pub mod export;
pub mod frame;
pub mod import;
pub mod link;

use std::sync::Arc;
use std::time::Duration;

use crate::server::engine_thread::EngineHandle;

/// Why a transfer did not complete.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TransferError {
    #[error("cannot connect to the prefill worker: {0}")]
    Connect(String),
    #[error("the peer went away: {0}")]
    PeerLost(String),
    #[error("bad frame: {0}")]
    Frame(#[from] frame::FrameError),
    #[error("the peer broke the protocol: {0}")]
    Protocol(String),
    #[error("the prefill worker refused ({code}): {reason}")]
    Refused { code: &'static str, reason: String },
    #[error("the peer cancelled: {0}")]
    Cancelled(String),
    #[error("the peer was silent for the lease ({0:?})")]
    Expired(Duration),
    #[error("the prefill made no progress within {0:?} (it is queued or stuck)")]
    Stalled(Duration),
    #[error("the engine: {0}")]
    Engine(String),
    #[error("the imported KV was refused: {0}")]
    Import(#[from] crate::engine::ImportError),
}

impl TransferError {
    /// Whether the same transfer may succeed if tried again (the peer was unreachable, busy, gone or silent); a
    /// protocol breach, a refused import or a wrong model will fail the same way.
    pub fn retryable(&self) -> bool {
        match self {
            Self::Connect(_)
            | Self::PeerLost(_)
            | Self::Expired(_)
            | Self::Stalled(_)
            | Self::Cancelled(_) => true,
            Self::Refused { code, .. } => *code == frame::RefuseCode::Overloaded.as_str(),
            Self::Import(e) => *e == crate::engine::ImportError::EngineGone,
            Self::Frame(_) | Self::Protocol(_) | Self::Engine(_) => false,
        }
    }

    /// The `outcome` label of `kvgate_worker_kv_transfers_total`.
    pub fn outcome(&self) -> &'static str {
        match self {
            Self::Connect(_) => "connect_failed",
            Self::PeerLost(_) => "peer_lost",
            Self::Frame(_) | Self::Protocol(_) => "protocol_error",
            Self::Refused { .. } => "refused",
            Self::Cancelled(_) => "cancelled",
            Self::Expired(_) => "expired",
            Self::Stalled(_) => "stalled",
            Self::Engine(_) => "engine_error",
            Self::Import(crate::engine::ImportError::EngineGone) => "engine_error",
            Self::Import(_) => "protocol_error",
        }
    }
}

/// What both sides of this worker's transfers need.
pub struct Transfers {
    pub key: [u8; 32],
    /// The key of the gateways' prefill grants (`handoff::grant_key`): an export checks the Hello's grant.
    pub grant_key: [u8; 32],
    /// This worker's model id and worker id, as grants name them.
    pub model: String,
    pub worker_id: String,
    /// What KV bytes are valid for: scheme, weights, layout, block bytes (`Engine::tier_fingerprint`).
    pub fingerprint: u64,
    pub block_bytes: usize,
    pub layers: usize,
    pub block_size: usize,
    pub lease: Duration,
    /// Longest an import waits for its prefill to move (`--kv-transfer-stall-timeout`): for the Accept, then for
    /// the next step, block or Done; a step the prefill worker announces (Progress) adds twice its expected time
    /// (at most a lease). Renew does not reset it.
    pub stall: Duration,
    pub layer_group: u16,
    /// Most KV bytes an export holds that its link has not sent (`--kv-export-backlog-bytes`): past it the
    /// export's prefill waits for the link.
    pub export_backlog: usize,
    /// Largest Blocks payload this worker reads (and its exports never exceed a decode worker's).
    pub frame_bytes: usize,
    pub max_prompt_tokens: usize,
    pub engine: EngineHandle,
    pub transport: link::TcpTransport,
    /// What this worker imported since the last report, by peer (the gateway's bandwidth samples).
    pub imports: std::sync::Mutex<ImportLog>,
    /// The LoRA adapter an export's keys name (`ExtraKey::LoraAdapter`, `name@digest`), if this worker holds it
    /// (blocking: it may read the weights again); `None`: it does not, and the export is refused.
    pub adapters: AdapterLookup,
}

/// Finds an adapter by its key (`name@digest`) for an export (see [`Transfers::adapters`]).
pub type AdapterLookup = Arc<dyn Fn(&str) -> Option<Arc<crate::model::lora::LoraAdapter>> + Send + Sync>;

/// An [`AdapterLookup`] that finds none (a worker without adapters).
pub fn no_adapters() -> AdapterLookup {
    Arc::new(|_: &str| None)
}

/// The adapter a request's keys name, as its key (`name@digest`).
pub fn adapter_key(keys: &kvgate_shared::hashing::ExtraKeys) -> Option<&str> {
    keys.keys().iter().find_map(|k| match k {
        kvgate_shared::hashing::ExtraKey::LoraAdapter(key) => Some(key.as_str()),
        _ => None,
    })
}

/// Per-peer sums of finished imports over one report interval, for at most `MAX_IMPORT_PEERS` peers (a transfer
/// from a further peer is left out of the sample, not of the import).
#[derive(Debug, Default)]
pub struct ImportLog {
    peers: Vec<kvgate_shared::report::PeerImport>,
}

impl ImportLog {
    pub fn record(&mut self, peer: &str, bytes: u64, seconds: f64) {
        let i = match self.peers.iter().position(|p| p.peer == peer) {
            Some(i) => i,
            None if self.peers.len() < kvgate_shared::report::MAX_IMPORT_PEERS => {
                self.peers
                    .push(kvgate_shared::report::PeerImport { peer: peer.to_owned(), ..Default::default() });
                self.peers.len() - 1
            }
            None => return,
        };
        let p = &mut self.peers[i];
        p.bytes = p.bytes.saturating_add(bytes);
        p.seconds += seconds.max(0.0);
        p.transfers = p.transfers.saturating_add(1);
    }

    /// The interval's figures; the log starts again empty.
    pub fn take(&mut self) -> Vec<kvgate_shared::report::PeerImport> {
        std::mem::take(&mut self.peers)
    }
}

impl Transfers {
    /// What a listener reads from its dialers: Hello up to this worker's context, and no Blocks (a decode worker
    /// sends none).
    pub fn listener_limits(&self) -> frame::Limits {
        frame::Limits { max_prompt_tokens: self.max_prompt_tokens, max_payload: 0 }
    }

    /// What this worker reads on its links: prompts up to its context, payloads up to its frame limit.
    pub fn limits(&self) -> frame::Limits {
        frame::Limits {
            max_prompt_tokens: self.max_prompt_tokens,
            max_payload: self.frame_bytes.max(self.block_bytes),
        }
    }
}

/// Counts a finished transfer.
fn count(side: &'static str, outcome: &'static str) {
    metrics::counter!("kvgate_worker_kv_transfers_total", "side" => side, "outcome" => outcome).increment(1);
}

fn count_bytes(side: &'static str, bytes: usize, blocks: usize) {
    metrics::counter!("kvgate_worker_kv_transfer_bytes_total", "side" => side).increment(bytes as u64);
    metrics::counter!("kvgate_worker_kv_transfer_blocks_total", "side" => side).increment(blocks as u64);
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
