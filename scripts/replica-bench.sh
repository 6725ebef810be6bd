#!/usr/bin/env bash
# Gateway replicas with and without shared sends, real processes, one run: a local redis-server, N kvgate gateways
# (`--redis-url`, `--share-sends true|false`) and 4 `kvgate-worker serve --engine sim` workers (gpu-h100-llama3-8b
# timing, real time) that report to every replica. The load generator spreads requests over the replicas in turn
# (`kvgate-loadtest run --target g1,g2,...`, what a round-robin Service does). Each configuration gets a fresh
# Redis, gateways and workers, so no run finds another's cache. Everything listens on 127.0.0.1 and stops by itself.
#
#   scripts/replica-bench.sh [OUT_DIR]   (default target/replica-bench; prints a Markdown table)
#
# CONFIGS (default "1:- 2:false 2:true 3:false 3:true"): replicas:share-sends. WORKLOADS (default "shared-prefix
# mooncake"). Needs: cargo, redis-server (scripts/setup.sh installs it), curl, python3.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-target/replica-bench}"
WORKERS="${WORKERS:-4}"
TRACE="${TRACE:-loadtest/traces/mooncake-synthetic.jsonl}"
WORKLOADS="${WORKLOADS:-shared-prefix mooncake}"
CONFIGS="${CONFIGS:-1:- 2:false 2:true 3:false 3:true}"
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
SECRET="replica-bench-$$"

declare -A WORKLOAD=(
  [shared-prefix]="--workload shared-prefix --groups 16 --prompts-per-group 8 --system-tokens 2048 --question-tokens 128 --rate 8 --output-tokens 64"
  [multi-turn]="--workload multi-turn --users 16 --turns 5 --rate 2 --system-words 1024 --output-tokens 64"
  [mooncake]="--workload mooncake --trace $TRACE --top-roots ${TOP_ROOTS:-10} --time-scale ${TIME_SCALE:-0.1}"
)

run_one() { # replicas share workload
  local n=$1 share=$2 workload=$3 tag="$1-$2-$3" c w i
  local log="$OUT/$tag"
  rm -rf "$log" && mkdir -p "$log"
  local rport
  rport=$(free_port)
  redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no --dir "$log" >"$log/redis.log" 2>&1 &
  PIDS+=($!)
  local targets=() controls=()
  for i in $(seq 1 "$n"); do
    local share_args=()
    [ "$share" != "-" ] && share_args=(--redis-url "redis://127.0.0.1:$rport" --share-sends "$share")
    start_gateway "$log/gateway-$i.log" --replica-id "g$i" "${share_args[@]}"
    targets+=("$GATEWAY_URL"); controls+=("$GATEWAY_CONTROL")
  done
  local report_to
  report_to=$(IFS=,; echo "${controls[*]}")
  start_sim_workers "$report_to" "$log" --kv-cache-tokens 262144
  local workers=("${WORKER_URLS[@]}")
  for c in "${controls[@]}"; do
    wait_workers "$c" "$WORKERS"
  done
  wait_http "${targets[0]}/v1/models" "gateway"
  local target
  target=$(IFS=,; echo "${targets[*]}")
  # shellcheck disable=SC2086
  "$BIN/kvgate-loadtest" run --target "$target" --model kvgate-tiny ${WORKLOAD[$workload]} --seed 42 \
    --duration 240s --no-progress --out "$log/run" >"$log/run.out" 2>&1 || { cat "$log/run.out" >&2; exit 1; }
  for w in "${workers[@]}"; do
    curl -s "$w/metrics" | awk '/^kvgate_worker_requests_total/ {n += $2} END {print n + 0}'
  done >"$log/per-worker"
  for c in "${controls[@]}"; do
    curl -s "$c/metrics" | awk '/^kvgate_gateway_shared_sends_total\{event="applied"\}/ {n += $2} END {print n + 0}'
  done >"$log/applied"
  cleanup
}

for workload in $WORKLOADS; do
  for c in $CONFIGS; do
    run_one "${c%%:*}" "${c##*:}" "$workload"
    echo "done: $c $workload" >&2
  done
done

python3 - "$OUT" "$CONFIGS" $WORKLOADS <<'EOF'
import json, sys, os
out, configs = sys.argv[1], sys.argv[2].split()
print("| workload | replicas | sends shared | requests | errors | hit rate | TTFT p50 ms | TTFT p99 ms | max/mean requests per worker | sends applied by other replicas |")
print("|---|---|---|---|---|---|---|---|---|---|")
for workload in sys.argv[3:]:
    for c in configs:
        n, share = c.split(":")
        d = os.path.join(out, f"{n}-{share}-{workload}")
        s = json.load(open(os.path.join(d, "run", "results.json")))["runs"][0]["summary"]
        per = [float(x) for x in open(os.path.join(d, "per-worker")).read().split()]
        applied = int(sum(float(x) for x in open(os.path.join(d, "applied")).read().split()))
        mm = max(per) / (sum(per) / len(per)) if sum(per) > 0 else 0.0
        shared = {"-": "-", "true": "yes", "false": "no"}[share]
        print(f"| {workload} | {n} | {shared} | {s['requests']} | {s['errors']} | {s['hit_rate']:.3f} | "
              f"{s['ttft_p50_ms']:.1f} | {s['ttft_p99_ms']:.1f} | {mm:.2f} | {applied} |")
EOF
