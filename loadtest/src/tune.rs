//! The tuning protocol (`kvgate-loadtest tune`): a routing policy's parameters are chosen on the tune set of
//! traces only, and judged on the test set, which the choice never sees.
//!
//! The sets are a TOML file (`loadtest/traces/sets.toml`): each `[[trace]]` names a file or a generated shape
//! and seed (`trace_shapes.rs`), its set (`tune` or `test`) and the fleet it runs on (workers, the share of its
//! distinct blocks the fleet holds, the offered load). A run:
//! 1. replays every tune trace under each candidate (every policy named, crossed with every `--grid` point) and
//!    under the baselines (`least_load`, `consistent_hash`, `round_robin`) and the earlier defaults
//!    ([`NAMED_GUARDS`]);
//! 2. picks the candidate of least loss (below) summed over the tune traces;
//! 3. replays the pick, the runner-up policies at their own best point, and the baselines on every test trace,
//!    and prints both tables, the tune set's marked as such, with each goal's margin.
//!
//! ```text
//! loss(trace) = ln(p99 / p99 of least_load) + ln(p50 / the better p50 of least_load and consistent_hash)
//!             + 2 ln(max(hit rate of consistent_hash, hit rate) / hit rate)     (a hit rate below the ring's costs)
//!             + ln(max(max/mean, 1.5) / 1.5)            (`max_mean_load`: a pile-up past #43's goal costs)
//!             + 2 ln(best baseline goodput / goodput)   (#66: goodput under the trace's SLOs, against the best of
//!                                                        round_robin, least_load and consistent_hash)
//! ```
//! Each trace names its fleet's timing profile (default: the run's `--profile`) and its SLOs (default
//! [`DEFAULT_SLO`], a GPU fleet's).
//! Invariants: a trace's figures are a pure function of the trace, the fleet and the candidate (the simulator is
//! deterministic); nothing of the test set enters the choice.

use std::path::{Path, PathBuf};

use kvgate_router::routing::{Slo, Weights};
use kvgate_worker::engine::timing::SimProfile;
use serde::Deserialize;

use crate::sim::{self, Pace, SimConfig, SimResult};
use crate::trace::{Trace, TRACE_BLOCK_TOKENS};
use crate::trace_shapes::Shape;

/// Why a tuning run could not be done. None of these goes away on a retry with the same arguments.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    /// The sets file is unreadable or one of its entries is invalid.
    #[error("{path}: {message}")]
    Sets { path: String, message: String },
    /// A trace of the sets could not be loaded or generated.
    #[error("trace {name}: {message}")]
    Trace { name: String, message: String },
    #[error("--grid {0}")]
    Grid(String),
    /// The simulator refused the fleet or a policy.
    #[error("replay: {0}")]
    Replay(String),
    #[error("no candidates to choose from")]
    NoCandidates,
}

/// #43's balance goal: `SimResult::max_mean_load` (the busiest worker's busy time over the mean) at most this.
pub const MAX_OVER_MEAN_GOAL: f64 = 1.5;

/// The baselines every goal is stated against.
pub const BASELINES: [&str; 3] = ["least_load", "consistent_hash", "round_robin"];

/// The earlier defaults, replayed on every trace beside the baselines (unless they are candidates): the goals ask
/// for goodput at least theirs (#66). Not in the loss.
pub const NAMED_GUARDS: [&str; 2] = ["cache_aware", "cache_aware_measured"];

/// The SLOs of a trace that names none: a GPU fleet's interactive traffic (first token within 2 s plus 100 ms per
/// 1,000 prompt tokens, then at least 10 tokens a second).
pub const DEFAULT_SLO: Slo = Slo { ttft_ms: 2000.0, ttft_ms_per_1k_tokens: 100.0, tpot_ms: 100.0 };

/// One trace of a set and the fleet it runs on.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceSpec {
    pub name: String,
    /// `tune` or `test`.
    pub set: String,
    /// A trace file (relative to the sets file's folder's parent: the repository's `loadtest/`).
    pub file: Option<PathBuf>,
    /// A generated shape (`agentic`, `bursty`, `tenants`, `long_document`, `families`) and its seed.
    pub shape: Option<String>,
    pub seed: Option<u64>,
    #[serde(default = "default_workers")]
    pub workers: usize,
    /// The share of the trace's distinct blocks the fleet holds.
    #[serde(default = "default_kv_share")]
    pub kv_share: f64,
    #[serde(default = "default_load")]
    pub load: f64,
    /// Workers of different KV sizes: `SimConfig::kv_spread` (0: all equal).
    #[serde(default)]
    pub kv_spread: f64,
    /// Workers of different speeds: `SimConfig::speed_spread` (0: all equal).
    #[serde(default)]
    pub speed_spread: f64,
    /// Skip the first N requests (arrivals count from the first replayed).
    #[serde(default)]
    pub skip: usize,
    /// Replay only N requests.
    pub limit: Option<usize>,
    /// The fleet's timing profile (a shipped name or a file; default: the run's `--profile`).
    pub profile: Option<String>,
    /// The SLOs goodput counts by (default [`DEFAULT_SLO`]).
    pub slo: Option<Slo>,
}

fn default_workers() -> usize {
    8
}
fn default_kv_share() -> f64 {
    0.25
}
fn default_load() -> f64 {
    0.7
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SetsFile {
    trace: Vec<TraceSpec>,
}

/// Reads a sets file; every entry must name a file or a known shape with a seed, and a set.
pub fn load_sets(path: &Path) -> Result<Vec<TraceSpec>, TuneError> {
    let bad = |message: String| TuneError::Sets { path: path.display().to_string(), message };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let f: SetsFile = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
    for t in &f.trace {
        if t.set != "tune" && t.set != "test" {
            return Err(bad(format!("trace {}: set must be tune or test, got {:?}", t.name, t.set)));
        }
        match (&t.file, &t.shape, t.seed) {
            (Some(_), None, None) => {}
            (None, Some(s), Some(_)) if Shape::parse(s).is_some() => {}
            _ => {
                return Err(bad(format!(
                    "trace {}: name a file, or a shape (agentic, bursty, tenants, long_document) and a seed",
                    t.name
                )))
            }
        }
        let fleet_ok = t.kv_share > 0.0
            && t.kv_share <= 1.0
            && t.load > 0.0
            && t.load.is_finite()
            && t.workers > 0
            && (0.0..1.0).contains(&t.kv_spread)
            && (0.0..1.0).contains(&t.speed_spread)
            && t.slo.is_none_or(|s| s.validate().is_empty());
        if !fleet_ok {
            return Err(bad(format!(
                "trace {}: kv_share in (0, 1], load > 0, workers >= 1, kv_spread and speed_spread in [0, 1), a valid slo",
                t.name
            )));
        }
    }
    Ok(f.trace)
}

/// The trace and fleet of one entry (files relative to `root`).
pub fn materialize(
    spec: &TraceSpec,
    root: &Path,
    profile: &SimProfile,
) -> Result<(Trace, SimConfig), TuneError> {
    let bad = |message: String| TuneError::Trace { name: spec.name.clone(), message };
    let mut trace = match (&spec.file, &spec.shape, spec.seed) {
        (Some(f), _, _) => Trace::load(&root.join(f)).map_err(bad)?,
        (None, Some(s), Some(seed)) => {
            Shape::parse(s).ok_or_else(|| bad(format!("unknown shape {s}")))?.generate(seed)
        }
        _ => return Err(bad("no file or shape".into())),
    };
    trace.window(spec.skip, spec.limit);
    let fleet = (trace.distinct_blocks() * TRACE_BLOCK_TOKENS) as f64 * spec.kv_share;
    let kv = ((fleet / spec.workers as f64) as usize).next_multiple_of(16).max(16 * 1024);
    let profile = match &spec.profile {
        Some(name) => SimProfile::named_or_file(name).map_err(bad)?,
        None => profile.clone(),
    };
    let mut cfg = SimConfig::new(spec.workers, kv, profile);
    cfg.slo = spec.slo.unwrap_or(DEFAULT_SLO);
    cfg.kv_spread = spec.kv_spread;
    cfg.speed_spread = spec.speed_spread;
    Ok((trace, cfg))
}

/// A candidate: a policy and the weights it runs with (`point`: the grid values that differ from the defaults).
#[derive(Clone, Debug)]
pub struct Candidate {
    pub policy: String,
    pub weights: Weights,
    pub point: Vec<(String, String)>,
}

/// A grid point: the weights it sets, by name, as given.
pub type Point = Vec<(String, String)>;

/// Every point of the grid (`NAME=v1,v2,...` each), on top of the defaults; one point (the defaults) when empty.
pub fn grid(specs: &[String]) -> Result<Vec<(Weights, Point)>, TuneError> {
    let mut points: Vec<Point> = vec![Vec::new()];
    for s in specs {
        let (k, vs) =
            s.split_once('=').ok_or_else(|| TuneError::Grid(format!("{s}: expected NAME=V1,V2")))?;
        points = points
            .into_iter()
            .flat_map(|p| {
                vs.split(',').map(move |v| {
                    let mut q = p.clone();
                    q.push((k.trim().to_owned(), v.trim().to_owned()));
                    q
                })
            })
            .collect();
    }
    points
        .into_iter()
        .map(|p| {
            let table: String = p.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
            let w: Weights = toml::from_str(&table).map_err(|e| TuneError::Grid(e.to_string()))?;
            let problems = w.validate();
            if problems.is_empty() {
                Ok((w, p))
            } else {
                Err(TuneError::Grid(problems.join("; ")))
            }
        })
        .collect()
}

/// One trace's figures: each run's result by name (candidates as `policy[point]`).
pub struct TraceRuns {
    pub spec: TraceSpec,
    pub oracle_hit_rate: f64,
    pub runs: Vec<(String, SimResult)>,
}

impl TraceRuns {
    fn get(&self, name: &str) -> Option<&SimResult> {
        self.runs.iter().find(|(n, _)| n == name).map(|(_, r)| r)
    }

    /// The loss of run `name` (formula at the top).
    pub fn loss(&self, name: &str) -> f64 {
        let (Some(r), Some(ll), Some(ch)) =
            (self.get(name), self.get("least_load"), self.get("consistent_hash"))
        else {
            return f64::INFINITY;
        };
        let ln = |a: f64, b: f64| (a.max(1e-9) / b.max(1e-9)).ln();
        let goodput =
            BASELINES.iter().filter_map(|b| self.get(b)).map(|b| b.goodput_tokens_per_s).fold(0.0, f64::max);
        ln(r.ttft_p99_ms, ll.ttft_p99_ms)
            + ln(r.ttft_p50_ms, ll.ttft_p50_ms.min(ch.ttft_p50_ms))
            + 2.0 * ln(ch.hit_rate.max(r.hit_rate), r.hit_rate)
            + ln(r.max_mean_load.max(MAX_OVER_MEAN_GOAL), MAX_OVER_MEAN_GOAL)
            + 2.0 * ln(goodput, r.goodput_tokens_per_s)
    }
}

/// A candidate's label in the tables.
pub fn label(c: &Candidate) -> String {
    if c.point.is_empty() {
        c.policy.clone()
    } else {
        let p: Vec<String> = c.point.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("{}[{}]", c.policy, p.join(" "))
    }
}

/// Replays `trace` under every candidate and the baselines, `jobs` at a time.
pub fn run_trace(
    spec: &TraceSpec,
    root: &Path,
    profile: &SimProfile,
    candidates: &[Candidate],
    jobs: usize,
) -> Result<TraceRuns, TuneError> {
    let (trace, cfg) = materialize(spec, root, profile)?;
    let plan = sim::prepare(&trace, &cfg, Pace::TargetLoad(spec.load)).map_err(TuneError::Replay)?;
    let mut work: Vec<(String, String, Weights)> =
        candidates.iter().map(|c| (label(c), c.policy.clone(), c.weights)).collect();
    for b in
        BASELINES.iter().chain(NAMED_GUARDS.iter().filter(|g| !candidates.iter().any(|c| c.policy == **g)))
    {
        work.push(((*b).to_owned(), (*b).to_owned(), Weights::default()));
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<Result<SimResult, String>>>> =
        work.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((_, policy, weights)) = work.get(i) else { break };
                let mut c = cfg.clone();
                c.weights = *weights;
                let r = sim::simulate(&trace, &c, &plan, policy);
                if let Ok(mut slot) = slots[i].lock() {
                    *slot = Some(r);
                }
            });
        }
    });
    let mut runs = Vec::with_capacity(work.len());
    for ((name, _, _), slot) in work.into_iter().zip(slots) {
        let r = slot
            .into_inner()
            .ok()
            .flatten()
            .unwrap_or_else(|| Err("a replay thread died".into()))
            .map_err(TuneError::Replay)?;
        if let Some(e) = &r.ttft_prediction {
            eprintln!(
                "{} {name}: predicted TTFT on {} picks: actual - predicted {:.0} ms on average, |error| mean {:.0} \
                 ms, p90 {:.0} ms, correlation {:.3}",
                spec.name, e.requests, e.bias_ms, e.mean_abs_ms, e.p90_abs_ms, e.correlation
            );
        }
        runs.push((name, r));
    }
    Ok(TraceRuns { spec: spec.clone(), oracle_hit_rate: plan.oracle.hit_rate, runs })
}

/// Markdown rows of one set: every run of every trace, with the goals of #43 checked for `pick`.
pub fn table(set: &[TraceRuns], pick: &str) -> String {
    let mut out = String::from(
        "| trace | policy | hit rate | x oracle | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | goodput t/s \
         | SLO met | max/mean | loss | goals |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for t in set {
        for (name, r) in &t.runs {
            let goals = if name == pick { goals(t, r) } else { String::new() };
            out.push_str(&format!(
                "| {} | {} | {:.3} | {:.2} | {:.0} | {:.0} | {:.1} | {:.1} | {:.0} | {:.3} | {:.2} | {:.3} | {} |\n",
                t.spec.name,
                name,
                r.hit_rate,
                r.hit_rate / t.oracle_hit_rate.max(1e-9),
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                r.tpot_p50_ms,
                r.tpot_p99_ms,
                r.goodput_tokens_per_s,
                r.slo_attainment,
                r.max_mean_load,
                t.loss(name),
                goals
            ));
        }
    }
    out
}

/// The goals of #43 and #66 for run `r` of `t`: "met", or each miss and by how much. Goodput must be at least
/// every other run's of the baselines and the named guards (`cache_aware`, `cache_aware_measured`) when present.
pub fn goals(t: &TraceRuns, r: &SimResult) -> String {
    let (Some(ll), Some(ch)) = (t.get("least_load"), t.get("consistent_hash")) else {
        return "no baselines".into();
    };
    let mut misses = Vec::new();
    for name in BASELINES.iter().chain(&["cache_aware", "cache_aware_measured"]) {
        let Some(b) = t.get(name).filter(|b| b.policy != r.policy) else { continue };
        if r.goodput_tokens_per_s < b.goodput_tokens_per_s {
            misses.push(format!(
                "goodput -{:.1}% under {name}",
                (1.0 - r.goodput_tokens_per_s / b.goodput_tokens_per_s.max(1e-9)) * 100.0
            ));
        }
    }
    if r.hit_rate < ch.hit_rate {
        misses.push(format!("hit {:.4} < consistent_hash {:.4}", r.hit_rate, ch.hit_rate));
    }
    let x = r.hit_rate / t.oracle_hit_rate.max(1e-9);
    if x < 0.97 {
        misses.push(format!("{x:.3}x oracle < 0.97"));
    }
    if r.ttft_p99_ms > ll.ttft_p99_ms {
        misses.push(format!("p99 +{:.1}% over least_load", (r.ttft_p99_ms / ll.ttft_p99_ms - 1.0) * 100.0));
    }
    let best = ll.ttft_p50_ms.min(ch.ttft_p50_ms);
    if r.ttft_p50_ms > best {
        misses.push(format!("p50 +{:.1}% over the better baseline", (r.ttft_p50_ms / best - 1.0) * 100.0));
    }
    if r.max_mean_load > MAX_OVER_MEAN_GOAL {
        misses.push(format!("max/mean {:.2} > {MAX_OVER_MEAN_GOAL}", r.max_mean_load));
    }
    if misses.is_empty() {
        "met".into()
    } else {
        misses.join("; ")
    }
}

/// Which sets a run replays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Only {
    /// Both: choose on the tune set, then judge the pick on the test set.
    Both,
    /// The tune set (while forms are tried).
    Tune,
    /// The test set, for a pick an earlier run made (the first candidate).
    Test,
}

/// What `run` prints: the pick, then both sets' tables.
pub struct Report {
    pub pick: String,
    pub tune: Vec<TraceRuns>,
    pub test: Vec<TraceRuns>,
}

/// The whole protocol: candidates on the tune set, the pick (and each policy's best point) on the test set.
pub fn run(
    sets: &[TraceSpec],
    root: &Path,
    profile: &SimProfile,
    candidates: &[Candidate],
    jobs: usize,
    only: Only,
) -> Result<Report, TuneError> {
    if only == Only::Test {
        // The choice was made on the tune set by an earlier run: the candidates named are its pick (first) and
        // the runners-up, replayed on the test set alone.
        let pick = candidates.first().map(label).ok_or(TuneError::NoCandidates)?;
        let mut test = Vec::new();
        for spec in sets.iter().filter(|t| t.set == "test") {
            eprintln!("test: {}", spec.name);
            test.push(run_trace(spec, root, profile, candidates, jobs)?);
        }
        return Ok(Report { pick, tune: Vec::new(), test });
    }
    let mut tune = Vec::new();
    for spec in sets.iter().filter(|t| t.set == "tune") {
        eprintln!("tune: {}", spec.name);
        tune.push(run_trace(spec, root, profile, candidates, jobs)?);
    }
    let total = |c: &Candidate| tune.iter().map(|t| t.loss(&label(c))).sum::<f64>();
    // Each policy's best point, best policy first.
    let mut best: Vec<(f64, &Candidate)> = Vec::new();
    for c in candidates {
        let l = total(c);
        match best.iter_mut().find(|(_, b)| b.policy == c.policy) {
            Some(slot) if l < slot.0 => *slot = (l, c),
            Some(_) => {}
            None => best.push((l, c)),
        }
    }
    best.sort_by(|a, b| a.0.total_cmp(&b.0));
    let pick = best.first().map(|(_, c)| label(c)).ok_or(TuneError::NoCandidates)?;
    let finalists: Vec<Candidate> = best.iter().map(|(_, c)| (*c).clone()).collect();
    let mut test = Vec::new();
    for spec in sets.iter().filter(|t| t.set == "test" && only != Only::Tune) {
        eprintln!("test: {}", spec.name);
        test.push(run_trace(spec, root, profile, &finalists, jobs)?);
    }
    Ok(Report { pick, tune, test })
}

impl Report {
    /// Markdown: the pick and its loss, the test set's table, the tune set's (marked).
    pub fn markdown(&self) -> String {
        let loss = |set: &[TraceRuns]| set.iter().map(|t| t.loss(&self.pick)).sum::<f64>();
        if self.tune.is_empty() {
            return format!(
                "Pick (chosen on the tune set by an earlier run): **{}**; loss on the test set {:.3}.\n\n\
                 **Test set** (the figures to report):\n\n{}",
                self.pick,
                loss(&self.test),
                table(&self.test, &self.pick)
            );
        }
        if self.test.is_empty() {
            return format!(
                "Pick (least loss on the tune set): **{}**; loss on the tune set {:.3}. The test set was not run.\n\n\
                 **Tune set** (the parameters were chosen on these; not a result):\n\n{}",
                self.pick,
                loss(&self.tune),
                table(&self.tune, &self.pick)
            );
        }
        format!(
            "Pick (least loss on the tune set): **{}**; loss on the tune set {:.3}, on the test set {:.3}.\n\n\
             **Test set** (the figures to report):\n\n{}\n**Tune set** (the parameters were chosen on these; \
             not a result):\n\n{}",
            self.pick,
            loss(&self.tune),
            loss(&self.test),
            table(&self.test, &self.pick),
            table(&self.tune, &self.pick)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grid_crosses_its_values_and_refuses_bad_ones_by_name() {
        let g = grid(&["w_ring=0.2,0.4".into(), "w_load=0.5,1".into()]).expect("valid");
        assert_eq!(g.len(), 4);
        assert!(g.iter().any(|(w, _)| w.w_ring == 0.4 && w.w_load == 1.0));
        assert_eq!(grid(&[]).expect("defaults").len(), 1);
        let err = grid(&["credit_host=2".into()]).expect_err("out of range").to_string();
        assert!(err.contains("credit_host"), "{err}");
        let err = grid(&["nonsense=1".into()]).expect_err("unknown").to_string();
        assert!(err.contains("nonsense"), "{err}");
    }

    fn windows_overlap(a: &TraceSpec, b: &TraceSpec) -> bool {
        let end = |t: &TraceSpec| t.limit.map_or(usize::MAX, |l| t.skip + l);
        a.skip < end(b) && b.skip < end(a)
    }

    #[test]
    fn the_loss_weighs_tail_median_hit_rate_and_a_pile_up_past_the_goal() {
        let run = |p50: f64, p99: f64, hit: f64, max_mean: f64| SimResult {
            ttft_p50_ms: p50,
            ttft_p99_ms: p99,
            hit_rate: hit,
            max_mean_load: max_mean,
            ..SimResult::default()
        };
        let spec: TraceSpec =
            toml::from_str("name = \"t\"\nset = \"tune\"\nshape = \"tenants\"").expect("spec");
        let runs = |r: SimResult| TraceRuns {
            spec: spec.clone(),
            oracle_hit_rate: 0.5,
            runs: vec![
                ("least_load".into(), run(200.0, 1000.0, 0.1, 1.0)),
                ("consistent_hash".into(), run(400.0, 4000.0, 0.4, 2.0)),
                ("x".into(), r),
            ],
        };
        // Half least_load's p99, half its p50, the ring's hit rate, balanced: ln 0.5 + ln 0.5.
        let base = runs(run(100.0, 500.0, 0.4, 1.2)).loss("x");
        assert!((base - 2.0 * 0.5f64.ln()).abs() < 1e-12, "{base}");
        // Half the ring's hit rate costs 2 ln 2; a busiest worker at 1.5x the mean costs nothing, at 3x ln 2.
        assert!((runs(run(100.0, 500.0, 0.2, 1.2)).loss("x") - base - 2.0 * 2f64.ln()).abs() < 1e-12);
        assert_eq!(runs(run(100.0, 500.0, 0.4, 1.5)).loss("x"), base);
        assert!((runs(run(100.0, 500.0, 0.4, 3.0)).loss("x") - base - 2f64.ln()).abs() < 1e-12);
        assert_eq!(runs(run(1.0, 1.0, 1.0, 1.0)).loss("missing"), f64::INFINITY);
    }

    #[test]
    fn a_bad_sets_file_is_refused_by_name() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("sets.toml");
        for (body, want) in [
            ("[[trace]]\nname = \"a\"\nset = \"both\"\nfile = \"x\"\n", "set must be tune or test"),
            (
                "[[trace]]\nname = \"a\"\nset = \"tune\"\nshape = \"nope\"\nseed = 1\n",
                "name a file, or a shape",
            ),
            ("[[trace]]\nname = \"a\"\nset = \"tune\"\nfile = \"x\"\nkv_spread = 1.0\n", "kv_spread"),
            ("[[trace]]\nname = \"a\"\nset = \"tune\"\nfile = \"x\"\nsurprise = 1\n", "surprise"),
        ] {
            std::fs::write(&path, body).expect("write");
            let err = load_sets(&path).expect_err(want).to_string();
            assert!(err.contains(want), "{err}");
        }
        assert!(matches!(load_sets(&dir.path().join("missing.toml")), Err(TuneError::Sets { .. })));
    }

    #[test]
    fn the_repository_sets_file_is_valid_and_keeps_the_sets_apart() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let sets = load_sets(&root.join("traces/sets.toml")).expect("valid");
        let of = |set: &str| sets.iter().filter(|t| t.set == set).map(|t| t.name.clone()).collect::<Vec<_>>();
        let (tune, test) = (of("tune"), of("test"));
        assert!(tune.len() >= 3 && test.len() >= 3, "{tune:?} {test:?}");
        // No trace is in both (by file, or by shape and seed).
        for t in sets.iter().filter(|t| t.set == "test") {
            let same = sets.iter().filter(|u| u.set == "tune").any(|u| {
                (t.file.is_some() && t.file == u.file && windows_overlap(t, u))
                    || (t.shape.is_some() && t.shape == u.shape && t.seed == u.seed)
            });
            assert!(!same, "{} is in both sets", t.name);
        }
    }
}
