//! The gateway's LoRA adapter catalogue (`--lora NAME=PATH`) and what a request's adapter is ([`AdapterRef`]):
//! plain data and the one-load-at-a-time locks, read by the prepare stage and the placement stage (`adapters.rs`).
//!
//! Invariants: the lock map holds catalogue names only (a client cannot grow it); a name outside the catalogue gets
//! a fresh lock that no one else shares (nothing to load for it anyway).

use std::collections::HashMap;
use std::sync::Arc;

use kvgate_router::placement::PlaceConfig;

/// An adapter a request names: its name, its base model and the key its blocks are hashed under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterRef {
    pub name: String,
    pub base: String,
    /// `name@digest` as its holders report it; the name alone before any holder said (a pod keyed by name, or
    /// an adapter not loaded yet: no block is cached under it then).
    pub key: String,
}

/// The `--lora` catalogue and the one-load-at-a-time locks.
pub struct AdapterLoads {
    paths: HashMap<String, String>,
    locks: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
    /// Placement's knobs.
    pub place: PlaceConfig,
}

impl AdapterLoads {
    /// The catalogue of `(name, path)` entries.
    pub fn new(catalogue: &[(String, String)]) -> Self {
        let paths: HashMap<String, String> = catalogue.iter().cloned().collect();
        let locks = paths.keys().map(|n| (n.clone(), Arc::default())).collect();
        Self { paths, locks, place: PlaceConfig::default() }
    }

    /// The path pods load `name` from, when the catalogue has it.
    pub fn path(&self, name: &str) -> Option<&str> {
        self.paths.get(name).map(String::as_str)
    }

    /// The lock that keeps `name`'s loads one at a time.
    pub fn lock_for(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks.get(name).cloned().unwrap_or_default()
    }

    /// The catalogue's names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut n: Vec<String> = self.paths.keys().cloned().collect();
        n.sort();
        n
    }
}
