#!/usr/bin/env bash
# The README's main command: set up what building needs (no Python, no Redis: the tests' set-up installs those),
# build the three binaries, and run the kvgate demo on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --build
cargo build --release -p kvgate-loadtest -p kvgate-gateway -p kvgate-worker
exec ./target/release/kvgate-loadtest demo "$@"
