//! The one routing entry point. The gateway's proxy, `POST /admin/v1/route/explain` and the simulator all decide
//! through [`Router`], so a decision explained, simulated or served is the same function of the same state.
//!
//! A request is routed in two steps around admission:
//! 1. [`Router::dry_run`] prices it: the decision the request would get now, nothing recorded (its predicted
//!    cached tokens give the admission cost); explain shows exactly this, with the tie-break the next routed
//!    request will get;
//! 2. after admission (which may wait), [`Router::route`] decides again on fresh state and records the send
//!    (in-flight count, uncached tokens, overlay) to the pick, under the caller's one registry lock, so requests
//!    released together see each other's sends.
//!
//! A fallback attempt after a refused connection records its send with [`Router::record_fallback`] (its own
//! uncached tokens, from its own prefix match).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::registry::{Registry, RootStarts, SentTicket, WorkerRef};
use crate::routing::least_load::LeastLoad;
use crate::routing::{RequestView, RouteReason, RoutingPolicy, ScoreTerms};
use crate::split::plan::{plan, SplitAsk, SplitPlan};
use crate::split::Choice;

pub use crate::input::RouteInput;

/// A worker the request may go to.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub wref: WorkerRef,
    pub id: String,
    pub url: String,
    /// A kvgate worker (it has reported): it understands the gateway's assertion and token.
    pub reports: bool,
    /// Its latest report's scheme fingerprint is the gateway's for the model: it may be handed token ids.
    pub fingerprint_ok: bool,
}

/// A routing decision.
#[derive(Clone, Debug)]
pub struct Routed {
    /// Best first: the pick, then the fallbacks (at most the `max_candidates` asked for).
    pub candidates: Vec<Candidate>,
    pub reason: RouteReason,
    /// Predicted cached prompt tokens on the pick.
    pub predicted_cached_tokens: usize,
    /// Uncached prompt tokens on the pick (the admission cost's prompt part and the load the send adds).
    pub uncached_tokens: u64,
    /// Every candidate worker's score terms (policies that score).
    pub terms: Vec<ScoreTerms>,
    /// The request's number at this router (its tie-break).
    pub seq: u64,
    /// The send recorded to the pick ([`Router::route`] only); hand it to [`Registry::record_done`] at the end.
    pub ticket: Option<SentTicket>,
    /// The split considered (when asked and a pair exists), chosen or not.
    pub split: Option<SplitPlan>,
    /// A chosen split's prefill worker: the first candidate is then its decode worker, and the rest serve the
    /// request whole (fallbacks recompute).
    pub prefill: Option<Candidate>,
    /// The prefill share recorded to it ([`Router::route`] only).
    pub prefill_ticket: Option<SentTicket>,
}

impl Routed {
    /// The request is split: its first candidate imports the prompt's KV from [`Routed::prefill`].
    pub fn is_split(&self) -> bool {
        self.prefill.is_some()
    }
}

/// A routing policy and the request counter that feeds its tie-breaks.
pub struct Router {
    policy: Box<dyn RoutingPolicy>,
    next_seq: AtomicU64,
}

impl Router {
    pub fn new(policy: Box<dyn RoutingPolicy>) -> Self {
        Self { policy, next_seq: AtomicU64::new(0) }
    }

    pub fn policy(&self) -> &dyn RoutingPolicy {
        self.policy.as_ref()
    }

    /// The decision `input` would get now, with the tie-break of the next routed request; nothing is recorded.
    pub fn dry_run(
        &self,
        reg: &Registry,
        input: &RouteInput<'_>,
        max_candidates: usize,
        now: Instant,
    ) -> Option<Routed> {
        self.dry_run_split(reg, input, max_candidates, None, now)
    }

    /// [`Router::dry_run`], considering a split as `split` asks.
    pub fn dry_run_split(
        &self,
        reg: &Registry,
        input: &RouteInput<'_>,
        max_candidates: usize,
        split: Option<&SplitAsk<'_>>,
        now: Instant,
    ) -> Option<Routed> {
        let seq = self.next_seq.load(Ordering::Relaxed);
        decide(self.policy.as_ref(), reg, input, seq, max_candidates, split, now)
    }

    /// Decides on the registry as it is now and records the send to the pick. `None`: no healthy worker serves
    /// the model.
    pub fn route(
        &self,
        reg: &mut Registry,
        input: &RouteInput<'_>,
        max_candidates: usize,
        now: Instant,
    ) -> Option<Routed> {
        self.route_split(reg, input, max_candidates, None, now)
    }

    /// [`Router::route`], considering a split as `split` asks. A split records the prefill (its uncached
    /// tokens) to the prefill worker and a send of no prefill tokens to the decode worker (both hold the prompt's
    /// KV afterwards).
    pub fn route_split(
        &self,
        reg: &mut Registry,
        input: &RouteInput<'_>,
        max_candidates: usize,
        split: Option<&SplitAsk<'_>>,
        now: Instant,
    ) -> Option<Routed> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let mut routed = decide(self.policy.as_ref(), reg, input, seq, max_candidates, split, now)?;
        let pick = reg.find(routed.candidates.first()?.wref)?;
        let pick_tokens = if routed.is_split() { 0 } else { routed.uncached_tokens };
        routed.ticket = Some(reg.record_sent(pick, input.hashes, pick_tokens, now));
        reg.record_session(pick, input.session_key, now);
        let starts = self.root_starts(input, seq);
        reg.record_root(pick, input.hashes, starts);
        if let Some(p) = routed.prefill.as_ref().and_then(|p| reg.find(p.wref)) {
            routed.prefill_ticket = Some(reg.record_sent(p, input.hashes, routed.uncached_tokens, now));
            reg.record_root(p, input.hashes, starts);
        }
        Some(routed)
    }
}

impl Router {
    /// Decides by load alone, whatever the policy (requests whose prompt the gateway does not read: embeddings,
    /// rerank, tokenize, passed through), and records the send (in flight, `input.prompt_tokens` uncached) to the
    /// pick. No session or prefix is remembered.
    pub fn route_by_load(
        &self,
        reg: &mut Registry,
        input: &RouteInput<'_>,
        max_candidates: usize,
        now: Instant,
    ) -> Option<Routed> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let policy = LeastLoad::new(crate::routing::Load::DEFAULT_PER_REQUEST_TOKENS);
        let mut routed = decide(&policy, reg, input, seq, max_candidates, None, now)?;
        let pick = reg.find(routed.candidates.first()?.wref)?;
        routed.ticket = Some(reg.record_sent(pick, input.hashes, input.prompt_tokens as u64, now));
        Some(routed)
    }
}

/// Workers of role prefill serve whole requests only as fallbacks: they go to the end of the ranking (the pick's
/// predicted cache follows the pick).
impl Router {
    /// Records a fallback attempt's send to `c` (the whole request on it, after the candidates before it refused
    /// or failed): its uncached tokens are what this worker lacks of the prompt now (its own prefix match through
    /// the tiers, not the first pick's), and they are returned for its first-byte budget and its charge. `None`:
    /// the worker was forgotten since the decision.
    pub fn record_fallback(
        &self,
        reg: &mut Registry,
        c: &Candidate,
        input: &RouteInput<'_>,
        now: Instant,
    ) -> Option<(SentTicket, u64)> {
        let i = reg.find(c.wref)?;
        let (views, index) = reg.views(input.model, input.hashes, None, now);
        let held = index
            .iter()
            .position(|&j| j == i)
            .map_or(0, |v| views[v].tier_match(input.hashes).through_disk * input.block_size);
        let uncached = input.prompt_tokens.saturating_sub(held) as u64;
        let ticket = reg.record_sent(i, input.hashes, uncached, now);
        reg.record_root(i, input.hashes, self.root_starts(input, 0));
        Some((ticket, uncached))
    }

    /// Where the request's roots start ([`root_starts`]).
    fn root_starts(&self, input: &RouteInput<'_>, seq: u64) -> RootStarts {
        let req = RequestView {
            hashes: input.hashes,
            prompt_tokens: input.prompt_tokens,
            session_key: input.session_key,
            shared_blocks: input.shared_blocks,
            seq,
            output_tokens: input.output_tokens,
            slo: input.slo,
        };
        root_starts(self.policy.as_ref(), &req, input)
    }
}

/// Where a request's roots start (`registry/roots.rs`): the policy's first credited block
/// (`RoutingPolicy::prefix_root`), and, when the policy credits a prefix other conversations share, the first block
/// past it too: a shared system prompt is held by most workers, so its root names no conversation's holder (the
/// holders kept under a root are bounded), while the conversation's own first block does.
fn root_starts(policy: &dyn RoutingPolicy, req: &RequestView<'_>, input: &RouteInput<'_>) -> RootStarts {
    let first = policy.prefix_root(req, input.block_size);
    let past_shared = first
        .filter(|f| *f < input.shared_blocks && input.shared_blocks < input.hashes.len())
        .map(|_| input.shared_blocks);
    [first, past_shared]
}

fn prefill_workers_last(
    reg: &Registry,
    index: &[usize],
    views: &[crate::routing::WorkerView<'_>],
    input: &RouteInput<'_>,
    d: &mut crate::routing::Decision,
) {
    let prefill_only = |v: &usize| {
        reg.workers()[index[*v]]
            .report
            .as_ref()
            .is_some_and(|r| r.pd.role == kvgate_shared::report::Role::Prefill)
    };
    if !d.ranked.iter().any(prefill_only) {
        return;
    }
    let first = d.ranked.first().copied();
    let (mut ranked, last): (Vec<usize>, Vec<usize>) = d.ranked.iter().partition(|v| !prefill_only(v));
    ranked.extend(last);
    if ranked.first().copied() != first {
        if let Some(&v) = ranked.first() {
            d.predicted_cached_tokens =
                (views[v].tier_match(input.hashes).through_disk * input.block_size).min(input.prompt_tokens);
        }
    }
    d.ranked = ranked;
}

fn candidate(reg: &Registry, i: usize) -> Option<Candidate> {
    let w = &reg.workers()[i];
    Some(Candidate {
        wref: reg.worker_ref(i)?,
        id: w.id.clone(),
        url: w.url.clone(),
        reports: w.report.is_some(),
        fingerprint_ok: w.report.is_some() && w.fingerprint_ok == Some(true),
    })
}

fn decide(
    policy: &dyn RoutingPolicy,
    reg: &Registry,
    input: &RouteInput<'_>,
    seq: u64,
    max_candidates: usize,
    split: Option<&SplitAsk<'_>>,
    now: Instant,
) -> Option<Routed> {
    let req = RequestView {
        hashes: input.hashes,
        prompt_tokens: input.prompt_tokens,
        session_key: input.session_key,
        shared_blocks: input.shared_blocks,
        seq,
        output_tokens: input.output_tokens,
        slo: input.slo,
    };
    let starts = root_starts(policy, &req, input);
    let (views, registry_index) =
        reg.focused_views(input.model, input.hashes, input.session_key, starts, now);
    let allowed = |i: usize| {
        let w = &reg.workers()[i];
        input.allows(&w.url) && input.adapter.is_none_or(|a| w.lora.holds(a, now))
    };
    let (views, registry_index) = match (input.only, input.adapter) {
        (None, None) => (views, registry_index),
        _ => views.into_iter().zip(registry_index).filter(|(_, i)| allowed(*i)).unzip(),
    };
    let mut d = policy.choose(&req, &views, reg.ring(), input.block_size)?;
    prefill_workers_last(reg, &registry_index, &views, input, &mut d);
    let considered = split.and_then(|ask| plan(reg, &views, &registry_index, *d.ranked.first()?, input, ask));
    let chosen = considered.as_ref().filter(|s| s.decision.choice == Choice::Split);
    // A split: its decode worker first, then the local ranking (whole requests) as fallbacks.
    let order: Vec<usize> = match chosen {
        Some(s) => std::iter::once(s.decode_view)
            .chain(d.ranked.iter().copied().filter(|v| *v != s.decode_view))
            .collect(),
        None => d.ranked.clone(),
    };
    let candidates: Vec<Candidate> = order
        .iter()
        .take(max_candidates.max(1))
        .filter_map(|&view| candidate(reg, registry_index[view]))
        .collect();
    if candidates.is_empty() {
        return None;
    }
    let (prefill, predicted) = match chosen {
        Some(s) => (
            candidate(reg, registry_index[s.prefill_view]),
            input.prompt_tokens.saturating_sub(s.input.prefill.uncached_tokens as usize),
        ),
        None => (None, d.predicted_cached_tokens),
    };
    Some(Routed {
        candidates,
        reason: d.reason,
        predicted_cached_tokens: predicted,
        uncached_tokens: input.prompt_tokens.saturating_sub(predicted) as u64,
        terms: d.terms,
        seq,
        ticket: None,
        split: considered,
        prefill,
        prefill_ticket: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::RegistryConfig;
    use crate::routing::{policy_by_name, Weights};
    use kvgate_shared::hashing::BlockHash;

    fn registry(n: usize) -> Registry {
        let mut reg = Registry::new(RegistryConfig::default());
        for i in 0..n {
            reg.add_static(&format!("http://w{i}.invalid"));
        }
        reg
    }

    fn input(hashes: &[BlockHash]) -> RouteInput<'_> {
        RouteInput {
            model: "m",
            hashes,
            prompt_tokens: hashes.len() * 16,
            session_key: 0,
            shared_blocks: 0,
            block_size: 16,
            only: None,
            adapter: None,
            output_tokens: 0,
            slo: crate::routing::Slo::default(),
        }
    }

    #[test]
    fn a_dry_run_decides_as_the_next_routed_request_and_records_nothing() {
        for policy in ["cache_aware", "round_robin", "least_load", "consistent_hash"] {
            let router = Router::new(policy_by_name(policy, Weights::default()).expect("policy"));
            let mut reg = registry(4);
            let now = Instant::now();
            let hashes: Vec<BlockHash> = (1..=8).map(BlockHash).collect();
            for _ in 0..3 {
                let dry = router.dry_run(&reg, &input(&hashes), 4, now).expect("dry");
                assert!(dry.ticket.is_none());
                let loads: Vec<_> = reg.workers().iter().map(|w| w.load(now)).collect();
                let again = router.dry_run(&reg, &input(&hashes), 4, now).expect("dry");
                assert_eq!(again.candidates, dry.candidates, "{policy}: a dry run changes nothing");
                assert_eq!(loads, reg.workers().iter().map(|w| w.load(now)).collect::<Vec<_>>());
                let real = router.route(&mut reg, &input(&hashes), 4, now).expect("route");
                assert_eq!(
                    real.candidates, dry.candidates,
                    "{policy}: same state, same tie-break, same pick"
                );
                assert_eq!(real.seq, dry.seq);
                assert!(real.ticket.is_some());
            }
        }
    }

    #[test]
    fn requests_routed_together_see_each_others_sends() {
        // Four cold requests released at the same instant (e.g. by admission): each decision sees the sends
        // before it, so least_load spreads them instead of sending all four to the one idle-looking worker.
        let router = Router::new(policy_by_name("least_load", Weights::default()).expect("policy"));
        let mut reg = registry(4);
        let now = Instant::now();
        let mut picks: Vec<String> = (0..4u64)
            .map(|i| {
                let hashes: Vec<BlockHash> = (0..64).map(|b| BlockHash(b * 1000 + i)).collect();
                let r = router.route(&mut reg, &input(&hashes), 1, now).expect("route");
                r.candidates[0].id.clone()
            })
            .collect();
        picks.sort();
        picks.dedup();
        assert_eq!(picks.len(), 4, "{picks:?}");
        let inflight: u64 = reg.workers().iter().map(|w| w.load(now).requests).sum();
        assert_eq!(inflight, 4);
        for t in reg.workers().iter().map(|w| w.load(now).pending_tokens) {
            assert_eq!(t, 64 * 16, "every send counted its uncached tokens");
        }
    }

    #[test]
    fn a_fallback_is_recorded_with_its_own_uncached_tokens() {
        // The prompt was routed to one worker (its overlay holds it); a fallback to it has nothing to compute,
        // a fallback to a cold worker the whole prompt, whatever the first pick predicted.
        let router = Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy"));
        let mut reg = registry(2);
        let now = Instant::now();
        let hashes: Vec<BlockHash> = (1..=8).map(BlockHash).collect();
        let first = router.route(&mut reg, &input(&hashes), 2, now).expect("route");
        let (warm, cold) = (&first.candidates[0], &first.candidates[1]);
        let (_, u) = router.record_fallback(&mut reg, warm, &input(&hashes), now).expect("warm");
        assert_eq!(u, 0);
        let (t, u) = router.record_fallback(&mut reg, cold, &input(&hashes), now).expect("cold");
        assert_eq!(u, 8 * 16);
        assert_eq!(reg.workers()[t.idx].load(now).pending_tokens, 8 * 16);
    }

    #[test]
    fn a_passed_through_request_goes_to_the_least_loaded_worker_whatever_the_policy() {
        // Under the cache-aware policy a conversation would stick to its worker; by load, the requests spread and
        // each send counts its (estimated) tokens where it went.
        let router = Router::new(policy_by_name("consistent_hash", Weights::default()).expect("policy"));
        let mut reg = registry(3);
        let now = Instant::now();
        let body = RouteInput { prompt_tokens: 100, ..input(&[]) };
        let mut picks: Vec<String> = (0..3)
            .map(|_| router.route_by_load(&mut reg, &body, 1, now).expect("route").candidates[0].id.clone())
            .collect();
        picks.sort();
        picks.dedup();
        assert_eq!(picks.len(), 3, "{picks:?}");
        for w in reg.workers() {
            assert_eq!((w.load(now).requests, w.load(now).pending_tokens), (1, 100));
        }
    }

    #[test]
    fn no_worker_no_decision() {
        let router = Router::new(policy_by_name("cache_aware", Weights::default()).expect("policy"));
        let mut reg = registry(0);
        let hashes: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
        assert!(router.dry_run(&reg, &input(&hashes), 4, Instant::now()).is_none());
        assert!(router.route(&mut reg, &input(&hashes), 4, Instant::now()).is_none());
    }
}
