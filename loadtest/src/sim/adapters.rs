//! LoRA adapters in the fleet simulator: which adapter each trace request names, which adapters each simulated
//! worker holds (an LRU of `slots`, as a kvgate worker's `--max-loras`), what a load costs (the request waits
//! `load_s` on its worker; later requests for the adapter there wait for the same load), and where the gateway
//! places a request under four rules, so the gateway's placement is compared with simple ones at any fleet size:
//! - `cost`: the gateway's own (`kvgate_router::placement::place`): holders, or a load where the cost is least;
//! - `anywhere`: the routing policy's pick among all workers as if the adapter did not matter (`--lora-placement
//!   anywhere`), loading it there when it lacks it;
//! - `random_holder`: a random healthy worker holding the adapter, else a random worker that then loads it;
//! - `least_loaded`: the least loaded worker, loading the adapter there when it lacks it.
//!
//! A trace names a request's adapter with its `lora` field; a trace without them gets `assign`: `count` adapters
//! of Zipf(`zipf`) popularity, drawn per request from its first hash id that at most 1% of the trace's requests
//! share (its conversation or document: a prompt every request shares, such as the Mooncake conversation trace's
//! first block, names no adapter), so the turns of one conversation name one adapter. An adapter's blocks are hashed under its key (`name@digest`, as a
//! kvgate worker's), in the workers' caches, their reports and the gateway's hashes alike.

use std::collections::{HashMap, HashSet};

use kvgate_shared::prompt::SplitMix64;
use kvgate_shared::report::{HeldAdapter, LoraInfo};

use crate::trace::Trace;

/// Where an adapter request goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    Cost,
    Anywhere,
    RandomHolder,
    LeastLoaded,
}

impl Rule {
    pub const ALL: [Rule; 4] = [Rule::Cost, Rule::Anywhere, Rule::RandomHolder, Rule::LeastLoaded];

    pub fn name(self) -> &'static str {
        match self {
            Rule::Cost => "cost",
            Rule::Anywhere => "anywhere",
            Rule::RandomHolder => "random_holder",
            Rule::LeastLoaded => "least_loaded",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|r| r.name() == s).ok_or_else(|| {
            format!("adapter placement {s:?}: expected cost, anywhere, random_holder, least_loaded or all")
        })
    }
}

/// The fleet's adapters.
#[derive(Clone, Debug)]
pub struct AdapterSim {
    pub rule: Rule,
    /// Adapters a worker holds at once.
    pub slots: usize,
    /// Seconds a load takes on a worker.
    pub load_s: f64,
    /// For a trace without `lora` fields: (adapters, Zipf exponent).
    pub assign: Option<(usize, f64)>,
}

impl AdapterSim {
    /// Every problem with the values.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.slots == 0 {
            p.push("adapter-slots must be at least 1".into());
        }
        if !(self.load_s >= 0.0 && self.load_s <= 600.0) {
            p.push(format!("adapter load {} s is not in 0..=600 s", self.load_s));
        }
        if let Some((n, s)) = self.assign {
            if n == 0 || n > 100_000 {
                p.push(format!("adapters {n} is not in 1..=100000"));
            }
            if !(0.0..=10.0).contains(&s) {
                p.push(format!("adapter-zipf {s} is not in 0..=10"));
            }
        }
        p
    }

    /// The adapter each request of `trace` names, if any: its own `lora`, else the assignment's.
    pub fn adapters_of(&self, trace: &Trace) -> Vec<Option<String>> {
        let cdf = self.cdf();
        let mut freq: HashMap<u64, usize> = HashMap::new();
        for r in &trace.requests {
            let ids: HashSet<u64> = r.hash_ids.iter().copied().collect();
            for h in ids {
                *freq.entry(h).or_default() += 1;
            }
        }
        let rare = (trace.requests.len() / 100).max(1);
        trace
            .requests
            .iter()
            .map(|r| {
                if let Some(l) = &r.lora {
                    return Some(l.clone());
                }
                self.assign?;
                let last = r.hash_ids.last().copied().unwrap_or(0);
                let id = r
                    .hash_ids
                    .iter()
                    .copied()
                    .find(|h| freq.get(h).is_some_and(|n| *n <= rare))
                    .unwrap_or(last);
                let u = SplitMix64::new(id ^ 0x4C6F_5241).unit();
                let k = cdf.partition_point(|c| *c <= u).min(cdf.len().saturating_sub(1));
                Some(format!("lora-{k}"))
            })
            .collect()
    }

    /// The cumulative Zipf weights of the assignment (empty without one).
    pub fn cdf(&self) -> Vec<f64> {
        let Some((n, s)) = self.assign else { return Vec::new() };
        let w: Vec<f64> = (1..=n).map(|k| 1.0 / (k as f64).powf(s)).collect();
        let total: f64 = w.iter().sum();
        w.iter()
            .scan(0.0, |acc, x| {
                *acc += x / total;
                Some(*acc)
            })
            .collect()
    }
}

/// The key a simulated worker hashes adapter `name`'s blocks under (`name@` and 16 hex digits, as a kvgate
/// worker's: `HeldAdapter::key_is_valid`).
pub fn key(name: &str) -> String {
    use std::hash::Hasher;
    // SipHash with fixed keys: the same digest in every run.
    let mut h = std::hash::DefaultHasher::new();
    h.write(name.as_bytes());
    format!("{name}@{:016x}", h.finish())
}

/// One worker's resident adapters, most recently used first.
#[derive(Clone, Debug, Default)]
pub struct Resident {
    names: Vec<String>,
    slots: usize,
}

impl Resident {
    pub fn new(slots: usize) -> Self {
        Self { names: Vec::new(), slots }
    }

    pub fn holds(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// `name` was used: now the most recently used.
    pub fn touch(&mut self, name: &str) {
        if let Some(i) = self.names.iter().position(|n| n == name) {
            let n = self.names.remove(i);
            self.names.insert(0, n);
        }
    }

    /// Loads `name`; returns the adapter it unloaded for it (the least recently used, when every slot is taken).
    pub fn load(&mut self, name: &str) -> Option<String> {
        if self.holds(name) {
            self.touch(name);
            return None;
        }
        let evicted = (self.names.len() >= self.slots).then(|| self.names.pop()).flatten();
        self.names.insert(0, name.to_owned());
        evicted
    }

    /// What its report says.
    pub fn info(&self) -> LoraInfo {
        let held = self.names.iter().map(|n| HeldAdapter { name: n.clone(), key: key(n) }).collect();
        LoraInfo { slots: self.slots.min(u16::MAX as usize) as u16, held }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resident_set_is_an_lru_of_its_slots_and_reports_valid_keys() {
        let mut r = Resident::new(2);
        assert_eq!((r.load("a"), r.load("b")), (None, None));
        r.touch("a");
        assert_eq!(r.load("c"), Some("b".into()), "b is the least recently used");
        assert!(r.holds("a") && r.holds("c") && !r.holds("b"));
        let info = r.info();
        assert_eq!(info.slots, 2);
        assert!(info.held.iter().all(|h| HeldAdapter::key_is_valid(&h.name, &h.key)), "{info:?}");
    }

    #[test]
    fn assigned_adapters_follow_the_zipf_weights_and_a_conversation_keeps_its_adapter() {
        let sim = AdapterSim { rule: Rule::Cost, slots: 4, load_s: 0.1, assign: Some((10, 1.0)) };
        let cdf = sim.cdf();
        assert!((cdf[9] - 1.0).abs() < 1e-12);
        // 20,000 conversations of two turns behind one shared first block (0), and one request naming its own.
        let mut rows: Vec<String> = Vec::new();
        for c in 0..20_000u64 {
            for turn in 0..2u64 {
                let ids = [0, 10 + c * 7, 10 + c * 7 + 1 + turn];
                rows.push(format!(
                    r#"{{"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": {ids:?}}}"#
                ));
            }
        }
        rows.push(
            r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0], "lora": "mine"}"#
                .into(),
        );
        let trace = Trace::parse(&rows.join("\n")).expect("trace");
        let of = sim.adapters_of(&trace);
        let mut counts = [0usize; 10];
        for a in of.iter().take(40_000).step_by(2) {
            counts
                [a.as_deref().expect("assigned").trim_start_matches("lora-").parse::<usize>().expect("k")] +=
                1;
        }
        // Zipf(1) over 10: the first takes 1/H(10) = 34%, the tenth 3.4%; the shared first block decides nothing.
        assert!((counts[0] as f64 / 20_000.0 - 0.341).abs() < 0.02, "{counts:?}");
        assert!(counts[0] > counts[1] && counts[1] > counts[4] && counts[4] > counts[9], "{counts:?}");
        assert!(
            of[..40_000].chunks(2).all(|turns| turns[0] == turns[1]),
            "a conversation's turns, one adapter"
        );
        assert_eq!(of[40_000].as_deref(), Some("mine"), "a trace's own adapter wins");
        assert_eq!(Rule::parse("random_holder"), Ok(Rule::RandomHolder));
        assert!(Rule::parse("nope").is_err());
    }
}
