#!/usr/bin/env bash
# The README's main command: set up, build, and run the kvgate demo on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cargo build --release --workspace
exec ./target/release/kvgate-loadtest demo "$@"
