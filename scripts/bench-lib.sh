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

# Starts a kvgate gateway on fresh loopback ports (report secret $SECRET, no state file) logging to $1, extra flags
# after; waits until its control port answers. Sets GATEWAY_URL and GATEWAY_CONTROL.
start_gateway() { # logfile [flags...]
  local log=$1 port cport
  shift
  port=$(free_port); cport=$(free_port)
  RUST_LOG=warn "$BIN/kvgate-gateway" --listen "127.0.0.1:$port" --control-listen "127.0.0.1:$cport" \
    --report-secret "$SECRET" --state-file off "$@" >"$log" 2>&1 &
  PIDS+=($!)
  GATEWAY_URL="http://127.0.0.1:$port"
  GATEWAY_CONTROL="http://127.0.0.1:$cport"
  wait_http "$GATEWAY_CONTROL/health" "gateway"
}

# Waits (60 s at most) until the gateway with control URL $1 lists $2 healthy workers (with fresh summaries unless
# $3 is "healthy").
wait_workers() { # control n [fresh|healthy]
  local cond='w["healthy"] and w["summary_fresh"]'
  [ "${3:-fresh}" = healthy ] && cond='w["healthy"]'
  for _ in $(seq 1 300); do
    [ "$(curl -s "$1/kvgate/v1/workers" | python3 -c "import json,sys; print(sum(1 for w in json.load(sys.stdin) if $cond))" 2>/dev/null)" = "$2" ] && return 0
    sleep 0.2
  done
  echo "the gateway at $1 never listed $2 workers" >&2; exit 1
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

# The peer router SMG (PyPI `smg==$SMG_VERSION`, default 1.13.0) in a venv under $OUT, installed on first use; sets
# SMG to its binary.
ensure_smg() {
  if [ ! -x "$OUT/venv/bin/smg" ]; then
    python3 -m venv "$OUT/venv"
    "$OUT/venv/bin/pip" install -q "smg==${SMG_VERSION:-1.13.0}"
  fi
  SMG="$OUT/venv/bin/smg"
}

# A fresh fleet (`kvgate-loadtest up`: a gateway routing by policy $2, default the gateway's own, and $WORKERS simulated
# workers, 262,144 KV tokens each) logging under $1; waits until it is up. Sets FLEET_PID, FLEET_GATEWAY (the
# gateway's URL) and FLEET_WORKERS (the workers' URLs, space-separated).
start_fleet() { # logdir [policy]
  local log=$1
  "$BIN/kvgate-loadtest" up --workers "$WORKERS" --engine sim ${2:+--policy "$2"} --kv-cache-tokens 262144 \
    --log-dir "$log/fleet" >"$log/up.out" 2>"$log/up.err" &
  FLEET_PID=$!
  PIDS+=("$FLEET_PID")
  for _ in $(seq 1 600); do grep -q '^workers:' "$log/up.out" 2>/dev/null && break; sleep 0.2; done
  grep -q '^workers:' "$log/up.out" || { echo "fleet did not start: $(cat "$log/up.err")" >&2; exit 1; }
  FLEET_GATEWAY=$(sed -n 's/^kvgate is up: gateway \([^ ]*\) .*/\1/p' "$log/up.out")
  FLEET_WORKERS=$(sed -n 's/^workers: //p' "$log/up.out")
}

# SMG with policy $2 in front of $FLEET_WORKERS, logging to $1/smg.log; waits until it answers and has had time to
# admit every worker. Sets SMG_PID and SMG_URL.
start_smg() { # logdir policy
  local port mport
  port=$(free_port)
  mport=$(free_port)
  # shellcheck disable=SC2086
  "$SMG" launch --host 127.0.0.1 --port "$port" --prometheus-port "$mport" --policy "$2" \
    --worker-urls $FLEET_WORKERS >"$1/smg.log" 2>&1 &
  SMG_PID=$!
  PIDS+=("$SMG_PID")
  SMG_URL="http://127.0.0.1:$port"
  for _ in $(seq 1 300); do curl -sf "$SMG_URL/v1/models" >/dev/null 2>&1 && break; sleep 0.2; done
  curl -sf "$SMG_URL/v1/models" >/dev/null || { echo "smg did not start: $(tail -5 "$1/smg.log")" >&2; exit 1; }
  sleep 2 # let SMG's health checks admit every worker
}

PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap cleanup EXIT
