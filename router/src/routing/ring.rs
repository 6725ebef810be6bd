//! The consistent-hash ring over worker ids: virtual nodes in a sorted array, walked clockwise from a session key
//! only until the workers asked for are found. A session key's primary is the first accepted worker clockwise, its
//! backup the next distinct accepted one: when a worker dies its keys fall to their backups and no other key moves.
//!
//! Positions depend only on worker ids (SipHash-2-4 with zero keys over the id and the virtual node's number, the
//! positions of the `hashring` crate this replaced, so replicas of either version agree), so every gateway replica
//! computes the same ring. A worker is named by its **slot**: its place in the id list the ring was built from (the
//! registry builds it from its workers in order, so a slot is a registry index).
//!
//! Cost: building sorts `workers x vnodes` positions; a lookup is a binary search plus the nodes walked, which is
//! about `vnodes` per distinct worker visited (not the whole ring).

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use siphasher::sip::SipHasher;

/// Virtual nodes per worker.
pub const DEFAULT_VNODES: u32 = 64;

/// A virtual node's identity, hashed for its position.
struct VNode<'a> {
    id: &'a str,
    vnode: u32,
}

impl Hash for VNode<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.id.hash(state);
        self.vnode.hash(state);
    }
}

fn position<T: Hash + ?Sized>(t: &T) -> u64 {
    let mut h = SipHasher::new();
    t.hash(&mut h);
    h.finish()
}

/// The ring of worker ids.
#[derive(Clone)]
pub struct Ring {
    /// (position, slot), sorted by position (ties in slot order).
    nodes: Vec<(u64, u32)>,
    /// Each slot's positions (for [`Ring::first_among`]).
    by_slot: Vec<Vec<u64>>,
    ids: Vec<Arc<str>>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("workers", &self.ids).finish()
    }
}

impl Ring {
    /// A ring over these worker ids (order does not matter for positions; it gives the slots).
    pub fn new<'a>(ids: impl IntoIterator<Item = &'a str>, vnodes: u32) -> Self {
        let ids: Vec<Arc<str>> = ids.into_iter().map(Arc::from).collect();
        let mut nodes = Vec::with_capacity(ids.len() * vnodes.max(1) as usize);
        let mut by_slot = Vec::with_capacity(ids.len());
        for (slot, id) in ids.iter().enumerate() {
            let at: Vec<u64> = (0..vnodes.max(1)).map(|vnode| position(&VNode { id, vnode })).collect();
            nodes.extend(at.iter().map(|p| (*p, slot as u32)));
            by_slot.push(at);
        }
        nodes.sort_by_key(|n| n.0);
        Self { nodes, by_slot, ids }
    }

    /// The worker ids on the ring, in slot order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.ids.iter().map(|s| &**s)
    }

    /// Workers on the ring.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The id in `slot`.
    pub fn id(&self, slot: usize) -> Option<&Arc<str>> {
        self.ids.get(slot)
    }

    /// Slots clockwise from `key`'s position, one per virtual node (a worker recurs).
    fn walk(&self, key: u64) -> impl Iterator<Item = usize> + '_ {
        let k = position(&key);
        let start = self.nodes.partition_point(|n| n.0 < k);
        self.nodes[start..].iter().chain(&self.nodes[..start]).map(|n| n.1 as usize)
    }

    /// Primary and backup slots for `key` among the slots `accept` takes. The walk stops at the backup; a worker's
    /// later virtual nodes are skipped without asking `accept` again.
    pub fn primary_backup_slots(
        &self,
        key: u64,
        mut accept: impl FnMut(usize) -> bool,
    ) -> (Option<usize>, Option<usize>) {
        let mut primary = None;
        // Slots refused so far, as bits.
        let mut refused = vec![0u64; self.ids.len().div_ceil(64)];
        let mut n_refused = 0;
        for slot in self.walk(key) {
            let (word, bit) = (slot / 64, 1u64 << (slot % 64));
            if primary == Some(slot) || refused[word] & bit != 0 {
                continue;
            }
            if !accept(slot) {
                refused[word] |= bit;
                n_refused += 1;
                // Every worker has been asked: no (other) one is accepted.
                if n_refused + usize::from(primary.is_some()) == self.ids.len() {
                    break;
                }
                continue;
            }
            match primary {
                None => primary = Some(slot),
                Some(_) => return (primary, Some(slot)),
            }
        }
        (primary, None)
    }

    /// Of `slots`, the first clockwise from `key`: what [`Ring::first_slot`] returns when `accept` takes exactly
    /// these, found from their own positions (`vnodes` a slot) instead of walking the ring to them. Slots not on
    /// the ring are ignored.
    pub fn first_among(&self, key: u64, slots: impl IntoIterator<Item = usize>) -> Option<usize> {
        let k = position(&key);
        // Clockwise distance orders positions as the walk visits them (those at or past `k` first, then the
        // wrapped ones); equal positions are visited in slot order.
        slots
            .into_iter()
            .filter_map(|s| Some((self.by_slot.get(s)?.iter().map(|p| p.wrapping_sub(k)).min()?, s)))
            .min()
            .map(|(_, s)| s)
    }

    /// The first slot clockwise from `key` among `holders` (`count` of them; `accept` takes exactly these): by their
    /// own positions when they are few (`count`² x 24 <= workers: a walk to one of them visits about
    /// workers / count nodes, the positions cost 64 a holder), else by the walk. The same answer either way.
    pub fn first_held(
        &self,
        key: u64,
        count: usize,
        holders: impl IntoIterator<Item = usize>,
        accept: impl FnMut(usize) -> bool,
    ) -> Option<usize> {
        match count {
            0 => None,
            c if c.saturating_mul(c).saturating_mul(24) <= self.len() => self.first_among(key, holders),
            _ => self.first_slot(key, accept),
        }
    }

    /// The first slot clockwise from `key` that `accept` takes (each worker asked once).
    pub fn first_slot(&self, key: u64, mut accept: impl FnMut(usize) -> bool) -> Option<usize> {
        let mut asked = vec![0u64; self.ids.len().div_ceil(64)];
        for slot in self.walk(key) {
            let (word, bit) = (slot / 64, 1u64 << (slot % 64));
            if asked[word] & bit == 0 {
                asked[word] |= bit;
                if accept(slot) {
                    return Some(slot);
                }
            }
        }
        None
    }

    /// Primary and backup ids for `key` among the workers `healthy` accepts.
    pub fn primary_backup(
        &self,
        key: u64,
        healthy: impl Fn(&str) -> bool,
    ) -> (Option<Arc<str>>, Option<Arc<str>>) {
        let (p, b) = self.primary_backup_slots(key, |s| healthy(&self.ids[s]));
        (p.map(|s| self.ids[s].clone()), b.map(|s| self.ids[s].clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The positions and walk of the `hashring` crate (0.3.6) that this replaced, so that replicas of the two
    /// versions put every key on the same worker.
    #[test]
    fn positions_and_walks_are_the_hashring_crates() {
        #[derive(Clone, Debug)]
        struct Old {
            id: Arc<str>,
            vnode: u32,
        }
        impl Hash for Old {
            fn hash<H: Hasher>(&self, state: &mut H) {
                self.id.hash(state);
                self.vnode.hash(state);
            }
        }
        let ids: Vec<String> = (0..12).map(|i| format!("http://10.1.{i}.7:8000")).collect();
        let mut old = hashring::HashRing::new();
        for id in &ids {
            old.batch_add(
                (0..DEFAULT_VNODES).map(|v| Old { id: Arc::from(id.as_str()), vnode: v }).collect(),
            );
        }
        let ring = Ring::new(ids.iter().map(String::as_str), DEFAULT_VNODES);
        for k in 0..2_000u64 {
            let key = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            // It walks one node past the whole ring (the first again).
            let walk = old.get_with_replicas(&key, old.len()).expect("ring");
            let mine: Vec<&str> = ring.walk(key).map(|s| &*ring.ids[s]).collect();
            assert_eq!(walk.len(), mine.len() + 1);
            assert!(
                walk.iter().take(mine.len()).map(|n| &*n.id).eq(mine.iter().copied()),
                "key {key}: the walks differ"
            );
        }
    }

    #[test]
    fn a_walk_asks_about_each_worker_once_and_stops_at_the_backup() {
        let ids: Vec<String> = (0..100).map(|i| format!("w{i}")).collect();
        let ring = Ring::new(ids.iter().map(String::as_str), DEFAULT_VNODES);
        let asked = std::cell::RefCell::new(Vec::new());
        let (p, b) = ring.primary_backup_slots(7, |s| {
            asked.borrow_mut().push(s);
            s % 3 == 0
        });
        let asked = asked.into_inner();
        let mut dedup = asked.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), asked.len(), "no worker asked twice");
        assert!(p.is_some_and(|p| p % 3 == 0) && b.is_some_and(|b| b % 3 == 0 && Some(b) != p));
        assert_eq!(asked.last().copied(), b, "the walk ends at the backup");
        // Nobody accepted: every worker asked once, then the walk ends.
        let n = std::cell::Cell::new(0);
        assert_eq!(
            ring.primary_backup_slots(7, |_| {
                n.set(n.get() + 1);
                false
            }),
            (None, None)
        );
        assert_eq!(n.get(), 100);
    }

    #[test]
    fn the_first_among_a_few_slots_is_the_first_a_walk_would_find() {
        // Including duplicate ids (equal positions, visited in slot order), a slot past the ring and no slot.
        let mut ids: Vec<String> = (0..40).map(|i| format!("http://10.2.{i}.9:8000")).collect();
        ids.push(ids[3].clone());
        let ring = Ring::new(ids.iter().map(String::as_str), DEFAULT_VNODES);
        for k in 0..3_000u64 {
            let key = k.wrapping_mul(0xD6E8_FEB8_6659_FD93);
            let set: Vec<usize> =
                (0..ids.len()).filter(|s| (s * 7 + k as usize) % 11 < 1 + (k % 3) as usize).collect();
            let walked = ring.first_slot(key, |s| set.contains(&s));
            let found = ring.first_among(key, set.iter().copied().chain([ids.len() + 5]));
            assert_eq!(found, walked, "key {key}, slots {set:?}");
            // Whichever lookup the count picks (41 workers: positions for one holder, the walk for two or more).
            let held = ring.first_held(key, set.len(), set.iter().copied(), |s| set.contains(&s));
            assert_eq!(held, walked, "key {key}, slots {set:?}");
        }
        assert_eq!(ring.first_among(1, []), None);
        assert_eq!(ring.first_among(1, [3, 40]), ring.first_slot(1, |s| s == 3 || s == 40));
    }
}
