//! `mooncake`: a Mooncake trace replayed against a real endpoint: token-id prompts expanded from the 512-token hash
//! ids exactly as the simulator does, arrivals at the trace's timestamps times `time_scale`, `output_length` tokens.

use super::{Job, Plan, Single};
use crate::trace::{expand_prompt, Trace};

/// The trace's requests as a plan.
pub fn plan(trace: &Trace, time_scale: f64, vocab: u32) -> Plan {
    let t0 = trace.requests.first().map_or(0, |r| r.timestamp_ms);
    let jobs = trace
        .requests
        .iter()
        .map(|r| {
            Job::Single(Single {
                at_s: (r.timestamp_ms - t0) as f64 / 1000.0 * time_scale,
                prompt: expand_prompt(r, vocab),
                max_tokens: r.output_length.max(1) as u32,
                user: None,
                tag: "trace".into(),
            })
        })
        .collect();
    Plan { name: "mooncake".into(), jobs }
}
