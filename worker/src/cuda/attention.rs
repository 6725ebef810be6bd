//! Attention launches over the paged KV pool (kernels in `kernels/attention.cu`): split-K decode for one-token
//! chunks, and GEMM-based causal prefill (gathered K/V, cuBLAS scores, masked softmax, cuBLAS P.V) for longer
//! chunks, with or without a cached prefix. Shared by the forward pass and the self-test.

use super::gpu::{Gpu, GpuResult, Scratch};
use super::weights::ptr;
use super::DType;

/// Keys per split of the decode kernel.
pub const DECODE_PART: usize = 512;
/// Bytes of attention scores (f32) + probabilities of one prefill query tile.
pub const SCORE_BUDGET: usize = 1 << 30;
const DEC_THREADS: u32 = 256;

/// Head layout and pool geometry.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl Heads {
    fn g(&self) -> usize {
        self.heads / self.kv_heads
    }
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// Splits of the decode kernel for a longest context of `max_ctx`.
pub fn decode_splits(max_ctx: usize) -> usize {
    max_ctx.div_ceil(DECODE_PART).max(1)
}

/// Bytes of the decode kernel's partial results.
pub fn decode_part_bytes(h: Heads, seqs: usize, splits: usize) -> usize {
    seqs * h.heads * splits * (h.head_dim + 2) * 4
}

/// Decode attention of `seqs` one-token queries. `q`/`o`: `[rows, heads * hd]`; per sequence its row (`rows`,
/// i32), its context length (`ctx`, i32) and `max_blocks` block ids (`tables`, i32). `part`: scratch of
/// [`decode_part_bytes`].
#[allow(clippy::too_many_arguments)]
pub fn decode(
    gpu: &Gpu,
    dt: DType,
    h: Heads,
    q: u64,
    o: u64,
    kc: u64,
    vc: u64,
    rows: u64,
    ctx: u64,
    tables: u64,
    max_blocks: usize,
    seqs: usize,
    splits: usize,
    part: u64,
) -> GpuResult<()> {
    let sfx = dt.suffix();
    let (heads, kvh, hd, g) = (h.heads, h.kv_heads, h.head_dim, h.g());
    let pa = part;
    let pml = part + (seqs * heads * splits * hd * 4) as u64;
    let (mut qq, mut rw, mut k, mut v, mut bt) = (q, rows, kc, vc, tables);
    let (mut mb, mut cx, mut bs) = (max_blocks as i32, ctx, h.block_size as i32);
    let (mut h_, mut kh_, mut hd_, mut sc, mut pt, mut pa_, mut pml_) =
        (heads as i32, kvh as i32, hd as i32, h.scale(), DECODE_PART as i32, pa, pml);
    let smem = ((2 * g * hd + g * DECODE_PART) * 4) as u32;
    gpu.launch(
        &format!("paged_decode_{sfx}"),
        (seqs as u32, kvh as u32, splits as u32),
        (DEC_THREADS, 1, 1),
        smem,
        &mut [
            ptr(&mut qq),
            ptr(&mut rw),
            ptr(&mut k),
            ptr(&mut v),
            ptr(&mut bt),
            ptr(&mut mb),
            ptr(&mut cx),
            ptr(&mut bs),
            ptr(&mut h_),
            ptr(&mut kh_),
            ptr(&mut hd_),
            ptr(&mut sc),
            ptr(&mut pt),
            ptr(&mut pa_),
            ptr(&mut pml_),
        ],
    )?;
    let (mut oo, mut rw, mut pa_, mut pml_, mut h_, mut hd_, mut sp) =
        (o, rows, pa, pml, heads as i32, hd as i32, splits as i32);
    gpu.launch(
        &format!("decode_reduce_{sfx}"),
        (seqs as u32, heads as u32, 1),
        (128, 1, 1),
        0,
        &mut [
            ptr(&mut oo),
            ptr(&mut rw),
            ptr(&mut pa_),
            ptr(&mut pml_),
            ptr(&mut h_),
            ptr(&mut hd_),
            ptr(&mut sp),
        ],
    )
}

/// Scratch of the prefill path.
#[derive(Debug, Default)]
pub struct PrefillScratch {
    /// Bytes of scores + probabilities per query tile (0 = [`SCORE_BUDGET`]); tests make it small to force tiles.
    pub budget: usize,
    kbuf: Scratch,
    vbuf: Scratch,
    scores: Scratch,
    probs: Scratch,
}

/// Causal attention of one chunk: queries at rows `row0..row0 + len` of `q` (positions `start..start + len`) over
/// the sequence's first `start + len` positions, whose block ids are at `table` (i32). Writes rows of `o`.
#[allow(clippy::too_many_arguments)]
pub fn prefill(
    gpu: &Gpu,
    dt: DType,
    h: Heads,
    q: u64,
    o: u64,
    kc: u64,
    vc: u64,
    table: u64,
    row0: usize,
    start: usize,
    len_all: usize,
    s: &mut PrefillScratch,
) -> GpuResult<()> {
    let sfx = dt.suffix();
    let es = dt.size();
    let (heads, kvh, hd, g) = (h.heads, h.kv_heads, h.head_dim, h.g());
    let qd = heads * hd;
    let ctx = start + len_all;
    let kbuf = s.kbuf.get(gpu, ctx * kvh * hd * es)?;
    let vbuf = s.vbuf.get(gpu, ctx * kvh * hd * es)?;
    {
        let (mut ko, mut vo, mut k, mut v) = (kbuf, vbuf, kc, vc);
        let (mut t, mut bs, mut kh_, mut hd_, mut cx) =
            (table, h.block_size as i32, kvh as i32, hd as i32, ctx as i32);
        gpu.launch(
            &format!("gather_kv_{sfx}"),
            (ctx as u32, kvh as u32, 1),
            (64, 1, 1),
            0,
            &mut [
                ptr(&mut ko),
                ptr(&mut vo),
                ptr(&mut k),
                ptr(&mut v),
                ptr(&mut t),
                ptr(&mut bs),
                ptr(&mut kh_),
                ptr(&mut hd_),
                ptr(&mut cx),
            ],
        )?;
    }
    let budget = if s.budget == 0 { SCORE_BUDGET } else { s.budget };
    let tile = (budget / (heads * ctx * (4 + es))).clamp(1, len_all);
    let scores = s.scores.get(gpu, heads * tile * ctx * 4)?;
    let probs = s.probs.get(gpu, heads * tile * ctx * es)?;
    let mut i0 = 0;
    while i0 < len_all {
        let len = tile.min(len_all - i0);
        let keys = start + i0 + len;
        let qrow = row0 + i0;
        for gi in 0..g {
            gpu.gemm_batched(
                dt,
                DType::F32,
                true,
                keys,
                len,
                hd,
                h.scale(),
                (kbuf, hd, ctx * hd),
                (q + ((qrow * qd + gi * hd) * es) as u64, qd, g * hd),
                0.0,
                (scores + (gi * len * keys * 4) as u64, keys, g * len * keys),
                kvh,
            )?;
        }
        let (mut p, mut sc, mut l, mut k, mut fp) =
            (probs, scores, len as i32, keys as i32, (start + i0) as i32);
        gpu.launch(
            &format!("causal_softmax_{sfx}"),
            ((heads * len) as u32, 1, 1),
            (256, 1, 1),
            0,
            &mut [ptr(&mut p), ptr(&mut sc), ptr(&mut l), ptr(&mut k), ptr(&mut fp)],
        )?;
        for gi in 0..g {
            gpu.gemm_batched(
                dt,
                dt,
                false,
                hd,
                len,
                keys,
                1.0,
                (vbuf, hd, ctx * hd),
                (probs + ((gi * len * keys) * es) as u64, keys, g * len * keys),
                0.0,
                (o + ((qrow * qd + gi * hd) * es) as u64, qd, g * hd),
                kvh,
            )?;
        }
        i0 += len;
    }
    Ok(())
}
