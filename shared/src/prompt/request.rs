//! An OpenAI request's prompt as both sides read it: which chat options reach the template, which cache salt keys
//! the blocks, and the token ids. The gateway (`prepare.rs`) and the worker (`server/api.rs`) parse bodies with
//! their own types (the gateway's borrow and skip; the worker's are complete) but both end here, so the ids and the
//! salt, and therefore the block hashes, cannot drift apart.

use serde_json::{Map, Value as Json};

use super::{ChatOptions, PromptError, PromptInput, Prompter};
use crate::handoff::TenantScope;
use crate::hashing::{ExtraKey, ExtraKeys};

/// Header that can carry the tenant's cache salt instead of the body's `cache_salt`.
pub const CACHE_SALT_HEADER: &str = "x-kvgate-cache-salt";

/// The chat options of a request's fields: `add_generation_prompt` defaults to true (an OpenAI chat always
/// answers); `tools: null` is no tools.
pub fn chat_options(
    add_generation_prompt: Option<bool>,
    tools: Option<Json>,
    chat_template_kwargs: Option<Map<String, Json>>,
) -> ChatOptions {
    ChatOptions {
        add_generation_prompt: add_generation_prompt.unwrap_or(true),
        tools: tools.filter(|t| !t.is_null()),
        extra: chat_template_kwargs,
        continue_final_message: false,
    }
}

/// A request's prompt and the salt sources it came with.
#[derive(Clone, Debug)]
pub struct RequestPrompt<'a> {
    pub input: PromptInput<'a>,
    /// The body's `cache_salt` (on the gateway: a caller key's forced salt replaces it).
    pub body_salt: Option<&'a str>,
    /// The `x-kvgate-cache-salt` header.
    pub header_salt: Option<&'a str>,
    /// The tenant the salt is scoped to (the gateway: from the caller's key; a worker: only from a verified
    /// gateway assertion, `handoff`).
    pub scope: Option<&'a TenantScope>,
}

impl RequestPrompt<'_> {
    /// The salt the blocks are keyed with: the body's, else the header's; an empty one counts as absent (so an
    /// empty body field does not hide the header).
    pub fn salt(&self) -> Option<&str> {
        self.body_salt.filter(|s| !s.is_empty()).or(self.header_salt.filter(|s| !s.is_empty()))
    }

    /// The extra hash keys of the salt: a plain client salt; a keyed tenant's client salt with its tenant; a salt
    /// the tenant's key forced, tagged as such, with its tenant. A scope without a salt keys nothing (unsalted
    /// requests share blocks across tenants, like a shared system prompt).
    pub fn extra_keys(&self) -> ExtraKeys {
        match (self.scope, self.salt()) {
            (_, None) => ExtraKeys::none(),
            (None, Some(s)) => ExtraKeys::from_salt(Some(s)),
            (Some(t), Some(s)) => {
                let salt =
                    if t.forced { ExtraKey::TenantSalt(s.into()) } else { ExtraKey::CacheSalt(s.into()) };
                ExtraKeys::none().with(ExtraKey::Tenant(t.id.clone())).with(salt)
            }
        }
    }

    /// The prompt's token ids: `handed` (ids the gateway computed and authenticated) when given, else rendered and
    /// tokenized here.
    pub fn token_ids(&self, prompter: &Prompter, handed: Option<Vec<u32>>) -> Result<Vec<u32>, PromptError> {
        match (handed, &self.input) {
            // Ids given as the prompt are the prompt: nothing was tokenized to hand over.
            (_, PromptInput::TokenIds(_)) | (None, _) => prompter.tokenize(&self.input),
            (Some(ids), _) => Ok(ids),
        }
    }

    /// The request field a prompt error is about.
    pub fn param(&self) -> &'static str {
        match self.input {
            PromptInput::Chat { .. } => "messages",
            _ => "prompt",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(body: Option<&'a str>, header: Option<&'a str>) -> RequestPrompt<'a> {
        RequestPrompt { input: PromptInput::Text("x"), body_salt: body, header_salt: header, scope: None }
    }

    #[test]
    fn the_body_salt_wins_and_empty_is_absent() {
        assert_eq!(req(Some("a"), Some("b")).salt(), Some("a"));
        assert_eq!(req(None, Some("b")).salt(), Some("b"));
        assert_eq!(req(Some(""), Some("b")).salt(), Some("b"), "an empty body salt does not hide the header");
        assert_eq!(req(Some(""), Some("")).salt(), None);
        assert_eq!(req(None, None).extra_keys(), ExtraKeys::none());
        assert_ne!(req(Some("a"), None).extra_keys(), ExtraKeys::none());
    }

    #[test]
    fn scoped_and_forced_salts_are_separate_namespaces() {
        let forced = TenantScope::new("team-a", true);
        let client = TenantScope::new("team-a", false);
        let other = TenantScope::new("team-b", false);
        let keys = |scope| RequestPrompt { scope, ..req(Some("team-a"), None) }.extra_keys();
        let all = [keys(None), keys(Some(&forced)), keys(Some(&client)), keys(Some(&other))];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        let unsalted = RequestPrompt { scope: Some(&client), ..req(None, None) };
        assert_eq!(unsalted.extra_keys(), ExtraKeys::none());
    }

    #[test]
    fn chat_options_default_to_answering() {
        let o = chat_options(None, Some(Json::Null), None);
        assert!(o.add_generation_prompt);
        assert!(o.tools.is_none());
        assert!(!chat_options(Some(false), None, None).add_generation_prompt);
    }
}
