//! The chaos run in CI (issue #45): the whole deployment (two gateway replicas, a real `redis-server`, four
//! simulated workers, three tenants) for three minutes under load and a seeded schedule of every fault kind; the
//! run's own invariant checks must all hold. The long run is by command (`docs/benchmarks/reliability.md`).

use std::process::Command;

use serde_json::Value;

#[test]
fn three_minutes_of_every_fault_kind_under_load_break_no_invariant() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("chaos");
    let run = Command::new(env!("CARGO_BIN_EXE_kvgate-loadtest"))
        .args(["chaos", "--duration", "180s", "--seed", "2", "--out", out.to_str().expect("path")])
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stdout}\n{stderr}");
    let s: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).expect("summary"))
        .expect("json");
    assert_eq!(s["violations"].as_array().map(Vec::len), Some(0), "{stdout}");
    let kinds: Vec<&str> =
        s["faults"].as_array().expect("faults").iter().filter_map(|f| f["kind"].as_str()).collect();
    for k in
        ["kill_worker", "stop_worker", "restart_redis", "restart_gateway", "slow_clients", "budget_burst"]
    {
        assert!(kinds.contains(&k), "{k} in {kinds:?}");
    }
    assert!(s["requests"].as_u64() > Some(1000), "{stdout}");
    assert!(s["isolation_checked"].as_u64() >= Some(6), "{stdout}");
    // Every fault's recovery was measured, and the fleet came back within the run.
    for r in s["recoveries"].as_array().expect("recoveries") {
        assert!(r["recovered_after_s"].is_number(), "{r}");
    }
}
