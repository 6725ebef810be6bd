//! The pre-tokenizer scanners give the regex's pieces, on any text.

use super::pretok::{PreTokenizer, GPT2_PATTERN, LLAMA3_PATTERN};
use proptest::prelude::*;
use std::sync::OnceLock;

/// The regex's pieces: its matches and the gaps between them.
fn by_regex(pattern: &str, text: &str) -> Vec<String> {
    let re = onig::Regex::new(pattern).expect("regex");
    let mut out = Vec::new();
    let mut prev = 0;
    for (s, e) in re.find_iter(text) {
        if s > prev {
            out.push(text[prev..s].to_owned());
        }
        if e > s {
            out.push(text[s..e].to_owned());
        }
        prev = e;
    }
    if prev < text.len() {
        out.push(text[prev..].to_owned());
    }
    out
}

fn scanned(p: &PreTokenizer, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    p.split(text, |s| -> Result<(), ()> {
        out.push(s.to_owned());
        Ok(())
    })
    .expect("splits");
    out
}

fn both() -> &'static [(PreTokenizer, &'static str); 2] {
    static P: OnceLock<[(PreTokenizer, &'static str); 2]> = OnceLock::new();
    P.get_or_init(|| [GPT2_PATTERN, LLAMA3_PATTERN].map(|p| (PreTokenizer::new(p).expect("pattern"), p)))
}

#[test]
fn the_known_patterns_are_scanned_and_others_are_not() {
    assert!(both().iter().all(|(p, _)| p.scans()));
    assert!(!PreTokenizer::new(r"\w+|[^\w\s]+").expect("pattern").scans());
}

#[test]
fn corner_cases_split_as_the_regex_does() {
    let cases = [
        "",
        " ",
        "  ",
        "a  b",
        "a \n b",
        "x\n\n\ny",
        " \n  x",
        "'s 'S 're 'RE 'll 'Ll 'd 'x '",
        "'ſ 'ﬅ",
        "\tword \x0bword \x0cword",
        "123456 1234 12 a1b2",
        "٣٤٥ 12٣",
        "héllo wörld",
        " é",
        "foo.\n\nBar",
        "a\r\nb\r\n",
        "...\n\n",
        "\x1c\x1d x \x00\x7f",
        "\u{a0}x \u{a0} \u{2028}y",
        "end with space ",
        "end with newline\n",
        "日本語 テスト",
        "🎉🎉 x",
        "e\u{301} ",
        "ǅemal",
    ];
    for (p, pattern) in both() {
        for t in cases {
            assert_eq!(scanned(p, t), by_regex(pattern, t), "{pattern} on {t:?}");
        }
    }
}

fn arb_text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            4 => "[a-zA-Z]{1,6}",
            3 => "[ \t\n\r\x0b\x0c]{1,4}",
            2 => "[0-9]{1,7}",
            2 => "[!-/:-@\\[-`{-~]{1,3}",
            1 => "'[a-zA-Z]{0,3}",
            1 => "[\x00-\x1f\x7f]{1,2}",
            1 => "(é|ü|ſ|ﬅ|K|日本語|🎉|\u{a0}|\u{2028}|\u{85}|e\u{301}|ǅ|ß|Ⅻ|٣|\u{3000}|—)",
        ],
        0..60,
    )
    .prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn scanning_equals_the_regex(text in arb_text()) {
        for (p, pattern) in both() {
            prop_assert_eq!(scanned(p, &text), by_regex(pattern, &text), "{}", pattern);
        }
    }
}
