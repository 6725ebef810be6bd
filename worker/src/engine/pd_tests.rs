//! The hand-off inside engines, on the real CPU model: a prompt exported by one engine and imported by another
//! decodes exactly like a local run, with bit-identical blocks, and only the blocks the importer lacks travel.

use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};

use super::tests::{drain, req};
use super::*;
use crate::model::llama::LlamaModel;
use crate::model::synth::{synth_model, Preset, SynthSpec};

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    let model = LlamaModel::load(dir).expect("model");
    let cfg = EngineConfig {
        num_blocks: 64,
        scheme: HashScheme::new(16, 9),
        scheduler: SchedulerConfig { max_num_batched_tokens: 32, max_num_seqs: 8 },
    };
    Engine::new(cfg, CpuBackend::new(model, 64 * 16), None)
}

fn prompt() -> Vec<u32> {
    (0..150).map(|i| (i * 37 + 11) % 500).collect()
}

/// A tiny model, the prompt, and what a local run of it with `max_tokens` generates.
fn setup(max_tokens: u32) -> (tempfile::TempDir, Vec<u32>, Engine<CpuBackend>, Vec<u32>) {
    let dir = tempfile::tempdir().expect("tmp");
    synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 8)).expect("synth");
    let prompt = prompt();
    let mut local = engine(dir.path());
    local.add_request(req(1, prompt.clone(), max_tokens)).expect("ok");
    let want = drain(&mut local).remove(&1).expect("local").0;
    (dir, prompt, local, want)
}

/// The K/V bytes of the cached full blocks of `tokens`, by hash.
fn cached_bytes(e: &mut Engine<CpuBackend>, tokens: &[u32]) -> Vec<Vec<u8>> {
    let hasher = BlockHasher::new(&HashScheme::new(16, 9), &ExtraKeys::none());
    let ids: Vec<u32> = {
        let pool = e.scheduler().kv().pool().lock();
        hasher.hash_blocks(tokens).iter().map(|h| pool.block_of(*h).expect("cached")).collect()
    };
    e.backend_mut().read_kv_blocks(&ids, 16).expect("read")
}

/// Exports `prompt` from `from_block` (every `group` layers): the chunks, the first token, cached tokens.
fn export(p: &mut Engine<CpuBackend>, prompt: &[u32], from_block: usize) -> (Vec<KvChunk>, u32, usize) {
    export_by(p, prompt, from_block, 0)
}

fn export_by(
    p: &mut Engine<CpuBackend>,
    prompt: &[u32],
    from_block: usize,
    group: usize,
) -> (Vec<KvChunk>, u32, usize) {
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let g = got.clone();
    let backlog = std::sync::Arc::new(super::request::ExportBacklog::new(usize::MAX));
    let sink = ExportSink::new(std::sync::Arc::new(move |kv| g.lock().expect("sink").push(kv)), backlog);
    p.add_export(req(100, prompt.to_vec(), 1), from_block, group, sink).expect("export");
    let (mut first, mut cached) = (None, 0);
    while p.has_work() {
        for o in p.step() {
            if o.token.is_some() {
                first = o.token;
                cached = o.cached_tokens;
                assert_eq!(o.finished, Some(FinishReason::Length));
            }
        }
    }
    let chunks = std::mem::take(&mut *got.lock().expect("sink"));
    (chunks, first.expect("a first token"), cached)
}

fn import(d: &mut Engine<CpuBackend>, id: u64, chunks: &[KvChunk], first: u32, cached: usize) -> Vec<u32> {
    for c in chunks {
        d.write_import(id, c.first, c.count, c.layers.clone(), &c.bytes).expect("write");
    }
    let o = d.finish_import(id, first, cached).expect("finish");
    assert_eq!(o.token, Some(first));
    let mut out = vec![first];
    out.extend(drain(d).remove(&id).map(|r| r.0).unwrap_or_default());
    out
}

#[test]
fn an_imported_prompt_decodes_like_a_local_run_with_bit_identical_blocks() {
    let (dir, prompt, mut local, want) = setup(8);
    let (mut p, mut d) = (engine(dir.path()), engine(dir.path()));
    let free = d.stats().blocks_free;
    let plan = d.start_import(req(2, prompt.clone(), 8)).expect("import");
    assert_eq!(plan, ImportPlan { from_block: 0, blocks: 10, cached_tokens: 0 });
    assert_eq!(d.stats().blocks_free, free - 10, "the prompt's blocks and the first token's are held");
    let (chunks, first, cached) = export(&mut p, &prompt, plan.from_block);
    // One chunk per 32-token prefill step (two blocks each), the last with the partial block.
    assert_eq!(chunks.iter().map(|c| c.count).sum::<usize>(), 10);
    assert!(chunks.len() >= 4, "blocks leave as each chunk fills them: {}", chunks.len());
    assert_eq!(cached, 0);
    let got = import(&mut d, 2, &chunks, first, cached);
    assert_eq!(got, want, "greedy output identical to the local run");
    assert_eq!(cached_bytes(&mut d, &prompt), cached_bytes(&mut local, &prompt), "K/V bit-identical");
    // The imported prompt is in the decode engine's prefix cache: its next turn hits there.
    d.add_request(req(3, prompt.iter().copied().chain([1, 2]).collect(), 1)).expect("ok");
    assert_eq!(drain(&mut d)[&3].2, 144);
}

#[test]
fn a_full_export_backlog_holds_the_prefill_until_the_link_drains_it() {
    let (dir, prompt, _local, _want) = setup(1);
    let mut p = engine(dir.path());
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::<KvChunk>::new()));
    let g = got.clone();
    // Bound: one byte, so every step's chunk fills it.
    let backlog = std::sync::Arc::new(super::request::ExportBacklog::new(1));
    let sink =
        ExportSink::new(std::sync::Arc::new(move |kv| g.lock().expect("sink").push(kv)), backlog.clone());
    p.add_export(req(100, prompt.clone(), 1), 0, 0, sink).expect("export");
    assert!(p.step().is_empty(), "the first chunk computes");
    let after_one = got.lock().expect("sink").len();
    assert_eq!(after_one, 1);
    let computed = p.scheduler().counters().scheduled_tokens;
    for _ in 0..3 {
        assert!(p.step().is_empty());
    }
    assert_eq!(got.lock().expect("sink").len(), 1, "nothing more is exported while the backlog is full");
    assert_eq!(p.scheduler().counters().scheduled_tokens, computed, "and nothing is computed for it");
    assert_eq!(p.scheduler().counters().export_holds, 3);
    // The link sends what it held: the prefill goes on, to its first token.
    let mut first = None;
    while p.has_work() {
        let bytes = backlog.bytes();
        backlog.sent(bytes);
        for o in p.step() {
            first = first.or(o.token);
        }
    }
    assert!(first.is_some());
    assert_eq!(got.lock().expect("sink").iter().map(|c| c.count).sum::<usize>(), prompt.len().div_ceil(16));
}

#[test]
fn only_the_blocks_the_importer_lacks_travel() {
    let (dir, prompt, _local, want) = setup(6);
    let (mut p, mut d) = (engine(dir.path()), engine(dir.path()));
    // The decode engine saw the first 64 tokens; the prefill engine saw the first 100.
    d.add_request(req(5, prompt[..64].iter().copied().chain([7]).collect(), 1)).expect("ok");
    p.add_request(req(6, prompt[..100].to_vec(), 1)).expect("ok");
    drain(&mut d);
    drain(&mut p);
    let plan = d.start_import(req(2, prompt.clone(), 6)).expect("import");
    assert_eq!((plan.from_block, plan.cached_tokens), (4, 64));
    let (chunks, first, cached) = export(&mut p, &prompt, plan.from_block);
    assert_eq!(chunks.iter().map(|c| c.count).sum::<usize>(), 6, "blocks 4..10 only");
    assert_eq!(chunks[0].first, 4);
    assert_eq!(cached, 96, "the prefill engine computed only what its own cache lacked");
    assert_eq!(import(&mut d, 2, &chunks, first, cached), want);
}

#[test]
fn bad_writes_are_refused_and_every_ending_frees_the_blocks() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 8)).expect("synth");
    let prompt = prompt();
    let mut d = engine(dir.path());
    let free = d.stats().blocks_free;
    let per = d.backend().kv_block_bytes(16).expect("bytes");
    let layers = d.backend().kv_layers();
    d.start_import(req(2, prompt.clone(), 4)).expect("import");
    assert!(d.write_import(2, 0, 1, 0..layers, &vec![0; per - 1]).is_err(), "short payload");
    assert!(d.write_import(2, 9, 2, 0..layers, &vec![0; 2 * per]).is_err(), "past the prompt");
    assert!(d.write_import(2, 0, 1, 0..layers + 1, &vec![0; per]).is_err(), "past the layers");
    assert!(d.write_import(7, 0, 1, 0..layers, &vec![0; per]).is_err(), "unknown request");
    d.write_import(2, 0, 1, 0..1, &vec![0; per / layers]).expect("one layer of one block");
    assert!(d.write_import(2, 0, 1, 0..1, &vec![0; per / layers]).is_err(), "repeated");
    assert!(d.finish_import(2, 5, 0).is_err(), "blocks are missing");
    assert!(d.abort(2));
    assert_eq!(d.stats().blocks_free, free, "abort frees every block");
    assert_eq!(d.stats().importing_requests, 0);
    // No room: more blocks than the pool has free is refused holding nothing.
    let long = |k: u32| (0..600).map(|i| (i + k) % 500).collect::<Vec<u32>>();
    d.start_import(req(8, long(0), 1)).expect("38 of 64 blocks");
    let held = d.stats().blocks_free;
    assert!(matches!(d.start_import(req(3, long(1), 1)), Err(AdmitError::NoRoom(_))));
    assert_eq!(d.stats().blocks_free, held, "a refused import holds nothing");
    assert!(d.abort(8));
    assert_eq!(d.stats().blocks_free, free);
    // A failed transfer falls back to computing here, with the local result.
    let mut local = engine(dir.path());
    local.add_request(req(1, prompt.clone(), 4)).expect("ok");
    let want = drain(&mut local).remove(&1).expect("local").0;
    d.start_import(req(4, prompt.clone(), 4)).expect("import");
    // One layer of a block is not a block: nothing of it is kept.
    d.write_import(4, 0, 1, 0..1, &vec![0; per / layers]).expect("garbage that must not survive");
    assert_eq!(d.import_to_local(4), Some(0));
    assert_eq!(drain(&mut d).remove(&4).expect("ran").0, want);
    assert_eq!(d.stats().blocks_free, free, "every block is free again (cached or not)");
}

#[test]
fn layer_groups_leave_during_the_forward_and_import_like_whole_blocks() {
    let (dir, prompt, mut local, want) = setup(8);
    let (mut p, mut d) = (engine(dir.path()), engine(dir.path()));
    let plan = d.start_import(req(2, prompt.clone(), 8)).expect("import");
    let (chunks, first, cached) = export_by(&mut p, &prompt, plan.from_block, 1);
    // The tiny model has 2 layers: each prefill chunk's blocks leave as two one-layer parts.
    assert!(
        chunks.iter().all(|c| c.layers.len() == 1),
        "{:?}",
        chunks.iter().map(|c| c.layers.clone()).collect::<Vec<_>>()
    );
    assert_eq!(chunks.iter().filter(|c| c.layers == (0..1)).map(|c| c.count).sum::<usize>(), 10);
    assert_eq!(import(&mut d, 2, &chunks, first, cached), want);
    assert_eq!(cached_bytes(&mut d, &prompt), cached_bytes(&mut local, &prompt), "K/V bit-identical");
}

#[test]
fn a_fallback_keeps_the_whole_blocks_that_arrived_and_computes_only_the_rest() {
    let (dir, prompt, _, want) = setup(8);
    let (mut p, mut d) = (engine(dir.path()), engine(dir.path()));
    let free = d.stats().blocks_free;
    let plan = d.start_import(req(2, prompt.clone(), 8)).expect("import");
    let (chunks, _, _) = export(&mut p, &prompt, plan.from_block);
    // The first two chunks arrive (blocks 0..4), then one layer of the next: the transfer then fails.
    for c in &chunks[..2] {
        d.write_import(2, c.first, c.count, c.layers.clone(), &c.bytes).expect("write");
    }
    let c = &chunks[2];
    let one_layer = c.bytes.len() / c.count / 2;
    d.write_import(2, c.first, 1, 0..1, &c.bytes[..one_layer]).expect("one layer");
    assert_eq!((chunks[0].first, chunks[1].first + chunks[1].count), (0, 4));
    assert_eq!(d.import_to_local(2), Some(4 * 16), "blocks 0..4 kept");
    assert!(d.import_to_local(2).is_none(), "no longer importing");
    let (tokens, _, cached) = drain(&mut d).remove(&2).expect("ran");
    assert_eq!(tokens, want, "the kept blocks are the prompt's KV");
    assert_eq!(cached, 4 * 16, "served from the kept blocks");
    assert_eq!(d.stats().blocks_free, free);
}

#[test]
fn each_step_of_an_export_is_announced_with_what_the_fit_expects_it_to_take() {
    let (dir, prompt, _, _) = setup(1);
    let mut p = engine(dir.path());
    p.set_prefill_cost(1e-3, 0.0);
    let (tx, rx) = tokio::sync::watch::channel(ExportProgress::default());
    let backlog = std::sync::Arc::new(super::request::ExportBacklog::new(usize::MAX));
    let sink = ExportSink::new(std::sync::Arc::new(|_| {}), backlog).with_progress(tx);
    p.add_export(req(100, prompt.clone(), 1), 0, 0, sink).expect("export");
    let mut seen = Vec::new();
    while p.has_work() {
        p.step();
        let a = *rx.borrow();
        seen.push((a.computed, a.through, (a.eta_s * 1e6).round() as u64));
    }
    // Chunks of 32 tokens (the engine's budget), the last one short; 1 ms a token.
    let want: Vec<(usize, usize, u64)> =
        (0..150).step_by(32).map(|s| (s, (s + 32).min(150), ((s + 32).min(150) - s) as u64 * 1000)).collect();
    assert_eq!(seen, want);
    // With an attention term, a step at a longer context is expected to take longer.
    p.set_prefill_cost(0.0, 1e-6);
    let (tx, rx) = tokio::sync::watch::channel(ExportProgress::default());
    let backlog = std::sync::Arc::new(super::request::ExportBacklog::new(usize::MAX));
    let sink = ExportSink::new(std::sync::Arc::new(|_| {}), backlog).with_progress(tx);
    let other: Vec<u32> = prompt.iter().map(|t| (t + 1) % 500).collect();
    p.add_export(req(101, other, 1), 0, 0, sink).expect("export");
    p.step();
    let first = rx.borrow().eta_s;
    p.step();
    let second = rx.borrow().eta_s;
    assert!(
        (first - 1e-6 * 32.0 * 16.0).abs() < 1e-12 && (second - 1e-6 * 32.0 * 48.0).abs() < 1e-12,
        "{first} {second}"
    );
}
