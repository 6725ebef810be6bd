//! What the registry learns of a worker for prefill/decode splits, from its reports: the step timings a split
//! decision weighs (kept through idle intervals: an interval that ran no prefill says nothing of prefill speed) and
//! the measured P->D rate of each prefill peer it imported from (a moving average per pair).
//!
//! It also names the pairs no transfer has measured yet ([`Registry::unmeasured_links`]), for the gateway to have
//! the decode worker probe them before their first split.
//!
//! Invariants: every figure is finite and non-negative (reports are validated; averages of them stay so); at most
//! [`MAX_LINKS`] peers are kept per worker, the least recently measured giving way.

use std::time::Instant;

use kvgate_shared::report::{PdInfo, Role, StepTiming};
use serde::Serialize;

use super::{Registry, Worker, WorkerRef};

/// A P->D pair no transfer has measured: the decode worker to ask, and the prefill peer to probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnmeasuredLink {
    pub decode: WorkerRef,
    pub decode_url: String,
    pub model: String,
    /// The prefill worker's transfer address.
    pub peer: String,
}

impl Registry {
    /// Up to `max` healthy (decode-capable worker, exporting worker) pairs of one model and KV layout whose rate
    /// the decode worker has not measured (and has room to keep), decode workers in registry order.
    pub fn unmeasured_links(&self, now: Instant, max: usize) -> Vec<UnmeasuredLink> {
        fn pd(w: &Worker) -> Option<&PdInfo> {
            w.report.as_ref().map(|r| &r.pd)
        }
        let ok = |w: &Worker| self.healthy(w, now) && w.fingerprint_ok == Some(true);
        // The exporting workers first (a prefill pool is small): pairs cost decode workers x exporters.
        let exporters: Vec<(&Worker, &PdInfo)> = self
            .workers
            .iter()
            .filter_map(|p| Some((p, pd(p)?)))
            .filter(|(p, pp)| {
                pp.role != Role::Decode && !pp.transfer_addr.is_empty() && p.model.is_some() && ok(p)
            })
            .collect();
        let mut out = Vec::new();
        if exporters.is_empty() {
            return out;
        }
        for (idx, d) in self.workers.iter().enumerate() {
            let Some(dp) = pd(d).filter(|p| p.role != Role::Prefill && p.kv_bytes_per_token > 0) else {
                continue;
            };
            let (Some(model), true) = (d.model.as_ref(), ok(d) && d.pd.links.len() < MAX_LINKS) else {
                continue;
            };
            for (p, pp) in &exporters {
                let same = p.uid != d.uid && p.model.as_ref() == Some(model);
                if !same
                    || pp.kv_bytes_per_token != dp.kv_bytes_per_token
                    || d.pd.link_rate(&pp.transfer_addr).is_some()
                {
                    continue;
                }
                if out.len() == max {
                    return out;
                }
                out.push(UnmeasuredLink {
                    decode: WorkerRef { idx, uid: d.uid },
                    decode_url: d.url.clone(),
                    model: model.clone(),
                    peer: pp.transfer_addr.clone(),
                });
            }
        }
        out
    }
}

/// Most prefill peers whose rate a decode worker's entry keeps.
pub const MAX_LINKS: usize = 16;
/// Weight of a new measurement in the moving averages.
pub const NEW_WEIGHT: f64 = 0.5;

/// One P->D pair's measured rate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkRate {
    /// The prefill worker's transfer address.
    pub peer: String,
    pub bytes_per_s: f64,
    /// Transfers measured.
    pub transfers: u64,
    /// Report number (of this worker) of the latest measurement.
    pub seen: u64,
}

/// The split inputs learned from a worker's reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PdState {
    /// Prefill tokens/s while prefilling (0: never measured).
    pub prefill_tokens_per_s: f64,
    /// The worker's latest fit of a prefill step's cost (`StepTiming::prefill_per_token_s` and
    /// `prefill_attention_s`; the worker smooths it over its last steps; 0: never measured).
    pub prefill_per_token_s: f64,
    pub prefill_attention_s: f64,
    /// Seconds per decode-only step (0: never measured).
    pub decode_step_s: f64,
    /// The worker's latest fit of a decode-only step (`StepTiming::decode_*`; 0: never measured).
    pub decode_base_s: f64,
    pub decode_per_seq_s: f64,
    pub decode_per_kv_token_s: f64,
    /// Share of decode-carrying step time prefill chunks added (the first report's, then a moving average: an
    /// interval without decodes reports 0 and halves it).
    pub stall_ratio: f64,
    pub links: Vec<LinkRate>,
    reports: u64,
}

fn blend(old: f64, new: f64) -> f64 {
    if old == 0.0 {
        new
    } else {
        old + NEW_WEIGHT * (new - old)
    }
}

impl PdState {
    /// Takes one report's figures.
    pub fn ingest(&mut self, pd: &PdInfo) {
        self.reports += 1;
        let t: StepTiming = pd.timing;
        if t.prefill_tokens_per_s > 0.0 {
            self.prefill_tokens_per_s = blend(self.prefill_tokens_per_s, t.prefill_tokens_per_s);
        }
        if t.prefill_per_token_s > 0.0 || t.prefill_attention_s > 0.0 {
            (self.prefill_per_token_s, self.prefill_attention_s) =
                (t.prefill_per_token_s, t.prefill_attention_s);
        }
        if t.decode_step_s > 0.0 {
            self.decode_step_s = blend(self.decode_step_s, t.decode_step_s);
        }
        if t.decode_base_s > 0.0 || t.decode_per_seq_s > 0.0 || t.decode_per_kv_token_s > 0.0 {
            (self.decode_base_s, self.decode_per_seq_s, self.decode_per_kv_token_s) =
                (t.decode_base_s, t.decode_per_seq_s, t.decode_per_kv_token_s);
        }
        self.stall_ratio = match self.reports {
            1 => t.stall_ratio,
            _ => self.stall_ratio + NEW_WEIGHT * (t.stall_ratio - self.stall_ratio),
        }
        .clamp(0.0, 1.0);
        for i in &pd.imports {
            if i.bytes == 0 || i.seconds <= 0.0 || i.peer.is_empty() {
                continue;
            }
            let rate = i.bytes as f64 / i.seconds;
            match self.links.iter_mut().find(|l| l.peer == i.peer) {
                Some(l) => {
                    l.bytes_per_s = blend(l.bytes_per_s, rate);
                    l.transfers = l.transfers.saturating_add(u64::from(i.transfers));
                    l.seen = self.reports;
                }
                None => {
                    if self.links.len() >= MAX_LINKS {
                        let oldest = (0..self.links.len()).min_by_key(|j| self.links[*j].seen).unwrap_or(0);
                        self.links.swap_remove(oldest);
                    }
                    self.links.push(LinkRate {
                        peer: i.peer.clone(),
                        bytes_per_s: rate,
                        transfers: u64::from(i.transfers),
                        seen: self.reports,
                    });
                }
            }
        }
    }

    /// The measured rate from `peer`, if any transfer from it was measured.
    pub fn link_rate(&self, peer: &str) -> Option<f64> {
        self.links.iter().find(|l| l.peer == peer).map(|l| l.bytes_per_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::report::PeerImport;

    fn pd(timing: StepTiming, imports: Vec<PeerImport>) -> PdInfo {
        PdInfo { timing, imports, ..PdInfo::default() }
    }

    #[test]
    fn idle_intervals_keep_speeds_and_links_average_per_peer() {
        let mut s = PdState::default();
        let busy = StepTiming {
            prefill_tokens_per_s: 40_000.0,
            decode_step_s: 0.006,
            stall_ratio: 0.4,
            ..StepTiming::default()
        };
        let link =
            |peer: &str, bytes, seconds| PeerImport { peer: peer.into(), bytes, seconds, transfers: 1 };
        s.ingest(&pd(busy, vec![link("p:1", 1_000_000_000, 1.0)]));
        s.ingest(&pd(StepTiming::default(), vec![link("p:1", 3_000_000_000, 1.0), link("", 5, 1.0)]));
        assert_eq!((s.prefill_tokens_per_s, s.decode_step_s), (40_000.0, 0.006), "idle: speeds kept");
        assert!((s.stall_ratio - 0.2).abs() < 1e-12, "the first report's stall, then it decays: {s:?}");
        assert_eq!(s.link_rate("p:1"), Some(2e9));
        assert_eq!(s.links.len(), 1, "an unnamed peer is no sample");
        // Bounded: the least recently measured peer gives way.
        for i in 0..MAX_LINKS + 3 {
            s.ingest(&pd(StepTiming::default(), vec![link(&format!("q:{i}"), 10, 1.0)]));
        }
        assert_eq!(s.links.len(), MAX_LINKS);
        assert!(s.link_rate("p:1").is_none() && s.link_rate(&format!("q:{}", MAX_LINKS + 2)).is_some());
    }
}
