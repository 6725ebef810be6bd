//! A backend without model math: deterministic next tokens (a hash of the whole context), no KV memory. The
//! engine's scheduling, block management and prefix cache run unchanged on top of it. The simulated worker
//! (`--engine sim`, issue #7) adds its timing model here.

use xxhash_rust::xxh3::xxh3_64;

use super::backend::{Backend, BatchItem, Next};

/// Deterministic token source.
#[derive(Clone, Debug)]
pub struct SimBackend {
    pub vocab_size: usize,
    pub max_model_len: usize,
    pub eos_token_ids: Vec<u32>,
}

impl SimBackend {
    /// The token that follows `context`: the same context always gives the same token.
    pub fn next_token(&self, context: &[u32]) -> u32 {
        let bytes: Vec<u8> = context.iter().flat_map(|t| t.to_le_bytes()).collect();
        (xxh3_64(&bytes) % self.vocab_size.max(1) as u64) as u32
    }
}

impl Backend for SimBackend {
    fn forward(&mut self, items: &[BatchItem<'_>]) -> Result<Vec<Option<Next>>, String> {
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
}
