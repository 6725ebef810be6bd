//! The Bloom filter of cached block hashes that a worker sends in its report, built on the `bloomfilter` crate.
//!
//! Two things the crate leaves open are fixed here so both sides agree bit for bit and untrusted bytes are safe:
//! - items are hashed as their 8 little-endian bytes (`Hasher::write`), never with `write_u64`'s native order;
//! - the SipHash seed is a constant of the protocol (it travels in the filter's header anyway);
//! - decoding checks the header before the crate sees it: a zero-length bitmap would divide by zero and a huge
//!   hash-function count would turn every lookup into a denial of service.

use std::hash::{Hash, Hasher};

use bloomfilter::Bloom;

use crate::hashing::BlockHash;

/// Seed of the two SipHash keys of every filter this build makes.
pub const BLOOM_SEED: [u8; 32] = *b"kvgate/bloom-seed/v1:0123456789a";
/// Most hash functions a received filter may ask for (the optimum for a 1e-9 false-positive rate is 30).
pub const MAX_BLOOM_HASH_FUNCTIONS: u32 = 32;
/// Largest bitmap a received filter may carry (enough for ~27M entries at 1% false positives).
pub const MAX_BLOOM_BYTES: usize = 32 << 20;
/// Header bytes the crate puts before the bitmap: version (1), bitmap length (8), hash functions (4), seed (32).
pub const BLOOM_HEADER_BYTES: usize = 1 + 8 + 4 + 32;
const BLOOM_FORMAT_VERSION: u8 = 1;

/// A block hash as the filter sees it: platform-independent bytes.
#[derive(Clone)]
struct BloomKey(u64);

impl Hash for BloomKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(&self.0.to_le_bytes());
    }
}

/// A Bloom filter of block hashes.
#[derive(Clone)]
pub struct BlockBloom {
    inner: Bloom<BloomKey>,
}

impl std::fmt::Debug for BlockBloom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockBloom")
            .field("bits", &self.inner.len())
            .field("hash_functions", &self.inner.number_of_hash_functions())
            .finish()
    }
}

impl PartialEq for BlockBloom {
    fn eq(&self, other: &Self) -> bool {
        self.inner.as_slice() == other.inner.as_slice()
    }
}

impl BlockBloom {
    /// A filter sized for `expected_items` at false-positive rate `fp_rate` (clamped to [1e-9, 0.5]; at least one
    /// item and one byte, so the crate's assertions can never fire).
    pub fn with_capacity(expected_items: usize, fp_rate: f64) -> Self {
        let items = expected_items.max(1);
        let fp = if fp_rate.is_finite() { fp_rate.clamp(1e-9, 0.5) } else { 0.01 };
        let bytes = Bloom::<BloomKey>::compute_bitmap_size(items, fp).clamp(1, MAX_BLOOM_BYTES);
        let inner = match Bloom::new_with_seed(bytes, items, &BLOOM_SEED) {
            Ok(b) => b,
            // Unreachable with the clamps above; fall back to the smallest valid filter rather than panic.
            Err(_) => Self::smallest(),
        };
        Self { inner }
    }

    fn smallest() -> Bloom<BloomKey> {
        let mut bytes = vec![0u8; BLOOM_HEADER_BYTES + 1];
        bytes[0] = BLOOM_FORMAT_VERSION;
        bytes[1..9].copy_from_slice(&1u64.to_le_bytes());
        bytes[9..13].copy_from_slice(&1u32.to_le_bytes());
        bytes[13..45].copy_from_slice(&BLOOM_SEED);
        Bloom::from_bytes(bytes).unwrap_or_else(|_| unreachable!("hand-built minimal filter is valid"))
    }

    /// Adds a block hash.
    pub fn insert(&mut self, hash: BlockHash) {
        self.inner.set(&BloomKey(hash.0));
    }

    /// Whether the hash may be present (false positives at the configured rate, no false negatives).
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.inner.check(&BloomKey(hash.0))
    }

    /// The wire form: the crate's header followed by the bitmap.
    pub fn as_bytes(&self) -> &[u8] {
        self.inner.as_slice()
    }

    /// Size of the wire form.
    pub fn byte_len(&self) -> usize {
        self.inner.as_slice().len()
    }

    /// Number of hash functions.
    pub fn hash_functions(&self) -> u32 {
        self.inner.number_of_hash_functions()
    }

    /// Parses and validates an untrusted wire form.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() <= BLOOM_HEADER_BYTES {
            return Err(format!("bloom filter of {} bytes has no bitmap", bytes.len()));
        }
        if bytes[0] != BLOOM_FORMAT_VERSION {
            return Err(format!(
                "bloom filter format version {} (expected {BLOOM_FORMAT_VERSION})",
                bytes[0]
            ));
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[1..9]);
        let bitmap_len = u64::from_le_bytes(len);
        let actual = (bytes.len() - BLOOM_HEADER_BYTES) as u64;
        if bitmap_len != actual {
            return Err(format!("bloom filter says {bitmap_len} bitmap bytes but carries {actual}"));
        }
        if actual as usize > MAX_BLOOM_BYTES {
            return Err(format!(
                "bloom filter bitmap of {actual} bytes is over the limit of {MAX_BLOOM_BYTES}"
            ));
        }
        let mut k = [0u8; 4];
        k.copy_from_slice(&bytes[9..13]);
        let k = u32::from_le_bytes(k);
        if k == 0 || k > MAX_BLOOM_HASH_FUNCTIONS {
            return Err(format!("bloom filter asks for {k} hash functions (1..={MAX_BLOOM_HASH_FUNCTIONS})"));
        }
        let inner = Bloom::from_slice(bytes).map_err(|e| format!("bloom filter: {e}"))?;
        Ok(Self { inner })
    }
}
