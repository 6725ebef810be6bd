#!/usr/bin/env python3
"""Compares kvgate's CUDA-engine logits (written by `kvgate-worker gpu-logits`) with HF transformers'
LlamaForCausalLM on the same safetensors, on the GPU, eager attention. Prints one JSON object.

usage: gpu_compare_hf.py MODEL_DIR LOGITS_DIR DTYPE [DTYPE...]
Pass criteria: float32 max relative difference <= 1e-4 (max |a-b| / max |hf| per row, worst row); bfloat16
top-1 agreement >= 0.99 and max relative difference <= 0.05.

A DTYPE of `float32-lora` / `bfloat16-lora` reads `gpu-logits --lora`'s files: each row names the adapter its
sequence ran with, and is compared with HF transformers on the base weights with that adapter merged in
(W + s B A, computed in float64 from the float32 weights, then cast to the dtype). Same criteria, and the adapter
must matter: its rows must differ from the base model's logits at the same positions by more than the tolerance
(`adapter_effect`), or the check could not tell a LoRA path that does nothing from one that works.
"""
import json
import math
import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

F32_TOL = 1e-4
BF16_TOL = 0.05
BF16_TOP1 = 0.99


DEVICE = os.environ.get("KVGATE_HF_DEVICE", "cuda")  # cpu: to check this script where no GPU is


def load(model_dir, dtype, adapter_dir=None):
    kw = dict(attn_implementation="eager")
    want = dtype
    if adapter_dir is not None:
        dtype = torch.float32  # merged in float64 from float32 weights, then cast
    try:
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
    except TypeError:
        m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype, **kw)
    if adapter_dir is not None:
        merge(m, adapter_dir)
        m = m.to(want)
    return m.to(DEVICE).eval()


def merge(model, adapter_dir):
    """W += s B A for every LoRA pair of a PEFT adapter (s = lora_alpha / r, or / sqrt(r) with rsLoRA)."""
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    r = cfg["r"]
    s = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    merged = 0
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            stem = key[: -len(".lora_A.weight")]
            b = tensors[stem + ".lora_B.weight"]
            name = stem.removeprefix("base_model.model.") + ".weight"
            w = params[name]
            w.copy_((w.double() + s * (b.double() @ a.double())).to(w.dtype))
            merged += 1
    if merged == 0:
        raise SystemExit(f"{adapter_dir}: no LoRA pairs")


def compare_rows(ours, rows, hf_of):
    """Per row: max |a-b| / max |ref| against the HF logits of its adapter (hf_of[adapter][position])."""
    per, worst, agree = {}, 0.0, 0
    for row, r in zip(ours, rows):
        ref = hf_of[r.get("adapter")][r["position"]]
        rel = float(np.max(np.abs(row - ref)) / max(np.max(np.abs(ref)), 1e-12))
        same = int(np.argmax(row) == np.argmax(ref))
        worst = max(worst, rel)
        agree += same
        key = r["scenario"] + (f" [{r['adapter']}]" if r.get("adapter") else "")
        s = per.setdefault(key, {"rows": 0, "max_rel_diff": 0.0, "top1_agree": 0})
        s["rows"] += 1
        s["max_rel_diff"] = max(s["max_rel_diff"], rel)
        s["top1_agree"] += same
    for s in per.values():
        s["top1_agree"] = s["top1_agree"] / s["rows"]
    return per, worst, agree / len(ours)


def main():
    model_dir, logits_dir, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    out = {}
    for name in names:
        meta = json.load(open(f"{logits_dir}/logits-{name}.json"))
        vocab = meta["vocab"]
        ours = np.fromfile(f"{logits_dir}/logits-{name}.bin", dtype="<f4").reshape(-1, vocab)
        base_name = name.removesuffix("-lora")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[base_name]
        if dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        dirs = {a["name"]: a["dir"] for a in meta.get("adapters") or []}
        ids = torch.tensor([meta["tokens"]], device=DEVICE)
        hf_of = {}
        for adapter in sorted({r.get("adapter") for r in meta["rows"]} | ({None} if dirs else set()), key=str):
            model = load(model_dir, dtype, dirs[adapter] if adapter else None)
            with torch.no_grad():
                hf_of[adapter] = model(ids).logits[0].float().cpu().numpy()
            del model
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        per, worst, top1 = compare_rows(ours, meta["rows"], hf_of)
        tol = F32_TOL if base_name == "float32" else BF16_TOL
        ok = worst <= tol if base_name == "float32" else (top1 >= BF16_TOP1 and worst <= tol)
        res = {
            "vs_hf": {"rows": len(ours), "max_rel_diff": worst, "top1_agree": top1, "pass": ok,
                      "criterion": f"max_rel_diff <= {F32_TOL}" if base_name == "float32"
                      else f"top1 >= {BF16_TOP1} and max_rel_diff <= {BF16_TOL}"},
            "vs_hf_by_scenario": per,
            "vs_cpu_f32": meta.get("vs_cpu_f32"),
            "device": meta.get("device"),
        }
        if dirs:
            # How far each adapter moves the logits from the base model's (HF on both): the check's sensitivity.
            effect = min(
                float(np.max(np.abs(hf_of[r["adapter"]][r["position"]] - hf_of[None][r["position"]]))
                      / max(np.max(np.abs(hf_of[None][r["position"]])), 1e-12))
                for r in meta["rows"] if r.get("adapter"))
            res["adapter_effect_min_rel"] = effect
            res["gpu_lora_slots"] = meta.get("gpu_lora_slots")
            res["vs_hf"]["pass"] = ok and effect > tol
            res["vs_hf"]["criterion"] += f" and adapter_effect > {tol}"
        out[name] = res
    out["transformers"] = __import__("transformers").__version__
    out["torch"] = torch.__version__
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
