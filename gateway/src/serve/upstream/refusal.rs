//! A worker's 503: a refusal another worker may take (its code is one of `kvgate_shared::errors::Refusal`), with
//! how long the worker asked to be left alone, or any other answer the client gets as it is. The body is read
//! within [`REFUSAL_BODY_LIMIT`] bytes and [`REFUSAL_BODY_TIMEOUT`]; the Retry-After is clamped to
//! [`MIN_RETRY_AFTER`]..=[`MAX_RETRY_AFTER`].

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::http::response::Parts;
use kvgate_shared::errors::Refusal;

use super::Outcome;

/// Largest refusal body read to learn its code.
const REFUSAL_BODY_LIMIT: usize = 64 * 1024;
/// Longest wait for a refusal body after its header.
const REFUSAL_BODY_TIMEOUT: Duration = Duration::from_secs(2);
/// Retry-After assumed when a refusal carries none.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Shortest Retry-After honoured.
const MIN_RETRY_AFTER: Duration = Duration::from_millis(100);
/// Longest Retry-After honoured (a worker cannot take itself out of the ring for longer per refusal).
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// Reads a 503's body: `Err` with the outcome when it is a refusal (or unreadable), else the bytes for the client.
pub(super) async fn read(parts: &Parts, body: Incoming) -> Result<Bytes, Outcome> {
    let read = Limited::new(body, REFUSAL_BODY_LIMIT).collect();
    let bytes = match tokio::time::timeout(REFUSAL_BODY_TIMEOUT, read).await {
        Ok(Ok(b)) => b.to_bytes(),
        _ => return Err(Outcome::ConnectFailed("an unreadable 503 answer".into())),
    };
    let Some(code) = refusal_code(&bytes) else { return Ok(bytes) };
    let retry_after = parts
        .headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_RETRY_AFTER, Duration::from_secs)
        .clamp(MIN_RETRY_AFTER, MAX_RETRY_AFTER);
    Err(Outcome::Refused { code, retry_after })
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
