//! The answer's phase of one ext_proc stream: the proxy streams the pod's response through the picker, which passes
//! it back (metered as on the proxy path, `serve::meter`: a stream's token events and its usage; the usage chunk
//! the gateway asked for on the client's behalf taken out again) and, when it ends, settles the request by the
//! charging rules (`serve::charge`) on the pod that really served it: the proxy's served-endpoint report
//! (`envoy.lb` `x-gateway-destination-endpoint-served`) moves the send, the in-flight slot and the index's credit
//! from the pick to the fallback that served.
//!
//! Bounds: the response head must come within the request's first-byte budget, each later message within
//! `--stream-idle-timeout` (a stream past it is settled as stalled and ended with `DEADLINE_EXCEEDED`); the meter
//! holds at most one event.

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use kvgate_router::input::url_address;
use tonic::Status;

use crate::epp::io::{kind, StreamIo};
use crate::epp::pick::Picked;
use crate::epp::wire::{self, BodyMode};
use crate::registry::Fault;
use crate::serve::charge::Settle;
use crate::serve::host::{InflightGuard, ServeHost};
use crate::serve::meter::Meter;
use crate::serve::stages::{Ctx, CLIENT_CLOSED};
use crate::serve::upstream::Outcome;

/// How the answer ended, as the charging rules read it.
struct Ended {
    outcome: Outcome,
    /// The candidate that served (its index in the ranking).
    served: usize,
}

/// Follows the answer to its end and settles it.
pub async fn follow(
    host: &Arc<dyn ServeHost>,
    io: &mut StreamIo,
    ctx: &mut Ctx,
    mut p: Picked<'_>,
    response_mode: BodyMode,
) {
    let cfg = host.cfg();
    let priced = &p.admitted.priced;
    let first_byte =
        cfg.first_byte.for_request(p.routed.routed.uncached_tokens, priced.output, p.prep.stream);
    let ended = relay(io, &p, response_mode, first_byte, cfg.stream_idle_timeout, ctx.route).await;
    let routed = &p.routed.routed;
    let t = &routed.candidates[ended.served];
    let mut uncached = routed.uncached_tokens;
    let mut guard: Option<InflightGuard> = p.routed.first.take();
    if ended.served != 0 {
        // The proxy's fallback served: its send (its own uncached prompt) replaces the pick's.
        guard = None;
        p.routed.prefill.take();
        let input = p.incoming.within(p.prep.route_input());
        let recorded = {
            let mut reg = host.registry();
            host.router().record_fallback(&mut reg, t, &input, Instant::now())
        };
        if let Some((ticket, u)) = recorded {
            guard = Some(InflightGuard::new(host, ticket));
            uncached = u;
            if p.prep.prompt.is_some() {
                host.share_send(&t.id, input.hashes, u, input.session_key);
            }
        }
        ctx.route = "fallback";
        ctx.worker = Some(t.id.clone());
    }
    if let Outcome::Responded { stalled: true, .. } = ended.outcome {
        host.registry().record_fault(t.wref, Fault::Timeout, Instant::now());
    }
    let mut permit = Some(p.admitted.permit);
    let s = Settle {
        host: host.as_ref(),
        prep: &p.prep,
        priced,
        t,
        uncached,
        first_byte,
        predicted: routed.predicted_cached_tokens,
    };
    let mut refused_for = None;
    if let Some(Err(e)) = s.settle(ctx, ended.outcome, &mut permit, &mut refused_for) {
        ctx.status = e.status;
    }
    drop(guard);
}

/// Which candidate the proxy says served (the pick when it does not say, or names an endpoint not ranked).
fn served_index(p: &Picked<'_>, served: Option<String>) -> usize {
    let Some(s) = served else { return 0 };
    let i = p.addresses.iter().position(|a| *a == s);
    let label = match i {
        Some(0) => "pick",
        Some(_) => "fallback",
        None => "unranked",
    };
    metrics::counter!("kvgate_gateway_epp_served_total", "by" => label).increment(1);
    let Some(i) = i else { return 0 };
    let address = &p.addresses[i];
    p.routed.routed.candidates.iter().position(|c| url_address(&c.url) == address).unwrap_or(0)
}

/// The gateway's response headers, as on the proxy path (`serve::upstream::head`): the worker that served, the
/// route, the class, the admission wait.
fn gateway_headers(p: &Picked<'_>, served: usize, route: &'static str) -> wire::HeaderMutation {
    let worker = p.routed.routed.candidates.get(served).map_or("", |c| c.id.as_str());
    let route = if served == 0 { route } else { "fallback" };
    let wait = format!("{:.3}", p.admitted.permit.waited.as_secs_f64() * 1e3);
    let set: Vec<(String, Vec<u8>)> = [
        ("x-kvgate-worker", worker),
        ("x-kvgate-route", route),
        ("x-kvgate-class", p.admitted.priced.class_name.as_str()),
        ("x-kvgate-admission-wait-ms", wait.as_str()),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
    .collect();
    wire::mutation(&set, Vec::new())
}

/// Passes the response through (metered) until it ends, the proxy leaves or it goes silent.
async fn relay(
    io: &mut StreamIo,
    p: &Picked<'_>,
    mode: BodyMode,
    first_byte: Duration,
    idle: Duration,
    route: &'static str,
) -> Ended {
    let whole = !p.prep.stream;
    let mut served = 0;
    // The head: within the first-byte budget (request trailers may come first).
    let head = loop {
        let Ok(m) = tokio::time::timeout(first_byte, io.next()).await else {
            io.fail(Status::deadline_exceeded("no response head within the first-byte timeout")).await;
            return Ended { outcome: Outcome::TimedOut, served };
        };
        match m.as_ref().and_then(|m| m.request.as_ref()) {
            None => return Ended { outcome: Outcome::ClientGone, served },
            Some(Request::RequestTrailers(_)) => {
                io.send([wire::trailers_continue(true)]).await;
            }
            Some(Request::ResponseHeaders(h)) => {
                served = served_index(p, wire::served(m.as_ref().and_then(|m| m.metadata_context.as_ref())));
                break h.clone();
            }
            Some(other) => {
                tracing::debug!(message = kind(other), "epp: unexpected message before the response head");
            }
        }
    };
    let headers = wire::header_list(&head);
    let status = wire::header_text(&headers, ":status").and_then(|s| s.parse().ok()).unwrap_or(0u16);
    let sse = wire::header_text(&headers, "content-type").is_some_and(|c| c.starts_with("text/event-stream"));
    let mut meter = Meter::new(sse, p.prep.strip_usage);
    let responded = |meter: &Meter, completed, stalled| Outcome::Responded {
        status,
        usage: meter.usage(),
        tokens_sent: meter.tokens_sent(),
        whole,
        completed,
        stalled,
    };
    if !io.send([wire::headers_with(false, Some(gateway_headers(p, served, route)))]).await {
        return Ended { outcome: responded(&meter, false, false), served };
    }
    if head.end_of_stream || mode == BodyMode::None {
        return Ended { outcome: responded(&meter, head.end_of_stream, false), served };
    }
    loop {
        let Ok(m) = tokio::time::timeout(idle, io.next()).await else {
            io.fail(Status::deadline_exceeded("the response went silent past --stream-idle-timeout")).await;
            return Ended { outcome: responded(&meter, false, true), served };
        };
        match m.and_then(|m| m.request) {
            None => {
                let mut o = responded(&meter, false, false);
                if let Outcome::Responded { usage, .. } = &mut o {
                    *usage = usage.or(meter.finish_usage());
                }
                return Ended { outcome: o, served };
            }
            Some(Request::ResponseBody(b)) => {
                let mut out = meter.feed(&b.body).to_vec();
                if b.end_of_stream {
                    out.extend_from_slice(&meter.finish());
                }
                let answers = match mode {
                    BodyMode::Duplex => wire::streamed_body(false, &out, b.end_of_stream),
                    _ => vec![wire::replaced_body(false, out)],
                };
                let sent = io.send(answers).await;
                if b.end_of_stream || !sent {
                    return Ended { outcome: responded(&meter, b.end_of_stream && sent, false), served };
                }
            }
            Some(Request::ResponseTrailers(_)) => {
                let rest = meter.finish();
                let mut answers = Vec::new();
                if mode == BodyMode::Duplex && !rest.is_empty() {
                    answers.extend(wire::streamed_body(false, &rest, false));
                }
                answers.push(wire::trailers_continue(false));
                let sent = io.send(answers).await;
                return Ended { outcome: responded(&meter, sent, false), served };
            }
            Some(Request::RequestTrailers(_)) => {
                io.send([wire::trailers_continue(true)]).await;
            }
            Some(other) => tracing::debug!(message = kind(&other), "epp: unexpected message in the response"),
        }
    }
}

/// The status the request is logged with when the answer's phase ends without one.
pub fn closed_status(ctx: &Ctx) -> u16 {
    if ctx.status == 0 {
        CLIENT_CLOSED
    } else {
        ctx.status
    }
}
