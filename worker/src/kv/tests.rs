//! Block pool and prefix-cache behaviour.

use super::*;
use kvgate_shared::hashing::{ExtraKeys, HashScheme};

const BS: usize = 4;

fn hasher() -> BlockHasher {
    BlockHasher::new(&HashScheme::new(BS as u32, 1), &ExtraKeys::none())
}

/// Runs a sequence over `tokens` to completion: start, reserve, commit everything.
fn run(kv: &KvManager, h: BlockHasher, tokens: &[u32]) -> BlockTable {
    let mut t = kv.start(h, tokens);
    assert!(kv.reserve(&mut t, tokens.len()));
    kv.commit(&mut t, tokens, tokens.len());
    t
}

#[test]
fn finished_prefix_is_reused_and_tokens_counted() {
    let kv = KvManager::new(16, BS);
    let a: Vec<u32> = (0..13).collect();
    drop(run(&kv, hasher(), &a));
    assert_eq!(kv.pool().lock().num_free(), 16);
    assert_eq!(kv.pool().lock().num_cached(), 3);
    // Same first 8 tokens, different rest.
    let b: Vec<u32> = (0..8).chain(100..110).collect();
    let t = kv.start(hasher(), &b);
    assert_eq!(t.cached_tokens(), 8);
    assert_eq!(t.blocks().len(), 2);
    kv.pool().lock().check_invariants().expect("invariants");
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_block() {
    let kv = KvManager::new(16, BS);
    let a: Vec<u32> = (0..12).collect();
    drop(run(&kv, hasher(), &a));
    let t = kv.start(hasher(), &a);
    assert_eq!(t.cached_tokens(), 8, "the last of 3 full blocks is recomputed so logits exist");
}

#[test]
fn first_block_differs_nothing_reused() {
    let kv = KvManager::new(16, BS);
    let a: Vec<u32> = (0..16).collect();
    drop(run(&kv, hasher(), &a));
    let mut b = a.clone();
    b[0] = 999;
    assert_eq!(kv.start(hasher(), &b).cached_tokens(), 0);
}

#[test]
fn forced_hash_collision_is_not_reused() {
    fn collide(_: BlockHash, _: &[u32]) -> BlockHash {
        BlockHash(42)
    }
    let h = BlockHasher::with_fn(&HashScheme::new(BS as u32, 1), &ExtraKeys::none(), collide);
    let kv = KvManager::new(16, BS);
    drop(run(&kv, h, &[1, 2, 3, 4, 5]));
    let t = kv.start(h, &[9, 9, 9, 9, 5]);
    assert_eq!(t.cached_tokens(), 0);
    assert_eq!(kv.pool().lock().counters().collisions, 1);
    // The identical request still hits.
    drop(t);
    assert_eq!(kv.start(h, &[1, 2, 3, 4, 5]).cached_tokens(), 4);
}

#[test]
fn salts_isolate() {
    let kv = KvManager::new(16, BS);
    let s1 = BlockHasher::new(&HashScheme::new(BS as u32, 1), &ExtraKeys::from_salt(Some("a")));
    let s2 = BlockHasher::new(&HashScheme::new(BS as u32, 1), &ExtraKeys::from_salt(Some("b")));
    let toks: Vec<u32> = (0..9).collect();
    drop(run(&kv, s1, &toks));
    assert_eq!(kv.start(s2, &toks).cached_tokens(), 0);
    assert_eq!(kv.start(s1, &toks).cached_tokens(), 8);
}

#[test]
fn eviction_is_lru_and_tail_first() {
    let kv = KvManager::new(4, BS);
    let a: Vec<u32> = (0..9).collect(); // 3 blocks, 2 full + 1 partial (uncached)
    drop(run(&kv, hasher(), &a));
    // One new block: the uncached partial block is reused first, nothing evicted.
    let mut t = kv.start(hasher(), &[50, 51]);
    assert!(kv.reserve(&mut t, 2));
    assert_eq!(kv.pool().lock().counters().evictions, 0);
    // Two more: the never-used block, then the tail of what a cached (its second full block), not its head.
    let mut u = kv.start(hasher(), &[60]);
    assert!(kv.reserve(&mut u, 2 * BS));
    assert_eq!(kv.pool().lock().counters().evictions, 1);
    drop((t, u));
    let again = kv.start(hasher(), &a);
    assert_eq!(again.cached_tokens(), 4, "a's first block survived, its second was evicted");
}

#[test]
fn reserve_fails_cleanly_when_full() {
    let kv = KvManager::new(2, BS);
    let mut t = kv.start(hasher(), &[1; 12]);
    assert!(!kv.reserve(&mut t, 12));
    assert_eq!(t.blocks().len(), 0);
    assert_eq!(kv.pool().lock().num_free(), 2);
    assert!(kv.reserve(&mut t, 8));
    assert_eq!(kv.pool().lock().num_free(), 0);
    drop(t);
    assert_eq!(kv.pool().lock().num_free(), 2);
}

#[test]
fn shared_blocks_are_referenced_twice_and_survive_one_release() {
    let kv = KvManager::new(8, BS);
    let p: Vec<u32> = (0..9).collect();
    let a = run(&kv, hasher(), &p);
    let b = kv.start(hasher(), &p);
    assert_eq!(b.cached_tokens(), 8);
    let shared = b.blocks()[0];
    assert_eq!(kv.pool().lock().ref_count(shared), 2);
    drop(a);
    assert_eq!(kv.pool().lock().ref_count(shared), 1);
    drop(b);
    let pool = kv.pool().lock();
    assert_eq!(pool.ref_count(shared), 0);
    pool.check_invariants().expect("invariants");
}
