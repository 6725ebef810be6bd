//! A chaos run: start the deployment (`deploy.rs`), measure the resources at rest, drive the clients
//! (`drive.rs`) for the run's duration while the fault executor (`execute.rs`) works through the seeded schedule
//! (`schedule.rs`), stop the clients, wait a quiet period, measure again, and check the invariants: the requests'
//! (`ledger.rs`), the charges' (`charges.rs`) and the resources' (every worker's KV blocks free, its queue empty,
//! no transfer lease, import or export staging left; no gateway in-flight count or admission permit; file
//! descriptors and resident memory of the processes that ran throughout within stated bounds of the start).
//! Writes `outcomes.jsonl`, `faults.json` and `summary.json` under the run's directory and prints a summary; a
//! violation names its request or resource and the fault active.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::charges::{self, Tally};
use super::deploy::{DeploySpec, Deployment, DECODE, PREFILL, TIERED};
use super::drive::{tenant_loop, Drive};
use super::execute::{execute, held, Executed};
use super::ledger::{
    check, isolation_by_fault, recovery, IsolationSeen, Limits, Outcome, Recovery, RequestKind, Violation,
};
use super::schedule::{active_at, schedule, Fault, ScheduleSpec};

/// Most file descriptors a process that ran throughout may hold past its count at rest.
pub const FD_SLACK: i64 = 64;
/// Most resident memory a worker or Redis that ran throughout may gain over the run, as a share of its start (plus
/// 32 MiB): their structures are sized at start (the KV pool, the tiers).
pub const RSS_GROWTH: f64 = 0.5;
/// Most resident memory a gateway that ran throughout may gain over its value at rest, in MiB: its bounded caches
/// (chat segments, long text, ring keys, the registry's recent conversations) fill under load; a 20-minute run
/// levelled off about 60 MiB over rest (`docs/benchmarks/reliability.md`).
pub const GATEWAY_RSS_GROWTH_MIB: f64 = 128.0;
/// Most resident memory a CPU-engine worker that ran throughout may gain over its value at rest, in MiB: at rest
/// it has computed nothing; its tensor math's working buffers, the allocator's arenas of its threads and its KV
/// pool (12 MiB of the tiny model's) are touched once it serves. A 100-second run saw about 36 MiB.
pub const CPU_WORKER_RSS_GROWTH_MIB: f64 = 64.0;
/// A process that lived at least this long must have levelled off: over the last third of its life its memory grows
/// at most [`LEVEL_OFF_GROWTH`] (plus 16 MiB).
pub const LEVEL_OFF_AFTER_S: f64 = 600.0;
pub const LEVEL_OFF_GROWTH: f64 = 0.1;

/// A chaos run's settings.
#[derive(Clone, Debug)]
pub struct ChaosSpec {
    pub seed: u64,
    pub duration: Duration,
    pub dir: PathBuf,
    pub bin_dir: PathBuf,
    /// Client loops per tenant.
    pub concurrency: usize,
    pub profile: String,
}

const GATEWAYS: usize = 2;
const WORKERS: usize = 4;
const TENANTS: usize = 3;
/// The run's limits on each request (the gateway's default first-byte cap is 30 s at most; a turn's stream is short).
const LIMITS: Limits = Limits { request_s: 40.0, slack_s: 10.0, settle_s: 5.0 };
/// How often the processes' resident memory is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// How long after the clients stop the resources are measured.
const QUIET: Duration = Duration::from_secs(5);

/// What a run found.
#[derive(Serialize)]
pub struct Summary {
    pub seed: u64,
    pub duration_s: f64,
    pub requests: usize,
    pub by_kind: BTreeMap<String, usize>,
    pub errors_by_code: BTreeMap<String, usize>,
    pub faults: Vec<Fault>,
    /// What the executor noted of its faults (a prefill kill mid-transfer, the bytes that filled the SSD, a fault
    /// it could not inject and why).
    pub fault_notes: Vec<String>,
    /// Answers by the gateway's route reason (`split`: a prefill/decode split).
    pub by_route: BTreeMap<String, usize>,
    /// What each tenant and class was charged against the usage of its requests (`charges.rs`).
    pub charges: Vec<Tally>,
    /// The workers' computed tokens (uncached prompt plus completion) over every worker life.
    pub computed_tokens: f64,
    pub ttft_p50_ms_quiet: f64,
    pub ttft_p99_ms_quiet: f64,
    pub ttft_p50_ms_faults: f64,
    pub ttft_p99_ms_faults: f64,
    pub violations: Vec<Violation>,
    pub resources: Vec<String>,
    pub recoveries: Vec<Recovery>,
    /// Every [`SAMPLE_EVERY`]: (seconds, process, pid, resident memory in MiB): whether memory levels off or keeps
    /// growing.
    pub rss_timeline: Vec<(f64, String, u32, f64)>,
    /// Shared documents first sent by a tenant (the isolation check's sample).
    pub isolation_checked: usize,
    /// The tenants' repeats of a shared document they had sent, answered where the first send was, outside
    /// faults, that carried usage (the positive control), and how many of them found their own blocks.
    pub isolation_controls: usize,
    pub isolation_control_hits: usize,
    /// The isolation checks each fault kind saw during its windows and after them.
    pub isolation_by_fault: BTreeMap<String, IsolationSeen>,
}

/// A process's file descriptors and resident memory (KiB).
fn usage(pid: u32) -> Option<(i64, i64)> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as i64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.split_whitespace().next()?.parse().ok()?;
    Some((fds, rss))
}

/// A process's name, pid and (fds, rss KiB).
type Usage = (String, Option<u32>, Option<(i64, i64)>);

/// Every process's usage.
fn resources(d: &Deployment) -> Vec<Usage> {
    let all = std::iter::once(&d.redis).chain(&d.gateways).chain(&d.workers);
    all.map(|m| (m.name.clone(), m.pid(), m.pid().and_then(usage))).collect()
}

/// Each process life (name and pid) of at least [`LEVEL_OFF_AFTER_S`] whose memory still grew over its last third.
fn levelled_off(timeline: &[(f64, String, u32, f64)]) -> Vec<Violation> {
    let mut lives: BTreeMap<(String, u32), Vec<(f64, f64)>> = BTreeMap::new();
    for (t, name, pid, mib) in timeline {
        lives.entry((name.clone(), *pid)).or_default().push((*t, *mib));
    }
    let mut out = Vec::new();
    for ((name, pid), samples) in lives {
        let (Some(first), Some(last)) = (samples.first(), samples.last()) else { continue };
        if last.0 - first.0 < LEVEL_OFF_AFTER_S {
            continue;
        }
        let from = last.0 - (last.0 - first.0) / 3.0;
        let start = samples.iter().find(|s| s.0 >= from).map_or(last.1, |s| s.1);
        if last.1 > start * (1.0 + LEVEL_OFF_GROWTH) + 16.0 {
            let detail = format!(
                "{name} (pid {pid}): {start:.0} -> {:.0} MiB over the last third of its life",
                last.1
            );
            out.push(Violation { invariant: "rss_levels_off", request: 0, detail, fault: None });
        }
    }
    out
}

fn ttft(outcomes: &[Outcome], faults: &[Fault], in_faults: bool) -> (f64, f64) {
    let v: Vec<f64> = outcomes
        .iter()
        .filter(|o| o.kind == RequestKind::Chat && o.code.is_none())
        .filter(|o| super::schedule::active_at(faults, o.start_s, LIMITS.settle_s).is_some() == in_faults)
        .filter_map(|o| o.ttft_s.map(|t| t * 1e3))
        .collect();
    (crate::stats::percentile(&v, 0.5), crate::stats::percentile(&v, 0.99))
}

/// The run's fault schedule.
fn schedule_for(spec: &ChaosSpec) -> Vec<Fault> {
    schedule(&ScheduleSpec {
        seed: spec.seed,
        duration: spec.duration,
        warmup: Duration::from_secs(15).min(spec.duration / 4),
        length: (Duration::from_secs(5), Duration::from_secs(12)),
        gap: (Duration::from_secs(10), Duration::from_secs(20)),
        workers: WORKERS,
        prefill: PREFILL,
        tiered: TIERED,
        gateways: GATEWAYS,
        tenants: TENANTS,
    })
}

/// A process's memory, sampled: (seconds, name, pid, MiB).
type Sample = (f64, String, u32, f64);

/// Drives the clients to the run's end while the executor works through `faults`, sampling every process's memory
/// all along; then the deployment back, what the executor saw, and the samples.
async fn drive_and_fault(
    d: Deployment,
    drive: &Drive,
    faults: &[Fault],
    spec: &ChaosSpec,
) -> (Deployment, Executed, Vec<Sample>) {
    let until = spec.duration.as_secs_f64();
    let mut loops = Vec::new();
    for t in 0..TENANTS {
        for s in 0..spec.concurrency {
            loops.push(tokio::spawn(tenant_loop(drive.clone(), t, s, spec.seed, until)));
        }
    }
    let d = tokio::sync::Mutex::new(d);
    let mut timeline = Vec::new();
    let executed = {
        let exec = async {
            let ex = execute(&d, drive, faults, spec.seed, TENANTS).await;
            for l in loops {
                let _ = l.await;
            }
            ex
        };
        tokio::pin!(exec);
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        loop {
            tokio::select! {
                ex = &mut exec => break ex,
                _ = tick.tick() => {
                    // Never wait for the lock here: the executor holds it across awaits (a prefill kill waits for
                    // a transfer), and it is polled only by this loop, so waiting would stop both for good. A
                    // sample that finds a fault being carried out is skipped.
                    let Ok(d) = d.try_lock() else { continue };
                    let t = drive.started.elapsed().as_secs_f64();
                    for (name, pid, u) in resources(&d) {
                        if let (Some(pid), Some((_, rss))) = (pid, u) {
                            timeline.push((t, name, pid, rss as f64 / 1024.0));
                        }
                    }
                }
            }
        }
    };
    (d.into_inner(), executed, timeline)
}

/// Each process's descriptors and memory now against its value at rest: a line per process, and the violations
/// of the bounds (processes restarted during the run are not compared).
fn drift(at_rest: &[Usage], now: &[Usage]) -> (Vec<String>, Vec<Violation>) {
    let (mut seen, mut violations) = (Vec::new(), Vec::new());
    let v = |invariant, detail| Violation { invariant, request: 0, detail, fault: None };
    for ((name, pid0, u0), (_, pid1, u1)) in at_rest.iter().zip(now) {
        let (Some((f0, r0)), Some((f1, r1))) = (u0, u1) else { continue };
        if pid0 != pid1 {
            seen.push(format!("{name}: restarted during the run (fds {f1}, rss {} MiB now)", r1 / 1024));
            continue;
        }
        seen.push(format!("{name}: fds {f0} -> {f1}, rss {} -> {} MiB", r0 / 1024, r1 / 1024));
        if f1 - f0 > FD_SLACK {
            violations.push(v("fds_flat", format!("{name}: {f0} -> {f1}")));
        }
        let cpu = [PREFILL, DECODE].iter().any(|i| *name == format!("worker-w{i}"));
        let bound = if name.starts_with("gateway") {
            *r0 as f64 + GATEWAY_RSS_GROWTH_MIB * 1024.0
        } else if cpu {
            *r0 as f64 + CPU_WORKER_RSS_GROWTH_MIB * 1024.0
        } else {
            *r0 as f64 * (1.0 + RSS_GROWTH) + 32.0 * 1024.0
        };
        if *r1 as f64 > bound {
            violations.push(v("rss_bounded", format!("{name}: {r0} -> {r1} KiB")));
        }
    }
    (seen, violations)
}

/// Requests by kind, by route and errors by code.
#[allow(clippy::type_complexity)]
fn counts(
    outcomes: &[Outcome],
) -> (BTreeMap<String, usize>, BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let (mut by_kind, mut by_route, mut errors) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    for o in outcomes {
        *by_kind.entry(format!("{:?}", o.kind).to_lowercase()).or_insert(0) += 1;
        if let Some(r) = &o.route {
            *by_route.entry(r.clone()).or_insert(0) += 1;
        }
        if let Some(c) = &o.code {
            *errors.entry(c.clone()).or_insert(0) += 1;
        }
    }
    (by_kind, by_route, errors)
}

/// Runs the whole thing; `Err` only when the run could not be carried out (violations are in the summary).
pub async fn run(spec: &ChaosSpec) -> Result<Summary, String> {
    let deploy = DeploySpec {
        bin_dir: spec.bin_dir.clone(),
        dir: spec.dir.clone(),
        gateways: GATEWAYS,
        workers: WORKERS,
        tenants: TENANTS,
        profile: spec.profile.clone(),
    };
    let d = Deployment::start(&deploy).await?;
    let faults = schedule_for(spec);
    let at_rest = resources(&d);
    let gateways: Vec<String> = d.gateways.iter().map(|g| g.url.clone()).collect();
    let give_up = Duration::from_secs_f64(LIMITS.request_s + LIMITS.slack_s + 30.0);
    let drive = Drive::new(gateways, "kvgate-tiny", give_up);
    let (d, mut executed, rss_timeline) = drive_and_fault(d, &drive, &faults, spec).await;
    tokio::time::sleep(QUIET).await;
    let outcomes = drive.ledger.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut violations = check(&outcomes, &faults, &LIMITS);
    let (isolation_by_fault, unseen) = isolation_by_fault(&outcomes, &faults);
    violations.extend(unseen);
    let controls: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.repeat_shared && o.same_place && o.cached_tokens.is_some())
        .filter(|o| active_at(&faults, o.start_s, LIMITS.settle_s).is_none())
        .collect();
    executed.scrape_all(&d).await;
    let tenant = |i: usize| format!("t{i}");
    violations.extend(charges::check(&outcomes, &executed.counters, &executed.blind, &tenant));
    for detail in held(&d).await {
        violations.push(Violation { invariant: "resources_back", request: 0, detail, fault: None });
    }
    let (resources_seen, drifted) = drift(&at_rest, &resources(&d));
    violations.extend(drifted);
    violations.extend(levelled_off(&rss_timeline));
    let write =
        |name: &str, text: String| std::fs::write(spec.dir.join(name), text).map_err(|e| e.to_string());
    let lines: Vec<String> = outcomes.iter().filter_map(|o| serde_json::to_string(o).ok()).collect();
    write("outcomes.jsonl", lines.join("\n"))?;
    write("faults.json", serde_json::to_string_pretty(&faults).map_err(|e| e.to_string())?)?;
    let (by_kind, by_route, errors_by_code) = counts(&outcomes);
    let (q50, q99) = ttft(&outcomes, &faults, false);
    let (f50, f99) = ttft(&outcomes, &faults, true);
    let summary = Summary {
        seed: spec.seed,
        duration_s: spec.duration.as_secs_f64(),
        requests: outcomes.len(),
        by_kind,
        errors_by_code,
        recoveries: recovery(&outcomes, &faults, spec.duration.as_secs_f64()),
        faults,
        fault_notes: executed.notes.clone(),
        by_route,
        charges: charges::tallies(&outcomes, &executed.counters, &executed.blind, &tenant),
        computed_tokens: executed.counters.computed,
        ttft_p50_ms_quiet: q50,
        ttft_p99_ms_quiet: q99,
        ttft_p50_ms_faults: f50,
        ttft_p99_ms_faults: f99,
        rss_timeline,
        isolation_checked: outcomes.iter().filter(|o| o.first_shared && o.cached_tokens.is_some()).count(),
        isolation_controls: controls.len(),
        isolation_control_hits: controls.iter().filter(|o| o.cached_tokens > Some(0)).count(),
        isolation_by_fault,
        violations,
        resources: resources_seen,
    };
    write("summary.json", serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?)?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_must_level_off_over_the_last_third_of_a_long_life() {
        let life = |name: &str, pid: u32, until: f64, mib: &dyn Fn(f64) -> f64| {
            let mut v = Vec::new();
            let mut t = 0.0;
            while t <= until {
                v.push((t, name.to_owned(), pid, mib(t)));
                t += 10.0;
            }
            v
        };
        let mut tl = life("gateway-0", 1, 1200.0, &|t| 20.0 + 60.0 * (t / 600.0).min(1.0)); // fills, then flat
        tl.extend(life("gateway-1", 2, 1200.0, &|t| 20.0 + t / 10.0)); // still growing: 100 -> 140 MiB
        tl.extend(life("worker-w0", 3, 300.0, &|t| 20.0 + t)); // too short a life to judge
        let v = levelled_off(&tl);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].detail.starts_with("gateway-1 (pid 2)"), "{}", v[0].detail);
    }
}
