//! Test helpers: start real `kvgate-worker serve` processes on ephemeral ports and talk HTTP to them.
#![allow(dead_code, unused_imports)]

use std::ops::{Deref, DerefMut};
use std::process::Command;

pub use kvgate_testkit::http::{client, get, metric, post, request, sse_events, Resp};
pub use kvgate_testkit::process::Proc;

/// A running worker process, killed on drop (a [`Proc`]), with its KV transfer listener.
pub struct Worker {
    proc: Proc,
    /// `host:port` of its KV transfer listener (empty without one).
    pub transfer: String,
    _dir: Option<tempfile::TempDir>,
}

impl Deref for Worker {
    type Target = Proc;
    fn deref(&self) -> &Proc {
        &self.proc
    }
}

impl DerefMut for Worker {
    fn deref_mut(&mut self) -> &mut Proc {
        &mut self.proc
    }
}

/// Starts `kvgate-worker serve --synth tiny` with extra flags; returns once it prints "ready".
pub fn start_worker(extra: &[&str]) -> Worker {
    start_worker_env(extra, &[])
}

/// [`start_worker`] with extra environment variables.
pub fn start_worker_env(extra: &[&str], env: &[(&str, &str)]) -> Worker {
    let dir = tempfile::tempdir().expect("tmp");
    let synth_dir = dir.path().join("tiny");
    let mut args: Vec<String> = vec![
        "serve".into(),
        "--synth".into(),
        "tiny".into(),
        "--synth-dir".into(),
        synth_dir.display().to_string(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        "0".into(),
    ];
    if !extra.contains(&"--kv-cache-tokens") {
        args.extend(["--kv-cache-tokens".into(), "4096".into()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-worker"));
    cmd.args(&args).envs(env.iter().copied());
    spawn_ready(cmd, Some(dir))
}

/// `kvgate-worker serve` with exactly these flags (and `--host 127.0.0.1 --port 0`).
pub fn serve(flags: &[&str]) -> Worker {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-worker"));
    cmd.args(["serve", "--host", "127.0.0.1", "--port", "0"]).args(flags);
    spawn_ready(cmd, None)
}

/// Starts `cmd` (a `serve` on port 0) and returns once it prints "ready", with the port and the transfer listener
/// it printed.
pub fn spawn_ready(cmd: Command, dir: Option<tempfile::TempDir>) -> Worker {
    let proc = kvgate_testkit::process::start(cmd, " ready ");
    let port = proc.after("listening on http://").and_then(|r| r.rsplit(':').next()?.trim().parse().ok());
    let proc = proc.on_port(port.expect("the worker printed its port"));
    let transfer = proc.after("kv transfer listening on ").unwrap_or("").to_owned();
    Worker { proc, transfer, _dir: dir }
}
