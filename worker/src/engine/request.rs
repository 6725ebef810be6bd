//! What goes into the engine (requests with their sampling parameters) and what comes out of each step.

use kvgate_shared::hashing::ExtraKeys;

/// Engine-wide id of a request.
pub type RequestId = u64;

/// How to pick tokens and when to stop.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// 0 (or below 1e-5) = greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: u32,
    /// Seed of this request's sampling stream; `None` = seeded from the request id.
    pub seed: Option<u64>,
    /// Extra token ids that end generation (the EOS ids of the model always do, unless `ignore_eos`); at most
    /// [`MAX_STOP_TOKEN_IDS`].
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation when they appear in the output text.
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// OpenAI's presence and frequency penalties over the generated tokens ([-2, 2]; 0 = off).
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// vLLM's repetition penalty over the prompt's and the generated tokens ((0, 2]; 1 = off): a seen token's
    /// positive logit is divided by it, a negative one multiplied.
    pub repetition_penalty: f32,
    /// Drops tokens whose probability is under `min_p` times the most likely one's ([0, 1]; 0 = off).
    pub min_p: f32,
    /// Added to these tokens' logits ([-100, 100] each; at most [`MAX_LOGIT_BIAS`] tokens).
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each sampled token's log-probability and this many most likely alternatives (`None`: off; at most
    /// [`MAX_TOP_LOGPROBS`]). Taken from the model's logits before penalties, bias and temperature (vLLM's default
    /// `raw_logprobs`).
    pub logprobs: Option<u32>,
}

/// Most alternatives per token a request may ask for (`top_logprobs`; OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Most tokens one request's `logit_bias` may name (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// Most ids one request's `stop_token_ids` may name (each generated token is looked up in them).
pub const MAX_STOP_TOKEN_IDS: usize = 2048;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            ignore_eos: false,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        Self { max_tokens, temperature: 0.0, ..Self::default() }
    }

    /// Checks ranges; the message names the OpenAI field.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return Err(("temperature", format!("{} is not in [0, 100]", self.temperature)));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(("top_p", format!("{} is not in (0, 1]", self.top_p)));
        }
        if self.max_tokens == 0 {
            return Err(("max_tokens", "must be at least 1".into()));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(("stop", "stop strings must not be empty".into()));
        }
        for (field, v) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
                return Err((field, format!("{v} is not in [-2, 2]")));
            }
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0 && r <= 2.0) {
            return Err(("repetition_penalty", format!("{r} is not in (0, 2]")));
        }
        if !(self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p)) {
            return Err(("min_p", format!("{} is not in [0, 1]", self.min_p)));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(("logit_bias", format!("at most {MAX_LOGIT_BIAS} tokens")));
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(("stop_token_ids", format!("at most {MAX_STOP_TOKEN_IDS} ids")));
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return Err(("top_logprobs", format!("at most {MAX_TOP_LOGPROBS}")));
        }
        if let Some((t, b)) =
            self.logit_bias.iter().find(|(_, b)| !(b.is_finite() && (-100.0..=100.0).contains(b)))
        {
            return Err(("logit_bias", format!("the bias of token {t}, {b}, is not in [-100, 100]")));
        }
        Ok(())
    }

    /// Whether anything changes the logits before sampling (then the backend's greedy shortcut, an arg-max on
    /// the device, cannot be used, and a prefill worker cannot sample the first token from its wire frame).
    pub fn modifies_logits(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || self.min_p > 0.0
            || !self.logit_bias.is_empty()
    }

    /// Whether sampling needs the logits on the host: they are adjusted, or log-probabilities are reported (then
    /// the device arg-max shortcut is off, and a split request is served whole by one worker).
    pub fn needs_logits(&self) -> bool {
        self.modifies_logits() || self.logprobs.is_some()
    }
}

/// A request as the engine sees it: token ids and parameters.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Hash extra keys (the tenant's `cache_salt`, ...): requests with different keys share no blocks.
    pub extra_keys: ExtraKeys,
    /// The LoRA adapter it runs with (`model::lora`); the engine adds the adapter's name to `extra_keys`, so its
    /// blocks are never another adapter's or the base model's. `None`: the base model.
    pub adapter: Option<std::sync::Arc<crate::model::lora::LoraAdapter>>,
}

/// Why a sequence ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id, or a stop string (`Some`).
    Stop(Option<String>),
    /// `max_tokens` reached, or the model's context is full.
    Length,
    /// Aborted by the caller.
    Abort,
    /// The backend failed on this sequence's batch (or reading its KV to export).
    Error(super::BackendError),
}

/// What one step produced for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    pub id: RequestId,
    /// The token sampled this step, if any (a prefill chunk that does not end the prompt samples none).
    pub token: Option<u32>,
    pub finished: Option<FinishReason>,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Seconds (engine clock) between its arrival and its first admission, once admitted (traces' queue span).
    pub queued_s: Option<f64>,
    /// The sampled token's log-probability and the most likely alternatives, when the request asks for them.
    pub logprobs: Option<TokenLogprobs>,
    /// K/V bytes of blocks the request exports (the prefill side of a hand-off, `Engine::add_export`).
    pub kv: Option<KvChunk>,
}

/// One sampled token's log-probability and the `n` most likely tokens with theirs (most likely first, lower id
/// first among equals).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Blocks `first..first + count` of an exporting request, layers `layers` of each, as one payload: per block, per
/// layer of the range, K then V (`Backend::read_kv_blocks`' layout restricted to the layers).
#[derive(Clone, Debug, PartialEq)]
pub struct KvChunk {
    pub first: usize,
    pub count: usize,
    pub layers: std::ops::Range<usize>,
    pub bytes: Vec<u8>,
}

/// Why a request was refused at admission.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AdmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {0} is outside the model's vocabulary of {1}")]
    TokenOutOfRange(u32, usize),
    #[error(
        "prompt ({prompt} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {limit} tokens"
    )]
    ContextTooLong { prompt: usize, max_tokens: u32, limit: usize },
    #[error("prompt ({prompt} tokens) + max_tokens ({max_tokens}) needs more KV than the whole cache holds ({capacity} tokens)")]
    ExceedsKvCapacity { prompt: usize, max_tokens: u32, capacity: usize },
    #[error("invalid {0}: {1}")]
    InvalidParam(&'static str, String),
    #[error("request id {0} is already in the engine")]
    DuplicateId(RequestId),
    #[error("no room to import the request's KV now ({0})")]
    NoRoom(&'static str),
    #[error("this worker's backend does not run LoRA adapters ({0})")]
    AdapterUnsupported(&'static str),
}

/// Where an exporting request's blocks go as they are written (the server: the transfer link's queue), and the
/// bytes handed over that the link has not sent yet.
#[derive(Clone)]
pub struct ExportSink {
    send: std::sync::Arc<dyn Fn(KvChunk) + Send + Sync>,
    backlog: std::sync::Arc<ExportBacklog>,
    progress: Option<std::sync::Arc<tokio::sync::watch::Sender<ExportProgress>>>,
}

/// How far an export's prefill has got, announced as each step that computes part of its prompt starts: the
/// transfer link forwards it, so the decode side waits for a prefill that moves and gives up on one that does not.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExportProgress {
    /// Prompt tokens computed (cache hits count).
    pub computed: usize,
    /// Prompt tokens computed once the step now starting ends.
    pub through: usize,
    /// What the engine expects that step to take, from its measured prefill cost (0: not measured yet).
    pub eta_s: f64,
}

impl ExportSink {
    pub fn new(
        send: std::sync::Arc<dyn Fn(KvChunk) + Send + Sync>,
        backlog: std::sync::Arc<ExportBacklog>,
    ) -> Self {
        Self { send, backlog, progress: None }
    }

    /// The same sink, also announcing each step of the prefill to `progress`.
    pub fn with_progress(mut self, progress: tokio::sync::watch::Sender<ExportProgress>) -> Self {
        self.progress = Some(std::sync::Arc::new(progress));
        self
    }

    /// Announces a step of the prefill (the latest announcement replaces the one before).
    pub fn announce(&self, p: ExportProgress) {
        if let Some(tx) = &self.progress {
            tx.send_replace(p);
        }
    }

    /// Hands a chunk over (its bytes count in the backlog until the link reports them sent).
    pub fn push(&self, chunk: KvChunk) {
        self.backlog.add(chunk.bytes.len());
        (self.send)(chunk);
    }

    /// Whether the backlog is at its bound: the sequence's prefill waits until the link drains it.
    pub fn held(&self) -> bool {
        self.backlog.held()
    }
}

/// Bytes an export handed to its link and the link has not sent: bounded, so a decode peer that reads slowly holds
/// back the export's prefill (back-pressure into the engine) rather than the prompt's whole KV piling up in host
/// memory. At most one step's chunk past the bound is held.
///
/// Once the export ends ([`ExportBacklog::drain`]) the backlog is closed: what it held leaves the gauge, and a chunk
/// the engine hands over after that (it may step the request once more before it sees the abort; the chunk is
/// dropped with the closed channel) is not counted, so `kvgate_worker_kv_export_backlog_bytes` comes back to 0.
/// Every change of the count and of the gauge is one atomic step of the same value.
#[derive(Debug)]
pub struct ExportBacklog {
    bytes: std::sync::atomic::AtomicUsize,
    limit: usize,
}

/// The count of a drained backlog.
const DRAINED: usize = usize::MAX;

impl ExportBacklog {
    pub fn new(limit: usize) -> Self {
        Self { bytes: std::sync::atomic::AtomicUsize::new(0), limit: limit.max(1) }
    }
    fn update(&self, f: impl Fn(usize) -> usize) -> Option<usize> {
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        self.bytes.fetch_update(AcqRel, Acquire, |b| (b != DRAINED).then(|| f(b))).ok()
    }
    fn add(&self, n: usize) {
        if self.update(|b| b.saturating_add(n).min(DRAINED - 1)).is_some() {
            metrics::gauge!("kvgate_worker_kv_export_backlog_bytes").increment(n as f64);
        }
    }
    /// `n` bytes handed over have left on the link.
    pub fn sent(&self, n: usize) {
        if let Some(before) = self.update(|b| b.saturating_sub(n)) {
            metrics::gauge!("kvgate_worker_kv_export_backlog_bytes").decrement(n.min(before) as f64);
        }
    }
    /// The export ended: what it held is dropped with its link, and nothing more is counted.
    pub fn drain(&self) {
        let before = self.bytes.swap(DRAINED, std::sync::atomic::Ordering::AcqRel);
        if before != DRAINED {
            metrics::gauge!("kvgate_worker_kv_export_backlog_bytes").decrement(before as f64);
        }
    }
    pub fn bytes(&self) -> usize {
        match self.bytes.load(std::sync::atomic::Ordering::Acquire) {
            DRAINED => 0,
            b => b,
        }
    }
    pub fn held(&self) -> bool {
        self.bytes() >= self.limit
    }
}

impl std::fmt::Debug for ExportSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExportSink")
    }
}

/// The prefill side of a hand-off, per sequence.
#[derive(Clone, Debug)]
pub struct Export {
    /// The next block to export.
    pub next: usize,
    /// Layers per chunk while a forward computes (0: whole blocks after each prefill chunk).
    pub layer_group: usize,
    pub sink: ExportSink,
}

/// What an importing sequence has received: one bit per (block, layer) of `from_block..blocks`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportState {
    pub from_block: usize,
    pub blocks: usize,
    pub layers: usize,
    received: Vec<u64>,
    missing: usize,
}

impl ImportState {
    pub fn new(from_block: usize, blocks: usize, layers: usize) -> Self {
        let bits = (blocks - from_block) * layers;
        Self { from_block, blocks, layers, received: vec![0; bits.div_ceil(64)], missing: bits }
    }

    /// Marks blocks `first..first + count`, layers `layers`, as received; `false` (and nothing marked) if any of
    /// them is outside the declared range or was received already.
    pub fn mark(&mut self, first: usize, count: usize, layers: std::ops::Range<usize>) -> bool {
        let in_range = first >= self.from_block
            && first.checked_add(count).is_some_and(|end| end <= self.blocks)
            && layers.start < layers.end
            && layers.end <= self.layers;
        if !in_range {
            return false;
        }
        let bit = |b: usize, l: usize| (b - self.from_block) * self.layers + l;
        let all = || (first..first + count).flat_map(|b| layers.clone().map(move |l| (b, l)));
        if all().any(|(b, l)| self.received[bit(b, l) / 64] >> (bit(b, l) % 64) & 1 == 1) {
            return false;
        }
        for (b, l) in all() {
            let i = bit(b, l);
            self.received[i / 64] |= 1 << (i % 64);
        }
        self.missing -= count * layers.len();
        true
    }

    /// Whether every declared block and layer has arrived.
    pub fn complete(&self) -> bool {
        self.missing == 0
    }

    /// The end of the blocks that arrived whole (every layer) from `from_block` on, without a gap: what a
    /// fallback keeps.
    pub fn whole_through(&self) -> usize {
        let bit = |b: usize, l: usize| (b - self.from_block) * self.layers + l;
        let whole =
            |b: usize| (0..self.layers).all(|l| self.received[bit(b, l) / 64] >> (bit(b, l) % 64) & 1 == 1);
        (self.from_block..self.blocks).find(|b| !whole(*b)).unwrap_or(self.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_past_their_limits_are_refused_by_field() {
        let ok = SamplingParams { stop_token_ids: vec![7; MAX_STOP_TOKEN_IDS], ..SamplingParams::default() };
        assert!(ok.validate().is_ok());
        let p =
            SamplingParams { stop_token_ids: vec![7; MAX_STOP_TOKEN_IDS + 1], ..SamplingParams::default() };
        assert_eq!(p.validate().expect_err("over the limit").0, "stop_token_ids");
        let p =
            SamplingParams { logit_bias: vec![(1, 1.0); MAX_LOGIT_BIAS + 1], ..SamplingParams::default() };
        assert_eq!(p.validate().expect_err("over the limit").0, "logit_bias");
    }

    /// The hour-long chaos run ended with 483,328 bytes in `kvgate_worker_kv_export_backlog_bytes` on the prefill
    /// worker and nothing exporting: a chunk handed over after the export ended (the engine stepped the request
    /// once more before it saw the abort) was counted and never sent. A drained backlog counts nothing more.
    #[test]
    fn an_export_backlog_drained_at_its_end_counts_no_later_chunk() {
        let b = ExportBacklog::new(100);
        b.add(60);
        b.sent(20);
        assert_eq!(b.bytes(), 40);
        b.sent(1000);
        assert_eq!(b.bytes(), 0, "never below zero");
        b.add(150);
        assert!(b.held());
        b.drain();
        assert_eq!(b.bytes(), 0);
        assert!(!b.held());
        b.add(70); // the engine's late chunk: dropped with the closed link, not counted
        b.sent(10);
        b.drain();
        assert_eq!(b.bytes(), 0);
    }
}
