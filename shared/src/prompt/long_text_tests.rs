//! Long text cut into cached chunks: exact against whole-text encoding (for the GPT-2 and the Llama-3 pre-tokenizer
//! regexes), prefix-stable, cached, and off for tokenizers the argument does not cover.

use super::long_text::cut_points;
use super::*;
use proptest::prelude::*;
use serde_json::json;
use std::sync::OnceLock;

/// The Llama-3 / Qwen2 pre-tokenizer pattern.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn synth_files(edit: impl FnOnce(&mut Json)) -> TokenizerFiles {
    static T: OnceLock<SynthTokenizer> = OnceLock::new();
    let t = T.get_or_init(|| synth_tokenizer(700, 7));
    let mut tj: Json = serde_json::from_str(&t.tokenizer_json).expect("json");
    whitespace_merges(&mut tj);
    edit(&mut tj);
    TokenizerFiles {
        tokenizer_json: tj.to_string(),
        chat_template: Some(CHAT_TEMPLATE.into()),
        bos_token: Some(BOS_TOKEN.into()),
        eos_token: Some(EOT_TOKEN.into()),
    }
}

/// Adds merges of whitespace runs and of whitespace with the next character (`Ġ` space, `Ċ` newline, `ĉ` tab, `č`
/// carriage return in the ByteLevel alphabet), so that a cut in the wrong place changes the ids: a vocabulary
/// without them would tokenize "\n\n" as two newlines either way and hide a wrong cut.
fn whitespace_merges(tj: &mut Json) {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for a in ["Ġ", "Ċ", "ĉ", "č"] {
        for b in ["Ġ", "Ċ", "ĉ", "č", "a", "e", "1", "."] {
            pairs.push((a.into(), b.into()));
        }
    }
    pairs.extend(
        [("ĠĠ", "Ġ"), ("ĊĊ", "Ċ"), ("Ġ", "ĊĊ"), ("1", "2"), ("12", "3"), (".", "Ċ")]
            .map(|(a, b)| (a.into(), b.into())),
    );
    let vocab = tj["model"]["vocab"].as_object_mut().expect("vocab");
    let mut next = vocab.len() as u64 + 16;
    let mut merges = Vec::new();
    for (a, b) in pairs {
        let joined = format!("{a}{b}");
        if !vocab.contains_key(&joined) {
            vocab.insert(joined, json!(next));
            next += 1;
            merges.push(json!(format!("{a} {b}")));
        }
    }
    let m = tj["model"]["merges"].as_array_mut().expect("merges");
    // First, so they win over the learnt ones.
    merges.append(m);
    *m = merges;
}

/// The synthetic tokenizer (GPT-2's ByteLevel regex).
fn gpt2() -> Prompter {
    Prompter::from_files(synth_files(|_| {})).expect("loads")
}

/// The synthetic vocabulary behind Llama-3's split pattern.
fn llama3() -> Prompter {
    Prompter::from_files(synth_files(|tj| {
        tj["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]});
    }))
    .expect("loads")
}

fn text_ids(p: &Prompter, text: &str) -> Vec<u32> {
    p.tokenize(&PromptInput::Text(text)).expect("tokenizes")
}

#[test]
fn both_pre_tokenizer_families_pass_the_checks() {
    for p in [gpt2(), llama3()] {
        assert_eq!(p.long_text_off(), None);
        assert_eq!(p.fast_path_off(), None);
    }
    // A normalizer is outside the fast path's argument (the cut is still exact).
    let p = Prompter::from_files(synth_files(|tj| tj["normalizer"] = json!({"type": "NFC"}))).expect("loads");
    assert_eq!(p.long_text_off(), None);
    assert!(p.fast_path_off().is_some_and(|w| w.contains("normalizer")), "{:?}", p.fast_path_off());
    let text = synth_text(2, 3_000);
    assert_eq!(text_ids(&p, &text), p.encode(&text, true).expect("whole"));
}

#[test]
fn a_long_text_prompt_is_cut_exactly_and_an_extension_only_pays_for_its_new_part() {
    let p = gpt2();
    let seen = synth_text(3, 12_000);
    let want = p.encode(&seen, true).expect("whole");
    assert_eq!(text_ids(&p, &seen), want, "with BOS, identical to whole-text encoding");
    let chunks = cut_points(&seen, long_text::DEFAULT_CHUNK_BYTES).len() as u64 + 1;
    assert!(chunks > 10, "{} bytes in {chunks} chunks", seen.len());
    assert_eq!(p.segment_cache_stats(), CacheStats { hits: 0, misses: chunks });
    // The same prompt with a new question after it: every chunk but the last comes from the cache.
    let longer = format!("{seen} and then a new question about it, with more words {}", synth_text(4, 300));
    assert_eq!(text_ids(&p, &longer), p.encode(&longer, true).expect("whole"));
    let s = p.segment_cache_stats();
    assert_eq!(s.hits, chunks - 1, "{s:?}");
    assert!(s.misses <= chunks + 2, "only the changed tail is tokenized: {s:?}");
    // A long message in a chat is cut the same way (its chunks are cached already).
    let before = p.segment_cache_stats();
    let m = vec![json!({"role": "user", "content": seen})];
    let opts = ChatOptions { add_generation_prompt: true, ..ChatOptions::default() };
    let ids = p.tokenize(&PromptInput::Chat { messages: &m, options: &opts }).expect("tokenizes");
    assert_eq!(ids, p.encode(&p.render_chat(&m, &opts).expect("renders"), false).expect("whole"));
    assert!(p.segment_cache_stats().hits >= before.hits + chunks - 2);
}

#[test]
fn cuts_are_prefix_stable() {
    let base = synth_text(5, 4_000);
    let cuts = cut_points(&base, 512);
    assert!(cuts.len() > 20);
    for extra in [" tail", "\nNext line", ", and more", "x"] {
        let ext = cut_points(&format!("{base}{extra}"), 512);
        // Every cut of the shorter text is a cut of the longer one.
        assert_eq!(&ext[..cuts.len()], &cuts[..], "{extra:?}");
    }
}

#[test]
fn tokenizers_the_argument_does_not_cover_encode_long_text_whole() {
    type Edit = Box<dyn Fn(&mut Json)>;
    let cases: [(&str, Edit); 4] = [
        ("no pre-tokenizer", Box::new(|tj: &mut Json| tj["pre_tokenizer"] = Json::Null)),
        (
            "normalizer Prepend",
            Box::new(|tj: &mut Json| tj["normalizer"] = json!({"type": "Prepend", "prepend": "▁"})),
        ),
        (
            "sets truncation",
            Box::new(|tj: &mut Json| {
                tj["truncation"] = json!({"direction": "Right", "max_length": 100000, "strategy": "LongestFirst", "stride": 0})
            }),
        ),
        (
            "changes the ids",
            Box::new(
                |tj: &mut Json| tj["pre_tokenizer"] = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
            ),
        ),
    ];
    let text = synth_text(9, 3_000);
    for (why, edit) in cases {
        let p = Prompter::from_files(synth_files(edit)).expect("loads").with_long_text_chunk_bytes(64);
        let off = p.long_text_off().unwrap_or_default().to_owned();
        assert!(!off.is_empty(), "{why}: refused");
        assert_eq!(text_ids(&p, &text), p.encode(&text, true).expect("whole"), "{why}");
    }
}

/// Text made of pieces that put every kind of character next to spaces and newlines.
fn arb_text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            4 => "[a-zA-Z]{1,8}",
            3 => Just(" ".to_owned()),
            1 => "[ \t\n\r]{1,3}",
            1 => "[0-9]{1,6}",
            1 => "[.,;:!?()'\"\\-]{1,2}",
            1 => "(é|ü|日本語|🎉|\u{a0}|e\u{301}|ǅ|ß|Ⅻ|٣)",
            1 => "'(s|t|re|ve|m|ll|d|S)",
            1 => "<\\|(eot_id|start_header_id|begin_of_text)\\|>",
        ],
        0..400,
    )
    .prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Cut at (nearly) every cut point and through the cache, twice: the ids of the whole text, for both pattern
    /// families, with special-token look-alikes in the text.
    #[test]
    fn cut_tokenization_equals_whole_text_encoding(text in arb_text(), chunk in 0usize..3) {
        static P: OnceLock<Vec<Prompter>> = OnceLock::new();
        let all = P.get_or_init(|| {
            [1, 7, 64]
                .into_iter()
                .flat_map(|c| [gpt2().with_long_text_chunk_bytes(c), llama3().with_long_text_chunk_bytes(c)])
                .collect()
        });
        for p in &all[2 * chunk..2 * chunk + 2] {
            for _ in 0..2 {
                prop_assert_eq!(text_ids(p, &text), p.encode(&text, true).expect("whole"));
            }
        }
    }

    /// A text and its extension are cut alike up to the shorter one's last cut.
    #[test]
    fn cut_points_of_an_extension_start_with_the_texts(text in arb_text(), extra in arb_text(), chunk in 1usize..256) {
        let short = cut_points(&text, chunk);
        let long = cut_points(&format!("{text}{extra}"), chunk);
        prop_assert!(long.len() >= short.len());
        prop_assert_eq!(&long[..short.len()], &short[..]);
    }
}
