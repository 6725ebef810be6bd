//! The budget invariant of a chaos run: what each tenant and class was charged, summed over both gateway replicas
//! and every life of each, against what the workers computed for it. Pure: the counters come in as scraped (the
//! executor scrapes a replica or a worker just before it kills it, and everything at the end), the requests as the
//! clients saw them.
//!
//! The gateway charges a request what was computed for it (`gateway/src/serve/charge.rs`): a completed answer its
//! usage, `prompt - cached + completion`, which is the worker's own report of it; a pass-through call answered
//! without usage its price, the prompt tokens it was priced with (`x-kvgate-prompt-tokens`: it generates nothing).
//! So, per tenant and class:
//! - **nothing charged never**: the charge is at least what the completed requests cost ([`Tally::exact`]) plus
//!   a token for every other one the gateway must have charged something ([`Tally::least`]: a stream that sent its
//!   first token, then was abandoned, computed its prompt's last token and that one), unless its replica died
//!   around it;
//! - **nothing charged twice**: the charge is at most that plus, for every other request of the tenant (cut short,
//!   abandoned, failed, one whose replica died around it), the most it may be charged ([`Tally::open`]: the prompt
//!   the gateway priced it with plus its `max_tokens`; nothing for one the gateway never got, refused at admission
//!   or answered with a worker's error, which are refunded; the body's bytes for the prompt when the gateway's head
//!   never came);
//! - **workers agree**: the workers' computed tokens (uncached prompt plus completion, summed over every worker life)
//!   differ from the charges of what they computed (all charges but the exact ones of pass-through calls, which
//!   no worker counts) by at most every open request's bound (a request's tokens a killed worker computed but
//!   never counted are open too).
//!
//! Exact equality is out of reach by design: a stream the client leaves is charged its prompt and the tokens
//! sent, the worker counts the tokens it computed before it saw the abort. The bound says how far apart they may be.

use std::collections::BTreeMap;

use serde::Serialize;

use super::ledger::{Outcome, RequestKind, Violation};

/// A stretch in which a process's counters may have missed requests: from its last scrape to its kill.
#[derive(Clone, Debug, Serialize)]
pub struct Blind {
    /// `gateway-<i>` or a worker id (`w<i>`).
    pub process: String,
    pub from_s: f64,
    pub to_s: f64,
}

/// Counters as scraped, summed over every life of every process.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Counters {
    /// Tokens charged per (tenant, class).
    pub charged: BTreeMap<(String, String), f64>,
    /// The workers' uncached prompt plus completion tokens.
    pub computed: f64,
}

/// One tenant and class: what the checks compared.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Tally {
    pub tenant: String,
    pub class: String,
    pub charged: f64,
    /// What the completed requests the gateway saw end cost (`prompt - cached + completion`; a pass-through
    /// call's price).
    pub exact: f64,
    pub exact_requests: usize,
    /// The most the other requests may have been charged, and how many they are (for a class: those whose class
    /// the answer named; the others are the tenant's `"?"` row).
    pub open: f64,
    pub open_requests: usize,
    /// The least the other requests must have been charged ([`least`]).
    pub least: f64,
}

/// The least an open request must have been charged: a token for an abandoned stream whose first token came (its
/// prompt's last token and the first output token were computed), none for one whose replica died around it or
/// that failed.
fn least(o: &Outcome, blind: &[Blind]) -> f64 {
    let replica = format!("gateway-{}", o.replica);
    if o.code.is_some() || blind.iter().any(|b| b.process == replica && overlaps(o, b)) {
        return 0.0;
    }
    match o.kind {
        RequestKind::Abandoned if o.ttft_s.is_some() => 1.0,
        _ => 0.0,
    }
}

fn overlaps(o: &Outcome, b: &Blind) -> bool {
    o.start_s <= b.to_s && o.end_s >= b.from_s
}

/// What a completed request was charged, or `None` for an open one.
fn exact_usage(o: &Outcome, blind: &[Blind]) -> Option<f64> {
    if o.code.is_some() {
        return None;
    }
    let replica = format!("gateway-{}", o.replica);
    if blind.iter().any(|b| b.process == replica && overlaps(o, b)) {
        return None;
    }
    let Some(p) = o.prompt_tokens else {
        // An answered pass-through call carries no usage: it is charged its price, the prompt it was priced with.
        return o
            .priced_prompt
            .filter(|_| o.kind == RequestKind::PassThrough && o.status == 200)
            .map(|p| p as f64);
    };
    let c = o.completion_tokens?;
    Some(p.saturating_sub(o.cached_tokens.unwrap_or(0)).saturating_add(c) as f64)
}

/// The exact charges of pass-through calls: no worker counts them as computed tokens.
fn uncomputed(outcomes: &[Outcome], blind: &[Blind]) -> f64 {
    outcomes
        .iter()
        .filter(|o| o.kind == RequestKind::PassThrough && o.prompt_tokens.is_none())
        .filter_map(|o| exact_usage(o, blind))
        .sum()
}

/// Per (tenant, class) tallies: `tenant(i)` names tenant `i` as the gateway does.
pub fn tallies(
    outcomes: &[Outcome],
    c: &Counters,
    blind: &[Blind],
    tenant: &dyn Fn(usize) -> String,
) -> Vec<Tally> {
    let mut rows: BTreeMap<(String, String), Tally> = BTreeMap::new();
    fn row(rows: &mut BTreeMap<(String, String), Tally>, tenant: String, class: String) -> &mut Tally {
        rows.entry((tenant.clone(), class.clone())).or_insert_with(|| Tally {
            tenant,
            class,
            ..Tally::default()
        })
    }
    for ((t, class), v) in &c.charged {
        row(&mut rows, t.clone(), class.clone()).charged += v;
    }
    for o in outcomes {
        let class = o.class.clone().unwrap_or_else(|| "?".into());
        let r = row(&mut rows, tenant(o.tenant), class);
        match exact_usage(o, blind) {
            Some(u) if r.class != "?" => {
                r.exact += u;
                r.exact_requests += 1;
            }
            _ => {
                r.open += o.most_charged as f64;
                r.open_requests += 1;
                r.least += least(o, blind);
            }
        }
    }
    rows.into_values().collect()
}

/// The violations of the budget invariant (module docs).
pub fn check(
    outcomes: &[Outcome],
    c: &Counters,
    blind: &[Blind],
    tenant: &dyn Fn(usize) -> String,
) -> Vec<Violation> {
    let rows = tallies(outcomes, c, blind, tenant);
    let mut out = Vec::new();
    let v = |invariant, detail| Violation { invariant, request: 0, detail, fault: None };
    let mut per_tenant: BTreeMap<&str, (f64, f64, f64)> = BTreeMap::new();
    for r in &rows {
        if r.charged + 0.5 < r.exact + r.least {
            out.push(v(
                "charged_never",
                format!(
                    "tenant {} class {}: charged {:.0}, but its {} completed requests used {:.0} and {:.0} more \
                     must have been charged for the others",
                    r.tenant, r.class, r.charged, r.exact_requests, r.exact, r.least
                ),
            ));
        }
        let t = per_tenant.entry(&r.tenant).or_default();
        *t = (t.0 + r.charged, t.1 + r.exact, t.2 + r.open);
    }
    for (t, (charged, exact, open)) in &per_tenant {
        if *charged > exact + open + 0.5 {
            out.push(v(
                "charged_twice",
                format!("tenant {t}: charged {charged:.0}, more than its completed requests' {exact:.0} plus the {open:.0} the others may cost"),
            ));
        }
    }
    let charged: f64 = rows.iter().map(|r| r.charged).sum::<f64>() - uncomputed(outcomes, blind);
    let open: f64 = rows.iter().map(|r| r.open).sum::<f64>() + worker_blind(outcomes, blind);
    if (charged - c.computed).abs() > open + 0.5 {
        out.push(v(
            "workers_computed_what_was_charged",
            format!(
                "charged {charged:.0} for what workers computed (pass-through calls' prices taken out), the workers \
                 computed {:.0}: apart by more than the {open:.0} that requests cut short or around a kill may explain",
                c.computed
            ),
        ));
    }
    out
}

/// The bound of the completed requests a killed worker may have served without counting them (they are exact on
/// the gateway's side, so not in any tally's `open`).
fn worker_blind(outcomes: &[Outcome], blind: &[Blind]) -> f64 {
    outcomes
        .iter()
        .filter(|o| o.kind != RequestKind::PassThrough && exact_usage(o, blind).is_some())
        .filter(|o| blind.iter().any(|b| o.worker.as_deref() == Some(b.process.as_str()) && overlaps(o, b)))
        .map(|o| o.most_charged as f64)
        .sum()
}

/// Reads `kvgate_gateway_tenant_tokens_charged_total{class="..",tenant=".."} v` lines into `into`.
pub fn add_charged(metrics: &str, into: &mut Counters) {
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("kvgate_gateway_tenant_tokens_charged_total{") else { continue };
        let Some((labels, value)) = rest.split_once("} ") else { continue };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\""))?.strip_suffix('"').map(str::to_owned))
        };
        if let (Some(class), Some(tenant), Ok(v)) =
            (label("class"), label("tenant"), value.trim().parse::<f64>())
        {
            *into.charged.entry((tenant, class)).or_default() += v;
        }
    }
}

/// Adds a worker's `prompt - cached + completion` counters to `into`.
pub fn add_computed(metrics: &str, into: &mut Counters) {
    let m = |name: &str| {
        metrics.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok()).unwrap_or(0.0)
    };
    into.computed += m("kvgate_worker_prompt_tokens_total ") - m("kvgate_worker_cached_prompt_tokens_total ")
        + m("kvgate_worker_completion_tokens_total ");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::ledger::tests::o;

    fn done(id: u64, tenant: usize, replica: usize, usage: (u64, u64, u64), class: &str) -> Outcome {
        Outcome {
            tenant,
            replica,
            prompt_tokens: Some(usage.0),
            cached_tokens: Some(usage.1),
            completion_tokens: Some(usage.2),
            class: Some(class.into()),
            worker: Some("w0".into()),
            most_charged: 500,
            ..o(id, RequestKind::Chat, 1.0, 2.0, None)
        }
    }

    fn counters(charged: &[(&str, &str, f64)], computed: f64) -> Counters {
        Counters {
            charged: charged.iter().map(|(t, c, v)| ((t.to_string(), c.to_string()), *v)).collect(),
            computed,
        }
    }

    fn names(v: &[Violation]) -> Vec<&str> {
        v.iter().map(|v| v.invariant).collect()
    }

    #[test]
    fn charges_match_usage_within_what_open_requests_may_cost() {
        let t = |i: usize| format!("t{i}");
        let cut = Outcome {
            most_charged: 300,
            class: Some("short".into()),
            ..o(3, RequestKind::Abandoned, 1.0, 2.0, None)
        };
        let runs = vec![done(1, 0, 0, (100, 40, 10), "short"), done(2, 0, 1, (50, 0, 5), "short"), cut];
        // Exact usage 70 + 55; the abandoned stream may cost up to 300.
        assert!(check(&runs, &counters(&[("t0", "short", 125.0)], 125.0), &[], &t).is_empty());
        assert!(check(&runs, &counters(&[("t0", "short", 400.0)], 380.0), &[], &t).is_empty());
        assert_eq!(
            names(&check(&runs, &counters(&[("t0", "short", 100.0)], 100.0), &[], &t)),
            ["charged_never"]
        );
        assert_eq!(
            names(&check(&runs, &counters(&[("t0", "short", 500.0)], 500.0), &[], &t)),
            ["charged_twice"]
        );
        // The abandoned stream sent its first token: charged nothing for it, the tenant was charged too little.
        let mut sent = runs.clone();
        sent[2].ttft_s = Some(0.2);
        assert_eq!(
            names(&check(&sent, &counters(&[("t0", "short", 125.0)], 125.0), &[], &t)),
            ["charged_never"]
        );
        assert!(check(&sent, &counters(&[("t0", "short", 127.0)], 127.0), &[], &t).is_empty());
        // Without the open request: the workers computed less than was charged.
        let v = check(&runs[..2], &counters(&[("t0", "short", 125.0)], 100.0), &[], &t);
        assert_eq!(names(&v), ["workers_computed_what_was_charged"]);
        // Another tenant's charge is compared with that tenant's requests: none.
        let v = check(&runs, &counters(&[("t0", "short", 125.0), ("t1", "short", 50.0)], 175.0), &[], &t);
        assert_eq!(names(&v), ["charged_twice"], "{v:?}");
    }

    #[test]
    fn an_answered_pass_through_call_costs_its_priced_prompt_which_no_worker_computes() {
        let t = |i: usize| format!("t{i}");
        let call = Outcome {
            priced_prompt: Some(12),
            class: Some("short".into()),
            most_charged: 12,
            ..o(2, RequestKind::PassThrough, 1.0, 1.1, None)
        };
        let runs = vec![done(1, 0, 0, (100, 40, 10), "short"), call];
        let rows = tallies(&runs, &counters(&[("t0", "short", 82.0)], 70.0), &[], &t);
        assert_eq!((rows[0].exact, rows[0].exact_requests, rows[0].open_requests), (82.0, 2, 0));
        // Charged exactly: the chat's usage and the call's price; the workers computed the chat alone.
        assert!(check(&runs, &counters(&[("t0", "short", 82.0)], 70.0), &[], &t).is_empty());
        for wrong in [70.0, 83.0] {
            assert!(!check(&runs, &counters(&[("t0", "short", wrong)], 70.0), &[], &t).is_empty(), "{wrong}");
        }
        assert_eq!(
            names(&check(&runs, &counters(&[("t0", "short", 82.0)], 82.0), &[], &t)),
            ["workers_computed_what_was_charged"]
        );
    }

    #[test]
    fn a_replica_killed_around_a_request_leaves_it_open() {
        let t = |i: usize| format!("t{i}");
        let runs = vec![done(1, 0, 0, (100, 0, 10), "short"), done(2, 0, 1, (100, 0, 10), "short")];
        // Replica 1's counters died with it after request 2 ended but before they were scraped again.
        let blind = [Blind { process: "gateway-1".into(), from_s: 1.5, to_s: 1.6 }];
        assert!(check(&runs, &counters(&[("t0", "short", 110.0)], 220.0), &blind, &t).is_empty());
        let rows = tallies(&runs, &counters(&[("t0", "short", 110.0)], 220.0), &blind, &t);
        assert_eq!((rows[0].exact_requests, rows[0].open_requests), (1, 1));
        // A worker killed around request 1: its counters may lack it, the gateway's may not.
        let blind = [Blind { process: "w0".into(), from_s: 1.9, to_s: 2.0 }];
        assert!(check(&runs, &counters(&[("t0", "short", 220.0)], 110.0), &blind, &t).is_empty());
        assert_eq!(
            names(&check(&runs, &counters(&[("t0", "short", 110.0)], 110.0), &blind, &t)),
            ["charged_never"]
        );
    }

    #[test]
    fn counters_are_read_from_the_exposition() {
        let mut c = Counters::default();
        let g = "# TYPE x counter\nkvgate_gateway_tenant_tokens_charged_total{class=\"short\",tenant=\"t1\"} 42\n\
                 kvgate_gateway_class_tokens_charged_total{class=\"short\"} 42\n";
        add_charged(g, &mut c);
        add_charged(g, &mut c);
        assert_eq!(c.charged.get(&("t1".to_string(), "short".to_string())), Some(&84.0));
        let w = "kvgate_worker_prompt_tokens_total 100\nkvgate_worker_cached_prompt_tokens_total 30\n\
                 kvgate_worker_completion_tokens_total 7\n";
        add_computed(w, &mut c);
        assert_eq!(c.computed, 77.0);
    }
}
