#!/usr/bin/env bash
# The README's test command: set up a fresh machine, then build and run every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export KVGATE_PYTHON="$PWD/.venv/bin/python"
# Real vLLM pods (gateway/tests/vllm_pods.rs), unless setup.sh was told to skip them (KVGATE_NO_VLLM=1).
if [ -x .venv-vllm/bin/python ] && [ "${KVGATE_NO_VLLM:-}" != 1 ]; then
  export KVGATE_VLLM_PYTHON="$PWD/.venv-vllm/bin/python"
fi
if cargo nextest --version >/dev/null 2>&1; then
  # Doc tests first (nextest does not run them), so the run ends with nextest's summary.
  cargo test --workspace --doc --quiet
  cargo nextest run --workspace --no-fail-fast "$@"
else
  cargo test --workspace --no-fail-fast "$@"
fi
