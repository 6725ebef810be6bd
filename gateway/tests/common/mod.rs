//! Test fleet: real `kvgate-worker` and `kvgate-gateway` processes on loopback ports, killed on drop.
#![allow(dead_code, unused_imports)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

pub use kvgate_testkit::http::metric;
pub use kvgate_testkit::http::{
    get, open_stream, post, read_rest, read_until, request, request_bytes, try_get, Resp,
};
pub use kvgate_testkit::percentile;
pub use kvgate_testkit::process::{bin, free_port, spawn, start, Proc};

pub mod chats;
pub mod envoy;
pub mod redis;
pub mod vllm;

pub const MODEL: &str = "kvgate-tiny";

/// The test venv's Python (`KVGATE_PYTHON`, set by scripts/test.sh), with what the test `needs` from it; `None`
/// (the test skips) outside CI, a failure in CI.
pub fn python(needs: &str) -> Option<std::ffi::OsString> {
    match std::env::var_os("KVGATE_PYTHON") {
        Some(p) if !p.is_empty() => Some(p),
        _ => {
            assert!(std::env::var_os("CI").is_none(), "CI needs KVGATE_PYTHON ({needs})");
            eprintln!("skipped: KVGATE_PYTHON is not set (run ./scripts/test.sh)");
            None
        }
    }
}

/// Starts a tiny-model worker reporting to `control` (if any) every 200 ms.
pub fn worker(id: &str, synth_dir: &std::path::Path, control: Option<&str>, extra: &[&str]) -> Proc {
    worker_on(free_port(), id, synth_dir, control, extra, &[])
}

/// [`worker`] on a given port, with extra environment variables.
pub fn worker_on(
    port: u16,
    id: &str,
    synth_dir: &std::path::Path,
    control: Option<&str>,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Proc {
    let mut args: Vec<String> =
        ["serve", "--synth", "tiny", "--host", "127.0.0.1"].map(String::from).to_vec();
    // Defaults that `extra` may set otherwise.
    for (flag, value) in
        [("--kv-cache-tokens", "8192"), ("--report-interval", "200ms"), ("--summary-granularity", "1")]
    {
        if !extra.contains(&flag) {
            args.extend([flag.to_owned(), value.to_owned()]);
        }
    }
    args.extend(["--synth-dir".into(), synth_dir.display().to_string(), "--port".into(), port.to_string()]);
    args.extend(["--worker-id".into(), id.to_owned()]);
    if let Some(c) = control {
        args.extend(["--report-to".into(), c.to_owned(), "--report-secret".into(), "test-secret".into()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut cmd = Command::new(bin("kvgate-worker"));
    cmd.args(&args).envs(env.iter().copied());
    start(cmd, " ready ").on_port(port)
}

/// A gateway; returns (process, control base URL). Each gets its own data directory (where the admin state file
/// goes by default), so tests never share one.
pub fn gateway(extra: &[&str]) -> (Proc, String) {
    let data = tempfile::tempdir().expect("data dir");
    gateway_in(extra, data)
}

/// A gateway whose data directory is `data` (a restart can reuse it).
/// A gateway that exits before listening (another process took a port between the check and the bind) is started
/// again on fresh ports, three times at most.
pub fn gateway_in(extra: &[&str], data: tempfile::TempDir) -> (Proc, String) {
    for _ in 0..3 {
        let (port, cport) = (free_port(), free_port());
        let mut args: Vec<String> = vec![
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--control-listen".into(),
            format!("127.0.0.1:{cport}"),
            "--report-secret".into(),
            "test-secret".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut cmd = Command::new(bin("kvgate-gateway"));
        cmd.args(&args).env("KVGATE_DATA_DIR", data.path());
        match spawn(cmd, "listening on", kvgate_testkit::process::READY_WITHIN) {
            Ok(mut g) => {
                g.data = Some(data);
                return (g.on_port(port), format!("http://127.0.0.1:{cport}"));
            }
            Err(kvgate_testkit::process::NotReady::Exited(_)) => continue,
            Err(e) => panic!("the gateway did not start: {e:?}"),
        }
    }
    panic!("the gateway exited before listening, three times");
}

/// Waits until the gateway lists `n` healthy workers with fresh summaries.
pub async fn wait_healthy(control: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = get(&format!("{control}/kvgate/v1/workers")).await;
        if r.status == 200 {
            let ws = r.json();
            let ok = ws.as_array().map_or(0, |a| {
                a.iter().filter(|w| w["healthy"] == true && w["summary_fresh"] == true).count()
            });
            // And the gateway is ready: a healthy worker's tokenizer is loaded (else a request gets 404).
            if ok >= n && get(&format!("{control}/ready")).await.status == 200 {
                return;
            }
        }
        assert!(Instant::now() < deadline, "gateway never saw {n} healthy workers: {}", r.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The API key of the test caller that may choose every class (see [`keys_file`]).
pub const TRUSTED_KEY: &str = "trusted-caller-key-0123456789";

/// Writes an API key file: `TRUSTED_KEY` (tenant "trusted", may choose `classes`) plus `extra` TOML.
pub fn keys_file(dir: &std::path::Path, classes: &[&str], extra: &str) -> PathBuf {
    let path = dir.join("keys.toml");
    let list: Vec<String> = classes.iter().map(|c| format!("{c:?}")).collect();
    std::fs::write(
        &path,
        format!(
            "[[keys]]\nkey = \"{TRUSTED_KEY}\"\ntenant = \"trusted\"\nclasses = [{}]\n{extra}",
            list.join(", ")
        ),
    )
    .expect("write keys");
    path
}

/// Writes a simulated-engine timing profile: `decode_step_s` per decode step, `prefill_token_s` per prompt token.
pub fn sim_profile(dir: &std::path::Path, name: &str, decode_step_s: f64, prefill_token_s: f64) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            "name = \"{name}\"\nsource = \"test fixture\"\nmax_model_len = 8192\n[timing]\nprefill_base_s = 0.0\n\
             prefill_per_token_s = {prefill_token_s}\nprefill_attention_s = 0.0\ndecode_base_s = {decode_step_s}\n\
             decode_per_seq_s = 0.0\ndecode_per_kv_token_s = 0.0\n"
        ),
    )
    .expect("write profile");
    path
}

/// A simulated-engine worker (tiny model's tokenizer) reporting to `control`, taking `decode_step_s` a token and no
/// time for prefill.
pub fn sim_worker(id: &str, dir: &std::path::Path, control: &str, decode_step_s: f64) -> Proc {
    let profile = sim_profile(dir, &format!("sim-{id}"), decode_step_s, 0.0);
    let p = profile.display().to_string();
    worker(id, &dir.join("tiny"), Some(control), &["--engine", "sim", "--sim-profile", &p])
}

/// Sends a signal to a process.
pub fn signal(p: &Proc, sig: i32) {
    p.signal(sig);
}

/// Resident memory of a process in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// One worker's entry in the gateway's worker list.
pub async fn worker_state(control: &str, id: &str) -> Option<Value> {
    let ws = get(&format!("{control}/kvgate/v1/workers")).await.json();
    ws.as_array().and_then(|a| a.iter().find(|w| w["id"] == id).cloned())
}

/// Polls `cond` on a worker's state until it holds (panics after `within`).
pub async fn wait_worker(control: &str, id: &str, within: Duration, cond: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + within;
    loop {
        if let Some(w) = worker_state(control, id).await {
            if cond(&w) {
                return w;
            }
        }
        assert!(
            Instant::now() < deadline,
            "worker {id} never reached the state: {:?}",
            worker_state(control, id).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `cond` until it holds (panics after `within`).
pub async fn wait_until<F, Fut>(within: Duration, cond: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !cond().await {
        assert!(Instant::now() < deadline, "condition not reached within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
