//! The attempts stage of an exchange: the routed candidates in rank order until one answers. The first is the
//! decision's pick (its send recorded at routing); each fallback's send is recorded through the router
//! (`Router::record_fallback`) with its own uncached count, which is its first-byte budget and its charge. A split's
//! decode leg retried on a worker that imports keeps the prefill peer (P's prefix cache holds the prompt by then);
//! any other fallback serves the request whole. Every fallback gives the split's prefill slot back (P has done its
//! part, or failed). Each outcome is settled by `charge.rs`.
//!
//! Invariants: an attempt's in-flight slot is given back when the attempt ends, the prefill slot at the first
//! fallback or when the walk ends (`InflightGuard`, on every path); the permit is settled exactly once, or dropped
//! (a full refund) when no worker computed anything.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_router::route::Candidate;
use kvgate_router::split::plan::can_import;

use crate::errors::{ApiError, GatewayErrors};
use crate::routing::RouteReason;
use crate::serve::charge::Settle;
use crate::serve::downstream::Downstream;
use crate::serve::host::{InflightGuard, ServeHost};
use crate::serve::outbound::Outbound;
use crate::serve::stages::{Admitted, Ctx, Incoming, Prepared, RoutedRequest};
use crate::serve::upstream::{self, Attempt};

/// Records a fallback's send through the router (its own uncached tokens, from its own prefix match) and shares
/// it; `None`: forgotten since the decision.
fn record_fallback(
    host: &Arc<dyn ServeHost>,
    prep: &Prepared,
    t: &Candidate,
) -> Option<(InflightGuard, u64)> {
    let input = prep.route_input();
    let (ticket, uncached) = {
        let mut reg = host.registry();
        host.router().record_fallback(&mut reg, t, &input, Instant::now())
    }?;
    if prep.prompt.is_some() {
        host.share_send(&t.id, input.hashes, uncached, input.session_key);
    }
    Some((InflightGuard::new(host, ticket), uncached))
}

/// The request as the attempts stage walks it.
pub struct Walk<'a> {
    pub host: &'a Arc<dyn ServeHost>,
    pub incoming: &'a Incoming,
    pub prep: &'a Prepared,
}

impl Walk<'_> {
    pub async fn run<D: Downstream>(
        &self,
        down: &mut D,
        ctx: &mut Ctx,
        a: Admitted<'_>,
        mut r: RoutedRequest,
    ) -> Result<(), ApiError> {
        let (host, prep, priced) = (self.host, self.prep, &a.priced);
        let cfg = host.cfg();
        let mut permit = Some(a.permit);
        let out = Outbound::new(cfg, self.incoming, prep, priced.kvgate_pool);
        let routed = &r.routed;
        let split = routed.split.as_ref().filter(|_| routed.is_split());
        // What the split decision predicted for the option taken (the first attempt's; a fallback is not it), when
        // it had measured speeds to predict with.
        let predicted = routed.split.as_ref().filter(|s| s.speed_measured).map(|s| {
            let o = if routed.is_split() { s.decision.terms.split } else { s.decision.terms.local };
            (o.ttft_s, o.tpot_s)
        });
        let mut reason = if routed.is_split() { RouteReason::Split } else { routed.reason };
        let mut refused_for: Option<Duration> = None;
        for (attempt, t) in routed.candidates.iter().enumerate() {
            let guard = if attempt == 0 {
                r.first.take().map(|g| (g, routed.uncached_tokens))
            } else {
                // A fallback: a split's prefill share is given back (P has done it, or failed).
                r.prefill.take();
                reason = RouteReason::Fallback;
                record_fallback(host, prep, t)
            };
            let Some((guard, uncached)) = guard else {
                continue; // forgotten since the decision
            };
            ctx.route = reason.as_str();
            let base = cfg.first_byte.for_request(uncached, priced.output, prep.stream);
            // The first attempt's header is expected when the route predicted it (its TTFT, and for a whole answer
            // the rest of its output at the predicted TPOT).
            let header_s = predicted.filter(|_| attempt == 0).map(|(ttft, tpot)| match prep.stream {
                true => ttft,
                false => ttft + priced.output.saturating_sub(1) as f64 * tpot,
            });
            let first_byte = cfg.first_byte.stretched(base, header_s);
            // A split's decode leg retried on another worker that imports keeps the prefill peer: P holds the
            // prompt's KV in its prefix cache now, so the new decode worker fetches it instead of recomputing it
            // (and computes it itself if P has lost it meanwhile).
            let peer = split
                .filter(|s| {
                    attempt == 0 || (t.id != s.prefill_worker && can_import(&host.registry(), t.wref))
                })
                .map(|s| s.peer.as_str());
            let (body, mut headers) = out.for_candidate(t, peer);
            let trace = ctx.trace.as_ref().map(|r| r.attempt());
            headers.extend(trace.as_ref().and_then(|t| t.header()));
            let attempt_req = Attempt {
                url: &t.url,
                path: &self.incoming.path,
                body,
                headers: &headers,
                worker_id: &t.id,
                reason,
                class: &priced.class_name,
                admission_wait: ctx.admission_wait,
                prompt_tokens: prep.prompt_tokens,
                first_byte_timeout: first_byte,
                idle_timeout: cfg.stream_idle_timeout,
                strip_usage: prep.strip_usage,
                trace: trace.as_ref(),
                predicted: predicted.filter(|_| attempt == 0),
            };
            let outcome = upstream::forward(host.client(), host.tracer(), down, &attempt_req).await;
            drop(guard);
            if let Some(tr) = trace {
                tr.finish(host.tracer(), &t.id, reason.as_str(), outcome.name(), outcome.status());
            }
            ctx.worker = Some(t.id.clone());
            let s = Settle {
                host: host.as_ref(),
                prep,
                priced,
                t,
                uncached,
                first_byte,
                predicted: routed.predicted_cached_tokens,
                served_known: true,
                proxied: false,
            };
            if let Some(done) = s.settle(ctx, outcome, &mut permit, &mut refused_for) {
                return done;
            }
        }
        match refused_for {
            Some(r) => Err(ApiError::all_refused(&prep.model, r.as_secs_f64().ceil() as u32)),
            None => Err(ApiError::no_worker(&prep.model)),
        }
    }
}
