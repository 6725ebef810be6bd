//! One streamed OpenAI request and what it measured: TTFT, inter-token latencies, end-to-end time, token counts and
//! `cached_tokens` from the final `usage` chunk, the `x-kvgate-worker` / `x-kvgate-route` headers, status and error.
//! Plain HTTP/1.1 over hyper; the only addresses it talks to are the targets it is given.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_json::{json, Value};

use crate::ending::{prompt_key, Ending};

/// What one request measured (a row of `results.json`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Order in which requests were issued.
    pub id: u64,
    pub tag: String,
    pub user: Option<String>,
    /// Turn index within a session.
    pub turn: Option<usize>,
    /// Seconds after the run started.
    pub start_s: f64,
    /// Time to the first content chunk.
    pub ttft_ms: Option<f64>,
    /// Gaps between content chunks.
    pub itl_ms: Vec<f64>,
    pub e2e_ms: f64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub worker: Option<String>,
    pub route: Option<String>,
    /// HTTP status; 0 when no response came (connection error, timeout).
    pub status: u16,
    pub error: Option<String>,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none()
    }

    /// Mean time per output token after the first (None with fewer than two tokens).
    pub fn tpot_ms(&self) -> Option<f64> {
        let ttft = self.ttft_ms?;
        (self.completion_tokens > 1).then(|| (self.e2e_ms - ttft) / (self.completion_tokens - 1) as f64)
    }
}

/// What to send.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// `/v1/completions` with token ids.
    Tokens(Vec<u32>),
    /// `/v1/chat/completions` with these messages.
    Chat(Vec<Value>),
    /// `/v1/completions` with a text prompt.
    Text(String),
}

/// A token-id prompt as text: one word per id, the same word for the same id, so prompts that share a prefix of
/// ids share a prefix of text (for servers that refuse token-id prompts, and routers that match text).
pub fn ids_as_text(ids: &[u32]) -> String {
    const SYLLABLES: [&str; 16] =
        ["ka", "ri", "to", "ne", "sa", "lo", "mi", "du", "ve", "po", "ta", "ke", "ru", "mo", "ni", "zu"];
    let mut s = String::with_capacity(ids.len() * 7);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        let mut v = *id;
        loop {
            s.push_str(SYLLABLES[(v % 16) as usize]);
            v /= 16;
            if v == 0 {
                break;
            }
        }
    }
    s
}

/// A client of one OpenAI-compatible endpoint, or of several taken in turn (gateway replicas behind a
/// round-robin load balancer).
#[derive(Clone)]
pub struct Client {
    http: HyperClient<HttpConnector, Full<Bytes>>,
    base: String,
    /// Every endpoint (`base` is the first); requests go to them in turn.
    bases: Arc<Vec<String>>,
    turn: Arc<AtomicUsize>,
    pub model: String,
    timeout: Duration,
    /// How each request's generation ends (what the gateway is told of its length).
    ending: Ending,
}

impl Client {
    /// A client of `base` (e.g. `http://127.0.0.1:8080`; several comma-separated: requests go to them in turn);
    /// each request gives up after `timeout`.
    pub fn new(base: &str, model: &str, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let http = HyperClient::builder(TokioExecutor::new()).pool_max_idle_per_host(1024).build(connector);
        let bases: Vec<String> = base
            .split(',')
            .map(|b| b.trim().trim_end_matches('/').to_owned())
            .filter(|b| !b.is_empty())
            .collect();
        let first = bases.first().cloned().unwrap_or_default();
        Self {
            http,
            base: first,
            bases: Arc::new(bases),
            turn: Arc::new(AtomicUsize::new(0)),
            model: model.to_owned(),
            timeout,
            ending: Ending::Exact,
        }
    }

    /// The same client, its requests ending as `ending` says.
    pub fn with_ending(mut self, ending: Ending) -> Self {
        self.ending = ending;
        self
    }

    /// The endpoint of the next request.
    fn next_base(&self) -> &str {
        match self.bases.len() {
            0 | 1 => &self.base,
            n => &self.bases[self.turn.fetch_add(1, Ordering::Relaxed) % n],
        }
    }

    /// The first model `GET /v1/models` lists.
    pub async fn first_model(base: &str) -> Result<String, String> {
        let c = Self::new(base, "", Duration::from_secs(10));
        let url = format!("{}/v1/models", c.base);
        let req = hyper::Request::get(&url).body(Full::new(Bytes::new())).map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(c.timeout, c.http.request(req))
            .await
            .map_err(|_| format!("{url}: timed out"))?
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
        let v: Value = serde_json::from_slice(&body).map_err(|e| format!("{url}: {status}: {e}"))?;
        v["data"][0]["id"].as_str().map(str::to_owned).ok_or_else(|| format!("{url} lists no model: {v}"))
    }

    /// Sends one streamed request of `max_tokens` planned output tokens (sent as `max_tokens` under
    /// [`Ending::Exact`]; under [`Ending::Model`] the model ends it near there); returns its record (id, tag, user, turn and start_s left for the caller) and
    /// the answer's text.
    pub async fn send(
        &self,
        prompt: &Prompt,
        max_tokens: u32,
        user: Option<&str>,
    ) -> (RequestRecord, String) {
        let t0 = Instant::now();
        let mut rec = RequestRecord::default();
        let mut text = String::new();
        let result = tokio::time::timeout(
            self.timeout,
            self.exchange(prompt, max_tokens, user, t0, &mut rec, &mut text),
        )
        .await
        .unwrap_or_else(|_| Err(format!("no complete answer within {:?}", self.timeout)));
        if let Err(e) = result {
            rec.error = Some(e);
        }
        rec.e2e_ms = t0.elapsed().as_secs_f64() * 1000.0;
        (rec, text)
    }

    async fn exchange(
        &self,
        prompt: &Prompt,
        max_tokens: u32,
        user: Option<&str>,
        t0: Instant,
        rec: &mut RequestRecord,
        text: &mut String,
    ) -> Result<(), String> {
        let (path, mut body) = match prompt {
            Prompt::Tokens(ids) => ("/v1/completions", json!({"prompt": ids})),
            Prompt::Chat(messages) => ("/v1/chat/completions", json!({"messages": messages})),
            Prompt::Text(text) => ("/v1/completions", json!({"prompt": text})),
        };
        body["model"] = json!(self.model);
        let key = prompt_key(body.get("prompt").or(body.get("messages")).unwrap_or(&Value::Null));
        self.ending.apply(&mut body, key, max_tokens);
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        if let Some(u) = user {
            body["user"] = json!(u);
        }
        let url = format!("{}{path}", self.next_base());
        let req = hyper::Request::post(&url)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let resp = self.http.request(req).await.map_err(|e| format!("{url}: {e}"))?;
        rec.status = resp.status().as_u16();
        let header = |n: &str| resp.headers().get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
        rec.worker = header("x-kvgate-worker");
        rec.route = header("x-kvgate-route");
        let mut body = resp.into_body();
        if rec.status != 200 {
            let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let msg = v["error"]["message"].as_str().map(str::to_owned);
            return Err(msg.unwrap_or_else(|| String::from_utf8_lossy(&bytes).chars().take(300).collect()));
        }
        let mut buf: Vec<u8> = Vec::new();
        let mut last_token: Option<Instant> = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("stream broke: {e}"))?;
            let Some(data) = frame.data_ref() else { continue };
            buf.extend_from_slice(data);
            while let Some(end) = find_event_end(&buf) {
                let event: Vec<u8> = buf.drain(..end.1).take(end.0).collect();
                let event = String::from_utf8_lossy(&event);
                for line in event.lines() {
                    let Some(payload) = line.strip_prefix("data:").map(str::trim) else { continue };
                    if payload == "[DONE]" {
                        return Ok(());
                    }
                    let v: Value =
                        serde_json::from_str(payload).map_err(|e| format!("bad SSE chunk: {e}"))?;
                    if let Some(msg) = v["error"]["message"].as_str() {
                        return Err(msg.to_owned());
                    }
                    let choice = &v["choices"][0];
                    let piece = choice["text"].as_str().or_else(|| choice["delta"]["content"].as_str());
                    if let Some(p) = piece.filter(|p| !p.is_empty()) {
                        let now = Instant::now();
                        match last_token {
                            None => rec.ttft_ms = Some((now - t0).as_secs_f64() * 1000.0),
                            Some(prev) => rec.itl_ms.push((now - prev).as_secs_f64() * 1000.0),
                        }
                        last_token = Some(now);
                        text.push_str(p);
                    }
                    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                        rec.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                        rec.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
                        rec.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
                    }
                }
            }
        }
        Err("the stream ended without [DONE]".into())
    }
}

/// (length of the event, bytes to drain including the blank line) of the first complete SSE event in `buf`.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, i + 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, i + 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_on_blank_lines() {
        assert_eq!(find_event_end(b"data: 1\n\ndata: 2\n\n"), Some((7, 9)));
        assert_eq!(find_event_end(b"data: 1\r\n\r\n"), Some((7, 11)));
        assert_eq!(find_event_end(b"data: partial"), None);
    }

    #[test]
    fn ids_as_text_keeps_shared_prefixes_and_tells_ids_apart() {
        assert_eq!(ids_as_text(&[0, 1, 16, 255]), "ka ri kari zuzu");
        let a = ids_as_text(&[5, 6, 7, 8]);
        let b = ids_as_text(&[5, 6, 7, 9]);
        assert_eq!(a[..a.len() - 2], b[..b.len() - 2]);
        assert_ne!(a, b);
    }

    #[test]
    fn tpot_needs_two_tokens() {
        let r =
            RequestRecord { ttft_ms: Some(100.0), e2e_ms: 400.0, completion_tokens: 4, ..Default::default() };
        assert_eq!(r.tpot_ms(), Some(100.0));
        assert_eq!(RequestRecord { completion_tokens: 1, ..r.clone() }.tpot_ms(), None);
        assert!(!RequestRecord { status: 200, error: Some("x".into()), ..r }.ok());
    }
}
