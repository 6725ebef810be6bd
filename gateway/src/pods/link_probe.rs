//! Link probes: before a P->D pair's first split, the gateway has the decode worker time a sample of the link from
//! the prefill worker (`POST /kvgate/v1/kv-probe` on D with the peer and grant headers a split carries; the worker's
//! `transfer::import::probe`), so the cost model weighs the pair's measured rate rather than
//! `--split-bandwidth-prior-gbps`. D's next report carries the sample as it would a transfer's; the registry's
//! moving average takes it from there.
//!
//! Invariants: nothing runs without a report secret or under `--split-policy aggregated`; at most
//! [`PROBES_PER_TICK`] start per upkeep tick, a pair is retried no sooner than [`PROBE_RETRY`], and the memory of
//! tried pairs is bounded ([`MAX_REMEMBERED`], forgotten wholesale past it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::header::{HeaderValue, AUTHORIZATION};
use kvgate_router::registry::pd::UnmeasuredLink;

use super::PodsHost;

/// Probes started per upkeep tick (`--probe-interval`).
pub const PROBES_PER_TICK: usize = 2;
/// Soonest a pair still unmeasured is probed again.
pub const PROBE_RETRY: Duration = Duration::from_secs(60);
/// Longest a probe call may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(15);
/// Most pairs remembered as tried.
pub const MAX_REMEMBERED: usize = 4096;

/// The pairs tried, by decode worker and prefill peer.
#[derive(Default)]
pub struct LinkProbes {
    tried: HashMap<(u64, String), Instant>,
}

impl LinkProbes {
    /// Of `links`, the ones to probe now (at most [`PROBES_PER_TICK`]); they count as tried at `now`.
    pub fn due(&mut self, links: Vec<UnmeasuredLink>, now: Instant) -> Vec<UnmeasuredLink> {
        if self.tried.len() >= MAX_REMEMBERED {
            self.tried.clear();
        }
        let mut out = Vec::new();
        for l in links {
            if out.len() == PROBES_PER_TICK {
                break;
            }
            let key = (l.decode.uid, l.peer.clone());
            if self.tried.get(&key).is_some_and(|at| now.duration_since(*at) < PROBE_RETRY) {
                continue;
            }
            self.tried.insert(key, now);
            out.push(l);
        }
        out
    }
}

/// Starts the probes due (called from the control runtime's upkeep).
pub fn start<H: PodsHost>(state: &Arc<H>, probes: &mut LinkProbes) {
    let Some(secret) = state.cfg().report_secret.clone() else { return };
    if state.split_policy() == "aggregated" {
        return;
    }
    let now = Instant::now();
    let links = state.registry().unmeasured_links(now, 4 * PROBES_PER_TICK);
    for l in probes.due(links, now) {
        let s = state.clone();
        let secret = secret.clone();
        tokio::spawn(async move { probe(s.as_ref(), &secret, &l).await });
    }
}

async fn probe(state: &impl PodsHost, secret: &str, l: &UnmeasuredLink) {
    let mut req = hyper::Request::post(format!("{}/kvgate/v1/kv-probe", l.decode_url));
    // A probe's grant names no prompt and no decode worker: it cannot stand for a split.
    let g = kvgate_shared::handoff::GrantFor { model: &l.model, peer: &l.peer, decode: "", prompt: &[] };
    for (name, value) in crate::serve::outbound::split_headers(secret, &g) {
        req = req.header(name, value);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("Bearer {}", kvgate_shared::handoff::gateway_token(secret)))
    {
        req = req.header(AUTHORIZATION, v);
    }
    let Ok(req) = req.body(http_body_util::Full::new(bytes::Bytes::new())) else { return };
    let outcome = match tokio::time::timeout(PROBE_TIMEOUT, state.client().request(req)).await {
        Ok(Ok(r)) if r.status().is_success() => "ok",
        Ok(Ok(r)) => {
            tracing::warn!(decode = %l.decode_url, peer = %l.peer, status = %r.status(), "link probe refused");
            "refused"
        }
        Ok(Err(e)) => {
            tracing::warn!(decode = %l.decode_url, peer = %l.peer, error = %e, "link probe failed");
            "failed"
        }
        Err(_) => "timeout",
    };
    tracing::debug!(decode = %l.decode_url, peer = %l.peer, outcome, "link probe");
    metrics::counter!("kvgate_gateway_link_probes_total", "outcome" => outcome).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_router::registry::WorkerRef;

    fn link(uid: u64, peer: &str) -> UnmeasuredLink {
        UnmeasuredLink {
            decode: WorkerRef { idx: 0, uid },
            decode_url: "http://d".into(),
            model: "m".into(),
            peer: peer.into(),
        }
    }

    #[test]
    fn a_pair_is_probed_a_few_at_a_time_and_not_again_before_the_retry() {
        let mut p = LinkProbes::default();
        let t0 = Instant::now();
        let all = || vec![link(1, "a"), link(1, "b"), link(2, "a")];
        let first: Vec<_> = p.due(all(), t0).into_iter().map(|l| (l.decode.uid, l.peer)).collect();
        assert_eq!(first, [(1, "a".to_owned()), (1, "b".to_owned())]);
        let next: Vec<_> =
            p.due(all(), t0 + Duration::from_secs(2)).into_iter().map(|l| l.decode.uid).collect();
        assert_eq!(next, [2], "the tried pairs wait out the retry");
        assert!(p.due(all(), t0 + Duration::from_secs(3)).is_empty());
        assert_eq!(p.due(all(), t0 + PROBE_RETRY + Duration::from_secs(1)).len(), PROBES_PER_TICK);
    }

    #[test]
    fn the_memory_of_tried_pairs_is_bounded() {
        let mut p = LinkProbes::default();
        let t0 = Instant::now();
        for i in 0..(MAX_REMEMBERED as u64 + 10) {
            p.due(vec![link(i, "a")], t0);
            assert!(p.tried.len() <= MAX_REMEMBERED);
        }
    }
}
