//! Test helpers: start real `kvgate-worker serve` processes on ephemeral ports and talk HTTP to them.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// A running worker process, killed on drop.
pub struct Worker {
    pub child: Child,
    pub base: String,
    pub port: u16,
    /// `host:port` of its KV transfer listener (empty without one).
    pub transfer: String,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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

/// Starts `cmd` (a `serve`) and returns once it prints "ready".
pub fn spawn_ready(mut cmd: Command, dir: Option<tempfile::TempDir>) -> Worker {
    let mut child = cmd
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("worker starts");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut port = 0;
    let mut transfer = String::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).expect("worker printed its ready line in time");
        if let Some(rest) = line.split("listening on http://").nth(1) {
            port = rest.rsplit(':').next().and_then(|p| p.trim().parse().ok()).expect("port");
        }
        if let Some(rest) = line.split("kv transfer listening on ").nth(1) {
            transfer = rest.trim().to_owned();
        }
        if line.contains(" ready ") {
            break;
        }
    }
    Worker { child, base: format!("http://127.0.0.1:{port}"), port, transfer, _dir: dir }
}

pub fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A complete response.
pub struct Resp {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

pub async fn request(method: &str, url: &str, body: Option<&str>) -> Resp {
    let req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or("").to_owned())))
        .expect("request");
    let resp = client().request(req).await.expect("response");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    Resp { status, headers, body: String::from_utf8_lossy(&bytes).into_owned() }
}

pub async fn get(url: &str) -> Resp {
    request("GET", url, None).await
}

pub async fn post(url: &str, body: &Value) -> Resp {
    request("POST", url, Some(&body.to_string())).await
}

/// The `data:` payloads of an SSE body.
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_owned).collect()
}

/// Reads a Prometheus sample value by its exact series text.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
