//! The compute behind the engine, behind one trait: the CPU model ([`CpuBackend`]), the CUDA model
//! (`crate::cuda::CudaBackend`) and the timing-model simulation (`sim::SimBackend`). A backend owns the KV memory
//! the block ids point at. Its calls fail with a [`BackendError`] (what failed, and whose fault it is).
//!
//! `Box<dyn Backend>` is a backend too (every method forwarded), so one engine type serves whichever device the
//! server picked at start (`crate::server::assemble`).

pub use super::backend_error::{BackendError, Fault};
use crate::model::fp8::KvCacheDtype;
use crate::model::llama::{KvStore, LlamaModel, SeqChunk};

/// One sequence's part of a batch.
#[derive(Clone, Debug)]
pub struct BatchItem<'a> {
    /// The whole sequence so far (prompt + output); `start..start + len` is computed now.
    pub tokens: &'a [u32],
    pub start: usize,
    pub len: usize,
    /// KV slot of every position `0..start + len` (empty for backends without KV memory).
    pub slots: Vec<usize>,
    /// Produce what the next token is sampled from.
    pub want_next: bool,
    /// The next token is picked greedily (arg-max): a backend may pick it itself and return [`Next::Token`].
    pub greedy: bool,
    /// The LoRA adapter its sequence runs with (only given to a backend that [`Backend::runs_adapters`]).
    pub adapter: Option<&'a crate::model::lora::LoraAdapter>,
}

/// What a backend returns for an item that wants a next token.
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// Logits to sample from.
    Logits(Vec<f32>),
    /// The backend chose the token itself (a simulated model, or greedy sampling on the GPU).
    Token(u32),
}

/// Computes batches.
pub trait Backend: Send {
    /// Writes the KV of every item's new tokens and returns, per item, what it asked for. An error fails every
    /// sequence of the batch (never the engine).
    fn forward(&mut self, items: &[BatchItem<'_>]) -> Result<Vec<Option<Next>>, BackendError>;

    /// Ids the model accepts.
    fn vocab_size(&self) -> usize;

    /// Longest sequence (prompt + output) the model supports.
    fn max_model_len(&self) -> usize;

    /// The model's end-of-sequence ids.
    fn eos_token_ids(&self) -> Vec<u32>;

    /// Whether it applies [`BatchItem::adapter`] (default: no, and a request with an adapter is refused at
    /// admission: the simulated engine models no adapters; CUDA runs them when it has device slots).
    fn runs_adapters(&self) -> bool {
        false
    }

    /// Whether [`BatchItem::slots`] must be filled (default `true`). A backend without KV memory says `false` and
    /// saves the engine an O(context) walk per item per step.
    fn needs_slots(&self) -> bool {
        true
    }

    /// Bytes of one KV block (K and V of every layer) as [`Backend::read_kv_blocks`] returns them, which lower
    /// tiers count against their capacity; `None` (the default): this backend cannot copy blocks out, so it gets
    /// no lower tiers.
    fn kv_block_bytes(&self, _block_size: usize) -> Option<usize> {
        None
    }

    /// What one block's K/V bytes mean: the backend, storage type and shape (layers, KV heads, head size), so KV
    /// written by another layout (bf16 vs f16 of the same size, say) is never read back as this one's. Default:
    /// empty (a backend without lower tiers).
    fn kv_layout(&self) -> String {
        String::new()
    }

    /// The K/V bytes of blocks `ids` (a block holds slots `id * block_size..(id + 1) * block_size`).
    fn read_kv_blocks(&mut self, _ids: &[u32], _block_size: usize) -> Result<Vec<Vec<u8>>, BackendError> {
        Err(BackendError::Unsupported("this backend cannot copy KV blocks".into()))
    }

    /// Told how many blocks were loaded from host DRAM before the next forward, and how long that step waits for
    /// SSD reads not yet done (`kv::ReadAhead`; a simulated backend charges both; a real one has spent them
    /// already). Default: nothing.
    fn note_kv_loaded(&mut self, _host_blocks: usize, _disk_wait_s: f64, _block_size: usize) {}

    /// Whether copying KV blocks takes real time worth timing into the tiers' speeds (default `true`; a simulated
    /// backend copies nothing and charges its profile's speeds).
    fn times_transfers(&self) -> bool {
        true
    }

    /// The engine's clock in seconds, where the backend keeps its own (a simulator's virtual time); `None` (the
    /// default): the engine's monotonic clock.
    fn clock_s(&self) -> Option<f64> {
        None
    }

    /// Writes blocks' K/V bytes (as read by [`Backend::read_kv_blocks`]) into blocks of this pool.
    fn write_kv_blocks(&mut self, _blocks: &[(u32, &[u8])], _block_size: usize) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("this backend cannot copy KV blocks".into()))
    }

    /// [`Backend::forward`], calling `tap(n, read)` as soon as layers `0..n` of the batch's K/V are written, where
    /// `read(ids, layers, block_size)` returns what [`Backend::read_kv_layers`] would. Default: no taps (the
    /// forward as a whole; [`Backend::taps_layers`] says `false`).
    fn forward_tapped(
        &mut self,
        items: &[BatchItem<'_>],
        _tap: &mut LayerTap<'_>,
    ) -> Result<Vec<Option<Next>>, BackendError> {
        self.forward(items)
    }

    /// Whether [`Backend::forward_tapped`] calls its tap per layer (default `false`).
    fn taps_layers(&self) -> bool {
        false
    }

    /// Layers of a block's bytes: [`Backend::read_kv_blocks`] lays a block out layer after layer, so a range of
    /// layers is a contiguous part of it (`kv_block_bytes / kv_layers` bytes each). Default 1: whole blocks only.
    fn kv_layers(&self) -> usize {
        1
    }

    /// The bytes of layers `layers` of blocks `ids`, one payload (block after block). Default: whole blocks only.
    fn read_kv_layers(
        &mut self,
        ids: &[u32],
        layers: std::ops::Range<usize>,
        block_size: usize,
    ) -> Result<Vec<u8>, BackendError> {
        if layers != (0..self.kv_layers()) {
            return Err(BackendError::Unsupported("this backend copies whole blocks only".into()));
        }
        Ok(self.read_kv_blocks(ids, block_size)?.concat())
    }

    /// Writes what [`Backend::read_kv_layers`] returned into blocks `ids` of this pool.
    fn write_kv_layers(
        &mut self,
        ids: &[u32],
        layers: std::ops::Range<usize>,
        bytes: &[u8],
        block_size: usize,
    ) -> Result<(), BackendError> {
        if layers != (0..self.kv_layers()) {
            return Err(BackendError::Unsupported("this backend copies whole blocks only".into()));
        }
        if ids.is_empty() || !bytes.len().is_multiple_of(ids.len()) {
            return Err(BackendError::InvalidInput("this backend copies whole blocks only".into()));
        }
        let per = bytes.len() / ids.len();
        let blocks: Vec<(u32, &[u8])> = ids.iter().copied().zip(bytes.chunks_exact(per)).collect();
        self.write_kv_blocks(&blocks, block_size)
    }
}

/// Reads layers of blocks from inside a forward (`ids`, `layers`, block size): what a [`LayerTap`] is given.
pub type LayerRead<'a> = dyn Fn(&[u32], std::ops::Range<usize>, usize) -> Result<Vec<u8>, BackendError> + 'a;
/// Called with `n` when layers `0..n` of a batch's K/V are written.
pub type LayerTap<'a> = dyn FnMut(usize, &LayerRead<'_>) + 'a;

/// A boxed backend is a backend: every method goes to the box's contents (none falls back to a default, so a boxed
/// backend behaves exactly as the backend itself).
impl<B: Backend + ?Sized> Backend for Box<B> {
    fn forward(&mut self, items: &[BatchItem<'_>]) -> Result<Vec<Option<Next>>, BackendError> {
        (**self).forward(items)
    }
    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }
    fn max_model_len(&self) -> usize {
        (**self).max_model_len()
    }
    fn eos_token_ids(&self) -> Vec<u32> {
        (**self).eos_token_ids()
    }
    fn needs_slots(&self) -> bool {
        (**self).needs_slots()
    }
    fn runs_adapters(&self) -> bool {
        (**self).runs_adapters()
    }
    fn kv_block_bytes(&self, block_size: usize) -> Option<usize> {
        (**self).kv_block_bytes(block_size)
    }
    fn kv_layout(&self) -> String {
        (**self).kv_layout()
    }
    fn read_kv_blocks(&mut self, ids: &[u32], block_size: usize) -> Result<Vec<Vec<u8>>, BackendError> {
        (**self).read_kv_blocks(ids, block_size)
    }
    fn note_kv_loaded(&mut self, host_blocks: usize, disk_wait_s: f64, block_size: usize) {
        (**self).note_kv_loaded(host_blocks, disk_wait_s, block_size)
    }
    fn times_transfers(&self) -> bool {
        (**self).times_transfers()
    }
    fn clock_s(&self) -> Option<f64> {
        (**self).clock_s()
    }
    fn write_kv_blocks(&mut self, blocks: &[(u32, &[u8])], block_size: usize) -> Result<(), BackendError> {
        (**self).write_kv_blocks(blocks, block_size)
    }
    fn forward_tapped(
        &mut self,
        items: &[BatchItem<'_>],
        tap: &mut LayerTap<'_>,
    ) -> Result<Vec<Option<Next>>, BackendError> {
        (**self).forward_tapped(items, tap)
    }
    fn taps_layers(&self) -> bool {
        (**self).taps_layers()
    }
    fn kv_layers(&self) -> usize {
        (**self).kv_layers()
    }
    fn read_kv_layers(
        &mut self,
        ids: &[u32],
        layers: std::ops::Range<usize>,
        block_size: usize,
    ) -> Result<Vec<u8>, BackendError> {
        (**self).read_kv_layers(ids, layers, block_size)
    }
    fn write_kv_layers(
        &mut self,
        ids: &[u32],
        layers: std::ops::Range<usize>,
        bytes: &[u8],
        block_size: usize,
    ) -> Result<(), BackendError> {
        (**self).write_kv_layers(ids, layers, bytes, block_size)
    }
}

/// Fault injection (tests only): `KVGATE_FAULT_SLOW_FORWARD_US=<us>` makes every CPU forward take `us` longer per
/// token it computes, as a slower device would (the worker measures it like any cost).
fn fault_slow_forward() -> Option<std::time::Duration> {
    static SLOW: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    *SLOW.get_or_init(|| {
        let us = std::env::var("KVGATE_FAULT_SLOW_FORWARD_US").ok()?.parse().ok()?;
        Some(std::time::Duration::from_micros(us))
    })
}

/// The CPU engine: the Llama-family model with an in-memory KV store.
#[derive(Debug)]
pub struct CpuBackend {
    model: LlamaModel,
    kv: KvStore,
    kv_dtype: KvCacheDtype,
}

impl CpuBackend {
    /// A backend with KV memory for `num_slots` positions (blocks x block size).
    pub fn new(model: LlamaModel, num_slots: usize) -> Self {
        Self::with_kv_dtype(model, num_slots, KvCacheDtype::Auto)
    }

    /// [`Self::new`] with a KV cache of `dtype` (`Fp8`: the reference math of an FP8 cache, `model::fp8`).
    pub fn with_kv_dtype(model: LlamaModel, num_slots: usize, kv_dtype: KvCacheDtype) -> Self {
        let kv = model.new_kv_store_as(num_slots, kv_dtype);
        Self { model, kv, kv_dtype }
    }

    pub fn model(&self) -> &LlamaModel {
        &self.model
    }
}

impl Backend for CpuBackend {
    fn forward(&mut self, items: &[BatchItem<'_>]) -> Result<Vec<Option<Next>>, BackendError> {
        self.forward_tapped(items, &mut |_, _| {})
    }

    /// The CPU forward pass applies each item's adapter (`model::llama`, checked against merged weights in
    /// `tests/lora.rs`).
    fn runs_adapters(&self) -> bool {
        true
    }

    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn max_model_len(&self) -> usize {
        self.model.config().max_position_embeddings
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        self.model.config().eos_token_ids.clone()
    }

    fn kv_layout(&self) -> String {
        let c = self.model.config();
        // An FP8-rounded cache's blocks are not an f32 cache's: tiers and transfers must not mix them.
        let dtype = if self.kv_dtype == KvCacheDtype::Fp8 { "f32 fp8-e4m3-rounded" } else { "f32" };
        format!(
            "cpu {dtype} layers={} kv_heads={} head_dim={}",
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim
        )
    }

    fn kv_block_bytes(&self, block_size: usize) -> Option<usize> {
        Some(self.kv.bytes_for(block_size))
    }

    fn read_kv_blocks(&mut self, ids: &[u32], block_size: usize) -> Result<Vec<Vec<u8>>, BackendError> {
        ids.iter()
            .map(|id| {
                self.kv.read_slots(*id as usize * block_size, block_size).map_err(BackendError::InvalidInput)
            })
            .collect()
    }

    fn write_kv_blocks(&mut self, blocks: &[(u32, &[u8])], block_size: usize) -> Result<(), BackendError> {
        for (id, bytes) in blocks {
            self.kv
                .write_slots(*id as usize * block_size, block_size, bytes)
                .map_err(BackendError::InvalidInput)?;
        }
        Ok(())
    }

    fn kv_layers(&self) -> usize {
        self.kv.num_layers()
    }

    fn taps_layers(&self) -> bool {
        true
    }

    fn forward_tapped(
        &mut self,
        items: &[BatchItem<'_>],
        tap: &mut LayerTap<'_>,
    ) -> Result<Vec<Option<Next>>, BackendError> {
        if let Some(per_token) = fault_slow_forward() {
            std::thread::sleep(per_token * items.iter().map(|i| i.len as u32).sum::<u32>());
        }
        let chunks: Vec<SeqChunk<'_>> = items
            .iter()
            .map(|it| SeqChunk {
                tokens: &it.tokens[it.start..it.start + it.len],
                start: it.start,
                slots: &it.slots,
                want_logits: it.want_next,
                adapter: it.adapter,
            })
            .collect();
        let mut inner = |n: usize, kv: &KvStore| {
            let read =
                |ids: &[u32], layers: std::ops::Range<usize>, bs: usize| read_layers(kv, ids, layers, bs);
            tap(n, &read);
        };
        let out = self.model.forward_tapped(&chunks, &mut self.kv, &mut inner)?;
        Ok(out.into_iter().map(|l| l.map(Next::Logits)).collect())
    }

    fn read_kv_layers(
        &mut self,
        ids: &[u32],
        layers: std::ops::Range<usize>,
        block_size: usize,
    ) -> Result<Vec<u8>, BackendError> {
        read_layers(&self.kv, ids, layers, block_size)
    }

    fn write_kv_layers(
        &mut self,
        ids: &[u32],
        layers: std::ops::Range<usize>,
        bytes: &[u8],
        block_size: usize,
    ) -> Result<(), BackendError> {
        if ids.is_empty() || !bytes.len().is_multiple_of(ids.len()) {
            return Err(BackendError::InvalidInput(format!(
                "{} bytes for {} blocks",
                bytes.len(),
                ids.len()
            )));
        }
        let per = bytes.len() / ids.len();
        for (id, b) in ids.iter().zip(bytes.chunks_exact(per)) {
            self.kv
                .write_slots_layers(*id as usize * block_size, block_size, layers.clone(), b)
                .map_err(BackendError::InvalidInput)?;
        }
        Ok(())
    }
}

/// Layers `layers` of blocks `ids` of `kv`, block after block (the store refuses slots or layers outside it).
fn read_layers(
    kv: &KvStore,
    ids: &[u32],
    layers: std::ops::Range<usize>,
    block_size: usize,
) -> Result<Vec<u8>, BackendError> {
    let mut out = Vec::new();
    for id in ids {
        let bytes = kv
            .read_slots_layers(*id as usize * block_size, block_size, layers.clone())
            .map_err(BackendError::InvalidInput)?;
        out.extend(bytes);
    }
    Ok(out)
}
