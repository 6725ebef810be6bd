//! The chaos run's clients: per tenant, conversations whose turns grow (so a worker's prefix cache matters), every
//! prompt opening with the tenant's own words (so a cache hit across tenants would show), sent alternately to the
//! gateway replicas with the tenant's key; some streams abandoned after their first chunk, some pass-through calls;
//! and the clients of two faults: slow readers, and a tenant's burst over its class budget. Each request ends as one
//! [`Outcome`], also when the connection fails or the client gives up.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvgate_shared::prompt::SplitMix64;
use serde_json::{json, Value};

use super::deploy::{tenant_key, BURST_CLASS};
use super::ledger::{Outcome, RequestKind, SharedSend};

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// What came back.
#[derive(Default)]
struct Answer {
    /// 0: no response (the connection failed).
    status: u16,
    code: Option<String>,
    ttft_s: Option<f64>,
    usage: Option<Value>,
    /// The gateway's `x-kvgate-worker`, `x-kvgate-route`, `x-kvgate-class` and `x-kvgate-prompt-tokens`.
    worker: Option<String>,
    route: Option<String>,
    class: Option<String>,
    priced_prompt: Option<u64>,
    /// No connection was made: the gateway never saw the request.
    unsent: bool,
}

impl Answer {
    fn failed(code: &str) -> Self {
        Self { code: Some(code.into()), ..Self::default() }
    }
}

/// What every client shares: where to send, the run's clock, the ledger.
#[derive(Clone)]
pub struct Drive {
    pub gateways: Arc<Vec<String>>,
    pub model: String,
    pub started: Instant,
    /// A client gives up on a request after this (it is recorded as `client_timeout`).
    pub give_up: Duration,
    pub ledger: Arc<Mutex<Vec<Outcome>>>,
    next_id: Arc<std::sync::atomic::AtomicU64>,
    http: Http,
}

/// How a request is read.
#[derive(Clone, Copy, PartialEq)]
enum Read {
    Whole,
    FirstChunk,
    Slowly,
}

impl Drive {
    pub fn new(gateways: Vec<String>, model: &str, give_up: Duration) -> Self {
        Self {
            gateways: Arc::new(gateways),
            model: model.into(),
            started: Instant::now(),
            give_up,
            ledger: Arc::new(Mutex::new(Vec::new())),
            next_id: Arc::new(std::sync::atomic::AtomicU64::new(1)),
            http: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(5))
                .build_http(),
        }
    }

    fn now_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// One request; its outcome goes to the ledger (and comes back, to be amended before it does: `first_shared`).
    async fn send(
        &self,
        tenant: usize,
        replica: usize,
        kind: RequestKind,
        path: &str,
        body: Value,
        class: Option<&str>,
    ) -> Outcome {
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let start_s = self.now_s();
        let read = match kind {
            RequestKind::Abandoned => Read::FirstChunk,
            RequestKind::Slow => Read::Slowly,
            _ => Read::Whole,
        };
        let limit = if read == Read::Slowly { self.give_up * 4 } else { self.give_up };
        let url = format!("{}{path}", self.gateways[replica]);
        let headers: Vec<(&str, String)> =
            class.map(|c| ("x-kvgate-class", c.to_owned())).into_iter().collect();
        let bound = Ask::of(&body, kind != RequestKind::PassThrough);
        let r = tokio::time::timeout(limit, self.exchange(&url, tenant, body, &headers, read, start_s)).await;
        self.record(id, (tenant, replica, kind, bound), start_s, r.ok(), SharedSend::No)
    }

    /// Records an outcome: `who` is (tenant, replica, kind, what it asked for).
    fn record(
        &self,
        id: u64,
        (tenant, replica, kind, ask): (usize, usize, RequestKind, Ask),
        start_s: f64,
        r: Option<Answer>,
        shared: SharedSend,
    ) -> Outcome {
        let a = r.unwrap_or_else(|| Answer::failed("client_timeout"));
        // A split's usage reports the prefill worker's cache hits (as a whole run there would), not the decode
        // worker's: a split repeat finds nothing once the busy prefill worker has evicted the document, though the
        // decode worker holds it. The control is a repeat the same worker computed whole.
        let whole = |route: &Option<String>| route.as_deref() != Some("split");
        let same_place = matches!(&shared, SharedSend::Repeat((w, r))
            if w.is_some() && *w == a.worker && whole(r) && whole(&a.route));
        let most_charged = ask.most_charged(&a);
        let usage = a.usage;
        let outcome = Outcome {
            id,
            tenant,
            replica,
            kind,
            start_s,
            end_s: self.now_s(),
            status: a.status,
            code: a.code,
            ttft_s: a.ttft_s,
            cached_tokens: usage.as_ref().and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64()),
            prompt_tokens: usage.as_ref().and_then(|u| u["prompt_tokens"].as_u64()),
            completion_tokens: usage.as_ref().and_then(|u| u["completion_tokens"].as_u64()),
            worker: a.worker,
            route: a.route,
            class: a.class,
            priced_prompt: a.priced_prompt,
            most_charged,
            first_shared: shared == SharedSend::First,
            repeat_shared: matches!(shared, SharedSend::Repeat(_)),
            same_place,
        };
        self.ledger.lock().unwrap_or_else(|e| e.into_inner()).push(outcome.clone());
        outcome
    }

    /// A shared document's send (`shared`: this tenant's first of it, or its repeat). Every tenant sends document
    /// `name` under one session id, so with nothing of it in the tenant's own cache the ring sends it to the worker
    /// that took the other tenants' sends of it: the isolation check meets their blocks.
    async fn send_shared(
        &self,
        tenant: usize,
        replica: usize,
        name: &str,
        body: Value,
        shared: SharedSend,
    ) -> Outcome {
        let headers = [("x-session-id", format!("chaos-shared-document-{name}"))];
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let start_s = self.now_s();
        let url = format!("{}/v1/chat/completions", self.gateways[replica]);
        let bound = Ask::of(&body, true);
        let r = tokio::time::timeout(
            self.give_up,
            self.exchange(&url, tenant, body, &headers, Read::Whole, start_s),
        )
        .await;
        self.record(id, (tenant, replica, RequestKind::Shared, bound), start_s, r.ok(), shared)
    }

    /// (status, error code, time to the first token, usage).
    async fn exchange(
        &self,
        url: &str,
        tenant: usize,
        body: Value,
        headers: &[(&str, String)],
        read: Read,
        start_s: f64,
    ) -> Answer {
        let mut req = hyper::Request::post(url)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {}", tenant_key(tenant)));
        for (name, value) in headers {
            req = req.header(*name, value);
        }
        let Ok(req) = req.body(Full::new(Bytes::from(body.to_string()))) else {
            return Answer::failed("client_error");
        };
        let resp = match self.http.request(req).await {
            Ok(r) => r,
            Err(e) => return Answer { unsent: e.is_connect(), ..Answer::failed("connection_failed") },
        };
        let status = resp.status().as_u16();
        let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let mut a = Answer {
            status,
            worker: header("x-kvgate-worker"),
            route: header("x-kvgate-route"),
            class: header("x-kvgate-class"),
            priced_prompt: header("x-kvgate-prompt-tokens").and_then(|v| v.parse().ok()),
            ..Answer::default()
        };
        let mut body = resp.into_body();
        let mut text = Vec::new();
        let mut ttft = None;
        loop {
            match body.frame().await {
                None => break,
                Some(Err(_)) => {
                    // The gateway cut the stream: what came so far says why, else it is an upstream failure.
                    break;
                }
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        if ttft.is_none() && d.windows(8).any(|w| w == b"\"delta\":") {
                            ttft = Some(self.now_s() - start_s);
                        }
                        text.extend_from_slice(&d);
                    }
                    match read {
                        Read::FirstChunk => return Answer { ttft_s: ttft, ..a },
                        Read::Slowly => tokio::time::sleep(Duration::from_secs(1)).await,
                        Read::Whole => {}
                    }
                }
            }
        }
        let (mut code, usage) = read_body(&text, status);
        // A stream that ended without its `[DONE]` and without an error event was cut (a replica or the connection
        // died under it).
        let stream = String::from_utf8_lossy(&text).contains("data: ");
        if code.is_none()
            && stream
            && (200..300).contains(&status)
            && !text.windows(12).any(|w| w == b"data: [DONE]")
        {
            code = Some("stream_cut".into());
        }
        a.code = code;
        a.ttft_s = ttft;
        a.usage = usage;
        a
    }
}

/// An answer's error code (a JSON error body, or an SSE error event) and its usage.
fn read_body(text: &[u8], status: u16) -> (Option<String>, Option<Value>) {
    let text = String::from_utf8_lossy(text);
    let mut code = None;
    let mut usage = None;
    let mut values: Vec<Value> = Vec::new();
    if let Ok(v) = serde_json::from_str::<Value>(&text) {
        values.push(v);
    } else {
        values.extend(
            text.split("\n\n")
                .filter_map(|e| e.trim().strip_prefix("data: "))
                .filter(|d| *d != "[DONE]")
                .filter_map(|d| serde_json::from_str(d).ok()),
        );
    }
    for v in values {
        if let Some(c) = v["error"]["code"].as_str() {
            code = Some(c.to_owned());
        }
        if v["usage"].is_object() {
            usage = Some(v["usage"].clone());
        }
    }
    if code.is_none() && !(200..300).contains(&status) {
        code = Some(format!("status_{status}"));
    }
    (code, usage)
}

/// What a request asked for, as far as its charge goes.
#[derive(Clone, Copy)]
struct Ask {
    body_bytes: u64,
    /// The output it may have (its `max_tokens`, or a generous 4096 when it names none; 0 for a pass-through call,
    /// which generates nothing).
    output: u64,
}

impl Ask {
    fn of(body: &Value, generates: bool) -> Self {
        let output = if generates { body["max_tokens"].as_u64().unwrap_or(4096) } else { 0 };
        Self { body_bytes: body.to_string().len() as u64, output }
    }

    /// The most the gateway may have charged it, from what the gateway told of it (`gateway/src/serve/charge.rs`'s
    /// rules): nothing when it never got the request, refused it at admission (`class_budget_exceeded`) or passed
    /// on a worker's error answer (a full refund); else the prompt it priced (`x-kvgate-prompt-tokens`) plus the
    /// output asked for; without the gateway's head (its own error answer, or none), the body's bytes bound the
    /// prompt's tokens (the chat template's few included).
    fn most_charged(&self, a: &Answer) -> u64 {
        let refused_at_admission = a.code.as_deref() == Some("class_budget_exceeded");
        let worker_error = a.worker.is_some() && !(200..300).contains(&a.status);
        if a.unsent || refused_at_admission || worker_error {
            return 0;
        }
        a.priced_prompt.unwrap_or(self.body_bytes).saturating_add(self.output)
    }
}

/// A tenant's conversation loop until `until` (seconds of the run): each turn adds to the conversation, one in
/// ten is abandoned after its first chunk, one in ten is a pass-through `/tokenize`; a conversation ends after a few
/// turns and a new one begins.
pub async fn tenant_loop(d: Drive, tenant: usize, slot: usize, seed: u64, until: f64) {
    let mut rng = SplitMix64::new(seed ^ ((tenant as u64) << 32) ^ slot as u64);
    let mut conversation = 0u64;
    let mut turn = 0;
    let mut messages: Vec<Value> = Vec::new();
    let mut n = 0usize;
    let mut shared_sent = std::collections::HashSet::new();
    while d.now_s() < until {
        if turn == 0 || turn > 4 + rng.below(4) as usize {
            conversation += 1;
            turn = 0;
            // The tenant's own words open every prompt: another tenant's cache can never hold them.
            let system = format!(
                "You are the assistant of tenant t{tenant}, conversation {slot}-{conversation}. {}",
                words(&mut rng, 120)
            );
            messages = vec![json!({"role": "system", "content": system})];
        }
        turn += 1;
        n += 1;
        let replica = n % d.gateways.len();
        if slot == 0 && n.is_multiple_of(SHARED_EVERY) {
            // A document every tenant sends word for word, new each epoch of the run (so the check runs before,
            // during and after every fault); this loop is the tenant's only sender of them, so its first send of
            // each finds nothing of its own cached. Then it sends it again at once: the positive control.
            let (epoch, k) = ((d.now_s() / SHARED_EPOCH_S) as u64, (n / SHARED_EVERY) % SHARED_DOCS);
            let name = format!("{k}.{epoch}");
            // Only the repeat right after the first send is a control: a later one (up to an epoch later) may find
            // its blocks evicted by a busy worker (the hour-long run's decode worker did, 4 times in 478).
            let mut place = (None, None);
            if shared_sent.insert((epoch, k)) {
                let doc = shared_doc(&d.model, &name);
                let first = d.send_shared(tenant, replica, &name, doc, SharedSend::First).await;
                if first.code.is_some() {
                    continue; // nothing of it may be cached: no control
                }
                place = (first.worker, first.route);
            }
            let doc = shared_doc(&d.model, &name);
            d.send_shared(tenant, replica, &name, doc, SharedSend::Repeat(place)).await;
            continue;
        }
        let roll = rng.below(10);
        if roll == 0 {
            let body = json!({"model": d.model, "prompt": words(&mut rng, 24)});
            d.send(tenant, replica, RequestKind::PassThrough, "/tokenize", body, None).await;
            continue;
        }
        messages.push(json!({"role": "user", "content": words(&mut rng, 30)}));
        let body = json!({"model": d.model, "messages": messages, "max_tokens": 8 + rng.below(24),
            "stream": true, "stream_options": {"include_usage": true}});
        let kind = if roll == 1 { RequestKind::Abandoned } else { RequestKind::Chat };
        d.send(tenant, replica, kind, "/v1/chat/completions", body, None).await;
        messages.push(json!({"role": "assistant", "content": words(&mut rng, 12)}));
    }
}

/// A slow reader: one stream read a chunk a second, again until `until`.
pub async fn slow_loop(d: Drive, tenant: usize, seed: u64, until: f64) {
    let mut rng = SplitMix64::new(seed ^ 0x736c_6f77);
    let mut n = 0;
    while d.now_s() < until {
        n += 1;
        let body = json!({"model": d.model, "messages": [{"role": "user", "content": words(&mut rng, 40)}],
            "max_tokens": 64, "stream": true, "stream_options": {"include_usage": true}});
        d.send(tenant, n % d.gateways.len(), RequestKind::Slow, "/v1/chat/completions", body, None).await;
    }
}

/// A tenant's burst over its class budget (`x-kvgate-class: burst`) until `until`.
pub async fn burst_loop(d: Drive, tenant: usize, seed: u64, until: f64) {
    let mut rng = SplitMix64::new(seed ^ 0x6275_7273);
    let mut n = 0;
    while d.now_s() < until {
        n += 1;
        let body = json!({"model": d.model, "messages": [{"role": "user", "content": words(&mut rng, 80)}],
            "max_tokens": 32});
        d.send(
            tenant,
            n % d.gateways.len(),
            RequestKind::Burst,
            "/v1/chat/completions",
            body,
            Some(BURST_CLASS),
        )
        .await;
    }
}

/// Shared documents per epoch.
const SHARED_DOCS: usize = 4;
/// Seconds of the run each set of shared documents is sent in (then a new set: every first send is a check). Short
/// enough that a tenant's first sends spread over the run rather than bunch at each epoch's start.
const SHARED_EPOCH_S: f64 = 10.0;
/// A tenant's slot-0 loop sends a shared document every this many turns.
const SHARED_EVERY: usize = 4;

/// Shared document `name` (`<k>.<epoch>`): the same words for every tenant, its first block its own (its name
/// opens it, right after the chat template's 8 tokens of the `tiny` model: within the first 16-token block).
fn shared_doc(model: &str, name: &str) -> Value {
    let seed = name.bytes().fold(0x646f_6373_u64, |h, b| h.wrapping_mul(0x100_0000_01b3) ^ u64::from(b));
    let mut rng = SplitMix64::new(seed);
    let text = format!("{name} document of the shared library: {}", words(&mut rng, 200));
    json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
        "stream": true, "stream_options": {"include_usage": true}})
}

/// `n` words from a small vocabulary.
fn words(rng: &mut SplitMix64, n: usize) -> String {
    const W: [&str; 16] = [
        "cache", "prefix", "token", "block", "worker", "gateway", "route", "budget", "tenant", "stream",
        "model", "layer", "tier", "decode", "prefill", "share",
    ];
    (0..n).map(|_| W[rng.below(W.len() as u64) as usize]).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_a_request_may_cost_is_what_the_gateway_told_of_it() {
        let body =
            json!({"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20});
        let ask = Ask::of(&body, true);
        let bytes = body.to_string().len() as u64;
        let head =
            Answer { status: 200, worker: Some("w0".into()), priced_prompt: Some(9), ..Answer::default() };
        assert_eq!(ask.most_charged(&head), 29, "its priced prompt and max_tokens");
        assert_eq!(Ask::of(&body, false).most_charged(&head), 9, "a pass-through call generates nothing");
        // No head from the gateway: its body's bytes bound the prompt.
        assert_eq!(ask.most_charged(&Answer::failed("upstream_timeout")), bytes + 20);
        assert_eq!(ask.most_charged(&Answer::failed("connection_failed")), bytes + 20);
        // Refunded or never seen: nothing.
        assert_eq!(ask.most_charged(&Answer { unsent: true, ..Answer::failed("connection_failed") }), 0);
        assert_eq!(ask.most_charged(&Answer { status: 429, ..Answer::failed("class_budget_exceeded") }), 0);
        assert_eq!(ask.most_charged(&Answer { status: 500, code: Some("x".into()), ..head }), 0);
    }

    #[test]
    fn an_answer_says_its_error_and_usage() {
        let sse = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"error\":{\"code\":\"upstream_error\"}}\n\n";
        assert_eq!(read_body(sse, 200).0.as_deref(), Some("upstream_error"));
        let done = b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\ndata: [DONE]\n\n";
        let (code, usage) = read_body(done, 200);
        assert_eq!(
            (code, usage.map(|u| u["prompt_tokens_details"]["cached_tokens"].clone())),
            (None, Some(json!(4)))
        );
        assert_eq!(
            read_body(br#"{"error":{"code":"class_budget_exceeded"}}"#, 429).0.as_deref(),
            Some("class_budget_exceeded")
        );
        assert_eq!(read_body(b"<html>", 502).0.as_deref(), Some("status_502"));
    }
}
