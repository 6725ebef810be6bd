#!/usr/bin/env bash
# Prefill/decode splits on real processes (#27): two CPU workers (the synthetic model on the real engine) behind a
# kvgate gateway, the same long-burst workload (short requests decoding while bursts of long prompts arrive: the
# co-located prefill that stalls decodes) per row:
#   aggregated  2 workers of role both, --split-policy aggregated (never split)
#   cost_model  1 prefill worker (KV transfer listener) + 1 decode worker, --split-policy cost_model
#   always      the same 1P+1D, --split-policy always (SGLang router / SMG)
# A fresh fleet per row; everything listens on 127.0.0.1 and stops by itself. Prints a Markdown table (TTFT, TPOT,
# goodput at the SLOs below, and the gateway's split decisions by choice and reason).
#
#   scripts/pd-bench.sh [OUT_DIR]   (default target/pd-bench)
#
# ROWS (default "aggregated cost_model always": rerun some; the table reads every row's last run), MODEL (default
# small), WORKLOAD (the loadtest flags), SLO_TTFT_MS / SLO_TPOT_MS (default 5000 / 100: CPU speeds), ENDING
# (default `model`: the model ends each request, sampled with a per-request stop set, under a max_tokens of 2-10x
# the workload's output or none, so the gateway prices splits with its own prediction; `exact`: max_tokens = the
# output with ignore_eos, the gateway told the true length, as before #43).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-target/pd-bench}"
MODEL="${MODEL:-small}"
SLO_TTFT_MS="${SLO_TTFT_MS:-5000}"
SLO_TPOT_MS="${SLO_TPOT_MS:-100}"
ENDING="${ENDING:-model}"
WORKLOAD="${WORKLOAD:---workload long-burst --rate 2 --short-tokens 128 --long-tokens 2048 --burst-every 6 --burst-size 2 --burst-duration 36 --output-tokens 48}"
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
SECRET="pd-bench-$$"

start_worker() { # id log role [flags...]
  local id=$1 log=$2 role=$3 port
  shift 3
  port=$(free_port)
  RUST_LOG=warn "$BIN/kvgate-worker" serve --synth "$MODEL" --synth-dir "$OUT/synth" --host 127.0.0.1 \
    --port "$port" --worker-id "$id" --role "$role" --report-to "http://127.0.0.1:$CPORT" --report-secret "$SECRET" \
    --report-interval 500ms "$@" >"$log/$id.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$port/ready" "worker $id"
}

run_one() { # name policy layout
  local name=$1 policy=$2 layout=$3 log="$OUT/$1" port
  rm -rf "$log" && mkdir -p "$log"
  start_gateway "$log/gateway.log" --split-policy "$policy" \
    --split-slo-ttft "${SLO_TTFT_MS}ms" --split-slo-tpot "${SLO_TPOT_MS}ms"
  port=${GATEWAY_URL##*:}; CPORT=${GATEWAY_CONTROL##*:}
  if [ "$layout" = aggregated ]; then
    start_worker w0 "$log" both
    start_worker w1 "$log" both
  else
    start_worker p0 "$log" prefill --kv-transfer-port 0
    start_worker d0 "$log" decode
  fi
  wait_workers "$GATEWAY_CONTROL" 2 healthy
  local ends=()
  case "$ENDING" in
    model) ends=(--model-ends "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$OUT/synth/config.json")") ;;
    exact) ;;
    *) echo "ENDING=$ENDING: expected model or exact" >&2; exit 2 ;;
  esac
  # shellcheck disable=SC2086
  "$BIN/kvgate-loadtest" run --target "http://127.0.0.1:$port" --model "kvgate-$MODEL" $WORKLOAD "${ends[@]}" --seed 7 \
    --duration 120s --slo-ttft-ms "$SLO_TTFT_MS" --slo-tpot-ms "$SLO_TPOT_MS" --no-progress --out "$log/run" \
    >"$log/run.out" 2>&1 || { cat "$log/run.out" >&2; exit 1; }
  curl -s "http://127.0.0.1:$CPORT/metrics" \
    | grep -E '^kvgate_gateway_split_(decisions_total|prediction_error_seconds_(sum|count))' >"$log/decisions" || true
  cleanup
}

for row in ${ROWS:-aggregated cost_model always}; do
  if [ "$row" = aggregated ]; then run_one aggregated aggregated aggregated; else run_one "$row" "$row" pd; fi
  echo "done: $row" >&2
done

python3 - "$OUT" "$SLO_TTFT_MS" "$SLO_TPOT_MS" "$ENDING" <<'PY'
import json, os, re, sys
out, ttft, tpot, ending = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
print(f"SLO: TTFT <= {ttft} ms, TPOT <= {tpot} ms; requests ended by: {ending}\n")
print("| fleet | split policy | requests ok | output tokens mean (max) | TTFT p50 / p99 ms | TPOT p50 / p99 ms | throughput tok/s | goodput tok/s | decisions | mean abs prediction error TTFT / TPOT ms |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name, fleet in [("aggregated", "2 both"), ("cost_model", "1P+1D"), ("always", "1P+1D")]:
    d = os.path.join(out, name)
    s = json.load(open(os.path.join(d, "run", "results.json")))["runs"][0]["summary"]
    recs = [r for r in json.load(open(os.path.join(d, "run", "results.json")))["runs"][0]["records"]
            if r["status"] == 200 and not r.get("error")]
    outs = [r["completion_tokens"] for r in recs] or [0]
    dec, err = [], {}
    for line in open(os.path.join(d, "decisions")):
        m = re.search(r'choice="(\w+)",reason="(\w+)"\} (\S+)', line)
        if m:
            dec.append(f"{m.group(1)}/{m.group(2)} {float(m.group(3)):.0f}")
        m = re.search(r'prediction_error_seconds_(sum|count)\{term="(\w+)"\} (\S+)', line)
        if m:
            err.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
    mean = lambda t: (f"{1000 * err[t]['sum'] / err[t]['count']:.0f}" if err.get(t, {}).get("count") else "-")
    print(f"| {fleet} | {name} | {s['ok']}/{s['requests']} | {sum(outs) / len(outs):.1f} ({max(outs)}) | "
          f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | "
          f"{s['tpot_p50_ms']:.1f} / {s['tpot_p99_ms']:.1f} | {s['throughput_tokens_per_s']:.1f} | "
          f"{s['goodput_tokens_per_s']:.1f} | {', '.join(dec) or '-'} | {mean('ttft')} / {mean('tpot')} |")
PY
