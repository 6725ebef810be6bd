#!/usr/bin/env python3
"""Compares kvgate's CUDA-engine logits (written by `kvgate-worker gpu-logits`) with HF transformers'
LlamaForCausalLM on the same safetensors, on the GPU, eager attention. Prints one JSON object.

usage: gpu_compare_hf.py MODEL_DIR LOGITS_DIR DTYPE [DTYPE...]
Pass criteria: float32 max relative difference <= 1e-4 (max |a-b| / max |hf| per row, worst row); bfloat16
top-1 agreement >= 0.99 and max relative difference <= 0.05.
"""
import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

F32_TOL = 1e-4
BF16_TOL = 0.05
BF16_TOP1 = 0.99


def load(model_dir, dtype):
    kw = dict(attn_implementation="eager")
    try:
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
    except TypeError:
        m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype, **kw)
    return m.to("cuda").eval()


def main():
    model_dir, logits_dir, dtypes = sys.argv[1], sys.argv[2], sys.argv[3:]
    out = {}
    for name in dtypes:
        meta = json.load(open(f"{logits_dir}/logits-{name}.json"))
        vocab = meta["vocab"]
        ours = np.fromfile(f"{logits_dir}/logits-{name}.bin", dtype="<f4").reshape(-1, vocab)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
        if dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        model = load(model_dir, dtype)
        ids = torch.tensor([meta["tokens"]], device="cuda")
        with torch.no_grad():
            hf = model(ids).logits[0].float().cpu().numpy()
        per = {}
        worst, agree = 0.0, 0
        for row, r in zip(ours, meta["rows"]):
            ref = hf[r["position"]]
            rel = float(np.max(np.abs(row - ref)) / max(np.max(np.abs(ref)), 1e-12))
            same = int(np.argmax(row) == np.argmax(ref))
            worst = max(worst, rel)
            agree += same
            s = per.setdefault(r["scenario"], {"rows": 0, "max_rel_diff": 0.0, "top1_agree": 0})
            s["rows"] += 1
            s["max_rel_diff"] = max(s["max_rel_diff"], rel)
            s["top1_agree"] += same
        for s in per.values():
            s["top1_agree"] = s["top1_agree"] / s["rows"]
        top1 = agree / len(ours)
        ok = worst <= F32_TOL if name == "float32" else (top1 >= BF16_TOP1 and worst <= BF16_TOL)
        out[name] = {
            "vs_hf": {"rows": len(ours), "max_rel_diff": worst, "top1_agree": top1, "pass": ok,
                      "criterion": f"max_rel_diff <= {F32_TOL}" if name == "float32"
                      else f"top1 >= {BF16_TOP1} and max_rel_diff <= {BF16_TOL}"},
            "vs_hf_by_scenario": per,
            "vs_cpu_f32": meta.get("vs_cpu_f32"),
            "device": meta.get("device"),
        }
        del model
        torch.cuda.empty_cache()
    out["transformers"] = __import__("transformers").__version__
    out["torch"] = torch.__version__
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
