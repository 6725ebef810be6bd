//! KV cache events as kvgate reads them from a pod (vLLM's and SGLang's `BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`): the decoded form the gateway's `pods::vllm_events` produces from the wire and the exact index
//! ([`super::event_index`]) consumes. Pure data.

/// A vLLM block hash, as published.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExternalHash {
    /// A 64-bit hash (published as a msgpack integer; negative ones are kept by their bits).
    Int(u64),
    /// A byte-string hash (sha256: 32 bytes).
    Bytes(Vec<u8>),
}

/// One KV cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    /// Blocks stored, in order, each the child of the one before; the first's parent is `parent` (none: a first
    /// block). `token_ids` holds `block_hashes.len() * block_size` tokens.
    Stored {
        block_hashes: Vec<ExternalHash>,
        parent: Option<ExternalHash>,
        token_ids: Vec<u32>,
        block_size: usize,
        medium: Option<String>,
        /// Hashed with more than the tokens (a LoRA adapter, multimodal inputs, a cache salt): kvgate cannot
        /// rebuild these hashes, so such blocks are not indexed.
        keyed: bool,
    },
    /// Blocks evicted.
    Removed { block_hashes: Vec<ExternalHash>, medium: Option<String> },
    /// Every block dropped (a cache reset or a restart).
    AllCleared,
}

/// A decoded batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
    /// Events of a type this decoder does not know (skipped).
    pub unknown: usize,
}
