//! Tokenizer synthesis, chat rendering, and gateway/worker tokenization parity.

use super::*;
use serde_json::json;
use std::sync::OnceLock;

fn synth() -> &'static SynthTokenizer {
    static T: OnceLock<SynthTokenizer> = OnceLock::new();
    T.get_or_init(|| synth_tokenizer(700, 7))
}

fn files() -> TokenizerFiles {
    let t = synth();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("tokenizer.json"), &t.tokenizer_json).expect("write");
    std::fs::write(dir.path().join("tokenizer_config.json"), &t.tokenizer_config_json).expect("write");
    TokenizerFiles::from_dir(dir.path()).expect("reads")
}

fn prompter() -> Prompter {
    Prompter::from_files(files()).expect("loads")
}

fn chat(messages: Json) -> Vec<Json> {
    messages.as_array().cloned().unwrap_or_default()
}

fn gen() -> ChatOptions {
    ChatOptions { add_generation_prompt: true, ..ChatOptions::default() }
}

#[test]
fn synth_tokenizer_is_deterministic_and_real_bpe() {
    let a = synth_tokenizer(700, 7);
    let b = synth_tokenizer(700, 7);
    assert_eq!(a.tokenizer_json, b.tokenizer_json);
    assert_ne!(a.tokenizer_json, synth_tokenizer(700, 8).tokenizer_json);
    assert!(a.vocab_size <= 700 && a.vocab_size > 600, "vocab {}", a.vocab_size);
    let p = prompter();
    assert_eq!(p.vocab_size(), a.vocab_size);
    let text = synth_text(3, 200);
    let ids = p.encode(&text, false).expect("encodes");
    // Merges compress: far fewer tokens than bytes.
    assert!(ids.len() * 2 < text.len(), "{} tokens for {} bytes", ids.len(), text.len());
    assert_eq!(p.decode(&ids, false).expect("decodes"), text);
    // Byte-level: any UTF-8 round-trips.
    let odd = "naïve 東京 🚀 \t\n x";
    assert_eq!(p.decode(&p.encode(odd, false).expect("encodes"), false).expect("decodes"), odd);
}

#[test]
fn text_prompts_get_bos_and_chat_prompts_get_it_once() {
    let p = prompter();
    let bos = p.token_id(BOS_TOKEN).expect("bos");
    let ids = p.tokenize(&PromptInput::Text("ka ri")).expect("ok");
    assert_eq!(ids[0], bos);
    let msgs = chat(json!([{"role": "user", "content": "hi"}]));
    let ids = p.tokenize(&PromptInput::Chat { messages: &msgs, options: &gen() }).expect("ok");
    assert_eq!(ids[0], bos);
    assert_ne!(ids[1], bos);
    assert_eq!(p.eos_token_id(), p.token_id(EOT_TOKEN));
}

#[test]
fn renders_llama3_style_chat() {
    let p = prompter();
    let msgs = chat(json!([
        {"role": "system", "content": "  be brief  "},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]));
    let text = p.render_chat(&msgs, &gen()).expect("renders");
    assert_eq!(
        text,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\na\nb<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let no_gen = p.render_chat(&msgs, &ChatOptions::default()).expect("renders");
    assert!(no_gen.ends_with("a\nb<|eot_id|>"));
}

#[test]
fn template_errors_are_client_errors_with_the_templates_message() {
    let p = prompter();
    let err = p.render_chat(&chat(json!([{"role": "wizard", "content": "x"}])), &gen()).expect_err("refused");
    assert!(
        matches!(&err, PromptError::InvalidConversation(m) if m.contains("unknown role: wizard")),
        "{err}"
    );
    assert!(err.is_client_error());
    assert!(p.render_chat(&[], &gen()).expect_err("empty").is_client_error());
    let bad_part = chat(json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]));
    assert!(p.render_chat(&bad_part, &gen()).expect_err("image").is_client_error());
    assert!(p
        .render_chat(&chat(json!(["just a string"])), &gen())
        .expect_err("not object")
        .is_client_error());
}

fn with_template(src: &str) -> Prompter {
    let mut f = files();
    f.chat_template = Some(src.to_owned());
    Prompter::from_files(f).expect("compiles")
}

#[test]
fn hf_template_features() {
    let msgs = chat(json!([{"role": "user", "content": "  Hello World  "}]));
    // Python string methods via pycompat, dict items, tojson with Python separators, loop variables.
    let p = with_template(
        "{% for m in messages %}{{ m.content.strip().upper() }}|{{ m.content.strip().startswith('Hello') }}|\
         {% for k, v in m.items() %}{{ k }}={{ v | length }};{% endfor %}{% endfor %}|{{ tools | tojson }}|\
         {{ tools | tojson(indent=2) }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}|{{ '<&>' | tojson }}",
    );
    let options = ChatOptions {
        tools: Some(json!([{"name": "f", "parameters": {"z": 1, "a": [1, 2.5, "é"]}}])),
        ..ChatOptions::default()
    };
    let out = p.render_chat(&msgs, &options).expect("renders");
    assert_eq!(
        out,
        "HELLO WORLD|True|role=4;content=15;|\
         [{\"name\": \"f\", \"parameters\": {\"z\": 1, \"a\": [1, 2.5, \"é\"]}}]|\
         [\n  {\n    \"name\": \"f\",\n    \"parameters\": {\n      \"z\": 1,\n      \"a\": [\n        1,\n        2.5,\n        \"é\"\n      ]\n    }\n  }\n]|\
         {\"a\": 2, \"b\": 1}|\"<&>\""
    );
}

#[test]
fn trim_and_lstrip_blocks_like_hf() {
    let p = with_template("{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n");
    let msgs = chat(json!([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]));
    assert_eq!(p.render_chat(&msgs, &gen()).expect("renders"), "[x]\n[y]\n");
}

#[test]
fn strftime_now_and_chat_template_kwargs() {
    let p = with_template("{{ strftime_now('%Y') }} {{ flavour }}");
    let mut extra = serde_json::Map::new();
    extra.insert("flavour".into(), json!("mint"));
    let out = p
        .render_chat(
            &chat(json!([{"role": "user", "content": "x"}])),
            &ChatOptions { extra: Some(extra), ..gen() },
        )
        .expect("renders");
    let year = chrono::Local::now().format("%Y").to_string();
    assert_eq!(out, format!("{year} mint"));
}

#[test]
fn template_syntax_error_names_the_problem() {
    let mut f = files();
    f.chat_template = Some("{% for %}".into());
    let err = Prompter::from_files(f).expect_err("bad template");
    assert!(matches!(err, PromptError::Template(ref m) if m.contains("does not compile")), "{err}");
}

#[test]
fn model_dir_variants() {
    let t = synth();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("tokenizer.json"), &t.tokenizer_json).expect("write");
    // No config at all: text prompts work, chat is a clear error.
    let p = Prompter::from_dir(dir.path()).expect("loads");
    assert!(matches!(
        p.render_chat(&chat(json!([{"role": "user", "content": "x"}])), &gen()),
        Err(PromptError::NoChatTemplate)
    ));
    // List-form chat_template picks "default"; chat_template.jinja wins over the config.
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"bos_token": {"content": "<|begin_of_text|>"}, "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]}"#,
    )
    .expect("write");
    let p = Prompter::from_dir(dir.path()).expect("loads");
    assert_eq!(
        p.render_chat(&chat(json!([{"role": "user", "content": "x"}])), &gen()).expect("ok"),
        "D<|begin_of_text|>"
    );
    std::fs::write(dir.path().join("chat_template.jinja"), "J").expect("write");
    let p = Prompter::from_dir(dir.path()).expect("loads");
    assert_eq!(p.render_chat(&chat(json!([{"role": "user", "content": "x"}])), &gen()).expect("ok"), "J");
    // Missing tokenizer.json names the file.
    let empty = tempfile::tempdir().expect("tempdir");
    let err = Prompter::from_dir(empty.path()).expect_err("missing");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    // Corrupt tokenizer.json.
    std::fs::write(empty.path().join("tokenizer.json"), "{not json").expect("write");
    assert!(matches!(Prompter::from_dir(empty.path()), Err(PromptError::Tokenizer(_))));
}

#[test]
fn token_id_prompts_pass_through() {
    let p = prompter();
    assert_eq!(p.tokenize(&PromptInput::TokenIds(&[5, 6, 7])).expect("ok"), vec![5, 6, 7]);
    assert!(p.tokenize(&PromptInput::TokenIds(&[])).expect_err("empty").is_client_error());
}

#[test]
fn gateway_and_worker_tokenize_identically() {
    // The worker loads its model directory; the gateway gets the same parts over HTTP as JSON
    // (GET /kvgate/v1/tokenizer) and builds its own Prompter from them.
    let worker = prompter();
    let wire = serde_json::to_string(worker.files()).expect("serialises");
    let gateway = Prompter::from_files(serde_json::from_str(&wire).expect("parses")).expect("loads");
    assert_eq!(worker.digest(), gateway.digest());
    let opts = gen();
    let conversations = [
        json!([{"role": "user", "content": synth_text(1, 300)}]),
        json!([{"role": "system", "content": "sys"}, {"role": "user", "content": "é 🚀"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": synth_text(2, 50)}]),
    ];
    for c in &conversations {
        let msgs = chat(c.clone());
        let input = PromptInput::Chat { messages: &msgs, options: &opts };
        assert_eq!(worker.tokenize(&input).expect("w"), gateway.tokenize(&input).expect("g"));
    }
    let text = synth_text(9, 500);
    assert_eq!(
        worker.tokenize(&PromptInput::Text(&text)).expect("w"),
        gateway.tokenize(&PromptInput::Text(&text)).expect("g")
    );
}

#[test]
fn digest_covers_template_and_tokens() {
    let base = prompter().digest();
    let mut f = files();
    f.chat_template = Some("x".into());
    assert_ne!(Prompter::from_files(f).expect("ok").digest(), base);
    let mut f = files();
    f.eos_token = None;
    assert_ne!(Prompter::from_files(f).expect("ok").digest(), base);
}

/// A conversation of `turns` user/assistant exchanges with long synthetic messages.
fn long_chat(turns: usize) -> Vec<Json> {
    let mut m = vec![json!({"role": "system", "content": synth_text(1, 200)})];
    for t in 0..turns {
        m.push(json!({"role": "user", "content": synth_text(10 + t as u64, 120)}));
        m.push(json!({"role": "assistant", "content": synth_text(100 + t as u64, 80)}));
    }
    m.push(json!({"role": "user", "content": "and now?"}));
    m
}

#[test]
fn chats_are_tokenized_piece_by_piece_with_the_history_from_the_cache() {
    let p = prompter();
    assert_eq!(p.segment_cache_off(), None, "the synthetic tokenizer passes the self-check");
    for turns in 0..6 {
        let m = long_chat(turns);
        let ids = p.tokenize(&PromptInput::Chat { messages: &m, options: &gen() }).expect("tokenizes");
        let text = p.render_chat(&m, &gen()).expect("renders");
        assert_eq!(
            ids,
            p.encode(&text, false).expect("whole"),
            "turn {turns}: identical to whole-text encoding"
        );
    }
    // The stretches between added tokens: each message's role and its "\n\n" + content, and the generation
    // prompt's role and "\n\n". Turn 0 meets six new ones (the three roles, the system prompt, the question, the
    // final "\n\n"); each later turn only its two new messages. Everything else is a hit.
    let s = p.segment_cache_stats();
    assert_eq!(s.misses, 6 + 2 * 5, "{s:?}");
    // Turn t has 2t + 3 role stretches, 2t + 2 contents and the final "\n\n".
    let stretches: u64 = (0..6).map(|t| 4 * t + 6).sum();
    assert_eq!(s.hits, stretches - s.misses, "{s:?}");
}

#[test]
fn the_segment_cache_is_bounded_and_capacity_zero_still_splits_exactly() {
    let p = prompter().with_segment_cache_tokens(2_000);
    for i in 0..50u64 {
        let m = vec![json!({"role": "user", "content": synth_text(1_000 + i, 100)})];
        p.tokenize(&PromptInput::Chat { messages: &m, options: &gen() }).expect("tokenizes");
    }
    assert!(p.segment_cache.tokens() <= 2_000, "{}", p.segment_cache.tokens());
    let off = prompter().with_segment_cache_tokens(0);
    let m = long_chat(2);
    let ids = off.tokenize(&PromptInput::Chat { messages: &m, options: &gen() }).expect("tokenizes");
    assert_eq!(ids, off.encode(&off.render_chat(&m, &gen()).expect("renders"), false).expect("whole"));
    assert_eq!(off.segment_cache_stats(), CacheStats::default());
}

#[test]
fn a_tokenizer_whose_added_tokens_strip_whitespace_is_encoded_whole() {
    let mut f = files();
    let mut tj: Json = serde_json::from_str(&f.tokenizer_json).expect("json");
    for t in tj["added_tokens"].as_array_mut().expect("added tokens") {
        t["lstrip"] = json!(true);
    }
    f.tokenizer_json = tj.to_string();
    let p = Prompter::from_files(f).expect("loads");
    assert!(
        p.segment_cache_off().is_some_and(|w| w.contains("strips whitespace")),
        "{:?}",
        p.segment_cache_off()
    );
    let m = long_chat(1);
    let ids = p.tokenize(&PromptInput::Chat { messages: &m, options: &gen() }).expect("tokenizes");
    assert_eq!(ids, p.encode(&p.render_chat(&m, &gen()).expect("renders"), false).expect("whole"));
}

mod hostile {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// Piece-by-piece tokenization through the cache equals whole-text encoding for any message text,
        /// special-token look-alikes and all, repeated so that pieces come from the cache.
        #[test]
        fn split_tokenization_equals_whole_text_encoding(
            contents in prop::collection::vec(
                prop_oneof![
                    ".{0,80}",
                    "( ?<\\|(eot_id|start_header_id|end_header_id|begin_of_text)\\|> ?[a-z \n]{0,70}){1,3}",
                    "[ \n\t]{0,4}[a-zé日🎉0-9 ]{60,120}[ \n]{0,3}",
                ],
                1..5,
            ),
        ) {
            static P: OnceLock<Prompter> = OnceLock::new();
            let p = P.get_or_init(prompter);
            let m: Vec<Json> = contents.iter().map(|c| json!({"role": "user", "content": c})).collect();
            for _ in 0..2 {
                let ids = p.tokenize(&PromptInput::Chat { messages: &m, options: &gen() }).expect("tokenizes");
                let whole = p.encode(&p.render_chat(&m, &gen()).expect("renders"), false).expect("whole");
                prop_assert_eq!(ids, whole);
            }
        }
    }

    fn arb_json() -> impl Strategy<Value = Json> {
        crate::testing::arb_json(3, "[a-z{}%# <>|'\"\\\\]{0,12}")
    }

    fn arb_message() -> impl Strategy<Value = Json> {
        let role = prop_oneof![
            Just(json!("user")),
            Just(json!("assistant")),
            Just(json!("system")),
            Just(json!("tool")),
            arb_json(),
        ];
        let content = prop_oneof![
            ".{0,40}".prop_map(Json::String),
            Just(json!([{"type": "text", "text": "hi"}])),
            arb_json(),
        ];
        (role, content, arb_json()).prop_map(|(role, content, extra)| {
            let mut m = serde_json::Map::new();
            m.insert("role".into(), role);
            m.insert("content".into(), content);
            if let Json::Object(x) = extra {
                m.extend(x);
            }
            Json::Object(m)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

        /// Whatever a client sends as messages, tools or template kwargs, rendering and tokenizing never panic,
        /// and every failure is the client's (a 400), never a server error.
        #[test]
        fn arbitrary_conversations_render_or_are_client_errors(
            messages in prop::collection::vec(prop_oneof![arb_message(), arb_json()], 0..6),
            tools in prop::option::of(arb_json()),
            kwargs in prop::option::of(prop::collection::btree_map("[a-z_]{1,8}", arb_json(), 0..3)),
            add_generation_prompt in any::<bool>(),
            continue_final_message in any::<bool>(),
        ) {
            static P: OnceLock<Prompter> = OnceLock::new();
            let p = P.get_or_init(prompter);
            let options = ChatOptions {
                add_generation_prompt,
                tools,
                extra: kwargs.map(|k| k.into_iter().collect()),
                continue_final_message,
            };
            if let Err(e) = p.tokenize(&PromptInput::Chat { messages: &messages, options: &options }) {
                prop_assert!(e.is_client_error(), "{e}");
            }
        }
    }
}

#[test]
fn handed_ids_replace_tokenizing_but_not_a_prompt_of_ids() {
    use super::request::RequestPrompt;
    let p = prompter();
    let text = RequestPrompt {
        input: PromptInput::Text("hello there"),
        body_salt: None,
        header_salt: None,
        scope: None,
    };
    let own = text.token_ids(&p, None).expect("tokenizes");
    assert_eq!(own, p.tokenize(&PromptInput::Text("hello there")).expect("tokenizes"));
    assert_eq!(text.token_ids(&p, Some(vec![7, 8])).expect("handed"), vec![7, 8]);
    let given = [own[0]];
    let ids = RequestPrompt {
        input: PromptInput::TokenIds(&given),
        body_salt: None,
        header_salt: None,
        scope: None,
    };
    assert_eq!(ids.token_ids(&p, Some(vec![9])).expect("ids"), given.to_vec());
}
