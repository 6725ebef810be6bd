//! The engine core: a library with no sockets and no clocks. The server (`server/`) feeds it requests and calls
//! [`Engine::step`] in a loop; each step schedules a batch, runs it on the [`Backend`], samples, and reports.
//!
//! - `request`: requests, sampling parameters, step outputs, admission errors;
//! - `scheduler`: continuous batching with chunked prefill and recompute preemption;
//! - `sampler`: greedy / temperature / top-k / top-p sampling;
//! - `backend`: the compute trait and the CPU model backend;
//! - `sim`, `timing`: the simulated backend (deterministic tokens) and its timing model / profile files.

pub mod backend;
pub mod calibrate;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod sim;
pub mod timing;

use std::sync::Arc;

use kvgate_shared::hashing::{BlockHash, BlockHasher, HashScheme};
use kvgate_shared::prompt::Prompter;

pub use backend::{Backend, BatchItem, CpuBackend, Next};
pub use request::{AdmitError, EngineRequest, FinishReason, RequestId, SamplingParams, StepOutput};
pub use scheduler::{Scheduler, SchedulerConfig, Sequence};

use crate::kv::KvManager;

/// Turns output ids into text, to find stop strings.
pub trait Detokenizer: Send + Sync {
    fn decode(&self, ids: &[u32]) -> String;
}

impl Detokenizer for Prompter {
    fn decode(&self, ids: &[u32]) -> String {
        Prompter::decode(self, ids, true).unwrap_or_default()
    }
}

/// Engine sizing.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// The hash scheme (its block size is the KV block size).
    pub scheme: HashScheme,
    pub scheduler: SchedulerConfig,
}

/// A snapshot for reports and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub waiting_requests: usize,
    /// Prompt tokens still to prefill, waiting (less cached) and running (`Scheduler::prefill_tokens`).
    pub prefill_tokens: u64,
    pub running_requests: usize,
    pub blocks_total: usize,
    pub blocks_free: usize,
    pub blocks_cached: usize,
    pub evictions: u64,
    pub preemptions: u64,
    pub hit_blocks: u64,
    pub queried_blocks: u64,
}

/// Scheduler + backend + sampling.
pub struct Engine<B: Backend> {
    sched: Scheduler,
    backend: B,
    scheme: HashScheme,
    eos: Vec<u32>,
    detok: Option<Arc<dyn Detokenizer>>,
}

impl<B: Backend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("scheme", &self.scheme).field("stats", &self.stats()).finish()
    }
}

impl<B: Backend> Engine<B> {
    /// An engine over `backend`, whose KV memory must hold `cfg.num_blocks * block_size` slots.
    pub fn new(cfg: EngineConfig, backend: B, detok: Option<Arc<dyn Detokenizer>>) -> Self {
        let kv = KvManager::new(cfg.num_blocks, cfg.scheme.block_size as usize);
        let eos = backend.eos_token_ids();
        Self { sched: Scheduler::new(cfg.scheduler, kv), backend, scheme: cfg.scheme, eos, detok }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }
    pub fn scheme(&self) -> &HashScheme {
        &self.scheme
    }
    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    /// Tokens the KV pool holds.
    pub fn kv_capacity_tokens(&self) -> usize {
        let kv = self.sched.kv();
        kv.pool().lock().num_blocks() * kv.block_size()
    }

    /// Hashes the prefix cache holds now (for the 1 s summary).
    pub fn cached_hashes(&self) -> Vec<BlockHash> {
        self.sched.kv().pool().lock().cached_hashes().collect()
    }

    pub fn stats(&self) -> EngineStats {
        let pool = self.sched.kv().pool().lock();
        let c = pool.counters();
        EngineStats {
            waiting_requests: self.sched.num_waiting(),
            prefill_tokens: self.sched.prefill_tokens(),
            running_requests: self.sched.running().len(),
            blocks_total: pool.num_blocks(),
            blocks_free: pool.num_free(),
            blocks_cached: pool.num_cached(),
            evictions: c.evictions,
            preemptions: self.sched.counters().preemptions,
            hit_blocks: c.hit_blocks,
            queried_blocks: c.queried_blocks,
        }
    }

    /// Validates and queues a request.
    pub fn add_request(&mut self, req: EngineRequest) -> Result<(), AdmitError> {
        if req.prompt.is_empty() {
            return Err(AdmitError::EmptyPrompt);
        }
        req.params.validate().map_err(|(f, m)| AdmitError::InvalidParam(f, m))?;
        let vocab = self.backend.vocab_size();
        if let Some(t) = req.prompt.iter().find(|t| **t as usize >= vocab) {
            return Err(AdmitError::TokenOutOfRange(*t, vocab));
        }
        let total = req.prompt.len() + req.params.max_tokens as usize;
        let limit = self.backend.max_model_len();
        if total > limit {
            return Err(AdmitError::ContextTooLong {
                prompt: req.prompt.len(),
                max_tokens: req.params.max_tokens,
                limit,
            });
        }
        let capacity = self.kv_capacity_tokens();
        if total > capacity {
            return Err(AdmitError::ExceedsKvCapacity {
                prompt: req.prompt.len(),
                max_tokens: req.params.max_tokens,
                capacity,
            });
        }
        if self.sched.contains(req.id) {
            return Err(AdmitError::DuplicateId(req.id));
        }
        let hasher = BlockHasher::new(&self.scheme, &req.extra_keys);
        let mut seq = Sequence::new(req.id, req.prompt, req.params, hasher);
        seq.cached_estimate = self.sched.kv().cached_prefix_tokens(&seq.hasher, &seq.tokens);
        self.sched.add(seq);
        Ok(())
    }

    /// Drops a request wherever it is; its blocks return to the pool at once.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.sched.remove(id).is_some()
    }

    /// Runs one step; returns what each scheduled request produced.
    pub fn step(&mut self) -> Vec<StepOutput> {
        let plan = self.sched.schedule();
        if plan.is_empty() {
            return Vec::new();
        }
        let result = {
            let running = self.sched.running();
            let with_slots = self.backend.needs_slots();
            let items: Vec<BatchItem<'_>> = plan
                .iter()
                .map(|c| {
                    let seq = &running[c.index];
                    let table = seq.table.as_ref();
                    let slots = match with_slots {
                        true => (0..c.start + c.len).map(|p| table.map_or(0, |t| t.slot(p))).collect(),
                        false => Vec::new(),
                    };
                    BatchItem {
                        tokens: &seq.tokens,
                        start: c.start,
                        len: c.len,
                        slots,
                        want_next: c.sample,
                        greedy: seq.params.temperature < sampler::GREEDY_BELOW,
                    }
                })
                .collect();
            self.backend.forward(&items)
        };
        let mut outputs = Vec::with_capacity(plan.len());
        let mut finished = Vec::new();
        match result {
            Err(e) => {
                for c in &plan {
                    let seq = &self.sched.running()[c.index];
                    outputs.push(output(seq, None, Some(FinishReason::Error(e.clone()))));
                    finished.push(seq.id);
                }
            }
            Ok(nexts) => {
                for (c, next) in plan.iter().zip(nexts) {
                    self.sched.complete_chunk(c);
                    if !c.sample {
                        continue;
                    }
                    let seq = &mut self.sched.running_mut()[c.index];
                    let token = match next {
                        Some(Next::Token(t)) => t,
                        Some(Next::Logits(l)) => sampler::sample(&l, &seq.params, &mut seq.rng),
                        None => {
                            let reason =
                                FinishReason::Error("backend returned nothing to sample from".into());
                            outputs.push(output(seq, None, Some(reason)));
                            finished.push(seq.id);
                            continue;
                        }
                    };
                    seq.tokens.push(token);
                    let reason = self.finish_reason(c.index, token);
                    let seq = &self.sched.running()[c.index];
                    if reason.is_some() {
                        finished.push(seq.id);
                    }
                    outputs.push(output(seq, Some(token), reason));
                }
            }
        }
        self.sched.retire(&finished);
        outputs
    }

    fn finish_reason(&self, index: usize, token: u32) -> Option<FinishReason> {
        let seq = &self.sched.running()[index];
        let p = &seq.params;
        if !p.ignore_eos && self.eos.contains(&token) || p.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop(None));
        }
        if let (Some(detok), false) = (&self.detok, p.stop.is_empty()) {
            let out = seq.output();
            let longest = p.stop.iter().map(String::len).max().unwrap_or(0);
            let tail = &out[out.len().saturating_sub(longest + 4)..];
            let text = detok.decode(tail);
            if let Some(s) = p.stop.iter().find(|s| text.contains(s.as_str())) {
                return Some(FinishReason::Stop(Some(s.clone())));
            }
        }
        if seq.output().len() >= p.max_tokens as usize || seq.tokens.len() >= self.backend.max_model_len() {
            return Some(FinishReason::Length);
        }
        None
    }
}

fn output(seq: &Sequence, token: Option<u32>, finished: Option<FinishReason>) -> StepOutput {
    StepOutput {
        id: seq.id,
        token,
        finished,
        prompt_tokens: seq.prompt_len,
        cached_tokens: seq.cached_prompt_tokens.unwrap_or(0),
        completion_tokens: seq.output().len(),
    }
}

#[cfg(test)]
mod tests;
