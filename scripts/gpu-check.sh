#!/usr/bin/env bash
# The GPU check: one prepared script for a machine with an NVIDIA driver, CUDA 13, and Python with PyTorch and
# transformers, but no Rust toolchain and no network. Build the binary on a build machine and bring it along:
#   cargo build --release -p kvgate-worker && strip -o .gpu/kvgate-worker target/release/kvgate-worker
#   scripts/gpu-check.sh .gpu/kvgate-worker          # results under $OUT (default /tmp/kvgate-gpu-check)
# Steps (about 5 minutes on an H200): nvidia-smi and the libraries found; `gpu-selftest` (every kernel against its
# CPU reference, f32 and bf16); logits of the `small` synthetic model on the GPU against the CPU engine and HF
# transformers (f32 and bf16; one-shot, decode, chunked, cached prefix, mixed batch); `serve --device cuda` against
# `--device cpu` end to end, then with a host DRAM and then an SSD KV tier under a small device pool (blocks copied
# down and back); `gpu-bench` on the Llama-3-8B shape; `calibrate --device cuda`; LoRA adapters on CUDA (logits
# with two synthesized adapters, a batch mixing them with the base model, against the CPU engine and HF
# transformers on merged weights, then with one device slot; `serve` with three adapters over two device slots,
# concurrent requests, against the CPU engine). Prints one table.
# STEPS=34 (say) runs only those steps (default: all, 1-7).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-.gpu/kvgate-worker}
OUT=${OUT:-/tmp/kvgate-gpu-check}
STEPS=${STEPS:-1234567}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
WORK=$(mktemp -d)
export KVGATE_CACHE_DIR="$WORK/cache"
status=0

# CUDA 13 libraries: the toolkit's first (its NVRTC matches the driver's CUDA version), then the Python wheels'
# (nvidia-cublas, nvidia-cuda-nvrtc).
LIBS=$($PY - <<'PY'
import glob, os
dirs = [d for d in ("/usr/local/cuda/lib64", "/usr/local/nvidia/lib64") if os.path.isdir(d)]
try:
    import nvidia
    for p in nvidia.__path__:
        dirs += sorted(glob.glob(os.path.join(p, "*", "lib")))
except Exception:
    pass
print(":".join(dirs))
PY
)
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

step() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
want() { [[ $STEPS == *$1* ]]; }

step "1. device and libraries"
"$BIN" synth-model --preset small --out "$WORK/small" >/dev/null
want 1 && {
nvidia-smi | tee "$OUT/nvidia-smi.txt"
for lib in libcuda.so.1 libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13; do
  found=$(for d in ${LD_LIBRARY_PATH//:/ } /usr/lib/x86_64-linux-gnu /usr/local/nvidia/lib64; do [ -e "$d/$lib" ] && echo "$d/$lib" && break; done)
  echo "$lib: ${found:-not found (loader default path)}"
done | tee -a "$OUT/nvidia-smi.txt"
"$BIN" --version
}

want 2 && { step "2. gpu-selftest"
timeout 120 "$BIN" gpu-selftest --json "$OUT/selftest.json" || status=1
}

want 3 && { step "3. logits: GPU vs CPU engine vs HF transformers (small synthetic model)"
for dt in float32 bfloat16; do
  timeout 120 "$BIN" gpu-logits --model "$WORK/small" --dtype "$dt" --out "$WORK/logits" || status=1
done
timeout 180 $PY scripts/gpu_compare_hf.py "$WORK/small" "$WORK/logits" float32 bfloat16 | tee "$OUT/logits.json" || status=1
}

want 4 && { step "4. serve --device cuda vs --device cpu (greedy, f32), then the KV tiers"
timeout 300 $PY scripts/gpu_serve_check.py "$BIN" "$WORK/small" | tee "$OUT/serve.json" || status=1
}

want 5 && { step "5. gpu-bench (Llama-3-8B shape, random bf16 weights)"
timeout 300 "$BIN" gpu-bench --json "$OUT/bench.json" > "$WORK/bench.out" 2>&1 || { status=1; tail -20 "$WORK/bench.out"; }
}

want 6 && { step "6. calibrate --device cuda (Llama-3-8B shape)"
name="gpu-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-' | sed 's/nvidia-//')-llama3-8b-measured"
timeout 240 "$BIN" calibrate --device cuda --llama3-8b --name "$name" --out "$OUT/$name.toml" || status=1
}

want 7 && { step "7. LoRA adapters on CUDA: logits vs CPU engine vs HF (merged), sub-batches, serve"
"$BIN" synth-lora --model "$WORK/small" --out "$WORK/lora-a" --seed 1 >/dev/null
"$BIN" synth-lora --model "$WORK/small" --out "$WORK/lora-b" --seed 2 --rank 16 --alpha 8 >/dev/null
for dt in float32 bfloat16; do
  timeout 120 "$BIN" gpu-logits --model "$WORK/small" --dtype "$dt" --out "$WORK/logits" \
    --lora "a=$WORK/lora-a" --lora "b=$WORK/lora-b" || status=1
done
timeout 240 $PY scripts/gpu_compare_hf.py "$WORK/small" "$WORK/logits" float32-lora bfloat16-lora | tee "$OUT/lora-logits.json" || status=1
# One device slot: every batch of two adapters runs as two, each adapter evicted and uploaded again.
timeout 120 "$BIN" gpu-logits --model "$WORK/small" --dtype float32 --out "$WORK/logits-1slot" \
  --lora "a=$WORK/lora-a" --lora "b=$WORK/lora-b" --gpu-lora-slots 1 | tee "$OUT/lora-1slot.json" || status=1
$PY -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d["max_rel_diff"] <= 1e-4 else 1)' \
  "$OUT/lora-1slot.json" || { echo "LoRA with 1 device slot: GPU vs CPU engine past 1e-4"; status=1; }
timeout 300 $PY scripts/gpu_serve_check.py "$BIN" "$WORK/small" --lora-only cuda | tee "$OUT/lora-serve.json" || status=1
}

step "summary"
$PY - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception as e:
        return None
st = load("selftest.json") or []
if st:
    print(f"selftest: {sum(c['pass'] for c in st)}/{len(st)} kernel cases pass"
      + "".join(f"\n  FAIL {c['kernel']} {c['dtype']} rel {c['rel_err']:.2e} ({c['shape']})" for c in st if not c["pass"]))
logits = {**(load("logits.json") or {}), **(load("lora-logits.json") or {})}
for dt in ("float32", "bfloat16", "float32-lora", "bfloat16-lora"):
    d = logits.get(dt)
    if d:
        h, c = d["vs_hf"], d.get("vs_cpu_f32") or {}
        lora = f", adapter effect {d['adapter_effect_min_rel']:.2e}" if "adapter_effect_min_rel" in d else ""
        print(f"logits {dt}: vs HF{' (merged)' if lora else ''} max rel {h['max_rel_diff']:.2e}, top-1 "
              f"{h['top1_agree']:.3f} ({h['rows']} rows{lora}) {'PASS' if h['pass'] else 'FAIL'} [{h['criterion']}]; "
              f"vs CPU engine max rel {c.get('max_rel_diff', float('nan')):.2e}, "
              f"top-1 {c.get('top1_agree', float('nan')):.3f}")
l1 = load("lora-1slot.json")
if l1:
    print(f"LoRA logits float32, 1 device slot: vs CPU engine max rel {l1.get('max_rel_diff', float('nan')):.2e}, "
          f"top-1 {l1.get('top1_agree', float('nan')):.3f} ({l1.get('rows')} rows)")
ls = load("lora-serve.json")
if ls:
    print(f"LoRA serve on CUDA (3 adapters, 2 device slots): {'PASS' if ls['ok'] else 'FAIL'} "
          f"(texts same as CPU {all(ls['same_as_cpu'].values())}, adapters change text {ls['adapters_change_text']}, "
          f"device uploads {ls['gpu_uploads']:.0f})")
sv = load("serve.json")
if sv:
    print(f"serve: CUDA greedy text identical to CPU: {sv['identical_greedy_text']}; cached tokens {sv['cuda_cached_tokens']}; "
          f"device {sv['cuda_device']}")
    for tier, what in (("host", "host DRAM"), ("disk", "SSD")):
        ht = sv.get(f"{tier}_tier") or {}
        print(f"{what} KV tier on CUDA (device -> {tier} -> device): {'PASS' if ht.get('ok') else 'FAIL'} "
              f"(text same as CPU {ht.get('same_as_cpu')}, cached {ht.get('a_again_cached_tokens')}, "
              f"blocks loaded from {tier} {ht.get(f'{tier}_loaded_blocks')})")
b = load("bench.json")
if b:
    print(f"bench on {b['gpu']}: copy {b['copy_gb_s']:.0f} GB/s, bf16 GEMM 8192^3 {b['gemm_bf16_8192_tflops']:.0f} TFLOP/s")
    for a in b["decode_attention"]:
        print(f"  paged decode attention ({a.get('kernel', 'simt')}) {a['seqs']} x {a['context']} ctx: {a['gb_s']:.0f} GB/s = {a['of_copy']:.0%} of copy")
    for p in b["prefill"]:
        print(f"  prefill {p['tokens']:>6} tokens: {p['tokens_per_s']:>9.0f} tok/s, {p['tflops']:.0f} TFLOP/s = "
              f"{p['of_gemm_peak']:.0%} of measured GEMM, {p['of_datasheet_989']:.0%} of 989")
    for d in b["decode"]:
        print(f"  decode batch {d['batch']:>3} @ {d['context']}: {d['step_ms']:.2f} ms/step, {d['tokens_per_s']:.0f} tok/s, "
              f"{d['of_roofline']:.0%} of roofline ({d['roofline_ms']:.2f} ms)")
    for p in b.get("prefill_attention_layer", []):
        print(f"  one layer's attention, 8K cold chunk, {p['path']}: {p['ms']:.2f} ms = {p['tflops']:.0f} TFLOP/s")
    if "prefill_8k_gemm_attention_ms" in b:
        print(f"  prefill 8192 on the GEMM attention path: {b['prefill_8k_gemm_attention_ms']:.0f} ms (flash: {b['flash_prefill']})")
    t = b.get("ttft_32k")
    if t:
        print(f"  TTFT 32K: cold {t['cold_ms']:.0f} ms, {t['cached_tokens']} cached {t['cached_ms']:.0f} ms, ratio {t['ratio']:.3f}")
PY
echo "gpu-check status $status; files in $OUT"
rm -rf "$WORK"
exit $status
