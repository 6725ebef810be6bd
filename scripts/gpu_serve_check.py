#!/usr/bin/env python3
"""End to end on a GPU: `kvgate-worker serve --device cuda` against `--device cpu` on the same synthetic model
(float32 on both), greedy completions of the same prompts must be token-identical; the second request of a prompt
is a prefix-cache hit on both. Prints one JSON object; exits 1 on a mismatch.

usage: gpu_serve_check.py BIN MODEL_DIR
"""
import json
import os
import subprocess
import sys
import time
import urllib.request


def start(bin_, model, device, port):
    args = [bin_, "serve", "--model", model, "--device", device, "--dtype", "float32", "--port", str(port),
            "--host", "127.0.0.1", "--kv-cache-tokens", "16384"]
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


def main():
    bin_, model = sys.argv[1], sys.argv[2]
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
    print(json.dumps(out, indent=1))
    sys.exit(0 if all(same) else 1)


if __name__ == "__main__":
    main()
