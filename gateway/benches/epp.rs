//! The endpoint picker against kvgate's own proxy and against Envoy alone, side by side in one run, on the same
//! three tiny workers (real processes on loopback, release builds, Envoy 1.40 from the test venv):
//! - latency: the same small completion direct to a worker, through kvgate's pingora path, through Envoy alone
//!   (round robin) and through Envoy + the kvgate picker (`ext_proc`), alternating request by request;
//! - CPU per request of the proxies (gateway and Envoy processes, from `/proc`), each path run alone;
//! - the hit rate of the same multi-turn conversations (their own texts per path) through kvgate's proxy and
//!   through Envoy + the picker.
//!
//! `KVGATE_PYTHON=$PWD/.venv/bin/python cargo bench -p kvgate-gateway --bench epp` (builds the release binaries).

#[path = "../tests/common/chats.rs"]
mod chats;
mod common;
#[path = "../tests/common/envoy.rs"]
mod envoy;

use std::time::{Duration, Instant};

use common::{http, percentile, port, release_bins, small_body, start, timed, Http};
use envoy::{Envoy, EnvoySpec};

const LATENCY_REQUESTS: u32 = 1000;
const CPU_REQUESTS: u32 = 1000;
const USERS: usize = 5;
const TURNS: usize = 4;

/// CPU seconds (user + system) a process has used.
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of stat; after the ")" they are the 12th and 13th.
    (ticks(11) + ticks(12)) / 100.0
}

async fn send(client: &Http, base: &str, i: u32) -> (bool, f64) {
    let (status, ms) = timed(client, "POST", &format!("{base}/v1/completions"), small_body(i)).await;
    (status == 200, ms)
}

fn main() {
    let python = std::env::var_os("KVGATE_PYTHON").expect("KVGATE_PYTHON: the test venv's python (envoy)");
    let bin = release_bins();
    let dir = tempfile::tempdir().expect("tmp");
    let (gp, cp, ep) = (port(), port(), port());
    let g = start(
        &bin("kvgate-gateway"),
        &[
            "--listen".into(),
            format!("127.0.0.1:{gp}"),
            "--control-listen".into(),
            format!("127.0.0.1:{cp}"),
            "--epp-listen".into(),
            format!("127.0.0.1:{ep}"),
            "--report-secret".into(),
            "bench-secret".into(),
        ],
        "listening on http",
    );
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let wp = port();
            let w = start(
                &bin("kvgate-worker"),
                &[
                    "serve",
                    "--synth",
                    "tiny",
                    "--synth-dir",
                    &dir.path().display().to_string(),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    &wp.to_string(),
                    "--worker-id",
                    &format!("w{i}"),
                    "--report-to",
                    &format!("http://127.0.0.1:{cp}"),
                    "--report-interval",
                    "200ms",
                    "--report-secret",
                    "bench-secret",
                ]
                .map(String::from),
                " ready ",
            );
            (w, wp)
        })
        .collect();
    let pool: Vec<u16> = workers.iter().map(|(_, p)| *p).collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("rt");
    rt.block_on(async move {
        let spec = |epp| EnvoySpec { epp, pool: &pool, fail_open: false, subset: None, buffered: false, ..Default::default() };
        let alone = Envoy::start(&python, dir.path(), "alone", &spec(None)).await;
        let picker = Envoy::start(&python, dir.path(), "picker", &spec(Some(ep))).await;
        let client = http();
        let paths = [
            ("direct to worker", format!("http://127.0.0.1:{}", pool[0])),
            ("kvgate proxy (pingora)", format!("http://127.0.0.1:{gp}")),
            ("Envoy alone (round robin)", alone.base.clone()),
            ("Envoy + kvgate picker (ext_proc)", picker.base.clone()),
        ];
        let deadline = Instant::now() + Duration::from_secs(60);
        for (_, url) in &paths {
            while !send(&client, url, 0).await.0 {
                assert!(Instant::now() < deadline, "{url} never answered 200");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        for i in 0..50 {
            for (_, url) in &paths {
                send(&client, url, i).await;
            }
        }
        let mut ms: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
        for i in 0..LATENCY_REQUESTS {
            for (k, (_, url)) in paths.iter().enumerate() {
                let (ok, t) = send(&client, url, i).await;
                assert!(ok, "{url}");
                ms[k].push(t);
            }
        }
        // CPU per request of the proxies on each path, each path alone.
        let proxies: [Vec<u32>; 4] = [
            vec![],
            vec![g.child.id()],
            vec![alone.proc.child.id()],
            vec![picker.proc.child.id(), g.child.id()],
        ];
        let mut cpu_ms = Vec::new();
        for (k, (_, url)) in paths.iter().enumerate() {
            let before: f64 = proxies[k].iter().map(|p| cpu_s(*p)).sum();
            for i in 0..CPU_REQUESTS {
                assert!(send(&client, url, i + 7).await.0, "{url}");
            }
            let after: f64 = proxies[k].iter().map(|p| cpu_s(*p)).sum();
            cpu_ms.push((after - before) * 1e3 / f64::from(CPU_REQUESTS));
        }
        let hit_proxy = chats::conversations(&paths[1].1, "p", USERS, TURNS).await.0;
        let hit_picker = chats::conversations(&paths[3].1, "e", USERS, TURNS).await.0;
        let hit_alone = chats::conversations(&paths[2].1, "r", USERS, TURNS).await.0;

        println!(
            "{LATENCY_REQUESTS} sequential 4-token completions (max_tokens 1) per path, tiny model, 3 workers, \
             the four paths alternating; then {CPU_REQUESTS} per path alone for the proxies' CPU\n"
        );
        println!("| path | p50 ms | p99 ms | added p50 ms | added p99 ms | proxy CPU ms/request |");
        println!("|---|---|---|---|---|---|");
        let q: Vec<(f64, f64)> = ms.iter().map(|v| (percentile(v, 0.5), percentile(v, 0.99))).collect();
        for (k, (name, _)) in paths.iter().enumerate() {
            println!(
                "| {name} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
                q[k].0,
                q[k].1,
                q[k].0 - q[0].0,
                q[k].1 - q[0].1,
                cpu_ms[k]
            );
        }
        println!(
            "\nHit rate of {USERS} users x {TURNS} turns (a shared system prompt, each turn the conversation so far): \
             kvgate proxy {hit_proxy:.3}, Envoy + kvgate picker {hit_picker:.3}, Envoy alone (round robin) \
             {hit_alone:.3}"
        );
        drop(workers);
    });
}
