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
        /// The first block hashed with more than its tokens and [`KvEvent::Stored::lora`] (a multimodal input, a
        /// cache salt, an adapter without a name: a non-null `extra_keys` entry other than the adapter's name, or a
        /// `lora_id` without a `lora_name`). kvgate cannot rebuild that hash, nor those of the blocks chained after
        /// it, so from there on the event's blocks are not indexed. `None`: every block is the tokens alone.
        keyed_from: Option<usize>,
        /// The LoRA adapter the blocks were computed with (vLLM's `lora_name`): rebuilt under
        /// `ExtraKey::LoraAdapter(name)`, the key the gateway gives a pod's adapter.
        lora: Option<String>,
        /// The KV cache group the blocks belong to (hybrid models keep one per attention kind).
        group: CacheGroup,
    },
    /// Blocks evicted (from `group`'s cache).
    Removed { block_hashes: Vec<ExternalHash>, medium: Option<String>, group: CacheGroup },
    /// Every block dropped (a cache reset or a restart).
    AllCleared,
}

/// Which of a model's KV cache groups an event is about: vLLM's `group_idx` and `kv_cache_spec_kind` (a hybrid
/// model keeps full-attention blocks in one group and sliding-window or Mamba state in others, under the same block
/// hashes). Absent fields (an older vLLM, SGLang) mean the model's one full-attention cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheGroup {
    pub idx: Option<i64>,
    /// `Some(false)`: a group of another kind (its blocks do not make a prefix a request can reuse whole).
    pub full_attention: Option<bool>,
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
