//! Load vs recompute: how much of a prefix found in a lower tier is worth loading rather than computing again.
//!
//! ```text
//! load(i)      = block_size * kv_bytes_per_token * s_per_byte(tier of block i)
//! recompute(i) = block_size * (prefill_s_per_token * (1 + queued) + attention_s * (i * block_size + block_size / 2))
//!     queued: requests waiting behind it for the engine (recomputing takes engine time they all wait for; a load
//!             runs on the copy engine or the IO thread); the attention term grows with the position, so
//!             recomputing a long context costs quadratically more
//! loaded blocks = the prefix length L (from the first lower-tier block) that maximises
//!                 sum over i < L of (recompute(i) - load(i)); 0 when nothing saves time
//! ```
//! Inputs: the tiers' bandwidths (a probe at start on a real worker, the profile in the simulator), the engine's
//! prefill cost (its measured step times, or the profile), the queue. `--kv-load-policy` can pin the choice
//! (`load`, `recompute`) for comparison. Pure: no clocks; every decision is logged at debug with its inputs.

/// Where a block of the lower-tier run is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Host,
    Disk,
}

/// The choice rule (`--kv-load-policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoadPolicy {
    /// The cheaper of the two, by the formula above.
    #[default]
    Auto,
    /// Always load what a lower tier holds.
    AlwaysLoad,
    /// Never load from a lower tier (the tiers still fill: for comparison).
    AlwaysRecompute,
}

impl LoadPolicy {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(LoadPolicy::Auto),
            "load" => Ok(LoadPolicy::AlwaysLoad),
            "recompute" => Ok(LoadPolicy::AlwaysRecompute),
            o => Err(format!("kv-load-policy {o}: expected auto, load or recompute")),
        }
    }
}

/// The inputs of the choice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoadCosts {
    pub policy: LoadPolicy,
    pub kv_bytes_per_token: f64,
    pub host_s_per_byte: f64,
    pub disk_s_per_byte: f64,
    /// Seconds one token of prefill takes on this engine (0: unknown, and loading wins).
    pub prefill_s_per_token: f64,
    /// Seconds per token per token of context before it (0: not modelled).
    pub attention_s: f64,
}

impl Default for LoadCosts {
    fn default() -> Self {
        Self {
            policy: LoadPolicy::Auto,
            kv_bytes_per_token: 0.0,
            host_s_per_byte: 0.0,
            disk_s_per_byte: 0.0,
            prefill_s_per_token: 0.0,
            attention_s: 0.0,
        }
    }
}

/// One choice, with what it weighed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// Lower-tier blocks to load (a prefix of the run).
    pub load_blocks: usize,
    /// Seconds loading them takes, and recomputing them would.
    pub load_s: f64,
    pub recompute_s: f64,
}

impl LoadCosts {
    fn block_load_s(&self, s: Source, block_size: usize) -> f64 {
        let per_byte = match s {
            Source::Host => self.host_s_per_byte,
            Source::Disk => self.disk_s_per_byte,
        };
        block_size as f64 * self.kv_bytes_per_token * per_byte
    }

    fn block_recompute_s(&self, index: usize, block_size: usize, queued: usize) -> f64 {
        let bs = block_size as f64;
        bs * (self.prefill_s_per_token * (1 + queued) as f64
            + self.attention_s * (index as f64 * bs + bs / 2.0))
    }

    /// How many of a lower-tier run to load: `sources[k]` is where block `first + k` of the prompt is.
    pub fn choose(&self, sources: &[Source], first: usize, block_size: usize, queued: usize) -> Choice {
        let (mut best, mut best_gain, mut gain) = (0, 0.0, 0.0);
        let (mut load, mut recompute) = (0.0, 0.0);
        let (mut best_load, mut best_recompute) = (0.0, 0.0);
        for (k, s) in sources.iter().enumerate() {
            let l = self.block_load_s(*s, block_size);
            let r = self.block_recompute_s(first + k, block_size, queued);
            load += l;
            recompute += r;
            gain += r - l;
            if gain > best_gain || (self.prefill_s_per_token == 0.0 && self.attention_s == 0.0) {
                (best, best_gain, best_load, best_recompute) = (k + 1, gain, load, recompute);
            }
        }
        let load_blocks = match self.policy {
            LoadPolicy::Auto => best,
            LoadPolicy::AlwaysLoad => sources.len(),
            LoadPolicy::AlwaysRecompute => 0,
        };
        if load_blocks == sources.len() {
            (best_load, best_recompute) = (load, recompute);
        }
        let c = Choice { load_blocks, load_s: best_load, recompute_s: best_recompute };
        tracing::debug!(
            run = sources.len(),
            first,
            queued,
            load_blocks = c.load_blocks,
            load_s = c.load_s,
            recompute_s = c.recompute_s,
            policy = ?self.policy,
            "load vs recompute"
        );
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama-3-8B on an H100 (the gpu-h100-llama3-8b profile), host DRAM at 50 GB/s, an SSD at 2 GB/s.
    fn h100() -> LoadCosts {
        LoadCosts {
            policy: LoadPolicy::Auto,
            kv_bytes_per_token: 131_072.0,
            host_s_per_byte: 2e-11,
            disk_s_per_byte: 5e-10,
            prefill_s_per_token: 2.35e-5,
            attention_s: 1.05e-9,
        }
    }

    #[test]
    fn the_choice_flips_with_the_tier_the_position_and_the_queue() {
        let c = h100();
        // Host DRAM: 2.6 us a token to load against 23.5+ us to compute: always load.
        assert_eq!(c.choose(&[Source::Host; 64], 0, 16, 0).load_blocks, 64);
        // SSD at 2 GB/s: 65.5 us a token. Early in a prompt, alone: computing is cheaper.
        assert_eq!(c.choose(&[Source::Disk; 64], 0, 16, 0).load_blocks, 0);
        // Deep in a long prompt the attention term makes computing dearer: (65.5 - 23.5) us / 1.05 ns = 40K
        // tokens of context before loading wins.
        assert_eq!(c.choose(&[Source::Disk; 64], 50_000 / 16, 16, 0).load_blocks, 64);
        // With two requests queued ahead the engine's time is worth three times as much: load.
        assert_eq!(c.choose(&[Source::Disk; 64], 0, 16, 2).load_blocks, 64);
        // A host run then an SSD run, alone and early: load the host part only.
        let mixed: Vec<Source> = [Source::Host; 10].into_iter().chain([Source::Disk; 10]).collect();
        let m = c.choose(&mixed, 0, 16, 0);
        assert_eq!(m.load_blocks, 10);
        assert!(m.load_s < m.recompute_s);
        // Pinned policies and an engine whose prefill cost is not known yet.
        assert_eq!(
            LoadCosts { policy: LoadPolicy::AlwaysLoad, ..c }.choose(&mixed, 0, 16, 0).load_blocks,
            20
        );
        assert_eq!(
            LoadCosts { policy: LoadPolicy::AlwaysRecompute, ..c }.choose(&mixed, 0, 16, 0).load_blocks,
            0
        );
        let unknown = LoadCosts { prefill_s_per_token: 0.0, attention_s: 0.0, ..c };
        assert_eq!(unknown.choose(&mixed, 0, 16, 0).load_blocks, 20);
        assert!(LoadPolicy::parse("sometimes").is_err());
    }
}
