//! Prefill/decode disaggregation through real worker processes on loopback: a decode worker fetches a prompt's KV
//! from a prefill worker and decodes exactly like a worker that ran the request alone; only the blocks it lacks
//! travel; and every failure (a killed or stopped peer, a client that leaves, a refusal, forged frames) ends in an
//! error or a local recompute, never a hang, with both pools back at their baseline within the lease + 1 s.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use common::{get, metric, start_worker, start_worker_env, Worker};
use http_body_util::{BodyExt, Full};
use kvgate_shared::handoff::{sign_prefill_grant, GrantFor, PREFILL_GRANT_HEADER, PREFILL_PEER_HEADER};
use serde_json::{json, Value};

const SECRET: &str = "pd-test-secret";
const MODEL: &str = "kvgate-tiny";

fn prefill_worker(env: &[(&str, &str)]) -> Worker {
    prefill_worker_with(&[], env)
}

fn prefill_worker_with(extra: &[&str], env: &[(&str, &str)]) -> Worker {
    let mut flags = vec![
        "--role",
        "prefill",
        "--report-secret",
        SECRET,
        "--kv-transfer-port",
        "0",
        "--kv-transfer-lease",
        "1s",
        "--max-num-batched-tokens",
        "64",
    ];
    flags.extend_from_slice(extra);
    start_worker_env(&flags, env)
}

fn decode_worker(extra: &[&str]) -> Worker {
    let mut flags = vec!["--role", "decode", "--report-secret", SECRET, "--kv-transfer-lease", "1s"];
    flags.extend_from_slice(extra);
    start_worker(&flags)
}

fn prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 37 + 11 + salt * 101) % 500 + 1).collect()
}

fn body(prompt: &[u32], max_tokens: u32, stream: bool) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
           "stream": stream})
}

/// Sends `sig` to a worker process this test started.
#[allow(unsafe_code)]
fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) with a pid of a child this test owns; no memory is touched.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill {pid} {sig}");
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The gateway's grant for the worker on `port` (its default id) to fetch `body`'s prompt from `peer`.
fn grant_for(port: u16, peer: &str, body: &Value) -> String {
    let prompt: Vec<u32> = body["prompt"]
        .as_array()
        .map_or_else(Vec::new, |a| a.iter().filter_map(|t| t.as_u64()).map(|t| t as u32).collect());
    let decode = format!("worker-{port}");
    let nonce = now_ms() ^ (u64::from(port) << 48) ^ prompt.len() as u64;
    sign_prefill_grant(
        SECRET,
        now_ms(),
        nonce,
        &GrantFor { model: MODEL, peer, decode: &decode, prompt: &prompt },
    )
}

/// POSTs a completion to `w`, naming `peer` as its prefill worker (with a valid grant unless `grant` is given).
async fn post_pd(w: &Worker, peer: Option<&str>, grant: Option<&str>, body: &Value) -> common::Resp {
    let mut req = hyper::Request::builder()
        .method("POST")
        .uri(format!("{}/v1/completions", w.base))
        .header("content-type", "application/json");
    if let Some(peer) = peer {
        let g = grant.map_or_else(|| grant_for(w.port, peer, body), str::to_owned);
        req = req.header(PREFILL_PEER_HEADER, peer).header(PREFILL_GRANT_HEADER, g);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).expect("request");
    let resp = common::client().request(req).await.expect("response");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    common::Resp { status, headers, body: String::from_utf8_lossy(&bytes).into_owned() }
}

async fn metrics(w: &Worker) -> String {
    get(&format!("{}/metrics", w.base)).await.body
}

async fn m(w: &Worker, series: &str) -> f64 {
    metric(&metrics(w).await, series).unwrap_or(0.0)
}

/// Waits until `series` of `w` reads `want`; panics after `within`.
async fn wait_metric(w: &Worker, series: &str, want: f64, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let got = m(w, series).await;
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "{series}: {got}, want {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until every block of `w`'s pool is free again (cached or not); panics after `within`.
async fn pool_at_baseline(w: &Worker, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let t = metrics(w).await;
        let (free, total) = (
            metric(&t, "kvgate_worker_kv_blocks{state=\"free\"}"),
            metric(&t, "kvgate_worker_kv_blocks{state=\"total\"}"),
        );
        if free.is_some() && free == total {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{}: pool not back at baseline: free {free:?} of {total:?}",
            w.base
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn text_and_usage(r: &common::Resp) -> (String, Value) {
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    (j["choices"][0]["text"].as_str().expect("text").to_owned(), j["usage"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_logit_controls_is_served_whole_by_the_decode_worker() {
    // The prefill worker samples a split's first token from temperature, top-p, top-k and seed only: a request
    // with a logit bias (or penalties, or min-p) is computed where it arrived, and answers like a whole run.
    let (p, d, alone) = (prefill_worker(&[]), decode_worker(&[]), start_worker(&[]));
    let mut b = body(&prompt(100, 3), 4, false);
    b["logit_bias"] = json!({"42": 100});
    let want = text_and_usage(&post_pd(&alone, None, None, &b).await);
    let got = text_and_usage(&post_pd(&d, Some(&p.transfer), None, &b).await);
    assert_eq!(got, want);
    assert_eq!(
        m(&d, "kvgate_worker_kv_transfer_blocks_total{side=\"import\"}").await,
        0.0,
        "nothing imported"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_request_answers_like_a_whole_one_and_moves_only_missing_blocks() {
    let (p, d, alone) = (prefill_worker(&[]), decode_worker(&[]), start_worker(&[]));
    let pr = prompt(300, 0);
    let want = text_and_usage(&post_pd(&alone, None, None, &body(&pr, 12, false)).await);
    let got = text_and_usage(&post_pd(&d, Some(&p.transfer), None, &body(&pr, 12, false)).await);
    assert_eq!(got, want, "text and usage (cached_tokens 0) equal a whole run");
    assert_eq!(m(&d, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"ok\"}").await, 1.0);
    assert_eq!(
        m(&d, "kvgate_worker_kv_transfer_blocks_total{side=\"import\"}").await,
        19.0,
        "ceil(300 / 16)"
    );
    // The peer counts its export after writing Done: wait for it.
    wait_metric(
        &p,
        "kvgate_worker_kv_transfers_total{side=\"export\",outcome=\"ok\"}",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    // The role is in /v1/models and /metrics.
    let models = get(&format!("{}/v1/models", d.base)).await.json();
    assert_eq!(models["data"][0]["role"], "decode");
    assert_eq!(m(&p, "kvgate_worker_role{role=\"prefill\"}").await, 1.0);

    // A second turn: the decode worker holds the first 304 tokens (its import entered its cache, and its own
    // decode), so only the new blocks travel; the prefill worker serves its part from its cache too.
    let mut turn2 = pr.clone();
    turn2.extend(prompt(100, 7));
    let want2 = text_and_usage(&post_pd(&alone, None, None, &body(&turn2, 8, false)).await);
    let got2 = text_and_usage(&post_pd(&d, Some(&p.transfer), None, &body(&turn2, 8, false)).await);
    assert_eq!(got2.0, want2.0);
    assert_eq!(got2.1, want2.1, "cached_tokens as the prefill worker served them (288 of 400)");
    let moved = m(&d, "kvgate_worker_kv_transfer_blocks_total{side=\"import\"}").await - 19.0;
    assert_eq!(moved, 25.0 - 18.0, "blocks 18..25 only: the decode worker held 18 full blocks");
    // Streamed, the same tokens arrive as SSE.
    let s = post_pd(&d, Some(&p.transfer), None, &body(&prompt(200, 3), 6, true)).await;
    assert_eq!(s.status, 200);
    assert!(s.body.ends_with("data: [DONE]\n\n"), "{}", s.body);
    pool_at_baseline(&d, Duration::from_secs(2)).await;
    pool_at_baseline(&p, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_in_the_decode_workers_host_or_ssd_tier_is_not_moved() {
    let (p, alone) = (prefill_worker(&[]), start_worker(&[]));
    let d = decode_worker(&[
        "--kv-cache-tokens",
        "1024",
        "--host-kv-bytes",
        "4000000",
        "--kv-load-policy",
        "load",
    ]);
    let pr = prompt(400, 1);
    // The decode worker computes the prompt once, then three others push it out of its 64-block pool to host.
    post_pd(&d, None, None, &body(&pr, 4, false)).await;
    for k in 0..3 {
        post_pd(&d, None, None, &body(&prompt(600, 10 + k), 1, false)).await;
    }
    assert!(m(&d, "kvgate_worker_host_kv_stored_blocks").await >= 25.0);
    let mut next = pr.clone();
    next.extend(prompt(40, 9));
    let want = text_and_usage(&post_pd(&alone, None, None, &body(&next, 4, false)).await);
    let got = text_and_usage(&post_pd(&d, Some(&p.transfer), None, &body(&next, 4, false)).await);
    assert_eq!(got.0, want.0);
    let moved = m(&d, "kvgate_worker_kv_transfer_blocks_total{side=\"import\"}").await;
    assert_eq!(moved, 28.0 - 25.0, "the 25 full blocks of the first prompt come from the host tier");

    // The same with the prefix on the decode worker's SSD tier (no host tier).
    let ssd = tempfile::tempdir().expect("tmp");
    let path = ssd.path().display().to_string();
    let d = decode_worker(&[
        "--kv-cache-tokens",
        "1024",
        "--disk-kv-bytes",
        "8000000",
        "--disk-kv-path",
        &path,
        "--kv-load-policy",
        "load",
    ]);
    post_pd(&d, None, None, &body(&pr, 4, false)).await;
    for k in 0..3 {
        post_pd(&d, None, None, &body(&prompt(600, 10 + k), 1, false)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while m(&d, "kvgate_worker_disk_kv_written_blocks").await < 25.0 {
        assert!(Instant::now() < deadline, "the SSD tier did not get the evicted blocks");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let got = text_and_usage(&post_pd(&d, Some(&p.transfer), None, &body(&next, 4, false)).await);
    assert_eq!(got.0, want.0);
    let moved = m(&d, "kvgate_worker_kv_transfer_blocks_total{side=\"import\"}").await;
    assert_eq!(moved, 3.0, "the 25 full blocks of the first prompt come from the SSD tier");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_or_stopped_prefill_worker_ends_in_a_local_recompute() {
    let alone = start_worker(&[]);
    let pr = prompt(600, 2);
    let want = text_and_usage(&post_pd(&alone, None, None, &body(&pr, 6, false)).await).0;
    let pr2 = prompt(600, 3);
    let want2 = text_and_usage(&post_pd(&alone, None, None, &body(&pr2, 6, false)).await).0;
    let d = decode_worker(&[]);
    // SIGKILL mid-transfer: the prefill worker stalls after 8 blocks, and dies.
    let mut p = prefill_worker(&[("KVGATE_FAULT_EXPORT_PAUSE", "8:30000")]);
    let peer = p.transfer.clone();
    let started = Instant::now();
    let killer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let _ = p.child.kill();
        let _ = p.child.wait();
    });
    let got = text_and_usage(&post_pd(&d, Some(&peer), None, &body(&pr, 6, false)).await);
    assert_eq!(got.0, want, "computed here after the peer died");
    assert!(started.elapsed() < Duration::from_secs(3), "no hang: {:?}", started.elapsed());
    killer.await.expect("killer");
    assert_eq!(m(&d, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"fallback\"}").await, 1.0);
    // What arrived before the peer died (8 blocks, then the pause) is not computed again.
    assert_eq!(m(&d, "kvgate_worker_kv_import_kept_tokens_total").await, 8.0 * 16.0);
    assert_eq!(got.1["prompt_tokens_details"]["cached_tokens"], 8 * 16, "{}", got.1);
    pool_at_baseline(&d, Duration::from_secs(2)).await;

    // SIGSTOP: the decode worker gives up after the 1 s lease; the prefill worker, resumed, drops its export.
    let p = prefill_worker(&[("KVGATE_FAULT_EXPORT_PAUSE", "8:400")]);
    let pid = p.child.id() as i32;
    let (d2, peer) = (d.base.clone(), p.transfer.clone());
    let stopper = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        signal(pid, libc::SIGSTOP);
        tokio::time::sleep(Duration::from_millis(2500)).await;
        signal(pid, libc::SIGCONT);
    });
    let started = Instant::now();
    let got = text_and_usage(&post_pd(&d, Some(&peer), None, &body(&pr2, 6, false)).await);
    assert_eq!(got.0, want2, "a new prompt: the decode worker holds the first one since it computed it");
    assert!(started.elapsed() < Duration::from_secs(4), "gave up after the lease: {:?}", started.elapsed());
    assert_eq!(
        m(&d, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"fallback\"}").await,
        2.0,
        "{d2}"
    );
    stopper.await.expect("stopper");
    wait_metric(&p, "kvgate_worker_kv_transfer_leases", 0.0, Duration::from_secs(2)).await;
    pool_at_baseline(&p, Duration::from_secs(2)).await;
    pool_at_baseline(&d, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_whose_steps_outlast_the_stall_timeout_is_waited_for_while_it_moves() {
    let alone = start_worker(&[]);
    let pr = prompt(600, 11);
    let want = text_and_usage(&post_pd(&alone, None, None, &body(&pr, 6, false)).await).0;
    // Each 64-token step of the prefill takes over 256 ms (4 ms a token), past the decode worker's 100 ms stall
    // timeout: its first block leaves only after the first step. The prefill worker measured its cost at start
    // and announces each step with what it expects it to take. (Before Progress frames this fell back: stalled.)
    let p = prefill_worker_with(&["--kv-cache-tokens", "1024"], &[("KVGATE_FAULT_SLOW_FORWARD_US", "4000")]);
    let d = decode_worker(&["--kv-transfer-stall-timeout", "100ms"]);
    let got = text_and_usage(&post_pd(&d, Some(&p.transfer), None, &body(&pr, 6, false)).await);
    assert_eq!(got.0, want, "imported, and decoded like a whole run");
    let outcome = |o: &str| format!("kvgate_worker_kv_transfers_total{{side=\"import\",outcome=\"{o}\"}}");
    assert_eq!(m(&d, &outcome("ok")).await, 1.0, "{}", metrics(&d).await);
    assert_eq!(m(&d, &outcome("stalled")).await, 0.0);
    assert_eq!(m(&d, &outcome("fallback")).await, 0.0);
    pool_at_baseline(&p, Duration::from_secs(2)).await;
    pool_at_baseline(&d, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_that_renews_but_sends_no_kv_is_given_up_within_the_stall_timeout() {
    let alone = start_worker(&[]);
    let pr = prompt(300, 7);
    let want = text_and_usage(&post_pd(&alone, None, None, &body(&pr, 6, false)).await).0;
    // The export's KV goes unread for 30 s while its link keeps renewing the lease (a prefill queued or stuck).
    let p = prefill_worker(&[("KVGATE_FAULT_EXPORT_HOLD", "30000")]);
    let d = decode_worker(&["--kv-transfer-stall-timeout", "500ms"]);
    let started = Instant::now();
    let got = text_and_usage(&post_pd(&d, Some(&p.transfer), None, &body(&pr, 6, false)).await);
    let took = started.elapsed();
    assert_eq!(got.0, want, "computed here");
    assert!(took < Duration::from_secs(3), "renewals kept the import waiting: {took:?}");
    assert_eq!(m(&d, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"stalled\"}").await, 1.0);
    assert_eq!(m(&d, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"fallback\"}").await, 1.0);
    // The decode worker's Cancel ends the export.
    wait_metric(&p, "kvgate_worker_kv_transfer_leases", 0.0, Duration::from_secs(2)).await;
    pool_at_baseline(&p, Duration::from_secs(2)).await;
    pool_at_baseline(&d, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_waits_for_room_like_a_local_request() {
    let alone = start_worker(&[]);
    let (pr1, pr2) = (prompt(300, 8), prompt(300, 9));
    let want1 = text_and_usage(&post_pd(&alone, None, None, &body(&pr1, 6, false)).await).0;
    let want2 = text_and_usage(&post_pd(&alone, None, None, &body(&pr2, 6, false)).await).0;
    // Each export's KV leaves 800 ms late: the first import holds the decode worker's only sequence slot meanwhile.
    let p = prefill_worker(&[("KVGATE_FAULT_EXPORT_HOLD", "800")]);
    let d = decode_worker(&["--max-num-seqs", "1", "--kv-transfer-stall-timeout", "5s"]);
    let peer = p.transfer.clone();
    let (b1, b2) = (body(&pr1, 6, false), body(&pr2, 6, false));
    let first = post_pd(&d, Some(&peer), None, &b1);
    let second = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        post_pd(&d, Some(&peer), None, &b2).await
    };
    let (r1, r2) = tokio::join!(first, second);
    assert_eq!(text_and_usage(&r1).0, want1);
    assert_eq!(text_and_usage(&r2).0, want2, "the second import waited for the slot, not refused");
    assert_eq!(m(&d, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"ok\"}").await, 2.0);
    assert_eq!(m(&d, "kvgate_worker_kv_imports_waiting").await, 0.0);
    pool_at_baseline(&d, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_or_stopped_decode_worker_or_a_client_that_leaves_frees_the_export() {
    let p = prefill_worker(&[("KVGATE_FAULT_EXPORT_PAUSE", "8:800")]);
    let pr = prompt(600, 4);
    // SIGKILL the decode worker mid-transfer.
    let mut d = decode_worker(&[]);
    let (base, peer) = (d.base.clone(), p.transfer.clone());
    let body_s = body(&pr, 4, false).to_string();
    let sender = std::thread::spawn(move || raw_post(&base, &peer, &body_s, None));
    std::thread::sleep(Duration::from_millis(400));
    let _ = d.child.kill();
    let _ = d.child.wait();
    let _ = sender.join();
    pool_at_baseline(&p, Duration::from_secs(3)).await;
    // The export notices when it next touches the link (after its stall).
    wait_metric(
        &p,
        "kvgate_worker_kv_transfers_total{side=\"export\",outcome=\"peer_lost\"}",
        1.0,
        Duration::from_secs(2),
    )
    .await;
    wait_metric(&p, "kvgate_worker_kv_transfer_leases", 0.0, Duration::from_secs(2)).await;

    // The client leaves during the transfer: both legs are cancelled.
    let d = decode_worker(&[]);
    let (base, peer) = (d.base.clone(), p.transfer.clone());
    let body_s = body(&pr, 4, true).to_string();
    raw_post(&base, &peer, &body_s, Some(Duration::from_millis(300)));
    pool_at_baseline(&d, Duration::from_secs(2)).await;
    pool_at_baseline(&p, Duration::from_secs(2)).await;
    wait_metric(
        &d,
        "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"client_left\"}",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    wait_metric(&p, "kvgate_worker_kv_transfer_leases", 0.0, Duration::from_secs(2)).await;
    let t = metrics(&p).await;
    let cancelled = metric(&t, "kvgate_worker_kv_transfers_total{side=\"export\",outcome=\"cancelled\"}")
        .unwrap_or(0.0)
        + metric(&t, "kvgate_worker_kv_transfers_total{side=\"export\",outcome=\"peer_lost\"}")
            .unwrap_or(0.0);
    assert_eq!(cancelled, 2.0, "{t}");

    // SIGSTOP the decode worker: the prefill worker's lease lapses and it drops the export.
    let d = decode_worker(&[]);
    let pid = d.child.id() as i32;
    let (base, peer) = (d.base.clone(), p.transfer.clone());
    let body_s = body(&pr, 4, false).to_string();
    let sender = std::thread::spawn(move || raw_post(&base, &peer, &body_s, None));
    std::thread::sleep(Duration::from_millis(300));
    signal(pid, libc::SIGSTOP);
    wait_metric(&p, "kvgate_worker_kv_transfer_leases_expired_total", 1.0, Duration::from_secs(3)).await;
    wait_metric(&p, "kvgate_worker_kv_transfer_leases", 0.0, Duration::from_secs(1)).await;
    pool_at_baseline(&p, Duration::from_secs(1)).await;
    signal(pid, libc::SIGCONT);
    let _ = sender.join();
    pool_at_baseline(&d, Duration::from_secs(2)).await;
}

/// A blocking HTTP/1.1 POST naming `peer`, reading the whole answer, or closing after `leave_after`.
fn raw_post(base: &str, peer: &str, body: &str, leave_after: Option<Duration>) -> String {
    let addr = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    let port: u16 = addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    let grant = grant_for(port, peer, &serde_json::from_str(body).expect("json"));
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         {PREFILL_PEER_HEADER}: {peer}\r\n{PREFILL_GRANT_HEADER}: {grant}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    if let Some(after) = leave_after {
        std::thread::sleep(after);
        return String::new();
    }
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_forged_grants_and_forged_frames_are_errors_not_hangs() {
    let p = prefill_worker(&[]);
    let d = decode_worker(&["--kv-cache-tokens", "512"]);
    let pr = prompt(300, 5);
    // No grant, a grant for another peer: 401 before anything is allocated or dialled.
    let r = post_pd(&d, Some(&p.transfer), Some("v1.1.00"), &body(&pr, 4, false)).await;
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (401, Some("invalid_prefill_grant")));
    let other = grant_for(d.port, "127.0.0.1:1", &body(&pr, 4, false));
    let r = post_pd(&d, Some(&p.transfer), Some(&other), &body(&pr, 4, false)).await;
    assert_eq!(r.status, 401);
    // A grant made for another decode worker: 401 too.
    let elsewhere = grant_for(d.port.wrapping_add(1), &p.transfer, &body(&pr, 4, false));
    let r = post_pd(&d, Some(&p.transfer), Some(&elsewhere), &body(&pr, 4, false)).await;
    assert_eq!(r.status, 401, "{}", r.body);
    // The decode worker refuses before allocating (more KV than its pool holds): the prefill side never hears.
    let r = post_pd(&d, Some(&p.transfer), None, &body(&prompt(600, 6), 4, false)).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(m(&p, "kvgate_worker_kv_transfers_total{side=\"export\",outcome=\"ok\"}").await, 0.0);
    // A prefill worker imports nothing.
    let r = post_pd(&p, Some(&p.transfer), None, &body(&pr, 4, false)).await;
    assert_eq!(r.status, 400);

    // At the transfer listener nothing but the handshake is read before the dialer proves the key: an Open under
    // another key closes the link (no frame is read, no Refuse is owed); so does a 4 GiB frame header sent in its
    // place, read as a 48-byte Open.
    for open in [vec![7u8; 48], [0xffu8, 0xff, 0xff, 0xff, 4].repeat(10)[..48].to_vec()] {
        let mut s = std::net::TcpStream::connect(&p.transfer).expect("connect");
        let mut challenge = [0u8; 22];
        s.read_exact(&mut challenge).expect("a challenge");
        assert_eq!(&challenge[..4], b"KVG1");
        s.write_all(&open).expect("write");
        let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
        let mut buf = [0u8; 16];
        assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "closed");
    }
    wait_metric(
        &p,
        "kvgate_worker_kv_links_refused_total{reason=\"unauthorized\"}",
        2.0,
        Duration::from_secs(5),
    )
    .await;

    // A fake prefill worker that opens with something other than a Challenge, with a 1 GiB Blocks header, or with
    // a Challenge and then an Opened it cannot sign: the decode worker computes the prompt itself.
    let mut fake_opened = b"KVG1".to_vec();
    fake_opened.extend_from_slice(&2u16.to_le_bytes());
    fake_opened.extend_from_slice(&[1u8; 16 + 32]);
    for answer in [forged_accept(), vec![0, 0, 0, 0x40, 4], fake_opened] {
        let fake = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = fake.local_addr().expect("addr").to_string();
        let server = std::thread::spawn(move || {
            let (mut c, _) = fake.accept().expect("accept");
            let _ = c.write_all(&answer);
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            std::thread::sleep(Duration::from_millis(500));
        });
        let started = Instant::now();
        let got = post_pd(&d, Some(&addr), None, &body(&pr, 4, false)).await;
        assert_eq!(got.status, 200, "{}", got.body);
        assert!(started.elapsed() < Duration::from_secs(2));
        server.join().expect("fake");
    }
    assert_eq!(m(&d, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"fallback\"}").await, 3.0);
    pool_at_baseline(&d, Duration::from_secs(2)).await;
}

/// POSTs a link probe to `w`, naming `peer` (with a valid grant).
async fn post_probe(w: &Worker, peer: &str) -> common::Resp {
    let g =
        sign_prefill_grant(SECRET, now_ms(), 1, &GrantFor { model: MODEL, peer, decode: "", prompt: &[] });
    let req = hyper::Request::builder()
        .method("POST")
        .uri(format!("{}/kvgate/v1/kv-probe", w.base))
        .header(PREFILL_PEER_HEADER, peer)
        .header(PREFILL_GRANT_HEADER, g)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = common::client().request(req).await.expect("response");
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    common::Resp { status, headers, body: String::from_utf8_lossy(&bytes).into_owned() }
}

#[tokio::test]
async fn a_link_probe_is_timed_and_a_forged_one_is_refused() {
    let p = prefill_worker(&[]);
    let d = decode_worker(&[]);
    let r = post_probe(&d, &p.transfer).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["bytes"].as_u64().expect("bytes") > 0 && v["bytes_per_s"].as_f64().expect("rate") > 0.0, "{v}");
    wait_metric(
        &p,
        "kvgate_worker_kv_transfers_total{side=\"probe\",outcome=\"ok\"}",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    // The engine was not touched: the prefill worker's pool is where it was.
    pool_at_baseline(&p, Duration::from_secs(2)).await;
    // A prefill worker probes nothing; a dead peer is a 502.
    assert_eq!(post_probe(&p, &p.transfer).await.status, 400);
    let r = post_probe(&d, "127.0.0.1:1").await;
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (502, Some("probe_failed")), "{}", r.body);
    // A split's grant is not a probe's.
    let split_grant = grant_for(d.port, &p.transfer, &body(&prompt(40, 1), 1, false));
    let req = hyper::Request::builder()
        .method("POST")
        .uri(format!("{}/kvgate/v1/kv-probe", d.base))
        .header(PREFILL_PEER_HEADER, p.transfer.as_str())
        .header(PREFILL_GRANT_HEADER, split_grant)
        .body(Full::new(Bytes::new()))
        .expect("request");
    assert_eq!(common::client().request(req).await.expect("response").status().as_u16(), 401);
    // Probes are rate-limited at the listener: past the minute's budget one is refused (502 at the decode worker).
    let mut statuses = Vec::new();
    for _ in 0..6 {
        statuses.push(post_probe(&d, &p.transfer).await.status);
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        5,
        "{statuses:?}: 6 a minute, one was sent before"
    );
    assert_eq!(statuses.last(), Some(&502));
}

fn forged_accept() -> Vec<u8> {
    let mut frame = (1u32 + 8 + 32).to_le_bytes().to_vec();
    frame.push(2);
    frame.extend_from_slice(&[0u8; 8 + 32]);
    frame
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_serves_one_request_once() {
    let p = prefill_worker(&[]);
    let d = decode_worker(&[]);
    let pr = prompt(200, 11);
    let b = body(&pr, 4, false);
    let grant = grant_for(d.port, &p.transfer, &b);
    let first = post_pd(&d, Some(&p.transfer), Some(&grant), &b).await;
    let want = text_and_usage(&first).0;
    assert_eq!(m(&p, "kvgate_worker_kv_transfers_total{side=\"export\",outcome=\"ok\"}").await, 1.0);
    // The same grant again (a replay of the gateway's headers): the prefill worker refuses it; the decode worker
    // computes the prompt itself, and the answer is the same.
    let again = post_pd(&d, Some(&p.transfer), Some(&grant), &b).await;
    assert_eq!(text_and_usage(&again).0, want);
    wait_metric(
        &p,
        "kvgate_worker_kv_transfers_total{side=\"export\",outcome=\"refused\"}",
        1.0,
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(m(&p, "kvgate_worker_kv_transfers_total{side=\"export\",outcome=\"ok\"}").await, 1.0);
    // A grant made for another prompt: not a split (no transfer), the request computed here.
    let other = body(&prompt(200, 12), 4, false);
    let r = post_pd(&d, Some(&p.transfer), Some(&grant), &other).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(m(&d, "kvgate_worker_prefill_grants_total{result=\"other_prompt\"}").await, 1.0);
    assert_eq!(m(&p, "kvgate_worker_kv_transfers_total{side=\"export\",outcome=\"ok\"}").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transfer_listener_caps_links_per_peer_and_drops_idle_handshakes() {
    let p = prefill_worker(&[]);
    // 64 links that never answer the Challenge are held (for the handshake timeout); the 65th is closed at once.
    let mut held = Vec::new();
    for _ in 0..64 {
        let mut s = std::net::TcpStream::connect(&p.transfer).expect("connect");
        let mut challenge = [0u8; 22];
        s.read_exact(&mut challenge).expect("a challenge");
        held.push(s);
    }
    let mut extra = std::net::TcpStream::connect(&p.transfer).expect("connect");
    let _ = extra.set_read_timeout(Some(Duration::from_secs(2)));
    let mut buf = [0u8; 22];
    assert_eq!(extra.read(&mut buf).unwrap_or(0), 0, "closed without a challenge");
    wait_metric(&p, "kvgate_worker_kv_links_refused_total{reason=\"per_peer\"}", 1.0, Duration::from_secs(2))
        .await;
    // Within the handshake timeout (5 s) and a second the idle ones are dropped, and a transfer is served again.
    let started = Instant::now();
    for s in &mut held {
        let _ = s.set_read_timeout(Some(Duration::from_secs(8)));
        assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "an idle handshake is dropped");
    }
    assert!(started.elapsed() < Duration::from_secs(7), "{:?}", started.elapsed());
    wait_metric(
        &p,
        "kvgate_worker_kv_links_refused_total{reason=\"handshake\"}",
        64.0,
        Duration::from_secs(2),
    )
    .await;
    drop(held);
    let d = decode_worker(&[]);
    let pr = prompt(100, 13);
    text_and_usage(&post_pd(&d, Some(&p.transfer), None, &body(&pr, 2, false)).await);
    assert_eq!(m(&d, "kvgate_worker_kv_transfers_total{side=\"import\",outcome=\"ok\"}").await, 1.0);
}
