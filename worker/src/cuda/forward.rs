//! The Llama-family forward pass (Llama 2/3.x, Mistral, Qwen2) on the GPU, over the paged KV pool in device memory,
//! for a batch of sequence chunks at once. Same math and rounding points as the CPU engine / HF eager attention:
//!
//! ```text
//! x = embed(ids)                                   per layer l:
//! xn = rmsnorm(x, in_norm[l])                      qkv = xn Wqkv^T (+ b);  q, k = rope(q, k);  K/V -> pool[slot]
//! o = attention(q, pool)                           x += o Wo^T;  xn = rmsnorm(x, post_norm[l])
//! x += (silu(xn Wg^T) * xn Wu^T) Wd^T;  xn = rmsnorm(x, next norm)
//! logits = xn[last rows] Wlm^T  (f32)              greedy rows: argmax on the device
//! ```
//! Decode chunks (one token) share one split-K paged attention launch; prefill chunks (with or without a cached
//! prefix) run as cuBLAS GEMMs over their gathered K/V, in query tiles bounded by [`SCORE_BUDGET`].

use super::attention::{self, Heads, PrefillScratch, SCORE_BUDGET};
use super::gpu::{DevBuf, Gpu, GpuError, GpuResult, Scratch};
use super::lora::{GpuAdapter, Site};
use super::weights::{ptr, GpuWeights};
use super::DType;
use crate::model::ModelConfig;

/// K and V memory of every layer on the device: `[slots, kv_heads * head_dim]` each.
#[derive(Debug)]
pub struct GpuKv {
    pub k: Vec<DevBuf>,
    pub v: Vec<DevBuf>,
    pub num_slots: usize,
}

impl GpuKv {
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, dt: DType, num_slots: usize) -> GpuResult<Self> {
        let bytes = num_slots * cfg.kv_dim() * dt.size();
        let mut k = Vec::with_capacity(cfg.num_hidden_layers);
        let mut v = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            k.push(gpu.zeros(bytes)?);
            v.push(gpu.zeros(bytes)?);
        }
        Ok(Self { k, v, num_slots })
    }

    /// Bytes of one slot's K (or V) row in one layer.
    fn row_bytes(&self) -> usize {
        self.k.first().map_or(0, |b| b.bytes() / self.num_slots.max(1))
    }

    /// Where slots `first..first + n` are: every layer's K, then its V (the layout of a lower-tier block).
    fn ranges(&self, first: usize, n: usize) -> GpuResult<Vec<(&DevBuf, usize)>> {
        if first + n > self.num_slots {
            return Err(format!("slots {first}..{} past {}", first + n, self.num_slots).into());
        }
        let off = first * self.row_bytes();
        Ok(self.k.iter().zip(&self.v).flat_map(|(k, v)| [(k, off), (v, off)]).collect())
    }

    /// The K/V bytes of slots `first..first + n` (what [`GpuKv::write_slots`] takes back).
    pub fn read_slots(&self, gpu: &Gpu, first: usize, n: usize) -> GpuResult<Vec<u8>> {
        gpu.read_ranges(&self.ranges(first, n)?, n * self.row_bytes())
    }

    /// Writes what [`GpuKv::read_slots`] returned into slots `first..first + n`.
    pub fn write_slots(&self, gpu: &Gpu, first: usize, n: usize, bytes: &[u8]) -> GpuResult<()> {
        gpu.write_ranges(&self.ranges(first, n)?, n * self.row_bytes(), bytes)
    }

    /// Bytes of K and V per token over all layers.
    pub fn bytes_per_token(cfg: &ModelConfig, dt: DType) -> usize {
        2 * cfg.num_hidden_layers * cfg.kv_dim() * dt.size()
    }
}

/// One sequence's part of a batch (positions `start..start + tokens.len()`).
#[derive(Clone, Debug)]
pub struct GpuChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    /// Slot of every position `0..start + tokens.len()`.
    pub slots: &'a [usize],
    pub want: Want,
    /// The LoRA adapter its sequence runs with (in device memory); `None`: the base model.
    pub adapter: Option<&'a GpuAdapter>,
}

/// What a chunk wants back for its last token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    Nothing,
    Logits,
    /// The arg-max token (greedy sampling on the device).
    Argmax,
}

/// What a chunk got.
#[derive(Clone, Debug, PartialEq)]
pub enum Out {
    Logits(Vec<f32>),
    Token(u32),
}

/// Scratch memory of the forward pass (grow-only).
#[derive(Debug, Default)]
pub struct Workspace {
    meta: Scratch,
    x: Scratch,
    xn: Scratch,
    qkv: Scratch,
    q: Scratch,
    o: Scratch,
    y: Scratch,
    gu: Scratch,
    act: Scratch,
    part: Scratch,
    /// Decode attention on the tensor-core kernel (checked against the CPU reference at start).
    decode_tc: bool,
    prefill: PrefillScratch,
    logits: Scratch,
    /// LoRA's `x . A^T` rows (`lora::GpuAdapter::apply`).
    lora_low: Scratch,
}

impl Workspace {
    pub fn set_flash(&mut self, on: bool) {
        self.prefill.flash = on;
    }
    pub fn flash(&self) -> bool {
        self.prefill.flash
    }
    pub fn set_decode_tc(&mut self, on: bool) {
        self.decode_tc = on;
    }
    pub fn decode_tc(&self) -> bool {
        self.decode_tc
    }
}

/// Bytes of activation scratch for `tokens` tokens per step and `rows` logits rows (for KV sizing).
pub fn workspace_bytes(cfg: &ModelConfig, dt: DType, tokens: usize, rows: usize, max_ctx: usize) -> usize {
    let (h, qd, kvd, i) =
        (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.kv_dim(), cfg.intermediate_size);
    let act = tokens * (3 * h + (qd + 2 * kvd) + 4 * qd + 3 * i) * dt.size();
    let kv = 2 * max_ctx * kvd * dt.size();
    act + kv + SCORE_BUDGET + rows * cfg.vocab_size * 4 + (256 << 20)
}

/// Metadata of one decode launch.
struct Decodes {
    rows: Vec<i32>,
    ctx: Vec<i32>,
    tables: Vec<i32>,
    max_blocks: usize,
}

/// Runs one batch.
pub fn forward(
    gpu: &Gpu,
    cfg: &ModelConfig,
    w: &GpuWeights,
    kv: &GpuKv,
    ws: &mut Workspace,
    block_size: usize,
    chunks: &[GpuChunk<'_>],
) -> GpuResult<Vec<Option<Out>>> {
    gpu.bind()?;
    let dt = w.dt;
    let es = dt.size();
    let sfx = dt.suffix();
    let (heads, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let (hidden, inter, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (qd, kvd) = (heads * hd, kvh * hd);
    let qkvd = qd + 2 * kvd;

    // Host-side metadata; the same checks as the CPU engine.
    let mut ids: Vec<u32> = Vec::new();
    let mut pos: Vec<i32> = Vec::new();
    let mut wslots: Vec<i64> = Vec::new();
    let mut dec = Decodes { rows: Vec::new(), ctx: Vec::new(), tables: Vec::new(), max_blocks: 0 };
    let mut dec_items: Vec<(usize, &GpuChunk<'_>)> = Vec::new();
    let mut prefills: Vec<(usize, &GpuChunk<'_>)> = Vec::new();
    let mut offset = 0;
    for c in chunks {
        let end = c.start + c.tokens.len();
        if c.slots.len() < end || end > cfg.max_position_embeddings {
            return Err(format!("chunk needs {end} positions, has {} slots", c.slots.len()).into());
        }
        if let Some(t) = c.tokens.iter().find(|t| **t as usize >= vocab) {
            return Err(format!("token id {t} is outside the vocabulary ({vocab})").into());
        }
        if c.slots[..end].iter().any(|s| *s >= kv.num_slots) {
            return Err("slot outside the KV store".into());
        }
        ids.extend_from_slice(c.tokens);
        pos.extend((c.start..end).map(|p| p as i32));
        wslots.extend(c.slots[c.start..end].iter().map(|s| *s as i64));
        match c.tokens.len() {
            0 => {}
            1 => dec_items.push((offset, c)),
            _ => prefills.push((offset, c)),
        }
        offset += c.tokens.len();
    }
    let n = ids.len();
    let mut out = vec![None; chunks.len()];
    if n == 0 {
        return Ok(out);
    }
    dec.max_blocks = dec_items.iter().map(|(_, c)| (c.start + 1).div_ceil(block_size)).max().unwrap_or(0);
    for (row, c) in &dec_items {
        dec.rows.push(*row as i32);
        dec.ctx.push((c.start + 1) as i32);
        let nb = (c.start + 1).div_ceil(block_size);
        dec.tables.extend((0..dec.max_blocks).map(|b| {
            if b < nb {
                (c.slots[b * block_size] / block_size) as i32
            } else {
                0
            }
        }));
    }

    // Prefill block tables.
    let mut pf_tables: Vec<i32> = Vec::new();
    let mut pf_table_at = Vec::new();
    for (_, c) in &prefills {
        let ctx = c.start + c.tokens.len();
        pf_table_at.push(pf_tables.len());
        pf_tables
            .extend((0..ctx.div_ceil(block_size)).map(|b| (c.slots[b * block_size] / block_size) as i32));
    }

    // Metadata in one buffer: ids | pos | wslots | decode rows | decode ctx | decode tables | prefill tables.
    let mut meta: Vec<u8> = Vec::new();
    let mut put = |bytes: &[u8]| -> usize {
        let at = meta.len().next_multiple_of(16);
        meta.resize(at, 0);
        meta.extend_from_slice(bytes);
        at
    };
    let o_ids = put(as_bytes(&ids));
    let o_pos = put(as_bytes(&pos));
    let o_slots = put(as_bytes(&wslots));
    let o_drows = put(as_bytes(&dec.rows));
    let o_dctx = put(as_bytes(&dec.ctx));
    let o_dtab = put(as_bytes(&dec.tables));
    let o_ptab = put(as_bytes(&pf_tables));
    let meta_ptr = ws.meta.get(gpu, meta.len())?;
    upload_raw(gpu, meta_ptr, &meta)?;
    let m = |o: usize| meta_ptr + o as u64;
    let pf_meta = m(o_ptab);

    let x = ws.x.get(gpu, n * hidden * es)?;
    let xn = ws.xn.get(gpu, n * hidden * es)?;
    let qkv = ws.qkv.get(gpu, n * qkvd * es)?;
    let q = ws.q.get(gpu, n * qd * es)?;
    let o = ws.o.get(gpu, n * qd * es)?;
    let y = ws.y.get(gpu, n * hidden * es)?;
    let gu = ws.gu.get(gpu, n * 2 * inter * es)?;
    let act = ws.act.get(gpu, n * inter * es)?;
    let eps = cfg.rms_norm_eps as f32;
    let lora = AdapterRuns::of(gpu, dt, chunks, n, &mut ws.lora_low)?;

    // embed + first norm
    let (mut a0, mut a1, mut a2, mut hid) = (x, w.embed.ptr(), m(o_ids), hidden as i32);
    gpu.launch(
        &format!("embed_{sfx}"),
        (n as u32, 1, 1),
        (256, 1, 1),
        0,
        &mut [ptr(&mut a0), ptr(&mut a1), ptr(&mut a2), ptr(&mut hid)],
    )?;
    rmsnorm(gpu, sfx, xn, x, w.layers[0].input_norm.ptr(), n, hidden, eps)?;

    let max_dec_ctx = dec.ctx.iter().map(|c| *c as usize).max().unwrap_or(1);
    let splits = attention::decode_splits(max_dec_ctx);
    let heads_ = Heads { heads, kv_heads: kvh, head_dim: hd, block_size };
    let part = match dec_items.is_empty() {
        true => 0,
        false => ws.part.get(gpu, attention::decode_part_bytes(heads_, dec_items.len(), splits))?,
    };

    for (li, layer) in w.layers.iter().enumerate() {
        gpu.linear(dt, dt, qkv, qkvd, xn, hidden, layer.wqkv.ptr(), n, qkvd, hidden)?;
        lora.apply(gpu, dt, li, Site::Qkv, (xn, hidden), (qkv, qkvd))?;
        {
            let (mut a, mut b, mut qq, mut kc, mut vc) =
                (qkv, layer.bqkv.as_ref().map_or(0, |b| b.ptr()), q, kv.k[li].ptr(), kv.v[li].ptr());
            let (mut p, mut s, mut f) = (m(o_pos), m(o_slots), w.inv_freq.ptr());
            let (mut h_, mut kh_, mut hd_) = (heads as i32, kvh as i32, hd as i32);
            gpu.launch(
                &format!("qkv_rope_store_{sfx}"),
                (n as u32, (heads + 2 * kvh) as u32, 1),
                (((hd / 2) as u32).max(1), 1, 1),
                0,
                &mut [
                    ptr(&mut a),
                    ptr(&mut b),
                    ptr(&mut qq),
                    ptr(&mut kc),
                    ptr(&mut vc),
                    ptr(&mut p),
                    ptr(&mut s),
                    ptr(&mut f),
                    ptr(&mut h_),
                    ptr(&mut kh_),
                    ptr(&mut hd_),
                ],
            )?;
        }
        let layer_ops = attention::Layer { q, o, kc: kv.k[li].ptr(), vc: kv.v[li].ptr() };
        if !dec_items.is_empty() {
            let d = attention::DecodeBatch {
                rows: m(o_drows),
                ctx: m(o_dctx),
                tables: m(o_dtab),
                max_blocks: dec.max_blocks,
                seqs: dec_items.len(),
                max_ctx: max_dec_ctx,
            };
            attention::decode(gpu, dt, heads_, layer_ops, d, part, ws.decode_tc)?;
        }
        for (pi, (row0, c)) in prefills.iter().enumerate() {
            let table = pf_meta + (pf_table_at[pi] * 4) as u64;
            attention::prefill(
                gpu,
                dt,
                heads_,
                layer_ops,
                table,
                *row0,
                c.start,
                c.tokens.len(),
                &mut ws.prefill,
            )?;
        }
        gpu.linear(dt, dt, y, hidden, o, qd, layer.wo.ptr(), n, hidden, qd)?;
        lora.apply(gpu, dt, li, Site::O, (o, qd), (y, hidden))?;
        add_rmsnorm(gpu, sfx, x, y, xn, layer.post_norm.ptr(), n, hidden, eps)?;
        gpu.linear(dt, dt, gu, 2 * inter, xn, hidden, layer.wgate_up.ptr(), n, 2 * inter, hidden)?;
        lora.apply(gpu, dt, li, Site::GateUp, (xn, hidden), (gu, 2 * inter))?;
        {
            let (mut a, mut b, mut i_) = (act, gu, inter as i32);
            gpu.launch(
                &format!("silu_mul_{sfx}"),
                (n as u32, inter.div_ceil(256) as u32, 1),
                (256, 1, 1),
                0,
                &mut [ptr(&mut a), ptr(&mut b), ptr(&mut i_)],
            )?;
        }
        gpu.linear(dt, dt, y, hidden, act, inter, layer.wdown.ptr(), n, hidden, inter)?;
        lora.apply(gpu, dt, li, Site::Down, (act, inter), (y, hidden))?;
        let next_norm = w.layers.get(li + 1).map_or(w.norm.ptr(), |l| l.input_norm.ptr());
        add_rmsnorm(gpu, sfx, x, y, xn, next_norm, n, hidden, eps)?;
    }

    // Logits of the rows asked for.
    let mut rows: Vec<i32> = Vec::new();
    let mut which = Vec::new();
    let mut off = 0;
    for (ci, c) in chunks.iter().enumerate() {
        off += c.tokens.len();
        if c.want != Want::Nothing && !c.tokens.is_empty() {
            rows.push((off - 1) as i32);
            which.push(ci);
        }
    }
    if rows.is_empty() {
        // A step is done when forward returns (the engine times and accounts steps).
        gpu.sync()?;
        return Ok(out);
    }
    let r = rows.len();
    let last_at = (r * vocab * 4).next_multiple_of(256);
    let rows_at = (last_at + r * hidden * es).next_multiple_of(256);
    let logits = ws.logits.get(gpu, rows_at + r * 4 + 256)?;
    let last = logits + last_at as u64;
    let rows_ptr = logits + rows_at as u64;
    upload_raw(gpu, rows_ptr, as_bytes(&rows))?;
    {
        let (mut a, mut b, mut c, mut h_) = (last, xn, rows_ptr, hidden as i32);
        gpu.launch(
            &format!("gather_rows_{sfx}"),
            (r as u32, 1, 1),
            (256, 1, 1),
            0,
            &mut [ptr(&mut a), ptr(&mut b), ptr(&mut c), ptr(&mut h_)],
        )?;
    }
    gpu.linear(dt, DType::F32, logits, vocab, last, hidden, w.lm_head_ptr(), r, vocab, hidden)?;
    let argmax_rows = rows_ptr; // reuse: tokens overwrite the row indices after the gather
    if which.iter().any(|ci| chunks[*ci].want == Want::Argmax) {
        let (mut a, mut b, mut v) = (argmax_rows, logits, vocab as i32);
        gpu.launch(
            "argmax_rows",
            (r as u32, 1, 1),
            (1024, 1, 1),
            0,
            &mut [ptr(&mut a), ptr(&mut b), ptr(&mut v)],
        )?;
        let mut toks = vec![0u32; r];
        download_raw(gpu, &mut toks, argmax_rows)?;
        for (k, ci) in which.iter().enumerate() {
            if chunks[*ci].want == Want::Argmax {
                out[*ci] = Some(Out::Token(toks[k]));
            }
        }
    }
    for (k, ci) in which.iter().enumerate() {
        if chunks[*ci].want == Want::Logits {
            let mut l = vec![0f32; vocab];
            download_raw(gpu, &mut l, logits + (k * vocab * 4) as u64)?;
            out[*ci] = Some(Out::Logits(l));
        }
    }
    gpu.sync()?;
    Ok(out)
}

/// The batch's rows that run with adapters, as runs of one adapter, and the scratch their updates use.
struct AdapterRuns<'a> {
    adapters: Vec<&'a GpuAdapter>,
    runs: Vec<super::lora::Run>,
    low: u64,
}

impl<'a> AdapterRuns<'a> {
    fn of(gpu: &Gpu, dt: DType, chunks: &[GpuChunk<'a>], n: usize, scratch: &mut Scratch) -> GpuResult<Self> {
        let mut adapters: Vec<&'a GpuAdapter> = Vec::new();
        let which: Vec<Option<usize>> = chunks
            .iter()
            .map(|c| {
                c.adapter.map(|a| match adapters.iter().position(|b| std::ptr::eq(*b, a)) {
                    Some(i) => i,
                    None => {
                        adapters.push(a);
                        adapters.len() - 1
                    }
                })
            })
            .collect();
        let lens: Vec<usize> = chunks.iter().map(|c| c.tokens.len()).collect();
        let runs = super::lora::runs(&lens, &which);
        let widest = adapters.iter().map(|a| a.max_rows).max().unwrap_or(0);
        let low = match runs.is_empty() {
            true => 0,
            false => scratch.get(gpu, n * widest * dt.size())?,
        };
        Ok(Self { adapters, runs, low })
    }

    /// Every run's adapter update of `site` in `layer`: `y` rows `+=` the update of the same rows of `x`.
    fn apply(
        &self,
        gpu: &Gpu,
        dt: DType,
        layer: usize,
        site: Site,
        x: (u64, usize),
        y: (u64, usize),
    ) -> GpuResult<()> {
        for &(row0, m, a) in &self.runs {
            self.adapters[a].apply(gpu, dt, layer, site, x, y, (row0, m), self.low)?;
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn rmsnorm(
    gpu: &Gpu,
    sfx: &str,
    out: u64,
    x: u64,
    w: u64,
    n: usize,
    hidden: usize,
    eps: f32,
) -> GpuResult<()> {
    let (mut a, mut b, mut c, mut h, mut e) = (out, x, w, hidden as i32, eps);
    gpu.launch(
        &format!("rmsnorm_{sfx}"),
        (n as u32, 1, 1),
        (256, 1, 1),
        0,
        &mut [ptr(&mut a), ptr(&mut b), ptr(&mut c), ptr(&mut h), ptr(&mut e)],
    )
}

#[allow(clippy::too_many_arguments)]
fn add_rmsnorm(
    gpu: &Gpu,
    sfx: &str,
    x: u64,
    y: u64,
    out: u64,
    w: u64,
    n: usize,
    hidden: usize,
    eps: f32,
) -> GpuResult<()> {
    let (mut a, mut b, mut c, mut d, mut h, mut e) = (x, y, out, w, hidden as i32, eps);
    gpu.launch(
        &format!("add_rmsnorm_{sfx}"),
        (n as u32, 1, 1),
        (256, 1, 1),
        0,
        &mut [ptr(&mut a), ptr(&mut b), ptr(&mut c), ptr(&mut d), ptr(&mut h), ptr(&mut e)],
    )
}

/// The bytes of a slice of plain numbers.
pub fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: T is a plain number type (u32/i32/i64/f32) with no padding; the view covers exactly its memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Host bytes to a device address inside a live buffer.
pub fn upload_raw(gpu: &Gpu, dst: u64, bytes: &[u8]) -> GpuResult<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    gpu.sync()?;
    // SAFETY: callers give an address inside a scratch buffer sized for `bytes`.
    unsafe { cudarc::driver::result::memcpy_htod_sync(dst, bytes) }
        .map_err(|e| GpuError::Call { what: "upload".into(), error: format!("{e:?}") })
}

/// Device memory at `src` into `out` (waits for the stream).
pub fn download_raw<T: Copy>(gpu: &Gpu, out: &mut [T], src: u64) -> GpuResult<()> {
    gpu.sync()?;
    // SAFETY: callers give an address inside a live buffer holding out.len() elements.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(out, src) }
        .map_err(|e| GpuError::Call { what: "download".into(), error: format!("{e:?}") })
}
