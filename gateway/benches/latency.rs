//! Gateway-added latency, side by side in one run: the same small request sent straight to a worker and through
//! the gateway (real processes on loopback, release builds), alternating, sequentially.
//!
//! `cargo bench -p kvgate-gateway --bench latency` (builds the release binaries it needs).

mod common;

use std::time::{Duration, Instant};

use common::{http, pct, port, release_bins, small_body, start, timed};

fn main() {
    let bin = release_bins();
    let dir = std::env::temp_dir().join("kvgate-latency-bench");
    let (wp, gp, cp) = (port(), port(), port());
    let _g = start(
        &bin("kvgate-gateway"),
        &[
            "--listen".into(),
            format!("127.0.0.1:{gp}"),
            "--control-listen".into(),
            format!("127.0.0.1:{cp}"),
            "--report-secret".into(),
            "bench-secret".into(),
        ],
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
