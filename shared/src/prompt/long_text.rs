//! Prefix-stable tokenization of long text: a completions prompt, or a long stretch of a chat, cut into chunks
//! whose ids are cached, so a prompt that extends one seen before only pays for its new part.
//!
//! A tokenizer with a pre-tokenizer splits text into pre-tokens first, and no token spans two of them. Some points
//! start a pre-token whatever the text around them is, for the regexes of byte-level BPE tokenizers (GPT-2's, and
//! the Llama-3 / Qwen2 pattern): no alternative of theirs matches a solid character followed by a whitespace, nor a
//! newline followed by a solid character, so
//! - a space between two solid characters (a letter, a digit or ASCII punctuation): `word| word`;
//! - the point after a newline between two solid characters: `line\n|Next`
//!
//! end a pre-token before them and start one after. There the ids of the text are the ids of the part before
//! followed by the ids of the part after (the part before ends in a solid character or a single newline, which no
//! lookahead reads differently at the end of a text). [`cut_points`] takes the first such point at least
//! `chunk_bytes` after the previous cut, from the start of the text: where two texts share a beginning, their cuts
//! are the same up to where they differ, so a prompt that extends a seen one is made of the same chunks.
//!
//! Exactness is the contract (block hashes on the gateway and the worker depend on it), so [`Chunker::new`]
//! accepts a tokenizer only if its structure allows the argument (a pre-tokenizer; no normalizer beyond Unicode
//! normal forms and lowercasing, which never join a space or a newline to a neighbour; no truncation, padding or
//! BPE dropout) and a self-check agrees: texts of words, spaces, newlines, digits, punctuation, contractions,
//! non-ASCII and emoji, encoded whole and cut at every candidate point, give the same ids. A tokenizer that fails
//! keeps whole-text encoding (the reason is logged at start). A post-processor (BOS for Llama-style tokenizers) is
//! applied as the ids it adds before and after a text, also checked at load.

use serde_json::Value as Json;
use tokenizers::Tokenizer;

use super::synth::SplitMix64;

/// Default target chunk length in bytes (about a thousand tokens of English text). Stretches shorter than two
/// chunks are not cut.
pub const DEFAULT_CHUNK_BYTES: usize = 2048;

/// A character that ends or starts a pre-token next to a space or a newline (see the module docs).
fn solid(c: char) -> bool {
    c.is_alphanumeric() || c.is_ascii_punctuation()
}

/// Whether the text can be cut at byte `i` (a char boundary): before a space between two solid characters, or
/// after a newline between two solid characters.
fn cut_at(text: &str, i: usize) -> bool {
    let bytes = text.as_bytes();
    if i == 0 || i >= bytes.len() {
        return false;
    }
    let after = |at: usize| text[at..].chars().next().is_some_and(solid);
    let before = |at: usize| text[..at].chars().next_back().is_some_and(solid);
    match (bytes[i - 1], bytes[i]) {
        (_, b' ') => before(i) && after(i + 1),
        (b'\n', _) => i >= 2 && before(i - 1) && after(i),
        _ => false,
    }
}

/// Where to cut `text`: the first cut point at least `chunk_bytes` after the previous cut (or the start), each in
/// turn. A function of the text up to one character past each cut, so shared beginnings are cut alike.
pub fn cut_points(text: &str, chunk_bytes: usize) -> Vec<usize> {
    let bytes = text.as_bytes();
    let mut cuts = Vec::new();
    let mut from = chunk_bytes.max(1);
    while from < bytes.len() {
        // Candidates are a space (cut before it) or the byte after a newline.
        let Some(off) = bytes[from..].iter().position(|b| *b == b' ' || *b == b'\n') else { break };
        let at = from + off;
        let i = if bytes[at] == b'\n' { at + 1 } else { at };
        if i < bytes.len() && text.is_char_boundary(i) && cut_at(text, i) {
            cuts.push(i);
            from = i + chunk_bytes.max(1);
        } else {
            from = at + 1;
        }
    }
    cuts
}

/// Cuts long text for a tokenizer that allows it (see the module docs).
#[derive(Clone, Debug)]
pub struct Chunker {
    chunk_bytes: usize,
    /// Ids the post-processor puts before and after a single text (`encode(text, true)`).
    specials: (Vec<u32>, Vec<u32>),
}

impl Chunker {
    /// A chunker for `tokenizer` (whose `tokenizer.json` is `json`), cutting every `chunk_bytes`, or why cutting
    /// would not be exact for it.
    pub fn new(tokenizer: &Tokenizer, json: &str, chunk_bytes: usize) -> Result<Self, String> {
        let j: Json = serde_json::from_str(json).map_err(|e| format!("tokenizer.json: {e}"))?;
        structure_allows(&j)?;
        let specials = specials(tokenizer)?;
        let c = Self { chunk_bytes: chunk_bytes.max(1), specials };
        self_check(tokenizer)?;
        Ok(c)
    }

    /// The same chunker cutting every `chunk_bytes` (at least 1) instead.
    pub fn with_chunk_bytes(mut self, chunk_bytes: usize) -> Self {
        self.chunk_bytes = chunk_bytes.max(1);
        self
    }

    /// Stretches of at least this many bytes are cut.
    pub fn min_cut_len(&self) -> usize {
        2 * self.chunk_bytes
    }

    /// The chunks of `text` in order (one, the whole text, when it is short or has no cut point).
    pub fn chunks<'a>(&self, text: &'a str) -> Vec<&'a str> {
        if text.len() < self.min_cut_len() {
            return vec![text];
        }
        let mut out = Vec::new();
        let mut at = 0;
        for c in cut_points(text, self.chunk_bytes) {
            out.push(&text[at..c]);
            at = c;
        }
        out.push(&text[at..]);
        out
    }

    /// Ids the post-processor adds before and after a text.
    pub fn specials(&self) -> (&[u32], &[u32]) {
        (&self.specials.0, &self.specials.1)
    }
}

/// The parts of `tokenizer.json` the argument needs.
fn structure_allows(j: &Json) -> Result<(), String> {
    for key in ["truncation", "padding"] {
        if !j.get(key).is_none_or(Json::is_null) {
            return Err(format!("the tokenizer sets {key}"));
        }
    }
    if j.get("pre_tokenizer").is_none_or(Json::is_null) {
        return Err("the tokenizer has no pre-tokenizer (tokens may span spaces and newlines)".into());
    }
    if let Some(n) = j.get("normalizer").filter(|n| !n.is_null()) {
        normalizer_allows(n)?;
    }
    let dropout = j.pointer("/model/dropout").and_then(Json::as_f64).unwrap_or(0.0);
    if dropout != 0.0 {
        return Err(format!("the BPE model has dropout {dropout}"));
    }
    Ok(())
}

/// Normalizers that act on each character alone (never joining a space or a newline to a neighbour).
fn normalizer_allows(n: &Json) -> Result<(), String> {
    match n.get("type").and_then(Json::as_str) {
        Some("NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase") => Ok(()),
        Some("Sequence") => n
            .get("normalizers")
            .and_then(Json::as_array)
            .ok_or_else(|| "a Sequence normalizer without normalizers".to_owned())?
            .iter()
            .try_for_each(normalizer_allows),
        other => Err(format!("the normalizer {} may act across characters", other.unwrap_or("<untyped>"))),
    }
}

/// What the post-processor adds around a text: the same ids before and after every probe, or an error.
fn specials(tokenizer: &Tokenizer) -> Result<(Vec<u32>, Vec<u32>), String> {
    let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
    for probe in ["Hello world", "a", " 12 x\ny", "日本語 🎉"] {
        let with = encode(tokenizer, probe, true)?;
        let without = encode(tokenizer, probe, false)?;
        let at = (0..=with.len().saturating_sub(without.len()))
            .find(|&s| with[s..].starts_with(&without))
            .ok_or_else(|| format!("the post-processor changes the ids of {probe:?}"))?;
        let got = (with[..at].to_vec(), with[at + without.len()..].to_vec());
        match &found {
            Some(f) if *f != got => {
                return Err("the post-processor adds different ids to different texts".into())
            }
            _ => found = Some(got),
        }
    }
    let found = found.unwrap_or_default();
    if encode(tokenizer, "", true)? != [&found.0[..], &found.1[..]].concat() {
        return Err("the post-processor adds different ids to an empty text".into());
    }
    Ok(found)
}

fn encode(tokenizer: &Tokenizer, text: &str, special: bool) -> Result<Vec<u32>, String> {
    Ok(tokenizer.encode(text, special).map_err(|e| e.to_string())?.get_ids().to_vec())
}

/// The ids of `text` encoded chunk by chunk (no cache), cut at every cut point.
fn encode_cut(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    let mut at = 0;
    for c in cut_points(text, 1).into_iter().chain([text.len()]) {
        ids.extend(encode(tokenizer, &text[at..c], false)?);
        at = c;
    }
    Ok(ids)
}

/// Fragments of the self-check's texts: every kind of character next to spaces and newlines.
const FRAGMENTS: [&str; 28] = [
    "hello",
    " world",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    " \n",
    "12345",
    " 678",
    "3.14",
    ",",
    ".",
    "!",
    " (x)",
    "--",
    "don't",
    " I'm",
    " we'll",
    "'s",
    "é",
    " héllo",
    "日本語",
    " 🎉",
    "\r\n",
    "\u{a0}",
    "e\u{301}",
    "_snake_case",
];

/// Plain prose, then pseudo-random texts of [`FRAGMENTS`]: the self-checks' probes.
pub(super) fn probe_texts() -> Vec<String> {
    let mut rng = SplitMix64::new(0x10E6_7E47);
    let mut texts =
        vec!["The quick brown fox jumps over the lazy dog.\nA second line, with 42 numbers; and more.\nEnd"
            .to_owned()];
    for _ in 0..48 {
        let n = 20 + rng.below(60) as usize;
        texts.push((0..n).map(|_| FRAGMENTS[rng.below(FRAGMENTS.len() as u64) as usize]).collect());
    }
    texts
}

/// The probes encoded whole and cut at every cut point.
fn self_check(tokenizer: &Tokenizer) -> Result<(), String> {
    let texts = probe_texts();
    if cut_points(&texts[0], 1).is_empty() {
        return Err("no cut points in plain prose".into());
    }
    for t in &texts {
        if encode(tokenizer, t, false)? != encode_cut(tokenizer, t)? {
            return Err(format!("cut tokenization differs from the tokenizer's on {t:?}"));
        }
    }
    Ok(())
}
