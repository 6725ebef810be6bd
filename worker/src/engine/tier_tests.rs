//! The host DRAM tier under the engine: write-back at eviction, promotion on a prefix hit, bit-exact round trips
//! on the real CPU model, and bounded, leak-free accounting under a random eviction storm.

use std::collections::HashSet;

use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::prompt::SplitMix64;

use super::sim::SimBackend;
use super::tests::{cpu_engine_with, drain, req, LogitLog, Recording};
use super::*;
use crate::kv::{chain_check, LoadCosts, LoadPolicy, WritePolicy};
use crate::model::synth::{synth_model, Preset, SynthSpec};

/// The K/V bytes the engine's device pool holds for each of `hashes` (all must be cached).
fn device_bytes(e: &mut Engine<Recording>, hashes: &[kvgate_shared::hashing::BlockHash]) -> Vec<Vec<u8>> {
    let ids: Vec<u32> = {
        let pool = e.scheduler().kv().pool().lock();
        hashes.iter().map(|h| pool.block_of(*h).expect("cached on the device")).collect()
    };
    e.backend_mut().read_kv_blocks(&ids, 16).expect("read")
}

fn last_logits(log: &LogitLog) -> Vec<f32> {
    log.lock().expect("log").last().expect("logits").1.clone()
}

/// The round-trip scenario on the tiny CPU model: prompt `a` caches a 64-token prefix that `b` shares; a reference
/// engine with a 16-block pool and no tier gives `b`'s tokens, its last logits and the prefix's device bytes.
struct RoundTrip {
    dir: tempfile::TempDir,
    shared: Vec<u32>,
    a: Vec<u32>,
    b: Vec<u32>,
    prefix: Vec<kvgate_shared::hashing::BlockHash>,
    hasher: BlockHasher,
    tokens: Vec<u32>,
    logits: Vec<f32>,
    device: Vec<Vec<u8>>,
}

fn round_trip() -> RoundTrip {
    let dir = tempfile::tempdir().expect("tmp");
    synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 8)).expect("synth");
    let shared: Vec<u32> = (0..70).map(|i| (i * 37 + 11) % 500).collect();
    let a: Vec<u32> = shared.iter().copied().chain([9]).collect();
    let b: Vec<u32> = shared.iter().copied().chain([3, 4, 5, 6, 7]).collect();
    let hasher = BlockHasher::new(&HashScheme::new(16, 9), &ExtraKeys::none());
    let prefix = hasher.hash_blocks(&shared[..64]);
    let (mut x, x_log) = cpu_engine_with(dir.path(), 32, 16);
    x.add_request(req(1, a.clone(), 1)).expect("ok");
    drain(&mut x);
    let device = device_bytes(&mut x, &prefix);
    x.add_request(req(2, b.clone(), 4)).expect("ok");
    let out = drain(&mut x);
    assert_eq!(out[&2].2, 64, "the reference finds the prefix on the device");
    let tokens = out[&2].0.clone();
    RoundTrip { dir, shared, a, b, prefix, hasher, tokens, logits: last_logits(&x_log), device }
}

/// Runs `a`, then four unrelated 200-token prompts that push every block of `a` out of a 16-block pool.
fn a_then_flood(e: &mut Engine<Recording>, a: &[u32]) {
    e.add_request(req(1, a.to_vec(), 1)).expect("ok");
    drain(e);
    for k in 0..4u64 {
        let other: Vec<u32> = (0..200).map(|i| (i * 7 + 100 * k as u32 + 1) % 500).collect();
        e.add_request(req(10 + k, other, 1)).expect("ok");
        drain(e);
    }
}

#[test]
fn blocks_go_down_to_host_and_come_back_bit_exact() {
    let RoundTrip { dir, shared, a, b, prefix, hasher, tokens, logits: x_logits, device } = round_trip();
    // The same with a host tier, and other prompts in between that evict every block of a from the pool.
    let (y, y_log) = cpu_engine_with(dir.path(), 32, 16);
    let block_bytes = y.backend().kv_block_bytes(16).expect("cpu copies blocks");
    let mut y = y.with_host_tier(64 * block_bytes, WritePolicy::WriteBack).expect("host tier");
    a_then_flood(&mut y, &a);
    {
        let pool = y.scheduler().kv().pool().lock();
        assert!(prefix.iter().all(|h| pool.block_of(*h).is_none()), "a's blocks left the device pool");
    }
    let host = y.scheduler().kv().host().expect("host").clone();
    let mut check = hasher.root_id();
    for (i, h) in prefix.iter().enumerate() {
        check = chain_check(check, &shared[i * 16..(i + 1) * 16]);
        let payload =
            host.lock().get(*h, check, i as u32, &shared[i * 16..(i + 1) * 16]).expect("kept in host");
        assert_eq!(&*payload, &device[i][..], "block {i}: host bytes = the device's");
    }
    y_log.lock().expect("log").clear();
    y.add_request(req(2, b.clone(), 4)).expect("ok");
    let y_out = drain(&mut y);
    assert_eq!(y_out[&2].2, 64, "the prefix came back from host DRAM");
    assert_eq!(y_out[&2].0, tokens, "same tokens");
    assert_eq!(last_logits(&y_log), x_logits, "identical logits, bit for bit");
    assert_eq!(device_bytes(&mut y, &prefix), device, "device -> host -> device: identical K/V bytes");
    let s = y.stats();
    assert!(s.host.stored_blocks >= 4 && s.host.hit_blocks >= 4, "{s:?}");
    y.scheduler().kv().pool().lock().check_invariants().expect("pool");
}

#[test]
fn an_eviction_storm_keeps_the_tiers_bounded_and_leaks_nothing() {
    const BS: u32 = 4;
    let num_blocks = 48;
    let backend = SimBackend::new(1000, 4096, vec![0]);
    let cfg = EngineConfig {
        num_blocks,
        scheme: HashScheme::new(BS, 1),
        scheduler: SchedulerConfig { max_num_batched_tokens: 64, max_num_seqs: 8 },
    };
    let block_bytes = backend.kv_block_bytes(BS as usize).expect("sim");
    let host_blocks = 100;
    // An SSD tier of about 150 blocks (record bytes: header + tokens + the nominal payload).
    let ssd = tempfile::tempdir().expect("ssd");
    let disk_blocks = 150;
    let mut e = Engine::new(cfg, backend, None)
        .with_host_tier(host_blocks * block_bytes, WritePolicy::WriteBack)
        .expect("tier")
        .with_disk_tier(ssd.path(), (disk_blocks * (block_bytes + 200)) as u64, WritePolicy::WriteBack, 0)
        .expect("disk");
    let mut rng = SplitMix64::new(7);
    let mut live: HashSet<u64> = HashSet::new();
    let mut host_served = 0;
    for id in 0..3000u64 {
        // 12 families of prompts sharing 8..40-token prefixes, varied tails.
        let family = rng.next_u64() % 12;
        let shared = 8 + (family as usize % 5) * 8;
        let mut p: Vec<u32> = (0..shared as u32).map(|i| (family as u32 * 97 + i * 13) % 997 + 1).collect();
        let tail = 1 + (rng.next_u64() % 20) as usize;
        p.extend((0..tail).map(|_| (rng.next_u64() % 997) as u32 + 1));
        if e.add_request(req(id, p, 1 + (rng.next_u64() % 6) as u32)).is_ok() {
            live.insert(id);
        }
        if rng.next_u64().is_multiple_of(9) {
            if let Some(&victim) = live.iter().next() {
                e.abort(victim);
                live.remove(&victim);
            }
        }
        for _ in 0..(rng.next_u64() % 3) {
            for o in e.step() {
                if o.finished.is_some() {
                    live.remove(&o.id);
                }
            }
        }
        let kv = e.scheduler().kv();
        let host = kv.host().expect("host").lock();
        assert!(host.len() <= host_blocks, "host tier over capacity: {}", host.len());
        if id % 250 == 0 {
            let pool = kv.pool().lock();
            host.check_invariants(|h| pool.is_cached(h)).expect("host invariants");
            pool.check_invariants().expect("pool invariants");
        }
        host_served = host.counters().hit_blocks;
    }
    while e.has_work() {
        e.step();
    }
    e.scheduler().kv().disk().expect("disk").flush();
    let s = e.stats();
    assert_eq!(s.blocks_free, num_blocks, "every block is back in the free pool");
    assert!(s.evictions > 0 && host_served > 0 && s.host.evicted_blocks > 0, "{s:?}");
    assert!(s.disk.written_blocks > 0 && s.disk_blocks_cached <= s.disk_blocks_total, "{s:?}");
    assert!(s.disk_blocks_total <= disk_blocks, "{s:?}");
    assert!(s.disk.read_blocks > 0 && s.disk.corrupt_blocks == 0, "{:?}", s.disk);
    let kv = e.scheduler().kv();
    let pool = kv.pool().lock();
    kv.host().expect("host").lock().check_invariants(|h| pool.is_cached(h)).expect("host invariants");
    pool.check_invariants().expect("pool invariants");
}

#[test]
fn write_through_copies_every_completed_block_and_write_back_only_what_leaves_the_pool() {
    const BS: u32 = 4;
    let run = |policy: WritePolicy| {
        let backend = SimBackend::new(1000, 4096, vec![0]);
        let block_bytes = backend.kv_block_bytes(BS as usize).expect("sim");
        let cfg = EngineConfig {
            num_blocks: 32,
            scheme: HashScheme::new(BS, 1),
            scheduler: SchedulerConfig { max_num_batched_tokens: 64, max_num_seqs: 4 },
        };
        let mut e = Engine::new(cfg, backend, None).with_host_tier(256 * block_bytes, policy).expect("tier");
        // A conversation that comes back every few requests (stays on the device) and one-off prompts around it.
        let mut history: Vec<u32> = (1..=24).collect();
        let mut served = Vec::new();
        for id in 0..40u64 {
            let prompt = if id % 4 == 0 {
                history.extend((0..8).map(|i| (id as u32 * 8 + i) % 900 + 1));
                history.clone()
            } else {
                (0..40).map(|i| (id as u32 * 41 + i * 3) % 900 + 1).collect()
            };
            e.add_request(req(id, prompt, 2)).expect("ok");
            let out = drain(&mut e);
            served.push(out[&id].2);
        }
        (e.stats(), served)
    };
    let (back, back_cached) = run(WritePolicy::WriteBack);
    let (through, through_cached) = run(WritePolicy::WriteThrough);
    assert_eq!(back_cached, through_cached, "both serve the same prefixes");
    assert!(back.host.stored_blocks > 0, "{back:?}");
    // Write-back skips what never leaves the pool (here the conversation that keeps coming back): fewer bytes.
    let (b, t) = (back.host.stored_blocks, through.host.stored_blocks);
    assert!(b < t, "write-back {b} blocks vs write-through {t}");
    assert!(
        through.host.stored_blocks >= back.host.stored_blocks + 8,
        "the hot conversation's blocks at least"
    );
}

#[test]
fn blocks_come_back_from_ssd_bit_exact_and_after_a_restart() {
    let RoundTrip { dir, a, b, prefix, tokens, logits: x_logits, device, .. } = round_trip();
    let ssd = tempfile::tempdir().expect("ssd");
    // No host tier: what the pool evicts goes straight to the SSD tier (write-back).
    let (y, y_log) = cpu_engine_with(dir.path(), 32, 16);
    let mut y = y.with_disk_tier(ssd.path(), 64 << 20, WritePolicy::WriteBack, 0).expect("disk tier");
    a_then_flood(&mut y, &a);
    y.scheduler().kv().disk().expect("disk").flush();
    y_log.lock().expect("log").clear();
    y.add_request(req(2, b.clone(), 4)).expect("ok");
    let y_out = drain(&mut y);
    assert_eq!(y_out[&2].2, 64, "the prefix came back from the SSD tier");
    assert_eq!(y_out[&2].0, tokens);
    assert_eq!(last_logits(&y_log), x_logits, "identical logits, bit for bit");
    assert_eq!(device_bytes(&mut y, &prefix), device, "device -> SSD -> device: identical K/V bytes");
    assert!(y.stats().disk.read_blocks >= 4, "{:?}", y.stats().disk);
    drop(y);

    // A new engine on the same directory (a restarted worker) serves the prefix from its first request.
    let (z, z_log) = cpu_engine_with(dir.path(), 32, 16);
    let mut z = z.with_disk_tier(ssd.path(), 64 << 20, WritePolicy::WriteBack, 0).expect("disk tier");
    assert!(z.stats().disk.recovered_blocks >= 4, "{:?}", z.stats().disk);
    z.add_request(req(2, b.clone(), 4)).expect("ok");
    // The queued request's prefix is read ahead by the IO thread (the flush waits for that read here).
    z.scheduler().kv().disk().expect("disk").flush();
    assert!(z.stats().disk.prefetched_blocks >= 4, "{:?}", z.stats().disk);
    let z_out = drain(&mut z);
    assert_eq!(z_out[&2].2, 64, "a warm restart");
    assert_eq!(last_logits(&z_log), x_logits);
    assert!(z.stats().disk.prefetch_hits >= 4, "admission took the blocks read ahead: {:?}", z.stats().disk);
}

#[test]
fn host_then_ssd_hold_more_than_either_and_stay_consistent() {
    const BS: u32 = 4;
    let ssd = tempfile::tempdir().expect("ssd");
    let backend = SimBackend::new(1000, 4096, vec![0]);
    let block_bytes = backend.kv_block_bytes(BS as usize).expect("sim");
    let cfg = EngineConfig {
        num_blocks: 32,
        scheme: HashScheme::new(BS, 1),
        scheduler: SchedulerConfig { max_num_batched_tokens: 64, max_num_seqs: 4 },
    };
    let mut e = Engine::new(cfg, backend, None)
        .with_host_tier(24 * block_bytes, WritePolicy::WriteBack)
        .expect("host")
        // 1 GiB: about 2,000 simulated blocks of 512 KiB (the simulator writes no K/V bytes, only records).
        .with_disk_tier(ssd.path(), 1 << 30, WritePolicy::WriteBack, 0)
        .expect("disk");
    // 30 distinct 40-token prompts (10 blocks each, 300 in all): far more than the pool (32) and host (24) hold.
    let prompt = |k: u32| -> Vec<u32> { (0..40).map(|i| (k * 53 + i * 7) % 997 + 1).collect() };
    for k in 0..30u32 {
        e.add_request(req(u64::from(k), prompt(k), 1)).expect("ok");
        drain(&mut e);
    }
    e.scheduler().kv().disk().expect("disk").flush();
    // The first prompts went device -> host -> SSD; asking again finds them there.
    e.add_request(req(100, prompt(0), 1)).expect("ok");
    let out = drain(&mut e);
    assert_eq!(out[&100].2, 36, "nine whole blocks back (the last token is always computed)");
    let s = e.stats();
    assert!(s.disk.written_blocks > 0 && s.disk.read_blocks >= 9, "{:?}", s.disk);
    assert!(s.host_blocks_cached <= 24);
    let kv = e.scheduler().kv();
    let pool = kv.pool().lock();
    kv.host().expect("host").lock().check_invariants(|h| pool.is_cached(h)).expect("host");
    pool.check_invariants().expect("pool");
    assert_eq!(s.blocks_free, 32);
}

/// A simulated engine (blocks of 4 tokens) over an SSD tier in `ssd` (`inline`: written and read on the engine's
/// thread), weighing loads with the gpu-h100 profile's prefill cost and an SSD of `disk_s_per_byte`.
fn sim_ssd_engine(
    ssd: &std::path::Path,
    num_blocks: usize,
    max_num_seqs: usize,
    (inline, write): (bool, WritePolicy),
    policy: LoadPolicy,
    disk_s_per_byte: f64,
) -> Engine<SimBackend> {
    let backend = SimBackend::new(1000, 4096, vec![0]);
    let cfg = EngineConfig {
        num_blocks,
        scheme: HashScheme::new(4, 1),
        scheduler: SchedulerConfig { max_num_batched_tokens: 64, max_num_seqs },
    };
    let e = Engine::new(cfg, backend, None);
    let mut e = match inline {
        true => e.with_inline_disk_tier(ssd, 1 << 30, write, 0),
        false => e.with_disk_tier(ssd, 1 << 30, write, 0),
    }
    .expect("disk");
    e.set_load_costs(LoadCosts {
        policy,
        kv_bytes_per_token: 0.0,
        host_s_per_byte: 2e-11,
        disk_s_per_byte,
        prefill_s_per_token: 2.35e-5,
        attention_s: 1.05e-9,
    });
    e
}

#[test]
fn load_or_recompute_follows_the_costs_and_is_counted() {
    // (The queue's effect on the choice is covered by kv::costs' tests.)
    let run = |policy: LoadPolicy, disk_s_per_byte: f64| {
        let ssd = tempfile::tempdir().expect("ssd");
        let mut e =
            sim_ssd_engine(ssd.path(), 16, 1, (false, WritePolicy::WriteBack), policy, disk_s_per_byte);
        let prompt: Vec<u32> = (0..40).map(|i| i * 3 + 1).collect();
        e.add_request(req(1, prompt.clone(), 1)).expect("ok");
        drain(&mut e);
        for k in 0..4u32 {
            e.add_request(req(10 + u64::from(k), (0..40).map(|i| (k * 97 + i * 5) % 900 + 2).collect(), 1))
                .expect("ok");
            drain(&mut e);
        }
        e.scheduler().kv().disk().expect("disk").flush();
        e.add_request(req(2, prompt.clone(), 1)).expect("ok");
        let out = drain(&mut e);
        let d = e.scheduler().kv().decisions();
        let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        (out[&2].2, get(&d.loads), get(&d.recomputes))
    };
    // A fast SSD (10 GB/s: 13 us a token) beats a 23.5 us prefill: loaded.
    let (cached, loads, _) = run(LoadPolicy::Auto, 1e-10);
    assert!(cached >= 36 && loads >= 1, "{cached} {loads}");
    // A slow one (1 GB/s: 131 us a token), alone and early in the prompt: computed again, and counted.
    let (cached, _, recomputes) = run(LoadPolicy::Auto, 1e-9);
    assert!(cached == 0 && recomputes >= 1, "{cached} {recomputes}");
    let (pinned, ..) = run(LoadPolicy::AlwaysLoad, 1e-9);
    assert!(pinned >= 36, "pinned to load: {pinned}");
    let (never, ..) = run(LoadPolicy::AlwaysRecompute, 1e-10);
    assert_eq!(never, 0, "pinned to recompute");
}

#[test]
fn a_request_whose_ssd_prefix_is_read_ahead_waits_its_turn_then_loads_it() {
    // A 1 GB/s SSD: 0.52 ms a simulated block against 94 us to compute it, so reading only pays while the request
    // queues behind other work. The engine's clock is the simulated backend's (set by hand here).
    let engine = |policy: LoadPolicy| {
        let ssd = tempfile::tempdir().expect("ssd");
        let mut e = sim_ssd_engine(ssd.path(), 200, 4, (true, WritePolicy::WriteThrough), policy, 1e-9);
        // Write-through puts the prompt's blocks on the SSD; dropping them from the pool leaves only the SSD copy.
        let a: Vec<u32> = (0..40).map(|i| i * 3 + 1).collect();
        e.add_request(req(1, a.clone(), 1)).expect("ok");
        drain(&mut e);
        {
            let mut pool = e.scheduler().kv().pool().lock();
            let hashes: Vec<_> = pool.cached_hashes().collect();
            for h in hashes {
                let id = pool.block_of(h).expect("cached");
                pool.invalidate(id);
            }
        }
        (e, a, ssd)
    };

    // Behind a 400-token prefill (9 ms of engine work) the 4.7 ms read overlaps the queue: read ahead, loaded.
    let (mut e, a, _ssd) = engine(LoadPolicy::Auto);
    e.add_request(req(2, (0..400).map(|i| i % 900 + 2).collect(), 30)).expect("ok");
    e.backend_mut().set_now(10.0);
    e.step();
    e.add_request(req(3, a.clone(), 1)).expect("ok");
    e.step();
    assert_eq!(e.scheduler().num_waiting(), 1, "passed over while its read is under way and other work runs");
    e.backend_mut().set_now(10.01);
    let out = drain(&mut e);
    assert_eq!(out[&3].2, 36, "admitted once read: nine blocks loaded from the SSD");
    let loads = e.scheduler().kv().decisions().loads.load(std::sync::atomic::Ordering::Relaxed);
    assert!(loads >= 1);

    // Alone, the same read is dearer than computing the prefix again: nothing is read, nothing waits.
    let (mut e, a, _ssd) = engine(LoadPolicy::Auto);
    e.backend_mut().set_now(10.0);
    e.add_request(req(3, a.clone(), 1)).expect("ok");
    assert_eq!(drain(&mut e)[&3].2, 0);

    // Pinned to load with nothing else to run, it is admitted at once (the step waits for the read; the engine
    // never idles with work).
    let (mut e, a, _ssd) = engine(LoadPolicy::AlwaysLoad);
    e.backend_mut().set_now(10.0);
    e.add_request(req(3, a, 1)).expect("ok");
    let first = e.step();
    assert!(first.iter().any(|o| o.id == 3 && o.cached_tokens == 36), "admitted at once, prefix loaded");
}

/// A simulated engine (IO thread, write-through, always load) whose 40-token prompt `a` is on the SSD only, with
/// a long request running so that `a`'s claim has other work to let run; the clock frozen at 10 s.
fn ssd_only_prefix_behind_work() -> (Engine<SimBackend>, Vec<u32>, tempfile::TempDir) {
    let ssd = tempfile::tempdir().expect("ssd");
    let mut e =
        sim_ssd_engine(ssd.path(), 200, 4, (false, WritePolicy::WriteThrough), LoadPolicy::AlwaysLoad, 1e-9);
    let a: Vec<u32> = (0..40).map(|i| i * 3 + 1).collect();
    e.add_request(req(1, a.clone(), 1)).expect("ok");
    drain(&mut e);
    e.scheduler().kv().disk().expect("disk").flush();
    {
        let mut pool = e.scheduler().kv().pool().lock();
        let hashes: Vec<_> = pool.cached_hashes().collect();
        for h in hashes {
            let id = pool.block_of(h).expect("cached");
            pool.invalidate(id);
        }
    }
    e.add_request(req(2, (0..400).map(|i| i % 900 + 2).collect(), 200)).expect("ok");
    freeze(&mut e);
    e.step();
    (e, a, ssd)
}

fn freeze(e: &mut Engine<SimBackend>) {
    freeze_at(e, 10.0);
}

fn freeze_at(e: &mut Engine<SimBackend>, t: f64) {
    e.backend_mut().take_elapsed();
    e.backend_mut().set_now(t);
}

#[test]
fn a_dropped_read_ahead_is_asked_again_and_the_engine_never_reads_the_disk_itself() {
    let (mut e, a, _ssd) = ssd_only_prefix_behind_work();
    let disk = e.scheduler().kv().disk().expect("disk").clone();
    // A full IO queue drops the read-ahead at arrival and the request of the first claim.
    disk.drop_next_requests(2);
    e.add_request(req(3, a.clone(), 1)).expect("ok");
    // Claimed once the read-ahead it was promised would be done (request 2's prefill takes the first steps' whole
    // budget: no admission runs before it is done either).
    let at = e.scheduler().waiting().next().expect("waiting").load_ready_s + 1e-6;
    for _ in 0..20 {
        freeze_at(&mut e, at);
        e.step();
        assert_eq!(e.scheduler().num_waiting(), 1, "passed over: its blocks are not in memory");
        assert_eq!(disk.counters().read_blocks, 0, "nothing read on the engine's thread");
        if disk.counters().dropped_reads == 2 {
            break;
        }
    }
    assert_eq!(disk.counters().dropped_reads, 2);
    // The next claim asks again; the IO thread reads (the queue is FIFO: a flush waits for the read).
    freeze_at(&mut e, at);
    e.step();
    assert_eq!(e.scheduler().num_waiting(), 1);
    disk.flush();
    let mut cached = None;
    while e.has_work() && cached.is_none() {
        freeze_at(&mut e, at);
        cached = e.step().into_iter().find(|o| o.id == 3).map(|o| o.cached_tokens);
    }
    assert_eq!(cached, Some(36), "admitted with its nine blocks loaded from the SSD");
    let c = disk.counters();
    assert_eq!((c.read_blocks, c.prefetch_hits), (9, 9), "every block came through the read-ahead");
    assert!(c.prefetched_blocks >= 9);
    drain(&mut e);
    let s = e.stats();
    assert_eq!(s.blocks_free, s.blocks_total, "every block back once the requests are done");
}

#[test]
fn a_read_that_never_arrives_is_given_up_at_its_deadline_and_the_prefix_computed() {
    let (mut e, a, _ssd) = ssd_only_prefix_behind_work();
    let disk = e.scheduler().kv().disk().expect("disk").clone();
    disk.drop_next_requests(usize::MAX);
    e.add_request(req(3, a, 1)).expect("ok");
    freeze(&mut e);
    e.step();
    assert_eq!(e.scheduler().num_waiting(), 1, "waiting for its read");
    // Past the deadline (at least MIN_READ_WAIT_S after the first claim): admitted, the prefix computed.
    e.backend_mut().take_elapsed();
    e.backend_mut().set_now(10.0 + crate::kv::tiers::MIN_READ_WAIT_S + 0.01);
    let mut cached = None;
    while e.has_work() && cached.is_none() {
        cached = e.step().into_iter().find(|o| o.id == 3).map(|o| o.cached_tokens);
    }
    assert_eq!(cached, Some(0));
    assert_eq!(disk.counters().read_blocks, 0);
    drain(&mut e);
    let s = e.stats();
    assert_eq!(s.blocks_free, s.blocks_total, "the waits held no block");
    let recomputes = e.scheduler().kv().decisions().recomputes.load(std::sync::atomic::Ordering::Relaxed);
    assert!(recomputes >= 1);
}
