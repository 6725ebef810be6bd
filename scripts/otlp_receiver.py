#!/usr/bin/env python3
"""A real OTLP/HTTP trace receiver for the tracing test (gateway/tests/tracing.rs): each `POST /v1/traces` body is
decoded with OpenTelemetry's own protobuf messages (PyPI `opentelemetry-proto`), so a malformed export fails the
test; it prints `listening PORT`, then one JSON line per span received:
{"service", "trace_id", "span_id", "parent", "name", "kind", "attributes", "status", "start", "end"}.
Exits by itself after --seconds.

usage: otlp_receiver.py [--seconds 120]
"""
import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse


OUT = threading.Lock()


def emit(line):
    # One write per line under a lock: two exports handled at once must not interleave their lines.
    with OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
            self.send_response(404)
            self.end_headers()
            return
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    emit(json.dumps({
                        "service": resource.get("service.name"), "instance": resource.get("service.instance.id"),
                        "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex() or None, "name": s.name, "kind": s.kind,
                        "attributes": {kv.key: value(kv.value) for kv in s.attributes},
                        "status": s.status.code, "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                    }))
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120)
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"listening {server.server_address[1]}", flush=True)
    threading.Timer(args.seconds, server.shutdown).start()
    server.serve_forever()
    sys.exit(0)


if __name__ == "__main__":
    main()
