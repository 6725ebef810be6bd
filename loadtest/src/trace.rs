//! Mooncake request traces (`loadtest/traces/README.md`): one JSON object a line with `timestamp` (ms from the
//! first request), `input_length`, `output_length` and `hash_ids` (chained prefix-block ids, 512 tokens a block),
//! and optionally `lora` (the LoRA adapter the request names; kvgate's extension).
//!
//! Replaying a trace needs real tokens: [`expand_prompt`] turns each hash id into 512 deterministic token ids
//! seeded by the id (equal ids give equal tokens, so the trace's shared prefixes become shared token prefixes) and
//! cuts the last block to `input_length`. Worker blocks of 16 tokens then line up with the trace's blocks.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use kvgate_shared::prompt::SplitMix64;
use serde::Deserialize;

/// Tokens per trace hash id.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    /// Arrival, ms after the first request.
    #[serde(rename = "timestamp")]
    pub timestamp_ms: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
    /// The LoRA adapter the request names (its `model`), if any: an extension of the Mooncake format, which the
    /// simulator reads (`sim::adapters`).
    #[serde(default)]
    pub lora: Option<String>,
}

/// A whole trace, in arrival order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    pub requests: Vec<TraceRequest>,
}

impl Trace {
    /// Reads a trace file; errors name the line.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses JSON lines (blank lines skipped) and checks every row: at least one input token, enough hash ids
    /// for `input_length`, timestamps that never go back.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut requests: Vec<TraceRequest> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let n = i + 1;
            let r: TraceRequest = serde_json::from_str(line).map_err(|e| format!("line {n}: {e}"))?;
            if r.input_length == 0 {
                return Err(format!("line {n}: input_length must be at least 1"));
            }
            let needed = r.input_length.div_ceil(TRACE_BLOCK_TOKENS);
            if r.hash_ids.len() < needed {
                return Err(format!(
                    "line {n}: input_length {} needs {needed} hash_ids of {TRACE_BLOCK_TOKENS} tokens, got {}",
                    r.input_length,
                    r.hash_ids.len()
                ));
            }
            if let Some(prev) = requests.last() {
                if r.timestamp_ms < prev.timestamp_ms {
                    return Err(format!(
                        "line {n}: timestamp {} goes back (previous {})",
                        r.timestamp_ms, prev.timestamp_ms
                    ));
                }
            }
            requests.push(r);
        }
        if requests.is_empty() {
            return Err("the trace has no requests".into());
        }
        Ok(Self { requests })
    }

    /// Keeps `limit` requests (all if `None`) after skipping the first `skip`; at least one stays.
    pub fn window(&mut self, skip: usize, limit: Option<usize>) {
        let skip = skip.min(self.requests.len().saturating_sub(1));
        self.requests.drain(..skip);
        if let Some(n) = limit {
            self.requests.truncate(n.max(1));
        }
    }

    /// Keeps only the requests of the `k` prefix families with the most requests (a family: the requests whose first
    /// hash id is the same; ties go to the family seen first), in arrival order. The trace's reuse is spread over
    /// its whole length (in the shared Mooncake trace, a window of 100 consecutive requests reuses under 4% of its
    /// blocks while the whole trace reuses 64%), so a short replay through real processes samples families rather
    /// than a window: the top 10 families are 189 requests that reuse 94% of their blocks.
    pub fn top_roots(&mut self, k: usize) {
        let mut families: HashMap<u64, (usize, usize)> = HashMap::new(); // root -> (requests, first seen)
        for (i, r) in self.requests.iter().enumerate() {
            if let Some(root) = r.hash_ids.first() {
                families.entry(*root).or_insert((0, i)).0 += 1;
            }
        }
        let mut ranked: Vec<(u64, (usize, usize))> = families.into_iter().collect();
        ranked.sort_by_key(|(_, (n, first))| (std::cmp::Reverse(*n), *first));
        let keep: HashSet<u64> = ranked.iter().take(k.max(1)).map(|(root, _)| *root).collect();
        self.requests.retain(|r| r.hash_ids.first().is_some_and(|root| keep.contains(root)));
    }

    /// Time from the first arrival to the last, in seconds.
    pub fn span_s(&self) -> f64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => (b.timestamp_ms - a.timestamp_ms) as f64 / 1000.0,
            _ => 0.0,
        }
    }

    /// Distinct hash ids (512-token blocks) the trace's prompts use.
    pub fn distinct_blocks(&self) -> usize {
        let mut seen: HashSet<u64> = HashSet::new();
        for r in &self.requests {
            seen.extend(&r.hash_ids[..r.input_length.div_ceil(TRACE_BLOCK_TOKENS)]);
        }
        seen.len()
    }
}

/// A trace from `(timestamp_ms, input_length, output_length, hash_ids)` rows (tests).
#[cfg(test)]
pub(crate) fn from_rows(rows: &[(u64, usize, usize, &[u64])]) -> Trace {
    let text: String = rows
        .iter()
        .map(|(ts, len, out, ids)| {
            format!(
                r#"{{"timestamp": {ts}, "input_length": {len}, "output_length": {out}, "hash_ids": {ids:?}}}"#
            ) + "\n"
        })
        .collect();
    Trace::parse(&text).expect("trace")
}

/// The 512 tokens of hash id `id`, each below `vocab`.
pub fn block_tokens(id: u64, vocab: u32, out: &mut Vec<u32>) {
    let mut rng = SplitMix64::new(id ^ 0x6B76_6761_7465_5452); // "kvgateTR"
    out.extend((0..TRACE_BLOCK_TOKENS).map(|_| rng.below(u64::from(vocab.max(1))) as u32));
}

/// A request's prompt: its hash ids expanded, cut to `input_length`.
pub fn expand_prompt(r: &TraceRequest, vocab: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(r.input_length.next_multiple_of(TRACE_BLOCK_TOKENS));
    for id in r.hash_ids.iter().take(r.input_length.div_ceil(TRACE_BLOCK_TOKENS)) {
        block_tokens(*id, vocab, &mut out);
    }
    out.truncate(r.input_length);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}

{"timestamp": 5, "input_length": 1100, "output_length": 0, "hash_ids": [7, 8, 9]}
"#;

    #[test]
    fn parses_and_expands_with_shared_prefixes() {
        let t = Trace::parse(TWO).expect("parses");
        assert_eq!(t.requests.len(), 2);
        assert_eq!(t.distinct_blocks(), 3);
        assert!((t.span_s() - 0.005).abs() < 1e-12);
        let mut w = t.clone();
        w.window(1, Some(5));
        assert_eq!(w.requests, t.requests[1..]);
        w.window(9, None);
        assert_eq!(w.requests.len(), 1, "a window never empties the trace");
        let a = expand_prompt(&t.requests[0], 32_000);
        let b = expand_prompt(&t.requests[1], 32_000);
        assert_eq!((a.len(), b.len()), (600, 1100));
        assert_eq!(a[..], b[..600], "equal ids at equal positions give equal tokens");
        assert!(b.iter().all(|t| *t < 32_000));
        let mut other = Vec::new();
        block_tokens(9, 32_000, &mut other);
        assert_eq!(other[..76], b[1024..], "block 9 is the third block, cut to 76 tokens");
        assert_ne!(a[..512], b[512..1024], "different ids differ");
    }

    #[test]
    fn top_roots_keeps_the_largest_families_in_order() {
        let row = |ts: u64, ids: &str| {
            format!(r#"{{"timestamp": {ts}, "input_length": 5, "output_length": 1, "hash_ids": [{ids}]}}"#)
        };
        let text =
            [row(0, "1"), row(1, "2"), row(2, "3"), row(3, "2"), row(4, "1"), row(5, "2"), row(6, "3")]
                .join("\n");
        let t = Trace::parse(&text).expect("parses");
        let mut top = t.clone();
        top.top_roots(1);
        let ts: Vec<u64> = top.requests.iter().map(|r| r.timestamp_ms).collect();
        assert_eq!(ts, [1, 3, 5], "family 2 has three requests");
        let mut two = t.clone();
        two.top_roots(2);
        let ts: Vec<u64> = two.requests.iter().map(|r| r.timestamp_ms).collect();
        assert_eq!(ts, [0, 1, 3, 4, 5], "families 1 and 3 tie at two; 1 was seen first");
        let mut all = t.clone();
        all.top_roots(0);
        assert_eq!(all.requests.len(), 3, "at least one family stays");
    }

    #[test]
    fn bad_rows_name_their_line() {
        let cases = [
            (r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}"#, "line 1: input_length"),
            (r#"{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}"#, "needs 2 hash_ids"),
            (r#"{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], "x": 1}"#, "unknown field"),
            ("{\"timestamp\": 9, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 3, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}", "line 2: timestamp 3 goes back"),
            ("", "no requests"),
        ];
        for (text, want) in cases {
            let err = Trace::parse(text).expect_err(text);
            assert!(err.contains(want), "{err} should contain {want}");
        }
    }
}
