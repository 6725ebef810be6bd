//! `long-burst`: short requests at a steady Poisson rate for the whole duration, plus every `burst_every_s` a burst
//! of `burst_size` very long prompts at once: the traffic the per-class token budgets exist for (a burst of huge
//! prompts must not starve the short ones).

use kvgate_shared::prompt::SplitMix64;

use super::{poisson_times, random_tokens, Job, Plan, Single};

/// Shape of the workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LongBurst {
    pub duration_s: f64,
    pub short_tokens: usize,
    pub long_tokens: usize,
    pub burst_every_s: f64,
    pub burst_size: usize,
    pub output_tokens: u32,
}

impl Default for LongBurst {
    fn default() -> Self {
        Self {
            duration_s: 30.0,
            short_tokens: 256,
            long_tokens: 16_384,
            burst_every_s: 10.0,
            burst_size: 4,
            output_tokens: 32,
        }
    }
}

impl LongBurst {
    /// `rate`: short requests per second.
    pub fn plan(&self, rate: f64, vocab: u32, seed: u64) -> Plan {
        let mut rng = SplitMix64::new(seed ^ 0x0042_5552_5354);
        let mut jobs = Vec::new();
        let expected = (rate.max(0.0) * self.duration_s).ceil() as usize + 1;
        for at_s in
            poisson_times(expected.max(1), rate, &mut rng).into_iter().filter(|t| *t < self.duration_s)
        {
            jobs.push(Job::Single(Single {
                at_s,
                prompt: random_tokens(self.short_tokens, vocab, &mut rng),
                max_tokens: self.output_tokens,
                user: None,
                tag: "short".into(),
            }));
        }
        let mut t = self.burst_every_s.max(0.1) / 2.0;
        while t < self.duration_s {
            for _ in 0..self.burst_size {
                jobs.push(Job::Single(Single {
                    at_s: t,
                    prompt: random_tokens(self.long_tokens, vocab, &mut rng),
                    max_tokens: self.output_tokens,
                    user: None,
                    tag: "long".into(),
                }));
            }
            t += self.burst_every_s.max(0.1);
        }
        let mut plan = Plan { name: "long-burst".into(), jobs };
        plan.sort();
        plan
    }
}
