#!/usr/bin/env python3
"""A forwarding shim that puts NVIDIA Dynamo's KV-routing policy in front of vLLM pods, as a peer row of
scripts/vllm_peer_bench.py (#66 item 4).

Dynamo's runtime-free selection service (`python -m dynamo.select_service`, PyPI `ai-dynamo-runtime`) selects a
worker and does not forward: it follows each pod's KV events and answers `POST /select_and_reserve` with the pod whose
cache and load cost least for the prompt's token ids. This shim is the rest of a router, and nothing more:
  1. tokenize the request as the pods do: a pod's own `POST /tokenize` (its tokenizer and chat template);
  2. `POST /select_and_reserve` with those ids;
  3. forward the body unchanged to the selected pod, streaming its answer back chunk by chunk;
  4. `POST /reservations/<id>/prefill_complete` at the answer's first chunk, `DELETE /reservations/<id>` at its end
     (also when the pod or the client fails).
It makes no choice of its own. `GET /v1/models` is answered by the first pod. Everything is on 127.0.0.1.

usage: dynamo_shim.py --port P --select URL --model NAME --pod URL [--pod URL ...]
"""
import argparse
import http.client
import json
import threading
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The longest a request may take end to end through the shim (seconds): the bench's own requests end far sooner.
TIMEOUT_S = 600


def call(method, url, body=None, timeout=30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def token_ids(pod, path, body):
    """The prompt's token ids as the pods compute them (`/tokenize` applies the chat template to messages)."""
    if path.endswith("/chat/completions"):
        req = {"model": body["model"], "messages": body["messages"], "add_generation_prompt": True}
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        req = {"model": body["model"], "prompt": prompt}
    return call("POST", f"{pod}/tokenize", req)["tokens"]


class Shim(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    cfg = None

    def log_message(self, *args):
        pass

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path != "/v1/models":
            return self.answer(404, {"error": {"message": "not found", "type": "invalid_request_error",
                                               "code": "not_found"}})
        self.answer(200, call("GET", f"{self.cfg.pod[0]}/v1/models"))

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            return self.answer(404, {"error": {"message": "not found", "type": "invalid_request_error",
                                               "code": "not_found"}})
        try:
            body = json.loads(raw)
            ids = token_ids(self.cfg.pod[0], self.path, body)
            rid = str(uuid.uuid4())
            pick = call("POST", f"{self.cfg.select}/select_and_reserve",
                        {"model_name": self.cfg.model, "token_ids": ids, "selection_id": rid})
        except Exception as e:  # the shim's own failure: an OpenAI-style error, never a hang
            return self.answer(502, {"error": {"message": f"dynamo shim: {e}", "type": "server_error",
                                               "code": "shim_error"}})
        rid = pick.get("selection_id", rid)
        try:
            self.forward(pick["endpoint"], raw, rid)
        finally:
            try:
                call("DELETE", f"{self.cfg.select}/reservations/{rid}")
            except Exception:
                pass

    def forward(self, endpoint, raw, rid):
        u = urllib.parse.urlsplit(endpoint)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S)
        try:
            conn.request("POST", self.path, body=raw, headers={"content-type": "application/json"})
            r = conn.getresponse()
        except OSError as e:  # the pod never answered: an OpenAI-style error, as a router would give
            conn.close()
            return self.answer(502, {"error": {"message": f"dynamo shim: {endpoint}: {e}", "type": "server_error",
                                               "code": "upstream_error"}})
        self.send_response(r.status)
        self.send_header("content-type", r.getheader("content-type", "application/json"))
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        first = True
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            if first:
                first = False
                threading.Thread(target=self.prefill_complete, args=(rid,), daemon=True).start()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        conn.close()

    def prefill_complete(self, rid):
        try:
            call("POST", f"{self.cfg.select}/reservations/{rid}/prefill_complete")
        except Exception:
            pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--select", required=True, help="the selection service's base URL")
    ap.add_argument("--model", required=True)
    ap.add_argument("--pod", action="append", required=True, help="a pod's base URL (the first tokenizes)")
    Shim.cfg = ap.parse_args()
    ThreadingHTTPServer(("127.0.0.1", Shim.cfg.port), Shim).serve_forever()


if __name__ == "__main__":
    main()
