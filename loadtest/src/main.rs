//! kvgate-loadtest: `run` (load against an endpoint), `compare` (policies on local fleets), `up` (a local fleet),
//! `demo` (the README's main command) and `simulate` (the virtual-time fleet simulator on Mooncake traces).

use std::path::PathBuf;
use std::process::ExitCode;

mod pd_cmd;

use clap::{Args, Parser, Subcommand};
use kvgate_loadtest::commands::{self, CompareArgs, DemoArgs, RunArgs, UpArgs};
use kvgate_loadtest::sim::{self, Pace, SimConfig, SimResult};
use kvgate_loadtest::trace::{Trace, TRACE_BLOCK_TOKENS};
use kvgate_router::routing::{Weights, POLICIES};
use kvgate_worker::engine::timing::SimProfile;

#[derive(Parser)]
#[command(name = "kvgate-loadtest", version, about = "kvgate load generator, simulator and demo")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Send a workload to an OpenAI-compatible endpoint and measure it (summary, results.json, report.html).
    Run(RunArgs),
    /// Start a local fleet per routing policy, run the same workload against each, compare.
    Compare(CompareArgs),
    /// Start a local fleet (gateway + 3 CPU workers) and keep it up until Ctrl-C.
    Up(UpArgs),
    /// The README's main command: a local fleet, a short multi-turn workload, round_robin vs the default policy (goodput).
    Demo(DemoArgs),
    /// Replay a Mooncake trace in virtual time through the real routing, scheduler and prefix-cache code.
    Simulate(SimulateArgs),
    /// Prefill/decode disaggregation in virtual time: every split policy on the seed's shapes (or a trace) at
    /// several link bandwidths.
    SimulatePd(pd_cmd::SimulatePdArgs),
    /// Write a synthetic trace in the Mooncake format: `long-document` (questions about a few long documents).
    GenTrace(GenTraceArgs),
    /// The tuning protocol: choose a policy's parameters on the tune set of traces, judge them on the test set.
    Tune(TuneArgs),
    /// The whole system (two gateway replicas, Redis, four workers, three tenants) under load and a seeded schedule
    /// of faults, checked against its invariants; exits 1 on a violation.
    Chaos(ChaosArgs),
}

#[derive(Args)]
struct ChaosArgs {
    /// How long the clients run.
    #[arg(long, default_value = "180s", value_parser = kvgate_shared::duration::parse_duration)]
    duration: std::time::Duration,
    /// Seeds the fault schedule and the clients.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Client loops per tenant.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// The simulated workers' timing profile.
    #[arg(long, default_value = "gpu-h100-llama3-8b")]
    profile: String,
    /// Where the logs, outcomes.jsonl, faults.json and summary.json go.
    #[arg(long, default_value = "target/chaos")]
    out: PathBuf,
}

#[derive(Args)]
struct TuneArgs {
    /// The trace sets (TOML; files in it are relative to its folder's parent).
    #[arg(long, default_value = "loadtest/traces/sets.toml")]
    sets: PathBuf,
    /// Candidate policies, comma-separated.
    #[arg(long, default_value = "cache_aware,cache_aware_measured")]
    policy: String,
    /// A weight to sweep, NAME=V1,V2,... (repeatable; the grid is their cross product over the defaults).
    #[arg(long = "grid", value_name = "NAME=V1,V2")]
    grid: Vec<String>,
    /// Only the traces of these names (repeatable; default all).
    #[arg(long = "only")]
    only: Vec<String>,
    /// Timing profile (as `simulate`) of the traces that name none.
    #[arg(long, default_value = "gpu-h100-llama3-8b")]
    profile: String,
    /// Replay the tune set only (while forms are tried: the test set is run once, when the choice is made).
    #[arg(long, conflicts_with = "test_only")]
    tune_only: bool,
    /// Replay the test set only, for the pick an earlier run made on the tune set (the first candidate; give its
    /// weights with --grid).
    #[arg(long)]
    test_only: bool,
}

fn tune(a: TuneArgs) -> Result<(), String> {
    use kvgate_loadtest::tune;
    let mut sets = tune::load_sets(&a.sets).map_err(|e| e.to_string())?;
    if !a.only.is_empty() {
        sets.retain(|t| a.only.contains(&t.name));
    }
    let root = a.sets.parent().and_then(|p| p.parent()).unwrap_or(std::path::Path::new("."));
    let profile = SimProfile::named_or_file(&a.profile)?;
    let points = tune::grid(&a.grid).map_err(|e| e.to_string())?;
    let mut candidates = Vec::new();
    for p in a.policy.split(',').map(str::trim) {
        if !POLICIES.contains(&p) {
            return Err(format!("unknown policy {p:?}; expected one of {}", POLICIES.join(", ")));
        }
        for (w, point) in &points {
            candidates.push(tune::Candidate { policy: p.to_owned(), weights: *w, point: point.clone() });
        }
    }
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
    let only = match (a.tune_only, a.test_only) {
        (true, _) => tune::Only::Tune,
        (_, true) => tune::Only::Test,
        _ => tune::Only::Both,
    };
    let report = tune::run(&sets, root, &profile, &candidates, jobs, only).map_err(|e| e.to_string())?;
    println!("{}", report.markdown());
    Ok(())
}

#[derive(Args)]
struct GenTraceArgs {
    /// The shape.
    #[arg(long, value_enum, default_value_t = TraceKind::LongDocument)]
    kind: TraceKind,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Distinct documents.
    #[arg(long, default_value_t = 32)]
    documents: usize,
    #[arg(long, default_value_t = 2_000)]
    requests: usize,
    /// Mean arrivals per second.
    #[arg(long, default_value_t = 2.0)]
    rate: f64,
    /// Where the JSON lines go.
    #[arg(long)]
    out: PathBuf,
}

/// The shapes `gen-trace` writes.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum TraceKind {
    /// Questions about a few long documents (`--documents`, `--requests`, `--rate`).
    LongDocument,
    /// The tuning protocol's generated shapes (`trace_shapes.rs`; only `--seed` applies).
    Agentic,
    Bursty,
    Tenants,
    Families,
    DecodeHeavy,
    ChatCpu,
}

fn gen_trace(a: GenTraceArgs) -> Result<(), kvgate_loadtest::trace_gen::TraceGenError> {
    use kvgate_loadtest::trace_gen::{to_jsonl, write_long_document, LongDocument, TraceGenError};
    use kvgate_loadtest::trace_shapes::Shape;
    let shape = match a.kind {
        TraceKind::LongDocument => None,
        TraceKind::Agentic => Some(Shape::Agentic),
        TraceKind::Bursty => Some(Shape::Bursty),
        TraceKind::Tenants => Some(Shape::Tenants),
        TraceKind::Families => Some(Shape::Families),
        TraceKind::DecodeHeavy => Some(Shape::DecodeHeavy),
        TraceKind::ChatCpu => Some(Shape::ChatCpu),
    };
    if let Some(shape) = shape {
        let t = shape.generate(a.seed);
        std::fs::write(&a.out, to_jsonl(&t))
            .map_err(|source| TraceGenError::Write { path: a.out.clone(), source })?;
        eprintln!(
            "{} requests, {} distinct blocks -> {}",
            t.requests.len(),
            t.distinct_blocks(),
            a.out.display()
        );
        return Ok(());
    }
    let shape = LongDocument {
        seed: a.seed,
        documents: a.documents,
        requests: a.requests,
        rate: a.rate,
        ..LongDocument::default()
    };
    let t = write_long_document(&shape, &a.out)?;
    eprintln!(
        "{} requests, {} distinct blocks -> {}",
        t.requests.len(),
        t.distinct_blocks(),
        a.out.display()
    );
    Ok(())
}

#[derive(Args)]
struct SimulateArgs {
    /// Mooncake trace (JSON lines: timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    trace: PathBuf,
    /// Simulated workers. Default 8.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Routing policy: goodput (the default), cache_aware_measured, cache_aware, round_robin, least_load,
    /// consistent_hash, or `all`.
    #[arg(long, default_value = kvgate_router::routing::DEFAULT_POLICY)]
    policy: String,
    /// KV tokens each worker holds. Default: the fleet holds a quarter of the trace's distinct blocks.
    #[arg(long)]
    kv_tokens_per_worker: Option<usize>,
    /// Timing profile: a shipped name (gpu-h100-llama3-8b, cpu-small) or a TOML file. Default gpu-h100-llama3-8b.
    #[arg(long, default_value = "gpu-h100-llama3-8b")]
    profile: String,
    /// Multiply arrival times by X (0.5 replays twice as fast). Default 1 (as recorded).
    #[arg(long, conflicts_with = "target_load")]
    time_scale: Option<f64>,
    /// Scale arrivals so the offered work (with the oracle's hits) is this fraction of the fleet's time.
    #[arg(long)]
    target_load: Option<f64>,
    /// Skip the first N requests (arrival times count from the first one replayed).
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Replay only N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Worker scheduler: most tokens per step. Default 2048 (the worker's default).
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Worker scheduler: most running sequences. Default 64.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// A routing weight, NAME=VALUE (repeatable): w_prefix, w_ring, w_load, per_request_tokens, load_floor_tokens,
    /// hotspot_abs_tokens, hotspot_ratio, hotspot_waste_factor, hotspot_copy_tokens, free_shared_tokens,
    /// ring_session_bound, credit_host, credit_disk. Defaults: the gateway's.
    #[arg(long = "weight", value_name = "NAME=VALUE")]
    weights: Vec<String>,
    /// The gateway's `--ring-hub-fanout`: a block followed by this many distinct blocks is a shared prefix's end.
    #[arg(long, default_value_t = kvgate_router::routing::ring_key::DEFAULT_HUB_FANOUT)]
    ring_hub_fanout: usize,
    /// Gateway replicas: request i goes to replica i mod N, each with its own registry and ring-key sketch
    /// (what each knows of its own sends); every worker reports to all. Default 1.
    #[arg(long, default_value_t = 1)]
    gateway_replicas: usize,
    /// With --gateway-replicas: replicas share their sends as the gateway's --share-sends does (overlay points,
    /// uncached tokens and ring key, applied by the others --share-delay-ms later). Default off.
    #[arg(long)]
    share_sends: bool,
    /// How long a shared send takes to reach the other replicas, in ms. Default 1 (measured between real
    /// replicas on one host: about 1 ms).
    #[arg(long, default_value_t = 1.0)]
    share_delay_ms: f64,
    /// Each worker's host DRAM KV tier, in tokens (131,072 bytes each; loads cost the profile's
    /// host_load_s_per_byte). Default 0: none.
    #[arg(long, default_value_t = 0)]
    host_kv_tokens_per_worker: usize,
    /// When blocks go to the host tier: write-back (at eviction) or write-through (every completed block).
    #[arg(long, default_value = "write-back")]
    kv_write_policy: String,
    /// Each worker's SSD KV tier, in tokens (loads cost the profile's disk_load_s_per_byte). Default 0: none.
    #[arg(long, default_value_t = 0)]
    disk_kv_tokens_per_worker: usize,
    /// Load vs recompute of what the lower tiers hold: auto (the cheaper, from the profile), load, recompute.
    #[arg(long, default_value = "auto")]
    kv_load_policy: String,
    /// Workers of different KV sizes: worker i of n holds the KV size x (1 + S x (2i / (n - 1) - 1)), the same
    /// total (0 <= S < 1). Default 0: all equal.
    #[arg(long, default_value_t = 0.0)]
    kv_spread: f64,
    /// Workers of different speeds: worker i of n computes 1 + S x (2i / (n - 1) - 1) times as fast as the
    /// profile, the same total (0 <= S < 1). Default 0: all equal.
    #[arg(long, default_value_t = 0.0)]
    speed_spread: f64,
    /// Run the gateway's admission with its default classes (short / long / reasoning budgets): requests wait
    /// for their class budget before they are routed, as in the gateway. Default off (every request is routed on
    /// arrival).
    #[arg(long)]
    admission: bool,
    /// Run admission with these classes: a TOML file with `[[classes]]` tables, the gateway config's syntax.
    #[arg(long, value_name = "FILE")]
    classes: Option<PathBuf>,
    /// LoRA adapters for a trace without `lora` fields: this many adapters, Zipf(--adapter-zipf) popularity, one per
    /// request drawn from its first hash id (a trace's own `lora` fields are used whatever this says). Default 0:
    /// none.
    #[arg(long, default_value_t = 0)]
    adapters: usize,
    /// Zipf exponent of the adapters' popularity. Default 1.
    #[arg(long, default_value_t = 1.0)]
    adapter_zipf: f64,
    /// Adapters each worker holds at once (the worker's --max-loras). Default 8.
    #[arg(long, default_value_t = 8)]
    adapter_slots: usize,
    /// How long an adapter load takes on a worker, in ms (a request waits for it). Default 500.
    #[arg(long, default_value_t = 500.0)]
    adapter_load_ms: f64,
    /// Where adapter requests go: cost (the gateway's), anywhere, random_holder, least_loaded, or all (each in
    /// turn, with --policy). Default cost.
    #[arg(long, default_value = "cost")]
    adapter_placement: String,
    /// Goodput's TTFT bound, ms, for a prompt of no tokens (with --slo-ttft-ms-per-1k). Default 1000.
    #[arg(long, default_value_t = 1000.0)]
    slo_ttft_ms: f64,
    /// Goodput's TTFT bound grows by this many ms per 1,000 prompt tokens. Default 0.
    #[arg(long = "slo-ttft-ms-per-1k", default_value_t = 0.0)]
    slo_ttft_ms_per_1k: f64,
    /// Goodput's TPOT bound, ms. Default 200.
    #[arg(long, default_value_t = 200.0)]
    slo_tpot_ms: f64,
    /// Print one JSON object per policy (one line each) instead of a table.
    #[arg(long, conflicts_with = "markdown")]
    json: bool,
    /// Print the table as Markdown rows (for docs/benchmarks/).
    #[arg(long)]
    markdown: bool,
}

async fn chaos(a: ChaosArgs) -> Result<(), String> {
    let spec = kvgate_loadtest::chaos::run::ChaosSpec {
        seed: a.seed,
        duration: a.duration,
        dir: a.out.clone(),
        bin_dir: kvgate_loadtest::fleet::default_bin_dir(),
        concurrency: a.concurrency,
        profile: a.profile,
    };
    let s = kvgate_loadtest::chaos::run::run(&spec).await?;
    println!("{} requests, {} faults; errors by code: {:?}", s.requests, s.faults.len(), s.errors_by_code);
    println!(
        "TTFT p50 / p99 ms: outside faults {:.1} / {:.1}, inside {:.1} / {:.1}",
        s.ttft_p50_ms_quiet, s.ttft_p99_ms_quiet, s.ttft_p50_ms_faults, s.ttft_p99_ms_faults
    );
    for r in &s.resources {
        println!("{r}");
    }
    for r in &s.recoveries {
        let after = r.recovered_after_s.map_or("not within the run".into(), |a| format!("{a:.1} s"));
        println!(
            "{} on {}: {:.1} turns/s and hit {:.2} before; back at rate after {after} (hit {:.2})",
            r.fault.kind.as_str(),
            r.fault.target,
            r.rate_before,
            r.hit_before,
            r.hit_after.unwrap_or(0.0)
        );
    }
    println!("isolation: {} first sends of shared documents checked", s.isolation_checked);
    for v in &s.violations {
        println!("VIOLATION {}: request {}: {} (fault: {:?})", v.invariant, v.request, v.detail, v.fault);
    }
    println!("summary: {}", a.out.join("summary.json").display());
    match s.violations.len() {
        0 => Ok(()),
        n => Err(format!("{n} invariant violations")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Simulate(args) => simulate(args),
        Command::SimulatePd(args) => pd_cmd::simulate_pd(args),
        Command::GenTrace(args) => gen_trace(args).map_err(|e| e.to_string()),
        Command::Tune(args) => tune(args),
        Command::Run(a) => block_on(commands::run(a)),
        Command::Compare(a) => block_on(async { commands::compare(a).await.map(|_| ()) }),
        Command::Up(a) => block_on(commands::up(a)),
        Command::Demo(a) => block_on(commands::demo(a)),
        Command::Chaos(a) => block_on(chaos(a)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvgate-loadtest: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs a command on a tokio runtime; Ctrl-C or SIGTERM drops it (and with it every process it started).
fn block_on(fut: impl std::future::Future<Output = Result<(), String>>) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| format!("signal handler: {e}"))?;
        tokio::select! {
            r = fut => r,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("\ninterrupted: stopping every process this command started");
                Ok(())
            }
            _ = term.recv() => {
                eprintln!("terminated: stopping every process this command started");
                Ok(())
            }
        }
    })
}

fn parse_weights(pairs: &[String]) -> Result<Weights, String> {
    let mut table = String::new();
    for p in pairs {
        let (k, v) = p.split_once('=').ok_or_else(|| format!("--weight {p}: expected NAME=VALUE"))?;
        table.push_str(&format!("{} = {}\n", k.trim(), v.trim()));
    }
    let w: Weights = toml::from_str(&table).map_err(|e| format!("--weight: {e}"))?;
    let problems = w.validate();
    if problems.is_empty() {
        Ok(w)
    } else {
        Err(problems.join("; "))
    }
}

fn simulate(a: SimulateArgs) -> Result<(), String> {
    let mut trace = Trace::load(&a.trace)?;
    trace.window(a.skip, a.limit);
    let profile = SimProfile::named_or_file(&a.profile)?;
    let workers = a.workers.max(1);
    let kv = a.kv_tokens_per_worker.unwrap_or_else(|| {
        let fleet = trace.distinct_blocks() * TRACE_BLOCK_TOKENS / 4;
        (fleet / workers).next_multiple_of(16)
    });
    let mut cfg = SimConfig::new(a.workers, kv, profile);
    cfg.scheduler.max_num_batched_tokens = a.max_num_batched_tokens;
    cfg.scheduler.max_num_seqs = a.max_num_seqs;
    cfg.weights = parse_weights(&a.weights)?;
    cfg.ring_hub_fanout = a.ring_hub_fanout;
    cfg.gateway_replicas = a.gateway_replicas;
    cfg.share_sends = a.share_sends;
    cfg.share_delay_s = a.share_delay_ms / 1000.0;
    cfg.host_kv_tokens_per_worker = a.host_kv_tokens_per_worker;
    cfg.kv_write_policy = kvgate_worker::kv::WritePolicy::parse(&a.kv_write_policy)?;
    cfg.disk_kv_tokens_per_worker = a.disk_kv_tokens_per_worker;
    cfg.kv_load_policy = kvgate_worker::kv::LoadPolicy::parse(&a.kv_load_policy)?;
    cfg.kv_spread = a.kv_spread;
    cfg.speed_spread = a.speed_spread;
    cfg.slo = kvgate_router::routing::Slo {
        ttft_ms: a.slo_ttft_ms,
        ttft_ms_per_1k_tokens: a.slo_ttft_ms_per_1k,
        tpot_ms: a.slo_tpot_ms,
    };
    cfg.classes = match (&a.classes, a.admission) {
        (Some(path), _) => load_classes(path)?,
        (None, true) => kvgate_router::admission::default_classes(),
        (None, false) => Vec::new(),
    };
    let pace = match (a.time_scale, a.target_load) {
        (_, Some(f)) => Pace::TargetLoad(f),
        (Some(x), None) => Pace::TimeScale(x),
        (None, None) => Pace::TimeScale(1.0),
    };
    let policies: Vec<String> = if a.policy == "all" {
        POLICIES.iter().map(|p| p.to_string()).collect()
    } else if POLICIES.contains(&a.policy.as_str()) {
        vec![a.policy.clone()]
    } else {
        return Err(format!("unknown policy {:?}; expected one of {} or all", a.policy, POLICIES.join(", ")));
    };
    let rules = match a.adapter_placement.as_str() {
        "all" => sim::adapters::Rule::ALL.to_vec(),
        one => vec![sim::adapters::Rule::parse(one)?],
    };
    let with_adapters = a.adapters > 0 || trace.requests.iter().any(|r| r.lora.is_some());
    let runs: Vec<(String, SimConfig)> = match with_adapters {
        false => policies.into_iter().map(|p| (p, cfg.clone())).collect(),
        true => policies
            .iter()
            .flat_map(|p| {
                rules.iter().map(|rule| {
                    let adapters = sim::adapters::AdapterSim {
                        rule: *rule,
                        slots: a.adapter_slots,
                        load_s: a.adapter_load_ms / 1000.0,
                        assign: (a.adapters > 0).then_some((a.adapters, a.adapter_zipf)),
                    };
                    (p.clone(), SimConfig { adapters: Some(adapters), ..cfg.clone() })
                })
            })
            .collect(),
    };
    let prep = sim::prepare(&trace, &runs[0].1, pace)?;
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get()).min(runs.len()).max(1);
    let results = run_parallel(&trace, &prep, &runs, jobs)?;
    if a.json {
        for r in &results {
            println!("{}", serde_json::to_string(r).map_err(|e| e.to_string())?);
        }
    } else if a.markdown {
        print_markdown(&cfg, &results);
    } else {
        print_table(&trace, &cfg, &results);
    }
    Ok(())
}

/// Classes from a TOML file of `[[classes]]` tables.
fn load_classes(path: &std::path::Path) -> Result<Vec<kvgate_router::admission::ClassConfig>, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        classes: Vec<kvgate_router::admission::ClassConfig>,
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("--classes {}: {e}", path.display()))?;
    let f: File = toml::from_str(&text).map_err(|e| format!("--classes {}: {e}", path.display()))?;
    Ok(f.classes)
}

/// Replays each (policy, configuration) on `jobs` threads.
fn run_parallel(
    trace: &Trace,
    prep: &sim::ReplayPlan,
    runs: &[(String, SimConfig)],
    jobs: usize,
) -> Result<Vec<SimResult>, String> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<Result<SimResult, String>>>> =
        runs.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((p, cfg)) = runs.get(i) else { break };
                let r = sim::simulate(trace, cfg, prep, p);
                if let Ok(mut slot) = slots[i].lock() {
                    *slot = Some(r);
                }
            });
        }
    });
    slots
        .into_iter()
        .map(|m| m.into_inner().ok().flatten().unwrap_or_else(|| Err("a replay thread died".into())))
        .collect()
}

fn print_table(trace: &Trace, cfg: &SimConfig, results: &[SimResult]) {
    let Some(first) = results.first() else { return };
    println!(
        "{} requests, {} workers x {} KV tokens, profile {}, time scale {:.4}, offered load {:.2}, oracle hit rate {:.3}",
        trace.requests.len(),
        cfg.workers,
        cfg.kv_tokens_per_worker,
        cfg.profile.name,
        first.time_scale,
        first.offered_load,
        first.oracle_hit_rate
    );
    println!(
        "{:<20} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11} {:>9} {:>8} {:>9}",
        "policy",
        "hit_rate",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "goodput_t/s",
        "max/mean",
        "busy",
        "rejected"
    );
    for r in results {
        if let Some(rule) = &r.adapter_placement {
            println!(
                "adapters placed by {rule}: {} loads, {} unloaded for another",
                r.adapter_loads, r.adapter_evictions
            );
        }
        println!(
            "{:<20} {:>9.3} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>9.2} {:>8.2} {:>9}",
            r.policy,
            r.hit_rate,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.tpot_p50_ms,
            r.tpot_p99_ms,
            r.goodput_tokens_per_s,
            r.max_mean_load,
            r.busy_fraction,
            r.rejected
        );
        for (name, c) in &r.classes {
            println!(
                "  class {:<10} completed {:>6}  refused {:>5}  timed out {:>5}  ttft p50 {:>9.1} ms  p99 {:>9.1} ms  wait p99 {:>9.1} ms",
                name, c.completed, c.refused, c.timed_out, c.ttft_p50_ms, c.ttft_p99_ms, c.wait_p99_ms
            );
        }
    }
}

/// One row per adapter placement rule.
fn print_adapter_markdown(results: &[SimResult]) {
    println!("| load | policy | placement | hit rate | x oracle | TTFT p50 ms | TTFT p99 ms | max/mean | adapter loads | unloaded for another |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in results {
        let vs_oracle = if r.oracle_hit_rate > 0.0 {
            format!("{:.2}", r.hit_rate / r.oracle_hit_rate)
        } else {
            "-".into()
        };
        println!(
            "| {:.2} | {} | {} | {:.3} | {} | {:.0} | {:.0} | {:.2} | {} | {} |",
            r.offered_load,
            r.policy,
            r.adapter_placement.as_deref().unwrap_or("-"),
            r.hit_rate,
            vs_oracle,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.max_mean_load,
            r.adapter_loads,
            r.adapter_evictions
        );
    }
}

fn print_markdown(cfg: &SimConfig, results: &[SimResult]) {
    if results.iter().any(|r| r.adapter_placement.is_some()) {
        return print_adapter_markdown(results);
    }
    println!(
        "| load | KV tokens/worker | policy | hit rate | x round_robin | x oracle | TTFT p50 ms | TTFT p99 ms | max/mean | busy |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let rr = results.iter().find(|r| r.policy == "round_robin").map(|r| r.hit_rate);
    for r in results {
        let vs_rr = rr.filter(|h| *h > 0.0).map_or("-".to_owned(), |h| format!("{:.2}", r.hit_rate / h));
        let vs_oracle = if r.oracle_hit_rate > 0.0 {
            format!("{:.2}", r.hit_rate / r.oracle_hit_rate)
        } else {
            "-".into()
        };
        println!(
            "| {:.2} | {} | {} | {:.3} | {} | {} | {:.0} | {:.0} | {:.2} | {:.2} |",
            r.offered_load,
            cfg.kv_tokens_per_worker,
            r.policy,
            r.hit_rate,
            vs_rr,
            vs_oracle,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.max_mean_load,
            r.busy_fraction
        );
    }
    for r in results.iter().filter(|r| r.host_kv_tokens_per_worker > 0 || r.disk_kv_tokens_per_worker > 0) {
        println!(
            "\n{}: host tier {} tokens/worker: {:.2} GB copied down, {} blocks loaded back; SSD tier {} tokens/worker: \
             {} blocks read back; {} lower-tier tokens computed again by choice",
            r.policy,
            r.host_kv_tokens_per_worker,
            r.host_stored_bytes as f64 / 1e9,
            r.host_hit_blocks,
            r.disk_kv_tokens_per_worker,
            r.disk_read_blocks,
            r.recomputed_tokens
        );
    }
}
