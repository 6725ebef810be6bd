//! The simulated engine's timing model and its profile file.
//!
//! ```text
//! prefill chunk of n new tokens after `start` cached/computed ones:
//!     t = prefill_base_s + prefill_per_token_s * n + prefill_attention_s * n * (start + n / 2)
//!     (the last term is the causal attention area: each new token attends to everything before it)
//! decode step of `batch` sequences holding `kv_tokens` tokens of context in total:
//!     t = decode_base_s + decode_per_seq_s * batch + decode_per_kv_token_s * kv_tokens
//! step = sum of its prefill chunks + its decode part (if any sequence decodes), with one base only: a step
//!        pays max(prefill_base_s, decode_base_s) of what it runs, not a base per chunk (one pass over the
//!        weights and one launch per step, whatever the batch holds)
//! loading KV blocks from the host tier before a step: host_load_s_per_byte * bytes (0, the default: free);
//! from the SSD tier: disk_load_s_per_byte * bytes
//! ```
//! Profiles are TOML files (`worker/profiles/`): the coefficients, the model limits the simulated worker
//! advertises, and where the numbers come from.

use serde::{Deserialize, Serialize};

use super::backend::BatchItem;

/// Coefficients of the timing model (seconds).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimingModel {
    pub prefill_base_s: f64,
    pub prefill_per_token_s: f64,
    pub prefill_attention_s: f64,
    pub decode_base_s: f64,
    pub decode_per_seq_s: f64,
    pub decode_per_kv_token_s: f64,
    /// Seconds per byte of KV loaded from host DRAM into the device pool (the host-to-device link). Default 0.
    #[serde(default)]
    pub host_load_s_per_byte: f64,
    /// The same from the SSD tier. Default 0.
    #[serde(default)]
    pub disk_load_s_per_byte: f64,
}

impl TimingModel {
    /// Seconds one prefill chunk takes.
    pub fn prefill(&self, start: usize, n: usize) -> f64 {
        let n_f = n as f64;
        self.prefill_base_s
            + self.prefill_per_token_s * n_f
            + self.prefill_attention_s * n_f * (start as f64 + n_f / 2.0)
    }

    /// Seconds one decode step takes.
    pub fn decode(&self, batch: usize, kv_tokens: usize) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        self.decode_base_s
            + self.decode_per_seq_s * batch as f64
            + self.decode_per_kv_token_s * kv_tokens as f64
    }

    /// Seconds a whole engine step takes (single-token items are decodes, the rest prefill chunks); the step
    /// pays one base, the larger of those of the kinds of work it holds.
    pub fn step(&self, items: &[BatchItem<'_>]) -> f64 {
        let mut t = 0.0;
        let (mut batch, mut kv, mut chunks) = (0usize, 0usize, 0usize);
        for it in items {
            if it.len == 1 && it.start > 0 {
                batch += 1;
                kv += it.start + 1;
            } else {
                chunks += 1;
                t += self.prefill(it.start, it.len) - self.prefill_base_s;
            }
        }
        if batch > 0 {
            t += self.decode(batch, kv) - self.decode_base_s;
        }
        let base = match (chunks > 0, batch > 0) {
            (true, true) => self.prefill_base_s.max(self.decode_base_s),
            (true, false) => self.prefill_base_s,
            (false, true) => self.decode_base_s,
            (false, false) => 0.0,
        };
        t + base
    }

    /// What load-vs-recompute weighs on an engine with these speeds (`kv::costs`; the KV bytes per token are set
    /// by `Engine::set_load_costs` from the backend).
    pub fn load_costs(&self, policy: crate::kv::LoadPolicy) -> crate::kv::LoadCosts {
        crate::kv::LoadCosts {
            policy,
            kv_bytes_per_token: 0.0,
            host_s_per_byte: self.host_load_s_per_byte,
            disk_s_per_byte: self.disk_load_s_per_byte,
            prefill_s_per_token: self.prefill_per_token_s,
            attention_s: self.prefill_attention_s,
        }
    }

    /// Every problem with the coefficients.
    pub fn validate(&self) -> Vec<String> {
        let fields = [
            ("prefill_base_s", self.prefill_base_s),
            ("prefill_per_token_s", self.prefill_per_token_s),
            ("prefill_attention_s", self.prefill_attention_s),
            ("decode_base_s", self.decode_base_s),
            ("decode_per_seq_s", self.decode_per_seq_s),
            ("decode_per_kv_token_s", self.decode_per_kv_token_s),
            ("host_load_s_per_byte", self.host_load_s_per_byte),
            ("disk_load_s_per_byte", self.disk_load_s_per_byte),
        ];
        fields
            .iter()
            .filter(|(_, v)| !v.is_finite() || *v < 0.0)
            .map(|(n, v)| format!("timing.{n} must be a finite number >= 0, got {v}"))
            .collect()
    }
}

/// A simulated worker's profile file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimProfile {
    /// A name for logs and reports.
    pub name: String,
    /// Where the coefficients come from (a measurement command, or a cited publication).
    pub source: String,
    /// Longest sequence (prompt + output) the simulated model accepts.
    pub max_model_len: usize,
    pub timing: TimingModel,
}

impl SimProfile {
    /// Reads and validates a profile file.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates a profile's text; errors start with `origin`.
    pub fn parse(text: &str, origin: &str) -> Result<Self, String> {
        let p: SimProfile = toml::from_str(text).map_err(|e| format!("{origin}: {e}"))?;
        let mut problems = p.timing.validate();
        if p.max_model_len == 0 {
            problems.push("max_model_len must be at least 1".into());
        }
        if problems.is_empty() {
            Ok(p)
        } else {
            Err(format!("{origin}: {}", problems.join("; ")))
        }
    }

    /// A profile shipped in `worker/profiles/` by name, or a file path.
    pub fn named_or_file(arg: &str) -> Result<Self, String> {
        match SHIPPED_PROFILES.iter().find(|(name, _)| *name == arg) {
            Some((name, text)) => Self::parse(text, name),
            None => Self::load(std::path::Path::new(arg)),
        }
    }
}

/// The profiles shipped with the worker, by name (usable without the source tree).
pub const SHIPPED_PROFILES: [(&str, &str); 3] = [
    ("gpu-h100-llama3-8b", include_str!("../../profiles/gpu-h100-llama3-8b.toml")),
    ("gpu-h200-llama3-8b-measured", include_str!("../../profiles/gpu-h200-llama3-8b-measured.toml")),
    ("cpu-small", include_str!("../../profiles/cpu-small.toml")),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> TimingModel {
        TimingModel {
            prefill_base_s: 0.01,
            prefill_per_token_s: 1e-4,
            prefill_attention_s: 1e-8,
            decode_base_s: 0.005,
            decode_per_seq_s: 1e-4,
            decode_per_kv_token_s: 1e-7,
            host_load_s_per_byte: 0.0,
            disk_load_s_per_byte: 0.0,
        }
    }

    #[test]
    fn formula() {
        let m = model();
        // 1000 new tokens after 1000: 0.01 + 0.1 + 1e-8 * 1000 * 1500.
        assert!((m.prefill(1000, 1000) - (0.01 + 0.1 + 0.015)).abs() < 1e-12);
        assert_eq!(m.decode(0, 0), 0.0);
        assert!((m.decode(4, 10_000) - (0.005 + 0.0004 + 0.001)).abs() < 1e-12);
        let tokens: Vec<u32> = vec![0; 3000];
        let items = [
            BatchItem {
                tokens: &tokens,
                start: 1000,
                len: 1000,
                slots: vec![],
                want_next: true,
                greedy: true,
                adapter: None,
            },
            BatchItem {
                tokens: &tokens,
                start: 2000,
                len: 1,
                slots: vec![],
                want_next: true,
                greedy: true,
                adapter: None,
            },
        ];
        // One base per step: the larger of the two.
        let both = m.prefill(1000, 1000) + m.decode(1, 2001) - m.prefill_base_s.min(m.decode_base_s);
        assert!((m.step(&items) - both).abs() < 1e-12);
        assert!((m.step(&items[..1]) - m.prefill(1000, 1000)).abs() < 1e-12);
        assert!((m.step(&items[1..]) - m.decode(1, 2001)).abs() < 1e-12);
        let two_chunks = [items[0].clone(), items[0].clone()];
        assert!((m.step(&two_chunks) - (2.0 * m.prefill(1000, 1000) - m.prefill_base_s)).abs() < 1e-12);
        assert_eq!(m.step(&[]), 0.0);
        assert!(TimingModel { decode_base_s: -1.0, ..m }.validate().len() == 1);
    }

    #[test]
    fn shipped_profiles_load() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/profiles");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).expect("profiles dir") {
            let path = entry.expect("entry").path();
            if path.extension().is_some_and(|e| e == "toml") {
                let p = SimProfile::load(&path).expect("valid profile");
                assert!(!p.source.is_empty());
                let stem = path.file_stem().and_then(|s| s.to_str()).expect("name");
                assert_eq!(
                    SimProfile::named_or_file(stem).expect("shipped by name"),
                    p,
                    "{stem} is embedded"
                );
                n += 1;
            }
        }
        assert!(n >= 1);
    }
}
