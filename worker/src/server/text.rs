//! Output text: incremental detokenization for streaming (never splitting a UTF-8 character), and stop strings
//! (the text ends before the first stop string; text that could still become a stop string is held back).
//!
//! Each token that adds text costs a bounded amount of work, not the whole answer so far (a run of tokens that add
//! none, or a decoder that rewrites its context, grows the window until text comes or the flush, as in vLLM's
//! incremental detokenizer): the stream decodes only a window of
//! recent ids (`ids[prefix..]`, where `ids[prefix..read]` were already shown; the prefix gives the decoder the
//! context a token's leading space depends on), appends what the window adds past its prefix once that is whole
//! characters, and looks for stop strings only where a new one can end. Invariant: `text` is what decoding every
//! id so far would give, up to the last complete character (`push(.., last: true)` flushes the rest); the tests
//! check it against whole decoding.

use std::sync::Arc;

use kvgate_shared::prompt::Prompter;

/// Turns a growing list of output ids into text deltas.
pub struct TextStream {
    prompter: Arc<Prompter>,
    ids: Vec<u32>,
    /// `ids[prefix..read]` were decoded into `text` already and are the next window's context.
    prefix: usize,
    read: usize,
    /// The text so far (complete characters only), up to a stop string once one is found.
    text: String,
    stops: Vec<String>,
    /// Bytes of `text` already emitted.
    emitted: usize,
    stopped: bool,
}

impl TextStream {
    pub fn new(prompter: Arc<Prompter>, stops: Vec<String>) -> Self {
        Self {
            prompter,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
            stops,
            emitted: 0,
            stopped: false,
        }
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.prompter.decode(ids, true).unwrap_or_default()
    }

    /// Appends what the ids past `read` add to the text, if it is whole characters (or `last`).
    fn advance(&mut self, last: bool) {
        if self.read == self.ids.len() {
            return;
        }
        let before = self.decode(&self.ids[self.prefix..self.read]);
        let window = self.decode(&self.ids[self.prefix..]);
        if window.len() <= before.len()
            || !window.is_char_boundary(before.len())
            || !window.starts_with(&before)
        {
            // Nothing new yet (a token that adds no text, or the first bytes of a character); or a decoder that
            // rewrites its context: then only the flush decides.
            if last {
                let whole = self.decode(&self.ids);
                let keep = self.text.len().min(whole.len());
                if whole.is_char_boundary(keep) {
                    self.text.push_str(&whole[keep..]);
                }
                self.read = self.ids.len();
            }
            return;
        }
        let added = &window[before.len()..];
        if !last && added.ends_with('\u{FFFD}') {
            // An incomplete character decodes to U+FFFD: wait for the next token.
            return;
        }
        self.text.push_str(added);
        self.prefix = self.read;
        self.read = self.ids.len();
    }

    /// Adds a token; returns the new text that is safe to show (maybe empty). `last` flushes everything left.
    pub fn push(&mut self, token: Option<u32>, last: bool) -> String {
        if let Some(t) = token {
            self.ids.push(t);
        }
        if self.stopped {
            return String::new();
        }
        let old_len = self.text.len();
        self.advance(last);
        // Cut at the first stop string; one that ends in the new text starts at most its length - 1 before it.
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = old_len.saturating_sub(longest.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(cut) = self.stops.iter().filter_map(|s| self.text[from..].find(s.as_str())).min() {
            self.text.truncate(from + cut);
            self.stopped = true;
        }
        let mut end = self.text.len();
        if !last && !self.stopped {
            // Hold back a tail that could be the start of a stop string.
            end = end.saturating_sub(longest.saturating_sub(1));
            while !self.text.is_char_boundary(end) {
                end -= 1;
            }
        }
        if end <= self.emitted {
            return String::new();
        }
        let delta = self.text[self.emitted..end].to_string();
        self.emitted = end;
        delta
    }
}

#[cfg(test)]
mod tests;
