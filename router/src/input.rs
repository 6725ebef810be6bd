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
    /// The workers it may go to, by address (`host:port`, [`url_address`]): a proxy's candidate subset (the
    /// endpoint picker's subset hint), sorted (looked up by binary search: [`RouteInput::allows`]). `None`: any.
    pub only: Option<&'a [String]>,
    /// The LoRA adapter it runs with (its `model` named one of `model`'s adapters): only workers holding it are
    /// candidates (`placement` says where to load one first). `None`: the base model.
    pub adapter: Option<&'a str>,
    /// The tokens it may generate (`RequestView::output_tokens`; 0: unknown).
    pub output_tokens: u64,
    /// Its class's SLOs.
    pub slo: crate::routing::Slo,
}

/// A worker URL's address, `host:port`: without its scheme, path or fragment (`http://10.0.0.1:8000/#dp1` is
/// `10.0.0.1:8000`).
pub fn url_address(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let end = rest.find(['/', '#', '?']).unwrap_or(rest.len());
    &rest[..end]
}

impl RouteInput<'_> {
    /// The same request with what its class says of it: the output it will probably produce and its SLOs.
    pub fn with_goal(self, output_tokens: u64, slo: crate::routing::Slo) -> Self {
        Self { output_tokens, slo, ..self }
    }

    /// Whether the worker at `url` is in the proxy's subset ([`RouteInput::only`], sorted), or there is none.
    pub fn allows(&self, url: &str) -> bool {
        let address = url_address(url);
        self.only.is_none_or(|only| only.binary_search_by(|a| a.as_str().cmp(address)).is_ok())
    }
}
