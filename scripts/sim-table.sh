#!/usr/bin/env bash
# The simulator's acceptance table (docs/benchmarks/routing.md): the Mooncake trace, 8 simulated GPU workers,
# every policy, at several offered loads and KV capacities; then the Mooncake conversation trace (every request
# shares its root block) and the synthetic long-document trace at load 0.7. Prints Markdown rows, each group after a
# line naming its trace.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p kvgate-loadtest
sim() { ./target/release/kvgate-loadtest simulate --workers 8 --policy all --markdown "$@"; }
SYN=loadtest/traces/mooncake-synthetic.jsonl
echo "mooncake-synthetic"
# The trace has 43,924 distinct 512-token blocks (22.5M tokens); per worker: 1/8, 1/4 (default), 1/2 of them.
for load in 0.5 0.7 0.9; do sim --trace "$SYN" --target-load "$load" | if [ "$load" = 0.5 ]; then cat; else tail -n +3; fi; done
for kv in 351392 1405568; do sim --trace "$SYN" --target-load 0.7 --kv-tokens-per-worker "$kv" | tail -n +3; done
for t in mooncake-conversation long-document-synthetic; do
  echo "$t"
  sim --trace "loadtest/traces/$t.jsonl" --target-load 0.7 | tail -n +3
done
