//! The gateway's shared state: configuration, the worker registry, per-model tokenizers (fetched from workers'
//! `/kvgate/v1/tokenizer`, so the gateway tokenizes and hashes exactly like them; the fetch is bounded in bytes and
//! time), the routing policy, admission, the API key table, the tokenize pool, the HTTP client to workers, and the
//! metrics handle.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvgate_shared::hashing::{BlockHash, HashScheme};
use kvgate_shared::prompt::{Prompter, TokenizerFiles};
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

pub use crate::HttpClient;

/// Longest a tokenizer fetch from a worker may take, body included.
pub const TOKENIZER_FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything the proxy and the control listener share.
pub struct GatewayState {
    pub cfg: GatewayConfig,
    registry: Mutex<Registry>,
    tokenizers: RwLock<HashMap<String, Arc<ModelTokenizer>>>,
    fetching: Mutex<HashSet<String>>,
    /// Worker URLs refused for serving a configured model with another tokenizer or block size.
    refused: Mutex<HashSet<String>>,
    /// The routing policy behind the one `route()` (`kvgate_router::route`).
    pub router: Router,
    /// The prefill/decode split policy (`--split-policy`).
    pub split: Box<dyn kvgate_router::split::SplitPolicy>,
    /// Per class: the output length of its completed requests (configured class names only).
    pub learned_outputs: LearnedOutputs,
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
        let mut tokenizers = HashMap::new();
        for m in &cfg.models {
            let prompter = Prompter::from_dir(&m.tokenizer)
                .map_err(|e| format!("model {}: tokenizer {}: {e}", m.name, m.tokenizer.display()))?
                .with_segment_cache_tokens(cfg.tokenize_cache_tokens);
            let scheme = HashScheme::new(m.block_size, prompter.digest());
            scheme.validate().map_err(|e| format!("model {}: {e}", m.name))?;
            tracing::info!(model = %m.name, kind = ?m.kind, fingerprint = scheme.fingerprint(), "tokenizer loaded from {}", m.tokenizer.display());
            for (what, off) in
                [("chat segments", prompter.segment_cache_off()), ("long text", prompter.long_text_off())]
            {
                if let Some(why) = off {
                    tracing::info!(model = %m.name, %why, "{what} of this model are tokenized whole (not cached)");
                }
            }
            tokenizers.insert(m.name.clone(), Arc::new(ModelTokenizer { prompter, scheme }));
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
        Ok(Self {
            cfg,
            registry: Mutex::new(registry),
            tokenizers: RwLock::new(tokenizers),
            fetching: Mutex::new(HashSet::new()),
            refused: Mutex::new(HashSet::new()),
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
        self.tokenizers.read().unwrap_or_else(|e| e.into_inner()).get(model).cloned()
    }

    /// Fetches a worker's tokenizer, learns its id, model and context length, and keeps the tokenizer for that
    /// model (the first one fetched for a model defines the gateway's fingerprint for it). The whole fetch takes at
    /// most [`TOKENIZER_FETCH_TIMEOUT`] and `--max-tokenizer-bytes`.
    pub async fn fetch_tokenizer(&self, url: &str) -> Result<String, String> {
        let uri = format!("{}/kvgate/v1/tokenizer", url.trim_end_matches('/'));
        let mut req = hyper::Request::get(&uri);
        if let Some(secret) = self.cfg.report_secret.as_deref() {
            // Workers with --require-gateway-token answer only gateways.
            req = req
                .header("authorization", format!("Bearer {}", kvgate_shared::handoff::gateway_token(secret)));
        }
        let req = req.body(Full::new(Bytes::new())).map_err(|e| e.to_string())?;
        let limit = self.cfg.max_tokenizer_bytes;
        let fetch = async {
            let resp = self.client.request(req).await.map_err(|e| format!("{uri}: {e}"))?;
            if !resp.status().is_success() {
                return Err(format!("{uri}: status {}", resp.status()));
            }
            let body = Limited::new(resp.into_body(), limit)
                .collect()
                .await
                .map_err(|e| format!("{uri}: {e} (limit {limit} bytes, --max-tokenizer-bytes)"))?;
            Ok(body.to_bytes())
        };
        let body = tokio::time::timeout(TOKENIZER_FETCH_TIMEOUT, fetch)
            .await
            .map_err(|_| format!("{uri}: no tokenizer within {TOKENIZER_FETCH_TIMEOUT:?}"))??;
        let json: serde_json::Value = serde_json::from_slice(&body).map_err(|e| format!("{uri}: {e}"))?;
        let model = json["model"].as_str().ok_or_else(|| format!("{uri}: no model"))?.to_owned();
        let worker_id = json["worker_id"].as_str().unwrap_or(url).to_owned();
        let max_model_len = json["max_model_len"].as_u64().map_or(0, |v| v.min(u64::from(u32::MAX)) as u32);
        let scheme: HashScheme =
            serde_json::from_value(json["scheme"].clone()).map_err(|e| format!("{uri}: scheme: {e}"))?;
        let files: TokenizerFiles = serde_json::from_value(json).map_err(|e| format!("{uri}: {e}"))?;
        if let Some(ours) = self.tokenizer(&model).filter(|_| self.cfg.is_configured(&model)) {
            if ours.scheme != scheme {
                self.refused.lock().unwrap_or_else(|e| e.into_inner()).insert(url.to_owned());
                self.registry().remove_static(url);
                return Err(format!(
                    "{url} refused: it serves {model} with block size {} and tokenizer digest {:016x}, but this \
                     gateway's [[models]] entry for {model} has block size {} and digest {:016x} (its hashes would \
                     never match; fix the entry's tokenizer or block-size, or the worker)",
                    scheme.block_size, scheme.tokenizer_digest, ours.scheme.block_size, ours.scheme.tokenizer_digest
                ));
            }
        }
        if self.tokenizer(&model).is_none() {
            let prompter = Prompter::from_files(files)
                .map_err(|e| format!("{uri}: {e}"))?
                .with_segment_cache_tokens(self.cfg.tokenize_cache_tokens);
            if let Some(why) = prompter.segment_cache_off() {
                tracing::info!(%uri, %why, "chat prompts of this model are tokenized whole (no segment cache)");
            }
            if let Some(why) = prompter.long_text_off() {
                tracing::info!(%uri, %why, "long text of this model is tokenized whole (no cached chunks)");
            }
            if prompter.digest() != scheme.tokenizer_digest {
                return Err(format!("{uri}: tokenizer digest does not match the advertised scheme"));
            }
            tracing::info!(%model, fingerprint = scheme.fingerprint(), "tokenizer loaded from {url}");
            self.tokenizers
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .entry(model.clone())
                .or_insert_with(|| Arc::new(ModelTokenizer { prompter, scheme }));
        }
        self.registry().identify(url, &worker_id, &model, max_model_len);
        Ok(model)
    }

    /// Whether a worker was refused for a tokenizer or block size that differs from its model's `[[models]]` entry
    /// (it is not identified, so never routed to; retrying cannot help).
    pub fn is_refused(&self, url: &str) -> bool {
        self.refused.lock().unwrap_or_else(|e| e.into_inner()).contains(url)
    }

    /// Starts fetching a worker's tokenizer in the background unless one is under way.
    pub fn fetch_tokenizer_in_background(self: &Arc<Self>, url: String) {
        if !self.fetching.lock().unwrap_or_else(|e| e.into_inner()).insert(url.clone()) {
            return;
        }
        let state = self.clone();
        tokio::spawn(async move {
            if let Err(e) = state.fetch_tokenizer(&url).await {
                tracing::warn!(error = %e, "cannot fetch a worker's tokenizer");
            }
            state.fetching.lock().unwrap_or_else(|e| e.into_inner()).remove(&url);
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
}
