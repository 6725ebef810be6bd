//! `shared-prefix`: `groups` x `prompts_per_group` requests; each group has its own system prompt of
//! `system_tokens`, each request appends its own question of `question_tokens` and asks for `output_tokens`. The
//! shape of SGLang's generated-shared-prefix benchmark (defaults 64 x 16, 2048, 128, 256); requests are shuffled
//! across groups and arrive as a Poisson process.

use kvgate_shared::prompt::SplitMix64;

use super::{poisson_times, random_tokens, shuffle, Job, Plan, Single};

/// Shape of the workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedPrefix {
    pub groups: usize,
    pub prompts_per_group: usize,
    pub system_tokens: usize,
    pub question_tokens: usize,
    pub output_tokens: u32,
}

impl Default for SharedPrefix {
    fn default() -> Self {
        Self {
            groups: 64,
            prompts_per_group: 16,
            system_tokens: 2048,
            question_tokens: 128,
            output_tokens: 256,
        }
    }
}

impl SharedPrefix {
    pub fn plan(&self, rate: f64, vocab: u32, seed: u64) -> Plan {
        let mut rng = SplitMix64::new(seed ^ 0x5348_4152_4544);
        let mut requests = Vec::with_capacity(self.groups * self.prompts_per_group);
        for g in 0..self.groups {
            let system = random_tokens(self.system_tokens, vocab, &mut rng);
            for _ in 0..self.prompts_per_group {
                let mut prompt = system.clone();
                prompt.extend(random_tokens(self.question_tokens, vocab, &mut rng));
                requests.push((g, prompt));
            }
        }
        shuffle(&mut requests, &mut rng);
        let times = poisson_times(requests.len(), rate, &mut rng);
        let jobs = requests
            .into_iter()
            .zip(times)
            .map(|((g, prompt), at_s)| {
                Job::Single(Single {
                    at_s,
                    prompt,
                    max_tokens: self.output_tokens,
                    user: None,
                    tag: format!("group-{g}"),
                })
            })
            .collect();
        Plan { name: "shared-prefix".into(), jobs }
    }
}
