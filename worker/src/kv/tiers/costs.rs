//! Load vs recompute: how much of a prefix found in a lower tier is worth loading rather than computing again.
//!
//! ```text
//! host(i)      = block_size * kv_bytes_per_token * host_s_per_byte          (block i in host DRAM)
//! wait(i)      = seconds until SSD block i is in memory (read_ahead.rs: 0 once read ahead while the request
//!                queued; else it is read now, behind the channel's backlog, at block_size * kv_bytes_per_token *
//!                disk_s_per_byte a block)
//! load(L)      = sum over host blocks i < L of host(i) + max over SSD blocks i < L of wait(i)
//! recompute(i) = block_size * (prefill_s_per_token + attention_s * (i * block_size + block_size / 2))
//!     the attention term grows with the position, so recomputing a long context costs quadratically more
//! when a request is added (what to read ahead; what its load report counts as cached):
//!     wait(i) -= the engine work queued ahead of it (prefill tokens x prefill_s_per_token): the read runs on the
//!     IO thread while the request queues, so a longer queue makes loading cheaper; admission passes the request
//!     over until its read ahead is done while anything else can run
//! when it is admitted: wait(i) *= 1 + running requests (in the simulator a read not done stalls the step for
//!     the whole batch; a worker passes the request over while its IO thread reads instead, so there the factor
//!     leans toward recomputing)
//! loaded blocks = the prefix length L (from the first lower-tier block) that maximises
//!                 sum over i < L of recompute(i) - load(L); 0 when nothing saves time
//! ```
//! Inputs: the tiers' bandwidths (a probe at start, then a moving average of real transfers, on a real worker; the
//! profile in the simulator), the engine's prefill cost (its measured step times, or the profile), the queue and
//! the SSD channel's schedule. `--kv-load-policy` can pin the choice (`load`, `recompute`) for comparison. Pure: no
//! clocks; every decision is logged at debug with its inputs.

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

/// Transfers smaller than this are not timed into the moving averages (fixed costs would dominate them).
pub const MIN_OBSERVED_BYTES: usize = 64 << 10;
/// Weight of the newest transfer in a tier's moving average of seconds per byte.
pub const OBSERVED_WEIGHT: f64 = 0.2;

/// Folds one timed transfer into a moving average of seconds per byte (`0`: none yet, the first one is taken).
pub fn observe(avg: f64, bytes: usize, secs: f64) -> f64 {
    if bytes < MIN_OBSERVED_BYTES || !secs.is_finite() || secs < 0.0 {
        return avg;
    }
    let s = secs / bytes as f64;
    if avg <= 0.0 {
        s
    } else {
        avg * (1.0 - OBSERVED_WEIGHT) + s * OBSERVED_WEIGHT
    }
}

impl LoadCosts {
    /// Seconds to copy one block from host DRAM.
    pub fn host_block_s(&self, block_size: usize) -> f64 {
        block_size as f64 * self.kv_bytes_per_token * self.host_s_per_byte
    }

    /// Seconds to read one block from the SSD tier.
    pub fn disk_block_s(&self, block_size: usize) -> f64 {
        block_size as f64 * self.kv_bytes_per_token * self.disk_s_per_byte
    }

    fn block_recompute_s(&self, index: usize, block_size: usize) -> f64 {
        let bs = block_size as f64;
        bs * (self.prefill_s_per_token + self.attention_s * (index as f64 * bs + bs / 2.0))
    }

    /// How many of a lower-tier run to load: `sources[k]` is where block `first + k` of the prompt is, and
    /// `waits[k]` (read for SSD blocks) the seconds until it is in memory (`ReadAhead::waits`).
    pub fn choose(&self, sources: &[Source], waits: &[f64], first: usize, block_size: usize) -> Choice {
        let (mut best, mut best_gain) = (0, 0.0);
        let (mut host, mut disk, mut recompute) = (0.0, 0.0f64, 0.0);
        let (mut best_load, mut best_recompute) = (0.0, 0.0);
        let host_block = self.host_block_s(block_size);
        let mut load = 0.0;
        for (k, s) in sources.iter().enumerate() {
            match s {
                Source::Host => host += host_block,
                Source::Disk => {
                    disk = disk.max(
                        waits
                            .get(k)
                            .copied()
                            .unwrap_or_else(|| (k + 1) as f64 * self.disk_block_s(block_size)),
                    )
                }
            }
            recompute += self.block_recompute_s(first + k, block_size);
            load = host + disk;
            let gain = recompute - load;
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

    impl LoadCosts {
        /// `choose` for a request added now behind `ahead` seconds of engine work, its SSD blocks read in order from
        /// an idle channel.
        fn pick(&self, sources: &[Source], first: usize, block_size: usize, ahead: f64) -> Choice {
            let mut n = 0.0;
            let waits: Vec<f64> = sources
                .iter()
                .map(|s| {
                    if *s == Source::Disk {
                        n += 1.0;
                    }
                    (n * self.disk_block_s(block_size) - ahead).max(0.0)
                })
                .collect();
            self.choose(sources, &waits, first, block_size)
        }
    }

    #[test]
    fn a_run_read_ahead_while_queued_is_loaded_and_a_backlog_makes_reading_dear() {
        let c = h100();
        let run = [Source::Disk; 64];
        // Alone and early, read now: recompute (as below). Read ahead already (every wait 0): load.
        assert_eq!(c.pick(&run, 0, 16, 0.0).load_blocks, 0);
        assert_eq!(c.choose(&run, &[0.0; 64], 0, 16).load_blocks, 64);
        // Half read ahead: the first half is in memory, the rest would wait for the disk: load the first half.
        let half: Vec<f64> =
            (0..64).map(|k| if k < 32 { 0.0 } else { (k - 31) as f64 * c.disk_block_s(16) }).collect();
        assert_eq!(c.choose(&run, &half, 0, 16).load_blocks, 32);
        // Deep in a long prompt loading wins when read now; behind a 10 s backlog it does not.
        assert_eq!(c.pick(&run, 50_000 / 16, 16, 0.0).load_blocks, 64);
        let behind: Vec<f64> = (0..64).map(|k| 10.0 + (k + 1) as f64 * c.disk_block_s(16)).collect();
        assert_eq!(c.choose(&run, &behind, 50_000 / 16, 16).load_blocks, 0);
    }

    #[test]
    fn real_transfers_move_the_averages_and_tiny_or_broken_ones_do_not() {
        assert_eq!(observe(0.0, 1 << 20, 1e-3), 1e-3 / (1 << 20) as f64);
        let a = observe(1e-9, 1 << 20, 2e-9 * (1 << 20) as f64);
        assert!((a - 1.2e-9).abs() < 1e-15, "{a}");
        assert_eq!(observe(1e-9, 100, 1.0), 1e-9);
        assert_eq!(observe(1e-9, 1 << 20, f64::NAN), 1e-9);
        assert_eq!(observe(1e-9, 1 << 20, -1.0), 1e-9);
    }

    #[test]
    fn the_choice_flips_with_the_tier_the_position_and_the_queue() {
        let c = h100();
        // Host DRAM: 2.6 us a token to load against 23.5+ us to compute: always load.
        assert_eq!(c.pick(&[Source::Host; 64], 0, 16, 0.0).load_blocks, 64);
        // SSD at 2 GB/s: 65.5 us a token. Early in a prompt, alone: computing is cheaper.
        assert_eq!(c.pick(&[Source::Disk; 64], 0, 16, 0.0).load_blocks, 0);
        // Deep in a long prompt the attention term makes computing dearer: (65.5 - 23.5) us / 1.05 ns = 40K
        // tokens of context before loading wins.
        assert_eq!(c.pick(&[Source::Disk; 64], 50_000 / 16, 16, 0.0).load_blocks, 64);
        // Behind a second of engine work the read is done before the request's turn: load. Behind 50 ms, load
        // what is read by then and a little more (a block read costs 1.05 ms, computing it 0.38 ms).
        assert_eq!(c.pick(&[Source::Disk; 64], 0, 16, 1.0).load_blocks, 64);
        let part = c.pick(&[Source::Disk; 64], 0, 16, 0.05).load_blocks;
        assert!((47..=50).contains(&part), "{part}");
        // A host run then an SSD run, alone and early: load the host part only.
        let mixed: Vec<Source> = [Source::Host; 10].into_iter().chain([Source::Disk; 10]).collect();
        let m = c.pick(&mixed, 0, 16, 0.0);
        assert_eq!(m.load_blocks, 10);
        assert!(m.load_s < m.recompute_s);
        // Pinned policies and an engine whose prefill cost is not known yet.
        assert_eq!(
            LoadCosts { policy: LoadPolicy::AlwaysLoad, ..c }.pick(&mixed, 0, 16, 0.0).load_blocks,
            20
        );
        assert_eq!(
            LoadCosts { policy: LoadPolicy::AlwaysRecompute, ..c }.pick(&mixed, 0, 16, 0.0).load_blocks,
            0
        );
        let unknown = LoadCosts { prefill_s_per_token: 0.0, attention_s: 0.0, ..c };
        assert_eq!(unknown.pick(&mixed, 0, 16, 0.0).load_blocks, 20);
        assert!(LoadPolicy::parse("sometimes").is_err());
    }
}
