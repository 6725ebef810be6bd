//! Gateway replicas sharing their admin state through a real `redis-server` (started here on a free port in a
//! temporary directory, stopped at the end; `scripts/setup.sh` installs it): a change on one replica reaches the
//! others within a second, a stale `If-Match` on any replica is 412, losing Redis fails no request, and the state
//! outlives every gateway's restart and Redis's.

mod common;

use std::time::{Duration, Instant};

use common::redis::Redis;
use common::*;
use serde_json::json;

const TOKEN: &str = "admin-t0ken";

async fn admin(method: &str, url: &str, body: Option<serde_json::Value>, extra: &[(&str, &str)]) -> Resp {
    let auth = format!("Bearer {TOKEN}");
    let mut headers: Vec<(&str, &str)> = vec![("authorization", auth.as_str())];
    headers.extend_from_slice(extra);
    request(method, url, body.map(|b| b.to_string()), &headers).await
}

/// A replica with the admin API on, sharing `redis`, with its own data directory.
fn replica(redis: &str, id: &str, data: tempfile::TempDir) -> (Proc, String) {
    gateway_in(&["--admin-token", TOKEN, "--redis-url", redis, "--replica-id", id], data)
}

async fn mode(control: &str) -> (Option<f64>, Option<f64>) {
    let m = get(&format!("{control}/metrics")).await.body;
    (
        metric(&m, "kvgate_gateway_shared_state_mode{mode=\"redis\"}"),
        metric(&m, "kvgate_gateway_shared_state_mode{mode=\"local\"}"),
    )
}

/// Polls until the replica's weights show `w_prefix` at `etag` (panics after `within`).
async fn wait_weights(control: &str, w_prefix: f64, etag: &str, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let r = admin("GET", &format!("{control}/admin/v1/weights"), None, &[]).await;
        if r.json()["w_prefix"].as_f64() == Some(w_prefix) && r.header("etag") == etag {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < within, "{control} still shows {} {}", r.header("etag"), r.body);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn replicas_share_admin_changes_through_redis() {
    let redis = Redis::start(free_port());
    let mut replicas: Vec<(Proc, String)> = ["a", "b", "c"]
        .iter()
        .map(|id| replica(&redis.url(), id, tempfile::tempdir().expect("tmp")))
        .collect();
    for (_, control) in &replicas {
        wait_until(Duration::from_secs(10), || async { mode(control).await == (Some(1.0), Some(0.0)) }).await;
    }
    let (a, b, c) = (replicas[0].1.clone(), replicas[1].1.clone(), replicas[2].1.clone());
    // A change on A is visible on B and C within a second.
    let put = admin(
        "PUT",
        &format!("{a}/admin/v1/weights"),
        Some(json!({"w_prefix": 2.0, "w_ring": 0.1, "credit_host": 0.5})),
        &[("if-match", "\"v1\"")],
    )
    .await;
    assert_eq!((put.status, put.header("etag")), (200, "\"v2\"".to_owned()), "{}", put.body);
    for control in [&b, &c] {
        let took = wait_weights(control, 2.0, "\"v2\"", Duration::from_secs(1)).await;
        eprintln!("{control}: the change arrived after {took:?}");
        // The tier credits are part of the weights: they travel with them.
        let w = admin("GET", &format!("{control}/admin/v1/weights"), None, &[]).await.json();
        assert_eq!((w["credit_host"].as_f64(), w["credit_disk"].as_f64()), (Some(0.5), Some(0.3)), "{w}");
    }
    // C still holding v1 is refused, although C itself never saw a write.
    let stale = admin(
        "PUT",
        &format!("{c}/admin/v1/weights"),
        Some(json!({"w_prefix": 3.0})),
        &[("if-match", "\"v1\"")],
    )
    .await;
    assert_eq!(stale.status, 412, "{}", stale.body);
    assert!(stale.body.contains("\\\"v2\\\""), "names the current version: {}", stale.body);
    // Budgets travel the same way.
    let one = json!([{"name": "all", "refill_tokens_per_s": 5000.0, "burst_tokens": 20000.0}]);
    let put = admin("PUT", &format!("{b}/admin/v1/budgets"), Some(one), &[]).await;
    assert_eq!(put.status, 200, "{}", put.body);
    for control in [&a, &c] {
        wait_until(Duration::from_secs(1), || async {
            admin("GET", &format!("{control}/admin/v1/budgets"), None, &[]).await.json()[0]["name"] == "all"
        })
        .await;
    }
    // A drain on A drains the worker on every replica (the worker reports to all three).
    let dir = tempfile::tempdir().expect("tmp");
    let all = [a.clone(), b.clone(), c.clone()].join(",");
    let _w = worker("w0", &dir.path().join("tiny"), Some(&all), &[]);
    for control in [&a, &b, &c] {
        wait_healthy(control, 1).await;
    }
    let d = admin("POST", &format!("{a}/admin/v1/workers/w0/drain"), None, &[]).await;
    assert_eq!(d.status, 200, "{}", d.body);
    for control in [&b, &c] {
        wait_until(Duration::from_secs(1), || async {
            let ws = admin("GET", &format!("{control}/admin/v1/workers"), None, &[]).await.json();
            ws.as_array().is_some_and(|a| a.iter().any(|w| w["id"] == "w0" && w["draining"] == true))
        })
        .await;
    }
    // Restart every gateway (new data directories: nothing local survives): the state comes from Redis.
    for (p, _) in &mut replicas {
        p.kill();
    }
    let (_a2, a2) = replica(&redis.url(), "a", tempfile::tempdir().expect("tmp"));
    wait_weights(&a2, 2.0, "\"v2\"", Duration::from_secs(5)).await;
    // One sync pass reads the resources one after another: the budgets may arrive a moment after the weights.
    wait_until(Duration::from_secs(5), || async {
        let b = admin("GET", &format!("{a2}/admin/v1/budgets"), None, &[]).await;
        b.json()[0]["name"] == "all" && b.header("etag") == "\"v2\""
    })
    .await;
}

#[tokio::test]
async fn losing_redis_fails_no_request_and_the_state_comes_back() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let redis_port = free_port();
    let mut redis = Redis::start(redis_port);
    let url = redis.url();
    let (_a, a) = replica(&url, "a", tempfile::tempdir().expect("tmp"));
    let (_b, b) = replica(&url, "b", tempfile::tempdir().expect("tmp"));
    let _w = worker("w0", &synth, Some(&format!("{a},{b}")), &[]);
    for control in [&a, &b] {
        wait_healthy(control, 1).await;
        wait_until(Duration::from_secs(10), || async { mode(control).await == (Some(1.0), Some(0.0)) }).await;
    }
    let public = format!("http://127.0.0.1:{}", _a.port);
    let put = admin("PUT", &format!("{a}/admin/v1/weights"), Some(json!({"w_prefix": 2.0})), &[]).await;
    assert_eq!(put.status, 200, "{}", put.body);
    wait_weights(&b, 2.0, "\"v2\"", Duration::from_secs(1)).await;

    // Requests keep flowing while Redis goes away and comes back.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (stop, public) = (stop.clone(), public.clone());
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let body = json!({"model": "kvgate-tiny", "prompt": "hello redis", "max_tokens": 2});
                let r = post(&format!("{public}/v1/completions"), &body, &[]).await;
                if r.status == 200 {
                    ok += 1;
                } else {
                    failed.push(format!("{} {}", r.status, r.body));
                }
            }
            (ok, failed)
        })
    };
    drop(redis);
    for control in [&a, &b] {
        wait_until(Duration::from_secs(5), || async { mode(control).await == (Some(0.0), Some(1.0)) }).await;
    }
    // Writes cannot be made durable for the other replica: 503; reads serve the last state.
    let down = admin("PUT", &format!("{a}/admin/v1/weights"), Some(json!({"w_prefix": 4.0})), &[]).await;
    assert_eq!((down.status, down.json()["error"]["code"].clone()), (503, json!("shared_state_unavailable")));
    let last = admin("GET", &format!("{b}/admin/v1/weights"), None, &[]).await;
    assert_eq!((last.json()["w_prefix"].as_f64(), last.header("etag")), (Some(2.0), "\"v2\"".to_owned()));
    // Redis returns empty (no persistence): the replicas seed it with their state and go back to redis mode.
    redis = Redis::start(redis_port);
    for control in [&a, &b] {
        wait_until(Duration::from_secs(10), || async { mode(control).await == (Some(1.0), Some(0.0)) }).await;
    }
    let put = admin(
        "PUT",
        &format!("{b}/admin/v1/weights"),
        Some(json!({"w_prefix": 5.0})),
        &[("if-match", "\"v2\"")],
    )
    .await;
    assert_eq!((put.status, put.header("etag")), (200, "\"v3\"".to_owned()), "{}", put.body);
    wait_weights(&a, 5.0, "\"v3\"", Duration::from_secs(1)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = traffic.await.expect("traffic");
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        failed
    );
    assert!(ok > 5, "traffic ran ({ok} requests)");
    drop(redis);
}

/// One class for everything, 2,000 tokens/s with a 2,000-token burst, waiting up to 2 s.
const ONE_CLASS: &str = r#"
[[classes]]
name = "all"
refill_tokens_per_s = 2000
burst_tokens = 2000
max_wait_ms = 2000
"#;

#[tokio::test]
async fn three_replicas_admit_one_class_budget_between_them() {
    let dir = tempfile::tempdir().expect("tmp");
    let redis = Redis::start(free_port());
    let cfg = dir.path().join("gateway.toml");
    std::fs::write(&cfg, ONE_CLASS).expect("write");
    let replicas: Vec<(Proc, String)> = ["a", "b", "c"]
        .iter()
        .map(|id| {
            gateway_in(
                &["--redis-url", &redis.url(), "--replica-id", id, "--config", cfg.to_str().expect("p")],
                tempfile::tempdir().expect("tmp"),
            )
        })
        .collect();
    let controls: Vec<String> = replicas.iter().map(|(_, c)| c.clone()).collect();
    let profile = sim_profile(dir.path(), "instant", 0.0, 0.0);
    let _w = worker(
        "w",
        &dir.path().join("tiny"),
        Some(&controls.join(",")),
        &["--engine", "sim", "--sim-profile", profile.to_str().expect("p")],
    );
    for control in &controls {
        wait_healthy(control, 1).await;
        wait_until(Duration::from_secs(10), || async { mode(control).await == (Some(1.0), Some(0.0)) }).await;
    }
    // Saturate the class from every replica for 30 s: 4 clients per replica, each request ~200 uncached tokens.
    let run_for = Duration::from_secs(30);
    let started = Instant::now();
    let mut clients = Vec::new();
    for (r, (p, _)) in replicas.iter().enumerate() {
        for k in 0..4u32 {
            let url = format!("{}/v1/completions", p.base);
            clients.push(tokio::spawn(async move {
                let (mut ok, mut refused, mut i) = (0u32, 0u32, 0u32);
                let mut waited = 0u32;
                while started.elapsed() < run_for {
                    // Distinct prompts: nothing is cached, the cost is the whole prompt + max_tokens.
                    let seed = (r as u32) * 1_000_000 + k * 100_000 + i;
                    let prompt: Vec<u32> = (0..190).map(|j| (seed.wrapping_mul(31).wrapping_add(j * 7)) % 500).collect();
                    let body = json!({"model": "kvgate-tiny", "prompt": prompt, "max_tokens": 10, "ignore_eos": true});
                    let r = post(&url, &body, &[]).await;
                    match r.status {
                        200 => ok += 1,
                        429 => refused += 1,
                        s => panic!("unexpected status {s}: {}", r.body),
                    }
                    // Waited for budget: the class was the bottleneck, not the worker or the client.
                    if r.header("x-kvgate-admission-wait-ms").parse::<f64>().is_ok_and(|ms| ms > 10.0) {
                        waited += 1;
                    }
                    i += 1;
                }
                (ok, refused, waited)
            }));
        }
    }
    let (mut ok, mut refused, mut waited) = (0u32, 0u32, 0u32);
    for c in clients {
        let (o, r, w) = c.await.expect("client");
        ok += o;
        refused += r;
        waited += w;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut charged = 0.0;
    for control in &controls {
        let m = get(&format!("{control}/metrics")).await.body;
        charged += metric(&m, "kvgate_gateway_class_tokens_charged_total{class=\"all\"}").unwrap_or(0.0);
    }
    let budget = 2000.0 * elapsed + 2000.0;
    eprintln!(
        "{ok} admitted ({waited} after waiting for budget), {refused} refused over {elapsed:.1} s: {charged:.0} tokens charged across 3 replicas, budget \
         {budget:.0} ({:+.1}%)",
        (charged / budget - 1.0) * 100.0
    );
    assert!(waited + refused > ok / 2, "the class was saturated: most requests waited for budget");
    assert!(
        charged <= budget * 1.05 && charged >= budget * 0.90,
        "{charged:.0} tokens vs a budget of {budget:.0}"
    );
}

#[tokio::test]
async fn a_replica_routes_by_what_another_replica_sent() {
    // Two static workers that never report: the only thing a gateway knows of their caches is its overlay of what
    // was routed there. A and B share their sends; C has --share-sends false.
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let redis = Redis::start(free_port());
    let w0 = worker("w0", &synth, None, &[]);
    let w1 = worker("w1", &synth, None, &[]);
    let (workers, url) = (format!("{},{}", w0.base, w1.base), redis.url());
    let start = |id: &str, extra: &[&str]| {
        let mut args = vec!["--redis-url", url.as_str(), "--replica-id", id, "--worker", workers.as_str()];
        args.extend_from_slice(extra);
        gateway_in(&args, tempfile::tempdir().expect("tmp"))
    };
    let (a, ca) = start("a", &[]);
    let (b, cb) = start("b", &[]);
    let (c, cc) = start("c", &["--share-sends", "false"]);
    for control in [&ca, &cb, &cc] {
        wait_until(Duration::from_secs(10), || async {
            let ws = get(&format!("{control}/kvgate/v1/workers")).await.json();
            ws.as_array().is_some_and(|a| a.iter().filter(|w| w["model"] == MODEL).count() == 2)
        })
        .await;
        wait_until(Duration::from_secs(10), || async { mode(control).await == (Some(1.0), Some(0.0)) }).await;
    }
    // Each replica believes sends only from replicas whose heartbeats it has seen.
    for control in [&ca, &cb, &cc] {
        wait_until(Duration::from_secs(10), || async {
            let m = get(&format!("{control}/metrics")).await.body;
            metric(&m, "kvgate_gateway_shared_state_live_replicas") == Some(3.0)
        })
        .await;
    }
    let applied = |control: String| async move {
        let m = get(&format!("{control}/metrics")).await.body;
        metric(&m, "kvgate_gateway_shared_sends_total{event=\"applied\"}").unwrap_or(0.0)
    };
    let mut latest = Duration::ZERO;
    for k in 0..6u32 {
        // A conversation's first turn through A, its second through B and through C.
        let turn1: Vec<u32> = (0..200).map(|j| (k * 997 + j * 13) % 400 + 1).collect();
        let mut turn2 = turn1.clone();
        turn2.extend((0..40).map(|j| (k + j) % 50 + 1));
        let body = |p: &Vec<u32>| json!({"model": MODEL, "prompt": p, "max_tokens": 2});
        let first = post(&format!("{}/v1/completions", a.base), &body(&turn1), &[]).await;
        assert_eq!(first.status, 200, "{}", first.body);
        let sent_at = Instant::now();
        let want = f64::from(k + 1);
        wait_until(Duration::from_secs(1), || {
            let n = applied(cb.clone());
            async move { n.await >= want }
        })
        .await;
        latest = latest.max(sent_at.elapsed());
        let via_b = post(&format!("{}/v1/completions", b.base), &body(&turn2), &[]).await;
        assert_eq!(via_b.status, 200, "{}", via_b.body);
        assert_eq!(
            (via_b.header("x-kvgate-worker"), via_b.header("x-kvgate-route")),
            (first.header("x-kvgate-worker"), "prefix".to_owned()),
            "B knows where A sent turn 1"
        );
        let via_c = post(&format!("{}/v1/completions", c.base), &body(&turn2), &[]).await;
        assert_eq!(via_c.status, 200, "{}", via_c.body);
        assert_ne!(via_c.header("x-kvgate-route"), "prefix", "C does not share sends: it cannot know");
    }
    eprintln!("a send reached the other replica within {latest:?}");
    let m = get(&format!("{ca}/metrics")).await.body;
    assert!(
        metric(&m, "kvgate_gateway_shared_sends_total{event=\"published\"}").unwrap_or(0.0) >= 6.0,
        "{m}"
    );
    assert_eq!(applied(cc.clone()).await, 0.0, "C applies none");
}
