//! An attempt's request: the buffered body posted to the worker (a vLLM pod's data-parallel rank as the gateway's
//! header, never a client's), and the wait for the response head within the first-byte timeout, unless the client
//! leaves first.

use std::time::Instant;

use http_body_util::Full;
use hyper::body::Incoming;

use super::{Attempt, Outcome};
use crate::errors::ApiError;
use crate::serve::downstream::{unless_client_leaves, Downstream};
use crate::HttpClient;

/// The worker's response head arrived.
pub(super) struct Sent {
    pub response: hyper::Response<Incoming>,
    /// When the request went out.
    pub at: Instant,
}

pub(super) async fn send<D: Downstream>(
    client: &HttpClient,
    down: &mut D,
    a: &Attempt<'_>,
) -> Result<Sent, Outcome> {
    // A vLLM pod's data-parallel rank is a worker of its own (`pods::dp_rank`): the pod's URL, the rank's header.
    // The rank is the gateway's choice alone: a client's header of that name is never passed on.
    let (base, rank) = crate::pods::dp_rank::split(a.url);
    let mut req = hyper::Request::post(format!("{}{}", base.trim_end_matches('/'), a.path))
        .header("content-type", "application/json");
    for (name, value) in a.headers {
        if name.as_str() != crate::pods::dp_rank::RANK_HEADER {
            req = req.header(name, value);
        }
    }
    if let Some(r) = rank {
        req = req.header(crate::pods::dp_rank::RANK_HEADER, r);
    }
    let req = req
        .body(Full::new(a.body.clone()))
        .map_err(|e| Outcome::Failed(ApiError::internal(e.to_string())))?;
    let at = Instant::now();
    let waited = unless_client_leaves(down, tokio::time::timeout(a.first_byte_timeout, client.request(req)));
    let response = match waited.await {
        None => return Err(Outcome::ClientGone),
        Some(Err(_)) => return Err(Outcome::TimedOut),
        // Before any response byte the request had no effect the client saw: another worker may serve it (an LLM
        // request has no side effects; at worst the first worker computed a prefill for nothing).
        Some(Ok(Err(e))) => return Err(Outcome::ConnectFailed(e.to_string())),
        Some(Ok(Ok(r))) => r,
    };
    metrics::histogram!("kvgate_gateway_upstream_first_byte_seconds", "path" => a.path_label())
        .record(at.elapsed().as_secs_f64());
    Ok(Sent { response, at })
}
