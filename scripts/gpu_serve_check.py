#!/usr/bin/env python3
"""End to end on a GPU: `kvgate-worker serve --device cuda` against `--device cpu` on the same synthetic model
(float32 on both), greedy completions of the same prompts must be token-identical; the second request of a prompt
is a prefix-cache hit on both; then the KV tiers on the GPU (`tiered`: host DRAM, then SSD). With `--lora-only
DEVICE`, LoRA adapters instead (`lora`: three synthesized adapters and the base model, concurrent requests so
batches mix them, two device slots on CUDA so batches of three adapters run as sub-batches and adapters are evicted
and uploaded again). Prints one JSON object; exits 1 on a mismatch.

usage: gpu_serve_check.py BIN MODEL_DIR [--tiers-only [DEVICE] | --lora-only [DEVICE]]
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
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


def lora(bin_, model, device, port=18304):
    """Greedy completions for the base model and three adapters on two prompts, on `device` and on the CPU engine
    (the reference: it matches PEFT), sent eight at a time so the engine batches different adapters together, then
    again one by one (prefix-cache hits under each adapter's key). `--max-gpu-loras 2` on CUDA: a batch naming three
    adapters runs as two, and adapters leave the device and come back."""
    tmp = tempfile.TemporaryDirectory()
    names = ["a", "b", "c"]
    flags = []
    for seed, name in enumerate(names, start=1):
        d = os.path.join(tmp.name, name)
        subprocess.run([bin_, "synth-lora", "--model", model, "--out", d, "--seed", str(seed)], check=True,
                       stdout=subprocess.DEVNULL)
        flags += ["--lora", f"{name}={d}"]
    prompts = [" ".join(f"q{i}" for i in range(n)) for n in (7, 400)]
    results = {}
    for dev, p_ in ((device, port), ("cpu", port + 1)):
        extra = ["--kv-cache-tokens", "16384", *flags] + (["--max-gpu-loras", "2"] if dev == "cuda" else [])
        p = start(bin_, model, dev, p_, extra)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{p_}/v1/models") as r:
                cards = json.load(r)["data"]
            base = next(c["id"] for c in cards if not c.get("parent"))
            models = [base, *names]
            jobs = [(m, i) for m in models for i in range(len(prompts))]
            first = {}

            def one(job):
                m, i = job
                body, _ = post(p_, {"model": m, "prompt": prompts[i], "max_tokens": 16, "temperature": 0})
                first[job] = body

            threads = [threading.Thread(target=one, args=(j,)) for j in jobs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            again = {j: post(p_, {"model": j[0], "prompt": prompts[j[1]], "max_tokens": 16, "temperature": 0})[0]
                     for j in jobs}
            with urllib.request.urlopen(f"http://127.0.0.1:{p_}/metrics") as r:
                metrics = r.read().decode()
        finally:
            p.terminate()
            p.wait(timeout=30)
        results[dev] = {
            "listed": sorted(c["id"] for c in cards if c.get("parent")),
            "text": {f"{m}/{i}": first[(m, i)]["choices"][0]["text"] for m, i in jobs},
            "text_again": {f"{m}/{i}": again[(m, i)]["choices"][0]["text"] for m, i in jobs},
            "cached_again": {f"{m}/{i}": (again[(m, i)]["usage"].get("prompt_tokens_details") or {})
                             .get("cached_tokens") or 0 for m, i in jobs},
            "gpu_uploads": sum(float(l.split()[-1]) for l in metrics.splitlines()
                               if l.startswith("kvgate_worker_lora_gpu_uploads_total")),
        }
    tmp.cleanup()
    got, want = results[device], results["cpu"]
    same = {k: got["text"][k] == want["text"][k] == got["text_again"][k] for k in want["text"]}
    # Each adapter must change some answer, or identical texts would not show that adapters ran.
    changed = {n: any(want["text"][f"{n}/{i}"] != want["text"][f"{base}/{i}"] for i in range(len(prompts)))
               for n in names}
    cached = all(v > 0 for k, v in got["cached_again"].items() if k.endswith("/1"))
    # On CUDA every adapter went to the device at least once (more: evictions with two slots).
    uploaded = device != "cuda" or got["gpu_uploads"] >= len(names)
    ok = all(same.values()) and all(changed.values()) and cached and got["listed"] == sorted(names) and uploaded
    return {"ok": ok, "device": device, "same_as_cpu": same, "adapters_change_text": changed,
            "cached_again": got["cached_again"], "listed": got["listed"], "gpu_uploads": got["gpu_uploads"]}


def main():
    bin_, model = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3 and sys.argv[3] == "--lora-only":
        # gpu-check.sh's step 7 (cuda), or a local check of the comparison itself (cpu against cpu).
        out = lora(bin_, model, sys.argv[4] if len(sys.argv) > 4 else "cpu")
        print(json.dumps(out, indent=1))
        sys.exit(0 if out["ok"] else 1)
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
