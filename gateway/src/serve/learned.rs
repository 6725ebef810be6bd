//! The output each class's completed requests produced (`kvgate_router::split::predict::OutputEstimate`: a moving
//! average and a count), learned from the responses' usage and read when a request that names no `max_tokens` is
//! priced. Bounded: at most one entry per configured class (class names are configured ones, never a client's).

use std::collections::HashMap;
use std::sync::Mutex;

use kvgate_router::split::predict::OutputEstimate;

/// Per class name, what its completed requests produced.
#[derive(Debug)]
pub struct LearnedOutputs {
    by_class: Mutex<HashMap<String, OutputEstimate>>,
    max_classes: usize,
}

impl LearnedOutputs {
    /// Keeps at most `max_classes` classes (at least one).
    pub fn new(max_classes: usize) -> Self {
        Self { by_class: Mutex::new(HashMap::new()), max_classes: max_classes.max(1) }
    }

    /// The output a request of `class` is priced with: what the class's completed requests produced (once enough
    /// finished), capped by `max_tokens`; before that, `max_tokens`, else the class's configured
    /// `expected_output_tokens`.
    pub fn expected(&self, class: &str, max_tokens: Option<u64>, configured: u64) -> u64 {
        let learned = self.by_class.lock().unwrap_or_else(|e| e.into_inner());
        learned.get(class).copied().unwrap_or_default().predict(max_tokens, configured)
    }

    /// Learns from a completed request of `class` that produced `tokens` (with or without `max_tokens`: a cap the
    /// answer did not reach says nothing, and one it reached is what the client asked for).
    pub fn learn(&self, class: &str, tokens: u64) {
        let mut learned = self.by_class.lock().unwrap_or_else(|e| e.into_inner());
        if !learned.contains_key(class) && learned.len() >= self.max_classes {
            return;
        }
        learned.entry(class.to_owned()).or_default().learn(tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_learns_per_class_and_never_past_its_bound() {
        let l = LearnedOutputs::new(1);
        for _ in 0..64 {
            l.learn("a", 300);
            l.learn("b", 900);
        }
        assert_eq!(l.expected("a", None, 256), 300);
        assert_eq!(l.expected("b", None, 256), 256, "a second class past the bound is not kept");
        assert_eq!(l.expected("a", Some(100), 256), 100, "capped by max_tokens");
    }
}
