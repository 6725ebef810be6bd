//! Golden vectors of the split policies: the seed's four shapes and a RAG-like mix on the measured H200 profile
//! (Llama-3-8B: 131,072 KV bytes a token), the flip where the equation's gain changes sign, and hostile inputs.

use super::cost_model::predict;
use super::*;

/// 25 Gb/s in bytes per second.
const GBPS_25: f64 = 25e9 / 8.0;
const KV_BYTES: f64 = 131_072.0;

/// A worker of the measured H200 profile: ~41.9K prefill tokens/s, 5.8 ms decode steps.
fn side(uncached: u64, stall: f64) -> Side {
    Side {
        uncached_tokens: uncached,
        queue_tokens: 0,
        running: 0,
        prefill_tokens_per_s: 1.0 / 0.000023872551629443412,
        decode_step_s: 0.005781023922206126,
        stall_ratio: stall,
    }
}

fn input(prompt: u64, output: u64, stall: f64, bandwidth: f64) -> SplitInput {
    SplitInput {
        prompt_tokens: prompt,
        expected_output: output,
        local: side(prompt, stall),
        prefill: side(prompt, 0.0),
        decode: side(prompt, 0.0),
        decode_cached_tokens: 0,
        kv_bytes_per_token: KV_BYTES,
        bandwidth_bytes_per_s: bandwidth,
        export_groups: 1,
        slo: Slo { ttft_s: 1e9, tpot_s: 1e9 }, // both options meet: the cost decides
    }
}

fn choice(i: &SplitInput) -> Choice {
    CostModel.decide(i).choice
}

#[test]
fn the_seed_shapes_split_where_the_gain_is_positive() {
    // (prompt, output, measured stall on the co-located worker, expected choice at 25 Gb/s)
    let rows = [
        (512, 1024, 0.3, Choice::Split),    // short prompt, long answer
        (4096, 512, 0.3, Choice::Split),    // 0.17 s to move vs 1.3 s of stalled decode
        (4096, 4096, 0.3, Choice::Split),   // decode-heavy
        (32768, 128, 0.3, Choice::Local),   // 1.37 s to move vs 0.33 s of stall
        (8192, 200, 0.1, Choice::Local),    // RAG: 0.34 s to move vs 0.13 s of stall
        (512, 1024, 0.0, Choice::Local),    // nothing stalls: nothing to gain
    ];
    for (prompt, output, stall, want) in rows {
        let i = input(prompt, output, stall, GBPS_25);
        let d = CostModel.decide(&i);
        assert_eq!(d.choice, want, "{prompt}/{output} at stall {stall}: {:?}", d.terms);
        // With equal queues, speeds and no other streams, the choice is the sign of the design's gain.
        assert_eq!(d.terms.gain_s > 0.0, want == Choice::Split, "{prompt}/{output}: gain {}", d.terms.gain_s);
    }
}

#[test]
fn the_choice_flips_where_the_gain_changes_sign() {
    // 32K prompt at 25 Gb/s, stall 0.3: the gain (output - 1) x tpot x 0.3 - 1.374 s is 0 near output 535.
    let base = input(32768, 1, 0.3, GBPS_25);
    let t = predict(&base);
    let per_token = t.local.tpot_s * 0.3;
    let flip = (t.exposed_transfer_s / per_token).ceil() as u64 + 1;
    assert_eq!(choice(&SplitInput { expected_output: flip - 1, ..base }), Choice::Local);
    assert_eq!(choice(&SplitInput { expected_output: flip + 1, ..base }), Choice::Split);
    // A faster link moves the flip down by the same ratio (400 Gb/s is 16x 25 Gb/s).
    let fast = SplitInput { bandwidth_bytes_per_s: GBPS_25 * 16.0, ..base };
    let flip_fast = (predict(&fast).exposed_transfer_s / per_token).ceil() as u64 + 1;
    assert!((flip_fast as f64 - flip as f64 / 16.0).abs() <= 2.0, "{flip} vs {flip_fast}");
    // Longer prompts move more bytes: the flip moves up with input length.
    let shorter = input(8192, 1, 0.3, GBPS_25);
    let flip_short = (predict(&shorter).exposed_transfer_s / per_token).ceil() as u64 + 1;
    assert!(flip_short * 3 < flip, "{flip_short} vs {flip}");
}

#[test]
fn the_kv_decode_already_holds_does_not_cross_the_link() {
    let mut i = input(32768, 128, 0.3, GBPS_25);
    assert_eq!(choice(&i), Choice::Local);
    i.decode_cached_tokens = 32768 - 512; // D holds all but the last turn
    let d = CostModel.decide(&i);
    assert_eq!(d.terms.transfer_bytes, 512.0 * KV_BYTES);
    assert_eq!(d.choice, Choice::Split, "{:?}", d.terms);
}

#[test]
fn layer_groups_hide_the_transfer_behind_the_prefill() {
    let mut i = input(32768, 128, 0.3, GBPS_25 * 4.0);
    let whole = predict(&i);
    i.export_groups = 8;
    let grouped = predict(&i);
    // 0.34 s to move, ~2.8 s of compute: only the last group's share shows.
    assert!((grouped.exposed_transfer_s - whole.transfer_s / 8.0).abs() < 1e-9);
    assert!(grouped.split.ttft_s < whole.split.ttft_s);
}

#[test]
fn an_slo_only_one_option_meets_decides() {
    // Local misses the 50 ms TPOT (stall 0.9 on a 6 ms step = 58 ms); the split meets it even though the queue on
    // P makes it slower end to end.
    let mut i = input(4096, 64, 0.9, GBPS_25);
    i.slo = DEFAULT_SLO;
    i.prefill.queue_tokens = 60_000; // ~1.4 s ahead on P
    let d = CostModel.decide(&i);
    assert!(!d.terms.local.meets_slo && d.terms.split.meets_slo, "{:?}", d.terms);
    assert_eq!((d.choice, d.reason), (Choice::Split, "slo"));
    // A queue on P that breaks the TTFT target keeps it local (both miss: the cost decides).
    i.prefill.queue_tokens = 200_000;
    let d = CostModel.decide(&i);
    assert_eq!((d.choice, d.reason), (Choice::Local, "cost"), "{:?}", d.terms);
}

#[test]
fn a_prefill_that_would_stall_many_streams_is_moved() {
    // Nothing stalls yet (stall 0) but 64 streams run on the local pick: its prefill would delay each of them.
    let mut i = input(4096, 16, 0.0, GBPS_25);
    assert_eq!(choice(&i), Choice::Local);
    i.local.running = 64;
    let d = CostModel.decide(&i);
    assert!((d.terms.local.imposed_s - 64.0 * 4096.0 * 0.000023872551629443412).abs() < 1e-9);
    assert_eq!(d.choice, Choice::Split);
}

#[test]
fn hostile_or_missing_measurements_give_finite_terms_and_stay_local() {
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1.0, 0.0] {
        let mut i = input(4096, 4096, 0.3, bad);
        i.kv_bytes_per_token = if bad.is_nan() { bad } else { KV_BYTES };
        i.prefill.prefill_tokens_per_s = bad;
        i.decode.stall_ratio = bad;
        i.decode.decode_step_s = bad;
        let d = CostModel.decide(&i);
        let t = d.terms;
        for v in [t.local.e2e_s, t.split.ttft_s, t.split.tpot_s, t.transfer_s, t.exposed_transfer_s] {
            assert!(v.is_finite() && v >= 0.0, "{bad}: {t:?}");
        }
        // An unknown link or prefill speed reads as the slowest believed: the split looks slow, not free.
        assert!(t.split.ttft_s > t.local.ttft_s, "{bad}: {t:?}");
        assert_eq!(d.choice, Choice::Local, "{bad}");
    }
    // A stall of 1.0 is capped: TPOT stays finite.
    let i = input(512, 1024, 1.0, GBPS_25);
    assert!(predict(&i).local.tpot_s.is_finite());
}

#[test]
fn the_anchor_rules_decide_as_published() {
    let dynamo = rules::Dynamo::default();
    let llm_d = rules::LlmD::default();
    let mut i = input(8192, 200, 0.1, GBPS_25);
    // Dynamo: 8192 uncached >= 2048: split (it ignores the output length).
    assert_eq!(dynamo.decide(&i).choice, Choice::Split);
    // ... unless the decode worker holds most of it: 1000 uncached < 2048 and 12% < 70%.
    i.decode_cached_tokens = 7192;
    assert_eq!((dynamo.decide(&i).choice, dynamo.decide(&i).reason), (Choice::Local, "short"));
    assert_eq!(llm_d.decide(&i).choice, Choice::Split, "1000 uncached >= 512");
    i.decode_cached_tokens = 7800;
    assert_eq!(llm_d.decide(&i).choice, Choice::Local, "392 uncached < 512");
    // A short prompt none of which is cached: 100% uncached >= 70%: Dynamo splits it.
    let j = input(512, 16, 0.0, GBPS_25);
    assert_eq!(dynamo.decide(&j).choice, Choice::Split);
    // A busy prefill worker keeps it local.
    let mut k = input(8192, 200, 0.1, GBPS_25);
    k.prefill.queue_tokens = 5000;
    assert_eq!(dynamo.decide(&k).reason, "prefill_busy");
    assert_eq!(rules::Always.decide(&k).choice, Choice::Split);
    assert_eq!(rules::Aggregated.decide(&k).choice, Choice::Local);
    for name in SPLIT_POLICIES {
        assert_eq!(split_policy_by_name(name).expect(name).name(), name);
    }
    assert!(split_policy_by_name("nope").is_none());
}
