//! The load-generation commands: `run` (against any endpoint the user names), `compare` (a local fleet per
//! policy, the same workload against each), `up` (a local fleet until Ctrl-C) and `demo` (the README's main
//! command). Arguments are clap structs so `main.rs` only dispatches.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use kvgate_shared::duration::parse_duration;

use crate::client::Client;
use crate::ending::{Ending, EndingError, ModelEnding};
use crate::fleet::{default_bin_dir, FleetSpec, LocalFleet, WorkerEngine};
use crate::report::{summary, Report, RunReport, Slo, Summary};
use crate::runner::{self, Mode, RunOptions};
use crate::trace::Trace;
use crate::workload::long_burst::LongBurst;
use crate::workload::multi_turn::MultiTurn;
use crate::workload::shared_prefix::SharedPrefix;
use crate::workload::{mooncake, Plan};

/// The workloads `--workload` accepts.
pub const WORKLOADS: [&str; 4] = ["multi-turn", "shared-prefix", "long-burst", "mooncake"];

/// Which workload, and its shape.
#[derive(Args, Clone, Debug)]
pub struct WorkloadArgs {
    /// multi-turn, shared-prefix, long-burst or mooncake.
    #[arg(long, default_value = "multi-turn")]
    pub workload: String,
    /// Seed of every generator (same seed, same requests).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Poisson arrival rate: requests/s (shared-prefix), users starting/s (multi-turn), short requests/s
    /// (long-burst). Default 2. mooncake uses the trace's timestamps instead.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Closed loop: keep N jobs in flight (a multi-turn user is one job) instead of arrival times.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Token ids of token-prompt workloads are below this (256: valid for any byte-level tokenizer).
    #[arg(long, default_value_t = 256)]
    pub vocab: u32,
    /// Output tokens per request. Default: 64 multi-turn, 256 shared-prefix, 32 long-burst (mooncake: the trace's).
    #[arg(long)]
    pub output_tokens: Option<u32>,
    /// mooncake: the trace file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// mooncake: keep only the requests of the K prefix families (same first block) with the most requests, before
    /// --skip/--limit (a short replay that still has the trace's reuse; see `Trace::top_roots`). Default: all.
    #[arg(long)]
    pub top_roots: Option<usize>,
    /// mooncake: skip the trace's first N requests.
    #[arg(long, default_value_t = 0)]
    pub skip: usize,
    /// mooncake: replay N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// mooncake: multiply the trace's arrival times by X.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// shared-prefix: groups (each with its own system prompt).
    #[arg(long, default_value_t = 64)]
    pub groups: usize,
    /// shared-prefix: prompts per group.
    #[arg(long, default_value_t = 16)]
    pub prompts_per_group: usize,
    /// shared-prefix: system prompt tokens.
    #[arg(long, default_value_t = 2048)]
    pub system_tokens: usize,
    /// shared-prefix: question tokens.
    #[arg(long, default_value_t = 128)]
    pub question_tokens: usize,
    /// multi-turn: users.
    #[arg(long, default_value_t = 16)]
    pub users: usize,
    /// multi-turn: turns per user.
    #[arg(long, default_value_t = 5)]
    pub turns: usize,
    /// multi-turn: words of the shared system prompt.
    #[arg(long, default_value_t = 1024)]
    pub system_words: usize,
    /// multi-turn: words per question.
    #[arg(long, default_value_t = 64)]
    pub question_words: usize,
    /// multi-turn: mean think time between turns, seconds.
    #[arg(long, default_value_t = 1.0)]
    pub think_time: f64,
    /// long-burst: short prompt tokens.
    #[arg(long, default_value_t = 256)]
    pub short_tokens: usize,
    /// long-burst: long prompt tokens.
    #[arg(long, default_value_t = 16_384)]
    pub long_tokens: usize,
    /// long-burst: seconds between bursts.
    #[arg(long, default_value_t = 10.0)]
    pub burst_every: f64,
    /// long-burst: long prompts per burst.
    #[arg(long, default_value_t = 4)]
    pub burst_size: usize,
    /// long-burst: seconds of traffic to generate.
    #[arg(long, default_value_t = 30.0)]
    pub burst_duration: f64,
    /// Send token-id prompts (shared-prefix, long-burst, mooncake) as text, one word per id, for servers that
    /// refuse token ids (SMG). Default off.
    #[arg(long)]
    pub text_prompts: bool,
    /// Let the model end each request instead of sending max_tokens = the output length with ignore_eos: sampled
    /// with a per-request seed and a per-request set of about VOCAB / output stop_token_ids, so lengths spread
    /// around the output length, under a loose max_tokens or none (see `ending.rs`). VOCAB: the model's vocabulary
    /// size (8192 for the synthetic `small`). Default off: every request generates exactly its output length.
    #[arg(long, value_name = "VOCAB")]
    pub model_ends: Option<u32>,
    /// With --model-ends: the sampling temperature. Default 16 (the synthetic models' samples spread over the
    /// vocabulary there).
    #[arg(long, requires = "model_ends")]
    pub model_ends_temperature: Option<f32>,
    /// With --model-ends: max_tokens = output x a factor uniform in [LO, HI]. Default 2,10.
    #[arg(long, value_name = "LO,HI", value_delimiter = ',', num_args = 2, requires = "model_ends")]
    pub max_tokens_over: Option<Vec<f64>>,
    /// With --model-ends: the share of requests sent with no max_tokens. Default 0.1.
    #[arg(long, requires = "model_ends")]
    pub no_max_tokens_share: Option<f64>,
}

impl WorkloadArgs {
    /// How requests end (`--model-ends` and its companions).
    pub fn ending(&self) -> Result<Ending, EndingError> {
        let Some(vocab) = self.model_ends else { return Ok(Ending::Exact) };
        let mut m = ModelEnding::new(vocab);
        if let Some(t) = self.model_ends_temperature {
            m.temperature = t;
        }
        if let Some(o) = &self.max_tokens_over {
            m.over = (o[0], o[1]);
        }
        if let Some(f) = self.no_max_tokens_share {
            m.no_max_share = f;
        }
        m.validate()?;
        Ok(Ending::Model(m))
    }

    /// Builds the plan (seeded: the same arguments give the same requests).
    pub fn plan(&self) -> Result<Plan, String> {
        let rate = self.rate.unwrap_or(2.0);
        if !(rate > 0.0 && rate.is_finite()) {
            return Err(format!("--rate must be a number > 0, got {rate}"));
        }
        let plan = match self.workload.as_str() {
            "shared-prefix" => SharedPrefix {
                groups: self.groups,
                prompts_per_group: self.prompts_per_group,
                system_tokens: self.system_tokens,
                question_tokens: self.question_tokens,
                output_tokens: self.output_tokens.unwrap_or(256),
            }
            .plan(rate, self.vocab, self.seed),
            "multi-turn" => MultiTurn {
                users: self.users,
                turns: self.turns,
                system_words: self.system_words,
                question_words: self.question_words,
                output_tokens: self.output_tokens.unwrap_or(64),
                think_s: self.think_time,
            }
            .plan(rate, self.seed),
            "long-burst" => LongBurst {
                duration_s: self.burst_duration,
                short_tokens: self.short_tokens,
                long_tokens: self.long_tokens,
                burst_every_s: self.burst_every,
                burst_size: self.burst_size,
                output_tokens: self.output_tokens.unwrap_or(32),
            }
            .plan(rate, self.vocab, self.seed),
            "mooncake" => {
                let path = self.trace.as_ref().ok_or("--workload mooncake needs --trace FILE")?;
                let mut trace = Trace::load(path)?;
                if let Some(k) = self.top_roots {
                    trace.top_roots(k);
                }
                trace.window(self.skip, self.limit);
                if !(self.time_scale > 0.0 && self.time_scale.is_finite()) {
                    return Err(format!("--time-scale must be a number > 0, got {}", self.time_scale));
                }
                mooncake::plan(&trace, self.time_scale, self.vocab)
            }
            other => {
                return Err(format!("unknown workload {other:?}; expected one of {}", WORKLOADS.join(", ")))
            }
        };
        if plan.requests() == 0 {
            return Err("the workload has no requests (check its size flags)".into());
        }
        Ok(plan)
    }

    fn mode(&self) -> Mode {
        self.concurrency.map_or(Mode::Open, Mode::Closed)
    }
}

/// Bounds, SLOs and output.
#[derive(Args, Clone, Debug)]
pub struct RunLimits {
    /// Issue no request after this long (the run always stops by itself). Default 300s.
    #[arg(long, default_value = "300s")]
    pub duration: String,
    /// Issue at most N requests. Default: the whole workload.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Give up on one request after this long. Default 120s.
    #[arg(long, default_value = "120s")]
    pub request_timeout: String,
    /// Goodput SLO: time to first token, ms. Default 2000.
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// Goodput SLO: time per output token, ms. Default 200.
    #[arg(long, default_value_t = 200.0)]
    pub slo_tpot_ms: f64,
    /// Where results.json and report.html go.
    #[arg(long, default_value = "kvgate-loadtest-out")]
    pub out: PathBuf,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

impl RunLimits {
    fn options(&self, mode: Mode) -> Result<(RunOptions, Slo), String> {
        let duration = parse_duration(&self.duration).map_err(|e| format!("--duration: {e}"))?;
        let request_timeout =
            parse_duration(&self.request_timeout).map_err(|e| format!("--request-timeout: {e}"))?;
        if self.slo_ttft_ms <= 0.0 || self.slo_tpot_ms <= 0.0 {
            return Err("--slo-ttft-ms and --slo-tpot-ms must be > 0".into());
        }
        let opts = RunOptions {
            mode,
            duration,
            max_requests: self.requests.unwrap_or(usize::MAX),
            progress: !self.no_progress,
            request_timeout,
            text_prompts: false,
        };
        Ok((opts, Slo { ttft_ms: self.slo_ttft_ms, tpot_ms: self.slo_tpot_ms }))
    }
}

/// `kvgate-loadtest run`.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    /// The OpenAI-compatible endpoint (a kvgate gateway, or a worker directly), e.g. http://127.0.0.1:8080.
    /// Several comma-separated (gateway replicas): requests go to them in turn.
    #[arg(long)]
    pub target: String,
    /// Model name. Default: the first one GET /v1/models lists.
    #[arg(long)]
    pub model: Option<String>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub limits: RunLimits,
}

fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

/// Runs one workload against `client`.
async fn run_one(
    label: &str,
    client: Client,
    plan: &Plan,
    opts: RunOptions,
    slo: Slo,
    fleet_workers: Option<usize>,
) -> RunReport {
    let out = runner::run(client, plan, opts).await;
    let summary = Summary::of(label, &out.records, out.wall_s, slo, fleet_workers);
    RunReport { label: label.to_owned(), summary, records: out.records }
}

fn finish(report: &Report, out: &std::path::Path) -> Result<(), String> {
    let rows: Vec<Summary> = report.runs.iter().map(|r| r.summary.clone()).collect();
    print!("{}", summary::table(&rows));
    for r in &rows {
        for e in &r.sample_errors {
            println!("  {} error: {e}", r.label);
        }
    }
    let html = report.write(out)?;
    println!("report: {} (every request: {})", html.display(), out.join("results.json").display());
    Ok(())
}

/// `run`: one workload against the target.
pub async fn run(a: RunArgs) -> Result<(), String> {
    let plan = a.workload.plan()?;
    let (mut opts, slo) = a.limits.options(a.workload.mode())?;
    opts.text_prompts = a.workload.text_prompts;
    let timeout = opts.request_timeout;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => Client::first_model(&a.target).await?,
    };
    eprintln!("{}: {} requests against {} (model {model})", plan.name, plan.requests(), a.target);
    let client =
        Client::new(&a.target, &model, timeout).with_ending(a.workload.ending().map_err(|e| e.to_string())?);
    let report = run_one("run", client, &plan, opts, slo, None).await;
    let report = Report { workload: plan.name.clone(), command: command_line(), runs: vec![report] };
    finish(&report, &a.limits.out)
}

/// The local fleet of `compare` and `up`.
#[derive(Args, Clone, Debug)]
pub struct FleetArgs {
    /// Workers in the fleet.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Worker engine: `sim` (timing model, fast, any size) or `cpu` (real math on a synthesized model).
    #[arg(long, default_value = "sim")]
    pub engine: String,
    /// Timing profile of `--engine sim` (shipped name or TOML file).
    #[arg(long, default_value = "gpu-h100-llama3-8b")]
    pub sim_profile: String,
    /// Synthetic model preset. Default: tiny for sim (tokenizer only), small for cpu.
    #[arg(long)]
    pub synth: Option<String>,
    /// KV tokens per worker.
    #[arg(long, default_value_t = 65_536)]
    pub kv_cache_tokens: usize,
    /// Where the binaries are. Default: next to this one (or $KVGATE_BIN_DIR).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
}

impl FleetArgs {
    fn spec(&self, policy: &str, log_dir: PathBuf) -> Result<FleetSpec, String> {
        let engine = match self.engine.as_str() {
            "sim" => WorkerEngine::Sim { profile: self.sim_profile.clone() },
            "cpu" => WorkerEngine::Cpu,
            e => return Err(format!("--engine {e}: expected sim or cpu")),
        };
        if self.workers == 0 {
            return Err("--workers must be at least 1".into());
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let synth = self
            .synth
            .clone()
            .unwrap_or_else(|| if engine == WorkerEngine::Cpu { "small" } else { "tiny" }.into());
        Ok(FleetSpec {
            workers: self.workers,
            worker_threads: (engine == WorkerEngine::Cpu).then(|| (cores / self.workers).max(1)),
            engine,
            synth,
            synth_dir: None,
            kv_cache_tokens: self.kv_cache_tokens,
            policy: policy.to_owned(),
            log_dir,
            bin_dir: self.bin_dir.clone().unwrap_or_else(default_bin_dir),
            ready_timeout: Duration::from_secs(300),
        })
    }
}

/// `kvgate-loadtest compare`.
#[derive(Args, Clone, Debug)]
pub struct CompareArgs {
    /// Policies, in order (comma-separated).
    #[arg(
        long,
        default_value = "round_robin,least_load,consistent_hash,cache_aware_measured,goodput",
        value_delimiter = ','
    )]
    pub policies: Vec<String>,
    #[command(flatten)]
    pub fleet: FleetArgs,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub limits: RunLimits,
}

/// `compare`: for each policy a fresh local fleet, the same workload, one table and one combined report.
/// `compare`: one fresh fleet per policy, the same workload against each; returns each run's summary.
pub async fn compare(a: CompareArgs) -> Result<Vec<Summary>, String> {
    for p in &a.policies {
        if !kvgate_router::routing::POLICIES.contains(&p.as_str()) {
            return Err(format!(
                "unknown policy {p:?}; expected {}",
                kvgate_router::routing::POLICIES.join(", ")
            ));
        }
    }
    let plan = a.workload.plan()?;
    let ending = a.workload.ending().map_err(|e| e.to_string())?;
    let (mut opts, slo) = a.limits.options(a.workload.mode())?;
    opts.text_prompts = a.workload.text_prompts;
    let mut runs = Vec::new();
    for policy in &a.policies {
        let spec = a.fleet.spec(policy, a.limits.out.join("logs").join(policy))?;
        eprintln!("{policy}: starting a gateway and {} {} workers", spec.workers, a.fleet.engine);
        let fleet = LocalFleet::start(&spec).await?;
        eprintln!("{policy}: {} ({} requests)", plan.name, plan.requests());
        let client =
            Client::new(&fleet.gateway, &fleet.model, opts.request_timeout).with_ending(ending.clone());
        runs.push(run_one(policy, client, &plan, opts, slo, Some(spec.workers)).await);
        fleet.stop();
    }
    let report = Report { workload: plan.name.clone(), command: command_line(), runs };
    finish(&report, &a.limits.out)?;
    Ok(report.runs.into_iter().map(|r| r.summary).collect())
}

/// What the demo's two rows mean, every claim derived from the numbers (round_robin, then the cache-aware run,
/// named by its label).
pub fn demo_explanation(rr: &Summary, ca: &Summary) -> String {
    let policy = &ca.label;
    let compare = |a: f64, b: f64, less: &str, more: &str| if a < b { less } else { more }.to_owned();
    let hit = compare(ca.hit_rate, rr.hit_rate, "lower than", "higher than");
    let ttft = compare(ca.ttft_p50_ms, rr.ttft_p50_ms, "lower", "not lower");
    let p99 = compare(ca.ttft_p99_ms, rr.ttft_p99_ms, "lower", "not lower");
    let goodput = compare(ca.goodput_tokens_per_s, rr.goodput_tokens_per_s, "lower than", "at least");
    let balance = if ca.max_mean_worker <= 1.25 {
        format!("close to even (the busiest worker served {:.2}x the mean)", ca.max_mean_worker)
    } else {
        format!("uneven (the busiest worker served {:.2}x the mean)", ca.max_mean_worker)
    };
    let tpot = if ca.tpot_p50_ms > rr.tpot_p50_ms * 1.15 {
        "more than 15% higher: on CPU workers batched decodes are not free, so a worker decoding for more users at \
         once is slower per token"
    } else {
        "within 15% of round_robin's"
    };
    format!(
        "What the numbers mean: hit_rate is the share of prompt tokens the workers served from their prefix cache \
         (from each response's usage.prompt_tokens_details.cached_tokens): {policy}'s {:.3} is {hit} \
         round_robin's {:.3}, because it sends each turn where the conversation's blocks are, so only the new question \
         is prefilled, while round_robin scatters a user's turns. Its TTFT p50 ({:.0} ms vs {:.0} ms) is {ttft}, its \
         p99 ({:.0} ms vs {:.0} ms) {p99}. goodput counts completion tokens/s of requests within the SLO (TTFT <= \
         {:.0} ms, TPOT <= {:.0} ms): {policy}'s {:.1} is {goodput} round_robin's {:.1}. max/mean is the busiest \
         worker's request count over the mean: here {policy}'s load was {balance}. Its TPOT p50 ({:.1} ms vs {:.1} \
         ms) is {tpot}.",
        ca.hit_rate,
        rr.hit_rate,
        ca.ttft_p50_ms,
        rr.ttft_p50_ms,
        ca.ttft_p99_ms,
        rr.ttft_p99_ms,
        ca.slo.ttft_ms,
        ca.slo.tpot_ms,
        ca.goodput_tokens_per_s,
        rr.goodput_tokens_per_s,
        ca.tpot_p50_ms,
        rr.tpot_p50_ms
    )
}

/// `kvgate-loadtest up`.
#[derive(Args, Clone, Debug)]
pub struct UpArgs {
    /// Routing policy of the gateway.
    #[arg(long, default_value = kvgate_router::routing::DEFAULT_POLICY)]
    pub policy: String,
    /// Workers (3 CPU workers on the synthesized `small` model by default).
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Worker engine: cpu or sim.
    #[arg(long, default_value = "cpu")]
    pub engine: String,
    #[arg(long, default_value = "gpu-h100-llama3-8b")]
    pub sim_profile: String,
    #[arg(long, default_value_t = 65_536)]
    pub kv_cache_tokens: usize,
    /// Where the process logs go.
    #[arg(long, default_value = "kvgate-up-logs")]
    pub log_dir: PathBuf,
}

/// `up`: a local fleet until Ctrl-C.
pub async fn up(a: UpArgs) -> Result<(), String> {
    let fleet_args = FleetArgs {
        workers: a.workers,
        engine: a.engine.clone(),
        sim_profile: a.sim_profile.clone(),
        synth: None,
        kv_cache_tokens: a.kv_cache_tokens,
        bin_dir: None,
    };
    let spec = fleet_args.spec(&a.policy, a.log_dir.clone())?;
    eprintln!(
        "starting a gateway and {} {} workers (the first start synthesizes the model)...",
        a.workers, a.engine
    );
    let fleet = LocalFleet::start(&spec).await?;
    println!("kvgate is up: gateway {} (policy {}), control {}", fleet.gateway, a.policy, fleet.control);
    println!("workers: {}", fleet.workers.join(" "));
    println!("logs: {}", a.log_dir.display());
    println!(
        "try:\n  curl -s {}/v1/chat/completions -H 'content-type: application/json' -H 'x-session-id: alice' \\\n    \
         -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}],\"max_tokens\":16}}' -i",
        fleet.gateway, fleet.model
    );
    println!("metrics: curl -s {}/metrics | grep kvgate_gateway_requests", fleet.control);
    println!("Ctrl-C stops everything.");
    std::future::pending::<()>().await;
    Ok(())
}

/// `kvgate-loadtest demo`.
#[derive(Args, Clone, Debug)]
pub struct DemoArgs {
    /// Where the report goes.
    #[arg(long, default_value = "target/kvgate-demo")]
    pub out: PathBuf,
    /// Workers.
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
}

/// `demo`: 3 CPU workers on the synthesized `small` model, a short multi-turn workload under round_robin then
/// the default policy, and the comparison.
pub async fn demo(a: DemoArgs) -> Result<(), String> {
    let fleet = FleetArgs {
        workers: a.workers,
        engine: "cpu".into(),
        sim_profile: String::new(),
        synth: Some("small".into()),
        kv_cache_tokens: 32_768,
        bin_dir: None,
    };
    let workload = WorkloadArgs {
        workload: "multi-turn".into(),
        seed: 7,
        rate: Some(1.0),
        concurrency: None,
        vocab: 256,
        output_tokens: Some(32),
        trace: None,
        top_roots: None,
        skip: 0,
        limit: None,
        time_scale: 1.0,
        groups: 0,
        prompts_per_group: 0,
        system_tokens: 0,
        question_tokens: 0,
        users: 8,
        turns: 6,
        system_words: 150,
        question_words: 60,
        think_time: 0.5,
        short_tokens: 0,
        long_tokens: 0,
        burst_every: 1.0,
        burst_size: 0,
        burst_duration: 0.0,
        text_prompts: false,
        model_ends: None,
        model_ends_temperature: None,
        max_tokens_over: None,
        no_max_tokens_share: None,
    };
    let limits = RunLimits {
        duration: "90s".into(),
        requests: None,
        request_timeout: "60s".into(),
        slo_ttft_ms: 1000.0,
        slo_tpot_ms: 200.0,
        out: a.out.clone(),
        no_progress: false,
    };
    println!(
        "kvgate demo: a gateway and {} CPU workers (synthesized `small` Llama-style model) on this machine; 8 users x 6 \
         chat turns sharing a system prompt, each turn carrying the conversation so far; first with round_robin, then \
         with {}.",
        a.workers,
        kvgate_router::routing::DEFAULT_POLICY
    );
    let runs = compare(CompareArgs {
        policies: vec!["round_robin".into(), kvgate_router::routing::DEFAULT_POLICY.into()],
        fleet,
        workload,
        limits,
    })
    .await?;
    if let [rr, ca] = runs.as_slice() {
        println!("\n{}", demo_explanation(rr, ca));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::summary::Slo;

    fn row(hit_rate: f64, ttft: f64, max_mean: f64) -> Summary {
        Summary {
            label: String::new(),
            requests: 48,
            ok: 48,
            errors: 0,
            hit_rate,
            ttft_p50_ms: ttft,
            ttft_p90_ms: ttft,
            ttft_p99_ms: ttft,
            tpot_p50_ms: 5.0,
            tpot_p99_ms: 5.0,
            e2e_p50_ms: ttft,
            throughput_tokens_per_s: 1.0,
            goodput_tokens_per_s: 1.0,
            slo: Slo { ttft_ms: 1000.0, tpot_ms: 200.0 },
            requests_per_worker: Default::default(),
            max_mean_worker: max_mean,
            wall_s: 1.0,
            sample_errors: Vec::new(),
        }
    }

    #[test]
    fn the_demo_explanation_says_what_its_numbers_say() {
        let uneven = demo_explanation(&row(0.6, 180.0, 1.0), &row(0.78, 120.0, 1.88));
        assert!(uneven.contains("0.780 is higher than") && uneven.contains("is lower"), "{uneven}");
        assert!(uneven.contains("uneven (the busiest worker served 1.88x the mean)"), "{uneven}");
        assert!(uneven.contains("is within 15% of round_robin's."), "equal TPOTs: {uneven}");
        assert!(uneven.contains("1.0 is at least round_robin's 1.0"), "{uneven}");
        assert!(!uneven.contains("near 1"));
        let even = demo_explanation(&row(0.6, 100.0, 1.0), &row(0.5, 150.0, 1.1));
        assert!(
            even.contains("lower than")
                && even.contains("not lower")
                && even.contains("close to even (the busiest worker served 1.10x"),
            "{even}"
        );
        let mut slow = row(0.78, 120.0, 1.5);
        slow.tpot_p50_ms = 9.0;
        slow.goodput_tokens_per_s = 0.5;
        let slow = demo_explanation(&row(0.6, 180.0, 1.0), &slow);
        assert!(slow.contains("(9.0 ms vs 5.0 ms) is more than 15% higher: on CPU"), "{slow}");
        assert!(slow.contains("0.5 is lower than round_robin's 1.0"), "{slow}");
    }
}
