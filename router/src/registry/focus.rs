//! The views of a large fleet: every worker's cheap state (health, load, conversations), and its cache (summaries,
//! overlay, event set) only where the decision needs it. Up to `RegistryConfig::full_scan_workers` workers of a
//! model every view has its cache; past it only the **focus** does:
//! - the holders of the request's root (`roots.rs`): the workers whose caches can earn prefix credit;
//! - the first `focus_ring` distinct workers on the request's ring walk (its primary and backup are among them);
//! - the `focus_least_loaded` least loaded healthy workers (where a request with no prefix goes);
//! - the workers that hold its conversation.
//!
//! The other views carry no summary and no overlay match: their prefix terms are 0, which is what they would be
//! for a worker without the root. So the work that grows with the fleet is a few numbers per worker; the Bloom
//! lookups, overlay walks and event-set lookups are bounded by the focus.

use std::time::{Duration, Instant};

use kvgate_shared::hashing::BlockHash;
use kvgate_shared::report::Tier;

use super::{roots, Registry};
use crate::routing::{Load, PrefixSignal, WorkerView};

/// Where a request's roots start, as block numbers: the policy's first credited block and the first block past a
/// credited shared prefix (either may be absent).
pub type RootStarts = [Option<usize>; 2];

impl Registry {
    /// [`Registry::views`], with the caches of the focus only when the model has more than `full_scan_workers`
    /// workers. `starts`: where the request's roots start (the policy's first credited block, and the first block
    /// past a credited shared prefix; `route.rs`).
    pub fn focused_views(
        &self,
        model: &str,
        hashes: &[BlockHash],
        session: u64,
        starts: RootStarts,
        now: Instant,
    ) -> (Vec<WorkerView<'_>>, Vec<usize>) {
        let of_model = |w: &super::Worker| w.model.as_deref().is_none_or(|m| m == model);
        let n = self.workers.iter().filter(|w| of_model(w)).count();
        if n <= self.cfg.full_scan_workers {
            return self.views(model, hashes, Some(session), now);
        }
        // Health, load and the report's age once per worker (None: another model's).
        let state: Vec<Option<(bool, Load, Option<Duration>)>> = self
            .workers
            .iter()
            .map(|w| {
                of_model(w).then(|| {
                    let age = w.report_age(now);
                    (self.healthy_aged(w, now, age), w.load(now), age)
                })
            })
            .collect();
        let focus = self.focus(hashes, session, starts, &state);
        let mut views = Vec::with_capacity(n);
        let mut registry_index = Vec::with_capacity(n);
        for (i, w) in self.workers.iter().enumerate() {
            let Some((healthy, load, age)) = state[i] else { continue };
            let holds_session = w.sessions.holds(session, now);
            let view = if focus[i] || holds_session {
                self.view_aged(i, w, hashes, Some(session), now, age)
            } else {
                WorkerView {
                    id: &w.id,
                    slot: i,
                    healthy,
                    summary: None,
                    host_summary: None,
                    disk_summary: None,
                    overlay_matched_blocks: 0,
                    prefix_signal: PrefixSignal::Overlay,
                    load,
                    sessions: w.sessions.active(),
                    holds_session,
                    speed: w.speed_aged(age.map_or(0.0, |a| a.as_secs_f64())),
                }
            };
            views.push(view);
            registry_index.push(i);
        }
        (views, registry_index)
    }

    /// Registry indices in the focus (see the module docs), as a mask; `state`: each worker's health and load.
    fn focus(
        &self,
        hashes: &[BlockHash],
        session: u64,
        starts: RootStarts,
        state: &[Option<(bool, Load, Option<Duration>)>],
    ) -> Vec<bool> {
        let mut focus = vec![false; self.workers.len()];
        for at in starts.iter().flatten().filter_map(|f| roots::root_block(*f, hashes.len())) {
            for uid in self.roots.holders(hashes[at]) {
                if let Some(&i) = self.by_uid.get(uid) {
                    focus[i] = true;
                }
            }
        }
        let mut on_ring = 0;
        self.ring.primary_backup_slots(session, |s| {
            if s < focus.len() && !focus[s] {
                focus[s] = true;
            }
            on_ring += 1;
            on_ring > self.cfg.focus_ring
        });
        let k = self.cfg.focus_least_loaded;
        let mut loads: Vec<(u64, usize)> = state
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Some((true, load, _)) => Some((load.cost(Load::DEFAULT_PER_REQUEST_TOKENS), i)),
                _ => None,
            })
            .collect();
        if loads.len() > k && k > 0 {
            loads.select_nth_unstable(k - 1);
            loads.truncate(k);
        }
        for (_, i) in loads {
            focus[i] = true;
        }
        focus
    }

    /// The full view of worker `i`, its report's age given (`Worker::report_age`: a decision reads it once a
    /// worker).
    pub(super) fn view_aged<'a>(
        &'a self,
        i: usize,
        w: &'a super::Worker,
        hashes: &[BlockHash],
        session: Option<u64>,
        now: Instant,
        age: Option<Duration>,
    ) -> WorkerView<'a> {
        let summary = self.summary_aged(w, Tier::Device, age);
        WorkerView {
            id: &w.id,
            slot: i,
            healthy: self.healthy_aged(w, now, age),
            summary,
            prefix_signal: match (&w.exact, &w.approx) {
                _ if summary.is_some() => PrefixSignal::Report,
                (Some(_), _) => PrefixSignal::Events,
                (None, Some(_)) => PrefixSignal::Approximate,
                (None, None) => PrefixSignal::Overlay,
            },
            host_summary: self.summary_aged(w, Tier::Host, age),
            disk_summary: self.summary_aged(w, Tier::Disk, age),
            overlay_matched_blocks: w.overlay.matched(hashes, now).max(match (&w.exact, &w.approx) {
                (Some(e), _) => hashes.iter().take_while(|h| e.contains(h)).count(),
                (None, Some(a)) => a.matched(hashes),
                (None, None) => 0,
            }),
            load: w.load(now),
            sessions: w.sessions.active(),
            holds_session: session.is_some_and(|k| w.sessions.holds(k, now)),
            speed: w.speed_aged(age.map_or(0.0, |a| a.as_secs_f64())),
        }
    }

    /// Enters worker `i` under the request's roots (a request was sent there); `starts` as in
    /// [`Registry::focused_views`].
    pub fn record_root(&mut self, i: usize, hashes: &[BlockHash], starts: RootStarts) {
        let Some(uid) = self.workers.get(i).map(|w| w.uid) else { return };
        for at in starts.iter().flatten().filter_map(|f| roots::root_block(*f, hashes.len())) {
            self.roots.add(hashes, at, uid);
        }
    }

    /// Roots remembered now.
    pub fn roots_len(&self) -> usize {
        self.roots.len()
    }
}

#[cfg(test)]
#[path = "focus_tests.rs"]
mod tests;
