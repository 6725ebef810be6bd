//! What a response carried, read as it is forwarded: the tokens a stream sent and the `usage` it ended with, so a
//! request is charged for what the worker computed even when it ends early (`charge.rs`); and, when the
//! gateway asked a stream for usage on the client's behalf, the usage chunk taken back out of what the client sees.
//!
//! Server-sent events are split at their blank line. Each complete event is classified:
//! - a *token event*: a chunk whose choices carry text (`"content"`, `"reasoning_content"`, `"text"` or a tool call's
//!   `"arguments"` with at least one character). One event is at least one token (a server may put several in one
//!   event, so the count is a lower bound; a completed stream's `usage` replaces it);
//! - a *usage event*: `"choices":[]` with a `usage` object (OpenAI's `stream_options.include_usage` chunk);
//! - a Responses API stream (`"type":"response.…"` events): its `*.delta` events with text are token events,
//!   `response.completed` / `.incomplete` / `.failed` carry the usage, and every other event is not counted (the
//!   `*.done` and `output_item.*` events repeat text the deltas carried; pinned by a real vLLM capture,
//!   `tests/vllm_responses.rs`);
//! - anything else (the role chunk, the finish chunk, `[DONE]`, errors, comments) is passed through and not counted.
//!
//! Bounds: an event is held only until its blank line arrives; one that grows past [`MAX_EVENT_BYTES`] is forwarded
//! as it is and counted as one token event, so memory never grows with what a peer sends. A JSON (non-stream)
//! response is not parsed into a tree: its top-level `usage` member is found by structure as the bytes pass
//! (`usage_scan.rs`, constant memory), wherever the pod wrote it (vLLM writes it before `prompt_logprobs`).
//!
//! Pure: bytes in, bytes out, no I/O.

use bytes::{Bytes, BytesMut};

use crate::serve::usage_scan::UsageScan;

/// Longest event held back to classify it; longer ones pass through unclassified (counted as one token event).
pub const MAX_EVENT_BYTES: usize = 256 * 1024;

/// The `usage` numbers of a response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsageSeen {
    pub prompt: u64,
    pub completion: u64,
    pub cached: u64,
}

impl UsageSeen {
    /// The usage in `text` (the last occurrence of each number; usage ends both response shapes). Also the
    /// Responses API's names (`input_tokens`, `output_tokens`) and an embedding's usage (no output).
    pub fn parse(text: &[u8]) -> Option<Self> {
        let number = |a: &[u8], b: &[u8]| last_number_after(text, a).or_else(|| last_number_after(text, b));
        Some(Self {
            prompt: number(b"\"prompt_tokens\":", b"\"input_tokens\":")?,
            completion: number(b"\"completion_tokens\":", b"\"output_tokens\":").unwrap_or(0),
            cached: last_number_after(text, b"\"cached_tokens\":").unwrap_or(0),
        })
    }
}

/// The last integer following `key` in `buf`.
fn last_number_after(buf: &[u8], key: &[u8]) -> Option<u64> {
    let at = find_last(buf, key)? + key.len();
    let rest = &buf[at..];
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let digits: Vec<u8> = rest[start..].iter().copied().take_while(u8::is_ascii_digit).take(20).collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

fn find_last(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.len() > hay.len() {
        return None;
    }
    (0..=hay.len() - needle.len()).rev().find(|&i| &hay[i..i + needle.len()] == needle)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Whether `key` occurs followed by a non-empty JSON string (`key` ends with `"`).
fn has_text(event: &[u8], key: &[u8]) -> bool {
    let mut rest = event;
    while let Some(i) = find(rest, key) {
        let after = &rest[i + key.len()..];
        let after = &after[after.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(after.len())..];
        if after.len() >= 2 && after[0] == b'"' && after[1] != b'"' {
            return true;
        }
        rest = &rest[i + key.len()..];
    }
    false
}

/// What one event is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Token,
    Usage,
    ResponseUsage,
    Other,
}

/// The Responses API's stream events that end a response with its usage.
const RESPONSE_ENDS: [&[u8]; 3] = [
    b"\"type\":\"response.completed\"",
    b"\"type\":\"response.incomplete\"",
    b"\"type\":\"response.failed\"",
];
/// Marks a Responses API stream event (its `type`; the raw quotes cannot occur inside a JSON string's text).
const RESPONSE_EVENT: &[u8] = b"\"type\":\"response.";
/// The Responses API's stream events that carry generated text.
const RESPONSE_DELTAS: [&[u8]; 4] = [
    b"\"type\":\"response.output_text.delta\"",
    b"\"type\":\"response.reasoning_text.delta\"",
    b"\"type\":\"response.refusal.delta\"",
    b"\"type\":\"response.function_call_arguments.delta\"",
];

fn classify(event: &[u8]) -> Kind {
    let is_data = event.split(|b| *b == b'\n').any(|l| l.starts_with(b"data:"));
    if !is_data {
        return Kind::Other;
    }
    if find(event, b"\"choices\":[]").is_some() && find(event, b"\"usage\":{").is_some() {
        return Kind::Usage;
    }
    // The Responses API: its usage ends the stream inside `response.completed` (or `.incomplete` / `.failed`, an
    // event that also repeats the whole output's text, so it is read before the token keys); text arrives in
    // `*.delta` events. Its usage is the client's own: never taken out.
    if RESPONSE_ENDS.iter().any(|t| find(event, t).is_some()) && find(event, b"\"usage\":{").is_some() {
        return Kind::ResponseUsage;
    }
    if RESPONSE_DELTAS.iter().any(|t| find(event, t).is_some()) && has_text(event, b"\"delta\":") {
        return Kind::Token;
    }
    // Every other Responses event is not a token: its `*.done` and `output_item.*` events repeat text the deltas
    // already carried (a real vLLM stream sends three of them, each with the whole text).
    if find(event, RESPONSE_EVENT).is_some() {
        return Kind::Other;
    }
    let keys: [&[u8]; 3] = [b"content\":", b"\"text\":", b"\"arguments\":"];
    if keys.iter().any(|k| has_text(event, k)) {
        return Kind::Token;
    }
    Kind::Other
}

/// Reads a response as it is forwarded (see the module docs).
#[derive(Debug)]
pub struct Meter {
    sse: bool,
    /// Take usage events (and `"usage":null` members) out of what is forwarded: the gateway asked for them.
    strip_usage: bool,
    /// The current, incomplete event (SSE).
    pending: BytesMut,
    /// A JSON response's top-level `usage`, found as it passes.
    scan: UsageScan,
    /// The current event grew past [`MAX_EVENT_BYTES`]: forwarded as it comes until its end.
    oversized: bool,
    token_events: u64,
    usage: Option<UsageSeen>,
}

impl Meter {
    /// A meter for a response that is `sse` (else JSON); `strip_usage`: the client did not ask for usage chunks.
    pub fn new(sse: bool, strip_usage: bool) -> Self {
        Self {
            sse,
            strip_usage: strip_usage && sse,
            pending: BytesMut::new(),
            scan: UsageScan::new(),
            oversized: false,
            token_events: 0,
            usage: None,
        }
    }

    /// Token events forwarded so far (a lower bound of the tokens the client received).
    pub fn token_events(&self) -> u64 {
        self.token_events
    }

    /// The usage the response carried (SSE: its usage event; JSON: read at [`Meter::finish`]).
    pub fn usage(&self) -> Option<UsageSeen> {
        self.usage
    }

    /// Completion tokens the client received: the usage's count once seen, else the token events.
    pub fn tokens_sent(&self) -> u64 {
        self.usage.map_or(self.token_events, |u| u.completion.max(self.token_events))
    }

    /// Takes a chunk from the worker; returns what to forward now.
    pub fn feed(&mut self, data: &[u8]) -> Bytes {
        if !self.sse {
            self.scan.feed(data);
            return Bytes::copy_from_slice(data);
        }
        let mut out = BytesMut::new();
        let mut rest = data;
        while !rest.is_empty() {
            if self.oversized {
                // Forward until the event's end (a blank line), then classify normally again.
                match event_end(&self.pending, rest) {
                    Some(n) => {
                        out.extend_from_slice(&rest[..n]);
                        rest = &rest[n..];
                        self.oversized = false;
                        self.pending.clear();
                    }
                    None => {
                        out.extend_from_slice(rest);
                        self.keep_tail(rest);
                        rest = &[];
                    }
                }
                continue;
            }
            match event_end(&self.pending, rest) {
                Some(n) => {
                    self.pending.extend_from_slice(&rest[..n]);
                    rest = &rest[n..];
                    let event = self.pending.split().freeze();
                    self.emit(event, &mut out);
                }
                None => {
                    self.pending.extend_from_slice(rest);
                    rest = &[];
                    if self.pending.len() > MAX_EVENT_BYTES {
                        self.token_events += 1;
                        out.extend_from_slice(&self.pending);
                        self.keep_tail(&[]);
                        self.oversized = true;
                    }
                }
            }
        }
        out.freeze()
    }

    /// Keeps only the last 3 bytes of an oversized event forwarded so far (`pending`, then `more`): its blank line
    /// may straddle two chunks.
    fn keep_tail(&mut self, more: &[u8]) {
        let mut t = [&self.pending[..], more].concat();
        let cut = t.len().saturating_sub(3);
        t.drain(..cut);
        self.pending.clear();
        self.pending.extend_from_slice(&t);
    }

    fn emit(&mut self, event: Bytes, out: &mut BytesMut) {
        match classify(&event) {
            Kind::Token => {
                self.token_events += 1;
                self.forward(&event, out);
            }
            Kind::Usage => {
                self.usage = UsageSeen::parse(&event).or(self.usage);
                if !self.strip_usage {
                    out.extend_from_slice(&event);
                }
            }
            Kind::ResponseUsage => {
                self.usage = UsageSeen::parse(&event).or(self.usage);
                out.extend_from_slice(&event);
            }
            Kind::Other => self.forward(&event, out),
        }
    }

    fn forward(&self, event: &[u8], out: &mut BytesMut) {
        if self.strip_usage {
            if let Some(i) = find(event, b",\"usage\":null") {
                out.extend_from_slice(&event[..i]);
                out.extend_from_slice(&event[i + b",\"usage\":null".len()..]);
                return;
            }
        }
        out.extend_from_slice(event);
    }

    /// A JSON response cut off: the usage its bytes so far end with, if they do (`None` for a stream).
    pub fn finish_usage(&mut self) -> Option<UsageSeen> {
        if self.sse {
            return None;
        }
        self.finish();
        self.usage
    }

    /// The response ended: what is still held (an event without its blank line is forwarded as it is).
    pub fn finish(&mut self) -> Bytes {
        if !self.sse {
            self.usage = self.scan.usage().and_then(UsageSeen::parse);
            return Bytes::new();
        }
        if self.oversized {
            self.pending.clear();
            return Bytes::new();
        }
        let event = self.pending.split().freeze();
        let mut out = BytesMut::new();
        if !event.is_empty() {
            self.emit(event, &mut out);
        }
        out.freeze()
    }
}

/// Where in `next` the event that `held` began ends (just past its blank line), if it does.
fn event_end(held: &[u8], next: &[u8]) -> Option<usize> {
    // The blank line may straddle `held` and `next`: look at the last bytes held too.
    let mut prev: [u8; 3] = [0; 3];
    for (i, b) in held.iter().rev().take(3).enumerate() {
        prev[2 - i] = *b;
    }
    let mut window = prev;
    for (i, &b) in next.iter().enumerate() {
        let ends = b == b'\n' && (window[2] == b'\n' || (window[2] == b'\r' && window[1] == b'\n'));
        window = [window[1], window[2], b];
        if ends {
            return Some(i + 1);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(content: &str) -> String {
        format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":\
             {{\"content\":{content:?}}}}}],\"usage\":null}}\n\n"
        )
    }

    const USAGE: &str =
        "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3,\
                         \"total_tokens\":15,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n";

    fn stream() -> String {
        [
            chunk(""),
            chunk("a"),
            chunk("b"),
            chunk("c"),
            chunk(""),
            USAGE.to_owned(),
            "data: [DONE]\n\n".into(),
        ]
        .concat()
    }

    #[test]
    fn token_events_and_usage_are_counted_and_the_usage_chunk_is_kept_when_asked_for() {
        let mut m = Meter::new(true, false);
        let out = m.feed(stream().as_bytes());
        assert_eq!(out, stream().as_bytes(), "nothing changed");
        assert_eq!(m.token_events(), 3, "role and finish chunks carry no text");
        assert_eq!(m.usage(), Some(UsageSeen { prompt: 12, completion: 3, cached: 8 }));
        assert!(m.finish().is_empty());
    }

    #[test]
    fn usage_the_gateway_asked_for_is_taken_out_byte_by_byte() {
        let mut m = Meter::new(true, true);
        let mut out = Vec::new();
        for b in stream().as_bytes() {
            out.extend_from_slice(&m.feed(std::slice::from_ref(b)));
        }
        out.extend_from_slice(&m.finish());
        let text = String::from_utf8(out).expect("utf8");
        assert!(!text.contains("usage"), "{text}");
        assert_eq!(text.matches("data: ").count(), 6, "every event but the usage one: {text}");
        assert!(text.ends_with("data: [DONE]\n\n"));
        for line in text.lines().filter(|l| l.starts_with("data: {")) {
            serde_json::from_str::<serde_json::Value>(&line[6..]).expect("still JSON");
        }
        assert_eq!((m.token_events(), m.usage().map(|u| u.completion)), (3, Some(3)));
    }

    #[test]
    fn a_stream_cut_short_counts_what_was_forwarded() {
        let s = stream();
        let cut = s.find("\"b\"").expect("b");
        let mut m = Meter::new(true, true);
        let out = m.feed(&s.as_bytes()[..cut]);
        assert_eq!(m.token_events(), 1, "a and the start of b's event");
        assert_eq!(m.tokens_sent(), 1);
        assert!(!out.is_empty());
        assert_eq!(m.usage(), None);
    }

    #[test]
    fn crlf_events_completions_and_tool_calls_count() {
        let text = "data: {\"choices\":[{\"index\":0,\"text\":\"hi\"}]}\r\n\r\n\
                    data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"function\":{\"arguments\":\"{\\\"a\"}}]}}]}\n\n\
                    data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}\n\n\
                    : a comment\n\n";
        let mut m = Meter::new(true, false);
        assert_eq!(m.feed(text.as_bytes()), text.as_bytes());
        assert_eq!(m.token_events(), 3);
    }

    #[test]
    fn an_endless_event_is_forwarded_not_held() {
        let mut m = Meter::new(true, true);
        let mut forwarded = 0;
        let piece = vec![b'x'; 64 * 1024];
        forwarded += m.feed(b"data: ").len();
        for _ in 0..64 {
            forwarded += m.feed(&piece).len();
            assert!(m.pending.len() <= MAX_EVENT_BYTES + piece.len());
        }
        assert!(forwarded >= 64 * piece.len() - MAX_EVENT_BYTES, "held back at most one event's limit");
        forwarded += m.feed(b"\n\n").len();
        assert_eq!(forwarded, 6 + 64 * piece.len() + 2, "every byte forwarded once");
        assert_eq!(m.token_events(), 1);
        // The next event is classified again.
        let out = m.feed(chunk("z").as_bytes());
        assert_eq!(out.len(), chunk("z").len() - ",\"usage\":null".len());
        assert_eq!(m.token_events(), 2);
    }

    #[test]
    fn usage_of_embeddings_and_responses_is_read_too() {
        let emb = br#"{"data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":9,"total_tokens":9}}"#;
        assert_eq!(UsageSeen::parse(emb), Some(UsageSeen { prompt: 9, completion: 0, cached: 0 }));
        let resp = br#"{"output":[],"usage":{"input_tokens":30,"input_tokens_details":{"cached_tokens":16},
            "output_tokens":5,"total_tokens":35}}"#;
        assert_eq!(UsageSeen::parse(resp), Some(UsageSeen { prompt: 30, completion: 5, cached: 16 }));
        assert_eq!(UsageSeen::parse(br#"{"tokens":[1,2]}"#), None);
    }

    #[test]
    fn json_responses_pass_untouched_and_their_usage_is_read_by_structure() {
        let body = format!(
            "{{\"choices\":[{{\"message\":{{\"content\":\"{}\"}}}}],\"usage\":{{\"prompt_tokens\":100,\
             \"completion_tokens\":7,\"prompt_tokens_details\":{{\"cached_tokens\":64}}}}}}",
            "y".repeat(100_000)
        );
        let mut m = Meter::new(false, true);
        let mut out = 0;
        for c in body.as_bytes().chunks(4096) {
            out += m.feed(c).len();
            assert!(m.pending.is_empty(), "a JSON answer is not held");
        }
        assert!(m.finish().is_empty());
        assert_eq!(out, body.len());
        assert_eq!(m.usage(), Some(UsageSeen { prompt: 100, completion: 7, cached: 64 }));
        assert_eq!(last_number_after(b"data: [DONE]", b"\"cached_tokens\":"), None);
    }

    #[test]
    fn a_responses_stream_counts_its_deltas_and_reads_the_usage_of_response_completed() {
        let delta = |t: &str| {
            format!("event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"item_id\":\"m\",\"delta\":\"{t}\"}}\n\n")
        };
        let created = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null}}\n\n";
        let done = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"output\":[{\"content\":[{\"type\":\"output_text\",\"text\":\"ab c\"}]}],\"usage\":{\"input_tokens\":12,\"input_tokens_details\":{\"cached_tokens\":8},\"output_tokens\":3000,\"total_tokens\":3012}}}\n\n";
        let text_done = "event: response.output_text.done\ndata: {\"type\":\"response.output_text.done\",\"item_id\":\"m\",\"text\":\"ab c\"}\n\n";
        let stream = format!("{created}{}{}{}{text_done}{done}", delta("ab"), delta(" c"), delta(""));
        let mut m = Meter::new(true, false);
        let out = m.feed(stream.as_bytes());
        assert_eq!(out, stream.as_bytes(), "a Responses stream passes unchanged");
        assert_eq!(
            m.token_events(),
            2,
            "two deltas with text; the .done event repeating them is not a token"
        );
        assert_eq!(m.usage(), Some(UsageSeen { prompt: 12, completion: 3000, cached: 8 }));
        assert_eq!(m.tokens_sent(), 3000);
        // Cut before response.completed: what was sent is counted.
        let mut cut = Meter::new(true, false);
        cut.feed(format!("{created}{}{}", delta("x"), delta("y")).as_bytes());
        assert_eq!((cut.usage(), cut.tokens_sent()), (None, 2));
    }
}
