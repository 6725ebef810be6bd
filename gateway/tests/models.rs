//! Models the gateway tokenizes itself (`[[models]]`), in front of real worker processes: a pool of pods that are
//! not kvgate workers (here `kvgate-worker` processes that never report, which to the gateway are plain OpenAI
//! servers) is routed by prefix with the configured tokenizer, and a kvgate worker whose block size differs from
//! its model's entry is refused instead of being routed with hashes that never match; a chat template that is not
//! the pods' is counted (`kvgate_gateway_prompt_token_mismatches_total`).

mod common;

use common::*;
use serde_json::json;

fn gateway_config(
    dir: &std::path::Path,
    tokenizer: &std::path::Path,
    kind: &str,
    block: u32,
    urls: &[&str],
) -> String {
    let path = dir.join("gateway.toml");
    let workers: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    std::fs::write(
        &path,
        format!(
            "[[models]]\nname = {MODEL:?}\ntokenizer = {:?}\nkind = {kind:?}\nblock-size = {block}\nworkers = [{}]\n",
            tokenizer.display().to_string(),
            workers.join(", ")
        ),
    )
    .expect("config");
    path.display().to_string()
}

#[tokio::test]
async fn a_pool_of_plain_openai_pods_is_routed_by_prefix_with_the_configured_tokenizer() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    // No --report-to: the gateway never hears from these workers except through their answers.
    let pods: Vec<Proc> = (0..2).map(|i| worker(&format!("p{i}"), &synth, None, &[])).collect();
    let urls: Vec<&str> = pods.iter().map(|p| p.base.as_str()).collect();
    let cfg = gateway_config(dir.path(), &synth, "openai", 16, &urls);
    let (g, _control) = gateway(&["--config", &cfg]);
    let shared = "the quick brown fox jumps over the lazy dog again and again ".repeat(12);
    let mut served = Vec::new();
    for turn in 0..4 {
        let body = json!({"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": format!("{shared} turn {turn}")}]});
        let r =
            post(&format!("{}/v1/chat/completions", g.base), &body, &[("x-session-id", &format!("s{turn}"))])
                .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        served.push((r.header("x-kvgate-worker"), r.header("x-kvgate-route"), cached));
    }
    let first = served[0].0.clone();
    assert!(served.iter().all(|s| s.0 == first), "one pod for one prefix: {served:?}");
    assert!(
        served[1..].iter().all(|s| s.1 == "prefix" && s.2 > 0),
        "routed by the prefix, served from its cache: {served:?}"
    );
}

#[tokio::test]
async fn a_kvgate_worker_whose_block_size_differs_from_its_models_entry_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let w = worker("w0", &synth, None, &[]);
    // The worker hashes blocks of 16 tokens; the entry says 8.
    let cfg = gateway_config(dir.path(), &synth, "kvgate", 8, &[&w.base]);
    let (g, control) = gateway(&["--config", &cfg]);
    let body = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]});
    // The gateway fetches the worker's tokenizer, refuses it and takes it out of its worker list.
    wait_until(std::time::Duration::from_secs(10), || async {
        let r = get(&format!("{control}/kvgate/v1/workers")).await;
        r.status == 200 && !r.body.contains(&w.base)
    })
    .await;
    let r = post(&format!("{}/v1/chat/completions", g.base), &body, &[]).await;
    assert_ne!(r.status, 200, "a refused worker is never routed to: {}", r.body);
    assert!(r.json()["error"]["message"].is_string(), "an OpenAI-style error: {}", r.body);
    // With the right block size the same worker serves.
    let cfg = gateway_config(dir.path(), &synth, "kvgate", 16, &[&w.base]);
    let (g2, _c2) = gateway(&["--config", &cfg]);
    let mut ok = false;
    for _ in 0..40 {
        if post(&format!("{}/v1/chat/completions", g2.base), &body, &[]).await.status == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    assert!(ok, "the same worker under a matching entry serves");
}

#[tokio::test]
async fn reports_of_a_worker_whose_scheme_differs_from_its_models_entry_are_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    // Write the model once (the gateway loads its tokenizer at start).
    drop(worker("warm", &synth, None, &[]));
    let cfg = gateway_config(dir.path(), &synth, "kvgate", 8, &[]);
    let (g, control) = gateway(&["--config", &cfg]);
    let _w = worker("w-reporting", &synth, Some(&control), &[]);
    wait_until(std::time::Duration::from_secs(10), || async {
        let m = get(&format!("{control}/metrics")).await.body;
        metric(&m, "kvgate_gateway_reports_total{result=\"model_mismatch\"}").unwrap_or(0.0) >= 2.0
    })
    .await;
    let workers = get(&format!("{control}/kvgate/v1/workers")).await.body;
    assert!(!workers.contains("w-reporting"), "never registered: {workers}");
    let body = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]});
    assert_ne!(post(&format!("{}/v1/chat/completions", g.base), &body, &[]).await.status, 200);
}

/// One plain pod behind a `[[models]]` entry of `kv_tokens`, the routing overlay forgotten after 100 ms: what is
/// left of a prefix's credit after the overlay is gone comes from the approximate index.
async fn routes_after_the_overlay_expires(kv_tokens: usize) -> Vec<String> {
    routes_around_a_refusal(kv_tokens, false).await
}

/// [`routes_after_the_overlay_expires`], with (`refused`) a long prompt the pod refuses between the two sends of
/// the same conversation.
async fn routes_around_a_refusal(kv_tokens: usize, refused: bool) -> Vec<String> {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let pod = worker("p0", &synth, None, &[]);
    let path = dir.path().join("gateway.toml");
    std::fs::write(
        &path,
        format!(
            "[[models]]\nname = {MODEL:?}\ntokenizer = {:?}\nkind = \"vllm\"\nkv-tokens = {kv_tokens}\nworkers = [{:?}]\n",
            synth.display().to_string(),
            pod.base
        ),
    )
    .expect("config");
    let (g, _control) = gateway(&["--config", &path.display().to_string(), "--overlay-ttl", "100ms"]);
    let a = "a long shared history of many words that fills a few blocks ".repeat(8);
    let b = "something else entirely with other words in it ".repeat(8);
    let mut routes = Vec::new();
    for text in [&a, &b, &a] {
        let body = json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]});
        let r = post(&format!("{}/v1/chat/completions", g.base), &body, &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        routes.push(r.header("x-kvgate-route"));
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        if refused && routes.len() == 1 {
            // A prompt of many more blocks than the index holds, which the pod refuses (a parameter out of its
            // range: the gateway passes it on to a pod that is not a kvgate worker).
            let long = "words the pod never computes because it refuses this request ".repeat(40);
            let body = json!({"model": MODEL, "max_tokens": 1, "top_p": 7.0,
                "messages": [{"role": "user", "content": long}]});
            let r = post(&format!("{}/v1/chat/completions", g.base), &body, &[]).await;
            assert_eq!(r.status, 400, "{}", r.body);
        }
    }
    routes
}

#[tokio::test]
async fn a_prompt_the_pod_refuses_is_not_credited_to_its_approximate_index() {
    // Room for a and b, not for the refused prompt: had it been credited at send, a would be gone.
    let routes = routes_around_a_refusal(512, true).await;
    assert_eq!(routes[2], "prefix", "{routes:?}");
}

#[tokio::test]
async fn a_plain_pods_prefix_is_remembered_by_the_approximate_index_up_to_its_capacity() {
    // Room for both prompts: the third request is credited with a's prefix although the overlay forgot it.
    let routes = routes_after_the_overlay_expires(65_536).await;
    assert_eq!(routes[2], "prefix", "{routes:?}");
    // Room for one block: b's blocks pushed a's out, as the pod's own LRU would have.
    let routes = routes_after_the_overlay_expires(16).await;
    assert_ne!(routes[2], "prefix", "{routes:?}");
    // Index off: only the overlay, which has forgotten.
    let routes = routes_after_the_overlay_expires(0).await;
    assert_ne!(routes[2], "prefix", "{routes:?}");
}

/// A stand-in for a vLLM pod (vLLM does not run here): answers chat completions with a canned reply and serves a
/// Prometheus page whose queue gauges say `waiting` requests, with its KV cache half used and 100 blocks of 16.
fn fake_vllm(py: &std::ffi::OsStr, waiting: u32) -> (std::process::Child, String) {
    let port = free_port();
    let script = format!(
        r#"
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
METRICS = ('# TYPE vllm:num_requests_waiting gauge\n'
           'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0\n'
           'vllm:num_requests_running{{engine="0",model_name="m"}} 1.0\n'
           'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.5\n'
           'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="100"}} 1.0\n').encode()
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, code, body, ctype):
        self.send_response(code); self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        if self.path == "/metrics": self.reply(200, METRICS, "text/plain; version=0.0.4")
        else: self.reply(200, b'{{"status":"ok"}}', "application/json")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = {{"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{{"index": 0, "message": {{"role": "assistant", "content": "ok"}}, "finish_reason": "stop"}}],
                "usage": {{"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}}}
        self.reply(200, json.dumps(body).encode(), "application/json")
ThreadingHTTPServer(("127.0.0.1", {port}), H).serve_forever()
"#
    );
    let child = std::process::Command::new(py).arg("-c").arg(script).spawn().expect("python pod");
    (child, format!("http://127.0.0.1:{port}"))
}

#[tokio::test]
async fn scraped_queues_steer_requests_away_from_a_busy_vllm_pod() {
    let Some(py) = common::python("a stand-in vLLM pod") else { return };
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    drop(worker("warm", &synth, None, &[])); // writes the model's tokenizer
    let (mut busy, busy_url) = fake_vllm(&py, 40);
    let (mut idle, idle_url) = fake_vllm(&py, 0);
    let scraped = sent_to(dir.path(), &synth, &busy_url, &idle_url, true).await;
    let blind = sent_to(dir.path(), &synth, &busy_url, &idle_url, false).await;
    let _ = (busy.kill(), idle.kill());
    let _ = (busy.wait(), idle.wait());
    assert_eq!(scraped, 12, "every new conversation goes to the pod whose metrics show no queue");
    assert!(blind < 12, "without the metrics the ring spreads them: {blind} of 12 to the idle pod");
}

/// Twelve new conversations through a gateway in front of `busy` and `idle` (scraping their metrics or not): how
/// many went to `idle`.
async fn sent_to(
    dir: &std::path::Path,
    synth: &std::path::Path,
    busy: &str,
    idle: &str,
    scrape: bool,
) -> usize {
    let path = dir.join(format!("gateway-{scrape}.toml"));
    // With the metrics, an approximate index of 64 tokens, which the pods' stated 1,600 replace.
    let kv_tokens = if scrape { 64 } else { 0 };
    let config = format!(
        "[[models]]\nname = {MODEL:?}\ntokenizer = {:?}\nkind = \"vllm\"\nkv-tokens = {kv_tokens}\n\
         scrape-metrics = {scrape}\nworkers = [{busy:?}, {idle:?}]\n",
        synth.display().to_string()
    );
    std::fs::write(&path, config).expect("config");
    let (g, control) = gateway(&["--config", &path.display().to_string()]);
    if scrape {
        // Both pods scraped at least once.
        wait_until(std::time::Duration::from_secs(10), || async {
            let m = get(&format!("{control}/metrics")).await.body;
            metric(&m, "kvgate_gateway_scrapes_total{result=\"ok\"}").unwrap_or(0.0) >= 2.0
        })
        .await;
        wait_until(std::time::Duration::from_secs(10), || async {
            let w = get(&format!("{control}/kvgate/v1/workers")).await.json();
            w.as_array()
                .is_some_and(|a| a.iter().all(|w| w["kv_usage"] == 0.5 && w["approx_blocks"][1] == 100))
        })
        .await;
    }
    let mut to_idle = 0;
    for i in 0..12 {
        let body = json!({"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": format!("question number {i} about something else")}]});
        let session = format!("s{i}");
        let r = post(&format!("{}/v1/chat/completions", g.base), &body, &[("x-session-id", &session)]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        if r.header("x-kvgate-worker") == idle {
            to_idle += 1;
        }
    }
    to_idle
}

#[tokio::test]
async fn a_pool_found_by_dns_is_routed_to() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let pod = worker("p0", &synth, None, &[]);
    let port = pod.base.rsplit(':').next().expect("port").to_owned();
    let path = dir.path().join("gateway.toml");
    // An address literal resolves to itself: the discovery path without a DNS server.
    std::fs::write(
        &path,
        format!(
            "[[models]]\nname = {MODEL:?}\ntokenizer = {:?}\nkind = \"openai\"\ndiscover = \"127.0.0.1:{port}\"\n",
            synth.display().to_string()
        ),
    )
    .expect("config");
    let (g, control) = gateway(&["--config", &path.display().to_string()]);
    wait_until(std::time::Duration::from_secs(10), || async {
        get(&format!("{control}/kvgate/v1/workers")).await.body.contains(&pod.base)
    })
    .await;
    let body =
        json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hello there"}]});
    let r = post(&format!("{}/v1/chat/completions", g.base), &body, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvgate-worker"), pod.base);
    let m = get(&format!("{control}/metrics")).await.body;
    assert!(metric(&m, "kvgate_gateway_discovery_total{result=\"ok\"}").unwrap_or(0.0) >= 1.0);
}

/// The body of a stream, read to its end.
async fn stream_text(url: &str, body: &serde_json::Value) -> (u16, String, String) {
    let r = post(url, body, &[]).await;
    (r.status, r.header("x-kvgate-worker"), r.body)
}

#[tokio::test]
async fn pods_that_do_not_report_are_held_to_their_context_and_charged_their_real_usage() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let profile = sim_profile(dir.path(), "instant", 0.0, 0.0);
    // Plain OpenAI pods to the gateway (they never report): an `openai` pool with a configured context length, and
    // a `vllm` pool whose context length comes from the pod's `/v1/models` (the sim profile's 8,192).
    let sim = ["--engine", "sim", "--sim-profile", profile.to_str().expect("p")];
    let pod_a = worker("pa", &synth, None, &sim);
    let sim_v = [&sim[..], &["--model-id", "kvgate-tiny-v"]].concat();
    let pod_v = worker("pv", &synth, None, &sim_v);
    let path = dir.path().join("gateway.toml");
    let tok = synth.display().to_string();
    std::fs::write(
        &path,
        format!(
            "[[classes]]\nname = \"all\"\nrefill_tokens_per_s = 1\nburst_tokens = 100000\nexpected_output_tokens = 256\n\n\
             [[models]]\nname = {MODEL:?}\ntokenizer = {tok:?}\nkind = \"openai\"\nmax-model-len = 256\nworkers = [{:?}]\n\n\
             [[models]]\nname = \"kvgate-tiny-v\"\ntokenizer = {tok:?}\nkind = \"vllm\"\nworkers = [{:?}]\n",
            pod_a.base, pod_v.base
        ),
    )
    .expect("config");
    let (g, control) = gateway(&["--config", &path.display().to_string()]);
    let url = format!("{}/v1/completions", g.base);
    let ids: Vec<u32> = (1..=20).collect();

    // Over the configured context: refused by the gateway, never sent (no worker header), nothing charged.
    let r = post(&url, &json!({"model": MODEL, "prompt": ids, "max_tokens": 300}), &[]).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (400, Some("context_length_exceeded")),
        "{}",
        r.body
    );
    assert_eq!(r.header("x-kvgate-worker"), "");
    // The vLLM pool's context length is read from its pod's model card.
    wait_until(std::time::Duration::from_secs(10), || async {
        let w = get(&format!("{control}/kvgate/v1/workers")).await.json();
        w.as_array().is_some_and(|a| a.iter().any(|w| w["url"] == pod_v.base && w["max_model_len"] == 8192))
    })
    .await;
    let over = json!({"model": "kvgate-tiny-v", "prompt": ids, "max_tokens": 9000});
    let r = post(&url, &over, &[]).await;
    assert_eq!((r.status, r.header("x-kvgate-worker")), (400, String::new()), "{}", r.body);

    // A stream without max_tokens or include_usage: the gateway asks the pod for usage, charges it (20 prompt +
    // completions' default 16 = 36, not the 256 estimate) and takes the usage chunk back out.
    let stream = json!({"model": MODEL, "prompt": ids, "stream": true, "ignore_eos": true});
    let (status, pod, text) = stream_text(&url, &stream).await;
    assert_eq!((status, pod.as_str()), (200, pod_a.base.as_str()), "{text}");
    assert!(!text.contains("usage"), "the client did not ask for usage: {text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // 16 tokens, in at most 16 events (the detokenizer holds back partial characters).
    let events = text.matches("\"text\":\"").count() - text.matches("\"text\":\"\"").count();
    assert!((1..=16).contains(&events), "{text}");
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(metric(&m, "kvgate_gateway_class_tokens_charged_total{class=\"all\"}"), Some(36.0), "{m}");
    // Asked for, the usage chunk reaches the client.
    let mut asked = stream.clone();
    asked["stream_options"] = json!({"include_usage": true});
    let (_, _, text) = stream_text(&url, &asked).await;
    assert_eq!(text.matches("\"usage\":{").count(), 1, "{text}");
}

/// The gateway's prompt length against the worker's `usage.prompt_tokens`: with the pods' own tokenizer directory
/// nothing is counted; with a chat template that is not theirs (a drift the operator would not see otherwise),
/// every answered chat is counted under its model.
#[tokio::test]
async fn a_chat_template_that_is_not_the_pods_is_counted_as_a_prompt_mismatch() {
    let dir = tempfile::tempdir().expect("tmp");
    let synth = dir.path().join("tiny");
    let pod = worker("p0", &synth, None, &[]);
    let drift = dir.path().join("drift");
    std::fs::create_dir(&drift).expect("mkdir");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(synth.join(f), drift.join(f)).expect("copy");
    }
    std::fs::write(
        drift.join("chat_template.jinja"),
        "A system note this pod's template does not have.\n{% for m in messages %}{{ m['role'] }} says: \
         {{ m['content'] }}\n{% endfor %}\
         {% if add_generation_prompt %}assistant says:{% endif %}",
    )
    .expect("template");
    for (name, tokenizer, want) in [("own", &synth, None), ("drift", &drift, Some(2.0))] {
        let sub = dir.path().join(format!("gateway-{name}"));
        std::fs::create_dir(&sub).expect("mkdir");
        let cfg = gateway_config(&sub, tokenizer, "openai", 16, &[pod.base.as_str()]);
        let (g, control) = gateway(&["--config", &cfg]);
        for turn in 0..2 {
            let body = json!({"model": MODEL, "max_tokens": 1,
                "messages": [{"role": "user", "content": format!("hello there, turn {turn}")}]});
            let r = post(&format!("{}/v1/chat/completions", g.base), &body, &[]).await;
            assert_eq!(r.status, 200, "{}", r.body);
        }
        // A request is settled (and its usage compared) just after its answer's last byte left: wait for it.
        let series = format!("kvgate_gateway_prompt_token_mismatches_total{{model=\"{MODEL}\"}}");
        let counted = || async { metric(&get(&format!("{control}/metrics")).await.body, &series) };
        if want.is_some() {
            wait_until(std::time::Duration::from_secs(5), || async { counted().await == want }).await;
        }
        assert_eq!(counted().await, want, "{name}");
    }
}
