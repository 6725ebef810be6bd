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
fn colliding_prefixes_with_the_same_last_block_are_not_reused() {
    // A chain function that ignores the parent: two prefixes that end with the same block collide at that block.
    fn last_block_only(_: BlockHash, t: &[u32]) -> BlockHash {
        BlockHash(t.iter().fold(7u64, |a, x| a.wrapping_mul(31).wrapping_add(u64::from(*x))))
    }
    let h = BlockHasher::with_fn(&HashScheme::new(BS as u32, 1), &ExtraKeys::none(), last_block_only);
    let kv = KvManager::new(16, BS);
    // Tenant A: blocks [1,1,1,1] [5,6,7,8]; tenant B: [2,2,2,2] [5,6,7,8]. Their second blocks share a hash.
    let a: Vec<u32> = [1, 1, 1, 1, 5, 6, 7, 8, 0].to_vec();
    let b: Vec<u32> = [2, 2, 2, 2, 5, 6, 7, 8, 0].to_vec();
    drop(run(&kv, h, &a));
    // B's first block misses (other tokens), so the walk stops there; were it to reach block 2 it would need the
    // parent to be B's block, not A's.
    assert_eq!(kv.start(h, &b).cached_tokens(), 0);
    let mut pool = kv.pool().lock();
    let hashes = h.hash_blocks(&b);
    assert!(
        !pool.contains(hashes[1], Parent::Block(999), &b[4..8]),
        "the parent is checked, not only tokens"
    );
    let a_hashes = h.hash_blocks(&a);
    let (first, uid) =
        pool.lookup(a_hashes[0], Parent::Root(h.root_id()), &a[0..4]).expect("A's first block");
    assert!(pool.contains(a_hashes[1], Parent::Block(uid), &a[4..8]));
    pool.release(&[first]);
    drop(pool);
    // B runs: its second block cannot be cached under the hash A holds, and neither can anything after it.
    drop(run(&kv, h, &b));
    assert!(kv.pool().lock().counters().collisions >= 1);
    assert_eq!(kv.start(h, &a).cached_tokens(), 8, "A still hits its own chain");
    assert_eq!(kv.start(h, &b).cached_tokens(), 4, "B hits its first block only");
    kv.pool().lock().check_invariants().expect("invariants");
}

#[test]
fn colliding_roots_do_not_share_blocks() {
    // Two tenants whose 64-bit roots collide (forced): the second digest of the root still tells them apart.
    let scheme = HashScheme::new(BS as u32, 1);
    let s1 = BlockHasher::new(&scheme, &ExtraKeys::from_salt(Some("tenant-a")));
    let s2 = BlockHasher::new(&scheme, &ExtraKeys::from_salt(Some("tenant-b"))).with_root(s1.root());
    let toks: Vec<u32> = (0..9).collect();
    assert_eq!(s1.hash_blocks(&toks), s2.hash_blocks(&toks), "every block hash collides");
    let kv = KvManager::new(16, BS);
    drop(run(&kv, s1, &toks));
    assert_eq!(kv.start(s2, &toks).cached_tokens(), 0, "another root's KV is never served");
    assert_eq!(kv.start(s1, &toks).cached_tokens(), 8);
}

#[test]
fn duplicate_computation_keeps_later_blocks_reachable() {
    // Two sequences compute the same prefix at once (neither found it cached); the second's blocks are duplicates,
    // and what it adds after the shared part must still chain from the cached copy.
    let kv = KvManager::new(32, BS);
    let p: Vec<u32> = (0..8).collect();
    let a_tokens: Vec<u32> = p.iter().copied().chain(100..104).collect();
    let b_tokens: Vec<u32> = p.iter().copied().chain(200..205).collect();
    let mut a = kv.start(hasher(), &a_tokens);
    let mut b = kv.start(hasher(), &b_tokens);
    assert!(kv.reserve(&mut a, a_tokens.len()) && kv.reserve(&mut b, b_tokens.len()));
    kv.commit(&mut a, &a_tokens, a_tokens.len());
    kv.commit(&mut b, &b_tokens, b_tokens.len());
    drop((a, b));
    let again = kv.start(hasher(), &b_tokens);
    assert_eq!(again.cached_tokens(), 12, "B's third block chains from A's cached copy of the prefix");
    kv.pool().lock().check_invariants().expect("invariants");
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

#[test]
fn a_duplicate_prefill_keeps_its_chain_when_the_other_copy_is_evicted() {
    // Two requests prefill the same 8-token prefix at once: both miss, both compute it, the first to commit caches it.
    let kv = KvManager::new(16, BS);
    let prefix: Vec<u32> = (0..8).collect();
    let a: Vec<u32> = prefix.iter().copied().chain(100..105).collect();
    let b: Vec<u32> = prefix.iter().copied().chain(200..205).collect();
    let mut ta = kv.start(hasher(), &a);
    let mut tb = kv.start(hasher(), &b);
    assert_eq!((ta.cached_tokens(), tb.cached_tokens()), (0, 0));
    assert!(kv.reserve(&mut ta, a.len()) && kv.reserve(&mut tb, b.len()));
    kv.commit(&mut ta, &a, a.len());
    kv.commit(&mut tb, &b, b.len());
    // A finishes; B decodes on (its next block is completed and cached) while a flood evicts all that is free.
    drop(ta);
    let mut b2 = b.clone();
    b2.extend(300..303);
    assert!(kv.reserve(&mut tb, b2.len()));
    kv.commit(&mut tb, &b2, b2.len());
    {
        let mut pool = kv.pool().lock();
        let n = pool.num_free();
        let flood = pool.allocate(n).expect("free blocks");
        pool.release(&flood);
        pool.check_invariants().expect("invariants");
    }
    drop(tb);
    // B's next turn finds its whole history: the shared prefix it computed and the blocks after it.
    let mut next = b2.clone();
    next.extend(400..410);
    let t = kv.start(hasher(), &next);
    assert_eq!(t.cached_tokens(), 16, "the conversation's 4 full blocks hit");
    kv.pool().lock().check_invariants().expect("invariants");
}
