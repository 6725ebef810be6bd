//! A request's spans on a worker, exported when `--otlp-endpoint` is set (`kvgate_shared::trace`): `worker.request`
//! (a server span under the caller's `traceparent`: the gateway's forward attempt) and its children, in order:
//! `queue` (arrival to first admission, from the engine's clock), then `prefill` (admission to the first token) or,
//! for a request whose prompt's KV comes from a prefill worker, `transfer` (admission, with the blocks held, to
//! the first token: the import and the first decode step), then `decode` (first to last token). Attributes name the
//! worker, the model, the token counts and how the request ended.

use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use kvgate_shared::trace::{parent_of, Kind, Span, TraceContext, Tracer, TRACEPARENT};

use crate::engine::StepOutput;

/// The trace one request is recorded in.
pub struct RequestSpans {
    tracer: Tracer,
    ctx: TraceContext,
    root: [u8; 8],
    /// Its KV comes from a prefill worker.
    pub split: bool,
    worker: String,
    model: String,
}

impl RequestSpans {
    /// `None` when tracing is off or the request is not sampled.
    pub fn begin(tracer: &Tracer, headers: &HeaderMap, worker: &str, model: &str) -> Option<Self> {
        let header = headers.get(TRACEPARENT).and_then(|v| v.to_str().ok());
        let ctx = tracer.context(header)?;
        Some(Self {
            tracer: tracer.clone(),
            ctx,
            root: kvgate_shared::trace::new_id(),
            split: false,
            worker: worker.to_owned(),
            model: model.to_owned(),
        })
    }

    fn child(&self, name: &'static str, start: Instant, end: Instant) {
        self.tracer.record(Span::new(self.ctx.trace_id, Some(self.root), name, Kind::Internal, start, end));
    }

    /// Records the spans of a request that started at `started`, waited `queued` (engine clock) for admission,
    /// had its first token at `first` and ended now with `out` (`status`: "ok" or "error").
    pub fn finish(
        &self,
        started: Instant,
        queued: Option<f64>,
        first: Option<Instant>,
        out: &StepOutput,
        status: &str,
    ) {
        let end = Instant::now();
        let admitted = queued.map(|q| (started + Duration::from_secs_f64(q.clamp(0.0, 1e6))).min(end));
        if let Some(a) = admitted {
            self.child("queue", started, a);
            if let Some(f) = first.filter(|f| *f >= a) {
                self.child(if self.split { "transfer" } else { "prefill" }, a, f);
            }
        }
        if let Some(f) = first {
            self.child("decode", f, end);
        }
        let mut root =
            Span::new(self.ctx.trace_id, parent_of(&self.ctx), "worker.request", Kind::Server, started, end)
                .attr("kvgate.worker", self.worker.as_str())
                .attr("gen_ai.request.model", self.model.as_str())
                .attr("gen_ai.usage.input_tokens", out.prompt_tokens as u64)
                .attr("kvgate.cached_tokens", out.cached_tokens as u64)
                .attr("gen_ai.usage.output_tokens", out.completion_tokens as u64)
                .attr("kvgate.split", self.split)
                .attr("kvgate.status", status);
        root.span_id = self.root;
        root.error = status != "ok";
        self.tracer.record(root);
    }
}
