//! What a chaos run records of each request on the client's side ([`Outcome`]), and the invariants checked against
//! those records and the fault schedule ([`check`]): every request ended within its limit plus a stated slack;
//! an error only of a documented kind (`docs/api.md`'s table, or a connection refused by a replica being
//! restarted); outside a fault's window (widened by the time the fleet needs to notice its end) no error at all,
//! except the 429s of a tenant's own budget burst. Pure: each violation names the request and the fault active.

use serde::Serialize;

use super::schedule::{active_at, Fault, FaultKind};

/// What kind of request it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestKind {
    /// A chat turn, streamed and read to its end.
    Chat,
    /// A streamed chat turn the client abandons after its first chunk.
    Abandoned,
    /// A pass-through call (`/tokenize`).
    PassThrough,
    /// A stream read a byte a second (a slow-clients fault).
    Slow,
    /// A request of a budget burst.
    Burst,
    /// A document every tenant sends word for word (the isolation check).
    Shared,
}

/// One request as the client saw it.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    pub id: u64,
    pub tenant: usize,
    /// The gateway replica it was sent to.
    pub replica: usize,
    pub kind: RequestKind,
    /// Seconds from the start of the run.
    pub start_s: f64,
    pub end_s: f64,
    /// The HTTP status; 0 when there was none (the connection failed).
    pub status: u16,
    /// The error code: the error body's, an SSE error event's, or `connection_failed` / `client_timeout`.
    pub code: Option<String>,
    /// Time to the first token (streams that produced one), seconds.
    pub ttft_s: Option<f64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when the answer carried it.
    pub cached_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// The gateway's `x-kvgate-worker`, `x-kvgate-route` (`split` for a prefill/decode split) and `x-kvgate-class`
    /// of the answer, when its head came.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// The prompt tokens the gateway priced it with (`x-kvgate-prompt-tokens`), when its head came.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priced_prompt: Option<u64>,
    /// The most the gateway may charge it (`drive.rs`'s `Ask::most_charged`): the prompt it priced (else its
    /// body's bytes) plus its `max_tokens`; 0 for a request the gateway never computed anything for.
    pub most_charged: u64,
    /// A shared document's first send by this tenant: no block of it can be in this tenant's cache yet, so any
    /// cached token of it was written under another tenant's salt.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub first_shared: bool,
    /// The same tenant's repeat of a shared document it just sent (the isolation check's positive control: its own
    /// blocks must be found, or the check could not have seen another tenant's).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub repeat_shared: bool,
    /// The repeat right after the tenant's first send of the document, computed whole by the worker that computed
    /// that first send whole (neither split): its blocks are there (outside faults), so it must find them.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub same_place: bool,
}

/// Which send of a shared document a request is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SharedSend {
    /// Not a shared document.
    No,
    /// The tenant's first send of it.
    First,
    /// The tenant's repeat of it; the worker and route that answered its first send when that came right before
    /// (else none: not a control).
    Repeat((Option<String>, Option<String>)),
}

/// The codes a request may end with under faults: `docs/api.md`'s gateway and worker codes that a fault can cause,
/// plus the client's own for a connection a restarting replica refused (`connection_failed`) or a stream it cut
/// (`stream_cut`: no `[DONE]`, no error event).
pub const DOCUMENTED_UNDER_FAULTS: &[&str] = &[
    "class_budget_exceeded",
    "upstream_error",
    "upstream_timeout",
    "queue_full",
    "model_loading",
    "shutting_down",
    "engine_stopped",
    "aborted",
    "kv_import_no_room",
    "no_healthy_worker",
    "workers_busy",
    "too_many_connections",
    "connection_failed",
    "stream_cut",
];

/// The limits the run holds requests to.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Limits {
    /// The longest a request may take (the gateway's first-byte cap plus the stream's own length).
    pub request_s: f64,
    /// Added to `request_s` (scheduling on a loaded 2-core machine).
    pub slack_s: f64,
    /// How long after a fault's end its errors still count as the fault's.
    pub settle_s: f64,
}

/// A broken promise.
#[derive(Clone, Debug, Serialize)]
pub struct Violation {
    pub invariant: &'static str,
    pub request: u64,
    pub detail: String,
    /// The fault active when the request started, if any.
    pub fault: Option<Fault>,
}

/// Every violation of the request invariants.
pub fn check(outcomes: &[Outcome], faults: &[Fault], limits: &Limits) -> Vec<Violation> {
    let mut out = Vec::new();
    for o in outcomes {
        let fault = active_at(faults, o.start_s, limits.settle_s)
            .or_else(|| active_at(faults, o.end_s, limits.settle_s))
            .cloned();
        let v =
            |invariant, detail: String| Violation { invariant, request: o.id, detail, fault: fault.clone() };
        let took = o.end_s - o.start_s;
        // A slow client holds its stream as long as it reads; only the fleet's own requests are bounded.
        if o.kind != RequestKind::Slow && took > limits.request_s + limits.slack_s {
            out.push(v(
                "ended_in_time",
                format!("took {took:.1} s, limit {:.1} s", limits.request_s + limits.slack_s),
            ));
        }
        if o.first_shared && o.cached_tokens.unwrap_or(0) > 0 {
            out.push(v(
                "tenant_isolation",
                format!(
                    "tenant t{}'s first send of a shared document found {:?} tokens cached",
                    o.tenant, o.cached_tokens
                ),
            ));
        }
        // Outside faults a repeat answered where the first send was finds its blocks there.
        if o.repeat_shared
            && o.same_place
            && fault.is_none()
            && o.code.is_none()
            && o.cached_tokens == Some(0)
        {
            out.push(v(
                "isolation_control",
                format!(
                    "tenant t{}'s repeat of a shared document it had just sent found nothing cached: the isolation \
                     check could not have seen a leak",
                    o.tenant
                ),
            ));
        }
        let Some(code) = o.code.as_deref() else { continue };
        if o.kind == RequestKind::Burst && code == "class_budget_exceeded" {
            continue; // the burst is over its budget on purpose
        }
        if !DOCUMENTED_UNDER_FAULTS.contains(&code) {
            out.push(v("documented_error", format!("status {} code {code}", o.status)));
        } else if fault.is_none() {
            out.push(v("no_error_outside_faults", format!("status {} code {code}", o.status)));
        } else if code == "class_budget_exceeded"
            && fault.as_ref().is_some_and(|f| f.kind != FaultKind::BudgetBurst)
        {
            out.push(v("no_budget_error_but_a_burst", format!("status {} during {:?}", o.status, fault)));
        }
    }
    out
}

/// How the fleet came back after one fault.
#[derive(Clone, Debug, Serialize)]
pub struct Recovery {
    pub fault: Fault,
    /// Chat turns served per second (completed without error) over the [`BEFORE_S`] before the fault.
    pub rate_before: f64,
    /// Cached / prompt tokens of those turns.
    pub hit_before: f64,
    /// Seconds after the fault's end until a [`WINDOW_S`] window serves at least [`RECOVERED`] of `rate_before`
    /// at a hit rate of at least [`RECOVERED`] of `hit_before` (`None`: not within the run).
    pub recovered_after_s: Option<f64>,
    /// Cached / prompt tokens of the turns in that first recovered window.
    pub hit_after: Option<f64>,
}

/// The stretch before a fault its rate is measured over.
pub const BEFORE_S: f64 = 10.0;
/// The window a recovered rate is measured over.
pub const WINDOW_S: f64 = 3.0;
/// The share of the rate and of the hit rate before that counts as recovered.
pub const RECOVERED: f64 = 0.8;

fn served(outcomes: &[Outcome], from: f64, to: f64) -> (f64, f64) {
    let turns: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.kind == RequestKind::Chat && o.code.is_none() && o.end_s >= from && o.end_s < to)
        .collect();
    let prompt: u64 = turns.iter().filter_map(|o| o.prompt_tokens).sum();
    let cached: u64 = turns.iter().filter_map(|o| o.cached_tokens).sum();
    (turns.len() as f64 / (to - from), if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 })
}

/// Each fault's recovery, measured from the outcomes; `run_end_s`: when the clients stopped.
pub fn recovery(outcomes: &[Outcome], faults: &[Fault], run_end_s: f64) -> Vec<Recovery> {
    faults
        .iter()
        .map(|f| {
            let (rate_before, hit_before) = served(outcomes, (f.start_s - BEFORE_S).max(0.0), f.start_s);
            let mut t = f.end_s;
            let mut found = None;
            while t + WINDOW_S <= run_end_s {
                let (rate, hit) = served(outcomes, t, t + WINDOW_S);
                if rate >= RECOVERED * rate_before && hit >= RECOVERED * hit_before {
                    found = Some((t - f.end_s, hit));
                    break;
                }
                t += 0.5;
            }
            Recovery {
                fault: f.clone(),
                rate_before,
                hit_before,
                recovered_after_s: found.map(|f| f.0),
                hit_after: found.map(|f| f.1),
            }
        })
        .collect()
}

/// The isolation checks (first sends that carried usage) a fault kind saw: started within one of its windows, and
/// within [`AFTER_S`] after one.
#[derive(Clone, Debug, Default, Serialize)]
pub struct IsolationSeen {
    pub during: usize,
    pub after: usize,
    /// Seconds of its windows in all.
    pub window_s: f64,
}

/// How long after a fault's end a check counts as after it.
pub const AFTER_S: f64 = 30.0;
/// A fault kind whose windows add up to at least this long must have seen an isolation check during them, and one
/// after them (a shorter one may fall between two shared sends).
pub const MIN_SEEN_WINDOW_S: f64 = 30.0;

/// Isolation checks by fault kind, and a violation for each kind that ran long enough and saw none during or after.
pub fn isolation_by_fault(
    outcomes: &[Outcome],
    faults: &[Fault],
) -> (std::collections::BTreeMap<String, IsolationSeen>, Vec<Violation>) {
    let mut seen: std::collections::BTreeMap<String, IsolationSeen> = std::collections::BTreeMap::new();
    let checks: Vec<f64> =
        outcomes.iter().filter(|o| o.first_shared && o.cached_tokens.is_some()).map(|o| o.start_s).collect();
    for f in faults {
        let s = seen.entry(f.kind.as_str().to_owned()).or_default();
        s.window_s += f.end_s - f.start_s;
        s.during += checks.iter().filter(|t| (f.start_s..f.end_s).contains(*t)).count();
        s.after += checks.iter().filter(|t| (f.end_s..f.end_s + AFTER_S).contains(*t)).count();
    }
    let violations = seen
        .iter()
        .filter(|(_, s)| s.window_s >= MIN_SEEN_WINDOW_S && (s.during == 0 || s.after == 0))
        .map(|(kind, s)| Violation {
            invariant: "isolation_seen_under_every_fault",
            request: 0,
            detail: format!(
                "{kind}: {} isolation checks during its {:.0} s of windows, {} within {AFTER_S} s after",
                s.during, s.window_s, s.after
            ),
            fault: None,
        })
        .collect();
    (seen, violations)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn o(id: u64, kind: RequestKind, start_s: f64, end_s: f64, code: Option<&str>) -> Outcome {
        Outcome {
            id,
            tenant: 0,
            replica: 0,
            kind,
            start_s,
            end_s,
            status: if code.is_some() { 503 } else { 200 },
            code: code.map(str::to_owned),
            ttft_s: None,
            cached_tokens: None,
            prompt_tokens: None,
            completion_tokens: None,
            worker: None,
            route: None,
            class: None,
            priced_prompt: None,
            most_charged: 0,
            first_shared: false,
            repeat_shared: false,
            same_place: false,
        }
    }

    #[test]
    fn each_invariant_names_its_request_and_the_fault_active() {
        let faults = vec![Fault { kind: FaultKind::KillWorker, target: 1, start_s: 10.0, end_s: 20.0 }];
        let limits = Limits { request_s: 30.0, slack_s: 5.0, settle_s: 3.0 };
        let runs = [
            o(1, RequestKind::Chat, 0.0, 1.0, None),
            o(2, RequestKind::Chat, 12.0, 13.0, Some("upstream_error")),
            o(3, RequestKind::Chat, 21.0, 22.0, Some("no_healthy_worker")), // settling: still the fault's
            o(4, RequestKind::Chat, 30.0, 31.0, Some("upstream_timeout")),
            o(5, RequestKind::Chat, 12.0, 13.0, Some("internal_error")),
            o(6, RequestKind::Chat, 40.0, 80.0, None),
            o(7, RequestKind::Slow, 40.0, 80.0, None),
            o(8, RequestKind::Burst, 40.0, 41.0, Some("class_budget_exceeded")),
            o(9, RequestKind::Chat, 12.0, 13.0, Some("class_budget_exceeded")),
            Outcome {
                first_shared: true,
                cached_tokens: Some(16),
                ..o(10, RequestKind::Shared, 50.0, 51.0, None)
            },
            Outcome {
                first_shared: false,
                cached_tokens: Some(16),
                ..o(11, RequestKind::Shared, 52.0, 53.0, None)
            },
            Outcome {
                first_shared: true,
                cached_tokens: Some(0),
                ..o(12, RequestKind::Shared, 54.0, 55.0, None)
            },
            // The positive control: a repeat that finds its own blocks, one that finds none (the check was blind),
            // and one that finds none during a fault (its worker may have died since the first send).
            Outcome {
                repeat_shared: true,
                same_place: true,
                cached_tokens: Some(48),
                ..o(13, RequestKind::Shared, 56.0, 57.0, None)
            },
            Outcome {
                repeat_shared: true,
                same_place: true,
                cached_tokens: Some(0),
                ..o(14, RequestKind::Shared, 58.0, 59.0, None)
            },
            Outcome {
                repeat_shared: true,
                same_place: true,
                cached_tokens: Some(0),
                ..o(15, RequestKind::Shared, 14.0, 15.0, None)
            },
            // Answered elsewhere than the first send (another route): its blocks need not be there.
            Outcome {
                repeat_shared: true,
                cached_tokens: Some(0),
                ..o(16, RequestKind::Shared, 60.0, 61.0, None)
            },
        ];
        let v = check(&runs, &faults, &limits);
        let got: Vec<(u64, &str)> = v.iter().map(|v| (v.request, v.invariant)).collect();
        assert_eq!(
            got,
            vec![
                (4, "no_error_outside_faults"),
                (5, "documented_error"),
                (6, "ended_in_time"),
                (9, "no_budget_error_but_a_burst"),
                (10, "tenant_isolation"),
                (14, "isolation_control"),
            ]
        );
        assert_eq!(v[1].fault.as_ref().map(|f| f.kind), Some(FaultKind::KillWorker));
        assert!(v[0].fault.is_none());
    }

    #[test]
    fn recovery_is_the_first_window_back_at_the_rate_before() {
        let fault = Fault { kind: FaultKind::KillWorker, target: 0, start_s: 20.0, end_s: 30.0 };
        // 10 turns a second before the fault, 2 during and for 4 s after it, 10 again from 34 s; the hit rate 0.5
        // before, 0.1 from the fault until 36 s (a cold index), 0.5 again after.
        let mut runs = Vec::new();
        let mut id = 0;
        let mut t = 0.0;
        while t < 60.0 {
            let per_s = if (20.0..34.0).contains(&t) { 2 } else { 10 };
            for k in 0..per_s {
                id += 1;
                let end = t + k as f64 / per_s as f64;
                runs.push(Outcome {
                    prompt_tokens: Some(100),
                    cached_tokens: Some(if (20.0..36.0).contains(&t) { 10 } else { 50 }),
                    ..o(id, RequestKind::Chat, end - 0.1, end, None)
                });
            }
            t += 1.0;
        }
        let r = recovery(&runs, &[fault], 60.0);
        assert!((r[0].rate_before - 10.0).abs() < 1e-9 && (r[0].hit_before - 0.5).abs() < 1e-9, "{r:?}");
        // The rate is back from the window at 33.5 s (it holds 34, 35 and half of 33), the hit rate (0.4 or more)
        // from the one at 35.5 s: 5 turns at 0.1, 25 at 0.5.
        let after = r[0].recovered_after_s.expect("recovered");
        assert!((after - 5.5).abs() < 1e-9, "{after}");
        assert!((r[0].hit_after.expect("hit") - 1300.0 / 3000.0).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn every_fault_kind_that_ran_long_enough_saw_isolation_checks_during_and_after() {
        let faults = vec![
            Fault { kind: FaultKind::KillWorker, target: 0, start_s: 10.0, end_s: 30.0 },
            Fault { kind: FaultKind::KillWorker, target: 1, start_s: 100.0, end_s: 115.0 },
            Fault { kind: FaultKind::RestartRedis, target: 0, start_s: 200.0, end_s: 240.0 },
            Fault { kind: FaultKind::FillSsd, target: 0, start_s: 300.0, end_s: 310.0 },
        ];
        let check = |id, t: f64| Outcome {
            first_shared: true,
            cached_tokens: Some(0),
            ..o(id, RequestKind::Shared, t, t + 1.0, None)
        };
        let runs = vec![check(1, 12.0), check(2, 40.0), check(3, 250.0), check(4, 305.0)];
        let (seen, v) = isolation_by_fault(&runs, &faults);
        let k = &seen["kill_worker"];
        assert_eq!((k.during, k.after, k.window_s), (1, 1, 35.0));
        let r = &seen["restart_redis"];
        assert_eq!((r.during, r.after), (0, 1));
        assert_eq!(seen["fill_ssd"].during, 1);
        // Redis ran 40 s with no check during it; the SSD fault's 10 s is too short to require one.
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].detail.starts_with("restart_redis"), "{}", v[0].detail);
    }
}
