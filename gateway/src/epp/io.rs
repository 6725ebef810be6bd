//! One ext_proc stream's two directions ([`StreamIo`]: the proxy's messages in, the picker's answers out) and the
//! request as the exchange's stages read it ([`EppClient`], a `serve::downstream::Client`): its headers from the
//! proxy's request headers message, its body from the body messages that follow, and the client gone when the
//! proxy closes the stream.
//!
//! Invariants: the body is read once, refused past the limit given (nothing past it is kept) and past the bytes
//! all streams' bodies may hold between them (`--epp-max-buffered-bytes`: 503 `epp_overloaded`); at most
//! [`MAX_STASHED`] messages that arrive while the picker waits (for the class budget) are kept for later, a proxy
//! that sends more is treated as gone; at most [`MAX_HEADERS`] request headers are read into the map the stages
//! see (the headers a pod would trust are looked for in all of them, `pick.rs`); an answer the proxy does not take
//! within `send_within` (it stopped granting flow-control window) counts as the proxy gone; a message without a
//! request (a flow-control window update) is skipped, never taken for the stream's end.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, ProcessingRequest, ProcessingResponse,
};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tonic::{Status, Streaming};

use crate::errors::ApiError;
use crate::serve::downstream::Client;

/// Messages kept while the picker waits for something else (request trailers, a stray message).
pub const MAX_STASHED: usize = 4;
/// Request headers read (Envoy bounds them too: 100 by default).
pub const MAX_HEADERS: usize = 256;

/// The answers' queue of one stream.
pub type Answers = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// An ext_proc stream, both ways.
pub struct StreamIo {
    inbound: Streaming<ProcessingRequest>,
    out: Answers,
    stash: VecDeque<ProcessingRequest>,
    closed: bool,
    /// How long an answer may wait for the proxy to take it.
    send_within: Duration,
}

impl StreamIo {
    pub fn new(inbound: Streaming<ProcessingRequest>, out: Answers, send_within: Duration) -> Self {
        Self { inbound, out, stash: VecDeque::new(), closed: false, send_within }
    }

    /// The proxy's next message; `None` when it closed the stream (or sent something that is not a message).
    pub async fn next(&mut self) -> Option<ProcessingRequest> {
        if let Some(m) = self.stash.pop_front() {
            return Some(m);
        }
        self.receive().await
    }

    async fn receive(&mut self) -> Option<ProcessingRequest> {
        if self.closed {
            return None;
        }
        loop {
            match self.inbound.message().await {
                Ok(Some(m)) if m.request.is_none() => continue,
                Ok(Some(m)) => return Some(m),
                Ok(None) | Err(_) => {
                    self.closed = true;
                    return None;
                }
            }
        }
    }

    /// Sends answers in order; `false` when the proxy is gone.
    pub async fn send(&self, answers: impl IntoIterator<Item = ProcessingResponse>) -> bool {
        for a in answers {
            if !matches!(tokio::time::timeout(self.send_within, self.out.send(Ok(a))).await, Ok(Ok(()))) {
                return false;
            }
        }
        true
    }

    /// Ends the stream with a gRPC error.
    pub async fn fail(&self, status: Status) {
        let _ = tokio::time::timeout(self.send_within, self.out.send(Err(status))).await;
    }

    /// Resolves when the proxy closes the stream (the client went away); messages that arrive meanwhile are kept.
    pub async fn gone(&mut self) {
        loop {
            match self.receive().await {
                None => return,
                Some(_) if self.stash.len() >= MAX_STASHED => return,
                Some(m) => self.stash.push_back(m),
            }
        }
    }
}

/// The request's headers as a header map (pseudo-headers and names or values that are not valid are left out).
pub fn header_map(list: &[(String, Vec<u8>)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (n, v) in list.iter().take(MAX_HEADERS) {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(n.as_bytes()), HeaderValue::from_bytes(v)) {
            map.append(n, v);
        }
    }
    map
}

/// The request of one stream, as the stages up to route read it.
pub struct EppClient<'a> {
    pub io: &'a mut StreamIo,
    pub headers: HeaderMap,
    /// The request has no (more) body: its headers message ended the stream.
    pub body_done: bool,
    /// Request trailers arrived (answered with the pick).
    pub trailers: bool,
    /// The proxy buffers the body (`BUFFERED`): its one body message is the whole body, even when trailers follow
    /// (Envoy holds those until the body is answered).
    pub buffered: bool,
    /// The bytes every stream's body may hold between them (`--epp-max-buffered-bytes`).
    pub bodies: Arc<Semaphore>,
    /// This body's share of them, held until the stream ends (the caller takes it).
    pub body_held: Option<OwnedSemaphorePermit>,
}

impl Client for EppClient<'_> {
    fn header(&self, name: &str) -> Option<&HeaderValue> {
        self.headers.get(name)
    }

    async fn read_body(&mut self, limit: usize) -> Result<Bytes, ApiError> {
        let mut buf = BytesMut::new();
        while !self.body_done {
            match self.io.next().await.and_then(|m| m.request) {
                Some(Request::RequestBody(b)) => {
                    if buf.len() + b.body.len() > limit {
                        return Err(ApiError::too_large(limit));
                    }
                    self.hold(b.body.len())?;
                    buf.extend_from_slice(&b.body);
                    self.body_done = b.end_of_stream || self.buffered;
                }
                Some(Request::RequestTrailers(_)) => {
                    self.trailers = true;
                    self.body_done = true;
                }
                Some(other) => {
                    return Err(ApiError::internal(format!(
                        "the proxy sent {} before the request body ended",
                        kind(&other)
                    )))
                }
                None => return Err(ApiError::bad_json("the request stream ended before its body")),
            }
        }
        Ok(buf.freeze())
    }

    async fn gone(&mut self) {
        self.io.gone().await;
    }
}

impl EppClient<'_> {
    /// Counts `n` more body bytes against every stream's budget; past it, 503 `epp_overloaded`.
    fn hold(&mut self, n: usize) -> Result<(), ApiError> {
        let Ok(n32) = u32::try_from(n) else { return Err(overloaded_bodies()) };
        let more = self.bodies.clone().try_acquire_many_owned(n32).map_err(|_| overloaded_bodies())?;
        match &mut self.body_held {
            Some(h) => h.merge(more),
            None => self.body_held = Some(more),
        }
        Ok(())
    }
}

fn overloaded_bodies() -> ApiError {
    metrics::counter!("kvgate_gateway_epp_body_budget_refusals_total").increment(1);
    ApiError::unavailable(
        "epp_overloaded",
        "the endpoint picker holds --epp-max-buffered-bytes of request bodies already; retry",
    )
}

/// A message's kind, for errors and logs.
pub fn kind(r: &Request) -> &'static str {
    match r {
        Request::RequestHeaders(_) => "request headers",
        Request::ResponseHeaders(_) => "response headers",
        Request::RequestBody(_) => "a request body chunk",
        Request::ResponseBody(_) => "a response body chunk",
        Request::RequestTrailers(_) => "request trailers",
        Request::ResponseTrailers(_) => "response trailers",
    }
}
