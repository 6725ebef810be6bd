# Shared by the bench scripts (sourced, not run): release binaries built once, free loopback ports, waiting for a
# server to answer, and stopping every process a script started (on exit, or between rows with `cleanup`).
#   OUT: the output directory (created, made absolute); BIN: the release binaries; PIDS: the processes to stop.

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cargo build --release -q -p kvgate-loadtest -p kvgate-gateway -p kvgate-worker
BIN="$PWD/target/release"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_http() { # url what
  for _ in $(seq 1 600); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "$2 did not start ($1)" >&2; exit 1
}

PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap cleanup EXIT
