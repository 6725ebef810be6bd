"""Lint, render and validate the kvgate chart offline (Helm v4 through helm-python-sdk; kubernetes-validate
--strict), for several value sets, and check the chart's behaviour. Run by gateway/tests/helm_chart.rs (so CI runs
it); exits non-zero with every failure listed.

    python helm/tests/check_chart.py [KUBERNETES_VERSION]
    python helm/tests/check_chart.py --render VALUE_SET   # JSON: the gateway.toml and worker args it renders
"""

import base64
import copy
import json
import sys
from pathlib import Path

import helm_python as helm
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
    "dashboard": {"grafana": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "kvgate"}}}},
    "single-replica": {"gateway": {"replicas": 1}, "redis": {"enabled": False}},
    "redis-url-secret": {"redis": {"enabled": True, "mode": "external", "urlSecret": "redis-auth"}},
    "redis-external": {"redis": {"enabled": True, "mode": "external", "url": "redis://redis.shared:6379/0"}},
    "hpa-on": {"gateway": {"hpa": {"enabled": True, "minReplicas": 3, "maxReplicas": 12}, "antiAffinity": "hard"}},
    "existing-secret": {"secrets": {"existingSecret": "my-kvgate-secrets"}},
    "given-secrets": {"secrets": {"reportSecret": "r3port", "adminToken": "adm1n"}},
    "e2e": {"workers": {"engine": "sim", "model": {"source": "synth", "synthPreset": "tiny"}},
            "gateway": {"classes": [{"name": "short", "refill_tokens_per_s": 500000, "burst_tokens": 1000000,
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
}

# Values the schema must reject, and a word its message must contain.
BAD_VALUES: dict[str, tuple[dict, str]] = {
    "negative worker replicas": ({"workers": {"replicas": -1}}, "replicas"),
    "negative gateway replicas": ({"gateway": {"replicas": -2}}, "replicas"),
    "unknown policy": ({"gateway": {"policy": "fastest"}}, "policy"),
    "unknown engine": ({"workers": {"engine": "tpu"}}, "engine"),
    "pvc without a claim": ({"workers": {"model": {"source": "pvc"}}}, "claimName"),
    "external redis without a url": ({"redis": {"enabled": True, "mode": "external"}}, "url"),
    "two replicas without redis": ({"redis": {"enabled": False}}, "/redis/enabled"),
    "an hpa without redis": ({"gateway": {"replicas": 1, "hpa": {"enabled": True}}, "redis": {"enabled": False}}, "/redis/enabled"),
    "typo in a key": ({"gateway": {"replica": 3}}, "replica"),
    "hotspot ratio under 1": ({"gateway": {"weights": {"hotspotRatio": 0.5}}}, "hotspotRatio"),
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
    print(json.dumps({"gateway_toml": cm["data"]["gateway.toml"], "gateway_args": gateway["args"],
                      "worker_args": worker["args"]}))
    sys.exit(0)

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
    check(f"max-connections = {g['maxConnections']}" in gw_toml and "header-read-timeout" in gw_toml,
          f"{name}: connection limits in gateway.toml")
    check(("advertise-allow" in gw_toml) == bool(g["advertiseAllow"]), f"{name}: advertise-allow follows values")
    gw_pod = find(docs, "Deployment", "-gateway")[0]["spec"]["template"]["spec"]
    key_vols = [v for v in gw_pod["volumes"] if v.get("secret", {}).get("secretName") == g["apiKeysSecret"]]
    check(("api-keys-file" in gw_toml) == bool(g["apiKeysSecret"]) == bool(key_vols),
          f"{name}: the API key Secret is mounted and named in gateway.toml, or neither")
    for cm in find(docs, "ConfigMap"):
        text = yaml.safe_dump(cm["data"])
        for s in ("r3port", "adm1n", "report-secret", "admin-token"):
            check(s not in text, f"{name}: ConfigMap {cm['metadata']['name']} holds no secret ({s})")
    secrets = find(docs, "Secret")
    if values["secrets"]["existingSecret"]:
        check(not secrets, f"{name}: no Secret is created when existingSecret is set")
    else:
        check(len(secrets) == 1 and set(secrets[0]["data"]) == {"report-secret", "admin-token"}, f"{name}: one Secret")
        if values["secrets"]["reportSecret"]:
            check(base64.b64decode(secrets[0]["data"]["report-secret"]) == b"r3port", f"{name}: given report secret")
        else:
            check(len(base64.b64decode(secrets[0]["data"]["report-secret"])) == 40, f"{name}: generated report secret")
    secret_name = values["secrets"]["existingSecret"] or "kv-kvgate-secrets"
    sts = find(docs, "StatefulSet")
    w = values["workers"]
    ext = w["external"]
    check(len(sts) == (0 if ext["service"] else 1), f"{name}: one worker StatefulSet, none when fronting pods")
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
            check(args[args.index("--dtype") + 1] == w["gpu"]["dtype"], f"{name}: --dtype follows values")
            check(c["image"].endswith("-gpu") or c["image"] == w["gpu"]["image"], f"{name}: GPU workers use the GPU image")
        else:
            check("nvidia.com/gpu" not in limits, f"{name}: no GPU asked for")
            check(args[args.index("--device") + 1] == "cpu", f"{name}: CPU workers run --device cpu")
        check(("--kv-cache-tokens" in args) == (w["kvCacheTokens"] > 0),
              f"{name}: --kv-cache-tokens only when set (0: sized from GPU memory)")
        check(("--engine" in args) == (w["engine"] == "sim"), f"{name}: --engine sim follows values")
        check(("--host-kv-bytes" in args) == (w["hostKvBytes"] > 0), f"{name}: --host-kv-bytes only when set")
        if w["hostKvBytes"] > 0:
            check(args[args.index("--host-kv-bytes") + 1] == str(w["hostKvBytes"])
                  and args[args.index("--kv-write-policy") + 1] == w["kvWritePolicy"], f"{name}: host tier args")
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
        refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]]
        check(refs == [secret_name], f"{name}: worker secret from {secret_name}")
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
        check(c["readinessProbe"]["httpGet"]["path"] == "/ready", f"{name}: readiness on /ready (needs a healthy worker)")
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
    check(f'policy = "{values["gateway"]["policy"]}"' in conf, f"{name}: policy in the gateway config")
    if values["gateway"]["classes"]:
        check(conf.count("[[classes]]") == len(values["gateway"]["classes"]), f"{name}: classes in the gateway config")
    dash = find(docs, "ConfigMap", "-dashboard")
    check(bool(dash) == values["grafana"]["dashboard"]["enabled"], f"{name}: the dashboard ConfigMap only when enabled")
    if dash:
        check(dash[0]["metadata"]["labels"].get("grafana_dashboard") == "1", f"{name}: the sidecar's label")
        board = json.loads(dash[0]["data"]["kvgate.json"])
        check(len(board["panels"]) >= 10 and all(t["expr"] for p in board["panels"] for t in p["targets"]),
              f"{name}: the dashboard's panels came through")
    print(f"ok: {name} ({len(docs)} manifests)")

for name, (extra, word) in BAD_VALUES.items():
    try:
        chart.validate_schema(deep_merge(defaults, extra))
        failures.append(f"schema accepted bad values: {name}")
    except helm.HelmValuesError as e:
        check(word in str(e), f"schema error for {name} names {word}: {e}")
        print(f"ok: rejected {name}")

if failures:
    print(f"\n{len(failures)} failure(s):", file=sys.stderr)
    for f in failures:
        print(f"  - {f}", file=sys.stderr)
    sys.exit(1)
print(f"chart ok against Kubernetes {KUBE}")
