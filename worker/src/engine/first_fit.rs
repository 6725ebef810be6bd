//! The prefill cost a worker measures before it serves: two shapes of forward of the same length, one at the start
//! of a context and one at its end, each timed a few times, so the fit of `server::prefill_fit` (seconds per token, per unit of attention
//! area) has an attention term from its first report on. Without it a worker that has computed only short prompts
//! prices a long one by its token rate: a CPU worker of `small` was predicted 6.7 s for a 14K-token prompt that
//! took about 80 s, and the gateway's split and first-byte bound followed the prediction.
//!
//! Invariants: it runs only while every block of the pool is free (at start, before any request), writes only
//! blocks it then leaves free again (their contents are never read: no block is registered), and only on a
//! backend that keeps KV memory and the real clock (a simulator has its profile).

use super::{Backend, BatchItem, Engine};

/// Context the second shape ends at (at most what the pool and the model hold); each shape computes a quarter of it.
pub const FIT_CONTEXT_TOKENS: usize = 2048;
/// Times each shape is timed.
pub const REPEATS: usize = 2;

impl<B: Backend> Engine<B> {
    /// `(prompt tokens, attention area, seconds)` of each timed forward (none where it cannot run: a simulated
    /// backend, blocks in use, a pool or model shorter than 256 tokens, a forward that fails).
    pub fn time_prefill_shapes(&mut self) -> Vec<(f64, f64, f64)> {
        if self.backend.clock_s().is_some() || !self.backend.needs_slots() {
            return Vec::new();
        }
        let bs = self.scheme.block_size as usize;
        let (free, blocks) = {
            let kv = self.sched.kv();
            let pool = kv.pool().lock();
            // A block in the prefix cache is free too, but its contents are kept: then none is written.
            (if pool.num_cached() == 0 { pool.num_free() } else { 0 }, pool.num_blocks())
        };
        let ctx = FIT_CONTEXT_TOKENS.min(blocks * bs).min(self.backend.max_model_len()) / 4 * 4;
        if free != blocks || ctx < 256 {
            return Vec::new();
        }
        // Block ids 0.. in order: slot p is p. Any valid token will do (the values are never read).
        let tokens = vec![0u32; ctx];
        let n = ctx / 4;
        // The first forward only warms the backend up (kernels compiled, buffers sized); then each shape is timed
        // REPEATS times, interleaved, and its fastest kept (what a neighbour's burst adds is noise, never less).
        let mut best = [f64::INFINITY; 2];
        let shapes = [(0, n), (ctx - n, n)];
        let runs = std::iter::once((0, (0, 16.min(n))))
            .chain((0..REPEATS).flat_map(|_| [(1, shapes[0]), (2, shapes[1])]));
        for (which, (start, len)) in runs {
            let item = BatchItem {
                tokens: &tokens,
                start,
                len,
                slots: (0..start + len).collect(),
                // A next token makes the forward end when its work has (a device backend copies it back).
                want_next: true,
                greedy: true,
                adapter: None,
            };
            let t = std::time::Instant::now();
            if let Err(e) = self.backend.forward(std::slice::from_ref(&item)) {
                tracing::warn!(error = %e, "timing the prefill at start failed: the fit waits for real prompts");
                return Vec::new();
            }
            if which > 0 {
                best[which - 1] = best[which - 1].min(t.elapsed().as_secs_f64());
            }
        }
        shapes
            .iter()
            .zip(best)
            .map(|((start, len), secs)| {
                let area = kvgate_shared::report::attention_area(*start as u64, *len as u64);
                (*len as f64, area as f64, secs)
            })
            .collect()
    }
}
