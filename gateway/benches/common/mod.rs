//! Helpers of the gateway's process benches: release binaries, free ports, processes killed on drop.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// The HTTP client of the benches.
pub type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn http() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// One request, timed to the end of its body: (status, milliseconds).
pub async fn timed(client: &Http, method: &str, url: &str, body: String) -> (u16, f64) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("req");
    let t = Instant::now();
    let resp = client.request(req).await.expect("resp");
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await.expect("body");
    (status, t.elapsed().as_secs_f64() * 1e3)
}

/// A 4-token completion (`max_tokens` 1) whose prompt varies with `i`.
pub fn small_body(i: u32) -> String {
    format!(
        "{{\"model\":\"kvgate-tiny\",\"prompt\":[{},{},{},{}],\"max_tokens\":1}}",
        i % 500,
        (i * 7) % 500,
        (i * 13) % 500,
        (i * 31) % 500
    )
}

/// A child process killed (and waited for) on drop.
pub struct Kill(pub Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn port() -> u16 {
    kvgate_shared::ports::free_loopback_port().expect("port")
}

/// Starts `bin` and waits for a stdout line containing `needle`.
pub fn start(bin: &str, args: &[String], needle: &str) -> Kill {
    // The child is wrapped in `Kill` (killed and waited on drop) before anything can fail.
    #[allow(clippy::zombie_processes)]
    let mut child =
        Command::new(bin).args(args).env("RUST_LOG", "error").stdout(Stdio::piped()).spawn().expect("spawn");
    let out = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(out).lines();
    loop {
        let line = lines.next().expect("line").expect("read");
        if line.contains(needle) {
            std::thread::spawn(move || for _ in lines.by_ref() {});
            return Kill(child);
        }
    }
}

/// The `p` quantile (0..=1) of `v`.
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Builds the release binaries and returns a function from a binary name to its path.
pub fn release_bins() -> impl Fn(&str) -> String {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let status = Command::new(env!("CARGO"))
        .current_dir(root)
        .args(["build", "--release", "-q", "--bin", "kvgate-worker", "--bin", "kvgate-gateway"])
        .status()
        .expect("cargo");
    assert!(status.success());
    move |n: &str| format!("{root}/target/release/{n}")
}
