//! LoRA adapters in the forward pass (`model::lora`, `SeqChunk::adapter`) against candle-transformers' llama on the
//! same weights with the adapter merged in (`W + s B A`, what PEFT's `merge_and_unload` computes): one batch mixes
//! two adapters and the base model, through a prefill and batched decodes, and each sequence matches its own
//! reference; a zero adapter changes nothing. Tolerance 1e-4 relative (f32), as `reference.rs`.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama;
use kvgate_worker::model::llama::{LlamaModel, SeqChunk};
use kvgate_worker::model::lora::{synth_lora, LoraAdapter, LoraSpec, Target, DEFAULT_MAX_LORA_RANK};
use kvgate_worker::model::synth::{synth_model, Preset, SynthSpec};
use kvgate_worker::model::ModelConfig;
use serde_json::Value;

const TOL: f32 = 1e-4;

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// A model directory with `adapter` merged into the base weights of `base`.
fn merged(base: &Path, adapter: &LoraAdapter, out: &Path) {
    std::fs::create_dir_all(out).expect("dir");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        if base.join(f).exists() {
            std::fs::copy(base.join(f), out.join(f)).expect("copy");
        }
    }
    let mut w =
        candle_core::safetensors::load(base.join("model.safetensors"), &Device::Cpu).expect("weights");
    for (layer, targets) in adapter.layers.iter().enumerate() {
        for (t, pair) in targets {
            let path = match t {
                Target::Q | Target::K | Target::V | Target::O => format!("self_attn.{}", t.module()),
                _ => format!("mlp.{}", t.module()),
            };
            let name = format!("model.layers.{layer}.{path}.weight");
            let delta = (pair.b.matmul(&pair.a).expect("BA") * f64::from(adapter.scaling)).expect("s");
            let base_w = w[&name].to_dtype(DType::F32).expect("f32");
            w.insert(name, (base_w + delta).expect("W + sBA"));
        }
    }
    candle_core::safetensors::save(&w, out.join("model.safetensors")).expect("save");
}

/// candle-transformers' llama on `dir`: the logits after `tokens` (fed at once), then after each of `more`.
fn reference(dir: &Path, tokens: &[u32], more: &[u32]) -> Vec<Vec<f32>> {
    let files = [dir.join("model.safetensors")];
    // SAFETY (of the mmap): the files are test fixtures nobody modifies while mapped.
    #[allow(unsafe_code)]
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu).expect("vb") };
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config");
    let cfg: llama::LlamaConfig = serde_json::from_str(&text).expect("llama config");
    let cfg = cfg.into_config(false);
    let mut cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).expect("cache");
    let model = llama::Llama::load(vb, &cfg).expect("llama");
    let mut step = |t: &[u32], pos: usize| {
        let input = Tensor::new(t, &Device::Cpu).expect("t").unsqueeze(0).expect("u");
        model
            .forward(&input, pos, &mut cache)
            .expect("forward")
            .flatten_all()
            .expect("f")
            .to_vec1::<f32>()
            .expect("v")
    };
    let mut out = vec![step(tokens, 0)];
    for (i, t) in more.iter().enumerate() {
        out.push(step(&[*t], tokens.len() + i));
    }
    out
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919)) % 500).collect()
}

#[test]
fn a_batch_mixing_adapters_gives_each_sequence_its_own_adapters_answer() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = dir.path().join("base");
    synth_model(&base, &SynthSpec::new(Preset::Tiny, 5)).expect("synth");
    let cfg = ModelConfig::from_dir(&base).expect("config");
    let spec = |targets, seed, zero| LoraSpec { base: "tiny", rank: 8, alpha: 16.0, targets, seed, zero };
    let (a_dir, b_dir, z_dir) = (dir.path().join("a"), dir.path().join("b"), dir.path().join("z"));
    synth_lora(&a_dir, &cfg, &spec(&Target::ALL, 1, false)).expect("a");
    synth_lora(&b_dir, &cfg, &spec(&[Target::Q, Target::V, Target::Down], 2, false)).expect("b");
    synth_lora(&z_dir, &cfg, &spec(&Target::ALL, 3, true)).expect("z");
    let load = |d: &Path, n: &str| LoraAdapter::load(d, n, &cfg, DEFAULT_MAX_LORA_RANK).expect("adapter");
    let (a, b, z) = (load(&a_dir, "a"), load(&b_dir, "b"), load(&z_dir, "z"));
    merged(&base, &a, &dir.path().join("merged-a"));
    merged(&base, &b, &dir.path().join("merged-b"));

    let model = LlamaModel::load(&base).expect("model");
    let span = 64;
    let mut kv = model.new_kv_store(4 * span);
    let slots: Vec<Vec<usize>> = (0..4).map(|i| (i * span..(i + 1) * span).collect()).collect();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(23 + i, i as u32)).collect();
    let adapters = [Some(&a), None, Some(&b), Some(&z)];
    let more: Vec<u32> = vec![7, 99, 311];

    // One batch: four prefills (adapter a, base, adapter b, zero adapter), then three batched decode steps.
    let mut ours: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 4];
    let mut step = |ours: &mut Vec<Vec<Vec<f32>>>, tokens: &dyn Fn(usize) -> (Vec<u32>, usize)| {
        let parts: Vec<(Vec<u32>, usize)> = (0..4).map(tokens).collect();
        let chunks: Vec<SeqChunk<'_>> = (0..4)
            .map(|i| SeqChunk {
                tokens: &parts[i].0,
                start: parts[i].1,
                slots: &slots[i],
                want_logits: true,
                adapter: adapters[i],
            })
            .collect();
        for (i, l) in model.forward(&chunks, &mut kv).expect("forward").into_iter().enumerate() {
            ours[i].push(l.expect("logits"));
        }
    };
    step(&mut ours, &|i| (prompts[i].clone(), 0));
    for (s, t) in more.iter().enumerate() {
        step(&mut ours, &|i| (vec![*t], prompts[i].len() + s));
    }
    let refs = [
        reference(&dir.path().join("merged-a"), &prompts[0], &more),
        reference(&base, &prompts[1], &more),
        reference(&dir.path().join("merged-b"), &prompts[2], &more),
        reference(&base, &prompts[3], &more),
    ];
    for (i, name) in ["adapter a", "base", "adapter b", "zero adapter"].iter().enumerate() {
        for (s, (o, r)) in ours[i].iter().zip(&refs[i]).enumerate() {
            let e = rel_err(o, r);
            assert!(e <= TOL, "{name}, step {s}: relative error {e:e}");
        }
    }
    // The adapters change the answer (the test is not vacuous).
    let base_ref = reference(&base, &prompts[0], &[]);
    assert!(rel_err(&ours[0][0], &base_ref[0]) > 1e-2, "adapter a changes the logits");
}

mod common;

/// `usage` of a greedy completion of `prompt` on `model` through the worker: (text, cached prompt tokens).
async fn complete(base: &str, model: &str, prompt: &str) -> (u16, String, u64) {
    let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let r = common::post(&format!("{base}/v1/completions"), &body, &[]).await;
    let v = r.json();
    let text = v["choices"][0]["text"].as_str().unwrap_or("").to_owned();
    (r.status, text, v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
}

/// A tiny base model in `dir/base` and adapters `names` for it (seeds 1, 2, ...; rank `rank`).
fn base_and_adapters(dir: &Path, names: &[&str], rank: usize) -> PathBuf {
    let base = dir.join("base");
    synth_model(&base, &SynthSpec::new(Preset::Tiny, 0)).expect("synth");
    let cfg = ModelConfig::from_dir(&base).expect("config");
    for (i, name) in names.iter().enumerate() {
        let spec = LoraSpec {
            base: "tiny",
            rank,
            alpha: 4.0 * rank as f64,
            targets: &Target::ALL,
            seed: i as u64 + 1,
            zero: false,
        };
        synth_lora(&dir.join(name), &cfg, &spec).expect("adapter");
    }
    base
}

/// A worker of `base` (model id `tiny-base`, 4,096 KV tokens) with `extra` flags.
fn serve_base(base: &Path, extra: &[&str]) -> common::Worker {
    let mut args =
        vec!["--model", base.to_str().expect("p"), "--model-id", "tiny-base", "--kv-cache-tokens", "4096"];
    args.extend_from_slice(extra);
    common::serve(&args)
}

#[tokio::test]
async fn a_worker_serves_its_adapters_by_name_and_never_shares_their_blocks() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = base_and_adapters(dir.path(), &["a", "b"], 8);
    let lora = |n: &str| format!("{n}={}", dir.path().join(n).display());
    let (la, lb) = (lora("a"), lora("b"));
    let w = serve_base(&base, &["--lora", &la, "--lora", &lb]);
    let models = common::get(&format!("{}/v1/models", w.base)).await.json();
    let cards: Vec<(String, Value)> = models["data"]
        .as_array()
        .expect("list")
        .iter()
        .map(|c| (c["id"].as_str().unwrap_or("").to_owned(), c["parent"].clone()))
        .collect();
    assert_eq!(
        cards,
        vec![
            ("tiny-base".to_owned(), Value::Null),
            ("a".to_owned(), Value::from("tiny-base")),
            ("b".to_owned(), Value::from("tiny-base"))
        ]
    );
    let prompt = "the quick brown fox jumps over the lazy dog and runs far away into the hills ".repeat(3);
    let (s, base_text, cached) = complete(&w.base, "tiny-base", &prompt).await;
    assert_eq!((s, cached), (200, 0));
    // Adapter a: another answer, and none of the base model's blocks (its name keys the chain).
    let (s, a_text, cached) = complete(&w.base, "a", &prompt).await;
    assert_eq!((s, cached), (200, 0), "an adapter never reads the base model's blocks");
    assert_ne!(a_text, base_text, "the adapter changes the answer");
    let (_, a_again, cached) = complete(&w.base, "a", &prompt).await;
    assert!(cached > 0, "its own blocks are its own cache hits");
    assert_eq!(a_again, a_text);
    let (s, b_text, cached) = complete(&w.base, "b", &prompt).await;
    assert_eq!((s, cached), (200, 0), "nor another adapter's");
    assert_ne!(b_text, a_text);
    let (s, _, _) = complete(&w.base, "nope", &prompt).await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn adapters_load_and_unload_at_run_time_behind_the_admin_token_with_an_lru_past_the_limit() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = base_and_adapters(dir.path(), &["a", "b", "c"], 4);
    let path = |n: &str| dir.path().join(n).display().to_string();
    let la = format!("a={}", path("a"));
    let w = serve_base(&base, &["--lora", &la, "--max-loras", "2", "--admin-token", "s3cret"]);
    let admin = [("authorization", "Bearer s3cret")];
    let load = |name: &str, auth: bool| {
        let body = serde_json::json!({"lora_name": name, "lora_path": path(name)});
        let url = format!("{}/v1/load_lora_adapter", w.base);
        async move { common::post(&url, &body, if auth { &admin[..] } else { &[] }).await }
    };
    let r = load("b", false).await;
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (401, Some("admin_token_required")));
    let r = load("b", true).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!((v["status"].as_str(), v["parent"].as_str()), (Some("loaded"), Some("tiny-base")));
    assert!(v["key"].as_str().is_some_and(|k| k.starts_with("b@")), "{v}");
    assert_eq!(load("b", true).await.json()["status"], "already_loaded");
    let prompt = "one two three four five six seven eight nine ten ".repeat(4);
    assert_eq!(complete(&w.base, "b", &prompt).await.0, 200, "a loaded adapter serves at once");
    // Two slots, `a` pinned by --lora: c takes b's.
    let v = load("c", true).await.json();
    assert_eq!((v["status"].as_str(), v["evicted"].as_str()), (Some("loaded"), Some("b")), "{v}");
    assert_eq!(complete(&w.base, "c", &prompt).await.0, 200);
    // b's weights went, its name did not: a request for it reads them again (taking c's slot), as vLLM does.
    assert_eq!(complete(&w.base, "b", &prompt).await.0, 200, "an unloaded adapter is read again");
    let m = common::get(&format!("{}/metrics", w.base)).await.body;
    assert_eq!(common::metric(&m, "kvgate_worker_lora_loads_total{outcome=\"reloaded\"}"), Some(1.0));
    let ids: Vec<String> = common::get(&format!("{}/v1/models", w.base)).await.json()["data"]
        .as_array()
        .expect("list")
        .iter()
        .map(|c| c["id"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(ids, ["tiny-base", "a", "b", "c"], "every adapter it knows");
    // Refused by name: a field kvgate does not implement, a name that is the model's, a missing directory.
    let url = format!("{}/v1/load_lora_adapter", w.base);
    let body = serde_json::json!({"lora_name": "d", "lora_path": path("c"), "load_inplace": true});
    let e = common::post(&url, &body, &admin).await.json();
    assert_eq!(
        (e["error"]["code"].as_str(), e["error"]["param"].as_str()),
        (Some("unsupported_parameter"), Some("load_inplace"))
    );
    let body = serde_json::json!({"lora_name": "tiny-base", "lora_path": path("c")});
    assert_eq!(common::post(&url, &body, &admin).await.status, 400);
    let body = serde_json::json!({"lora_name": "d", "lora_path": path("nowhere")});
    assert_eq!(common::post(&url, &body, &admin).await.json()["error"]["code"], "lora_path_not_found");
    let unload = format!("{}/v1/unload_lora_adapter", w.base);
    let r = common::post(&unload, &serde_json::json!({"lora_name": "c"}), &admin).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = common::post(&unload, &serde_json::json!({"lora_name": "c"}), &admin).await;
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (404, Some("lora_not_found")));
    assert_eq!(complete(&w.base, "c", &prompt).await.0, 404);
}

/// Issue #65: the gateway's static token is not an admin credential (a gateway loads with a credential for that
/// call alone), `--lora` adapters cannot be unloaded, files are read only as regular files inside `--lora-root`
/// (a link out is refused, a FIFO answered at once), and a burst of requests for an unloaded adapter reads its
/// files once.
#[tokio::test]
async fn runtime_loads_need_their_own_credential_stay_in_the_root_and_read_once_per_burst() {
    use kvgate_shared::credential::{now_ms, sign_request, RequestFor};
    let dir = tempfile::tempdir().expect("tmp");
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).expect("root");
    let base = base_and_adapters(&root, &["a", "b", "c"], 4);
    let at = |n: &str| root.join(n).display().to_string();
    let la = format!("a={}", at("a"));
    let root_s = root.display().to_string();
    let w = serve_base(
        &base,
        &[
            "--lora",
            &la,
            "--max-loras",
            "2",
            "--lora-root",
            &root_s,
            "--admin-token",
            "s3cret",
            "--report-secret",
            "rs",
        ],
    );
    let url = format!("{}/v1/load_lora_adapter", w.base);
    let load_body =
        |name: &str, path: &str| serde_json::json!({"lora_name": name, "lora_path": path}).to_string();
    let send = |body: String, auth: String| {
        let url = url.clone();
        async move {
            common::request(
                "POST",
                &url,
                Some(body),
                &[("authorization", &auth), ("content-type", "application/json")],
            )
            .await
        }
    };
    // The gateway's static token calls the API, it does not load files.
    let static_token = format!("Bearer {}", kvgate_shared::handoff::gateway_token("rs"));
    let r = send(load_body("b", &at("b")), static_token).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (401, serde_json::json!("admin_token_required"))
    );
    // A gateway's credential for this very call loads; the same credential for another body does not.
    let body = load_body("b", &at("b"));
    let r = RequestFor { path: "/v1/load_lora_adapter", body: body.as_bytes(), salt_header: None };
    let cred = format!("Bearer {}", sign_request("rs", now_ms(), &r));
    let ok = send(body, cred.clone()).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    let r = send(load_body("c", &at("c")), cred).await;
    assert_eq!(r.status, 401, "{}", r.body);
    let admin = "Bearer s3cret".to_owned();
    // A pinned adapter stays.
    let unload = format!("{}/v1/unload_lora_adapter", w.base);
    let r =
        common::post(&unload, &serde_json::json!({"lora_name": "a"}), &[("authorization", "Bearer s3cret")])
            .await;
    assert_eq!((r.status, r.json()["error"]["code"].clone()), (409, serde_json::json!("lora_pinned")));
    // A weights file that links out of the root, and a FIFO: refused, the FIFO at once.
    let out = dir.path().join("outside");
    let evil = root.join("evil");
    std::fs::create_dir_all(&evil).expect("dir");
    std::fs::create_dir_all(&out).expect("dir");
    std::fs::copy(root.join("b/adapter_model.safetensors"), out.join("w.safetensors")).expect("copy");
    std::fs::copy(root.join("b/adapter_config.json"), evil.join("adapter_config.json")).expect("copy");
    std::os::unix::fs::symlink(out.join("w.safetensors"), evil.join("adapter_model.safetensors"))
        .expect("link");
    let r = send(load_body("evil", &evil.display().to_string()), admin.clone()).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (403, serde_json::json!("lora_path_forbidden"))
    );
    let fifo = root.join("fifo");
    std::fs::create_dir_all(&fifo).expect("dir");
    std::fs::copy(root.join("b/adapter_config.json"), fifo.join("adapter_config.json")).expect("copy");
    assert!(std::process::Command::new("mkfifo")
        .arg(fifo.join("adapter_model.safetensors"))
        .status()
        .expect("mkfifo")
        .success());
    let started = std::time::Instant::now();
    let r = send(load_body("fifo", &fifo.display().to_string()), admin.clone()).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "a FIFO is not waited on");
    // c takes b's slot (a is pinned); then twenty requests for b at once read its files once.
    assert_eq!(send(load_body("c", &at("c")), admin).await.status, 200);
    let prompt = "one two three four five six seven eight nine ten ".repeat(2);
    let burst: Vec<_> = (0..20).map(|_| complete(&w.base, "b", &prompt)).collect();
    for (status, _, _) in futures_util::future::join_all(burst).await {
        assert_eq!(status, 200);
    }
    let m = common::get(&format!("{}/metrics", w.base)).await.body;
    assert_eq!(common::metric(&m, "kvgate_worker_lora_reloads_total{outcome=\"read\"}"), Some(1.0), "{m}");
}
