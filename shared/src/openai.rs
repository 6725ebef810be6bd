//! OpenAI API types (completions, chat completions, streaming chunks, models, errors) as kvgate's gateway and
//! workers speak them. Unknown request fields are kept (`extra`) so a proxy never drops what it does not know.

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `prompt` of a completions request: text, token ids, or (batch forms) several of either.
///
/// Deserialized by looking at the first element only (no untagged buffering: a prompt of a million token ids costs
/// 4 bytes each, not a tree of JSON values).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    TokenIds(Vec<u32>),
    TextBatch(Vec<String>),
    TokenIdBatch(Vec<Vec<u32>>),
}

/// The first element of an array `prompt`, which decides its form.
enum PromptElem {
    Id(u32),
    Text(String),
    Ids(Vec<u32>),
}

struct PromptElemVisitor;

impl<'de> Visitor<'de> for PromptElemVisitor {
    type Value = PromptElem;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a token id (0..=4294967295), a string or an array of token ids")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<PromptElem, E> {
        u32::try_from(v).map(PromptElem::Id).map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<PromptElem, E> {
        u32::try_from(v).map(PromptElem::Id).map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptElem, E> {
        Ok(PromptElem::Text(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<PromptElem, E> {
        Ok(PromptElem::Text(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptElem, A::Error> {
        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(id) = seq.next_element::<u32>()? {
            ids.push(id);
        }
        Ok(PromptElem::Ids(ids))
    }
}

impl<'de> Deserialize<'de> for PromptElem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptElemVisitor)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string, an array of token ids, an array of strings or an array of token-id arrays")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        fn rest<'de, T: Deserialize<'de>, A: SeqAccess<'de>>(
            first: T,
            seq: &mut A,
        ) -> Result<Vec<T>, A::Error> {
            let mut v = vec![first];
            while let Some(x) = seq.next_element::<T>()? {
                v.push(x);
            }
            Ok(v)
        }
        Ok(match seq.next_element::<PromptElem>()? {
            None => Prompt::TokenIds(Vec::new()),
            Some(PromptElem::Id(id)) => Prompt::TokenIds(rest(id, &mut seq)?),
            Some(PromptElem::Text(t)) => Prompt::TextBatch(rest(t, &mut seq)?),
            Some(PromptElem::Ids(ids)) => Prompt::TokenIdBatch(rest(ids, &mut seq)?),
        })
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

impl Prompt {
    /// The single prompt, if this is not a batch of several (kvgate serves one prompt per request).
    pub fn single(&self) -> Result<SinglePrompt<'_>, String> {
        match self {
            Prompt::Text(s) => Ok(SinglePrompt::Text(s)),
            Prompt::TokenIds(ids) => Ok(SinglePrompt::TokenIds(ids)),
            Prompt::TextBatch(v) if v.len() == 1 => Ok(SinglePrompt::Text(&v[0])),
            Prompt::TokenIdBatch(v) if v.len() == 1 => Ok(SinglePrompt::TokenIds(&v[0])),
            _ => Err("a batch of several prompts is not supported: send one prompt per request".into()),
        }
    }
}

/// One prompt of a completions request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SinglePrompt<'a> {
    Text(&'a str),
    TokenIds(&'a [u32]),
}

/// `stop`: one string or several.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopSequences {
    One(String),
    Many(Vec<String>),
}

impl StopSequences {
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            StopSequences::One(s) => vec![s.clone()],
            StopSequences::Many(v) => v.clone(),
        }
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by both endpoints (OpenAI's plus the common vLLM extensions `top_k`,
/// `stop_token_ids`, `ignore_eos`, and kvgate's `cache_salt`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Chat's newer name for `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopSequences>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// OpenAI's end-user id; also a session key for routing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Tenant isolation: requests with different salts never share cached blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
}

impl SamplingFields {
    /// The effective output limit (`max_completion_tokens` wins over `max_tokens`).
    pub fn max_output_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

/// Request fields a kvgate worker does not implement, with the value that asks for nothing (a request may send
/// it): set to anything else, the worker refuses the request with 400 `unsupported_parameter` naming the field
/// rather than ignore it. The worker implements the typed fields and, from the untyped ones, `presence_penalty`,
/// `frequency_penalty`, `repetition_penalty`, `min_p` and `logit_bias` (and the chat endpoint takes `logprobs` and
/// `top_logprobs` out before this check: it implements them); other fields are not sampling controls and are
/// ignored.
pub const UNSUPPORTED_PARAMETERS: &[(&str, Neutral)] = &[
    ("logprobs", Neutral::FalseOrZero),
    ("top_logprobs", Neutral::FalseOrZero),
    ("prompt_logprobs", Neutral::FalseOrZero),
    ("min_tokens", Neutral::FalseOrZero),
    ("best_of", Neutral::One),
    ("use_beam_search", Neutral::FalseOrZero),
    ("length_penalty", Neutral::One),
    ("suffix", Neutral::EmptyString),
    ("response_format", Neutral::TextFormat),
    ("tool_choice", Neutral::AutoOrNone),
    ("function_call", Neutral::AutoOrNone),
    ("functions", Neutral::Absent),
    ("guided_json", Neutral::Absent),
    ("guided_regex", Neutral::Absent),
    ("guided_choice", Neutral::Absent),
    ("guided_grammar", Neutral::Absent),
    ("structured_outputs", Neutral::Absent),
];

/// What value of an unsupported field asks for nothing (`null` always does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Neutral {
    /// `false` or 0.
    FalseOrZero,
    /// 1.
    One,
    /// `{}`.
    EmptyObject,
    /// `""`.
    EmptyString,
    /// `{"type": "text"}`.
    TextFormat,
    /// `"auto"` or `"none"` (the model answers in text).
    AutoOrNone,
    /// Only `null`.
    Absent,
}

impl Neutral {
    fn accepts(self, v: &Value) -> bool {
        if v.is_null() {
            return true;
        }
        match self {
            Neutral::FalseOrZero => v == &Value::Bool(false) || v.as_f64() == Some(0.0),
            Neutral::One => v.as_f64() == Some(1.0),
            Neutral::EmptyObject => v.as_object().is_some_and(Map::is_empty),
            Neutral::EmptyString => v.as_str() == Some(""),
            Neutral::TextFormat => v.get("type").and_then(Value::as_str) == Some("text"),
            Neutral::AutoOrNone => matches!(v.as_str(), Some("auto" | "none")),
            Neutral::Absent => false,
        }
    }
}

/// The first field of `extra` (a request's untyped fields) that asks for something a kvgate worker does not
/// implement ([`UNSUPPORTED_PARAMETERS`]).
pub fn unsupported_parameter(extra: &Map<String, Value>) -> Option<&'static str> {
    UNSUPPORTED_PARAMETERS
        .iter()
        .find(|(name, neutral)| extra.get(*name).is_some_and(|v| !neutral.accepts(v)))
        .map(|(name, _)| *name)
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// Token ids the gateway computed for this prompt (`handoff.rs`); used only with a valid
    /// `x-kvgate-prompt-auth` header, else ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvgate_prompt_ids: Option<String>,
    /// Fields this type does not model, kept as sent.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `POST /v1/chat/completions`. Messages stay JSON objects: templates may read any field (`tool_calls`, `name`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<Value>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Defaults to true, as in vLLM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_generation_prompt: Option<bool>,
    /// Token ids the gateway computed for this prompt (`handoff.rs`); used only with a valid
    /// `x-kvgate-prompt-auth` header, else ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvgate_prompt_ids: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Cached prompt tokens, as OpenAI reports them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

/// `usage`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }

    /// Cached prompt tokens (0 when not reported).
    pub fn cached_tokens(&self) -> u32 {
        self.prompt_tokens_details.as_ref().map_or(0, |d| d.cached_tokens)
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    /// The request was aborted (kvgate extension, as in vLLM).
    Abort,
}

/// One choice of a (non-streamed or streamed) completions response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<Value>,
    pub finish_reason: Option<FinishReason>,
}

/// `text_completion` object, also each streamed chunk of completions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// An assistant message of a chat response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<String>,
}

/// One choice of a non-streamed chat response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessage,
    pub logprobs: Option<Value>,
    pub finish_reason: Option<FinishReason>,
}

/// `chat.completion`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// The delta of a streamed chat chunk.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a streamed chat chunk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<Value>,
    pub finish_reason: Option<FinishReason>,
}

/// `chat.completion.chunk`. With `include_usage`, the last chunk has empty `choices` and the usage; every other
/// chunk carries `"usage": null`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(default)]
    pub usage: Option<Usage>,
}

/// An entry of `GET /v1/models`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
    /// kvgate workers: where the engine computes (`cpu`, `cuda:0 (NVIDIA H200, sm_90, bfloat16)`, `sim`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// kvgate workers: their part in prefill/decode disaggregation (`both`, `prefill`, `decode`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// A LoRA adapter's base model (vLLM's field); `None` for a base model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

/// `GET /v1/models`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// The inner object of an OpenAI error body.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    /// e.g. `invalid_request_error`, `not_found_error`, `rate_limit_error`, `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

impl ErrorBody {
    pub fn new(kind: &str, code: &str, message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.to_owned(),
                param: param.map(str::to_owned),
                code: Some(code.to_owned()),
            },
        }
    }

    /// Serialized body (never fails: every field is a plain string).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self)
            .unwrap_or_else(|_| String::from("{\"error\":{\"message\":\"internal error\"}}"))
    }
}

/// Server-sent-events framing of one JSON payload: `data: {json}\n\n`.
pub fn sse_data(json: &str) -> String {
    format!("data: {json}\n\n")
}

/// The last SSE event of every OpenAI stream.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// The largest request body a gateway or a worker reads by default (`--max-body-bytes`): 8 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn completion_prompt_forms() {
        let text: CompletionRequest =
            serde_json::from_value(json!({"model": "m", "prompt": "hi"})).expect("text");
        assert_eq!(text.prompt.single(), Ok(SinglePrompt::Text("hi")));
        let ids: CompletionRequest =
            serde_json::from_value(json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5})).expect("ids");
        assert_eq!(ids.prompt.single(), Ok(SinglePrompt::TokenIds(&[1, 2, 3])));
        assert_eq!(ids.sampling.max_output_tokens(), Some(5));
        let one: CompletionRequest =
            serde_json::from_value(json!({"model": "m", "prompt": [[4, 5]]})).expect("batch");
        assert_eq!(one.prompt.single(), Ok(SinglePrompt::TokenIds(&[4, 5])));
        let many: CompletionRequest =
            serde_json::from_value(json!({"model": "m", "prompt": ["a", "b"]})).expect("batch");
        assert!(many.prompt.single().is_err());
        assert!(serde_json::from_value::<CompletionRequest>(json!({"model": "m", "prompt": [-1]})).is_err());
        assert!(
            serde_json::from_value::<CompletionRequest>(json!({"model": "m", "prompt": [1, "a"]})).is_err()
        );
        assert!(serde_json::from_value::<CompletionRequest>(
            json!({"model": "m", "prompt": [4294967296u64]})
        )
        .is_err());
        assert!(
            serde_json::from_value::<CompletionRequest>(json!({"model": "m", "prompt": {"a": 1}})).is_err()
        );
        let from_str: CompletionRequest =
            serde_json::from_str(r#"{"model": "m", "prompt": [[1, 2], [3]]}"#).expect("batch of ids");
        assert_eq!(from_str.prompt, Prompt::TokenIdBatch(vec![vec![1, 2], vec![3]]));
        let texts: CompletionRequest =
            serde_json::from_str(r#"{"model": "m", "prompt": ["x", "y"]}"#).expect("batch of texts");
        assert_eq!(texts.prompt, Prompt::TextBatch(vec!["x".into(), "y".into()]));
        assert!(serde_json::from_value::<CompletionRequest>(json!({"model": "m"})).is_err());
    }

    #[test]
    fn chat_request_keeps_unknown_fields_and_extensions() {
        let body = json!({
            "model": "m", "messages": [{"role": "user", "content": "x", "name": "bob"}],
            "stream": true, "stream_options": {"include_usage": true}, "cache_salt": "t1",
            "max_completion_tokens": 9, "max_tokens": 3, "stop": "END", "logit_bias": {"1": 2}
        });
        let req: ChatCompletionRequest = serde_json::from_value(body).expect("parses");
        assert!(req.sampling.stream);
        assert_eq!(req.sampling.stream_options, Some(StreamOptions { include_usage: true }));
        assert_eq!(req.sampling.cache_salt.as_deref(), Some("t1"));
        assert_eq!(req.sampling.max_output_tokens(), Some(9));
        assert_eq!(req.sampling.stop.as_ref().map(StopSequences::to_vec), Some(vec!["END".to_string()]));
        assert_eq!(req.extra.get("logit_bias"), Some(&json!({"1": 2})));
        // Round trip keeps everything.
        let again: ChatCompletionRequest =
            serde_json::from_value(serde_json::to_value(&req).expect("ser")).expect("de");
        assert_eq!(again, req);
    }

    #[test]
    fn usage_and_error_shapes() {
        let u = Usage::new(100, 5, 64);
        assert_eq!(
            serde_json::to_value(&u).expect("ser"),
            json!({"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105,
                   "prompt_tokens_details": {"cached_tokens": 64}})
        );
        let e = ErrorBody::new("invalid_request_error", "invalid_json", "bad", Some("messages"));
        assert_eq!(
            serde_json::from_str::<Value>(&e.to_json()).expect("json"),
            json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "messages", "code": "invalid_json"}})
        );
    }

    #[test]
    fn chunk_serialises_usage_null_and_finish_reason() {
        let c = ChatCompletionChunk {
            id: "c1".into(),
            object: "chat.completion.chunk".into(),
            created: 1,
            model: "m".into(),
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta { role: None, content: Some("x".into()) },
                logprobs: None,
                finish_reason: Some(FinishReason::Length),
            }],
            usage: None,
        };
        let v = serde_json::to_value(&c).expect("ser");
        assert_eq!(v["usage"], Value::Null);
        assert_eq!(v["choices"][0]["finish_reason"], json!("length"));
        assert_eq!(v["choices"][0]["delta"], json!({"content": "x"}));
        assert_eq!(sse_data("{}"), "data: {}\n\n");
    }

    #[test]
    fn unimplemented_parameters_are_named_unless_they_ask_for_nothing() {
        let req = |extra: Value| -> Map<String, Value> { extra.as_object().cloned().unwrap_or_default() };
        let neutral = json!({"logprobs": false, "top_logprobs": 0, "best_of": 1, "prompt_logprobs": null,
            "response_format": {"type": "text"}, "tool_choice": "auto", "suffix": "", "metadata": {"anything": 1},
            "store": true, "logit_bias": {"1": 5}, "presence_penalty": 1.0});
        assert_eq!(unsupported_parameter(&req(neutral)), None);
        for (field, value) in [
            ("logprobs", json!(true)),
            ("top_logprobs", json!(5)),
            ("response_format", json!({"type": "json_object"})),
            ("tool_choice", json!("required")),
            ("tool_choice", json!({"type": "function", "function": {"name": "f"}})),
            ("best_of", json!(3)),
            ("guided_json", json!({})),
        ] {
            let got = unsupported_parameter(&req(json!({ field: value })));
            assert_eq!(got, Some(field), "{field} = {value}");
        }
    }
}
