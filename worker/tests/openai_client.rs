//! A real, widely used OpenAI client (the official `openai` Python package, installed into `.venv` by
//! `scripts/setup.sh`) against a real worker. Under CI (`CI` set) a missing `KVGATE_PYTHON` fails the test.

mod common;

#[test]
fn official_openai_python_client_works() {
    let Some(python) = std::env::var_os("KVGATE_PYTHON") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run this test: set KVGATE_PYTHON (scripts/setup.sh)"
        );
        eprintln!("KVGATE_PYTHON not set: skipping the openai client check (run scripts/test.sh)");
        return;
    };
    let w = common::start_worker(&[]);
    let out = std::process::Command::new(python)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py"))
        .arg(&w.base)
        .arg("kvgate-tiny")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stdout.trim() == "ok", "openai client failed:\n{stdout}\n{stderr}");
}
