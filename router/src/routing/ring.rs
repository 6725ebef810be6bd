//! The consistent-hash ring over worker ids (hashring crate, virtual nodes). A session key's primary is the first
//! healthy worker clockwise, its backup the next distinct healthy one: when a worker dies its keys fall to their
//! backups and no other key moves. Positions depend only on worker ids (SipHash with fixed keys), so every gateway
//! replica computes the same ring.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use hashring::HashRing;

/// Virtual nodes per worker.
pub const DEFAULT_VNODES: u32 = 64;

#[derive(Clone, Debug)]
struct VNode {
    id: Arc<str>,
    vnode: u32,
}

impl Hash for VNode {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.id.hash(state);
        self.vnode.hash(state);
    }
}

/// The ring of worker ids.
#[derive(Clone)]
pub struct Ring {
    ring: HashRing<VNode>,
    ids: Vec<Arc<str>>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("workers", &self.ids).finish()
    }
}

impl Ring {
    /// A ring over these worker ids (order does not matter).
    pub fn new<'a>(ids: impl IntoIterator<Item = &'a str>, vnodes: u32) -> Self {
        let mut ring = HashRing::new();
        let mut all = Vec::new();
        for id in ids {
            let id: Arc<str> = Arc::from(id);
            ring.batch_add((0..vnodes.max(1)).map(|v| VNode { id: id.clone(), vnode: v }).collect());
            all.push(id);
        }
        Self { ring, ids: all }
    }

    /// The worker ids on the ring.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.ids.iter().map(|s| &**s)
    }

    /// Primary and backup ids for `key` among the workers `healthy` accepts.
    pub fn primary_backup(
        &self,
        key: u64,
        healthy: impl Fn(&str) -> bool,
    ) -> (Option<Arc<str>>, Option<Arc<str>>) {
        let Some(walk) = self.ring.get_with_replicas(&key, self.ring.len()) else { return (None, None) };
        let mut primary: Option<Arc<str>> = None;
        for node in walk {
            if !healthy(&node.id) {
                continue;
            }
            match &primary {
                None => primary = Some(node.id.clone()),
                Some(p) if **p != *node.id => return (primary, Some(node.id.clone())),
                Some(_) => {}
            }
        }
        (primary, None)
    }
}
