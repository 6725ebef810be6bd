#!/usr/bin/env bash
# kvgate in front of real llama.cpp servers (issue #18's drop-in proof, at benchmark size): PODS llama-cpp-python
# servers on CPU serving the synthetic `small` model as GGUF, a gateway with only the model's tokenizer configured,
# the multi-turn workload once per policy (fresh pods each time). The work is scripts/llamacpp_proof.py's; this
# builds the release binaries, runs it and prints a Markdown table. Everything listens on 127.0.0.1 and stops by
# itself.
#
#   scripts/llamacpp-bench.sh [OUT_DIR]   (default target/llamacpp-bench)
#
# PODS (default 3); POLICIES (default cache_aware_measured,round_robin,least_load); WORKLOAD: the driver's workload flags.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-target/llamacpp-bench}"
PODS="${PODS:-3}"
POLICIES="${POLICIES:-cache_aware_measured,round_robin,least_load}"
WORKLOAD="${WORKLOAD:---users 16 --turns 5 --system-words 200 --question-words 48 --output-tokens 32 --rate 1 --think-time 1}"
PY="${KVGATE_PYTHON:-.venv/bin/python}"
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh

# shellcheck disable=SC2086
"$PY" scripts/llamacpp_proof.py --bin-dir "$BIN" --out "$OUT" --pods "$PODS" --policies "$POLICIES" $WORKLOAD \
  --duration 300 >"$OUT/proof.stdout"
"$PY" - "$OUT/proof.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
c = d["conversion"]
print(f"conversion: token ids equal (BOS aside) {all(c['token_ids_equal_without_bos'])}; greedy chat same text "
      f"{all(g['same_text'] for g in c['greedy_chat'])}, prompt tokens {[g['prompt_tokens'] for g in c['greedy_chat']]}")
print(f"{d['pods']} llama.cpp pods; workload {d['workload']}\n")
print("| policy | requests ok | conversations on one pod | pods per conversation | prompt tokens from cache | "
      "prompt tokens evaluated | hit rate | TTFT p50 / p90 ms | requests per pod |")
print("|---|---|---|---|---|---|---|---|---|")
for name, p in d["policies"].items():
    print(f"| {name} | {p['ok']}/{p['requests']} | {p['sticky_sessions']}/{p['sessions']} | "
          f"{p['mean_pods_per_session']} | {p['prompt_tokens_reused']:,} | {p['prompt_tokens_evaluated']:,} | "
          f"{p['hit_rate']:.3f} | {p['ttft_p50_ms']} / {p['ttft_p90_ms']} | {p['requests_per_pod']} |")
PY
