//! Synthetic Mooncake-format traces for shapes the published traces lack. `long_document`: questions about a few long
//! documents (RAG over whole documents, long-context QA): every request is one document (24K-96K tokens) followed by
//! its own question, documents drawn Zipf-like (a few are asked about most), Poisson arrivals. The cache decides
//! almost everything: a hit prefills a question, a miss prefills a whole document.

use std::path::{Path, PathBuf};

use kvgate_shared::prompt::SplitMix64;

use crate::trace::{Trace, TraceRequest, TRACE_BLOCK_TOKENS};

/// Why a trace was not generated. None of these goes away on a retry with the same arguments.
#[derive(Debug, thiserror::Error)]
pub enum TraceGenError {
    #[error("invalid trace shape: {0}")]
    Shape(&'static str),
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
}

/// The long-document trace's shape.
#[derive(Clone, Copy, Debug)]
pub struct LongDocument {
    pub seed: u64,
    pub documents: usize,
    pub requests: usize,
    /// Mean arrivals per second.
    pub rate: f64,
    /// Document lengths are uniform in this range, in tokens.
    pub doc_tokens: (usize, usize),
    /// Question lengths, tokens.
    pub question_tokens: (usize, usize),
    /// Output lengths, tokens.
    pub output_tokens: (usize, usize),
}

impl Default for LongDocument {
    fn default() -> Self {
        Self {
            seed: 1,
            documents: 32,
            requests: 2_000,
            rate: 2.0,
            doc_tokens: (24_576, 98_304),
            question_tokens: (64, 1_024),
            output_tokens: (64, 512),
        }
    }
}

fn uniform(rng: &mut SplitMix64, (lo, hi): (usize, usize)) -> usize {
    lo + rng.below((hi.max(lo) - lo + 1) as u64) as usize
}

impl LongDocument {
    /// Refuses a shape with no documents or requests, or a rate that is not a positive number.
    pub fn validate(&self) -> Result<(), TraceGenError> {
        if self.documents == 0 {
            return Err(TraceGenError::Shape("documents must be at least 1"));
        }
        if self.requests == 0 {
            return Err(TraceGenError::Shape("requests must be at least 1"));
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err(TraceGenError::Shape("rate must be a positive number"));
        }
        Ok(())
    }
}

/// The trace (hash ids: each document's blocks, then a fresh id per question block).
pub fn long_document(c: &LongDocument) -> Trace {
    let mut rng = SplitMix64::new(c.seed);
    let mut next_id = 0u64;
    let docs: Vec<Vec<u64>> = (0..c.documents.max(1))
        .map(|_| {
            let blocks = uniform(&mut rng, c.doc_tokens) / TRACE_BLOCK_TOKENS;
            (0..blocks.max(1))
                .map(|_| {
                    next_id += 1;
                    next_id
                })
                .collect()
        })
        .collect();
    // Zipf-like popularity: document k with weight 1 / (k + 1).
    let weights: Vec<f64> = (0..docs.len()).map(|k| 1.0 / (k + 1) as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut at_ms = 0.0f64;
    let requests = (0..c.requests)
        .map(|_| {
            at_ms += -(1.0 - rng.unit()).ln() / c.rate.max(1e-9) * 1000.0;
            let mut roll = rng.unit() * total;
            let d = weights.iter().position(|w| {
                roll -= w;
                roll <= 0.0
            });
            let doc = &docs[d.unwrap_or(docs.len() - 1)];
            let question = uniform(&mut rng, c.question_tokens);
            let input_length = doc.len() * TRACE_BLOCK_TOKENS + question;
            let mut hash_ids = doc.clone();
            for _ in 0..question.div_ceil(TRACE_BLOCK_TOKENS) {
                next_id += 1;
                hash_ids.push(next_id);
            }
            TraceRequest {
                timestamp_ms: at_ms as u64,
                input_length,
                output_length: uniform(&mut rng, c.output_tokens),
                hash_ids,
                lora: None,
            }
        })
        .collect();
    Trace { requests }
}

/// Generates the trace of shape `c` and writes it to `path` as JSON lines.
pub fn write_long_document(c: &LongDocument, path: &Path) -> Result<Trace, TraceGenError> {
    c.validate()?;
    let t = long_document(c);
    std::fs::write(path, to_jsonl(&t))
        .map_err(|source| TraceGenError::Write { path: path.to_owned(), source })?;
    Ok(t)
}

/// The trace as JSON lines (the published traces' format).
pub fn to_jsonl(t: &Trace) -> String {
    let mut out = String::new();
    for r in &t.requests {
        out.push_str(
            &serde_json::json!({
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": r.hash_ids,
            })
            .to_string(),
        );
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_document_trace_is_valid_and_reuses_its_documents() {
        let t = long_document(&LongDocument { requests: 300, ..LongDocument::default() });
        let parsed = Trace::parse(&to_jsonl(&t)).expect("valid");
        assert_eq!(parsed, t, "round trip");
        let roots: std::collections::HashSet<u64> = t.requests.iter().map(|r| r.hash_ids[0]).collect();
        assert!(roots.len() <= 32 && roots.len() > 5, "{} documents asked about", roots.len());
        let mean = t.requests.iter().map(|r| r.input_length).sum::<usize>() / t.requests.len();
        assert!((24_576..=98_304 + 1_024).contains(&mean), "{mean}");
        // Every request but the first of each document reuses all of it.
        assert!(t.distinct_blocks() * 4 < t.requests.iter().map(|r| r.hash_ids.len()).sum::<usize>());
    }

    #[test]
    fn a_shape_without_documents_requests_or_rate_is_refused_by_name() {
        let ok = LongDocument::default();
        for (bad, what) in [
            (LongDocument { documents: 0, ..ok }, "documents"),
            (LongDocument { requests: 0, ..ok }, "requests"),
            (LongDocument { rate: f64::NAN, ..ok }, "rate"),
            (LongDocument { rate: 0.0, ..ok }, "rate"),
        ] {
            let err = bad.validate().expect_err(what).to_string();
            assert!(err.contains(what), "{err}");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let err =
            write_long_document(&ok, &dir.path().join("missing/trace.jsonl")).expect_err("no such folder");
        assert!(matches!(err, TraceGenError::Write { .. }), "{err}");
    }
}
