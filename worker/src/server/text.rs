//! Output text: incremental detokenization for streaming (never splitting a UTF-8 character), and stop strings
//! (the text ends before the first stop string; text that could still become a stop string is held back).

use std::sync::Arc;

use kvgate_shared::prompt::Prompter;

/// Turns a growing list of output ids into text deltas.
pub struct TextStream {
    prompter: Arc<Prompter>,
    ids: Vec<u32>,
    stops: Vec<String>,
    /// Bytes of the full text already emitted.
    emitted: usize,
    stopped: bool,
}

impl TextStream {
    pub fn new(prompter: Arc<Prompter>, stops: Vec<String>) -> Self {
        Self { prompter, ids: Vec::new(), stops, emitted: 0, stopped: false }
    }

    /// Adds a token; returns the new text that is safe to show (maybe empty). `last` flushes everything left.
    pub fn push(&mut self, token: Option<u32>, last: bool) -> String {
        if let Some(t) = token {
            self.ids.push(t);
        }
        if self.stopped {
            return String::new();
        }
        let mut text = self.prompter.decode(&self.ids, true).unwrap_or_default();
        // Cut at the first stop string.
        if let Some(cut) = self.stops.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(cut);
            self.stopped = true;
        }
        let mut end = text.len();
        if !last && !self.stopped {
            // An incomplete character decodes to U+FFFD: wait for the next token.
            if text.ends_with('\u{FFFD}') {
                end = text.trim_end_matches('\u{FFFD}').len();
            }
            // Hold back a tail that could be the start of a stop string.
            let hold = self.stops.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
            end = end.saturating_sub(hold);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
        }
        if end <= self.emitted {
            return String::new();
        }
        let delta = text[self.emitted..end].to_string();
        self.emitted = end;
        delta
    }
}
