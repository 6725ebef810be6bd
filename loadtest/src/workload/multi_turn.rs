//! `multi-turn`: `users` conversations of `turns` turns. Every user shares one system prompt of about
//! `system_words` words; each turn asks a new question of about `question_words` words and appends the previous
//! answers (the chat history grows), after an exponential think time of mean `think_s`. Users start as a Poisson
//! process. Sent as chat completions with the OpenAI `user` field set, so the gateway keeps a user on one worker.

use kvgate_shared::prompt::{synth_text, SplitMix64};

use super::{exponential, poisson_times, Job, Plan, Session};

/// Shape of the workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MultiTurn {
    pub users: usize,
    pub turns: usize,
    pub system_words: usize,
    pub question_words: usize,
    pub output_tokens: u32,
    pub think_s: f64,
}

impl Default for MultiTurn {
    fn default() -> Self {
        Self { users: 16, turns: 5, system_words: 1024, question_words: 64, output_tokens: 64, think_s: 1.0 }
    }
}

impl MultiTurn {
    /// `rate`: users starting per second.
    pub fn plan(&self, rate: f64, seed: u64) -> Plan {
        let mut rng = SplitMix64::new(seed ^ 0x004D_554C_5449);
        let system = synth_text(seed ^ 0x5359_5354_454D, self.system_words);
        let starts = poisson_times(self.users, rate, &mut rng);
        let jobs = starts
            .into_iter()
            .enumerate()
            .map(|(u, at_s)| {
                let questions = (0..self.turns)
                    .map(|t| synth_text(seed ^ ((u as u64) << 20) ^ (t as u64 + 1), self.question_words))
                    .collect();
                let think_s = (0..self.turns).map(|_| exponential(self.think_s.max(0.0), &mut rng)).collect();
                Job::Session(Session {
                    at_s,
                    user: format!("user-{u}"),
                    system: system.clone(),
                    questions,
                    think_s,
                    max_tokens: self.output_tokens,
                    tag: "turn".into(),
                })
            })
            .collect();
        Plan { name: "multi-turn".into(), jobs }
    }
}
