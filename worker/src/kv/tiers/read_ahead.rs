//! The SSD tier's read channel in time: when the blocks read ahead for queued requests will be in memory, and how
//! long a read that was not read ahead waits behind them. Load-vs-recompute ([`super::costs`]) weighs a disk block
//! by this wait (a block read ahead while its request queued costs nothing more), and a simulated engine's step
//! pays it. Pure: the caller passes the time (the engine's clock, virtual in the simulator).
//!
//! ```text
//! read ahead n blocks at t:  in order, ready(b) = max(t, busy) + block_s; busy = the last ready
//! wait(b) at t:              read ahead: max(0, ready(b) - t)
//!                            not read ahead: max(t, busy) - t + k * block_s  (the run's k-th such block, k from 1:
//!                            read in order after the backlog)
//! ```
//! At most `cap` blocks are tracked (what the read-ahead memory holds, `disk::MAX_PREFETCH_BYTES`); the oldest go
//! first, as in the tier's own read-ahead cache.

use std::collections::{HashMap, VecDeque};

use kvgate_shared::hashing::BlockHash;

/// The read channel's schedule.
#[derive(Debug, Default)]
pub struct ReadAhead {
    busy_until: f64,
    ready: HashMap<BlockHash, f64>,
    /// Read-ahead order (may hold hashes already taken; they are skipped when popped).
    order: VecDeque<BlockHash>,
}

impl ReadAhead {
    /// Schedules reads of `hashes` (those not read ahead already), keeping at most `cap` blocks.
    pub fn prefetch(&mut self, hashes: &[BlockHash], now: f64, block_s: f64, cap: usize) {
        for h in hashes {
            if self.ready.contains_key(h) {
                continue;
            }
            if cap == 0 {
                return;
            }
            while self.ready.len() >= cap || self.order.len() >= 2 * cap {
                match self.order.pop_front() {
                    Some(old) => {
                        self.ready.remove(&old);
                    }
                    None => break,
                }
            }
            self.busy_until = self.busy_until.max(now) + block_s;
            self.ready.insert(*h, self.busy_until);
            self.order.push_back(*h);
        }
    }

    /// Seconds from `now` until each block of a run is in memory (read ahead, or read in order after the backlog).
    pub fn waits(&self, hashes: &[BlockHash], now: f64, block_s: f64) -> Vec<f64> {
        let mut next = self.busy_until.max(now);
        hashes
            .iter()
            .map(|h| match self.ready.get(h) {
                Some(r) => (r - now).max(0.0),
                None => {
                    next += block_s;
                    next - now
                }
            })
            .collect()
    }

    /// Takes blocks loaded now: those not read ahead are read at once, behind the backlog. Returns the longest wait.
    pub fn take(&mut self, hashes: &[BlockHash], now: f64, block_s: f64) -> f64 {
        let mut wait = 0.0f64;
        for h in hashes {
            let w = match self.ready.remove(h) {
                Some(r) => (r - now).max(0.0),
                None => {
                    self.busy_until = self.busy_until.max(now) + block_s;
                    self.busy_until - now
                }
            };
            wait = wait.max(w);
        }
        wait
    }

    /// Blocks tracked as read ahead (tests).
    pub fn len(&self) -> usize {
        self.ready.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ready.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u64) -> BlockHash {
        BlockHash(i)
    }

    #[test]
    fn a_block_read_ahead_is_free_once_its_read_is_done_and_others_wait_behind_the_backlog() {
        let mut r = ReadAhead::default();
        r.prefetch(&[h(1), h(2), h(3)], 10.0, 1.0, 100);
        // Read in order from t = 10: ready at 11, 12, 13.
        assert_eq!(r.waits(&[h(1), h(2), h(3)], 10.0, 1.0), vec![1.0, 2.0, 3.0]);
        assert_eq!(r.waits(&[h(1), h(2), h(3)], 12.5, 1.0), vec![0.0, 0.0, 0.5]);
        // Blocks not read ahead queue behind the backlog (busy until 13).
        assert_eq!(r.waits(&[h(3), h(4), h(5)], 12.0, 1.0), vec![1.0, 2.0, 3.0]);
        // Taking them: the longest wait; the two new reads extend the backlog.
        assert_eq!(r.take(&[h(1), h(2), h(3), h(4), h(5)], 12.0, 1.0), 3.0);
        assert!(r.is_empty());
        assert_eq!(r.waits(&[h(6)], 12.0, 1.0), vec![4.0]);
        // An idle channel starts at now.
        assert_eq!(r.waits(&[h(6)], 100.0, 1.0), vec![1.0]);
        // Asking twice for a block schedules it once.
        r.prefetch(&[h(7), h(7)], 100.0, 1.0, 100);
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn the_read_ahead_keeps_at_most_cap_blocks_dropping_the_oldest() {
        let mut r = ReadAhead::default();
        let hashes: Vec<BlockHash> = (0..50).map(h).collect();
        for chunk in hashes.chunks(5) {
            r.prefetch(chunk, 0.0, 0.001, 8);
            r.take(&chunk[..1], 0.0, 0.001);
        }
        assert!(r.len() <= 8, "{}", r.len());
        assert!(r.order.len() <= 16);
        // The newest are kept; the oldest are not read ahead any more.
        assert!(r.ready.contains_key(&h(49)));
        assert!(!r.ready.contains_key(&h(1)));
        r.prefetch(&hashes, 0.0, 0.001, 0);
        assert!(r.len() <= 8);
    }
}
