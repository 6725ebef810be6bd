#!/usr/bin/env bash
# The simulator's acceptance table (BENCHMARKS.md): the Mooncake trace, 8 simulated GPU workers, every policy,
# at several offered loads and KV capacities. Prints Markdown rows.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p kvgate-loadtest
sim() { ./target/release/kvgate-loadtest simulate --trace loadtest/traces/mooncake-synthetic.jsonl --workers 8 \
    --policy all --markdown "$@"; }
# The trace has 43,924 distinct 512-token blocks (22.5M tokens); per worker: 1/8, 1/4 (default), 1/2 of them.
for load in 0.5 0.7 0.9; do sim --target-load "$load" | if [ "$load" = 0.5 ]; then cat; else tail -n +3; fi; done
for kv in 351392 1405568; do sim --target-load 0.7 --kv-tokens-per-worker "$kv" | tail -n +3; done
