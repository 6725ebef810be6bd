#!/usr/bin/env bash
# kvgate vs the peer routers in front of the same real vLLM pods (#42 item 6): kvgate on the pods' KV events and on
# its approximate index, the vLLM production-stack router (PyPI `vllm-router`: kv_aware on the same events, and
# cache_aware), SMG (PyPI `smg`, cache_aware) and NVIDIA Dynamo's KV-routing policy (PyPI `ai-dynamo-runtime`'s
# selection service on the same events, behind scripts/dynamo_shim.py); multi-turn, shared-prefix and long-document
# workloads, every pod's
# prefix cache reset before each row; then NVIDIA's aiperf (PyPI) against each router on multi-turn chats. All of it
# runs in scripts/vllm_peer_bench.py (its docstring says how); figures in docs/benchmarks/peers.md.
#
#   scripts/vllm-peer-bench.sh [OUT_DIR] [extra vllm_peer_bench.py flags]   (default target/vllm-peer-bench)
#
# Needs: .venv-vllm (scripts/setup.sh), cargo, python3 with venv and PyPI for the first run (the peers and aiperf go
# into $OUT_DIR/venv).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-target/vllm-peer-bench}"
shift || true
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
[ -x .venv-vllm/bin/python ] || { echo "no .venv-vllm: run scripts/setup.sh" >&2; exit 1; }
if [ ! -x "$OUT/venv/bin/vllm-router" ] || [ ! -x "$OUT/venv/bin/aiperf" ] || [ ! -x "$OUT/venv/bin/smg" ] \
  || ! "$OUT/venv/bin/python" -c "import dynamo.select_service" 2>/dev/null; then
  python3 -m venv "$OUT/venv"
  "$OUT/venv/bin/pip" install -q "smg==${SMG_VERSION:-1.13.0}" "vllm-router==${VLLM_ROUTER_VERSION:-0.1.17}" \
    "aiperf==${AIPERF_VERSION:-0.13.0}" "ai-dynamo-runtime==${DYNAMO_VERSION:-1.6.1}"
fi
exec python3 scripts/vllm_peer_bench.py --bin-dir "$BIN" --vllm-python "$PWD/.venv-vllm/bin/python" \
  --peers "$OUT/venv" --out "$OUT" --aiperf --dynamo "$OUT/venv/bin/python" "$@"
