//! A real byte-level BPE tokenizer and a Llama-3-style chat template, synthesised deterministically from a seed.
//!
//! No model hub is reachable here, so test and demo models bring their own tokenizer: the merges are learnt by a
//! small BPE trainer on a seeded pseudo-language corpus and written in the Hugging Face `tokenizer.json` format
//! (ByteLevel pre-tokenizer and decoder, BPE model, a post-processor that prepends `<|begin_of_text|>`), loaded by
//! the `tokenizers` crate like any hub tokenizer.

use std::collections::HashMap;

use serde_json::{json, Value};

/// Beginning-of-text token (prepended by the post-processor and by the chat template).
pub const BOS_TOKEN: &str = "<|begin_of_text|>";
/// End of a generated turn: the synthetic models' EOS.
pub const EOT_TOKEN: &str = "<|eot_id|>";
/// Special tokens, in id order after the BPE vocabulary.
pub const SPECIAL_TOKENS: [&str; 5] =
    [BOS_TOKEN, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", EOT_TOKEN];

/// The Llama-3-style template of synthetic models (no date line, so rendering never depends on the clock).
pub const CHAT_TEMPLATE: &str = "{{- bos_token }}\n\
{%- for message in messages %}\n\
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n\
        {{- raise_exception('unknown role: ' ~ message['role']) }}\n\
    {%- endif %}\n\
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n\
{%- endfor %}\n\
{%- if add_generation_prompt %}\n\
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n\
{%- endif %}\n";

/// The files of a synthesised tokenizer.
#[derive(Clone, Debug)]
pub struct SynthTokenizer {
    /// `tokenizer.json`.
    pub tokenizer_json: String,
    /// `tokenizer_config.json` (with `chat_template`, `bos_token`, `eos_token`).
    pub tokenizer_config_json: String,
    /// Total ids, special tokens included.
    pub vocab_size: usize,
    /// Id of [`EOT_TOKEN`].
    pub eos_token_id: u32,
    /// Id of [`BOS_TOKEN`].
    pub bos_token_id: u32,
}

/// GPT-2's reversible map from bytes to printable characters (the ByteLevel alphabet).
pub fn byte_to_char() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            b
        } else {
            extra += 1;
            255 + extra
        };
        out[b as usize] = char::from_u32(c).unwrap_or('?');
    }
    out
}

/// splitmix64: a tiny, well-known deterministic generator (no dependency, identical on every platform).
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

const SYLLABLES: [&str; 40] = [
    "ka", "ri", "to", "ne", "sa", "lo", "mi", "du", "ve", "po", "an", "el", "is", "or", "um", "th", "ing",
    "er", "qu", "st", "re", "co", "de", "la", "ti", "on", "ma", "ex", "pr", "bl", "gr", "ch", "sh", "wa",
    "yo", "zi", "fe", "hu", "ju", "ba",
];
const PUNCT: [&str; 8] = [",", ".", "?", "!", ":", ";", "\n", " -"];

/// A seeded pseudo-language: a Zipf-like lexicon (word k drawn with weight 1/(k+1)), punctuation, numbers.
struct Language {
    rng: SplitMix64,
    lexicon: Vec<String>,
    cumulative: Vec<f64>,
}

impl Language {
    fn new(seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let lexicon: Vec<String> = (0..3000)
            .map(|_| {
                let n = 1 + rng.below(4) as usize;
                (0..n).map(|_| SYLLABLES[rng.below(SYLLABLES.len() as u64) as usize]).collect()
            })
            .collect();
        let mut cumulative = Vec::with_capacity(lexicon.len());
        let mut total = 0.0;
        for k in 0..lexicon.len() {
            total += 1.0 / (k + 1) as f64;
            cumulative.push(total);
        }
        Self { rng, lexicon, cumulative }
    }

    /// The next piece: punctuation (8%), a number (3%) or a word with its leading space (sometimes capitalised).
    fn piece(&mut self) -> String {
        let rng = &mut self.rng;
        let roll = rng.unit();
        if roll < 0.08 {
            PUNCT[rng.below(PUNCT.len() as u64) as usize].to_string()
        } else if roll < 0.11 {
            format!(" {}", rng.below(1000))
        } else {
            let total = self.cumulative.last().copied().unwrap_or(1.0);
            let target = rng.unit() * total;
            let k = self.cumulative.partition_point(|c| *c < target).min(self.lexicon.len() - 1);
            let w = &self.lexicon[k];
            if rng.below(10) == 0 {
                let mut c = w.chars();
                let first = c.next().map(|f| f.to_ascii_uppercase()).unwrap_or('A');
                format!(" {first}{}", c.as_str())
            } else {
                format!(" {w}")
            }
        }
    }
}

/// The pre-tokenized pieces of a seeded pseudo-language corpus, with their counts, in a fixed order.
fn corpus_pieces(seed: u64, n_pieces: usize) -> Vec<(String, u64)> {
    let mut lang = Language::new(seed);
    let mut counts: HashMap<String, u64> = HashMap::new();
    for _ in 0..n_pieces {
        *counts.entry(lang.piece()).or_default() += 1;
    }
    let mut pieces: Vec<(String, u64)> = counts.into_iter().collect();
    pieces.sort();
    pieces
}

/// About `n_pieces` words, punctuation and numbers of the language a [`synth_tokenizer`] of the same `seed` was
/// trained on, drawn from `text_seed`: prose-like text (frequent words repeat, as in natural language), where
/// [`synth_text`] draws every word anew.
pub fn synth_prose(seed: u64, text_seed: u64, n_pieces: usize) -> String {
    let mut lang = Language::new(seed);
    lang.rng = SplitMix64::new(text_seed ^ 0x9805_E000);
    let mut s = String::new();
    for _ in 0..n_pieces {
        s.push_str(&lang.piece());
    }
    s.trim_start().to_owned()
}

/// Learns up to `n_merges` BPE merges over byte-level symbols; ties go to the lexicographically smallest pair.
/// Symbols are interned as integers so each round is one counting pass over the distinct pieces.
fn learn_merges(pieces: &[(String, u64)], n_merges: usize, b2c: &[char; 256]) -> Vec<(String, String)> {
    let mut names: Vec<String> = b2c.iter().map(|c| c.to_string()).collect();
    let mut words: Vec<(Vec<u32>, u64)> =
        pieces.iter().map(|(p, n)| (p.bytes().map(u32::from).collect(), *n)).collect();
    let mut merges = Vec::with_capacity(n_merges);
    let mut counts: HashMap<(u32, u32), u64> = HashMap::new();
    while merges.len() < n_merges {
        counts.clear();
        for (syms, n) in &words {
            for pair in syms.windows(2) {
                *counts.entry((pair[0], pair[1])).or_default() += n;
            }
        }
        let best = counts
            .iter()
            .filter(|(_, c)| **c >= 2)
            .max_by(|(pa, ca), (pb, cb)| {
                let key = |p: &(u32, u32)| (names[p.0 as usize].clone(), names[p.1 as usize].clone());
                ca.cmp(cb).then_with(|| {
                    if ca == cb {
                        key(pb).cmp(&key(pa)).then(pb.cmp(pa))
                    } else {
                        std::cmp::Ordering::Equal
                    }
                })
            })
            .map(|(p, _)| *p);
        let Some((a, b)) = best else { break };
        let joined = names.len() as u32;
        names.push(format!("{}{}", names[a as usize], names[b as usize]));
        for (syms, _) in &mut words {
            let mut i = 0;
            while i + 1 < syms.len() {
                if syms[i] == a && syms[i + 1] == b {
                    syms[i] = joined;
                    syms.remove(i + 1);
                }
                i += 1;
            }
        }
        merges.push((names[a as usize].clone(), names[b as usize].clone()));
    }
    merges
}

/// Synthesises a byte-level BPE tokenizer with at most `vocab_size` ids (special tokens included; at least 261).
pub fn synth_tokenizer(vocab_size: usize, seed: u64) -> SynthTokenizer {
    let b2c = byte_to_char();
    let mut alphabet: Vec<char> = b2c.to_vec();
    alphabet.sort();
    let n_merges = vocab_size.saturating_sub(256 + SPECIAL_TOKENS.len());
    let pieces = corpus_pieces(seed, 20_000 + 40 * n_merges);
    let merges = learn_merges(&pieces, n_merges, &b2c);

    let mut vocab = serde_json::Map::new();
    for c in &alphabet {
        vocab.insert(c.to_string(), json!(vocab.len()));
    }
    for (a, b) in &merges {
        let joined = format!("{a}{b}");
        if !vocab.contains_key(&joined) {
            vocab.insert(joined, json!(vocab.len()));
        }
    }
    let first_special = vocab.len() as u32;
    let added: Vec<Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": first_special + i as u32, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let bos_id = first_special;
    let eos_id = first_special + 4;
    let merges_json: Vec<Value> = merges.iter().map(|(a, b)| json!(format!("{a} {b}"))).collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": BOS_TOKEN, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [bos_id], "tokens": [BOS_TOKEN]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges_json}
    });
    let decoder: serde_json::Map<String, Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                (first_special as usize + i).to_string(),
                json!({"content": t, "lstrip": false, "normalized": false,
                "rstrip": false, "single_word": false, "special": true}),
            )
        })
        .collect();
    let config = json!({
        "added_tokens_decoder": decoder,
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast"
    });
    SynthTokenizer {
        tokenizer_json: serde_json::to_string_pretty(&tokenizer).unwrap_or_default(),
        tokenizer_config_json: serde_json::to_string_pretty(&config).unwrap_or_default(),
        vocab_size: first_special as usize + SPECIAL_TOKENS.len(),
        eos_token_id: eos_id,
        bos_token_id: bos_id,
    }
}

/// Deterministic pseudo-language text of about `n_words` words (for tests and workloads).
pub fn synth_text(seed: u64, n_words: usize) -> String {
    corpus_pieces_text(seed, n_words)
}

fn corpus_pieces_text(seed: u64, n_words: usize) -> String {
    let mut rng = SplitMix64::new(seed ^ 0x5EED);
    let mut s = String::new();
    for i in 0..n_words {
        let n = 1 + rng.below(3) as usize;
        if i > 0 {
            s.push(' ');
        }
        for _ in 0..n {
            s.push_str(SYLLABLES[rng.below(SYLLABLES.len() as u64) as usize]);
        }
        if rng.below(12) == 0 {
            s.push_str(PUNCT[rng.below(6) as usize]);
        }
    }
    s
}
