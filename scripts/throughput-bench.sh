#!/usr/bin/env bash
# Router throughput on short chats: one kvgate gateway (2 proxy threads, the default) and SMG (PyPI `smg`,
# cache_aware) in turn in front of the same kind of fleet, driven closed-loop by `kvgate-loadtest run` at a fixed
# concurrency. Per router: requests/s served, and the router's CPU time per request (its processes' utime + stime
# from /proc over the run, divided by the requests served). The fleet is `kvgate-loadtest up`: $WORKERS simulated
# workers (`--engine sim`, gpu-h100-llama3-8b timing in real time: a short chat's prefill and one output token
# take a few ms, so the workers are not what limits); each router gets a fresh fleet. Everything shares this
# machine's cores and listens on 127.0.0.1; every process stops by itself.
#
#   scripts/throughput-bench.sh [OUT_DIR]      (default target/throughput-bench; prints a Markdown table)
#
# Knobs (env): WORKERS (8), CONCURRENCY (64), DURATION (30s), SMG_VERSION (1.13.0), BASELINE_BIN (a directory
# with another build's kvgate-loadtest, kvgate-gateway and kvgate-worker, e.g. before a change: its kvgate runs too,
# in the same run, as the row `kvgate-baseline`).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-target/throughput-bench}"
WORKERS="${WORKERS:-8}"
CONCURRENCY="${CONCURRENCY:-64}"
DURATION="${DURATION:-30s}"
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
ensure_smg
TICKS=$(getconf CLK_TCK)

# CPU seconds (user + system) of a process and its descendants, alive ones only.
cpu_of_tree() { # pid
  local pids
  pids=$(pstree -p -T "$1" 2>/dev/null | grep -o '([0-9]\+)' | tr -d '()' || echo "$1")
  local t=0
  for p in $pids; do
    [ -r "/proc/$p/stat" ] || continue
    t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat")))
  done
  python3 -c "print($t / $TICKS)"
}

run_one() { # router
  local router=$1 log="$OUT/$1" this_bin=$BIN
  rm -rf "$log" && mkdir -p "$log"
  [ "$router" = kvgate-baseline ] && BIN=$BASELINE_BIN
  start_fleet "$log"
  local target=$FLEET_GATEWAY pid
  pid=$(pgrep -f "kvgate-gateway.*$(echo "$target" | sed 's/.*://')" | head -1 || true)
  [ -n "$pid" ] || pid=$(pgrep -P "$FLEET_PID" -f kvgate-gateway | head -1)
  if [ "$router" = smg ]; then
    start_smg "$log" cache_aware
    pid=$SMG_PID
    target=$SMG_URL
  fi
  local before after
  before=$(cpu_of_tree "$pid")
  "$this_bin/kvgate-loadtest" run --target "$target" --model kvgate-tiny --workload multi-turn --users 100000 --turns 1 \
    --system-words 48 --question-words 16 --output-tokens 1 --think-time 0 --concurrency "$CONCURRENCY" \
    --seed 42 --duration "$DURATION" --no-progress --out "$log/run" >"$log/run.out" 2>&1 ||
    { cat "$log/run.out" >&2; exit 1; }
  after=$(cpu_of_tree "$pid")
  python3 -c "print($after - $before)" >"$log/cpu"
  cleanup
  BIN=$this_bin
}

ROUTERS="${BASELINE_BIN:+kvgate-baseline }kvgate smg"
for r in $ROUTERS; do
  run_one "$r"
  echo "done: $r" >&2
done

python3 - "$OUT" "$CONCURRENCY" "$WORKERS" $ROUTERS <<'EOF'
import json, os, sys
out, conc, workers, routers = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
print(f"| router | concurrency | workers | requests | errors | requests/s | router CPU ms per request | TTFT p50 ms | TTFT p99 ms |")
print("|---|---|---|---|---|---|---|---|---|")
for router in routers:
    d = os.path.join(out, router)
    s = json.load(open(os.path.join(d, "run", "results.json")))["runs"][0]["summary"]
    cpu = float(open(os.path.join(d, "cpu")).read())
    ok = s["ok"]
    rps = ok / s["wall_s"]
    print(f"| {router} | {conc} | {workers} | {s['requests']} | {s['errors']} | {rps:.0f} | "
          f"{1000 * cpu / max(ok, 1):.3f} | {s['ttft_p50_ms']:.1f} | {s['ttft_p99_ms']:.1f} |")
EOF
