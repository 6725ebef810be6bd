//! The LoRA adapters a worker holds ([`AdapterStore`]): the one owner of which adapters are loaded, under which
//! names, and which goes when a new one needs its slot. Lifecycle as vLLM's: `--lora NAME=DIR` at start, then
//! `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` at run time (`routes.rs` authenticates them), and
//! [`AdapterStore::resolve`] for every request whose `model` names one.
//!
//! Invariants: at most `slots` adapters' weights are resident; loading one past that unloads the weights of the
//! least recently used adapter loaded at run time (an adapter from `--lora` is pinned: it goes only when unloaded
//! by name), and is refused (409 `lora_slots_full`) when every slot is pinned. An adapter whose weights were
//! unloaded stays known (at most [`MAX_KNOWN_ADAPTERS`]): a request naming it reads them again from its directory
//! first (as vLLM does for a registered adapter), so a gateway's request never meets a 404 because another load
//! took the slot; only `unload` forgets a name. Reports name the resident adapters. A request holds its adapter's
//! `Arc`, so weights unloaded under a running request stay in memory until that request ends; cached blocks stay
//! keyed by the adapter's key (`name@digest` of its files), so the same files loaded again find them, and other
//! files under the same name never do. Names are never the base model's, at most `MAX_ADAPTER_NAME_BYTES` bytes, without control characters.
//! Files are read outside the lock (a load takes milliseconds to seconds); two loads of one name race to the lock
//! and the second finds the first; requests that find one adapter unloaded wait for one read of its files
//! ([`AdapterStore::reload`]). Only regular files are read (no FIFO, no device), each within its bound as read,
//! and under `--lora-root` every file's canonical path (its links followed) must be inside the root.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use kvgate_shared::report::{HeldAdapter, LoraInfo, MAX_ADAPTER_NAME_BYTES};

use crate::model::lora::LoraAdapter;
use crate::model::{ModelConfig, ModelError};

use super::errors::ApiError;

/// The files of an adapter directory that are read.
const ADAPTER_FILES: [&str; 2] = ["adapter_config.json", "adapter_model.safetensors"];

/// Adapters a worker holds at once when `--max-loras` is not given.
pub const DEFAULT_MAX_LORAS: usize = 16;

/// Why an adapter could not be loaded or unloaded. None is helped by retrying the same call.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("this engine does not run LoRA adapters (the simulated engine, or CUDA with no device slots for adapters: --max-gpu-loras)")]
    Unsupported,
    #[error("the adapter name {0:?} is not usable: {1}")]
    BadName(String, &'static str),
    #[error("an adapter named {name:?} is already loaded from other files ({held}); unload it first")]
    NameTaken { name: String, held: String },
    #[error("lora_path {0:?} is not a directory this worker can read")]
    NoDirectory(PathBuf),
    #[error("lora_path {0:?} is outside --lora-root (or a link in it leads out)")]
    Forbidden(PathBuf),
    #[error("{0}")]
    Invalid(ModelError),
    #[error("this worker holds no LoRA adapters (--max-loras 0)")]
    NoSlots,
    #[error(
        "every one of the {0} adapter slots (--max-loras) holds an adapter given by --lora; unload one first"
    )]
    SlotsFull(usize),
    #[error("no LoRA adapter named {0:?} is loaded")]
    Unknown(String),
    #[error("the adapter {0:?} was given by --lora: it stays loaded for as long as the worker runs")]
    Pinned(String),
}

impl LoadError {
    /// The OpenAI-style answer: 400 for what the body gets wrong, 403 for a path outside the root, 404 for a
    /// missing directory or adapter, 409 when no slot can be freed or a `--lora` adapter would be unloaded.
    pub fn api(&self) -> ApiError {
        let m = self.to_string();
        match self {
            LoadError::Unsupported => ApiError::new(400, "invalid_request_error", "lora_unsupported", m),
            LoadError::BadName(..) => ApiError::invalid("lora_name", m),
            LoadError::NameTaken { .. } => {
                ApiError::new(400, "invalid_request_error", "lora_name_taken", m).with_param("lora_name")
            }
            LoadError::NoDirectory(_) => {
                ApiError::new(404, "invalid_request_error", "lora_path_not_found", m).with_param("lora_path")
            }
            LoadError::Forbidden(_) => {
                ApiError::new(403, "permission_error", "lora_path_forbidden", m).with_param("lora_path")
            }
            LoadError::Invalid(_) => ApiError::invalid("lora_path", m),
            LoadError::NoSlots => ApiError::new(400, "invalid_request_error", "lora_unsupported", m),
            LoadError::SlotsFull(_) => ApiError::new(409, "invalid_request_error", "lora_slots_full", m),
            LoadError::Unknown(_) => ApiError::new(404, "invalid_request_error", "lora_not_found", m),
            LoadError::Pinned(_) => {
                ApiError::new(409, "invalid_request_error", "lora_pinned", m).with_param("lora_name")
            }
        }
    }
}

/// What a load did.
#[derive(Debug)]
pub struct Loaded {
    pub adapter: Arc<LoraAdapter>,
    /// The same files were already loaded under this name (nothing changed).
    pub already: bool,
    /// The adapter unloaded to make room.
    pub evicted: Option<String>,
}

/// An adapter this worker knows: loaded by `--lora` or a load call, its weights resident or unloaded past the
/// slots (they are read again from `dir` when a request names it).
struct Entry {
    name: String,
    dir: PathBuf,
    /// The weights, while resident.
    adapter: Option<Arc<LoraAdapter>>,
    /// Its key when last read (what reports said).
    key: String,
    /// Loaded by `--lora`: never evicted.
    pinned: bool,
}

/// Most adapters a worker remembers (resident or not); past it the least recently used non-resident one is
/// forgotten (a request for it is then 404 until it is loaded again).
pub const MAX_KNOWN_ADAPTERS: usize = 1024;

/// What a request's `model` names.
pub enum Lookup {
    /// The base model.
    Base,
    /// A resident adapter (now the most recently used).
    Resident(Arc<LoraAdapter>),
    /// A known adapter whose weights were unloaded: [`AdapterStore::reload`] reads them again.
    Unloaded,
}

/// The adapters one worker knows and holds.
pub struct AdapterStore {
    model_id: String,
    /// The base model's shapes (`None`: the backend runs no adapters).
    base: Option<ModelConfig>,
    max_rank: usize,
    slots: usize,
    root: Option<PathBuf>,
    /// Most recently used first.
    entries: Mutex<Vec<Entry>>,
    /// One reload of a name at a time: requests that find an adapter unloaded wait for the one read of its files.
    reloading: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl AdapterStore {
    /// A store for `model_id` (shapes `base`; `None` when the backend runs no adapters) holding at most `slots`.
    pub fn new(
        model_id: &str,
        base: Option<ModelConfig>,
        max_rank: usize,
        slots: usize,
        root: Option<PathBuf>,
    ) -> Self {
        Self {
            model_id: model_id.to_owned(),
            base,
            max_rank,
            slots,
            root,
            entries: Mutex::new(Vec::new()),
            reloading: Mutex::new(HashMap::new()),
        }
    }

    /// The list (a panic under the lock left a consistent list: every change is one insert, remove or swap).
    fn lock(&self) -> MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The `--lora` adapters, loaded and pinned (refused past the slots).
    pub fn preload(&self, adapters: &[(String, PathBuf)]) -> Result<(), LoadError> {
        for (name, dir) in adapters {
            let a = self.read(name, dir)?;
            let mut entries = self.lock();
            if entries.iter().any(|e| e.name == *name) {
                return Err(LoadError::NameTaken { name: name.clone(), held: "--lora".into() });
            }
            if entries.len() >= self.slots {
                return Err(LoadError::SlotsFull(self.slots));
            }
            let key = a.key.clone();
            entries.push(Entry {
                name: name.clone(),
                dir: dir.clone(),
                adapter: Some(Arc::new(a)),
                key,
                pinned: true,
            });
        }
        Ok(())
    }

    /// What a request's `model` names (an adapter named is now the most recently used); 404 for anything else.
    pub fn lookup(&self, model: &str) -> Result<Lookup, ApiError> {
        use super::errors::WorkerErrors;
        if model == self.model_id {
            return Ok(Lookup::Base);
        }
        let mut entries = self.lock();
        let i = entries
            .iter()
            .position(|e| e.name == model)
            .ok_or_else(|| ApiError::model_not_found(model, &self.model_id))?;
        let e = entries.remove(i);
        let found = match &e.adapter {
            Some(a) => Lookup::Resident(a.clone()),
            None => Lookup::Unloaded,
        };
        entries.insert(0, e);
        Ok(found)
    }

    /// [`Self::lookup`] for a caller that cannot wait for a reload: an unloaded adapter is a 404.
    pub fn resolve(&self, model: &str) -> Result<Option<Arc<LoraAdapter>>, ApiError> {
        use super::errors::WorkerErrors;
        match self.lookup(model)? {
            Lookup::Base => Ok(None),
            Lookup::Resident(a) => Ok(Some(a)),
            Lookup::Unloaded => Err(ApiError::model_not_found(model, &self.model_id)),
        }
    }

    /// Reads the weights of the known adapter `name` again (blocking), as a load would; one read at a time per
    /// name: a caller that waited for another's read gets its result without reading.
    pub fn reload(&self, name: &str) -> Result<Loaded, LoadError> {
        let resident = |entries: &[Entry]| -> Result<Option<Arc<LoraAdapter>>, LoadError> {
            let e = entries.iter().find(|e| e.name == name).ok_or_else(|| LoadError::Unknown(name.into()))?;
            Ok(e.adapter.clone())
        };
        resident(&self.lock())?;
        let one = {
            let mut map = self.reloading.lock().unwrap_or_else(|e| e.into_inner());
            if map.len() >= 2 * MAX_KNOWN_ADAPTERS {
                map.retain(|_, l| Arc::strong_count(l) > 1);
            }
            map.entry(name.to_owned()).or_default().clone()
        };
        let _one = one.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(adapter) = resident(&self.lock())? {
            metrics::counter!("kvgate_worker_lora_reloads_total", "outcome" => "shared").increment(1);
            return Ok(Loaded { adapter, already: true, evicted: None });
        }
        let dir = self.lock().iter().find(|e| e.name == name).map(|e| e.dir.clone());
        let dir = dir.ok_or_else(|| LoadError::Unknown(name.into()))?;
        metrics::counter!("kvgate_worker_lora_reloads_total", "outcome" => "read").increment(1);
        self.load_as(name, &dir, true)
    }

    /// Loads the adapter in `dir` as `name` (blocking: reads its files), unloading the least recently used
    /// unpinned adapter's weights when every slot is taken.
    pub fn load(&self, name: &str, dir: &Path) -> Result<Loaded, LoadError> {
        self.load_as(name, dir, false)
    }

    fn load_as(&self, name: &str, dir: &Path, reload: bool) -> Result<Loaded, LoadError> {
        let a = Arc::new(self.read(name, dir)?);
        let mut entries = self.lock();
        let existing = entries.iter().position(|e| e.name == name);
        if let Some(i) = existing {
            let e = &entries[i];
            if let Some(held) = e.adapter.as_ref().filter(|h| h.key == a.key) {
                return Ok(Loaded { adapter: held.clone(), already: true, evicted: None });
            }
            // Other files under a known name: refused, unless it is the reload of that name (its files changed).
            if !reload && e.key != a.key {
                return Err(LoadError::NameTaken { name: name.into(), held: e.dir.display().to_string() });
            }
        }
        let resident = entries.iter().filter(|e| e.adapter.is_some()).count();
        let mut evicted = None;
        if resident >= self.slots {
            let i = entries
                .iter()
                .rposition(|e| e.adapter.is_some() && !e.pinned)
                .ok_or(LoadError::SlotsFull(self.slots))?;
            entries[i].adapter = None;
            evicted = Some(entries[i].name.clone());
        }
        let pinned = existing.is_some_and(|i| entries[i].pinned);
        if let Some(i) = existing {
            entries.remove(i);
        }
        if entries.len() >= MAX_KNOWN_ADAPTERS {
            if let Some(i) = entries.iter().rposition(|e| e.adapter.is_none() && !e.pinned) {
                entries.remove(i);
            }
        }
        let key = a.key.clone();
        entries.insert(
            0,
            Entry { name: name.to_owned(), dir: dir.to_owned(), adapter: Some(a.clone()), key, pinned },
        );
        Ok(Loaded { adapter: a, already: false, evicted })
    }

    /// The adapter whose key is `key` (`name@digest`), its weights read again first if they were unloaded
    /// (blocking); `None` when this worker does not know the name, or knows other files under it.
    pub fn by_key(&self, key: &str) -> Option<Arc<LoraAdapter>> {
        let (name, _) = key.rsplit_once('@')?;
        let a = match self.lookup(name).ok()? {
            Lookup::Base => return None,
            Lookup::Resident(a) => a,
            Lookup::Unloaded => self.reload(name).ok()?.adapter,
        };
        (a.key == key).then_some(a)
    }

    /// Forgets `name` (requests running with it finish with it); an adapter given by `--lora` is refused.
    pub fn unload(&self, name: &str) -> Result<(), LoadError> {
        let mut entries = self.lock();
        let i = entries.iter().position(|e| e.name == name).ok_or_else(|| LoadError::Unknown(name.into()))?;
        if entries[i].pinned {
            return Err(LoadError::Pinned(name.into()));
        }
        entries.remove(i);
        Ok(())
    }

    /// The names known (resident or not), most recently used first.
    pub fn names(&self) -> Vec<String> {
        self.lock().iter().map(|e| e.name.clone()).collect()
    }

    /// What reports say: the slots (0 when the backend runs none) and the adapters resident.
    pub fn info(&self) -> LoraInfo {
        let slots = if self.base.is_some() { self.slots.min(u16::MAX as usize) as u16 } else { 0 };
        let held = self
            .lock()
            .iter()
            .filter(|e| e.adapter.is_some())
            .map(|e| HeldAdapter { name: e.name.clone(), key: e.key.clone() })
            .collect();
        LoraInfo { slots, held }
    }

    /// Checks the name and the path, then reads and checks the adapter against the base model.
    fn read(&self, name: &str, dir: &Path) -> Result<LoraAdapter, LoadError> {
        let base = self.base.as_ref().ok_or(LoadError::Unsupported)?;
        if self.slots == 0 {
            return Err(LoadError::NoSlots);
        }
        check_name(name, &self.model_id)?;
        let real = dir.canonicalize().map_err(|_| LoadError::NoDirectory(dir.to_owned()))?;
        if !real.is_dir() {
            return Err(LoadError::NoDirectory(dir.to_owned()));
        }
        let root = match &self.root {
            None => None,
            Some(root) => Some(root.canonicalize().map_err(|_| LoadError::Forbidden(dir.to_owned()))?),
        };
        if root.as_ref().is_some_and(|r| !real.starts_with(r)) {
            return Err(LoadError::Forbidden(dir.to_owned()));
        }
        // Each file where its links lead (a Hugging Face cache's files are links into its blobs), and, under
        // --lora-root, only there: a link out of the root is refused like a directory outside it.
        for f in ADAPTER_FILES {
            if let (Some(r), Ok(p)) = (&root, real.join(f).canonicalize()) {
                if !p.starts_with(r) {
                    return Err(LoadError::Forbidden(dir.join(f)));
                }
            }
        }
        let files = |f: &str| real.join(f).canonicalize().map_err(|e| e.to_string());
        LoraAdapter::load_files(&files, name, base, self.max_rank).map_err(LoadError::Invalid)
    }
}

/// A name requests may give as `model`: not the base model's, 1 to `MAX_ADAPTER_NAME_BYTES` bytes, no control
/// characters or whitespace (it travels in headers and reports).
pub fn check_name(name: &str, model_id: &str) -> Result<(), LoadError> {
    let bad = |why| Err(LoadError::BadName(name.to_owned(), why));
    if name.is_empty() || name.len() > MAX_ADAPTER_NAME_BYTES {
        return bad("it must be 1 to 256 bytes");
    }
    if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return bad("it may not hold whitespace or control characters");
    }
    if name == model_id {
        return bad("it is the base model's");
    }
    Ok(())
}

/// Largest body of a load or unload call.
pub const MAX_ADMIN_BODY_BYTES: usize = 64 * 1024;

/// `POST /v1/load_lora_adapter` (vLLM's): `{"lora_name", "lora_path"}`; any other field is refused by name.
/// 200 with what was loaded (`status`: `loaded` or `already_loaded`; `evicted`: the adapter unloaded for it).
pub async fn load(
    axum::extract::State(state): axum::extract::State<Arc<super::state::AppState>>,
    body: bytes::Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (l, req) = match admin_call(&state, &body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let Some(path) = req.lora_path else {
        return ApiError::invalid("lora_path", "lora_path is required").into_response();
    };
    let (store, name) = (l.adapters.clone(), req.lora_name.clone());
    let started = std::time::Instant::now();
    let done = tokio::task::spawn_blocking(move || store.load(&name, Path::new(&path))).await;
    let loaded = match done {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            metrics::counter!("kvgate_worker_lora_loads_total", "outcome" => "refused").increment(1);
            return e.api().into_response();
        }
        Err(e) => return ApiError::internal(format!("adapter load: {e}")).into_response(),
    };
    let outcome = if loaded.already { "already_loaded" } else { "loaded" };
    metrics::counter!("kvgate_worker_lora_loads_total", "outcome" => outcome).increment(1);
    if loaded.evicted.is_some() {
        metrics::counter!("kvgate_worker_lora_evictions_total").increment(1);
    }
    metrics::gauge!("kvgate_worker_lora_adapters").set(l.adapters.names().len() as f64);
    tracing::info!(name = %req.lora_name, key = %loaded.adapter.key, outcome, evicted = ?loaded.evicted, "LoRA adapter");
    state.report_now.notify_one();
    axum::Json(serde_json::json!({
        "object": "lora_adapter",
        "id": req.lora_name,
        "parent": l.model_id,
        "key": loaded.adapter.key,
        "status": outcome,
        "evicted": loaded.evicted,
        "load_ms": started.elapsed().as_secs_f64() * 1e3,
    }))
    .into_response()
}

/// `POST /v1/unload_lora_adapter` (vLLM's): `{"lora_name"}`. 200, or 404 `lora_not_found`.
pub async fn unload(
    axum::extract::State(state): axum::extract::State<Arc<super::state::AppState>>,
    body: bytes::Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (l, req) = match admin_call(&state, &body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    if req.lora_path.is_some() {
        return ApiError::unsupported("lora_path").into_response();
    }
    if let Err(e) = l.adapters.unload(&req.lora_name) {
        return e.api().into_response();
    }
    metrics::counter!("kvgate_worker_lora_unloads_total").increment(1);
    metrics::gauge!("kvgate_worker_lora_adapters").set(l.adapters.names().len() as f64);
    state.report_now.notify_one();
    axum::Json(serde_json::json!({"object": "lora_adapter", "id": req.lora_name, "status": "unloaded"}))
        .into_response()
}

/// The body of a load or unload call.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AdminBody {
    lora_name: String,
    #[serde(default)]
    lora_path: Option<String>,
}

/// The loaded model and the parsed body of an admin call; 503 while the model loads, 413 past
/// [`MAX_ADMIN_BODY_BYTES`], 400 naming a field kvgate does not implement (vLLM's `load_inplace`, `lora_int_id`).
fn admin_call(
    state: &super::state::AppState,
    body: &[u8],
) -> Result<(Arc<super::state::ServingModel>, AdminBody), ApiError> {
    let l = state.loaded().ok_or_else(|| {
        ApiError::refused(super::errors::Refusal::ModelLoading, "the model is still loading")
    })?;
    if body.len() > MAX_ADMIN_BODY_BYTES {
        return Err(ApiError::too_large(MAX_ADMIN_BODY_BYTES));
    }
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| ApiError::bad_json(e.to_string()))?;
    if let Some(o) = v.as_object() {
        if let Some(k) = o.keys().find(|k| !matches!(k.as_str(), "lora_name" | "lora_path")) {
            return Err(ApiError::unsupported(k));
        }
    }
    let b: AdminBody = serde_json::from_value(v).map_err(|e| ApiError::bad_json(e.to_string()))?;
    Ok((l, b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::{synth_lora, LoraSpec, Target};
    use crate::model::synth::{synth_model, Preset, SynthSpec};

    fn fixture(n: usize) -> (tempfile::TempDir, ModelConfig, Vec<PathBuf>) {
        let t = tempfile::tempdir().expect("tmp");
        let model = t.path().join("m");
        synth_model(&model, &SynthSpec::new(Preset::Tiny, 1)).expect("model");
        let cfg = ModelConfig::from_dir(&model).expect("cfg");
        let dirs = (0..n)
            .map(|i| {
                let d = t.path().join(format!("a{i}"));
                let spec = LoraSpec {
                    base: "m",
                    rank: 4,
                    alpha: 8.0,
                    targets: &Target::ALL,
                    seed: i as u64,
                    zero: false,
                };
                synth_lora(&d, &cfg, &spec).expect("lora");
                d
            })
            .collect();
        (t, cfg, dirs)
    }

    #[test]
    fn past_its_slots_the_least_recently_used_runtime_adapter_goes_and_pinned_ones_stay() {
        let (_t, cfg, d) = fixture(4);
        let s = AdapterStore::new("base", Some(cfg), 64, 3, None);
        s.preload(&[("pinned".into(), d[0].clone())]).expect("preload");
        s.load("x", &d[1]).expect("x");
        s.load("y", &d[2]).expect("y");
        s.resolve("x").expect("x used").expect("an adapter");
        let l = s.load("z", &d[3]).expect("z");
        assert_eq!(l.evicted.as_deref(), Some("y"), "y is the least recently used unpinned");
        let resident = |s: &AdapterStore| s.info().held.iter().map(|h| h.name.clone()).collect::<Vec<_>>();
        assert_eq!(resident(&s), ["z", "x", "pinned"]);
        assert_eq!(s.names(), ["z", "x", "y", "pinned"], "y's weights went, its name stays known");
        assert!(matches!(s.lookup("y"), Ok(Lookup::Unloaded)));
        assert_eq!(s.resolve("y").expect_err("not resident").status, 404, "a caller that cannot wait");
        // A request naming y reads it again, taking the least recently used slot (x: y's lookup came after z).
        let again = s.reload("y").expect("reload");
        assert_eq!(again.evicted.as_deref(), Some("x"));
        assert_eq!(resident(&s), ["y", "z", "pinned"]);
        let info = s.info();
        assert_eq!((info.slots, info.held.len()), (3, 3));
        assert!(info.held.iter().all(|h| HeldAdapter::key_is_valid(&h.name, &h.key)), "{info:?}");
        assert_eq!(s.lookup("nope").err().map(|e| e.status), Some(404));
        // Every slot pinned: refused, nothing unloaded.
        let only = AdapterStore::new("base", s.base.clone(), 64, 1, None);
        only.preload(&[("p".into(), d[0].clone())]).expect("preload");
        assert!(matches!(only.load("q", &d[1]), Err(LoadError::SlotsFull(1))));
        assert_eq!(only.names(), ["p"]);
    }

    #[test]
    fn a_name_holds_one_set_of_files_and_loading_them_again_changes_nothing() {
        let (_t, cfg, d) = fixture(2);
        let s = AdapterStore::new("base", Some(cfg), 64, 4, None);
        let first = s.load("a", &d[0]).expect("a");
        let again = s.load("a", &d[0]).expect("again");
        assert!(again.already && Arc::ptr_eq(&again.adapter, &first.adapter));
        let e = s.load("a", &d[1]).expect_err("other files");
        assert_eq!((e.api().status, e.api().code), (400, "lora_name_taken"));
        s.unload("a").expect("unload");
        assert_eq!(s.unload("a").expect_err("twice").api().status, 404);
        let other = s.load("a", &d[1]).expect("other files after the unload");
        assert_ne!(other.adapter.key, first.adapter.key, "other files, another key: no block is shared");
    }

    #[test]
    fn hostile_names_and_paths_are_refused_by_name() {
        let (t, cfg, d) = fixture(1);
        let s = AdapterStore::new("base", Some(cfg.clone()), 64, 4, Some(t.path().join("a0")));
        for (name, code) in [("", "invalid_value"), ("base", "invalid_value"), ("a b", "invalid_value")] {
            let e = s.load(name, &d[0]).expect_err(name).api();
            assert_eq!((e.status, e.code, e.param.as_deref()), (400, code, Some("lora_name")), "{name:?}");
        }
        assert_eq!(s.load(&"n".repeat(257), &d[0]).expect_err("long").api().status, 400);
        let e = s.load("m", &t.path().join("m")).expect_err("outside the root").api();
        assert_eq!((e.status, e.code), (403, "lora_path_forbidden"));
        let e = s.load("m", &t.path().join("a0/../m")).expect_err("a way out of the root").api();
        assert_eq!(e.code, "lora_path_forbidden");
        let e = s.load("m", &t.path().join("nowhere")).expect_err("missing").api();
        assert_eq!((e.status, e.code), (404, "lora_path_not_found"));
        // The model's own directory is not an adapter.
        let open = AdapterStore::new("base", Some(cfg), 64, 4, None);
        let e = open.load("m", &t.path().join("m")).expect_err("no adapter files").api();
        assert_eq!((e.status, e.param.as_deref()), (400, Some("lora_path")));
        let none = AdapterStore::new("base", None, 64, 4, None);
        assert_eq!(none.load("a", &d[0]).expect_err("unsupported").api().code, "lora_unsupported");
        assert_eq!(none.info().slots, 0);
    }
    /// An adapter directory like `d` whose weights file is made by `weights` (a link, a FIFO...).
    fn with_weights(t: &Path, d: &Path, name: &str, weights: impl FnOnce(&Path)) -> PathBuf {
        let out = t.join(name);
        std::fs::create_dir_all(&out).expect("dir");
        std::fs::copy(d.join("adapter_config.json"), out.join("adapter_config.json")).expect("config");
        weights(&out.join("adapter_model.safetensors"));
        out
    }

    #[test]
    fn only_regular_files_inside_the_root_are_read_and_within_their_bound() {
        let (t, cfg, d) = fixture(1);
        let root = t.path().join("root");
        std::fs::create_dir_all(&root).expect("root");
        let rooted = AdapterStore::new("base", Some(cfg.clone()), 64, 4, Some(root.clone()));
        let open = AdapterStore::new("base", Some(cfg), 64, 4, None);
        // A file link out of the root: refused like a directory outside it.
        let out_link = with_weights(&root, &d[0], "out", |w| {
            std::os::unix::fs::symlink(d[0].join("adapter_model.safetensors"), w).expect("link")
        });
        let e = rooted.load("x", &out_link).expect_err("a link out of the root").api();
        assert_eq!((e.status, e.code), (403, "lora_path_forbidden"));
        // A link that stays inside the root (a Hugging Face cache's blobs) is followed.
        let blob = root.join("blob.safetensors");
        std::fs::copy(d[0].join("adapter_model.safetensors"), &blob).expect("blob");
        let in_link =
            with_weights(&root, &d[0], "in", |w| std::os::unix::fs::symlink(&blob, w).expect("link"));
        rooted.load("y", &in_link).expect("a link inside the root");
        // A FIFO is refused at once, not waited on; a device is refused, never read.
        let fifo = with_weights(t.path(), &d[0], "fifo", |w| {
            let made = std::process::Command::new("mkfifo").arg(w).status().expect("mkfifo (coreutils)");
            assert!(made.success(), "mkfifo");
        });
        let started = std::time::Instant::now();
        let e = open.load("f", &fifo).expect_err("a FIFO");
        assert!(started.elapsed() < std::time::Duration::from_secs(2), "not waited on");
        assert!(e.to_string().contains("FIFO"), "{e}");
        let zero = with_weights(t.path(), &d[0], "zero", |w| {
            std::os::unix::fs::symlink("/dev/zero", w).expect("link")
        });
        let e = open.load("z", &zero).expect_err("a device");
        assert!(e.to_string().contains("device"), "{e}");
        let read = crate::model::lora::read_regular(Path::new("/dev/zero"), 10);
        assert_eq!(read.err().as_deref(), Some("a device: only regular files are read"));
        // A regular file past its bound, as read.
        let big = t.path().join("big");
        std::fs::write(&big, vec![0u8; 64]).expect("write");
        assert!(crate::model::lora::read_regular(&big, 63).is_err());
        assert_eq!(crate::model::lora::read_regular(&big, 64).expect("at the bound").len(), 64);
    }

    #[test]
    fn pinned_adapters_stay_and_a_burst_for_an_unloaded_one_reads_its_files_once() {
        let (_t, cfg, d) = fixture(3);
        let s = Arc::new(AdapterStore::new("base", Some(cfg), 64, 2, None));
        s.preload(&[("pinned".into(), d[0].clone())]).expect("preload");
        let e = s.unload("pinned").expect_err("pinned").api();
        assert_eq!((e.status, e.code), (409, "lora_pinned"));
        s.load("b", &d[1]).expect("b");
        s.load("c", &d[2]).expect("c takes b's slot");
        assert!(matches!(s.lookup("b"), Ok(Lookup::Unloaded)));
        let threads: Vec<_> = (0..16)
            .map(|_| {
                let s = s.clone();
                std::thread::spawn(move || s.reload("b").expect("reload"))
            })
            .collect();
        let loaded: Vec<Loaded> = threads.into_iter().map(|t| t.join().expect("thread")).collect();
        assert_eq!(loaded.iter().filter(|l| !l.already).count(), 1, "one read; the others got its result");
        assert!(loaded.iter().all(|l| Arc::ptr_eq(&l.adapter, &loaded[0].adapter)));
    }
}
