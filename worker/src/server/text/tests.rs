//! The streamed text against whole decoding, on the synthesized tokenizer (byte-level: multi-byte characters span
//! tokens, and random ids make invalid UTF-8).

use std::sync::{Arc, OnceLock};

use proptest::prelude::*;

use super::*;
use crate::model::synth::{synth_model, Preset, SynthSpec};

fn prompter() -> Arc<Prompter> {
    static P: OnceLock<Arc<Prompter>> = OnceLock::new();
    P.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tmp");
        synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 4)).expect("synth");
        Arc::new(Prompter::from_dir(dir.path()).expect("prompter"))
    })
    .clone()
}

/// Every delta of a stream over `ids`, the last push flushing.
fn stream(ids: &[u32], stops: &[&str]) -> Vec<String> {
    let mut s = TextStream::new(prompter(), stops.iter().map(|x| x.to_string()).collect());
    let mut out: Vec<String> = ids.iter().map(|t| s.push(Some(*t), false)).collect();
    out.push(s.push(None, true));
    out
}

#[test]
fn multi_byte_characters_stream_whole_and_equal_the_whole_decoding() {
    let p = prompter();
    let text = "héllo wörld: 世界 and 🙂🙂, naïve café";
    let ids = p.encode(text, false).expect("encode");
    let deltas = stream(&ids, &[]);
    assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
    assert_eq!(deltas.concat(), p.decode(&ids, true).expect("decode"));
}

#[test]
fn a_stop_string_ends_the_text_even_across_tokens() {
    let p = prompter();
    let ids = p.encode("one two STOP three STOP", false).expect("encode");
    let deltas = stream(&ids, &["STOP"]);
    assert_eq!(deltas.concat(), "one two ");
    // Not shown before it is known not to be a stop string's start: no delta ends inside "STOP".
    let ids = p.encode("abc ST", false).expect("encode");
    assert_eq!(stream(&ids, &["STOP"]).concat(), "abc ST", "at the end the held tail is flushed");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Random ids (invalid UTF-8 included): the deltas concatenate to the whole decoding, and each prefix shown
    /// is a prefix of it.
    #[test]
    fn deltas_concatenate_to_the_whole_decoding(ids in proptest::collection::vec(0u32..300, 0..200)) {
        let whole = prompter().decode(&ids, true).expect("decode");
        let deltas = stream(&ids, &[]);
        let mut shown = String::new();
        for d in &deltas {
            shown.push_str(d);
            prop_assert!(whole.starts_with(&shown), "{shown:?} vs {whole:?}");
        }
        prop_assert_eq!(shown, whole);
    }
}
