//! Gateway-added latency, side by side in one run: the same small request sent straight to a worker and through
//! the gateway (real processes on loopback, release builds), alternating, sequentially.
//!
//! `cargo bench -p kvgate-gateway --bench latency` (builds the release binaries it needs). With
//! `KVGATE_BASELINE_GATEWAY=<path to another kvgate-gateway binary>` (e.g. a build from before a change), that gateway
//! runs too, in front of the same worker, and joins the alternation: before and after in one run.

mod common;

use std::time::{Duration, Instant};

use common::{http, percentile, port, release_bins, small_body, start, timed};

fn main() {
    let bin = release_bins();
    let dir = std::env::temp_dir().join("kvgate-latency-bench");
    let (wp, gp, cp, bp, bcp) = (port(), port(), port(), port(), port());
    let gateway = |path: &str, listen: u16, control: u16| {
        let args = [
            "--listen".into(),
            format!("127.0.0.1:{listen}"),
            "--control-listen".into(),
            format!("127.0.0.1:{control}"),
            "--report-secret".into(),
            "bench-secret".into(),
        ];
        start(path, &args, "listening on")
    };
    let _g = gateway(&bin("kvgate-gateway"), gp, cp);
    let baseline = std::env::var("KVGATE_BASELINE_GATEWAY").ok().filter(|p| !p.is_empty());
    let _b = baseline.as_deref().map(|path| gateway(path, bp, bcp));
    let mut report_to = format!("http://127.0.0.1:{cp}");
    if baseline.is_some() {
        report_to.push_str(&format!(",http://127.0.0.1:{bcp}"));
    }
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
            report_to,
            "--report-interval".into(),
            "200ms".into(),
            "--report-secret".into(),
            "bench-secret".into(),
        ],
        " ready ",
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("rt");
    rt.block_on(async move {
        let client = http();
        let send = |base: String, i: u32| {
            let client = client.clone();
            async move {
                let (status, ms) =
                    timed(&client, "POST", &format!("{base}/v1/completions"), small_body(i)).await;
                (status == 200, ms)
            }
        };
        // The paths alternated: the worker, this build's gateway, and the baseline gateway when given.
        let mut paths = vec![
            ("direct to worker", format!("http://127.0.0.1:{wp}")),
            ("through gateway", format!("http://127.0.0.1:{gp}")),
        ];
        if baseline.is_some() {
            paths.push(("through baseline gateway", format!("http://127.0.0.1:{bp}")));
        }
        // Wait until the gateways route.
        let deadline = Instant::now() + Duration::from_secs(30);
        for (_, url) in &paths[1..] {
            while !send(url.clone(), 0).await.0 {
                assert!(Instant::now() < deadline, "gateway {url} never became ready");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        for i in 0..50 {
            for (_, url) in &paths {
                send(url.clone(), i).await;
            }
        }
        let mut ms: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
        for i in 0..1000u32 {
            for (k, (_, url)) in paths.iter().enumerate() {
                let (ok, t) = send(url.clone(), i).await;
                assert!(ok, "{url}");
                ms[k].push(t);
            }
        }
        let q: Vec<(f64, f64)> = ms.iter().map(|v| (percentile(v, 0.5), percentile(v, 0.99))).collect();
        let names: Vec<&str> = paths.iter().map(|p| p.0).collect();
        println!(
            "1000 sequential 4-token completions (max_tokens 1), tiny model, alternating {}\n",
            names.join(" / ")
        );
        println!("| path | p50 ms | p99 ms |\n|---|---|---|");
        for (name, (p50, p99)) in names.iter().zip(&q) {
            println!("| {name} | {p50:.3} | {p99:.3} |");
        }
        for (k, name) in names.iter().enumerate().skip(1) {
            let added = name.replace("through ", "added by ");
            println!("| {added} | {:.3} | {:.3} |", q[k].0 - q[0].0, q[k].1 - q[0].1);
        }
    });
}
