//! The chaos run in CI (issue #45): the whole deployment (two gateway replicas, a real `redis-server`, two
//! simulated workers, one with host and SSD tiers, a prefill and a decode worker on the CPU engine, three tenants)
//! for 220 seconds under load and a seeded schedule of every fault kind; the run's own invariant checks must all
//! hold. The long run is by command (`docs/benchmarks/reliability.md`).

use std::process::Command;

use serde_json::Value;

#[test]
fn every_fault_kind_under_load_breaks_no_invariant() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("chaos");
    let run = Command::new(env!("CARGO_BIN_EXE_kvgate-loadtest"))
        .args(["chaos", "--duration", "220s", "--seed", "2", "--out", out.to_str().expect("path")])
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
    for k in [
        "kill_worker",
        "stop_worker",
        "restart_redis",
        "restart_gateway",
        "slow_clients",
        "budget_burst",
        "kill_prefill",
        "fill_ssd",
    ] {
        assert!(kinds.contains(&k), "{k} in {kinds:?}");
    }
    // Requests split (the default policy sends prompts to the prefill worker), and the prefill worker was killed
    // while it held a transfer.
    assert!(s["by_route"]["split"].as_u64() > Some(100), "{}", s["by_route"]);
    let notes: Vec<&str> =
        s["fault_notes"].as_array().expect("notes").iter().filter_map(Value::as_str).collect();
    assert!(notes.iter().any(|n| n.starts_with("kill_prefill") && n.contains("holding")), "{notes:?}");
    // The SSD directory was filled (this needs the right to mount a tmpfs, as root in CI; a run without it says
    // so in its notes instead).
    assert!(notes.iter().any(|n| n.contains("the tmpfs is full")), "{notes:?}");
    // Every tenant's charges were compared with its requests' usage.
    let charged: Vec<&Value> = s["charges"].as_array().expect("charges").iter().collect();
    assert!(charged.iter().filter(|r| r["exact_requests"].as_u64() > Some(100)).count() >= 3, "{charged:?}");
    assert!(s["requests"].as_u64() > Some(1000), "{stdout}");
    assert!(s["isolation_checked"].as_u64() >= Some(6), "{stdout}");
    // Every fault's recovery was measured, and the fleet came back within the run.
    for r in s["recoveries"].as_array().expect("recoveries") {
        assert!(r["recovered_after_s"].is_number(), "{r}");
    }
}
