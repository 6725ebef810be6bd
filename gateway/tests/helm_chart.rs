//! The Helm chart (`helm/kvgate`): checked offline by `helm/tests/check_chart.py` (Helm v4 lint and render through
//! helm-python-sdk, `kubernetes-validate --strict` on every manifest, chart behaviour, schema refusals), and what it
//! renders run on the real binaries: the gateway starts on the chart's `gateway.toml`, a worker on the chart's
//! arguments reports to it, the gateway turns ready and serves a chat completion.
//!
//! Needs `KVGATE_PYTHON` (set by scripts/test.sh) with `helm-python-sdk` and `kubernetes-validate`; under CI a
//! missing interpreter fails the test.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../helm/tests/check_chart.py")
}

#[test]
fn chart_lints_renders_validates_and_refuses_bad_values() {
    let Some(py) = python("the chart checks") else { return };
    let out = Command::new(py).arg(script()).output().expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("chart ok against Kubernetes"), "{stdout}");
    assert!(stdout.matches("ok: rejected").count() >= 10, "{stdout}");
}

#[tokio::test]
async fn what_the_chart_renders_runs_on_the_real_binaries() {
    let Some(py) = python("the chart checks") else { return };
    let out = Command::new(py).arg(script()).args(["--render", "e2e"]).output().expect("python runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rendered: Value = serde_json::from_slice(&out.stdout).expect("json");
    let dir = tempfile::tempdir().expect("tmp");
    let config = dir.path().join("gateway.toml");
    std::fs::write(&config, rendered["gateway_toml"].as_str().expect("toml")).expect("write");

    // The gateway on the chart's config; only the listen addresses change (flags beat the file).
    let (port, cport) = (free_port(), free_port());
    let mut gw_args: Vec<String> = rendered["gateway_args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("str").to_owned())
        .collect();
    let cfg_pos = gw_args.iter().position(|a| a == "--config").expect("--config") + 1;
    gw_args[cfg_pos] = config.display().to_string();
    gw_args.extend([
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--control-listen".into(),
        format!("127.0.0.1:{cport}"),
    ]);
    let mut cmd = Command::new(bin("kvgate-gateway"));
    cmd.args(&gw_args)
        .env("KVGATE_REPORT_SECRET", "chart-secret")
        .env("KVGATE_ADMIN_TOKEN", "chart-admin")
        .env("KVGATE_DATA_DIR", dir.path());
    let gw = start(cmd, "listening on").on_port(port);
    let control = format!("http://127.0.0.1:{cport}");
    // No worker yet: not ready (the readiness probe keeps traffic away).
    assert_eq!(get(&format!("{control}/ready")).await.status, 503);
    // The chart's classes reached the gateway.
    let budgets = request(
        "GET",
        &format!("{control}/admin/v1/budgets"),
        None,
        &[("authorization", "Bearer chart-admin")],
    )
    .await;
    assert_eq!(budgets.status, 200, "{}", budgets.body);
    assert!(budgets.body.contains("\"short\"") && budgets.body.contains("\"long\""), "{}", budgets.body);

    // A worker on the chart's arguments, as pod kv-kvgate-worker-0 would run them.
    let wport = free_port();
    let pod = "kv-kvgate-worker-0";
    let mut args: Vec<String> = Vec::new();
    let rendered_args = rendered["worker_args"].as_array().expect("args");
    let mut it = rendered_args.iter().map(|a| a.as_str().expect("str").replace("$(POD_NAME)", pod));
    while let Some(a) = it.next() {
        let value = match a.as_str() {
            "--host" => Some("127.0.0.1".to_owned()),
            "--port" => Some(wport.to_string()),
            "--report-to" => Some(control.clone()),
            "--advertise-url" => Some(format!("http://127.0.0.1:{wport}")),
            "--synth-dir" => Some(dir.path().join("tiny").display().to_string()),
            _ => None,
        };
        match value {
            Some(v) => {
                it.next();
                args.extend([a, v]);
            }
            None => args.push(a),
        }
    }
    assert!(args.contains(&"sim".to_owned()) && args.contains(&pod.to_owned()), "{args:?}");
    let mut cmd = Command::new(bin("kvgate-worker"));
    cmd.args(&args).env("KVGATE_REPORT_SECRET", "chart-secret");
    let _worker = start(cmd, " ready ").on_port(wport);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = get(&format!("{control}/ready")).await;
        if r.status == 200 {
            assert_eq!(r.json()["healthy_workers"], 1);
            break;
        }
        assert!(Instant::now() < deadline, "the gateway never turned ready: {}", r.body);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let workers = get(&format!("{control}/kvgate/v1/workers")).await.json();
    assert_eq!(workers[0]["id"], pod);
    let r = post(
        &format!("{}/v1/chat/completions", gw.base),
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvgate-worker"), pod);
}

/// The chart fronting existing pods (`workers.external`): the gateway starts on the rendered `gateway.toml` and
/// routes to a pod its discovery finds (the Service name and the tokenizer path pointed at this machine's).
#[tokio::test]
async fn the_charts_external_mode_runs_on_the_real_gateway() {
    let Some(py) = python("the chart checks") else { return };
    let out =
        Command::new(py).arg(script()).args(["--render", "external-e2e"]).output().expect("python runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rendered: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(rendered["worker_args"].as_array().map(Vec::len), Some(0), "no kvgate workers deployed");
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let pod = worker("pod", &synth, None, &[]);
    let toml = rendered["gateway_toml"].as_str().expect("toml");
    assert!(toml.contains("[[models]]") && toml.contains("discover = \"127.0.0.1:1\""), "{toml}");
    let toml = toml
        .replace("\"/opt/kvgate/tokenizer\"", &format!("{:?}", synth.display().to_string()))
        .replace("127.0.0.1:1\"", &format!("127.0.0.1:{}\"", pod.port));
    let config = dir.path().join("gateway.toml");
    std::fs::write(&config, toml).expect("write");
    let (g, control) = gateway(&["--config", &config.display().to_string()]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(&format!("{control}/ready")).await.status != 200 {
        assert!(Instant::now() < deadline, "the gateway never found the pod");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let r = post(
        &format!("{}/v1/chat/completions", g.base),
        &serde_json::json!({"model": "kvgate-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvgate-worker"), pod.base);
}
