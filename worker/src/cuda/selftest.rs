//! `kvgate-worker gpu-selftest`: every kernel (and the cuBLAS GEMM shapes) against a CPU reference of the same math
//! on random inputs, in f32 and bf16. Inputs are rounded to the storage type first and the reference reads the
//! rounded values, so the error measured is the kernel's own. Tolerances: f32 1e-4, bf16 2e-2, both relative to
//! the reference's largest magnitude.

use super::attention::{self, Heads, PrefillScratch};
use super::forward::download_raw;
use super::gpu::{DevBuf, Gpu, GpuResult};
use super::weights::{download_f32, ptr, upload_as};
use super::DType;

/// One case's outcome.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Case {
    pub kernel: String,
    pub dtype: String,
    pub shape: String,
    pub max_abs_err: f64,
    pub rel_err: f64,
    pub tolerance: f64,
    pub pass: bool,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 40) as f32 / 16_777_216.0) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (((self.next() + 1.0) * 0.5 * n as f32) as usize).min(n - 1)
    }
}

fn tol(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-4,
        _ => 2e-2,
    }
}

fn compare(kernel: &str, dt: DType, shape: String, got: &[f32], want: &[f32]) -> Case {
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-6);
    let mut err = if got.len() == want.len() { 0f64 } else { f64::INFINITY };
    for (g, w) in got.iter().zip(want) {
        let e = (*g as f64 - *w as f64).abs();
        err = if e.is_nan() { f64::INFINITY } else { err.max(e) };
    }
    let rel = err / scale;
    Case {
        kernel: kernel.into(),
        dtype: dt.hf_name().into(),
        shape,
        max_abs_err: err,
        rel_err: rel,
        tolerance: tol(dt),
        pass: rel <= tol(dt),
    }
}

/// Random values stored as `dt`; returns the buffer and the values it holds.
fn input(gpu: &Gpu, dt: DType, rng: &mut Rng, n: usize, scale: f32) -> GpuResult<(DevBuf, Vec<f32>)> {
    let b = upload_as(gpu, dt, &rng.vec(n, scale))?;
    let v = download_f32(gpu, dt, b.ptr(), n)?;
    Ok((b, v))
}

fn bf16_round(v: f32, dt: DType) -> f32 {
    match dt {
        DType::F32 => v,
        DType::BF16 => {
            let u = v.to_bits();
            f32::from_bits((u.wrapping_add(0x7fff + ((u >> 16) & 1))) & 0xffff_0000)
        }
        DType::F16 => v, // not rounded by the reference; f16 has more mantissa than the bf16 tolerance needs
    }
}

/// Runs every case on GPU `ordinal`.
pub fn run(ordinal: usize) -> GpuResult<Vec<Case>> {
    let gpu = Gpu::open(ordinal)?;
    let mut cases = Vec::new();
    for dt in [DType::F32, DType::BF16] {
        let mut rng = Rng(7 + dt.size() as u64);
        cases.push(linear(&gpu, dt, &mut rng, 37, 300, 256, dt)?);
        cases.push(linear(&gpu, dt, &mut rng, 37, 1000, 128, DType::F32)?);
        // m <= 8: the GEMV kernel (k not a multiple of its unrolled span, to test the tail)
        cases.push(linear(&gpu, dt, &mut rng, 1, 300, 4096 + 264, dt)?);
        cases.push(linear(&gpu, dt, &mut rng, 2, 1000, 128, DType::F32)?);
        cases.push(linear(&gpu, dt, &mut rng, 8, 77, 1032, dt)?);
        cases.extend(norms(&gpu, dt, &mut rng)?);
        // LoRA's update of a fused projection: m <= 2 takes the GEMV kernel for x . A^T, 37 rows cuBLAS.
        cases.push(lora_site(&gpu, dt, &mut rng, 1)?);
        cases.push(lora_site(&gpu, dt, &mut rng, 37)?);
        cases.push(silu(&gpu, dt, &mut rng)?);
        cases.push(embed(&gpu, dt, &mut rng)?);
        cases.extend(rope(&gpu, dt, &mut rng)?);
        for (heads, kvh, hd) in [(8, 2, 128), (8, 4, 32), (4, 4, 64), (14, 2, 64)] {
            let h = Heads { heads, kv_heads: kvh, head_dim: hd, block_size: 16 };
            cases.push(decode(&gpu, dt, &mut rng, h, false)?);
            if attention::flash_supported(dt, hd) {
                cases.push(decode(&gpu, dt, &mut rng, h, true)?);
            }
            cases.push(prefill(&gpu, dt, &mut rng, h, false)?);
            if attention::flash_supported(dt, hd) {
                cases.push(prefill(&gpu, dt, &mut rng, h, true)?);
            }
        }
    }
    cases.push(argmax(&gpu)?);
    Ok(cases)
}

fn linear(
    gpu: &Gpu,
    dt: DType,
    rng: &mut Rng,
    m: usize,
    n: usize,
    k: usize,
    out_dt: DType,
) -> GpuResult<Case> {
    let (x, xv) = input(gpu, dt, rng, m * k, 1.0)?;
    let (w, wv) = input(gpu, dt, rng, n * k, 0.1)?;
    let y = gpu.zeros(m * n * out_dt.size())?;
    gpu.linear(dt, out_dt, y.ptr(), n, x.ptr(), k, w.ptr(), m, n, k)?;
    let got = download_f32(gpu, out_dt, y.ptr(), m * n)?;
    let mut want = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k).map(|t| xv[i * k + t] as f64 * wv[j * k + t] as f64).sum();
            want[i * n + j] = bf16_round(s as f32, out_dt);
        }
    }
    let name = match (m <= super::gpu::GEMV_MAX_ROWS, out_dt == DType::F32 && dt != DType::F32) {
        (false, false) => "linear (cuBLAS)",
        (false, true) => "linear (cuBLAS, f32 out)",
        (true, false) => "linear (GEMV)",
        (true, true) => "linear (GEMV, f32 out)",
    };
    Ok(compare(name, dt, format!("{m}x{k} . {n}x{k}^T"), &got, &want))
}

fn rms_ref(x: &[f32], w: &[f32], eps: f32, dt: DType) -> Vec<f32> {
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let r = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| bf16_round(w * bf16_round(v * r, dt), dt)).collect()
}

fn norms(gpu: &Gpu, dt: DType, rng: &mut Rng) -> GpuResult<Vec<Case>> {
    let (rows, h, eps) = (5usize, 1000usize, 1e-5f32);
    let (x, xv) = input(gpu, dt, rng, rows * h, 2.0)?;
    let (w, wv) = input(gpu, dt, rng, h, 1.0)?;
    let (y, yv) = input(gpu, dt, rng, rows * h, 1.0)?;
    let out = gpu.zeros(rows * h * dt.size())?;
    let sfx = dt.suffix();
    let (mut a, mut b, mut c, mut hh, mut e) = (out.ptr(), x.ptr(), w.ptr(), h as i32, eps);
    gpu.launch(
        &format!("rmsnorm_{sfx}"),
        (rows as u32, 1, 1),
        (256, 1, 1),
        0,
        &mut [ptr(&mut a), ptr(&mut b), ptr(&mut c), ptr(&mut hh), ptr(&mut e)],
    )?;
    let got = download_f32(gpu, dt, out.ptr(), rows * h)?;
    let want: Vec<f32> = xv.chunks(h).flat_map(|r| rms_ref(r, &wv, eps, dt)).collect();
    let c1 = compare("rmsnorm", dt, format!("{rows}x{h}"), &got, &want);
    let (mut a, mut b, mut c, mut d, mut hh, mut e) = (x.ptr(), y.ptr(), out.ptr(), w.ptr(), h as i32, eps);
    gpu.launch(
        &format!("add_rmsnorm_{sfx}"),
        (rows as u32, 1, 1),
        (256, 1, 1),
        0,
        &mut [ptr(&mut a), ptr(&mut b), ptr(&mut c), ptr(&mut d), ptr(&mut hh), ptr(&mut e)],
    )?;
    let sum: Vec<f32> = xv.iter().zip(&yv).map(|(a, b)| bf16_round(a + b, dt)).collect();
    let mut got = download_f32(gpu, dt, x.ptr(), rows * h)?;
    got.extend(download_f32(gpu, dt, out.ptr(), rows * h)?);
    let mut want = sum.clone();
    want.extend(sum.chunks(h).flat_map(|r| rms_ref(r, &wv, eps, dt)));
    Ok(vec![c1, compare("add_rmsnorm", dt, format!("{rows}x{h}"), &got, &want)])
}

fn silu(gpu: &Gpu, dt: DType, rng: &mut Rng) -> GpuResult<Case> {
    let (t, inter) = (3usize, 700usize);
    let (gu, v) = input(gpu, dt, rng, t * 2 * inter, 4.0)?;
    let out = gpu.zeros(t * inter * dt.size())?;
    let (mut a, mut b, mut i) = (out.ptr(), gu.ptr(), inter as i32);
    gpu.launch(
        &format!("silu_mul_{}", dt.suffix()),
        (t as u32, inter.div_ceil(256) as u32, 1),
        (256, 1, 1),
        0,
        &mut [ptr(&mut a), ptr(&mut b), ptr(&mut i)],
    )?;
    let got = download_f32(gpu, dt, out.ptr(), t * inter)?;
    let mut want = Vec::new();
    for r in v.chunks(2 * inter) {
        for j in 0..inter {
            let g = r[j];
            want.push(bf16_round(bf16_round(g / (1.0 + (-g).exp()), dt) * r[inter + j], dt));
        }
    }
    Ok(compare("silu_mul", dt, format!("{t}x{inter}"), &got, &want))
}

fn embed(gpu: &Gpu, dt: DType, rng: &mut Rng) -> GpuResult<Case> {
    let (vocab, h) = (50usize, 96usize);
    let (table, tv) = input(gpu, dt, rng, vocab * h, 1.0)?;
    let ids: Vec<u32> = vec![3, 0, 49, 3, 17];
    let idb = gpu.upload_new(&ids)?;
    let out = gpu.zeros(ids.len() * h * dt.size())?;
    let (mut a, mut b, mut c, mut hh) = (out.ptr(), table.ptr(), idb.ptr(), h as i32);
    gpu.launch(
        &format!("embed_{}", dt.suffix()),
        (ids.len() as u32, 1, 1),
        (256, 1, 1),
        0,
        &mut [ptr(&mut a), ptr(&mut b), ptr(&mut c), ptr(&mut hh)],
    )?;
    let got = download_f32(gpu, dt, out.ptr(), ids.len() * h)?;
    let want: Vec<f32> =
        ids.iter().flat_map(|i| tv[*i as usize * h..(*i as usize + 1) * h].to_vec()).collect();
    Ok(compare("embed", dt, format!("{}x{h}", ids.len()), &got, &want))
}

fn rope(gpu: &Gpu, dt: DType, rng: &mut Rng) -> GpuResult<Vec<Case>> {
    let (heads, kvh, hd) = (4usize, 2usize, 128usize);
    let (qd, kvd) = (heads * hd, kvh * hd);
    let row = qd + 2 * kvd;
    let positions: Vec<i32> = vec![0, 5, 1000, 32_000];
    let slots: Vec<i64> = vec![7, 2, 30, 11];
    let t = positions.len();
    let (qkv, qv) = input(gpu, dt, rng, t * row, 1.0)?;
    let (bias, bv) = input(gpu, dt, rng, row, 0.5)?;
    let inv: Vec<f32> = (0..hd / 2).map(|i| 1.0 / 500_000f32.powf(2.0 * i as f32 / hd as f32)).collect();
    let invb = gpu.upload_new(&inv)?;
    let posb = gpu.upload_new(&positions)?;
    let slotb = gpu.upload_new(&slots)?;
    let q = gpu.zeros(t * qd * dt.size())?;
    let kc = gpu.zeros(32 * kvd * dt.size())?;
    let vc = gpu.zeros(32 * kvd * dt.size())?;
    let (mut a, mut b, mut c, mut d, mut e) = (qkv.ptr(), bias.ptr(), q.ptr(), kc.ptr(), vc.ptr());
    let (mut p, mut s, mut f, mut h1, mut h2, mut h3) =
        (posb.ptr(), slotb.ptr(), invb.ptr(), heads as i32, kvh as i32, hd as i32);
    gpu.launch(
        &format!("qkv_rope_store_{}", dt.suffix()),
        (t as u32, (heads + 2 * kvh) as u32, 1),
        ((hd / 2) as u32, 1, 1),
        0,
        &mut [
            ptr(&mut a),
            ptr(&mut b),
            ptr(&mut c),
            ptr(&mut d),
            ptr(&mut e),
            ptr(&mut p),
            ptr(&mut s),
            ptr(&mut f),
            ptr(&mut h1),
            ptr(&mut h2),
            ptr(&mut h3),
        ],
    )?;
    let (gq, gk, gv) = (
        download_f32(gpu, dt, q.ptr(), t * qd)?,
        download_f32(gpu, dt, kc.ptr(), 32 * kvd)?,
        download_f32(gpu, dt, vc.ptr(), 32 * kvd)?,
    );
    let (mut got, mut want) = (Vec::new(), Vec::new());
    let half = hd / 2;
    for ti in 0..t {
        let r = &qv[ti * row..(ti + 1) * row];
        for hh in 0..heads + 2 * kvh {
            let col = if hh < heads {
                hh * hd
            } else if hh < heads + kvh {
                qd + (hh - heads) * hd
            } else {
                qd + kvd + (hh - heads - kvh) * hd
            };
            let out: &[f32] = if hh < heads {
                &gq[ti * qd + hh * hd..ti * qd + (hh + 1) * hd]
            } else if hh < heads + kvh {
                let o = slots[ti] as usize * kvd + (hh - heads) * hd;
                &gk[o..o + hd]
            } else {
                let o = slots[ti] as usize * kvd + (hh - heads - kvh) * hd;
                &gv[o..o + hd]
            };
            got.extend_from_slice(out);
            let mut w = vec![0f32; hd];
            for i in 0..half {
                let a = bf16_round(r[col + i] + bv[col + i], dt);
                let b = bf16_round(r[col + half + i] + bv[col + half + i], dt);
                if hh < heads + kvh {
                    let ang = positions[ti] as f32 * inv[i];
                    let (c, s) = (ang.cos(), ang.sin());
                    w[i] = a * c - b * s;
                    w[half + i] = b * c + a * s;
                } else {
                    w[i] = a;
                    w[half + i] = b;
                }
            }
            want.extend(w);
        }
    }
    // Angles up to 32000 rad: f32 argument reduction differs by ~1e-4 between libm and CUDA.
    let mut case =
        compare("qkv_rope_store", dt, format!("{t} tokens, {heads}/{kvh} heads x {hd}"), &got, &want);
    if dt == DType::F32 {
        case.tolerance = 1e-3;
        case.pass = case.rel_err <= case.tolerance;
    }
    Ok(vec![case])
}

/// A pool of `blocks` random blocks and, per sequence, a random (shuffled) block table.
struct Pool {
    kc: DevBuf,
    vc: DevBuf,
    kv: Vec<f32>,
    vv: Vec<f32>,
    tables: Vec<Vec<i32>>,
}

fn pool(gpu: &Gpu, dt: DType, rng: &mut Rng, h: Heads, ctxs: &[usize]) -> GpuResult<Pool> {
    let kvd = h.kv_heads * h.head_dim;
    let need: usize = ctxs.iter().map(|c| c.div_ceil(h.block_size)).sum();
    let blocks = need + 3;
    let (kc, kv) = input(gpu, dt, rng, blocks * h.block_size * kvd, 1.0)?;
    let (vc, vv) = input(gpu, dt, rng, blocks * h.block_size * kvd, 1.0)?;
    let mut ids: Vec<i32> = (0..blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        let j = rng.below(i + 1);
        ids.swap(i, j);
    }
    let mut tables = Vec::new();
    let mut at = 0;
    for c in ctxs {
        let nb = c.div_ceil(h.block_size);
        tables.push(ids[at..at + nb].to_vec());
        at += nb;
    }
    Ok(Pool { kc, vc, kv, vv, tables })
}

/// Reference attention of one query (`q`: heads x hd) at position `p` over the pool.
fn attend_ref(
    h: Heads,
    pool: &Pool,
    table: &[i32],
    q: &[f32],
    p: usize,
    dt: DType,
    round_p: bool,
) -> Vec<f32> {
    let (hd, kvd, g) = (h.head_dim, h.kv_heads * h.head_dim, h.heads / h.kv_heads);
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0f32; h.heads * hd];
    for hh in 0..h.heads {
        let kh = hh / g;
        let slot = |j: usize| table[j / h.block_size] as usize * h.block_size + j % h.block_size;
        let s: Vec<f64> = (0..=p)
            .map(|j| {
                let k = &pool.kv[slot(j) * kvd + kh * hd..slot(j) * kvd + (kh + 1) * hd];
                q[hh * hd..(hh + 1) * hd].iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                    * scale
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
        let l: f64 = e.iter().sum();
        for (j, ej) in e.iter().enumerate() {
            let pj = if round_p { bf16_round((ej / l) as f32, dt) as f64 } else { ej / l };
            let v = &pool.vv[slot(j) * kvd + kh * hd..slot(j) * kvd + (kh + 1) * hd];
            for d in 0..hd {
                out[hh * hd + d] += (pj * v[d] as f64) as f32;
            }
        }
    }
    out
}

/// Whether the tensor-core decode kernel matches the CPU reference on this device.
pub fn decode_tc_agrees(gpu: &Gpu, dt: DType, h: Heads) -> GpuResult<(bool, f64)> {
    let mut rng = Rng(37);
    let c = decode(gpu, dt, &mut rng, h, true)?;
    Ok((c.pass, c.rel_err))
}

fn decode(gpu: &Gpu, dt: DType, rng: &mut Rng, h: Heads, tc: bool) -> GpuResult<Case> {
    let ctxs = [1usize, 17, 513, 1500, 4097];
    let pool = pool(gpu, dt, rng, h, &ctxs)?;
    let qd = h.heads * h.head_dim;
    let rows: Vec<i32> = (0..ctxs.len() as i32).rev().collect(); // rows in reverse order
    let (q, qv) = input(gpu, dt, rng, ctxs.len() * qd, 1.0)?;
    let o = gpu.zeros(ctxs.len() * qd * dt.size())?;
    let max_blocks = ctxs.iter().map(|c| c.div_ceil(h.block_size)).max().unwrap_or(1);
    let mut tables = Vec::new();
    for t in &pool.tables {
        tables.extend(t.iter().copied().chain(std::iter::repeat(0)).take(max_blocks));
    }
    let ctx32: Vec<i32> = ctxs.iter().map(|c| *c as i32).collect();
    let (rb, cb, tb) = (gpu.upload_new(&rows)?, gpu.upload_new(&ctx32)?, gpu.upload_new(&tables)?);
    let splits = attention::decode_splits(*ctxs.iter().max().unwrap_or(&1));
    let part = gpu.zeros(attention::decode_part_bytes(h, ctxs.len(), splits))?;
    let l = attention::Layer { q: q.ptr(), o: o.ptr(), kc: pool.kc.ptr(), vc: pool.vc.ptr() };
    let max_ctx = *ctxs.iter().max().unwrap_or(&1);
    let d = attention::DecodeBatch {
        rows: rb.ptr(),
        ctx: cb.ptr(),
        tables: tb.ptr(),
        max_blocks,
        seqs: ctxs.len(),
        max_ctx,
    };
    attention::decode(gpu, dt, h, l, d, part.ptr(), tc)?;
    let got = download_f32(gpu, dt, o.ptr(), ctxs.len() * qd)?;
    let mut want = vec![0f32; ctxs.len() * qd];
    for (b, c) in ctxs.iter().enumerate() {
        let r = rows[b] as usize;
        let o = attend_ref(h, &pool, &pool.tables[b], &qv[r * qd..(r + 1) * qd], c - 1, dt, false);
        for (d, v) in o.iter().enumerate() {
            want[r * qd + d] = bf16_round(*v, dt);
        }
    }
    Ok(compare(
        if tc { "paged_decode (tensor c.)" } else { "paged_decode (SIMT)" },
        dt,
        format!("ctx {ctxs:?}, {}/{} heads x {}", h.heads, h.kv_heads, h.head_dim),
        &got,
        &want,
    ))
}

/// Whether the flash prefill kernel matches the GEMM path on this device (random inputs, both chunk kinds).
pub fn flash_agrees(gpu: &Gpu, dt: DType, h: Heads) -> GpuResult<(bool, f64)> {
    let mut rng = Rng(31);
    let c = prefill(gpu, dt, &mut rng, h, true)?;
    Ok((c.pass, c.rel_err))
}

fn prefill(gpu: &Gpu, dt: DType, rng: &mut Rng, h: Heads, flash: bool) -> GpuResult<Case> {
    // Two chunks: a cold one and one after a cached prefix, in one q buffer; a small budget forces query tiles.
    let chunks = [(0usize, 70usize), (37usize, 50usize), (130usize, 150usize)];
    let ctxs: Vec<usize> = chunks.iter().map(|(s, n)| s + n).collect();
    let pool = pool(gpu, dt, rng, h, &ctxs)?;
    let qd = h.heads * h.head_dim;
    let rows: usize = chunks.iter().map(|c| c.1).sum();
    let (q, qv) = input(gpu, dt, rng, rows * qd, 1.0)?;
    let o = gpu.zeros(rows * qd * dt.size())?;
    let mut scratch = PrefillScratch::default();
    scratch.budget = h.heads * 100 * 24 * dt.size();
    scratch.flash = flash;
    let mut row0 = 0;
    let mut want = vec![0f32; rows * qd];
    for (ci, (start, n)) in chunks.iter().enumerate() {
        let tb = gpu.upload_new(&pool.tables[ci])?;
        let l = attention::Layer { q: q.ptr(), o: o.ptr(), kc: pool.kc.ptr(), vc: pool.vc.ptr() };
        attention::prefill(gpu, dt, h, l, tb.ptr(), row0, *start, *n, &mut scratch)?;
        gpu.sync()?;
        for i in 0..*n {
            let r = row0 + i;
            let out = attend_ref(
                h,
                &pool,
                &pool.tables[ci],
                &qv[r * qd..(r + 1) * qd],
                start + i,
                dt,
                dt != DType::F32,
            );
            for (d, v) in out.iter().enumerate() {
                want[r * qd + d] = bf16_round(*v, dt);
            }
        }
        row0 += n;
    }
    let got = download_f32(gpu, dt, o.ptr(), rows * qd)?;
    Ok(compare(
        if flash { "prefill_attn (flash)" } else { "prefill_attn (GEMM)" },
        dt,
        format!("chunks (start, len) {chunks:?}, {}/{} heads x {}", h.heads, h.kv_heads, h.head_dim),
        &got,
        &want,
    ))
}

/// A LoRA adapter's update of a fused projection (`lora::GpuAdapter::apply`) on a run of `m` rows in the middle of
/// a batch, added to outputs that already hold the base projection (beta 1), against `lora::apply_host`: the fused
/// output has three targets, the middle one not adapted; rows outside the run must stay as they were.
fn lora_site(gpu: &Gpu, dt: DType, rng: &mut Rng, m: usize) -> GpuResult<Case> {
    use super::lora::{apply_host, GpuAdapter, HostAdapter, HostOut, HostSite, Site};
    let (fin, rank, row0, scaling) = (264, 4, 3, 1.5f32);
    let widths = [48, 16, 24];
    let ldy: usize = widths.iter().sum();
    let rows_total = row0 + m + 2;
    let mut host = |n: usize, scale: f32| -> Vec<f32> {
        rng.vec(n, scale).into_iter().map(|v| bf16_round(v, dt)).collect()
    };
    let site = HostSite {
        a: host(2 * rank * fin, 0.1),
        rows: 2 * rank,
        fin,
        outs: vec![
            HostOut { col0: 0, out: widths[0], a_row0: 0, b: host(widths[0] * rank, 0.5) },
            HostOut {
                col0: widths[0] + widths[1],
                out: widths[2],
                a_row0: rank,
                b: host(widths[2] * rank, 0.5),
            },
        ],
    };
    let xv = host(rows_total * fin, 1.0);
    let yv = host(rows_total * ldy, 1.0);
    let adapter = HostAdapter {
        key: "selftest".into(),
        rank,
        scaling,
        layers: vec![[Some(site.clone()), None, None, None]],
    };
    let dev = GpuAdapter::upload(gpu, dt, &adapter)?;
    let x = upload_as(gpu, dt, &xv)?;
    let y = upload_as(gpu, dt, &yv)?;
    let low = gpu.zeros(m * 2 * rank * dt.size())?;
    dev.apply(gpu, dt, 0, Site::Qkv, (x.ptr(), fin), (y.ptr(), ldy), (row0, m), low.ptr())?;
    let got = download_f32(gpu, dt, y.ptr(), rows_total * ldy)?;
    let mut want = yv.clone();
    let run = row0 * ldy..(row0 + m) * ldy;
    apply_host(&site, rank, scaling, &xv[row0 * fin..(row0 + m) * fin], fin, &mut want[run], ldy);
    let want: Vec<f32> = want.into_iter().map(|v| bf16_round(v, dt)).collect();
    let path = if m <= super::gpu::GEMV_MAX_ROWS { "GEMV + cuBLAS" } else { "cuBLAS" };
    Ok(compare(
        &format!("lora site ({path})"),
        dt,
        format!("{m} of {rows_total} rows, in {fin}, out {widths:?} (middle not adapted), rank {rank}"),
        &got,
        &want,
    ))
}

fn argmax(gpu: &Gpu) -> GpuResult<Case> {
    let vocab = 128_256usize;
    let mut rng = Rng(99);
    let mut l = rng.vec(3 * vocab, 10.0);
    l[5] = 50.0; // row 0: a tie at 5 and 70000: lowest wins
    l[70_000] = 50.0;
    l[vocab + vocab - 1] = 60.0; // row 1: the last id
    let lb = gpu.upload_new(&l)?;
    let out = gpu.zeros(3 * 4 + 16)?;
    let (mut a, mut b, mut v) = (out.ptr(), lb.ptr(), vocab as i32);
    gpu.launch("argmax_rows", (3, 1, 1), (1024, 1, 1), 0, &mut [ptr(&mut a), ptr(&mut b), ptr(&mut v)])?;
    let mut got = vec![0u32; 3];
    download_raw(gpu, &mut got, out.ptr())?;
    let want: Vec<u32> = l.chunks(vocab).map(crate::engine::sampler::argmax).collect();
    let g: Vec<f32> = got.iter().map(|x| *x as f32).collect();
    let w: Vec<f32> = want.iter().map(|x| *x as f32).collect();
    let mut c = compare("argmax_rows", DType::F32, format!("3x{vocab}"), &g, &w);
    c.pass = got == want;
    Ok(c)
}
