//! What preparing a long multi-turn chat costs the gateway, step by step: parse the body, render the template,
//! tokenize (whole, and piece by piece with the history cached), hash the blocks, build the prompt handoff, and
//! rewrite the body for a stream's usage and a tenant's salt (members put in front of a body without them, against
//! the member-by-member rewrite a body that has them needs).
//! A ~15K-token conversation (synthetic tokenizer and template, 12 turns).
//!
//! `cargo bench -p kvgate-gateway --bench prepare`

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_gateway::serve::request::{parse, with_first_members, with_members};
use kvgate_shared::handoff;
use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::prompt::{
    synth_prose, synth_text, synth_tokenizer, ChatOptions, PromptInput, Prompter, TokenizerFiles,
};
use serde_json::json;
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let t = synth_tokenizer(512, 0);
    let files = TokenizerFiles {
        tokenizer_json: t.tokenizer_json.clone(),
        chat_template: Some(kvgate_shared::prompt::CHAT_TEMPLATE.into()),
        bos_token: Some(kvgate_shared::prompt::BOS_TOKEN.into()),
        eos_token: Some(kvgate_shared::prompt::EOT_TOKEN.into()),
    };
    let prompter = Prompter::from_files(files).expect("prompter");
    let mut messages = vec![json!({"role": "system", "content": synth_text(1, 6_300)})];
    for turn in 0..11u64 {
        messages.push(json!({"role": "user", "content": synth_text(10 + turn, 30)}));
        messages.push(json!({"role": "assistant", "content": synth_text(100 + turn, 30)}));
    }
    messages.push(json!({"role": "user", "content": synth_text(999, 40)}));
    let body = json!({"model": "m", "max_tokens": 1, "messages": messages}).to_string();
    let options = ChatOptions { add_generation_prompt: true, ..ChatOptions::default() };
    let input = PromptInput::Chat { messages: &messages, options: &options };
    let ids = prompter.tokenize(&input).expect("tokenizes");
    let text = prompter.render_chat(&messages, &options).expect("renders");
    eprintln!("{} tokens, body {} bytes", ids.len(), body.len());
    let hasher = BlockHasher::new(&HashScheme::new(16, prompter.digest()), &ExtraKeys::none());

    c.bench_function("parse_body", |b| {
        b.iter(|| parse(true, black_box(body.as_bytes()), 100_000).expect("parses"))
    });
    c.bench_function("render_template", |b| {
        b.iter(|| prompter.render_chat(black_box(&messages), &options).expect("renders"))
    });
    c.bench_function("tokenize_whole", |b| {
        b.iter(|| prompter.encode(black_box(&text), false).expect("encodes"))
    });
    c.bench_function("tokenize_with_history_cached", |b| {
        b.iter(|| prompter.tokenize(black_box(&input)).expect("tokenizes"))
    });
    let members = [
        ("cache_salt", "\"kvgate-salt-v1:0123456789abcdef0123456789abcdef\"".to_owned()),
        ("stream_options", r#"{"include_usage":true}"#.to_owned()),
    ];
    c.bench_function("rewrite_first_members", |b| {
        b.iter(|| with_first_members(black_box(body.as_bytes()), &members).expect("object").len())
    });
    c.bench_function("rewrite_members_parsed", |b| {
        b.iter(|| with_members(black_box(body.as_bytes()), &members).expect("object").len())
    });
    c.bench_function("hash_blocks", |b| b.iter(|| hasher.hash_blocks(black_box(&ids))));
    fn assertion(enc: &str) -> handoff::Assertion<'_> {
        handoff::Assertion {
            issued_ms: 1,
            fingerprint: 7,
            scope: None,
            model: "kvgate-small",
            salt: None,
            ids: Some(enc),
        }
    }
    c.bench_function("handoff_encode_and_sign", |b| {
        b.iter(|| {
            let enc = handoff::encode_ids(black_box(&ids));
            let body = handoff::with_ids_field(body.as_bytes(), &enc).expect("object");
            (body.len(), handoff::sign("secret", &assertion(&enc)))
        })
    });
    let enc = handoff::encode_ids(&ids);
    let auth = handoff::sign("secret", &assertion(&enc));
    c.bench_function("handoff_verify_and_decode", |b| {
        b.iter(|| {
            assert!(handoff::verify(Some("secret"), &auth, "kvgate-small", None, Some(black_box(&enc)), 1)
                .is_ok());
            handoff::decode_ids(&enc).expect("decodes").len()
        })
    });
}

/// A 32K-token completions prompt as text whose first 30K tokens were seen before (a long document, then a new
/// question): preparing it (parse the body, tokenize, hash the blocks) with `Tokenizer::encode` on the whole text
/// (`whole`, before issue #28), through the prompter with nothing cached (`unseen`: the fast byte-level path), and
/// with the document's chunks cached (`seen_30k`), a new tail every iteration. Two kinds of text: `words` draws
/// every word anew (`synth_text`: the BPE's own word cache rarely hits), `prose` draws them Zipf-like from a
/// lexicon as natural language does (`synth_prose`). The ids are checked equal first.
fn long_text(c: &mut Criterion) {
    // The vocabulary of the `small` preset that the demo and the peer bench serve.
    let t = synth_tokenizer(8192, 0);
    let files = TokenizerFiles {
        tokenizer_json: t.tokenizer_json.clone(),
        chat_template: Some(kvgate_shared::prompt::CHAT_TEMPLATE.into()),
        bos_token: Some(kvgate_shared::prompt::BOS_TOKEN.into()),
        eos_token: Some(kvgate_shared::prompt::EOT_TOKEN.into()),
    };
    let prompter = Prompter::from_files(files).expect("prompter");
    assert_eq!((prompter.long_text_off(), prompter.fast_path_off()), (None, None));
    let hasher = BlockHasher::new(&HashScheme::new(16, prompter.digest()), &ExtraKeys::none());
    let body = |text: &str| json!({"model": "m", "max_tokens": 1, "prompt": text}).to_string();
    let prepare = |body: &str, whole: bool| {
        let (_, prompt) = parse(false, body.as_bytes(), 100_000).expect("parses");
        let ids = match (prompt.input(), whole) {
            (PromptInput::Text(text), true) => prompter.encode(text, true).expect("encodes"),
            (input, _) => prompter.tokenize(&input).expect("tokenizes"),
        };
        hasher.hash_blocks(&ids).len()
    };
    type Gen = fn(u64, usize) -> String;
    let kinds: [(&str, Gen); 2] =
        [("words", |seed, n| synth_text(seed, n)), ("prose", |seed, n| synth_prose(0, seed, n))];
    for (kind, gen) in kinds {
        // About 30K tokens of document, then tails of about 2K tokens.
        let mut n = 6_000;
        let doc = loop {
            let d = gen(77, n);
            let got = prompter.encode(&d, true).expect("encodes").len();
            if got >= 30_000 {
                break d;
            }
            n = n * 30_500 / got.max(1) + 1;
        };
        let tail = |i: u64| format!("{doc} {}", gen(10_000 + i, n / 15));
        let first = tail(0);
        let ids = prompter.tokenize(&PromptInput::Text(&first)).expect("tokenizes");
        assert_eq!(ids, prompter.encode(&first, true).expect("whole"), "same ids bit for bit");
        eprintln!(
            "long text ({kind}): {} tokens ({} seen), body {} bytes",
            ids.len(),
            prompter.encode(&doc, true).expect("ids").len(),
            body(&first).len()
        );
        let long = body(&first);
        c.bench_function(&format!("parse_text_32k_{kind}"), |b| {
            b.iter(|| {
                matches!(
                    parse(false, black_box(long.as_bytes()), 100_000).expect("parses").1.input(),
                    PromptInput::Text(_)
                )
            })
        });
        let mut i = 0u64;
        let cases: [(&str, bool, bool); 3] =
            [("whole", true, true), ("unseen", false, false), ("seen_30k", false, true)];
        for (name, whole, seen) in cases {
            c.bench_function(&format!("prepare_text_32k_{kind}_{name}"), |b| {
                b.iter_batched(
                    || {
                        i += 1;
                        // An unseen prompt is a document of its own.
                        let text = if seen { tail(i) } else { gen(1_000_000 + i, n + n / 15) };
                        body(&text)
                    },
                    |body| prepare(black_box(&body), whole),
                    criterion::BatchSize::PerIteration,
                )
            });
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = bench, long_text
}
criterion_main!(benches);
