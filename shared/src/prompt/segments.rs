//! Tokenizing a rendered chat piece by piece, with the pieces cached.
//!
//! A tokenizer splits its input at added tokens (`<|start_header_id|>`, `<|eot_id|>`, ...) before anything else,
//! and tokenizes the text between them independently. So the ids of a rendered conversation are the
//! concatenation of: the id of each added token, and the ids of each stretch of text between two of them. In a
//! multi-turn chat every earlier message is such a stretch, identical turn after turn: [`SegmentCache`] keeps the
//! ids of recent stretches, so a conversation's history is tokenized once and each turn only pays for its new
//! message.
//!
//! Exactness is the contract (hash parity with the worker depends on it), so the split is used only where it
//! provably gives the tokenizer's own answer: every added token matched on the raw text (none normalized, none
//! stripping whitespace or restricted to single words), and a self-check at construction that compares the split
//! with whole-text encoding on probe texts (leading spaces, newlines, digits, non-ASCII, every added token between
//! text). A tokenizer that fails either check keeps plain encoding ([`Segmenter::new`] returns the reason).
//!
//! Cache bounds: at most `capacity_tokens` ids in all (two generations of half each: a hit in the older one is
//! promoted; when the newer one fills, the older one is dropped), keyed by the 128-bit xxh3 of the stretch's
//! bytes. Short stretches are cached too: a role name between two header tokens is a few bytes, but every message
//! has one and a call into the tokenizer costs microseconds however short its input, so a long conversation's
//! short stretches cost more to re-tokenize than its long ones cost to look up.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_128;

use super::fast_bpe::FastBpe;
use super::long_text::Chunker;

/// What turns a stretch of text (no added tokens in it) into ids: the tokenizer, through its fast byte-level BPE
/// path where it has one (`fast_bpe.rs`; the same ids).
#[derive(Clone, Copy)]
pub struct Encoder<'a> {
    pub tokenizer: &'a Tokenizer,
    pub fast: Option<&'a FastBpe>,
}

impl Encoder<'_> {
    /// Appends the ids of `text` to `out`.
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        match self.fast {
            Some(f) => f.encode(self.tokenizer, text, out),
            None => {
                out.extend_from_slice(
                    self.tokenizer.encode_fast(text, false).map_err(|e| e.to_string())?.get_ids(),
                );
                Ok(())
            }
        }
    }
}

/// Default capacity of the cache in token ids (about 16 MiB of ids).
pub const DEFAULT_CACHE_TOKENS: usize = 4 << 20;

/// Splits text at the tokenizer's added tokens.
pub struct Segmenter {
    matcher: AhoCorasick,
    /// Id of each pattern of `matcher`.
    ids: Vec<u32>,
}

/// A piece of a split text.
#[derive(Debug, PartialEq)]
pub enum Piece<'a> {
    Added(u32),
    Text(&'a str),
}

impl Segmenter {
    /// A segmenter for `tokenizer`, or why splitting would not be exact for it.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, String> {
        let mut added: Vec<(u32, tokenizers::AddedToken)> =
            tokenizer.get_added_tokens_decoder().into_iter().collect();
        added.sort_by_key(|(id, _)| *id);
        if added.is_empty() {
            return Err("the tokenizer has no added tokens".into());
        }
        if let Some((_, t)) = added.iter().find(|(_, t)| t.lstrip || t.rstrip || t.single_word) {
            return Err(format!(
                "added token {:?} strips whitespace or matches single words only",
                t.content
            ));
        }
        if tokenizer.get_normalizer().is_some() {
            if let Some((_, t)) = added.iter().find(|(_, t)| t.normalized) {
                return Err(format!("added token {:?} is matched after normalization", t.content));
            }
        }
        let matcher = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(added.iter().map(|(_, t)| t.content.as_str()))
            .map_err(|e| format!("cannot build the added-token matcher: {e}"))?;
        let seg = Self { matcher, ids: added.iter().map(|(id, _)| *id).collect() };
        seg.self_check(tokenizer, &added.iter().map(|(_, t)| t.content.clone()).collect::<Vec<_>>())?;
        Ok(seg)
    }

    /// The pieces of `text` in order.
    pub fn split<'a>(&self, text: &'a str) -> Vec<Piece<'a>> {
        let mut out = Vec::new();
        let mut at = 0;
        for m in self.matcher.find_iter(text) {
            if m.start() > at {
                out.push(Piece::Text(&text[at..m.start()]));
            }
            out.push(Piece::Added(self.ids[m.pattern().as_usize()]));
            at = m.end();
        }
        if at < text.len() {
            out.push(Piece::Text(&text[at..]));
        }
        out
    }

    /// Compares split encoding with the tokenizer's own on probe texts.
    fn self_check(&self, tokenizer: &Tokenizer, added: &[String]) -> Result<(), String> {
        let texts = [
            "Hello world",
            " leading space",
            "  two leading spaces and trailing  ",
            "\n\nnew lines\nin between\n",
            "digits 12345 6789 and 3.14159",
            "non-ASCII: héllo wörld ünïcödé 日本語 🎉",
            "code: fn main() { println!(\"hi\"); }",
            "\ttab\tseparated\t",
            "a",
            " ",
        ];
        let mut probes: Vec<String> = texts.iter().map(|t| t.to_string()).collect();
        for (i, tok) in added.iter().enumerate().take(64) {
            let a = texts[i % texts.len()];
            let b = texts[(i + 3) % texts.len()];
            probes.push(format!("{a}{tok}{b}"));
            probes.push(format!("{tok}{a}{tok}{tok}{b}"));
            probes.push(format!("{b}{tok}"));
        }
        for p in &probes {
            let whole = tokenizer.encode(p.as_str(), false).map_err(|e| e.to_string())?;
            let mut split = Vec::new();
            for piece in self.split(p) {
                match piece {
                    Piece::Added(id) => split.push(id),
                    Piece::Text(t) => {
                        let enc = tokenizer.encode(t, false).map_err(|e| e.to_string())?;
                        split.extend_from_slice(enc.get_ids());
                    }
                }
            }
            if whole.get_ids() != split.as_slice() {
                return Err(format!("split tokenization differs from the tokenizer's on {p:?}"));
            }
        }
        Ok(())
    }
}

/// Ids of recent text stretches (see the module docs for the bounds).
pub struct SegmentCache {
    capacity_tokens: usize,
    inner: Mutex<Generations>,
}

#[derive(Default)]
struct Generations {
    new: HashMap<u128, Arc<[u32]>>,
    new_tokens: usize,
    old: HashMap<u128, Arc<[u32]>>,
}

/// Hit and miss counts (for metrics and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
}

impl SegmentCache {
    pub fn new(capacity_tokens: usize) -> Self {
        Self { capacity_tokens, inner: Mutex::new(Generations::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Generations> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, key: u128) -> Option<Arc<[u32]>> {
        let mut g = self.lock();
        if let Some(ids) = g.new.get(&key) {
            return Some(ids.clone());
        }
        let ids = g.old.remove(&key)?;
        Self::put(&mut g, key, ids.clone(), self.capacity_tokens);
        Some(ids)
    }

    fn insert(&self, key: u128, ids: Arc<[u32]>) {
        if ids.len() > self.capacity_tokens / 2 {
            return;
        }
        Self::put(&mut self.lock(), key, ids, self.capacity_tokens);
    }

    fn put(g: &mut Generations, key: u128, ids: Arc<[u32]>, capacity: usize) {
        if g.new_tokens + ids.len() > capacity / 2 {
            g.old = std::mem::take(&mut g.new);
            g.new_tokens = 0;
        }
        g.new_tokens += ids.len();
        if let Some(prev) = g.new.insert(key, ids) {
            g.new_tokens -= prev.len();
        }
    }

    /// Ids held now (both generations).
    pub fn tokens(&self) -> usize {
        let g = self.lock();
        g.new_tokens + g.old.values().map(|v| v.len()).sum::<usize>()
    }

    /// Tokenizes `text` (no special tokens added) piece by piece through the cache; with a `chunker`, a long
    /// stretch between added tokens is cut into chunks (`long_text.rs`), each looked up on its own.
    pub fn encode(
        &self,
        seg: &Segmenter,
        chunker: Option<&Chunker>,
        enc: Encoder<'_>,
        text: &str,
        stats: &mut CacheStats,
    ) -> Result<Vec<u32>, String> {
        let mut out = Vec::new();
        for piece in seg.split(text) {
            match piece {
                Piece::Added(id) => out.push(id),
                Piece::Text(t) if self.capacity_tokens == 0 => enc.encode(t, &mut out)?,
                Piece::Text(t) => match chunker {
                    Some(c) if t.len() >= c.min_cut_len() => {
                        for chunk in c.chunks(t) {
                            self.encode_stretch(enc, chunk, &mut out, stats)?;
                        }
                    }
                    _ => self.encode_stretch(enc, t, &mut out, stats)?,
                },
            }
        }
        Ok(out)
    }

    /// Appends the ids of one stretch of text, from the cache or the tokenizer.
    fn encode_stretch(
        &self,
        enc: Encoder<'_>,
        t: &str,
        out: &mut Vec<u32>,
        stats: &mut CacheStats,
    ) -> Result<(), String> {
        let key = xxh3_128(t.as_bytes());
        if let Some(ids) = self.get(key) {
            stats.hits += 1;
            out.extend_from_slice(&ids);
        } else {
            stats.misses += 1;
            let from = out.len();
            enc.encode(t, out)?;
            self.insert(key, out[from..].into());
        }
        Ok(())
    }
}
