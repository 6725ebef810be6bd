//! Gateway-added latency, side by side in one run: the same small request sent straight to a worker and through
//! the gateway (real processes on loopback, release builds), alternating, sequentially.
//!
//! `cargo bench -p kvgate-gateway --bench latency` (builds the release binaries it needs).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("port")
}

fn start(bin: &str, args: &[String], needle: &str) -> Kill {
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

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let status = Command::new(env!("CARGO"))
        .current_dir(root)
        .args(["build", "--release", "-q", "--bin", "kvgate-worker", "--bin", "kvgate-gateway"])
        .status()
        .expect("cargo");
    assert!(status.success());
    let bin = |n: &str| format!("{root}/target/release/{n}");
    let dir = std::env::temp_dir().join("kvgate-latency-bench");
    let (wp, gp, cp) = (port(), port(), port());
    let _g = start(
        &bin("kvgate-gateway"),
        &["--listen".into(), format!("127.0.0.1:{gp}"), "--control-listen".into(), format!("127.0.0.1:{cp}")],
        "listening on",
    );
    let _w = start(
        &bin("kvgate-worker"),
        &[
            "serve".into(),
            "--synth".into(),
            "tiny".into(),
            "--synth-dir".into(),
            dir.display().to_string(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            wp.to_string(),
            "--report-to".into(),
            format!("http://127.0.0.1:{cp}"),
            "--report-interval".into(),
            "200ms".into(),
        ],
        " ready ",
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("rt");
    rt.block_on(async move {
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let send = |base: String, i: u32| {
            let client = client.clone();
            async move {
                let body = format!(
                    "{{\"model\":\"kvgate-tiny\",\"prompt\":[{},{},{},{}],\"max_tokens\":1}}",
                    i % 500,
                    (i * 7) % 500,
                    (i * 13) % 500,
                    (i * 31) % 500
                );
                let req = hyper::Request::post(format!("{base}/v1/completions"))
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .expect("req");
                let t = Instant::now();
                let resp = client.request(req).await.expect("resp");
                let ok = resp.status().is_success();
                let _ = resp.into_body().collect().await.expect("body");
                (ok, t.elapsed().as_secs_f64() * 1e3)
            }
        };
        let gw = format!("http://127.0.0.1:{gp}");
        let direct = format!("http://127.0.0.1:{wp}");
        // Wait until the gateway routes.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !send(gw.clone(), 0).await.0 {
            assert!(Instant::now() < deadline, "gateway never became ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for i in 0..50 {
            send(gw.clone(), i).await;
            send(direct.clone(), i).await;
        }
        let (mut d, mut g) = (Vec::new(), Vec::new());
        for i in 0..1000u32 {
            let (ok1, a) = send(direct.clone(), i).await;
            let (ok2, b) = send(gw.clone(), i).await;
            assert!(ok1 && ok2);
            d.push(a);
            g.push(b);
        }
        let (d50, d99, g50, g99) = (pct(&mut d, 0.5), pct(&mut d, 0.99), pct(&mut g, 0.5), pct(&mut g, 0.99));
        println!(
            "1000 sequential 4-token completions (max_tokens 1), tiny model, alternating direct / gateway\n"
        );
        println!("| path | p50 ms | p99 ms |\n|---|---|---|");
        println!("| direct to worker | {d50:.3} | {d99:.3} |");
        println!("| through gateway | {g50:.3} | {g99:.3} |");
        println!("| added by gateway | {:.3} | {:.3} |", g50 - d50, g99 - d99);
    });
}
