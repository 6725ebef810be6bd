#!/usr/bin/env bash
# Host DRAM KV tier vs device pool only, real processes, one run: a kvgate gateway (its default policy) and WORKERS
# `kvgate-worker serve --engine sim` workers (gpu-h100-llama3-8b timing, real time, whose host-tier loads cost the
# profile's host_load_s_per_byte) with a small device pool, without and with `--host-kv-bytes`, under the multi-turn
# workload (conversations come back after others pushed them out of the pool). A fresh fleet per row; everything
# listens on 127.0.0.1 and stops by itself.
#
#   scripts/tier-bench.sh [OUT_DIR]   (default target/tier-bench; prints a Markdown table)
#
# HOST_BYTES (default "0 8000000000"): each worker's --host-kv-bytes per row (the simulated engine keeps no K/V
# bytes, so a large tier costs no memory here). KV_TOKENS (default 4096): each worker's device pool.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-target/tier-bench}"
WORKERS="${WORKERS:-2}"
KV_TOKENS="${KV_TOKENS:-4096}"
HOST_BYTES="${HOST_BYTES:-0 8000000000}"
WORKLOAD="${WORKLOAD:---workload multi-turn --users 48 --turns 5 --rate 4 --think-time 3 --system-words 512 --output-tokens 64}"
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
SECRET="tier-bench-$$"

run_one() { # host_bytes
  local host=$1 log="$OUT/host-$1" i w
  rm -rf "$log" && mkdir -p "$log"
  start_gateway "$log/gateway.log"
  start_sim_workers "$GATEWAY_CONTROL" "$log" --kv-cache-tokens "$KV_TOKENS" --host-kv-bytes "$host"
  local workers=("${WORKER_URLS[@]}")
  wait_workers "$GATEWAY_CONTROL" "$WORKERS"
  wait_http "$GATEWAY_URL/v1/models" "gateway"
  # shellcheck disable=SC2086
  "$BIN/kvgate-loadtest" run --target "$GATEWAY_URL" --model kvgate-tiny $WORKLOAD --seed 42 \
    --duration 300s --no-progress --out "$log/run" >"$log/run.out" 2>&1 || { cat "$log/run.out" >&2; exit 1; }
  for w in "${workers[@]}"; do
    curl -s "$w/metrics" | awk '/^kvgate_worker_host_kv_hit_blocks / {h += $2} /^kvgate_worker_host_kv_stored_blocks / {s += $2} /^kvgate_worker_kv_evictions / {e += $2} END {print h + 0, s + 0, e + 0}'
  done >"$log/tiers"
  cleanup
}

for h in $HOST_BYTES; do
  run_one "$h"
  echo "done: host $h" >&2
done

python3 - "$OUT" "$KV_TOKENS" $HOST_BYTES <<'EOF'
import json, sys, os
out, kv = sys.argv[1], sys.argv[2]
print("| device pool tokens/worker | host tier bytes/worker | requests | errors | hit rate | TTFT p50 ms | TTFT p99 ms | blocks loaded from host | blocks copied to host | device evictions |")
print("|---|---|---|---|---|---|---|---|---|---|")
for h in sys.argv[3:]:
    d = os.path.join(out, f"host-{h}")
    s = json.load(open(os.path.join(d, "run", "results.json")))["runs"][0]["summary"]
    rows = [list(map(float, l.split())) for l in open(os.path.join(d, "tiers")) if l.strip()]
    hit, stored, ev = (int(sum(r[i] for r in rows)) for i in range(3))
    print(f"| {kv} | {h} | {s['requests']} | {s['errors']} | {s['hit_rate']:.3f} | {s['ttft_p50_ms']:.1f} | "
          f"{s['ttft_p99_ms']:.1f} | {hit} | {stored} | {ev} |")
EOF
