//! Chat `logprobs` / `top_logprobs`: parsing the request's fields and writing OpenAI's `logprobs.content` entries
//! (`{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}`) for the tokens sampled.
//!
//! A token's text is its own decoding (special tokens included), its bytes that text's UTF-8 (a token that is part
//! of a character decodes to U+FFFD, as in vLLM). A log-probability of minus infinity is written -9999.0 (JSON has
//! no infinity; vLLM's convention). Streamed, each chunk carries the entries of the tokens sampled since the last
//! chunk; the finishing chunk carries the rest.

use std::sync::Arc;

use kvgate_shared::prompt::Prompter;
use serde_json::{json, Map, Value};

use super::errors::ApiError;
use crate::engine::request::{TokenLogprobs, MAX_TOP_LOGPROBS};

/// What JSON writes for a log-probability of minus infinity.
const MIN_LOGPROB: f32 = -9999.0;

/// Takes `logprobs` (a boolean) and `top_logprobs` (0..=[`MAX_TOP_LOGPROBS`], only with `logprobs: true`) out of a
/// chat request's untyped fields: `Some(n)` reports each token with `n` alternatives.
pub fn take_chat_fields(extra: &mut Map<String, Value>) -> Result<Option<u32>, ApiError> {
    let on = match extra.remove("logprobs") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(_) => return Err(ApiError::invalid("logprobs", "logprobs must be a boolean")),
    };
    let top = match extra.remove("top_logprobs") {
        None | Some(Value::Null) => 0,
        Some(v) => match v.as_u64() {
            Some(n) if n <= u64::from(MAX_TOP_LOGPROBS) => n as u32,
            _ => {
                let m = format!("top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]");
                return Err(ApiError::invalid("top_logprobs", m));
            }
        },
    };
    if top > 0 && !on {
        return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs: true"));
    }
    Ok(on.then_some(top))
}

/// Collects the entries of one request's sampled tokens.
pub struct Collector {
    prompter: Arc<Prompter>,
    pending: Vec<Value>,
}

impl Collector {
    pub fn new(prompter: Arc<Prompter>) -> Self {
        Self { prompter, pending: Vec::new() }
    }

    fn entry(&self, token: u32, logprob: f32) -> Map<String, Value> {
        let text = self.prompter.decode(&[token], false).unwrap_or_default();
        let mut m = Map::new();
        m.insert("token".into(), json!(text));
        m.insert("logprob".into(), json!(logprob.max(MIN_LOGPROB)));
        m.insert("bytes".into(), json!(text.as_bytes()));
        m
    }

    /// Adds the entry of `token`, sampled with `lp`.
    pub fn push(&mut self, token: u32, lp: &TokenLogprobs) {
        let mut e = self.entry(token, lp.logprob);
        let top: Vec<Value> = lp.top.iter().map(|&(t, l)| Value::Object(self.entry(t, l))).collect();
        e.insert("top_logprobs".into(), Value::Array(top));
        self.pending.push(Value::Object(e));
    }

    /// The choice's `logprobs` object with the entries collected since the last call.
    pub fn take(&mut self) -> Value {
        json!({ "content": std::mem::take(&mut self.pending), "refusal": null })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: Value) -> Result<Option<u32>, ApiError> {
        let Value::Object(mut m) = v else { unreachable!() };
        let got = take_chat_fields(&mut m);
        assert!(!m.contains_key("logprobs") && !m.contains_key("top_logprobs"), "taken out");
        got
    }

    #[test]
    fn chat_fields_are_parsed_and_checked_by_name() {
        assert_eq!(fields(json!({})).ok(), Some(None));
        assert_eq!(fields(json!({"logprobs": false, "top_logprobs": 0})).ok(), Some(None));
        assert_eq!(fields(json!({"logprobs": true})).ok(), Some(Some(0)));
        assert_eq!(fields(json!({"logprobs": true, "top_logprobs": 20})).ok(), Some(Some(20)));
        for (body, param) in [
            (json!({"logprobs": 1}), "logprobs"),
            (json!({"logprobs": true, "top_logprobs": 21}), "top_logprobs"),
            (json!({"logprobs": true, "top_logprobs": -1}), "top_logprobs"),
            (json!({"logprobs": true, "top_logprobs": 1.5}), "top_logprobs"),
            (json!({"top_logprobs": 3}), "top_logprobs"),
        ] {
            let e = fields(body.clone()).expect_err("refused");
            assert_eq!((e.status, e.param.as_deref()), (400, Some(param)), "{body}");
        }
    }
}
