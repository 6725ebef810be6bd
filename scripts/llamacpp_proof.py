#!/usr/bin/env python3
"""The drop-in proof of issue #18: kvgate in front of real llama.cpp servers (PyPI `llama-cpp-python[server]`, CPU)
that know nothing of kvgate, on the multi-turn workload, once per routing policy.

1. The synthetic `small` model (`kvgate-worker synth-model`) is converted to GGUF (scripts/synth_to_gguf.py), and
   the conversion is checked against kvgate on the same weights: llama.cpp's token ids for a few texts equal the
   gateway's tokenizer's (the `tokenizers` library on the same tokenizer.json; BOS aside, see `check_conversion`),
   and greedy chat completions from a llama.cpp pod equal a kvgate CPU worker's, with the same prompt token counts.
2. Per policy: N fresh llama.cpp pods (`--cache true`: llama-cpp-python's RAM prompt cache, restored by longest
   token prefix), a gateway with one `[[models]]` entry of kind `openai` (the model's tokenizer directory
   configured, no kvgate worker anywhere), and `kvgate-loadtest run --workload multi-turn` through it.
   Stickiness comes from the gateway's `x-kvgate-worker` header per request (results.json); the hit rate from the
   pods' own logs: llama.cpp prints "N prefix-match hit, remaining M prompt tokens to eval" for each prompt that
   reuses KV, and "prompt eval time = ... / M tokens" for every prompt it evaluates, so
   hit rate = sum(N) / (sum(N) + sum(M)) over all pods.

3. Pass-through (#30): a pod started with `--embedding true` behind a gateway: `POST /v1/embeddings` through the
   gateway answers the vector the pod answers directly, and `GET /v1/models/{id}` is the gateway's card.

Prints one JSON object (also written to OUT/proof.json); exits 1 if the conversion check fails or a request fails.

usage: llamacpp_proof.py --bin-dir target/release --out DIR [--pods 3] [--users 8] [--turns 4] ...
"""
import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "kvgate-small"
HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


def free_port() -> int:
    """A loopback port below the ephemeral range (as kvgate_shared::ports)."""
    for _ in range(1000):
        p = random.randrange(15000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                pass
    raise SystemExit("no free port")


def http(url, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def wait(url, what, proc, secs=120):
    deadline = time.time() + secs
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.2)
    raise SystemExit(f"{what} did not answer {url} in {secs} s")


class Procs:
    """Every process started, stopped on exit."""

    def __init__(self):
        self.procs = []

    def start(self, args, log, **kw):
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []


def llama_pod(procs, gguf, log_path, threads, n_ctx, extra=()):
    port = free_port()
    log = open(log_path, "w")
    p = procs.start([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                     "--port", str(port), "--model_alias", MODEL, "--cache", "true", "--n_ctx", str(n_ctx),
                     "--n_threads", str(threads), "--n_threads_batch", str(threads), *extra], log)
    url = f"http://127.0.0.1:{port}"
    wait(f"{url}/v1/models", "llama.cpp server", p)
    return url


def check_conversion(args, procs, model_dir, gguf, out):
    """Token ids and greedy chat completions: llama.cpp on the GGUF vs kvgate on the safetensors."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    pod = llama_pod(procs, gguf, out / "convert-llamacpp.log", args.threads, args.n_ctx)
    wport = free_port()
    w = procs.start([str(args.bin_dir / "kvgate-worker"), "serve", "--model", str(model_dir), "--host", "127.0.0.1",
                     "--port", str(wport)], open(out / "convert-kvgate.log", "w"))
    worker = f"http://127.0.0.1:{wport}"
    wait(f"{worker}/ready", "kvgate worker", w)
    wmodel = http(f"{worker}/v1/models")["data"][0]["id"]
    texts = ["hello there", "ka ri to ne sa lo mi du ve po, and 12345 more!", "Ünïcode — works?\nnew line"]
    # Without BOS: the GGUF says add_bos_token = false because the chat template writes BOS itself (so chat prompts
    # are the same tokens on both, counted below); a /v1/completions prompt is one token (BOS) shorter on llama.cpp.
    ids_equal = [http(f"{pod}/extras/tokenize", {"input": t})["tokens"] == tok.encode(t, add_special_tokens=False).ids
                 for t in texts]
    chats = []
    for q in ("What is the capital of France?", "ka ri to ne sa lo mi du ve po"):
        body = {"model": MODEL, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": q}]}
        a = http(f"{pod}/v1/chat/completions", body)
        b = http(f"{worker}/v1/chat/completions", {**body, "model": wmodel})
        chats.append({"same_text": a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"],
                      "prompt_tokens": [a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]]})
    procs.stop()
    ok = all(ids_equal) and all(c["same_text"] and c["prompt_tokens"][0] == c["prompt_tokens"][1] for c in chats)
    return {"ok": ok, "token_ids_equal_without_bos": ids_equal, "greedy_chat": chats}


def gateway_for(procs, args, d, model_dir, pods, policy="cache_aware_measured"):
    """A gateway with one `[[models]]` entry of kind `openai` over `pods`; its base URL."""
    cfg = d / "gateway.toml"
    cfg.write_text(f'[[models]]\nname = "{MODEL}"\ntokenizer = "{model_dir}"\nkind = "openai"\n'
                   f"kv-tokens = {args.n_ctx}\nworkers = [{', '.join(json.dumps(p) for p in pods)}]\n")
    port, cport = free_port(), free_port()
    g = procs.start([str(args.bin_dir / "kvgate-gateway"), "--config", str(cfg), "--policy", policy,
                     "--listen", f"127.0.0.1:{port}", "--control-listen", f"127.0.0.1:{cport}",
                     "--report-secret", f"proof-{os.getpid()}"], open(d / "gateway.log", "w"),
                    env={**os.environ, "KVGATE_DATA_DIR": str(d / "gateway-data"), "RUST_LOG": "warn"})
    gateway = f"http://127.0.0.1:{port}"
    wait(f"{gateway}/health", "gateway", g)
    return gateway


def check_passthrough(args, procs, model_dir, gguf, out):
    """Endpoints the gateway does not route by prefix reach the pod (issue #30): `/v1/embeddings` through the
    gateway answers what the llama.cpp pod answers directly; `GET /v1/models/{id}` is the gateway's card."""
    d = out / "passthrough"
    d.mkdir(parents=True, exist_ok=True)
    pod = llama_pod(procs, gguf, d / "pod.log", args.threads, args.n_ctx, ["--embedding", "true"])
    gateway = gateway_for(procs, args, d, model_dir, [pod])
    body = {"model": MODEL, "input": "the quick brown fox"}
    direct = http(f"{pod}/v1/embeddings", body)
    deadline = time.time() + 30
    while True:  # the gateway marks the pod healthy after its first scrape
        try:
            through = http(f"{gateway}/v1/embeddings", body)
            break
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.time() > deadline:
                raise
            time.sleep(0.2)
    card = http(f"{gateway}/v1/models/{MODEL}")
    procs.stop()
    def flat(v):  # a model without pooling answers one vector per token
        return [y for x in v for y in flat(x)] if isinstance(v, list) else [v]

    a, b = flat(direct["data"][0]["embedding"]), flat(through["data"][0]["embedding"])
    same = len(a) == len(b) and all(abs(x - y) < 1e-6 for x, y in zip(a, b))
    return {"ok": same and card.get("id") == MODEL, "embedding_equal": same, "dims": len(b),
            "usage": through.get("usage"), "model_card": card.get("id")}


def pod_hits(log_path):
    text = Path(log_path).read_text(errors="replace")
    hit = sum(int(m.group(1)) for m in HIT.finditer(text))
    evaluated = sum(int(m.group(1)) for m in EVAL.finditer(text))
    return hit, evaluated


def run_policy(args, procs, policy, model_dir, gguf, out):
    d = out / policy
    d.mkdir(parents=True, exist_ok=True)
    pods = [llama_pod(procs, gguf, d / f"pod{i}.log", args.threads, args.n_ctx) for i in range(args.pods)]
    gateway = gateway_for(procs, args, d, model_dir, pods, policy)
    t0 = time.time()
    lt = subprocess.run([str(args.bin_dir / "kvgate-loadtest"), "run", "--target", gateway, "--model", MODEL,
                         "--workload", "multi-turn", "--seed", str(args.seed), "--users", str(args.users),
                         "--turns", str(args.turns), "--system-words", str(args.system_words),
                         "--question-words", str(args.question_words), "--output-tokens", str(args.output_tokens),
                         "--rate", str(args.rate), "--think-time", str(args.think_time),
                         "--duration", f"{args.duration}s", "--out", str(d / "loadtest"), "--no-progress"],
                        stdout=open(d / "loadtest.log", "w"), stderr=subprocess.STDOUT, timeout=args.duration + 300)
    wall = time.time() - t0
    procs.stop()
    if lt.returncode != 0:
        raise SystemExit(f"kvgate-loadtest failed for {policy}: {(d / 'loadtest.log').read_text()[-2000:]}")
    records = json.loads((d / "loadtest" / "results.json").read_text())["runs"][0]["records"]
    ok = [r for r in records if r["status"] == 200 and not r.get("error")]
    sessions = {}
    for r in ok:
        sessions.setdefault(r["user"], []).append(r["worker"])
    multi = {u: w for u, w in sessions.items() if len(w) > 1}
    sticky = sum(1 for w in multi.values() if len(set(w)) == 1)
    hits = [pod_hits(d / f"pod{i}.log") for i in range(args.pods)]
    hit, evaluated = sum(h for h, _ in hits), sum(e for _, e in hits)
    ttft = sorted(r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None)
    per_pod = {p: sum(1 for r in ok if r["worker"] == p) for p in pods}
    return {
        "requests": len(records),
        "ok": len(ok),
        "sessions": len(multi),
        "sticky_sessions": sticky,
        "mean_pods_per_session": round(sum(len(set(w)) for w in multi.values()) / max(1, len(multi)), 2),
        "prompt_tokens_reused": hit,
        "prompt_tokens_evaluated": evaluated,
        "hit_rate": round(hit / max(1, hit + evaluated), 4),
        "ttft_p50_ms": round(ttft[len(ttft) // 2], 1) if ttft else None,
        "ttft_p90_ms": round(ttft[int(len(ttft) * 0.9)], 1) if ttft else None,
        "requests_per_pod": list(per_pod.values()),
        "wall_s": round(wall, 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", type=Path, required=True, help="where kvgate-worker, -gateway, -loadtest are")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pods", type=int, default=3)
    ap.add_argument("--policies", default="cache_aware_measured,round_robin")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=200)
    ap.add_argument("--question-words", type=int, default=24)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--rate", type=float, default=2.0, help="users starting per second")
    ap.add_argument("--think-time", type=float, default=0.5)
    ap.add_argument("--duration", type=int, default=120, help="seconds after which no request is issued")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--threads", type=int, default=1, help="threads per llama.cpp pod")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--skip-conversion-check", action="store_true")
    args = ap.parse_args()
    # Killed (a test's timeout, Ctrl-C's SIGTERM cousin): stop every pod and the gateway on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.bin_dir = args.bin_dir.resolve()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir, gguf = out / "small", out / "small.gguf"
    if not (model_dir / "config.json").exists():
        subprocess.run([str(args.bin_dir / "kvgate-worker"), "synth-model", "--preset", "small", "--out", str(model_dir)],
                       check=True, stdout=subprocess.DEVNULL)
    if not gguf.exists():
        subprocess.run([sys.executable, str(HERE / "synth_to_gguf.py"), str(model_dir), str(gguf)], check=True,
                       stdout=subprocess.DEVNULL)
    procs = Procs()
    try:
        result = {"pods": args.pods, "workload": {k: getattr(args, k) for k in (
            "users", "turns", "system_words", "question_words", "output_tokens", "rate", "think_time", "seed")}}
        if not args.skip_conversion_check:
            result["conversion"] = check_conversion(args, procs, model_dir, gguf, out)
        result["passthrough"] = check_passthrough(args, procs, model_dir, gguf, out)
        result["policies"] = {p: run_policy(args, procs, p, model_dir, gguf, out) for p in args.policies.split(",")}
    finally:
        procs.stop()
    (out / "proof.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    failed = not result.get("conversion", {"ok": True})["ok"] or not result["passthrough"]["ok"] or any(
        p["ok"] != p["requests"] for p in result["policies"].values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
