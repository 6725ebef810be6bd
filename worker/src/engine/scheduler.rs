//! Continuous batching with chunked prefill and recompute preemption. Pure: sequences and KV bookkeeping in,
//! a plan out; no tensors, sockets or clocks, so the simulator can drive the same code.
//!
//! # One step
//! 1. **Running** sequences, oldest first, each get what they need (1 token when decoding, the rest of the prompt
//!    when prefilling) within `max_num_batched_tokens`; a long prompt is cut into chunks across steps.
//! 2. If a running sequence's next blocks cannot be allocated, the **newest** running sequence is preempted
//!    (its blocks freed, its computed tokens forgotten, and it goes back to the front of the waiting queue to be
//!    recomputed, usually from the prefix cache), repeating until the allocation fits or the sequence itself was
//!    the newest and is preempted.
//! 3. If nothing was preempted, **waiting** sequences are admitted first-come first-served while tokens, sequence
//!    slots (`max_num_seqs`) and blocks last; each first looks up its cached prefix. The queue's head is never
//!    skipped (no starvation of long prompts).
//!
//! Admission refuses any request whose prompt + max_tokens cannot fit the whole pool, so a sequence running alone
//! always fits: preemption makes progress and never deadlocks. Block tables return their blocks when dropped, so
//! every way out (finish, abort, preempt, error) frees them.

use std::collections::VecDeque;

use kvgate_shared::hashing::BlockHasher;
use kvgate_shared::prompt::SplitMix64;
use kvgate_shared::report::attention_area;

use super::request::{Export, ImportState, RequestId, SamplingParams};
use crate::kv::{BlockTable, Claim, Clock, KvManager};

/// Scheduling limits.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Most tokens computed in one step (decodes + prefill chunks). Default 2048.
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once. Default 64.
    pub max_num_seqs: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self { max_num_batched_tokens: 2048, max_num_seqs: 64 }
    }
}

/// A request inside the engine.
#[derive(Debug)]
pub struct Sequence {
    pub id: RequestId,
    /// The LoRA adapter it runs with (its name is among the hasher's extra keys).
    pub adapter: Option<std::sync::Arc<crate::model::lora::LoraAdapter>>,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub params: SamplingParams,
    pub hasher: BlockHasher,
    /// Blocks while admitted; `None` while waiting.
    pub table: Option<BlockTable>,
    /// Positions whose KV is written.
    pub num_computed: usize,
    /// Prompt tokens served from the prefix cache at first admission (what `usage` reports).
    pub cached_prompt_tokens: Option<usize>,
    /// While waiting: prompt tokens the prefix cache held when the request arrived (load reports count the rest).
    pub cached_estimate: usize,
    /// While waiting: when (engine clock, seconds) the SSD blocks read ahead for it will all be in memory;
    /// admission passes it over until then while other work can run (`KvManager::prefetch`).
    pub load_ready_s: f64,
    /// While waiting: the deadline (engine clock) of the SSD reads its claim asked for; past it, what has not
    /// arrived is computed again.
    pub read_until: Option<f64>,
    pub rng: SplitMix64,
    pub preemptions: u32,
    /// The prefill side of a hand-off (`Engine::add_export`).
    pub export: Option<Export>,
    /// The decode side of a hand-off, while its KV arrives (`Engine::start_import`).
    pub import: Option<ImportState>,
    /// Engine clock (seconds) when it arrived, and when it was first admitted (its time in the queue: traces).
    pub arrived_s: f64,
    pub admitted_s: Option<f64>,
}

impl Sequence {
    pub fn new(id: RequestId, prompt: Vec<u32>, params: SamplingParams, hasher: BlockHasher) -> Self {
        let seed = params.seed.unwrap_or(id ^ 0xA076_1D64_78BD_642F);
        Self {
            id,
            adapter: None,
            prompt_len: prompt.len(),
            tokens: prompt,
            rng: SplitMix64::new(seed),
            params,
            hasher,
            table: None,
            num_computed: 0,
            cached_prompt_tokens: None,
            cached_estimate: 0,
            load_ready_s: 0.0,
            read_until: None,
            preemptions: 0,
            export: None,
            import: None,
            arrived_s: 0.0,
            admitted_s: None,
        }
    }

    /// Generated tokens so far.
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Tokens not yet computed.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }
}

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    /// Index into the running list (valid until the next `schedule`).
    pub index: usize,
    pub start: usize,
    pub len: usize,
    /// The chunk reaches the last known token: sample after it.
    pub sample: bool,
}

/// Counters since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerCounters {
    pub preemptions: u64,
    pub steps: u64,
    pub scheduled_tokens: u64,
    /// Scheduled chunks that decode (one generated token past the prompt), of all the steps.
    pub decode_chunks: u64,
    /// The causal-attention area of the scheduled prompt chunks: the sum of `n x (start + n / 2)`
    /// (`kvgate_shared::report::attention_area`; what the reports' prefill fit prices per unit).
    pub prefill_area: u64,
    /// The KV tokens the decode chunks attended to: the sum of `start + 1` over them (what a decode step's cost
    /// grows with besides its batch; the reports' decode fit).
    pub decode_context: u64,
    /// Steps an exporting sequence was passed over because its link's backlog was full.
    pub export_holds: u64,
}

/// The scheduler's queues.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvManager,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    /// Sequences whose blocks are allocated and whose KV is arriving from a prefill worker: never scheduled or
    /// preempted until the import finishes (then they run, decoding) or falls back (then they wait, to recompute).
    importing: Vec<Sequence>,
    counters: SchedulerCounters,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, kv: KvManager) -> Self {
        Self {
            cfg,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            importing: Vec::new(),
            counters: SchedulerCounters::default(),
        }
    }

    pub fn kv(&self) -> &KvManager {
        &self.kv
    }
    pub fn kv_mut(&mut self) -> &mut KvManager {
        &mut self.kv
    }
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }
    pub fn counters(&self) -> SchedulerCounters {
        self.counters
    }
    pub fn running(&self) -> &[Sequence] {
        &self.running
    }
    pub fn running_mut(&mut self) -> &mut [Sequence] {
        &mut self.running
    }
    pub fn waiting(&self) -> impl Iterator<Item = &Sequence> {
        self.waiting.iter()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }
    /// Prompt tokens still to prefill: waiting sequences' uncomputed tokens less their cached estimate, plus running
    /// sequences' uncomputed prompt (a running sequence with one token left is decoding and counts 0).
    pub fn prefill_tokens(&self) -> u64 {
        let waiting: u64 =
            self.waiting.iter().map(|s| s.remaining().saturating_sub(s.cached_estimate) as u64).sum();
        let running: u64 = self.prefilling().map(|s| s.remaining() as u64).sum();
        waiting + running
    }
    /// Running sequences still computing their prompt (one token left is a decode).
    pub fn prefilling(&self) -> impl Iterator<Item = &Sequence> {
        self.running.iter().filter(|s| s.remaining() > 1)
    }
    /// The causal-attention area of those tokens: `n x (start + n / 2)` per sequence, for its `n` tokens still to
    /// prefill after `start` computed (or, waiting, believed cached).
    pub fn prefill_area(&self) -> u64 {
        let area = |start: usize, n: usize| attention_area(start as u64, n as u64);
        let waiting = self.waiting.iter().map(|s| {
            let n = s.remaining().saturating_sub(s.cached_estimate);
            area(s.tokens.len() - n, n)
        });
        let running = self.prefilling().map(|s| area(s.num_computed, s.remaining()));
        waiting.chain(running).fold(0u64, u64::saturating_add)
    }
    pub fn contains(&self, id: RequestId) -> bool {
        self.waiting.iter().chain(&self.running).chain(&self.importing).any(|s| s.id == id)
    }

    /// Sequences whose KV is being imported.
    pub fn num_importing(&self) -> usize {
        self.importing.len()
    }

    /// Sequences holding a slot of `max_num_seqs`: running and importing.
    pub fn num_slots_used(&self) -> usize {
        self.running.len() + self.importing.len()
    }

    /// Parks a sequence (its blocks allocated) while its KV is imported.
    pub fn add_importing(&mut self, seq: Sequence) {
        self.importing.push(seq);
    }

    pub fn importing_mut(&mut self, id: RequestId) -> Option<&mut Sequence> {
        self.importing.iter_mut().find(|s| s.id == id)
    }

    /// Takes an importing sequence out (to run it, or to recompute it).
    pub fn take_importing(&mut self, id: RequestId) -> Option<Sequence> {
        let i = self.importing.iter().position(|s| s.id == id)?;
        Some(self.importing.remove(i))
    }

    /// Puts a sequence whose KV is complete among the running (its slot was held while it imported). Returns its
    /// index in the running list.
    pub fn push_running(&mut self, seq: Sequence) -> usize {
        self.running.push(seq);
        self.running.len() - 1
    }

    /// Queues a sequence at the head of the waiting queue (an import that fell back to recomputing).
    pub fn add_front(&mut self, seq: Sequence) {
        self.waiting.push_front(seq);
    }

    /// Queues a new sequence.
    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    /// Removes a sequence wherever it is (its blocks are freed as it drops).
    pub fn remove(&mut self, id: RequestId) -> Option<Sequence> {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            return self.waiting.remove(i);
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            return Some(self.running.remove(i));
        }
        self.take_importing(id)
    }

    /// Takes finished sequences out of the running list (indices from the last plan become invalid).
    pub fn retire(&mut self, finished: &[RequestId]) -> Vec<Sequence> {
        let mut out = Vec::with_capacity(finished.len());
        for id in finished {
            if let Some(i) = self.running.iter().position(|s| s.id == *id) {
                out.push(self.running.remove(i));
            }
        }
        out
    }

    fn preempt_newest(&mut self) -> Option<RequestId> {
        let mut seq = self.running.pop()?;
        seq.table = None;
        seq.num_computed = 0;
        seq.preemptions += 1;
        self.counters.preemptions += 1;
        let id = seq.id;
        self.waiting.push_front(seq);
        Some(id)
    }

    /// Plans the next step; `now`: the engine's clock (seconds).
    pub fn schedule(&mut self, now: f64) -> Vec<ScheduledChunk> {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let held = self.running[i].export.as_ref().is_some_and(|e| e.sink.held());
            if held {
                // Its link has not sent what it exported yet: the prefill waits (back-pressure, not memory).
                self.counters.export_holds += 1;
                i += 1;
                continue;
            }
            let n = self.running[i].remaining().min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let target = self.running[i].num_computed + n;
            let fits = loop {
                let seq = &mut self.running[i];
                let Some(table) = seq.table.as_mut() else { break false };
                if self.kv.reserve(table, target) {
                    break true;
                }
                preempted = true;
                let victim_is_self = self.running.len() - 1 == i;
                self.preempt_newest();
                if victim_is_self {
                    break false;
                }
            };
            if !fits {
                // Either this sequence was preempted itself (it was the newest) or it has no table.
                break;
            }
            let seq = &self.running[i];
            plan.push(ScheduledChunk {
                index: i,
                start: seq.num_computed,
                len: n,
                sample: target == seq.tokens.len(),
            });
            budget -= n;
            i += 1;
        }
        if !preempted {
            self.admit(&mut budget, &mut plan, now);
        }
        self.counters.steps += 1;
        self.counters.scheduled_tokens += plan.iter().map(|c| c.len as u64).sum::<u64>();
        let decodes = plan.iter().filter(|c| c.start >= self.running[c.index].prompt_len);
        let (n, context) =
            decodes.fold((0u64, 0u64), |(n, k), c| (n + 1, k.saturating_add(c.start as u64 + 1)));
        self.counters.decode_chunks += n;
        self.counters.decode_context = self.counters.decode_context.saturating_add(context);
        let area: u64 = plan
            .iter()
            .filter(|c| c.start < self.running[c.index].prompt_len)
            .map(|c| attention_area(c.start as u64, c.len as u64))
            .fold(0, u64::saturating_add);
        self.counters.prefill_area = self.counters.prefill_area.saturating_add(area);
        plan
    }

    /// Admits waiting requests in order while the budget and the batch have room. A request whose SSD prefix is
    /// still being read ahead (or whose claim found SSD blocks not in memory yet) is passed over (it keeps its
    /// place) while anything else can run, so the read overlaps other work instead of stalling the step.
    fn admit(&mut self, budget: &mut usize, plan: &mut Vec<ScheduledChunk>, now: f64) {
        let mut passed = Vec::new();
        self.admit_ready(budget, plan, now, &mut passed);
        for seq in passed.into_iter().rev() {
            self.waiting.push_front(seq);
        }
    }

    fn admit_ready(
        &mut self,
        budget: &mut usize,
        plan: &mut Vec<ScheduledChunk>,
        now: f64,
        passed: &mut Vec<Sequence>,
    ) {
        while *budget > 0 && self.running.len() + self.importing.len() < self.cfg.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else { break };
            let alone = self.running.is_empty() && self.waiting.is_empty();
            if seq.load_ready_s > now && !alone {
                passed.push(seq);
                continue;
            }
            let Some(table) = self.claim(&mut seq, now, alone) else {
                passed.push(seq);
                continue;
            };
            let cached = table.cached_tokens();
            let mut table = table;
            let n = (seq.tokens.len() - cached).min(*budget);
            if !self.kv.reserve(&mut table, cached + n) {
                // Not enough free blocks now: the head waits (dropping the table releases its cache hits).
                drop(table);
                self.waiting.push_front(seq);
                break;
            }
            seq.num_computed = cached;
            seq.read_until = None;
            seq.cached_prompt_tokens.get_or_insert(cached.min(seq.prompt_len));
            seq.admitted_s.get_or_insert(now);
            seq.table = Some(table);
            let target = cached + n;
            plan.push(ScheduledChunk {
                index: self.running.len(),
                start: cached,
                len: n,
                sample: target == seq.tokens.len(),
            });
            *budget -= n;
            self.running.push(seq);
        }
    }

    /// The sequence's table, or `None` while SSD blocks it would load are being read (asked for here; the
    /// sequence is passed over and claims again next step). Past the read's deadline, what is not in memory is
    /// computed again. `alone` (nothing else could run meanwhile): waits for the read here, holding no lock.
    fn claim(&mut self, seq: &mut Sequence, now: f64, alone: bool) -> Option<BlockTable> {
        let at = Clock { now, ahead_s: 0.0, running: self.running.len() };
        let give_up = seq.read_until.is_some_and(|u| now >= u);
        if alone && !give_up {
            return Some(self.kv.claim_waiting(seq.hasher, &seq.tokens, &at));
        }
        match self.kv.claim(seq.hasher, &seq.tokens, &at, give_up) {
            Claim::Table(t) => Some(t),
            Claim::Read(wait) => {
                seq.read_until.get_or_insert(wait.until);
                // The inline tier has read them now: claim again. Else the IO thread reads meanwhile.
                self.kv.request_reads(&wait).then(|| self.kv.start_at(seq.hasher, &seq.tokens, &at))
            }
        }
    }

    /// Records that a chunk's KV is written (and its full blocks may enter the prefix cache).
    pub fn complete_chunk(&mut self, chunk: &ScheduledChunk) {
        let kv = &self.kv;
        let seq = &mut self.running[chunk.index];
        seq.num_computed = chunk.start + chunk.len;
        if let Some(table) = seq.table.as_mut() {
            kv.commit(table, &seq.tokens, seq.num_computed);
        }
    }
}
