//! What every handler shares: the server's state ([`AppState`]) and, once the model is loaded, the model it serves
//! ([`ServingModel`]).
//!
//! Invariants: `loaded` is set once, by `boot` when the assembled model's transfer listener is up, and never
//! cleared (a dead engine thread ends the process instead); `draining` only ever turns true. Every other module
//! of the server reads these and depends on this one; this one depends on none of them but `config` and
//! `engine_thread`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use kvgate_shared::hashing::HashScheme;
use kvgate_shared::prompt::Prompter;
use metrics_exporter_prometheus::PrometheusHandle;

use super::config::ServeConfig;
use super::engine_thread::EngineHandle;

/// Everything that exists once the model is loaded.
pub struct ServingModel {
    pub engine: EngineHandle,
    pub prompter: Arc<Prompter>,
    pub model_id: String,
    pub worker_id: String,
    pub max_model_len: usize,
    pub scheme: HashScheme,
    /// Where the engine computes: `cpu`, `cuda:0 (NVIDIA H200, sm_90, bfloat16)`, or `sim`.
    pub device: String,
    /// Its role and KV transfer listener, as reports say (the listener's address once it is bound).
    pub pd_info: kvgate_shared::report::PdInfo,
    /// What KV transfers need (`None`: this worker has no report secret, so it neither exports nor imports).
    pub transfer: Option<Arc<crate::transfer::Transfers>>,
    /// The LoRA adapters it holds (`--lora`, then runtime loads), by the name a request's `model` gives.
    pub adapters: Arc<super::adapters::AdapterStore>,
}

impl ServingModel {
    /// What a request's `model` names: the base model (`None`) or one of its adapters, its weights read again
    /// first if they were unloaded past `--max-loras` (as vLLM does for a registered adapter); else 404.
    pub async fn resolve(
        &self,
        model: &str,
    ) -> Result<Option<Arc<crate::model::lora::LoraAdapter>>, super::errors::ApiError> {
        use super::adapters::Lookup;
        match self.adapters.lookup(model)? {
            Lookup::Base => Ok(None),
            Lookup::Resident(a) => Ok(Some(a)),
            Lookup::Unloaded => {
                let (store, name) = (self.adapters.clone(), model.to_owned());
                let done = tokio::task::spawn_blocking(move || store.reload(&name))
                    .await
                    .map_err(|e| super::errors::ApiError::internal(format!("adapter reload: {e}")))?;
                let loaded = done.map_err(|e| e.api())?;
                metrics::counter!("kvgate_worker_lora_loads_total", "outcome" => "reloaded").increment(1);
                if loaded.evicted.is_some() {
                    metrics::counter!("kvgate_worker_lora_evictions_total").increment(1);
                }
                Ok(Some(loaded.adapter))
            }
        }
    }
}

/// Exit status of a worker whose engine thread died (EX_SOFTWARE).
pub const EXIT_ENGINE_DEAD: i32 = 70;

/// Shared by every handler.
pub struct AppState {
    pub cfg: ServeConfig,
    pub worker_id: String,
    pub(super) loaded: OnceLock<Arc<ServingModel>>,
    pub(super) draining: Arc<AtomicBool>,
    /// Wakes the reporter for an immediate report (draining started).
    pub(super) report_now: Arc<tokio::sync::Notify>,
    /// Notified by the reporter once a report saying `draining` has been delivered (or has failed) everywhere.
    pub(super) draining_reported: Arc<tokio::sync::Notify>,
    pub(super) prometheus: PrometheusHandle,
    pub(super) created: u64,
    /// Request spans to an OTLP collector (`--otlp-endpoint`; off without one).
    pub tracer: kvgate_shared::trace::Tracer,
}

impl AppState {
    pub fn loaded(&self) -> Option<Arc<ServingModel>> {
        self.loaded.get().cloned()
    }
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
    /// Whether the engine thread is dead (false while the model loads).
    pub fn engine_dead(&self) -> bool {
        self.loaded.get().is_some_and(|l| !l.engine.is_alive())
    }
}
