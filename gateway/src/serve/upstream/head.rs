//! The response head the client gets: the worker's status and headers without hop-by-hop ones (and without a
//! worker's own `x-kvgate-*` of these names), plus the gateway's `x-kvgate-worker`, `-route`, `-class`,
//! `-admission-wait-ms` and `-prompt-tokens` (the prompt tokens the request was priced with: counted by the
//! gateway's tokenizer when it routes by prefix, else estimated from the body); a body of no declared length (a
//! stream) is sent chunked, so the connection outlives it.

use hyper::header::{HeaderName, HeaderValue};
use hyper::http::response::Parts;

use super::Attempt;
use crate::serve::downstream::Head;

/// Headers never passed on from a worker (hop-by-hop ones, and the gateway's own, which it sets).
const DROPPED: [&str; 8] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "x-kvgate-worker",
    "x-kvgate-route",
    "x-kvgate-class",
    "x-kvgate-admission-wait-ms",
    "x-kvgate-prompt-tokens",
];

/// Whether the worker answers with a stream of server-sent events.
pub(super) fn is_sse(parts: &Parts) -> bool {
    parts
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// The body's declared length (`content-length`), which the client gets too.
pub(super) fn content_length(parts: &Parts) -> Option<u64> {
    parts.headers.get(hyper::header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// `Err`: a gateway header's value is not a valid header value (a worker id or class name with control characters).
pub(super) fn response_head(parts: &Parts, a: &Attempt<'_>) -> Result<Head, String> {
    let mut headers = Vec::with_capacity(parts.headers.len() + 4);
    for (name, value) in &parts.headers {
        if !DROPPED.contains(&name.as_str()) {
            headers.push((name.clone(), value.clone()));
        }
    }
    let extra = [
        ("x-kvgate-worker", a.worker_id.to_owned()),
        ("x-kvgate-route", a.reason.as_str().to_owned()),
        ("x-kvgate-class", a.class.to_owned()),
        ("x-kvgate-admission-wait-ms", format!("{:.3}", a.admission_wait.as_secs_f64() * 1e3)),
        ("x-kvgate-prompt-tokens", a.prompt_tokens.to_string()),
    ];
    for (k, v) in extra {
        let v = HeaderValue::from_str(&v).map_err(|e| format!("{k}: {e}"))?;
        headers.push((HeaderName::from_static(k), v));
    }
    // A body of no declared length (a stream) goes out chunked: sent as it comes, it would otherwise end only with
    // the connection (pingora frames a body of unknown length by closing), and no request could follow it on the
    // connection, a pipelined one included.
    if content_length(parts).is_none() && !matches!(parts.status.as_u16(), 100..=199 | 204 | 304) {
        headers.push((hyper::header::TRANSFER_ENCODING, HeaderValue::from_static("chunked")));
    }
    Ok(Head { status: parts.status.as_u16(), headers })
}
