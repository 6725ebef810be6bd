//! `kvgate-loadtest simulate-pd`: prefill/decode disaggregation in virtual time. A fleet of workers (all `both`
//! for the aggregated baseline; `prefill_workers` of role prefill and the rest decode for the split policies)
//! serves a workload; per request the gateway's split policy (`kvgate_router::split`, the same code the gateway
//! runs) chooses local or split from the measured inputs the workers report each second. The transfer is
//! modelled on the P->D link: `(prompt - tokens D holds) x kv_bytes_per_token / bandwidth`, sent in
//! `export_groups` layer groups while P computes (1: after the prefill), one transfer at a time per P's link.
//!
//! What it models and what it does not:
//! - step times are the engine's timing model (`worker/profiles`), with chunked prefill of at most
//!   `max_batched_tokens` a step and at most `max_seqs` decoding streams;
//! - the gateway sees exact queues and prefix matches (the Bloom-summary and report path is the other
//!   simulator's, `sim::fleet`); speeds and stall ratios it sees as reported once a second;
//! - KV capacity is not a limit (an H200 holds ~900K tokens of Llama-3-8B KV); the prefix cache is an LRU of
//!   `cache_blocks` 512-token blocks per worker;
//! - D computes the first token after the import, in its next decode step;
//! - what the gateway knows (`Knowledge`): with `Predicted` (the default) the split is priced with the output the
//!   gateway would predict (`kvgate_router::split::predict`: the learned mean output of the requests finished so
//!   far, capped by the request's `max_tokens`, which the workloads set 2-10x above the real output, or leave out
//!   for a fifth of the requests) and the link rate it would have measured (the configured prior until the first
//!   transfer, then the moving average of the transfers); `Oracle` hands it the true output and the exact link
//!   rate, the bound that shows what not knowing costs;
//! - each split decision's predicted TTFT and TPOT of the option taken are compared with what happened
//!   (`PdResult::ttft_error_*`, `tpot_error_*`).

pub mod table;
mod worker;

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use kvgate_router::registry::pd::NEW_WEIGHT;
use kvgate_router::split::predict::OutputEstimate;
use kvgate_router::split::{Choice, Slo, SplitInput, SplitPolicy};
use kvgate_shared::report::Role;
use kvgate_worker::engine::timing::TimingModel;
use serde::Serialize;

use crate::stats::percentile;
use worker::{Job, SimWorker, Stream};

/// Tokens per block id (the Mooncake trace's).
pub const BLOCK_TOKENS: usize = crate::trace::TRACE_BLOCK_TOKENS;

/// One request of a PD workload.
#[derive(Clone, Debug)]
pub struct PdRequest {
    pub arrival_s: f64,
    pub prompt: usize,
    pub output: usize,
    /// Ids of the prompt's 512-token blocks (equal ids: equal prefixes), as the caches' keys.
    pub blocks: Vec<kvgate_shared::hashing::BlockHash>,
    /// What the client asked for (`None`: no limit): above `output`, as real clients send it.
    pub max_tokens: Option<usize>,
}

/// Sets each request's `max_tokens` as real clients do: a fifth send none, the rest 2-10x what they will get
/// (seeded).
pub fn with_max_tokens(reqs: &mut [PdRequest], seed: u64) {
    let mut rng = seed ^ 0xD1B5_4A32_D192_ED03;
    for r in reqs {
        rng = splitmix(rng);
        let u = ((rng >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        r.max_tokens = (u >= 0.2).then(|| (r.output as f64 * (2.0 + 8.0 * (u - 0.2) / 0.8)).round() as usize);
    }
}

/// What the split decision is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Knowledge {
    /// What the gateway can know: the predicted output and the measured link rate (the default).
    Predicted,
    /// The true output length and the exact link rate (a bound, never the gateway's case).
    Oracle,
}

impl Knowledge {
    pub fn as_str(self) -> &'static str {
        match self {
            Knowledge::Predicted => "predicted",
            Knowledge::Oracle => "oracle",
        }
    }
}

/// The fleet and the link.
#[derive(Clone, Debug)]
pub struct PdConfig {
    pub workers: usize,
    /// Workers of role prefill in the split layouts (the rest decode).
    pub prefill_workers: usize,
    pub timing: TimingModel,
    pub max_batched_tokens: usize,
    pub max_seqs: usize,
    pub cache_blocks: usize,
    pub kv_bytes_per_token: f64,
    pub bandwidth_bytes_per_s: f64,
    pub export_groups: u32,
    pub slo: Slo,
    pub report_interval_s: f64,
    pub knowledge: Knowledge,
    /// The link rate believed before the first transfer (`Predicted`; the gateway's `--split-bandwidth-prior`).
    pub bandwidth_prior_bytes_per_s: f64,
    /// The output believed for a request without `max_tokens` before any finished (a class's configured
    /// `expected_output_tokens`).
    pub configured_output: u64,
}

/// One policy's run.
#[derive(Clone, Debug, Serialize)]
pub struct PdResult {
    pub policy: String,
    pub layout: String,
    pub requests: usize,
    /// Requests that finished (all of them: the loop runs until every one is done).
    pub finished: usize,
    /// Output tokens per second of requests that met both SLOs, over the run (first arrival to last finish).
    pub goodput_tokens_per_s: f64,
    pub slo_met_share: f64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub tpot_p50_s: f64,
    pub tpot_p99_s: f64,
    pub split_share: f64,
    pub makespan_s: f64,
    pub knowledge: Knowledge,
    /// |predicted - seen| of the option taken, over requests whose split was considered (seconds).
    pub ttft_error_p50_s: f64,
    pub ttft_error_p99_s: f64,
    pub tpot_error_p50_s: f64,
    pub tpot_error_p99_s: f64,
    /// |predicted output - real output| / real output, median.
    pub output_error_p50: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Event {
    Arrive(usize),
    StepEnd(usize),
    Imported { req: usize, decode: usize },
    Report,
}

struct Timed(f64, u64, Event);

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    /// Earliest first (a max-heap of reversed times); equal times in scheduling order.
    fn cmp(&self, o: &Self) -> Ordering {
        o.0.total_cmp(&self.0).then(o.1.cmp(&self.1))
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct ReqState {
    first_token_s: Option<f64>,
    done_s: Option<f64>,
    split: bool,
    /// The decision's predicted (TTFT, TPOT) of the option taken, and the output it priced, when one was asked.
    predicted: Option<(f64, f64, u64)>,
}

struct Fleet<'a> {
    cfg: &'a PdConfig,
    reqs: &'a [PdRequest],
    policy: &'a dyn SplitPolicy,
    workers: Vec<SimWorker>,
    state: Vec<ReqState>,
    events: BinaryHeap<Timed>,
    seq: u64,
    /// The step each busy worker is running.
    plans: Vec<Option<worker::StepPlan>>,
    /// The learned output of the requests finished so far (`Knowledge::Predicted`).
    output: OutputEstimate,
    /// The measured link rate (bytes/s; 0 until the first transfer).
    link_rate: f64,
}

/// Replays `reqs` on the fleet under `policy`; `aggregated`: every worker `both` (the policy is still asked, and
/// a split is served locally on the local pick's worker only if the policy says local).
pub fn replay(reqs: &[PdRequest], cfg: &PdConfig, policy: &dyn SplitPolicy, aggregated: bool) -> PdResult {
    let roles: Vec<Role> = (0..cfg.workers)
        .map(|i| match (aggregated, i < cfg.prefill_workers) {
            (true, _) => Role::Both,
            (false, true) => Role::Prefill,
            (false, false) => Role::Decode,
        })
        .collect();
    let mut f = Fleet {
        cfg,
        reqs,
        policy,
        workers: roles.iter().map(|r| SimWorker::new(*r, cfg.cache_blocks, &cfg.timing)).collect(),
        state: vec![ReqState::default(); reqs.len()],
        events: BinaryHeap::new(),
        seq: 0,
        plans: (0..cfg.workers).map(|_| None).collect(),
        output: OutputEstimate::default(),
        link_rate: 0.0,
    };
    for (i, r) in reqs.iter().enumerate() {
        f.push(r.arrival_s, Event::Arrive(i));
    }
    f.push(cfg.report_interval_s, Event::Report);
    let mut pending = reqs.len();
    while let Some(Timed(t, _, e)) = f.events.pop() {
        match e {
            Event::Arrive(i) => f.arrive(i, t),
            Event::StepEnd(w) => pending -= f.step_end(w, t),
            Event::Imported { req, decode } => f.imported(req, decode, t),
            Event::Report => {
                f.workers.iter_mut().for_each(|w| w.report(cfg.report_interval_s));
                if pending > 0 {
                    f.push(t + cfg.report_interval_s, Event::Report);
                }
            }
        }
    }
    f.result(if aggregated { "all both".into() } else { layout(cfg) })
}

fn layout(cfg: &PdConfig) -> String {
    format!("{}P+{}D", cfg.prefill_workers, cfg.workers - cfg.prefill_workers)
}

impl Fleet<'_> {
    fn push(&mut self, t: f64, e: Event) {
        self.seq += 1;
        self.events.push(Timed(t, self.seq, e));
    }

    fn cached(&self, w: usize, r: &PdRequest) -> usize {
        (self.workers[w].cache.matched(&r.blocks) * BLOCK_TOKENS).min(r.prompt.saturating_sub(1))
    }

    /// The pick among `eligible` with the least of `key`.
    fn pick(&self, eligible: impl Fn(Role) -> bool, key: impl Fn(usize) -> (u64, u64)) -> Option<usize> {
        (0..self.workers.len()).filter(|w| eligible(self.workers[*w].role)).min_by_key(|w| key(*w))
    }

    fn arrive(&mut self, i: usize, t: f64) {
        let r = &self.reqs[i];
        let work = |s: &Self, w: usize| {
            let side = s.workers[w].side(r.prompt, s.cached(w, r));
            (side.queue_tokens + side.uncached_tokens, side.running)
        };
        let decodes = |role: Role| role != Role::Prefill;
        // Local: the decode-capable worker with the least prefill work; D: the one with the fewest streams;
        // P: the prefill-capable one with the least prefill work (a `both` fleet: any worker).
        let local = self.pick(decodes, |w| work(self, w)).expect("a decode-capable worker");
        let decode = self.pick(decodes, |w| (work(self, w).1, work(self, w).0)).expect("decode");
        let prefill = self.pick(|role| role != Role::Decode, |w| work(self, w));
        let choice = match prefill.filter(|p| *p != decode) {
            None => Choice::Local,
            Some(p) => {
                let (expected_output, bandwidth_bytes_per_s) = match self.cfg.knowledge {
                    Knowledge::Oracle => (r.output as u64, self.cfg.bandwidth_bytes_per_s),
                    Knowledge::Predicted => (
                        self.output.predict(r.max_tokens.map(|m| m as u64), self.cfg.configured_output),
                        if self.link_rate > 0.0 {
                            self.link_rate
                        } else {
                            self.cfg.bandwidth_prior_bytes_per_s
                        },
                    ),
                };
                let input = SplitInput {
                    prompt_tokens: r.prompt as u64,
                    expected_output,
                    local: self.workers[local].side(r.prompt, self.cached(local, r)),
                    prefill: self.workers[p].side(r.prompt, self.cached(p, r)),
                    decode: self.workers[decode].side(r.prompt, self.cached(decode, r)),
                    decode_cached_tokens: self.cached(decode, r) as u64,
                    kv_bytes_per_token: self.cfg.kv_bytes_per_token,
                    bandwidth_bytes_per_s,
                    export_groups: self.cfg.export_groups,
                    slo: self.cfg.slo,
                };
                let d = self.policy.decide(&input);
                let o = if d.choice == Choice::Split { d.terms.split } else { d.terms.local };
                self.state[i].predicted = Some((o.ttft_s, o.tpot_s, expected_output));
                d.choice
            }
        };
        let (w, split_to) = match (choice, prefill) {
            (Choice::Split, Some(p)) if p != decode => (p, Some(decode)),
            _ => (local, None),
        };
        self.state[i].split = split_to.is_some();
        let done = self.cached(w, r);
        self.workers[w].prefill.push_back(Job { req: i, done, prompt: r.prompt, split_to, started_at: None });
        self.kick(w, t);
    }

    fn kick(&mut self, w: usize, t: f64) {
        if self.workers[w].busy || !self.workers[w].has_work() {
            return;
        }
        let cfg = self.cfg;
        let plan = self.workers[w].plan(&cfg.timing, cfg.max_batched_tokens, cfg.max_seqs);
        for &(j, _) in &plan.chunks {
            self.workers[w].prefill[j].started_at.get_or_insert(t);
        }
        self.workers[w].busy = true;
        self.push(t + plan.seconds, Event::StepEnd(w));
        self.plans[w] = Some(plan);
    }

    /// Ends worker `w`'s step at `t`; returns how many requests finished.
    fn step_end(&mut self, w: usize, t: f64) -> usize {
        let plan = self.plans[w].take().expect("a planned step");
        let mut finished = 0;
        // Every stream in the batch emits one token.
        let mut keep = Vec::with_capacity(plan.decodes);
        for mut s in std::mem::take(&mut self.workers[w].running) {
            self.state[s.req].first_token_s.get_or_insert(t);
            s.left -= 1;
            s.ctx += 1;
            if s.left == 0 {
                self.state[s.req].done_s = Some(t);
                self.output.learn(self.reqs[s.req].output as u64);
                finished += 1;
            } else {
                keep.push(s);
            }
        }
        self.workers[w].running = keep;
        // Chunks advance; finished prompts leave the queue (back to front, so indices stay valid).
        for &(j, n) in plan.chunks.iter().rev() {
            let job = &mut self.workers[w].prefill[j];
            job.done += n;
            if job.done < job.prompt {
                continue;
            }
            let job = self.workers[w].prefill.remove(j).expect("job");
            finished += self.prefilled(w, job, t);
        }
        self.workers[w].busy = false;
        self.kick(w, t);
        finished
    }

    /// A prompt computed on `w` at `t`: it decodes here (its first token is out), or its KV leaves for D.
    fn prefilled(&mut self, w: usize, job: Job, t: f64) -> usize {
        let r = &self.reqs[job.req];
        self.workers[w].cache.touch(&r.blocks);
        let Some(d) = job.split_to else {
            self.state[job.req].first_token_s = Some(t);
            if r.output <= 1 {
                self.state[job.req].done_s = Some(t);
                self.output.learn(r.output as u64);
                return 1;
            }
            self.workers[w].waiting.push_back(Stream { req: job.req, ctx: r.prompt + 1, left: r.output - 1 });
            return 0;
        };
        let moved = r.prompt - self.cached(d, r);
        let transfer_s = moved as f64 * self.cfg.kv_bytes_per_token / self.cfg.bandwidth_bytes_per_s;
        let groups = self.cfg.export_groups.max(1) as f64;
        let from = if groups > 1.0 { job.started_at.unwrap_or(t) } else { t };
        let start = from.max(self.workers[w].link_free_at);
        let end = (start + transfer_s).max(t + transfer_s / groups);
        self.workers[w].link_free_at = end;
        self.push(end, Event::Imported { req: job.req, decode: d });
        0
    }

    fn imported(&mut self, req: usize, d: usize, t: f64) {
        // What D's next report says of the link: the transfer's bytes over its time (the moving average the
        // gateway keeps, `registry::pd`).
        let rate = self.cfg.bandwidth_bytes_per_s;
        self.link_rate =
            if self.link_rate == 0.0 { rate } else { self.link_rate + NEW_WEIGHT * (rate - self.link_rate) };
        let r = &self.reqs[req];
        self.workers[d].cache.touch(&r.blocks);
        self.workers[d].waiting.push_back(Stream { req, ctx: r.prompt, left: r.output.max(1) });
        self.kick(d, t);
    }

    fn result(&self, layout: String) -> PdResult {
        let (mut ttft, mut tpot) = (Vec::new(), Vec::new());
        let (mut ttft_err, mut tpot_err, mut out_err) = (Vec::new(), Vec::new(), Vec::new());
        let (mut good_tokens, mut met, mut splits) = (0.0, 0usize, 0usize);
        let start = self.reqs.iter().map(|r| r.arrival_s).fold(f64::INFINITY, f64::min);
        let mut end: f64 = 0.0;
        for (r, s) in self.reqs.iter().zip(&self.state) {
            let (Some(first), Some(done)) = (s.first_token_s, s.done_s) else { continue };
            end = end.max(done);
            let t1 = first - r.arrival_s;
            let t2 = if r.output > 1 { (done - first) / (r.output - 1) as f64 } else { 0.0 };
            ttft.push(t1);
            tpot.push(t2);
            if let Some((p1, p2, out)) = s.predicted {
                ttft_err.push((t1 - p1).abs());
                if r.output > 1 {
                    tpot_err.push((t2 - p2).abs());
                }
                out_err.push((out as f64 - r.output as f64).abs() / r.output.max(1) as f64);
            }
            splits += s.split as usize;
            if t1 <= self.cfg.slo.ttft_s && t2 <= self.cfg.slo.tpot_s {
                met += 1;
                good_tokens += r.output as f64;
            }
        }
        let n = self.reqs.len().max(1);
        let makespan = (end - start).max(1e-9);
        PdResult {
            policy: self.policy.name().into(),
            layout,
            requests: self.reqs.len(),
            finished: ttft.len(),
            goodput_tokens_per_s: good_tokens / makespan,
            slo_met_share: met as f64 / n as f64,
            ttft_p50_s: percentile(&ttft, 0.5),
            ttft_p99_s: percentile(&ttft, 0.99),
            tpot_p50_s: percentile(&tpot, 0.5),
            tpot_p99_s: percentile(&tpot, 0.99),
            split_share: splits as f64 / n as f64,
            makespan_s: makespan,
            knowledge: self.cfg.knowledge,
            ttft_error_p50_s: percentile(&ttft_err, 0.5),
            ttft_error_p99_s: percentile(&ttft_err, 0.99),
            tpot_error_p50_s: percentile(&tpot_err, 0.5),
            tpot_error_p99_s: percentile(&tpot_err, 0.99),
            output_error_p50: percentile(&out_err, 0.5),
        }
    }
}

/// A fixed-shape workload: `n` requests of `prompt`/`output` tokens, Poisson arrivals at `rate` a second
/// (seeded), no shared prefixes.
pub fn shape_workload(n: usize, prompt: usize, output: usize, rate: f64, seed: u64) -> Vec<PdRequest> {
    let mut rng = seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut t = 0.0;
    let blocks = prompt.div_ceil(BLOCK_TOKENS);
    (0..n)
        .map(|i| {
            rng = splitmix(rng);
            let u = ((rng >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            t += -u.ln() / rate;
            let base = (i as u64 + 1) << 24;
            let ids: Vec<u64> = (0..blocks as u64).map(|b| base + b).collect();
            PdRequest {
                arrival_s: t,
                prompt,
                output,
                blocks: worker::block_keys(&ids),
                max_tokens: Some(output),
            }
        })
        .collect()
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The rate at which `workers` aggregated workers are busy a `load` share of the time with requests of this
/// shape, by the timing model (a prefill, then `output` decode tokens at batch 64 with half the output in
/// context).
pub fn rate_for_load(timing: &TimingModel, workers: usize, prompt: usize, output: usize, load: f64) -> f64 {
    let batch = 64usize;
    let ctx = prompt + output / 2;
    let per_token = timing.decode(batch, batch * ctx) / batch as f64;
    let work = timing.prefill(0, prompt) + output as f64 * per_token;
    load * workers as f64 / work
}

#[cfg(test)]
mod tests;
