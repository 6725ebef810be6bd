//! Prefill/decode hand-off inside one engine: the prefill side **exports** a request's KV blocks as its prefill
//! writes them; the decode side **imports** them into blocks it allocated up front and then decodes as if it had
//! prefilled the prompt itself. No sockets here (`crate::transfer` moves the bytes); `now` comes from the engine.
//!
//! Export (`add_export`): an ordinary request (the caller asks for one token) whose blocks from `from_block` on
//! leave in [`KvChunk`]s on its step outputs: after each prefill chunk, the blocks that chunk filled (every layer),
//! and with the first token, the rest (the last, partial block included). Its blocks stay in the prefix cache.
//!
//! Import (`start_import` -> `write_import`* -> `finish_import`, or `import_to_local`, or `abort`): the sequence
//! looks up its own prefix (pool and lower tiers), allocates blocks for the rest of the prompt and the first token,
//! and is parked ([`super::scheduler::ImportState`]): never scheduled nor preempted. Each write must fall inside
//! the declared blocks and layers, once; finishing needs every one, then commits the blocks to the prefix cache,
//! appends the first token and moves the sequence to the running set with its prompt computed. Dropping it (abort,
//! a failed import falling back) frees its blocks like any other sequence's.
//!
//! Invariant: the client-visible result equals a local run on the prefill worker: the same first token (sampled
//! there, its sampling stream advanced here by the one draw it took), `cached_tokens` as the prefill side served.

use super::backend::LayerRead;
use super::request::{
    AdmitError, EngineRequest, Export, ExportProgress, ExportSink, ImportState, KvChunk, RequestId,
    StepOutput,
};
use super::sampler::GREEDY_BELOW;
use super::scheduler::ScheduledChunk;
use super::{output, Backend, Engine};
use crate::kv::Clock;

/// One exporting chunk's blocks, sent layer group by layer group from inside the forward.
pub struct LayerExport {
    plan_index: usize,
    ids: Vec<u32>,
    first: usize,
    end: usize,
    group: usize,
    /// Layers sent so far.
    done: usize,
    failed: bool,
    sink: ExportSink,
}

impl LayerExport {
    /// Called with `n` when layers `0..n` are written (of `layers`): sends the group that just completed.
    pub fn tap(&mut self, n: usize, layers: usize, read: &LayerRead<'_>, block_size: usize) {
        if self.failed || (!n.is_multiple_of(self.group) && n != layers) || n <= self.done {
            return;
        }
        match read(&self.ids, self.done..n, block_size) {
            Ok(bytes) => {
                let chunk =
                    KvChunk { first: self.first, count: self.end - self.first, layers: self.done..n, bytes };
                self.sink.push(chunk);
                self.done = n;
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading KV layers to export failed: sending whole blocks instead");
                self.failed = true;
            }
        }
    }
}

/// Why an import write or finish was refused (nothing was written or changed). None is worth retrying with the same
/// frame: the transfer is given up (the decode side then computes the prompt itself).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    #[error("no import of request {0} is in the engine")]
    Unknown(RequestId),
    #[error("{got} bytes for {blocks} blocks x {layers} layers (want {want})")]
    Size { got: usize, want: usize, blocks: usize, layers: usize },
    #[error("blocks {first}..{end} layers {layers:?} are outside the transfer or repeated")]
    Range { first: usize, end: usize, layers: std::ops::Range<usize> },
    #[error("blocks are missing")]
    Incomplete,
    #[error("first token {0} is outside the vocabulary")]
    Token(u32),
    #[error("writing the blocks: {0}")]
    Backend(super::BackendError),
    #[error("the engine has stopped")]
    EngineGone,
}

/// What a decode worker lacks of a prompt it will import.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImportPlan {
    /// The first block it lacks (it holds `0..from_block` from its own cache).
    pub from_block: usize,
    /// Blocks of the whole prompt.
    pub blocks: usize,
    /// Prompt tokens its own cache holds.
    pub cached_tokens: usize,
}

impl<B: Backend> Engine<B> {
    /// Queues a request whose blocks `from_block..` go to `sink` as they are written (the prefill side of a
    /// hand-off): every `layer_group` layers during the forward where the backend taps layers, else whole blocks
    /// after each prefill chunk. Checked like [`Engine::add_request`].
    pub fn add_export(
        &mut self,
        req: EngineRequest,
        from_block: usize,
        layer_group: usize,
        sink: ExportSink,
    ) -> Result<(), AdmitError> {
        let blocks = req.prompt.len().div_ceil(self.scheme.block_size as usize);
        if from_block >= blocks {
            return Err(AdmitError::InvalidParam(
                "from_block",
                format!("{from_block} is past the prompt's {blocks} blocks"),
            ));
        }
        let mut seq = self.new_sequence(req)?;
        seq.export = Some(Export { next: from_block, layer_group, sink });
        self.sched.add(seq);
        Ok(())
    }

    /// The blocks each exporting chunk of `plan` completes: `(plan index, block ids, first block, end block)`.
    fn completed_blocks(&self, plan: &[ScheduledChunk]) -> Vec<(usize, Vec<u32>, usize, usize)> {
        let bs = self.scheme.block_size as usize;
        let mut out = Vec::new();
        for (i, c) in plan.iter().enumerate() {
            let seq = &self.sched.running()[c.index];
            let Some(e) = &seq.export else { continue };
            let end = c.start + c.len;
            let ready = if end >= seq.prompt_len { seq.prompt_len.div_ceil(bs) } else { end / bs };
            if ready > e.next {
                let ids = seq.table.as_ref().map_or(&[][..], |t| t.blocks())[e.next..ready].to_vec();
                out.push((i, ids, e.next, ready));
            }
        }
        out
    }

    /// Announces, for each exporting sequence this step computes part of the prompt of, how far its prefill has
    /// got and what the step is expected to take: the fit's cost of every prompt chunk in the step (they run as
    /// one forward), else the measured token rate's, else 0 (not measured).
    pub(super) fn announce_exports(&self, plan: &[ScheduledChunk]) {
        let running = self.sched.running();
        let exporting = |c: &&ScheduledChunk| {
            let seq = &running[c.index];
            seq.export.is_some() && c.start < seq.prompt_len
        };
        if !plan.iter().any(|c| exporting(&c)) {
            return;
        }
        let (mut tokens, mut area) = (0.0, 0.0);
        for c in plan.iter().filter(|c| c.start < running[c.index].prompt_len) {
            let n = c.len as f64;
            tokens += n;
            area += n * (c.start as f64 + n / 2.0);
        }
        let (a, b) = self.prefill_cost;
        let eta_s = if a > 0.0 || b > 0.0 {
            a * tokens + b * area
        } else {
            tokens * self.sched.kv().costs().prefill_s_per_token.max(0.0)
        };
        for c in plan.iter().filter(exporting) {
            let seq = &running[c.index];
            if let Some(e) = &seq.export {
                let through = (c.start + c.len).min(seq.prompt_len);
                e.sink.announce(ExportProgress { computed: c.start, through, eta_s });
            }
        }
    }

    /// The layer taps of this step's forward: for each exporting chunk with a layer group, what to read as its
    /// layers are written. Empty where the backend does not tap layers.
    pub(super) fn layer_taps(&self, plan: &[ScheduledChunk]) -> Vec<LayerExport> {
        if !self.backend.taps_layers() || self.backend.kv_layers() < 2 {
            return Vec::new();
        }
        self.completed_blocks(plan)
            .into_iter()
            .filter_map(|(i, ids, first, end)| {
                let e = self.sched.running()[plan[i].index].export.as_ref()?;
                (e.layer_group > 0).then(|| LayerExport {
                    plan_index: i,
                    ids,
                    first,
                    end,
                    group: e.layer_group,
                    done: 0,
                    failed: false,
                    sink: e.sink.clone(),
                })
            })
            .collect()
    }

    /// After a tapped forward: the blocks the taps sent count as exported.
    pub(super) fn taps_done(&mut self, plan: &[ScheduledChunk], taps: &[LayerExport]) {
        let layers = self.backend.kv_layers();
        for t in taps.iter().filter(|t| !t.failed && t.done == layers) {
            if let Some(e) = self.sched.running_mut()[plan[t.plan_index].index].export.as_mut() {
                e.next = t.end;
            }
        }
    }

    /// Reads the blocks this step's chunks completed for exporting sequences (those no layer tap sent) into their
    /// sinks; a failed read ends the sequence with an error output.
    pub(super) fn export_chunks(&mut self, plan: &[ScheduledChunk]) -> Vec<StepOutput> {
        let bs = self.scheme.block_size as usize;
        let layers = self.backend.kv_layers();
        let mut out = Vec::new();
        for (i, ids, first, end) in self.completed_blocks(plan) {
            let read = self.backend.read_kv_layers(&ids, 0..layers, bs);
            let seq = &mut self.sched.running_mut()[plan[i].index];
            let Some(e) = seq.export.as_mut() else { continue };
            match read {
                Ok(bytes) => {
                    e.next = end;
                    e.sink.push(KvChunk { first, count: end - first, layers: 0..layers, bytes });
                }
                Err(err) => {
                    let reason =
                        super::FinishReason::Error(err.blame_engine().context("reading KV to export"));
                    out.push(output(seq, None, Some(reason)));
                }
            }
        }
        out
    }

    /// Whether an import of a `prompt_len`-token prompt would find room now: a sequence slot, and free blocks for
    /// the whole prompt and its first token (its own cache hits, found at the start, only make it need fewer), with
    /// no request waiting ahead of it (an import waits its turn like a local request).
    pub fn import_room(&self, prompt_len: usize) -> bool {
        let kv = self.sched.kv();
        self.sched.num_slots_used() < self.sched.config().max_num_seqs
            && self.sched.num_waiting() == 0
            && kv.pool().lock().num_free() >= kv.blocks_for(prompt_len + 1)
    }

    /// Admits a request whose prompt's KV will arrive from a prefill worker: finds its own cached prefix, allocates
    /// blocks for the rest and the first token, and parks it. Refused (nothing held) when no sequence slot or not
    /// enough free blocks are left.
    pub fn start_import(&mut self, req: EngineRequest) -> Result<ImportPlan, AdmitError> {
        if self.sched.num_slots_used() >= self.sched.config().max_num_seqs {
            return Err(AdmitError::NoRoom("every sequence slot is taken"));
        }
        let mut seq = self.new_sequence(req)?;
        let kv = self.sched.kv().clone();
        // What this worker's tiers hold is not imported: SSD blocks are read (waited for outside every lock, up to
        // the read's deadline) rather than moved over the network.
        let at = Clock { now: self.clock_s(), ahead_s: 0.0, running: self.sched.running().len() };
        let mut table = kv.claim_waiting(seq.hasher, &seq.tokens, &at);
        let cached = table.cached_tokens();
        if !kv.reserve(&mut table, seq.prompt_len + 1) {
            return Err(AdmitError::NoRoom("not enough free KV blocks"));
        }
        let bs = self.scheme.block_size as usize;
        let plan = ImportPlan {
            from_block: cached / bs,
            blocks: seq.prompt_len.div_ceil(bs),
            cached_tokens: cached,
        };
        seq.table = Some(table);
        seq.admitted_s = Some(at.now);
        seq.import = Some(ImportState::new(plan.from_block, plan.blocks, self.backend.kv_layers()));
        self.sched.add_importing(seq);
        Ok(plan)
    }

    /// Writes blocks `first..first + count`, layers `layers`, of an importing request. An error (unknown request,
    /// outside the declared range, received already, wrong size) writes nothing.
    pub fn write_import(
        &mut self,
        id: RequestId,
        first: usize,
        count: usize,
        layers: std::ops::Range<usize>,
        bytes: &[u8],
    ) -> Result<(), ImportError> {
        let bs = self.scheme.block_size as usize;
        let per_layer = self.backend.kv_block_bytes(bs).unwrap_or(0) / self.backend.kv_layers().max(1);
        let seq = self.sched.importing_mut(id).ok_or(ImportError::Unknown(id))?;
        let want = count.saturating_mul(layers.len()).saturating_mul(per_layer);
        if bytes.len() != want {
            return Err(ImportError::Size { got: bytes.len(), want, blocks: count, layers: layers.len() });
        }
        let state = seq.import.as_mut().ok_or(ImportError::Unknown(id))?;
        let mut probe = state.clone();
        if !probe.mark(first, count, layers.clone()) {
            return Err(ImportError::Range { first, end: first.saturating_add(count), layers });
        }
        let ids: Vec<u32> = seq.table.as_ref().map_or(&[][..], |t| t.blocks())[first..first + count].to_vec();
        self.backend.write_kv_layers(&ids, layers, bytes, bs).map_err(ImportError::Backend)?;
        if let Some(seq) = self.sched.importing_mut(id) {
            seq.import = Some(probe);
        }
        Ok(())
    }

    /// Ends an import: every declared block must have arrived; the prompt's blocks enter the prefix cache, the first
    /// token (sampled by the prefill worker, which served `cached_tokens` of the prompt from its cache) is appended,
    /// and the sequence runs. Returns the first token's output. On error the import stays (the caller aborts it
    /// or falls back).
    pub fn finish_import(
        &mut self,
        id: RequestId,
        first_token: u32,
        cached_tokens: usize,
    ) -> Result<StepOutput, ImportError> {
        let seq = self.sched.importing_mut(id).ok_or(ImportError::Unknown(id))?;
        if !seq.import.as_ref().is_some_and(ImportState::complete) {
            return Err(ImportError::Incomplete);
        }
        if first_token as usize >= self.backend.vocab_size() {
            return Err(ImportError::Token(first_token));
        }
        let Some(mut seq) = self.sched.take_importing(id) else { return Err(ImportError::Unknown(id)) };
        seq.import = None;
        seq.num_computed = seq.prompt_len;
        if let Some(table) = seq.table.as_mut() {
            self.sched.kv().commit(table, &seq.tokens, seq.prompt_len);
        }
        seq.cached_prompt_tokens = Some(cached_tokens.min(seq.prompt_len));
        if seq.params.temperature >= GREEDY_BELOW && self.backend.vocab_size() > 1 {
            // The prefill worker's sampler drew once for this token.
            seq.rng.unit();
        }
        seq.tokens.push(first_token);
        let index = self.sched.push_running(seq);
        let reason = self.finish_reason(index, first_token);
        let o = output(&self.sched.running()[index], Some(first_token), reason.clone());
        if reason.is_some() {
            self.sched.retire(&[id]);
        }
        Ok(o)
    }

    /// Gives up an import and computes the prompt here instead (the prefill worker failed or stalled): the blocks
    /// that arrived whole, without a gap from the first one lacked, enter the prefix cache (a prefill that got far
    /// is not thrown away: the local prefill finds them as cache hits, unless they are evicted first), the rest are
    /// freed, and the request waits at the head of the queue. Returns the imported prompt tokens kept that way;
    /// `None` if it was not importing.
    pub fn import_to_local(&mut self, id: RequestId) -> Option<usize> {
        let mut seq = self.sched.take_importing(id)?;
        let bs = self.scheme.block_size as usize;
        let (from, whole) = seq.import.as_ref().map_or((0, 0), |i| (i.from_block, i.whole_through()));
        // Whole blocks only: the prompt's last block, if partial, is never cached.
        let kept = (whole * bs).min(seq.prompt_len / bs * bs);
        if let Some(table) = seq.table.as_mut() {
            self.sched.kv().commit(table, &seq.tokens, kept);
        }
        let kept = seq.table.as_ref().map_or(0, |t| t.chained_tokens()).min(kept);
        seq.import = None;
        seq.table = None;
        seq.num_computed = 0;
        self.sched.add_front(seq);
        Some(kept.saturating_sub(from * bs))
    }
}
