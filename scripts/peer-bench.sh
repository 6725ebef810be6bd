#!/usr/bin/env bash
# kvgate vs the peer router SMG (PyPI `smg`, cache_aware and round_robin) in front of the same simulated workers,
# same workloads and seeds, one run. Each (router, workload) pair gets a fresh fleet (`kvgate-loadtest up`: 4
# `kvgate-worker serve --engine sim` workers, gpu-h100-llama3-8b timing, real time), so no run finds another's
# cache. Token-id workloads are sent as text (`--text-prompts`: SMG refuses token-id prompts). Requests per worker
# come from the workers' own counters (SMG sets no worker header). Everything listens on 127.0.0.1 and stops by
# itself. mooncake replays the trace's 10 largest prefix families (`--top-roots`, 189 requests that reuse 94% of
# their blocks; a window of consecutive requests has almost no reuse) at 0.1x their recorded gaps (about 100 s);
# mooncake-long its 20 largest (325 requests, 56K tokens on average once rendered as text, about 3x the trace's
# count) at 0.2x (about 200 s; 0.27 of what 4 workers can prefill in the simulator; its 40 largest at 0.2x are 1.4x,
# and every router times out there); heavy-multi-turn is multi-turn with a 2,048-word system prompt and 200-word turns.
#
#   scripts/peer-bench.sh [OUT_DIR]      (default target/peer-bench; prints a Markdown table)
#
# Needs: cargo, python3 with venv and network access to PyPI for the first run (SMG goes into $OUT_DIR/venv).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-target/peer-bench}"
WORKERS="${WORKERS:-4}"
TRACE="${TRACE:-loadtest/traces/mooncake-synthetic.jsonl}"
WORKLOADS="${WORKLOADS:-multi-turn heavy-multi-turn shared-prefix mooncake mooncake-long}"
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
ensure_smg

# workload name -> loadtest arguments
declare -A WORKLOAD=(
  [multi-turn]="--workload multi-turn --users 16 --turns 5 --rate 2 --system-words 1024 --output-tokens 64"
  [shared-prefix]="--workload shared-prefix --groups 16 --prompts-per-group 8 --system-tokens 2048 --question-tokens 128 --rate 8 --output-tokens 64 --text-prompts"
  [mooncake]="--workload mooncake --trace $TRACE --top-roots ${TOP_ROOTS:-10} --time-scale ${TIME_SCALE:-0.1} --text-prompts"
  [mooncake-long]="--workload mooncake --trace $TRACE --top-roots 20 --time-scale 0.2 --text-prompts"
  [heavy-multi-turn]="--workload multi-turn --users 16 --turns 5 --rate 2 --system-words 2048 --question-words 200 --output-tokens 64"
)
# ROUTERS: router:policy pairs (kvgate's policy is its gateway's: kvgate:cache_aware_measured is the default, the
# guard in measured seconds; kvgate:cache_aware the token-threshold baseline).
read -r -a ROUTERS <<<"${ROUTERS:-kvgate:cache_aware_measured smg:cache_aware smg:round_robin}"

run_one() { # router policy workload
  local router=$1 policy=$2 workload=$3 tag="$1-$2-$3"
  local log="$OUT/$tag"
  rm -rf "$log" && mkdir -p "$log"
  if [ "$router" = kvgate ]; then start_fleet "$log" "$policy"; else start_fleet "$log"; fi
  local workers=$FLEET_WORKERS target=$FLEET_GATEWAY
  if [ "$router" = smg ]; then
    start_smg "$log" "$policy"
    target=$SMG_URL
  fi
  # shellcheck disable=SC2086
  "$BIN/kvgate-loadtest" run --target "$target" --model kvgate-tiny ${WORKLOAD[$workload]} --seed 42 \
    --duration 240s --no-progress --out "$log/run" >"$log/run.out" 2>&1 || { cat "$log/run.out" >&2; exit 1; }
  for w in $workers; do
    curl -s "$w/metrics" | awk '/^kvgate_worker_requests_total/ {n += $2} END {print n + 0}'
  done >"$log/per-worker"
  cleanup
}

for workload in $WORKLOADS; do
  for r in "${ROUTERS[@]}"; do
    run_one "${r%%:*}" "${r##*:}" "$workload"
    echo "done: $r $workload" >&2
  done
done

python3 - "$OUT" "${ROUTERS[*]}" $WORKLOADS <<'EOF'
import json, sys, os
out, routers = sys.argv[1], [r.split(":") for r in sys.argv[2].split()]
print("| workload | router | policy | requests | errors | hit rate | TTFT p50 ms | TTFT p99 ms | max/mean requests per worker |")
print("|---|---|---|---|---|---|---|---|---|")
for workload in sys.argv[3:]:
    for router, policy in routers:
        d = os.path.join(out, f"{router}-{policy}-{workload}")
        s = json.load(open(os.path.join(d, "run", "results.json")))["runs"][0]["summary"]
        per = [float(x) for x in open(os.path.join(d, "per-worker")).read().split()]
        mm = max(per) / (sum(per) / len(per)) if sum(per) > 0 else 0.0
        print(f"| {workload} | {router} | {policy} | {s['requests']} | {s['errors']} | {s['hit_rate']:.3f} | "
              f"{s['ttft_p50_ms']:.1f} | {s['ttft_p99_ms']:.1f} | {mm:.2f} |")
EOF
