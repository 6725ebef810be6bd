//! Parity with Hugging Face `transformers`: our Prompter must produce exactly the token ids that
//! `AutoTokenizer.apply_chat_template` / `tokenizer(text)` produce on the same model directory.
//!
//! Needs a Python with `transformers` and `jinja2`: `scripts/setup.sh` makes one and `scripts/test.sh` exports it as
//! `KVGATE_PYTHON`. Without it the test says so and passes locally, but fails under CI (`CI` set), so CI can never
//! skip it silently.

use std::io::Write;
use std::process::{Command, Stdio};

use kvgate_shared::prompt::{synth_text, synth_tokenizer, ChatOptions, PromptInput, Prompter};
use serde_json::{json, Value};

#[test]
fn token_ids_match_transformers() {
    let Some(python) = std::env::var_os("KVGATE_PYTHON") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run this test: set KVGATE_PYTHON (scripts/setup.sh)"
        );
        eprintln!("KVGATE_PYTHON not set: skipping the transformers parity check (run scripts/test.sh)");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let synth = synth_tokenizer(2000, 11);
    std::fs::write(dir.path().join("tokenizer.json"), &synth.tokenizer_json).expect("write");
    std::fs::write(dir.path().join("tokenizer_config.json"), &synth.tokenizer_config_json).expect("write");

    let long = synth_text(5, 400);
    let chats = vec![
        json!([{"role": "user", "content": "Hello there"}]),
        json!([{"role": "system", "content": "  You are terse.\n"}, {"role": "user", "content": long},
               {"role": "assistant", "content": "ka ri to."}, {"role": "user", "content": "naïve 東京 🚀 and 42!"}]),
        json!([{"role": "user", "content": "  spaces   inside  \n\n and newlines "}]),
    ];
    let texts = vec![synth_text(8, 300), "  leading spaces, digits 12345 and émojis 🚀".to_string()];

    let mut cases: Vec<Value> = Vec::new();
    for c in &chats {
        cases.push(json!({"chat": c, "add_generation_prompt": true}));
        cases.push(json!({"chat": c, "add_generation_prompt": false}));
    }
    for t in &texts {
        cases.push(json!({"text": t}));
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/hf_reference.py");
    let mut child = Command::new(python)
        .arg(script)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_VERBOSITY", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python starts");
    let req = json!({"model_dir": dir.path(), "cases": cases});
    child.stdin.take().expect("stdin").write_all(req.to_string().as_bytes()).expect("write");
    let out = child.wait_with_output().expect("python runs");
    assert!(out.status.success(), "reference script failed");
    let reference: Vec<Vec<u32>> = serde_json::from_slice(&out.stdout).expect("ids");

    let prompter = Prompter::from_dir(dir.path()).expect("loads");
    let mut ours: Vec<Vec<u32>> = Vec::new();
    for c in &chats {
        let msgs = c.as_array().cloned().unwrap_or_default();
        for add in [true, false] {
            let opts = ChatOptions { add_generation_prompt: add, ..ChatOptions::default() };
            ours.push(
                prompter.tokenize(&PromptInput::Chat { messages: &msgs, options: &opts }).expect("tokenizes"),
            );
        }
    }
    for t in &texts {
        ours.push(prompter.tokenize(&PromptInput::Text(t)).expect("tokenizes"));
    }
    assert_eq!(ours.len(), reference.len());
    for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
        assert_eq!(a, b, "case {i} differs from transformers");
    }
}
