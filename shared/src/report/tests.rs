//! Round trips, size, and decoder robustness of the report protocol.

use super::*;
use crate::hashing::{BlockHasher, ExtraKeys};
use proptest::prelude::*;

fn sample(n_hashes: u64, granularity: u32) -> WorkerReport {
    let scheme = HashScheme::new(16, 42);
    let mut bloom = BlockBloom::with_capacity(n_hashes as usize, 0.01);
    for i in 0..n_hashes {
        bloom.insert(BlockHash(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
    }
    WorkerReport {
        pd: Default::default(),
        lora: Default::default(),
        worker_id: "worker-0".into(),
        advertise_url: "http://127.0.0.1:8000".into(),
        model_id: "kvgate-small".into(),
        scheme,
        fingerprint: scheme.fingerprint(),
        seq: 7,
        timestamp_ms: 1_790_000_000_000,
        instance_id: 0xDEAD_BEEF_0123,
        max_model_len: 131_072,
        draining: false,
        queue: QueueStats {
            waiting_requests: 3,
            prefill_tokens: 4096,
            running_requests: 5,
            prefill_area: 9_000_000,
            prefilling_requests: 2,
        },
        throughput: Throughput { prefill_tokens_per_s: 5000.5, decode_tokens_per_s: 120.25 },
        tiers: vec![
            TierReport {
                tier: Tier::Device,
                blocks_total: 200_000,
                blocks_free: 1000,
                blocks_cached: 150_000,
                summary: Some(CacheSummary { granularity, entries: n_hashes, bloom }),
            },
            TierReport {
                tier: Tier::Host,
                blocks_total: 10,
                blocks_free: 10,
                blocks_cached: 0,
                summary: None,
            },
        ],
    }
}

#[test]
fn round_trip() {
    let r = sample(1000, 1);
    let bytes = r.encode();
    assert_eq!(WorkerReport::decode(&bytes).expect("decodes"), r);
}

#[test]
fn draining_flag_round_trips_and_unknown_flags_are_refused() {
    let mut r = sample(10, 1);
    r.draining = true;
    let bytes = r.encode();
    assert_eq!(&bytes[6..8], &FLAG_DRAINING.to_le_bytes());
    assert_eq!(WorkerReport::decode(&bytes).expect("decodes"), r);
    let mut bad = bytes.clone();
    bad[6] = 0b10;
    assert!(matches!(WorkerReport::decode(&bad), Err(ReportError::Invalid { field: "flags", .. })));
}

/// Where the version-7 decode fit starts in `r`'s encoding (after the prefill fit).
fn decode_fit_at(r: &WorkerReport) -> usize {
    let strings: usize = [&r.worker_id, &r.advertise_url, &r.model_id].iter().map(|s| 2 + s.len()).sum();
    8 + strings + 24 + 16 + 12 + 1 + 2 + r.pd.transfer_addr.len() + 4 + 2 + 24 + 16
}

/// The version-6 encoding of `r`: no decode fit.
fn encode_v6(r: &WorkerReport) -> Vec<u8> {
    let v7 = r.encode();
    let at = decode_fit_at(r);
    let mut v6 = v7[..at].to_vec();
    v6.extend_from_slice(&v7[at + 24..]);
    v6[4..6].copy_from_slice(&6u16.to_le_bytes());
    v6
}

/// The version-5 encoding of `r`: no adapters.
fn encode_v5(r: &WorkerReport) -> Vec<u8> {
    let v6 = encode_v6(r);
    let strings: usize = [&r.worker_id, &r.advertise_url, &r.model_id].iter().map(|s| 2 + s.len()).sum();
    let start = 8 + strings + 24 + 16 + 12 + pd_len(r) + 16 + 16 + 12 + 16;
    let len = 4 + r.lora.held.iter().map(|a| 4 + a.name.len() + a.key.len()).sum::<usize>();
    let mut v5 = v6[..start].to_vec();
    v5.extend_from_slice(&v6[start + len..]);
    v5[4..6].copy_from_slice(&5u16.to_le_bytes());
    v5
}

/// The version-4 encoding of `r`: no prefill fit in the step timings, no attention area in the queue.
fn encode_v4(r: &WorkerReport) -> Vec<u8> {
    let v5 = encode_v5(r);
    let strings: usize = [&r.worker_id, &r.advertise_url, &r.model_id].iter().map(|s| 2 + s.len()).sum();
    let fit = 8 + strings + 24 + 16 + 12 + 1 + 2 + r.pd.transfer_addr.len() + 4 + 2 + 24;
    let area = 8 + strings + 24 + 16 + 12 + pd_len(r) + 16 + 16;
    let mut v4 = v5[..fit].to_vec();
    v4.extend_from_slice(&v5[fit + 16..area]);
    v4.extend_from_slice(&v5[area + 12..]);
    v4[4..6].copy_from_slice(&4u16.to_le_bytes());
    v4
}

/// The version-2 encoding of `r` (no prefill/decode part), as workers before version 3 send it.
fn encode_v2(r: &WorkerReport) -> Vec<u8> {
    let v3 = encode_v4(r);
    let strings: usize = [&r.worker_id, &r.advertise_url, &r.model_id].iter().map(|s| 2 + s.len()).sum();
    let cut = 8 + strings + 24 + 16 + 12;
    let mut v2 = v3[..cut].to_vec();
    v2.extend_from_slice(&v3[cut + pd_len(r)..]);
    v2[4..6].copy_from_slice(&2u16.to_le_bytes());
    v2
}

/// Bytes of the prefill/decode part of `r`'s version-4 encoding (version 5 adds 16, version 7 24 more).
fn pd_len(r: &WorkerReport) -> usize {
    let imports: usize = r.pd.imports.iter().map(|i| 2 + i.peer.len() + 8 + 8 + 4).sum();
    1 + 2 + r.pd.transfer_addr.len() + 4 + 2 + 24 + 1 + imports
}

/// The version-3 encoding of `r`: the version-4 fields after `kv_bytes_per_token` left out.
fn encode_v3(r: &WorkerReport) -> Vec<u8> {
    let v4 = encode_v4(r);
    let strings: usize = [&r.worker_id, &r.advertise_url, &r.model_id].iter().map(|s| 2 + s.len()).sum();
    let v4_start = 8 + strings + 24 + 16 + 12 + 1 + 2 + r.pd.transfer_addr.len() + 4;
    let mut v3 = v4[..v4_start].to_vec();
    v3.extend_from_slice(&v4[8 + strings + 24 + 16 + 12 + pd_len(r)..]);
    v3[4..6].copy_from_slice(&3u16.to_le_bytes());
    v3
}

fn pd_sample() -> PdInfo {
    PdInfo {
        role: Role::Prefill,
        transfer_addr: "10.0.0.7:9100".into(),
        kv_bytes_per_token: 131_072,
        export_groups: 8,
        timing: StepTiming {
            prefill_tokens_per_s: 41_000.0,
            decode_step_s: 0.0058,
            stall_ratio: 0.25,
            prefill_per_token_s: 2.35e-5,
            prefill_attention_s: 1.05e-9,
            decode_base_s: 0.0048,
            decode_per_seq_s: 2.35e-5,
            decode_per_kv_token_s: 3.9e-8,
        },
        imports: vec![PeerImport {
            peer: "10.0.0.8:9100".into(),
            bytes: 1 << 30,
            seconds: 0.4,
            transfers: 3,
        }],
    }
}

fn lora_sample() -> LoraInfo {
    let key = |n: &str| format!("{n}@{:016x}", n.len() as u64 * 0x0123_4567_89ab);
    let held = ["sql", "chat-v2"].iter().map(|n| HeldAdapter { name: (*n).into(), key: key(n) }).collect();
    LoraInfo { slots: 8, held }
}

#[test]
fn adapters_round_trip_older_senders_hold_none_and_hostile_ones_are_refused() {
    let mut r = sample(10, 1);
    r.pd = pd_sample();
    r.lora = lora_sample();
    assert_eq!(WorkerReport::decode(&r.encode()).expect("v7"), r);
    let v5 = WorkerReport::decode(&encode_v5(&r)).expect("v5");
    let no_decode_fit =
        StepTiming { decode_base_s: 0.0, decode_per_seq_s: 0.0, decode_per_kv_token_s: 0.0, ..r.pd.timing };
    let pd = PdInfo { timing: no_decode_fit, ..r.pd.clone() };
    assert_eq!(
        v5,
        WorkerReport { lora: LoraInfo::default(), pd, ..r.clone() },
        "a version-5 sender holds none"
    );
    let refused = |l: LoraInfo| {
        let bad = WorkerReport { lora: l, ..r.clone() };
        match WorkerReport::decode(&bad.encode()) {
            Err(ReportError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        }
    };
    let with = |name: &str, key: &str| {
        let mut l = lora_sample();
        l.held.push(HeldAdapter { name: name.into(), key: key.into() });
        l
    };
    assert_eq!(refused(with("sql", &lora_sample().held[0].key)), "adapter name", "a name twice");
    assert_eq!(refused(with("x", "y@0123456789abcdef")), "adapter key", "another name's key");
    assert_eq!(refused(with("x", "x@0123456789ABCDEF")), "adapter key", "not lowercase hex");
    assert_eq!(refused(with("x", "x@0123")), "adapter key", "short digest");
    assert_eq!(refused(with("", "@0123456789abcdef")), "adapter name", "empty name");
    let long = "n".repeat(MAX_ADAPTER_NAME_BYTES + 1);
    assert_eq!(refused(with(&long, &format!("{long}@0123456789abcdef"))), "adapter name");
    // More than the limit: the encoder sends the first MAX_REPORT_ADAPTERS; a count past it is refused.
    let many = LoraInfo {
        slots: u16::MAX,
        held: (0..MAX_REPORT_ADAPTERS + 5)
            .map(|i| HeldAdapter { name: format!("a{i}"), key: format!("a{i}@{i:016x}") })
            .collect(),
    };
    let sent = WorkerReport::decode(&WorkerReport { lora: many, ..r.clone() }.encode()).expect("capped");
    assert_eq!(sent.lora.held.len(), MAX_REPORT_ADAPTERS);
    let mut bytes = r.encode();
    let strings: usize = [&r.worker_id, &r.advertise_url, &r.model_id].iter().map(|s| 2 + s.len()).sum();
    let count = 8 + strings + 24 + 16 + 12 + pd_len(&r) + 16 + 24 + 16 + 12 + 16 + 2;
    bytes[count..count + 2].copy_from_slice(&(MAX_REPORT_ADAPTERS as u16 + 1).to_le_bytes());
    assert!(matches!(WorkerReport::decode(&bytes), Err(ReportError::Invalid { field: "adapters", .. })));
}

#[test]
fn step_timings_and_imports_round_trip_and_hostile_ones_are_refused() {
    let mut r = sample(10, 1);
    r.pd = pd_sample();
    assert_eq!(WorkerReport::decode(&r.encode()).expect("v5"), r);
    let v4 = WorkerReport::decode(&encode_v4(&r)).expect("v4");
    let no_fit = StepTiming {
        prefill_per_token_s: 0.0,
        prefill_attention_s: 0.0,
        decode_base_s: 0.0,
        decode_per_seq_s: 0.0,
        decode_per_kv_token_s: 0.0,
        ..r.pd.timing
    };
    let v6 = WorkerReport::decode(&encode_v6(&r)).expect("v6");
    let no_decode_fit =
        StepTiming { decode_base_s: 0.0, decode_per_seq_s: 0.0, decode_per_kv_token_s: 0.0, ..r.pd.timing };
    assert_eq!(v6.pd.timing, no_decode_fit, "a version-6 sender has no decode fit");
    assert_eq!(v4.pd, PdInfo { timing: no_fit, ..pd_sample() }, "a version-4 sender has no prefill fit");
    assert_eq!(
        v4.queue,
        QueueStats { prefill_area: 0, prefilling_requests: 0, ..r.queue },
        "nor a queue area"
    );
    // More prefilling than running is a lie, refused by name.
    let mut bad = r.clone();
    bad.queue.prefilling_requests = bad.queue.running_requests + 1;
    let e = WorkerReport::decode(&bad.encode());
    assert!(matches!(e, Err(ReportError::Invalid { field: "prefilling_requests", .. })), "{e:?}");
    let v3 = WorkerReport::decode(&encode_v3(&r)).expect("v3");
    assert_eq!(
        v3.pd,
        PdInfo { export_groups: 0, timing: StepTiming::default(), imports: vec![], ..pd_sample() }
    );
    let strings: usize = [&r.worker_id, &r.advertise_url, &r.model_id].iter().map(|s| 2 + s.len()).sum();
    let at = 8 + strings + 24 + 16 + 12 + 1 + 2 + r.pd.transfer_addr.len() + 4 + 2;
    for (offset, value, field) in
        [(16, 1.5f64, "stall_ratio"), (0, f64::NAN, "prefill_tokens_per_busy_s"), (8, -1.0, "decode_step_s")]
            .into_iter()
            .chain([(24, -2e-5, "prefill_per_token_s"), (32, f64::INFINITY, "prefill_attention_s")])
            .chain([(40, f64::NAN, "decode_base_s"), (48, -1e-3, "decode_per_seq_s")])
            .chain([(56, f64::NEG_INFINITY, "decode_per_kv_token_s")])
    {
        let mut bad = r.encode();
        bad[at + offset..at + offset + 8].copy_from_slice(&value.to_bits().to_le_bytes());
        let e = WorkerReport::decode(&bad);
        assert!(matches!(e, Err(ReportError::Invalid { field: f, .. }) if f == field), "{field}: {e:?}");
    }
    let mut bad = r.encode();
    bad[at + 64] = (MAX_IMPORT_PEERS + 1) as u8;
    assert!(matches!(WorkerReport::decode(&bad), Err(ReportError::Invalid { field: "imports", .. })));
    // The encoder never writes more peers than a decoder takes.
    r.pd.imports = vec![PeerImport::default(); MAX_IMPORT_PEERS + 5];
    assert_eq!(WorkerReport::decode(&r.encode()).expect("capped").pd.imports.len(), MAX_IMPORT_PEERS);
}

#[test]
fn the_prefill_decode_part_round_trips_and_older_reports_read_as_both() {
    let mut r = sample(10, 1);
    r.pd = PdInfo {
        role: Role::Prefill,
        transfer_addr: "10.0.0.7:9100".into(),
        kv_bytes_per_token: 131_072,
        ..PdInfo::default()
    };
    assert_eq!(WorkerReport::decode(&r.encode()).expect("v5"), r);
    let old = WorkerReport::decode(&encode_v2(&r)).expect("v2");
    assert_eq!(old.pd, PdInfo::default());
    assert_eq!(old.tiers, r.tiers);
    // An unknown role is refused.
    let mut bad = r.encode();
    let strings: usize = [&r.worker_id, &r.advertise_url, &r.model_id].iter().map(|s| 2 + s.len()).sum();
    bad[8 + strings + 24 + 16 + 12] = 9;
    assert!(matches!(WorkerReport::decode(&bad), Err(ReportError::Invalid { field: "role", .. })));
}

/// The version-1 encoding of `r` (no instance id or context length, flags 0), as older workers send it.
fn encode_v1(r: &WorkerReport) -> Vec<u8> {
    let v2 = encode_v4(r);
    // Header (8) + three strings + scheme (24) + seq/timestamp (16), then the v2-only 12 bytes.
    let strings: usize = [&r.worker_id, &r.advertise_url, &r.model_id].iter().map(|s| 2 + s.len()).sum();
    let cut = 8 + strings + 24 + 16;
    let pd = pd_len(r);
    let mut v1 = v2[..cut].to_vec();
    v1.extend_from_slice(&v2[cut + 12 + pd..]);
    v1[4..6].copy_from_slice(&1u16.to_le_bytes());
    v1[6..8].copy_from_slice(&0u16.to_le_bytes());
    v1
}

#[test]
fn version_1_reports_still_decode() {
    let r = sample(10, 1);
    let back = WorkerReport::decode(&encode_v1(&r)).expect("v1 decodes");
    assert_eq!(back.instance_id, 0);
    assert_eq!(back.max_model_len, 0);
    assert!(!back.draining);
    assert_eq!(back.tiers, r.tiers);
    assert_eq!(back.queue, QueueStats { prefill_area: 0, prefilling_requests: 0, ..r.queue });
    // A v1 report cannot say "draining": the bit is unknown there.
    let mut v1 = encode_v1(&r);
    v1[6] = 1;
    assert!(WorkerReport::decode(&v1).is_err());
}

#[test]
fn bloom_has_no_false_negatives_and_about_the_target_false_positives() {
    let r = WorkerReport::decode(&sample(10_000, 1).encode()).expect("decodes");
    let s = r.tier(Tier::Device).and_then(|t| t.summary.as_ref()).expect("summary");
    for i in 0..10_000u64 {
        assert!(s.bloom.contains(BlockHash(i.wrapping_mul(0x9E37_79B9_7F4A_7C15))));
    }
    let fp = (0..100_000u64).filter(|i| s.bloom.contains(BlockHash(i.wrapping_mul(31) + 1))).count();
    let rate = fp as f64 / 100_000.0;
    assert!(rate < 0.02, "false-positive rate {rate}");
}

#[test]
fn report_size_for_100k_blocks() {
    // The documented figure: 100K cached blocks at 1% false positives.
    let bytes = sample(100_000, 1).encode();
    let bloom = BlockBloom::with_capacity(100_000, 0.01).byte_len();
    assert_eq!(bloom, 119_814 + BLOOM_HEADER_BYTES);
    assert!(bytes.len() < bloom + 300, "report is {} bytes", bytes.len());
}

#[test]
fn matched_blocks_respects_granularity() {
    let hasher = BlockHasher::new(&HashScheme::new(16, 1), &ExtraKeys::none());
    let tokens: Vec<u32> = (0..16 * 10).collect();
    let hashes = hasher.hash_blocks(&tokens);
    let mut bloom = BlockBloom::with_capacity(100, 0.0001);
    // Cache the first 7 blocks, summarised every 4th block: only block index 3 is in the filter.
    for (i, h) in hashes.iter().enumerate().take(7) {
        if (i + 1) % 4 == 0 {
            bloom.insert(*h);
        }
    }
    let s = CacheSummary { granularity: 4, entries: 1, bloom };
    assert!(s.covers_block(3) && !s.covers_block(4));
    assert_eq!(s.matched_blocks(&hashes), 4);
    assert_eq!(s.matched_blocks(&hashes[..3]), 0);
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = sample(50, 1).encode();
    for n in 0..bytes.len() {
        assert!(WorkerReport::decode(&bytes[..n]).is_err(), "prefix of {n} bytes decoded");
    }
}

#[test]
fn trailing_bytes_bad_magic_version_and_values_are_errors() {
    let good = sample(10, 1).encode();
    let mut extra = good.clone();
    extra.push(0);
    assert_eq!(WorkerReport::decode(&extra), Err(ReportError::TrailingBytes(1)));
    let mut magic = good.clone();
    magic[0] = b'X';
    assert_eq!(WorkerReport::decode(&magic), Err(ReportError::BadMagic));
    let mut version = good.clone();
    version[4] = 9;
    assert_eq!(WorkerReport::decode(&version), Err(ReportError::UnsupportedVersion(9)));

    let mut r = sample(10, 1);
    r.throughput.decode_tokens_per_s = f64::NAN;
    assert!(matches!(WorkerReport::decode(&r.encode()), Err(ReportError::Invalid { .. })));
    let mut r = sample(10, 1);
    r.tiers[0].blocks_free = r.tiers[0].blocks_total + 1;
    assert!(matches!(WorkerReport::decode(&r.encode()), Err(ReportError::Invalid { .. })));
    let mut r = sample(10, 1);
    r.tiers[1].tier = Tier::Device;
    assert!(matches!(WorkerReport::decode(&r.encode()), Err(ReportError::Invalid { .. })));
    let mut r = sample(10, 0);
    r.tiers[0].summary.as_mut().expect("summary").granularity = 0;
    assert!(matches!(WorkerReport::decode(&r.encode()), Err(ReportError::Invalid { .. })));
    let mut r = sample(10, 1);
    r.worker_id.clear();
    assert!(matches!(WorkerReport::decode(&r.encode()), Err(ReportError::Invalid { .. })));
}

/// Offset of the Bloom header inside `sample(n, 1).encode()`: everything before the device tier's filter.
fn bloom_offset(bytes: &[u8], bloom_len: usize) -> usize {
    // The host tier (26 bytes: tier + 3 x u64 + has_summary) follows the device filter.
    bytes.len() - 26 - bloom_len
}

#[test]
fn hostile_bloom_headers_are_errors_not_panics_or_hangs() {
    let r = sample(10, 1);
    let bloom_len = r.tiers[0].summary.as_ref().expect("summary").bloom.byte_len();
    let good = r.encode();
    let at = bloom_offset(&good, bloom_len);
    assert_eq!(good[at], 1, "bloom format version byte");
    // A huge hash-function count (would make every lookup loop 4 billion times).
    let mut k = good.clone();
    k[at + 9..at + 13].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(WorkerReport::decode(&k), Err(ReportError::Invalid { field: "bloom", .. })));
    // Zero hash functions.
    let mut k0 = good.clone();
    k0[at + 9..at + 13].copy_from_slice(&0u32.to_le_bytes());
    assert!(WorkerReport::decode(&k0).is_err());
    // A bitmap length that disagrees with the bytes carried.
    let mut len = good.clone();
    len[at + 1..at + 9].copy_from_slice(&1u64.to_le_bytes());
    assert!(WorkerReport::decode(&len).is_err());
    // An empty bitmap (would divide by zero on lookup).
    assert!(BlockBloom::from_bytes(&good[at..at + BLOOM_HEADER_BYTES]).is_err());
}

#[test]
fn oversized_input_is_refused_before_decoding() {
    let big = vec![0u8; MAX_REPORT_BYTES + 1];
    assert_eq!(WorkerReport::decode(&big), Err(ReportError::TooLarge(MAX_REPORT_BYTES + 1)));
}

#[test]
fn overlong_strings_are_cut_on_encode_and_still_decode() {
    let mut r = sample(1, 1);
    r.model_id = "é".repeat(MAX_STRING_BYTES);
    let back = WorkerReport::decode(&r.encode()).expect("decodes");
    assert!(back.model_id.len() <= MAX_STRING_BYTES);
    assert!(back.model_id.chars().all(|c| c == 'é'));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn fast_match_equals_linear_match(cached in 0usize..300, total in 0usize..300, g in 1u32..6) {
        let hasher = BlockHasher::new(&HashScheme::new(16, 1), &ExtraKeys::none());
        let tokens: Vec<u32> = (0..16 * total as u32).collect();
        let hashes = hasher.hash_blocks(&tokens);
        let mut bloom = BlockBloom::with_capacity(300, 1e-9);
        for (i, h) in hashes.iter().enumerate().take(cached) {
            if (i + 1) % g as usize == 0 {
                bloom.insert(*h);
            }
        }
        let s = CacheSummary { granularity: g, entries: 0, bloom };
        prop_assert_eq!(s.matched_blocks_fast(&hashes), s.matched_blocks(&hashes));
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = WorkerReport::decode(&bytes);
    }

    #[test]
    fn mutated_reports_never_panic(pos in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<prop::sample::Index>()) {
        let mut bytes = sample(20, 2).encode();
        let i = pos.index(bytes.len());
        bytes[i] = byte;
        let end = cut.index(bytes.len() + 1);
        if let Ok(r) = WorkerReport::decode(&bytes[..end]) {
            // Whatever decodes re-encodes to the same bytes (no silent reinterpretation); a version byte mutated
            // to 1 re-encodes as version 2.
            if bytes[4..6] == REPORT_VERSION.to_le_bytes() {
                prop_assert_eq!(r.encode(), bytes[..end].to_vec());
            }
        }
    }
}
