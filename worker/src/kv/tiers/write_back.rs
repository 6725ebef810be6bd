//! The tiers' one write entry point: blocks whose device memory still holds their K/V (evicted by the pool before
//! the forward overwrites them, or, write-through, completed by this step) go down to the host tier, or to the SSD
//! tier without one (write-through: to both); what the host tier lets go for room goes on to the SSD tier. Parents
//! before children; a block a tier holds already is not read again (only marked used). SSD writes are queued for
//! its IO thread, never waited for. The bytes are read by the caller's closure (the backend) with no lock held.

use std::collections::HashSet;
use std::sync::Arc;

use super::{HostInsert, SharedHost, Tiers};
use crate::kv::pool::{BlockId, Evicted};
use crate::kv::SharedPool;

/// Reads the K/V bytes of device blocks (`Backend::read_kv_blocks`).
pub type ReadBlocks<'a> = dyn FnMut(&[BlockId]) -> Result<Vec<Vec<u8>>, String> + 'a;

impl Tiers {
    /// Copies `blocks` down (`through`: write-through's completed blocks, which go to the SSD tier too).
    pub fn write_back(
        &self,
        pool: &SharedPool,
        mut blocks: Vec<Evicted>,
        through: bool,
        read: &mut ReadBlocks<'_>,
    ) {
        let (host, disk) = (self.host.as_ref(), self.disk.as_ref());
        if blocks.is_empty() || (host.is_none() && disk.is_none()) {
            return;
        }
        blocks.sort_by_key(|e| e.index);
        let to_host = |e: &Evicted| host.is_some_and(|h| !h.lock().contains(e.hash));
        let to_disk =
            |e: &Evicted| disk.is_some_and(|d| (through || host.is_none()) && !d.index().contains(e.hash));
        let mut work: Vec<(Evicted, bool, bool)> = Vec::with_capacity(blocks.len());
        for e in blocks {
            let (h, d) = (to_host(&e), to_disk(&e));
            if h || d {
                work.push((e, h, d));
            } else if let Some(host) = host {
                // Held already (a copy kept at promotion; its device memory may not even be written yet).
                host.lock().refresh(e.hash);
            }
        }
        let ids: Vec<BlockId> = work.iter().map(|(e, ..)| e.id).collect();
        let payloads = if ids.is_empty() { Ok(Vec::new()) } else { read(&ids) };
        let pool = pool.lock();
        let mut host = host.map(SharedHost::lock);
        let payloads = match payloads {
            Ok(p) => p,
            Err(err) => {
                tracing::error!(error = %err, blocks = work.len(), "copying KV blocks to a lower tier failed");
                if let Some(host) = host.as_mut() {
                    for (e, ..) in &work {
                        host.drop_descendants(e.hash);
                    }
                }
                return;
            }
        };
        // Blocks of this batch go to disk parents first: a child's parent among them counts as held above.
        let to_disk_now: HashSet<_> = work.iter().filter(|w| w.2).map(|w| w.0.hash).collect();
        for ((e, h, d), payload) in work.into_iter().zip(payloads) {
            let on_device = e.parent_hash.is_some_and(|p| pool.is_cached(p));
            let b = HostInsert {
                hash: e.hash,
                check: e.check,
                index: e.index,
                tokens: e.tokens,
                payload: Arc::<[u8]>::from(payload),
                parent: e.parent_hash,
            };
            if let (true, Some(disk)) = (d, disk) {
                let in_host = host.as_ref().is_some_and(|hh| e.parent_hash.is_some_and(|p| hh.contains(p)));
                let in_batch = e.parent_hash.is_some_and(|p| to_disk_now.contains(&p));
                disk.write(b.clone(), on_device || in_host || in_batch);
            }
            if let (true, Some(host)) = (h, host.as_mut()) {
                host.insert(b, on_device);
            }
        }
        if let (Some(host), Some(disk)) = (host.as_mut(), disk) {
            // Parents first: the IO thread stores them before their children, which then find them on disk.
            let mut spilled = host.take_spilled();
            spilled.sort_by_key(|b| b.index);
            let batch: HashSet<_> = spilled.iter().map(|b| b.hash).collect();
            for b in spilled {
                let above =
                    b.parent.is_some_and(|p| pool.is_cached(p) || host.contains(p) || batch.contains(&p));
                disk.write(b, above);
            }
        }
    }
}
