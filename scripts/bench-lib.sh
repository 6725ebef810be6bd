# Shared by the bench scripts (sourced, not run): release binaries built once, free loopback ports, waiting for a
# server to answer, and stopping every process a script started (on exit, or between rows with `cleanup`).
#   OUT: the output directory (created, made absolute); BIN: the release binaries; PIDS: the processes to stop.

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cargo build --release -q -p kvgate-loadtest -p kvgate-gateway -p kvgate-worker
BIN="$PWD/target/release"

# A port below the kernel's ephemeral range (as kvgate_shared::ports): an outgoing connection cannot take it before
# the server binds it.
free_port() {
  python3 -c '
import random, socket
for _ in range(1000):
    p = random.randrange(15000, 32768)
    try:
        s = socket.socket(); s.bind(("127.0.0.1", p)); s.close(); print(p); break
    except OSError:
        pass'
}

wait_http() { # url what
  for _ in $(seq 1 600); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "$2 did not start ($1)" >&2; exit 1
}

# Starts $WORKERS simulated workers (tiny model, gpu-h100-llama3-8b timing) reporting to $1 (control URLs,
# comma-separated) with the report secret $SECRET, logs under $2, extra worker flags after; waits until each is
# ready. Their base URLs: WORKER_URLS.
start_sim_workers() { # report_to logdir [flags...]
  local report_to=$1 log=$2
  shift 2
  WORKER_URLS=()
  for i in $(seq 0 $((WORKERS - 1))); do
    local wport
    wport=$(free_port)
    RUST_LOG=warn "$BIN/kvgate-worker" serve --synth tiny --synth-dir "$OUT/synth" --engine sim \
      --sim-profile gpu-h100-llama3-8b --host 127.0.0.1 --port "$wport" --worker-id "w$i" \
      --report-to "$report_to" --report-secret "$SECRET" "$@" >"$log/worker-$i.log" 2>&1 &
    PIDS+=($!)
    WORKER_URLS+=("http://127.0.0.1:$wport")
    # The first one writes the synthetic model the others read.
    [ "$i" = 0 ] && wait_http "http://127.0.0.1:$wport/ready" "worker w0"
  done
  for w in "${WORKER_URLS[@]}"; do wait_http "$w/ready" "worker $w"; done
}

PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap cleanup EXIT
