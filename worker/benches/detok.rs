//! Streaming detokenization cost: one answer of N tokens pushed through `TextStream` (a bounded window per token)
//! against the whole-answer decode per token it replaced (issue #29), side by side in one run, on the synthesized
//! tokenizer. One pass each (the whole-decode pass is quadratic: seconds at 32K tokens).
//!
//!   cargo bench -p kvgate-worker --bench detok

use std::sync::Arc;
use std::time::Instant;

use kvgate_shared::prompt::Prompter;
use kvgate_worker::model::synth::{synth_model, Preset, SynthSpec};
use kvgate_worker::server::text::TextStream;

/// The replaced algorithm: decode every id so far on each token, emit what grew (no stop strings).
fn whole_decode_stream(p: &Prompter, ids: &[u32]) -> usize {
    let mut emitted = 0;
    for n in 1..=ids.len() {
        let text = p.decode(&ids[..n], true).unwrap_or_default();
        let end = text.trim_end_matches('\u{FFFD}').len();
        emitted = emitted.max(end);
    }
    emitted
}

fn main() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 4)).expect("synth");
    let p = Arc::new(Prompter::from_dir(dir.path()).expect("prompter"));
    let words = "the quick brown fox jumps over the lazy dog while naïve café owners say 世界 and 🙂 ";
    let mut ids = Vec::new();
    while ids.len() < 32_768 {
        ids.extend(p.encode(words, false).expect("encode"));
    }
    println!("| answer tokens | whole decode per token, total ms | TextStream, total ms | ratio | TextStream us per token |");
    println!("|---:|---:|---:|---:|---:|");
    for n in [4_096usize, 8_192, 16_384, 32_768] {
        let ids = &ids[..n];
        let t = Instant::now();
        let old = whole_decode_stream(&p, ids);
        let old_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut s = TextStream::new(p.clone(), vec!["</answer>".into()]);
        let mut len = 0;
        for id in ids {
            len += s.push(Some(*id), false).len();
        }
        len += s.push(None, true).len();
        let new_s = t.elapsed().as_secs_f64();
        assert_eq!(len, old, "the same text");
        println!(
            "| {n} | {:.1} | {:.1} | {:.0}x | {:.2} |",
            old_s * 1e3,
            new_s * 1e3,
            old_s / new_s,
            new_s * 1e6 / n as f64
        );
    }
}
