//! One attempt to serve a request from one worker: send the buffered body, wait for the response header within the
//! request's first-byte timeout (watching for the client to go away meanwhile), then stream the response back chunk
//! by chunk with an idle timeout between chunks. A streamed response's headers come at once and its first chunk with
//! the first token, so the first chunk may take what is left of the first-byte budget (if that is longer than the
//! idle timeout): a request queued at a busy worker is not cut off as a silent stream.
//!
//! The outcome says what the caller may do next ([`Outcome`]): before any byte reached the client, a connection
//! failure, a connection the worker closed without answering, or a refusal (`queue_full`, `model_loading`,
//! `shutting_down`, `engine_stopped`, `aborted`, with its Retry-After) may be retried on the next-ranked worker; a first-byte timeout is a 504;
//! after the first byte an upstream failure or an idle stream becomes an SSE error event and the stream ends.
//! Dropping the upstream response (timeout, client gone) closes that connection, and the worker aborts the
//! request and frees its KV blocks.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{HeaderName, HeaderValue};
use pingora::http::ResponseHeader;
use pingora::proxy::Session;

use crate::errors::{ApiError, GatewayErrors};
use crate::routing::RouteReason;
use crate::serve::meter::Meter;
pub use crate::serve::meter::UsageSeen;
use crate::state::GatewayState;
use kvgate_shared::errors::Refusal;

/// Largest refusal body read to learn its code.
const REFUSAL_BODY_LIMIT: usize = 64 * 1024;
/// Longest wait for a refusal body after its header.
const REFUSAL_BODY_TIMEOUT: Duration = Duration::from_secs(2);
/// Retry-After assumed when a refusal carries none.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Longest Retry-After honoured (a worker cannot take itself out of the ring for longer per refusal).
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// Where one attempt goes and what it sends.
pub struct Attempt<'a> {
    pub url: &'a str,
    pub path: &'a str,
    pub body: &'a Bytes,
    pub headers: &'a [(HeaderName, HeaderValue)],
    pub worker_id: &'a str,
    pub reason: RouteReason,
    pub class: &'a str,
    pub admission_wait: Duration,
    pub first_byte_timeout: Duration,
    pub idle_timeout: Duration,
    /// The gateway asked the stream for usage the client did not ask for: take it out again (`meter.rs`).
    pub strip_usage: bool,
    /// The attempt's span, when traced (its `first_byte` is recorded here).
    pub trace: Option<&'a crate::serve::spans::AttemptTrace>,
    /// The TTFT and TPOT the split decision predicted for this attempt's option (seconds), when a split was
    /// considered: a completed stream records how far off they were
    /// (`kvgate_gateway_split_prediction_error_seconds{term}`).
    pub predicted: Option<(f64, f64)>,
}

/// How an attempt ended.
#[derive(Debug)]
pub enum Outcome {
    /// A response went to the client.
    Responded {
        status: u16,
        /// `usage` found at the end of the response.
        usage: Option<UsageSeen>,
        /// Completion tokens the client received (the usage's count, else a stream's token events so far).
        tokens_sent: u64,
        /// Not a stream: the worker computed the whole answer before sending it (a client that leaves mid-body
        /// left after the work was done).
        whole: bool,
        /// The body ended normally (not cut by the client, a failure or the idle timeout).
        completed: bool,
        /// The stream went silent past the idle timeout (the worker is suspect).
        stalled: bool,
    },
    /// Nothing reached the client; the connection failed or closed before a response: try another worker.
    ConnectFailed(String),
    /// The worker refused before starting (its code, and how long it asked to be left alone): try another worker.
    Refused { code: String, retry_after: Duration },
    /// No response header within the first-byte timeout.
    TimedOut,
    /// The client went away before the response started.
    ClientGone,
    /// Any other failure before the response started.
    Failed(ApiError),
}

impl Outcome {
    /// Its name in traces.
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Responded { .. } => "responded",
            Outcome::ConnectFailed(_) => "connect_failed",
            Outcome::Refused { .. } => "refused",
            Outcome::TimedOut => "timed_out",
            Outcome::ClientGone => "client_gone",
            Outcome::Failed(_) => "failed",
        }
    }

    /// The worker's status, when it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            Outcome::Responded { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// Resolves when the client closes its connection (or sends bytes it should not, which pingora treats the same).
async fn client_gone(session: &mut Session) {
    let _ = session.read_body_or_idle(true).await;
}

/// Runs `fut` unless the client goes away first (`None` then).
pub async fn unless_client_leaves<F: std::future::Future>(
    session: &mut Session,
    fut: F,
) -> Option<F::Output> {
    tokio::select! {
        out = fut => Some(out),
        _ = client_gone(session) => None,
    }
}

pub async fn forward(state: &GatewayState, session: &mut Session, a: &Attempt<'_>) -> Outcome {
    // A vLLM pod's data-parallel rank is a worker of its own (`pods::dp_rank`): the pod's URL, the rank's header.
    // The rank is the gateway's choice alone: a client's header of that name is never passed on.
    let (base, rank) = crate::pods::dp_rank::split(a.url);
    let mut req = hyper::Request::post(format!("{}{}", base.trim_end_matches('/'), a.path))
        .header("content-type", "application/json");
    for (name, value) in a.headers {
        if name.as_str() != crate::pods::dp_rank::RANK_HEADER {
            req = req.header(name, value);
        }
    }
    if let Some(r) = rank {
        req = req.header(crate::pods::dp_rank::RANK_HEADER, r);
    }
    let req = match req.body(Full::new(a.body.clone())) {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(ApiError::internal(e.to_string())),
    };
    let sent_at = Instant::now();
    let waited =
        unless_client_leaves(session, tokio::time::timeout(a.first_byte_timeout, state.client.request(req)));
    let resp = match waited.await {
        None => return Outcome::ClientGone,
        Some(Err(_)) => return Outcome::TimedOut,
        // Before any response byte the request had no effect the client saw: another worker may serve it (an LLM
        // request has no side effects; at worst the first worker computed a prefill for nothing).
        Some(Ok(Err(e))) => return Outcome::ConnectFailed(e.to_string()),
        Some(Ok(Ok(r))) => r,
    };
    // By path: a split's first byte waits for the prefill on another worker and the KV transfer.
    let path = if a.reason == RouteReason::Split { "split" } else { "local" };
    metrics::histogram!("kvgate_gateway_upstream_first_byte_seconds", "path" => path)
        .record(sent_at.elapsed().as_secs_f64());
    if let Some(t) = a.trace {
        t.first_byte(&state.tracer, sent_at);
    }
    let status = resp.status().as_u16();
    let (parts, body) = resp.into_parts();
    let sse = parts
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    // A 503 may be a refusal another worker can take: read its (small) body before anything goes to the client.
    let (early_body, body) = if status == 503 {
        let read = Limited::new(body, REFUSAL_BODY_LIMIT).collect();
        let bytes = match tokio::time::timeout(REFUSAL_BODY_TIMEOUT, read).await {
            Ok(Ok(b)) => b.to_bytes(),
            _ => return Outcome::ConnectFailed("an unreadable 503 answer".into()),
        };
        if let Some(code) = refusal_code(&bytes) {
            let retry_after = parts
                .headers
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(DEFAULT_RETRY_AFTER, Duration::from_secs)
                .clamp(Duration::from_millis(100), MAX_RETRY_AFTER);
            return Outcome::Refused { code, retry_after };
        }
        (Some(bytes), None)
    } else {
        (None, Some(body))
    };
    let io = |e: Box<pingora::Error>| Outcome::Failed(ApiError::internal(e.to_string()));
    let mut h = match ResponseHeader::build(status, Some(parts.headers.len() + 4)) {
        Ok(h) => h,
        Err(e) => return io(e),
    };
    for (name, value) in &parts.headers {
        if !matches!(name.as_str(), "connection" | "keep-alive" | "x-kvgate-worker" | "transfer-encoding") {
            if let Err(e) = h.append_header(name.clone(), value.clone()) {
                return io(e);
            }
        }
    }
    let extra = [
        ("x-kvgate-worker", a.worker_id.to_owned()),
        ("x-kvgate-route", a.reason.as_str().to_owned()),
        ("x-kvgate-class", a.class.to_owned()),
        ("x-kvgate-admission-wait-ms", format!("{:.3}", a.admission_wait.as_secs_f64() * 1e3)),
    ];
    for (k, v) in extra {
        if let Err(e) = h.insert_header(k, v) {
            return io(e);
        }
    }
    if session.write_response_header(Box::new(h), false).await.is_err() {
        return Outcome::ClientGone;
    }
    // From here on bytes reached the client: no retry.
    let mut body = match body {
        Some(b) => b,
        None => {
            // A 503 that was not a refusal: its body was read already.
            let ok = session.write_response_body(early_body, true).await.is_ok();
            return Outcome::Responded {
                status,
                usage: None,
                tokens_sent: 0,
                whole: true,
                completed: ok,
                stalled: false,
            };
        }
    };
    let mut meter = Meter::new(sse, a.strip_usage);
    let mut tpot = TpotClock::default();
    let mut stalled = false;
    let mut completed = true;
    let mut first = true;
    loop {
        // A worker sends a stream's headers at once and its first chunk with the first token: until then the
        // request may still be queued or in prefill, which the first-byte budget covers, not the idle timeout.
        let wait = if first {
            a.idle_timeout.max(a.first_byte_timeout.saturating_sub(sent_at.elapsed()))
        } else {
            a.idle_timeout
        };
        // The client may leave while the worker is silent (a split's decode worker waits for the prompt's KV
        // before its first token): noticed now, not at the next write, so the worker drops the request at once.
        let Some(next) = unless_client_leaves(session, tokio::time::timeout(wait, body.frame())).await else {
            let usage = if sse { None } else { meter.finish_usage() };
            return Outcome::Responded {
                status,
                usage,
                tokens_sent: meter.tokens_sent(),
                whole: !sse,
                completed: false,
                stalled: false,
            };
        };
        match next {
            Ok(None) => break,
            Ok(Some(Ok(frame))) => {
                first = false;
                if let Ok(data) = frame.into_data() {
                    let out = meter.feed(&data);
                    tpot.saw(meter.tokens_sent(), Instant::now());
                    if !out.is_empty() && session.write_response_body(Some(out), false).await.is_err() {
                        // The client went away: dropping the upstream body closes that connection, and the
                        // worker aborts the request. What it sent until then is charged (a whole answer: its
                        // usage, if its end was read already).
                        let usage = if sse { None } else { meter.finish_usage() };
                        let tokens_sent = meter.tokens_sent();
                        return Outcome::Responded {
                            status,
                            usage,
                            tokens_sent,
                            whole: !sse,
                            completed: false,
                            stalled: false,
                        };
                    }
                }
            }
            Ok(Some(Err(e))) => {
                tracing::warn!(worker = %a.worker_id, error = %e, "upstream failed mid-response");
                completed = false;
                if sse {
                    let err =
                        ApiError::bad_gateway(a.worker_id, &format!("the worker failed mid-stream: {e}"));
                    write_sse_error(session, &err).await;
                }
                break;
            }
            Err(_) => {
                tracing::warn!(worker = %a.worker_id, waited = ?wait, first, "upstream stream went silent");
                completed = false;
                stalled = true;
                if sse {
                    let mut err = ApiError::upstream_timeout(a.worker_id, wait);
                    err.message = if first {
                        format!(
                            "worker {} sent no token within {:.1?} of the request (the first-byte timeout)",
                            a.worker_id,
                            sent_at.elapsed()
                        )
                    } else {
                        format!(
                            "worker {} sent nothing for {:.1?} mid-stream (--stream-idle-timeout)",
                            a.worker_id, wait
                        )
                    };
                    write_sse_error(session, &err).await;
                }
                break;
            }
        }
    }
    let rest = meter.finish();
    if !rest.is_empty() {
        let _ = session.write_response_body(Some(rest), false).await;
    }
    let _ = session.write_response_body(None, true).await;
    let usage = if completed { meter.usage() } else { None };
    if let (true, Some(s)) = (completed && sse, tpot.seconds()) {
        metrics::histogram!("kvgate_gateway_tpot_seconds", "path" => path).record(s);
    }
    if let (true, Some((ttft, tpot_s)), Some(first)) = (completed && sse, a.predicted, tpot.first_at()) {
        let seen_ttft = first.duration_since(sent_at).as_secs_f64();
        metrics::histogram!("kvgate_gateway_split_prediction_error_seconds", "term" => "ttft")
            .record((seen_ttft - ttft).abs());
        if let Some(seen) = tpot.seconds() {
            metrics::histogram!("kvgate_gateway_split_prediction_error_seconds", "term" => "tpot")
                .record((seen - tpot_s).abs());
        }
        tracing::debug!(worker = %a.worker_id, predicted_ttft = ttft, seen_ttft, predicted_tpot = tpot_s,
            seen_tpot = ?tpot.seconds(), "split prediction vs outcome");
    }
    Outcome::Responded { status, usage, tokens_sent: meter.tokens_sent(), whole: !sse, completed, stalled }
}

/// A stream's time per output token as the client sees it: from the chunk that brought its first token to the one
/// that brought its last, over the tokens between (none for fewer than 2 tokens).
#[derive(Default)]
struct TpotClock {
    first: Option<(u64, Instant)>,
    last: Option<(u64, Instant)>,
}

impl TpotClock {
    fn saw(&mut self, tokens: u64, at: Instant) {
        if tokens == 0 || self.last.is_some_and(|(n, _)| n == tokens) {
            return;
        }
        self.first.get_or_insert((tokens, at));
        self.last = Some((tokens, at));
    }

    /// When the first token arrived.
    fn first_at(&self) -> Option<Instant> {
        self.first.map(|f| f.1)
    }

    fn seconds(&self) -> Option<f64> {
        let ((n0, t0), (n1, t1)) = (self.first?, self.last?);
        (n1 > n0).then(|| t1.duration_since(t0).as_secs_f64() / (n1 - n0) as f64)
    }
}

async fn write_sse_error(session: &mut Session, err: &ApiError) {
    metrics::counter!("kvgate_gateway_errors_total", "code" => err.code).increment(1);
    let event = Bytes::from(format!("data: {}\n\n", err.body().to_json()));
    let _ = session.write_response_body(Some(event), false).await;
}

/// The error code of a worker's refusal body, if it is one another worker may take.
pub fn refusal_code(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let code = v.get("error")?.get("code")?.as_str()?;
    Refusal::from_code(code).map(|r| r.code().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tpot_counts_from_the_first_token_to_the_last() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut c = TpotClock::default();
        c.saw(0, at(0)); // the role chunk: no token yet
        c.saw(1, at(500)); // the first token, after the prefill
        assert_eq!(c.seconds(), None, "one token has no TPOT");
        c.saw(1, at(510)); // a chunk without a token
        c.saw(3, at(540));
        c.saw(5, at(580));
        assert!((c.seconds().expect("tpot") - 0.020).abs() < 1e-9, "80 ms over 4 tokens after the first");
    }

    #[test]
    fn only_refusals_are_retried() {
        let body =
            |code: &str| format!(r#"{{"error":{{"message":"m","type":"server_error","code":"{code}"}}}}"#);
        for r in Refusal::ALL {
            assert_eq!(refusal_code(body(r.code()).as_bytes()).as_deref(), Some(r.code()));
        }
        assert_eq!(refusal_code(body("internal_error").as_bytes()), None);
        assert_eq!(refusal_code(b"<html>busy</html>"), None);
    }
}
