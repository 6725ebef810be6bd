//! The SSD tier's file format: segment files of block records, each self-describing and checksummed, so the index
//! can be rebuilt from the files at start (a warm restart) and a torn or corrupt record is never served.
//!
//! A record: a 72-byte header, then the block's token ids (u32 LE) and its K/V bytes.
//! ```text
//! 0  magic "KVGB"        4  version u16 (1)     6  flags u16 (bit 0: has a parent)
//! 8  scheme fingerprint  16 chained hash        24 parent's chained hash   32 chain check   (u64 LE each)
//! 40 position u32        44 token count u32     48 digest of the token ids u64 (xxh3)
//! 56 payload length u32  60 reserved u32        64 checksum u64: xxh3 of bytes 0..64 (checksum zeroed), tokens, payload
//! ```
//! A file is named `seg-<number>.kvd`; records are appended, never rewritten in place.

use kvgate_shared::hashing::BlockHash;
use xxhash_rust::xxh3::xxh3_64;

pub const MAGIC: [u8; 4] = *b"KVGB";
pub const VERSION: u16 = 1;
pub const HEADER_BYTES: usize = 72;
/// Longest record accepted when reading (a header claiming more is corrupt).
pub const MAX_RECORD_BYTES: usize = 256 << 20;

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

/// Why bytes are not a record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bad {
    /// Fewer bytes than the header or its lengths say: a torn write at the end of a file.
    Truncated,
    /// Not a record header (no magic, unknown version, absurd lengths): nothing after it can be trusted.
    Garbage,
    /// A whole record whose checksum or token digest does not match: skipped, the next one may be fine.
    Corrupt { len: usize },
    /// Written for another hash scheme or KV layout.
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
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
        out.extend_from_slice(&tb);
        out.extend_from_slice(&self.payload);
        let sum = xxh3_64(&out);
        out[64..72].copy_from_slice(&sum.to_le_bytes());
        out
    }

    /// The whole length of the record whose header starts `b` (`None`: not a plausible header).
    pub fn length(b: &[u8]) -> Result<usize, Bad> {
        if b.len() < HEADER_BYTES {
            return Err(Bad::Truncated);
        }
        if b[0..4] != MAGIC || u16::from_le_bytes([b[4], b[5]]) != VERSION {
            return Err(Bad::Garbage);
        }
        let len = HEADER_BYTES + 4 * u32_at(b, 44) as usize + u32_at(b, 56) as usize;
        if len > MAX_RECORD_BYTES {
            return Err(Bad::Garbage);
        }
        Ok(len)
    }

    /// Decodes one record from the start of `b` (which may hold more), checking it for `fingerprint`.
    pub fn decode(b: &[u8], fingerprint: u64) -> Result<(Record, usize), Bad> {
        let len = Self::length(b)?;
        if b.len() < len {
            return Err(Bad::Truncated);
        }
        let r = &b[..len];
        let mut zeroed = r.to_vec();
        zeroed[64..72].fill(0);
        let n_tokens = u32_at(r, 44) as usize;
        let tb = &r[HEADER_BYTES..HEADER_BYTES + 4 * n_tokens];
        if xxh3_64(&zeroed) != u64_at(r, 64) || xxh3_64(tb) != u64_at(r, 48) {
            return Err(Bad::Corrupt { len });
        }
        if u64_at(r, 8) != fingerprint {
            return Err(Bad::OtherScheme { len });
        }
        let has_parent = u16::from_le_bytes([r[6], r[7]]) & 1 == 1;
        let record = Record {
            fingerprint,
            hash: BlockHash(u64_at(r, 16)),
            parent: has_parent.then(|| BlockHash(u64_at(r, 24))),
            check: u64_at(r, 32),
            index: u32_at(r, 40),
            tokens: tb.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            payload: r[HEADER_BYTES + 4 * n_tokens..].to_vec(),
        };
        Ok((record, len))
    }
}

/// Every whole, valid record of a segment's bytes with its offset, and how many were corrupt or of another scheme;
/// scanning stops at a torn tail or at bytes that are no header.
pub fn scan(bytes: &[u8], fingerprint: u64) -> (Vec<(u64, usize, Record)>, u64) {
    let mut out = Vec::new();
    let mut bad = 0;
    let mut at = 0;
    while at < bytes.len() {
        match Record::decode(&bytes[at..], fingerprint) {
            Ok((r, len)) => {
                out.push((at as u64, len, r));
                at += len;
            }
            Err(Bad::Corrupt { len }) | Err(Bad::OtherScheme { len }) => {
                bad += 1;
                at += len;
            }
            Err(Bad::Truncated) | Err(Bad::Garbage) => {
                bad += 1;
                break;
            }
        }
    }
    (out, bad)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn records_round_trip_and_damage_is_found() {
        let mut file = Vec::new();
        for i in 0..4 {
            file.extend(rec(i).encode());
        }
        let (ok, bad) = scan(&file, 77);
        assert_eq!((ok.len(), bad), (4, 0));
        assert_eq!(ok[2].2, rec(2));
        assert_eq!(scan(&file, 78).0.len(), 0, "another scheme's records are never served");
        // A flipped payload byte in record 1: that record is skipped, the others survive.
        let len = rec(0).encode().len();
        let mut flipped = file.clone();
        flipped[len + HEADER_BYTES + 64 + 10] ^= 0x40;
        let (ok, bad) = scan(&flipped, 77);
        assert_eq!(ok.iter().map(|r| r.2.index).collect::<Vec<_>>(), vec![0, 2, 3]);
        assert_eq!(bad, 1);
        // A flipped token: the token digest and the checksum both catch it.
        let mut tok = file.clone();
        tok[HEADER_BYTES + 3] ^= 1;
        assert_eq!(scan(&tok, 77).0.len(), 3);
        // A torn tail: the whole records before it are kept.
        let torn = &file[..3 * len + 50];
        let (ok, bad) = scan(torn, 77);
        assert_eq!((ok.len(), bad), (3, 1));
        // A wrecked header stops the scan there.
        let mut wreck = file.clone();
        wreck[2 * len] = b'X';
        assert_eq!(scan(&wreck, 77).0.len(), 2);
    }
}
