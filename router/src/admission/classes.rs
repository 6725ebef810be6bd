//! Request classes: a name, a match rule and a budget. The first class whose rule matches takes the request (the
//! last class if none does). The `x-kvgate-class` header can name a class only for a caller whose API key allows
//! that class (see `keys.rs`); the proxy checks that before it asks for a class by name. Defaults (`short`, `long`,
//! `reasoning`) keep a burst of million-token requests from starving short ones out of the box.

use serde::{Deserialize, Serialize};

/// Header naming a class explicitly (honoured only for callers allowed to choose it).
pub const CLASS_HEADER: &str = "x-kvgate-class";

/// Which requests a class takes (every given condition must hold).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MatchRule {
    /// Prompt tokens at least this many.
    pub min_prompt_tokens: Option<u64>,
    /// Prompt tokens fewer than this many.
    pub max_prompt_tokens: Option<u64>,
    /// `max_tokens` at least this many.
    pub min_max_tokens: Option<u64>,
    /// `max_tokens` fewer than this many.
    pub max_max_tokens: Option<u64>,
    /// Only these models (empty: any).
    pub models: Vec<String>,
    /// Requests that carry `reasoning_effort` (true) or do not (false).
    pub reasoning: Option<bool>,
}

/// A class's budget and queue limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    pub name: String,
    #[serde(default, rename = "match")]
    pub rule: MatchRule,
    /// Refill rate, tokens per second.
    pub refill_tokens_per_s: f64,
    /// Bucket size in tokens.
    pub burst_tokens: f64,
    /// Most requests waiting in the class queue.
    #[serde(default = "default_queue_requests")]
    pub max_queued_requests: usize,
    /// Most tokens (sum of costs) waiting in the class queue.
    #[serde(default = "default_queue_tokens")]
    pub max_queued_tokens: f64,
    /// Longest a request waits before 429, in milliseconds.
    #[serde(default = "default_max_wait_ms")]
    pub max_wait_ms: u64,
    /// Output tokens charged when a request gives no `max_tokens`.
    #[serde(default = "default_expected_output")]
    pub expected_output_tokens: u64,
    /// When its own bucket is empty, take from an idle class (empty queue, full bucket). Default false.
    #[serde(default)]
    pub borrow_idle: bool,
    /// Most tenants with their own wait queue; further tenants share one overflow queue. Default 1024.
    #[serde(default = "default_max_tenant_queues")]
    pub max_tenant_queues: usize,
    /// The SLOs its requests are routed to meet (`routing::Slo`; a `[classes.slo]` table; default: first token
    /// within 1 s, then 200 ms a token).
    #[serde(default)]
    pub slo: crate::routing::Slo,
}

fn default_max_tenant_queues() -> usize {
    1024
}

fn default_queue_requests() -> usize {
    256
}
fn default_queue_tokens() -> f64 {
    4_000_000.0
}
fn default_max_wait_ms() -> u64 {
    10_000
}
fn default_expected_output() -> u64 {
    DEFAULT_EXPECTED_OUTPUT_TOKENS
}

/// A class's `expected_output_tokens` unless configured.
pub const DEFAULT_EXPECTED_OUTPUT_TOKENS: u64 = 256;

/// What classification looks at.
#[derive(Clone, Debug, Default)]
pub struct ClassInput<'a> {
    pub prompt_tokens: u64,
    pub max_tokens: Option<u64>,
    pub model: &'a str,
    pub reasoning: bool,
}

impl MatchRule {
    pub fn matches(&self, r: &ClassInput<'_>) -> bool {
        let mt = r.max_tokens.unwrap_or(0);
        self.min_prompt_tokens.is_none_or(|v| r.prompt_tokens >= v)
            && self.max_prompt_tokens.is_none_or(|v| r.prompt_tokens < v)
            && self.min_max_tokens.is_none_or(|v| mt >= v)
            && self.max_max_tokens.is_none_or(|v| mt < v)
            && (self.models.is_empty() || self.models.iter().any(|m| m == r.model))
            && self.reasoning.is_none_or(|v| v == r.reasoning)
    }
}

/// The default class set: `reasoning` (requests with `reasoning_effort`), `short` (prompts under 8K tokens) and
/// `long` (the rest), each with its own budget.
pub fn default_classes() -> Vec<ClassConfig> {
    let class = |name: &str, rule: MatchRule, rate: f64, burst: f64| ClassConfig {
        name: name.into(),
        rule,
        refill_tokens_per_s: rate,
        burst_tokens: burst,
        max_queued_requests: default_queue_requests(),
        max_queued_tokens: default_queue_tokens(),
        max_wait_ms: default_max_wait_ms(),
        expected_output_tokens: default_expected_output(),
        borrow_idle: false,
        max_tenant_queues: default_max_tenant_queues(),
        slo: crate::routing::Slo::default(),
    };
    vec![
        class(
            "reasoning",
            MatchRule { reasoning: Some(true), ..MatchRule::default() },
            200_000.0,
            1_000_000.0,
        ),
        class(
            "short",
            MatchRule { max_prompt_tokens: Some(8192), ..MatchRule::default() },
            500_000.0,
            1_000_000.0,
        ),
        ClassConfig {
            // A long prompt takes longer to its first token: 100 ms more per 1,000 tokens.
            slo: crate::routing::Slo { ttft_ms_per_1k_tokens: 100.0, ..crate::routing::Slo::default() },
            ..class("long", MatchRule::default(), 500_000.0, 4_000_000.0)
        },
    ]
}

/// Index of the class for a request: the first matching rule, else the last class.
pub fn classify(classes: &[ClassConfig], r: &ClassInput<'_>) -> usize {
    classify_by(classes.iter(), r)
}

/// [`classify`] over any sequence of class configs.
pub fn classify_by<'a, I>(classes: I, r: &ClassInput<'_>) -> usize
where
    I: Iterator<Item = &'a ClassConfig> + Clone,
{
    let n = classes.clone().count();
    classes.clone().position(|c| c.rule.matches(r)).unwrap_or(n.saturating_sub(1))
}

/// Every problem with a class set.
pub fn validate(classes: &[ClassConfig]) -> Vec<String> {
    let mut p = Vec::new();
    if classes.is_empty() {
        p.push("at least one class is required".into());
    }
    for (i, c) in classes.iter().enumerate() {
        if c.name.is_empty() {
            p.push(format!("class {i}: name is empty"));
        }
        if classes[..i].iter().any(|o| o.name == c.name) {
            p.push(format!("class {:?}: duplicate name", c.name));
        }
        if !(c.refill_tokens_per_s.is_finite() && c.refill_tokens_per_s > 0.0) {
            p.push(format!("class {:?}: refill_tokens_per_s must be > 0", c.name));
        }
        if !(c.burst_tokens.is_finite() && c.burst_tokens >= 1.0) {
            p.push(format!("class {:?}: burst_tokens must be >= 1", c.name));
        }
        if !(c.max_queued_tokens.is_finite() && c.max_queued_tokens >= 0.0) {
            p.push(format!("class {:?}: max_queued_tokens must be >= 0", c.name));
        }
        if c.max_tenant_queues == 0 {
            p.push(format!("class {:?}: max_tenant_queues must be >= 1", c.name));
        }
        if c.name.len() > 64 {
            p.push(format!("class {:?}: name longer than 64 bytes", c.name));
        }
        p.extend(c.slo.validate().into_iter().map(|e| format!("class {:?}: {e}", c.name)));
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_classes_split_short_long_reasoning() {
        let c = default_classes();
        assert!(validate(&c).is_empty());
        let input = |p: u64, reasoning: bool| ClassInput {
            prompt_tokens: p,
            reasoning,
            model: "m",
            ..Default::default()
        };
        assert_eq!(c[classify(&c, &input(100, false))].name, "short");
        assert_eq!(c[classify(&c, &input(100_000, false))].name, "long");
        assert_eq!(c[classify(&c, &input(100, true))].name, "reasoning");
        let mut bad = default_classes();
        bad[1].name = "reasoning".into();
        bad[0].refill_tokens_per_s = 0.0;
        assert_eq!(validate(&bad).len(), 2);
    }
}
