//! Finds a whole (not streamed) JSON answer's top-level `usage` object by the JSON's structure, as the bytes pass
//! through, wherever in the object the pod wrote it: vLLM writes `usage` before `prompt_logprobs`, so an answer
//! with prompt logprobs ends in megabytes of them, and a search of the answer's end finds nothing.
//!
//! Invariants: one pass, constant memory: the scanner keeps its nesting depth, whether it is inside a string, the
//! current top-level key (at most [`MAX_KEY_BYTES`]) and the `usage` value's bytes (at most [`MAX_USAGE_BYTES`];
//! a longer one is dropped: no usage). Only a member of the outermost object counts (a `usage` key nested in a
//! choice, or text that spells `"usage"` inside a string, does not). A later top-level `usage` replaces an
//! earlier one (JSON parsers keep the last). Pure: bytes in, no I/O.

/// Longest top-level key remembered (longer keys are not `usage`).
pub const MAX_KEY_BYTES: usize = 16;
/// Longest `usage` object kept.
pub const MAX_USAGE_BYTES: usize = 4096;

/// Where the scanner is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// Before the outermost value's first byte.
    Start,
    /// Inside the outermost object, expecting a key (or its end).
    Key,
    /// Reading a top-level key's string.
    KeyText,
    /// After a top-level key, before its `:`.
    Colon,
    /// Before a top-level member's value.
    Value,
    /// Inside a top-level member's value.
    InValue,
    /// After a top-level member's value, before `,` or `}`.
    After,
    /// The outermost value is not an object, or it ended: nothing more is read.
    Done,
}

/// The scanner (module docs).
#[derive(Debug)]
pub struct UsageScan {
    at: At,
    /// Nesting depth inside the current top-level value (0: at its start).
    depth: usize,
    in_string: bool,
    escape: bool,
    key: Vec<u8>,
    key_too_long: bool,
    /// The value being read belongs to `usage`: its bytes (`None` once past the bound).
    capture: Option<Vec<u8>>,
    capturing: bool,
    usage: Option<Vec<u8>>,
}

impl Default for UsageScan {
    fn default() -> Self {
        Self::new()
    }
}

impl UsageScan {
    pub fn new() -> Self {
        Self {
            at: At::Start,
            depth: 0,
            in_string: false,
            escape: false,
            key: Vec::new(),
            key_too_long: false,
            capture: None,
            capturing: false,
            usage: None,
        }
    }

    /// The last complete top-level `usage` value seen so far (its JSON text).
    pub fn usage(&self) -> Option<&[u8]> {
        self.usage.as_deref()
    }

    /// Reads the next bytes of the answer.
    pub fn feed(&mut self, data: &[u8]) {
        for &b in data {
            if self.at == At::Done {
                return;
            }
            self.step(b);
        }
    }

    fn step(&mut self, b: u8) {
        match self.at {
            At::Start => match b {
                b'{' => self.at = At::Key,
                b if b.is_ascii_whitespace() => {}
                _ => self.at = At::Done,
            },
            At::Key => match b {
                b'"' => {
                    self.key.clear();
                    self.key_too_long = false;
                    self.escape = false;
                    self.at = At::KeyText;
                }
                b'}' => self.at = At::Done,
                _ => {}
            },
            At::KeyText => {
                if self.escape {
                    self.escape = false;
                    self.push_key(b);
                } else if b == b'\\' {
                    self.escape = true;
                    self.push_key(b);
                } else if b == b'"' {
                    self.at = At::Colon;
                } else {
                    self.push_key(b);
                }
            }
            At::Colon => {
                if b == b':' {
                    self.at = At::Value;
                }
            }
            At::Value => {
                if b.is_ascii_whitespace() {
                    return;
                }
                self.capturing = !self.key_too_long && self.key == b"usage";
                self.capture = self.capturing.then(Vec::new);
                self.depth = 0;
                self.in_string = false;
                self.escape = false;
                self.at = At::InValue;
                self.value_byte(b);
            }
            At::InValue => self.value_byte(b),
            At::After => match b {
                b',' => self.at = At::Key,
                b'}' => self.at = At::Done,
                _ => {}
            },
            At::Done => {}
        }
    }

    fn push_key(&mut self, b: u8) {
        if self.key.len() < MAX_KEY_BYTES {
            self.key.push(b);
        } else {
            self.key_too_long = true;
        }
    }

    /// One byte of a top-level value; a scalar ends at the byte that ends it (`,` or `}` of the outer object,
    /// which is then read as such).
    fn value_byte(&mut self, b: u8) {
        if self.in_string {
            self.keep(b);
            if self.escape {
                self.escape = false;
            } else if b == b'\\' {
                self.escape = true;
            } else if b == b'"' {
                self.in_string = false;
                if self.depth == 0 {
                    self.end_value();
                }
            }
            return;
        }
        match b {
            b'"' => {
                self.keep(b);
                self.in_string = true;
            }
            b'{' | b'[' => {
                self.keep(b);
                self.depth += 1;
            }
            b'}' | b']' if self.depth > 0 => {
                self.keep(b);
                self.depth -= 1;
                if self.depth == 0 {
                    self.end_value();
                }
            }
            b',' | b'}' if self.depth == 0 => {
                // The end of a scalar (a number, true, false, null): the byte belongs to the outer object.
                self.end_value();
                self.step(b);
            }
            _ => self.keep(b),
        }
    }

    fn keep(&mut self, b: u8) {
        if !self.capturing {
            return;
        }
        match &mut self.capture {
            Some(c) if c.len() < MAX_USAGE_BYTES => c.push(b),
            _ => self.capture = None,
        }
    }

    fn end_value(&mut self) {
        if self.capturing {
            if let Some(c) = self.capture.take() {
                let t = String::from_utf8_lossy(&c);
                self.usage = Some(t.trim().as_bytes().to_vec());
            }
        }
        self.capturing = false;
        self.at = At::After;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_in_chunks(text: &[u8], chunk: usize) -> Option<String> {
        let mut s = UsageScan::new();
        for c in text.chunks(chunk.max(1)) {
            s.feed(c);
        }
        s.usage().map(|u| String::from_utf8_lossy(u).into_owned())
    }

    #[test]
    fn the_top_level_usage_is_found_wherever_it_is_and_however_the_bytes_are_cut() {
        let big: String =
            (0..20_000).map(|i| format!("{{\"{i}\":{{\"logprob\":-1.5,\"rank\":1}}}},")).collect();
        let body = format!(
            r#"{{"id":"x","choices":[{{"text":"a \"usage\":{{\"prompt_tokens\":9}}","usage":{{"prompt_tokens":1}}}}],"usage":{{"prompt_tokens":12,"completion_tokens":3000,"prompt_tokens_details":{{"cached_tokens":4}}}},"prompt_logprobs":[{big}null],"kv_transfer_params":null}}"#
        );
        let want =
            r#"{"prompt_tokens":12,"completion_tokens":3000,"prompt_tokens_details":{"cached_tokens":4}}"#;
        for chunk in [1, 2, 7, 4096, body.len()] {
            assert_eq!(scan_in_chunks(body.as_bytes(), chunk).as_deref(), Some(want), "chunks of {chunk}");
        }
    }

    #[test]
    fn nothing_but_a_top_level_usage_object_counts_and_memory_is_bounded() {
        assert_eq!(scan_in_chunks(br#"{"a":{"usage":{"prompt_tokens":1}}}"#, 3), None, "nested");
        assert_eq!(scan_in_chunks(br#"{"a":"\"usage\":{}","b":1}"#, 3), None, "inside a string");
        assert_eq!(scan_in_chunks(br#"[{"usage":{"prompt_tokens":1}}]"#, 3), None, "not an object");
        assert_eq!(scan_in_chunks(br#"{"n":12,"t":true,"usage":null}"#, 1).as_deref(), Some("null"));
        assert_eq!(
            scan_in_chunks(br#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}"#, 5).as_deref(),
            Some(r#"{"prompt_tokens":2}"#),
            "the last one, as parsers keep"
        );
        let huge = format!(r#"{{"usage":{{"x":"{}"}}}}"#, "y".repeat(MAX_USAGE_BYTES * 2));
        assert_eq!(scan_in_chunks(huge.as_bytes(), 100), None, "past the bound: dropped");
        let long_key = format!(r#"{{"{}usage":{{"prompt_tokens":1}}}}"#, "k".repeat(40));
        assert_eq!(scan_in_chunks(long_key.as_bytes(), 9), None);
        assert_eq!(
            scan_in_chunks(br#"{"us\"age":{"prompt_tokens":1}}"#, 9),
            None,
            "an escaped key is another key"
        );
    }
}
