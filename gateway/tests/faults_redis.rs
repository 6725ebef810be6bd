//! Redis as hostile ground, with a real `redis-server`: the chart's ACL (no default user, one user limited to the
//! gateway's prefix and to commands that are not @dangerous) is how replicas connect and keeps anonymous clients
//! out; what anyone who reaches Redis writes is checked before it is believed: a version no replica could have
//! written, or a value that fails validation, is replaced (admin writes keep working), a class bucket cannot be
//! inflated past its burst, and sends from a replica without a heartbeat, or past a message's caps, are dropped.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::redis::Redis;
use common::*;
use serde_json::json;

const TOKEN: &str = "admin-t0ken";
const PASSWORD: &str = "redis-pass-0123456789";

async fn admin(method: &str, url: &str, body: Option<serde_json::Value>, extra: &[(&str, &str)]) -> Resp {
    let auth = format!("Bearer {TOKEN}");
    let mut headers: Vec<(&str, &str)> = vec![("authorization", auth.as_str())];
    headers.extend_from_slice(extra);
    request(method, url, body.map(|b| b.to_string()), &headers).await
}

async fn redis_mode(control: &str) -> bool {
    let m = get(&format!("{control}/metrics")).await.body;
    metric(&m, "kvgate_gateway_shared_state_mode{mode=\"redis\"}") == Some(1.0)
}

async fn counter(control: &str, series: &str) -> f64 {
    metric(&get(&format!("{control}/metrics")).await.body, series).unwrap_or(0.0)
}

/// The chart's Redis: no default user, user `kvgate` with `PASSWORD`, keys and channels `kvgate:*`, no
/// @dangerous commands (helm/kvgate/templates/redis.yaml).
fn chart_redis() -> Redis {
    let pass = format!(">{PASSWORD}");
    Redis::start_with(
        free_port(),
        &[
            "--user",
            "default",
            "off",
            "--user",
            "kvgate",
            "on",
            &pass,
            "~kvgate:*",
            "&kvgate:*",
            "+@all",
            "-@dangerous",
        ],
    )
}

fn replica(redis: &Redis, id: &str, extra: &[&str]) -> (Proc, String) {
    let url = redis.url();
    let mut args = vec!["--admin-token", TOKEN, "--redis-url", url.as_str(), "--replica-id", id];
    args.extend_from_slice(extra);
    gateway_in(&args, tempfile::tempdir().expect("tmp"))
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_millis() as u64
}

#[tokio::test]
async fn replicas_reach_the_charts_acl_redis_with_its_user_and_nobody_else_does() {
    let redis = chart_redis();
    let auth = ["--redis-username", "kvgate", "--redis-password", PASSWORD];
    let (_a, ca) = replica(&redis, "a", &auth);
    let (_b, cb) = replica(&redis, "b", &auth);
    // Without the password a replica cannot use it (it runs on its own state, local mode).
    let (_c, cc) = replica(&redis, "c", &[]);
    for control in [&ca, &cb] {
        wait_until(Duration::from_secs(10), || async { redis_mode(control).await }).await;
    }
    let put = admin(
        "PUT",
        &format!("{ca}/admin/v1/weights"),
        Some(json!({"w_prefix": 2.5})),
        &[("if-match", "\"v1\"")],
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.body);
    wait_until(Duration::from_secs(2), || async {
        admin("GET", &format!("{cb}/admin/v1/weights"), None, &[]).await.json()["w_prefix"] == 2.5
    })
    .await;
    // Several sync passes later, the replica without the password still is not in redis mode.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!redis_mode(&cc).await, "a replica without the password is not in redis mode");
    // Anonymous clients and the user's own dangerous commands are refused by Redis itself.
    assert!(redis.cli(None, &["HGET", "kvgate:admin:weights", "value"]).contains("NOAUTH"));
    let user = Some(("kvgate", PASSWORD));
    assert!(redis.cli(user, &["HGET", "kvgate:admin:weights", "value"]).contains("w_prefix"));
    for refused in [&["FLUSHALL"][..], &["CONFIG", "GET", "*"], &["KEYS", "*"], &["GET", "other:key"]] {
        let out = redis.cli(user, refused);
        assert!(out.contains("NOPERM"), "{refused:?}: {out}");
    }
}

#[tokio::test]
async fn versions_and_values_no_replica_wrote_are_replaced_not_believed() {
    let redis = Redis::start(free_port());
    let (_a, ca) = replica(&redis, "a", &[]);
    wait_until(Duration::from_secs(10), || async { redis_mode(&ca).await }).await;
    let weights = format!("{ca}/admin/v1/weights");
    let put = admin("PUT", &weights, Some(json!({"w_prefix": 2.0})), &[("if-match", "\"v1\"")]).await;
    assert_eq!(put.status, 200, "{}", put.body);
    // A version of 2^63 (Lua's doubles would make v + 1 == v: every compare-and-set failing).
    redis.cli(None, &["HSET", "kvgate:admin:weights", "version", "9223372036854775807"]);
    let invalid = "kvgate_gateway_shared_state_invalid_total{resource=\"weights\",action=\"replaced\"}";
    let ignored = "kvgate_gateway_shared_state_invalid_total{resource=\"weights\",action=\"ignored\"}";
    wait_until(Duration::from_secs(5), || async { counter(&ca, invalid).await >= 1.0 }).await;
    let etag = admin("GET", &weights, None, &[]).await.header("etag");
    let put = admin("PUT", &weights, Some(json!({"w_prefix": 3.0})), &[("if-match", &etag)]).await;
    assert_eq!(put.status, 200, "admin writes still work: {}", put.body);
    let stored = redis.cli(None, &["HGET", "kvgate:admin:weights", "version"]);
    assert!(stored.trim().parse::<u64>().is_ok_and(|v| v < 1 << 52), "{stored}");
    // A value that is not JSON: corrupt, replaced by this replica's (only while it is still what was read).
    redis.cli(None, &["HSET", "kvgate:admin:weights", "version", "1000", "value", "\u{1}garbage"]);
    wait_until(Duration::from_secs(5), || async { counter(&ca, invalid).await >= 2.0 }).await;
    let value = redis.cli(None, &["HGET", "kvgate:admin:weights", "value"]);
    assert!(value.contains("\"w_prefix\":3.0"), "{value}");
    assert_eq!(redis.cli(None, &["HGET", "kvgate:admin:weights", "version"]).trim(), "1001");
    // A newer version with a JSON value that fails validation (say a newer replica's, during an upgrade): never
    // applied, not replaced either; a PUT's 412 names the stored ETag, with which the admin writes over it.
    redis.cli(None, &["HSET", "kvgate:admin:weights", "version", "2000", "value", "{\"w_prefix\": -7}"]);
    wait_until(Duration::from_secs(5), || async { counter(&ca, ignored).await >= 1.0 }).await;
    assert_eq!(admin("GET", &weights, None, &[]).await.json()["w_prefix"], 3.0);
    let etag = admin("GET", &weights, None, &[]).await.header("etag");
    let put = admin("PUT", &weights, Some(json!({"w_prefix": 4.0})), &[("if-match", &etag)]).await;
    assert_eq!(put.status, 412, "{}", put.body);
    assert!(put.json()["error"]["message"].as_str().is_some_and(|m| m.contains("\"v2000\"")), "{}", put.body);
    let put = admin("PUT", &weights, Some(json!({"w_prefix": 4.0})), &[("if-match", "\"v2000\"")]).await;
    assert_eq!(put.status, 200, "{}", put.body);
    assert_eq!(admin("GET", &weights, None, &[]).await.json()["w_prefix"], 4.0);
    // If-Match past the largest version is not an ETag of this API.
    let put =
        admin("PUT", &weights, Some(json!({"w_prefix": 4.0})), &[("if-match", "\"v9223372036854775807\"")])
            .await;
    assert_eq!(put.status, 412, "{}", put.body);
}

#[tokio::test]
async fn a_class_bucket_written_full_of_tokens_buys_at_most_one_burst() {
    let dir = tempfile::tempdir().expect("tmp");
    let redis = Redis::start(free_port());
    // 100 tokens of burst, next to no refill (1 token in 100 s): each request below costs 1 + 50 = 51.
    let cfg = dir.path().join("gateway.toml");
    std::fs::write(
        &cfg,
        "[[classes]]\nname = \"c\"\nrefill_tokens_per_s = 0.01\nburst_tokens = 100\nmax_wait_ms = 200\n",
    )
    .expect("config");
    let (g, control) = replica(&redis, "a", &["--config", cfg.to_str().expect("p")]);
    let _w = sim_worker("w", dir.path(), &control, 0.0);
    wait_healthy(&control, 1).await;
    wait_until(Duration::from_secs(10), || async { redis_mode(&control).await }).await;
    let url = format!("{}/v1/completions", g.base);
    let body = json!({"model": MODEL, "prompt": [7], "max_tokens": 50, "ignore_eos": true});
    let admitted = |n: usize| {
        let (url, body) = (url.clone(), body.clone());
        async move {
            let mut ok = 0;
            for _ in 0..n {
                if post(&url, &body, &[]).await.status == 200 {
                    ok += 1;
                }
            }
            ok
        }
    };
    // The burst buys one request (51 of 100; usage reconciles to 51, 49 left, less than the next one's 51).
    assert_eq!(admitted(3).await, 1);
    // Someone writes the shared bucket full of tokens, stamped in the future.
    let future = (now_ms() + 86_400_000).to_string();
    redis.cli(None, &["HSET", "kvgate:budget:c", "level", "1e300", "t", &future]);
    // It reads as a full bucket at most: one more burst, not an endless one.
    let after = admitted(6).await;
    assert!((1..=2).contains(&after), "{after} of 6 admitted after the write");
}

#[tokio::test]
async fn sends_from_a_replica_without_a_heartbeat_or_past_a_messages_caps_are_dropped() {
    let dir = tempfile::tempdir().expect("tmp");
    let redis = Redis::start(free_port());
    let w = worker("w", &dir.path().join("tiny"), None, &[]);
    let (_a, ca) = replica(&redis, "a", &["--worker", &w.base]);
    wait_until(Duration::from_secs(10), || async {
        redis_mode(&ca).await && worker_state(&ca, "w").await.is_some_and(|s| s["model"] == MODEL)
    })
    .await;
    let load = || async {
        worker_state(&ca, "w").await.expect("w")["load"]["pending_tokens"].as_u64().expect("load")
    };
    let message = |from: &str, points: usize| {
        let points: Vec<u64> = (1..=points as u64).collect();
        json!({"from": from, "nonce": 7, "sends": [{"worker": "w", "points": points,
            "uncached_tokens": 100_000, "session": null}]})
        .to_string()
    };
    let event = |e: &str| format!("kvgate_gateway_shared_sends_total{{event=\"{e}\"}}");
    redis.cli(None, &["PUBLISH", "kvgate:sends", &message("intruder", 2)]);
    wait_until(Duration::from_secs(5), || async { counter(&ca, &event("unknown_replica")).await == 1.0 })
        .await;
    assert_eq!(load().await, 0, "not applied");
    // With a heartbeat (which the chart's ACL lets only gateways write), it is a replica; over the message's point
    // cap (three sends of 4,096 points), it is not believed either.
    redis.cli(None, &["ZADD", "kvgate:replicas", &now_ms().to_string(), "intruder"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        // Until the replica's next sync has read the heartbeat.
        redis.cli(None, &["PUBLISH", "kvgate:sends", &message("intruder", 2)]);
        tokio::time::sleep(Duration::from_millis(100)).await;
        if load().await > 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "a send from a live replica was never applied");
    }
    assert!(counter(&ca, &event("applied")).await >= 1.0);
    let wide: Vec<u64> = (1..=4096).collect();
    let three = json!({"from": "intruder", "nonce": 7, "sends": [
        {"worker": "w", "points": wide, "uncached_tokens": 1, "session": null},
        {"worker": "w", "points": wide, "uncached_tokens": 1, "session": null},
        {"worker": "w", "points": wide, "uncached_tokens": 1, "session": null}]});
    redis.cli(None, &["PUBLISH", "kvgate:sends", &three.to_string()]);
    wait_until(Duration::from_secs(5), || async { counter(&ca, &event("invalid")).await >= 1.0 }).await;
}
