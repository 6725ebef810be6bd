//! What the engine benchmarks share.

use kvgate_shared::hashing::ExtraKeys;
use kvgate_worker::engine::{EngineRequest, SamplingParams};

/// A greedy request of `max_tokens` that ignores EOS (every benchmark run generates the same count).
pub fn request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        id,
        prompt,
        params: SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) },
        extra_keys: ExtraKeys::none(),
        adapter: None,
    }
}
