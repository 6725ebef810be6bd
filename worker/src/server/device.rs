//! The one device-specific step of assembling the engine ([`make_backend`]): the [`Backend`] for the configured
//! engine and device, boxed, and what it says of itself ([`DeviceBackend`]). The CPU engine is the Llama-family
//! model with its KV in host memory; the CUDA engine the same model on a GPU (`crate::cuda`), its KV pool sized from
//! the GPU's free memory; the simulated engine a timing profile's tokens and speeds. Everything after this step is
//! the same for all three (`assemble`).
//!
//! Invariants: `kv_slots` is a whole number of blocks, and the backend's KV memory holds at least that many
//! positions (the simulated backend holds none and needs none); each maker logs its one start-up line ("CPU engine", "CUDA engine", "simulated engine") once the
//! backend exists, and fails with the text a person reads before the process exits (status 1).

use std::path::Path;

use kvgate_shared::prompt::Prompter;

use super::config::{self, EngineKind, ServeConfig};
use crate::cuda::DeviceChoice;
use crate::engine::sim::{SimBackend, SimClock};
use crate::engine::timing::SimProfile;
use crate::engine::{Backend, CpuBackend};
use crate::kv::LoadCosts;
use crate::model::fp8::KvCacheDtype;
use crate::model::llama::LlamaModel;

/// A backend for the configured device and what the rest of the assembly needs to know of it.
pub struct DeviceBackend {
    pub backend: Box<dyn Backend>,
    /// Positions of its KV memory the engine's pool spans (`kv_slots / block_size` blocks).
    pub kv_slots: usize,
    /// Longest sequence the model supports.
    pub max_model_len: usize,
    /// Where it computes, for `/v1/models` and the `kvgate_worker_device_info` metric: `cpu`, `sim`, or the GPU
    /// (`cuda:0 (NVIDIA H200, sm_90, bfloat16)`).
    pub device: String,
    /// Where load-vs-recompute's tier speeds come from.
    pub load_costs: LoadCostsFrom,
    /// Whether its KV blocks may move to other workers (the simulated engine has no real KV to send).
    pub transfers_kv: bool,
}

/// Where the tiers' load speeds come from.
pub enum LoadCostsFrom {
    /// Measured on this machine at start (`load_costs::measure`): the backend really copies blocks.
    Measured,
    /// A simulated engine loads and computes at its profile's speeds: weigh those, not this machine's.
    Profile(LoadCosts),
}

/// The backend `cfg` asks for: the simulated engine, or the model on `--device` (`auto` resolved by probing for a
/// GPU). `dir` is the model directory; `prompter` its tokenizer (the simulated engine's vocabulary and EOS).
pub fn make_backend(cfg: &ServeConfig, dir: &Path, prompter: &Prompter) -> Result<DeviceBackend, String> {
    match &cfg.engine {
        EngineKind::Cpu => match cfg.device.resolve() {
            DeviceChoice::Cuda(ordinal) => cuda(cfg, dir, ordinal),
            _ => cpu(cfg, dir),
        },
        EngineKind::Sim { profile } => sim(cfg, profile, prompter),
    }
}

fn cpu(cfg: &ServeConfig, dir: &Path) -> Result<DeviceBackend, String> {
    let bs = cfg.block_size as usize;
    let tokens = cfg.kv_cache_tokens.unwrap_or(config::CPU_KV_CACHE_TOKENS);
    let model = LlamaModel::load(dir).map_err(|e| e.to_string())?;
    let max_model_len = model.config().max_position_embeddings;
    let backend = CpuBackend::with_kv_dtype(model, tokens / bs * bs, cfg.kv_cache_dtype);
    tracing::info!(device = "cpu", requested = %cfg.device, kv_cache_tokens = tokens / bs * bs,
        kv_cache_dtype = ?cfg.kv_cache_dtype, "CPU engine");
    Ok(DeviceBackend {
        backend: Box::new(backend),
        kv_slots: tokens / bs * bs,
        max_model_len,
        device: "cpu".to_string(),
        load_costs: LoadCostsFrom::Measured,
        transfers_kv: true,
    })
}

fn cuda(cfg: &ServeConfig, dir: &Path, ordinal: usize) -> Result<DeviceBackend, String> {
    if cfg.kv_cache_dtype == KvCacheDtype::Fp8 {
        return Err(format!(
            "--kv-cache-dtype fp8 on cuda:{ordinal}: the CUDA FP8 KV kernels are not built yet (only the CPU \
             engine's reference math is); use --kv-cache-dtype auto"
        ));
    }
    let bs = cfg.block_size as usize;
    let l = crate::cuda::backend::GpuModel::from_dir(dir, ordinal, cfg.dtype)
        .map_err(|e| format!("--device cuda:{ordinal}: {e} (--device cpu serves on the CPU)"))?;
    let adapter_slots = cfg.gpu_lora_slots();
    let reserved = crate::cuda::lora::reserve_bytes(
        &l.cfg,
        l.weights.dt,
        adapter_slots,
        cfg.max_lora_rank,
        cfg.max_num_batched_tokens,
    );
    let slots = crate::cuda::backend::kv_slots_for(
        &l,
        cfg.gpu_memory_utilization,
        cfg.kv_cache_tokens,
        cfg.max_num_batched_tokens,
        cfg.max_num_seqs,
        bs,
        reserved,
    )?;
    let max_model_len = l.cfg.max_position_embeddings;
    let backend = crate::cuda::CudaBackend::new(l, slots, bs)?.with_adapter_slots(adapter_slots);
    let device = backend.describe();
    tracing::info!(device = %device, kv_cache_tokens = slots, lora_slots = adapter_slots,
        lora_reserved_mib = reserved >> 20, "CUDA engine");
    Ok(DeviceBackend {
        backend: Box::new(backend),
        kv_slots: slots,
        max_model_len,
        device,
        load_costs: LoadCostsFrom::Measured,
        transfers_kv: true,
    })
}

fn sim(cfg: &ServeConfig, profile: &Path, prompter: &Prompter) -> Result<DeviceBackend, String> {
    let profile = SimProfile::named_or_file(&profile.to_string_lossy())?;
    let eos: Vec<u32> = prompter.eos_token_id().into_iter().collect();
    let backend = SimBackend::new(prompter.vocab_size(), profile.max_model_len, eos)
        .with_timing(profile.timing, SimClock::RealTime);
    tracing::info!(profile = %profile.name, "simulated engine");
    let bs = cfg.block_size as usize;
    let tokens = cfg.kv_cache_tokens.unwrap_or(config::CPU_KV_CACHE_TOKENS);
    Ok(DeviceBackend {
        backend: Box::new(backend),
        kv_slots: tokens / bs * bs,
        max_model_len: profile.max_model_len,
        device: "sim".to_string(),
        load_costs: LoadCostsFrom::Profile(profile.timing.load_costs(cfg.kv_load_policy)),
        transfers_kv: false,
    })
}
