//! Workloads: seeded, reproducible plans of requests for `kvgate-loadtest run` (and `compare`, `demo`).
//!
//! A [`Plan`] is a list of [`Job`]s in start order. A job is one request (`Single`: token-id prompt, known arrival
//! time) or a conversation (`Session`: turns sent one after another, each carrying the previous answers, with think
//! time between them), because a turn cannot be written before the previous answer is back.
//!
//! - `mooncake`: a Mooncake trace's requests, token ids from its hash ids (as in the simulator), trace timestamps;
//! - `multi_turn`: users sharing a system prompt, each turn appending the previous answer;
//! - `shared_prefix`: groups x prompts with a per-group system prompt (SGLang's generated-shared-prefix shape);
//! - `long_burst`: steady short requests plus bursts of very long ones (exercises the class budgets).

pub mod long_burst;
pub mod mooncake;
pub mod multi_turn;
pub mod shared_prefix;

use kvgate_shared::prompt::SplitMix64;
use serde::Serialize;

/// One request with a token-id prompt.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Single {
    /// Seconds after the run starts (open loop; ignored in closed loop).
    pub at_s: f64,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    /// Sent as the OpenAI `user` field (the gateway's session key).
    pub user: Option<String>,
    /// What part of the workload it is (`short`, `long`, `group-3`...), for the report.
    pub tag: String,
}

/// A conversation: chat turns, each sent after the previous answer plus think time.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Session {
    pub at_s: f64,
    pub user: String,
    pub system: String,
    /// The user's message of each turn.
    pub questions: Vec<String>,
    /// Think time before each turn after the first.
    pub think_s: Vec<f64>,
    pub max_tokens: u32,
    pub tag: String,
}

/// A unit of work.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Job {
    Single(Single),
    Session(Session),
}

impl Job {
    pub fn at_s(&self) -> f64 {
        match self {
            Job::Single(s) => s.at_s,
            Job::Session(s) => s.at_s,
        }
    }
    /// Requests this job sends.
    pub fn requests(&self) -> usize {
        match self {
            Job::Single(_) => 1,
            Job::Session(s) => s.questions.len(),
        }
    }
}

/// A whole workload.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Plan {
    pub name: String,
    pub jobs: Vec<Job>,
}

impl Plan {
    /// Requests the plan sends in all.
    pub fn requests(&self) -> usize {
        self.jobs.iter().map(Job::requests).sum()
    }

    /// Sorts jobs by start time (stable).
    pub fn sort(&mut self) {
        self.jobs.sort_by(|a, b| a.at_s().total_cmp(&b.at_s()));
    }
}

/// Poisson arrival times: `n` times with exponential gaps of mean `1 / rate` (all 0 when `rate` is infinite or 0).
pub fn poisson_times(n: usize, rate: f64, rng: &mut SplitMix64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            if rate.is_finite() && rate > 0.0 {
                t += exponential(1.0 / rate, rng);
            }
            t
        })
        .collect()
}

/// An exponential sample of the given mean.
pub fn exponential(mean: f64, rng: &mut SplitMix64) -> f64 {
    -(1.0 - rng.unit()).ln() * mean
}

/// `n` token ids below `vocab`.
pub fn random_tokens(n: usize, vocab: u32, rng: &mut SplitMix64) -> Vec<u32> {
    (0..n).map(|_| rng.below(u64::from(vocab.max(1))) as u32).collect()
}

/// Fisher-Yates shuffle.
pub fn shuffle<T>(v: &mut [T], rng: &mut SplitMix64) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

#[cfg(test)]
mod tests;
