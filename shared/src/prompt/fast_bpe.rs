//! A faster exact path for the text of byte-level BPE tokenizers (the GPT-2, Llama-3 and Qwen2 families).
//!
//! `Tokenizer::encode` keeps a normalized string with per-byte alignments through every step, which costs more than
//! the BPE itself (about 7 MB/s of pre-tokenization on this project's 2-core machine). For a stretch of text with no
//! added tokens in it, the ids are determined by three steps only: the pre-tokenizer's regex splits the text (each
//! match and each gap between matches is a piece), each piece's bytes are mapped to the ByteLevel alphabet, and the
//! BPE model turns each mapped piece into ids. [`FastBpe`] runs exactly those steps, the split by the same regex
//! engine (Oniguruma, which `tokenizers` uses) or an equivalent scanner for the common patterns (`pretok.rs`), and
//! the tokenizer's own model, and nothing else.
//!
//! Pieces repeat (a language's frequent words), so their ids are kept in a bounded word cache keyed by the piece's
//! text ([`WORD_CACHE_PIECES`] pieces of at most [`WORD_CACHE_MAX_BYTES`] bytes, in two generations; keyed SipHash,
//! so client text cannot aim collisions at it).
//!
//! Accepted only for the structures where those are all the steps: no normalizer, a BPE model, and a pre-tokenizer
//! that is `ByteLevel` with its GPT-2 regex, or a `Split` by a regex (isolated, not inverted) followed by a
//! `ByteLevel` without its regex, neither adding a prefix space; and only if a self-check on probe texts gives the
//! tokenizer's own ids. Everything else uses `Tokenizer::encode`.

use std::collections::HashMap;
use std::hash::RandomState;
use std::sync::{Arc, Mutex};

use serde_json::Value as Json;
use tokenizers::{Model, Tokenizer};

use super::pretok::{PreTokenizer, GPT2_PATTERN};
use super::synth::byte_to_char;

/// Pieces the word cache holds at most (two generations of half each).
pub const WORD_CACHE_PIECES: usize = 1 << 16;
/// Longer pieces are not cached.
pub const WORD_CACHE_MAX_BYTES: usize = 64;

/// The pre-tokenizer's regex and the ByteLevel alphabet.
pub struct FastBpe {
    pre: PreTokenizer,
    b2c: [char; 256],
    words: WordCache,
}

type WordMap = HashMap<Box<str>, Arc<[u32]>, RandomState>;

/// Ids of recent pieces: a hit in the older generation is promoted; when the newer fills, the older is dropped.
struct WordCache {
    inner: Mutex<(WordMap, WordMap)>,
}

impl WordCache {
    fn new() -> Self {
        // Keyed SipHash (std's RandomState): the keys are client text.
        let map = || WordMap::with_capacity_and_hasher(WORD_CACHE_PIECES / 2, RandomState::new());
        Self { inner: Mutex::new((map(), map())) }
    }

    fn get(&self, piece: &str) -> Option<Arc<[u32]>> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ids) = g.0.get(piece) {
            return Some(ids.clone());
        }
        let (k, ids) = g.1.remove_entry(piece)?;
        Self::put(&mut g, k, ids.clone());
        Some(ids)
    }

    fn insert(&self, piece: &str, ids: Arc<[u32]>) {
        if piece.len() <= WORD_CACHE_MAX_BYTES {
            Self::put(&mut self.inner.lock().unwrap_or_else(|e| e.into_inner()), piece.into(), ids);
        }
    }

    fn put(g: &mut (WordMap, WordMap), k: Box<str>, ids: Arc<[u32]>) {
        if g.0.len() >= WORD_CACHE_PIECES / 2 {
            let fresh = WordMap::with_capacity_and_hasher(WORD_CACHE_PIECES / 2, g.1.hasher().clone());
            g.1 = std::mem::replace(&mut g.0, fresh);
        }
        g.0.insert(k, ids);
    }
}

impl std::fmt::Debug for FastBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastBpe").finish_non_exhaustive()
    }
}

impl FastBpe {
    /// The fast path for `tokenizer` (whose `tokenizer.json` is `json`), or why it would not be exact.
    pub fn new(tokenizer: &Tokenizer, json: &str) -> Result<Self, String> {
        let j: Json = serde_json::from_str(json).map_err(|e| format!("tokenizer.json: {e}"))?;
        if !j.get("normalizer").is_none_or(Json::is_null) {
            return Err("the tokenizer has a normalizer".into());
        }
        if j.pointer("/model/type").and_then(Json::as_str) != Some("BPE") {
            return Err("the model is not BPE".into());
        }
        let pattern = pattern_of(j.get("pre_tokenizer").unwrap_or(&Json::Null))?;
        let fast = Self { pre: PreTokenizer::new(&pattern)?, b2c: byte_to_char(), words: WordCache::new() };
        fast.self_check(tokenizer)?;
        Ok(fast)
    }

    /// Appends the ids of `text` (a stretch without added tokens, no special tokens added) to `out`.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        let model = tokenizer.get_model();
        let mut word = String::new();
        let piece = |s: &str| -> Result<(), String> {
            if let Some(ids) = self.words.get(s) {
                out.extend_from_slice(&ids);
                return Ok(());
            }
            word.clear();
            word.extend(s.bytes().map(|b| self.b2c[b as usize]));
            let ids: Arc<[u32]> =
                model.tokenize(&word).map_err(|e| e.to_string())?.into_iter().map(|t| t.id).collect();
            out.extend_from_slice(&ids);
            self.words.insert(s, ids);
            Ok(())
        };
        self.pre.split(text, piece)
    }

    /// Compares with `Tokenizer::encode` on the long-text self-check's texts and the probes of every character class.
    fn self_check(&self, tokenizer: &Tokenizer) -> Result<(), String> {
        for t in super::long_text::probe_texts() {
            let want = tokenizer.encode(t.as_str(), false).map_err(|e| e.to_string())?;
            let mut got = Vec::new();
            self.encode(tokenizer, &t, &mut got)?;
            if got != want.get_ids() {
                return Err(format!("the fast path differs from the tokenizer on {t:?}"));
            }
        }
        Ok(())
    }
}

/// The regex that makes the pieces, for the accepted pre-tokenizer structures.
fn pattern_of(pre: &Json) -> Result<String, String> {
    let byte_level = |p: &Json, regex: bool| {
        p.get("type").and_then(Json::as_str) == Some("ByteLevel")
            && p.get("add_prefix_space").and_then(Json::as_bool) == Some(false)
            && p.get("use_regex").and_then(Json::as_bool).unwrap_or(true) == regex
    };
    if byte_level(pre, true) {
        return Ok(GPT2_PATTERN.to_owned());
    }
    let seq = match pre.get("type").and_then(Json::as_str) {
        Some("Sequence") => pre.get("pretokenizers").and_then(Json::as_array),
        _ => None,
    };
    if let Some([split, bl]) = seq.map(Vec::as_slice) {
        let regex = split.pointer("/pattern/Regex").and_then(Json::as_str);
        if split.get("type").and_then(Json::as_str) == Some("Split")
            && split.get("behavior").and_then(Json::as_str) == Some("Isolated")
            && split.get("invert").and_then(Json::as_bool) == Some(false)
            && byte_level(bl, false)
        {
            if let Some(r) = regex {
                return Ok(r.to_owned());
            }
        }
    }
    Err("the pre-tokenizer is not ByteLevel, or a regex Split then ByteLevel".into())
}
