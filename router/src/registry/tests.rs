//! Registry behaviour on an explicit clock: health, staleness, identity, faults, forgetting.

use super::*;
use crate::routing::Load;
use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
use kvgate_shared::report::{BlockBloom, QueueStats, Throughput, TierReport};

fn cfg() -> RegistryConfig {
    RegistryConfig {
        stale_after: Duration::from_secs(3),
        dead_after: Duration::from_secs(10),
        overlay_ttl: Duration::from_secs(3),
        vnodes: 16,
        forget_after: Duration::from_secs(60),
        max_workers: 3,
        ..RegistryConfig::default()
    }
}

fn report(id: &str, seq: u64, hashes: &[BlockHash], fingerprint: u64) -> WorkerReport {
    let mut bloom = BlockBloom::with_capacity(64, 0.001);
    hashes.iter().for_each(|h| bloom.insert(*h));
    WorkerReport {
        pd: Default::default(),
        lora: Default::default(),
        worker_id: id.into(),
        advertise_url: format!("http://{id}:8000"),
        model_id: "m".into(),
        scheme: HashScheme::new(16, 1),
        fingerprint,
        seq,
        timestamp_ms: 0,
        instance_id: 1,
        max_model_len: 4096,
        draining: false,
        queue: QueueStats {
            waiting_requests: 1,
            prefill_tokens: 100,
            running_requests: 2,
            prefill_area: 7_000,
            prefilling_requests: 1,
        },
        throughput: Throughput::default(),
        tiers: vec![TierReport {
            tier: Tier::Device,
            blocks_total: 100,
            blocks_free: 50,
            blocks_cached: 10,
            summary: Some(CacheSummary { granularity: 1, entries: hashes.len() as u64, bloom }),
        }],
    }
}

fn hashes() -> Vec<BlockHash> {
    BlockHasher::new(&HashScheme::new(16, 1), &ExtraKeys::none()).hash_blocks(&(0..64).collect::<Vec<u32>>())
}

#[test]
fn stale_reports_stop_prefix_scoring_and_silence_removes_from_the_ring() {
    let mut r = Registry::new(cfg());
    let t0 = Instant::now();
    let h = hashes();
    assert_eq!(r.ingest(report("a", 1, &h, 7), Some(7), t0), Ingest::Accepted);
    let (v, _) = r.views("m", &h, None, t0 + Duration::from_secs(1));
    assert!(v[0].healthy);
    assert_eq!(v[0].matched_blocks(&h), 4);
    let (v, _) = r.views("m", &h, None, t0 + Duration::from_secs(4));
    assert!(v[0].healthy && v[0].summary.is_none(), "stale: no prefix score, still routable");
    assert_eq!(v[0].matched_blocks(&h), 0);
    let (v, _) = r.views("m", &h, None, t0 + Duration::from_secs(11));
    assert!(!v[0].healthy, "silent past dead_after: out of the ring");
    // Reporting again brings it back.
    assert_eq!(r.ingest(report("a", 2, &h, 7), Some(7), t0 + Duration::from_secs(12)), Ingest::Accepted);
    assert!(r.views("m", &h, None, t0 + Duration::from_secs(12)).0[0].healthy);
}

#[test]
fn fingerprint_mismatch_gets_no_cache_score() {
    let mut r = Registry::new(cfg());
    let t0 = Instant::now();
    let h = hashes();
    r.ingest(report("a", 1, &h, 8), Some(7), t0);
    let (v, _) = r.views("m", &h, None, t0);
    assert!(v[0].healthy && v[0].summary.is_none());
    assert_eq!(r.status(t0)[0].fingerprint_ok, Some(false));
}

#[test]
fn refusals_overlay_order_and_load() {
    let mut r = Registry::new(cfg());
    let t0 = Instant::now();
    let h = hashes();
    r.ingest(report("a", 5, &[], 7), Some(7), t0);
    assert_eq!(
        r.ingest(report("a", 4, &[], 7), Some(7), t0),
        Ingest::OutOfOrder,
        "older reports are ignored"
    );
    let ticket = r.record_sent(0, &h, 300, t0);
    let (v, _) = r.views("m", &h, None, t0);
    assert_eq!(v[0].overlay_matched_blocks, 4, "what this gateway routed counts before the next report");
    // The send's attention area: 300 uncached tokens of a prompt of 4 blocks of 16 (all uncached) = 300 x 150.
    assert_eq!(
        v[0].load,
        Load { pending_tokens: 400, requests: 4, waiting: 2, pending_area: 7_000 + 45_000, prefilling: 1 }
    );
    r.record_done(ticket);
    assert_eq!(
        r.views("m", &h, None, t0).0[0].load,
        Load { pending_tokens: 100, requests: 3, waiting: 1, pending_area: 7_000, prefilling: 1 },
        "finished: no load"
    );
    assert_eq!(
        r.views("m", &h, None, t0 + Duration::from_secs(4)).0[0].overlay_matched_blocks,
        0,
        "overlay expires"
    );
    let a = r.worker_ref(0).expect("a");
    r.record_fault(a, Fault::Refused, t0 + Duration::from_millis(10));
    assert!(!r.views("m", &h, None, t0 + Duration::from_millis(20)).0[0].healthy);
    r.ingest(report("a", 6, &[], 7), Some(7), t0 + Duration::from_millis(30));
    assert!(r.views("m", &h, None, t0 + Duration::from_millis(40)).0[0].healthy);
    assert!(r.views("other-model", &h, None, t0).0.is_empty());
    r.add_static("http://s:1");
    assert!(
        r.views("m", &h, None, t0).0.iter().any(|w| w.id == "http://s:1" && w.healthy),
        "unknown model: candidate"
    );
    assert!(r.set_draining("a", true));
    assert!(!r.views("m", &h, None, t0 + Duration::from_millis(40)).0[0].healthy);
}

#[test]
fn a_draining_report_takes_the_worker_out_of_the_ring() {
    let mut r = Registry::new(cfg());
    let t0 = Instant::now();
    r.ingest(report("a", 1, &[], 7), Some(7), t0);
    let mut d = report("a", 2, &[], 7);
    d.draining = true;
    r.ingest(d, Some(7), t0);
    assert!(!r.views("m", &[], None, t0).0[0].healthy);
    let s = &r.status(t0)[0];
    assert!(s.draining && !s.healthy);
}

#[test]
fn a_live_workers_id_cannot_be_claimed_by_another_url() {
    let mut r = Registry::new(cfg());
    let t0 = Instant::now();
    r.ingest(report("a", 1, &[], 7), Some(7), t0);
    let mut thief = report("a", 50, &[], 7);
    thief.advertise_url = "http://evil:8000".into();
    thief.instance_id = 99;
    assert_eq!(
        r.ingest(thief.clone(), Some(7), t0 + Duration::from_secs(1)),
        Ingest::IdConflict { holder_url: "http://a:8000".into() }
    );
    assert_eq!(r.workers()[0].url, "http://a:8000");
    // Once the holder is dead (silent for dead_after), the id may move (a rescheduled pod with a new address).
    assert_eq!(r.ingest(thief, Some(7), t0 + Duration::from_secs(11)), Ingest::Accepted);
    assert_eq!(r.workers().len(), 1);
    assert_eq!(r.workers()[0].url, "http://evil:8000");
}

#[test]
fn a_restarted_worker_is_accepted_at_its_first_report() {
    let mut r = Registry::new(cfg());
    let t0 = Instant::now();
    r.ingest(report("a", 500, &[], 7), Some(7), t0);
    let mut fresh = report("a", 1, &[], 7);
    fresh.instance_id = 2;
    assert_eq!(
        r.ingest(fresh, Some(7), t0 + Duration::from_millis(300)),
        Ingest::Accepted,
        "new instance, seq 1"
    );
    assert_eq!(
        r.ingest(report("a", 2, &[], 7), Some(7), t0),
        Ingest::Accepted,
        "instance 1 again: a restart too"
    );
    let mut old = report("a", 1, &[], 7);
    old.instance_id = 1;
    assert_eq!(r.ingest(old, Some(7), t0), Ingest::OutOfOrder, "same instance, older seq");
}

#[test]
fn faults_close_on_a_report_or_a_probe_and_refusals_expire() {
    let mut r = Registry::new(cfg());
    let t0 = Instant::now();
    r.add_static("http://s:1");
    let s = r.worker_ref(0).expect("s");
    assert!(r.views("m", &[], None, t0).0[0].healthy, "a static worker is healthy until a fault");
    r.record_fault(s, Fault::Timeout, t0);
    assert!(!r.views("m", &[], None, t0).0[0].healthy);
    assert!(r.status(t0)[0].suspect);
    assert_eq!(r.probe_targets(), vec![(s, "http://s:1".to_string())]);
    r.record_probe_ok(s, t0 + Duration::from_millis(5));
    assert!(r.views("m", &[], None, t0 + Duration::from_millis(6)).0[0].healthy, "the probe answered");
    assert!(r.probe_targets().is_empty());
    r.record_busy(s, t0 + Duration::from_secs(2));
    assert!(!r.views("m", &[], None, t0 + Duration::from_secs(1)).0[0].healthy, "Retry-After honoured");
    assert!(r.views("m", &[], None, t0 + Duration::from_secs(2)).0[0].healthy);
    assert_eq!(r.status(t0)[0].counters.refusals, 1);
    assert_eq!(r.status(t0)[0].counters.timeouts, 1);
}

#[test]
fn silent_workers_are_forgotten_and_the_registry_is_bounded() {
    let mut r = Registry::new(cfg());
    let t0 = Instant::now();
    r.add_static("http://s:1");
    r.ingest(report("a", 1, &[], 7), Some(7), t0);
    r.ingest(report("b", 1, &[], 7), Some(7), t0 + Duration::from_secs(30));
    assert_eq!(r.ingest(report("c", 1, &[], 7), Some(7), t0), Ingest::Full, "max_workers 3");
    let ticket = r.record_sent(2, &[], 10, t0);
    assert!(
        r.sweep(t0 + Duration::from_secs(61)) == vec!["a".to_string()],
        "a silent 61 s; b 31 s; s static"
    );
    // b's index shifted from 2 to 1: its ticket still finds it.
    assert_eq!(r.workers()[1].id, "b");
    assert_eq!(r.workers()[1].inflight, 1);
    r.record_done(ticket);
    assert_eq!(r.workers()[1].inflight, 0);
    assert!(r.sweep(t0 + Duration::from_secs(200)) == vec!["b".to_string()]);
    assert_eq!(r.workers().len(), 1);
    assert_eq!(r.max_model_len("m"), None);
    r.ingest(report("d", 1, &[], 7), Some(7), t0);
    assert_eq!(r.max_model_len("m"), Some(4096));
}

/// Chained hashes of `n` blocks whose first `shared` blocks are common to every `family` and the rest its own.
fn family_prompt(shared: usize, n: usize, family: u32) -> Vec<BlockHash> {
    let tokens: Vec<u32> = (0..n * 16)
        .map(|i| if i < shared * 16 { i as u32 } else { 100_000 + family * 10_000 + i as u32 })
        .collect();
    BlockHasher::new(&HashScheme::new(16, 1), &ExtraKeys::none()).hash_blocks(&tokens)
}

#[test]
fn the_sparse_overlay_is_exact_at_its_points_and_never_overcounts() {
    let t0 = Instant::now();
    let later = t0 + Duration::from_secs(1);
    for sent_len in [1, 7, 8, 9, 16, 20, 33] {
        let mut o = Overlay::default();
        o.insert(&family_prompt(sent_len, sent_len, 0), t0 + Duration::from_secs(3), t0);
        for shared in 0..=sent_len {
            for req_len in [shared, shared + 1, shared + 9] {
                if req_len == 0 {
                    continue;
                }
                let req = family_prompt(shared, req_len, 1);
                let got = o.matched(&req, later);
                assert!(got <= shared, "sent {sent_len}, shared {shared}, len {req_len}: {got} overcounts");
                // Exact when the shared prefix ends at a point: a multiple of the stride, or the sent prompt's end.
                if shared % Overlay::STRIDE == 0 || shared == sent_len {
                    assert_eq!(got, shared, "sent {sent_len}, shared {shared}, len {req_len}");
                } else {
                    assert!(shared - got < Overlay::STRIDE, "sent {sent_len}, shared {shared}: {got}");
                }
            }
        }
        assert_eq!(
            o.matched(&family_prompt(sent_len, sent_len, 0), t0 + Duration::from_secs(3)),
            0,
            "expired"
        );
    }
    assert!(Overlay::points(&family_prompt(20, 20, 0)).len() == 3, "blocks 8, 16 and the last");
}

#[test]
fn another_replicas_send_counts_as_load_and_overlay_until_the_next_report() {
    let mut r = Registry::new(cfg());
    let t0 = Instant::now();
    let h = hashes();
    r.ingest(report("a", 1, &[], 7), Some(7), t0);
    let send = SharedSend::new("a", &h, 500, Some(42));
    assert!(send.valid());
    assert!(r.record_shared_send(&send, t0));
    assert!(!r.record_shared_send(&SharedSend::new("nobody", &h, 1, None), t0), "unknown worker: ignored");
    let (v, _) = r.views("m", &h, Some(42), t0);
    assert_eq!(v[0].overlay_matched_blocks, 4);
    assert_eq!(
        v[0].load,
        Load { pending_tokens: 600, requests: 4, waiting: 2, pending_area: 7_000 + 500 * 250, prefilling: 1 }
    );
    assert!(v[0].holds_session);
    assert_eq!(r.status(t0)[0].inflight, 0, "another replica's request is not in flight here");
    r.ingest(report("a", 2, &[], 7), Some(7), t0 + Duration::from_secs(1));
    let (v, _) = r.views("m", &h, None, t0 + Duration::from_secs(1));
    assert_eq!(
        v[0].load,
        Load { pending_tokens: 100, requests: 3, waiting: 1, pending_area: 7_000, prefilling: 1 },
        "the report's queue includes it now"
    );
    let mut bad = SharedSend::new("a", &h, SharedSend::MAX_TOKENS + 1, None);
    assert!(!bad.valid());
    bad.uncached_tokens = 1;
    bad.points = vec![BlockHash(1); SharedSend::MAX_POINTS + 1];
    assert!(!bad.valid());
}

#[test]
fn other_replicas_sends_to_a_pod_that_never_reports_expire_and_stay_bounded() {
    let mut r = Registry::new(cfg());
    let t0 = Instant::now();
    r.add_static("http://pod:8000");
    r.identify("http://pod:8000", "pod", "m", 0);
    let h = hashes();
    // Far more sends than entries kept: all counted, memory bounded.
    for i in 0..(MAX_SHARED_LOAD_ENTRIES as u64 * 4) {
        assert!(r.record_shared_send(&SharedSend::new("pod", &h, 10, None), t0 + Duration::from_millis(i)));
    }
    let at = t0 + Duration::from_millis(MAX_SHARED_LOAD_ENTRIES as u64 * 4);
    let w = &r.workers()[0];
    assert!(w.shared_load.len() <= MAX_SHARED_LOAD_ENTRIES);
    let area = 1024 * 10 * 5;
    assert_eq!(
        w.load(at),
        Load { pending_tokens: 10 * 1024, requests: 1024, waiting: 1024, pending_area: area, prefilling: 0 }
    );
    // With no report or scrape to end them, they stop counting after the TTL.
    assert_eq!(w.load(at + SHARED_LOAD_TTL), Load::default());
    let (v, _) = r.views("m", &h, None, at + SHARED_LOAD_TTL);
    assert_eq!(v[0].load, Load::default());
}

#[test]
fn pods_without_reports_match_by_their_approximate_index_or_their_events() {
    let mut r = Registry::new(RegistryConfig { overlay_ttl: Duration::from_millis(10), ..cfg() });
    let t0 = Instant::now();
    let later = t0 + Duration::from_secs(5);
    let h = hashes();
    r.add_static("http://pod-a:8000/");
    r.identify("http://pod-a:8000", "pod-a", "m", 0);
    assert!(r.track_sends("http://pod-a:8000", 100));
    assert!(!r.track_sends("http://nowhere:1", 100));
    // A send the pod refuses (over its context, say) is never credited: only the send's overlay counts it, and
    // only while it lasts.
    let refused = r.record_sent(0, &h, 64, t0);
    r.record_done(refused);
    assert_eq!(r.views("m", &h, None, t0).0[0].overlay_matched_blocks, 4, "in flight: the overlay");
    assert_eq!(r.views("m", &h, None, later).0[0].overlay_matched_blocks, 0, "refused: nothing remembered");
    assert_eq!(r.status(later)[0].approx_blocks, Some([0, 100]));
    let t = r.record_sent(0, &h, 64, t0);
    r.record_served(WorkerRef { idx: t.idx, uid: t.uid }, &h);
    r.record_done(t);
    // Served: the overlay has expired; the approximate index still remembers.
    assert_eq!(r.views("m", &h, None, later).0[0].overlay_matched_blocks, 4);
    assert_eq!(r.views("m", &h, None, later).0[0].prefix_signal, crate::routing::PrefixSignal::Approximate);
    // The pod's metrics say how big its cache is: the index follows (here it shrinks to three blocks, keeping
    // the prefix), and the usage is shown; nonsense is not taken.
    let scraped = Scraped {
        waiting: 1,
        running: 2,
        kv_usage: Some(0.25),
        kv_capacity_blocks: Some(3),
        ..Scraped::default()
    };
    assert!(r.set_scraped("http://pod-a:8000/", &scraped));
    assert_eq!(r.views("m", &h, None, later).0[0].overlay_matched_blocks, 3);
    let st = &r.status(later)[0];
    assert_eq!((st.kv_usage, st.approx_blocks), (Some(0.25), Some([3, 3])));
    assert!(r.set_scraped("http://pod-a:8000", &Scraped { kv_usage: Some(f64::NAN), ..scraped }));
    assert_eq!(r.status(later)[0].kv_usage, None);
    assert!(r.set_scraped(
        "http://pod-a:8000",
        &Scraped { kv_usage: Some(7.0), kv_capacity_blocks: Some(0), ..scraped }
    ));
    assert_eq!((r.status(later)[0].kv_usage, r.status(later)[0].approx_blocks), (Some(1.0), Some([3, 3])));
    assert!(!r.set_scraped("http://nowhere:1", &scraped));
    // A figure within 1/16 of the capacity changes nothing (an estimate's jitter); a bigger one does.
    let cap = |blocks| Scraped { kv_capacity_blocks: Some(blocks), ..scraped };
    assert!(r.set_scraped("http://pod-a:8000", &cap(1600)));
    assert!(r.set_scraped("http://pod-a:8000", &cap(1550)));
    assert_eq!(r.status(later)[0].approx_blocks, Some([3, 1600]));
    assert!(r.set_scraped("http://pod-a:8000", &cap(1400)));
    assert_eq!(r.status(later)[0].approx_blocks, Some([3, 1400]));
    // Events replace the guess: the pod holds the first two blocks only, then a clear.
    assert!(r.apply_exact(
        "http://pod-a:8000",
        false,
        &[(h[0], true), (h[1], true), (h[2], true), (h[2], false)]
    ));
    assert_eq!(r.views("m", &h, None, later).0[0].overlay_matched_blocks, 2);
    assert_eq!(r.views("m", &h, None, later).0[0].prefix_signal, crate::routing::PrefixSignal::Events);
    r.apply_exact("http://pod-a:8000", true, &[]);
    assert_eq!(r.views("m", &h, None, later).0[0].overlay_matched_blocks, 0);
    assert!(!r.apply_exact("http://nowhere:1", false, &[]));
    // A refused static worker leaves the registry.
    assert!(r.remove_static("http://pod-a:8000/"));
    assert!(r.workers().is_empty());
}

#[test]
fn a_pods_decode_cost_is_fitted_from_its_scraped_inter_token_latency_and_its_pool_from_its_page() {
    let (mut r, t0) = (Registry::new(cfg()), Instant::now());
    r.add_static("http://pod-a:8000");
    let page = |running: u32, sum: f64, count: f64| Scraped {
        running,
        kv_usage: Some(0.25),
        kv_capacity_tokens: Some(4_000),
        itl_sum_count: Some((sum, count)),
        ..Scraped::default()
    };
    let speed = |r: &Registry| r.status(t0)[0].speed;
    // The first scrape is a baseline only: no interval yet.
    assert!(r.set_scraped("http://pod-a:8000", &page(1, 10.0, 1_000.0)));
    assert_eq!(speed(&r).decode_base_s, 0.0);
    // Intervals at batches 1..=8 whose time per token is 5 ms + 1 ms a running request: the fit recovers both.
    let (mut sum, mut count) = (10.0, 1_000.0);
    for b in [1u32, 2, 4, 8].repeat(10) {
        count += 100.0;
        sum += 100.0 * (0.005 + 0.001 * f64::from(b));
        assert!(r.set_scraped("http://pod-a:8000", &page(b, sum, count)));
        assert!(r.set_scraped("http://pod-a:8000", &page(b, sum, count)), "an interval without tokens");
    }
    let s = speed(&r);
    assert!((s.decode_per_seq_s - 0.001).abs() < 2e-4 && (s.decode_base_s - 0.005).abs() < 1e-3, "{s:?}");
    assert_eq!((s.kv_total_tokens, s.kv_free_tokens, s.kv_cached_tokens), (4_000, 3_000, 0));
    // A restart (the counters went back), a negative or absurd figure: a new baseline at most, never a sample.
    let before = r.workers[0].pod_decode.samples;
    assert!(r.set_scraped("http://pod-a:8000", &page(2, 1.0, 10.0)));
    assert!(r.set_scraped("http://pod-a:8000", &page(2, 1.0 + 1e6, 11.0)));
    assert!(r.set_scraped("http://pod-a:8000", &page(2, f64::NAN, 20.0)));
    assert!(r.set_scraped("http://pod-a:8000", &page(2, -5.0, 30.0)));
    assert_eq!(r.workers[0].pod_decode.samples, before);
    let fit = |s: crate::routing::Speed| (s.decode_base_s, s.decode_per_seq_s, s.decode_per_kv_token_s);
    assert_eq!(fit(speed(&r)), fit(s), "nothing believed moved the fit");
    // A page without capacity or usage leaves the pool unknown.
    assert!(r.set_scraped("http://pod-a:8000", &Scraped { running: 1, ..Scraped::default() }));
    assert_eq!(speed(&r).kv_total_tokens, 0);
}
