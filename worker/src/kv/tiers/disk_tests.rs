//! The SSD tier on a real directory: writes off the caller's thread, the index rebuilt at start, damaged records
//! never served, capacity held under a storm of writes.

use std::sync::Arc;

use kvgate_shared::hashing::BlockHash;

use super::disk::{DiskTier, SEGMENT_BYTES};
use super::host::HostInsert;

const FP: u64 = 0xfeed;

/// Block `i` of chain `c` (parent: block `i - 1` of the same chain), 64 bytes of K/V.
fn block(c: u64, i: u32) -> HostInsert<Arc<[u8]>> {
    HostInsert {
        hash: BlockHash(c * 1_000 + u64::from(i) + 1),
        check: c * 7 + u64::from(i),
        index: i,
        tokens: vec![i; 4].into(),
        payload: Arc::from(vec![(c as u8).wrapping_add(i as u8); 64]),
        parent: (i > 0).then(|| BlockHash(c * 1_000 + u64::from(i))),
    }
}

fn read(d: &DiskTier, c: u64, i: u32) -> Option<Vec<u8>> {
    let b = block(c, i);
    d.read(b.hash, b.check, b.index, &b.tokens)
}

#[test]
fn blocks_survive_a_restart_and_damage_is_never_served() {
    let dir = tempfile::tempdir().expect("tmp");
    {
        let d = DiskTier::open(dir.path(), 1 << 20, 64, 4, FP).expect("open");
        for c in 0..3 {
            for i in 0..5 {
                d.write(block(c, i), i > 0);
            }
        }
        d.flush();
        assert_eq!(d.counters().written_blocks, 15);
        assert_eq!(read(&d, 1, 3).expect("served"), vec![4u8; 64]);
        let mut wrong = block(1, 3);
        wrong.check += 1;
        assert!(
            d.read(wrong.hash, wrong.check, 3, &wrong.tokens).is_none(),
            "another chain check: not served"
        );
    }
    // A warm restart: the index comes back from the files.
    let d = DiskTier::open(dir.path(), 1 << 20, 64, 4, FP).expect("reopen");
    assert_eq!(d.counters().recovered_blocks, 15);
    assert_eq!(read(&d, 2, 4).expect("served after a restart"), vec![6u8; 64]);
    drop(d);
    // Another hash scheme or KV layout finds nothing it may serve.
    assert_eq!(
        DiskTier::open(dir.path(), 1 << 20, 64, 4, FP + 1).expect("open").counters().recovered_blocks,
        0
    );
}

#[test]
fn flipped_bytes_and_torn_segments_are_skipped_and_the_rest_is_served() {
    let dir = tempfile::tempdir().expect("tmp");
    {
        let d = DiskTier::open(dir.path(), 1 << 20, 64, 4, FP).expect("open");
        for c in 0..4 {
            for i in 0..4 {
                d.write(block(c, i), i > 0);
            }
        }
        d.flush();
    }
    let seg = std::fs::read_dir(dir.path())
        .expect("dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.len() > 0))
        .expect("a segment with records");
    let mut bytes = std::fs::read(&seg).expect("read");
    let record = bytes.len() / 16;
    // Chain 1's second block (record 5): one payload byte flipped. The last record: cut in half.
    bytes[5 * record + record - 3] ^= 0x10;
    bytes.truncate(15 * record + record / 2);
    std::fs::write(&seg, &bytes).expect("write");
    let d = DiskTier::open(dir.path(), 1 << 20, 64, 4, FP).expect("reopen");
    // The rebuild reads headers only: the tear is found now, the flipped payload at its first read.
    assert_eq!(d.counters().corrupt_blocks, 1, "{:?}", d.counters());
    assert!(read(&d, 1, 1).is_none(), "the flipped record is not served");
    assert_eq!(d.counters().corrupt_blocks, 2, "{:?}", d.counters());
    assert!(read(&d, 1, 2).is_none() && read(&d, 1, 3).is_none(), "nor what hangs below it");
    assert!(read(&d, 3, 3).is_none(), "the torn record is not served");
    assert_eq!(read(&d, 3, 2).expect("the record before the tear"), vec![5u8; 64]);
    for i in 0..4 {
        assert_eq!(read(&d, 0, i).expect("untouched chain"), vec![i as u8; 64]);
    }
    assert_eq!(read(&d, 1, 0).expect("the parent of the flipped one"), vec![1u8; 64]);
    // Damage found at a read (after start): the block is forgotten, never served.
    drop(d);
    let d = DiskTier::open(dir.path(), 1 << 20, 64, 4, FP).expect("reopen");
    let seg_bytes = std::fs::read(&seg).expect("read");
    let mut bad = seg_bytes.clone();
    bad[2 * record + record - 1] ^= 1;
    std::fs::write(&seg, &bad).expect("write");
    assert!(read(&d, 0, 2).is_none(), "bytes that changed on disk are caught at the read");
    assert!(read(&d, 0, 2).is_none(), "and forgotten");
    assert!(d.counters().corrupt_blocks >= 1);
}

#[test]
fn a_storm_of_writes_stays_within_capacity() {
    let dir = tempfile::tempdir().expect("tmp");
    // Records of 64 KiB payloads, a 1 MiB tier (about 15 records): many more written.
    let payload = 64 << 10;
    let d = DiskTier::open(dir.path(), 1 << 20, payload, 4, FP).expect("open");
    for c in 0..200u64 {
        let mut b = block(c, 0);
        b.payload = Arc::from(vec![c as u8; payload]);
        d.write(b, false);
    }
    d.flush();
    let held = d.index().len();
    assert!(held > 0 && held <= d.index().capacity_blocks(), "{held} blocks held");
    assert!(d.file_bytes() <= (1 << 20) + 3 * SEGMENT_BYTES, "{} bytes of files", d.file_bytes());
    // The newest survive, the oldest went.
    let mut newest = block(199, 0);
    newest.payload = Arc::from(vec![199u8; payload]);
    assert_eq!(d.read(newest.hash, newest.check, 0, &newest.tokens).expect("newest"), vec![199u8; payload]);
    let oldest = block(0, 0);
    assert!(d.read(oldest.hash, oldest.check, 0, &oldest.tokens).is_none());
}

#[test]
fn a_write_that_fails_part_way_leaves_no_torn_record_and_shifts_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    {
        let d = DiskTier::open(dir.path(), 1 << 20, 64, 4, FP).expect("open");
        for i in 0..3 {
            d.write(block(0, i), i > 0);
        }
        d.flush();
        // The disk fills up half-way through the next record, then frees up again.
        d.fail_next_write_after(40);
        d.write(block(0, 3), true);
        d.flush();
        assert_eq!(d.counters().dropped_writes, 1);
        for i in 4..8 {
            d.write(block(0, i), true);
        }
        d.flush();
        // Everything after the failure is where the index says it is.
        for i in 0..3 {
            assert_eq!(read(&d, 0, i).expect("before"), vec![i as u8; 64]);
        }
        assert!(read(&d, 0, 3).is_none(), "never written");
        for i in 4..8 {
            assert_eq!(read(&d, 0, i).expect("after: at the offsets the index holds"), vec![i as u8; 64]);
        }
        assert_eq!(d.counters().corrupt_blocks, 0);
    }
    // No torn bytes anywhere: a restart finds every whole record and nothing damaged.
    let d = DiskTier::open(dir.path(), 1 << 20, 64, 4, FP).expect("reopen");
    assert_eq!(d.counters().corrupt_blocks, 0, "{:?}", d.counters());
    assert_eq!(d.counters().recovered_blocks, 3, "the chain stops at the block never written");
    for entry in std::fs::read_dir(dir.path()).expect("dir").filter_map(|e| e.ok()) {
        let len = entry.metadata().expect("meta").len();
        let name = entry.file_name().into_string().expect("name");
        if name.ends_with(".kvd") {
            let record = super::segment::Record::decode(&std::fs::read(entry.path()).expect("read"), FP);
            assert!(len == 0 || record.is_ok(), "{name}: {len} bytes, {record:?}");
        }
    }
}

#[test]
fn the_directory_is_the_workers_alone() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("tier");
    let d = DiskTier::open(&path, 1 << 20, 64, 4, FP).expect("open");
    d.write(block(0, 0), false);
    d.flush();
    let mode = |p: &std::path::Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o700);
    for entry in std::fs::read_dir(&path).expect("dir").filter_map(|e| e.ok()) {
        assert_eq!(mode(&entry.path()), 0o600, "{:?}", entry.file_name());
    }
    // A second tier on the same directory is refused while the first is open (after the lock wait).
    let err = DiskTier::open(&path, 1 << 20, 64, 4, FP).expect_err("locked");
    assert!(err.contains("in use by another worker"), "{err}");
    drop(d);
    DiskTier::open(&path, 1 << 20, 64, 4, FP).expect("free again once the first is closed");
}
