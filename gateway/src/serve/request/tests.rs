//! The gateway's request parser: fields, limits, errors, and hostile input (proptest).

use super::*;
use proptest::prelude::*;
use serde_json::json;

fn chat(body: &Value) -> Result<(RoutingFields, PromptBody), ApiError> {
    parse(true, body.to_string().as_bytes(), 1000)
}

#[test]
fn chat_fields_and_options() {
    let (f, p) = chat(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5, "max_completion_tokens": 7, "stream": true, "user": "u1", "cache_salt": "s",
        "reasoning_effort": "high", "tools": [{"type": "function"}], "chat_template_kwargs": {"x": 1},
        "add_generation_prompt": false, "logit_bias": {"1": 2}, "unknown": [1, 2, 3]}))
    .expect("parses");
    assert_eq!(
        f,
        RoutingFields {
            model: "m".into(),
            max_tokens: Some(7),
            stream: true,
            include_usage: false,
            user: Some("u1".into()),
            cache_salt: Some("s".into()),
            body_keys: BodyKeys { cache_salt: true, stream_options: false },
            reasoning: true,
            choices: 1,
        }
    );
    let PromptBody::Chat { messages, options } = p else { panic!("chat") };
    assert_eq!(messages, vec![json!({"role": "user", "content": "hi"})]);
    assert!(!options.add_generation_prompt);
    assert_eq!(options.tools, Some(json!([{"type": "function"}])));
    assert_eq!(options.extra.expect("kwargs")["x"], json!(1));
    let (f, _) = chat(&json!({"model": "m", "messages": [], "reasoning_effort": null, "stream": null}))
        .expect("nulls are absent");
    assert!(!f.reasoning && !f.stream);
}

#[test]
fn choices_are_the_larger_of_n_and_best_of_and_bounded() {
    let body = |extra: Value| {
        let mut b = json!({"model": "m", "prompt": "x"});
        b.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        parse(false, b.to_string().as_bytes(), 10)
    };
    assert_eq!(body(json!({})).expect("ok").0.choices, 1);
    assert_eq!(body(json!({"n": 50})).expect("ok").0.choices, 50);
    assert_eq!(body(json!({"n": 2, "best_of": 5})).expect("ok").0.choices, 5);
    for (extra, param) in [
        (json!({"n": 0}), "n"),
        (json!({"n": MAX_CHOICES + 1}), "n"),
        (json!({"best_of": MAX_CHOICES + 1}), "best_of"),
    ] {
        let e = body(extra).expect_err("refused");
        assert_eq!((e.status, e.code, e.param.as_deref()), (400, "invalid_value", Some(param)));
    }
    let (f, _) = chat(&json!({"model": "m", "messages": [], "n": 3})).expect("chat");
    assert_eq!(f.choices, 3);
}

#[test]
fn completion_prompt_forms_move_not_copy() {
    for (prompt, want) in [
        (json!("text"), PromptBody::Text("text".into())),
        (json!([1, 2, 3]), PromptBody::TokenIds(vec![1, 2, 3])),
        (json!(["one"]), PromptBody::Text("one".into())),
        (json!([[4, 5]]), PromptBody::TokenIds(vec![4, 5])),
    ] {
        let (_, p) =
            parse(false, json!({"model": "m", "prompt": prompt}).to_string().as_bytes(), 10).expect("ok");
        assert_eq!(format!("{p:?}"), format!("{want:?}"));
    }
    let err = parse(false, br#"{"model": "m", "prompt": ["a", "b"]}"#, 10).expect_err("batch");
    assert_eq!((err.status, err.param.as_deref()), (400, Some("prompt")));
}

#[test]
fn errors_name_the_field() {
    let e = parse(true, b"{oops", 10).expect_err("syntax");
    assert_eq!((e.status, e.code), (400, "invalid_json"));
    let e = parse(true, br#"{"model": "m"}"#, 10).expect_err("no messages");
    assert_eq!(e.param.as_deref(), Some("messages"));
    let e = parse(true, br#"{"model": 3, "messages": []}"#, 10).expect_err("model type");
    assert_eq!(e.param.as_deref(), Some("model"));
    let e = parse(false, br#"{"model": "m", "prompt": [1], "max_tokens": -1}"#, 10).expect_err("negative");
    assert_eq!(e.param.as_deref(), Some("max_tokens"));
    let e = parse(false, br#"{"model": "m", "prompt": [1], "max_tokens": 4294967296}"#, 10).expect_err("u32");
    assert_eq!(e.param.as_deref(), Some("max_tokens"));
    let e = parse(true, br#"{"model": "m", "messages": {}}"#, 10).expect_err("object");
    assert_eq!(e.param.as_deref(), Some("messages"));
    let e = parse(true, br#"{"model": "m", "messages": []} x"#, 10).expect_err("trailing");
    assert_eq!(e.code, "invalid_json");
}

#[test]
fn chat_json_values_are_bounded() {
    let many: Vec<Value> = (0..600).map(|_| json!({})).collect();
    let e =
        parse(true, json!({"model": "m", "messages": many}).to_string().as_bytes(), 500).expect_err("over");
    assert_eq!((e.status, e.param.as_deref()), (400, Some("messages")));
    assert!(e.message.contains("--max-chat-json-values"), "{}", e.message);
    // The budget covers tools too.
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": many});
    assert_eq!(
        parse(true, body.to_string().as_bytes(), 500).expect_err("tools").param.as_deref(),
        Some("tools")
    );
    // Just under the budget is fine: 1 array + 3 x (object + 2 strings).
    let ok = json!({"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
        {"role": "user", "content": "c"}]});
    assert!(parse(true, ok.to_string().as_bytes(), 10).is_ok());
    assert!(parse(true, ok.to_string().as_bytes(), 9).is_err());
}

fn salt(s: &str) -> (&'static str, String) {
    ("cache_salt", serde_json::to_string(s).expect("json"))
}

#[test]
fn a_forced_salt_replaces_the_callers_and_keeps_everything_else() {
    let body = br#"{"model":"m","cache_salt":"mine","prompt":[1,2],"x":{"cache_salt":"nested"},"q\"k":1}"#;
    let out = with_members(body, &[salt("tenant-a")]).expect("rewritten");
    let v: Value = serde_json::from_slice(&out).expect("json");
    assert_eq!(v["cache_salt"], "tenant-a");
    assert_eq!(v["prompt"], json!([1, 2]));
    assert_eq!(v["x"]["cache_salt"], "nested", "only the top level");
    assert_eq!(v["q\"k"], 1);
    let out = with_members(br#"{"model":"m"}"#, &[salt("t")]).expect("added");
    assert_eq!(serde_json::from_slice::<Value>(&out).expect("json")["cache_salt"], "t");
    assert!(with_members(b"[1]", &[salt("t")]).is_err());
    let out =
        with_members(br#"{}"#, &[salt("t"), ("stream", "true".into())]).expect("added to an empty object");
    assert_eq!(
        serde_json::from_slice::<Value>(&out).expect("json"),
        json!({"cache_salt": "t", "stream": true})
    );
}

#[test]
fn members_go_in_front_of_a_body_without_them_and_the_keys_present_are_known() {
    let set = [salt("t"), ("stream_options", r#"{"include_usage":true}"#.to_owned())];
    let out = with_first_members(br#" {"model":"m","prompt":[1]}"#, &set).expect("object");
    let v: Value = serde_json::from_slice(&out).expect("json");
    assert_eq!(
        v,
        json!({"cache_salt": "t", "stream_options": {"include_usage": true}, "model": "m", "prompt": [1]})
    );
    let out = with_first_members(b"{ }", &set).expect("empty object");
    assert!(serde_json::from_slice::<Value>(&out).is_ok());
    assert!(with_first_members(b"[1]", &set).is_err());
    // A key that is there, even null, is known (a rewrite must replace it, not add a second one).
    let keys = |body: &str| parse(false, body.as_bytes(), 10).expect("parses").0.body_keys;
    assert_eq!(keys(r#"{"model":"m","prompt":"x"}"#), BodyKeys::default());
    assert_eq!(
        keys(r#"{"model":"m","prompt":"x","cache_salt":null,"stream_options":null}"#),
        BodyKeys { cache_salt: true, stream_options: true }
    );
    let (f, _) = parse(false, br#"{"model":"m","prompt":"x","cache_salt":null}"#, 10).expect("parses");
    assert_eq!(f.cache_salt, None);
}

#[test]
fn a_stream_is_asked_for_usage_keeping_its_other_options() {
    let body = br#"{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true}}"#;
    let (f, _) = parse(false, br#"{"model":"m","prompt":"x","stream":true}"#, 10).expect("parses");
    assert!(f.stream && !f.include_usage);
    let (f, _) = parse(
        false,
        br#"{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":true}}"#,
        10,
    )
    .expect("parses");
    assert!(f.include_usage);
    let opts = stream_options_with_usage(body).expect("object");
    assert_eq!(
        serde_json::from_str::<Value>(&opts).expect("json"),
        json!({"continuous_usage_stats": true, "include_usage": true})
    );
    assert_eq!(stream_options_with_usage(br#"{"model":"m"}"#).expect("none"), r#"{"include_usage":true}"#);
    assert_eq!(
        stream_options_with_usage(br#"{"stream_options":null}"#).expect("null"),
        r#"{"include_usage":true}"#
    );
    assert_eq!(stream_options_with_usage(br#"{"stream_options":[1]}"#).expect_err("array").status, 400);
    let huge = format!(r#"{{"stream_options":{{"a":[{}]}}}}"#, vec!["1"; 1000].join(","));
    assert_eq!(stream_options_with_usage(huge.as_bytes()).expect_err("bounded").status, 400);
}

fn arb_json() -> impl Strategy<Value = Value> {
    kvgate_shared::testing::arb_json(4, ".{0,12}")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_and_fail_as_4xx(bytes in prop::collection::vec(any::<u8>(), 0..256), chat in any::<bool>()) {
        if let Err(e) = parse(chat, &bytes, 100) {
            prop_assert!((400..500).contains(&e.status), "{e:?}");
        }
        let _ = with_members(&bytes, &[salt("s")]);
        let _ = stream_options_with_usage(&bytes);
    }

    #[test]
    fn arbitrary_json_bodies_never_panic_and_fail_as_4xx(
        model in arb_json(), messages in arb_json(), prompt in arb_json(), extra in arb_json(), chat in any::<bool>()
    ) {
        let body = json!({"model": model, "messages": messages, "prompt": prompt.clone(), "max_tokens": extra.clone(),
            "tools": extra.clone(), "chat_template_kwargs": extra, "stream": prompt});
        if let Err(e) = parse(chat, body.to_string().as_bytes(), 10_000) {
            prop_assert!((400..500).contains(&e.status), "{e:?}");
        }
    }
}

#[test]
fn a_rewrite_replaces_a_null_member_and_refuses_a_repeated_one() {
    let out = set_members(br#"{"model":"m","cache_salt":null}"#, true, &[salt("t")]).expect("rewritten");
    let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
    assert_eq!(v, serde_json::json!({"model": "m", "cache_salt": "t"}));
    assert_eq!(String::from_utf8_lossy(&out).matches("cache_salt").count(), 1, "one salt member");
    let e = set_members(br#"{"cache_salt":"a","model":"m","cache_salt":null}"#, true, &[salt("t")])
        .expect_err("a repeated member");
    assert_eq!((e.status, e.param.as_deref()), (400, Some("cache_salt")));
    let out = set_members(br#"{"model":"m"}"#, false, &[salt("t")]).expect("prepended");
    assert!(out.starts_with(br#"{"cache_salt":"t","#), "{}", String::from_utf8_lossy(&out));
}
