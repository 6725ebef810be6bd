"""PEFT's greedy logits for kvgate's LoRA reference test (worker/tests/lora_peft.rs), offline, fp32.

    python scripts/peft_reference.py BASE_DIR ADAPTER_DIR '[prompt ids]' STEPS

Prints JSON: {"logits": [the last position's logits after the prompt, then after each greedy token], "ids": [...]}.
Run by .venv-vllm's Python (transformers, torch, peft: scripts/vllm-requirements.txt).
"""

import json
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

base_dir, adapter_dir, ids_json, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
model = PeftModel.from_pretrained(model, adapter_dir).eval()
ids = json.loads(ids_json)
out = []
with torch.no_grad():
    for _ in range(steps + 1):
        logits = model(torch.tensor([ids])).logits[0, -1].tolist()
        out.append(logits)
        ids.append(max(range(len(logits)), key=logits.__getitem__))
print(json.dumps({"logits": out, "ids": ids}))
