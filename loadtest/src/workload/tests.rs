//! Workload generators: determinism and shapes.

use std::collections::HashMap;

use super::long_burst::LongBurst;
use super::multi_turn::MultiTurn;
use super::shared_prefix::SharedPrefix;
use super::*;
use crate::trace::Trace;

fn singles(p: &Plan) -> Vec<&Single> {
    p.jobs
        .iter()
        .map(|j| match j {
            Job::Single(s) => s,
            Job::Session(_) => panic!("expected singles"),
        })
        .collect()
}

#[test]
fn poisson_arrivals_have_the_asked_rate_and_are_seeded() {
    let mut rng = SplitMix64::new(7);
    let t = poisson_times(20_000, 50.0, &mut rng);
    assert!(t.windows(2).all(|w| w[0] <= w[1]));
    let rate = t.len() as f64 / t[t.len() - 1];
    assert!((rate - 50.0).abs() < 2.0, "{rate}");
    assert_eq!(
        poisson_times(5, 3.0, &mut SplitMix64::new(1)),
        poisson_times(5, 3.0, &mut SplitMix64::new(1))
    );
    assert_eq!(poisson_times(3, f64::INFINITY, &mut SplitMix64::new(1)), vec![0.0; 3]);
}

#[test]
fn shared_prefix_groups_share_exactly_their_system_prompt() {
    let shape = SharedPrefix {
        groups: 4,
        prompts_per_group: 3,
        system_tokens: 100,
        question_tokens: 10,
        output_tokens: 8,
    };
    let p = shape.plan(10.0, 1000, 42);
    assert_eq!(p, shape.plan(10.0, 1000, 42), "seeded");
    assert_ne!(p, shape.plan(10.0, 1000, 43));
    let s = singles(&p);
    assert_eq!(s.len(), 12);
    let mut by_group: HashMap<&str, Vec<&Single>> = HashMap::new();
    for r in &s {
        assert_eq!((r.prompt.len(), r.max_tokens), (110, 8));
        assert!(r.prompt.iter().all(|t| *t < 1000));
        by_group.entry(&r.tag).or_default().push(r);
    }
    assert_eq!(by_group.len(), 4);
    let firsts: Vec<&[u32]> = by_group.values().map(|g| &g[0].prompt[..100]).collect();
    for g in by_group.values() {
        assert!(g.iter().all(|r| r.prompt[..100] == g[0].prompt[..100]));
        assert_ne!(g[0].prompt[100..], g[1].prompt[100..]);
    }
    assert!(firsts.iter().enumerate().all(|(i, a)| firsts[i + 1..].iter().all(|b| a != b)));
    // Shuffled across groups, arriving in order.
    assert!(s.windows(2).all(|w| w[0].at_s <= w[1].at_s));
    assert!(s.windows(3).any(|w| w[0].tag != w[1].tag || w[1].tag != w[2].tag));
    let d = SharedPrefix::default();
    assert_eq!(
        (d.groups, d.prompts_per_group, d.system_tokens, d.question_tokens, d.output_tokens),
        (64, 16, 2048, 128, 256)
    );
}

#[test]
fn long_burst_mixes_steady_short_requests_with_bursts_of_long_ones() {
    let shape = LongBurst {
        duration_s: 20.0,
        short_tokens: 50,
        long_tokens: 5000,
        burst_every_s: 10.0,
        burst_size: 3,
        output_tokens: 4,
    };
    let p = shape.plan(5.0, 500, 1);
    assert_eq!(p, shape.plan(5.0, 500, 1));
    let s = singles(&p);
    let long: Vec<_> = s.iter().filter(|r| r.tag == "long").collect();
    let short: Vec<_> = s.iter().filter(|r| r.tag == "short").collect();
    assert_eq!(long.len(), 6, "two bursts of three");
    assert!(long.iter().all(|r| r.prompt.len() == 5000 && (r.at_s == 5.0 || r.at_s == 15.0)));
    assert!(short.iter().all(|r| r.prompt.len() == 50 && r.at_s < 20.0));
    assert!((60..=140).contains(&short.len()), "about 5/s for 20 s: {}", short.len());
    assert!(s.windows(2).all(|w| w[0].at_s <= w[1].at_s));
}

#[test]
fn multi_turn_sessions_share_the_system_prompt_and_grow() {
    let shape =
        MultiTurn { users: 3, turns: 4, system_words: 50, question_words: 8, output_tokens: 5, think_s: 2.0 };
    let p = shape.plan(1.0, 9);
    assert_eq!(p, shape.plan(1.0, 9));
    assert_eq!(p.requests(), 12);
    let sessions: Vec<&Session> = p
        .jobs
        .iter()
        .map(|j| match j {
            Job::Session(s) => s,
            Job::Single(_) => panic!("expected sessions"),
        })
        .collect();
    assert!(sessions.iter().all(|s| s.system == sessions[0].system && s.questions.len() == 4));
    assert!(sessions[0].system.split_whitespace().count() >= 40);
    assert_ne!(sessions[0].questions, sessions[1].questions);
    assert_ne!(sessions[0].user, sessions[1].user);
    assert!(sessions.iter().all(|s| s.think_s.len() == 4 && s.think_s.iter().all(|t| *t >= 0.0)));
}

#[test]
fn mooncake_plan_follows_the_trace() {
    let t = Trace::parse(
        "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 0, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 3000, \"input_length\": 700, \"output_length\": 9, \"hash_ids\": [1, 3]}",
    )
    .expect("trace");
    let p = mooncake::plan(&t, 0.5, 300);
    let s = singles(&p);
    assert_eq!((s[0].at_s, s[1].at_s), (0.0, 1.0));
    assert_eq!((s[0].prompt.len(), s[1].prompt.len()), (600, 700));
    assert_eq!((s[0].max_tokens, s[1].max_tokens), (1, 9));
    assert_eq!(s[0].prompt[..512], s[1].prompt[..512]);
}
