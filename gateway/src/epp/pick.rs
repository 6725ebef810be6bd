//! The request phase of one ext_proc stream: the exchange's stages 1 to 6 (`serve::exchange`: read, identify,
//! prepare, price, admit, route) on the request the proxy streams, then the answer that names the pick instead of
//! forwarding to it: the destination (the pick, then the other candidates as fallbacks, `ip:port`), the headers a
//! worker gets (`serve::outbound`, as on the proxy path, except that a kvgate worker gets a per-request credential
//! where the proxy path sends the gateway's token: its assertion, the client's headers for other pods, a split's
//! prefill peer and grant), and the body every worker gets.
//!
//! Invariants: a header a worker would trust (`authorization`, `x-kvgate-*`, the data-parallel rank, the routing
//! headers) that the client sent reaches the pod only when the picker sets it itself; a request the stages refuse
//! is answered by the proxy with the gateway's error (its status, its OpenAI-style body, its Retry-After); the
//! in-flight slot and the class budget's permit stay with the stream until the answer ends (`follow.rs`).

use std::sync::Arc;

use kvgate_router::input::url_address;

use crate::epp::io::EppClient;
use crate::epp::wire::{self, DESTINATION_HEADER};
use crate::errors::{ApiError, GatewayErrors};
use crate::pods::dp_rank;
use crate::serve::endpoints::completions::Completions;
use crate::serve::endpoints::passthrough::{self, PassThrough};
use crate::serve::exchange::{self, Endpoint};
use crate::serve::host::ServeHost;
use crate::serve::outbound::Outbound;
use crate::serve::stages::{Admitted, Ctx, Incoming, Prepared, RoutedRequest, CLIENT_CLOSED};

/// A request decided: what the proxy is told, and what the answer's phase settles.
pub struct Picked<'s> {
    pub incoming: Incoming,
    pub prep: Prepared,
    pub admitted: Admitted<'s>,
    pub routed: RoutedRequest,
    /// The candidates' addresses, in rank order (the destination header's list).
    pub addresses: Vec<String>,
    /// The request headers to set (the destination last) and to remove.
    pub set: Vec<(String, Vec<u8>)>,
    pub remove: Vec<String>,
    /// The body the pod gets.
    pub body: bytes::Bytes,
}

impl Picked<'_> {
    /// The destination header's value: the pick, then the fallbacks.
    pub fn destination(&self) -> String {
        self.addresses.join(",")
    }
}

/// Request headers a pod may trust, which only the picker sets.
fn trusted(name: &str) -> bool {
    name == "authorization"
        || name.starts_with("x-kvgate-")
        || name == dp_rank::RANK_HEADER
        || name.starts_with(DESTINATION_HEADER)
}

/// The names of the headers a pod would trust among all the request's headers (not only those the stages read).
pub fn trusted_sent(headers: &[(String, Vec<u8>)]) -> Vec<String> {
    let mut names: Vec<String> = headers.iter().map(|(n, _)| n.clone()).filter(|n| trusted(n)).collect();
    names.sort();
    names.dedup();
    names
}

/// Stages 1 to 6 for the request at `path`; `Ok(None)`: the client left while it waited. `trusted`: the headers a
/// pod would trust that the client sent ([`trusted_sent`]), removed unless the picker sets them.
pub async fn decide<'s>(
    host: &'s Arc<dyn ServeHost>,
    client: &mut EppClient<'_>,
    ctx: &mut Ctx,
    path: &str,
    subset: Option<Vec<String>>,
    trusted: Vec<String>,
) -> Result<Option<Picked<'s>>, ApiError> {
    let (mut incoming, body) = exchange::read(host.as_ref(), client, path).await?;
    incoming.subset = subset;
    let prep = match Completions::at(path) {
        Some(e) => e.prepare(host, &incoming, body).await?,
        None if passthrough::PATHS.contains(&path) => PassThrough.prepare(host, &incoming, body).await?,
        None => return Err(ApiError::not_found_route(path)),
    };
    let priced = exchange::price(host.as_ref(), &prep, &incoming, 1)?;
    ctx.class = priced.class_name.clone();
    let Some(admitted) = exchange::admit(host.as_ref(), client, &incoming.caller, priced).await? else {
        ctx.status = CLIENT_CLOSED;
        return Ok(None);
    };
    ctx.admission_wait = admitted.permit.waited;
    crate::serve::adapters::place(host, &prep, &mut incoming).await?;
    let routed = exchange::route(host, &incoming, &prep, &admitted)?;
    let r = &routed.routed;
    let first = r.candidates.first().ok_or_else(|| ApiError::no_worker(&prep.model))?;
    ctx.route = if r.is_split() { "split" } else { r.reason.as_str() };
    ctx.worker = Some(first.id.clone());
    // The proxy sends every fallback the headers built for the pick: a split's prefill grant names the decode
    // worker, a data-parallel rank the pick's; then there is no fallback.
    let per_host = r.is_split() || dp_rank::split(&first.url).1.is_some();
    let mut addresses: Vec<String> = Vec::with_capacity(r.candidates.len());
    for c in r.candidates.iter().take(if per_host { 1 } else { usize::MAX }) {
        let a = url_address(&c.url).to_owned();
        if !addresses.contains(&a) {
            addresses.push(a);
        }
    }
    // What the first candidate gets on the proxy path (a split's decode worker: its prefill peer and grant).
    let peer = r.split.as_ref().filter(|_| r.is_split()).map(|s| s.peer.as_str());
    let out = Outbound::new(host.cfg(), &incoming, &prep, admitted.priced.kvgate_pool);
    // The proxy holds what it is handed: a credential for this request alone, never the gateway's token.
    let (body, headers) = out.per_request(first, peer, path);
    let body = body.clone();
    let mut set: Vec<(String, Vec<u8>)> =
        headers.iter().map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec())).collect();
    if let (_, Some(rank)) = dp_rank::split(&first.url) {
        set.push((dp_rank::RANK_HEADER.to_owned(), rank.to_string().into_bytes()));
    }
    // The body may have changed (a tenant's salt, the usage asked for): the proxy sends it chunked.
    let mut remove: Vec<String> = vec!["content-length".to_owned()];
    remove.extend(trusted.into_iter().filter(|n| !set.iter().any(|(s, _)| s == n)));
    Ok(Some(Picked { incoming, prep, admitted, routed, addresses, set, remove, body }))
}

/// The answers that tell the proxy the pick: in a duplex stream, the headers (with the pick) then the body as
/// streamed chunks; in a buffered one, the body message's answer (the headers were answered already).
pub fn answers(p: &Picked<'_>, buffered: bool, trailers: bool) -> Vec<wire::Message> {
    let m = wire::mutation(&p.set, p.remove.clone());
    let destination = p.destination();
    let mut out = if buffered {
        vec![wire::pick(&destination, m, Some(p.body.to_vec()))]
    } else {
        let mut v = vec![wire::pick(&destination, m, None)];
        v.extend(wire::streamed_body(true, &p.body, !trailers));
        v
    };
    if trailers {
        out.push(wire::trailers_continue(true));
    }
    out
}

/// The proxy's answer to the client for a refused request: the gateway's error, as the proxy path writes it.
pub fn refusal(e: &ApiError) -> wire::Message {
    let body = e.body().to_json().into_bytes();
    let mut headers = vec![("content-type".to_owned(), b"application/json".to_vec())];
    if let Some(s) = e.retry_after_s {
        headers.push(("retry-after".to_owned(), s.to_string().into_bytes()));
    }
    metrics::counter!("kvgate_gateway_errors_total", "code" => e.code).increment(1);
    wire::immediate(e.status, &headers, body, e.code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_picker_sets_the_headers_a_pod_trusts() {
        for h in ["authorization", "x-kvgate-gateway-auth", "x-kvgate-prefill-grant", "x-data-parallel-rank"]
        {
            assert!(trusted(h), "{h}");
        }
        assert!(trusted("x-gateway-destination-endpoint"));
        assert!(trusted("x-gateway-destination-endpoint-served"));
        // Found among all the headers, past the ones the stages read.
        let mut many: Vec<(String, Vec<u8>)> =
            (0..300).map(|i| (format!("x-filler-{i}"), vec![b'a'])).collect();
        many.push(("x-kvgate-gateway-auth".into(), b"forged".to_vec()));
        assert_eq!(trusted_sent(&many), vec!["x-kvgate-gateway-auth".to_owned()]);
        for h in ["content-type", "x-session-id", "accept", "user-agent"] {
            assert!(!trusted(h), "{h}");
        }
    }
}
