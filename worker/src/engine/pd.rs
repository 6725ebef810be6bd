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

use super::request::{AdmitError, EngineRequest, KvChunk, RequestId, StepOutput};
use super::sampler::GREEDY_BELOW;
use super::scheduler::{ImportState, ScheduledChunk};
use super::{output, Backend, Engine};

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
    /// Queues a request whose blocks `from_block..` leave on its step outputs as they are written (the prefill side
    /// of a hand-off). Checked like [`Engine::add_request`].
    pub fn add_export(&mut self, req: EngineRequest, from_block: usize) -> Result<(), AdmitError> {
        let blocks = req.prompt.len().div_ceil(self.scheme.block_size as usize);
        if from_block >= blocks {
            return Err(AdmitError::InvalidParam("from_block", format!("{from_block} is past the prompt's {blocks} blocks")));
        }
        let mut seq = self.new_sequence(req)?;
        seq.export_next = Some(from_block);
        self.sched.add(seq);
        Ok(())
    }

    /// Reads the blocks the chunks of this step completed for exporting sequences and returns them as outputs
    /// (before the step's tokens, so a first token always follows its KV).
    pub(super) fn export_chunks(&mut self, plan: &[ScheduledChunk]) -> Vec<StepOutput> {
        let bs = self.scheme.block_size as usize;
        let layers = self.backend.kv_layers();
        let mut out = Vec::new();
        for c in plan {
            let seq = &self.sched.running()[c.index];
            let Some(next) = seq.export_next else { continue };
            let ready = if seq.num_computed >= seq.prompt_len {
                seq.prompt_len.div_ceil(bs)
            } else {
                seq.num_computed / bs
            };
            if ready <= next {
                continue;
            }
            let ids: Vec<u32> = seq.table.as_ref().map_or(&[][..], |t| t.blocks())[next..ready].to_vec();
            let read = self.backend.read_kv_layers(&ids, 0..layers, bs);
            let seq = &mut self.sched.running_mut()[c.index];
            let mut o = output(seq, None, None);
            match read {
                Ok(bytes) => {
                    seq.export_next = Some(ready);
                    o.kv = Some(KvChunk { first: next, count: ready - next, layers: 0..layers, bytes });
                }
                Err(e) => o.finished = Some(super::FinishReason::Error(format!("reading KV to export: {e}"))),
            }
            out.push(o);
        }
        out
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
        let mut table = kv.start(seq.hasher, &seq.tokens);
        let cached = table.cached_tokens();
        if !kv.reserve(&mut table, seq.prompt_len + 1) {
            return Err(AdmitError::NoRoom("not enough free KV blocks"));
        }
        let bs = self.scheme.block_size as usize;
        let plan = ImportPlan { from_block: cached / bs, blocks: seq.prompt_len.div_ceil(bs), cached_tokens: cached };
        seq.table = Some(table);
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
    ) -> Result<(), String> {
        let bs = self.scheme.block_size as usize;
        let per_layer = self.backend.kv_block_bytes(bs).unwrap_or(0) / self.backend.kv_layers().max(1);
        let seq = self.sched.importing_mut(id).ok_or("no such import")?;
        let want = count.saturating_mul(layers.len()).saturating_mul(per_layer);
        if bytes.len() != want {
            return Err(format!("{} bytes for {count} blocks x {} layers (want {want})", bytes.len(), layers.len()));
        }
        let state = seq.import.as_mut().ok_or("not importing")?;
        let mut probe = state.clone();
        if !probe.mark(first, count, layers.clone()) {
            return Err(format!("blocks {first}..{} layers {layers:?} are outside the transfer or repeated", first + count));
        }
        let ids: Vec<u32> = seq.table.as_ref().map_or(&[][..], |t| t.blocks())[first..first + count].to_vec();
        self.backend.write_kv_layers(&ids, layers, bytes, bs)?;
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
    ) -> Result<StepOutput, String> {
        let seq = self.sched.importing_mut(id).ok_or("no such import")?;
        if !seq.import.as_ref().is_some_and(ImportState::complete) {
            return Err("blocks are missing".into());
        }
        if first_token as usize >= self.backend.vocab_size() {
            return Err(format!("first token {first_token} is outside the vocabulary"));
        }
        let Some(mut seq) = self.sched.take_importing(id) else { return Err("no such import".into()) };
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

    /// Gives up an import and computes the prompt here instead (the prefill worker failed): the blocks written so
    /// far are freed and the request waits at the head of the queue. `false` if it was not importing.
    pub fn import_to_local(&mut self, id: RequestId) -> bool {
        let Some(mut seq) = self.sched.take_importing(id) else { return false };
        seq.import = None;
        seq.table = None;
        seq.num_computed = 0;
        self.sched.add_front(seq);
        true
    }
}
