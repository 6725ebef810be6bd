//! LoRA adapters on the GPU (issue #47): the CUDA engine's side of `model::lora`. UNVERIFIED until a GPU run: the
//! host packing and its reference math are tested here, the device path is checked by `gpu-selftest` (case `lora
//! site`) and `gpu-logits --lora` (against the CPU engine and HF transformers on merged weights) on a GPU machine.
//!
//! The forward pass fuses projections that share an input (q/k/v into one `[q + 2 kv, hidden]` weight, gate/up
//! into `[2 i, hidden]`). An adapter's update of one fused projection (a [`Site`]) on a run of rows is one GEMM
//! for `low` and one per target:
//!
//! ```text
//! low[m, R]  = x[rows, in] . A_site[R, in]^T          A_site: the site's targets' A stacked (R = r x targets)
//! y[rows, c_t..c_t + out_t] += s . low[:, j_t r..(j_t + 1) r] . B_t[out_t, r]^T      per target t (beta = 1)
//! ```
//! with `c_t` the target's first column in the fused output (q 0, k q, v q + kv; gate 0, up i) and `s` the adapter's
//! scaling. A batch's rows are grouped by adapter ([`plan`]), so each adapter's rows are one run: per site, one GEMM
//! for `x Aᵀ` and one per target for `Bᵀ`. A batch of many adapters costs launches, not a gather (Punica-style
//! grouped SGMV kernels would launch once per site for all adapters and are not written).
//!
//! Device memory: [`AdapterCache`] holds at most `--max-gpu-loras` adapters (uploaded on first use from the host
//! copy the worker's adapter store keeps, one allocation each laid out by [`flatten`]; least recently used
//! evicted, never one the batch being run needs); the KV pool is sized after reserving [`reserve_bytes`]
//! (that many adapters at `--max-lora-rank` on all seven projections, and the `low` scratch), so adapters never
//! run the device out of memory mid-serving. A batch runs grouped by adapter, and one naming more distinct adapters
//! than slots runs as consecutive sub-batches, adapters already resident first ([`plan`]).

use super::gpu::{DevBuf, Gpu, GpuError, GpuResult};
use super::weights::upload_as;
use super::DType;
use crate::model::lora::{LoraAdapter, Target};
use crate::model::ModelConfig;

/// A fused projection of the forward pass an adapter may update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// q, k, v: input the normed hidden state, output `[q + 2 kv]`.
    Qkv,
    /// o: input the attention output.
    O,
    /// gate, up: input the normed hidden state, output `[2 i]`.
    GateUp,
    /// down: input the gated activation.
    Down,
}

impl Site {
    pub const ALL: [Site; 4] = [Site::Qkv, Site::O, Site::GateUp, Site::Down];

    /// The projections fused into it, in the fused output's column order.
    pub fn targets(self) -> &'static [Target] {
        match self {
            Site::Qkv => &[Target::Q, Target::K, Target::V],
            Site::O => &[Target::O],
            Site::GateUp => &[Target::Gate, Target::Up],
            Site::Down => &[Target::Down],
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// `(in, fused out)` features.
    pub fn features(self, cfg: &ModelConfig) -> (usize, usize) {
        let fin = self.targets()[0].features(cfg).0;
        (fin, self.targets().iter().map(|t| t.features(cfg).1).sum())
    }
}

/// One target's part of a packed site.
#[derive(Clone, Debug, PartialEq)]
pub struct HostOut {
    /// First column of the target in the fused output.
    pub col0: usize,
    pub out: usize,
    /// First row of its A in the stacked A (its columns of `low`).
    pub a_row0: usize,
    /// `B` `[out, r]`, row-major.
    pub b: Vec<f32>,
}

/// An adapter's update of one site, packed for the device: the targets' A stacked `[rows, in]` and their B's.
#[derive(Clone, Debug, PartialEq)]
pub struct HostSite {
    pub a: Vec<f32>,
    pub rows: usize,
    pub fin: usize,
    pub outs: Vec<HostOut>,
}

/// An adapter packed per layer and site (f32 on the host).
#[derive(Clone, Debug)]
pub struct HostAdapter {
    pub key: String,
    pub rank: usize,
    pub scaling: f32,
    pub layers: Vec<[Option<HostSite>; 4]>,
}

fn values(t: &candle_core::Tensor) -> GpuResult<Vec<f32>> {
    t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(|e| GpuError::Invalid(format!("adapter: {e}")))
}

/// Packs `adapter` (checked against `cfg` when it was loaded) for the fused projections.
pub fn pack(adapter: &LoraAdapter, cfg: &ModelConfig) -> GpuResult<HostAdapter> {
    let r = adapter.rank;
    let mut layers = Vec::with_capacity(adapter.layers.len());
    for pairs in &adapter.layers {
        let mut sites: [Option<HostSite>; 4] = Default::default();
        for site in Site::ALL {
            let (fin, _) = site.features(cfg);
            let mut packed = HostSite { a: Vec::new(), rows: 0, fin, outs: Vec::new() };
            let mut col0 = 0;
            for &t in site.targets() {
                let out = t.features(cfg).1;
                if let Some(p) = pairs.get(&t) {
                    packed.outs.push(HostOut { col0, out, a_row0: packed.rows, b: values(&p.b)? });
                    packed.a.extend(values(&p.a)?);
                    packed.rows += r;
                }
                col0 += out;
            }
            if packed.rows > 0 {
                sites[site.index()] = Some(packed);
            }
        }
        layers.push(sites);
    }
    Ok(HostAdapter { key: adapter.key.clone(), rank: r, scaling: adapter.scaling, layers })
}

/// What the device computes for one run of `m` rows, on the host: `y[i, c_t + j] += s (x_i . A_t^T) . B_t^T`
/// (`x` `[m, ldx]`, `y` `[m, ldy]`, row-major). The reference of `gpu-selftest`'s `lora site` case and of the
/// packing test.
pub fn apply_host(
    site: &HostSite,
    rank: usize,
    scaling: f32,
    x: &[f32],
    ldx: usize,
    y: &mut [f32],
    ldy: usize,
) {
    let m = y.len() / ldy.max(1);
    for i in 0..m {
        let xi = &x[i * ldx..i * ldx + site.fin];
        let low: Vec<f64> = (0..site.rows)
            .map(|j| {
                site.a[j * site.fin..(j + 1) * site.fin]
                    .iter()
                    .zip(xi)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum()
            })
            .collect();
        for o in &site.outs {
            for c in 0..o.out {
                let d: f64 = (0..rank).map(|k| o.b[c * rank + k] as f64 * low[o.a_row0 + k]).sum();
                y[i * ldy + o.col0 + c] += (d * scaling as f64) as f32;
            }
        }
    }
}

/// Device bytes of one adapter of rank `rank` targeting all seven projections in every layer, stored as `dt`.
pub fn slot_bytes(cfg: &ModelConfig, dt: DType, rank: usize) -> usize {
    // Each A and B rounded up to ALIGN (a site's stacked A takes at most one rounding per target).
    let per_layer: usize = Target::ALL
        .iter()
        .map(|t| {
            let (i, o) = t.features(cfg);
            rank * (i + o) + 2 * ALIGN
        })
        .sum();
    per_layer * cfg.num_hidden_layers * dt.size()
}

/// Device memory kept from the KV pool for `slots` adapters of up to `max_rank`, the `low` scratch of a step of
/// `max_tokens` tokens (rounded up as `Scratch` allocates) and the f32 staging buffer an upload converts through
/// (`weights::upload_as`: at most 2^24 values); 0 when `slots` is 0.
pub fn reserve_bytes(
    cfg: &ModelConfig,
    dt: DType,
    slots: usize,
    max_rank: usize,
    max_tokens: usize,
) -> usize {
    if slots == 0 {
        return 0;
    }
    let one = slot_bytes(cfg, dt, max_rank);
    let staging = if dt == DType::F32 { 0 } else { (one / dt.size()).min(1 << 24) * 4 };
    slots * one + (max_tokens * 3 * max_rank * dt.size()).next_multiple_of(1 << 20) + staging
}

/// The order a batch runs in on the device: the item indices of each consecutive sub-batch. Items are grouped by
/// adapter (the base model's first, then the adapters already in device memory per `resident`, then the others,
/// each group in the order its adapter first appears, and items within a group in batch order), so each adapter's
/// rows are one run (one `low` GEMM per site, however its items interleave), and a sub-batch is cut only
/// between groups, when the next group's adapter would make `slots` + 1 distinct ones (`slots` 0 counts as 1).
/// Rows of a forward pass are independent (each item has its own slots; a step's new blocks are committed after
/// it), so the order changes no item's result.
pub fn plan(keys: &[Option<&str>], resident: impl Fn(&str) -> bool, slots: usize) -> Vec<Vec<usize>> {
    let mut base: Vec<usize> = Vec::new();
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        match k {
            None => base.push(i),
            Some(k) => match groups.iter_mut().find(|(g, _)| g == k) {
                Some((_, items)) => items.push(i),
                None => groups.push((k, vec![i])),
            },
        }
    }
    // Stable: residents keep their order, then the others keep theirs.
    groups.sort_by_key(|(k, _)| !resident(k));
    let mut parts = vec![base];
    let mut distinct = 0;
    for (_, items) in groups {
        if distinct == slots.max(1) {
            parts.push(Vec::new());
            distinct = 0;
        }
        distinct += 1;
        if let Some(last) = parts.last_mut() {
            last.extend(items);
        }
    }
    parts
}

/// A run of consecutive rows of a batch on one adapter: `(first row, rows, adapter index)`.
pub type Run = (usize, usize, usize);

/// The runs of rows of chunks of `lens` tokens running with adapters `which` (an index into the batch's adapters;
/// `None`: the base model, no run). Neighbouring chunks of one adapter make one run.
pub fn runs(lens: &[usize], which: &[Option<usize>]) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    let mut row = 0;
    for (n, w) in lens.iter().zip(which) {
        if let (Some(a), true) = (w, *n > 0) {
            match out.last_mut() {
                Some((r0, m, last)) if *last == *a && *r0 + *m == row => *m += n,
                _ => out.push((row, *n, *a)),
            }
        }
        row += n;
    }
    out
}

/// Where one target's `B` sits in an adapter's device buffer (elements), with its place in the fused output.
#[derive(Clone, Debug, PartialEq)]
pub struct OutAt {
    pub col0: usize,
    pub out: usize,
    pub a_row0: usize,
    pub b: usize,
}

/// Where one site's stacked `A` and its targets' `B`s sit in an adapter's device buffer (elements).
#[derive(Clone, Debug, PartialEq)]
pub struct SiteAt {
    pub a: usize,
    pub rows: usize,
    pub fin: usize,
    pub outs: Vec<OutAt>,
}

/// Every tensor of an adapter starts at a multiple of this many elements of its one device buffer (128 bytes in
/// bf16): the GEMV kernel reads 8 elements at a time from aligned rows, cuBLAS picks faster kernels on aligned
/// operands.
pub const ALIGN: usize = 64;

/// An adapter's tensors laid end to end (each at a multiple of [`ALIGN`]): the one buffer uploaded, and where
/// each site's tensors are in it.
pub fn flatten(h: &HostAdapter) -> (Vec<f32>, Vec<[Option<SiteAt>; 4]>) {
    let mut flat: Vec<f32> = Vec::new();
    let mut put = |v: &[f32]| {
        let at = flat.len().next_multiple_of(ALIGN);
        flat.resize(at, 0.0);
        flat.extend_from_slice(v);
        at
    };
    let layers = h
        .layers
        .iter()
        .map(|sites| {
            let mut at: [Option<SiteAt>; 4] = Default::default();
            for (i, s) in sites.iter().enumerate() {
                let Some(s) = s else { continue };
                let a = put(&s.a);
                let outs = s
                    .outs
                    .iter()
                    .map(|o| OutAt { col0: o.col0, out: o.out, a_row0: o.a_row0, b: put(&o.b) })
                    .collect();
                at[i] = Some(SiteAt { a, rows: s.rows, fin: s.fin, outs });
            }
            at
        })
        .collect();
    (flat, layers)
}

/// An adapter in device memory: one buffer (`flatten`'s), freed when it is dropped.
#[derive(Debug)]
pub struct GpuAdapter {
    pub key: String,
    rank: usize,
    scaling: f32,
    buf: DevBuf,
    layers: Vec<[Option<SiteAt>; 4]>,
    /// Widest stacked A (columns of `low` it needs).
    pub max_rows: usize,
}

impl GpuAdapter {
    /// Uploads a packed adapter in `dt` (one allocation).
    pub fn upload(gpu: &Gpu, dt: DType, h: &HostAdapter) -> GpuResult<Self> {
        let (flat, layers) = flatten(h);
        let buf = upload_as(gpu, dt, &flat)?;
        let max_rows = layers.iter().flatten().flatten().map(|s| s.rows).max().unwrap_or(0);
        Ok(Self { key: h.key.clone(), rank: h.rank, scaling: h.scaling, buf, layers, max_rows })
    }

    /// Device bytes it holds.
    pub fn bytes(&self) -> usize {
        self.buf.bytes()
    }

    /// Adds this adapter's update of `site` in `layer` to rows `row0..row0 + m` of `y` (`ldy` wide, the fused
    /// projection's output) from the same rows of `x` (`ldx` wide); `low` is scratch of `m x max_rows` elements.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        gpu: &Gpu,
        dt: DType,
        layer: usize,
        site: Site,
        (x, ldx): (u64, usize),
        (y, ldy): (u64, usize),
        (row0, m): (usize, usize),
        low: u64,
    ) -> GpuResult<()> {
        let Some(s) = self.layers.get(layer).and_then(|l| l[site.index()].as_ref()) else { return Ok(()) };
        let es = dt.size();
        let at = |elems: usize| self.buf.ptr() + (elems * es) as u64;
        let xr = x + (row0 * ldx * es) as u64;
        // low[m, rows] = x[m, in] . A[rows, in]^T
        gpu.linear(dt, dt, low, s.rows, xr, ldx, at(s.a), m, s.rows, s.fin)?;
        for o in &s.outs {
            // Column-major, as cuBLAS sees row-major buffers: Y^T[out, m] += s . B[out, r] . low^T[r, m], i.e.
            // op(A) = B (its row-major [out, r] is a column-major [r, out] with ld r, transposed), B = the target's
            // r columns of low (column-major [r, m], ld rows), C = the target's columns of y (ld ldy), beta 1.
            let yc = y + ((row0 * ldy + o.col0) * es) as u64;
            let lo = low + (o.a_row0 * es) as u64;
            gpu.gemm_batched(
                dt,
                dt,
                true,
                o.out,
                m,
                self.rank,
                self.scaling,
                (at(o.b), self.rank, 0),
                (lo, s.rows, 0),
                1.0,
                (yc, ldy, 0),
                1,
            )?;
        }
        Ok(())
    }
}

/// The adapters in device memory: at most `slots`, least recently used evicted.
#[derive(Debug, Default)]
pub struct AdapterCache {
    slots: usize,
    tick: u64,
    entries: Vec<(GpuAdapter, u64)>,
    /// The first upload warned that this path is unverified.
    warned: bool,
}

impl AdapterCache {
    pub fn new(slots: usize) -> Self {
        Self { slots, tick: 0, entries: Vec::new(), warned: false }
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Whether the adapter keyed `key` is in device memory.
    pub fn holds(&self, key: &str) -> bool {
        self.entries.iter().any(|(g, _)| g.key == key)
    }

    /// Makes every adapter of `want` (at most `slots` distinct: see [`plan`]) resident and returns, per
    /// entry of `want`, its index for [`AdapterCache::get`]. Evicts the least recently used adapters `want` does
    /// not name; an upload that fails leaves the cache as it was, less what was evicted.
    pub fn ensure(
        &mut self,
        gpu: &Gpu,
        dt: DType,
        cfg: &ModelConfig,
        want: &[&LoraAdapter],
    ) -> GpuResult<Vec<usize>> {
        if want.is_empty() {
            return Ok(Vec::new()); // a base-model batch: nothing to do, nothing allocated
        }
        let mut distinct: Vec<&str> = want.iter().map(|a| a.key.as_str()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() > self.slots {
            return Err(GpuError::Invalid(format!(
                "a sub-batch names {} adapters; {} fit in device memory (--max-gpu-loras)",
                distinct.len(),
                self.slots
            )));
        }
        self.tick += 1;
        for a in want {
            if let Some(e) = self.entries.iter_mut().find(|(g, _)| g.key == a.key) {
                e.1 = self.tick;
                continue;
            }
            if self.entries.len() >= self.slots {
                let victim = self
                    .entries
                    .iter()
                    .enumerate()
                    .filter(|(_, (g, _))| !distinct.contains(&g.key.as_str()))
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(i, _)| i);
                if let Some(i) = victim {
                    gpu.sync()?; // kernels of an earlier step may still read its weights
                    self.entries.swap_remove(i);
                }
            }
            if !std::mem::replace(&mut self.warned, true) {
                tracing::warn!(
                    "LoRA on CUDA has not been checked on a GPU yet (issue #47): scripts/gpu-check.sh does"
                );
            }
            let dev = GpuAdapter::upload(gpu, dt, &pack(a, cfg)?)?;
            metrics::counter!("kvgate_worker_lora_gpu_uploads_total").increment(1);
            tracing::debug!(adapter = %a.key, held = self.entries.len() + 1, bytes = dev.bytes(),
                "LoRA adapter uploaded to the GPU");
            self.entries.push((dev, self.tick));
        }
        want.iter()
            .map(|a| {
                self.entries.iter().position(|(g, _)| g.key == a.key).ok_or_else(|| {
                    GpuError::Invalid(format!("adapter {} is not in device memory after its upload", a.key))
                })
            })
            .collect()
    }

    /// The adapter at `i` (from [`AdapterCache::ensure`]).
    pub fn get(&self, i: usize) -> Option<&GpuAdapter> {
        self.entries.get(i).map(|(g, _)| g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::{synth_lora, LoraSpec, DEFAULT_MAX_LORA_RANK};
    use crate::model::synth::{synth_model, Preset, SynthSpec};
    use candle_core::{Device, Tensor};

    #[test]
    fn runs_join_neighbouring_chunks_of_one_adapter_and_skip_the_base_model() {
        let lens = [3, 1, 1, 4, 0, 2, 2];
        let which = [Some(0), Some(0), None, Some(1), Some(1), Some(1), Some(0)];
        assert_eq!(runs(&lens, &which), vec![(0, 4, 0), (5, 6, 1), (11, 2, 0)]);
        assert!(runs(&[5, 1], &[None, None]).is_empty());
    }

    #[test]
    fn a_plan_groups_each_adapters_items_residents_first_and_holds_at_most_the_slots_per_part() {
        let k = [Some("a"), None, Some("b"), Some("a"), Some("c"), Some("b"), None, Some("d")];
        let none = |_: &str| false;
        assert_eq!(plan(&k, none, 4), vec![vec![1, 6, 0, 3, 2, 5, 4, 7]]);
        assert_eq!(plan(&k, none, 2), vec![vec![1, 6, 0, 3, 2, 5], vec![4, 7]]);
        assert_eq!(plan(&k, none, 1), vec![vec![1, 6, 0, 3], vec![2, 5], vec![4], vec![7]]);
        // Adapters in device memory run first, so the first part needs no upload.
        assert_eq!(plan(&k, |a| a == "c" || a == "d", 2), vec![vec![1, 6, 4, 7], vec![0, 3, 2, 5]]);
        assert_eq!(plan(&[None, None], none, 0), vec![vec![0, 1]]);
        assert_eq!(plan(&[], none, 3), vec![Vec::<usize>::new()]);
        // Interleaved decodes of three adapters over two slots: two parts, not one per change of adapter.
        let d = [Some("a"), Some("b"), Some("c"), Some("a"), Some("b"), Some("c")];
        assert_eq!(plan(&d, |a| a != "c", 2), vec![vec![0, 3, 1, 4], vec![2, 5]]);
        for s in 0..5 {
            let parts = plan(&k, |a| a == "b", s);
            let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
            all.sort_unstable();
            assert_eq!(all, (0..k.len()).collect::<Vec<_>>(), "every item once");
            for p in &parts {
                let ks: Vec<Option<&str>> = p.iter().map(|i| k[*i]).collect();
                let mut d: Vec<&str> = ks.iter().flatten().copied().collect();
                d.dedup();
                assert!(d.len() <= s.max(1), "{ks:?}");
                let mut seen = d.clone();
                seen.sort_unstable();
                seen.dedup();
                assert_eq!(seen.len(), d.len(), "one run per adapter: {ks:?}");
            }
        }
    }

    /// The packing (stacked A's, each target's columns in the fused output) applied as the device applies it equals
    /// the CPU engine's per-target update (`LoraAdapter::delta`) placed in the fused layout.
    #[test]
    fn the_packed_update_of_each_fused_projection_equals_the_per_target_updates() {
        let dir = tempfile::tempdir().expect("tmp");
        synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 3)).expect("synth");
        let cfg = ModelConfig::from_dir(dir.path()).expect("config");
        let out = dir.path().join("lora");
        // Not every target, so stacked rows and column offsets differ.
        let targets = [Target::K, Target::V, Target::O, Target::Up, Target::Down];
        let spec = LoraSpec { base: "tiny", rank: 4, alpha: 12.0, targets: &targets, seed: 5, zero: false };
        synth_lora(&out, &cfg, &spec).expect("synth-lora");
        let adapter = LoraAdapter::load(&out, "x", &cfg, DEFAULT_MAX_LORA_RANK).expect("load");
        let packed = pack(&adapter, &cfg).expect("pack");
        assert!(packed.layers[0][Site::Qkv.index()]
            .as_ref()
            .is_some_and(|s| s.rows == 8 && s.outs[0].a_row0 == 0));
        assert!(packed.layers[0][Site::GateUp.index()]
            .as_ref()
            .is_some_and(|s| s.outs[0].col0 == cfg.intermediate_size));
        let m = 3;
        for site in Site::ALL {
            let (fin, fout) = site.features(&cfg);
            let xs: Vec<f32> = (0..m * fin).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
            let x = Tensor::from_vec(xs.clone(), (m, fin), &Device::Cpu).expect("x");
            let mut got = vec![0f32; m * fout];
            let s = packed.layers[1][site.index()].as_ref().expect("targeted");
            apply_host(s, packed.rank, packed.scaling, &xs, fin, &mut got, fout);
            let mut want = vec![0f32; m * fout];
            let mut col0 = 0;
            for &t in site.targets() {
                let out = t.features(&cfg).1;
                if let Some(d) = adapter.delta(1, t, &x).expect("delta") {
                    let d: Vec<Vec<f32>> = d.to_vec2().expect("rows");
                    for i in 0..m {
                        want[i * fout + col0..i * fout + col0 + out].copy_from_slice(&d[i]);
                    }
                }
                col0 += out;
            }
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let err = got.iter().zip(&want).fold(0f32, |a, (g, w)| a.max((g - w).abs()));
            assert!(scale > 0.0 && err <= 1e-5 * scale, "{site:?}: err {err} of {scale}");
        }
        // The device buffer holds every site's tensors where its layout says, aligned.
        let (flat, at) = flatten(&packed);
        for (sites, ats) in packed.layers.iter().zip(&at) {
            for (s, a) in sites.iter().zip(ats) {
                let (Some(s), Some(a)) = (s, a) else {
                    assert!(s.is_none() && a.is_none());
                    continue;
                };
                assert_eq!((a.rows, a.fin, a.a % ALIGN), (s.rows, s.fin, 0));
                assert_eq!(&flat[a.a..a.a + s.a.len()], &s.a[..]);
                for (o, oa) in s.outs.iter().zip(&a.outs) {
                    assert_eq!((oa.col0, oa.out, oa.a_row0, oa.b % ALIGN), (o.col0, o.out, o.a_row0, 0));
                    assert_eq!(&flat[oa.b..oa.b + o.b.len()], &o.b[..]);
                }
            }
        }
        // The reserve covers the buffer of the largest adapter an adapter store admits, padding included.
        let all = LoraSpec { rank: DEFAULT_MAX_LORA_RANK, targets: &Target::ALL, ..spec };
        let big = dir.path().join("big");
        synth_lora(&big, &cfg, &all).expect("synth-lora");
        let big = pack(&LoraAdapter::load(&big, "big", &cfg, DEFAULT_MAX_LORA_RANK).expect("load"), &cfg)
            .expect("pack");
        let one = slot_bytes(&cfg, DType::BF16, DEFAULT_MAX_LORA_RANK);
        assert!(flatten(&big).0.len() * 2 <= one, "{} elements, {one} bytes", flatten(&big).0.len());
        assert!(flat.len() * 2 <= one);
        assert!(reserve_bytes(&cfg, DType::BF16, 2, DEFAULT_MAX_LORA_RANK, 64) > 2 * one);
        assert_eq!(reserve_bytes(&cfg, DType::BF16, 0, 64, 64), 0);
    }
}
