//! Generated traces of shapes the published ones lack, for the tuning protocol (`tune.rs`): each is a pure
//! function of its seed, so a tune set and a test set are the same shape drawn twice, never the same requests.
//!
//! - [`agentic`]: agent sessions whose prompts grow by tool results up to about 100K tokens, some forking
//!   sub-agents that start from their parent's context, all after one shared tool-spec preamble;
//! - [`bursty`]: multi-turn chats at a steady rate plus batch jobs that arrive in bursts, each burst's requests
//!   sharing a long prefix of their own;
//! - [`tenants`]: many small tenants, each with its own system prompt (popularity Zipf-like), whose users hold
//!   short conversations;
//! - [`families`]: a few large prefix families, each one document asked again and again with a short question (the
//!   Mooncake trace's largest families look so: near-identical prompts of 2K-40K tokens repeated 16-24 times),
//!   fewer families than twice the fleet: where load balance and cache affinity pull hardest against each other;
//! - [`decode_heavy`]: chats whose answers are long (512-2,048 tokens: code, documents), so decode batches and the
//!   KV their streams hold, not prefill, decide how fast a worker serves;
//! - [`chat_cpu`]: the README demo's shape at a CPU worker's scale: a few dozen users sharing a one-block system
//!   prompt, each turn adding one block of question and one of answer, prompts to about 8K tokens.
//!
//! Invariants: every segment is whole 512-token blocks (a prompt that extends another repeats its hash ids, so the
//! trace's prefixes are exact); arrivals never go back; ids are fresh except where a prefix is reused.

use kvgate_shared::prompt::SplitMix64;

use crate::trace::{Trace, TraceRequest, TRACE_BLOCK_TOKENS};

/// A shape and its seed, as the trace sets name them (`agentic:2`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Agentic,
    Bursty,
    Tenants,
    /// `trace_gen::LongDocument` with its defaults.
    LongDocument,
    Families,
    DecodeHeavy,
    ChatCpu,
}

impl Shape {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "agentic" => Some(Self::Agentic),
            "bursty" => Some(Self::Bursty),
            "tenants" => Some(Self::Tenants),
            "long_document" => Some(Self::LongDocument),
            "families" => Some(Self::Families),
            "decode_heavy" => Some(Self::DecodeHeavy),
            "chat_cpu" => Some(Self::ChatCpu),
            _ => None,
        }
    }

    /// The trace of this shape for `seed`.
    pub fn generate(self, seed: u64) -> Trace {
        match self {
            Self::Agentic => agentic(seed),
            Self::Bursty => bursty(seed),
            Self::Tenants => tenants(seed),
            Self::Families => families(seed),
            Self::DecodeHeavy => decode_heavy(seed),
            Self::ChatCpu => chat_cpu(seed),
            Self::LongDocument => crate::trace_gen::long_document(&crate::trace_gen::LongDocument {
                seed,
                ..Default::default()
            }),
        }
    }
}

struct Gen {
    rng: SplitMix64,
    next_id: u64,
    requests: Vec<TraceRequest>,
}

impl Gen {
    fn new(seed: u64) -> Self {
        // Ids far from the published traces' and from another seed's.
        Self { rng: SplitMix64::new(seed), next_id: seed << 40, requests: Vec::new() }
    }

    /// `n` fresh block ids.
    fn fresh(&mut self, n: usize) -> Vec<u64> {
        (0..n.max(1))
            .map(|_| {
                self.next_id += 1;
                self.next_id
            })
            .collect()
    }

    /// Fresh ids for a segment of `lo..=hi` tokens, in whole blocks.
    fn segment(&mut self, lo: usize, hi: usize) -> Vec<u64> {
        let tokens = self.uniform(lo, hi);
        self.fresh(blocks(tokens))
    }

    fn uniform(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.rng.below((hi.max(lo) - lo + 1) as u64) as usize
    }

    /// Seconds to the next Poisson arrival at `rate` a second.
    fn exp(&mut self, rate: f64) -> f64 {
        -(1.0 - self.rng.unit()).ln() / rate
    }

    /// Index drawn with weight 1 / (k + 1).
    fn zipf(&mut self, n: usize) -> usize {
        let total: f64 = (0..n).map(|k| 1.0 / (k + 1) as f64).sum();
        let mut roll = self.rng.unit() * total;
        for k in 0..n {
            roll -= 1.0 / (k + 1) as f64;
            if roll <= 0.0 {
                return k;
            }
        }
        n - 1
    }

    fn push(&mut self, at_s: f64, hash_ids: &[u64], output: usize) {
        self.requests.push(TraceRequest {
            timestamp_ms: (at_s * 1000.0) as u64,
            input_length: hash_ids.len() * TRACE_BLOCK_TOKENS,
            output_length: output,
            hash_ids: hash_ids.to_vec(),
            lora: None,
        });
    }

    fn finish(mut self) -> Trace {
        self.requests.sort_by_key(|r| r.timestamp_ms);
        Trace { requests: self.requests }
    }
}

/// Blocks of `tokens` tokens, at least one.
fn blocks(tokens: usize) -> usize {
    tokens.div_ceil(TRACE_BLOCK_TOKENS).max(1)
}

/// One agent (or sub-agent) from `context`: turns until its prompt reaches `limit` tokens or its turns run out;
/// each turn adds the previous answer and a tool result, some fork a sub-agent from the context so far.
fn agent(g: &mut Gen, mut context: Vec<u64>, mut at: f64, turns: usize, limit: usize, depth: u32) {
    for _ in 0..turns {
        let output = g.uniform(64, 512);
        g.push(at, &context, output);
        if context.len() * TRACE_BLOCK_TOKENS >= limit {
            break;
        }
        // The answer's tokens, then a tool result (most small, some whole files or search pages).
        let tool = if g.rng.unit() < 0.2 { g.uniform(8_192, 24_576) } else { g.uniform(512, 4_096) };
        let added = g.fresh(blocks(output) + blocks(tool));
        // Decode at about 30 tokens/s, then the tool runs 1-8 s.
        at += output as f64 / 30.0 + g.uniform(1, 8) as f64;
        if depth == 0 && g.rng.unit() < 0.15 {
            let mut sub = context.clone();
            sub.extend(g.segment(512, 2_048));
            let sub_turns = g.uniform(2, 6);
            agent(g, sub, at, sub_turns, limit / 2, depth + 1);
        }
        context.extend(added);
    }
}

/// A conversation's shape: ranges (inclusive) of its turns, each user turn's tokens, each answer's tokens and the
/// seconds between turns.
struct Chat {
    turns: (usize, usize),
    user: (usize, usize),
    output: (usize, usize),
    gap_s: (usize, usize),
}

/// One conversation from `context` at `at`: each turn adds a user turn and asks for an answer, which the next turn,
/// `gap_s` later, carries in its context.
fn conversation(g: &mut Gen, mut context: Vec<u64>, at: f64, c: &Chat) {
    let mut t = at;
    for _ in 0..g.uniform(c.turns.0, c.turns.1) {
        context.extend(g.segment(c.user.0, c.user.1));
        let output = g.uniform(c.output.0, c.output.1);
        g.push(t, &context, output);
        context.extend(g.fresh(blocks(output)));
        t += g.uniform(c.gap_s.0, c.gap_s.1) as f64;
    }
}

/// Agent sessions: a 6K-token tool-spec preamble all share, a task of 1-4K, then 3-30 turns growing by answers
/// and tool results to 20K-100K tokens; 15% of a parent's turns fork a sub-agent (2-6 turns from the parent's
/// context plus a sub-task). Sessions arrive at 0.5 a second, 150 of them.
pub fn agentic(seed: u64) -> Trace {
    let mut g = Gen::new(seed);
    let preamble = g.fresh(blocks(6_144));
    let mut at = 0.0;
    for _ in 0..150 {
        at += g.exp(0.5);
        let mut context = preamble.clone();
        context.extend(g.segment(1_024, 4_096));
        let (turns, limit) = (g.uniform(3, 30), g.uniform(20_480, 102_400));
        agent(&mut g, context, at, turns, limit, 0);
    }
    g.finish()
}

/// Chats and bursts: 400 conversations of 2-6 turns (a 2K system prompt all share, 256-2K per user turn, 20-60 s
/// between turns) arriving at 1 a second, and every 60 s a batch job of 48 requests within 2 s sharing a 12-24K
/// prefix of its own (an evaluation or extraction job: one document, many questions).
pub fn bursty(seed: u64) -> Trace {
    let mut g = Gen::new(seed);
    let system = g.fresh(blocks(2_048));
    let mut at = 0.0;
    for _ in 0..400 {
        at += g.exp(1.0);
        let chat = Chat { turns: (2, 6), user: (256, 2_048), output: (64, 512), gap_s: (20, 60) };
        conversation(&mut g, system.clone(), at, &chat);
    }
    let mut burst_at = 30.0;
    while burst_at < at {
        let prefix = g.segment(12_288, 24_576);
        for _ in 0..48 {
            let mut p = prefix.clone();
            p.extend(g.segment(128, 1_024));
            let (t, output) = (burst_at + g.rng.unit() * 2.0, g.uniform(16, 256));
            g.push(t, &p, output);
        }
        burst_at += 60.0;
    }
    g.finish()
}

/// Many small tenants: 200 tenants, each a system prompt of 1-6K tokens, chosen Zipf-like per conversation;
/// 1,500 conversations of 1-4 turns (512-3K tokens a turn, 10-40 s apart) arriving at 2 a second.
pub fn tenants(seed: u64) -> Trace {
    let mut g = Gen::new(seed);
    let prompts: Vec<Vec<u64>> = (0..200).map(|_| g.segment(1_024, 6_144)).collect();
    let mut at = 0.0;
    for _ in 0..1_500 {
        at += g.exp(2.0);
        let tenant = g.zipf(prompts.len());
        let chat = Chat { turns: (1, 4), user: (512, 3_072), output: (32, 384), gap_s: (10, 40) };
        conversation(&mut g, prompts[tenant].clone(), at, &chat);
    }
    g.finish()
}

/// A few large families: 12 documents of 2K-40K tokens, each asked 45-75 times (the document, then a question of
/// 16-512 tokens: one block of its own), outputs of 16-512 tokens, the requests arriving at 1 a second, the
/// families interleaved.
pub fn families(seed: u64) -> Trace {
    let mut g = Gen::new(seed);
    let docs: Vec<Vec<u64>> = (0..12).map(|_| g.segment(2_048, 40_960)).collect();
    let mut asks: Vec<usize> = Vec::new();
    for (f, _) in docs.iter().enumerate() {
        asks.extend(std::iter::repeat_n(f, g.uniform(45, 75)));
    }
    // Interleave the families: a seeded shuffle of the asks.
    for i in (1..asks.len()).rev() {
        asks.swap(i, g.rng.below(i as u64 + 1) as usize);
    }
    let mut at = 0.0;
    for f in asks {
        at += g.exp(1.0);
        let mut p = docs[f].clone();
        p.extend(g.segment(16, 512));
        let output = g.uniform(16, 512);
        g.push(at, &p, output);
    }
    g.finish()
}

/// A conversation whose next turn waits for its answer: each turn adds a user turn of `user` tokens and asks for
/// an answer of `output` tokens, which arrives at `decode_tps` tokens a second; the user reads and types for
/// `think_s` seconds, then sends the next turn carrying it.
fn paced_conversation(g: &mut Gen, mut context: Vec<u64>, at: f64, c: &Chat, decode_tps: f64) {
    let mut t = at;
    for _ in 0..g.uniform(c.turns.0, c.turns.1) {
        context.extend(g.segment(c.user.0, c.user.1));
        let output = g.uniform(c.output.0, c.output.1);
        g.push(t, &context, output);
        context.extend(g.fresh(blocks(output)));
        t += output as f64 / decode_tps + g.uniform(c.gap_s.0, c.gap_s.1) as f64;
    }
}

/// Long answers: 30 tenants' system prompts of 1-3K tokens (Zipf-like), 360 conversations of 2-8 turns arriving at
/// 0.5 a second, questions of 128-1K tokens, answers of 512-2,048 tokens (read at 40 tokens a second, then 5-30 s
/// before the next question).
pub fn decode_heavy(seed: u64) -> Trace {
    let mut g = Gen::new(seed);
    let prompts: Vec<Vec<u64>> = (0..30).map(|_| g.segment(1_024, 3_072)).collect();
    let mut at = 0.0;
    for _ in 0..360 {
        at += g.exp(0.5);
        let tenant = g.zipf(prompts.len());
        let chat = Chat { turns: (2, 8), user: (128, 1_024), output: (512, 2_048), gap_s: (5, 30) };
        paced_conversation(&mut g, prompts[tenant].clone(), at, &chat, 40.0);
    }
    g.finish()
}

/// The demo's shape for CPU workers: 4 system prompts of one block, 96 users (Zipf-like over the prompts) arriving
/// at 0.1 a second, 3-8 turns each of one block of question and an answer of 32-384 tokens (read at 10 tokens a
/// second, then 5-20 s before the next).
pub fn chat_cpu(seed: u64) -> Trace {
    let mut g = Gen::new(seed);
    let prompts: Vec<Vec<u64>> = (0..4).map(|_| g.fresh(1)).collect();
    let mut at = 0.0;
    for _ in 0..96 {
        at += g.exp(0.1);
        let tenant = g.zipf(prompts.len());
        let chat = Chat { turns: (3, 8), user: (1, 512), output: (32, 384), gap_s: (5, 20) };
        paced_conversation(&mut g, prompts[tenant].clone(), at, &chat, 10.0);
    }
    g.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace_gen::to_jsonl;

    #[test]
    fn every_shape_is_a_valid_trace_that_differs_by_seed() {
        for shape in [
            Shape::Agentic,
            Shape::Bursty,
            Shape::Tenants,
            Shape::Families,
            Shape::DecodeHeavy,
            Shape::ChatCpu,
        ] {
            let (a, b) = (shape.generate(1), shape.generate(2));
            assert_eq!(Trace::parse(&to_jsonl(&a)).expect("valid"), a, "{shape:?} round trip");
            assert_eq!(a, shape.generate(1), "{shape:?} is a function of its seed");
            let ids = |t: &Trace| t.requests.iter().flat_map(|r| r.hash_ids.clone()).collect::<Vec<_>>();
            let shared: std::collections::HashSet<u64> = ids(&a).into_iter().collect();
            assert!(ids(&b).iter().all(|i| !shared.contains(i)), "{shape:?}: seeds share no block");
            let least = if shape == Shape::ChatCpu { 300 } else { 500 };
            assert!(a.requests.len() > least, "{shape:?}: {} requests", a.requests.len());
            // Prefixes are reused: far fewer distinct blocks than blocks sent.
            let sent: usize = a.requests.iter().map(|r| r.hash_ids.len()).sum();
            assert!(a.distinct_blocks() * 2 < sent, "{shape:?}");
        }
    }

    #[test]
    fn decode_heavy_answers_are_long_and_a_turn_waits_for_the_answer_before_it() {
        let t = decode_heavy(1);
        let out: Vec<usize> = t.requests.iter().map(|r| r.output_length).collect();
        assert!(out.iter().all(|o| (512..=2_048).contains(o)), "answers of 512-2,048 tokens");
        let mean_out = out.iter().sum::<usize>() / out.len();
        assert!(mean_out >= 1_000, "decode-heavy: mean output {mean_out}");
        // A turn that extends another comes after that turn's answer was read (40 tokens a second).
        let by_prompt: std::collections::HashMap<&[u64], &TraceRequest> =
            t.requests.iter().map(|r| (&r.hash_ids[..], r)).collect();
        let mut followed = 0;
        for r in &t.requests {
            for cut in 1..r.hash_ids.len() {
                if let Some(prev) = by_prompt.get(&r.hash_ids[..cut]) {
                    let answer_ms = prev.output_length as u64 * 1000 / 40;
                    assert!(r.timestamp_ms >= prev.timestamp_ms + answer_ms, "a turn before its answer");
                    followed += 1;
                }
            }
        }
        assert!(followed > 500, "{followed} follow-up turns");
        let cpu = chat_cpu(1);
        let longest = cpu.requests.iter().map(|r| r.input_length).max().unwrap_or(0);
        assert!((4_096..=8_704).contains(&longest), "CPU-sized prompts: {longest}");
    }

    #[test]
    fn agent_prompts_grow_to_about_100k_tokens_and_sub_agents_fork_their_parents() {
        let t = agentic(1);
        let longest = t.requests.iter().map(|r| r.input_length).max().unwrap_or(0);
        assert!((90_000..140_000).contains(&longest), "{longest}");
        // A fork: two prompts that both extend a third (the context at the fork) and diverge right after it. In
        // sorted order such siblings' groups meet where their common prefix is exactly a request's prompt.
        let prompts: std::collections::HashSet<&[u64]> = t.requests.iter().map(|r| &r.hash_ids[..]).collect();
        let mut sorted: Vec<&[u64]> = prompts.iter().copied().collect();
        sorted.sort();
        let lcp = |a: &[u64], b: &[u64]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let forks = sorted
            .windows(2)
            .filter(|w| {
                let n = lcp(w[0], w[1]);
                n < w[0].len() && n < w[1].len() && prompts.contains(&w[0][..n])
            })
            .count();
        assert!(forks > 10, "{forks} forks");
    }
}
