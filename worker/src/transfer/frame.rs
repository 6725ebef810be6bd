//! The KV transfer wire format: length-prefixed frames on one TCP connection from a decode worker (which dials) to
//! a prefill worker's transfer listener. Pure encoding and decoding; no sockets.
//!
//! ```text
//! frame  = len: u32 LE (of kind + body) | kind: u8 | body
//! Hello  (D->P) version u16, transfer id u64, issued unix ms u64, fingerprint u64, block bytes u32, layers u16,
//!               layer group u16, max frame u32, from block u32, blocks u32, temperature f32, top_p f32, top_k u32,
//!               seed flag u8 + u64, extra keys (u32 len + bytes), prompt (u32 count + u32 LE ids), decode
//!               worker id (u16 len + UTF-8), the gateway's prefill grant (u16 len + ASCII), mac [32]
//! Accept (P->D) transfer id, mac [32]            Refuse (P->D) transfer id, code u16, reason (u16 len + UTF-8)
//! Blocks (P->D) transfer id, first block u32, count u32, layer from u16, layer to u16, xxh3 u64, payload
//! Done   (P->D) transfer id, first token u32, prompt tokens u32, cached tokens u32
//! Progress (P->D, to a Hello of version >= PROGRESS_SINCE) transfer id, computed u32, through u32, eta ms u32:
//!               the export's prefill has computed `computed` prompt tokens and now computes up to `through`,
//!               expected to take `eta ms` (0: not measured yet)
//! Renew, Ack (D->P) transfer id                  Cancel (either) transfer id, reason (u16 len + UTF-8)
//! Probe  (D->P) transfer id, issued unix ms u64, bytes u32, max frame u32, mac [32]: a link-rate sample; P answers
//!               Accept, `bytes` of zeros as Blocks frames (block 0, layer 0..1) of at most max frame, then Done
//! ```
//!
//! Every link opens with a handshake of fixed-size messages, read before any frame (so nothing large is read from
//! a peer that has not proved it holds the key): the listener sends Challenge (`KVG1`, a fresh 16-byte nonce); the
//! dialer answers Open (its own nonce, and a MAC of both under the transfer key); the listener answers Opened (its
//! MAC of both): each side then knows the other holds the key, and both derive the link's session key from the two
//! nonces. Every frame after it is sealed: its length counts a 32-byte MAC after the body, keyed BLAKE3 under the
//! session key of (direction, the frame's sequence number in that direction, kind, body). A frame replayed from
//! another link, reordered, dropped or altered fails the next MAC and ends the link.
//!
//! Invariants: a decoder learns a frame's length from its 5-byte header and checks it against [`Limits`] for that
//! kind before it allocates anything; every malformed input is an error, never a panic; a Blocks payload is
//! exactly `count x (layer to - layer from) x layer bytes`, checked by the receiver against what it declared.

use xxhash_rust::xxh3::xxh3_64;

/// Version of this format (in the Challenge, and the least a Hello may name).
pub const VERSION: u16 = 2;
/// The Hello version this worker sends: a prefill worker answers a Hello of this version or later with Progress
/// frames (one of `VERSION` gets none, as before).
pub const PROGRESS_SINCE: u16 = 3;
/// Bytes of a frame header (length + kind).
pub const HEADER_BYTES: usize = 5;
/// Longest reason text in Refuse and Cancel.
pub const MAX_REASON_BYTES: usize = 256;
/// Longest decode worker id in Hello.
pub const MAX_DECODE_ID_BYTES: usize = kvgate_shared::handoff::MAX_WORKER_ID_BYTES;
/// Longest grant in Hello.
pub const MAX_GRANT_BYTES: usize = kvgate_shared::handoff::MAX_ASSERTION_BYTES;
/// Longest extra-keys field in Hello.
pub const MAX_EXTRA_KEY_BYTES: usize = 4096;
/// Most bytes a Probe may ask for (a sample of the link, not a way to make a prefill worker send without end).
pub const MAX_PROBE_BYTES: u32 = 32 << 20;
/// Bytes of the MAC that seals every frame after the handshake.
pub const SEAL_BYTES: usize = 32;
/// Bytes of a handshake nonce.
pub const NONCE_BYTES: usize = 16;
/// Bytes of the handshake messages: Challenge (magic, version, nonce), Open (nonce, MAC), Opened (MAC).
pub const CHALLENGE_BYTES: usize = 4 + 2 + NONCE_BYTES;
pub const OPEN_BYTES: usize = NONCE_BYTES + 32;
pub const OPENED_BYTES: usize = 32;
const CHALLENGE_MAGIC: &[u8; 4] = b"KVG1";
/// Longest frame that is neither Hello nor Blocks.
const MAX_CONTROL_FRAME: usize = 1 + 8 + 2 + 2 + MAX_REASON_BYTES + 64;
/// Fixed part of a Hello body (before extra keys and the prompt) and its MAC.
const HELLO_FIXED: usize = 2 + 8 + 8 + 8 + 4 + 2 + 2 + 4 + 4 + 4 + 4 + 4 + 4 + 1 + 8;
const MAC_BYTES: usize = 32;
/// Fixed part of a Blocks body before its payload.
pub const BLOCKS_FIXED: usize = 8 + 4 + 4 + 2 + 2 + 8;

const K_HELLO: u8 = 1;
const K_ACCEPT: u8 = 2;
const K_REFUSE: u8 = 3;
const K_BLOCKS: u8 = 4;
const K_DONE: u8 = 5;
const K_RENEW: u8 = 6;
const K_CANCEL: u8 = 7;
const K_ACK: u8 = 8;
const K_PROBE: u8 = 9;
const K_PROGRESS: u8 = 10;

/// How a prefill worker samples the first token (the decode worker samples the rest).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FirstToken {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: Option<u64>,
}

/// A decode worker's request for one prompt's KV.
#[derive(Clone, Debug, PartialEq)]
pub struct Hello {
    pub version: u16,
    pub transfer_id: u64,
    pub issued_ms: u64,
    /// What the KV bytes are valid for: hash scheme, weights, layout, block bytes (`Engine::tier_fingerprint`).
    pub fingerprint: u64,
    pub block_bytes: u32,
    pub layers: u16,
    /// Layers per Blocks frame while computing (0: whole blocks once their chunk is done).
    pub layer_group: u16,
    /// Largest Blocks payload the decode worker reads.
    pub max_frame: u32,
    /// The first block the decode worker lacks (it holds `0..from_block` already).
    pub from_block: u32,
    /// Blocks of the whole prompt (`ceil(prompt / block size)`).
    pub blocks: u32,
    pub sampling: FirstToken,
    /// `ExtraKeys::to_bytes` of the request's keys.
    pub extra_keys: Vec<u8>,
    pub prompt: Vec<u32>,
    /// The decode worker's id, as the grant names it.
    pub decode: String,
    /// The gateway's prefill grant for this prompt and decode worker (`kvgate_shared::handoff`).
    pub grant: String,
    pub mac: [u8; 32],
}

/// Part of the KV: blocks `first..first + count`, layers `layers.0..layers.1` of each.
#[derive(Clone, Debug, PartialEq)]
pub struct Blocks {
    pub transfer_id: u64,
    pub first: u32,
    pub count: u32,
    pub layers: (u16, u16),
    pub checksum: u64,
    pub payload: Vec<u8>,
}

/// The prefill side is done: every block is sent, here is the first token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    pub transfer_id: u64,
    pub first_token: u32,
    pub prompt_tokens: u32,
    /// Prompt tokens the prefill worker served from its own cache.
    pub cached_tokens: u32,
}

/// Why a prefill worker refused a Hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefuseCode {
    Unauthorized = 1,
    WrongModel = 2,
    Invalid = 3,
    Overloaded = 4,
    Failed = 5,
}

impl RefuseCode {
    fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            1 => Self::Unauthorized,
            2 => Self::WrongModel,
            3 => Self::Invalid,
            4 => Self::Overloaded,
            5 => Self::Failed,
            _ => return None,
        })
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::WrongModel => "wrong_model",
            Self::Invalid => "invalid",
            Self::Overloaded => "overloaded",
            Self::Failed => "failed",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    Hello(Box<Hello>),
    Accept { transfer_id: u64, mac: [u8; 32] },
    Refuse { transfer_id: u64, code: RefuseCode, reason: String },
    Blocks(Blocks),
    Done(Done),
    Renew { transfer_id: u64 },
    Cancel { transfer_id: u64, reason: String },
    Ack { transfer_id: u64 },
    Probe(Probe),
    Progress(Progress),
}

/// How far an export's prefill has got (see the module's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    pub transfer_id: u64,
    /// Prompt tokens computed (the prefill worker's cache hits count).
    pub computed: u32,
    /// Prompt tokens computed once the step now running ends.
    pub through: u32,
    /// What the prefill worker expects that step to take, in ms (0: it has not measured its prefill yet).
    pub eta_ms: u32,
}

/// A decode worker's request for `bytes` of padding, to time the link (`frame` module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    pub transfer_id: u64,
    pub issued_ms: u64,
    pub bytes: u32,
    pub max_frame: u32,
    pub mac: [u8; 32],
}

impl Probe {
    fn signed_bytes(&self) -> Vec<u8> {
        let mut b = b"probe".to_vec();
        b.extend_from_slice(&self.transfer_id.to_le_bytes());
        b.extend_from_slice(&self.issued_ms.to_le_bytes());
        b.extend_from_slice(&self.bytes.to_le_bytes());
        b.extend_from_slice(&self.max_frame.to_le_bytes());
        b
    }

    /// The MAC of this Probe under the transfer key.
    pub fn code(&self, key: &[u8; 32]) -> [u8; 32] {
        *blake3::keyed_hash(key, &self.signed_bytes()).as_bytes()
    }

    /// Whether the MAC verifies under `key` (constant time).
    pub fn verifies(&self, key: &[u8; 32]) -> bool {
        blake3::Hash::from(self.mac) == blake3::keyed_hash(key, &self.signed_bytes())
    }
}

/// What a reader accepts: anything longer is refused from the header, before it is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Longest prompt a Hello may carry.
    pub max_prompt_tokens: usize,
    /// Longest Blocks payload.
    pub max_payload: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("a frame of kind {kind} and {len} bytes is longer than allowed ({max})")]
    TooLong { kind: u8, len: usize, max: usize },
    #[error("a frame of kind {kind} ends early or has {extra} trailing bytes")]
    Malformed { kind: u8, extra: usize },
    #[error("a frame field is invalid: {0}")]
    Invalid(&'static str),
}

/// The kind and body length of a frame from its header, checked against `limits`.
pub fn decode_header(h: &[u8; HEADER_BYTES], limits: &Limits) -> Result<(u8, usize), FrameError> {
    let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    let kind = h[4];
    let max = match kind {
        K_HELLO => {
            HELLO_FIXED
                + 4
                + MAX_EXTRA_KEY_BYTES
                + 4
                + 4 * limits.max_prompt_tokens
                + 2
                + MAX_DECODE_ID_BYTES
                + 2
                + MAX_GRANT_BYTES
                + MAC_BYTES
        }
        K_BLOCKS => BLOCKS_FIXED + limits.max_payload,
        K_ACCEPT..=K_PROGRESS => MAX_CONTROL_FRAME,
        k => return Err(FrameError::UnknownKind(k)),
    } + 1
        + SEAL_BYTES;
    if len < 1 + SEAL_BYTES || len > max {
        return Err(FrameError::TooLong { kind, len, max });
    }
    Ok((kind, len - 1))
}

/// The Challenge a listener opens a link with.
pub fn challenge(nonce: &[u8; NONCE_BYTES]) -> [u8; CHALLENGE_BYTES] {
    let mut b = [0u8; CHALLENGE_BYTES];
    b[..4].copy_from_slice(CHALLENGE_MAGIC);
    b[4..6].copy_from_slice(&VERSION.to_le_bytes());
    b[6..].copy_from_slice(nonce);
    b
}

/// The listener's nonce from a Challenge; an error for another magic or version.
pub fn read_challenge(b: &[u8; CHALLENGE_BYTES]) -> Result<[u8; NONCE_BYTES], FrameError> {
    if &b[..4] != CHALLENGE_MAGIC {
        return Err(FrameError::Invalid("not a KV transfer listener"));
    }
    if u16::from_le_bytes([b[4], b[5]]) != VERSION {
        return Err(FrameError::Invalid("the listener speaks another version"));
    }
    Ok(b[6..].try_into().unwrap_or_default())
}

fn handshake_code(
    key: &[u8; 32],
    what: &[u8],
    listener: &[u8; NONCE_BYTES],
    dialer: &[u8; NONCE_BYTES],
) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(what);
    h.update(&VERSION.to_le_bytes());
    h.update(listener);
    h.update(dialer);
    *h.finalize().as_bytes()
}

/// The dialer's Open: its nonce and its proof of the key over both nonces.
pub fn open(key: &[u8; 32], listener: &[u8; NONCE_BYTES], dialer: &[u8; NONCE_BYTES]) -> [u8; OPEN_BYTES] {
    let mut b = [0u8; OPEN_BYTES];
    b[..NONCE_BYTES].copy_from_slice(dialer);
    b[NONCE_BYTES..].copy_from_slice(&handshake_code(key, b"open", listener, dialer));
    b
}

/// The dialer's nonce from its Open, if its MAC answers `listener`'s challenge under `key` (constant time).
pub fn verify_open(
    key: &[u8; 32],
    listener: &[u8; NONCE_BYTES],
    b: &[u8; OPEN_BYTES],
) -> Option<[u8; NONCE_BYTES]> {
    let dialer: [u8; NONCE_BYTES] = b[..NONCE_BYTES].try_into().ok()?;
    let mac: [u8; 32] = b[NONCE_BYTES..].try_into().ok()?;
    let want = blake3::Hash::from(handshake_code(key, b"open", listener, &dialer));
    (blake3::Hash::from(mac) == want).then_some(dialer)
}

/// The listener's Opened: its proof of the key over both nonces.
pub fn opened(
    key: &[u8; 32],
    listener: &[u8; NONCE_BYTES],
    dialer: &[u8; NONCE_BYTES],
) -> [u8; OPENED_BYTES] {
    handshake_code(key, b"opened", listener, dialer)
}

/// Whether an Opened answers the two nonces under `key` (constant time).
pub fn verify_opened(
    key: &[u8; 32],
    listener: &[u8; NONCE_BYTES],
    dialer: &[u8; NONCE_BYTES],
    b: &[u8; 32],
) -> bool {
    blake3::Hash::from(*b) == blake3::Hash::from(opened(key, listener, dialer))
}

/// The link's session key, from the transfer key and both nonces.
pub fn session_key(key: &[u8; 32], listener: &[u8; NONCE_BYTES], dialer: &[u8; NONCE_BYTES]) -> [u8; 32] {
    handshake_code(key, b"session", listener, dialer)
}

/// Which way a sealed frame goes (part of its MAC, so a frame cannot be reflected back to its sender).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    ToDialer = 0,
    ToListener = 1,
}

/// The MAC sealing frame `seq` going `dir`, over `parts` (the frame's kind and body, in order).
pub fn seal(session: &[u8; 32], dir: Direction, seq: u64, parts: &[&[u8]]) -> [u8; SEAL_BYTES] {
    let mut h = blake3::Hasher::new_keyed(session);
    h.update(&[dir as u8]);
    h.update(&seq.to_le_bytes());
    for p in parts {
        h.update(p);
    }
    *h.finalize().as_bytes()
}

/// An encoded frame ([`encode`], or [`blocks_head`] and its payload) sealed as frame `seq` going `dir`: its length
/// grows by the MAC, which follows its body. `payload`: bytes that follow `frame` on the wire (a Blocks payload
/// sent without a copy; empty otherwise). Returns the head to send before `payload` and the MAC to send after it.
pub fn seal_frame(
    session: &[u8; 32],
    dir: Direction,
    seq: u64,
    mut frame: Vec<u8>,
    payload: &[u8],
) -> (Vec<u8>, [u8; SEAL_BYTES]) {
    let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize + SEAL_BYTES;
    frame[..4].copy_from_slice(&(len as u32).to_le_bytes());
    let mac = seal(session, dir, seq, &[&frame[4..], payload]);
    (frame, mac)
}

/// A sealed frame's body (as [`decode_header`] sized it: the body then its MAC) checked as frame `seq` going `dir`,
/// then decoded.
pub fn open_frame(
    session: &[u8; 32],
    dir: Direction,
    seq: u64,
    kind: u8,
    sealed: &[u8],
) -> Result<Frame, FrameError> {
    let Some(at) = sealed.len().checked_sub(SEAL_BYTES) else {
        return Err(FrameError::Malformed { kind, extra: 0 });
    };
    let (body, mac) = sealed.split_at(at);
    let mac: [u8; SEAL_BYTES] = mac.try_into().unwrap_or_default();
    if !unseal(session, dir, seq, &[&[kind], body], &mac) {
        return Err(FrameError::Invalid("the frame's MAC does not verify"));
    }
    decode_body(kind, body)
}

/// Whether `mac` seals `parts` as frame `seq` going `dir` (constant time).
pub fn unseal(session: &[u8; 32], dir: Direction, seq: u64, parts: &[&[u8]], mac: &[u8; SEAL_BYTES]) -> bool {
    blake3::Hash::from(*mac) == blake3::Hash::from(seal(session, dir, seq, parts))
}

struct Reader<'a> {
    b: &'a [u8],
    kind: u8,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.b.len() < n {
            return Err(FrameError::Malformed { kind: self.kind, extra: 0 });
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap_or_default()))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn f32(&mut self) -> Result<f32, FrameError> {
        Ok(f32::from_bits(self.u32()?))
    }
    fn mac(&mut self) -> Result<[u8; 32], FrameError> {
        Ok(self.take(MAC_BYTES)?.try_into().unwrap_or_default())
    }
    fn reason(&mut self) -> Result<String, FrameError> {
        let n = self.u16()? as usize;
        if n > MAX_REASON_BYTES {
            return Err(FrameError::Invalid("reason too long"));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| FrameError::Invalid("reason is not UTF-8"))
    }
    fn text(&mut self, max: usize, what: &'static str) -> Result<String, FrameError> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(FrameError::Invalid(what));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| FrameError::Invalid(what))
    }
    fn end(self) -> Result<(), FrameError> {
        match self.b.len() {
            0 => Ok(()),
            extra => Err(FrameError::Malformed { kind: self.kind, extra }),
        }
    }
}

/// A frame from its kind and body (as [`decode_header`] sized it).
pub fn decode_body(kind: u8, body: &[u8]) -> Result<Frame, FrameError> {
    let mut r = Reader { b: body, kind };
    let frame = match kind {
        K_HELLO => Frame::Hello(Box::new(hello(&mut r)?)),
        K_ACCEPT => Frame::Accept { transfer_id: r.u64()?, mac: r.mac()? },
        K_REFUSE => {
            let transfer_id = r.u64()?;
            let code = RefuseCode::from_u16(r.u16()?).ok_or(FrameError::Invalid("refuse code"))?;
            Frame::Refuse { transfer_id, code, reason: r.reason()? }
        }
        K_BLOCKS => {
            let (transfer_id, first, count) = (r.u64()?, r.u32()?, r.u32()?);
            let layers = (r.u16()?, r.u16()?);
            let checksum = r.u64()?;
            let payload = std::mem::take(&mut r.b).to_vec();
            if layers.0 >= layers.1 || count == 0 {
                return Err(FrameError::Invalid("empty block or layer range"));
            }
            if xxh3_64(&payload) != checksum {
                return Err(FrameError::Invalid("payload checksum"));
            }
            Frame::Blocks(Blocks { transfer_id, first, count, layers, checksum, payload })
        }
        K_DONE => Frame::Done(Done {
            transfer_id: r.u64()?,
            first_token: r.u32()?,
            prompt_tokens: r.u32()?,
            cached_tokens: r.u32()?,
        }),
        K_RENEW => Frame::Renew { transfer_id: r.u64()? },
        K_CANCEL => Frame::Cancel { transfer_id: r.u64()?, reason: r.reason()? },
        K_ACK => Frame::Ack { transfer_id: r.u64()? },
        K_PROBE => Frame::Probe(Probe {
            transfer_id: r.u64()?,
            issued_ms: r.u64()?,
            bytes: r.u32()?,
            max_frame: r.u32()?,
            mac: r.mac()?,
        }),
        K_PROGRESS => Frame::Progress(Progress {
            transfer_id: r.u64()?,
            computed: r.u32()?,
            through: r.u32()?,
            eta_ms: r.u32()?,
        }),
        k => return Err(FrameError::UnknownKind(k)),
    };
    r.end()?;
    Ok(frame)
}

fn hello(r: &mut Reader<'_>) -> Result<Hello, FrameError> {
    let version = r.u16()?;
    let (transfer_id, issued_ms, fingerprint) = (r.u64()?, r.u64()?, r.u64()?);
    let (block_bytes, layers, layer_group, max_frame) = (r.u32()?, r.u16()?, r.u16()?, r.u32()?);
    let (from_block, blocks) = (r.u32()?, r.u32()?);
    let (temperature, top_p, top_k) = (r.f32()?, r.f32()?, r.u32()?);
    let (has_seed, seed) = (r.u8()?, r.u64()?);
    let n_keys = r.u32()? as usize;
    if n_keys > MAX_EXTRA_KEY_BYTES {
        return Err(FrameError::Invalid("extra keys too long"));
    }
    let extra_keys = r.take(n_keys)?.to_vec();
    let n = r.u32()? as usize;
    // The header check bounded the body, so `n` ids fit in what was read if this take succeeds.
    let ids = r.take(n.checked_mul(4).ok_or(FrameError::Invalid("prompt length"))?)?;
    let prompt = ids.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let decode = r.text(MAX_DECODE_ID_BYTES, "decode worker id")?;
    let grant = r.text(MAX_GRANT_BYTES, "grant")?;
    let mac = r.mac()?;
    let seed = match (has_seed, seed) {
        (0, 0) => None,
        (1, s) => Some(s),
        _ => return Err(FrameError::Invalid("seed flag")),
    };
    let sampling = FirstToken { temperature, top_p, top_k, seed };
    Ok(Hello {
        version,
        transfer_id,
        issued_ms,
        fingerprint,
        block_bytes,
        layers,
        layer_group,
        max_frame,
        from_block,
        blocks,
        sampling,
        extra_keys,
        prompt,
        decode,
        grant,
        mac,
    })
}

fn with_header(kind: u8, body: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + body.len());
    out.extend_from_slice(&((body.len() + 1) as u32).to_le_bytes());
    out.push(kind);
    out.extend_from_slice(&body);
    out
}

fn put_reason(b: &mut Vec<u8>, reason: &str) {
    let mut end = reason.len().min(MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    b.extend_from_slice(&(end as u16).to_le_bytes());
    b.extend_from_slice(&reason.as_bytes()[..end]);
}

impl Hello {
    /// The body without its MAC: what the MAC covers.
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HELLO_FIXED + 8 + self.extra_keys.len() + 4 * self.prompt.len());
        b.extend_from_slice(&self.version.to_le_bytes());
        for v in [self.transfer_id, self.issued_ms, self.fingerprint] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.block_bytes.to_le_bytes());
        b.extend_from_slice(&self.layers.to_le_bytes());
        b.extend_from_slice(&self.layer_group.to_le_bytes());
        b.extend_from_slice(&self.max_frame.to_le_bytes());
        b.extend_from_slice(&self.from_block.to_le_bytes());
        b.extend_from_slice(&self.blocks.to_le_bytes());
        b.extend_from_slice(&self.sampling.temperature.to_bits().to_le_bytes());
        b.extend_from_slice(&self.sampling.top_p.to_bits().to_le_bytes());
        b.extend_from_slice(&self.sampling.top_k.to_le_bytes());
        b.push(u8::from(self.sampling.seed.is_some()));
        b.extend_from_slice(&self.sampling.seed.unwrap_or(0).to_le_bytes());
        b.extend_from_slice(&(self.extra_keys.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.extra_keys);
        b.extend_from_slice(&(self.prompt.len() as u32).to_le_bytes());
        b.extend(self.prompt.iter().flat_map(|t| t.to_le_bytes()));
        for (text, max) in [(&self.decode, MAX_DECODE_ID_BYTES), (&self.grant, MAX_GRANT_BYTES)] {
            // An over-long field is cut (the grant then fails to verify): the encoding never breaks its bounds.
            let mut end = text.len().min(max);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            b.extend_from_slice(&(end as u16).to_le_bytes());
            b.extend_from_slice(&text.as_bytes()[..end]);
        }
        b
    }

    /// The MAC of this Hello under the transfer key.
    pub fn code(&self, key: &[u8; 32]) -> [u8; 32] {
        *blake3::keyed_hash(key, &self.signed_bytes()).as_bytes()
    }

    /// Whether the MAC verifies under `key` (constant time).
    pub fn verifies(&self, key: &[u8; 32]) -> bool {
        blake3::Hash::from(self.mac) == blake3::keyed_hash(key, &self.signed_bytes())
    }
}

/// The MAC a prefill worker answers a Hello with: proof that it holds the key too.
pub fn accept_code(key: &[u8; 32], hello_mac: &[u8; 32]) -> [u8; 32] {
    let mut b = b"accept".to_vec();
    b.extend_from_slice(hello_mac);
    *blake3::keyed_hash(key, &b).as_bytes()
}

/// Whether an Accept's MAC answers `hello_mac` (constant time).
pub fn accept_verifies(key: &[u8; 32], hello_mac: &[u8; 32], mac: &[u8; 32]) -> bool {
    blake3::Hash::from(*mac) == blake3::Hash::from(accept_code(key, hello_mac))
}

/// The header and fixed fields of a Blocks frame; the payload follows it on the wire (sent without a copy).
pub fn blocks_head(transfer_id: u64, first: u32, count: u32, layers: (u16, u16), payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER_BYTES + BLOCKS_FIXED);
    b.extend_from_slice(&((1 + BLOCKS_FIXED + payload.len()) as u32).to_le_bytes());
    b.push(K_BLOCKS);
    b.extend_from_slice(&transfer_id.to_le_bytes());
    b.extend_from_slice(&first.to_le_bytes());
    b.extend_from_slice(&count.to_le_bytes());
    b.extend_from_slice(&layers.0.to_le_bytes());
    b.extend_from_slice(&layers.1.to_le_bytes());
    b.extend_from_slice(&xxh3_64(payload).to_le_bytes());
    b
}

/// A whole frame's bytes (Blocks included, with its payload copied: [`blocks_head`] avoids that).
pub fn encode(f: &Frame) -> Vec<u8> {
    let mut b = Vec::new();
    let kind = match f {
        Frame::Hello(h) => {
            b = h.signed_bytes();
            b.extend_from_slice(&h.mac);
            K_HELLO
        }
        Frame::Accept { transfer_id, mac } => {
            b.extend_from_slice(&transfer_id.to_le_bytes());
            b.extend_from_slice(mac);
            K_ACCEPT
        }
        Frame::Refuse { transfer_id, code, reason } => {
            b.extend_from_slice(&transfer_id.to_le_bytes());
            b.extend_from_slice(&(*code as u16).to_le_bytes());
            put_reason(&mut b, reason);
            K_REFUSE
        }
        Frame::Blocks(x) => {
            let mut out = blocks_head(x.transfer_id, x.first, x.count, x.layers, &x.payload);
            out.extend_from_slice(&x.payload);
            return out;
        }
        Frame::Done(d) => {
            b.extend_from_slice(&d.transfer_id.to_le_bytes());
            for v in [d.first_token, d.prompt_tokens, d.cached_tokens] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            K_DONE
        }
        Frame::Renew { transfer_id } => {
            b.extend_from_slice(&transfer_id.to_le_bytes());
            K_RENEW
        }
        Frame::Cancel { transfer_id, reason } => {
            b.extend_from_slice(&transfer_id.to_le_bytes());
            put_reason(&mut b, reason);
            K_CANCEL
        }
        Frame::Ack { transfer_id } => {
            b.extend_from_slice(&transfer_id.to_le_bytes());
            K_ACK
        }
        Frame::Probe(p) => {
            b = p.signed_bytes().split_off(5);
            b.extend_from_slice(&p.mac);
            K_PROBE
        }
        Frame::Progress(p) => {
            b.extend_from_slice(&p.transfer_id.to_le_bytes());
            for v in [p.computed, p.through, p.eta_ms] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            K_PROGRESS
        }
    };
    with_header(kind, b)
}

#[cfg(test)]
#[path = "frame_tests.rs"]
mod tests;
