//! One attempt to serve a request from one worker, in four steps, each its own file:
//! 1. [`send`]: send the buffered body and wait for the response head within the request's first-byte timeout,
//!    watching for the client to go away meanwhile;
//! 2. [`refusal`]: a 503 whose body is a refusal (`kvgate_shared::errors::Refusal`: `queue_full`, `model_loading`,
//!    `shutting_down`, `engine_stopped`, `aborted`, `kv_import_no_room`) is read before anything reaches the client,
//!    with its Retry-After;
//! 3. [`head`]: the worker's response head, without hop-by-hop headers, plus the gateway's `x-kvgate-*`;
//! 4. [`body`]: the body chunk by chunk with an idle timeout between chunks, metered (`meter.rs`). A streamed
//!    response's headers come at once and its first chunk with the first token, so the first chunk may take what is
//!    left of the first-byte budget (if that is longer than the idle timeout): a request queued at a busy worker is
//!    not cut off as a silent stream.
//!
//! The outcome says what the caller may do next ([`Outcome`]): before any byte reached the client, a connection
//! failure, a connection the worker closed without answering, or a refusal may be retried on the next-ranked
//! worker; a first-byte timeout is a 504; after the first byte an upstream failure or an idle stream becomes an SSE
//! error event and the stream ends. Dropping the upstream response (timeout, client gone) closes that connection,
//! and the worker aborts the request and frees its KV blocks.

mod body;
mod head;
mod refusal;
mod send;

use std::time::Duration;

use bytes::Bytes;
use kvgate_shared::trace::Tracer;

use crate::errors::ApiError;
use crate::routing::RouteReason;
use crate::serve::downstream::{Downstream, HeadError};
pub use crate::serve::meter::UsageSeen;
use crate::serve::spans::AttemptTrace;
use crate::serve::stages::Header;
use crate::HttpClient;
pub use refusal::refusal_code;

/// Where one attempt goes and what it sends.
pub struct Attempt<'a> {
    pub url: &'a str,
    pub path: &'a str,
    pub body: &'a Bytes,
    pub headers: &'a [Header],
    pub worker_id: &'a str,
    pub reason: RouteReason,
    pub class: &'a str,
    pub admission_wait: Duration,
    /// The prompt tokens it was priced with (`x-kvgate-prompt-tokens`).
    pub prompt_tokens: u64,
    pub first_byte_timeout: Duration,
    pub idle_timeout: Duration,
    /// The gateway asked the stream for usage the client did not ask for: take it out again (`meter.rs`).
    pub strip_usage: bool,
    /// The attempt's span, when traced (its `first_byte` is recorded here).
    pub trace: Option<&'a AttemptTrace>,
    /// The TTFT and TPOT the split decision predicted for this attempt's option (seconds), when a split was
    /// considered: a completed stream records how far off they were
    /// (`kvgate_gateway_split_prediction_error_seconds{term}`).
    pub predicted: Option<(f64, f64)>,
}

impl Attempt<'_> {
    /// Its first-byte histogram label: a split's first byte waits for the prefill on another worker and the KV
    /// transfer.
    fn path_label(&self) -> &'static str {
        if self.reason == RouteReason::Split {
            "split"
        } else {
            "local"
        }
    }
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

/// One attempt: send, then (unless refused) the head and the body to the client.
pub async fn forward<D: Downstream>(
    client: &HttpClient,
    tracer: &Tracer,
    down: &mut D,
    a: &Attempt<'_>,
) -> Outcome {
    let sent = match send::send(client, down, a).await {
        Ok(s) => s,
        Err(outcome) => return outcome,
    };
    if let Some(t) = a.trace {
        t.first_byte(tracer, sent.at);
    }
    let (parts, body) = sent.response.into_parts();
    // A 503 may be a refusal another worker can take: read its (small) body before anything goes to the client.
    let early = match parts.status.as_u16() {
        503 => match refusal::read(&parts, body).await {
            Err(outcome) => return outcome,
            Ok(bytes) => Err(bytes),
        },
        _ => Ok(body),
    };
    let status = parts.status.as_u16();
    let sse = head::is_sse(&parts);
    let length = head::content_length(&parts);
    let head = match head::response_head(&parts, a) {
        Ok(h) => h,
        Err(e) => return Outcome::Failed(ApiError::internal(e)),
    };
    match down.write_head(head).await {
        Ok(()) => {}
        Err(HeadError::Gone) => return Outcome::ClientGone,
        Err(HeadError::Invalid(e)) => return Outcome::Failed(ApiError::internal(e)),
    }
    // From here on bytes reached the client: no retry.
    match early {
        Ok(body) => body::relay(down, a, body::Relay { status, sse, length, sent_at: sent.at }, body).await,
        Err(bytes) => {
            // A 503 that was not a refusal: its body was read already.
            let ok = down.write_body(Some(bytes), true).await.is_ok();
            Outcome::Responded {
                status,
                usage: None,
                tokens_sent: 0,
                whole: true,
                completed: ok,
                stalled: false,
            }
        }
    }
}
