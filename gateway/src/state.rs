//! The gateway's shared state: configuration, the worker registry, the tokenizer catalog (`tokenizers.rs`), the
//! routing and split policies, admission, the API key table, the tokenize pool, the HTTP client to workers, the
//! admin resources and their versions, and the metrics handle. Held whole only by `main` and `control/`; every other
//! room takes a narrow host trait this file implements (`serve::host::ServeHost`, `pods::PodsHost`, the replicas'
//! `SendsHost`, `BudgetsHost`, `SyncHost`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvgate_shared::hashing::{BlockHash, HashScheme};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::admission::Admission;
use crate::config::{GatewayConfig, ModelSpec, WorkerKind};
use crate::control::keys::KeyTable;
use crate::registry::{Registry, RegistryConfig, SharedSend};
use crate::replicas::sends::{SendSharer, SendsHost};
use crate::replicas::{RedisTarget, Resource, SharedState};
use crate::route::Router;
use crate::routing::{policy_by_name, RingKeys, Weights};
use crate::serve::host::{ModelTokenizer, ServeHost};
use crate::serve::learned::LearnedOutputs;
use crate::serve::tokenize::TokenizePool;
use crate::tokenizers::{FetchError, Tokenizers};

pub use crate::HttpClient;

/// Everything the proxy and the control listener share.
pub struct GatewayState {
    pub cfg: GatewayConfig,
    registry: Mutex<Registry>,
    /// How each model is tokenized and hashed (`tokenizers.rs`).
    pub tokenizers: Tokenizers,
    /// The routing policy behind the one `route()` (`kvgate_router::route`).
    pub router: Router,
    /// The prefill/decode split policy (`--split-policy`).
    pub split: Box<dyn kvgate_router::split::SplitPolicy>,
    /// Per class: the output length of its completed requests (configured class names only).
    pub learned_outputs: LearnedOutputs,
    /// The `--lora` catalogue and its loads (`serve/adapters.rs`).
    pub adapter_loads: crate::serve::lora_catalog::AdapterLoads,
    pub admission: Admission,
    pub keys: KeyTable,
    pub tokenize: TokenizePool,
    pub client: HttpClient,
    pub prometheus: PrometheusHandle,
    /// The ring-key chooser and its fan-out sketch (routing/ring_key.rs).
    ring_keys: Mutex<RingKeys>,
    /// Current weights and their version (the admin API's ETag).
    weights: RwLock<(Weights, u64)>,
    classes_version: AtomicU64,
    admin: Mutex<()>,
    /// What the replicas share through Redis (`replicas/`), and the mode.
    pub shared: SharedState,
    /// The replicas' shared sends (`--share-sends` with `--redis-url`; `replicas/sends.rs`).
    pub sends: Option<SendSharer>,
    /// Workers drained through the admin API, as shared through Redis, with the version (sorted ids).
    drains: RwLock<(Vec<String>, u64)>,
    /// Request spans to an OTLP collector (`--otlp-endpoint`; off without one).
    pub tracer: kvgate_shared::trace::Tracer,
}

/// Adds a pod of `m`'s pool as a static worker: one that is not a kvgate worker is identified at once (its id is
/// its URL) and gets its approximate index.
pub fn enroll(registry: &mut Registry, m: &ModelSpec, url: &str) {
    registry.add_static(url);
    if m.kind != WorkerKind::Kvgate {
        registry.identify(url, url.trim_end_matches('/'), &m.name, m.max_model_len.unwrap_or(0));
        if m.kv_tokens > 0 {
            registry.track_sends(url, m.kv_tokens.div_ceil(m.block_size as usize));
        }
    }
}

impl GatewayState {
    pub fn new(cfg: GatewayConfig, prometheus: PrometheusHandle) -> Result<Self, String> {
        let policy = policy_by_name(&cfg.policy, cfg.weights)
            .ok_or_else(|| format!("unknown policy {}", cfg.policy))?;
        let split = kvgate_router::split::split_policy_by_name(&cfg.split_policy)
            .ok_or_else(|| format!("unknown split policy {}", cfg.split_policy))?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(cfg.connect_timeout));
        connector.set_nodelay(true);
        let client =
            Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(connector);
        let mut registry = Registry::new(RegistryConfig {
            stale_after: cfg.stale_after,
            dead_after: cfg.dead_after,
            overlay_ttl: cfg.overlay_ttl,
            vnodes: cfg.vnodes,
            forget_after: cfg.forget_after,
            max_workers: cfg.max_workers,
            ..RegistryConfig::default()
        });
        let keys = match &cfg.api_keys_file {
            Some(path) => KeyTable::load(path)?,
            None => KeyTable::default(),
        };
        let tokenize = TokenizePool::new(cfg.tokenize_threads, cfg.tokenize_queue);
        for w in &cfg.workers {
            registry.add_static(w);
        }
        // Models tokenized here (`[[models]]`): their pools' pods that are not kvgate workers are identified at once.
        let tokenizers = Tokenizers::configured(&cfg)?;
        for m in &cfg.models {
            for w in &m.workers {
                enroll(&mut registry, m, w);
            }
        }
        // Admin changes persisted by an earlier run win over the configuration.
        let persisted = cfg.state_file.as_deref().and_then(crate::control::persist::load_or_set_aside);
        if let (Some(path), Some(p)) = (&cfg.state_file, &persisted) {
            tracing::warn!(
                "admin changes kept in {} override the configured weights and classes (versions {} and {})",
                path.display(),
                p.weights_version,
                p.classes_version
            );
        }
        let (weights, weights_version, classes, classes_version) = match persisted {
            Some(p) => (p.weights, p.weights_version, p.classes, p.classes_version),
            None => (cfg.weights, 1, cfg.classes.clone(), 1),
        };
        policy.set_weights(weights);
        let admission = Admission::new(classes);
        let target = cfg.redis_url.as_deref().map(|url| RedisTarget {
            url,
            prefix: &cfg.redis_prefix,
            username: cfg.redis_username.as_deref(),
            password: cfg.redis_password.as_deref(),
        });
        let shared = SharedState::new(target, cfg.replica_id.clone())?;
        let tracer = kvgate_shared::trace::Tracer::from_flags(
            cfg.otlp_endpoint.as_deref(),
            "kvgate-gateway",
            &cfg.replica_id,
            cfg.trace_sample_ratio,
        )
        .map_err(|e| e.to_string())?
        .trusting_upstream_sampling(cfg.trust_trace_sampling);
        let cfg_ring = (cfg.ring_sketch_entries, cfg.ring_hub_fanout);
        let cfg_share_sends = cfg.share_sends && cfg.redis_url.is_some();
        let cfg_classes = cfg.classes.len();
        let adapter_loads = crate::serve::lora_catalog::AdapterLoads::new(&cfg.lora);
        Ok(Self {
            adapter_loads,
            cfg,
            registry: Mutex::new(registry),
            tokenizers,
            router: Router::new(policy),
            split,
            admission,
            keys,
            tokenize,
            client,
            prometheus,
            ring_keys: Mutex::new(RingKeys::new(cfg_ring.0, cfg_ring.1)),
            learned_outputs: LearnedOutputs::new(cfg_classes),
            weights: RwLock::new((weights, weights_version)),
            classes_version: AtomicU64::new(classes_version),
            sends: (cfg_share_sends).then(SendSharer::new),
            shared,
            drains: RwLock::new((Vec::new(), 1)),
            tracer,
            admin: Mutex::new(()),
        })
    }

    /// The ring-key chooser (held briefly: one prompt's block chain).
    pub fn ring_keys(&self) -> MutexGuard<'_, RingKeys> {
        self.ring_keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serialises admin writes (check-version-then-write must not interleave).
    pub fn admin_lock(&self) -> MutexGuard<'_, ()> {
        self.admin.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn weights(&self) -> (Weights, u64) {
        *self.weights.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies new weights live; returns the new version.
    pub fn set_weights(&self, w: Weights) -> u64 {
        let mut g = self.weights.write().unwrap_or_else(|e| e.into_inner());
        self.router.policy().set_weights(w);
        g.0 = w;
        g.1 += 1;
        g.1
    }

    /// Applies weights at `version` if it is newer than the current one (from Redis); true when applied.
    pub fn apply_weights(&self, w: Weights, version: u64) -> bool {
        let mut g = self.weights.write().unwrap_or_else(|e| e.into_inner());
        if version <= g.1 {
            return false;
        }
        self.router.policy().set_weights(w);
        *g = (w, version);
        true
    }

    /// Applies a class set at `version` if it is newer than the current one (from Redis); true when applied.
    pub fn apply_classes(&self, classes: Vec<crate::admission::ClassConfig>, version: u64) -> bool {
        let _guard = self.admin_lock();
        if version <= self.classes_version.load(Ordering::Acquire) {
            return false;
        }
        self.admission.set_classes(classes);
        self.classes_version.store(version, Ordering::Release);
        true
    }

    /// A resource as the admin API shows it, with its version.
    pub fn resource_json(&self, r: Resource) -> (u64, String) {
        let text = |v: Result<String, serde_json::Error>| v.unwrap_or_else(|_| "null".into());
        match r {
            Resource::Weights => {
                let (w, v) = self.weights();
                (v, text(serde_json::to_string(&w)))
            }
            Resource::Budgets => {
                let (c, v) = self.classes();
                (v, text(serde_json::to_string(&c)))
            }
            Resource::Drains => {
                let (d, v) = self.drains();
                (v, text(serde_json::to_string(&d)))
            }
        }
    }

    /// The shared drain set and its version.
    pub fn drains(&self) -> (Vec<String>, u64) {
        self.drains.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Takes a drain set at `version` if it is newer (from Redis); true when taken. The registry follows at the
    /// next [`Self::apply_drains`].
    pub fn set_drains(&self, mut ids: Vec<String>, version: u64) -> bool {
        let mut g = self.drains.write().unwrap_or_else(|e| e.into_inner());
        if version <= g.1 {
            return false;
        }
        ids.sort();
        ids.dedup();
        *g = (ids, version);
        true
    }

    /// Marks exactly the workers of the shared drain set as drained by an operator (a worker that registers later
    /// is marked at the next call; the sync loop calls this every pass).
    pub fn apply_drains(&self) {
        let (ids, _) = self.drains();
        let mut reg = self.registry();
        let known: Vec<String> = reg.workers().iter().map(|w| w.id.clone()).collect();
        for id in known {
            let drained = ids.binary_search(&id).is_ok();
            reg.set_draining(&id, drained);
        }
    }

    /// Keeps the current admin state in the state file (with Redis, the replica's copy for a restart while Redis
    /// is down); a failure is logged, not fatal.
    pub fn save_local_copy(&self) {
        let Some(path) = &self.cfg.state_file else { return };
        let save = || crate::control::persist::save_state(path, &self.persisted());
        // fsync may take a while: off the (multi-threaded) control runtime's worker thread meanwhile.
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let saved = if multi_thread { tokio::task::block_in_place(save) } else { save() };
        if let Err(e) = saved {
            tracing::error!(error = %e, "cannot keep a local copy of the admin state");
        }
    }

    pub fn classes(&self) -> (Vec<crate::admission::ClassConfig>, u64) {
        (self.admission.classes(), self.classes_version.load(Ordering::Acquire))
    }

    /// Applies a new class set live; returns the new version.
    pub fn set_classes(&self, classes: Vec<crate::admission::ClassConfig>) -> u64 {
        self.admission.set_classes(classes);
        self.classes_version.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// What the state file keeps.
    pub fn persisted(&self) -> crate::control::persist::Persisted {
        let (weights, weights_version) = self.weights();
        let (classes, classes_version) = self.classes();
        crate::control::persist::Persisted { weights, weights_version, classes, classes_version }
    }

    /// Tells the other replicas of a send to worker `worker` (with `--share-sends` and Redis; never waits).
    pub fn share_send(&self, worker: &str, hashes: &[BlockHash], uncached_tokens: u64, session: u64) {
        if let Some(s) = &self.sends {
            s.share(SharedSend::new(worker, hashes, uncached_tokens, Some(session)));
        }
    }

    /// The registry (locks are short and never held across an await).
    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn tokenizer(&self, model: &str) -> Option<Arc<ModelTokenizer>> {
        self.tokenizers.get(model)
    }

    /// Fetches a worker's tokenizer (`Tokenizers::fetch`) and identifies the worker in the registry: its id, model
    /// and context length. A worker refused for its scheme loses its static entry.
    pub async fn fetch_tokenizer(&self, url: &str) -> Result<String, String> {
        match self.tokenizers.fetch(&self.client, &self.cfg, url).await {
            Ok(d) => {
                self.registry().identify(url, &d.worker_id, &d.model, d.max_model_len);
                Ok(d.model)
            }
            Err(FetchError::Refused(e)) => {
                self.registry().remove_static(url);
                Err(e)
            }
            Err(FetchError::Failed(e)) => Err(e),
        }
    }

    /// (healthy workers, healthy workers whose model's tokenizer is loaded here): the gateway is ready when the
    /// second is not 0 (`GET /ready`).
    pub fn readiness(&self) -> (usize, usize) {
        let statuses = self.registry().status(std::time::Instant::now());
        let healthy = statuses.iter().filter(|w| w.healthy).count();
        let serving = statuses
            .iter()
            .filter(|w| w.healthy && w.model.as_deref().is_some_and(|m| self.tokenizer(m).is_some()))
            .count();
        (healthy, serving)
    }

    /// Whether a worker was refused for a tokenizer or block size that differs from its model's `[[models]]` entry.
    pub fn is_refused(&self, url: &str) -> bool {
        self.tokenizers.is_refused(url)
    }

    /// Starts fetching a worker's tokenizer in the background unless one is under way.
    pub fn fetch_tokenizer_in_background(self: &Arc<Self>, url: String) {
        if !self.tokenizers.begin_fetch(&url) {
            return;
        }
        let state = self.clone();
        tokio::spawn(async move {
            if let Err(e) = state.fetch_tokenizer(&url).await {
                tracing::warn!(error = %e, "cannot fetch a worker's tokenizer");
            }
            state.tokenizers.end_fetch(&url);
        });
    }
}

impl SendsHost for GatewayState {
    fn shared(&self) -> &SharedState {
        &self.shared
    }
    fn sharer(&self) -> Option<&SendSharer> {
        self.sends.as_ref()
    }
    fn registry(&self) -> MutexGuard<'_, Registry> {
        GatewayState::registry(self)
    }
}

impl crate::replicas::budgets::BudgetsHost for GatewayState {
    fn shared(&self) -> &SharedState {
        &self.shared
    }
    fn admission(&self) -> &Admission {
        &self.admission
    }
}

impl crate::pods::PodsHost for GatewayState {
    fn cfg(&self) -> &GatewayConfig {
        &self.cfg
    }
    fn registry(&self) -> MutexGuard<'_, Registry> {
        GatewayState::registry(self)
    }
    fn client(&self) -> &HttpClient {
        &self.client
    }
    fn scheme(&self, model: &str) -> Option<HashScheme> {
        GatewayState::tokenizer(self, model).map(|t| t.scheme)
    }
    fn enroll(&self, m: &ModelSpec, url: &str) {
        enroll(&mut GatewayState::registry(self), m, url);
    }
    fn fetch_tokenizer(self: &Arc<Self>, url: String) {
        self.fetch_tokenizer_in_background(url);
    }
    fn split_policy(&self) -> &'static str {
        self.split.name()
    }
}

impl crate::replicas::sync::SyncHost for GatewayState {
    fn resource_json(&self, r: Resource) -> (u64, String) {
        GatewayState::resource_json(self, r)
    }
    fn weights_version(&self) -> u64 {
        self.weights().1
    }
    fn apply_weights(&self, w: Weights, version: u64) -> bool {
        GatewayState::apply_weights(self, w, version)
    }
    fn classes_version(&self) -> u64 {
        self.classes().1
    }
    fn apply_classes(&self, c: Vec<crate::admission::ClassConfig>, version: u64) -> bool {
        GatewayState::apply_classes(self, c, version)
    }
    fn set_drains(&self, ids: Vec<String>, version: u64) -> bool {
        GatewayState::set_drains(self, ids, version)
    }
    fn apply_drains(&self) {
        GatewayState::apply_drains(self)
    }
    fn save_local_copy(&self) {
        GatewayState::save_local_copy(self)
    }
    fn max_workers(&self) -> usize {
        self.cfg.max_workers
    }
}

impl ServeHost for GatewayState {
    fn cfg(&self) -> &GatewayConfig {
        &self.cfg
    }
    fn registry(&self) -> MutexGuard<'_, Registry> {
        GatewayState::registry(self)
    }
    fn router(&self) -> &Router {
        &self.router
    }
    fn split_policy(&self) -> &dyn kvgate_router::split::SplitPolicy {
        self.split.as_ref()
    }
    fn admission(&self) -> &Admission {
        &self.admission
    }
    fn identify(&self, authorization: Option<&str>) -> Option<Arc<crate::control::keys::Caller>> {
        self.keys.identify(authorization)
    }
    fn tokenize_pool(&self) -> &TokenizePool {
        &self.tokenize
    }
    fn tokenizer(&self, model: &str) -> Option<Arc<ModelTokenizer>> {
        GatewayState::tokenizer(self, model)
    }
    fn warming_up(&self) -> bool {
        // O(1): an unknown model is a client's to send at will, so this never scans the registry.
        self.tokenizers.fetching_any() || self.tokenizers.is_empty()
    }
    fn ring_keys(&self) -> MutexGuard<'_, RingKeys> {
        GatewayState::ring_keys(self)
    }
    fn learned_outputs(&self) -> &LearnedOutputs {
        &self.learned_outputs
    }
    fn share_send(&self, worker: &str, hashes: &[BlockHash], uncached_tokens: u64, session: u64) {
        GatewayState::share_send(self, worker, hashes, uncached_tokens, session)
    }
    fn client(&self) -> &HttpClient {
        &self.client
    }
    fn tracer(&self) -> &kvgate_shared::trace::Tracer {
        &self.tracer
    }
    fn adapter_loads(&self) -> &crate::serve::lora_catalog::AdapterLoads {
        &self.adapter_loads
    }
}
