#!/usr/bin/env python3
"""End to end on a GPU: `kvgate-worker serve --device cuda` against `--device cpu` on the same synthetic model
(float32 on both), greedy completions of the same prompts must be token-identical; the second request of a prompt
is a prefix-cache hit on both; then the KV tiers on the GPU (`tiered`: host DRAM, then SSD). Prints one JSON object;
exits 1 on a mismatch.

usage: gpu_serve_check.py BIN MODEL_DIR [--tiers-only [DEVICE]]
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request


def start(bin_, model, device, port, extra=("--kv-cache-tokens", "16384")):
    args = [bin_, "serve", "--model", model, "--device", device, "--dtype", "float32", "--port", str(port),
            "--host", "127.0.0.1", *extra]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(f"/tmp/serve-{device}.log", "w"))
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    return p
        except Exception:
            time.sleep(0.1)
    p.kill()
    raise SystemExit(f"{device} worker did not become ready: " + open(f"/tmp/serve-{device}.log").read()[-2000:])


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t = time.time()
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r), time.time() - t


def tiered(bin_, model, device, port, want, tier="host"):
    """A device pool of 4,096 tokens over a 1 GB tier (`host`: DRAM; `disk`: SSD segment files in a temporary
    directory, no host tier): A, then B (which evicts A to the tier), then A again, whose prefix is loaded back (K/V
    copied device -> tier -> device). A's text must be the same all three times and the same as `want` (the CPU
    engine's), its third request must find cached tokens, and the worker's metrics must show blocks loaded from the
    tier."""
    a = " ".join(f"a{i}" for i in range(600))
    b = " ".join(f"b{i}" for i in range(600))
    tmp = tempfile.TemporaryDirectory()
    if tier == "host":
        flags, metric = ["--host-kv-bytes", "1000000000"], "kvgate_worker_host_kv_hit_blocks"
    else:
        flags = ["--disk-kv-bytes", "1000000000", "--disk-kv-path", tmp.name]
        metric = "kvgate_worker_disk_kv_read_blocks"
    p = start(bin_, model, device, port, ["--kv-cache-tokens", "4096", *flags])
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
            card = json.load(r)["data"][0]
        outs = []
        for prompt in (a, b, a):
            body, _ = post(port, {"model": card["id"], "prompt": prompt, "max_tokens": 16, "temperature": 0})
            outs.append(body)
            time.sleep(0.5)  # the SSD tier writes on its own IO thread
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            metrics = r.read().decode()
    finally:
        p.terminate()
        p.wait(timeout=30)
        tmp.cleanup()
    loaded = sum(float(l.split()[-1]) for l in metrics.splitlines() if l.startswith(metric))
    texts = [o["choices"][0]["text"] for o in outs]
    cached = outs[2]["usage"].get("prompt_tokens_details", {}).get("cached_tokens") or 0
    ok = texts[0] == texts[2] == want and cached > 0 and loaded > 0
    return {"ok": ok, "a_text_same": texts[0] == texts[2], "same_as_cpu": texts[0] == want,
            "a_again_cached_tokens": cached, f"{tier}_loaded_blocks": loaded,
            "prompt_tokens": outs[0]["usage"]["prompt_tokens"]}


def main():
    bin_, model = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3 and sys.argv[3] == "--tiers-only":
        # Local check of the tier round trip on one device (e.g. cpu against itself).
        device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
        a = " ".join(f"a{i}" for i in range(600))
        p = start(bin_, model, "cpu", 18302)
        try:
            with urllib.request.urlopen("http://127.0.0.1:18302/v1/models") as r:
                mid = json.load(r)["data"][0]["id"]
            want = post(18302, {"model": mid, "prompt": a, "max_tokens": 16, "temperature": 0})[0]
        finally:
            p.terminate()
            p.wait(timeout=30)
        t = {tier: tiered(bin_, model, device, 18303, want["choices"][0]["text"], tier) for tier in ("host", "disk")}
        print(json.dumps(t, indent=1))
        sys.exit(0 if all(v["ok"] for v in t.values()) else 1)
    prompts = [" ".join(f"w{i}" for i in range(n)) for n in (5, 300, 1200)]
    results = {}
    for device, port in (("cuda", 18301), ("cpu", 18302)):
        p = start(bin_, model, device, port)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
                card = json.load(r)["data"][0]
            outs = []
            for prompt in prompts:
                for _ in range(2):
                    body, secs = post(port, {"model": card["id"], "prompt": prompt, "max_tokens": 16,
                                             "temperature": 0})
                    outs.append({"text": body["choices"][0]["text"], "usage": body["usage"], "secs": secs})
            results[device] = {"device": card.get("device"), "outputs": outs}
        finally:
            p.terminate()
            p.wait(timeout=30)
    same = [a["text"] == b["text"] for a, b in zip(results["cuda"]["outputs"], results["cpu"]["outputs"])]
    cached = [o["usage"].get("prompt_tokens_details", {}).get("cached_tokens") for o in results["cuda"]["outputs"]]
    out = {"identical_greedy_text": all(same), "per_request_identical": same, "cuda_cached_tokens": cached,
           "cuda_device": results["cuda"]["device"], "cpu_device": results["cpu"]["device"],
           "cuda_secs": [round(o["secs"], 3) for o in results["cuda"]["outputs"]],
           "cpu_secs": [round(o["secs"], 3) for o in results["cpu"]["outputs"]]}
    # The KV tiers on the GPU: blocks copied down to host DRAM and back give the CPU engine's text.
    p = start(bin_, model, "cpu", 18302)
    try:
        a = " ".join(f"a{i}" for i in range(600))
        want = post(18302, {"model": card["id"], "prompt": a, "max_tokens": 16, "temperature": 0})[0]
    finally:
        p.terminate()
        p.wait(timeout=30)
    out["host_tier"] = tiered(bin_, model, "cuda", 18303, want["choices"][0]["text"], "host")
    out["disk_tier"] = tiered(bin_, model, "cuda", 18303, want["choices"][0]["text"], "disk")
    print(json.dumps(out, indent=1))
    sys.exit(0 if all(same) and out["host_tier"]["ok"] and out["disk_tier"]["ok"] else 1)


if __name__ == "__main__":
    main()
