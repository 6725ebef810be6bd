//! A request's spans in the gateway, exported when `--otlp-endpoint` is set (`kvgate_shared::trace`):
//! `gateway.request` (a server span under the client's W3C `traceparent`, if it sent one) and its children, the
//! stages of the exchange (`exchange.rs`): `prepare`, `admit` (pricing and the wait for the class budget),
//! `route`, then one `forward` per attempt (a client span naming the worker, the route reason and the outcome) with its
//! `first_byte`. Each attempt sends the worker a `traceparent` naming its `forward` span, so the worker's
//! `worker.request` hangs under it. A stage that fails records no span; the root says how the request ended.

use std::time::Instant;

use hyper::header::{HeaderName, HeaderValue};
use kvgate_shared::trace::{new_id, parent_of, Kind, Span, TraceContext, Tracer, Value, TRACEPARENT};

/// The trace of one request.
#[derive(Debug)]
pub struct RequestTrace {
    ctx: TraceContext,
    root: [u8; 8],
    start: Instant,
}

impl RequestTrace {
    /// `None` when tracing is off or the request is not sampled.
    pub fn begin(tracer: &Tracer, traceparent: Option<&str>) -> Option<Self> {
        Some(Self { ctx: tracer.context(traceparent)?, root: new_id(), start: Instant::now() })
    }

    /// Records stage `name`, from `start` to now, with the attributes `attrs` gives (called only when traced, so
    /// an untraced request builds none).
    pub fn stage(
        &self,
        tracer: &Tracer,
        name: &'static str,
        start: Instant,
        attrs: impl FnOnce() -> Vec<(&'static str, Value)>,
    ) {
        let mut s =
            Span::new(self.ctx.trace_id, Some(self.root), name, Kind::Internal, start, Instant::now());
        s.attributes = attrs();
        tracer.record(s);
    }

    /// A new attempt's span (recorded by [`AttemptTrace::finish`]).
    pub fn attempt(&self) -> AttemptTrace {
        AttemptTrace {
            trace_id: self.ctx.trace_id,
            span_id: new_id(),
            parent: self.root,
            start: Instant::now(),
        }
    }

    /// Records the root span, ending now.
    pub fn end(
        &self,
        tracer: &Tracer,
        path: &str,
        status: u16,
        route: &str,
        class: &str,
        worker: Option<&str>,
    ) {
        let mut s = Span::new(
            self.ctx.trace_id,
            parent_of(&self.ctx),
            "gateway.request",
            Kind::Server,
            self.start,
            Instant::now(),
        )
        .attr("url.path", path)
        .attr("http.response.status_code", i64::from(status))
        .attr("kvgate.route", route)
        .attr("kvgate.class", class);
        if let Some(w) = worker {
            s = s.attr("kvgate.worker", w);
        }
        s.span_id = self.root;
        s.error = status >= 500;
        tracer.record(s);
    }
}

/// One forward attempt's span.
#[derive(Debug)]
pub struct AttemptTrace {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: [u8; 8],
    start: Instant,
}

impl AttemptTrace {
    /// The `traceparent` header the worker gets: this attempt is its parent.
    pub fn header(&self) -> Option<(HeaderName, HeaderValue)> {
        let ctx = TraceContext { trace_id: self.trace_id, span_id: self.span_id, sampled: true };
        Some((
            HeaderName::from_static(TRACEPARENT),
            HeaderValue::from_str(&ctx.header_for(self.span_id)).ok()?,
        ))
    }

    /// Records the wait for the response header, from `sent` to now.
    pub fn first_byte(&self, tracer: &Tracer, sent: Instant) {
        tracer.record(Span::new(
            self.trace_id,
            Some(self.span_id),
            "first_byte",
            Kind::Internal,
            sent,
            Instant::now(),
        ));
    }

    /// Records the attempt: its worker, route reason and outcome (`ok`, `refused`, `connect_failed`, ...).
    pub fn finish(
        self,
        tracer: &Tracer,
        worker: &str,
        route: &str,
        outcome: &'static str,
        status: Option<u16>,
    ) {
        let mut s =
            Span::new(self.trace_id, Some(self.parent), "forward", Kind::Client, self.start, Instant::now())
                .attr("kvgate.worker", worker)
                .attr("kvgate.route", route)
                .attr("kvgate.outcome", outcome);
        if let Some(st) = status {
            s = s.attr("http.response.status_code", i64::from(st));
        }
        s.span_id = self.span_id;
        s.error = outcome != "responded";
        tracer.record(s);
    }
}
