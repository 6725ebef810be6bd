//! The seeded fault schedule of a chaos run: faults one after another (never two at once, so each violation names
//! the one fault active), each a kind, a target and a window `[start, end)`, separated by quiet gaps in which the
//! fleet must serve without errors (the last fault is followed by one too, before the run ends). Pure: the same seed and settings give the same schedule.

use std::time::Duration;

use kvgate_shared::prompt::SplitMix64;
use serde::Serialize;

/// What a fault does (the executor in `run.rs` carries it out; its end undoes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL a worker at the start; start it again (same port, same id) at the end.
    KillWorker,
    /// SIGSTOP a worker at the start (it stops answering and reporting); SIGCONT at the end.
    StopWorker,
    /// SIGKILL the shared `redis-server` at the start; start it again (empty) at the end.
    RestartRedis,
    /// SIGKILL one gateway replica at the start; start it again (same ports) at the end.
    RestartGateway,
    /// Clients that read their stream a byte a second hold connections for the whole window.
    SlowClients,
    /// A tenant sends a burst over its class budget for the whole window (its 429s are documented).
    BudgetBurst,
    /// SIGKILL the prefill worker while it holds a transfer (once one is seen in flight); start it again at the end.
    KillPrefill,
    /// Fill the tiered worker's SSD directory to the last byte at the start; free it at the end.
    FillSsd,
}

impl FaultKind {
    pub const ALL: [FaultKind; 8] = [
        FaultKind::KillWorker,
        FaultKind::StopWorker,
        FaultKind::RestartRedis,
        FaultKind::RestartGateway,
        FaultKind::SlowClients,
        FaultKind::BudgetBurst,
        FaultKind::KillPrefill,
        FaultKind::FillSsd,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::KillWorker => "kill_worker",
            FaultKind::StopWorker => "stop_worker",
            FaultKind::RestartRedis => "restart_redis",
            FaultKind::RestartGateway => "restart_gateway",
            FaultKind::SlowClients => "slow_clients",
            FaultKind::BudgetBurst => "budget_burst",
            FaultKind::KillPrefill => "kill_prefill",
            FaultKind::FillSsd => "fill_ssd",
        }
    }
}

/// One fault of the schedule.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fault {
    pub kind: FaultKind,
    /// Which worker, gateway replica or tenant (by index; unused by the others).
    pub target: usize,
    /// Seconds from the start of the run.
    pub start_s: f64,
    pub end_s: f64,
}

/// How the schedule is drawn.
#[derive(Clone, Debug)]
pub struct ScheduleSpec {
    pub seed: u64,
    /// The whole run.
    pub duration: Duration,
    /// No fault before this (the fleet warms up and the baseline is measured).
    pub warmup: Duration,
    /// Each fault lasts between these.
    pub length: (Duration, Duration),
    /// The quiet gap after a fault before the next one (recovery is measured in it), between these.
    pub gap: (Duration, Duration),
    /// How many workers, gateway replicas and tenants there are to target, and which worker is the prefill worker
    /// and which has the SSD tier.
    pub workers: usize,
    pub prefill: usize,
    pub tiered: usize,
    pub gateways: usize,
    pub tenants: usize,
}

fn between(rng: &mut SplitMix64, (lo, hi): (Duration, Duration)) -> f64 {
    let (lo, hi) = (lo.as_secs_f64(), hi.as_secs_f64().max(lo.as_secs_f64()));
    lo + (hi - lo) * (rng.below(1_000_001) as f64 / 1e6)
}

/// The faults, in order: every kind once before any repeats (in a seeded order), none past the run's end.
pub fn schedule(s: &ScheduleSpec) -> Vec<Fault> {
    let mut rng = SplitMix64::new(s.seed ^ 0x6368_616f_735f_7363); // "chaos_sc"
    let mut out = Vec::new();
    let mut t = s.warmup.as_secs_f64();
    let end = s.duration.as_secs_f64();
    let mut bag: Vec<FaultKind> = Vec::new();
    loop {
        if bag.is_empty() {
            bag = FaultKind::ALL.to_vec();
        }
        let kind = bag.remove(rng.below(bag.len() as u64) as usize);
        let length = between(&mut rng, s.length);
        // The shortest gap follows the last fault too: its recovery is measured within the run.
        if t + length + s.gap.0.as_secs_f64() > end {
            break;
        }
        let targets = match kind {
            FaultKind::KillWorker | FaultKind::StopWorker => s.workers,
            FaultKind::RestartGateway => s.gateways,
            FaultKind::BudgetBurst => s.tenants,
            FaultKind::RestartRedis
            | FaultKind::SlowClients
            | FaultKind::KillPrefill
            | FaultKind::FillSsd => 1,
        };
        let target = match kind {
            FaultKind::KillPrefill => s.prefill,
            FaultKind::FillSsd => s.tiered,
            _ => rng.below(targets.max(1) as u64) as usize,
        };
        out.push(Fault { kind, target, start_s: t, end_s: t + length });
        t += length + between(&mut rng, s.gap);
    }
    out
}

/// The fault whose window, widened by `settle` after its end (the fleet's time to notice the recovery), holds `t`.
pub fn active_at(faults: &[Fault], t: f64, settle: f64) -> Option<&Fault> {
    faults.iter().find(|f| f.start_s <= t && t < f.end_s + settle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(seed: u64) -> ScheduleSpec {
        ScheduleSpec {
            seed,
            duration: Duration::from_secs(600),
            warmup: Duration::from_secs(20),
            length: (Duration::from_secs(5), Duration::from_secs(15)),
            gap: (Duration::from_secs(10), Duration::from_secs(20)),
            workers: 4,
            prefill: 2,
            tiered: 1,
            gateways: 2,
            tenants: 3,
        }
    }

    #[test]
    fn a_seed_gives_one_schedule_of_every_kind_without_overlaps() {
        let a = schedule(&spec(7));
        assert_eq!(a, schedule(&spec(7)), "seeded");
        assert_ne!(a, schedule(&spec(8)));
        for k in FaultKind::ALL {
            assert!(a.iter().any(|f| f.kind == k), "{k:?} in {a:?}");
        }
        assert!(a[0].start_s >= 20.0 && a.last().expect("faults").end_s <= 590.0, "a gap after the last");
        for w in a.windows(2) {
            assert!(w[0].end_s + 10.0 <= w[1].start_s + 1e-9, "a quiet gap between faults: {w:?}");
        }
        for f in &a {
            assert!((5.0..=15.0).contains(&(f.end_s - f.start_s)));
            let bound = match f.kind {
                FaultKind::KillPrefill => {
                    assert_eq!(f.target, 2, "{f:?}");
                    4
                }
                FaultKind::FillSsd => {
                    assert_eq!(f.target, 1, "{f:?}");
                    4
                }
                FaultKind::KillWorker | FaultKind::StopWorker => 4,
                FaultKind::RestartGateway => 2,
                FaultKind::BudgetBurst => 3,
                _ => 1,
            };
            assert!(f.target < bound, "{f:?}");
        }
        assert_eq!(active_at(&a, a[0].start_s + 1.0, 0.0), Some(&a[0]));
        assert_eq!(active_at(&a, a[0].end_s + 1.0, 2.0), Some(&a[0]), "settling");
        assert_eq!(active_at(&a, a[0].end_s + 3.0, 2.0), None);
    }
}
