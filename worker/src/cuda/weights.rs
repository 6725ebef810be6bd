//! The model's tensors in device memory, in the storage dtype, laid out for the forward pass: Hugging Face
//! `[out, in]` Linear weights as they are (cuBLAS transposes), q/k/v and gate/up fused by stacking rows.
//! Loaded from a model directory as stored (`from_stored`: bf16/f16 bytes uploaded as they are when the dtype
//! matches, else converted a piece at a time; no f32 copy of the model on the host), from f32 CPU weights
//! (`upload`), or random (benchmarks of large shapes without writing gigabytes of safetensors).

use super::gpu::{DevBuf, Gpu, GpuError, GpuResult};
use super::DType;
use crate::model::stored::{Stored, StoredDtype, StoredTensors};
use crate::model::{ModelConfig, ModelWeights};

/// One decoder layer.
#[derive(Debug)]
pub struct GpuLayer {
    pub input_norm: DevBuf,
    /// `[q + 2 kv, hidden]`.
    pub wqkv: DevBuf,
    pub bqkv: Option<DevBuf>,
    /// `[hidden, q]`.
    pub wo: DevBuf,
    pub post_norm: DevBuf,
    /// `[2 * intermediate, hidden]`: gate rows then up rows.
    pub wgate_up: DevBuf,
    /// `[hidden, intermediate]`.
    pub wdown: DevBuf,
}

/// Every tensor of the model.
#[derive(Debug)]
pub struct GpuWeights {
    pub dt: DType,
    /// `[vocab, hidden]`.
    pub embed: DevBuf,
    pub layers: Vec<GpuLayer>,
    pub norm: DevBuf,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<DevBuf>,
    /// RoPE inverse frequencies (with Llama 3 scaling), f32 `[head_dim / 2]`.
    pub inv_freq: DevBuf,
}

/// Uploads f32 values and converts them to `dt` on the device.
pub fn upload_as(gpu: &Gpu, dt: DType, values: &[f32]) -> GpuResult<DevBuf> {
    let out = gpu.alloc(values.len() * dt.size())?;
    if dt == DType::F32 {
        gpu.upload(&out, values)?;
        return Ok(out);
    }
    // In pieces, so a large tensor needs little temporary device memory.
    const PIECE: usize = 1 << 24;
    let tmp = gpu.alloc(PIECE.min(values.len()) * 4)?;
    for (i, piece) in values.chunks(PIECE).enumerate() {
        gpu.upload(&tmp, piece)?;
        let dst = out.ptr() + (i * PIECE * dt.size()) as u64;
        convert_from_f32(gpu, dt, dst, tmp.ptr(), piece.len())?;
    }
    gpu.sync()?;
    Ok(out)
}

/// `dst[i] = dt(src[i])` for `n` f32 values on the device.
pub fn convert_from_f32(gpu: &Gpu, dt: DType, dst: u64, src: u64, n: usize) -> GpuResult<()> {
    let (mut d, mut s, mut n64) = (dst, src, n as i64);
    let blocks = (n.div_ceil(256)).clamp(1, 65_535) as u32;
    gpu.launch(
        &format!("from_f32_{}", dt.suffix()),
        (blocks, 1, 1),
        (256, 1, 1),
        0,
        &mut [ptr(&mut d), ptr(&mut s), ptr(&mut n64)],
    )
}

/// Reads `n` elements of type `dt` at `src` as f32.
pub fn download_f32(gpu: &Gpu, dt: DType, src: u64, n: usize) -> GpuResult<Vec<f32>> {
    let tmp = gpu.alloc(n * 4)?;
    let (mut d, mut s, mut n64) = (tmp.ptr(), src, n as i64);
    let blocks = (n.div_ceil(256)).clamp(1, 65_535) as u32;
    gpu.launch(
        &format!("to_f32_{}", dt.suffix()),
        (blocks, 1, 1),
        (256, 1, 1),
        0,
        &mut [ptr(&mut d), ptr(&mut s), ptr(&mut n64)],
    )?;
    let mut out = vec![0f32; n];
    gpu.download(&mut out, &tmp, 0)?;
    Ok(out)
}

/// A kernel argument.
pub fn ptr<T>(v: &mut T) -> *mut std::ffi::c_void {
    v as *mut T as *mut std::ffi::c_void
}

fn values(t: &candle_core::Tensor) -> GpuResult<Vec<f32>> {
    t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(|e| GpuError::Invalid(format!("weights: {e}")))
}

fn stacked(gpu: &Gpu, dt: DType, parts: &[&candle_core::Tensor]) -> GpuResult<DevBuf> {
    let mut all = Vec::new();
    for p in parts {
        all.extend(values(p)?);
    }
    upload_as(gpu, dt, &all)
}

/// Whether bytes stored as `s` are already `dt`'s.
fn same(s: StoredDtype, dt: DType) -> bool {
    matches!(
        (s, dt),
        (StoredDtype::F32, DType::F32) | (StoredDtype::BF16, DType::BF16) | (StoredDtype::F16, DType::F16)
    )
}

/// `parts` one after another in one buffer of `dt`: bytes as stored when they are `dt` already, else converted a
/// piece at a time (f32 on the host, `dt` on the device), so the host never holds a tensor in f32.
fn stacked_stored(gpu: &Gpu, dt: DType, parts: &[Stored<'_>]) -> GpuResult<DevBuf> {
    const PIECE: usize = 1 << 22;
    let total: usize = parts.iter().map(Stored::len).sum();
    let out = gpu.alloc(total * dt.size())?;
    let converting = parts.iter().any(|p| !same(p.dtype, dt));
    let tmp = if converting { Some(gpu.alloc(PIECE.min(total.max(1)) * 4)?) } else { None };
    let mut at = 0usize;
    for p in parts {
        let dst = out.ptr() + (at * dt.size()) as u64;
        match &tmp {
            Some(tmp) if !same(p.dtype, dt) => {
                for start in (0..p.len()).step_by(PIECE) {
                    let end = (start + PIECE).min(p.len());
                    gpu.upload(tmp, &p.f32_range(start..end))?;
                    convert_from_f32(gpu, dt, dst + (start * dt.size()) as u64, tmp.ptr(), end - start)?;
                    gpu.sync()?;
                }
            }
            _ => super::forward::upload_raw(gpu, dst, p.bytes)?,
        }
        at += p.len();
    }
    gpu.sync()?;
    Ok(out)
}

/// Checks the shape limits of the GPU kernels.
pub fn check_shape(cfg: &ModelConfig) -> Result<(), String> {
    let hd = cfg.head_dim;
    if !(16..=256).contains(&hd) || !hd.is_power_of_two() {
        return Err(format!("the CUDA kernels need head_dim a power of two in 16..=256 (model has {hd})"));
    }
    if cfg.group_size() > 8 {
        return Err(format!(
            "the CUDA decode kernel supports up to 8 query heads per KV head (model has {})",
            cfg.group_size()
        ));
    }
    Ok(())
}

impl GpuWeights {
    /// From loaded (f32, CPU) weights.
    pub fn upload(gpu: &Gpu, cfg: &ModelConfig, w: &ModelWeights, dt: DType) -> GpuResult<Self> {
        check_shape(cfg)?;
        gpu.bind()?;
        let mut layers = Vec::with_capacity(w.layers.len());
        for lw in &w.layers {
            let bqkv = match (&lw.q_bias, &lw.k_bias, &lw.v_bias) {
                (Some(q), Some(k), Some(v)) => Some(stacked(gpu, dt, &[q, k, v])?),
                _ => None,
            };
            layers.push(GpuLayer {
                input_norm: stacked(gpu, dt, &[&lw.input_layernorm])?,
                wqkv: stacked(gpu, dt, &[&lw.q_proj, &lw.k_proj, &lw.v_proj])?,
                bqkv,
                wo: stacked(gpu, dt, &[&lw.o_proj])?,
                post_norm: stacked(gpu, dt, &[&lw.post_attention_layernorm])?,
                wgate_up: stacked(gpu, dt, &[&lw.gate_proj, &lw.up_proj])?,
                wdown: stacked(gpu, dt, &[&lw.down_proj])?,
            });
        }
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(stacked(gpu, dt, &[&w.lm_head])?) };
        Ok(Self {
            dt,
            embed: stacked(gpu, dt, &[&w.embed_tokens])?,
            layers,
            norm: stacked(gpu, dt, &[&w.norm])?,
            lm_head,
            inv_freq: gpu.upload_new(&cfg.rope_inv_freq())?,
        })
    }

    /// From the tensors as stored in the model's files (`model::stored`): what loading a real model takes.
    pub fn from_stored(gpu: &Gpu, cfg: &ModelConfig, st: &StoredTensors, dt: DType) -> GpuResult<Self> {
        check_shape(cfg)?;
        gpu.bind()?;
        let (h, q, kv, i) =
            (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.kv_dim(), cfg.intermediate_size);
        let get =
            |name: &str, shape: &[usize]| st.get(name, shape).map_err(|e| GpuError::Invalid(e.to_string()));
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let bqkv = if cfg.attention_bias {
                let parts = [
                    get(&p("self_attn.q_proj.bias"), &[q])?,
                    get(&p("self_attn.k_proj.bias"), &[kv])?,
                    get(&p("self_attn.v_proj.bias"), &[kv])?,
                ];
                Some(stacked_stored(gpu, dt, &parts)?)
            } else {
                None
            };
            let qkv = [
                get(&p("self_attn.q_proj.weight"), &[q, h])?,
                get(&p("self_attn.k_proj.weight"), &[kv, h])?,
                get(&p("self_attn.v_proj.weight"), &[kv, h])?,
            ];
            let gate_up =
                [get(&p("mlp.gate_proj.weight"), &[i, h])?, get(&p("mlp.up_proj.weight"), &[i, h])?];
            layers.push(GpuLayer {
                input_norm: stacked_stored(gpu, dt, &[get(&p("input_layernorm.weight"), &[h])?])?,
                wqkv: stacked_stored(gpu, dt, &qkv)?,
                bqkv,
                wo: stacked_stored(gpu, dt, &[get(&p("self_attn.o_proj.weight"), &[h, q])?])?,
                post_norm: stacked_stored(gpu, dt, &[get(&p("post_attention_layernorm.weight"), &[h])?])?,
                wgate_up: stacked_stored(gpu, dt, &gate_up)?,
                wdown: stacked_stored(gpu, dt, &[get(&p("mlp.down_proj.weight"), &[h, i])?])?,
            });
        }
        let lm_head = match cfg.tie_word_embeddings {
            true => None,
            false => Some(stacked_stored(gpu, dt, &[get("lm_head.weight", &[cfg.vocab_size, h])?])?),
        };
        Ok(Self {
            dt,
            embed: stacked_stored(gpu, dt, &[get("model.embed_tokens.weight", &[cfg.vocab_size, h])?])?,
            layers,
            norm: stacked_stored(gpu, dt, &[get("model.norm.weight", &[h])?])?,
            lm_head,
            inv_freq: gpu.upload_new(&cfg.rope_inv_freq())?,
        })
    }

    /// Random weights of `cfg`'s shape made on the device (uniform, scaled by 1/sqrt(fan-in); norms 1).
    pub fn random(gpu: &Gpu, cfg: &ModelConfig, dt: DType, seed: u64) -> GpuResult<Self> {
        check_shape(cfg)?;
        gpu.bind()?;
        let (h, q, kv, i) =
            (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.kv_dim(), cfg.intermediate_size);
        let mut n = 0u64;
        let mut rand = |rows: usize, cols: usize, scale: f32| -> GpuResult<DevBuf> {
            n += 1;
            let b = gpu.alloc(rows * cols * dt.size())?;
            let (mut p, mut len, mut s, mut sc) =
                (b.ptr(), (rows * cols) as i64, seed.wrapping_mul(1_000_003) + n, scale);
            gpu.launch(
                &format!("fill_uniform_{}", dt.suffix()),
                (((rows * cols).div_ceil(256)).clamp(1, 65_535) as u32, 1, 1),
                (256, 1, 1),
                0,
                &mut [ptr(&mut p), ptr(&mut len), ptr(&mut s), ptr(&mut sc)],
            )?;
            Ok(b)
        };
        let ones = vec![1.0f32; h];
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            let (sh, si) = (1.0 / (h as f32).sqrt(), 1.0 / (i as f32).sqrt());
            layers.push(GpuLayer {
                input_norm: upload_as(gpu, dt, &ones)?,
                wqkv: rand(q + 2 * kv, h, sh)?,
                bqkv: if cfg.attention_bias { Some(rand(1, q + 2 * kv, 0.02)?) } else { None },
                wo: rand(h, q, 1.0 / (q as f32).sqrt())?,
                post_norm: upload_as(gpu, dt, &ones)?,
                wgate_up: rand(2 * i, h, sh)?,
                wdown: rand(h, i, si)?,
            });
        }
        let embed = rand(cfg.vocab_size, h, 1.0)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(rand(cfg.vocab_size, h, 1.0 / (h as f32).sqrt())?)
        };
        gpu.sync()?;
        Ok(Self {
            dt,
            embed,
            layers,
            norm: upload_as(gpu, dt, &ones)?,
            lm_head,
            inv_freq: gpu.upload_new(&cfg.rope_inv_freq())?,
        })
    }

    /// The LM head's pointer (the embedding when tied).
    pub fn lm_head_ptr(&self) -> u64 {
        self.lm_head.as_ref().unwrap_or(&self.embed).ptr()
    }

    /// Bytes of every weight read by one decode step (all but the embedding, which is gathered).
    pub fn step_bytes(&self) -> usize {
        let mut n = self.norm.bytes() + self.lm_head.as_ref().unwrap_or(&self.embed).bytes();
        for l in &self.layers {
            n += l.input_norm.bytes() + l.wqkv.bytes() + l.wo.bytes() + l.post_norm.bytes();
            n += l.wgate_up.bytes() + l.wdown.bytes() + l.bqkv.as_ref().map_or(0, |b| b.bytes());
        }
        n
    }
}
