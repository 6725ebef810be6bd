//! Golden vectors and properties of the block-hash scheme.

use super::*;
use proptest::prelude::*;

fn scheme() -> HashScheme {
    HashScheme::new(16, 0x0123_4567_89ab_cdef)
}

fn tokens(n: u32) -> Vec<u32> {
    (0..n).map(|i| i.wrapping_mul(2_654_435_761) % 128_256).collect()
}

#[test]
fn xxh3_is_the_reference_xxh3() {
    // Published XXH3_64bits test values (seed 0): the empty input, and "a".
    assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2);
    assert_eq!(xxh3_64(b"a"), 0xE6C6_32B6_1E96_4E1F);
}

#[test]
fn golden_fingerprint_and_root() {
    let s = scheme();
    assert_eq!(s.fingerprint(), GOLDEN_FINGERPRINT, "fingerprint changed: that is a new hash version");
    assert_eq!(root_hash(s.fingerprint(), &ExtraKeys::none()).0, GOLDEN_ROOT);
    assert_eq!(root_hash(s.fingerprint(), &ExtraKeys::from_salt(Some("tenant-a"))).0, GOLDEN_ROOT_SALTED);
}

#[test]
fn golden_block_hashes() {
    let hasher = BlockHasher::new(&scheme(), &ExtraKeys::none());
    let got: Vec<u64> = hasher.hash_blocks(&tokens(50)).into_iter().map(|h| h.0).collect();
    assert_eq!(got, GOLDEN_BLOCKS.to_vec(), "block hashes changed: that is a new hash version");
    let salted = BlockHasher::new(&scheme(), &ExtraKeys::from_salt(Some("tenant-a")));
    assert_eq!(salted.hash_blocks(&tokens(16))[0].0, GOLDEN_SALTED_FIRST_BLOCK);
}

// Computed from the scheme as documented in hashing.rs by an independent implementation (Python's `xxhash`
// package, struct.pack("<...")), not by this crate: they pin the spec, not just the code.
const GOLDEN_FINGERPRINT: u64 = 0xa060_bc9f_6a32_5d63;
const GOLDEN_ROOT: u64 = 0x56b2_67e7_aa38_d9b0;
const GOLDEN_ROOT_SALTED: u64 = 0x66f9_70ed_4c35_87ef;
const GOLDEN_BLOCKS: [u64; 3] = [0xd91e_e55d_95f3_139b, 0x6f8a_b74b_23ff_990f, 0xe450_a257_7f2e_b7dd];
const GOLDEN_SALTED_FIRST_BLOCK: u64 = 0x2689_67e7_e12d_9046;

#[test]
fn only_full_blocks_are_hashed() {
    let hasher = BlockHasher::new(&scheme(), &ExtraKeys::none());
    assert_eq!(hasher.hash_blocks(&tokens(15)).len(), 0);
    assert_eq!(hasher.hash_blocks(&tokens(16)).len(), 1);
    assert_eq!(hasher.hash_blocks(&tokens(47)).len(), 2);
}

#[test]
fn salt_and_adapter_with_same_text_differ() {
    let fp = scheme().fingerprint();
    let salt = root_hash(fp, &ExtraKeys::none().with(ExtraKey::CacheSalt("x".into())));
    let lora = root_hash(fp, &ExtraKeys::none().with(ExtraKey::LoraAdapter("x".into())));
    assert_ne!(salt, lora);
    assert_ne!(salt, root_hash(fp, &ExtraKeys::none()));
    // Length prefixes: ("ab","c") vs ("a","bc") as Other name/value must differ.
    let a =
        root_hash(fp, &ExtraKeys::none().with(ExtraKey::Other { name: "ab".into(), value: b"c".to_vec() }));
    let b =
        root_hash(fp, &ExtraKeys::none().with(ExtraKey::Other { name: "a".into(), value: b"bc".to_vec() }));
    assert_ne!(a, b);
}

#[test]
fn tenant_keys_are_encoded_as_written_and_apart_from_client_salts() {
    // The root input written out by hand: domain, fingerprint, then (tag, u32 length, bytes) in canonical order
    // (CacheSalt 1 < Tenant 4 < TenantSalt 5).
    let fp = scheme().fingerprint();
    let by_hand = |keys: &[(u8, &str)]| {
        let mut b = b"kvgate/block-hash/v1".to_vec();
        b.extend_from_slice(&fp.to_le_bytes());
        for (tag, v) in keys {
            b.push(*tag);
            b.extend_from_slice(&(v.len() as u32).to_le_bytes());
            b.extend_from_slice(v.as_bytes());
        }
        BlockHash(xxh3_64(&b))
    };
    let forced = ExtraKeys::none().with(ExtraKey::TenantSalt("s".into())).with(ExtraKey::Tenant("t".into()));
    assert_eq!(root_hash(fp, &forced), by_hand(&[(4, "t"), (5, "s")]));
    let scoped = ExtraKeys::none().with(ExtraKey::Tenant("t".into())).with(ExtraKey::CacheSalt("s".into()));
    assert_eq!(root_hash(fp, &scoped), by_hand(&[(1, "s"), (4, "t")]));
    let plain = ExtraKeys::from_salt(Some("s"));
    assert_eq!(root_hash(fp, &plain), by_hand(&[(1, "s")]));
    assert_ne!(root_hash(fp, &forced), root_hash(fp, &scoped));
    assert_ne!(
        root_hash(fp, &ExtraKeys::none().with(ExtraKey::TenantSalt("s".into()))),
        root_hash(fp, &plain)
    );
}

#[test]
fn extra_key_order_does_not_matter() {
    let fp = scheme().fingerprint();
    let ab = ExtraKeys::none().with(ExtraKey::CacheSalt("t".into())).with(ExtraKey::LoraAdapter("l".into()));
    let ba = ExtraKeys::none().with(ExtraKey::LoraAdapter("l".into())).with(ExtraKey::CacheSalt("t".into()));
    assert_eq!(root_hash(fp, &ab), root_hash(fp, &ba));
}

#[test]
fn scheme_fields_all_change_the_fingerprint() {
    let base = scheme();
    let mut other = base;
    other.block_size = 32;
    assert_ne!(base.fingerprint(), other.fingerprint());
    other = base;
    other.hash_version += 1;
    assert_ne!(base.fingerprint(), other.fingerprint());
    other = base;
    other.tokenizer_digest ^= 1;
    assert_ne!(base.fingerprint(), other.fingerprint());
}

#[test]
fn extend_hashes_continues_a_chain() {
    let hasher = BlockHasher::new(&scheme(), &ExtraKeys::none());
    let all = tokens(64);
    let mut incremental = hasher.hash_blocks(&all[..32]);
    hasher.extend_hashes(&mut incremental, &all[32..]);
    assert_eq!(incremental, hasher.hash_blocks(&all));
}

#[test]
fn injected_chain_function_is_used() {
    fn constant(_: BlockHash, _: &[u32]) -> BlockHash {
        BlockHash(7)
    }
    let hasher = BlockHasher::with_fn(&scheme(), &ExtraKeys::none(), constant);
    assert_eq!(hasher.hash_blocks(&tokens(32)), vec![BlockHash(7), BlockHash(7)]);
}

#[test]
fn validate_rejects_bad_block_sizes() {
    assert!(HashScheme::new(0, 1).validate().is_err());
    assert!(HashScheme::new(MAX_BLOCK_SIZE + 1, 1).validate().is_err());
    assert!(HashScheme::new(16, 1).validate().is_ok());
}

proptest! {
    #[test]
    fn prefix_hashes_to_prefix(seq in prop::collection::vec(0u32..200_000, 0..400), cut in 0usize..400) {
        let hasher = BlockHasher::new(&scheme(), &ExtraKeys::none());
        let cut = cut.min(seq.len());
        let full = hasher.hash_blocks(&seq);
        let prefix = hasher.hash_blocks(&seq[..cut]);
        prop_assert_eq!(&full[..prefix.len()], &prefix[..]);
    }

    #[test]
    fn differing_first_block_shares_no_later_hash(
        first_a in prop::collection::vec(0u32..50_000, 16),
        first_b in prop::collection::vec(0u32..50_000, 16),
        tail in prop::collection::vec(0u32..50_000, 16..160),
    ) {
        prop_assume!(first_a != first_b);
        let hasher = BlockHasher::new(&scheme(), &ExtraKeys::none());
        let a: Vec<u32> = first_a.iter().chain(&tail).copied().collect();
        let b: Vec<u32> = first_b.iter().chain(&tail).copied().collect();
        let ha = hasher.hash_blocks(&a);
        let hb = hasher.hash_blocks(&b);
        for x in &ha {
            prop_assert!(!hb.contains(x));
        }
    }

    #[test]
    fn different_salts_share_no_hash(
        seq in prop::collection::vec(0u32..50_000, 16..200),
        s1 in "[a-z0-9]{0,12}",
        s2 in "[a-z0-9]{0,12}",
    ) {
        prop_assume!(s1 != s2);
        let h1 = BlockHasher::new(&scheme(), &ExtraKeys::from_salt(Some(&s1))).hash_blocks(&seq);
        let h2 = BlockHasher::new(&scheme(), &ExtraKeys::from_salt(Some(&s2))).hash_blocks(&seq);
        for x in &h1 {
            prop_assert!(!h2.contains(x));
        }
    }
}

#[test]
fn extra_keys_travel_as_bytes_and_back() {
    let keys = ExtraKeys::none()
        .with(ExtraKey::TenantSalt("s".into()))
        .with(ExtraKey::Tenant("t".into()))
        .with(ExtraKey::Other { name: "img".into(), value: vec![1, 2, 3] })
        .with(ExtraKey::CacheSalt("c".into()));
    let b = keys.to_bytes();
    assert_eq!(ExtraKeys::from_bytes(&b), Some(keys.clone()));
    assert_eq!(ExtraKeys::from_bytes(&[]), Some(ExtraKeys::none()));
    // Truncated, an unknown tag, a length past the end, and a non-canonical order are all refused.
    assert_eq!(ExtraKeys::from_bytes(&b[..b.len() - 1]), None);
    assert_eq!(ExtraKeys::from_bytes(&[9, 0, 0, 0, 0]), None);
    assert_eq!(ExtraKeys::from_bytes(&[1, 255, 255, 255, 255]), None);
    let mut swapped = ExtraKey::TenantSalt("s".into()).encode_to_vec();
    swapped.extend(ExtraKey::CacheSalt("c".into()).encode_to_vec());
    assert_eq!(ExtraKeys::from_bytes(&swapped), None);
}

impl ExtraKey {
    fn encode_to_vec(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode_into(&mut v);
        v
    }
}

proptest! {
    #[test]
    fn extra_keys_from_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        if let Some(k) = ExtraKeys::from_bytes(&bytes) {
            prop_assert_eq!(k.to_bytes(), bytes);
        }
    }
}

#[test]
fn one_shot_and_streamed_blocks_hash_alike() {
    // chain_hash hashes small blocks in one call and streams large ones: both must be xxh3 of the same bytes.
    let streamed = |parent: BlockHash, toks: &[u32]| {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(&parent.0.to_le_bytes());
        for t in toks {
            h.update(&t.to_le_bytes());
        }
        BlockHash(h.digest())
    };
    let toks: Vec<u32> = (0..600u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    for n in [0, 1, 15, 16, 64, 125, 126, 127, 128, 252, 253, 600] {
        let parent = BlockHash(0x0123_4567_89ab_cdef ^ n as u64);
        assert_eq!(chain_hash(parent, &toks[..n]), streamed(parent, &toks[..n]), "block of {n} tokens");
    }
}
