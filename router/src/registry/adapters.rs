//! Which LoRA adapters each worker holds, as far as this gateway knows: what a kvgate worker's latest report names
//! (`WorkerReport::lora`), what a pod's own `/v1/models` lists (adapters are the cards with a `parent`), and the
//! loads this gateway made since (believed for [`LOADED_BELIEF`], time for a report or a scrape to list them). Also
//! what loads cost on each worker, measured (a moving average of the load calls' latency), and the loads that failed
//! there (not tried again on it for [`FAILED_LOAD_BACKOFF`]).
//!
//! Invariants: `Registry::adapter_names` holds every name of every worker's lists (rebuilt when workers come or
//! go or a list changes; a load adds its name), so a request naming no adapter costs one hash lookup, not a scan;
//! a worker's lists are bounded (`MAX_REPORT_ADAPTERS` from a report or a scrape; its own loads are
//! bounded by [`MAX_BELIEVED`]); an adapter's key is whatever the last holder said (`name@digest`), or the name
//! alone for a pod whose events carry only the name.

use std::time::{Duration, Instant};

use kvgate_shared::report::{HeldAdapter, LoraInfo, MAX_REPORT_ADAPTERS};

use super::{Registry, WorkerRef};

/// How long a load this gateway made is believed without a report or a scrape listing it.
pub const LOADED_BELIEF: Duration = Duration::from_secs(5);
/// How long a worker is not asked again to load an adapter it failed to load.
pub const FAILED_LOAD_BACKOFF: Duration = Duration::from_secs(30);
/// Most loads (made or failed) remembered per worker.
pub const MAX_BELIEVED: usize = 64;

/// One worker's adapters.
#[derive(Clone, Debug, Default)]
pub struct WorkerAdapters {
    /// How many it may hold (`None`: unknown, a pod that does not say).
    pub slots: Option<u16>,
    /// What its latest report or scrape lists, most recently used first where it says.
    pub held: Vec<HeldAdapter>,
    /// Loads this gateway made: (name, key if the worker said it, when).
    loaded: Vec<(String, Option<String>, Instant)>,
    /// Loads that failed here: (name, when).
    failed: Vec<(String, Instant)>,
    /// Seconds a load takes here (moving average of the measured ones; `None`: none measured).
    pub load_s: Option<f64>,
}

impl WorkerAdapters {
    /// Whether it holds `name` now (listed, or loaded by this gateway within [`LOADED_BELIEF`]).
    pub fn holds(&self, name: &str, now: Instant) -> bool {
        self.held.iter().any(|h| h.name == name)
            || self
                .loaded
                .iter()
                .any(|(n, _, at)| n == name && now.saturating_duration_since(*at) < LOADED_BELIEF)
    }

    /// How many it holds now (listed, plus believed loads not listed yet).
    pub fn count(&self, now: Instant) -> usize {
        let pending = self
            .loaded
            .iter()
            .filter(|(n, _, at)| {
                now.saturating_duration_since(*at) < LOADED_BELIEF && !self.held.iter().any(|h| h.name == *n)
            })
            .count();
        self.held.len() + pending
    }

    /// Whether every slot it has is taken (a load there unloads another adapter); `false` when its slots are
    /// unknown.
    pub fn full(&self, now: Instant) -> bool {
        self.slots.is_some_and(|s| self.count(now) >= usize::from(s))
    }

    /// Whether it may be asked to load `name` now: it takes adapters (slots unknown or above 0) and did not fail
    /// to load this one within [`FAILED_LOAD_BACKOFF`].
    pub fn may_load(&self, name: &str, now: Instant) -> bool {
        self.slots != Some(0)
            && !self
                .failed
                .iter()
                .any(|(n, at)| n == name && now.saturating_duration_since(*at) < FAILED_LOAD_BACKOFF)
    }

    /// The key `name`'s blocks are hashed under here, if it said.
    fn key(&self, name: &str) -> Option<&str> {
        self.held
            .iter()
            .find(|h| h.name == name)
            .map(|h| h.key.as_str())
            .or_else(|| self.loaded.iter().rev().find(|(n, ..)| n == name).and_then(|(_, k, _)| k.as_deref()))
    }

    /// Takes a report's or a scrape's list (keeps at most `MAX_REPORT_ADAPTERS`).
    pub fn set(&mut self, info: &LoraInfo) {
        self.slots = Some(info.slots);
        self.held = info.held.iter().take(MAX_REPORT_ADAPTERS).cloned().collect();
    }

    fn remember<T>(list: &mut Vec<T>, item: T) {
        if list.len() >= MAX_BELIEVED {
            list.remove(0);
        }
        list.push(item);
    }
}

impl Registry {
    /// Rebuilds the set of adapter names held or loaded anywhere (when workers come or go, or a list changes).
    pub(super) fn rebuild_adapter_names(&mut self) {
        self.adapter_names = self
            .workers
            .iter()
            .flat_map(|w| {
                w.lora.held.iter().map(|h| h.name.clone()).chain(w.lora.loaded.iter().map(|l| l.0.clone()))
            })
            .collect();
    }

    /// The key `name`'s blocks are hashed under (`ExtraKey::LoraAdapter`): the one its holders report (the
    /// first worker, in registry order, that says), else `None`.
    pub fn adapter_key(&self, name: &str) -> Option<String> {
        if !self.adapter_names.contains(name) {
            return None;
        }
        self.workers.iter().find_map(|w| w.lora.key(name)).map(str::to_owned)
    }

    /// The base model of adapter `name`: the model of a healthy worker holding it.
    pub fn adapter_base(&self, name: &str, now: Instant) -> Option<String> {
        if !self.adapter_names.contains(name) {
            return None;
        }
        self.workers
            .iter()
            .filter(|w| w.lora.holds(name, now) && self.healthy(w, now))
            .find_map(|w| w.model.clone())
    }

    /// (adapter, base model) of every adapter some healthy worker holds, sorted.
    pub fn adapters(&self, now: Instant) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .workers
            .iter()
            .filter(|w| self.healthy(w, now))
            .flat_map(|w| {
                let model = w.model.clone().unwrap_or_default();
                w.lora.held.iter().map(move |h| (h.name.clone(), model.clone()))
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Takes the adapters a pod without reports lists (its `/v1/models` cards with a parent) and its slots if it
    /// says (`None`: keep what is known); `false` if no such worker, or it reports.
    pub fn set_pod_adapters(&mut self, url: &str, names: &[String], slots: Option<u16>) -> bool {
        let url = url.trim_end_matches('/');
        let Some(w) = self.workers.iter_mut().find(|w| w.url == url && w.report.is_none()) else {
            return false;
        };
        // A pod keys its blocks by the adapter's name alone (vLLM's events carry no digest).
        let held: Vec<HeldAdapter> = names
            .iter()
            .take(MAX_REPORT_ADAPTERS)
            .map(|n| HeldAdapter { name: n.clone(), key: n.clone() })
            .collect();
        let changed = w.lora.held != held;
        w.lora.held = held;
        if slots.is_some() {
            w.lora.slots = slots;
        }
        if changed {
            self.rebuild_adapter_names();
        }
        true
    }

    /// Records a load of `name` on worker `r` that this gateway made: `Ok(key)` (the key, if the worker said) with
    /// its measured seconds, or a failure.
    pub fn record_adapter_load(
        &mut self,
        r: WorkerRef,
        name: &str,
        outcome: Result<Option<String>, ()>,
        seconds: f64,
        now: Instant,
    ) {
        let Some(w) = self.find_mut(r) else { return };
        match outcome {
            Ok(key) => {
                let s = seconds.max(0.0);
                w.lora.load_s = Some(w.lora.load_s.map_or(s, |m| 0.7 * m + 0.3 * s));
                w.lora.loaded.retain(|(n, ..)| n != name);
                WorkerAdapters::remember(&mut w.lora.loaded, (name.to_owned(), key, now));
                self.adapter_names.insert(name.to_owned());
            }
            Err(()) => WorkerAdapters::remember(&mut w.lora.failed, (name.to_owned(), now)),
        }
    }

    /// The measured load seconds across the fleet (mean of the workers that measured one), if any.
    pub fn fleet_load_s(&self) -> Option<f64> {
        let m: Vec<f64> = self.workers.iter().filter_map(|w| w.lora.load_s).collect();
        (!m.is_empty()).then(|| m.iter().sum::<f64>() / m.len() as f64)
    }
}
