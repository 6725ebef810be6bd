//! Prompt rendering and tokenization: the one [`Prompter`] type the gateway and the worker both use, so that the
//! same request becomes the same token ids (and therefore the same block hashes) on both sides.
//!
//! A prompt is a chat conversation (rendered with the model's chat template, then tokenized without adding
//! special tokens, since the template writes them), a text (tokenized with the tokenizer's post-processor, which
//! adds BOS for Llama-style tokenizers), or token ids given directly (used as they are). A rendered chat is
//! tokenized piece by piece between added tokens, earlier messages' pieces from a bounded cache (`segments.rs`;
//! exact by construction and checked at start, else the whole text is encoded). A long stretch of text (a
//! completions prompt, a long message) is further cut where the pre-tokenizer must split (`long_text.rs`), so a
//! prompt that extends one seen before is tokenized only past the shared part.

pub mod fast_bpe;
pub mod long_text;
pub mod pretok;
pub mod request;
pub mod segments;
mod synth;
mod template;

pub use request::{chat_options, RequestPrompt, CACHE_SALT_HEADER};
pub use segments::CacheStats;
pub use synth::{
    byte_to_char, synth_prose, synth_text, synth_tokenizer, SplitMix64, SynthTokenizer, BOS_TOKEN,
    CHAT_TEMPLATE, EOT_TOKEN, SPECIAL_TOKENS,
};
pub use template::ChatTemplate;

use fast_bpe::FastBpe;
use long_text::{Chunker, DEFAULT_CHUNK_BYTES};
use segments::{Encoder, SegmentCache, Segmenter, DEFAULT_CACHE_TOKENS};

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::Xxh3;

/// Why a prompt could not be produced. `InvalidConversation` and `InvalidPrompt` are the client's fault (400);
/// the others are deployment problems.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("cannot read {path}: {reason}")]
    File { path: String, reason: String },
    #[error("invalid tokenizer: {0}")]
    Tokenizer(String),
    #[error("{0}")]
    Template(String),
    #[error("this model has no chat template; use /v1/completions or give the model a chat template")]
    NoChatTemplate,
    #[error("invalid conversation: {0}")]
    InvalidConversation(String),
    #[error("invalid prompt: {0}")]
    InvalidPrompt(String),
}

impl PromptError {
    /// Whether the request (not the deployment) is at fault.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            PromptError::InvalidConversation(_) | PromptError::InvalidPrompt(_) | PromptError::NoChatTemplate
        )
    }
}

/// The parts of a tokenizer that travel between processes (`GET /kvgate/v1/tokenizer` serves these).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TokenizerFiles {
    /// The `tokenizer.json` text.
    pub tokenizer_json: String,
    /// The chat template, if the model has one.
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl TokenizerFiles {
    /// Reads a Hugging Face model directory: `tokenizer.json`, and `tokenizer_config.json` (`chat_template`,
    /// `bos_token`, `eos_token`) and/or `chat_template.jinja` (which wins, as in `transformers`).
    pub fn from_dir(dir: &Path) -> Result<Self, PromptError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path)
                .map_err(|e| PromptError::File { path: path.display().to_string(), reason: e.to_string() })
        };
        let tokenizer_json = read("tokenizer.json")?;
        let mut files =
            TokenizerFiles { tokenizer_json, chat_template: None, bos_token: None, eos_token: None };
        if dir.join("tokenizer_config.json").exists() {
            let path = dir.join("tokenizer_config.json");
            let cfg: Json = serde_json::from_str(&read("tokenizer_config.json")?)
                .map_err(|e| PromptError::File { path: path.display().to_string(), reason: e.to_string() })?;
            files.chat_template = template_from_config(&cfg);
            files.bos_token = special_token(&cfg, "bos_token");
            files.eos_token = special_token(&cfg, "eos_token");
        }
        if dir.join("chat_template.jinja").exists() {
            files.chat_template = Some(read("chat_template.jinja")?);
        }
        Ok(files)
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which `default` is used.
fn template_from_config(cfg: &Json) -> Option<String> {
    match cfg.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(items) => items
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// A special token is a string or an AddedToken object with `content`.
fn special_token(cfg: &Json, key: &str) -> Option<String> {
    match cfg.get(key)? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// Options of chat rendering (the OpenAI request's fields that reach the template).
#[derive(Clone, Debug, Default)]
pub struct ChatOptions {
    /// End with the assistant header so the model answers (OpenAI chat always does: default true in requests).
    pub add_generation_prompt: bool,
    /// Tool definitions, passed to the template as `tools`.
    pub tools: Option<Json>,
    /// `chat_template_kwargs`: extra variables for the template.
    pub extra: Option<serde_json::Map<String, Json>>,
    /// vLLM's `continue_final_message` (with `add_generation_prompt` false): the rendered text ends where the final
    /// message's content does, as Hugging Face's `apply_chat_template` cuts it, so the model continues that message.
    pub continue_final_message: bool,
}

/// What a request asks the model to continue.
#[derive(Clone, Debug)]
pub enum PromptInput<'a> {
    /// A completions prompt as text.
    Text(&'a str),
    /// A completions prompt as token ids.
    TokenIds(&'a [u32]),
    /// A chat conversation (OpenAI message objects).
    Chat { messages: &'a [Json], options: &'a ChatOptions },
}

/// Renders and tokenizes prompts exactly the same way on every kvgate process.
pub struct Prompter {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    files: TokenizerFiles,
    digest: u64,
    /// Splits rendered chats at added tokens (`None`: plain encoding; `segments_off` says why).
    segmenter: Option<Segmenter>,
    segments_off: Option<String>,
    /// Cuts long text stretches (`None`: stretches are encoded whole; `long_text_off` says why).
    chunker: Option<Chunker>,
    long_text_off: Option<String>,
    /// The exact fast path of byte-level BPE tokenizers for stretches of text (`None`: `Tokenizer::encode`).
    fast: Option<FastBpe>,
    fast_off: Option<String>,
    segment_cache: SegmentCache,
    segment_hits: AtomicU64,
    segment_misses: AtomicU64,
}

impl std::fmt::Debug for Prompter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prompter").field("digest", &self.digest).field("template", &self.template).finish()
    }
}

impl Prompter {
    /// Loads from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self, PromptError> {
        Self::from_files(TokenizerFiles::from_dir(dir)?)
    }

    /// Builds from the transported parts.
    pub fn from_files(files: TokenizerFiles) -> Result<Self, PromptError> {
        let tokenizer = Tokenizer::from_bytes(files.tokenizer_json.as_bytes())
            .map_err(|e| PromptError::Tokenizer(format!("tokenizer.json: {e}")))?;
        let template = files.chat_template.as_deref().map(ChatTemplate::new).transpose()?;
        let digest = Self::digest_of(&files);
        let (segmenter, segments_off) = match Segmenter::new(&tokenizer) {
            Ok(s) => (Some(s), None),
            Err(why) => (None, Some(why)),
        };
        let (chunker, long_text_off) = match &segmenter {
            None => (None, Some("text is split at added tokens first, and that is off".to_owned())),
            Some(_) => match Chunker::new(&tokenizer, &files.tokenizer_json, DEFAULT_CHUNK_BYTES) {
                Ok(c) => (Some(c), None),
                Err(why) => (None, Some(why)),
            },
        };
        let (fast, fast_off) = match FastBpe::new(&tokenizer, &files.tokenizer_json) {
            Ok(f) => (Some(f), None),
            Err(why) => (None, Some(why)),
        };
        Ok(Self {
            tokenizer,
            template,
            files,
            digest,
            segmenter,
            segments_off,
            chunker,
            long_text_off,
            fast,
            fast_off,
            segment_cache: SegmentCache::new(DEFAULT_CACHE_TOKENS),
            segment_hits: AtomicU64::new(0),
            segment_misses: AtomicU64::new(0),
        })
    }

    /// Sets the chat-segment cache's capacity in token ids (0: no cache; the split still applies). Default
    /// [`segments::DEFAULT_CACHE_TOKENS`].
    pub fn with_segment_cache_tokens(mut self, capacity_tokens: usize) -> Self {
        self.segment_cache = SegmentCache::new(capacity_tokens);
        self
    }

    /// Sets the target chunk length of long text stretches in bytes (at least 1; stretches shorter than two chunks
    /// are not cut). Default [`long_text::DEFAULT_CHUNK_BYTES`].
    pub fn with_long_text_chunk_bytes(mut self, chunk_bytes: usize) -> Self {
        self.chunker = self.chunker.map(|c| c.with_chunk_bytes(chunk_bytes));
        self
    }

    /// Why rendered chats are tokenized whole instead of piece by piece through the cache (`None`: they are not).
    pub fn segment_cache_off(&self) -> Option<&str> {
        self.segments_off.as_deref()
    }

    /// Why long text stretches are tokenized whole instead of in cached chunks (`None`: they are not).
    pub fn long_text_off(&self) -> Option<&str> {
        self.long_text_off.as_deref()
    }

    /// Why stretches of text go through `Tokenizer::encode` rather than the fast byte-level BPE path (`None`: they
    /// do not).
    pub fn fast_path_off(&self) -> Option<&str> {
        self.fast_off.as_deref()
    }

    /// Segment cache hits and misses so far (chat stretches and long-text chunks).
    pub fn segment_cache_stats(&self) -> CacheStats {
        CacheStats {
            hits: self.segment_hits.load(Ordering::Relaxed),
            misses: self.segment_misses.load(Ordering::Relaxed),
        }
    }

    /// xxh3-64 over every part that influences token ids, length-prefixed.
    fn digest_of(files: &TokenizerFiles) -> u64 {
        let mut h = Xxh3::new();
        h.update(b"kvgate/tokenizer-digest/v1");
        for part in [
            Some(&files.tokenizer_json),
            files.chat_template.as_ref(),
            files.bos_token.as_ref(),
            files.eos_token.as_ref(),
        ] {
            match part {
                Some(s) => {
                    h.update(&[1]);
                    h.update(&(s.len() as u64).to_le_bytes());
                    h.update(s.as_bytes());
                }
                None => h.update(&[0]),
            }
        }
        h.digest()
    }

    /// Digest of the tokenizer and template: the `tokenizer_digest` of the hash scheme.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// The parts this prompter was built from.
    pub fn files(&self) -> &TokenizerFiles {
        &self.files
    }

    /// Whether chat requests can be served.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Ids known to the tokenizer, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Id of a token string (e.g. the EOS token).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Id of the configured EOS token.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.files.eos_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// Renders a conversation with the chat template.
    pub fn render_chat(&self, messages: &[Json], options: &ChatOptions) -> Result<String, PromptError> {
        let template = self.template.as_ref().ok_or(PromptError::NoChatTemplate)?;
        if messages.is_empty() {
            return Err(PromptError::InvalidConversation("messages must not be empty".into()));
        }
        let messages: Vec<Json> = messages.iter().map(flatten_content).collect::<Result<_, _>>()?;
        let mut ctx = serde_json::Map::new();
        if let Some(extra) = &options.extra {
            ctx.extend(extra.clone());
        }
        ctx.insert("messages".into(), Json::Array(messages));
        ctx.insert("add_generation_prompt".into(), Json::Bool(options.add_generation_prompt));
        ctx.insert("bos_token".into(), Json::String(self.files.bos_token.clone().unwrap_or_default()));
        ctx.insert("eos_token".into(), Json::String(self.files.eos_token.clone().unwrap_or_default()));
        if let Some(tools) = &options.tools {
            ctx.insert("tools".into(), tools.clone());
        }
        let final_content = match options.continue_final_message {
            true => match ctx["messages"].as_array().and_then(|m| m.last()).and_then(|m| m.get("content")) {
                Some(Json::String(c)) => Some(c.clone()),
                _ => {
                    return Err(PromptError::InvalidConversation(
                        "continue_final_message needs a final message with text content".into(),
                    ))
                }
            },
            false => None,
        };
        let rendered = template.render(minijinja::Value::from_serialize(Json::Object(ctx)))?;
        match final_content {
            None => Ok(rendered),
            Some(c) => cut_after_final(rendered, &c),
        }
    }

    /// Tokenizes text; `add_special_tokens` runs the post-processor (BOS for Llama-style tokenizers).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        let enc = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| PromptError::InvalidPrompt(format!("cannot tokenize: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Turns ids back into text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, PromptError> {
        self.tokenizer.decode(ids, skip_special_tokens).map_err(|e| PromptError::Tokenizer(e.to_string()))
    }

    /// The token ids of a prompt: the function both sides call.
    pub fn tokenize(&self, input: &PromptInput<'_>) -> Result<Vec<u32>, PromptError> {
        match input {
            PromptInput::Text(text) => {
                let (Some(seg), Some(chunker)) = (&self.segmenter, &self.chunker) else {
                    return self.encode(text, true);
                };
                // The post-processor's ids around the text's, which come piece by piece through the cache.
                let (before, after) = chunker.specials();
                let mut ids = before.to_vec();
                ids.extend(self.cached_encode(seg, text)?);
                ids.extend_from_slice(after);
                Ok(ids)
            }
            PromptInput::TokenIds(ids) => {
                if ids.is_empty() {
                    return Err(PromptError::InvalidPrompt("prompt must not be empty".into()));
                }
                Ok(ids.to_vec())
            }
            PromptInput::Chat { messages, options } => {
                let text = self.render_chat(messages, options)?;
                let Some(seg) = &self.segmenter else { return self.encode(&text, false) };
                self.cached_encode(seg, &text)
            }
        }
    }

    fn encoder(&self) -> Encoder<'_> {
        Encoder { tokenizer: &self.tokenizer, fast: self.fast.as_ref() }
    }

    /// `text` without special tokens added, piece by piece through the segment cache.
    fn cached_encode(&self, seg: &Segmenter, text: &str) -> Result<Vec<u32>, PromptError> {
        let mut stats = CacheStats::default();
        let ids = self
            .segment_cache
            .encode(seg, self.chunker.as_ref(), self.encoder(), text, &mut stats)
            .map_err(|e| PromptError::InvalidPrompt(format!("cannot tokenize: {e}")))?;
        self.segment_hits.fetch_add(stats.hits, Ordering::Relaxed);
        self.segment_misses.fetch_add(stats.misses, Ordering::Relaxed);
        Ok(ids)
    }
}

/// OpenAI content may be a list of parts; templates written for text expect a string. Text parts are joined with
/// newlines (as vLLM does for string-format templates); any other part type is refused.
/// The rendered chat up to the end of the final message's content (its last occurrence; stripped of surrounding
/// whitespace when the template trimmed it), as `transformers`' `apply_chat_template(continue_final_message=True)`.
fn cut_after_final(mut rendered: String, content: &str) -> Result<String, PromptError> {
    let end = match rendered.rfind(content) {
        Some(i) => i + content.len(),
        None => {
            let trimmed = content.trim();
            let i = rendered.rfind(trimmed).filter(|_| !trimmed.is_empty()).ok_or_else(|| {
                PromptError::InvalidConversation(
                    "continue_final_message: the final message does not appear in the rendered chat".into(),
                )
            })?;
            i + trimmed.len()
        }
    };
    rendered.truncate(end);
    Ok(rendered)
}

fn flatten_content(message: &Json) -> Result<Json, PromptError> {
    let Json::Object(obj) = message else {
        return Err(PromptError::InvalidConversation("each message must be an object".into()));
    };
    match obj.get("role") {
        Some(Json::String(_)) => {}
        _ => return Err(PromptError::InvalidConversation("each message needs a string 'role'".into())),
    }
    let Some(Json::Array(parts)) = obj.get("content") else {
        return Ok(message.clone());
    };
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        match (part.get("type").and_then(Json::as_str), part.get("text").and_then(Json::as_str)) {
            (Some("text"), Some(t)) => texts.push(t),
            (kind, _) => {
                return Err(PromptError::InvalidConversation(format!(
                    "content part of type {} is not supported (text only)",
                    kind.unwrap_or("<missing>")
                )))
            }
        }
    }
    let mut out = obj.clone();
    out.insert("content".into(), Json::String(texts.join("\n")));
    Ok(Json::Object(out))
}

#[cfg(test)]
mod long_text_tests;
#[cfg(test)]
mod pretok_tests;
#[cfg(test)]
mod tests;
