//! The tokenizer catalog: how this gateway tokenizes and hashes each model ([`ModelTokenizer`], read by the
//! exchange through `ServeHost::tokenizer`). A model's tokenizer comes from its `[[models]]` entry's directory at
//! start ([`Tokenizers::configured`]), else from the first kvgate worker of the model that describes itself at
//! `/kvgate/v1/tokenizer` ([`Tokenizers::fetch`]: at most [`TOKENIZER_FETCH_TIMEOUT`] and `--max-tokenizer-bytes`).
//!
//! Invariants: the first tokenizer kept for a model is the model's for the gateway's life (a later worker's never
//! replaces it); a worker of a configured model whose scheme differs from the entry's is refused ([`Self::is_refused`]:
//! its hashes would never match) and never kept; one fetch per worker URL is under way at a time
//! ([`Self::begin_fetch`]); no lock is held across an await.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use kvgate_shared::hashing::HashScheme;
use kvgate_shared::prompt::{Prompter, TokenizerFiles};

use crate::config::GatewayConfig;
use crate::serve::host::ModelTokenizer;
use crate::HttpClient;

/// Longest a tokenizer fetch from a worker may take, body included.
pub const TOKENIZER_FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// What a worker said of itself with its tokenizer.
pub struct Described {
    pub model: String,
    pub worker_id: String,
    /// Its context length (0: not told).
    pub max_model_len: u32,
}

/// Why a fetch failed.
pub enum FetchError {
    /// The worker serves a configured model with another scheme: refused for good (its static entry goes).
    Refused(String),
    /// Anything else (unreachable, slow, malformed): may be tried again.
    Failed(String),
}

/// The per-model tokenizers.
#[derive(Default)]
pub struct Tokenizers {
    by_model: RwLock<HashMap<String, Arc<ModelTokenizer>>>,
    fetching: Mutex<HashSet<String>>,
    /// Worker URLs refused for serving a configured model with another tokenizer or block size.
    refused: Mutex<HashSet<String>>,
}

impl Tokenizers {
    /// The `[[models]]` entries' tokenizers, loaded from their directories.
    pub fn configured(cfg: &GatewayConfig) -> Result<Self, String> {
        let mut by_model = HashMap::new();
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
            by_model.insert(m.name.clone(), Arc::new(ModelTokenizer { prompter, scheme }));
        }
        Ok(Self { by_model: RwLock::new(by_model), ..Self::default() })
    }

    /// How `model` is tokenized and hashed, once known.
    pub fn get(&self, model: &str) -> Option<Arc<ModelTokenizer>> {
        self.by_model.read().unwrap_or_else(|e| e.into_inner()).get(model).cloned()
    }

    /// Whether a worker was refused for a tokenizer or block size that differs from its model's `[[models]]` entry
    /// (it is not identified, so never routed to; retrying cannot help).
    pub fn is_refused(&self, url: &str) -> bool {
        self.refused.lock().unwrap_or_else(|e| e.into_inner()).contains(url)
    }

    /// Marks a fetch from `url` under way; false when one already is.
    pub fn begin_fetch(&self, url: &str) -> bool {
        self.fetching.lock().unwrap_or_else(|e| e.into_inner()).insert(url.to_owned())
    }

    /// Whether no model has a tokenizer yet.
    pub fn is_empty(&self) -> bool {
        self.by_model.read().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// Whether any fetch is under way.
    pub fn fetching_any(&self) -> bool {
        !self.fetching.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// Marks the fetch from `url` over.
    pub fn end_fetch(&self, url: &str) {
        self.fetching.lock().unwrap_or_else(|e| e.into_inner()).remove(url);
    }

    /// Fetches a worker's tokenizer and what it says of itself, and keeps the tokenizer for its model unless the
    /// model has one (module docs).
    pub async fn fetch(
        &self,
        client: &HttpClient,
        cfg: &GatewayConfig,
        url: &str,
    ) -> Result<Described, FetchError> {
        let uri = format!("{}/kvgate/v1/tokenizer", url.trim_end_matches('/'));
        let failed = |e: String| FetchError::Failed(format!("{uri}: {e}"));
        let body = download(client, cfg, &uri).await.map_err(FetchError::Failed)?;
        let json: serde_json::Value = serde_json::from_slice(&body).map_err(|e| failed(e.to_string()))?;
        let model = json["model"].as_str().ok_or_else(|| failed("no model".into()))?.to_owned();
        let worker_id = json["worker_id"].as_str().unwrap_or(url).to_owned();
        let max_model_len = json["max_model_len"].as_u64().map_or(0, |v| v.min(u64::from(u32::MAX)) as u32);
        let scheme: HashScheme =
            serde_json::from_value(json["scheme"].clone()).map_err(|e| failed(format!("scheme: {e}")))?;
        let files: TokenizerFiles = serde_json::from_value(json).map_err(|e| failed(e.to_string()))?;
        if let Some(ours) = self.get(&model).filter(|_| cfg.is_configured(&model)) {
            if ours.scheme != scheme {
                self.refused.lock().unwrap_or_else(|e| e.into_inner()).insert(url.to_owned());
                return Err(FetchError::Refused(format!(
                    "{url} refused: it serves {model} with block size {} and tokenizer digest {:016x}, but this \
                     gateway's [[models]] entry for {model} has block size {} and digest {:016x} (its hashes would \
                     never match; fix the entry's tokenizer or block-size, or the worker)",
                    scheme.block_size, scheme.tokenizer_digest, ours.scheme.block_size, ours.scheme.tokenizer_digest
                )));
            }
        }
        if self.get(&model).is_none() {
            let prompter = Prompter::from_files(files)
                .map_err(|e| failed(e.to_string()))?
                .with_segment_cache_tokens(cfg.tokenize_cache_tokens);
            if let Some(why) = prompter.segment_cache_off() {
                tracing::info!(%uri, %why, "chat prompts of this model are tokenized whole (no segment cache)");
            }
            if let Some(why) = prompter.long_text_off() {
                tracing::info!(%uri, %why, "long text of this model is tokenized whole (no cached chunks)");
            }
            if prompter.digest() != scheme.tokenizer_digest {
                return Err(failed("tokenizer digest does not match the advertised scheme".into()));
            }
            tracing::info!(%model, fingerprint = scheme.fingerprint(), "tokenizer loaded from {url}");
            self.by_model
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .entry(model.clone())
                .or_insert_with(|| Arc::new(ModelTokenizer { prompter, scheme }));
        }
        Ok(Described { model, worker_id, max_model_len })
    }
}

/// `GET uri` with the gateway's token (workers with `--require-gateway-token` answer only gateways), within
/// [`TOKENIZER_FETCH_TIMEOUT`] and `--max-tokenizer-bytes`.
async fn download(client: &HttpClient, cfg: &GatewayConfig, uri: &str) -> Result<Bytes, String> {
    let mut req = hyper::Request::get(uri);
    if let Some(secret) = cfg.report_secret.as_deref() {
        req =
            req.header("authorization", format!("Bearer {}", kvgate_shared::handoff::gateway_token(secret)));
    }
    let req = req.body(Full::new(Bytes::new())).map_err(|e| e.to_string())?;
    let limit = cfg.max_tokenizer_bytes;
    let fetch = async {
        let resp = client.request(req).await.map_err(|e| format!("{uri}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{uri}: status {}", resp.status()));
        }
        let body = Limited::new(resp.into_body(), limit)
            .collect()
            .await
            .map_err(|e| format!("{uri}: {e} (limit {limit} bytes, --max-tokenizer-bytes)"))?;
        Ok(body.to_bytes())
    };
    tokio::time::timeout(TOKENIZER_FETCH_TIMEOUT, fetch)
        .await
        .map_err(|_| format!("{uri}: no tokenizer within {TOKENIZER_FETCH_TIMEOUT:?}"))?
}
