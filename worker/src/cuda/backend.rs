//! [`CudaBackend`]: the engine's `Backend` on a GPU. It owns the device, the weights, the KV pool in device memory
//! and the forward pass's scratch; the engine's block ids index its pool exactly as they index the CPU one, so
//! prefix-cache hits, eviction and reports behave the same.
//!
//! KV pool sizing ([`kv_slots_for`]): like vLLM's `--gpu-memory-utilization`, a fraction of the memory free after
//! the weights are loaded, less the forward pass's scratch for the largest step; or `--kv-cache-tokens` exactly.

use std::path::Path;

use super::forward::{self, GpuChunk, GpuKv, Out, Want, Workspace};
use super::gpu::{Gpu, GpuResult};
use super::lora::AdapterCache;
use super::weights::GpuWeights;
use super::DType;
use crate::engine::{Backend, BackendError, BatchItem, Next};
use crate::model::ModelConfig;

/// The CUDA engine.
pub struct CudaBackend {
    gpu: Gpu,
    cfg: ModelConfig,
    w: GpuWeights,
    kv: GpuKv,
    ws: Workspace,
    block_size: usize,
    /// LoRA adapters in device memory (`lora.rs`); 0 slots: the base model only.
    lora: AdapterCache,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("gpu", &self.gpu).field("dtype", &self.w.dt).finish()
    }
}

/// A model on a GPU before its KV pool is sized.
pub struct GpuModel {
    pub gpu: Gpu,
    pub cfg: ModelConfig,
    pub weights: GpuWeights,
}

impl GpuModel {
    /// Opens GPU `ordinal` and loads a model directory's weights in `dt`.
    pub fn from_dir(dir: &Path, ordinal: usize, dt: DType) -> GpuResult<Self> {
        let cfg = ModelConfig::from_dir(dir).map_err(|e| e.to_string())?;
        super::weights::check_shape(&cfg)?;
        let gpu = Gpu::open(ordinal)?;
        // The files as stored: bf16/f16 bytes go to the device as they are (no f32 copy of the model on the host).
        let stored = crate::model::stored::StoredTensors::open(dir)
            .map_err(|e| super::gpu::GpuError::Invalid(e.to_string()))?;
        let weights = GpuWeights::from_stored(&gpu, &cfg, &stored, dt)?;
        Ok(Self { gpu, cfg, weights })
    }

    /// Random weights of `cfg`'s shape (benchmarks).
    pub fn random(cfg: ModelConfig, ordinal: usize, dt: DType, seed: u64) -> GpuResult<Self> {
        let gpu = Gpu::open(ordinal)?;
        let weights = GpuWeights::random(&gpu, &cfg, dt, seed)?;
        Ok(Self { gpu, cfg, weights })
    }
}

/// KV slots (tokens) that fit: `kv_cache_tokens` if given (checked), else `utilization` x free memory less the
/// scratch of a `max_tokens`-token step with `max_rows` logits rows and `reserved` bytes (LoRA adapters'
/// device memory, `lora::reserve_bytes`); rounded down to whole blocks.
#[allow(clippy::too_many_arguments)]
pub fn kv_slots_for(
    l: &GpuModel,
    utilization: f64,
    kv_cache_tokens: Option<usize>,
    max_tokens: usize,
    max_rows: usize,
    block_size: usize,
    reserved: usize,
) -> GpuResult<usize> {
    let (free, _) = l.gpu.mem_info()?;
    let per_token = GpuKv::bytes_per_token(&l.cfg, l.weights.dt);
    let scratch = forward::workspace_bytes(
        &l.cfg,
        l.weights.dt,
        max_tokens,
        max_rows,
        l.cfg.max_position_embeddings.min(1 << 17),
    ) + reserved;
    let budget = ((free as f64 * utilization) as usize).saturating_sub(scratch);
    let fits = budget / per_token / block_size * block_size;
    match kv_cache_tokens {
        Some(t) if t * per_token > budget => Err(format!(
            "kv-cache-tokens {t} needs {} MiB of KV; {} MiB fit ({} MiB free x {utilization}, less {} MiB scratch)",
            (t * per_token) >> 20,
            budget >> 20,
            free >> 20,
            scratch >> 20
        ).into()),
        Some(t) => Ok(t / block_size * block_size),
        None if fits < block_size => Err(format!(
            "no room for KV blocks: {} MiB free x {utilization} less {} MiB scratch",
            free >> 20,
            scratch >> 20
        ).into()),
        None => Ok(fits),
    }
}

impl CudaBackend {
    /// A backend with a KV pool of `num_slots` positions (blocks x `block_size`).
    pub fn new(l: GpuModel, num_slots: usize, block_size: usize) -> GpuResult<Self> {
        let kv = GpuKv::new(&l.gpu, &l.cfg, l.weights.dt, num_slots)?;
        let mut ws = Workspace::default();
        let dt = l.weights.dt;
        if super::attention::flash_supported(dt, l.cfg.head_dim) {
            let h = super::attention::Heads {
                heads: l.cfg.num_attention_heads,
                kv_heads: l.cfg.num_key_value_heads,
                head_dim: l.cfg.head_dim,
                block_size,
            };
            let (ok, err) = super::selftest::flash_agrees(&l.gpu, dt, h)?;
            if ok {
                tracing::info!(rel_err = err, "flash prefill attention checked against the GEMM path: on");
            } else {
                tracing::warn!(
                    rel_err = err,
                    "flash prefill attention disagrees with the GEMM path: using GEMMs"
                );
            }
            ws.set_flash(ok);
            let (ok, err) = super::selftest::decode_tc_agrees(&l.gpu, dt, h)?;
            if ok {
                tracing::info!(
                    rel_err = err,
                    "tensor-core decode attention checked against the reference: on"
                );
            } else {
                tracing::warn!(
                    rel_err = err,
                    "tensor-core decode attention disagrees with the reference: off"
                );
            }
            ws.set_decode_tc(ok);
        }
        Ok(Self { gpu: l.gpu, cfg: l.cfg, w: l.weights, kv, ws, block_size, lora: AdapterCache::new(0) })
    }

    /// Runs LoRA adapters, at most `slots` in device memory at once (their memory reserved by the caller when it
    /// sized the KV pool: `kv_slots_for`'s `reserved`). 0: the base model only.
    pub fn with_adapter_slots(mut self, slots: usize) -> Self {
        self.lora = AdapterCache::new(slots);
        self
    }

    /// Adapters it keeps in device memory at once (0: none run).
    pub fn adapter_slots(&self) -> usize {
        self.lora.slots()
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn dtype(&self) -> DType {
        self.w.dt
    }

    pub fn weights(&self) -> &GpuWeights {
        &self.w
    }

    pub fn kv(&self) -> &GpuKv {
        &self.kv
    }

    /// Whether prefill attention runs on the flash kernel.
    pub fn flash(&self) -> bool {
        self.ws.flash()
    }

    /// Whether decode attention runs on the tensor-core kernel.
    pub fn decode_tc(&self) -> bool {
        self.ws.decode_tc()
    }

    /// Turns the tensor-core decode kernel off (or back on, where supported).
    pub fn set_decode_tc(&mut self, on: bool) {
        self.ws.set_decode_tc(on && super::attention::flash_supported(self.w.dt, self.cfg.head_dim));
    }

    /// Turns the flash prefill kernel off (or back on, where supported): benchmarks compare the two paths.
    pub fn set_flash(&mut self, on: bool) {
        self.ws.set_flash(on && super::attention::flash_supported(self.w.dt, self.cfg.head_dim));
    }

    /// One batch of chunks.
    pub fn run(&mut self, chunks: &[GpuChunk<'_>]) -> GpuResult<Vec<Option<Out>>> {
        forward::forward(&self.gpu, &self.cfg, &self.w, &self.kv, &mut self.ws, self.block_size, chunks)
    }

    /// "cuda:N (name, sm_XY)" for logs and metadata.
    pub fn describe(&self) -> String {
        format!("cuda:{} ({}, {}, {})", self.gpu.ordinal, self.gpu.name, self.gpu.arch, self.w.dt.hf_name())
    }
}

impl CudaBackend {
    /// One sub-batch of items whose distinct adapters fit the device slots: adapters made resident, then the
    /// forward pass.
    fn forward_part(&mut self, items: &[&BatchItem<'_>]) -> Result<Vec<Option<Out>>, BackendError> {
        let want: Vec<&crate::model::lora::LoraAdapter> = items.iter().filter_map(|it| it.adapter).collect();
        if !want.is_empty() && self.lora.slots() == 0 {
            return Err(BackendError::Unsupported(
                "LoRA on CUDA has no device slots (--max-gpu-loras)".into(),
            ));
        }
        let at = self.lora.ensure(&self.gpu, self.w.dt, &self.cfg, &want)?;
        let mut at = at.into_iter();
        let chunks: Vec<GpuChunk<'_>> = items
            .iter()
            .map(|it| GpuChunk {
                tokens: &it.tokens[it.start..it.start + it.len],
                start: it.start,
                slots: &it.slots,
                want: match (it.want_next, it.greedy) {
                    (false, _) => Want::Nothing,
                    (true, true) => Want::Argmax,
                    (true, false) => Want::Logits,
                },
                adapter: it.adapter.and_then(|_| at.next()).and_then(|i| self.lora.get(i)),
            })
            .collect();
        Ok(forward::forward(&self.gpu, &self.cfg, &self.w, &self.kv, &mut self.ws, self.block_size, &chunks)?)
    }
}

impl Backend for CudaBackend {
    /// Items run grouped by adapter, and a batch naming more distinct adapters than fit in device memory runs as
    /// consecutive sub-batches (`lora::plan`); results come back in the batch's order, each the same either way.
    fn forward(&mut self, items: &[BatchItem<'_>]) -> Result<Vec<Option<Next>>, BackendError> {
        let next = |o: Out| match o {
            Out::Logits(l) => Next::Logits(l),
            Out::Token(t) => Next::Token(t),
        };
        if items.iter().all(|it| it.adapter.is_none()) {
            let all: Vec<&BatchItem<'_>> = items.iter().collect();
            return Ok(self.forward_part(&all)?.into_iter().map(|o| o.map(next)).collect());
        }
        let keys: Vec<Option<&str>> = items.iter().map(|it| it.adapter.map(|a| a.key.as_str())).collect();
        let mut out: Vec<Option<Next>> = vec![None; items.len()];
        for part in super::lora::plan(&keys, |k| self.lora.holds(k), self.lora.slots()) {
            let these: Vec<&BatchItem<'_>> = part.iter().map(|i| &items[*i]).collect();
            for (i, o) in part.iter().zip(self.forward_part(&these)?) {
                out[*i] = o.map(next);
            }
        }
        Ok(out)
    }

    /// With device slots for adapters (`--max-gpu-loras`); UNVERIFIED on a GPU yet (`lora.rs`).
    fn runs_adapters(&self) -> bool {
        self.lora.slots() > 0
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn max_model_len(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        self.cfg.eos_token_ids.clone()
    }

    /// A block is its slots' K and V rows of every layer, in the model's dtype, copied as they are on the device.
    fn kv_block_bytes(&self, block_size: usize) -> Option<usize> {
        Some(block_size * GpuKv::bytes_per_token(&self.cfg, self.w.dt))
    }

    fn kv_layout(&self) -> String {
        let c = &self.cfg;
        format!(
            "cuda {} layers={} kv_heads={} head_dim={}",
            self.w.dt.hf_name(),
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim
        )
    }

    fn read_kv_blocks(&mut self, ids: &[u32], block_size: usize) -> Result<Vec<Vec<u8>>, BackendError> {
        ids.iter()
            .map(|id| {
                self.kv
                    .read_slots(&self.gpu, *id as usize * block_size, block_size)
                    .map_err(BackendError::from)
            })
            .collect()
    }

    fn write_kv_blocks(&mut self, blocks: &[(u32, &[u8])], block_size: usize) -> Result<(), BackendError> {
        for (id, bytes) in blocks {
            self.kv.write_slots(&self.gpu, *id as usize * block_size, block_size, bytes)?;
        }
        Ok(())
    }
}
