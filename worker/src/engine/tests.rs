//! Engine behaviour: admission, stopping, aborts, preemption and block accounting under random load, and the real
//! CPU model's logits with and without the prefix cache.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use kvgate_shared::hashing::{ExtraKeys, HashScheme};
use kvgate_shared::prompt::SplitMix64;

use super::sim::SimBackend;
use super::*;
use crate::model::llama::LlamaModel;
use crate::model::synth::{synth_model, Preset, SynthSpec};

const BS: u32 = 4;

fn sim_engine(num_blocks: usize, max_batched: usize, max_seqs: usize) -> Engine<SimBackend> {
    let backend = SimBackend::new(1000, 4096, vec![0]);
    let cfg = EngineConfig {
        num_blocks,
        scheme: HashScheme::new(BS, 1),
        scheduler: SchedulerConfig { max_num_batched_tokens: max_batched, max_num_seqs: max_seqs },
    };
    Engine::new(cfg, backend, None)
}

pub(super) fn req(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        id,
        prompt,
        params: SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) },
        extra_keys: ExtraKeys::none(),
        adapter: None,
    }
}

/// Runs until idle; returns each request's output tokens and finish reason.
pub(super) fn drain<B: Backend>(e: &mut Engine<B>) -> HashMap<u64, (Vec<u32>, FinishReason, usize)> {
    let mut out: HashMap<u64, (Vec<u32>, FinishReason, usize)> = HashMap::new();
    let mut steps = 0;
    while e.has_work() {
        for o in e.step() {
            let entry = out.entry(o.id).or_insert_with(|| (Vec::new(), FinishReason::Abort, 0));
            entry.0.extend(o.token);
            entry.2 = o.cached_tokens;
            if let Some(r) = o.finished {
                entry.1 = r;
            }
        }
        steps += 1;
        assert!(steps < 1_000_000, "engine did not drain");
    }
    out
}

#[test]
fn admission_errors() {
    let mut e = sim_engine(8, 64, 4);
    assert_eq!(e.add_request(req(1, vec![], 4)), Err(AdmitError::EmptyPrompt));
    assert_eq!(e.add_request(req(1, vec![5000], 4)), Err(AdmitError::TokenOutOfRange(5000, 1000)));
    assert!(matches!(e.add_request(req(1, vec![1; 4090], 10)), Err(AdmitError::ContextTooLong { .. })));
    assert!(matches!(
        e.add_request(req(1, vec![1; 30], 3)),
        Err(AdmitError::ExceedsKvCapacity { capacity: 32, .. })
    ));
    let mut bad = req(1, vec![1], 4);
    bad.params.top_p = 0.0;
    assert!(matches!(e.add_request(bad), Err(AdmitError::InvalidParam("top_p", _))));
    e.add_request(req(1, vec![1, 2], 4)).expect("ok");
    assert_eq!(e.add_request(req(1, vec![1, 2], 4)), Err(AdmitError::DuplicateId(1)));
}

#[test]
fn stops_on_length_eos_and_stop_ids() {
    let mut e = sim_engine(64, 64, 4);
    e.add_request(req(1, vec![1, 2, 3], 5)).expect("ok");
    let out = drain(&mut e);
    assert_eq!(out[&1].0.len(), 5);
    assert_eq!(out[&1].1, FinishReason::Length);
    // The third token becomes a stop id: generation ends right there.
    let third = out[&1].0[2];
    let mut e = sim_engine(64, 64, 4);
    let mut r = req(2, vec![1, 2, 3], 5);
    r.params.stop_token_ids = vec![third];
    e.add_request(r).expect("ok");
    let out2 = drain(&mut e);
    assert_eq!(out2[&2].0, out[&1].0[..3].to_vec());
    assert_eq!(out2[&2].1, FinishReason::Stop(None));
    assert_eq!(e.stats().blocks_free, 64);
}

#[test]
fn stop_strings_use_the_detokenizer() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 4)).expect("synth");
    let prompter = Arc::new(kvgate_shared::prompt::Prompter::from_dir(dir.path()).expect("prompter"));
    let make = |detok: Option<Arc<dyn Detokenizer>>| {
        let backend = SimBackend::new(500, 4096, vec![]);
        let cfg = EngineConfig {
            num_blocks: 64,
            scheme: HashScheme::new(BS, 1),
            scheduler: SchedulerConfig::default(),
        };
        Engine::new(cfg, backend, detok)
    };
    let mut e = make(Some(prompter.clone()));
    e.add_request(req(1, vec![10, 20, 30], 8)).expect("ok");
    let full = drain(&mut e)[&1].0.clone();
    let text3 = prompter.decode(&full[..3], true).expect("decode");
    let stop: String = prompter.decode(&full[2..3], true).expect("decode");
    assert!(!stop.is_empty());
    let mut e = make(Some(prompter.clone()));
    let mut r = req(2, vec![10, 20, 30], 8);
    r.params.stop = vec![stop.clone()];
    e.add_request(r).expect("ok");
    let out = drain(&mut e);
    let got = prompter.decode(&out[&2].0, true).expect("decode");
    assert!(out[&2].0.len() <= 3, "stopped by the third token ({text3:?})");
    assert!(got.contains(&stop));
    assert_eq!(out[&2].1, FinishReason::Stop(Some(stop)));
}

#[test]
fn abort_frees_blocks_at_once() {
    let mut e = sim_engine(32, 8, 4);
    e.add_request(req(1, (0..40).collect(), 20)).expect("ok");
    e.step();
    assert!(e.stats().blocks_free < 32);
    assert!(e.abort(1));
    assert_eq!(e.stats().blocks_free, 32);
    assert!(!e.has_work());
    assert!(!e.abort(1));
}

#[test]
fn prefix_cache_reports_cached_tokens() {
    let mut e = sim_engine(64, 2048, 8);
    let shared: Vec<u32> = (100..140).collect(); // 10 blocks
    e.add_request(req(1, shared.iter().copied().chain([1, 2, 3]).collect(), 2)).expect("ok");
    drain(&mut e);
    e.add_request(req(2, shared.iter().copied().chain([7, 8]).collect(), 2)).expect("ok");
    let out = drain(&mut e);
    assert_eq!(out[&2].2, 40, "exactly the shared full blocks");
}

#[test]
fn outputs_do_not_depend_on_batching_or_preemption() {
    // Greedy outputs of the deterministic backend: alone vs crowded into a tiny pool that forces preemption.
    let prompts: Vec<Vec<u32>> = (0..12).map(|i| (0..(20 + i * 7)).map(|t| t * 3 + i).collect()).collect();
    let mut alone = HashMap::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut e = sim_engine(256, 2048, 64);
        e.add_request(req(i as u64, p.clone(), 30)).expect("ok");
        alone.insert(i as u64, drain(&mut e).remove(&(i as u64)).expect("out").0);
    }
    let mut e = sim_engine(40, 32, 16);
    for (i, p) in prompts.iter().enumerate() {
        e.add_request(req(i as u64, p.clone(), 30)).expect("ok");
    }
    let crowded = drain(&mut e);
    assert!(e.stats().preemptions > 0, "the test must exercise preemption");
    for (id, toks) in &alone {
        assert_eq!(&crowded[id].0, toks, "request {id}");
    }
    assert_eq!(e.stats().blocks_free, 40);
}

#[test]
fn thousands_of_random_requests_leak_nothing() {
    let mut rng = SplitMix64::new(2026);
    let num_blocks = 96;
    let mut e = sim_engine(num_blocks, 48, 12);
    let prefixes: Vec<Vec<u32>> =
        (0..6).map(|p| (0..(8 + p * 12)).map(|t| (t * 7 + p * 100) % 500).collect()).collect();
    let mut next_id = 0u64;
    let mut live: HashSet<u64> = HashSet::new();
    let mut ended = 0usize;
    let total = 3000u64;
    let mut steps = 0u64;
    while next_id < total || e.has_work() {
        // Arrivals.
        for _ in 0..rng.below(4) {
            if next_id >= total {
                break;
            }
            let base = &prefixes[rng.below(prefixes.len() as u64) as usize];
            let tail = rng.below(40) as u32;
            let prompt: Vec<u32> =
                base.iter().copied().chain((0..tail).map(|t| 500 + t + next_id as u32 % 13)).collect();
            let max_tokens = 1 + rng.below(40) as u32;
            match e.add_request(req(next_id, prompt, max_tokens)) {
                Ok(()) => {
                    live.insert(next_id);
                }
                Err(AdmitError::ExceedsKvCapacity { .. }) => {}
                Err(other) => panic!("unexpected admission error {other}"),
            }
            next_id += 1;
        }
        // Aborts (client gone) of random live requests.
        if rng.below(5) == 0 && !live.is_empty() {
            let victim = *live.iter().nth(rng.below(live.len() as u64) as usize).expect("live");
            assert!(e.abort(victim));
            live.remove(&victim);
            ended += 1;
        }
        for o in e.step() {
            if o.finished.is_some() {
                assert!(live.remove(&o.id), "request {} finished twice", o.id);
                ended += 1;
            }
        }
        e.scheduler().kv().pool().lock().check_invariants().expect("pool invariants every step");
        steps += 1;
        assert!(steps < 2_000_000);
    }
    let s = e.stats();
    assert!(live.is_empty());
    assert!(ended > 2500, "{ended} requests ended");
    assert_eq!(s.blocks_free, num_blocks, "every block is back in the free pool");
    assert!(s.preemptions > 0 && s.evictions > 0 && s.hit_blocks > 0, "{s:?}");
}

/// Logits returned, with the position they follow.
pub(super) type LogitLog = Arc<Mutex<Vec<(usize, Vec<f32>)>>>;

/// A real CPU backend that records the logits it returns.
pub(super) struct Recording {
    inner: CpuBackend,
    log: LogitLog,
}

impl Backend for Recording {
    fn forward(&mut self, items: &[BatchItem<'_>]) -> Result<Vec<Option<Next>>, BackendError> {
        let out = self.inner.forward(items)?;
        let mut log = self.log.lock().expect("log");
        for (it, o) in items.iter().zip(&out) {
            if let Some(Next::Logits(l)) = o {
                log.push((it.start + it.len, l.clone()));
            }
        }
        Ok(out)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_model_len(&self) -> usize {
        self.inner.max_model_len()
    }
    fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.eos_token_ids()
    }
    fn kv_block_bytes(&self, block_size: usize) -> Option<usize> {
        self.inner.kv_block_bytes(block_size)
    }
    fn read_kv_blocks(&mut self, ids: &[u32], block_size: usize) -> Result<Vec<Vec<u8>>, BackendError> {
        self.inner.read_kv_blocks(ids, block_size)
    }
    fn write_kv_blocks(&mut self, blocks: &[(u32, &[u8])], block_size: usize) -> Result<(), BackendError> {
        self.inner.write_kv_blocks(blocks, block_size)
    }
}

fn cpu_engine(dir: &std::path::Path, chunk: usize) -> (Engine<Recording>, LogitLog) {
    cpu_engine_with(dir, chunk, 64)
}

pub(super) fn cpu_engine_with(
    dir: &std::path::Path,
    chunk: usize,
    num_blocks: usize,
) -> (Engine<Recording>, LogitLog) {
    let model = LlamaModel::load(dir).expect("model");
    let log = Arc::new(Mutex::new(Vec::new()));
    let backend = Recording { inner: CpuBackend::new(model, num_blocks * 16), log: log.clone() };
    let cfg = EngineConfig {
        num_blocks,
        scheme: HashScheme::new(16, 9),
        scheduler: SchedulerConfig { max_num_batched_tokens: chunk, max_num_seqs: 8 },
    };
    (Engine::new(cfg, backend, None), log)
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn cached_prefix_gives_the_same_logits_as_computing_it() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 8)).expect("synth");
    let shared: Vec<u32> = (0..70).map(|i| (i * 37 + 11) % 500).collect();
    let b: Vec<u32> = shared.iter().copied().chain([3, 4, 5, 6, 7]).collect();
    // Cold: b alone, chunked by 32.
    let (mut cold, cold_log) = cpu_engine(dir.path(), 32);
    cold.add_request(req(2, b.clone(), 4)).expect("ok");
    let cold_out = drain(&mut cold);
    assert_eq!(cold_out[&2].2, 0);
    // Warm: a first (same 70-token prefix), then b from the cache.
    let (mut warm, warm_log) = cpu_engine(dir.path(), 32);
    warm.add_request(req(1, shared.iter().copied().chain([9]).collect(), 1)).expect("ok");
    drain(&mut warm);
    warm_log.lock().expect("log").clear();
    warm.add_request(req(2, b.clone(), 4)).expect("ok");
    let warm_out = drain(&mut warm);
    assert_eq!(warm_out[&2].2, 64, "four full 16-token blocks of the shared prefix");
    assert_eq!(warm_out[&2].0, cold_out[&2].0);
    let (cold_log, warm_log) = (cold_log.lock().expect("log"), warm_log.lock().expect("log"));
    assert_eq!(cold_log.len(), 4);
    assert_eq!(warm_log.len(), 4);
    for (c, w) in cold_log.iter().zip(warm_log.iter()) {
        assert_eq!(c.0, w.0);
        let e = rel_err(&w.1, &c.1);
        assert!(e <= 1e-4, "position {}: relative error {e:e}", c.0);
    }
}

#[test]
fn a_request_alone_equals_it_inside_a_batch() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 9)).expect("synth");
    let target: Vec<u32> = (0..45).map(|i| (i * 13 + 1) % 500).collect();
    let (mut alone, alone_log) = cpu_engine(dir.path(), 2048);
    alone.add_request(req(7, target.clone(), 3)).expect("ok");
    let a = drain(&mut alone);
    let (mut batch, batch_log) = cpu_engine(dir.path(), 2048);
    for (id, n) in [(1u64, 30usize), (2, 90), (3, 5)] {
        batch
            .add_request(req(id, (0..n as u32).map(|i| (i * 7 + id as u32) % 500).collect(), 3))
            .expect("ok");
    }
    batch.add_request(req(7, target.clone(), 3)).expect("ok");
    let b = drain(&mut batch);
    assert_eq!(a[&7].0, b[&7].0);
    // Compare the target's logits (its positions are 45, 46, 47; the others never reach 45 with these lengths
    // except request 2, whose positions are 90+, and request 1 ends at 33).
    let pick = |log: &[(usize, Vec<f32>)]| -> Vec<Vec<f32>> {
        log.iter().filter(|(p, _)| (45..48).contains(p)).map(|(_, l)| l.clone()).collect()
    };
    let (al, bl) = (pick(&alone_log.lock().expect("l")), pick(&batch_log.lock().expect("l")));
    assert_eq!(al.len(), 3);
    assert_eq!(bl.len(), 3);
    for (x, y) in al.iter().zip(&bl) {
        assert!(rel_err(y, x) <= 1e-4);
    }
}

#[test]
fn the_load_signal_counts_running_prefill_and_not_what_is_cached() {
    // Chunks of 16 tokens, room for two sequences.
    let mut e = sim_engine(256, 16, 2);
    let prompt: Vec<u32> = (0..100).map(|i| i % 900 + 1).collect();
    e.add_request(req(1, prompt.clone(), 2)).expect("admit");
    assert_eq!(e.stats().prefill_tokens, 100, "waiting, nothing cached");
    // Its attention area: 100 tokens from context 0 = 100 x 50.
    assert_eq!(e.stats().prefill_area, 100 * 50);
    e.step();
    // Running, one 16-token chunk done: its remaining prompt still counts (it used to count as one request only).
    assert_eq!(e.stats().prefill_tokens, 84);
    // 84 tokens after 16 computed; the step's chunk was 16 tokens from 0.
    assert_eq!(e.stats().prefill_area, 84 * (16 + 42));
    assert_eq!(e.scheduler().counters().prefill_area, 16 * 8);
    drain(&mut e);
    assert_eq!((e.stats().prefill_tokens, e.stats().prefill_area), (0, 0));
    // Every prompt chunk's area was counted once: the whole prompt's, 100 x 50.
    assert_eq!(e.scheduler().counters().prefill_area, 100 * 50);
    // The same prompt again with a new tail: its cached whole blocks (all 100 tokens: 25 blocks of 4) do not count.
    let mut again = prompt.clone();
    again.extend([7, 8, 9, 10]);
    e.add_request(req(2, again, 2)).expect("admit");
    assert_eq!(e.stats().prefill_tokens, 104 - 100);
    assert_eq!(e.stats().prefill_area, 4 * (100 + 2), "after what the cache holds");
    drain(&mut e);
    // Decoding sequences add nothing to the prefill figure.
    e.add_request(req(3, vec![5, 6, 7], 50)).expect("admit");
    e.step();
    e.step();
    assert_eq!((e.stats().prefill_tokens, e.stats().running_requests), (0, 1));
}
