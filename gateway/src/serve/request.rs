//! Request bodies as the gateway reads them: only what routing and admission need, parsed straight into typed
//! structs that borrow from the body (no JSON tree of the whole body; unknown fields are skipped without being
//! built). The worker parses the same body again with its full types, so a field the gateway ignores is still
//! validated where it is used.
//!
//! Limits: the body is at most `--max-body-bytes` (checked while reading); a completions prompt of token ids costs
//! 4 bytes per id; the JSON values of a chat's `messages`, `tools` and `chat_template_kwargs` (which the chat
//! template needs as a tree) are counted while they are built and refused past `--max-chat-json-values`, so a body
//! of 8 MiB of `{},{},...` costs at most that many small values, not millions.

use std::borrow::Cow;
use std::cell::Cell;

use kvgate_shared::openai::Prompt;
use kvgate_shared::prompt::{chat_options, ChatOptions, PromptInput};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::errors::ApiError;

/// The fields of a request that routing and admission use.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutingFields {
    pub model: String,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u32>,
    pub stream: bool,
    /// `stream_options.include_usage`: the client asked a stream for its usage chunk.
    pub include_usage: bool,
    /// OpenAI's end-user id (a session key).
    pub user: Option<String>,
    pub cache_salt: Option<String>,
    /// Which rewritable top-level keys the body has (a rewrite adds the others without re-parsing the body).
    pub body_keys: BodyKeys,
    /// The request carries `reasoning_effort`.
    pub reasoning: bool,
    /// Sequences the pod generates for it: the larger of `n` and `best_of` (1 without them). Each may produce up
    /// to `max_tokens`: the price and the cap are per choice times this.
    pub choices: u32,
}

/// Most choices (`n`, `best_of`) one request may ask for (OpenAI's limit on `n`): past it, 400 `invalid_value`
/// on the member that asked.
pub const MAX_CHOICES: u32 = 128;

/// Whether the body has these top-level keys at all (even `null`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BodyKeys {
    pub cache_salt: bool,
    pub stream_options: bool,
}

/// The prompt, ready for the tokenizer.
#[derive(Clone, Debug)]
pub enum PromptBody {
    Chat { messages: Vec<Value>, options: ChatOptions },
    Text(String),
    TokenIds(Vec<u32>),
}

impl PromptBody {
    pub fn input(&self) -> PromptInput<'_> {
        match self {
            PromptBody::Chat { messages, options } => PromptInput::Chat { messages, options },
            PromptBody::Text(t) => PromptInput::Text(t),
            PromptBody::TokenIds(ids) => PromptInput::TokenIds(ids),
        }
    }
}

#[derive(Deserialize)]
struct ChatLean<'a> {
    #[serde(borrow)]
    model: Cow<'a, str>,
    #[serde(borrow)]
    messages: &'a RawValue,
    #[serde(default, borrow)]
    tools: Option<&'a RawValue>,
    #[serde(default, borrow)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    /// vLLM's: end the prompt inside the final (assistant) message rather than after it.
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default, borrow)]
    reasoning_effort: Option<&'a RawValue>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    best_of: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default, deserialize_with = "present")]
    stream_options: Option<Option<StreamOptionsLean>>,
    #[serde(default, borrow)]
    user: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "present")]
    cache_salt: Option<Option<String>>,
    /// Reserved for the gateway's prompt handoff: a client body carrying it is refused.
    #[serde(default, borrow)]
    kvgate_prompt_ids: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct CompletionLean<'a> {
    #[serde(borrow)]
    model: Cow<'a, str>,
    prompt: Prompt,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    best_of: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default, deserialize_with = "present")]
    stream_options: Option<Option<StreamOptionsLean>>,
    #[serde(default, borrow)]
    user: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "present")]
    cache_salt: Option<Option<String>>,
    #[serde(default, borrow)]
    kvgate_prompt_ids: Option<&'a RawValue>,
}

/// A member that may be absent, `null` or a value: `None`, `Some(None)`, `Some(Some(v))` (the body's rewrite
/// must know whether the key is there at all).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// `stream_options`: only whether the client asked for usage (other members pass through untouched).
#[derive(Deserialize, Default)]
struct StreamOptionsLean {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// The shared fields, whichever struct they came from (no `flatten`: it would buffer every unknown field).
struct Common<'a> {
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    n: Option<u32>,
    best_of: Option<u32>,
    stream: Option<bool>,
    include_usage: bool,
    stream_options_key: bool,
    user: Option<Cow<'a, str>>,
    cache_salt: Option<Option<String>>,
}

macro_rules! common {
    ($r:expr) => {
        Common {
            max_tokens: $r.max_tokens,
            max_completion_tokens: $r.max_completion_tokens,
            n: $r.n,
            best_of: $r.best_of,
            stream: $r.stream,
            include_usage: $r
                .stream_options
                .as_ref()
                .and_then(|o| o.as_ref()?.include_usage)
                .unwrap_or(false),
            stream_options_key: $r.stream_options.is_some(),
            user: $r.user,
            cache_salt: $r.cache_salt,
        }
    };
}

/// Refuses the handoff field in a client body: only the gateway sets it (`kvgate_shared::handoff`).
fn reserved(field: Option<&RawValue>) -> Result<(), ApiError> {
    match field {
        None => Ok(()),
        Some(_) => Err(ApiError::invalid(
            kvgate_shared::handoff::PROMPT_IDS_FIELD,
            "kvgate_prompt_ids is set by the gateway, not by clients",
        )),
    }
}

/// Parses a chat (`chat`) or completions body.
pub fn parse(
    chat: bool,
    body: &[u8],
    max_json_values: usize,
) -> Result<(RoutingFields, PromptBody), ApiError> {
    if chat {
        let req: ChatLean<'_> = typed(body)?;
        reserved(req.kvgate_prompt_ids)?;
        let budget = Cell::new(max_json_values);
        let messages = match bounded(req.messages, &budget, "messages")? {
            Value::Array(m) => m,
            _ => return Err(ApiError::invalid("messages", "invalid request: messages: expected an array")),
        };
        let tools = req.tools.map(|t| bounded(t, &budget, "tools")).transpose()?.filter(|t| !t.is_null());
        let extra = match req
            .chat_template_kwargs
            .map(|k| bounded(k, &budget, "chat_template_kwargs"))
            .transpose()?
        {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) => Some(m),
            Some(_) => {
                return Err(ApiError::invalid(
                    "chat_template_kwargs",
                    "chat_template_kwargs must be an object",
                ))
            }
        };
        let mut options = chat_options(req.add_generation_prompt, tools, extra);
        options.continue_final_message = req.continue_final_message.unwrap_or(false);
        if options.continue_final_message && options.add_generation_prompt {
            // As vLLM refuses it (add_generation_prompt defaults to true there too).
            return Err(ApiError::invalid(
                "continue_final_message",
                "continue_final_message and add_generation_prompt are not compatible: set add_generation_prompt \
                 to false to continue the final message",
            ));
        }
        let reasoning = req.reasoning_effort.is_some_and(|r| r.get() != "null");
        Ok((fields(req.model, common!(req), reasoning)?, PromptBody::Chat { messages, options }))
    } else {
        let req: CompletionLean<'_> = typed(body)?;
        reserved(req.kvgate_prompt_ids)?;
        // Moved, not copied: a prompt of a million ids is 4 MB once.
        let prompt = match req.prompt {
            Prompt::Text(t) => PromptBody::Text(t),
            Prompt::TokenIds(ids) => PromptBody::TokenIds(ids),
            Prompt::TextBatch(mut v) if v.len() == 1 => PromptBody::Text(v.pop().unwrap_or_default()),
            Prompt::TokenIdBatch(mut v) if v.len() == 1 => PromptBody::TokenIds(v.pop().unwrap_or_default()),
            batch => {
                let m = batch.single().err().unwrap_or_default();
                return Err(ApiError::invalid("prompt", &m));
            }
        };
        Ok((fields(req.model, common!(req), false)?, prompt))
    }
}

/// The choices a body asks for (`n`, `best_of`), within [`MAX_CHOICES`].
fn choices(n: Option<u32>, best_of: Option<u32>) -> Result<u32, ApiError> {
    for (param, v) in [("n", n), ("best_of", best_of)] {
        match v {
            Some(0) => return Err(ApiError::invalid(param, format!("{param} must be at least 1"))),
            Some(v) if v > MAX_CHOICES => {
                let m = format!(
                    "{param} may be at most {MAX_CHOICES} through the gateway (each choice is priced)"
                );
                return Err(ApiError::invalid(param, m));
            }
            _ => {}
        }
    }
    Ok(n.unwrap_or(1).max(best_of.unwrap_or(1)))
}

fn fields(model: Cow<'_, str>, c: Common<'_>, reasoning: bool) -> Result<RoutingFields, ApiError> {
    Ok(RoutingFields {
        choices: choices(c.n, c.best_of)?,
        model: model.into_owned(),
        max_tokens: c.max_completion_tokens.or(c.max_tokens),
        stream: c.stream.unwrap_or(false),
        include_usage: c.include_usage,
        user: c.user.map(Cow::into_owned),
        body_keys: BodyKeys { cache_salt: c.cache_salt.is_some(), stream_options: c.stream_options_key },
        cache_salt: c.cache_salt.flatten().filter(|s| !s.is_empty()),
        reasoning,
    })
}

/// Deserializes a body, naming the offending field (`param`) on error; malformed JSON is `invalid_json`.
fn typed<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let v = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if matches!(inner.classify(), serde_json::error::Category::Syntax | serde_json::error::Category::Eof)
        {
            return ApiError::bad_json(format!("the body is not valid JSON: {inner}"));
        }
        let msg = inner.to_string();
        let param = if path == "." { msg.split('`').nth(1).unwrap_or("body").to_owned() } else { path };
        ApiError::invalid(&param, format!("invalid request: {param}: {msg}"))
    })?;
    de.end().map_err(|e| ApiError::bad_json(format!("the body is not valid JSON: {e}")))?;
    Ok(v)
}

/// Builds the JSON value of `raw`, spending one unit of `budget` per value; refused when it runs out.
fn bounded(raw: &RawValue, budget: &Cell<usize>, field: &str) -> Result<Value, ApiError> {
    let mut de = serde_json::Deserializer::from_str(raw.get());
    BudgetSeed(budget).deserialize(&mut de).map_err(|e| {
        if budget.get() == 0 {
            ApiError::invalid(
                field,
                "the request's messages, tools and chat_template_kwargs hold more JSON values than this gateway \
                 accepts (--max-chat-json-values)",
            )
        } else {
            ApiError::invalid(field, format!("invalid request: {field}: {e}"))
        }
    })
}

struct BudgetSeed<'b>(&'b Cell<usize>);

impl BudgetSeed<'_> {
    fn spend<E: serde::de::Error>(&self) -> Result<(), E> {
        match self.0.get() {
            0 => Err(E::custom("too many JSON values")),
            n => {
                self.0.set(n - 1);
                Ok(())
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for BudgetSeed<'_> {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for BudgetSeed<'_> {
    type Value = Value;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Value, E> {
        self.spend()?;
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Value, E> {
        self.spend()?;
        Ok(Value::from(v))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Value, E> {
        self.spend()?;
        Ok(Value::from(v))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        self.spend()?;
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Value, E> {
        self.spend()?;
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Value, E> {
        self.spend()?;
        Ok(Value::String(v))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
        self.spend()?;
        Ok(Value::Null)
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.spend()?;
        let mut v = Vec::new();
        while let Some(x) = seq.next_element_seed(BudgetSeed(self.0))? {
            v.push(x);
        }
        Ok(Value::Array(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.spend()?;
        let mut m = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(BudgetSeed(self.0))?;
            m.insert(k, v);
        }
        Ok(Value::Object(m))
    }
}

/// `body` with the members of `set` (JSON texts) in place of its own: prepended to a copy when `present` is false
/// (the body has none of them), else rewritten member by member, a body that repeats a member refused (400). The
/// one salt and `stream_options` rewrite of every path that forwards a client's body.
pub fn set_members(body: &[u8], present: bool, set: &[(&str, String)]) -> Result<Vec<u8>, ApiError> {
    match present {
        false => with_first_members(body, set),
        true => with_members(body, set),
    }
}

/// `body` (an object without any of these keys) with the members of `set` added first: a copy, no parse (the
/// common case: a stream asked for its usage, a tenant's salt, in a body that has neither).
pub fn with_first_members(body: &[u8], set: &[(&str, String)]) -> Result<Vec<u8>, ApiError> {
    let not_object = || ApiError::bad_json("the body is not a JSON object");
    let open = body.iter().position(|b| !b.is_ascii_whitespace()).ok_or_else(not_object)?;
    if body[open] != b'{' {
        return Err(not_object());
    }
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()).is_none_or(|b| *b == b'}');
    let extra: usize = set.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
    let mut out = Vec::with_capacity(body.len() + extra);
    out.push(b'{');
    for (i, (k, v)) in set.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, k).map_err(|e| ApiError::internal(e.to_string()))?;
        out.push(b':');
        out.extend_from_slice(v.as_bytes());
    }
    if !empty && !set.is_empty() {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Ok(out)
}

/// `body` with top-level members replaced or added: each `(key, JSON text)` of `set` (a caller's key forces its
/// tenant's salt; a stream is asked for its usage). Only the top-level keys are looked at; every other value is
/// copied as it was sent.
pub fn with_members(body: &[u8], set: &[(&str, String)]) -> Result<Vec<u8>, ApiError> {
    struct Entries<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);
    impl<'de> Deserialize<'de> for Entries<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Entries<'de>;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries<'de>, A::Error> {
                    let mut out = Vec::new();
                    while let Some(k) = map.next_key::<Cow<'de, str>>()? {
                        out.push((k, map.next_value::<&'de RawValue>()?));
                    }
                    Ok(Entries(out))
                }
            }
            d.deserialize_map(V)
        }
    }
    let text = std::str::from_utf8(body).map_err(|_| ApiError::bad_json("the body is not UTF-8"))?;
    let entries: Entries<'_> = serde_json::from_str(text)
        .map_err(|e| ApiError::bad_json(format!("the body is not valid JSON: {e}")))?;
    // A body with a member twice means different things to different parsers (serde keeps the first or refuses,
    // Python's json the last): the gateway would rewrite one copy and a pod might read the other.
    let mut seen = std::collections::HashSet::with_capacity(entries.0.len());
    if let Some((k, _)) = entries.0.iter().find(|(k, _)| !seen.insert(k.as_ref())) {
        return Err(ApiError::invalid(
            k.to_string(),
            format!("the member {k:?} appears more than once in the body"),
        ));
    }
    let extra: usize = set.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
    let mut out = Vec::with_capacity(body.len() + extra + 2);
    out.push(b'{');
    for (k, v) in entries.0.iter().filter(|(k, _)| !set.iter().any(|(s, _)| s == k)) {
        serde_json::to_writer(&mut out, k).map_err(|e| ApiError::internal(e.to_string()))?;
        out.push(b':');
        out.extend_from_slice(v.get().as_bytes());
        out.push(b',');
    }
    for (k, v) in set {
        serde_json::to_writer(&mut out, k).map_err(|e| ApiError::internal(e.to_string()))?;
        out.push(b':');
        out.extend_from_slice(v.as_bytes());
        out.push(b',');
    }
    if out.last() == Some(&b',') {
        out.pop();
    }
    out.push(b'}');
    Ok(out)
}

/// Most JSON values of a `stream_options` object the gateway rewrites (it has two members in OpenAI's API).
pub const MAX_STREAM_OPTIONS_VALUES: usize = 64;

/// The top-level `stream_options` of `body` with `include_usage: true` (other members kept), as JSON text.
pub fn stream_options_with_usage(body: &[u8]) -> Result<String, ApiError> {
    #[derive(Deserialize)]
    struct Only<'a> {
        #[serde(default, borrow)]
        stream_options: Option<&'a RawValue>,
    }
    let only: Only<'_> = typed(body)?;
    let budget = Cell::new(MAX_STREAM_OPTIONS_VALUES);
    let mut o = match only.stream_options.map(|r| bounded(r, &budget, "stream_options")).transpose()? {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(ApiError::invalid("stream_options", "stream_options must be an object")),
    };
    o.insert("include_usage".into(), Value::Bool(true));
    serde_json::to_string(&o).map_err(|e| ApiError::internal(e.to_string()))
}

#[cfg(test)]
mod tests;
