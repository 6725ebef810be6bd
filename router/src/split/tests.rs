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
        prefill_per_token_s: 0.0,
        prefill_attention_s: 0.0,
        held_tokens: 0,
        decode_step_s: 0.005781023922206126,
        stall_ratio: stall,
        prefill_busy: 0.0,
    }
}

fn input(prompt: u64, output: u64, stall: f64, bandwidth: f64) -> SplitInput {
    SplitInput {
        prompt_tokens: prompt,
        expected_output: output,
        local: side(prompt, stall),
        // A `both` worker with streams of its own (a dedicated, idle prefill worker is its own test).
        prefill: Side { running: 4, ..side(prompt, 0.0) },
        decode: side(prompt, 0.0),
        decode_cached_tokens: 0,
        kv_bytes_per_token: KV_BYTES,
        bandwidth_bytes_per_s: bandwidth,
        export_groups: 1,
        slo: Slo { ttft_s: 0.0, tpot_s: 0.0 }, // neither option meets (tests that judge by the SLOs set them)
    }
}

fn choice(i: &SplitInput) -> Choice {
    CostModel.decide(i).choice
}

#[test]
fn the_seed_shapes_split_where_only_the_split_meets_the_slos() {
    // (prompt, output, measured stall on the co-located worker, expected choice at 25 Gb/s). At stall 0.9 local
    // TPOT is 5.8 ms / 0.1 = 58 ms > 50 ms; the split's TPOT is D's 5.8 ms and its TTFT prefill + transfer.
    let rows = [
        (512, 1024, 0.9, Choice::Split, "slo"),
        (4096, 512, 0.9, Choice::Split, "slo"),
        (4096, 4096, 0.9, Choice::Split, "slo"),
        (32768, 128, 0.9, Choice::Local, "neither_meets"), // 0.78 s prefill + 1.37 s transfer > 2 s
        (8192, 200, 0.9, Choice::Split, "slo"),            // 0.20 s + 0.34 s
        (8192, 200, 0.5, Choice::Local, "both_meet"),      // local TPOT 11.6 ms: nothing to buy
        (512, 1024, 0.0, Choice::Local, "both_meet"),
    ];
    for (prompt, output, stall, want, reason) in rows {
        let mut i = input(prompt, output, stall, GBPS_25);
        i.slo = DEFAULT_SLO;
        let d = CostModel.decide(&i);
        assert_eq!((d.choice, d.reason), (want, reason), "{prompt}/{output} at stall {stall}: {:?}", d.terms);
    }
}

#[test]
fn the_choice_flips_where_the_predictions_cross_the_slos() {
    let step = 0.005781023922206126;
    // Over the stall ratio: local TPOT = step / (1 - stall) crosses 50 ms at stall 1 - step / 0.05.
    let at = 1.0 - step / DEFAULT_SLO.tpot_s;
    for (stall, want) in [(at - 0.01, Choice::Local), (at + 0.01, Choice::Split)] {
        let mut i = input(4096, 512, stall, GBPS_25);
        i.slo = DEFAULT_SLO;
        assert_eq!(choice(&i), want, "stall {stall}");
    }
    // Over the prompt length (stall 0.9): the split's TTFT = n / rate + n x kv bytes / bandwidth + step crosses
    // 2 s at n = (2 - step) / (1 / rate + kv bytes / bandwidth): longer prompts stay local.
    let flip = |bw: f64| (DEFAULT_SLO.ttft_s - step) / (0.000023872551629443412 + KV_BYTES / bw);
    for bw in [GBPS_25, GBPS_25 * 16.0] {
        let n = flip(bw);
        for (prompt, want) in [((n * 0.98) as u64, Choice::Split), ((n * 1.02) as u64, Choice::Local)] {
            let mut i = input(prompt, 128, 0.9, bw);
            i.slo = DEFAULT_SLO;
            assert_eq!(choice(&i), want, "{prompt} tokens at {bw} B/s (flip {n:.0})");
        }
    }
    // A faster link lets longer prompts split: 25 Gb/s flips near 30K tokens, 400 Gb/s near 72K.
    assert!(flip(GBPS_25 * 16.0) > 2.0 * flip(GBPS_25));
}

#[test]
fn the_design_gain_grows_with_output_and_shrinks_with_input() {
    let g = |prompt, output| predict(&input(prompt, output, 0.3, GBPS_25)).gain_s;
    assert!(g(4096, 4096) > g(4096, 512) && g(4096, 512) > g(4096, 64));
    assert!(g(512, 1024) > g(8192, 1024) && g(8192, 1024) > g(32768, 1024));
    assert!(g(32768, 128) < 0.0 && g(512, 1024) > 0.0);
}

#[test]
fn the_kv_decode_already_holds_does_not_cross_the_link() {
    let mut i = input(32768, 128, 0.9, GBPS_25);
    i.slo = DEFAULT_SLO;
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
    assert_eq!((d.choice, d.reason), (Choice::Local, "neither_meets"), "{:?}", d.terms);
}

#[test]
fn when_both_options_meet_the_slos_the_request_stays_local() {
    // 512/1024 at stall 0.3: the split is faster end to end, but local meets TTFT <= 2 s and TPOT <= 50 ms too,
    // and a `both` prefill worker's streams would take the stall instead.
    let mut i = input(512, 1024, 0.3, GBPS_25);
    i.slo = DEFAULT_SLO;
    let d = CostModel.decide(&i);
    assert!(d.terms.local.meets_slo && d.terms.split.meets_slo && d.terms.gain_s > 0.0, "{:?}", d.terms);
    assert_eq!((d.choice, d.reason), (Choice::Local, "both_meet"));
    // ... unless the prefill worker runs no streams (a dedicated one) and the split leaves more headroom: D's
    // 5.8 ms TPOT uses 12% of the target, local's 8.3 ms 17%.
    i.prefill.running = 0;
    let d = CostModel.decide(&i);
    assert!(d.terms.split.slack > d.terms.local.slack, "{:?}", d.terms);
    assert_eq!(d.reason, "more_slack");
    // A dedicated prefill worker with 1.7 s queued leaves less TTFT headroom than local has TPOT headroom.
    i.prefill.queue_tokens = 70_000;
    let d = CostModel.decide(&i);
    assert!(d.terms.split.meets_slo && d.terms.split.slack < d.terms.local.slack, "{:?}", d.terms);
    assert_eq!(d.reason, "both_meet");
    // A prefill worker whose own streams miss the TPOT target is no rescue.
    let mut j = input(4096, 512, 0.9, GBPS_25);
    j.slo = DEFAULT_SLO;
    assert_eq!(choice(&j), Choice::Split);
    j.prefill.stall_ratio = 0.9;
    assert_eq!(CostModel.decide(&j).reason, "neither_meets");
}

#[test]
fn when_neither_option_meets_an_idle_dedicated_prefill_worker_takes_the_cheaper_one() {
    // 32768/128 at stall 0.9 and 25 Gb/s: local TPOT 58 ms, the split's TTFT 0.78 s + 1.37 s; neither meets.
    // On a `both` prefill worker with streams it stays local; a dedicated one takes it, as the split ends
    // sooner (2.9 s vs 8.1 s) and stalls no one. Without this the decode workers' stall (which their own local
    // prefills cause) would make every split look as slow as local, and nothing would ever move.
    let mut i = input(32768, 128, 0.9, GBPS_25);
    i.slo = DEFAULT_SLO;
    assert_eq!(CostModel.decide(&i).reason, "neither_meets");
    i.prefill.running = 0;
    let d = CostModel.decide(&i);
    assert!(!d.terms.local.meets_slo && !d.terms.split.meets_slo, "{:?}", d.terms);
    assert!(d.terms.split.e2e_s < 3.0 && d.terms.local.e2e_s > 8.0, "{:?}", d.terms);
    assert_eq!((d.choice, d.reason), (Choice::Split, "lower_cost"));
    // A prefill worker busy 90% of the time: the prompts that would queue behind this one's 0.78 s (9 of
    // them) make the split dearer than the local stall; local.
    i.prefill.prefill_busy = 0.9;
    let d = CostModel.decide(&i);
    let want = 32768.0 * 0.000023872551629443412 * 9.0;
    assert!((d.terms.split.harm_s - want).abs() < 1e-6, "{:?}", d.terms);
    assert_eq!(d.reason, "neither_meets");
}

#[test]
fn the_stall_a_local_prefill_puts_on_the_streams_there_is_weighed() {
    // 4,096/512 on an unstalled fleet: local leaves the most headroom (no transfer), so it stays local.
    let mut i = input(4096, 512, 0.0, GBPS_25);
    i.slo = DEFAULT_SLO;
    i.prefill.running = 0;
    let d = CostModel.decide(&i);
    assert!(d.terms.split.e2e_s > d.terms.local.e2e_s && d.terms.local.harm_s == 0.0, "{:?}", d.terms);
    assert_eq!((d.choice, d.reason), (Choice::Local, "both_meet"));
    // 16 streams on a local pick whose decodes already stall (14.5 ms at 0.6), a 64-token answer: its 98 ms of
    // chunks take them to 16 ms, the split onto an idle dedicated prefill worker keeps them at D's 5.8 ms.
    i.local.running = 16;
    i.local.stall_ratio = 0.6;
    i.expected_output = 64;
    let d = CostModel.decide(&i);
    assert!((d.terms.local.harm_s - 16.0 * 4096.0 * 0.000023872551629443412).abs() < 1e-9, "{:?}", d.terms);
    assert!(d.terms.local.meets_slo && d.terms.split.harm_s == 0.0, "{:?}", d.terms);
    assert_eq!((d.choice, d.reason), (Choice::Split, "more_slack"));
    // The same streams on a `both` prefill worker: the split would stall them there instead; local.
    i.prefill.running = 16;
    assert_eq!(CostModel.decide(&i).reason, "both_meet");
}

#[test]
fn a_prefill_that_would_push_the_local_streams_over_the_target_goes_to_an_idle_prefill_worker() {
    // 4,096 tokens take 98 ms here; spread over a 2-token answer that adds 49 ms to each of the 32 streams on
    // the local pick (5.8 + 49 > 50 ms), though the request itself would meet its own targets.
    let mut i = input(4096, 2, 0.0, GBPS_25);
    i.slo = DEFAULT_SLO;
    i.local.running = 32;
    i.prefill.running = 0;
    let d = CostModel.decide(&i);
    assert!(d.terms.local.others_tpot_s > DEFAULT_SLO.tpot_s && d.terms.local.tpot_s < DEFAULT_SLO.tpot_s);
    assert_eq!((d.choice, d.reason), (Choice::Split, "slo"), "{:?}", d.terms);
    // A longer answer spreads the same prefill thinner: the local streams stay under the target.
    i.expected_output = 64;
    assert!(CostModel.decide(&i).terms.local.meets_slo);
    // ... and on a `both` prefill worker with streams of its own it stays local.
    i.prefill.running = 8;
    assert_eq!(CostModel.decide(&i).choice, Choice::Local);
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

#[test]
fn a_long_prompt_is_priced_by_the_fit_of_its_attention_not_by_the_token_rate() {
    // The reproduction of #65: a CPU worker of `small` measured ~2,200 tokens/s on short prompts, and its fit of
    // 5e-4 s a token and 7e-7 s per unit of attention area; a 14,223-token prompt took about 80 s.
    let cpu = |held: u64, uncached: u64| Side {
        uncached_tokens: uncached,
        held_tokens: held,
        prefill_tokens_per_s: 2_200.0,
        prefill_per_token_s: 5e-4,
        prefill_attention_s: 7e-7,
        decode_step_s: 0.005,
        ..Side::default()
    };
    let mut i = input(14_223, 1, 0.0, GBPS_25);
    (i.local, i.prefill, i.decode) = (cpu(0, 14_223), cpu(0, 14_223), cpu(0, 14_223));
    let t = predict(&i);
    let n = 14_223.0_f64;
    let want = 5e-4 * n + 7e-7 * n * n / 2.0 + 0.005;
    assert!((t.local.ttft_s - want).abs() < 1e-6 && t.local.ttft_s > 70.0, "{} vs {want}", t.local.ttft_s);
    // The rate alone said 6.5 s.
    let rate_only = Side { prefill_per_token_s: 0.0, prefill_attention_s: 0.0, ..cpu(0, 14_223) };
    i.local = rate_only;
    assert!((predict(&i).local.ttft_s - (n / 2_200.0 + 0.005)).abs() < 1e-9);
    // Held tokens are attended to: the last 1,000 tokens after 13,223 held cost their share of the area.
    i.local = cpu(13_223, 1_000);
    let tail = 5e-4 * 1_000.0 + 7e-7 * 1_000.0 * (13_223.0 + 500.0) + 0.005;
    assert!((predict(&i).local.ttft_s - tail).abs() < 1e-9);
    // Hostile fits are bounded: NaN and negatives read as 0 (the rate then prices), infinities are capped.
    i.local = Side { prefill_per_token_s: f64::NAN, prefill_attention_s: -1.0, ..cpu(0, 14_223) };
    assert!((predict(&i).local.ttft_s - (n / 2_200.0 + 0.005)).abs() < 1e-9);
    i.local = Side { prefill_attention_s: f64::INFINITY, ..cpu(0, 14_223) };
    assert!(predict(&i).local.ttft_s.is_finite());
}

#[test]
fn a_workers_own_fit_counts_once_it_has_a_token_rate_and_only_when_sane() {
    use super::cost_model::own_fit;
    assert_eq!(own_fit(1e-3, 1e-7, 900.0), Some((1e-3, 1e-7)));
    assert_eq!(own_fit(0.0, 1e-7, 900.0), Some((0.0, 1e-7)), "an attention term alone is a fit");
    assert_eq!(own_fit(1e-3, 1e-7, 0.0), None, "measured at start only");
    assert_eq!(own_fit(0.0, 0.0, 900.0), None, "no fit");
    for bad in [f64::NAN, f64::INFINITY, -1e-3] {
        assert_eq!(own_fit(bad, 1e-7, 900.0), None, "{bad}");
        assert_eq!(own_fit(1e-3, bad, 900.0), None, "{bad}");
        assert_eq!(own_fit(1e-3, 1e-7, bad), None, "{bad}");
    }
}
