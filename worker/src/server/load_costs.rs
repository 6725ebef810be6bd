//! The start-up measurement behind load-vs-recompute (`kv::costs`): how fast this machine copies a block into the
//! host DRAM tier and writes one to the SSD tier, measured once before the engine thread starts. The engine's
//! prefill speed is not measured here: the engine measures it as it runs (`Engine::observe_prefill`). A simulated
//! engine is not measured at all: it loads at its profile's speeds (`device::LoadCostsFrom::Profile`).
//!
//! Invariants: only the tiers the engine has are measured (a speed left unmeasured stays at its default); the SSD
//! probe file is removed whether or not its write succeeded; a failed SSD write leaves the SSD speed unmeasured
//! rather than failing start-up; the log line "KV tiers: measured load speeds" appears only with a tier.

use std::path::Path;

use crate::kv::{KvManager, LoadCosts, LoadPolicy};

/// Bytes of the host copy timed (the best of three).
const HOST_PROBE_BYTES: usize = 64 << 20;
/// Bytes written and synced in the SSD tier's directory (reads are at least as fast on NVMe).
const DISK_PROBE_BYTES: usize = 32 << 20;

/// Measures the tiers `kv` has (the SSD tier's in `disk_dir`) and returns what load-vs-recompute weighs under
/// `policy`.
pub fn measure(kv: &KvManager, policy: LoadPolicy, disk_dir: Option<&Path>) -> LoadCosts {
    let mut costs = LoadCosts { policy, ..Default::default() };
    if kv.host().is_some() {
        costs.host_s_per_byte = host_copy_s_per_byte();
    }
    if let (Some(_), Some(dir)) = (kv.disk(), disk_dir) {
        if let Some(s) = disk_write_s_per_byte(dir) {
            costs.disk_s_per_byte = s;
        }
    }
    if kv.host().is_some() || kv.disk().is_some() {
        tracing::info!(
            host_gb_per_s = 1e-9 / costs.host_s_per_byte.max(1e-15),
            disk_gb_per_s = 1e-9 / costs.disk_s_per_byte.max(1e-15),
            policy = ?costs.policy,
            "KV tiers: measured load speeds"
        );
    }
    costs
}

/// Seconds a byte of a host-memory copy: both buffers touched first (no page faults in the timing); the best of
/// three copies.
fn host_copy_s_per_byte() -> f64 {
    let src = vec![7u8; HOST_PROBE_BYTES];
    let mut dst = vec![1u8; HOST_PROBE_BYTES];
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    best / src.len() as f64
}

/// Seconds a byte of a synced write in `dir` (`None`: the write failed).
fn disk_write_s_per_byte(dir: &Path) -> Option<f64> {
    let path = dir.join(".probe");
    let t = std::time::Instant::now();
    let wrote = std::fs::File::create(&path).and_then(|mut f| {
        use std::io::Write;
        f.write_all(&vec![7u8; DISK_PROBE_BYTES])?;
        f.sync_all()
    });
    let _ = std::fs::remove_file(&path);
    wrote.ok().map(|()| t.elapsed().as_secs_f64() / DISK_PROBE_BYTES as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_tiers_nothing_is_measured_but_the_policy_is_kept() {
        let kv = KvManager::new(4, 16);
        let costs = measure(&kv, LoadPolicy::AlwaysLoad, None);
        assert_eq!(costs, LoadCosts { policy: LoadPolicy::AlwaysLoad, ..Default::default() });
    }

    #[test]
    fn a_synced_write_is_timed_and_its_probe_file_removed() {
        let dir = tempfile::tempdir().expect("tmp");
        let s = disk_write_s_per_byte(dir.path()).expect("writes");
        assert!(s > 0.0 && s.is_finite(), "{s}");
        assert!(!dir.path().join(".probe").exists());
        assert_eq!(disk_write_s_per_byte(&dir.path().join("missing")), None);
    }
}
