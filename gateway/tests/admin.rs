//! The admin REST API on a real gateway process: auth, validation, ETags, live effect, persistence, drain,
//! route/explain.

mod common;

use common::*;
use serde_json::json;

const TOKEN: &str = "admin-t0ken";

fn auth() -> (&'static str, String) {
    ("authorization", format!("Bearer {TOKEN}"))
}

async fn admin(method: &str, url: &str, body: Option<serde_json::Value>, extra: &[(&str, &str)]) -> Resp {
    let (k, v) = auth();
    let mut headers: Vec<(&str, &str)> = vec![(k, v.as_str())];
    headers.extend_from_slice(extra);
    request(method, url, body.map(|b| b.to_string()), &headers).await
}

#[tokio::test]
async fn admin_is_off_without_a_token_and_needs_the_right_one() {
    let (_g, control) = gateway(&[]);
    assert_eq!(get(&format!("{control}/admin/v1/weights")).await.status, 404);
    let (_g2, control2) = gateway(&["--admin-token", TOKEN]);
    let url = format!("{control2}/admin/v1/weights");
    assert_eq!(get(&url).await.status, 401);
    assert_eq!(request("GET", &url, None, &[("authorization", "Bearer nope")]).await.status, 401);
    let ok = admin("GET", &url, None, &[]).await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json()["w_prefix"], 1.0);
    assert_eq!(ok.header("etag"), "\"v1\"");
}

#[tokio::test]
async fn changes_are_validated_versioned_and_survive_a_restart() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state.json");
    let state_arg = state.to_str().expect("path").to_owned();
    let flags = ["--admin-token", TOKEN, "--state-file", state_arg.as_str()];
    let (mut g, control) = gateway(&flags);
    let wurl = format!("{control}/admin/v1/weights");
    // Every problem is listed.
    let bad = admin("PUT", &wurl, Some(json!({"w_prefix": -1.0, "hotspot_ratio": 0.1})), &[]).await;
    assert_eq!(bad.status, 400);
    let msg = bad.json()["error"]["message"].as_str().expect("msg").to_owned();
    assert!(msg.contains("w_prefix") && msg.contains("hotspot_ratio"), "{msg}");
    // A valid change with the right If-Match.
    let put =
        admin("PUT", &wurl, Some(json!({"w_prefix": 2.0, "w_ring": 0.1})), &[("if-match", "\"v1\"")]).await;
    assert_eq!(put.status, 200, "{}", put.body);
    assert_eq!(put.header("etag"), "\"v2\"");
    // Another operator still holding v1 is refused.
    let stale = admin("PUT", &wurl, Some(json!({"w_prefix": 3.0})), &[("if-match", "\"v1\"")]).await;
    assert_eq!(stale.status, 412);
    // Budgets: validation and a change.
    let burl = format!("{control}/admin/v1/budgets");
    let current = admin("GET", &burl, None, &[]).await.json();
    assert_eq!(current.as_array().map(Vec::len), Some(3));
    let dup = json!([{"name": "a", "refill_tokens_per_s": 1.0, "burst_tokens": 10.0},
                     {"name": "a", "refill_tokens_per_s": 0.0, "burst_tokens": 10.0}]);
    let bad = admin("PUT", &burl, Some(dup), &[]).await;
    assert_eq!(bad.status, 400);
    assert!(bad.body.contains("duplicate") && bad.body.contains("refill_tokens_per_s"), "{}", bad.body);
    let one = json!([{"name": "all", "refill_tokens_per_s": 5000.0, "burst_tokens": 20000.0}]);
    assert_eq!(admin("PUT", &burl, Some(one), &[]).await.status, 200);
    // Restart: the changes are back.
    g.kill();
    let (_g, control) = gateway(&flags);
    let w = admin("GET", &format!("{control}/admin/v1/weights"), None, &[]).await;
    assert_eq!(w.json()["w_prefix"], 2.0);
    assert_eq!(w.header("etag"), "\"v2\"");
    let b = admin("GET", &format!("{control}/admin/v1/budgets"), None, &[]).await.json();
    assert_eq!(b[0]["name"], "all");
}

#[tokio::test]
async fn by_default_changes_persist_under_the_data_dir_and_a_bad_file_is_set_aside() {
    // No --state-file: a new user's gateway with the admin API on keeps its changes.
    let data = tempfile::tempdir().expect("tmp");
    let root = data.path().to_owned();
    let (mut g, control) = gateway_in(&["--admin-token", TOKEN], data);
    let wurl = format!("{control}/admin/v1/weights");
    assert_eq!(admin("PUT", &wurl, Some(json!({"w_prefix": 2.5})), &[]).await.status, 200);
    assert!(root.join("gateway-state.json").exists());
    let data = g.data.take().expect("data dir");
    g.kill();
    let (mut g, control) = gateway_in(&["--admin-token", TOKEN], data);
    let w = admin("GET", &format!("{control}/admin/v1/weights"), None, &[]).await;
    assert_eq!((w.json()["w_prefix"].as_f64(), w.header("etag")), (Some(2.5), "\"v2\"".to_owned()));
    // A corrupt file: moved aside, the gateway starts from its configuration and keeps working.
    let data = g.data.take().expect("data dir");
    g.kill();
    std::fs::write(root.join("gateway-state.json"), "{\"weights\": ").expect("corrupt");
    let (_g, control) = gateway_in(&["--admin-token", TOKEN], data);
    let w = admin("GET", &format!("{control}/admin/v1/weights"), None, &[]).await;
    assert_eq!((w.json()["w_prefix"].as_f64(), w.header("etag")), (Some(1.0), "\"v1\"".to_owned()));
    let names: Vec<String> = std::fs::read_dir(&root)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().any(|n| n.starts_with("gateway-state.json.corrupt-")), "{names:?}");
    assert!(!names.contains(&"gateway-state.json".to_owned()), "{names:?}");
    // `--state-file off`: nothing is written.
    let off = tempfile::tempdir().expect("tmp");
    let off_root = off.path().to_owned();
    let (_g, control) = gateway_in(&["--admin-token", TOKEN, "--state-file", "off"], off);
    assert_eq!(
        admin("PUT", &format!("{control}/admin/v1/weights"), Some(json!({"w_prefix": 3.0})), &[])
            .await
            .status,
        200
    );
    assert_eq!(std::fs::read_dir(&off_root).expect("dir").count(), 0);
}

#[tokio::test]
async fn a_change_that_cannot_be_saved_is_not_applied() {
    let dir = tempfile::tempdir().expect("tmp");
    // A state file under a path whose "directory" is a file: every save fails.
    std::fs::write(dir.path().join("not-a-dir"), "").expect("write");
    let state = dir.path().join("not-a-dir").join("state.json");
    let (_g, control) = gateway(&["--admin-token", TOKEN, "--state-file", state.to_str().expect("path")]);
    let wurl = format!("{control}/admin/v1/weights");
    let put = admin("PUT", &wurl, Some(json!({"w_prefix": 5.0})), &[]).await;
    assert_eq!(put.status, 500, "{}", put.body);
    assert_eq!(put.json()["error"]["code"], "state_file");
    let now = admin("GET", &wurl, None, &[]).await;
    assert_eq!(now.json()["w_prefix"], 1.0, "persisted before applied: nothing changed");
    assert_eq!(now.header("etag"), "\"v1\"");
    let burl = format!("{control}/admin/v1/budgets");
    let one = json!([{"name": "all", "refill_tokens_per_s": 5000.0, "burst_tokens": 20000.0}]);
    assert_eq!(admin("PUT", &burl, Some(one), &[]).await.status, 500);
    assert_eq!(admin("GET", &burl, None, &[]).await.json().as_array().map(Vec::len), Some(3));
    assert!(!state.exists());
}

#[tokio::test]
async fn drain_and_explain() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let (g, control) = gateway(&["--admin-token", TOKEN]);
    let _w0 = worker("w0", &synth, Some(&control), &[]);
    let _w1 = worker("w1", &synth, Some(&control), &[]);
    wait_healthy(&control, 2).await;
    let body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "ka ri to ne sa lo mi du ve po"}]});
    let ex = admin(
        "POST",
        &format!("{control}/admin/v1/route/explain"),
        Some(body.clone()),
        &[("x-session-id", "s1")],
    )
    .await;
    assert_eq!(ex.status, 200, "{}", ex.body);
    let ej = ex.json();
    assert_eq!(ej["terms"].as_array().map(Vec::len), Some(2));
    assert!(ej["terms"][0]["score"].is_number() && ej["terms"][0]["ring"].is_number());
    // Matched blocks by tier (these workers report only their device pool: every figure is the device match).
    for t in ej["terms"].as_array().expect("terms") {
        let tiers = &t["tiers"];
        assert!(tiers["device"].is_u64() && tiers["through_host"] == tiers["device"], "{t}");
        assert_eq!(tiers["through_disk"], t["matched_blocks"], "{t}");
    }
    assert_eq!(ej["class"], "short");
    let pick = ej["pick"].as_str().expect("pick").to_owned();
    // Nothing was sent upstream by explain: no requests in flight or counted.
    // Drain the pick: traffic goes to the other one; undrain restores it.
    let other = if pick == "w0" { "w1" } else { "w0" };
    assert_eq!(
        admin("POST", &format!("{control}/admin/v1/workers/{pick}/drain"), None, &[]).await.status,
        200
    );
    let r = post(
        &format!("{}/v1/chat/completions", g.base),
        &json!({"model": MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": "ka ri to ne sa lo mi du ve po"}]}),
        &[("x-session-id", "s1")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvgate-worker"), other);
    assert_eq!(
        admin("POST", &format!("{control}/admin/v1/workers/{pick}/undrain"), None, &[]).await.status,
        200
    );
    let ex2 =
        admin("POST", &format!("{control}/admin/v1/route/explain"), Some(body), &[("x-session-id", "s1")])
            .await
            .json();
    assert!(ex2["terms"].as_array().expect("terms").iter().all(|t| t["healthy"] == true));
    assert_eq!(
        admin("POST", &format!("{control}/admin/v1/workers/nobody/drain"), None, &[]).await.status,
        404
    );
    let ws = admin("GET", &format!("{control}/admin/v1/workers"), None, &[]).await.json();
    assert_eq!(ws.as_array().map(Vec::len), Some(2));
}
