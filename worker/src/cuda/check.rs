//! The GPU check's measurements: `gpu-logits` (the CUDA engine's logits against the CPU engine on the same
//! weights, in the scenarios that exercise every path: one-shot prefill, decode steps, chunked prefill, a cached
//! prefix, a mixed batch; with `--lora`, the same with LoRA adapters and a batch mixing them; written out for the
//! comparison with HF transformers) and `gpu-bench` (copy bandwidth, GEMM rate, paged decode attention bandwidth,
//! prefill and decode throughput, TTFT with a cached prefix).

use std::path::Path;

use serde_json::json;

use super::attention::{self, Heads};
use super::backend::{CudaBackend, GpuModel};
use super::forward::{as_bytes, GpuChunk, Out, Want};
use super::gpu::{Gpu, GpuResult};
use super::DType;
use crate::engine::{Backend, BatchItem, CpuBackend, Next};
use crate::model::llama::LlamaModel;
use crate::model::lora::{LoraAdapter, DEFAULT_MAX_LORA_RANK};
use crate::model::ModelConfig;

const BS: usize = 16;

/// One logits vector requested from the engines: which scenario, at which position of the shared token sequence.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    pub scenario: &'static str,
    pub position: usize,
    /// The LoRA adapter its sequence ran with (`gpu-logits --lora`); absent: the base model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
}

/// A chunk of the script: tokens `start..start + len` of sequence `seq` (slot table `tables[seq]`).
struct Step {
    seq: usize,
    start: usize,
    len: usize,
    want: bool,
    scenario: &'static str,
}

/// Slots of a sequence from its block ids.
fn slots(blocks: &[usize]) -> Vec<usize> {
    blocks.iter().flat_map(|b| b * BS..(b + 1) * BS).collect()
}

/// The scenario script over `len` (96) tokens: batches of steps run in order. With `lora`, four more sequences
/// and a batch that mixes adapters (see [`LORA_OF_SEQ`]).
fn script(len: usize, lora: bool) -> (Vec<Vec<usize>>, Vec<Vec<Step>>) {
    let nb = len / BS; // 6
    let own = |first: usize| (first..first + nb).collect::<Vec<usize>>();
    // seq 0 single; 1 decode; 2 chunked; 3 cached (A's first 4 blocks); 4 mixed prefill; 5 mixed decode (A's first 5)
    let mut cached: Vec<usize> = (0..4).collect();
    cached.extend(40..40 + nb - 4);
    let mut shared5: Vec<usize> = (0..5).collect();
    shared5.extend(60..60 + nb - 5);
    let tables = vec![own(0), own(10), own(20), cached, own(50), shared5];
    let s = |seq, start, len, want, scenario| Step { seq, start, len, want, scenario };
    let mut batches = vec![vec![s(0, 0, len, true, "single")], vec![s(1, 0, 32, true, "decode")]];
    for p in 32..len {
        batches.push(vec![s(1, p, 1, true, "decode")]);
    }
    for c in 0..len / 24 {
        batches.push(vec![s(2, c * 24, 24, true, "chunked")]);
    }
    batches.push(vec![s(3, 64, len - 64, true, "cached")]);
    batches.push(vec![s(5, 0, 80, false, "mixed")]);
    batches.push(vec![s(4, 0, 40, true, "mixed"), s(5, 80, 1, true, "mixed")]);
    let mut tables = tables;
    if lora {
        // 6 base, 7 and 9 the first adapter (neighbours in the batch: one run of rows), 8 the second.
        tables.extend([vec![26, 27, 28], vec![30, 31, 32], vec![70, 71, 72], vec![74]]);
        batches.push(vec![
            s(7, 0, 48, true, "mixed_adapters"),
            s(9, 0, 1, true, "mixed_adapters"),
            s(6, 0, 48, true, "mixed_adapters"),
            s(8, 0, 48, true, "mixed_adapters"),
        ]);
    }
    (tables, batches)
}

/// With `gpu-logits --lora A [--lora B]`: the adapter of each sequence of the script (an index into the adapters,
/// the second wrapping to the first when only one is given; `None`: the base model). Sequences that share blocks
/// (0, 3 and 5) run with the same adapter, since a block's KV is its adapter's; 4 and 5 make the last `mixed`
/// batch one of two adapters, and `mixed_adapters` runs the base model (6) beside two adapters in one batch.
pub const LORA_OF_SEQ: [Option<usize>; 10] =
    [Some(0), Some(1), None, Some(0), Some(1), Some(0), None, Some(0), Some(1), Some(0)];

/// LoRA adapters for [`logits`]: `(name, dir)` each, and the device slots the CUDA engine gets (fewer than the
/// adapters: a batch naming more runs as sub-batches, and adapters are evicted and uploaded again).
#[derive(Clone, Debug, Default)]
pub struct LoraRun {
    pub adapters: Vec<(String, std::path::PathBuf)>,
    pub slots: usize,
}

/// Runs the script on the GPU (and the CPU engine when `cpu`); writes `logits-<dtype>.bin` (f32 rows) and
/// `logits-<dtype>.json` under `out` (`logits-<dtype>-lora.*` with adapters, each row naming its adapter; the GPU
/// then runs through the engine's `Backend::forward`, as serving does), and returns the JSON summary.
pub fn logits(
    dir: &Path,
    ordinal: usize,
    dt: DType,
    out: &Path,
    cpu: bool,
    lora: &LoraRun,
) -> GpuResult<serde_json::Value> {
    let len = 96;
    let l = GpuModel::from_dir(dir, ordinal, dt)?;
    let cfg = l.cfg.clone();
    let vocab = cfg.vocab_size;
    let tokens: Vec<u32> = (0..len).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    let with_lora = !lora.adapters.is_empty();
    let (tables, batches) = script(len, with_lora);
    let slot_tables: Vec<Vec<usize>> = tables.iter().map(|t| slots(t)).collect();
    let num_slots = 80 * BS;
    let adapters: Vec<LoraAdapter> = lora
        .adapters
        .iter()
        .map(|(name, d)| LoraAdapter::load(d, name, &cfg, DEFAULT_MAX_LORA_RANK).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let adapter_of = |seq: usize| match with_lora {
        true => LORA_OF_SEQ[seq].map(|i| &adapters[i % adapters.len()]),
        false => None,
    };
    let mut gpu =
        CudaBackend::new(l, num_slots, BS)?.with_adapter_slots(if with_lora { lora.slots.max(1) } else { 0 });
    let mut cpu_backend = if cpu {
        Some(CpuBackend::new(LlamaModel::load(dir).map_err(|e| e.to_string())?, num_slots))
    } else {
        None
    };
    let mut rows = Vec::new();
    let mut gpu_rows: Vec<Vec<f32>> = Vec::new();
    let mut cpu_rows: Vec<Vec<f32>> = Vec::new();
    for batch in &batches {
        let items: Vec<BatchItem<'_>> = batch
            .iter()
            .map(|s| BatchItem {
                tokens: &tokens,
                start: s.start,
                len: s.len,
                slots: slot_tables[s.seq].clone(),
                want_next: s.want,
                greedy: false,
                adapter: adapter_of(s.seq),
            })
            .collect();
        let got: Vec<Option<Vec<f32>>> = match with_lora {
            true => Backend::forward(&mut gpu, &items)
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|o| match o {
                    Some(Next::Logits(l)) => Some(l),
                    _ => None,
                })
                .collect(),
            false => {
                let chunks: Vec<GpuChunk<'_>> = batch
                    .iter()
                    .map(|s| GpuChunk {
                        tokens: &tokens[s.start..s.start + s.len],
                        start: s.start,
                        slots: &slot_tables[s.seq],
                        want: if s.want { Want::Logits } else { Want::Nothing },
                        adapter: None,
                    })
                    .collect();
                gpu.run(&chunks)?
                    .into_iter()
                    .map(|o| match o {
                        Some(Out::Logits(l)) => Some(l),
                        _ => None,
                    })
                    .collect()
            }
        };
        let cpu_got = match cpu_backend.as_mut() {
            Some(c) => Some(Backend::forward(c, &items).map_err(|e| e.to_string())?),
            None => None,
        };
        for (i, s) in batch.iter().enumerate() {
            if !s.want {
                continue;
            }
            let Some(v) = &got[i] else {
                return Err(format!("no logits for {}", s.scenario).into());
            };
            let adapter = adapter_of(s.seq).map(|a| a.name.clone());
            rows.push(Row { scenario: s.scenario, position: s.start + s.len - 1, adapter });
            gpu_rows.push(v.clone());
            if let Some(c) = &cpu_got {
                match &c[i] {
                    Some(Next::Logits(l)) => cpu_rows.push(l.clone()),
                    _ => return Err("the CPU engine returned no logits".into()),
                }
            }
        }
    }
    let flat: Vec<f32> = gpu_rows.iter().flatten().copied().collect();
    std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
    let name = format!("{}{}", dt.hf_name(), if with_lora { "-lora" } else { "" });
    std::fs::write(out.join(format!("logits-{name}.bin")), as_bytes(&flat)).map_err(|e| e.to_string())?;
    let vs_cpu = (!cpu_rows.is_empty()).then(|| agreement(&gpu_rows, &cpu_rows));
    let summary = json!({
        "model": dir.display().to_string(),
        "dtype": dt.hf_name(),
        "device": gpu.describe(),
        "vocab": vocab,
        "tokens": tokens,
        "rows": rows,
        "vs_cpu_f32": vs_cpu,
        "adapters": adapters.iter().zip(&lora.adapters).map(|(a, (_, d))| json!({
            "name": a.name, "dir": d.display().to_string(), "key": a.key, "rank": a.rank, "scaling": a.scaling,
        })).collect::<Vec<_>>(),
        "gpu_lora_slots": gpu.adapter_slots(),
    });
    std::fs::write(out.join(format!("logits-{name}.json")), summary.to_string())
        .map_err(|e| e.to_string())?;
    Ok(summary)
}

/// Max relative difference (max |a-b| over max |b|, per row, worst row) and top-1 agreement.
pub fn agreement(a: &[Vec<f32>], b: &[Vec<f32>]) -> serde_json::Value {
    let argmax = |v: &[f32]| crate::engine::sampler::argmax(v);
    let mut worst = 0f64;
    let mut same = 0;
    for (x, y) in a.iter().zip(b) {
        let scale = y.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-12);
        let err = x.iter().zip(y).fold(0f64, |m, (p, q)| m.max((*p as f64 - *q as f64).abs()));
        worst = worst.max(err / scale);
        same += usize::from(argmax(x) == argmax(y));
    }
    json!({"rows": a.len(), "max_rel_diff": worst, "top1_agree": same as f64 / a.len().max(1) as f64})
}

/// Llama-3-8B's shape (random weights are made on the device).
pub fn llama3_8b() -> ModelConfig {
    let text = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,
        "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,
        "rms_norm_eps":1e-5,"rope_theta":500000.0,"max_position_embeddings":131072,"tie_word_embeddings":false,
        "bos_token_id":128000,"eos_token_id":128001,"torch_dtype":"bfloat16",
        "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
        "original_max_position_embeddings":8192}}"#;
    ModelConfig::from_json(text, "llama3-8b (built in)").expect("the built-in shape is valid")
}

/// Milliseconds of `f` on the device (median of `reps` after one warm-up).
fn time_ms(
    b: &mut CudaBackend,
    reps: usize,
    mut f: impl FnMut(&mut CudaBackend) -> GpuResult<()>,
) -> GpuResult<f64> {
    f(b)?;
    let mut t = Vec::new();
    for _ in 0..reps {
        let start = b.gpu().event()?;
        f(b)?;
        let end = b.gpu().event()?;
        t.push(end.ms_since(&start)? as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// FLOPs of a chunk of `n` tokens after `start` cached ones: the matmuls (2 x params x n) and causal attention.
fn chunk_flops(cfg: &ModelConfig, start: usize, n: usize, logits_rows: usize) -> f64 {
    let (h, q, kv, i) =
        (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.kv_dim(), cfg.intermediate_size);
    let per_layer = (h * (q + 2 * kv) + q * h + 3 * h * i) as f64;
    let mm = 2.0 * n as f64 * per_layer * cfg.num_hidden_layers as f64;
    let keys: f64 = (0..n).map(|t| (start + t + 1) as f64).sum();
    let att = 4.0 * keys * q as f64 * cfg.num_hidden_layers as f64;
    mm + att + 2.0 * (logits_rows * h * cfg.vocab_size) as f64
}

/// Milliseconds of `f` on the device (median of `reps` after one warm-up).
fn time_gpu(gpu: &Gpu, reps: usize, mut f: impl FnMut() -> GpuResult<()>) -> GpuResult<f64> {
    f()?;
    let mut t = Vec::new();
    for _ in 0..reps {
        let start = gpu.event()?;
        f()?;
        let end = gpu.event()?;
        t.push(end.ms_since(&start)? as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// The kernels alone, on Llama-3-8B's attention shape: copy bandwidth, the GEMM rate, paged decode attention at
/// 32K context, and one layer's prefill attention of an 8K chunk (flash kernel and GEMM path).
pub fn kernel_bench(gpu: &Gpu) -> GpuResult<serde_json::Value> {
    let dt = DType::BF16;
    let mut report = json!({"gpu": gpu.name});
    // Copy bandwidth (read + write bytes) and the GEMM rate, measured now.
    let copy_bytes = 2usize << 30;
    let (src, dst) = (gpu.zeros(copy_bytes)?, gpu.zeros(copy_bytes)?);
    let copy_ms = time_gpu(gpu, 5, || gpu.copy(dst.ptr(), src.ptr(), copy_bytes))?;
    let copy_gbs = 2.0 * copy_bytes as f64 / (copy_ms / 1e3) / 1e9;
    drop((src, dst));
    let nmk = 8192usize;
    let (x, w, y) = (gpu.zeros(nmk * nmk * 2)?, gpu.zeros(nmk * nmk * 2)?, gpu.zeros(nmk * nmk * 2)?);
    let gemm_ms =
        time_gpu(gpu, 5, || gpu.linear(dt, dt, y.ptr(), nmk, x.ptr(), nmk, w.ptr(), nmk, nmk, nmk))?;
    let gemm_tflops = 2.0 * (nmk as f64).powi(3) / (gemm_ms / 1e3) / 1e12;
    drop((x, w, y));
    report["copy_gb_s"] = json!(copy_gbs);
    report["gemm_bf16_8192_tflops"] = json!(gemm_tflops);

    // Paged decode attention at 32K context (one layer's pool, shuffled blocks).
    let h = Heads { heads: 32, kv_heads: 8, head_dim: 128, block_size: BS };
    let kvd = h.kv_heads * h.head_dim;
    let mut att = Vec::new();
    let (tc_ok, _) = super::selftest::decode_tc_agrees(gpu, dt, h)?;
    for seqs in [1usize, 8] {
        let ctx = 32_768usize;
        let nb = ctx / BS;
        let tables: Vec<i32> = (0..seqs * nb).map(|i| ((i * 7919) % (seqs * nb)) as i32).collect();
        let rows: Vec<i32> = (0..seqs as i32).collect();
        let ctxs = vec![ctx as i32; seqs];
        let (tb, rb, cb) = (gpu.upload_new(&tables)?, gpu.upload_new(&rows)?, gpu.upload_new(&ctxs)?);
        let (kc, vc) = (gpu.zeros(seqs * ctx * kvd * 2)?, gpu.zeros(seqs * ctx * kvd * 2)?);
        let (q, o) = (gpu.zeros(seqs * 4096 * 2)?, gpu.zeros(seqs * 4096 * 2)?);
        let part = gpu.zeros(attention::decode_part_bytes(h, seqs, attention::decode_splits(ctx)))?;
        for tc in [true, false] {
            if tc && !tc_ok {
                continue;
            }
            let l = attention::Layer { q: q.ptr(), o: o.ptr(), kc: kc.ptr(), vc: vc.ptr() };
            let d = attention::DecodeBatch {
                rows: rb.ptr(),
                ctx: cb.ptr(),
                tables: tb.ptr(),
                max_blocks: nb,
                seqs,
                max_ctx: ctx,
            };
            let ms = time_gpu(gpu, 20, || attention::decode(gpu, dt, h, l, d, part.ptr(), tc))?;
            let bytes = (seqs * ctx * kvd * 2 * 2) as f64;
            let gbs = bytes / (ms / 1e3) / 1e9;
            att.push(
                json!({"kernel": if tc { "tensor-cores" } else { "simt" }, "seqs": seqs, "context": ctx,
                "ms": ms, "gb_s": gbs, "of_copy": gbs / copy_gbs}),
            );
        }
    }
    report["decode_attention"] = json!(att);

    // One layer's causal attention of an 8K cold chunk.
    let n = 8192usize;
    let table: Vec<i32> = (0..(n / BS) as i32).rev().collect();
    let tb = gpu.upload_new(&table)?;
    let (kc, vc) = (super::weights::upload_as(gpu, dt, &vec![0.01f32; n * kvd])?, gpu.zeros(n * kvd * 2)?);
    let (q, o) = (gpu.zeros(n * 4096 * 2)?, gpu.zeros(n * 4096 * 2)?);
    let flops = 4.0 * (n as f64) * (n as f64 + 1.0) / 2.0 * 4096.0;
    let mut pf = Vec::new();
    let (flash_ok, _) = super::selftest::flash_agrees(gpu, dt, h)?;
    for flash in [true, false] {
        if flash && !flash_ok {
            continue;
        }
        let mut scratch = attention::PrefillScratch::default();
        scratch.flash = flash;
        let l = attention::Layer { q: q.ptr(), o: o.ptr(), kc: kc.ptr(), vc: vc.ptr() };
        let ms = time_gpu(gpu, 5, || attention::prefill(gpu, dt, h, l, tb.ptr(), 0, 0, n, &mut scratch))?;
        pf.push(json!({"path": if flash { "flash" } else { "gemm" }, "tokens": n, "ms": ms,
            "tflops": flops / (ms / 1e3) / 1e12}));
    }
    report["prefill_attention_layer"] = json!(pf);
    Ok(report)
}

/// `gpu-bench`: everything in one JSON object (and a printed table). `kernels_only`: [`kernel_bench`] alone.
pub fn bench(ordinal: usize, quick: bool, kernels_only: bool) -> GpuResult<serde_json::Value> {
    let mut report = {
        let gpu = Gpu::open(ordinal)?;
        kernel_bench(&gpu)?
    };
    if kernels_only {
        return Ok(report);
    }
    let copy_gbs = report["copy_gb_s"].as_f64().unwrap_or(1.0);
    let gemm_tflops = report["gemm_bf16_8192_tflops"].as_f64().unwrap_or(1.0);
    let cfg = llama3_8b();
    let dt = DType::BF16;
    let l = GpuModel::random(cfg.clone(), ordinal, dt, 1)?;
    let weights_gb = l.weights.step_bytes() as f64 / 1e9;
    let kv_tokens = 256 * 2048 + 40 * 1024;
    let mut b = CudaBackend::new(l, kv_tokens, BS)?;
    report["device"] = json!(b.describe());
    report["model"] = json!("llama3-8b shape, random bf16 weights");
    report["weights_gb_read_per_step"] = json!(weights_gb);

    // Prefill throughput (one cold sequence; chunks of at most 8192 tokens, as --max-num-batched-tokens 8192).
    let vocab = cfg.vocab_size;
    let longest = if quick { 8192 } else { 32_768 };
    let tokens: Vec<u32> = (0..longest).map(|i| ((i * 7919 + 1) % vocab) as u32).collect();
    let seq_slots: Vec<usize> = (0..longest).collect();
    let mut pre = Vec::new();
    let mut cold_32k_ms = None;
    for n in [2048usize, 8192, 32_768].into_iter().filter(|n| *n <= longest) {
        let ms = time_ms(&mut b, 2, |b| {
            let mut s = 0;
            while s < n {
                let len = 8192.min(n - s);
                let want = if s + len == n { Want::Argmax } else { Want::Nothing };
                b.run(&[GpuChunk {
                    tokens: &tokens[s..s + len],
                    start: s,
                    slots: &seq_slots,
                    want,
                    adapter: None,
                }])?;
                s += len;
            }
            Ok(())
        })?;
        let flops: f64 =
            (0..n.div_ceil(8192)).map(|c| chunk_flops(&cfg, c * 8192, 8192.min(n - c * 8192), 1)).sum();
        let tflops = flops / (ms / 1e3) / 1e12;
        pre.push(json!({"tokens": n, "ms": ms, "tokens_per_s": n as f64 / (ms / 1e3), "tflops": tflops,
            "of_gemm_peak": tflops / gemm_tflops, "of_datasheet_989": tflops / 989.0}));
        if n == 32_768 {
            cold_32k_ms = Some(ms);
        }
    }
    report["prefill"] = json!(pre);
    // The same 8K prefill on the GEMM attention path (the fallback, and f32's path).
    if b.flash() {
        b.set_flash(false);
        let ms = time_ms(&mut b, 2, |b| {
            b.run(&[GpuChunk {
                tokens: &tokens[..8192],
                start: 0,
                slots: &seq_slots,
                want: Want::Argmax,
                adapter: None,
            }])
            .map(|_| ())
        })?;
        b.set_flash(true);
        report["prefill_8k_gemm_attention_ms"] = json!(ms);
    }
    report["flash_prefill"] = json!(b.flash());
    report["tensor_core_decode"] = json!(b.decode_tc());

    // TTFT with 90% of a 32K prompt cached (whole blocks) vs cold.
    if let Some(cold) = cold_32k_ms {
        let cached = (32_768 * 9 / 10) / BS * BS;
        let ms = time_ms(&mut b, 3, |b| {
            b.run(&[GpuChunk {
                tokens: &tokens[cached..],
                start: cached,
                slots: &seq_slots,
                want: Want::Argmax,
                adapter: None,
            }])
            .map(|_| ())
        })?;
        report["ttft_32k"] =
            json!({"cold_ms": cold, "cached_tokens": cached, "cached_ms": ms, "ratio": ms / cold});
    }

    // Decode throughput at 2K context.
    let ctx = 2048usize;
    let step_tokens: Vec<u32> = (0..=ctx).map(|i| ((i * 31 + 7) % vocab) as u32).collect();
    let per_token_kv = super::forward::GpuKv::bytes_per_token(&cfg, dt) as f64;
    let mut dec = Vec::new();
    let batches: &[usize] = if quick { &[1, 64] } else { &[1, 8, 64, 256] };
    for &batch in batches {
        let tables: Vec<Vec<usize>> =
            (0..batch).map(|s| (s * (ctx + BS)..(s + 1) * (ctx + BS)).collect()).collect();
        let ms = time_ms(&mut b, 10, |b| {
            let chunks: Vec<GpuChunk<'_>> = tables
                .iter()
                .map(|t| GpuChunk {
                    tokens: &step_tokens[ctx..],
                    start: ctx,
                    slots: t,
                    want: Want::Argmax,
                    adapter: None,
                })
                .collect();
            b.run(&chunks).map(|_| ())
        })?;
        let bytes = weights_gb * 1e9 + batch as f64 * (ctx + 1) as f64 * per_token_kv;
        let roofline_ms = bytes / (copy_gbs * 1e9) * 1e3;
        dec.push(
            json!({"batch": batch, "context": ctx, "step_ms": ms, "tokens_per_s": batch as f64 / (ms / 1e3),
            "roofline_ms": roofline_ms, "of_roofline": roofline_ms / ms}),
        );
    }
    report["decode"] = json!(dec);
    Ok(report)
}
