"""Lint, render and validate the kvgate chart offline (Helm v4 through helm-python-sdk; kubernetes-validate
--strict; the InferencePool, a CRD kubernetes-validate does not know, against the CRD's own OpenAPI schema in
inferencepool-v1.schema.yaml), for several value sets, and check the chart's behaviour. Run by
gateway/tests/helm_chart.rs (so CI runs it); exits non-zero with every failure listed.

    python helm/tests/check_chart.py [KUBERNETES_VERSION]
    python helm/tests/check_chart.py --render VALUE_SET   # JSON: the gateway.toml and worker args it renders
                                                          # (and gateway_env / worker_env: name -> value,
                                                          # "secret:<name>/<key>" or "field:<path>")
"""

import base64
import copy
import hashlib
import json
import os
import ssl
import sys
import tempfile
import time
from pathlib import Path

import helm_python as helm
import jsonschema  # kubernetes-validate's own dependency (it validates with it), so installed with it
import kubernetes_validate
import yaml

CHART = Path(__file__).resolve().parent.parent / "kvgate"
RENDER = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--render" else None
KUBE = sys.argv[1] if len(sys.argv) > 1 and not RENDER else kubernetes_validate.latest_version()
failures: list[str] = []


def check(cond: bool, what: str) -> None:
    if not cond:
        failures.append(what)


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    "sim-workers": {"workers": {"engine": "sim", "simProfile": "cpu-small", "replicas": 4,
                                "model": {"source": "synth", "synthPreset": "tiny"}}},
    "gpu-workers": {"workers": {"replicas": 3, "gpu": {"count": 2}, "runtimeClassName": "nvidia", "kvCacheTokens": 0,
                                "nodeSelector": {"nvidia.com/gpu.present": "true"},
                                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                                "model": {"source": "pvc", "pvc": {"claimName": "models", "subPath": "llama-3.1-8b"}}}},
    "ssd-tier": {"workers": {"kvSsd": {"enabled": True, "type": "hostPath", "path": "/mnt/nvme/kvgate", "bytes": 1000000000},
                             "hostKvBytes": 4294967296}},
    "host-model": {"workers": {"model": {"source": "hostPath", "hostPath": {"path": "/data/models/qwen2"}, "id": "qwen2"},
                               "kvSsd": {"enabled": True}}},
    "host-tier": {"workers": {"hostKvBytes": 8589934592, "kvWritePolicy": "write-through"}},
    "gpu-tiers": {"workers": {"gpu": {"count": 1}, "hostKvBytes": 68719476736,
                              "kvSsd": {"enabled": True, "type": "hostPath", "path": "/mnt/nvme/kvgate"}}},
    "redis-on": {"redis": {"enabled": True}},
    "external-vllm": {"workers": {"external": {"service": "vllm-headless.serving.svc.cluster.local", "model": "llama",
                                               "kvEventsPort": 5557,
                                               "tokenizer": {"pvc": {"claimName": "models", "subPath": "llama"}}}}},
    "external-e2e": {"gateway": {"replicas": 1}, "redis": {"enabled": False},
                     "workers": {"external": {"service": "127.0.0.1", "port": 1, "kind": "openai", "model": "kvgate-tiny",
                                              "tokenizer": {"image": "registry/tokenizer:1"}}}},
    "external-sglang-image": {"workers": {"external": {"service": "sglang", "port": 30000, "kind": "sglang",
                                                       "model": "qwen", "tokenizer": {"image": "registry/qwen-tok:1"}}}},
    "traced": {"tracing": {"otlpEndpoint": "http://otel-collector.observability:4318", "sampleRatio": 0.25}},
    "tuned": {"gateway": {"policy": "least_load", "staleAfter": "5s", "maxConnections": 100, "weights": {"creditDisk": 0},
                          "split": {"policy": "dynamo", "sloTtft": "1s"}},
              "workers": {"blockSize": 32, "maxNumSeqs": 8, "reportInterval": "2s", "gpu": {"count": 1, "dtype": "float16"},
                          "external": {"blockSize": 32}}},
    "dashboard": {"grafana": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "kvgate"}}}},
    "single-replica": {"gateway": {"replicas": 1}, "redis": {"enabled": False}},
    "redis-url-secret": {"redis": {"enabled": True, "mode": "external", "urlSecret": "redis-auth"}},
    "redis-external": {"redis": {"enabled": True, "mode": "external", "url": "redis://redis.shared:6379/0"}},
    "hpa-on": {"gateway": {"hpa": {"enabled": True, "minReplicas": 3, "maxReplicas": 12}, "antiAffinity": "hard"}},
    "existing-secret": {"secrets": {"existingSecret": "my-kvgate-secrets"}},
    "given-secrets": {"secrets": {"reportSecret": "r3port", "adminToken": "adm1n"}},
    "guard-weights": {"gateway": {"weights": {"hotspotWasteFactor": 2.5, "hotspotCopyTokens": 16384}}},
    "e2e": {"workers": {"engine": "sim", "model": {"source": "synth", "synthPreset": "tiny"}},
            "gateway": {"lora": {"adapters": {"sql": "/models/adapters/sql", "chat-v2": "/models/adapters/chat"},
                                 "placement": "cost", "loadTimeout": "20s"},
                        "classes": [{"name": "short", "refill_tokens_per_s": 500000, "burst_tokens": 1000000,
                                     "expected_output_tokens": 64, "match": {"max_prompt_tokens": 8192}},
                                    {"name": "long", "refill_tokens_per_s": 250000.5, "burst_tokens": 4000000,
                                     "max_queued_tokens": 8000000, "max_wait_ms": 5000}]}},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                   "gateway": {"service": {"type": "LoadBalancer"}, "policy": "least_load",
                               "advertiseAllow": ["*.kv-kvgate-worker.serving.svc.cluster.local"],
                               "apiKeysSecret": "team-keys", "forwardAuthorization": True,
                               "headerReadTimeout": "5s", "maxConnections": 1000,
                               "classes": [{"name": "short", "refill_tokens_per_s": 500000, "burst_tokens": 1000000,
                                            "match": {"max_prompt_tokens": 8192}},
                                           {"name": "long", "refill_tokens_per_s": 250000, "burst_tokens": 4000000,
                                            "max_queued_requests": 64, "borrow_idle": False,
                                            "match": {"models": ["llama"], "min_prompt_tokens": 8192}}]}},
    # Lock-down (#25): policies, Redis auth, securityContext, per-secret existing Secrets.
    "policies-off": {"networkPolicy": {"enabled": False}, "workers": {"requireGatewayToken": False}},
    "policies-peers": {"serviceMonitor": {"enabled": True},
                       "networkPolicy": {
                           "publicFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}},
                                          {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.9.0.0/16"]}}],
                           "controlFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                                            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
                           "workerFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                           "extraWorkerPorts": [9000, "kv-xfer"]}},
    # Egress (#41): open again, and the knobs: DNS peers, fronted pods' peers, extra rules; a prefill/decode split
    # with tracing and an external Redis on another port.
    "egress-open": {"networkPolicy": {"restrictEgress": False}, "workers": {"prefill": {"replicas": 1}}},
    "egress-knobs": {"networkPolicy": {"dnsTo": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}},
                                                 {"ipBlock": {"cidr": "169.254.20.10/32"}}],
                                       "extraEgress": [{"to": [{"ipBlock": {"cidr": "10.20.0.5/32"}}],
                                                        "ports": [{"port": 443, "protocol": "TCP"}]}],
                                       "extraWorkerPorts": [9000],
                                       "workerFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
                     "workers": {"prefill": {"replicas": 2, "transferPort": 9200}, "decode": {"replicas": 2}},
                     "redis": {"mode": "external", "url": "rediss://fleet:pw@redis.shared:6380/0"},
                     "tracing": {"otlpEndpoint": "http://otel-collector.observability/v1/traces"}},
    "egress-external": {"networkPolicy": {"externalTo": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "vllm"}},
                                                          "podSelector": {"matchLabels": {"app": "vllm"}}}]},
                        "redis": {"mode": "external", "urlSecret": "redis-auth"},
                        "workers": {"external": {"service": "vllm.vllm.svc.cluster.local", "model": "llama", "kvEventsPort": 5557,
                                                 "kvEventsReplayPort": 5558, "tokenizer": {"image": "registry/tok:1"}}},
                        "tracing": {"otlpEndpoint": "http://otel-collector.observability:4318"}},
    "existing-secrets-each": {"secrets": {"reportSecretFrom": {"existingSecret": "kv-report", "existingSecretKey": "secret"},
                                          "adminTokenFrom": {"existingSecret": "kv-admin"}},
                              "redis": {"auth": {"existingSecret": "kv-redis", "existingSecretKey": "password"}}},
    "existing-secret-mixed": {"secrets": {"existingSecret": "my-kvgate-secrets", "adminTokenFrom": {"existingSecret": "kv-admin"}}},
    "given-redis-password": {"secrets": {"redisPassword": "r3dis"}, "redis": {"prefix": "fleet-a", "auth": {"username": "fleet-a"}}},
    "redis-no-auth": {"redis": {"auth": {"enabled": False}}},
    "redis-external-auth": {"redis": {"mode": "external", "url": "redis://redis.shared:6379/0", "prefix": "fleet-b",
                                      "auth": {"username": "fleet-b", "existingSecret": "shared-redis",
                                               "existingSecretKey": "fleet-b-password"}}},
    # Prefill/decode pools (#27): a prefill pool with a KV transfer listener, a decode pool, the split settings.
    "pd-pools": {"workers": {"replicas": 1, "prefill": {"replicas": 2, "resources": {"limits": {"cpu": "8"}}},
                             "decode": {"replicas": 3}},
                 "gateway": {"split": {"policy": "dynamo", "sloTtft": "1500ms", "bandwidthPriorGbps": 100}}},
    "security-overrides": {"workers": {"gpu": {"count": 1}, "runtimeClassName": "nvidia",
                                       "containerSecurityContext": {"readOnlyRootFilesystem": False}},
                           "gateway": {"podSecurityContext": {"fsGroupChangePolicy": "OnRootMismatch"}}},
    # The endpoint picker of an InferencePool (GIE): the defaults (port 9002, FailClose, the pool named after the
    # release, TLS with the chart's self-signed certificate), vLLM pods with KV events and a tokenizer PVC; then
    # another port, FailOpen, a named SGLang pool with an annotation, one replica, eppFrom, TLS with a Secret of the
    # user's (cert-manager's); an h2c pool without NetworkPolicies and a cleartext picker (Istio without a
    # DestinationRule); and what a test could run.
    "epp": {"epp": {"enabled": True, "pool": {"selector": {"app": "vllm-llama3-8b"}, "model": "meta-llama/Llama-3.1-8B-Instruct"}},
            "workers": {"external": {"kvEventsPort": 5557, "tokenizer": {"pvc": {"claimName": "models", "subPath": "llama-3.1-8b"}}}}},
    "epp-open": {"epp": {"enabled": True, "port": 9102, "maxStreams": 512, "failureMode": "FailOpen",
                         "tls": {"secretName": "qwen-epp-cert"},
                         "pool": {"name": "qwen-pool", "selector": {"app.kubernetes.io/name": "sglang", "model": "qwen3"},
                                  "targetPort": 30000, "kind": "sglang", "model": "qwen3",
                                  "annotations": {"aigateway.envoyproxy.io/processing-body-mode": "buffered"}}},
                 "workers": {"external": {"blockSize": 32, "tokenizer": {"image": "registry/qwen-tok:1"}}},
                 "networkPolicy": {"eppFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}}}]},
                 "gateway": {"replicas": 1}, "redis": {"enabled": False}},
    "epp-h2c": {"epp": {"enabled": True, "tls": {"enabled": False},
                        "auth": {"mode": "token", "tokenSecret": "picker-token"},
                        "pool": {"selector": {"app": "vllm", "tier": "true"}, "model": "llama",
                                 "appProtocol": "kubernetes.io/h2c"}},
                "workers": {"external": {"tokenizer": {"image": "registry/tok:1"}}},
                "networkPolicy": {"enabled": False}},
    # Mutual TLS between the proxies and the picker (epp.auth.mode mtls).
    "epp-mtls": {"epp": {"enabled": True, "auth": {"mode": "mtls", "clientCASecret": "proxies-ca"},
                         "pool": {"selector": {"app": "vllm"}, "model": "llama"}},
                 "workers": {"external": {"tokenizer": {"image": "registry/tok:1"}}}},
    "epp-e2e": {"gateway": {"replicas": 1}, "redis": {"enabled": False},
                "epp": {"enabled": True, "pool": {"selector": {"app": "pod"}, "model": "kvgate-tiny", "kind": "openai"}},
                "workers": {"external": {"tokenizer": {"image": "registry/tokenizer:1"}}}},
}

# Values the schema must reject, and a word its message must contain.
BAD_VALUES: dict[str, tuple[dict, str]] = {
    "negative worker replicas": ({"workers": {"replicas": -1}}, "replicas"),
    "negative gateway replicas": ({"gateway": {"replicas": -2}}, "replicas"),
    "unknown policy": ({"gateway": {"policy": "fastest"}}, "policy"),
    "unknown lora placement": ({"gateway": {"lora": {"placement": "random"}}}, "placement"),
    "a lora name with a space": ({"gateway": {"lora": {"adapters": {"my adapter": "/models/a"}}}}, "my adapter"),
    "unknown engine": ({"workers": {"engine": "tpu"}}, "engine"),
    "pvc without a claim": ({"workers": {"model": {"source": "pvc"}}}, "claimName"),
    "external redis without a url": ({"redis": {"enabled": True, "mode": "external"}}, "url"),
    "two replicas without redis": ({"redis": {"enabled": False}}, "/redis/enabled"),
    "an hpa without redis": ({"gateway": {"replicas": 1, "hpa": {"enabled": True}}, "redis": {"enabled": False}}, "/redis/enabled"),
    "typo in a key": ({"gateway": {"replica": 3}}, "replica"),
    "hotspot ratio under 1": ({"gateway": {"weights": {"hotspotRatio": 0.5}}}, "hotspotRatio"),
    "negative waste factor": ({"gateway": {"weights": {"hotspotWasteFactor": -1}}}, "hotspotWasteFactor"),
    "bad duration": ({"gateway": {"staleAfter": "soon"}}, "staleAfter"),
    "negative gpus": ({"workers": {"gpu": {"count": -1}}}, "count"),
    "unknown gpu dtype": ({"workers": {"gpu": {"count": 1, "dtype": "int4"}}}, "dtype"),
    "gpu memory over 1": ({"workers": {"gpu": {"count": 1, "memoryUtilization": 1.5}}}, "memoryUtilization"),
    "bad header timeout": ({"gateway": {"headerReadTimeout": "slow"}}, "headerReadTimeout"),
    "zero connections": ({"gateway": {"maxConnections": 0}}, "maxConnections"),
    "tier credit over 1": ({"gateway": {"weights": {"creditHost": 1.5}}}, "creditHost"),
    "unknown write policy": ({"workers": {"hostKvBytes": 1, "kvWritePolicy": "later"}}, "kvWritePolicy"),
    "external pods without a model": ({"workers": {"external": {"service": "vllm", "tokenizer": {"image": "t"}}}}, "model"),
    "external pods without a tokenizer": ({"workers": {"external": {"service": "vllm", "model": "m"}}}, "tokenizer"),
    "events from openai pods": ({"workers": {"external": {"kind": "openai", "kvEventsPort": 5557}}}, "kvEventsPort"),
    "a report secret given twice": ({"secrets": {"reportSecret": "x", "reportSecretFrom": {"existingSecret": "s"}}}, "reportSecret"),
    "an admin token given twice": ({"secrets": {"adminToken": "x", "adminTokenFrom": {"existingSecret": "s"}}}, "adminToken"),
    "a redis password given twice": ({"secrets": {"redisPassword": "x"}, "redis": {"auth": {"existingSecret": "s"}}}, "redisPassword"),
    "an empty secret key": ({"secrets": {"reportSecretFrom": {"existingSecret": "s", "existingSecretKey": ""}}}, "existingSecretKey"),
    "a secret name with capitals": ({"redis": {"auth": {"existingSecret": "My_Secret"}}}, "existingSecret"),
    "a glob in the redis prefix": ({"redis": {"prefix": "kv*"}}, "prefix"),
    "the disabled default user": ({"redis": {"auth": {"username": "default"}}}, "username"),
    "an external username without a password": ({"redis": {"mode": "external", "url": "redis://r:6379",
                                                           "auth": {"username": "u"}}}, "existingSecret"),
    "a typo in a peer": ({"networkPolicy": {"controlFrom": [{"podSelecter": {}}]}}, "podSelecter"),
    "ipBlock with a selector": ({"networkPolicy": {"publicFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"},
                                                                   "podSelector": {}}]}}, "publicFrom"),
    "a worker port over 65535": ({"networkPolicy": {"extraWorkerPorts": [70000]}}, "extraWorkerPorts"),
    "a typo in an egress rule": ({"networkPolicy": {"extraEgress": [{"too": [{"podSelector": {}}]}]}}, "too"),
    "an egress port over 65535": ({"networkPolicy": {"extraEgress": [{"ports": [{"port": 70000}]}]}}, "port"),
    "no DNS peers": ({"networkPolicy": {"dnsTo": []}}, "dnsTo"),
    "a non-boolean egress switch": ({"networkPolicy": {"restrictEgress": "yes"}}, "restrictEgress"),
    "a negative uid": ({"workers": {"podSecurityContext": {"runAsUser": -1}}}, "runAsUser"),
    "an unknown seccomp type": ({"redis": {"containerSecurityContext": {"seccompProfile": {"type": "Off"}}}}, "type"),
    "a lower-case capability": ({"gateway": {"containerSecurityContext": {"capabilities": {"drop": ["all"]}}}}, "drop"),
    "a typo in a securityContext": ({"tests": {"containerSecurityContext": {"readOnlyRootFS": True}}}, "readOnlyRootFS"),
    "a non-boolean token switch": ({"workers": {"requireGatewayToken": "yes"}}, "requireGatewayToken"),
    "a non-boolean policy switch": ({"networkPolicy": {"enabled": "on"}}, "enabled"),
    "an unknown split policy": ({"gateway": {"split": {"policy": "sometimes"}}}, "policy"),
    "negative prefill replicas": ({"workers": {"prefill": {"replicas": -1}}}, "replicas"),
    "a zero bandwidth prior": ({"gateway": {"split": {"bandwidthPriorGbps": 0}}}, "bandwidthPriorGbps"),
    "an endpoint picker without a model": ({"epp": {"enabled": True, "pool": {"selector": {"app": "v"}}},
                                            "workers": {"external": {"tokenizer": {"image": "t"}}}}, "model"),
    "an endpoint picker without a selector": ({"epp": {"enabled": True, "pool": {"model": "m"}},
                                               "workers": {"external": {"tokenizer": {"image": "t"}}}}, "selector"),
    "an endpoint picker without a tokenizer": ({"epp": {"enabled": True, "pool": {"model": "m", "selector": {"app": "v"}}}},
                                               "tokenizer"),
    "an endpoint picker and a fronted service": ({"epp": {"enabled": True, "pool": {"model": "m", "selector": {"app": "v"}}},
                                                  "workers": {"external": {"service": "vllm", "model": "m",
                                                                           "tokenizer": {"image": "t"}}}}, "service"),
    "an unknown failure mode": ({"epp": {"failureMode": "FailSoft"}}, "failureMode"),
    "a pool label value with a slash": ({"epp": {"pool": {"selector": {"app": "a/b"}}}}, "selector"),
    "a pool label key with a space": ({"epp": {"pool": {"selector": {"my app": "a"}}}}, "selector"),
    "an unknown pool protocol": ({"epp": {"pool": {"appProtocol": "grpc"}}}, "appProtocol"),
    "an epp port over 65535": ({"epp": {"port": 70000}}, "port"),
    "a pool name with capitals": ({"epp": {"pool": {"name": "MyPool"}}}, "name"),
    "a picker TLS secret name with capitals": ({"epp": {"tls": {"secretName": "EPP_Cert"}}}, "secretName"),
    "a picker TLS secret with TLS off": ({"epp": {"tls": {"enabled": False, "secretName": "epp-cert"}}}, "secretName"),
    "a typo in the picker's TLS": ({"epp": {"tls": {"secret": "epp-cert"}}}, "secret"),
    "an unknown picker auth mode": ({"epp": {"auth": {"mode": "none"}}}, "mode"),
    "a picker token secret name with capitals": ({"epp": {"auth": {"tokenSecret": "Token"}}}, "tokenSecret"),
    "a non-boolean picker TLS switch": ({"epp": {"tls": {"enabled": "on"}}}, "enabled"),
    "events from an openai pool": ({"epp": {"enabled": True, "pool": {"model": "m", "selector": {"app": "v"}, "kind": "openai"}},
                                    "workers": {"external": {"kvEventsPort": 5557, "tokenizer": {"image": "t"}}}}, "kvEventsPort"),
}

chart = helm.Chart.load(str(CHART))
defaults = chart.values


def render(name: str, values: dict) -> list[dict]:
    rendered = chart.render(values, name="kv", namespace="serving", is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            check("port-forward" in text or "get svc" in text, f"{name}: NOTES.txt says how to reach the gateway")
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__path"] = path
                docs.append(doc)
    return docs


def find(docs: list[dict], kind: str, suffix: str = "") -> list[dict]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]


if RENDER:
    import json

    docs = render(RENDER, deep_merge(defaults, VALUE_SETS[RENDER]))
    cm = find(docs, "ConfigMap", "-gateway")[0]
    sts = find(docs, "StatefulSet")
    worker = sts[0]["spec"]["template"]["spec"]["containers"][0] if sts else {"args": []}
    gateway = find(docs, "Deployment", "-gateway")[0]["spec"]["template"]["spec"]["containers"][0]

    def env_of(c: dict) -> dict:
        # Plain values as they are; a Secret's as "secret:<name>/<key>"; a field's as "field:<path>".
        out = {}
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            if "secretKeyRef" in ref:
                out[e["name"]] = f'secret:{ref["secretKeyRef"]["name"]}/{ref["secretKeyRef"]["key"]}'
            elif "fieldRef" in ref:
                out[e["name"]] = f'field:{ref["fieldRef"]["fieldPath"]}'
            else:
                out[e["name"]] = e.get("value", "")
        return out

    print(json.dumps({"gateway_toml": cm["data"]["gateway.toml"], "gateway_args": gateway["args"],
                      "worker_args": worker["args"], "gateway_env": env_of(gateway), "worker_env": env_of(worker)}))
    sys.exit(0)


def secret_refs(pod: dict) -> set[tuple[str, str]]:
    """(Secret, key) of every secretKeyRef in a pod's containers and init containers."""
    return {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for c in pod.get("initContainers", []) + pod["containers"] for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


def env_map(c: dict) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def expected_secret_refs(values: dict) -> dict:
    """Where each secret should come from: use -> (Secret, key, managed by the chart)."""
    s, r, chart_secret = values["secrets"], values["redis"], "kv-kvgate-secrets"
    refs = {}
    for use, frm, key in (("report", "reportSecretFrom", "report-secret"), ("admin", "adminTokenFrom", "admin-token")):
        if s[frm]["existingSecret"]:
            refs[use] = (s[frm]["existingSecret"], s[frm]["existingSecretKey"], False)
        elif s["existingSecret"]:
            refs[use] = (s["existingSecret"], key, False)
        else:
            refs[use] = (chart_secret, key, True)
    internal_auth = r["enabled"] and r["mode"] == "internal" and r["auth"]["enabled"]
    external_auth = r["enabled"] and r["mode"] == "external" and r["auth"]["existingSecret"]
    if (internal_auth or external_auth) and r["auth"]["existingSecret"]:
        refs["redis"] = (r["auth"]["existingSecret"], r["auth"]["existingSecretKey"], False)
    elif internal_auth:
        refs["redis"] = (chart_secret, "redis-password", True)
    return refs


def pod_templates(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(name, pod metadata, pod spec) of every workload and bare pod."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out.append((d["metadata"]["name"], d["spec"]["template"]["metadata"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "Pod":
            out.append((d["metadata"]["name"], d["metadata"], d["spec"]))
    return out


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def fronted(values: dict) -> dict | None:
    """The pods the gateway fronts instead of kvgate workers, in the shape of workers.external: its own, or with
    epp.enabled the InferencePool's (the chart's headless Service; port, model and kind from epp.pool); None when
    the chart deploys kvgate workers."""
    ext, e = values["workers"]["external"], values["epp"]
    if e["enabled"]:
        p = e["pool"]
        return {**ext, "service": "kv-kvgate-pool.serving.svc.cluster.local", "port": p["targetPort"],
                "model": p["model"], "kind": p["kind"]}
    return ext if ext["service"] else None


# Where the gateway container reads the picker's certificate and key (epp.tls).
EPP_TLS_DIR = "/etc/kvgate/epp-tls"


def tls_pair(secret: dict) -> dict | str:
    """A kubernetes.io/tls Secret's certificate, decoded, if its key is the certificate's (loaded as a TLS server
    loads them, as the picker does at start); else why not."""
    with tempfile.TemporaryDirectory() as d:
        crt, key = Path(d, "tls.crt"), Path(d, "tls.key")
        crt.write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
        key.write_bytes(base64.b64decode(secret["data"]["tls.key"]))
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(crt, key)
            return ssl._ssl._test_decode_cert(str(crt))  # the stdlib's decoder (no cryptography package here)
        except (ssl.SSLError, ValueError) as e:
            return f"{type(e).__name__}: {e}"


# The InferencePool CRD's schema (GIE v1.6.0, copied verbatim: see the file's header).
POOL_SCHEMA = yaml.safe_load((Path(__file__).resolve().parent / "inferencepool-v1.schema.yaml").read_text())


def strict(node):
    """The schema refusing unknown fields, as kubernetes-validate --strict does (the API server prunes them, or
    refuses them under strict field validation): every object schema that lists its properties and says nothing
    about others gets additionalProperties false (metadata, a bare `type: object`, stays open)."""
    if isinstance(node, list):
        return [strict(i) for i in node]
    if not isinstance(node, dict):
        return node
    out = {k: ({f: strict(s) for f, s in v.items()} if k == "properties" else strict(v)) for k, v in node.items()}
    if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


POOL_VALIDATOR = jsonschema.Draft7Validator(strict(POOL_SCHEMA))


def pool_errors(d: dict) -> list[str]:
    """What the API server would refuse in an InferencePool: its CRD's OpenAPI schema, and the two CEL rules
    (x-kubernetes-validations) the CRD adds, which jsonschema does not evaluate."""
    errs = [f"{e.message} at {list(e.absolute_path)}" for e in POOL_VALIDATOR.iter_errors(d)]
    if d.get("apiVersion") != "inference.networking.k8s.io/v1" or d.get("kind") != "InferencePool":
        errs.append(f"apiVersion/kind {d.get('apiVersion')}/{d.get('kind')}")
    name = d.get("metadata", {}).get("name", "")
    if not (0 < len(name) <= 253 and all(c.islower() or c.isdigit() or c in "-." for c in name)
            and name[0].isalnum() and name[-1].isalnum()):
        errs.append(f"metadata.name {name!r} is not a DNS subdomain")
    spec = d.get("spec", {})
    numbers = [p_.get("number") for p_ in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        errs.append("port number must be unique")  # self.all(p1, self.exists_one(p2, p1.number==p2.number))
    ref = spec.get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
        errs.append("port is required when kind is 'Service' or unspecified")  # self.kind != 'Service' || has(self.port)
    return errs


# The pool check refuses what the API server would (a broken checker would pass everything).
_good_pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "p"},
              "spec": {"selector": {"matchLabels": {"app": "v"}}, "targetPorts": [{"number": 8000}],
                       "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "FailClose"}}}
check(pool_errors(_good_pool) == [], f"the InferencePool check accepts a valid pool: {pool_errors(_good_pool)}")
for what, bad in [("no targetPorts", {"targetPorts": []}), ("a port of 0", {"targetPorts": [{"number": 0}]}),
                  ("a repeated port", {"targetPorts": [{"number": 1}, {"number": 1}]}),
                  ("no selector labels", {"selector": {"matchLabels": {}}}),
                  ("matchExpressions", {"selector": {"matchLabels": {"a": "b"}, "matchExpressions": []}}),
                  ("a label value with a slash", {"selector": {"matchLabels": {"a": "b/c"}}}),
                  ("an unknown failure mode", {"endpointPickerRef": {"name": "e", "port": {"number": 1}, "failureMode": "FailSoft"}}),
                  ("a Service ref without a port", {"endpointPickerRef": {"name": "e"}}),
                  ("an unknown appProtocol", {"appProtocol": "grpc"})]:
    pool = copy.deepcopy(_good_pool)
    pool["spec"].update(bad)
    check(bool(pool_errors(pool)), f"the InferencePool check refuses {what}")

for name, extra in VALUE_SETS.items():
    values = deep_merge(defaults, extra)
    lint = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE}")
    errors = [m for m in lint.get("messages") or [] if m.get("severity", 0) >= 2] + (lint.get("errors") or [])
    check(not errors, f"{name}: helm lint --strict: {errors}")
    try:
        docs = render(name, values)
    except helm.HelmError as e:
        failures.append(f"{name}: render failed: {e}")
        continue
    for d in docs:
        path = d.pop("__path")
        if d["kind"] == "ServiceMonitor":
            # A CRD: not in the Kubernetes schemas; check its shape here instead.
            check(d["apiVersion"] == "monitoring.coreos.com/v1" and d["spec"]["endpoints"], f"{name}: ServiceMonitor shape")
            continue
        if d["kind"] == "InferencePool":
            # A CRD too: validated against the CRD's own OpenAPI schema (and its CEL rules).
            for err in pool_errors(d):
                failures.append(f"{name}: {path} InferencePool/{d['metadata']['name']}: {err}")
            continue
        try:
            kubernetes_validate.validate(d, KUBE, strict=True)
        except kubernetes_validate.ValidationError as e:
            failures.append(f"{name}: {path} {d['kind']}/{d['metadata']['name']}: {e.message} at {list(e.path)}")
    # Behaviour.
    services = find(docs, "Service")
    control = [s for s in services if s["metadata"]["name"].endswith("-control")]
    check(len(control) == 1 and control[0]["spec"]["type"] == "ClusterIP", f"{name}: the control Service is ClusterIP")
    public = [s for s in services if s["metadata"]["name"].endswith("-gateway")]
    check(len(public) == 1 and all(p["name"] != "control" for p in public[0]["spec"]["ports"]),
          f"{name}: the public Service does not expose the control port")
    g = values["gateway"]
    gw_toml = next((cm["data"]["gateway.toml"] for cm in find(docs, "ConfigMap") if "gateway.toml" in cm["data"]), "")
    # A setting left null is not written: the binary's own default applies (each default is written once, in code).
    for key, toml_key, value in [("maxConnections", "max-connections", g["maxConnections"]),
                                 ("staleAfter", "stale-after", g["staleAfter"]), ("policy", "policy", g["policy"]),
                                 ("split.policy", "split-policy", g["split"]["policy"]),
                                 ("split.sloTtft", "split-slo-ttft", g["split"]["sloTtft"]),
                                 ("weights.creditDisk", "credit_disk", g["weights"]["creditDisk"])]:
        lines = [l.strip() for l in gw_toml.splitlines() if l.strip().startswith(f"{toml_key} =")]
        want = [] if value is None else [f"{toml_key} = " + (f'"{value}"' if isinstance(value, str) else
                                                             f"{float(value):.6f}" if key.startswith("weights") else str(value))]
        check(lines == want, f"{name}: {key} in gateway.toml only when set ({lines} vs {want})")
    otlp = values["tracing"]["otlpEndpoint"]
    check((f'otlp-endpoint = "{otlp}"' in gw_toml) == bool(otlp) and ("otlp-endpoint" in gw_toml) == bool(otlp),
          f"{name}: the gateway exports traces exactly when tracing.otlpEndpoint is set")
    check(("advertise-allow" in gw_toml) == bool(g["advertiseAllow"]), f"{name}: advertise-allow follows values")
    for key, toml_key in [("hotspotWasteFactor", "hotspot_waste_factor"), ("hotspotCopyTokens", "hotspot_copy_tokens")]:
        set_ = g["weights"][key] is not None
        check((toml_key in gw_toml) == set_, f"{name}: {toml_key} in gateway.toml only when set (else the code's default)")
    gw_pod = find(docs, "Deployment", "-gateway")[0]["spec"]["template"]["spec"]
    key_vols = [v for v in gw_pod["volumes"] if v.get("secret", {}).get("secretName") == g["apiKeysSecret"]]
    check(("api-keys-file" in gw_toml) == bool(g["apiKeysSecret"]) == bool(key_vols),
          f"{name}: the API key Secret is mounted and named in gateway.toml, or neither")
    for cm in find(docs, "ConfigMap"):
        text = yaml.safe_dump(cm["data"])
        for s in ("r3port", "adm1n", "report-secret", "admin-token"):
            check(s not in text, f"{name}: ConfigMap {cm['metadata']['name']} holds no secret ({s})")
    # The chart's Secret of generated and given secrets (the picker's TLS Secret is checked with the picker below).
    secrets = [s for s in find(docs, "Secret") if s["metadata"]["name"] != "kv-kvgate-epp-tls"]
    refs = expected_secret_refs(values)
    managed_keys = {key for (_, key, managed) in refs.values() if managed}
    if not managed_keys:
        check(not secrets, f"{name}: no Secret is created when every secret comes from an existing one")
    else:
        # The chart's Secret holds exactly the secrets no existing Secret supplies (with the all-in-one
        # existingSecret: only the in-chart Redis's password).
        check(len(secrets) == 1 and secrets[0]["metadata"]["name"] == "kv-kvgate-secrets"
              and set(secrets[0]["data"]) == managed_keys, f"{name}: one Secret with {sorted(managed_keys)}")
    chart_data = secrets[0]["data"] if secrets else {}
    given = {"report-secret": values["secrets"]["reportSecret"], "admin-token": values["secrets"]["adminToken"],
             "redis-password": values["secrets"]["redisPassword"]}
    for key in managed_keys & set(chart_data):
        plain = base64.b64decode(chart_data[key])
        if given[key]:
            check(plain == given[key].encode(), f"{name}: given {key}")
        else:
            check(len(plain) == 40 and plain.isalnum(), f"{name}: generated {key}")
    secret_name = refs["report"][0]
    sts = find(docs, "StatefulSet")
    w = values["workers"]
    ext = fronted(values) or w["external"]
    epp = values["epp"]
    pools = [p for p in ("prefill", "decode") if w[p]["replicas"] > 0]
    check(len(sts) == (0 if ext["service"] else 1 + len(pools)),
          f"{name}: one worker StatefulSet per pool, none when fronting pods")
    if not ext["service"]:
        for st in sts:
            pool = next((p for p in pools if st["metadata"]["name"].endswith(f"-worker-{p}")), None)
            c = st["spec"]["template"]["spec"]["containers"][0]
            args = c["args"]
            role = args[args.index("--role") + 1]
            check(role == (pool or "both"), f"{name}: {st['metadata']['name']} serves role {role}")
            check(("--kv-transfer-port" in args) == (pool == "prefill"), f"{name}: only the prefill pool listens for transfers")
            envs = {e["name"]: e.get("value") for e in c.get("env", [])}
            check(envs.get("KVGATE_WORKER_OTLP_ENDPOINT") == values["tracing"]["otlpEndpoint"],
                  f"{name}: workers export traces exactly when tracing.otlpEndpoint is set")
            for flag, value in [("--block-size", w["blockSize"]), ("--max-num-seqs", w["maxNumSeqs"]),
                                ("--report-interval", w["reportInterval"])]:
                got = args[args.index(flag) + 1] if flag in args else None
                check(got == (None if value is None else str(value)), f"{name}: {flag} only when set ({got})")
            if pool:
                check(st["spec"]["replicas"] == w[pool]["replicas"], f"{name}: {pool} replicas follow values")
                want_res = w[pool]["resources"] or w["resources"]
                check(c["resources"] == want_res, f"{name}: {pool} resources follow values")
            # No other StatefulSet of the release selects this one's pods (the main one's selector is a subset of
            # every pool's, so only pools are checked against each other and against the main pool's pods).
            labels = st["spec"]["template"]["metadata"]["labels"]
            for other in sts:
                if other is not st and "kvgate.io/pool" in other["spec"]["selector"]["matchLabels"]:
                    check(not selects(other["spec"]["selector"], labels),
                          f"{name}: {other['metadata']['name']} does not select {st['metadata']['name']}'s pods")
    gw_spec = find(docs, "Deployment", "-gateway")[0]["spec"]["template"]["spec"]
    tok_vols = [v for v in gw_spec["volumes"] if v["name"] == "tokenizer"]
    if ext["service"]:
        check(f'discover = "{ext["service"]}:{ext["port"]}"' in gw_toml and f'name = "{ext["model"]}"' in gw_toml
              and 'tokenizer = "/opt/kvgate/tokenizer"' in gw_toml, f"{name}: the fronted pool in gateway.toml")
        check(("kv-events-port" in gw_toml) == (ext["kvEventsPort"] > 0), f"{name}: KV events only when a port is set")
        mounts = [m for m in gw_spec["containers"][0]["volumeMounts"] if m["name"] == "tokenizer"]
        check(len(tok_vols) == 1 and len(mounts) == 1, f"{name}: the tokenizer volume is mounted")
        inits = gw_spec.get("initContainers", [])
        if ext["tokenizer"]["pvc"]["claimName"]:
            check(tok_vols[0]["persistentVolumeClaim"]["claimName"] == ext["tokenizer"]["pvc"]["claimName"] and not inits,
                  f"{name}: the tokenizer from its PVC")
        else:
            check(len(inits) == 1 and inits[0]["image"] == ext["tokenizer"]["image"], f"{name}: an init container copies the tokenizer")
    else:
        check(not tok_vols and "[[models]]" not in gw_toml, f"{name}: no fronted pool")
    if sts:
        s = sts[0]
        check(s["spec"]["replicas"] == w["replicas"], f"{name}: worker replicas follow values")
        pod = s["spec"]["template"]["spec"]
        c = pod["containers"][0]
        limits = c["resources"].get("limits", {})
        args = c["args"]
        if w["gpu"]["count"] > 0:
            check(limits.get("nvidia.com/gpu") == w["gpu"]["count"], f"{name}: GPUs per worker follow values")
            check(pod.get("runtimeClassName") == (w["runtimeClassName"] or None), f"{name}: runtimeClassName")
            check(args[args.index("--device") + 1] == "cuda", f"{name}: GPU workers run --device cuda")
            dtype = args[args.index("--dtype") + 1] if "--dtype" in args else None
            check(dtype == w["gpu"]["dtype"], f"{name}: --dtype follows values (absent when null)")
            check(c["image"].endswith("-gpu") or c["image"] == w["gpu"]["image"], f"{name}: GPU workers use the GPU image")
        else:
            check("nvidia.com/gpu" not in limits, f"{name}: no GPU asked for")
            check(args[args.index("--device") + 1] == "cpu", f"{name}: CPU workers run --device cpu")
        check(("--kv-cache-tokens" in args) == ((w["kvCacheTokens"] or 0) > 0),
              f"{name}: --kv-cache-tokens only when set (null or 0: the worker's default, sized from GPU memory on GPUs)")
        check(("--engine" in args) == (w["engine"] == "sim"), f"{name}: --engine sim follows values")
        check(("--host-kv-bytes" in args) == ((w["hostKvBytes"] or 0) > 0), f"{name}: --host-kv-bytes only when set")
        if (w["hostKvBytes"] or 0) > 0:
            check(args[args.index("--host-kv-bytes") + 1] == str(w["hostKvBytes"]), f"{name}: host tier args")
        policy = args[args.index("--kv-write-policy") + 1] if "--kv-write-policy" in args else None
        check(policy == w["kvWritePolicy"], f"{name}: --kv-write-policy only when set")
        check(("--disk-kv-path" in args) == w["kvSsd"]["enabled"], f"{name}: --disk-kv-path with the SSD volume")
        if w["kvSsd"]["enabled"]:
            check(args[args.index("--disk-kv-path") + 1] == "/var/lib/kvgate/kv-ssd/$(POD_NAME)"
                  and args[args.index("--disk-kv-bytes") + 1] == str(w["kvSsd"]["bytes"]), f"{name}: SSD tier args")
            check(any(e["name"] == "POD_NAME" for e in c["env"]), f"{name}: POD_NAME for the per-pod SSD directory")
        check(any(a.startswith("http://kv-kvgate-control.serving.svc.cluster.local:") for a in args),
              f"{name}: --report-to the control Service")
        adv = args[args.index("--advertise-url") + 1]
        check(adv.startswith("http://$(POD_NAME).kv-kvgate-worker.serving.svc"), f"{name}: advertise URL from the pod DNS name")
        check(c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 300, f"{name}: startup probe")
        wrefs = [e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]]
        check(wrefs == [secret_name], f"{name}: worker secret from {secret_name}")
        wenv = env_map(c)
        check(wenv["KVGATE_REPORT_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": refs["report"][0], "key": refs["report"][1]},
              f"{name}: the workers' report secret from {refs['report'][:2]}")
        check(("KVGATE_WORKER_REQUIRE_GATEWAY_TOKEN" in wenv) == w["requireGatewayToken"]
              and wenv.get("KVGATE_WORKER_REQUIRE_GATEWAY_TOKEN", {"value": "true"}).get("value") == "true",
              f"{name}: KVGATE_WORKER_REQUIRE_GATEWAY_TOKEN=true follows workers.requireGatewayToken")
        check("--require-gateway-token" not in args, f"{name}: the token switch is an env var, not an argument")
        wmounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        check(wenv.get("KVGATE_CACHE_DIR", {}).get("value") in wmounts and "/tmp" in wmounts,
              f"{name}: the worker's cache dir and /tmp are volumes")
        if w["model"]["source"] == "synth":
            sd = args[args.index("--synth-dir") + 1]
            check(any(sd.startswith(m + "/") for m in wmounts), f"{name}: the synth dir is on a volume")
        if w["gpu"]["count"] > 0:
            check(any(wenv.get("CUDA_CACHE_PATH", {}).get("value", "-").startswith(m + "/") for m in wmounts),
                  f"{name}: the CUDA JIT cache is on a volume")
        if w["model"]["source"] == "pvc":
            vols = {v["name"]: v for v in pod["volumes"]}
            check(vols["model"]["persistentVolumeClaim"]["claimName"] == w["model"]["pvc"]["claimName"], f"{name}: model PVC")
    dep = find(docs, "Deployment", "-gateway")
    check(len(dep) == 1, f"{name}: one gateway Deployment")
    if dep:
        spec = dep[0]["spec"]
        pod = spec["template"]["spec"]
        c = pod["containers"][0]
        hpa = values["gateway"]["hpa"]["enabled"]
        check(("replicas" in spec) != hpa, f"{name}: replicas set unless the HPA owns them")
        if epp["enabled"] and not epp["tls"]["enabled"]:
            # The endpoint picker's gRPC health service on its port (the EPP Service lists only Ready pods).
            check(c["readinessProbe"].get("grpc") == {"port": epp["port"], "service": "readiness"}
                  and c["livenessProbe"].get("grpc") == {"port": epp["port"], "service": "liveness"},
                  f"{name}: gRPC readiness and liveness probes on the EPP port: {c['readinessProbe']} {c['livenessProbe']}")
        else:
            # Also a picker over TLS: the kubelet's gRPC probe speaks cleartext only, so HTTP on the control port.
            check(c["readinessProbe"].get("httpGet") == {"path": "/ready", "port": "control"}
                  and c["livenessProbe"].get("httpGet") == {"path": "/health", "port": "control"}
                  and not any("grpc" in c[p_] for p_ in ("readinessProbe", "livenessProbe")),
                  f"{name}: readiness on /ready (needs a healthy worker), liveness on /health, on the control port: "
                  f"{c['readinessProbe']} {c['livenessProbe']}")
        g = values["gateway"]
        check(pod["terminationGracePeriodSeconds"] > g["shutdownGraceSeconds"] + g["preStopSleepSeconds"],
              f"{name}: termination grace longer than the drain")
        check(bool(find(docs, "HorizontalPodAutoscaler")) == hpa, f"{name}: HPA only when enabled")
        redis_url = [e for e in c["env"] if e["name"] == "KVGATE_GATEWAY_REDIS_URL"]
        check(bool(redis_url) == values["redis"]["enabled"], f"{name}: Redis URL only with Redis on")
        if redis_url and values["redis"]["urlSecret"] and values["redis"]["mode"] == "external":
            check(redis_url[0]["valueFrom"]["secretKeyRef"] == {"name": values["redis"]["urlSecret"], "key": "redis-url"},
                  f"{name}: the Redis URL from its Secret")
        data_dir = [e for e in c["env"] if e["name"] == "KVGATE_DATA_DIR"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        check(bool(data_dir) and mounts.get("state") == data_dir[0]["value"], f"{name}: the data dir is a mounted volume")
        state_vol = {v["name"]: v for v in pod["volumes"]}["state"]
        persisted = not values["redis"]["enabled"] and g["persistence"]["enabled"]
        check(("persistentVolumeClaim" in state_vol) == persisted, f"{name}: state on a PVC only for a lone replica")
        check(bool(find(docs, "PersistentVolumeClaim", "-state")) == persisted, f"{name}: the state PVC")
        if persisted:
            check(spec.get("strategy", {}).get("type") == "Recreate", f"{name}: Recreate with a ReadWriteOnce volume")
    check(bool(find(docs, "Deployment", "-redis")) == (values["redis"]["enabled"] and values["redis"]["mode"] == "internal"),
          f"{name}: in-chart Redis only in internal mode")
    check(bool(find(docs, "PodDisruptionBudget")) == values["gateway"]["pdb"]["enabled"], f"{name}: PDB")
    tests = [d for d in docs if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    check(len(tests) == 1 and "chat/completions" in str(tests[0]["spec"]), f"{name}: a helm test sends a chat completion")
    conf = yaml.safe_load(yaml.safe_dump(find(docs, "ConfigMap")[0]["data"]))["gateway.toml"]
    if values["gateway"]["classes"]:
        check(conf.count("[[classes]]") == len(values["gateway"]["classes"]), f"{name}: classes in the gateway config")
    dash = find(docs, "ConfigMap", "-dashboard")
    check(bool(dash) == values["grafana"]["dashboard"]["enabled"], f"{name}: the dashboard ConfigMap only when enabled")
    if dash:
        check(dash[0]["metadata"]["labels"].get("grafana_dashboard") == "1", f"{name}: the sidecar's label")
        board = json.loads(dash[0]["data"]["kvgate.json"])
        check(len(board["panels"]) >= 10 and all(t["expr"] for p in board["panels"] for t in p["targets"]),
              f"{name}: the dashboard's panels came through")
    # --- Lock-down (#25) ---
    r = values["redis"]
    internal = r["enabled"] and r["mode"] == "internal"
    chart_secret_data = {("kv-kvgate-secrets", k): v for k, v in chart_data.items()}
    # Every secret the pods read comes from where the values say, and each pod's checksum/secret is the sha256 of
    # {"<secret>/<key>": base64 value} over exactly the secrets it reads (user-managed ones: "" offline, no lookup).
    gw = find(docs, "Deployment", "-gateway")[0]["spec"]["template"]
    gc = env_map(gw["spec"]["containers"][0])
    for env, use in (("KVGATE_REPORT_SECRET", "report"), ("KVGATE_ADMIN_TOKEN", "admin")):
        check(gc[env]["valueFrom"]["secretKeyRef"] == {"name": refs[use][0], "key": refs[use][1]},
              f"{name}: gateway {env} from {refs[use][:2]}")
    if "redis" in refs:
        check(gc.get("KVGATE_GATEWAY_REDIS_PASSWORD", {}).get("valueFrom", {}).get("secretKeyRef")
              == {"name": refs["redis"][0], "key": refs["redis"][1]}, f"{name}: gateway Redis password from {refs['redis'][:2]}")
    else:
        check("KVGATE_GATEWAY_REDIS_PASSWORD" not in gc, f"{name}: no Redis password without Redis auth")
    user = (r["auth"]["username"] or "kvgate") if internal and r["auth"]["enabled"] else (
        r["auth"]["username"] if "redis" in refs else "")
    check(gc.get("KVGATE_GATEWAY_REDIS_USERNAME", {}).get("value", "") == user, f"{name}: KVGATE_GATEWAY_REDIS_USERNAME={user!r}")
    check(("redis-prefix" in gw_toml) == r["enabled"] and (not r["enabled"] or f'redis-prefix = "{r["prefix"]}"' in gw_toml),
          f"{name}: redis-prefix in gateway.toml follows redis.prefix")
    for pname, meta, pod in pod_templates(docs):
        used = secret_refs(pod)
        ann = meta.get("annotations", {})
        if used and "test-chat" not in pname:
            want = {f"{n}/{k}": chart_secret_data.get((n, k), "") for (n, k) in used}
            digest = hashlib.sha256(json.dumps(want, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
            check(ann.get("checksum/secret") == digest,
                  f"{name}: {pname}'s checksum/secret covers the secrets it reads {sorted(used)}")
        for n, k in used:
            check((n, k) in chart_secret_data or n != "kv-kvgate-secrets", f"{name}: {pname} reads {n}/{k}, which the chart's Secret holds")
    # The in-chart Redis: an ACL user limited to the prefix, its password from the same Secret as the gateway's.
    rd = find(docs, "Deployment", "-redis")
    if rd:
        rpod = rd[0]["spec"]["template"]["spec"]
        rc = rpod["containers"][0]
        rargs = " ".join(rc["args"])
        check("tcpSocket" in rc["readinessProbe"], f"{name}: Redis readiness over TCP (no password needed)")
        check({"name": "data", "mountPath": "/data"} in rc["volumeMounts"], f"{name}: Redis's /data is a volume")
        if r["auth"]["enabled"]:
            acl = (f'--user {user} on >$(REDIS_PASSWORD) ~{r["prefix"]}:* &{r["prefix"]}:* +@all -@dangerous')
            check("--user default off" in rargs and acl in rargs, f"{name}: Redis ACL user: {rargs}")
            check(env_map(rc)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
                  == gc["KVGATE_GATEWAY_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"],
                  f"{name}: Redis and the gateway read the same password")
            check("KVGATE_GATEWAY_REDIS_PASSWORD" in gc and "REDIS_PASSWORD" not in gc, f"{name}: gateway password env name")
        else:
            check("--user" not in rargs and "env" not in rc, f"{name}: Redis without auth when redis.auth.enabled is false")
    # securityContext on every pod and container.
    for pname, meta, pod in pod_templates(docs):
        psc = pod.get("securityContext", {})
        check(pod.get("automountServiceAccountToken") is False, f"{name}: {pname} mounts no service account token")
        for c in pod.get("initContainers", []) + pod["containers"]:
            csc = c.get("securityContext", {})
            eff = {**psc, **csc}
            where = f"{name}: {pname}/{c['name']}"
            check(eff.get("runAsNonRoot") is True, f"{where}: runAsNonRoot")
            check(isinstance(eff.get("runAsUser"), int) and eff["runAsUser"] > 0
                  and isinstance(eff.get("runAsGroup"), int), f"{where}: numeric runAsUser/runAsGroup")
            check(csc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation false")
            check("ALL" in csc.get("capabilities", {}).get("drop", []) and not csc.get("capabilities", {}).get("add"),
                  f"{where}: capabilities drop ALL")
            check(eff.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{where}: seccomp RuntimeDefault")
            check(not csc.get("privileged"), f"{where}: not privileged")
            comp = meta.get("labels", {}).get("app.kubernetes.io/component")
            vals_csc = {"gateway": g, "worker": w, "redis": r}.get(comp, values["tests"])["containerSecurityContext"]
            check(csc.get("readOnlyRootFilesystem") is vals_csc.get("readOnlyRootFilesystem", False)
                  and (comp != "worker" or csc.get("readOnlyRootFilesystem") == (name != "security-overrides")),
                  f"{where}: readOnlyRootFilesystem follows values")
            if csc.get("readOnlyRootFilesystem") and comp in ("gateway", "worker"):
                check("/tmp" in {m["mountPath"] for m in c.get("volumeMounts", [])} or c["name"] == "tokenizer",
                      f"{where}: /tmp is writable")
        if "redis" in pname:
            check(psc.get("runAsUser") == 999 and psc.get("runAsGroup") == 1000, f"{name}: Redis as redis:7.4-alpine's redis user")
        elif "test-chat" not in pname:
            check(psc.get("runAsUser") == 65532 and psc.get("fsGroup") == 65532, f"{name}: {pname} as the image's user 65532")
    if name == "security-overrides":
        check(gw["spec"]["securityContext"].get("fsGroupChangePolicy") == "OnRootMismatch"
              and gw["spec"]["securityContext"].get("runAsUser") == 65532, f"{name}: securityContext overrides merge")
    # NetworkPolicies.
    npol = {d["metadata"]["name"]: d for d in find(docs, "NetworkPolicy")}
    np_vals = values["networkPolicy"]
    kv_workers = not ext["service"]
    if not np_vals["enabled"]:
        check(not npol, f"{name}: no NetworkPolicy when networkPolicy.enabled is false")
    else:
        want_np = {"kv-kvgate-gateway"} | ({"kv-kvgate-worker"} if kv_workers else set()) | ({"kv-kvgate-redis"} if internal else set())
        check(set(npol) == want_np, f"{name}: NetworkPolicies {sorted(want_np)}, got {sorted(npol)}")
        pods_by_comp = {meta.get("labels", {}).get("app.kubernetes.io/component"): meta["labels"] for _, meta, _ in pod_templates(docs)}
        sel = lambda comp: {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvgate",
                                                           "app.kubernetes.io/instance": "kv",
                                                           "app.kubernetes.io/component": comp}}}
        restrict = np_vals["restrictEgress"]
        for pol in npol.values():
            spec = pol["spec"]
            comp = pol["metadata"]["labels"]["app.kubernetes.io/component"]
            check(selects(spec["podSelector"], pods_by_comp.get(comp, {})) and spec["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == comp,
                  f"{name}: NetworkPolicy {pol['metadata']['name']} selects the {comp} pods")
            if restrict:
                check(spec["policyTypes"] == ["Ingress", "Egress"] and isinstance(spec.get("egress"), list),
                      f"{name}: {pol['metadata']['name']}: ingress and egress restricted")
            else:
                check(spec["policyTypes"] == ["Ingress"] and "egress" not in spec,
                      f"{name}: {pol['metadata']['name']}: ingress only with restrictEgress false")
        # Who may talk to whom, as a CNI would judge it. A pod: (namespace, labels); "outside": an address that is
        # no pod (another network). Same-namespace pod selectors; a rule without `from`/`to` or `ports` allows all.
        pool_pods = {lab.get("kvgate.io/pool"): lab for _, meta, _ in pod_templates(docs)
                     for lab in [meta.get("labels", {})] if lab.get("app.kubernetes.io/component") == "worker"}
        ns_labels = lambda ns: {"kubernetes.io/metadata.name": ns}

        def match_sel(selector: dict, labels: dict) -> bool:
            if not selects(selector, labels):
                return False
            for e in selector.get("matchExpressions", []):
                v = labels.get(e["key"])
                if e["operator"] == "In" and v not in e["values"] or e["operator"] == "NotIn" and v in e["values"] \
                        or e["operator"] == "Exists" and v is None or e["operator"] == "DoesNotExist" and v is not None:
                    return False
            return True

        def peer_matches(peer: dict, pod) -> bool:
            if pod == "outside":
                return "ipBlock" in peer
            ns, labels = pod
            if "ipBlock" in peer:
                return False  # pod IPs are not in the peers' CIDRs here
            if "namespaceSelector" not in peer and ns != "serving":
                return False
            return match_sel(peer.get("namespaceSelector", {}), ns_labels(ns)) and match_sel(peer.get("podSelector", {}), labels)

        def allowed(rules: list, pod, port, proto: str = "TCP", key: str = "from") -> bool:
            return any((key not in r_ or any(peer_matches(pe, pod) for pe in r_[key]))
                       and ("ports" not in r_ or any(pp.get("port") == port and pp.get("protocol", "TCP") == proto for pp in r_["ports"]))
                       for r_ in rules)

        gw_pod, redis_pod = ("serving", pods_by_comp.get("gateway", {})), ("serving", pods_by_comp.get("redis", {}))
        other_release = ("serving", {**pods_by_comp.get("worker", {}), "app.kubernetes.io/instance": "other"})
        monitoring = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
        kube_dns = ("kube-system", {"k8s-app": "kube-dns"})
        if internal:
            rules = npol["kv-kvgate-redis"]["spec"]["ingress"]
            check(rules == [{"ports": [{"port": 6379, "protocol": "TCP"}], "from": [sel("gateway")]}],
                  f"{name}: Redis only from the gateways: {rules}")
            check(selects(sel("gateway")["podSelector"], pods_by_comp["gateway"]), f"{name}: the gateway peer matches the gateway pods")
            if restrict:
                check(npol["kv-kvgate-redis"]["spec"].get("egress") == [], f"{name}: Redis may dial nothing")
        transfer = w["prefill"]["transferPort"] if kv_workers and w["prefill"]["replicas"] > 0 else None
        if kv_workers:
            wspec = npol["kv-kvgate-worker"]["spec"]
            rules = wspec["ingress"]
            ports = [p["port"] for p in rules[0]["ports"]]
            check(len(rules) == (2 if transfer else 1) and ports == [w["port"]] + np_vals["extraWorkerPorts"]
                  and rules[0]["from"] == [sel("gateway"), sel("worker")] + np_vals["workerFrom"],
                  f"{name}: worker API port only from gateways, peers and workerFrom: {rules}")
            check(selects(sel("worker")["podSelector"], pods_by_comp["worker"]), f"{name}: the worker peer matches the worker pods")
            if transfer:
                check(all(transfer not in [p["port"] for p in r_["ports"]] for r_ in rules[:1]),
                      f"{name}: the transfer port is not in the API port's rule (its peers)")
                # Only this release's importing workers (the decode and main pools) reach the transfer listener.
                for pool, labels in pool_pods.items():
                    check(allowed(rules, ("serving", labels), transfer) == (pool in ("main", "decode")),
                          f"{name}: the transfer port admits the {pool} pool only if it imports KV")
                for who, pod in (("the gateways", gw_pod), ("workerFrom", monitoring), ("another release's workers", other_release),
                                 ("an outside address", "outside")):
                    check(not allowed(rules, pod, transfer), f"{name}: the transfer port does not admit {who}")
            for who, pod in (("the gateways", gw_pod), ("the workers", ("serving", pods_by_comp["worker"]))):
                check(allowed(rules, pod, w["port"]), f"{name}: the worker API port admits {who}")
        rules = npol["kv-kvgate-gateway"]["spec"]["ingress"]
        by_port = {r_["ports"][0]["port"]: r_ for r_ in rules}
        gw_np_ports = {g["service"]["port"], g["controlPort"]} | ({epp["port"]} if epp["enabled"] else set())
        check(set(by_port) == gw_np_ports and len(rules) == len(gw_np_ports) and all(len(r_["ports"]) == 1 for r_ in rules),
              f"{name}: gateway policy covers the public and control ports (and the EPP port with epp): {sorted(by_port)}")
        if epp["enabled"]:
            eppr = by_port.get(epp["port"], {})
            check(eppr.get("from") == (np_vals["eppFrom"] or None), f"{name}: the EPP port from eppFrom (empty: anyone): {eppr}")
        pub = by_port.get(g["service"]["port"], {})
        if np_vals["publicFrom"]:
            check(pub.get("from") == np_vals["publicFrom"] + [sel("test")], f"{name}: public port from publicFrom and the helm test")
            test_pods = [meta for pn, meta, _ in pod_templates(docs) if "test-chat" in pn]
            check(test_pods and selects(sel("test")["podSelector"], test_pods[0]["labels"]), f"{name}: the test peer matches the test pod")
        else:
            check("from" not in pub, f"{name}: public port open to anyone by default")
        ctl = by_port.get(g["controlPort"], {})
        check(ctl.get("from") == [sel("gateway")] + ([sel("worker")] if kv_workers else []) + np_vals["controlFrom"],
              f"{name}: control port only from gateways, workers and controlFrom: {ctl}")
        if restrict:
            dns = {"to": np_vals["dnsTo"], "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
            otlp_url = values["tracing"]["otlpEndpoint"]
            otlp_port = None
            if otlp_url:
                hostport = otlp_url.split("://", 1)[1].split("/", 1)[0]
                otlp_port = int(hostport.rsplit(":", 1)[1]) if ":" in hostport else 80
            gegress = npol["kv-kvgate-gateway"]["spec"].get("egress", [])
            wegress = npol["kv-kvgate-worker"]["spec"].get("egress", []) if kv_workers else []
            for comp, egress in (("gateway", gegress), ("worker", wegress)) if kv_workers else (("gateway", gegress),):
                check(egress[:1] == [dns], f"{name}: {comp} egress: DNS to dnsTo first: {egress[:1]}")
                check(allowed(egress, kube_dns, 53, "UDP", "to") and allowed(egress, kube_dns, 53, "TCP", "to"),
                      f"{name}: {comp} may query kube-dns")
                n_extra = len(np_vals["extraEgress"])
                check(egress[len(egress) - n_extra:] == np_vals["extraEgress"], f"{name}: {comp} egress ends with extraEgress")
                check((otlp_port is not None and {"ports": [{"port": otlp_port, "protocol": "TCP"}]} in egress) or
                      (otlp_port is None and not any(r_.get("ports") == [{"port": p_, "protocol": "TCP"}] and "to" not in r_
                                                     for r_ in egress[:len(egress) - n_extra] for p_ in (80, 4317, 4318))),
                      f"{name}: {comp} reaches the OTLP port {otlp_port} exactly when tracing is on")
                if not np_vals["extraEgress"]:
                    check(not allowed(egress, "outside", 443, "TCP", "to") and not allowed(egress, monitoring, 9090, "TCP", "to"),
                          f"{name}: {comp} egress is not open to anything else")
            # The gateway: workers' API port (not their transfer port), Redis, the fronted pods.
            if kv_workers:
                for pool, labels in pool_pods.items():
                    check(allowed(gegress, ("serving", labels), w["port"], "TCP", "to"), f"{name}: the gateway reaches the {pool} pool's API port")
                    if transfer and transfer != otlp_port:
                        check(not allowed(gegress, ("serving", labels), transfer, "TCP", "to"),
                              f"{name}: the gateway does not reach the transfer port")
            else:
                want_ports = [{"port": ext["port"], "protocol": "TCP"}] + [
                    {"port": ext[k], "protocol": "TCP"} for k in ("kvEventsPort", "kvEventsReplayPort") if ext[k] > 0]
                to = np_vals["externalTo"] or ([{"podSelector": {"matchLabels": epp["pool"]["selector"]}}] if epp["enabled"] else None)
                want = {"ports": want_ports, **({"to": to} if to else {})}
                check(want in gegress, f"{name}: the gateway reaches the fronted pods' ports {want}")
            if r["enabled"] and internal:
                check(allowed(gegress, redis_pod, 6379, "TCP", "to"), f"{name}: the gateway reaches the in-chart Redis")
            elif r["enabled"]:
                rport = 6379
                if not r["urlSecret"]:
                    hostport = r["url"].split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
                    rport = int(hostport.rsplit(":", 1)[1]) if ":" in hostport else 6379
                check({"ports": [{"port": rport, "protocol": "TCP"}]} in gegress, f"{name}: the gateway reaches the external Redis's port {rport}")
            else:
                check(not allowed(gegress, redis_pod, 6379, "TCP", "to") or otlp_port == 6379, f"{name}: no Redis egress without Redis")
            # The workers: reports to the gateways' control port, the prefill pool's transfer port.
            if kv_workers:
                check(allowed(wegress, gw_pod, g["controlPort"], "TCP", "to"), f"{name}: workers report to the control port")
                check(not allowed(wegress, gw_pod, g["service"]["port"], "TCP", "to"), f"{name}: workers do not reach the public port")
                if transfer:
                    check(allowed(wegress, ("serving", pool_pods["prefill"]), transfer, "TCP", "to"),
                          f"{name}: workers reach the prefill pool's transfer port")
                    check(not allowed(wegress, other_release, transfer, "TCP", "to"),
                          f"{name}: workers do not reach another release's transfer port")
    # The GitOps warning, and the Prometheus reminder.
    notes = next(t for p_, t in chart.render(values, name="kv", namespace="serving", is_install=True).items() if p_.endswith("NOTES.txt"))
    generated = [k for k in managed_keys if not given[k]]
    check(("GitOps" in notes) == bool(generated), f"{name}: NOTES warns about generated secrets under GitOps")
    check(f"get secret {refs['admin'][0]} -o jsonpath='{{.data.{refs['admin'][1]}}}'" in notes, f"{name}: NOTES: the admin token's Secret")
    check(("controlFrom" in notes) == (np_vals["enabled"] and values["serviceMonitor"]["enabled"] and not np_vals["controlFrom"]),
          f"{name}: NOTES reminds that Prometheus needs controlFrom")
    # --- The endpoint picker of an InferencePool (GIE) ---
    pools = find(docs, "InferencePool")
    epp_svcs = [s for s in services if s["metadata"]["name"] == "kv-kvgate-epp"]
    pool_svcs = [s for s in services if s["metadata"]["name"] == "kv-kvgate-pool"]
    epp_lines = [l.strip() for l in gw_toml.splitlines() if l.strip().startswith("epp-")]
    gwc = find(docs, "Deployment", "-gateway")[0]["spec"]["template"]
    gw_ports = {p_["name"]: p_["containerPort"] for p_ in gwc["spec"]["containers"][0]["ports"]}
    tls_vols = [v for v in gwc["spec"]["volumes"] if v["name"] == "epp-tls"]
    tls_mounts = [m for m in gwc["spec"]["containers"][0]["volumeMounts"] if m["name"] == "epp-tls"]
    tls_secrets = [s for s in find(docs, "Secret") if s["metadata"]["name"] == "kv-kvgate-epp-tls"]
    gw_annotations = gwc["metadata"].get("annotations", {})
    if not epp["enabled"]:
        check(not pools and not epp_svcs and not pool_svcs and not epp_lines and "grpc-ext-proc" not in gw_ports,
              f"{name}: no InferencePool, EPP Services, epp-listen or EPP port without epp.enabled")
        check(not tls_vols and not tls_mounts and not tls_secrets and "checksum/epp-tls" not in gw_annotations,
              f"{name}: no picker certificate without epp.enabled")
    else:
        pe = epp["pool"]
        tls, tls_secret = epp["tls"]["enabled"], epp["tls"]["secretName"] or "kv-kvgate-epp-tls"
        mode = epp["auth"]["mode"]
        want_lines = ([f'epp-listen = "0.0.0.0:{epp["port"]}"'] + ([f"epp-max-streams = {epp['maxStreams']}"] if epp["maxStreams"] else [])
                      + ([f'epp-tls-cert = "{EPP_TLS_DIR}/tls.crt"', f'epp-tls-key = "{EPP_TLS_DIR}/tls.key"'] if tls else [])
                      + (["epp-trust-network = true"] if mode == "network" else [])
                      + ([f'epp-client-ca = "/etc/kvgate/epp-client-ca/ca.crt"'] if mode == "mtls" else []))
        check(epp_lines == want_lines, f"{name}: gateway.toml listens for the EPP on epp.port, says who may drive it: {epp_lines} vs {want_lines}")
        # Who may drive the picker: the token from its Secret, the client CA mounted, or the network policy.
        gw_env = {e["name"]: e for e in gwc["spec"]["containers"][0].get("env", [])}
        token_env = gw_env.get("KVGATE_GATEWAY_EPP_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
        check(token_env == ({"name": epp["auth"]["tokenSecret"], "key": "token"} if mode == "token" else None),
              f"{name}: the picker's token comes from epp.auth.tokenSecret (key token) with mode token: {token_env}")
        ca_vols = [v for v in gwc["spec"]["volumes"] if v["name"] == "epp-client-ca"]
        ca_mounts = [m for m in gwc["spec"]["containers"][0]["volumeMounts"] if m["name"] == "epp-client-ca"]
        if mode == "mtls":
            check(len(ca_vols) == 1 and ca_vols[0]["secret"]["secretName"] == epp["auth"]["clientCASecret"]
                  and ca_vols[0]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
                  and len(ca_mounts) == 1 and ca_mounts[0]["mountPath"] == "/etc/kvgate/epp-client-ca"
                  and ca_mounts[0]["readOnly"] is True, f"{name}: the client CA mounted read-only: {ca_vols} {ca_mounts}")
        else:
            check(not ca_vols and not ca_mounts, f"{name}: no client CA without mode mtls")
        check(gw_ports.get("grpc-ext-proc") == epp["port"], f"{name}: the gateway container's grpc-ext-proc port is epp.port: {gw_ports}")
        check(len(epp_svcs) == 1 and len(pool_svcs) == 1 and len(pools) == 1, f"{name}: one EPP Service, one pool Service, one InferencePool")
        if epp_svcs and pool_svcs and pools:
            try:
                es, ps, pool = epp_svcs[0]["spec"], pool_svcs[0]["spec"], pools[0]
                # The EPP Service: ClusterIP, the EPP port over the gateway pods (and nothing else of the release):
                # http2 with TLS (as GIE's own picker's Service; not h2c, which says cleartext), else h2c.
                proto = "http2" if tls else "kubernetes.io/h2c"
                check(es.get("type") == "ClusterIP" and es.get("clusterIP") is None
                      and es["ports"] == [{"name": "grpc-ext-proc", "port": epp["port"], "targetPort": "grpc-ext-proc",
                                           "protocol": "TCP", "appProtocol": proto}],
                      f"{name}: the EPP Service: ClusterIP, port {epp['port']} {proto}: {es}")
                for pname, meta, _ in pod_templates(docs):
                    is_gw = meta.get("labels", {}).get("app.kubernetes.io/component") == "gateway"
                    check(selects({"matchLabels": es["selector"]}, meta.get("labels", {})) == is_gw,
                          f"{name}: the EPP Service selects the gateway pods only ({pname})")
                # The headless Service the gateway discovers the pool's pods through: the pool's selector, its port,
                # Ready pods only; the [[models]] entry names it.
                check(ps.get("clusterIP") == "None" and not ps.get("publishNotReadyAddresses")
                      and ps["selector"] == pe["selector"] == pool["spec"]["selector"]["matchLabels"]
                      and [(p_["port"], p_["targetPort"]) for p_ in ps["ports"]] == [(pe["targetPort"], pe["targetPort"])],
                      f"{name}: the pool Service is headless over the pool's selector and port: {ps}")
                check(f'discover = "kv-kvgate-pool.serving.svc.cluster.local:{pe["targetPort"]}"' in gw_toml
                      and f'name = "{pe["model"]}"' in gw_toml and f'kind = "{pe["kind"]}"' in gw_toml
                      and gw_toml.count("[[models]]") == 1, f"{name}: the pool's model in gateway.toml, discovered through the pool Service")
                check(("block-size = " in gw_toml) == (ext["blockSize"] is not None), f"{name}: block-size from workers.external.blockSize")
                # The InferencePool: its name, the pool's pods and port, the EPP Service and port, the failure mode.
                check(pool["metadata"]["name"] == (pe["name"] or "kv-kvgate") and pool["metadata"].get("annotations", {}) == pe["annotations"],
                      f"{name}: the InferencePool's name and annotations: {pool['metadata']}")
                check(pool["spec"]["targetPorts"] == [{"number": pe["targetPort"]}] and pool["spec"]["appProtocol"] == pe["appProtocol"],
                      f"{name}: the InferencePool's targetPorts and appProtocol: {pool['spec']}")
                check(pool["spec"]["endpointPickerRef"] == {"name": epp_svcs[0]["metadata"]["name"], "port": {"number": epp["port"]},
                                                             "failureMode": epp["failureMode"]},
                      f"{name}: endpointPickerRef names the EPP Service, its port and the failure mode: {pool['spec']['endpointPickerRef']}")
                check(es["ports"][0]["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"],
                      f"{name}: the pool's EPP port is the EPP Service's port (not a target port)")
            except (KeyError, IndexError, TypeError) as e:  # a manifest without a field the checks read
                failures.append(f"{name}: the EPP manifests lack {e!r}")
        check(not sts and "kv-kvgate-worker" not in npol, f"{name}: no kvgate workers (nor their policy) with epp")
        # The picker's TLS: the Secret mounted read-only where gateway.toml names the files; the chart's self-signed
        # certificate only when no Secret is named, a usable pair for the EPP Service's names; the pods roll for a
        # named Secret's change (its resourceVersion), not for the chart's own.
        if tls:
            check([v.get("secret") for v in tls_vols] == [{"secretName": tls_secret, "items": [{"key": "tls.crt", "path": "tls.crt"},
                                                                                           {"key": "tls.key", "path": "tls.key"}]}]
                  and tls_mounts == [{"name": "epp-tls", "mountPath": EPP_TLS_DIR, "readOnly": True}],
                  f"{name}: the Secret {tls_secret} mounted read-only at {EPP_TLS_DIR}: {tls_vols} {tls_mounts}")
            check(("checksum/epp-tls" in gw_annotations) == bool(epp["tls"]["secretName"]),
                  f"{name}: checksum/epp-tls only for a named Secret: {sorted(gw_annotations)}")
            if epp["tls"]["secretName"]:
                check(not tls_secrets, f"{name}: no certificate generated when epp.tls.secretName names one")
            else:
                one = (len(tls_secrets) == 1 and tls_secrets[0].get("type") == "kubernetes.io/tls"
                       and set(tls_secrets[0].get("data", {})) == {"tls.crt", "tls.key"})
                check(one, f"{name}: one kubernetes.io/tls Secret kv-kvgate-epp-tls with tls.crt and tls.key: {tls_secrets}")
                cert = tls_pair(tls_secrets[0]) if one else {}
                check(isinstance(cert, dict), f"{name}: the generated certificate and key are a usable pair: {cert}")
                if isinstance(cert, dict):
                    sans = {v for k, v in cert.get("subjectAltName", ()) if k == "DNS"}
                    check({"kv-kvgate-epp", "kv-kvgate-epp.serving.svc", "kv-kvgate-epp.serving.svc.cluster.local"} <= sans,
                          f"{name}: the certificate names the EPP Service: {sans}")
                    check(ssl.cert_time_to_seconds(cert["notAfter"]) - time.time() > 9 * 365 * 86400,
                          f"{name}: the self-signed certificate lasts years: {cert['notAfter']}")
            check(f"over TLS with the certificate of Secret {tls_secret}" in notes and "HTTP/2 cleartext" not in notes,
                  f"{name}: NOTES says the picker serves TLS, and with which Secret")
        else:
            check(not tls_vols and not tls_mounts and not tls_secrets and "checksum/epp-tls" not in gw_annotations,
                  f"{name}: no picker certificate with epp.tls.enabled false")
            check("HTTP/2 cleartext" in notes and "epp.tls.enabled=true" in notes, f"{name}: NOTES says the picker serves cleartext")
        check(gwc["spec"].get("automountServiceAccountToken") is False, f"{name}: the picker needs no Kubernetes API access")
    print(f"ok: {name} ({len(docs)} manifests)")



def checksums(values: dict) -> dict:
    return {pn: meta.get("annotations", {}).get("checksum/secret") for pn, meta, _ in pod_templates(render("rotation", values))}


# An EPP port that is the gateway's public or control port is refused at render time.
for clash in ("service", "control"):
    port = defaults["gateway"]["service"]["port"] if clash == "service" else defaults["gateway"]["controlPort"]
    try:
        render("epp-clash", deep_merge(defaults, deep_merge(VALUE_SETS["epp"], {"epp": {"port": port}})))
        failures.append(f"an EPP port on the gateway's {clash} port rendered")
    except helm.HelmError as e:
        check("epp.port" in str(e), f"the EPP port clash names epp.port: {e}")
print("ok: an EPP port on the public or control port is refused")

# A picker whose callers nothing tells apart is refused at render time (epp.auth).
for what, extra, word in [
    ("network mode without NetworkPolicies", {"networkPolicy": {"enabled": False}}, "networkPolicy.enabled"),
    ("network mode with an empty eppFrom", {"networkPolicy": {"eppFrom": []}}, "eppFrom"),
    ("token mode without its Secret", {"epp": {"auth": {"mode": "token"}}}, "tokenSecret"),
    ("mtls mode without its CA", {"epp": {"auth": {"mode": "mtls"}}}, "clientCASecret"),
    ("mtls mode without TLS", {"epp": {"auth": {"mode": "mtls", "clientCASecret": "ca"}, "tls": {"enabled": False}}}, "epp.tls.enabled"),
]:
    try:
        render("epp-auth", deep_merge(defaults, deep_merge(VALUE_SETS["epp"], extra)))
        failures.append(f"the picker rendered with {what}")
    except helm.HelmError as e:
        check(word in str(e), f"the refusal of {what} names {word}: {e}")
print("ok: a picker without a way to tell its proxies apart is refused")

# The chart's self-signed picker certificate: kept across upgrades by lookup, which finds nothing without a cluster
# (`helm template`, as here): then every render makes a new one, and the gateway pods' template stays the same (no
# roll for it). A named Secret's certificate is never rendered.
_tls_vals = deep_merge(defaults, VALUE_SETS["epp"])
_renders = [render("epp-tls-render", _tls_vals) for _ in range(2)]
_certs = [[s["data"]["tls.crt"] for s in find(r_, "Secret") if s["metadata"]["name"] == "kv-kvgate-epp-tls"] for r_ in _renders]
_cfg = [find(r_, "Deployment", "-gateway")[0]["spec"]["template"]["metadata"]["annotations"]["checksum/config"] for r_ in _renders]
check(len(_certs[0]) == len(_certs[1]) == 1 and _certs[0] != _certs[1] and _cfg[0] == _cfg[1],
      "helm template: a new self-signed picker certificate each render, the gateway's configuration unchanged")
print("ok: the picker's self-signed certificate (new under helm template; the pods not rolled for it)")

base = deep_merge(defaults, VALUE_SETS["given-secrets"])
before = checksums(deep_merge(base, {"secrets": {"redisPassword": "one"}}))
after_report = checksums(deep_merge(base, {"secrets": {"reportSecret": "other", "redisPassword": "one"}}))
after_admin = checksums(deep_merge(base, {"secrets": {"adminToken": "other", "redisPassword": "one"}}))
after_redis = checksums(deep_merge(base, {"secrets": {"redisPassword": "two"}}))
check(before == checksums(deep_merge(base, {"secrets": {"redisPassword": "one"}})), "rotation: given secrets render the same checksums")
check(all(before[k] != after_report[k] for k in ("kv-kvgate-gateway", "kv-kvgate-worker")) and
      before["kv-kvgate-redis"] == after_report["kv-kvgate-redis"], "rotation: the report secret rolls gateways and workers")
check(before["kv-kvgate-gateway"] != after_admin["kv-kvgate-gateway"] and
      before["kv-kvgate-worker"] == after_admin["kv-kvgate-worker"], "rotation: the admin token rolls only the gateways")
check(all(before[k] != after_redis[k] for k in ("kv-kvgate-gateway", "kv-kvgate-redis")) and
      before["kv-kvgate-worker"] == after_redis["kv-kvgate-worker"], "rotation: the Redis password rolls gateways and Redis")
print("ok: secret rotation rolls the pods that read the secret")

for name, (extra, word) in BAD_VALUES.items():
    try:
        chart.validate_schema(deep_merge(defaults, extra))
        failures.append(f"schema accepted bad values: {name}")
    except helm.HelmValuesError as e:
        check(word in str(e), f"schema error for {name} names {word}: {e}")
        print(f"ok: rejected {name}")

# The values reference is what values.yaml says (KVGATE_BLESS=1 writes it).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import values_doc  # noqa: E402

if os.environ.get("KVGATE_BLESS") == "1":
    values_doc.PAGE.write_text(values_doc.page())
check(values_doc.PAGE.exists() and values_doc.PAGE.read_text() == values_doc.page(),
      f"{values_doc.PAGE} is what helm/kvgate/values.yaml says (regenerate: KVGATE_BLESS=1 python helm/tests/check_chart.py)")

if failures:
    print(f"\n{len(failures)} failure(s):", file=sys.stderr)
    for f in failures:
        print(f"  - {f}", file=sys.stderr)
    sys.exit(1)
print(f"chart ok against Kubernetes {KUBE}")
