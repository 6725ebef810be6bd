//! The pre-tokenizer regexes of byte-level BPE tokenizers, run as a regex (Oniguruma, as `tokenizers` does) or, for
//! the two patterns most models use, as a hand-written scanner over ASCII text with the regex for the rest.
//!
//! Both patterns match at every position (each character is whitespace, a letter, a number or something else, and
//! some alternative takes each), so the pieces are consecutive matches: the scanner decides the match that starts
//! at `p` by the pattern's alternatives in order (leftmost-first, greedy, with the backtracking they need), as long
//! as every character it must look at is ASCII; where one is not (a letter class, a case fold or a whitespace class
//! of Unicode decides), that one match is the regex's, from `p`. ASCII classes are taken from the regex engine at
//! construction (`\s`, `\p{L}`, `\p{N}` of each ASCII byte), not written down. Exactness against the regex is a
//! property test (`pretok_tests.rs`).

use onig::{Region, SearchOptions};

/// The regex of `tokenizers`' `ByteLevel` pre-tokenizer (`use_regex: true`): GPT-2's.
pub const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// The `Split` regex of Llama-3 and Qwen2 tokenizers.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Gpt2,
    Llama3,
}

/// The class of the character at a position, as far as the scanner may know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum C {
    Letter,
    Number,
    /// Whitespace other than `\r` and `\n`.
    Space,
    /// `\r` or `\n`.
    Newline,
    Other,
    End,
    /// Not ASCII: only the regex knows.
    Unknown,
}

/// Splits text into pre-tokens.
pub struct PreTokenizer {
    regex: onig::Regex,
    family: Option<Family>,
    ascii: [C; 128],
}

impl PreTokenizer {
    /// A pre-tokenizer for `pattern` (a scanner for the two known patterns, the regex for any).
    pub fn new(pattern: &str) -> Result<Self, String> {
        let regex = onig::Regex::new(pattern).map_err(|e| format!("the pre-tokenizer's regex: {e}"))?;
        let family = match pattern {
            GPT2_PATTERN => Some(Family::Gpt2),
            LLAMA3_PATTERN => Some(Family::Llama3),
            _ => None,
        };
        let is = |re: &str| onig::Regex::new(re).map_err(|e| e.to_string());
        let (space, letter, number) = (is(r"\A\s\z")?, is(r"\A\p{L}\z")?, is(r"\A\p{N}\z")?);
        let mut ascii = [C::Other; 128];
        for (b, c) in ascii.iter_mut().enumerate() {
            let s = (b as u8 as char).to_string();
            *c = if b == b'\r' as usize || b == b'\n' as usize {
                C::Newline
            } else if space.is_match(&s) {
                C::Space
            } else if letter.is_match(&s) {
                C::Letter
            } else if number.is_match(&s) {
                C::Number
            } else {
                C::Other
            };
        }
        if !space.is_match("\r") || !space.is_match("\n") {
            return Err("the regex engine does not count \\r and \\n as whitespace".into());
        }
        Ok(Self { regex, family, ascii })
    }

    /// Whether the scanner runs (a known pattern), rather than the regex alone.
    pub fn scans(&self) -> bool {
        self.family.is_some()
    }

    /// Calls `piece` with each pre-token of `text`, in order (the matches, and any text between them).
    pub fn split<E>(&self, text: &str, mut piece: impl FnMut(&str) -> Result<(), E>) -> Result<(), E> {
        let Some(family) = self.family else {
            let mut prev = 0;
            for (start, end) in self.regex.find_iter(text) {
                if start > prev {
                    piece(&text[prev..start])?;
                }
                if end > start {
                    piece(&text[start..end])?;
                }
                prev = end;
            }
            if prev < text.len() {
                piece(&text[prev..])?;
            }
            return Ok(());
        };
        let b = text.as_bytes();
        let mut region = Region::new();
        let mut p = 0;
        while p < b.len() {
            let end = match family {
                Family::Gpt2 => self.gpt2(b, p),
                Family::Llama3 => self.llama3(b, p),
            };
            let end = match end {
                Some(e) => e,
                None => self.by_regex(text, p, &mut region),
            };
            piece(&text[p..end])?;
            p = end;
        }
        Ok(())
    }

    /// The end of the regex's match at `p` (the patterns match at every position; a failure takes the rest).
    fn by_regex(&self, text: &str, p: usize, region: &mut Region) -> usize {
        region.clear();
        let found = self.regex.search_with_options(
            text,
            p,
            text.len(),
            SearchOptions::SEARCH_OPTION_NONE,
            Some(region),
        );
        match (found, region.pos(0)) {
            (Some(s), Some((_, e))) if s == p && e > p => e,
            _ => text.len(),
        }
    }

    fn c(&self, b: &[u8], i: usize) -> C {
        match b.get(i) {
            None => C::End,
            Some(&x) if x < 128 => self.ascii[x as usize],
            Some(_) => C::Unknown,
        }
    }

    /// The end of the run of `class` from `i`; `None` if it runs into a character only the regex knows.
    fn run(&self, b: &[u8], mut i: usize, class: impl Fn(C) -> bool) -> Option<usize> {
        loop {
            match self.c(b, i) {
                C::Unknown => return None,
                c if class(c) => i += 1,
                _ => return Some(i),
            }
        }
    }

    /// `'s|'t|'re|'ve|'m|'ll|'d` at `p` (ASCII case folded when `fold`); `Err` if a non-ASCII character could fold.
    fn contraction(&self, b: &[u8], p: usize, fold: bool) -> Result<Option<usize>, ()> {
        if b[p] != b'\'' {
            return Ok(None);
        }
        let at = |i: usize| -> Result<u8, ()> {
            match b.get(p + i) {
                Some(&x) if x >= 128 && fold => Err(()),
                Some(&x) if fold => Ok(x.to_ascii_lowercase()),
                Some(&x) => Ok(x),
                None => Ok(0),
            }
        };
        Ok(match at(1)? {
            b's' | b't' | b'm' | b'd' => Some(p + 2),
            b'r' | b'v' if at(2)? == b'e' => Some(p + 3),
            b'l' if at(2)? == b'l' => Some(p + 3),
            _ => None,
        })
    }

    /// `\s+(?!\S)|\s+` at `p` (whitespace there).
    fn trailing_space(&self, b: &[u8], p: usize) -> Option<usize> {
        let end = self.run(b, p, |c| matches!(c, C::Space | C::Newline))?;
        Some(if end == b.len() || end - p == 1 { end } else { end - 1 })
    }

    fn gpt2(&self, b: &[u8], p: usize) -> Option<usize> {
        if let Some(e) = self.contraction(b, p, false).ok()? {
            return Some(e);
        }
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: with the space, then without.
        for class in [C::Letter, C::Number, C::Other] {
            for q in [p + usize::from(b[p] == b' '), p] {
                match self.c(b, q) {
                    C::Unknown => return None,
                    c if c == class => return self.run(b, q, |c| c == class),
                    _ => {}
                }
                if b[p] != b' ' {
                    break;
                }
            }
        }
        match self.c(b, p) {
            C::Space | C::Newline => self.trailing_space(b, p),
            _ => None,
        }
    }

    fn llama3(&self, b: &[u8], p: usize) -> Option<usize> {
        if let Some(e) = self.contraction(b, p, true).ok()? {
            return Some(e);
        }
        let first = self.c(b, p);
        // `[^\r\n\p{L}\p{N}]?\p{L}+`
        if matches!(first, C::Space | C::Other) {
            match self.c(b, p + 1) {
                C::Unknown => return None,
                C::Letter => return self.run(b, p + 1, |c| c == C::Letter),
                _ => {}
            }
        }
        match first {
            C::Unknown => return None,
            C::Letter => return self.run(b, p, |c| c == C::Letter),
            // `\p{N}{1,3}`
            C::Number => {
                let mut e = p;
                while e < p + 3 {
                    match self.c(b, e) {
                        C::Number => e += 1,
                        C::Unknown => return None,
                        _ => break,
                    }
                }
                return Some(e);
            }
            _ => {}
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        for q in [p + usize::from(b[p] == b' '), p] {
            match self.c(b, q) {
                C::Unknown => return None,
                C::Other => {
                    let e = self.run(b, q, |c| c == C::Other)?;
                    return Some(e + b[e..].iter().take_while(|x| matches!(x, b'\r' | b'\n')).count());
                }
                _ => {}
            }
        }
        // `\s*[\r\n]+`: the whitespace run up to its last newline.
        let end = self.run(b, p, |c| matches!(c, C::Space | C::Newline))?;
        if let Some(k) = (p..end).rev().find(|&i| matches!(b[i], b'\r' | b'\n')) {
            return Some(k + 1);
        }
        self.trailing_space(b, p)
    }
}
