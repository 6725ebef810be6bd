//! A backend without model math: deterministic next tokens, no KV memory. The engine's scheduling, block
//! management and prefix cache run unchanged on top of it. With a [`TimingModel`] each step takes the time the
//! model predicts: slept in real time (`kvgate-worker serve --engine sim`), or accumulated as virtual time (the
//! fleet simulator reads [`SimBackend::take_elapsed`]).

use xxhash_rust::xxh3::xxh3_64;

use super::backend::{Backend, BackendError, BatchItem, Next};
use super::timing::TimingModel;

/// How simulated time passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimClock {
    /// Steps take no time (tests).
    Instant,
    /// Steps sleep for their predicted time (a simulated worker serving real clients).
    RealTime,
    /// Steps add their predicted time to a counter (a virtual-time simulator).
    Virtual,
}

/// Deterministic token source with an optional timing model.
#[derive(Clone, Debug)]
pub struct SimBackend {
    pub vocab_size: usize,
    pub max_model_len: usize,
    pub eos_token_ids: Vec<u32>,
    pub timing: Option<TimingModel>,
    pub clock: SimClock,
    /// K/V bytes one token would take (lower tiers count simulated blocks at this size). Default 131,072: a
    /// Llama-3-8B token in bf16 (32 layers x 8 KV heads x 128 x 2 x 2 bytes).
    pub kv_bytes_per_token: usize,
    elapsed: f64,
    /// Virtual time at the start of the current step ([`SimBackend::set_now`]).
    now: f64,
    /// Seconds of lower-tier loads the next step pays first.
    pending_load_s: f64,
}

impl SimBackend {
    /// A backend whose steps take no time.
    pub fn new(vocab_size: usize, max_model_len: usize, eos_token_ids: Vec<u32>) -> Self {
        Self {
            vocab_size,
            max_model_len,
            eos_token_ids,
            timing: None,
            clock: SimClock::Instant,
            kv_bytes_per_token: 131_072,
            elapsed: 0.0,
            now: 0.0,
            pending_load_s: 0.0,
        }
    }

    /// Adds a timing model and a clock.
    pub fn with_timing(mut self, timing: TimingModel, clock: SimClock) -> Self {
        self.timing = Some(timing);
        self.clock = clock;
        self
    }

    /// The virtual time now (the simulator sets it before a step or an admission).
    pub fn set_now(&mut self, now: f64) {
        self.now = now;
    }

    /// Virtual seconds accumulated since the last call.
    pub fn take_elapsed(&mut self) -> f64 {
        std::mem::take(&mut self.elapsed)
    }

    /// The token that follows `context`: a hash of its length and last 16 tokens, so the same context always
    /// gives the same token and a 200K-token context costs no more than a short one.
    pub fn next_token(&self, context: &[u32]) -> u32 {
        let tail = &context[context.len().saturating_sub(16)..];
        let mut bytes: Vec<u8> = (context.len() as u64).to_le_bytes().to_vec();
        bytes.extend(tail.iter().flat_map(|t| t.to_le_bytes()));
        (xxh3_64(&bytes) % self.vocab_size.max(1) as u64) as u32
    }
}

impl Backend for SimBackend {
    fn forward(&mut self, items: &[BatchItem<'_>]) -> Result<Vec<Option<Next>>, BackendError> {
        if let Some(t) = &self.timing {
            let secs = t.step(items) + std::mem::take(&mut self.pending_load_s);
            match self.clock {
                SimClock::Instant => {}
                SimClock::RealTime => std::thread::sleep(std::time::Duration::from_secs_f64(secs)),
                SimClock::Virtual => self.elapsed += secs,
            }
        }
        Ok(items
            .iter()
            .map(|it| it.want_next.then(|| Next::Token(self.next_token(&it.tokens[..it.start + it.len]))))
            .collect())
    }
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    fn max_model_len(&self) -> usize {
        self.max_model_len
    }
    fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_ids.clone()
    }
    fn needs_slots(&self) -> bool {
        false
    }

    /// No KV memory: blocks copy as empty payloads, counted at [`SimBackend::kv_bytes_per_token`] a token.
    fn kv_block_bytes(&self, block_size: usize) -> Option<usize> {
        Some(self.kv_bytes_per_token * block_size)
    }

    fn kv_layout(&self) -> String {
        format!("sim kv_bytes_per_token={}", self.kv_bytes_per_token)
    }

    fn note_kv_loaded(&mut self, host_blocks: usize, disk_wait_s: f64, block_size: usize) {
        if let Some(t) = &self.timing {
            let bytes = (block_size * self.kv_bytes_per_token) as f64;
            self.pending_load_s += bytes * host_blocks as f64 * t.host_load_s_per_byte + disk_wait_s;
        }
    }

    fn times_transfers(&self) -> bool {
        false
    }

    fn clock_s(&self) -> Option<f64> {
        match self.clock {
            SimClock::RealTime => None,
            SimClock::Instant | SimClock::Virtual => Some(self.now + self.elapsed),
        }
    }

    fn read_kv_blocks(&mut self, ids: &[u32], _block_size: usize) -> Result<Vec<Vec<u8>>, BackendError> {
        Ok(vec![Vec::new(); ids.len()])
    }

    fn write_kv_blocks(&mut self, _blocks: &[(u32, &[u8])], _block_size: usize) -> Result<(), BackendError> {
        Ok(())
    }
}
