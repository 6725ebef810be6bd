//! The answer's phase of one ext_proc stream: the proxy streams the pod's response through the picker, which passes
//! it back (metered as on the proxy path, `serve::meter`: a stream's token events and its usage; the usage chunk
//! the gateway asked for on the client's behalf taken out again) and, when it ends, settles the request by the
//! charging rules (`serve::charge`) on the pod that really served it: the proxy's served-endpoint report
//! (`envoy.lb` `x-gateway-destination-endpoint-served`) moves the send, the in-flight slot and the index's credit
//! from the pick to the fallback that served.
//!
//! Bounds: the response head must come within the request's first-byte budget, each body chunk within
//! `--stream-idle-timeout` of the one before (a stream past it is settled as stalled and ended with
//! `DEADLINE_EXCEEDED`); messages that are not the answer's do not restart either clock; an answer the proxy does
//! not take within `--stream-idle-timeout` ends the stream (`io.rs`); the meter holds at most one event. A 504 (the
//! proxy's upstream timeout) is charged as the proxy path charges its own first-byte timeout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use kvgate_router::input::url_address;
use tonic::Status;

use crate::epp::io::{kind, StreamIo};
use crate::epp::pick::Picked;
use crate::epp::wire::{self, BodyMode};
use crate::serve::charge::Settle;
use crate::serve::host::{InflightGuard, ServeHost};
use crate::serve::meter::Meter;
use crate::serve::stages::{Ctx, CLIENT_CLOSED};
use crate::serve::upstream::Outcome;

/// How the answer ended, as the charging rules read it.
struct Ended {
    outcome: Outcome,
}

/// The response head, and the candidate that served (its index in the ranking).
struct Head {
    headers: Vec<(String, Vec<u8>)>,
    end_of_stream: bool,
    served: usize,
    /// The proxy named an endpoint the picker did not rank: no worker's index is credited.
    unranked: bool,
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
    let head = head(io, &p, first_byte).await;
    let routed = &p.routed.routed;
    let served = head.as_ref().map_or(0, |h| h.served);
    let unranked = head.as_ref().is_ok_and(|h| h.unranked);
    let t = &routed.candidates[served];
    let mut uncached = routed.uncached_tokens;
    let mut guard: Option<InflightGuard> = p.routed.first.take();
    if served != 0 {
        // The proxy's fallback serves: its send (its own uncached prompt, as it is now), in-flight slot and index
        // credit replace the pick's before its answer streams.
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
    let ended = match head {
        Err(e) => e,
        Ok(h) => {
            let route = ctx.route;
            body(io, &p, h, response_mode, cfg.stream_idle_timeout, route).await
        }
    };
    let mut permit = Some(p.admitted.permit);
    let s = Settle {
        host: host.as_ref(),
        prep: &p.prep,
        priced,
        t,
        uncached,
        first_byte,
        predicted: routed.predicted_cached_tokens,
        served_known: !unranked,
        proxied: true,
    };
    let mut refused_for = None;
    if let Some(Err(e)) = s.settle(ctx, ended.outcome, &mut permit, &mut refused_for) {
        ctx.status = e.status;
    }
    drop(guard);
}

/// Which candidate the proxy says served (the pick when it does not say), and whether it named an endpoint the
/// picker did not rank (then the pick's slot is kept and no index is credited).
fn served_index(p: &Picked<'_>, served: Option<String>) -> (usize, bool) {
    let Some(s) = served else { return (0, false) };
    let i = p.addresses.iter().position(|a| *a == s);
    let label = match i {
        Some(0) => "pick",
        Some(_) => "fallback",
        None => "unranked",
    };
    metrics::counter!("kvgate_gateway_epp_served_total", "by" => label).increment(1);
    let Some(i) = i else { return (0, true) };
    let address = &p.addresses[i];
    (p.routed.routed.candidates.iter().position(|c| url_address(&c.url) == address).unwrap_or(0), false)
}

/// The gateway's response headers, as on the proxy path (`serve::upstream::head`): the worker that served, the
/// route, the class, the admission wait, the prompt tokens it was priced with.
fn gateway_headers(p: &Picked<'_>, served: usize, route: &'static str) -> wire::HeaderMutation {
    let worker = p.routed.routed.candidates.get(served).map_or("", |c| c.id.as_str());
    let wait = format!("{:.3}", p.admitted.permit.waited.as_secs_f64() * 1e3);
    let prompt = p.prep.prompt_tokens.to_string();
    let set: Vec<(String, Vec<u8>)> = [
        ("x-kvgate-worker", worker),
        ("x-kvgate-route", route),
        ("x-kvgate-class", p.admitted.priced.class_name.as_str()),
        ("x-kvgate-admission-wait-ms", wait.as_str()),
        ("x-kvgate-prompt-tokens", prompt.as_str()),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
    .collect();
    wire::mutation(&set, Vec::new())
}

/// The response head, within the first-byte budget from now (request trailers may come first and are answered;
/// they do not restart the budget).
async fn head(io: &mut StreamIo, p: &Picked<'_>, first_byte: Duration) -> Result<Head, Ended> {
    let deadline = tokio::time::Instant::now() + first_byte;
    loop {
        let Ok(m) = tokio::time::timeout_at(deadline, io.next()).await else {
            io.fail(Status::deadline_exceeded("no response head within the first-byte timeout")).await;
            return Err(Ended { outcome: Outcome::TimedOut });
        };
        let Some(m) = m else { return Err(Ended { outcome: Outcome::ClientGone }) };
        match m.request {
            Some(Request::RequestTrailers(_)) => {
                io.send([wire::trailers_continue(true)]).await;
            }
            Some(Request::ResponseHeaders(h)) => {
                let (served, unranked) = served_index(p, wire::served(m.metadata_context.as_ref()));
                return Ok(Head {
                    headers: wire::header_list(&h),
                    end_of_stream: h.end_of_stream,
                    served,
                    unranked,
                });
            }
            Some(other) => {
                tracing::debug!(message = kind(&other), "epp: unexpected message before the response head");
            }
            None => {}
        }
    }
}

/// Passes the response body through (metered) until it ends, the proxy leaves or it goes silent past `idle`.
async fn body(
    io: &mut StreamIo,
    p: &Picked<'_>,
    head: Head,
    mode: BodyMode,
    idle: Duration,
    route: &'static str,
) -> Ended {
    let status = wire::header_text(&head.headers, ":status").and_then(|s| s.parse().ok()).unwrap_or(0u16);
    if status == 504 {
        // The proxy's own upstream timeout (or a pod's): the pod had the request; its prefill is charged.
        io.send([wire::headers_continue(false)]).await;
        return Ended { outcome: Outcome::TimedOut };
    }
    let sse =
        wire::header_text(&head.headers, "content-type").is_some_and(|c| c.starts_with("text/event-stream"));
    let mut meter = Meter::new(sse, p.prep.strip_usage);
    let whole = !p.prep.stream;
    let responded = |meter: &Meter, completed, stalled| Ended {
        outcome: Outcome::Responded {
            status,
            usage: meter.usage(),
            tokens_sent: meter.tokens_sent(),
            whole,
            completed,
            stalled,
        },
    };
    if !io.send([wire::headers_with(false, Some(gateway_headers(p, head.served, route)))]).await {
        return responded(&meter, false, false);
    }
    // Without a body to follow (none, or the proxy does not send it), the answer counts as complete: its price.
    if head.end_of_stream || mode == BodyMode::None {
        return responded(&meter, true, false);
    }
    let mut deadline = tokio::time::Instant::now() + idle;
    loop {
        let Ok(m) = tokio::time::timeout_at(deadline, io.next()).await else {
            io.fail(Status::deadline_exceeded("the response went silent past --stream-idle-timeout")).await;
            return responded(&meter, false, true);
        };
        match m.and_then(|m| m.request) {
            None => {
                let mut ended = responded(&meter, false, false);
                if let Outcome::Responded { usage, .. } = &mut ended.outcome {
                    *usage = usage.or(meter.finish_usage());
                }
                return ended;
            }
            Some(Request::ResponseBody(b)) => {
                deadline = tokio::time::Instant::now() + idle;
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
                    return responded(&meter, b.end_of_stream && sent, false);
                }
            }
            Some(Request::ResponseTrailers(_)) => {
                // What the meter still holds goes out before the trailers (duplex: a last chunk; the other
                // modes answered every chunk already, so what is held is an unterminated event, sent as it is).
                let rest = meter.finish();
                let mut answers = Vec::new();
                if mode == BodyMode::Duplex && !rest.is_empty() {
                    answers.extend(wire::streamed_body(false, &rest, false));
                }
                answers.push(wire::trailers_continue(false));
                let sent = io.send(answers).await;
                return responded(&meter, sent, false);
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
