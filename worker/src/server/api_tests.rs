//! The worker's request parser on hostile input: never a panic, always an OpenAI-style 4xx.

use super::*;
use proptest::prelude::*;
use serde_json::{json, Value};

fn arb_json() -> impl Strategy<Value = Value> {
    kvgate_shared::testing::arb_json(3, ".{0,12}")
}

fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
    let errors =
        [parse_json::<CompletionRequest>(bytes).err(), parse_json::<ChatCompletionRequest>(bytes).err()];
    for e in errors.into_iter().flatten() {
        prop_assert!((400..500).contains(&e.status), "{e:?}");
        let body: Value = serde_json::from_str(&e.body().to_json()).expect("json");
        prop_assert!(body["error"]["message"].is_string() && body["error"]["code"].is_string());
    }
    Ok(())
}

#[test]
fn a_million_token_ids_parse_without_a_json_tree() {
    let body = format!("{{\"model\":\"m\",\"prompt\":[{}]}}", vec!["7"; 1_000_000].join(","));
    let req: CompletionRequest = parse_json(body.as_bytes()).expect("parses");
    assert!(matches!(req.prompt, kvgate_shared::openai::Prompt::TokenIds(ref v) if v.len() == 1_000_000));
    assert_eq!(parse_json::<CompletionRequest>(b"{oops").expect_err("syntax").code, "invalid_json");
    let e = parse_json::<CompletionRequest>(br#"{"model": "m", "prompt": [1], "max_tokens": "x"}"#)
        .expect_err("type");
    assert_eq!((e.status, e.code), (400, "invalid_value"));
    let e = parse_json::<CompletionRequest>(br#"{"model": "m", "prompt": {"a": 1}}"#).expect_err("shape");
    assert_eq!(e.param.as_deref(), Some("prompt"));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_are_4xx(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        check(&bytes)?;
    }

    #[test]
    fn arbitrary_request_shapes_are_4xx(
        model in arb_json(), prompt in arb_json(), messages in arb_json(), sampling in arb_json()
    ) {
        let mut body = json!({"model": model, "prompt": prompt, "messages": messages});
        if let (Value::Object(b), Value::Object(s)) = (&mut body, sampling) {
            b.extend(s);
        }
        check(body.to_string().as_bytes())?;
    }
}
