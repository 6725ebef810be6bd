//! The engine core: a library with no sockets and no clocks. The server (`server/`) feeds it requests and calls
//! [`Engine::step`] in a loop; each step schedules a batch, runs it on the [`Backend`], samples, and reports.
//!
//! - `request`: requests, sampling parameters, step outputs, admission errors;
//! - `scheduler`: continuous batching with chunked prefill and recompute preemption;
//! - `sampler`: penalties and bias, greedy / temperature / top-k / top-p / min-p sampling (linear in the
//!   vocabulary), log-probabilities;
//! - `backend`: the compute trait and the CPU model backend; `backend_error`: what a backend call fails with;
//! - `sim`, `timing`: the simulated backend (deterministic tokens) and its timing model / profile files.

pub mod backend;
pub mod backend_error;
pub mod calibrate;
pub mod first_fit;
pub mod pd;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod sim;
pub mod timing;

use std::sync::Arc;

use kvgate_shared::hashing::{BlockHash, BlockHasher, HashScheme};
use kvgate_shared::prompt::Prompter;

pub use backend::{Backend, BatchItem, CpuBackend, Next};
pub use backend_error::{BackendError, Fault};
pub use pd::{ImportError, ImportPlan};
pub use request::{
    AdmitError, EngineRequest, ExportBacklog, ExportProgress, ExportSink, FinishReason, KvChunk, RequestId,
    SamplingParams, StepOutput, TokenLogprobs,
};
pub use scheduler::{Scheduler, SchedulerConfig, Sequence};

use crate::kv::{
    Clock, DiskCounters, DiskTier, HostCounters, HostTier, KvManager, LoadCosts, Source, WritePolicy,
};

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
    /// Their causal-attention area (`Scheduler::prefill_area`).
    pub prefill_area: u64,
    /// Running sequences still computing their prompt.
    pub prefilling_requests: usize,
    pub running_requests: usize,
    /// Requests whose KV is arriving from a prefill worker (blocks held, not yet running).
    pub importing_requests: usize,
    pub blocks_total: usize,
    pub blocks_free: usize,
    pub blocks_cached: usize,
    pub evictions: u64,
    pub preemptions: u64,
    pub hit_blocks: u64,
    pub queried_blocks: u64,
    /// The host DRAM tier (all 0 without one).
    pub host_blocks_total: usize,
    pub host_blocks_cached: usize,
    pub host: HostCounters,
    /// The SSD tier (all 0 without one).
    pub disk_blocks_total: usize,
    pub disk_blocks_cached: usize,
    pub disk: DiskCounters,
}

/// Scheduler + backend + sampling.
pub struct Engine<B: Backend> {
    sched: Scheduler,
    backend: B,
    scheme: HashScheme,
    eos: Vec<u32>,
    detok: Option<Arc<dyn Detokenizer>>,
    /// The engine's monotonic clock, where the backend keeps none ([`Backend::clock_s`]).
    started: std::time::Instant,
    /// The worker's fit of a prefill step's seconds: per prompt token, per unit of attention area
    /// (`set_prefill_cost`; (0, 0) until measured). What an export's progress expects a step to take.
    prefill_cost: (f64, f64),
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
        Self {
            sched: Scheduler::new(cfg.scheduler, kv),
            backend,
            scheme: cfg.scheme,
            eos,
            detok,
            started: std::time::Instant::now(),
            prefill_cost: (0.0, 0.0),
        }
    }

    /// Seconds on the engine's clock: the backend's (virtual time in the simulator) or since the engine started.
    fn clock_s(&self) -> f64 {
        self.backend.clock_s().unwrap_or_else(|| self.started.elapsed().as_secs_f64())
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

    /// One KV block's bytes, for a lower tier of `bytes` (`flag` names it in errors): the backend must copy blocks
    /// and the tier hold at least one.
    fn tier_block_bytes(&self, bytes: u64, flag: &str) -> Result<usize, String> {
        let Some(block_bytes) = self.backend.kv_block_bytes(self.scheme.block_size as usize) else {
            return Err(format!("this backend cannot copy KV blocks to a lower tier (--{flag} must be 0)"));
        };
        if bytes < block_bytes as u64 {
            return Err(format!("--{flag} {bytes} holds less than one KV block ({block_bytes} bytes)"));
        }
        Ok(block_bytes)
    }

    /// Puts a host DRAM tier of `bytes` under the KV pool (`--host-kv-bytes`; 0: none). Fails when the backend
    /// cannot copy KV blocks out.
    pub fn with_host_tier(mut self, bytes: usize, policy: WritePolicy) -> Result<Self, String> {
        if bytes == 0 {
            return Ok(self);
        }
        let block_bytes = self.tier_block_bytes(bytes as u64, "host-kv-bytes")?;
        self.sched.kv_mut().set_host(HostTier::new(bytes, block_bytes), policy);
        Ok(self)
    }

    /// Puts an SSD tier of `bytes` in `dir` under the host tier, or under the pool without one (`--disk-kv-path`,
    /// `--disk-kv-bytes`; 0: none). Blocks found in `dir` from an earlier run of the same hash scheme, model
    /// (`model`: `model::identity::weights_digest` of its directory, or anything else that names the weights) and KV
    /// layout are served again (a warm restart); others are never read.
    pub fn with_disk_tier(
        self,
        dir: &std::path::Path,
        bytes: u64,
        policy: WritePolicy,
        model: u64,
    ) -> Result<Self, String> {
        self.disk_tier(dir, bytes, policy, model, false)
    }

    /// [`Self::with_disk_tier`] writing and reading on the engine's thread: deterministic, for the virtual-time
    /// simulator (its read-ahead exists only in time, `kv::ReadAhead`, which the simulated step pays).
    pub fn with_inline_disk_tier(
        self,
        dir: &std::path::Path,
        bytes: u64,
        policy: WritePolicy,
        model: u64,
    ) -> Result<Self, String> {
        self.disk_tier(dir, bytes, policy, model, true)
    }

    /// What the SSD tier's records are valid for: the hash scheme, the model's weights, the backend's KV layout
    /// and a block's bytes.
    pub fn tier_fingerprint(&self, model: u64, block_bytes: usize) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(b"kvgate/ssd-tier/v2");
        h.update(&self.scheme.fingerprint().to_le_bytes());
        h.update(&model.to_le_bytes());
        h.update(&(block_bytes as u64).to_le_bytes());
        h.update(self.backend.kv_layout().as_bytes());
        h.digest()
    }

    fn disk_tier(
        mut self,
        dir: &std::path::Path,
        bytes: u64,
        policy: WritePolicy,
        model: u64,
        inline: bool,
    ) -> Result<Self, String> {
        if bytes == 0 {
            return Ok(self);
        }
        let block_size = self.scheme.block_size as usize;
        let block_bytes = self.tier_block_bytes(bytes, "disk-kv-bytes")?;
        let fingerprint = self.tier_fingerprint(model, block_bytes);
        let disk = DiskTier::open(dir, bytes, block_bytes, block_size, fingerprint)?;
        let disk = if inline { disk.inline() } else { disk };
        self.sched.kv_mut().set_disk(disk, policy);
        Ok(self)
    }

    /// Sets what load-vs-recompute weighs (`kv::costs`); the KV bytes per token come from the backend.
    pub fn set_load_costs(&mut self, mut costs: LoadCosts) {
        let bs = self.scheme.block_size as usize;
        if let Some(b) = self.backend.kv_block_bytes(bs) {
            costs.kv_bytes_per_token = b as f64 / bs as f64;
        }
        self.sched.kv().set_costs(costs);
    }

    /// Feeds a measured prefill step (its computed tokens and seconds) into load-vs-recompute's prefill cost (a
    /// moving average; steps of under 256 tokens, mostly decode, are not prefill measurements).
    /// Takes the worker's latest fit of a prefill step's cost (seconds per prompt token, per unit of attention
    /// area; `server::prefill_fit`): non-finite or negative terms read as 0.
    pub fn set_prefill_cost(&mut self, per_token_s: f64, attention_s: f64) {
        let ok = |v: f64| if v.is_finite() && v > 0.0 { v } else { 0.0 };
        self.prefill_cost = (ok(per_token_s), ok(attention_s));
    }

    pub fn observe_prefill(&self, tokens: u64, secs: f64) {
        if tokens < 256 || !(secs > 0.0 && secs.is_finite()) {
            return;
        }
        let kv = self.sched.kv();
        let mut c = kv.costs();
        let sample = secs / tokens as f64;
        c.prefill_s_per_token =
            if c.prefill_s_per_token > 0.0 { 0.8 * c.prefill_s_per_token + 0.2 * sample } else { sample };
        kv.set_costs(c);
    }

    /// Copies the blocks the pool just evicted down to the tiers (their memory is intact until the forward), then
    /// writes the lower-tier blocks promoted by this step's claims into their device blocks. Runs between
    /// scheduling and the forward. An error writing a promotion drops those blocks from the cache and fails the
    /// step's batch (it would read them).
    fn move_blocks(&mut self) -> Result<(), BackendError> {
        let kv = self.sched.kv().clone();
        if kv.tiers().is_empty() {
            return Ok(());
        }
        let block_size = self.scheme.block_size as usize;
        let evicted = kv.pool().lock().take_evicted();
        let backend = &mut self.backend;
        kv.write_back(evicted, false, &mut |ids| {
            backend.read_kv_blocks(ids, block_size).map_err(|e| e.to_string())
        });
        let (live, wait) = kv.take_loads();
        if live.is_empty() {
            return Ok(());
        }
        let from_host = live.iter().filter(|l| l.source == Source::Host).count();
        self.backend.note_kv_loaded(from_host, wait, block_size);
        let writes: Vec<(u32, &[u8])> = live.iter().map(|l| (l.id, &*l.payload)).collect();
        let started = std::time::Instant::now();
        let written = self.backend.write_kv_blocks(&writes, block_size);
        if written.is_ok() && self.backend.times_transfers() {
            // Real copies keep load-vs-recompute's host speed current (the probe at start was the first guess).
            let bytes = writes.iter().map(|(_, b)| b.len()).sum();
            kv.observe_host_load(bytes, started.elapsed().as_secs_f64());
        }
        if let Err(err) = written {
            let mut pool = kv.pool().lock();
            for l in &live {
                pool.invalidate(l.id);
            }
            return Err(err.blame_engine().context("loading KV blocks from host"));
        }
        Ok(())
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
        let (host_blocks_total, host_blocks_cached, host) = match self.sched.kv().host() {
            Some(h) => {
                let h = h.lock();
                (h.capacity_blocks(), h.len(), h.counters())
            }
            None => (0, 0, HostCounters::default()),
        };
        let (disk_blocks_total, disk_blocks_cached, disk) = match self.sched.kv().disk() {
            Some(d) => {
                let i = d.index();
                (i.capacity_blocks(), i.len(), d.counters())
            }
            None => (0, 0, DiskCounters::default()),
        };
        let pool = self.sched.kv().pool().lock();
        let c = pool.counters();
        EngineStats {
            disk_blocks_total,
            disk_blocks_cached,
            disk,
            host_blocks_total,
            host_blocks_cached,
            host,
            waiting_requests: self.sched.num_waiting(),
            prefill_tokens: self.sched.prefill_tokens(),
            prefill_area: self.sched.prefill_area(),
            prefilling_requests: self.sched.prefilling().count(),
            running_requests: self.sched.running().len(),
            importing_requests: self.sched.num_importing(),
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
        let seq = self.new_sequence(req)?;
        self.sched.add(seq);
        Ok(())
    }

    /// The checks every request passes before it holds anything; then it is estimated and read ahead like a
    /// queued request (its cached prefix, its SSD blocks).
    pub fn validate(&self, req: &EngineRequest) -> Result<(), AdmitError> {
        if req.prompt.is_empty() {
            return Err(AdmitError::EmptyPrompt);
        }
        if req.adapter.is_some() && !self.backend.runs_adapters() {
            return Err(AdmitError::AdapterUnsupported(
                "this engine serves the base model only (the simulated engine, or CUDA with no device slots for adapters: --max-gpu-loras)",
            ));
        }
        req.params.validate().map_err(|(f, m)| AdmitError::InvalidParam(f, m))?;
        let vocab = self.backend.vocab_size();
        if let Some(t) = req.prompt.iter().find(|t| **t as usize >= vocab) {
            return Err(AdmitError::TokenOutOfRange(*t, vocab));
        }
        if let Some((t, _)) = req.params.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            let m = format!("token {t} is not in the vocabulary of {vocab}");
            return Err(AdmitError::InvalidParam("logit_bias", m));
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
        Ok(())
    }

    /// A validated sequence for `req`, its cached prefix estimated and its SSD blocks read ahead.
    fn new_sequence(&self, req: EngineRequest) -> Result<Sequence, AdmitError> {
        self.validate(&req)?;
        // An adapter's blocks are its own: its name and weights' digest key the chain, whoever built the request.
        let mut keys = req.extra_keys;
        if let Some(a) = &req.adapter {
            keys.push(kvgate_shared::hashing::ExtraKey::LoraAdapter(a.key.clone()));
        }
        let hasher = BlockHasher::new(&self.scheme, &keys);
        let mut seq = Sequence::new(req.id, req.prompt, req.params, hasher);
        seq.adapter = req.adapter;
        // The SSD reads a request would wait for overlap the engine work queued ahead of it.
        let kv = self.sched.kv();
        let ahead_s = self.sched.prefill_tokens() as f64 * kv.costs().prefill_s_per_token;
        let at = Clock { now: self.clock_s(), ahead_s, running: self.sched.running().len() };
        seq.arrived_s = at.now;
        // What only the SSD tier holds (and is worth loading) is read ahead while the request waits for admission.
        (seq.cached_estimate, seq.load_ready_s) = kv.arrive(&seq.hasher, &seq.tokens, &at);
        Ok(seq)
    }

    /// Drops a request wherever it is; its blocks return to the pool at once.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.abort_computed(id).is_some()
    }

    /// [`Engine::abort`], and what the engine had computed for the request (`None`: it was not here).
    pub fn abort_computed(&mut self, id: RequestId) -> Option<Computed> {
        self.sched.remove(id).map(|seq| Computed::of(&seq))
    }

    /// Runs one step; returns what each scheduled request produced.
    pub fn step(&mut self) -> Vec<StepOutput> {
        let plan = self.sched.schedule(self.clock_s());
        let moved = self.move_blocks();
        if plan.is_empty() {
            return Vec::new();
        }
        self.announce_exports(&plan);
        let mut taps = self.layer_taps(&plan);
        let result = if let Err(e) = moved {
            Err(e)
        } else {
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
                        greedy: seq.params.temperature < sampler::GREEDY_BELOW && !seq.params.needs_logits(),
                        adapter: seq.adapter.as_deref(),
                    }
                })
                .collect();
            if taps.is_empty() {
                self.backend.forward(&items)
            } else {
                let (layers, bs) = (self.backend.kv_layers(), self.scheme.block_size as usize);
                let mut tap = |n: usize, read: &backend::LayerRead<'_>| {
                    for t in taps.iter_mut() {
                        t.tap(n, layers, read, bs);
                    }
                };
                self.backend.forward_tapped(&items, &mut tap)
            }
        };
        let mut outputs = Vec::with_capacity(plan.len());
        let mut finished = Vec::new();
        match result {
            Err(e) => {
                // The engine built the batch (admitted requests' tokens, its own slots): a refused argument is its
                // own fault, not the request's.
                let e = e.blame_engine();
                for c in &plan {
                    let seq = &self.sched.running()[c.index];
                    outputs.push(output(seq, None, Some(FinishReason::Error(e.clone()))));
                    finished.push(seq.id);
                }
            }
            Ok(nexts) => {
                for c in &plan {
                    self.sched.complete_chunk(c);
                }
                self.taps_done(&plan, &taps);
                for o in self.export_chunks(&plan) {
                    if o.finished.is_some() {
                        finished.push(o.id);
                    }
                    outputs.push(o);
                }
                for (c, next) in plan.iter().zip(nexts) {
                    if !c.sample || finished.contains(&self.sched.running()[c.index].id) {
                        continue;
                    }
                    let seq = &mut self.sched.running_mut()[c.index];
                    let want = seq.params.logprobs.map(|n| n as usize);
                    let (token, logprobs) = match next {
                        // A backend that picks the token itself (the simulated model) is certain of it.
                        Some(Next::Token(t)) => (
                            t,
                            want.map(|n| TokenLogprobs {
                                logprob: 0.0,
                                top: vec![(t, 0.0)][..n.min(1)].to_vec(),
                            }),
                        ),
                        Some(Next::Logits(l)) => {
                            let t = sampler::sample_seq(
                                &l,
                                &seq.params,
                                &mut seq.rng,
                                &seq.tokens,
                                seq.prompt_len,
                            );
                            (t, want.map(|n| sampler::logprobs(&l, t, n)))
                        }
                        None => {
                            let reason = FinishReason::Error(BackendError::Other(
                                "backend returned nothing to sample from".into(),
                            ));
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
                    outputs.push(StepOutput { logprobs, ..output(seq, Some(token), reason) });
                }
            }
        }
        self.sched.retire(&finished);
        let kv = self.sched.kv().clone();
        if !kv.tiers().is_empty() {
            let registered = kv.pool().lock().take_registered();
            let (backend, bs) = (&mut self.backend, self.scheme.block_size as usize);
            kv.write_back(registered, true, &mut |ids| {
                backend.read_kv_blocks(ids, bs).map_err(|e| e.to_string())
            });
        }
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

/// What an aborted request had cost the engine, counted as a finished one's usage is: the prompt positions it
/// processed (all of them once it generated), those its prefix cache served, and the tokens it generated. A request
/// never admitted computed nothing; the prefill side of a hand-off (an export) is counted by the decode side's
/// answer, as when it completes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Computed {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

impl Computed {
    fn of(seq: &Sequence) -> Self {
        let Some(cached) = seq.cached_prompt_tokens.filter(|_| seq.export.is_none()) else {
            return Self::default();
        };
        let completion = seq.output().len();
        let prompt = match completion {
            0 => seq.num_computed.min(seq.prompt_len).max(cached),
            _ => seq.prompt_len,
        };
        Self { prompt_tokens: prompt, cached_tokens: cached.min(prompt), completion_tokens: completion }
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
        queued_s: seq.admitted_s.map(|a| (a - seq.arrived_s).max(0.0)),
        logprobs: None,
        kv: None,
    }
}

#[cfg(test)]
mod backend_tests;
#[cfg(test)]
mod pd_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tier_tests;
