//! The SSD tier's file format: segment files of block records, each self-describing and checksummed, so the index
//! can be rebuilt from the files at start (a warm restart) and a torn or corrupt record is never served.
//!
//! A record: a 72-byte header, then the block's token ids (u32 LE) and its K/V bytes.
//! ```text
//! 0  magic "KVGB"        4  version u16 (2)     6  flags u16 (bit 0: has a parent)
//! 8  tier fingerprint    16 chained hash        24 parent's chained hash   32 chain check   (u64 LE each)
//! 40 position u32        44 token count u32     48 digest of the token ids u64 (xxh3)
//! 56 payload length u32  60 header check u32: low half of xxh3 of bytes 0..60 and the token ids
//! 64 checksum u64: xxh3 of bytes 0..64 (checksum zeroed), tokens, payload
//! ```
//! The header check lets the index be rebuilt from headers and token ids alone ([`scan`]: the payloads are
//! skipped, so a restart reads a few bytes a block and holds no payload, whatever the tier's size); the whole
//! checksum is verified when a block is read back ([`Record::decode`]), so a damaged payload is still never served.
//! A file is named `seg-<number>.kvd`; records are appended, never rewritten in place.

use std::io::{BufReader, Read, Seek};

use kvgate_shared::hashing::BlockHash;
use xxhash_rust::xxh3::xxh3_64;

pub const MAGIC: [u8; 4] = *b"KVGB";
/// 2: the header check (1 had none; its records are not read).
pub const VERSION: u16 = 2;
pub const HEADER_BYTES: usize = 72;
/// Longest record accepted when reading (a header claiming more is corrupt).
pub const MAX_RECORD_BYTES: usize = 256 << 20;
/// Read buffer of a rebuild scan.
pub const SCAN_BUFFER_BYTES: usize = 64 << 10;

/// One block as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub fingerprint: u64,
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub check: u64,
    pub index: u32,
    pub tokens: Vec<u32>,
    pub payload: Vec<u8>,
}

/// A record without its payload: what the index needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub check: u64,
    pub index: u32,
    pub tokens: Vec<u32>,
}

/// Why bytes are not a record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bad {
    /// Fewer bytes than the header or its lengths say: a torn write at the end of a file.
    Truncated,
    /// Not a record header (no magic, unknown version, absurd lengths): nothing after it can be trusted.
    Garbage,
    /// A whole record whose checks do not match: skipped, the next one may be fine.
    Corrupt { len: usize },
    /// Written for another hash scheme, model or KV layout.
    OtherScheme { len: usize },
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn tokens_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// The header check of a header's first 60 bytes and the token bytes.
fn header_check(head: &[u8], tokens: &[u8]) -> u32 {
    let mut buf = Vec::with_capacity(60 + tokens.len());
    buf.extend_from_slice(&head[..60]);
    buf.extend_from_slice(tokens);
    xxh3_64(&buf) as u32
}

/// The whole length of the record whose header is `h` (`Err`: not a plausible header).
fn plausible(h: &[u8]) -> Result<usize, Bad> {
    if h.len() < HEADER_BYTES {
        return Err(Bad::Truncated);
    }
    if h[0..4] != MAGIC || u16::from_le_bytes([h[4], h[5]]) != VERSION {
        return Err(Bad::Garbage);
    }
    let len = HEADER_BYTES + 4 * u32_at(h, 44) as usize + u32_at(h, 56) as usize;
    if len > MAX_RECORD_BYTES {
        return Err(Bad::Garbage);
    }
    Ok(len)
}

/// Checks a header and its token bytes for `fingerprint`; the record's length and what the index needs.
fn meta(h: &[u8], tb: &[u8], fingerprint: u64) -> Result<(Meta, usize), Bad> {
    let len = plausible(h)?;
    if header_check(h, tb) != u32_at(h, 60) || xxh3_64(tb) != u64_at(h, 48) {
        return Err(Bad::Corrupt { len });
    }
    if u64_at(h, 8) != fingerprint {
        return Err(Bad::OtherScheme { len });
    }
    let has_parent = u16::from_le_bytes([h[6], h[7]]) & 1 == 1;
    let m = Meta {
        hash: BlockHash(u64_at(h, 16)),
        parent: has_parent.then(|| BlockHash(u64_at(h, 24))),
        check: u64_at(h, 32),
        index: u32_at(h, 40),
        tokens: tb.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    };
    Ok((m, len))
}

impl Record {
    /// The record's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let tb = tokens_bytes(&self.tokens);
        let mut out = Vec::with_capacity(HEADER_BYTES + tb.len() + self.payload.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&u16::from(self.parent.is_some()).to_le_bytes());
        out.extend_from_slice(&self.fingerprint.to_le_bytes());
        out.extend_from_slice(&self.hash.0.to_le_bytes());
        out.extend_from_slice(&self.parent.map_or(0, |p| p.0).to_le_bytes());
        out.extend_from_slice(&self.check.to_le_bytes());
        out.extend_from_slice(&self.index.to_le_bytes());
        out.extend_from_slice(&(self.tokens.len() as u32).to_le_bytes());
        out.extend_from_slice(&xxh3_64(&tb).to_le_bytes());
        out.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        let check = header_check(&out, &tb);
        out.extend_from_slice(&check.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
        out.extend_from_slice(&tb);
        out.extend_from_slice(&self.payload);
        let sum = xxh3_64(&out);
        out[64..72].copy_from_slice(&sum.to_le_bytes());
        out
    }

    /// Decodes one whole record from the start of `b` (which may hold more), checking all of it for
    /// `fingerprint`.
    pub fn decode(b: &[u8], fingerprint: u64) -> Result<(Record, usize), Bad> {
        let (m, payload, len) = Self::verify(b, fingerprint)?;
        let record = Record {
            fingerprint,
            hash: m.hash,
            parent: m.parent,
            check: m.check,
            index: m.index,
            tokens: m.tokens,
            payload: b[payload].to_vec(),
        };
        Ok((record, len))
    }

    /// Checks a record at the start of `b` (header, token ids, whole checksum) without copying it: its index
    /// entry, where its payload is in `b`, and its length.
    pub fn verify(b: &[u8], fingerprint: u64) -> Result<(Meta, std::ops::Range<usize>, usize), Bad> {
        let len = plausible(b)?;
        if b.len() < len {
            return Err(Bad::Truncated);
        }
        let r = &b[..len];
        let n_tokens = u32_at(r, 44) as usize;
        let tb = &r[HEADER_BYTES..HEADER_BYTES + 4 * n_tokens];
        let (m, _) = meta(r, tb, fingerprint)?;
        // The checksum covers the record with its own 8 bytes zeroed.
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(&r[..64]);
        h.update(&[0u8; 8]);
        h.update(&r[72..]);
        if h.digest() != u64_at(r, 64) {
            return Err(Bad::Corrupt { len });
        }
        Ok((m, HEADER_BYTES + 4 * n_tokens..len, len))
    }
}

/// A record found by [`scan`]: its offset, length and index entry.
pub type Found = (u64, usize, Meta);

/// Every record of a segment of `len` bytes whose header and token ids check out for `fingerprint`, with its
/// offset, and how many were corrupt or of another scheme. Reads headers and token ids only (payloads are
/// skipped, [`SCAN_BUFFER_BYTES`] at a time), so memory does not grow with the segment; stops at a torn tail or
/// at bytes that are no header.
pub fn scan<R: Read + Seek>(file: R, len: u64, fingerprint: u64) -> std::io::Result<(Vec<Found>, u64)> {
    let mut r = BufReader::with_capacity(SCAN_BUFFER_BYTES, file);
    let (mut out, mut bad, mut at) = (Vec::new(), 0u64, 0u64);
    let mut head = [0u8; HEADER_BYTES];
    let mut tb = Vec::new();
    while at < len {
        if len - at < HEADER_BYTES as u64 {
            bad += 1; // a torn header
            break;
        }
        r.read_exact(&mut head)?;
        let rec_len = match plausible(&head) {
            Ok(l) => l,
            Err(_) => {
                bad += 1;
                break;
            }
        };
        if at + rec_len as u64 > len {
            bad += 1; // a torn record
            break;
        }
        tb.resize(4 * u32_at(&head, 44) as usize, 0);
        r.read_exact(&mut tb)?;
        let payload = rec_len - HEADER_BYTES - tb.len();
        match meta(&head, &tb, fingerprint) {
            Ok((m, l)) => out.push((at, l, m)),
            Err(_) => bad += 1,
        }
        r.seek_relative(payload as i64)?;
        at += rec_len as u64;
    }
    Ok((out, bad))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn rec(i: u32) -> Record {
        Record {
            fingerprint: 77,
            hash: BlockHash(1000 + u64::from(i)),
            parent: (i > 0).then(|| BlockHash(999 + u64::from(i))),
            check: 5 * u64::from(i),
            index: i,
            tokens: vec![i; 16],
            payload: vec![i as u8; 300],
        }
    }

    fn scan_bytes(b: &[u8], fp: u64) -> (Vec<Found>, u64) {
        scan(Cursor::new(b), b.len() as u64, fp).expect("in memory")
    }

    fn indexes(found: &[Found]) -> Vec<u32> {
        found.iter().map(|f| f.2.index).collect()
    }

    #[test]
    fn records_round_trip_and_damage_is_found() {
        let mut file = Vec::new();
        for i in 0..4 {
            file.extend(rec(i).encode());
        }
        let (ok, bad) = scan_bytes(&file, 77);
        assert_eq!((ok.len(), bad), (4, 0));
        let r2 = rec(2);
        assert_eq!(
            ok[2].2,
            Meta { hash: r2.hash, parent: r2.parent, check: r2.check, index: 2, tokens: r2.tokens }
        );
        let len = rec(0).encode().len();
        assert_eq!(Record::decode(&file[2 * len..], 77).expect("whole").0, rec(2));
        assert_eq!(scan_bytes(&file, 78).0.len(), 0, "another scheme's records are never served");
        // A flipped payload byte in record 1: the scan (headers only) keeps it; reading it back refuses it.
        let mut flipped = file.clone();
        flipped[len + HEADER_BYTES + 64 + 10] ^= 0x40;
        assert_eq!(scan_bytes(&flipped, 77).0.len(), 4);
        assert_eq!(Record::decode(&flipped[len..], 77), Err(Bad::Corrupt { len }));
        // A flipped token or header field: the header check catches it at the scan, the others survive.
        for at in [HEADER_BYTES + 3, 40, 17] {
            let mut tok = file.clone();
            tok[at] ^= 1;
            let (ok, bad) = scan_bytes(&tok, 77);
            assert_eq!((indexes(&ok), bad), (vec![1, 2, 3], 1), "byte {at}");
        }
        // A torn tail: the whole records before it are kept.
        let torn = &file[..3 * len + 50];
        let (ok, bad) = scan_bytes(torn, 77);
        assert_eq!((ok.len(), bad), (3, 1));
        let (ok, bad) = scan_bytes(&file[..3 * len + 30], 77);
        assert_eq!((ok.len(), bad), (3, 1), "a torn header");
        // A wrecked header stops the scan there.
        let mut wreck = file.clone();
        wreck[2 * len] = b'X';
        assert_eq!(scan_bytes(&wreck, 77).0.len(), 2);
        // Version 1 records (no header check) are not read.
        let mut v1 = file.clone();
        v1[4] = 1;
        assert_eq!(scan_bytes(&v1, 77), (vec![], 1));
    }

    #[test]
    fn a_scan_reads_headers_not_payloads() {
        // A reader that counts what it is asked for.
        struct Counting<'a>(Cursor<&'a [u8]>, u64);
        impl Read for Counting<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = self.0.read(buf)?;
                self.1 += n as u64;
                Ok(n)
            }
        }
        impl Seek for Counting<'_> {
            fn seek(&mut self, pos: std::io::SeekFrom) -> std::io::Result<u64> {
                self.0.seek(pos)
            }
        }
        let big = |i: u32| Record { payload: vec![7; 1 << 20], ..rec(i) };
        let file: Vec<u8> = (0..8).flat_map(|i| big(i).encode()).collect();
        let mut c = Counting(Cursor::new(&file[..]), 0);
        let (ok, bad) = scan(&mut c, file.len() as u64, 77).expect("scan");
        assert_eq!((ok.len(), bad), (8, 0));
        assert!(c.1 < 8 * (SCAN_BUFFER_BYTES as u64 + 200), "read {} of {} bytes", c.1, file.len());
    }
}
