//! The Llama-family forward pass (Llama 2/3.x, Mistral, Qwen2) over a paged KV pool, for a batch of sequence
//! chunks at once: prefill chunks and decode tokens of many sequences share every projection and MLP matmul;
//! attention runs per sequence over the K/V gathered from its blocks.
//!
//! Attention of a chunk is tiled over queries ([`QUERY_TILE`] rows at a time), and a tile only reads the keys it
//! may attend to (causal), so a long prefill never materialises the full `[heads, n, n]` matrix and skips the
//! masked half of it. GQA is computed without repeating K/V: the query heads of one KV head are stacked as rows.
//!
//! Numerics follow `transformers`/candle-transformers: f32 compute, RMSNorm, rotate-half RoPE (with Llama 3
//! scaling), softmax in f32, SiLU-gated MLP; checked against candle-transformers' llama in `tests/reference.rs`.

use candle_core::{DType, Device, Tensor};

use super::lora::{LoraAdapter, Target};
use super::{ModelConfig, ModelError, ModelWeights};

/// Query rows per attention tile.
pub const QUERY_TILE: usize = 256;

/// Appends `rows` as little-endian bytes (a memcpy on a little-endian machine).
fn put_le(out: &mut Vec<u8>, rows: &[f32]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(rows));
    } else {
        out.extend(rows.iter().flat_map(|x| x.to_le_bytes()));
    }
}

/// Fills `rows` from little-endian bytes (`src.len() == 4 * rows.len()`; a memcpy on a little-endian machine).
fn get_le(rows: &mut [f32], src: &[u8]) {
    if cfg!(target_endian = "little") && src.len() == rows.len() * 4 {
        bytemuck::cast_slice_mut::<f32, u8>(rows).copy_from_slice(src);
    } else {
        for (x, c) in rows.iter_mut().zip(src.chunks_exact(4)) {
            *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

/// K and V memory of every layer: `[slots, kv_heads * head_dim]` each, a slot being `block * block_size + offset`.
/// (The pool layout `[num_blocks, block_size, kv_heads, head_dim]` flattened.)
#[derive(Debug)]
pub struct KvStore {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    kv_dim: usize,
    num_slots: usize,
    /// With `--kv-cache-dtype fp8`: the head size each written row is rounded through FP8 by (`fp8::round_heads`).
    fp8_head_dim: Option<usize>,
}

impl KvStore {
    /// Zeroed memory for `num_slots` positions of every layer (pages are touched lazily by the OS).
    pub fn new(num_layers: usize, num_slots: usize, kv_dim: usize) -> Self {
        let n = num_slots * kv_dim;
        Self {
            k: (0..num_layers).map(|_| vec![0.0; n]).collect(),
            v: (0..num_layers).map(|_| vec![0.0; n]).collect(),
            kv_dim,
            num_slots,
            fp8_head_dim: None,
        }
    }

    /// The same store holding what an FP8 cache would (each written row rounded through E4M3, a scale per head).
    pub fn with_fp8(mut self, head_dim: usize) -> Self {
        self.fp8_head_dim = Some(head_dim);
        self
    }

    /// Bytes of K and V per token across all layers.
    pub fn bytes_per_token(num_layers: usize, kv_dim: usize) -> usize {
        2 * num_layers * kv_dim * std::mem::size_of::<f32>()
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Bytes [`Self::read_slots`] returns for `n` slots.
    pub fn bytes_for(&self, n: usize) -> usize {
        Self::bytes_per_token(self.k.len(), self.kv_dim) * n
    }

    /// The K and V of slots `first..first + n`, every layer (K then V per layer, little-endian f32): a KV block's
    /// bytes for a lower tier.
    pub fn read_slots(&self, first: usize, n: usize) -> Result<Vec<u8>, String> {
        let d = self.kv_dim;
        if first + n > self.num_slots {
            return Err(format!("slots {first}..{} past {}", first + n, self.num_slots));
        }
        let mut out = Vec::with_capacity(self.bytes_for(n));
        for layer in 0..self.k.len() {
            for rows in [&self.k[layer], &self.v[layer]] {
                put_le(&mut out, &rows[first * d..(first + n) * d]);
            }
        }
        Ok(out)
    }

    /// Writes what [`Self::read_slots`] returned back into slots `first..first + n`.
    pub fn write_slots(&mut self, first: usize, n: usize, bytes: &[u8]) -> Result<(), String> {
        let d = self.kv_dim;
        if first + n > self.num_slots || bytes.len() != self.bytes_for(n) {
            return Err(format!(
                "{} bytes for slots {first}..{} (want {})",
                bytes.len(),
                first + n,
                self.bytes_for(n)
            ));
        }
        // Layer after layer, K then V: one contiguous run of `n * d` floats each, converted in place.
        let mut runs = bytes.chunks_exact(n * d * 4);
        for layer in 0..self.k.len() {
            for rows in [&mut self.k[layer], &mut self.v[layer]] {
                get_le(&mut rows[first * d..(first + n) * d], runs.next().unwrap_or_default());
            }
        }
        Ok(())
    }

    /// Layers of the store.
    pub fn num_layers(&self) -> usize {
        self.k.len()
    }

    /// [`Self::read_slots`] restricted to `layers` (the bytes of those layers, in the same order).
    pub fn read_slots_layers(
        &self,
        first: usize,
        n: usize,
        layers: std::ops::Range<usize>,
    ) -> Result<Vec<u8>, String> {
        let d = self.kv_dim;
        if first + n > self.num_slots || layers.end > self.k.len() || layers.start >= layers.end {
            return Err(format!("slots {first}..{} layers {layers:?} past the store", first + n));
        }
        let mut out = Vec::with_capacity(2 * layers.len() * n * d * 4);
        for layer in layers {
            for rows in [&self.k[layer], &self.v[layer]] {
                put_le(&mut out, &rows[first * d..(first + n) * d]);
            }
        }
        Ok(out)
    }

    /// Writes what [`Self::read_slots_layers`] returned back into slots `first..first + n`, layers `layers`.
    pub fn write_slots_layers(
        &mut self,
        first: usize,
        n: usize,
        layers: std::ops::Range<usize>,
        bytes: &[u8],
    ) -> Result<(), String> {
        let d = self.kv_dim;
        let want = 2 * layers.len() * n * d * 4;
        if first + n > self.num_slots || layers.end > self.k.len() || bytes.len() != want {
            return Err(format!(
                "{} bytes for slots {first}..{} layers {layers:?} (want {want})",
                bytes.len(),
                first + n
            ));
        }
        let mut chunks = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        for layer in layers {
            for rows in [&mut self.k[layer], &mut self.v[layer]] {
                for x in &mut rows[first * d..(first + n) * d] {
                    *x = chunks.next().unwrap_or(0.0);
                }
            }
        }
        Ok(())
    }

    fn write(&mut self, layer: usize, slots: &[usize], k_rows: &[f32], v_rows: &[f32]) {
        let d = self.kv_dim;
        for (i, &s) in slots.iter().enumerate() {
            let (k, v) = (&mut self.k[layer][s * d..(s + 1) * d], &mut self.v[layer][s * d..(s + 1) * d]);
            k.copy_from_slice(&k_rows[i * d..(i + 1) * d]);
            v.copy_from_slice(&v_rows[i * d..(i + 1) * d]);
            if let Some(hd) = self.fp8_head_dim {
                super::fp8::round_heads(k, hd);
                super::fp8::round_heads(v, hd);
            }
        }
    }

    /// K and V rows of `slots`, contiguous runs copied at once.
    fn gather(&self, layer: usize, slots: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let d = self.kv_dim;
        let mut k = Vec::with_capacity(slots.len() * d);
        let mut v = Vec::with_capacity(slots.len() * d);
        let mut i = 0;
        while i < slots.len() {
            let mut j = i + 1;
            while j < slots.len() && slots[j] == slots[j - 1] + 1 {
                j += 1;
            }
            let (a, b) = (slots[i] * d, (slots[j - 1] + 1) * d);
            k.extend_from_slice(&self.k[layer][a..b]);
            v.extend_from_slice(&self.v[layer][a..b]);
            i = j;
        }
        (k, v)
    }
}

/// One sequence's part of a forward batch.
#[derive(Clone, Debug)]
pub struct SeqChunk<'a> {
    /// Tokens to compute, at positions `start..start + tokens.len()`.
    pub tokens: &'a [u32],
    pub start: usize,
    /// KV slot of every position `0..start + tokens.len()` (from the block table).
    pub slots: &'a [usize],
    /// Return the logits of the chunk's last token.
    pub want_logits: bool,
    /// The LoRA adapter its sequence runs with (`lora.rs`); `None`: the base model.
    pub adapter: Option<&'a LoraAdapter>,
}

/// The rows of a batch that run with each adapter (chunks of one adapter grouped), for the low-rank updates.
struct AdapterRows<'a> {
    groups: Vec<(&'a LoraAdapter, Tensor)>,
}

impl<'a> AdapterRows<'a> {
    fn of(chunks: &[SeqChunk<'a>]) -> Result<Self, ModelError> {
        let mut groups: Vec<(&'a LoraAdapter, Vec<u32>)> = Vec::new();
        let mut offset = 0u32;
        for c in chunks {
            let n = c.tokens.len() as u32;
            if let Some(a) = c.adapter {
                let rows = offset..offset + n;
                match groups.iter_mut().find(|(g, _)| std::ptr::eq(*g, a)) {
                    Some((_, r)) => r.extend(rows),
                    None => groups.push((a, rows.collect())),
                }
            }
            offset += n;
        }
        let groups = groups
            .into_iter()
            .filter(|(_, r)| !r.is_empty())
            .map(|(a, r)| {
                let n = r.len();
                Ok((a, Tensor::from_vec(r, n, &Device::Cpu)?))
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(Self { groups })
    }

    /// `base` (`[T, sum of targets' outputs]`, the fused projections of `input` `[T, in]`) plus each group's
    /// adapter update of `targets` on its rows; a target an adapter does not touch adds zeros.
    fn add(
        &self,
        base: Tensor,
        input: &Tensor,
        layer: usize,
        targets: &[(Target, usize)],
    ) -> Result<Tensor, ModelError> {
        let mut out = base;
        for (adapter, rows) in &self.groups {
            // Nothing is gathered or allocated for an adapter that leaves these projections of this layer alone.
            let touched =
                adapter.layers.get(layer).is_some_and(|l| targets.iter().any(|(t, _)| l.contains_key(t)));
            if !touched {
                continue;
            }
            let x = input.index_select(rows, 0)?;
            let n = rows.dims1()?;
            let mut parts = Vec::with_capacity(targets.len());
            for &(t, width) in targets {
                match adapter.delta(layer, t, &x)? {
                    Some(d) => parts.push(d),
                    None => parts.push(Tensor::zeros((n, width), DType::F32, &Device::Cpu)?),
                }
            }
            let delta = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 1)? };
            out = out.index_add(rows, &delta, 0)?;
        }
        Ok(out)
    }
}

struct Layer {
    input_norm: Tensor,
    /// `[hidden, q + 2 kv]`: q, k and v projections fused and transposed.
    wqkv: Tensor,
    bqkv: Option<Tensor>,
    wo: Tensor,
    post_norm: Tensor,
    /// `[hidden, 2 * intermediate]`: gate and up fused and transposed.
    wgate_up: Tensor,
    wdown: Tensor,
}

/// A loaded model ready to run.
pub struct LlamaModel {
    cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    inv_freq: Vec<f32>,
    eps: f32,
}

impl std::fmt::Debug for LlamaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaModel").field("cfg", &self.cfg).finish()
    }
}

fn bad_input(reason: String) -> ModelError {
    ModelError::Candle(candle_core::Error::Msg(reason))
}

impl LlamaModel {
    /// Prepares loaded weights (fusing and transposing projections once).
    pub fn new(cfg: ModelConfig, w: ModelWeights) -> Result<Self, ModelError> {
        let mut layers = Vec::with_capacity(w.layers.len());
        for lw in w.layers {
            let wqkv = Tensor::cat(&[&lw.q_proj, &lw.k_proj, &lw.v_proj], 0)?.t()?.contiguous()?;
            let bqkv = match (&lw.q_bias, &lw.k_bias, &lw.v_bias) {
                (Some(q), Some(k), Some(v)) => Some(Tensor::cat(&[q, k, v], 0)?),
                _ => None,
            };
            layers.push(Layer {
                input_norm: lw.input_layernorm,
                wqkv,
                bqkv,
                wo: lw.o_proj.t()?.contiguous()?,
                post_norm: lw.post_attention_layernorm,
                wgate_up: Tensor::cat(&[&lw.gate_proj, &lw.up_proj], 0)?.t()?.contiguous()?,
                wdown: lw.down_proj.t()?.contiguous()?,
            });
        }
        Ok(Self {
            inv_freq: cfg.rope_inv_freq(),
            eps: cfg.rms_norm_eps as f32,
            embed: w.embed_tokens,
            layers,
            norm: w.norm,
            lm_head: w.lm_head.t()?.contiguous()?,
            cfg,
        })
    }

    /// Loads `config.json` and the weights of a model directory.
    pub fn load(dir: &std::path::Path) -> Result<Self, ModelError> {
        let cfg = ModelConfig::from_dir(dir)?;
        let w = ModelWeights::load(dir, &cfg)?;
        Self::new(cfg, w)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// A KV store for this model's shape.
    pub fn new_kv_store(&self, num_slots: usize) -> KvStore {
        self.new_kv_store_as(num_slots, super::fp8::KvCacheDtype::Auto)
    }

    /// A KV store of `dtype` (`Fp8`: rounded through E4M3 as written, the reference of an FP8 cache).
    pub fn new_kv_store_as(&self, num_slots: usize, dtype: super::fp8::KvCacheDtype) -> KvStore {
        let kv = KvStore::new(self.cfg.num_hidden_layers, num_slots, self.cfg.kv_dim());
        match dtype {
            super::fp8::KvCacheDtype::Auto => kv,
            super::fp8::KvCacheDtype::Fp8 => kv.with_fp8(self.cfg.head_dim),
        }
    }

    /// cos and sin `[T, head_dim / 2]` of each position.
    fn rope_tables(&self, positions: &[usize]) -> Result<(Tensor, Tensor), ModelError> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let dev = Device::Cpu;
        Ok((
            Tensor::from_vec(cos, (positions.len(), half), &dev)?,
            Tensor::from_vec(sin, (positions.len(), half), &dev)?,
        ))
    }

    /// Runs one batch; returns, per chunk, the last token's logits when asked for.
    pub fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        kv: &mut KvStore,
    ) -> Result<Vec<Option<Vec<f32>>>, ModelError> {
        self.forward_tapped(chunks, kv, &mut |_, _| {})
    }

    /// [`Self::forward`], calling `tap(n, kv)` as soon as layers `0..n` of this batch's K/V are written (before
    /// layer `n - 1`'s attention), so they can leave while the rest computes.
    pub fn forward_tapped(
        &self,
        chunks: &[SeqChunk<'_>],
        kv: &mut KvStore,
        tap: &mut dyn FnMut(usize, &KvStore),
    ) -> Result<Vec<Option<Vec<f32>>>, ModelError> {
        let cfg = &self.cfg;
        let (heads, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let (qd, kvd) = (heads * hd, kvh * hd);
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut write_slots = Vec::new();
        for c in chunks {
            let end = c.start + c.tokens.len();
            if c.slots.len() < end || end > cfg.max_position_embeddings {
                return Err(bad_input(format!("chunk needs {end} positions, has {} slots", c.slots.len())));
            }
            if let Some(t) = c.tokens.iter().find(|t| **t as usize >= cfg.vocab_size) {
                return Err(bad_input(format!(
                    "token id {t} is outside the vocabulary ({})",
                    cfg.vocab_size
                )));
            }
            if c.slots[..end].iter().any(|s| *s >= kv.num_slots()) {
                return Err(bad_input("slot outside the KV store".into()));
            }
            ids.extend_from_slice(c.tokens);
            positions.extend(c.start..end);
            write_slots.extend_from_slice(&c.slots[c.start..end]);
        }
        let total = ids.len();
        if total == 0 {
            return Ok(vec![None; chunks.len()]);
        }
        let dev = Device::Cpu;
        let (cos, sin) = self.rope_tables(&positions)?;
        let mut x = self.embed.index_select(&Tensor::from_vec(ids, total, &dev)?, 0)?;
        let lora = AdapterRows::of(chunks)?;
        let inter = cfg.intermediate_size;
        for (li, layer) in self.layers.iter().enumerate() {
            let xn = candle_nn::ops::rms_norm(&x, &layer.input_norm, self.eps)?;
            let mut qkv = lora.add(
                xn.matmul(&layer.wqkv)?,
                &xn,
                li,
                &[(Target::Q, qd), (Target::K, kvd), (Target::V, kvd)],
            )?;
            if let Some(b) = &layer.bqkv {
                qkv = qkv.broadcast_add(b)?;
            }
            // [1, heads, T, hd] for the rope kernel.
            let to_heads = |t: Tensor, n: usize| -> candle_core::Result<Tensor> {
                t.reshape((total, n, hd))?.transpose(0, 1)?.contiguous()?.unsqueeze(0)
            };
            let q = candle_nn::rotary_emb::rope(&to_heads(qkv.narrow(1, 0, qd)?, heads)?, &cos, &sin)?;
            let k = candle_nn::rotary_emb::rope(&to_heads(qkv.narrow(1, qd, kvd)?, kvh)?, &cos, &sin)?;
            let v = qkv.narrow(1, qd + kvd, kvd)?.contiguous()?;
            // Store this batch's K/V ([T, kv_heads * hd] rows) before attention reads them back.
            let k_rows = k.squeeze(0)?.transpose(0, 1)?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
            let v_rows = v.flatten_all()?.to_vec1::<f32>()?;
            kv.write(li, &write_slots, &k_rows, &v_rows);
            tap(li + 1, kv);

            // Per-chunk outputs [heads, n, hd] keyed by token offset; single-token chunks (decodes) share one
            // batched attention.
            let mut outs: Vec<(usize, Tensor)> = Vec::with_capacity(chunks.len());
            let mut decodes: Vec<(usize, &SeqChunk<'_>)> = Vec::new();
            let mut offset = 0;
            for c in chunks {
                let n = c.tokens.len();
                if n == 1 {
                    decodes.push((offset, c));
                } else if n > 0 {
                    outs.push((offset, self.attend(kv, li, c, &q.narrow(2, offset, n)?)?));
                }
                offset += n;
            }
            if decodes.len() == 1 {
                let (o, c) = decodes[0];
                outs.push((o, self.attend(kv, li, c, &q.narrow(2, o, 1)?)?));
            } else if !decodes.is_empty() {
                let batched = self.attend_decodes(kv, li, &decodes, &q)?; // [heads, B, hd]
                for (b, (o, _)) in decodes.iter().enumerate() {
                    outs.push((*o, batched.narrow(1, b, 1)?));
                }
            }
            outs.sort_by_key(|(o, _)| *o);
            let outs: Vec<Tensor> = outs.into_iter().map(|(_, t)| t).collect();
            // [heads, T, hd] -> [T, heads * hd]
            let y = Tensor::cat(&outs, 1)?.transpose(0, 1)?.contiguous()?.reshape((total, qd))?;
            x = (x + lora.add(y.matmul(&layer.wo)?, &y, li, &[(Target::O, cfg.hidden_size)])?)?;
            let xn = candle_nn::ops::rms_norm(&x, &layer.post_norm, self.eps)?;
            let gu = lora.add(
                xn.matmul(&layer.wgate_up)?,
                &xn,
                li,
                &[(Target::Gate, inter), (Target::Up, inter)],
            )?;
            let m = (candle_nn::ops::silu(&gu.narrow(1, 0, inter)?)? * gu.narrow(1, inter, inter)?)?;
            x = (x + lora.add(m.matmul(&layer.wdown)?, &m, li, &[(Target::Down, cfg.hidden_size)])?)?;
        }
        // Logits only for the rows asked for.
        let mut rows = Vec::new();
        let mut offset = 0u32;
        for c in chunks {
            offset += c.tokens.len() as u32;
            if c.want_logits && !c.tokens.is_empty() {
                rows.push(offset - 1);
            }
        }
        let mut out = vec![None; chunks.len()];
        if rows.is_empty() {
            return Ok(out);
        }
        let n_rows = rows.len();
        let last = x.index_select(&Tensor::from_vec(rows, n_rows, &dev)?, 0)?;
        let logits = candle_nn::ops::rms_norm(&last, &self.norm, self.eps)?.matmul(&self.lm_head)?;
        let mut it = logits.to_vec2::<f32>()?.into_iter();
        for (c, o) in chunks.iter().zip(out.iter_mut()) {
            if c.want_logits && !c.tokens.is_empty() {
                *o = it.next();
            }
        }
        Ok(out)
    }

    /// Attention of many single-token chunks at once: their K/V gathered into one padded batch, one batched
    /// matmul for scores and one for values, padding masked. Returns `[heads, B, hd]` in `decodes` order.
    fn attend_decodes(
        &self,
        kv: &KvStore,
        layer: usize,
        decodes: &[(usize, &SeqChunk<'_>)],
        q: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let cfg = &self.cfg;
        let (heads, kvh, hd, group) =
            (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.group_size());
        let kvd = kvh * hd;
        let b = decodes.len();
        let maxc = decodes.iter().map(|(_, c)| c.start + 1).max().unwrap_or(1);
        let mut kbuf = vec![0f32; b * maxc * kvd];
        let mut vbuf = vec![0f32; b * maxc * kvd];
        let mut mask = vec![0f32; b * maxc];
        for (i, (_, c)) in decodes.iter().enumerate() {
            let ctx = c.start + 1;
            let (k, v) = kv.gather(layer, &c.slots[..ctx]);
            kbuf[i * maxc * kvd..i * maxc * kvd + ctx * kvd].copy_from_slice(&k);
            vbuf[i * maxc * kvd..i * maxc * kvd + ctx * kvd].copy_from_slice(&v);
            for m in &mut mask[i * maxc + ctx..(i + 1) * maxc] {
                *m = f32::NEG_INFINITY;
            }
        }
        let dev = Device::Cpu;
        // [B, kv_heads, maxc, hd]
        let k = Tensor::from_vec(kbuf, (b, maxc, kvh, hd), &dev)?.transpose(1, 2)?.contiguous()?;
        let v = Tensor::from_vec(vbuf, (b, maxc, kvh, hd), &dev)?.transpose(1, 2)?.contiguous()?;
        let rows: Vec<u32> = decodes.iter().map(|(o, _)| *o as u32).collect();
        // q [1, heads, T, hd] -> the decode rows [heads, B, hd] -> [B, kv_heads, group, hd]
        let qd = q.squeeze(0)?.index_select(&Tensor::from_vec(rows, b, &dev)?, 1)?;
        let qd = qd.transpose(0, 1)?.contiguous()?.reshape((b, kvh, group, hd))?;
        let att = (qd.matmul(&k.transpose(2, 3)?)? / (hd as f64).sqrt())?; // [B, kvh, group, maxc]
        let att = att.broadcast_add(&Tensor::from_vec(mask, (b, 1, 1, maxc), &dev)?)?;
        let p = candle_nn::ops::softmax_last_dim(&att)?;
        let o = p.matmul(&v)?; // [B, kvh, group, hd]
        Ok(o.reshape((b, heads, hd))?.transpose(0, 1)?.contiguous()?)
    }

    /// Causal attention of one chunk's queries `[1, heads, n, hd]` over its sequence's K/V; returns `[heads, n, hd]`.
    fn attend(&self, kv: &KvStore, layer: usize, c: &SeqChunk<'_>, q: &Tensor) -> Result<Tensor, ModelError> {
        let cfg = &self.cfg;
        let (kvh, hd, group) = (cfg.num_key_value_heads, cfg.head_dim, cfg.group_size());
        let n = c.tokens.len();
        let ctx = c.start + n;
        let dev = Device::Cpu;
        let (k, v) = kv.gather(layer, &c.slots[..ctx]);
        // [kv_heads, ctx, hd]
        let k = Tensor::from_vec(k, (ctx, kvh, hd), &dev)?.transpose(0, 1)?.contiguous()?;
        let v = Tensor::from_vec(v, (ctx, kvh, hd), &dev)?.transpose(0, 1)?.contiguous()?;
        // Query heads h = kv_head * group + g, so [heads, n, hd] views as [kv_heads, group, n, hd].
        let q = q.squeeze(0)?.reshape((kvh, group, n, hd))?;
        let scale = (hd as f64).sqrt();
        let mut tiles = Vec::with_capacity(n.div_ceil(QUERY_TILE));
        let mut i0 = 0;
        while i0 < n {
            let len = QUERY_TILE.min(n - i0);
            let keys = c.start + i0 + len; // causal: this tile sees keys 0..keys
            let q_t = q.narrow(2, i0, len)?.contiguous()?.reshape((kvh, group * len, hd))?;
            let k_t = k.narrow(1, 0, keys)?;
            let att = (q_t.matmul(&k_t.t()?)? / scale)?;
            let att = if len > 1 {
                let mut mask = vec![0f32; len * keys];
                for i in 0..len {
                    let pos = c.start + i0 + i;
                    for m in &mut mask[i * keys + pos + 1..(i + 1) * keys] {
                        *m = f32::NEG_INFINITY;
                    }
                }
                let mask = Tensor::from_vec(mask, (1, 1, len, keys), &dev)?;
                att.reshape((kvh, group, len, keys))?.broadcast_add(&mask)?.reshape((
                    kvh,
                    group * len,
                    keys,
                ))?
            } else {
                att
            };
            let p = candle_nn::ops::softmax_last_dim(&att)?;
            let o = p.matmul(&v.narrow(1, 0, keys)?.contiguous()?)?; // [kvh, group*len, hd]
            tiles.push(o.reshape((kvh * group, len, hd))?);
            i0 += len;
        }
        Ok(if tiles.len() == 1 { tiles.remove(0) } else { Tensor::cat(&tiles, 1)? })
    }
}

/// Dtype the CPU engine computes in.
pub const COMPUTE_DTYPE: DType = DType::F32;
