//! kvgate's LoRA against PEFT itself (`peft` over `transformers`, fp32, scripts/peft_reference.py in .venv-vllm) on
//! the same synthesized model and adapter: the logits after the prompt and after each greedy token agree within 1e-4
//! relative, and so do the greedy tokens.

use std::process::Command;

use kvgate_worker::model::llama::{LlamaModel, SeqChunk};
use kvgate_worker::model::lora::{synth_lora, LoraAdapter, LoraSpec, Target, DEFAULT_MAX_LORA_RANK};
use kvgate_worker::model::synth::{synth_model, Preset, SynthSpec};
use kvgate_worker::model::ModelConfig;

const TOL: f32 = 1e-4;
const STEPS: usize = 6;

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::MIN), |(bi, bv), (i, x)| if *x > bv { (i, *x) } else { (bi, bv) }).0
        as u32
}

/// `.venv-vllm`'s Python (`KVGATE_VLLM_PYTHON`, set by scripts/test.sh); `None` (skip) outside CI, a failure in CI.
fn python() -> Option<std::ffi::OsString> {
    match std::env::var_os("KVGATE_VLLM_PYTHON") {
        Some(p) if !p.is_empty() => Some(p),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI needs KVGATE_VLLM_PYTHON (peft, transformers, torch)"
            );
            eprintln!("skipped: KVGATE_VLLM_PYTHON is not set (run ./scripts/test.sh)");
            None
        }
    }
}

#[test]
fn greedy_logits_with_an_adapter_match_peft_on_the_same_weights() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let base = dir.path().join("base");
    synth_model(&base, &SynthSpec::new(Preset::Tiny, 3)).expect("synth");
    let cfg = ModelConfig::from_dir(&base).expect("config");
    let adapter_dir = dir.path().join("adapter");
    let spec = LoraSpec { base: "tiny", rank: 8, alpha: 16.0, targets: &Target::ALL, seed: 11, zero: false };
    synth_lora(&adapter_dir, &cfg, &spec).expect("adapter");
    let adapter = LoraAdapter::load(&adapter_dir, "a", &cfg, DEFAULT_MAX_LORA_RANK).expect("load");
    let prompt: Vec<u32> = (0..19u32).map(|i| (i * 37 + 5) % 500).collect();

    // Ours: the paged forward with the adapter, prefill then greedy decodes.
    let model = LlamaModel::load(&base).expect("model");
    let mut kv = model.new_kv_store(64);
    let slots: Vec<usize> = (0..64).collect();
    let mut ids = prompt.clone();
    let mut ours = Vec::new();
    let mut start = 0;
    for _ in 0..=STEPS {
        let chunk = SeqChunk {
            tokens: &ids[start..],
            start,
            slots: &slots,
            want_logits: true,
            adapter: Some(&adapter),
        };
        let logits = model.forward(&[chunk], &mut kv).expect("forward").remove(0).expect("logits");
        start = ids.len();
        ids.push(argmax(&logits));
        ours.push(logits);
    }

    // The adapter matters here (else the comparison would not test it).
    let mut kv0 = model.new_kv_store(64);
    let plain = SeqChunk { tokens: &prompt, start: 0, slots: &slots, want_logits: true, adapter: None };
    let base_logits = model.forward(&[plain], &mut kv0).expect("forward").remove(0).expect("logits");
    assert!(rel_err(&ours[0], &base_logits) > 1e-2, "the adapter changes the logits");

    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/peft_reference.py");
    let out = Command::new(py)
        .arg(&script)
        .args([base.as_os_str(), adapter_dir.as_os_str()])
        .arg(serde_json::to_string(&prompt).expect("json"))
        .arg(STEPS.to_string())
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run the PEFT reference");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let theirs: Vec<Vec<f32>> = serde_json::from_value(v["logits"].clone()).expect("logits");
    let their_ids: Vec<u32> = serde_json::from_value(v["ids"].clone()).expect("ids");
    assert_eq!(ids, their_ids, "greedy tokens");
    for (s, (o, t)) in ours.iter().zip(&theirs).enumerate() {
        let e = rel_err(o, t);
        assert!(e <= TOL, "step {s}: relative error {e:e}");
    }
}
