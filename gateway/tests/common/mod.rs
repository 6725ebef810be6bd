//! Test fleet: real `kvgate-worker` and `kvgate-gateway` processes on loopback ports, killed on drop.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub mod redis;
pub mod vllm;

pub const MODEL: &str = "kvgate-tiny";

/// A child process killed on drop.
pub struct Proc {
    pub child: Child,
    pub base: String,
    pub port: u16,
    /// The process's own data directory (`KVGATE_DATA_DIR`), removed with it.
    pub data: Option<tempfile::TempDir>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

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

/// A free loopback port below the ephemeral range (see `kvgate_shared::ports`).
pub fn free_port() -> u16 {
    kvgate_shared::ports::free_loopback_port().expect("port")
}

pub fn bin(name: &str) -> PathBuf {
    // target/debug/deps/<test> -> target/debug/<name>. `cargo nextest run --workspace` / `cargo test --workspace`
    // build every workspace binary first; a lone `cargo test -p kvgate-gateway` may find an older worker binary
    // (build it, or run the workspace). Building here would compile the dependencies a second time with the
    // non-test feature set, minutes on a clean CI machine.
    let exe = std::env::current_exe().expect("exe");
    let dir = exe.parent().and_then(|p| p.parent()).expect("target dir");
    let path = dir.join(name);
    if !path.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", name, "--bin", name])
            .status()
            .expect("cargo build");
        assert!(status.success(), "building {name}");
    }
    path
}

pub fn wait_for_line(child: &mut Child, needle: &str) {
    assert!(try_wait_for_line(child, needle), "no {needle:?} line: the process exited");
}

/// Waits (60 s at most) for a stdout line containing `needle`; false if the process closed its stdout (exited)
/// first.
pub fn try_wait_for_line(child: &mut Child, needle: &str) -> bool {
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = match rx.recv_timeout(left) {
            Ok(line) => line,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return false,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("no {needle:?} line in time"),
        };
        if line.contains(needle) {
            // Keep draining so the child never blocks on a full pipe.
            std::thread::spawn(move || while rx.recv().is_ok() {});
            return true;
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
    let mut child = Command::new(bin("kvgate-worker"))
        .args(&args)
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .spawn()
        .expect("worker starts");
    wait_for_line(&mut child, " ready ");
    Proc { child, base: format!("http://127.0.0.1:{port}"), port, data: None }
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
        let mut child = Command::new(bin("kvgate-gateway"))
            .args(&args)
            .env("RUST_LOG", "warn")
            .env("KVGATE_DATA_DIR", data.path())
            .stdout(Stdio::piped())
            .spawn()
            .expect("gateway starts");
        if try_wait_for_line(&mut child, "listening on") {
            let base = format!("http://127.0.0.1:{port}");
            return (Proc { child, base, port, data: Some(data) }, format!("http://127.0.0.1:{cport}"));
        }
        let _ = child.wait();
    }
    panic!("the gateway exited before listening, three times");
}

pub struct Resp {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    pub fn header(&self, name: &str) -> String {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()
    }
}

pub async fn request(method: &str, url: &str, body: Option<String>, headers: &[(&str, &str)]) -> Resp {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    request_bytes(method, url, body.unwrap_or_default().into_bytes(), &all).await
}

/// A request with a raw body and exactly the given headers.
pub async fn request_bytes(method: &str, url: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> Resp {
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body))).expect("request");
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let resp = client.request(req).await.expect("response");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    Resp { status, headers, body: String::from_utf8_lossy(&bytes).into_owned() }
}

/// A streamed POST of `body` to `url`: the response with its body unread (read it with [`read_until`] and
/// [`read_rest`]).
pub async fn open_stream(url: &str, body: &Value) -> hyper::Response<hyper::body::Incoming> {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("req");
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    client.request(req).await.expect("resp")
}

/// Reads `body` until what came holds `n` times `needle` (each frame within `each`); returns what came.
pub async fn read_until(body: &mut hyper::body::Incoming, needle: &str, n: usize, each: Duration) -> String {
    let mut text = String::new();
    while text.matches(needle).count() < n {
        let frame = tokio::time::timeout(each, body.frame()).await.expect("chunk in time");
        text.push_str(&String::from_utf8_lossy(
            &frame.expect("frame").expect("ok").into_data().unwrap_or_default(),
        ));
    }
    text
}

/// The rest of `body` up to EOF or an error, which must come within `within`.
pub async fn read_rest(body: &mut hyper::body::Incoming, within: Duration) -> String {
    tokio::time::timeout(within, async {
        let mut rest = String::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => rest.push_str(&String::from_utf8_lossy(&f.into_data().unwrap_or_default())),
                Err(_) => break,
            }
        }
        rest
    })
    .await
    .unwrap_or_else(|_| panic!("no EOF within {within:?}"))
}

/// The status of `GET url`; `None` when there was none (a refused connection, for one).
pub async fn try_get(url: &str) -> Option<u16> {
    let req = hyper::Request::get(url).body(Full::new(Bytes::new())).ok()?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    client.request(req).await.ok().map(|r| r.status().as_u16())
}

pub async fn get(url: &str) -> Resp {
    request("GET", url, None, &[]).await
}

pub async fn post(url: &str, body: &Value, headers: &[(&str, &str)]) -> Resp {
    request("POST", url, Some(body.to_string()), headers).await
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
    // SAFETY: kill(2) on a child we own; no memory is touched.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::kill(p.child.id() as i32, sig) };
    assert_eq!(rc, 0, "kill({sig})");
}

/// The value of one Prometheus series (`name{labels}` exactly as exported), if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
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
