//! The drop-in proof against a real third-party server (issue #18): three llama.cpp servers (PyPI
//! `llama-cpp-python[server]`, built from source on CPU) serving the synthetic `small` model as GGUF, a gateway in
//! front of them with only the model's tokenizer configured (`[[models]]` kind `openai`), and the multi-turn workload
//! through it under `cache_aware_measured` (the default) and under `round_robin`. All of it runs in
//! `scripts/llamacpp_proof.py` (also the benchmark's driver, `scripts/llamacpp-bench.sh`); this test runs it small
//! and checks what it measured.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

mod common;

#[test]
fn conversations_stick_to_one_llama_cpp_pod_and_reuse_more_of_its_cache_than_round_robin() {
    let Some(py) = common::python("llama-cpp-python") else { return };
    // The gateway, worker (the conversion check's reference) and load generator next to this test's binary.
    let bin_dir = common::bin("kvgate-gateway").parent().expect("bin dir").to_path_buf();
    common::bin("kvgate-worker");
    common::bin("kvgate-loadtest");
    let out = tempfile::tempdir().expect("tmp");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/llamacpp_proof.py");
    let run = Command::new(py)
        .arg(&script)
        .args(["--bin-dir", bin_dir.to_str().expect("path"), "--out", out.path().to_str().expect("path")])
        .args([
            "--pods",
            "3",
            "--users",
            "6",
            "--turns",
            "4",
            "--system-words",
            "100",
            "--question-words",
            "32",
        ])
        .args(["--output-tokens", "16", "--duration", "60"])
        .output()
        .expect("the proof script runs");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    let proof: Value = serde_json::from_str(&stdout).expect("one JSON object");

    // Same weights, same tokens: the GGUF on llama.cpp against kvgate's CPU engine on the safetensors.
    let conv = &proof["conversion"];
    assert_eq!(conv["ok"], true, "{conv}");
    assert!(conv["greedy_chat"].as_array().is_some_and(|c| c.len() == 2), "{conv}");

    // What the gateway does not route by prefix reaches the pod (#30): embeddings through it equal the pod's own.
    let pass = &proof["passthrough"];
    assert_eq!(pass["embedding_equal"], true, "{pass}");
    assert!(pass["dims"].as_u64().is_some_and(|d| d > 0), "{pass}");
    assert_eq!(pass["model_card"], "kvgate-small", "{pass}");

    let (ca, rr) = (&proof["policies"]["cache_aware_measured"], &proof["policies"]["round_robin"]);
    for p in [ca, rr] {
        assert_eq!(p["ok"], p["requests"], "every request answered: {p}");
        assert_eq!(p["requests"], 24, "{p}");
        assert_eq!(p["sessions"], 6, "{p}");
    }
    // Every conversation on one pod under cache_aware_measured; spread over the pods under round_robin.
    assert_eq!(ca["sticky_sessions"], 6, "{ca}");
    assert!(rr["mean_pods_per_session"].as_f64().expect("mean") > 1.5, "{rr}");
    // The pods' own logs: more of the prompts came from their KV cache under cache_aware_measured. The margin
    // depends on the machine's load (cache_aware alone: 0.746 vs 0.641; inside the full suite on 2 cores, 0.708 vs
    // 0.679, 2026-12-02), so the test asks for strictly better, and for fewer prompt tokens evaluated;
    // docs/benchmarks/peers.md has the measured run.
    let (hca, hrr) = (ca["hit_rate"].as_f64().expect("hit"), rr["hit_rate"].as_f64().expect("hit"));
    assert!(hca > hrr, "cache_aware_measured {hca} vs round_robin {hrr}");
    assert!(ca["prompt_tokens_evaluated"].as_u64() < rr["prompt_tokens_evaluated"].as_u64(), "{ca} {rr}");
}
