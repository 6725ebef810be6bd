//! What routing needs to know about one request ([`RouteInput`]): the request side of every decision, shared by
//! the one entry point (`route`) and the split planner (`split::plan`), which both read it and neither owns it.

use kvgate_shared::hashing::BlockHash;

/// What routing needs to know about one request.
#[derive(Clone, Copy, Debug)]
pub struct RouteInput<'a> {
    pub model: &'a str,
    /// Chained hashes of the prompt's full blocks.
    pub hashes: &'a [BlockHash],
    pub prompt_tokens: usize,
    /// The ring key (`routing::RingKeys`).
    pub session_key: u64,
    /// Leading blocks other conversations share (`routing::RingKey::shared_blocks`).
    pub shared_blocks: usize,
    /// Tokens per block of the model's hash scheme.
    pub block_size: usize,
}
