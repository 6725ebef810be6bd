//! The client's side of an exchange, as the stages see it: [`Client`] (its headers, its body, whether it is still
//! there: all the stages up to route need) and [`Downstream`] (where the answer goes: the attempts). The pingora
//! listener adapts its session to both (`proxy.rs`); a front end that only decides (an endpoint picker, which answers
//! with the pick) implements [`Client`] alone.
//!
//! Invariants: a body is read once, within the limit given; `gone` resolves only when the client closed its
//! connection (or sent bytes it should not have, which a front end treats the same); a body write error means the
//! client is gone; a head write error says whether the client is gone or the head could not be built.

use std::future::Future;

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};

use crate::errors::ApiError;

/// A response head: status and headers, in order.
pub struct Head {
    pub status: u16,
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// Why a response head was not sent.
#[derive(Debug)]
pub enum HeadError {
    /// The client is gone.
    Gone,
    /// The front end could not build the head (a header it refuses).
    Invalid(String),
}

/// The client of one exchange, as the stages up to route read it.
pub trait Client: Send {
    /// A request header's value.
    fn header(&self, name: &str) -> Option<&HeaderValue>;

    /// A request header's value as text (`None` when absent or not text).
    fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| v.to_str().ok())
    }

    /// The whole request body, refused (413) past `limit` bytes.
    fn read_body(&mut self, limit: usize) -> impl Future<Output = Result<Bytes, ApiError>> + Send;

    /// Resolves when the client goes away.
    fn gone(&mut self) -> impl Future<Output = ()> + Send;
}

/// A client the gateway answers itself (it forwards the request and streams the answer back).
pub trait Downstream: Client {
    /// Sends the response head.
    fn write_head(&mut self, head: Head) -> impl Future<Output = Result<(), HeadError>> + Send;

    /// Sends body bytes (`end`: the last); `Err`: the client is gone.
    fn write_body(&mut self, data: Option<Bytes>, end: bool) -> impl Future<Output = Result<(), ()>> + Send;
}

/// Runs `fut` unless the client goes away first (`None` then).
pub async fn unless_client_leaves<C: Client, F: Future>(down: &mut C, fut: F) -> Option<F::Output> {
    tokio::select! {
        out = fut => Some(out),
        _ = down.gone() => None,
    }
}

/// Answers with a JSON body; `Err`: the client is gone, or the head could not be built.
pub async fn write_json<D: Downstream>(down: &mut D, status: u16, body: Bytes) -> Result<(), HeadError> {
    let text = |v: &'static str| HeaderValue::from_static(v);
    let headers = vec![
        (hyper::header::CONTENT_TYPE, text("application/json")),
        (hyper::header::CONTENT_LENGTH, HeaderValue::from(body.len())),
    ];
    down.write_head(Head { status, headers }).await?;
    down.write_body(Some(body), true).await.map_err(|()| HeadError::Gone)
}
