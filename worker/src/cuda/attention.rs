//! Attention launches over the paged KV pool (kernels in `kernels/attention.cu`): split-K decode for one-token
//! chunks, and GEMM-based causal prefill for longer chunks, with or without a cached prefix: K/V gathered, the
//! queries of each KV head's group stacked so that one batched GEMM per tile computes every head's scores (in the
//! storage type, as eager attention does), masked softmax in place, one batched GEMM for P.V, rows scattered back.
//! Shared by the forward pass and the self-test.

use super::gpu::{Gpu, GpuResult, Scratch};
use super::weights::ptr;
use super::DType;

/// Keys per split of the decode kernel.
pub const DECODE_PART: usize = 512;
/// Bytes of attention scores of one prefill query tile (probabilities overwrite them).
pub const SCORE_BUDGET: usize = 2 << 30;
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

/// Most splits the merge kernel takes (`DEC_MAX_SPLITS`).
const MAX_SPLITS: usize = 1024;

/// Keys per split for a longest context of `max_ctx`: [`DECODE_PART`], larger past 1024 splits.
pub fn decode_part(max_ctx: usize) -> usize {
    DECODE_PART.max(max_ctx.div_ceil(MAX_SPLITS).next_multiple_of(32))
}

/// Splits of the decode kernel for a longest context of `max_ctx`.
pub fn decode_splits(max_ctx: usize) -> usize {
    max_ctx.div_ceil(decode_part(max_ctx)).max(1)
}

/// Dynamic shared memory the kernels may use (opted in at start): flash tiles, decode scores of long splits.
pub const MAX_DYNAMIC_SMEM: usize = 96 << 10;

/// Bytes of the decode kernel's partial results.
pub fn decode_part_bytes(h: Heads, seqs: usize, splits: usize) -> usize {
    seqs * h.heads * splits * (h.head_dim + 2) * 4
}

/// One layer's attention operands: queries and output `[rows, heads * head_dim]`, and the layer's K and V pool.
#[derive(Clone, Copy, Debug)]
pub struct Layer {
    pub q: u64,
    pub o: u64,
    pub kc: u64,
    pub vc: u64,
}

/// A decode launch's sequences: per sequence its row of q/o (`rows`, i32), its context length (`ctx`, i32; the
/// longest is `max_ctx`) and `max_blocks` block ids (`tables`, i32).
#[derive(Clone, Copy, Debug)]
pub struct DecodeBatch {
    pub rows: u64,
    pub ctx: u64,
    pub tables: u64,
    pub max_blocks: usize,
    pub seqs: usize,
    pub max_ctx: usize,
}

/// Decode attention of one-token queries. `part`: scratch of [`decode_part_bytes`] for
/// [`decode_splits`]`(max_ctx)`. `tensor_cores`: the mma kernel where [`flash_supported`], else the SIMT one.
pub fn decode(
    gpu: &Gpu,
    dt: DType,
    h: Heads,
    l: Layer,
    d: DecodeBatch,
    part: u64,
    tensor_cores: bool,
) -> GpuResult<()> {
    let (keys_per_split, splits) = (decode_part(d.max_ctx), decode_splits(d.max_ctx));
    let sfx = dt.suffix();
    let (heads, kvh, hd, g) = (h.heads, h.kv_heads, h.head_dim, h.g());
    let seqs = d.seqs;
    let pa = part;
    let pml = part + (seqs * heads * splits * hd * 4) as u64;
    let (mut qq, mut rw, mut k, mut v, mut bt) = (l.q, d.rows, l.kc, l.vc, d.tables);
    let (mut mb, mut cx, mut bs) = (d.max_blocks as i32, d.ctx, h.block_size as i32);
    let (mut h_, mut kh_, mut hd_, mut sc, mut pt, mut pa_, mut pml_) =
        (heads as i32, kvh as i32, hd as i32, h.scale(), keys_per_split as i32, pa, pml);
    let tc = tensor_cores && flash_supported(dt, hd);
    // The mma kernel takes the same arguments less head_dim (a template parameter there).
    let (name, threads, smem) = match tc {
        true => (format!("flash_decode_{sfx}_hd{hd}"), 128, (keys_per_split + 4 * 8 * (hd + 2)) * 4),
        false => (format!("paged_decode_{sfx}_g{g}"), DEC_THREADS, (g + 1) * keys_per_split * 4),
    };
    let mut args = vec![
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
    ];
    if !tc {
        args.push(ptr(&mut hd_));
    }
    args.extend([ptr(&mut sc), ptr(&mut pt), ptr(&mut pa_), ptr(&mut pml_)]);
    gpu.launch(&name, (seqs as u32, kvh as u32, splits as u32), (threads, 1, 1), smem as u32, &mut args)?;
    let (mut oo, mut rw, mut pa_, mut pml_, mut h_, mut hd_, mut sp) =
        (l.o, d.rows, pa, pml, heads as i32, hd as i32, splits as i32);
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
    /// Bytes of scores per query tile (0 = [`SCORE_BUDGET`]); tests make it small to force tiles.
    pub budget: usize,
    /// Use the tensor-core flash kernel (bf16/f16, head_dim 64 or 128) instead of the GEMM path; the backend
    /// turns it on once [`flash_agrees`] on this device.
    pub flash: bool,
    kbuf: Scratch,
    vbuf: Scratch,
    scores: Scratch,
    qs: Scratch,
    os: Scratch,
}

/// Causal attention of one chunk: queries at rows `row0..row0 + len` of `q` (positions `start..start + len`) over
/// the sequence's first `start + len` positions, whose block ids are at `table` (i32). Writes rows of `o`.
#[allow(clippy::too_many_arguments)]
pub fn prefill(
    gpu: &Gpu,
    dt: DType,
    h: Heads,
    l: Layer,
    table: u64,
    row0: usize,
    start: usize,
    len_all: usize,
    s: &mut PrefillScratch,
) -> GpuResult<()> {
    let sfx = dt.suffix();
    let es = dt.size();
    let (heads, kvh, hd, g) = (h.heads, h.kv_heads, h.head_dim, h.g());
    let Layer { q, o, kc, vc } = l;
    if s.flash && flash_supported(dt, hd) {
        let (mut a, mut b, mut k, mut v, mut t) = (q, o, kc, vc, table);
        let (mut bs, mut h_, mut kh_, mut r0, mut st, mut l, mut sc) = (
            h.block_size as i32,
            heads as i32,
            kvh as i32,
            row0 as i32,
            start as i32,
            len_all as i32,
            h.scale(),
        );
        return gpu.launch(
            &format!("flash_prefill_{sfx}_hd{hd}"),
            (len_all.div_ceil(FLASH_BQ) as u32, heads as u32, 1),
            (FLASH_THREADS, 1, 1),
            flash_smem(hd, es) as u32,
            &mut [
                ptr(&mut a),
                ptr(&mut b),
                ptr(&mut k),
                ptr(&mut v),
                ptr(&mut t),
                ptr(&mut bs),
                ptr(&mut h_),
                ptr(&mut kh_),
                ptr(&mut r0),
                ptr(&mut st),
                ptr(&mut l),
                ptr(&mut sc),
            ],
        );
    }
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
    let tile = (budget / (heads * ctx * es)).clamp(1, len_all);
    let scores = s.scores.get(gpu, heads * tile * ctx * es)?;
    let qs = s.qs.get(gpu, tile * qd * es)?;
    let os = s.os.get(gpu, tile * qd * es)?;
    let mut i0 = 0;
    while i0 < len_all {
        let len = tile.min(len_all - i0);
        let keys = start + i0 + len;
        let rows = g * len; // stacked query rows per KV head: (gi, i)
        let (mut a, mut b, mut r0, mut l, mut h_, mut kh_, mut hd_) =
            (qs, q, (row0 + i0) as i32, len as i32, heads as i32, kvh as i32, hd as i32);
        let mut args =
            [ptr(&mut a), ptr(&mut b), ptr(&mut r0), ptr(&mut l), ptr(&mut h_), ptr(&mut kh_), ptr(&mut hd_)];
        gpu.launch(
            &format!("q_stack_{sfx}"),
            (len as u32, heads as u32, 1),
            (hd as u32, 1, 1),
            0,
            &mut args,
        )?;
        // scores[kh][(gi, i)][key] = scale * q . k, in T (as eager attention).
        gpu.gemm_batched(
            dt,
            dt,
            true,
            keys,
            rows,
            hd,
            h.scale(),
            (kbuf, hd, ctx * hd),
            (qs, hd, rows * hd),
            0.0,
            (scores, keys, rows * keys),
            kvh,
        )?;
        let (mut p, mut sc, mut l, mut k, mut fp) =
            (scores, scores, len as i32, keys as i32, (start + i0) as i32);
        gpu.launch(
            &format!("causal_softmax_{sfx}"),
            ((heads * len) as u32, 1, 1),
            (256, 1, 1),
            0,
            &mut [ptr(&mut p), ptr(&mut sc), ptr(&mut l), ptr(&mut k), ptr(&mut fp)],
        )?;
        // os[kh][(gi, i)][d] = P . V
        gpu.gemm_batched(
            dt,
            dt,
            false,
            hd,
            rows,
            keys,
            1.0,
            (vbuf, hd, ctx * hd),
            (scores, keys, rows * keys),
            0.0,
            (os, hd, rows * hd),
            kvh,
        )?;
        let (mut a, mut b, mut r0, mut l, mut h_, mut kh_, mut hd_) =
            (o, os, (row0 + i0) as i32, len as i32, heads as i32, kvh as i32, hd as i32);
        let mut args =
            [ptr(&mut a), ptr(&mut b), ptr(&mut r0), ptr(&mut l), ptr(&mut h_), ptr(&mut kh_), ptr(&mut hd_)];
        gpu.launch(
            &format!("o_scatter_{sfx}"),
            (len as u32, heads as u32, 1),
            (hd as u32, 1, 1),
            0,
            &mut args,
        )?;
        i0 += len;
    }
    Ok(())
}

/// Queries per block of the flash kernel (`FA_BQ` in flash.cu), its threads and its dynamic shared memory.
const FLASH_BQ: usize = 128;
const FLASH_THREADS: u32 = 256;
fn flash_smem(head_dim: usize, es: usize) -> usize {
    4 * 64 * (head_dim + 8) * es
}

/// Whether the flash kernels (prefill and tensor-core decode) exist for this dtype and head size.
pub fn flash_supported(dt: DType, head_dim: usize) -> bool {
    dt != DType::F32 && (head_dim == 64 || head_dim == 128)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_splits_stay_within_the_merge_kernel() {
        assert_eq!((decode_part(1), decode_splits(1)), (512, 1));
        assert_eq!((decode_part(2048), decode_splits(2048)), (512, 4));
        assert_eq!(decode_splits(512 * 1024), 1024);
        let long = 3 << 20;
        assert!(decode_splits(long) <= MAX_SPLITS && decode_part(long) * decode_splits(long) >= long);
        // The largest split's scores and slots fit the opted-in shared memory for 8 query heads per KV head.
        assert!(9 * decode_part(2 << 20) * 4 <= MAX_DYNAMIC_SMEM);
        assert!(flash_smem(128, 2) <= MAX_DYNAMIC_SMEM);
    }
}
