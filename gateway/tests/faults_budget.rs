//! Fault injection, budgets and identity: budget poisoning, class-header spoofing, tenant-name floods, and what a
//! caller's key grants (tenant, classes, forced cache salt; its `Authorization` header stays at the gateway), against
//! a real gateway and real workers on loopback.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::Request;
use common::*;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97)) % 500).collect()
}

fn wait_ms(r: &Resp) -> f64 {
    r.header("x-kvgate-admission-wait-ms").parse().unwrap_or(f64::NAN)
}

/// A gateway with `classes` (TOML) and the key file, and one instant simulated worker.
async fn setup(
    dir: &std::path::Path,
    classes: &str,
    keys_extra: &str,
    key_classes: &[&str],
) -> (Proc, String, Proc) {
    let cfg = dir.join("gateway.toml");
    std::fs::write(&cfg, classes).expect("write");
    let keys = keys_file(dir, key_classes, keys_extra);
    let (g, control) =
        gateway(&["--config", cfg.to_str().expect("p"), "--api-keys-file", keys.to_str().expect("p")]);
    let profile = sim_profile(dir, "instant", 0.0, 0.0);
    let w = worker(
        "w",
        &dir.join("tiny"),
        Some(&control),
        &["--engine", "sim", "--sim-profile", profile.to_str().expect("p")],
    );
    wait_healthy(&control, 1).await;
    (g, control, w)
}

const SHORT_AND_LONG: &str = r#"
[[classes]]
name = "short"
refill_tokens_per_s = 100
burst_tokens = 2000
max_wait_ms = 3000
[classes.match]
max_prompt_tokens = 64

[[classes]]
name = "long"
refill_tokens_per_s = 100
burst_tokens = 5000
max_wait_ms = 3000
"#;

#[tokio::test]
async fn budget_poisoning_is_refused_or_refunded_and_the_victim_is_admitted_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let (g, _control, _w) = setup(dir.path(), SHORT_AND_LONG, "", &[]).await;
    let url = format!("{}/v1/completions", g.base);
    // max_tokens = 2^32 - 1: refused by the gateway before anything is charged.
    for _ in 0..5 {
        let r =
            post(&url, &json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4_294_967_295u64}), &[])
                .await;
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    }
    // Requests the worker refuses (400) cost 1,503 tokens each at admission: refunded, or the second would wait.
    for _ in 0..5 {
        let bad = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1500, "temperature": -1});
        let r = post(&url, &bad, &[]).await;
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.header("x-kvgate-worker"), "w", "the worker refused it");
        assert!(
            wait_ms(&r) < 100.0,
            "admitted at once: the previous charge was refunded ({} ms)",
            wait_ms(&r)
        );
    }
    let t = Instant::now();
    let victim = post(&url, &json!({"model": MODEL, "prompt": ids(8, 1), "max_tokens": 2}), &[]).await;
    assert_eq!(victim.status, 200, "{}", victim.body);
    assert!(t.elapsed() < Duration::from_secs(1) && wait_ms(&victim) < 1000.0);
}

#[tokio::test]
async fn a_class_header_buys_nothing_without_a_key_that_allows_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let extra = "[[keys]]\nkey = \"short-only-key-0123456789\"\ntenant = \"s\"\nclasses = [\"short\"]\n";
    let (g, control, _w) = setup(dir.path(), SHORT_AND_LONG, extra, &["long"]).await;
    let url = format!("{}/v1/completions", g.base);
    // Without a key: a short request claiming `long` (to drain it), a long one claiming `short` (to skip its own
    // budget): both 403, nothing charged.
    for i in 0..20 {
        let r = post(
            &url,
            &json!({"model": MODEL, "prompt": ids(8, i), "max_tokens": 1000}),
            &[("x-kvgate-class", "long")],
        )
        .await;
        assert_eq!(r.status, 403, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "class_not_allowed");
        assert_eq!(r.json()["error"]["type"], "permission_error");
    }
    let r = post(
        &url,
        &json!({"model": MODEL, "prompt": ids(200, 3), "max_tokens": 2}),
        &[("x-kvgate-class", "short")],
    )
    .await;
    assert_eq!(r.status, 403);
    // A key allowed `short` cannot pick `long`, can pick `short`.
    let short_key = [("authorization", "Bearer short-only-key-0123456789")];
    let r = post(
        &url,
        &json!({"model": MODEL, "prompt": ids(8, 4), "max_tokens": 2}),
        &[short_key[0], ("x-kvgate-class", "long")],
    )
    .await;
    assert_eq!(r.status, 403);
    let r = post(
        &url,
        &json!({"model": MODEL, "prompt": ids(8, 5), "max_tokens": 2}),
        &[short_key[0], ("x-kvgate-class", "short")],
    )
    .await;
    assert_eq!((r.status, r.header("x-kvgate-class")), (200, "short".into()));
    // The victim of `long` is admitted at once.
    let t = Instant::now();
    let victim = post(&url, &json!({"model": MODEL, "prompt": ids(200, 6), "max_tokens": 2}), &[]).await;
    assert_eq!((victim.status, victim.header("x-kvgate-class")), (200, "long".into()), "{}", victim.body);
    assert!(t.elapsed() < Duration::from_secs(1) && wait_ms(&victim) < 1000.0);
    let m = get(&format!("{control}/metrics")).await.body;
    assert!(!m.contains("kvgate_gateway_class_queued_total{class=\"long\"}"), "nothing ever waited in long");
}

#[tokio::test]
async fn a_flood_of_tenant_names_opens_no_queues_and_a_keyed_tenant_gets_its_turn() {
    let dir = tempfile::tempdir().expect("tmp");
    let classes = r#"
[[classes]]
name = "short"
refill_tokens_per_s = 500
burst_tokens = 200
max_wait_ms = 10000
max_queued_requests = 2000
max_queued_tokens = 1000000000
"#;
    let extra = "[[keys]]\nkey = \"victim-key-0123456789\"\ntenant = \"victim\"\n";
    let (g, control, _w) = setup(dir.path(), classes, extra, &[]).await;
    let url = format!("{}/v1/completions", g.base);
    // 300 anonymous requests of ~108 tokens (65 s of budget), each naming its own tenant.
    let flood: Vec<_> = (0..300u32)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let body = json!({"model": MODEL, "prompt": ids(8, 1000 + i), "max_tokens": 100});
                post(&url, &body, &[("x-kvgate-tenant", &format!("tenant-{i}"))]).await.status
            })
        })
        .collect();
    // Until the flood waits in the class queue.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = get(&format!("{control}/metrics")).await.body;
        if metric(&m, "kvgate_gateway_class_queued_total{class=\"short\"}").unwrap_or(0.0) >= 250.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the flood never queued");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let t = Instant::now();
    let victim = post(
        &url,
        &json!({"model": MODEL, "prompt": ids(8, 7), "max_tokens": 2}),
        &[("authorization", "Bearer victim-key-0123456789")],
    )
    .await;
    let took = t.elapsed();
    assert_eq!(victim.status, 200, "{}", victim.body);
    eprintln!(
        "victim admitted after {took:?} behind 300 flooding requests ({} ms in the queue)",
        wait_ms(&victim)
    );
    assert!(took < Duration::from_secs(1), "{took:?}");
    let m = get(&format!("{control}/metrics")).await.body;
    assert!(!m.contains("kvgate_gateway_class_tenant_overflow_total"), "the header opened no queues");
    for f in flood {
        f.abort();
    }
}

/// A recording proxy in front of a real worker: what the gateway sends upstream, as the worker would see it.
async fn recorder(worker: String) -> (String, Arc<Mutex<Vec<(hyper::HeaderMap, Bytes)>>>) {
    let seen: Arc<Mutex<Vec<(hyper::HeaderMap, Bytes)>>> = Arc::default();
    let log = seen.clone();
    let app = axum::Router::new().fallback(move |req: Request| {
        let (worker, log) = (worker.clone(), log.clone());
        async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await.expect("body").to_bytes();
            if parts.method == hyper::Method::POST {
                log.lock().expect("log").push((parts.headers.clone(), body.clone()));
            }
            let mut up = hyper::Request::builder().method(parts.method).uri(format!("{worker}{}", parts.uri));
            for (k, v) in &parts.headers {
                up = up.header(k, v);
            }
            let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
            let resp = client.request(up.body(Full::new(body)).expect("req")).await.expect("worker");
            let (p, b) = resp.into_parts();
            let b = b.collect().await.expect("body").to_bytes();
            hyper::Response::from_parts(p, axum::body::Body::from(b))
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), seen)
}

#[tokio::test]
async fn a_keys_salt_is_forced_upstream_and_the_callers_authorization_stays_at_the_gateway() {
    let dir = tempfile::tempdir().expect("tmp");
    let w = worker("w", &dir.path().join("tiny"), None, &[]);
    let (rec, seen) = recorder(w.base.clone()).await;
    let keys = keys_file(
        dir.path(),
        &[],
        "[[keys]]\nkey = \"tenant-a-key-0123456789\"\ntenant = \"a\"\ncache_salt = \"salt-a\"\n",
    );
    let k = keys.to_str().expect("p");
    let (g, control) = gateway(&["--worker", &rec, "--api-keys-file", k]);
    wait_worker(&control, "w", Duration::from_secs(10), |s| s["healthy"] == true && s["model"] == MODEL)
        .await;
    let url = format!("{}/v1/completions", g.base);
    let prompt = ids(64, 9);
    let a = [("authorization", "Bearer tenant-a-key-0123456789")];
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": "i-choose-b"});
    assert_eq!(post(&url, &body, &a).await.status, 200);
    let again = post(&url, &body, &a).await;
    assert_eq!(
        again.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        48,
        "tenant a hits its own cache"
    );
    // Anonymous, no salt: the same prompt shares nothing with tenant a.
    let anon = post(
        &url,
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}),
        &[("x-kvgate-cache-salt", "hdr")],
    )
    .await;
    assert_eq!(anon.json()["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let token = format!("Bearer {}", kvgate_shared::handoff::gateway_token("test-secret"));
    {
        let seen = seen.lock().expect("log");
        assert_eq!(seen.len(), 3);
        for (headers, body) in seen.iter() {
            // A kvgate worker gets the gateway's token, never the client's key.
            let auth = headers.get("authorization").and_then(|v| v.to_str().ok());
            assert_eq!(auth, Some(token.as_str()), "{headers:?}");
            let _: Value = serde_json::from_slice(body).expect("json");
        }
        let forced: Value = serde_json::from_slice(&seen[0].1).expect("json");
        let want = kvgate_shared::handoff::tenant_salt(Some("test-secret"), "a", true, "salt-a");
        assert_eq!(
            forced["cache_salt"],
            want.as_str(),
            "the key's salt, as tenant a's, replaced the caller's"
        );
        assert_eq!(forced["prompt"], json!(prompt));
        assert!(seen[0].0.get("x-kvgate-cache-salt").is_none());
        assert_eq!(seen[2].0.get("x-kvgate-cache-salt").and_then(|v| v.to_str().ok()), Some("hdr"));
    }
    // With --forward-authorization the client's header goes to pods that are not kvgate workers.
    drop(g);
    let cfg = dir.path().join("openai-pool.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[models]]\nname = \"{MODEL}\"\ntokenizer = {:?}\nkind = \"openai\"\nworkers = [\"{rec}\"]\n",
            dir.path().join("tiny").display().to_string()
        ),
    )
    .expect("config");
    let c = cfg.to_str().expect("p");
    let (g2, control2) = gateway(&["--config", c, "--api-keys-file", k, "--forward-authorization"]);
    wait_until(Duration::from_secs(10), || async { get(&format!("{control2}/ready")).await.status == 200 })
        .await;
    let r = post(
        &format!("{}/v1/completions", g2.base),
        &json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 1}),
        &a,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let last = seen.lock().expect("log").last().cloned().expect("seen");
    assert_eq!(
        last.0.get("authorization").and_then(|v| v.to_str().ok()),
        Some("Bearer tenant-a-key-0123456789")
    );
    assert!(last.0.get(kvgate_shared::handoff::ASSERTION_HEADER).is_none(), "no assertion for other pods");
}

fn cached(r: &Resp) -> u64 {
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens")
}

#[tokio::test]
async fn a_tenants_forced_salt_cannot_be_named_by_any_other_caller() {
    let dir = tempfile::tempdir().expect("tmp");
    let keys = keys_file(
        dir.path(),
        &[],
        "[[keys]]\nkey = \"team-a-key-0123456789abc\"\ntenant = \"team-a\"\ncache_salt = \"team-a\"\n\
         [[keys]]\nkey = \"team-a-free-key-012345678\"\ntenant = \"team-a\"\n\
         [[keys]]\nkey = \"team-b-key-0123456789abc\"\ntenant = \"team-b\"\n",
    );
    let (g, control) = gateway(&["--api-keys-file", keys.to_str().expect("p")]);
    let w = worker("w", &dir.path().join("tiny"), Some(&control), &[]);
    wait_healthy(&control, 1).await;
    let url = format!("{}/v1/completions", g.base);
    // One prompt per try below, each cached by team-a first: a try that reached team-a's namespace would hit it
    // (anonymous body and header salts are one namespace, so they cannot share a prompt).
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| ids(400, 3 + i)).collect();
    let body = |i: usize, salt: Option<&str>| match salt {
        Some(s) => json!({"model": MODEL, "prompt": prompts[i], "max_tokens": 1, "cache_salt": s}),
        None => json!({"model": MODEL, "prompt": prompts[i], "max_tokens": 1}),
    };
    let team_a = [("authorization", "Bearer team-a-key-0123456789abc")];
    for i in 0..prompts.len() {
        assert_eq!(cached(&post(&url, &body(i, None), &team_a).await), 0);
        assert_eq!(
            cached(&post(&url, &body(i, Some("anything")), &team_a).await),
            384,
            "team-a hits its blocks"
        );
    }
    // Nobody else reaches them: anonymous callers naming the salt in the body or the header, another tenant
    // naming it, team-a's own key without the forced salt naming it, or a caller at the worker directly.
    let anon_header = [("x-kvgate-cache-salt", "team-a")];
    let team_b = [("authorization", "Bearer team-b-key-0123456789abc")];
    let team_a_free = [("authorization", "Bearer team-a-free-key-012345678")];
    let direct = format!("{}/v1/completions", w.base);
    let derived = kvgate_shared::handoff::tenant_salt(Some("test-secret"), "team-a", true, "team-a");
    let tries: [(&str, Resp); 6] = [
        ("anonymous body salt", post(&url, &body(0, Some("team-a")), &[]).await),
        ("anonymous header salt", post(&url, &body(1, None), &anon_header).await),
        ("another tenant", post(&url, &body(2, Some("team-a")), &team_b).await),
        ("the tenant's unforced key", post(&url, &body(3, Some("team-a")), &team_a_free).await),
        ("at the worker", post(&direct, &body(4, Some("team-a")), &[]).await),
        // Even the salt the pods are sent, sent by a client to the worker, is not team-a's namespace (the tenant
        // tag comes only with the gateway's assertion).
        ("the pods' salt at the worker", post(&direct, &body(5, Some(&derived)), &[]).await),
    ];
    for (who, r) in &tries {
        assert_eq!(cached(r), 0, "{who} reached team-a's blocks");
    }
    // Through the gateway, a salt of the tenant salts' form is refused outright (without a report secret their
    // derivation is public).
    let forged = post(&url, &body(0, Some(&derived)), &[]).await;
    assert_eq!(
        (forged.status, forged.json()["error"]["param"].as_str()),
        (400, Some("cache_salt")),
        "{}",
        forged.body
    );
    // Scoped client salts still work for their own tenant: team-b's salted prompt hits team-b's blocks.
    assert_eq!(cached(&post(&url, &body(2, Some("team-a")), &team_b).await), 384);
    // And unsalted requests keep sharing across callers (a shared system prompt).
    assert_eq!(
        cached(&post(&url, &json!({"model": MODEL, "prompt": ids(64, 5), "max_tokens": 1}), &[]).await),
        0
    );
    assert_eq!(
        cached(&post(&url, &json!({"model": MODEL, "prompt": ids(64, 5), "max_tokens": 1}), &team_b).await),
        48
    );
}

/// Streams `body` and reads `events` token events (chunks carrying text), then closes the connection; the status.
async fn stream_and_leave(url: &str, body: &Value, events: usize) -> u16 {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let resp = client.request(req).await.expect("response");
    let status = resp.status().as_u16();
    if status != 200 {
        return status;
    }
    let mut body = resp.into_body();
    let (mut seen, mut text) = (0, String::new());
    while seen < events {
        let Some(Ok(frame)) = body.frame().await else { panic!("the stream ended after {seen} events") };
        if let Ok(data) = frame.into_data() {
            text.push_str(&String::from_utf8_lossy(&data));
            while let Some(end) = text.find("\n\n") {
                let event: String = text.drain(..end + 2).collect();
                if event.contains("\"content\":\"") && !event.contains("\"content\":\"\"") {
                    seen += 1;
                }
            }
        }
    }
    status // `body` and the connection are dropped here: the client left.
}

#[tokio::test]
async fn leaving_a_stream_early_is_charged_what_was_computed_not_refunded() {
    // The attack: 2,000-token streams read for 50 tokens each, against a 400-token burst refilling 5 tokens/s. With
    // every early exit refunded in full, a stream was admitted every time the bucket refilled (6 of 12 in the
    // field); charged the prompt and the tokens sent, the bucket stays spent and only the first is admitted.
    let dir = tempfile::tempdir().expect("tmp");
    let classes =
        "[[classes]]\nname = \"metered\"\nrefill_tokens_per_s = 5\nburst_tokens = 400\nmax_wait_ms = 800\n";
    let cfg = dir.path().join("gateway.toml");
    std::fs::write(&cfg, classes).expect("write");
    let (g, control) = gateway(&["--config", cfg.to_str().expect("p")]);
    let _w = sim_worker("w", dir.path(), &control, 0.002);
    wait_healthy(&control, 1).await;
    let url = format!("{}/v1/chat/completions", g.base);
    let body = json!({"model": MODEL, "max_tokens": 2000, "stream": true, "ignore_eos": true,
        "messages": [{"role": "user", "content": "ka ri"}]});
    let mut statuses = Vec::new();
    for _ in 0..6 {
        statuses.push(stream_and_leave(&url, &body, 50).await);
    }
    assert_eq!(statuses[0], 200);
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 1, "{statuses:?}");
    assert!(statuses[1..].iter().all(|s| *s == 429), "{statuses:?}");
    // The charge is the prompt plus the tokens that went out before the gateway saw the client gone; nothing was
    // refunded in full.
    let m = get(&format!("{control}/metrics")).await.body;
    let charged = metric(&m, "kvgate_gateway_class_tokens_charged_total{class=\"metered\"}").unwrap_or(0.0);
    assert!((50.0..1000.0).contains(&charged), "charged {charged}: {m}");
    assert_eq!(metric(&m, "kvgate_gateway_class_refunds_total{class=\"metered\"}").unwrap_or(0.0), 0.0);
    assert_eq!(metric(&m, "kvgate_gateway_class_partial_charges_total{class=\"metered\"}"), Some(1.0));
    // The same tokens per tenant (no key: `anonymous`), and no permit left held once every request settled.
    let tenant = "kvgate_gateway_tenant_tokens_charged_total{class=\"metered\",tenant=\"anonymous\"}";
    assert_eq!(metric(&m, tenant), Some(charged), "{m}");
    assert_eq!(metric(&m, "kvgate_gateway_admission_permits_held{class=\"metered\"}"), Some(0.0), "{m}");
}
