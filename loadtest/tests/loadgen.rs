//! The load generator against real processes: `compare` on local fleets of simulated workers, and `run` against a
//! worker started here. The tables' figures must be real measurements.

use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_testkit::process::{bin, free_port, spawn, start, Proc};
use serde_json::Value;

fn loadtest(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate-loadtest")).args(args).output().expect("runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn results(dir: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(dir.join("results.json")).expect("results.json");
    serde_json::from_str(&text).expect("json")
}

#[test]
fn compare_measures_each_policy_on_a_shared_prefix_workload() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("cmp");
    let (ok, stdout, stderr) = loadtest(&[
        "compare",
        "--workers",
        "2",
        "--policies",
        "round_robin,cache_aware",
        "--workload",
        "shared-prefix",
        "--groups",
        "6",
        "--prompts-per-group",
        "5",
        // A group prompt worth keeping together (5,120 tokens: over 4,096, so also with a positive
        // free_shared_tokens, which spreads a cheaper one on purpose, as a common system prompt).
        "--system-tokens",
        "5120",
        "--question-tokens",
        "32",
        "--output-tokens",
        "8",
        "--rate",
        "15",
        "--duration",
        "60s",
        "--no-progress",
        "--out",
        out.to_str().expect("path"),
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("round_robin") && stdout.contains("cache_aware") && stdout.contains("report.html")
    );
    let r = results(&out);
    let runs = r["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    let hit = |i: usize| runs[i]["summary"]["hit_rate"].as_f64().expect("hit rate");
    for run in runs {
        let s = &run["summary"];
        assert_eq!((s["requests"].as_u64(), s["errors"].as_u64()), (Some(30), Some(0)), "{s}");
        assert!(s["ttft_p50_ms"].as_f64().expect("ttft") > 0.0);
        assert!(s["goodput_tokens_per_s"].as_f64().expect("goodput") > 0.0);
        let records = run["records"].as_array().expect("records");
        assert_eq!(records.len(), 30);
        // The summary's hit rate is the records' usage figures, not something made up.
        let cached: u64 = records.iter().map(|x| x["cached_tokens"].as_u64().expect("cached")).sum();
        let prompt: u64 = records.iter().map(|x| x["prompt_tokens"].as_u64().expect("prompt")).sum();
        assert_eq!(prompt, 30 * 5152);
        assert!((s["hit_rate"].as_f64().expect("hit") - cached as f64 / prompt as f64).abs() < 1e-9);
        assert!(records.iter().all(|x| x["worker"].is_string() && x["completion_tokens"] == 8));
    }
    assert_eq!(runs[0]["summary"]["requests_per_worker"].as_object().map(|m| m.len()), Some(2));
    assert!(hit(1) > hit(0), "cache_aware {} vs round_robin {}", hit(1), hit(0));
    let html = std::fs::read_to_string(out.join("report.html")).expect("html");
    // TTFT and TPOT CDFs, hit rate and goodput over time, and a per-worker chart per run; every legend fits.
    assert_eq!(html.matches("<svg").count(), 6);
    assert!(html.contains("TPOT CDF") && html.contains("Goodput over time"));
}

#[test]
fn run_measures_multi_turn_sessions_against_a_worker_and_stops_by_itself() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let mut cmd = Command::new(bin("kvgate-worker"));
    cmd.args(["serve", "--synth", "tiny", "--engine", "sim", "--sim-profile", "gpu-h100-llama3-8b"])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--synth-dir", dir.path().join("tiny").to_str().expect("path")]);
    let worker = start(cmd, " ready ").on_port(port);
    let target = worker.base.clone();
    let out = dir.path().join("run");
    let common = [
        "run",
        "--target",
        &target,
        "--workload",
        "multi-turn",
        "--users",
        "3",
        "--turns",
        "3",
        "--system-words",
        "60",
        "--question-words",
        "12",
        "--output-tokens",
        "6",
        "--think-time",
        "0.05",
        "--rate",
        "20",
        "--no-progress",
        "--request-timeout",
        "30s",
    ];
    // The worker may still be loading: `run` waits for nothing, so retry the model lookup a few times.
    let mut attempt = 0;
    let (ok, stdout, stderr) = loop {
        let mut args = common.to_vec();
        args.extend(["--out", out.to_str().expect("path")]);
        let r = loadtest(&args);
        attempt += 1;
        if r.0 || attempt == 20 {
            break r;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(ok, "{stdout}\n{stderr}");
    let r = results(&out);
    let records = r["runs"][0]["records"].as_array().expect("records");
    assert_eq!(records.len(), 9);
    for x in records {
        assert_eq!(x["status"], 200, "{x}");
        assert!(x["ttft_ms"].as_f64().expect("ttft") > 0.0);
        // 6 tokens arrive in 2..=6 content chunks (the detokenizer holds back incomplete characters).
        let gaps = x["itl_ms"].as_array().map_or(0, |a| a.len());
        assert!((1..=5).contains(&gaps), "{x}");
        if x["turn"].as_u64() > Some(0) {
            // Each later turn carries the conversation so far, which this worker has cached.
            assert!(x["cached_tokens"].as_u64().expect("cached") > 0, "{x}");
        }
    }
    // Bounded by a request count.
    let capped = dir.path().join("capped");
    let mut args = common.to_vec();
    args.extend(["--requests", "2", "--out", capped.to_str().expect("path")]);
    let (ok, _, stderr) = loadtest(&args);
    assert!(ok, "{stderr}");
    assert_eq!(results(&capped)["runs"][0]["records"].as_array().map(|a| a.len()), Some(2));
    // Bad input: a clear message, exit status 2.
    let (ok, _, stderr) = loadtest(&["run", "--target", &target, "--workload", "poisson-ish"]);
    assert!(!ok && stderr.contains("unknown workload \"poisson-ish\""), "{stderr}");
    let (ok, _, stderr) = loadtest(&["run", "--target", &target, "--workload", "mooncake"]);
    assert!(!ok && stderr.contains("--trace"), "{stderr}");
    drop(worker);
}

#[test]
fn up_stops_every_process_it_started_on_ctrl_c() {
    let dir = tempfile::tempdir().expect("tmp");
    let logs = dir.path().join("logs");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-loadtest"));
    cmd.args(["up", "--engine", "sim", "--workers", "2", "--log-dir", logs.to_str().expect("path")])
        .stderr(std::process::Stdio::null());
    // `up` prints the gateway's URL, then the workers' line.
    let mut up: Proc = spawn(cmd, "workers: ", Duration::from_secs(120)).expect("up prints its URLs");
    let mut urls: Vec<String> = Vec::new();
    urls.extend(
        up.after("kvgate is up: gateway ").and_then(|r| r.split_whitespace().next()).map(str::to_owned),
    );
    urls.extend(up.after("workers: ").into_iter().flat_map(|r| r.split_whitespace()).map(str::to_owned));
    assert_eq!(urls.len(), 3, "{:?}", up.seen);
    let ports: Vec<u16> =
        urls.iter().map(|u| u.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port")).collect();
    assert!(ports.iter().all(|p| std::net::TcpStream::connect(("127.0.0.1", *p)).is_ok()), "{urls:?}");
    // Ctrl-C: SIGINT to `up` only; it must stop the gateway and both workers itself.
    up.signal(kvgate_testkit::process::signal::SIGINT);
    let deadline = Instant::now() + Duration::from_secs(20);
    while up.child.try_wait().expect("wait").is_none() {
        assert!(Instant::now() < deadline, "up did not exit on SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while ports.iter().any(|p| std::net::TcpStream::connect(("127.0.0.1", *p)).is_ok()) {
        assert!(Instant::now() < deadline, "a process `up` started still listens: {urls:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
