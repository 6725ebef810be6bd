//! One simulated worker of the PD simulator: a prefill queue chunked into steps of at most
//! `max_num_batched_tokens`, a decode batch of at most `max_num_seqs` streams, an LRU of the prompt blocks it
//! holds, and the measurements the gateway reads from its report each second (prefill speed, decode step time,
//! the share of decode-carrying step time that prefill chunks took).
//!
//! Invariants: a step's time is the engine's timing model of what it holds (`TimingModel`: one base per step);
//! a stream emits one token per step it is in; a prompt chunk never exceeds what is left of its prompt.

use std::collections::VecDeque;

use kvgate_router::registry::approx::ApproxIndex;
use kvgate_router::split::Side;
use kvgate_shared::hashing::BlockHash;
use kvgate_shared::report::Role;
use kvgate_worker::engine::timing::TimingModel;

/// A prompt being computed.
#[derive(Clone, Debug)]
pub struct Job {
    pub req: usize,
    /// Prompt tokens computed or cached so far.
    pub done: usize,
    pub prompt: usize,
    /// The decode worker its KV goes to (a split); `None`: it decodes here.
    pub split_to: Option<usize>,
    /// When its first chunk ran (layer groups start moving then).
    pub started_at: Option<f64>,
}

/// A request decoding.
#[derive(Clone, Debug)]
pub struct Stream {
    pub req: usize,
    /// Context tokens (prompt + generated).
    pub ctx: usize,
    /// Tokens it still emits.
    pub left: usize,
}

/// What one step did (the fleet turns it into tokens, prefill ends and transfers).
#[derive(Debug, Default)]
pub struct StepPlan {
    pub seconds: f64,
    /// (job index in the queue order at planning, tokens) of each chunk.
    pub chunks: Vec<(usize, usize)>,
    pub decodes: usize,
}

/// Per-interval sums behind the measurements.
#[derive(Clone, Copy, Debug, Default)]
struct Meter {
    prefill_tokens: f64,
    prefill_s: f64,
    decode_only_s: f64,
    decode_only_steps: f64,
    decode_carrying_s: f64,
    stalled_s: f64,
}

/// What the gateway last read from the worker's report.
#[derive(Clone, Copy, Debug)]
pub struct Measured {
    pub prefill_tokens_per_s: f64,
    pub decode_step_s: f64,
    pub stall_ratio: f64,
    /// Share of the interval spent computing prompt tokens.
    pub prefill_busy: f64,
}

/// Block ids as the index's keys.
pub fn block_keys(ids: &[u64]) -> Vec<BlockHash> {
    ids.iter().map(|&i| BlockHash(i)).collect()
}

pub struct SimWorker {
    pub role: Role,
    pub prefill: VecDeque<Job>,
    pub running: Vec<Stream>,
    pub waiting: VecDeque<Stream>,
    pub busy: bool,
    /// The prompt blocks it holds, as an LRU (the router's approximate index: least recently used first, a
    /// prompt's tail before its head).
    pub cache: ApproxIndex,
    /// When its outgoing link is free (transfers leave one after another).
    pub link_free_at: f64,
    meter: Meter,
    pub measured: Measured,
}

impl SimWorker {
    pub fn new(role: Role, cache_blocks: usize, timing: &TimingModel) -> Self {
        Self {
            role,
            prefill: VecDeque::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            busy: false,
            cache: ApproxIndex::new(cache_blocks),
            link_free_at: 0.0,
            meter: Meter::default(),
            // Before the first report: the profile's speeds (what the gateway's priors stand for).
            measured: Measured {
                prefill_tokens_per_s: 1.0 / timing.prefill_per_token_s.max(1e-12),
                decode_step_s: timing.decode(1, 1024),
                stall_ratio: 0.0,
                prefill_busy: 0.0,
            },
        }
    }

    pub fn has_work(&self) -> bool {
        !self.prefill.is_empty() || !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn queue_tokens(&self) -> u64 {
        self.prefill.iter().map(|j| (j.prompt - j.done) as u64).sum()
    }

    /// The gateway's view of it for a request whose prompt it holds `cached` tokens of.
    pub fn side(&self, prompt: usize, cached: usize) -> Side {
        Side {
            uncached_tokens: (prompt - cached.min(prompt)) as u64,
            queue_tokens: self.queue_tokens(),
            running: (self.running.len() + self.waiting.len()) as u64,
            prefill_tokens_per_s: self.measured.prefill_tokens_per_s,
            // The simulator's gateway prices by the token rate alone (its figures in docs/benchmarks predate the
            // fit's use in the split).
            prefill_per_token_s: 0.0,
            prefill_attention_s: 0.0,
            held_tokens: cached.min(prompt) as u64,
            decode_step_s: self.measured.decode_step_s,
            stall_ratio: self.measured.stall_ratio,
            prefill_busy: self.measured.prefill_busy,
        }
    }

    /// Plans the next step: waiting streams join the batch up to `max_seqs`, prompt chunks fill the token budget
    /// left after the decodes, oldest prompt first.
    pub fn plan(&mut self, timing: &TimingModel, budget: usize, max_seqs: usize) -> StepPlan {
        while self.running.len() < max_seqs {
            let Some(s) = self.waiting.pop_front() else { break };
            self.running.push(s);
        }
        let decodes = self.running.len();
        let mut left = budget.saturating_sub(decodes);
        let mut chunks = Vec::new();
        let mut prefill_s = 0.0;
        for (i, j) in self.prefill.iter().enumerate() {
            if left == 0 {
                break;
            }
            let n = (j.prompt - j.done).min(left);
            if n == 0 {
                continue;
            }
            prefill_s += timing.prefill(j.done, n) - timing.prefill_base_s;
            chunks.push((i, n));
            left -= n;
        }
        let kv: usize = self.running.iter().map(|s| s.ctx).sum();
        let decode_s = if decodes > 0 { timing.decode(decodes, kv) - timing.decode_base_s } else { 0.0 };
        let base = match (!chunks.is_empty(), decodes > 0) {
            (true, true) => timing.prefill_base_s.max(timing.decode_base_s),
            (true, false) => timing.prefill_base_s,
            (false, true) => timing.decode_base_s,
            (false, false) => 0.0,
        };
        let seconds = prefill_s + decode_s + base;
        let m = &mut self.meter;
        if !chunks.is_empty() {
            m.prefill_tokens += chunks.iter().map(|c| c.1 as f64).sum::<f64>();
            m.prefill_s += prefill_s + if decodes == 0 { base } else { 0.0 };
        }
        if decodes > 0 {
            m.decode_carrying_s += seconds;
            if chunks.is_empty() {
                m.decode_only_s += seconds;
                m.decode_only_steps += 1.0;
            } else {
                m.stalled_s += prefill_s + (base - timing.decode_base_s).max(0.0);
            }
        }
        StepPlan { seconds, chunks, decodes }
    }

    /// The report: this interval's measurements, half-weighted with the last ones (an idle interval keeps them,
    /// but an interval whose decodes ran without prefill lowers the stall).
    pub fn report(&mut self, interval_s: f64) {
        let m = std::mem::take(&mut self.meter);
        let blend = |old: f64, new: f64| 0.5 * old + 0.5 * new;
        self.measured.prefill_busy = blend(self.measured.prefill_busy, (m.prefill_s / interval_s).min(1.0));
        if m.prefill_tokens > 0.0 && m.prefill_s > 0.0 {
            self.measured.prefill_tokens_per_s =
                blend(self.measured.prefill_tokens_per_s, m.prefill_tokens / m.prefill_s);
        }
        if m.decode_only_steps > 0.0 {
            self.measured.decode_step_s =
                blend(self.measured.decode_step_s, m.decode_only_s / m.decode_only_steps);
        }
        if m.decode_carrying_s > 0.0 {
            self.measured.stall_ratio = blend(self.measured.stall_ratio, m.stalled_s / m.decode_carrying_s);
        } else {
            self.measured.stall_ratio *= 0.5;
        }
    }
}
