//! What a passed-through body (`passthrough.rs`) may cost in prompt tokens, without its tokenizer: an estimate the
//! class budget reserves, and a bound a pod's usage is believed up to.
//!
//! Most bodies are computed once: estimated at `bytes / BYTES_PER_TOKEN`, bounded by the body's bytes plus
//! [`TEMPLATE_SLACK_TOKENS`] (a byte-level tokenizer's token is at least one byte; a chat template adds its own).
//! A score or rerank body is computed once per (query, document) pair: a 400-word query against 2,000 documents
//! is 2,000 sequences that each hold the query. So `/v1/score` (`text_1` / `text_2`, or `queries` with
//! `documents` or `items`) and `/v1/rerank` (`query`, `documents`) are sized per pair: one query against N
//! documents is N pairs, N queries against N documents N pairs (vLLM's 1:N and N:N forms), other shapes the
//! product. A pair is estimated at its bytes / `BYTES_PER_TOKEN` and bounded by its bytes plus
//! [`PAIR_SLACK_TOKENS`] (at most the model's context, which bounds every pair; a non-text entry, an image, is
//! bounded by the context alone).
//!
//! Pure: a parse of the body's members (their raw text, no tree), no I/O.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::passthrough::BYTES_PER_TOKEN;

/// Tokens a chat template may add to a body beyond its bytes.
pub const TEMPLATE_SLACK_TOKENS: u64 = 1024;
/// Tokens a pair's template and special tokens may add beyond its bytes.
pub const PAIR_SLACK_TOKENS: u64 = 256;

/// A body's prompt, as priced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptSize {
    /// What admission reserves.
    pub estimate: u64,
    /// The most a pod's usage is believed.
    pub cap: u64,
}

/// One side of a score or rerank body: each entry's size in bytes (`None`: not text).
type Side = Vec<Option<u64>>;

#[derive(Deserialize)]
struct ScoreLean<'a> {
    #[serde(default, borrow)]
    text_1: Option<&'a RawValue>,
    #[serde(default, borrow)]
    text_2: Option<&'a RawValue>,
    #[serde(default, borrow)]
    query: Option<&'a RawValue>,
    #[serde(default, borrow)]
    queries: Option<&'a RawValue>,
    #[serde(default, borrow)]
    documents: Option<&'a RawValue>,
    #[serde(default, borrow)]
    items: Option<&'a RawValue>,
}

/// The entries of a member that is a string or a list: each one's bytes, `None` for an entry that is not text.
fn side(raw: &RawValue) -> Side {
    if let Ok(list) = serde_json::from_str::<Vec<&RawValue>>(raw.get()) {
        return list.iter().map(|e| entry(e)).collect();
    }
    vec![entry(raw)]
}

fn entry(raw: &RawValue) -> Option<u64> {
    let t = raw.get().trim_start();
    if t.starts_with('"') {
        return Some(raw.get().len() as u64);
    }
    // A rerank document may be {"text": "..."}: its text is what is computed.
    #[derive(Deserialize)]
    struct Text<'a> {
        #[serde(borrow)]
        text: &'a RawValue,
    }
    serde_json::from_str::<Text<'_>>(raw.get())
        .ok()
        .filter(|t| t.text.get().starts_with('"'))
        .map(|t| t.text.get().len() as u64)
}

/// The size of any body computed once.
pub fn whole(body_bytes: u64) -> PromptSize {
    PromptSize {
        estimate: body_bytes / BYTES_PER_TOKEN,
        cap: body_bytes.saturating_add(TEMPLATE_SLACK_TOKENS),
    }
}

/// The size of a score or rerank body at `path` (module docs); `None` when it names no sides (then [`whole`]).
pub fn pairs(path: &str, body: &[u8], max_model_len: Option<u32>) -> Option<PromptSize> {
    if path != "/v1/score" && path != "/v1/rerank" {
        return None;
    }
    let b: ScoreLean<'_> = serde_json::from_slice(body).ok()?;
    let queries = side(b.text_1.or(b.query).or(b.queries)?);
    let docs = side(b.text_2.or(b.documents).or(b.items)?);
    let context = max_model_len.map(u64::from);
    let pair = |q: Option<u64>, d: Option<u64>| -> PromptSize {
        let text = q.zip(d).map(|(q, d)| q.saturating_add(d));
        let estimate = text.map_or_else(|| context.unwrap_or(0), |t| t / BYTES_PER_TOKEN);
        let bound = text.map(|t| t.saturating_add(PAIR_SLACK_TOKENS));
        let cap = match (bound, context) {
            (Some(b), Some(c)) => b.min(c),
            (Some(b), None) => b,
            (None, Some(c)) => c,
            // An image without a known context: nothing bounds it but the estimate of a whole body.
            (None, None) => TEMPLATE_SLACK_TOKENS,
        };
        PromptSize { estimate: estimate.min(cap), cap }
    };
    let mut total = PromptSize { estimate: 0, cap: 0 };
    let mut add = |p: PromptSize| {
        total.estimate = total.estimate.saturating_add(p.estimate);
        total.cap = total.cap.saturating_add(p.cap);
    };
    match (queries.len(), docs.len()) {
        (1, _) => docs.iter().for_each(|d| add(pair(queries[0], *d))),
        (q, d) if q == d => queries.iter().zip(&docs).for_each(|(q, d)| add(pair(*q, *d))),
        _ => queries.iter().for_each(|q| docs.iter().for_each(|d| add(pair(*q, *d)))),
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_against_many_documents_costs_the_query_once_per_document() {
        let query: String = (0..400).map(|i| format!("word{i} ")).collect();
        let docs: Vec<String> = (0..2000).map(|i| format!("document number {i}")).collect();
        let body = serde_json::json!({"model": "m", "text_1": query, "text_2": docs}).to_string();
        let s = pairs("/v1/score", body.as_bytes(), Some(4096)).expect("sized");
        let q = query.len() as u64 + 2;
        assert!(s.estimate >= 2000 * (q / BYTES_PER_TOKEN), "{s:?}");
        assert!(s.estimate > 50 * whole(body.len() as u64).estimate, "far past the body's own size: {s:?}");
        assert!(s.cap >= 2000 * q && s.cap <= 2000 * (q + 22 + PAIR_SLACK_TOKENS), "{s:?}");
        // The same as a rerank body, documents as objects.
        let docs_obj: Vec<serde_json::Value> = docs.iter().map(|d| serde_json::json!({"text": d})).collect();
        let rerank = serde_json::json!({"model": "m", "query": query, "documents": docs_obj}).to_string();
        let r = pairs("/v1/rerank", rerank.as_bytes(), Some(4096)).expect("sized");
        assert!(r.estimate.abs_diff(s.estimate) < 2000, "{r:?} vs {s:?}");
    }

    #[test]
    fn pairs_take_the_forms_vllm_takes_and_the_context_bounds_each() {
        let n_to_n = serde_json::json!({"text_1": ["aaaa", "bbbb"], "text_2": ["cccc", "dddd"]}).to_string();
        let s = pairs("/v1/score", n_to_n.as_bytes(), None).expect("sized");
        assert_eq!(s.estimate, 2 * (12 / BYTES_PER_TOKEN), "two pairs, not four");
        let one = serde_json::json!({"text_1": "q", "text_2": "d"}).to_string();
        assert_eq!(pairs("/v1/score", one.as_bytes(), None).expect("sized").cap, 6 + PAIR_SLACK_TOKENS);
        let image = serde_json::json!({"query": "q", "documents": [{"image_url": "x"}]}).to_string();
        assert_eq!(pairs("/v1/rerank", image.as_bytes(), Some(8192)).expect("sized").cap, 8192);
        let long = serde_json::json!({"query": "q".repeat(10_000), "documents": ["d"]}).to_string();
        assert_eq!(pairs("/v1/rerank", long.as_bytes(), Some(512)).expect("sized").cap, 512);
        assert_eq!(pairs("/v1/embeddings", one.as_bytes(), None), None, "not a pairs path");
        assert_eq!(pairs("/v1/score", b"{\"input\": \"x\"}", None), None, "no sides: the whole body");
        assert_eq!(pairs("/v1/score", b"not json", None), None);
    }
}
