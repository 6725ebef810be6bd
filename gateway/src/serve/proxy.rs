//! The public listener's pingora service: it adapts pingora's session to the exchange (`Downstream`) and
//! dispatches each request to its exchange (`exchange.rs`) or to the routes the gateway answers itself
//! (`models.rs`, `/health`).
//!
//! Routing needs the whole request body (the prompt) before an upstream is chosen, and pingora 0.9 can only forward
//! a body consumed in `request_filter` through its 64 KiB retry buffer (cloudflare/pingora #349, #780; early body
//! buffering is an unmerged PR). Long-context prompts are megabytes, so the gateway buffers the body itself and
//! forwards it in `request_filter` with its own pooled client (`upstream/`), streaming the response back through
//! pingora's downstream session; `request_filter` then answers `true` (response sent) and pingora's upstream phases
//! are not used. Connections reach this service through `listener.rs` (connection cap, header deadline, keep-alive
//! idle timeout).

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use hyper::header::HeaderValue;
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::{ProxyHttp, Session};

use crate::errors::ApiError;
use crate::serve::downstream::{Client, Downstream, Head, HeadError};
use crate::serve::endpoints::completions::Completions;
use crate::serve::endpoints::passthrough::{self, PassThrough};
use crate::serve::exchange;
use crate::serve::host::ServeHost;
use crate::serve::models;
use crate::serve::spans::RequestTrace;
pub use crate::serve::stages::{Ctx, CLIENT_CLOSED};

/// The pingora service.
pub struct Gateway {
    pub host: Arc<dyn ServeHost>,
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::new()
    }

    /// Never reached: every request is answered in `request_filter` (see the module docs).
    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        Err(Error::explain(ErrorType::InternalError, "kvgate answers every request in request_filter"))
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        // A request pipelined behind this one (RFC 9112 §9.3.2) waits for its turn: watching this client for its
        // leaving keeps the next request's bytes for it instead of taking them for data sent after the body.
        session.as_downstream_mut().set_pipelining_enabled(true);
        let traceparent = session.req_header().headers.get(kvgate_shared::trace::TRACEPARENT);
        ctx.trace = RequestTrace::begin(self.host.tracer(), traceparent.and_then(|v| v.to_str().ok()));
        if let Err(e) = dispatch(&self.host, session, ctx).await {
            ctx.status = e.status;
            write_error(session, &e).await?;
        }
        Ok(true)
    }

    async fn logging(&self, session: &mut Session, _e: Option<&pingora::Error>, ctx: &mut Ctx) {
        if let Some(t) = &ctx.trace {
            let path = session.req_header().uri.path();
            t.end(self.host.tracer(), path, ctx.status, ctx.route, &ctx.class, ctx.worker.as_deref());
        }
        metrics::counter!("kvgate_gateway_requests_total", "policy" => self.host.router().policy().name(),
            "route" => ctx.route, "status" => ctx.status.to_string(), "class" => ctx.class.clone())
        .increment(1);
        metrics::histogram!("kvgate_gateway_request_seconds").record(ctx.started.elapsed().as_secs_f64());
    }
}

/// Which exchange or answer a request gets, by method and path.
async fn dispatch(host: &Arc<dyn ServeHost>, session: &mut Session, ctx: &mut Ctx) -> Result<(), ApiError> {
    let method = session.req_header().method.clone();
    let path = session.req_header().uri.path().to_owned();
    let mut down = PingoraDownstream(session);
    match (method.as_str(), path.as_str()) {
        ("POST", p) => match Completions::at(p) {
            Some(e) => exchange::serve(host, &mut down, ctx, &e, p).await,
            None if passthrough::PATHS.contains(&p) => {
                exchange::serve(host, &mut down, ctx, &PassThrough, p).await
            }
            None => Err(ApiError::not_found_route(p)),
        },
        ("GET", p) => models::answer(host.as_ref(), &mut down, ctx, p).await,
        _ => Err(ApiError::not_found_route(&path)),
    }
}

async fn write_error(session: &mut Session, e: &ApiError) -> Result<()> {
    let body = Bytes::from(e.body().to_json());
    let mut h = ResponseHeader::build(e.status, Some(4))?;
    h.insert_header("content-type", "application/json")?;
    h.insert_header("content-length", body.len().to_string())?;
    if let Some(s) = e.retry_after_s {
        h.insert_header("retry-after", s.to_string())?;
    }
    metrics::counter!("kvgate_gateway_errors_total", "code" => e.code).increment(1);
    session.write_response_header(Box::new(h), false).await?;
    session.write_response_body(Some(body), true).await
}

/// Pingora's session as the exchange's client.
struct PingoraDownstream<'s>(&'s mut Session);

impl Client for PingoraDownstream<'_> {
    fn header(&self, name: &str) -> Option<&HeaderValue> {
        self.0.req_header().headers.get(name)
    }

    async fn read_body(&mut self, limit: usize) -> Result<Bytes, ApiError> {
        let session = &mut *self.0;
        if let Some(len) = session.req_header().headers.get("content-length") {
            if len.to_str().ok().and_then(|v| v.parse::<usize>().ok()).is_some_and(|n| n > limit) {
                return Err(ApiError::too_large(limit));
            }
        }
        let mut buf = bytes::BytesMut::new();
        loop {
            match session.read_request_body().await {
                Ok(Some(chunk)) => {
                    if buf.len() + chunk.len() > limit {
                        return Err(ApiError::too_large(limit));
                    }
                    buf.extend_from_slice(&chunk);
                }
                Ok(None) => break,
                Err(e) => return Err(ApiError::bad_json(format!("cannot read the request body: {e}"))),
            }
        }
        Ok(buf.freeze())
    }

    /// The client closed its connection (or sent bytes it should not, which pingora treats the same).
    async fn gone(&mut self) {
        let _ = self.0.read_body_or_idle(true).await;
    }
}

impl Downstream for PingoraDownstream<'_> {
    async fn write_head(&mut self, head: Head) -> Result<(), HeadError> {
        let invalid = |e: Box<pingora::Error>| HeadError::Invalid(e.to_string());
        let mut h = ResponseHeader::build(head.status, Some(head.headers.len())).map_err(invalid)?;
        for (name, value) in head.headers {
            h.append_header(name, value).map_err(invalid)?;
        }
        self.0.write_response_header(Box::new(h), false).await.map_err(|_| HeadError::Gone)
    }

    async fn write_body(&mut self, data: Option<Bytes>, end: bool) -> Result<(), ()> {
        self.0.write_response_body(data, end).await.map_err(|_| ())
    }
}
