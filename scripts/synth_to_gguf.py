#!/usr/bin/env python3
"""Converts a synthetic kvgate model (a Llama-architecture Hugging Face directory: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) to GGUF for llama.cpp, without torch: PyPI `gguf`'s writer, the byte-level
BPE tokenizer as llama.cpp's `gpt2` model, tensors renamed the llama.cpp way, and the q/k projection rows permuted
into llama.cpp's rotary layout (as llama.cpp's own converter does for Llama checkpoints). Used to serve the same
weights from llama.cpp's server (PyPI `llama-cpp-python[server]`) for the drop-in proof of issue #18.

usage: synth_to_gguf.py MODEL_DIR OUT.gguf
"""
import json
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotary halves -> llama.cpp's interleaved pairs, per head (llama.cpp's convert_hf_to_gguf `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def main() -> None:
    src, out = Path(sys.argv[1]), sys.argv[2]
    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // n_head)

    w = gguf.GGUFWriter(out, "llama")
    w.add_name(cfg.get("kvgate_synthetic", {}).get("preset", "kvgate-synthetic"))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    # Tokenizer: byte-level BPE; ids without a token become UNUSED placeholders, added tokens CONTROL.
    vocab = {t: i for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    tokens, types = [], []
    by_id = {i: t for t, i in vocab.items()}
    for i in range(cfg["vocab_size"]):
        if i in added:
            tokens.append(added[i])
            types.append(gguf.TokenType.CONTROL)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0])
    w.add_add_bos_token(False)
    template = (src / "chat_template.jinja").read_text() if (src / "chat_template.jinja").exists() \
        else tok_cfg.get("chat_template")
    if template:
        w.add_chat_template(template)

    t = load_file(str(src / "model.safetensors"))
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"].astype(np.float32))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names = {
            "attn_norm.weight": p + "input_layernorm.weight",
            "attn_q.weight": p + "self_attn.q_proj.weight",
            "attn_k.weight": p + "self_attn.k_proj.weight",
            "attn_v.weight": p + "self_attn.v_proj.weight",
            "attn_output.weight": p + "self_attn.o_proj.weight",
            "ffn_norm.weight": p + "post_attention_layernorm.weight",
            "ffn_gate.weight": p + "mlp.gate_proj.weight",
            "ffn_up.weight": p + "mlp.up_proj.weight",
            "ffn_down.weight": p + "mlp.down_proj.weight",
        }
        for dst, key in names.items():
            a = t[key].astype(np.float32)
            if dst == "attn_q.weight":
                a = permute(a, n_head)
            elif dst == "attn_k.weight":
                a = permute(a, n_kv)
            w.add_tensor(f"blk.{i}.{dst}", a)
    w.add_tensor("output_norm.weight", t["model.norm.weight"].astype(np.float32))
    if not cfg.get("tie_word_embeddings", False):
        w.add_tensor("output.weight", t["lm_head.weight"].astype(np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{out}: {len(tokens)} tokens, {cfg['num_hidden_layers']} layers")


if __name__ == "__main__":
    main()
