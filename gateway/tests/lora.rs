//! LoRA adapters behind the gateway, with real kvgate workers: adapter requests go to the workers holding their
//! adapter, an adapter nobody holds is loaded once on one worker (through its `POST /v1/load_lora_adapter`) and
//! then served there with cache hits under its own key, `/v1/models` and explain show the adapters, and keys may be
//! kept to named models.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const BASE: &str = "kvgate-tiny";

/// The tiny model `--synth tiny` serves, written to `dir/model`, and adapters `names` for it (seeds 1, 2, ...).
fn model_and_adapters(dir: &Path, names: &[&str]) {
    let model = dir.join("model");
    let ok = |c: &mut Command| assert!(c.status().expect("run").success(), "{c:?}");
    ok(Command::new(bin("kvgate-worker"))
        .args(["synth-model", "--preset", "tiny", "--seed", "0", "--out"])
        .arg(&model));
    for (i, n) in names.iter().enumerate() {
        ok(Command::new(bin("kvgate-worker"))
            .args(["synth-lora", "--rank", "4", "--seed", &(i + 1).to_string(), "--model"])
            .arg(&model)
            .arg("--out")
            .arg(dir.join(n)));
    }
}

/// A completion of `model`: (status, the worker that answered, cached prompt tokens, body).
async fn complete(base: &str, model: &str, prompt: &str, auth: &[(&str, &str)]) -> (u16, String, u64, Value) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0});
    let r = post(&format!("{base}/v1/completions"), &body, auth).await;
    let v: Value = serde_json::from_str(&r.body).unwrap_or(Value::Null);
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    (r.status, r.header("x-kvgate-worker"), cached, v)
}

fn loads(metrics: &str, reason: &str) -> f64 {
    metric(metrics, &format!("kvgate_gateway_lora_loads_total{{outcome=\"loaded\",reason=\"{reason}\"}}"))
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_are_routed_to_their_holders_and_loaded_once_where_nobody_holds_them() {
    let dir = tempfile::tempdir().expect("tmp");
    model_and_adapters(dir.path(), &["a", "b", "c"]);
    let path = |n: &str| dir.path().join(n).display().to_string();
    let catalogue: Vec<String> = ["a", "b", "c"].iter().map(|n| format!("{n}={}", path(n))).collect();
    let keys = keys_file(
        dir.path(),
        &[],
        "models = [\"a\"]\n[[keys]]\nkey = \"open-key-0123456789\"\ntenant = \"open\"\n",
    );
    // A class of its own for adapter `a` (a budget per adapter), the rest in another.
    let cfg = dir.path().join("gateway.toml");
    let class = |name: &str, rule: &str| {
        format!("[[classes]]\nname = \"{name}\"\nrefill_tokens_per_s = 100000\nburst_tokens = 100000\n{rule}")
    };
    std::fs::write(&cfg, class("adapter-a", "[classes.match]\nmodels = [\"a\"]\n") + &class("rest", ""))
        .expect("cfg");
    let mut args = vec![
        "--policy",
        "cache_aware",
        "--api-keys-file",
        keys.to_str().expect("p"),
        "--admin-token",
        "adm",
        "--config",
        cfg.to_str().expect("cfg"),
    ];
    for c in &catalogue {
        args.extend(["--lora", c.as_str()]);
    }
    let (g, control) = gateway(&args);
    let model = dir.path().join("model");
    let la = format!("a={}", path("a"));
    let w0 = worker("w0", &model, Some(&control), &["--max-loras", "2", "--lora", &la]);
    let w1 = worker("w1", &model, Some(&control), &["--max-loras", "2"]);
    let w2 = worker("w2", &model, Some(&control), &["--max-loras", "2"]);
    wait_healthy(&control, 3).await;

    // /v1/models: the base model, then every adapter (held or in the catalogue) with its parent.
    let cards = get(&format!("{}/v1/models", g.base)).await.json();
    let listed: Vec<(String, Value)> = cards["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|c| (c["id"].as_str().unwrap_or("").to_owned(), c["parent"].clone()))
        .collect();
    let want: Vec<(String, Value)> = std::iter::once((BASE.to_owned(), Value::Null))
        .chain(["a", "b", "c"].iter().map(|n| ((*n).to_owned(), json!(BASE))))
        .collect();
    assert_eq!(listed, want);

    // `a` is held by w0 alone: every `a` request goes there (no load), and its prefix is a hit the second time.
    let prompt = "the quick brown fox jumps over the lazy dog and runs far away into the hills ".repeat(3);
    let (s, w, _, v) = complete(&g.base, "a", &prompt, &[]).await;
    assert_eq!((s, w.as_str()), (200, "w0"), "{v}");
    let body = json!({"model": "a", "prompt": prompt, "max_tokens": 1});
    let r = post(&format!("{}/v1/completions", g.base), &body, &[]).await;
    assert_eq!(r.header("x-kvgate-class"), "adapter-a", "the adapter's own class");
    let (_, w, cached, _) = complete(&g.base, "a", &prompt, &[]).await;
    assert_eq!(w, "w0");
    assert!(cached > 0, "the adapter's own blocks are a hit");

    // `b`: nobody holds it. Loaded once (cold), on a worker with a free slot, then served there with hits.
    let (s, first, cached, v) = complete(&g.base, "b", &prompt, &[]).await;
    assert_eq!((s, cached), (200, 0), "{v}");
    let body = json!({"model": "b", "prompt": "x", "max_tokens": 1});
    assert_eq!(
        post(&format!("{}/v1/completions", g.base), &body, &[]).await.header("x-kvgate-class"),
        "rest"
    );
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(loads(&m, "cold"), 1.0);
    // Once the worker has reported it, the gateway hashes `b` under the worker's key: the prefix is scored.
    wait_worker(&control, &first, Duration::from_secs(10), |_| true).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let explain_url = format!("{control}/admin/v1/route/explain");
    let admin = [("authorization", "Bearer adm")];
    let explain = post(&explain_url, &json!({"model": "b", "prompt": prompt}), &admin).await.json();
    let key = explain["adapter"]["key"].as_str().unwrap_or("");
    assert!(key.starts_with("b@") && key.len() == 18, "{explain}");
    assert_eq!(explain["adapter"]["placement"]["choice"], "holders", "{explain}");
    assert_eq!(explain["pick"].as_str(), Some(first.as_str()), "{explain}");
    assert!(explain["predicted_cached_tokens"].as_u64().unwrap_or(0) > 0, "{explain}");
    let (s, w, cached, _) = complete(&g.base, "b", &prompt, &[]).await;
    assert_eq!((s, w.as_str()), (200, first.as_str()));
    assert!(cached > 0, "served where its blocks are");

    // `c`: a burst of four at once loads it once (one load per adapter at a time; the rest find the holder).
    let sends: Vec<_> = (0..4)
        .map(|i| {
            let (base, p) = (g.base.clone(), format!("request {i}: {prompt}"));
            tokio::spawn(async move { complete(&base, "c", &p, &[]).await.0 })
        })
        .collect();
    for s in sends {
        assert_eq!(s.await.expect("send"), 200);
    }
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(loads(&m, "cold"), 2.0, "b and c, each once");

    // Refusals: a name neither held nor in the catalogue; a key kept to `a` naming `b`.
    assert_eq!(complete(&g.base, "nope", &prompt, &[]).await.0, 404);
    let bearer = format!("Bearer {TRUSTED_KEY}");
    let auth = [("authorization", bearer.as_str())];
    let (s, _, _, v) = complete(&g.base, "b", &prompt, &auth).await;
    assert_eq!((s, v["error"]["code"].as_str()), (403, Some("model_not_allowed")), "{v}");
    assert_eq!(complete(&g.base, "a", &prompt, &auth).await.0, 200);
    // Every path gave back what it held: no permit, no load counted running.
    wait_until(Duration::from_secs(10), || async {
        let m = get(&format!("{control}/metrics")).await.body;
        let held = m
            .lines()
            .filter(|l| l.starts_with("kvgate_gateway_admission_permits_held{"))
            .all(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) == Some(0.0));
        held && metric(&m, "kvgate_gateway_lora_loads_running") == Some(0.0)
    })
    .await;
    drop((w0, w1, w2));
}

/// A split adapter request: the prefill worker computes the prompt with the adapter (it holds it under the same
/// key), the decode worker imports that KV and decodes with the adapter; the answer is the one the decode worker
/// gives the same request alone. A split whose prefill worker lacks the adapter is never planned (only holders
/// are candidates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_adapter_request_is_prefilled_with_its_adapter_and_decoded_with_it() {
    let dir = tempfile::tempdir().expect("tmp");
    model_and_adapters(dir.path(), &["a"]);
    let la = format!("a={}", dir.path().join("a").display());
    let (g, control) = gateway(&["--split-policy", "always"]);
    let model = dir.path().join("model");
    let d = worker("d0", &model, Some(&control), &["--lora", &la]);
    let _p = worker(
        "p0",
        &model,
        Some(&control),
        &["--lora", &la, "--role", "prefill", "--kv-transfer-port", "0"],
    );
    wait_healthy(&control, 2).await;
    let prompt = "harbor lantern quiet river stone meadow copper window orchard thunder ".repeat(6);
    let body = json!({"model": "a", "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let mut split = None;
    for _ in 0..50 {
        let r = post(&format!("{}/v1/completions", g.base), &body, &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        if r.header("x-kvgate-route") == "split" {
            split = Some(r);
            break;
        }
        // The pair's link is probed first; until then the planner may serve it whole.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let split = split.expect("a split adapter request");
    assert_eq!(split.header("x-kvgate-worker"), "d0");
    let m = get(&format!("{}/metrics", d.base)).await.body;
    assert!(
        metric(&m, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"ok\"}").unwrap_or(0.0) >= 1.0,
        "the decode worker imported the adapter's KV"
    );
    // The same request on the decode worker alone (a fresh prompt of the same text would hit its cache: ask the
    // base model nothing, compare the adapter's greedy answer).
    let alone = post(&format!("{}/v1/completions", d.base), &body, &[]).await;
    assert_eq!(alone.status, 200, "{}", alone.body);
    assert_eq!(
        split.json()["choices"][0]["text"],
        alone.json()["choices"][0]["text"],
        "the adapter's answer"
    );
    let base = json!({"model": BASE, "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let base = post(&format!("{}/v1/completions", d.base), &base, &[]).await;
    assert_ne!(base.json()["choices"][0]["text"], alone.json()["choices"][0]["text"], "not the base model's");
}
