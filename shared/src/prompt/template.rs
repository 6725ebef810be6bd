//! Chat templates rendered with minijinja the way Hugging Face's `apply_chat_template` renders them with Jinja2:
//! `trim_blocks` + `lstrip_blocks`, `raise_exception`, `strftime_now`, a Python-compatible `tojson`, and
//! Python string/dict methods (`.strip()`, `.startswith()`, `.items()`, ...) through minijinja-contrib's pycompat.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

use super::PromptError;

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("source_len", &self.source.len()).finish()
    }
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles a template; a syntax error is a [`PromptError::Template`].
    pub fn new(source: &str) -> Result<Self, PromptError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| PromptError::Template(format!("chat template does not compile: {e:#}")))?;
        Ok(Self { env, source: source.to_owned() })
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders with the given context (`messages`, `add_generation_prompt`, `bos_token`, ...).
    pub fn render(&self, ctx: Value) -> Result<String, PromptError> {
        let tmpl = self.env.get_template(NAME).map_err(|e| PromptError::Template(e.to_string()))?;
        tmpl.render(ctx).map_err(|e| match e.kind() {
            // raise_exception(): the template refusing the conversation is the caller's fault.
            ErrorKind::InvalidOperation if e.detail().is_some() => {
                PromptError::InvalidConversation(e.detail().unwrap_or_default().to_owned())
            }
            // The template compiled at load time; failing now is about these messages (a content of a type the
            // template does not expect, a missing field it reads): the caller's fault, 400, as in vLLM.
            _ => PromptError::InvalidConversation(format!(
                "the chat template cannot render these messages: {e:#}"
            )),
        })
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    // chrono reports an unknown specifier as a formatting error instead of panicking when written this way.
    match write!(out, "{}", chrono::Local::now().format(&format)) {
        Ok(()) => out,
        Err(_) => format,
    }
}

/// `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`: Python's separators (`", "` and
/// `": "` without indent), no HTML escaping, keys in insertion order unless `sort_keys`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    if sort_keys.unwrap_or(false) {
        sort_json_keys(&mut json);
    }
    let mut out = Vec::new();
    let res = match indent {
        Some(n) => {
            let pad = " ".repeat(n);
            let fmt = serde_json::ser::PrettyFormatter::with_indent(pad.as_bytes());
            serde::Serialize::serialize(&json, &mut serde_json::Serializer::with_formatter(&mut out, fmt))
        }
        None => serde::Serialize::serialize(
            &json,
            &mut serde_json::Serializer::with_formatter(&mut out, PyCompact),
        ),
    };
    res.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(String::from_utf8(out).unwrap_or_default()))
}

fn sort_json_keys(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<(String, serde_json::Value)> = std::mem::take(map).into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut val) in entries {
                sort_json_keys(&mut val);
                map.insert(k, val);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(sort_json_keys),
        _ => {}
    }
}

/// serde_json formatter with Python's default separators.
struct PyCompact;

impl serde_json::ser::Formatter for PyCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}
