//! Chained block hashing: the key of every KV block in the prefix cache, computed identically by the gateway
//! (to score workers) and the worker (to find cached blocks).
//!
//! # Scheme (hash version 1)
//! A prompt's token ids are cut into blocks of `block_size` tokens; only full blocks are hashed. With
//! `xxh3(b)` the 64-bit XXH3 of the byte string `b` (seed 0) and `le(x)` little-endian bytes:
//!
//! ```text
//! root = xxh3( "kvgate/block-hash/v1" || le(fingerprint: u64) || for each extra key, in canonical order:
//!              le(tag: u8) || le(len: u32) || bytes )
//! h_0  = xxh3( le(root) || le(t_0: u32) || ... || le(t_{B-1}: u32) )
//! h_i  = xxh3( le(h_{i-1}) || le(tokens of block i as u32) )
//! ```
//!
//! The fingerprint ([`HashScheme::fingerprint`]) covers the block size, the hash version and a digest of the
//! tokenizer and chat template, so two deployments that would tokenize differently never share a hash. Extra keys
//! (a client's `cache_salt`, a tenant scope and a key-forced tenant salt, LoRA adapter, ...) are tagged and
//! length-prefixed: a salt `"x"` and an adapter `"x"` give
//! different roots, and no concatenation of two keys can equal another key.
//!
//! # Collisions
//! Hashes are 64 bits. Among `n` distinct blocks the chance that any two collide is about `n^2 / 2^65`: 1e-9 for
//! 10^5 blocks, 3e-4 for 10^8 blocks held fleet-wide. That is why the two sides treat a hash differently:
//! the worker verifies the whole chain on every hit: the block's stored tokens and its parent (the cached block it
//! extended, or for a first block a second, independent digest of the root, [`root_identity`]); a mismatch is a miss, so a
//! collision (say two tenants' prefixes with the same last block) can cost a recompute, never another prefix's KV.
//! The gateway only uses hashes to *score* workers, where a collision (or a Bloom false positive) costs at most one
//! sub-optimal routing decision.
//!
//! The values are pinned by golden-vector tests: changing anything here is a new hash version.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed, Xxh3};

/// The version of the scheme above; part of every fingerprint.
pub const HASH_VERSION: u32 = 1;
/// Tokens per KV block unless configured otherwise (gateway and worker must agree).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Largest block size accepted anywhere (a sanity bound, not a tuning knob).
pub const MAX_BLOCK_SIZE: u32 = 4096;

const ROOT_DOMAIN: &[u8] = b"kvgate/block-hash/v1";
const FINGERPRINT_DOMAIN: &[u8] = b"kvgate/scheme-fingerprint/v1";

/// A chained block hash: covers its block's tokens and every block before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// What must be equal on both sides for their hashes to be comparable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HashScheme {
    /// Tokens per block.
    pub block_size: u32,
    /// [`HASH_VERSION`] of the side that computed the hashes.
    pub hash_version: u32,
    /// Digest of the tokenizer and chat template (see `prompt::Prompter::digest`).
    pub tokenizer_digest: u64,
}

impl HashScheme {
    /// The scheme of this build for a given block size and tokenizer digest.
    pub fn new(block_size: u32, tokenizer_digest: u64) -> Self {
        Self { block_size, hash_version: HASH_VERSION, tokenizer_digest }
    }

    /// One number that differs whenever any field differs; sent in every report and mixed into every root.
    pub fn fingerprint(&self) -> u64 {
        let mut buf = Vec::with_capacity(FINGERPRINT_DOMAIN.len() + 16);
        buf.extend_from_slice(FINGERPRINT_DOMAIN);
        buf.extend_from_slice(&self.block_size.to_le_bytes());
        buf.extend_from_slice(&self.hash_version.to_le_bytes());
        buf.extend_from_slice(&self.tokenizer_digest.to_le_bytes());
        xxh3_64(&buf)
    }

    /// Checks the block size is usable.
    pub fn validate(&self) -> Result<(), String> {
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(format!("block_size must be in 1..={MAX_BLOCK_SIZE}, got {}", self.block_size));
        }
        Ok(())
    }
}

/// One extra key mixed into a request's root hash. The tag keeps kinds apart.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ExtraKey {
    /// A tenant's `cache_salt`: tenants with different salts never share a block.
    CacheSalt(String),
    /// A LoRA adapter name: adapters change the KV, so they never share a block.
    LoraAdapter(String),
    /// Anything else that changes the KV (e.g. a multimodal input digest): a name and opaque bytes.
    Other { name: String, value: Vec<u8> },
    /// The tenant a salted request belongs to (`handoff::scope_id` of its name): a keyed caller's salt never
    /// reaches another tenant's blocks, nor an anonymous caller's.
    Tenant(String),
    /// A salt the tenant's API key forces: tagged apart from [`ExtraKey::CacheSalt`], so no salt a client sends
    /// (body or header) can key the same blocks.
    TenantSalt(String),
}

impl ExtraKey {
    fn tag(&self) -> u8 {
        match self {
            ExtraKey::CacheSalt(_) => 1,
            ExtraKey::LoraAdapter(_) => 2,
            ExtraKey::Other { .. } => 3,
            ExtraKey::Tenant(_) => 4,
            ExtraKey::TenantSalt(_) => 5,
        }
    }

    fn encode_into(&self, buf: &mut Vec<u8>) {
        fn field(buf: &mut Vec<u8>, bytes: &[u8]) {
            buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            buf.extend_from_slice(bytes);
        }
        buf.push(self.tag());
        match self {
            ExtraKey::CacheSalt(s)
            | ExtraKey::LoraAdapter(s)
            | ExtraKey::Tenant(s)
            | ExtraKey::TenantSalt(s) => field(buf, s.as_bytes()),
            ExtraKey::Other { name, value } => {
                // Both parts length-prefixed inside the outer length, so name/value boundaries cannot shift.
                let mut inner = Vec::with_capacity(8 + name.len() + value.len());
                field(&mut inner, name.as_bytes());
                field(&mut inner, value);
                field(buf, &inner);
            }
        }
    }
}

/// The set of extra keys of one request, kept in canonical (sorted, deduplicated) order so that the order in
/// which they were added never matters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtraKeys(Vec<ExtraKey>);

impl ExtraKeys {
    /// No extra keys.
    pub fn none() -> Self {
        Self::default()
    }

    /// Adds a key (builder style).
    pub fn with(mut self, key: ExtraKey) -> Self {
        self.push(key);
        self
    }

    /// Adds a key.
    pub fn push(&mut self, key: ExtraKey) {
        if let Err(pos) = self.0.binary_search(&key) {
            self.0.insert(pos, key);
        }
    }

    /// A request's keys from its optional tenant salt (the common case).
    pub fn from_salt(cache_salt: Option<&str>) -> Self {
        let mut keys = Self::none();
        if let Some(salt) = cache_salt {
            keys.push(ExtraKey::CacheSalt(salt.to_owned()));
        }
        keys
    }

    /// The keys, in canonical order.
    pub fn keys(&self) -> &[ExtraKey] {
        &self.0
    }

    /// The keys as bytes (what the root hash reads: each key's tag, then length-prefixed fields), for a peer that
    /// must key blocks exactly like this side (a KV transfer's prefill request).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        for key in &self.0 {
            key.encode_into(&mut buf);
        }
        buf
    }

    /// The keys of [`Self::to_bytes`]' output; `None` if `bytes` is not that (an unknown tag, a length past the
    /// end, text that is not UTF-8). Allocates at most `bytes.len()`.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        fn field<'a>(b: &mut &'a [u8]) -> Option<&'a [u8]> {
            let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
            let out = b.get(4..4usize.checked_add(len)?)?;
            *b = &b[4 + len..];
            Some(out)
        }
        let text = |v: &[u8]| String::from_utf8(v.to_vec()).ok();
        let mut keys = Self::none();
        let mut b = bytes;
        while let Some((&tag, rest)) = b.split_first() {
            b = rest;
            let v = field(&mut b)?;
            let key = match tag {
                1 => ExtraKey::CacheSalt(text(v)?),
                2 => ExtraKey::LoraAdapter(text(v)?),
                3 => {
                    let mut inner = v;
                    let name = text(field(&mut inner)?)?;
                    let value = field(&mut inner)?.to_vec();
                    if !inner.is_empty() {
                        return None;
                    }
                    ExtraKey::Other { name, value }
                }
                4 => ExtraKey::Tenant(text(v)?),
                5 => ExtraKey::TenantSalt(text(v)?),
                _ => return None,
            };
            keys.push(key);
        }
        // Canonical order only: anything else would hash differently on the two sides.
        (keys.to_bytes() == bytes).then_some(keys)
    }
}

fn root_input(fingerprint: u64, extra: &ExtraKeys) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64);
    buf.extend_from_slice(ROOT_DOMAIN);
    buf.extend_from_slice(&fingerprint.to_le_bytes());
    for key in extra.keys() {
        key.encode_into(&mut buf);
    }
    buf
}

/// The hash that the first block chains from, for one scheme and one set of extra keys.
pub fn root_hash(fingerprint: u64, extra: &ExtraKeys) -> BlockHash {
    BlockHash(xxh3_64(&root_input(fingerprint, extra)))
}

/// Seed of [`root_identity`]: a second digest of the root input, independent of [`root_hash`].
const ROOT_IDENTITY_SEED: u64 = 0x6B76_6761_7465_5249; // "kvgateRI"

/// A second, independent 64-bit digest of the same root input as [`root_hash`]. The worker's prefix cache stores it
/// with every first block and compares it on a hit, so two roots whose 64-bit hashes collide (two tenants' salts)
/// still do not share a block: a false match needs both digests of two distinct root inputs to collide (about
/// 2^-128). Not on the wire.
pub fn root_identity(fingerprint: u64, extra: &ExtraKeys) -> u64 {
    xxh3_64_with_seed(&root_input(fingerprint, extra), ROOT_IDENTITY_SEED)
}

/// Tokens a block may have for [`chain_hash`] to hash it in one shot from a stack buffer (larger blocks stream).
const ONE_SHOT_TOKENS: usize = 126;

/// The hash of one block given its parent's hash (the root for the first block): xxh3-64 (seed 0) of the parent's
/// hash and the tokens, little-endian, as one byte run. Blocks up to [`ONE_SHOT_TOKENS`] hash that run in one
/// call (xxh3's one-shot and streaming forms give the same digest of the same bytes; the streaming state's set-up
/// was a third of a 32K-token prompt's hashing); larger ones stream it.
#[inline]
pub fn chain_hash(parent: BlockHash, block_tokens: &[u32]) -> BlockHash {
    let mut buf = [0u8; 8 + 4 * ONE_SHOT_TOKENS];
    buf[..8].copy_from_slice(&parent.0.to_le_bytes());
    if block_tokens.len() <= ONE_SHOT_TOKENS {
        for (i, t) in block_tokens.iter().enumerate() {
            buf[8 + i * 4..12 + i * 4].copy_from_slice(&t.to_le_bytes());
        }
        return BlockHash(xxh3_64(&buf[..8 + 4 * block_tokens.len()]));
    }
    let mut h = Xxh3::new();
    h.update(&buf[..8]);
    for chunk in block_tokens.chunks(ONE_SHOT_TOKENS) {
        for (i, t) in chunk.iter().enumerate() {
            buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    BlockHash(h.digest())
}

/// Hashes a token sequence block by block; the pure function both sides call.
///
/// The hash function is a parameter so that tests can force collisions (`BlockHasher::with_fn`).
#[derive(Clone, Copy)]
pub struct BlockHasher {
    block_size: usize,
    root: BlockHash,
    root_id: u64,
    chain: fn(BlockHash, &[u32]) -> BlockHash,
}

impl std::fmt::Debug for BlockHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockHasher").field("block_size", &self.block_size).field("root", &self.root).finish()
    }
}

impl BlockHasher {
    /// A hasher for one request: its scheme and its extra keys.
    pub fn new(scheme: &HashScheme, extra: &ExtraKeys) -> Self {
        Self::with_fn(scheme, extra, chain_hash)
    }

    /// Same, with another chain function (tests inject colliding ones).
    pub fn with_fn(
        scheme: &HashScheme,
        extra: &ExtraKeys,
        chain: fn(BlockHash, &[u32]) -> BlockHash,
    ) -> Self {
        let input = root_input(scheme.fingerprint(), extra);
        Self {
            block_size: scheme.block_size.max(1) as usize,
            root: BlockHash(xxh3_64(&input)),
            root_id: xxh3_64_with_seed(&input, ROOT_IDENTITY_SEED),
            chain,
        }
    }

    /// Same as [`Self::with_fn`], with a given root (tests force two roots to collide).
    pub fn with_root(mut self, root: BlockHash) -> Self {
        self.root = root;
        self
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The parent of the first block.
    pub fn root(&self) -> BlockHash {
        self.root
    }

    /// The second digest of the root ([`root_identity`]).
    pub fn root_id(&self) -> u64 {
        self.root_id
    }

    /// The hash of the block that follows `parent` (`None`: the first block).
    #[inline]
    pub fn next(&self, parent: Option<BlockHash>, block_tokens: &[u32]) -> BlockHash {
        (self.chain)(parent.unwrap_or(self.root), block_tokens)
    }

    /// Hashes of every full block of `tokens`; a trailing partial block is not hashed.
    pub fn hash_blocks(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        self.extend_hashes(&mut out, tokens);
        out
    }

    /// Appends the hashes of the full blocks of `tokens`, which continue the blocks already hashed in `hashes`
    /// (`tokens` must start at a block boundary: token `hashes.len() * block_size` of the sequence).
    pub fn extend_hashes(&self, hashes: &mut Vec<BlockHash>, tokens: &[u32]) {
        let mut parent = hashes.last().copied();
        for block in tokens.chunks_exact(self.block_size) {
            let h = self.next(parent, block);
            hashes.push(h);
            parent = Some(h);
        }
    }
}

#[cfg(test)]
#[path = "hashing_tests.rs"]
mod tests;
