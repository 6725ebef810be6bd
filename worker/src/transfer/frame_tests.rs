//! Round trips and hostile input of the KV transfer frame codec.

use proptest::prelude::*;

use super::*;

const LIMITS: Limits = Limits { max_prompt_tokens: 1024, max_payload: 1 << 20 };

fn hello() -> Hello {
    let mut h = Hello {
        version: VERSION,
        transfer_id: 7,
        issued_ms: 1_700_000_000_000,
        fingerprint: 0xabcd,
        block_bytes: 4096,
        layers: 4,
        layer_group: 2,
        max_frame: 1 << 20,
        from_block: 1,
        blocks: 3,
        sampling: FirstToken { temperature: 0.0, top_p: 1.0, top_k: 0, seed: Some(9) },
        extra_keys: vec![1, 1, 0, 0, 0, b'x'],
        prompt: (0..40).collect(),
        decode: "d0".into(),
        grant: "v2.1.2.3.4".into(),
        mac: [0; 32],
    };
    h.mac = h.code(&[3; 32]);
    h
}

const SESSION: [u8; 32] = [9; 32];

/// `encode`d bytes sealed as frame 0 to the dialer.
fn sealed(bytes: Vec<u8>) -> Vec<u8> {
    let (mut b, mac) = seal_frame(&SESSION, Direction::ToDialer, 0, bytes, &[]);
    b.extend_from_slice(&mac);
    b
}

fn decode(bytes: &[u8]) -> Result<Frame, FrameError> {
    let bytes = sealed(bytes.to_vec());
    let head: [u8; HEADER_BYTES] = bytes[..HEADER_BYTES].try_into().expect("a header");
    let (kind, len) = decode_header(&head, &LIMITS)?;
    if bytes.len() != HEADER_BYTES + len {
        return Err(FrameError::Malformed { kind, extra: 0 });
    }
    open_frame(&SESSION, Direction::ToDialer, 0, kind, &bytes[HEADER_BYTES..])
}

#[test]
fn a_sealed_frame_opens_only_as_itself() {
    let bytes = sealed(encode(&Frame::Renew { transfer_id: 7 }));
    let body = &bytes[HEADER_BYTES..];
    let kind = bytes[4];
    assert_eq!(open_frame(&SESSION, Direction::ToDialer, 0, kind, body), Ok(Frame::Renew { transfer_id: 7 }));
    let bad = FrameError::Invalid("the frame's MAC does not verify");
    // Another sequence number (a replay or a reorder), the other direction (a reflection), another link's key.
    assert_eq!(open_frame(&SESSION, Direction::ToDialer, 1, kind, body), Err(bad.clone()));
    assert_eq!(open_frame(&SESSION, Direction::ToListener, 0, kind, body), Err(bad.clone()));
    assert_eq!(open_frame(&[8; 32], Direction::ToDialer, 0, kind, body), Err(bad.clone()));
    // One bit of the body, or another kind.
    let mut flipped = body.to_vec();
    flipped[0] ^= 1;
    assert_eq!(open_frame(&SESSION, Direction::ToDialer, 0, kind, &flipped), Err(bad.clone()));
    assert_eq!(open_frame(&SESSION, Direction::ToDialer, 0, 8, body), Err(bad));
}

#[test]
fn the_handshake_proves_the_key_both_ways_and_binds_both_nonces() {
    let (key, other) = ([3u8; 32], [4u8; 32]);
    let (l, d) = ([1u8; NONCE_BYTES], [2u8; NONCE_BYTES]);
    assert_eq!(read_challenge(&challenge(&l)), Ok(l));
    let mut wrong = challenge(&l);
    wrong[4] ^= 1;
    assert!(read_challenge(&wrong).is_err(), "another version");
    let o = open(&key, &l, &d);
    assert_eq!(verify_open(&key, &l, &o), Some(d));
    assert_eq!(verify_open(&other, &l, &o), None, "a dialer without the key");
    assert_eq!(
        verify_open(&key, &[5; NONCE_BYTES], &o),
        None,
        "an Open captured on another link (challenge)"
    );
    assert!(verify_opened(&key, &l, &d, &opened(&key, &l, &d)));
    assert!(!verify_opened(&key, &l, &d, &opened(&other, &l, &d)), "a listener without the key");
    assert_ne!(session_key(&key, &l, &d), session_key(&key, &l, &[6; NONCE_BYTES]), "each link its own key");
}

#[test]
fn every_frame_round_trips() {
    let payload = vec![5u8; 300];
    let frames = [
        Frame::Hello(Box::new(hello())),
        Frame::Accept { transfer_id: 7, mac: accept_code(&[3; 32], &hello().mac) },
        Frame::Refuse { transfer_id: 7, code: RefuseCode::Overloaded, reason: "queue full".into() },
        Frame::Blocks(Blocks {
            transfer_id: 7,
            first: 1,
            count: 2,
            layers: (0, 4),
            checksum: xxh3_64(&payload),
            payload,
        }),
        Frame::Done(Done { transfer_id: 7, first_token: 42, prompt_tokens: 40, cached_tokens: 16 }),
        Frame::Renew { transfer_id: 7 },
        Frame::Cancel { transfer_id: 7, reason: "client left".into() },
        Frame::Ack { transfer_id: 7 },
        Frame::Probe(probe()),
        Frame::Progress(Progress { transfer_id: 7, computed: 2048, through: 4096, eta_ms: 1_500 }),
    ];
    for f in frames {
        assert_eq!(decode(&encode(&f)).as_ref(), Ok(&f));
    }
}

fn probe() -> Probe {
    let mut p = Probe {
        transfer_id: 8,
        issued_ms: 1_700_000_000_000,
        bytes: 1 << 20,
        max_frame: 1 << 16,
        mac: [0; 32],
    };
    p.mac = p.code(&[3; 32]);
    p
}

#[test]
fn a_probe_verifies_only_under_its_key_and_unchanged() {
    let p = probe();
    assert!(p.verifies(&[3; 32]) && !p.verifies(&[4; 32]));
    let bigger = Probe { bytes: MAX_PROBE_BYTES, ..p };
    assert!(!bigger.verifies(&[3; 32]), "a changed size must not verify");
}

#[test]
fn a_hello_verifies_only_under_its_key_and_unchanged() {
    let h = hello();
    assert!(h.verifies(&[3; 32]));
    assert!(!h.verifies(&[4; 32]));
    let mut changed = h.clone();
    changed.from_block = 0;
    assert!(!changed.verifies(&[3; 32]), "a changed block range must not verify");
    let mac = accept_code(&[3; 32], &h.mac);
    assert!(accept_verifies(&[3; 32], &h.mac, &mac));
    assert!(!accept_verifies(&[4; 32], &h.mac, &mac));
}

#[test]
fn lengths_are_refused_from_the_header_before_any_read() {
    // A Blocks frame claiming 4 GiB, a Hello longer than the prompt limit allows, a control frame of 1 MiB.
    let cases: [(u32, u8); 5] =
        [(u32::MAX, 4), ((8 + 4 * 5000 + 64) as u32, 1), (1 << 20, 6), (0, 6), (SEAL_BYTES as u32, 6)];
    for (len, kind) in cases {
        let mut h = [0u8; HEADER_BYTES];
        h[..4].copy_from_slice(&len.to_le_bytes());
        h[4] = kind;
        assert!(matches!(decode_header(&h, &LIMITS), Err(FrameError::TooLong { .. })), "{len} {kind}");
    }
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(&9u32.to_le_bytes());
    h[4] = 99;
    assert_eq!(decode_header(&h, &LIMITS), Err(FrameError::UnknownKind(99)));
}

#[test]
fn a_corrupt_payload_or_empty_range_is_refused() {
    let payload = vec![1u8; 64];
    let mut bytes = encode(&Frame::Blocks(Blocks {
        transfer_id: 1,
        first: 0,
        count: 1,
        layers: (0, 1),
        checksum: xxh3_64(&payload),
        payload,
    }));
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    assert_eq!(decode(&bytes), Err(FrameError::Invalid("payload checksum")));
    let empty = blocks_head(1, 0, 1, (2, 2), &[]);
    assert_eq!(decode(&empty), Err(FrameError::Invalid("empty block or layer range")));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Any bytes at all: an error or a frame, never a panic, and never a body longer than the header allowed.
    #[test]
    fn any_bytes_decode_to_an_error_or_a_frame(kind in 0u8..10, body in proptest::collection::vec(any::<u8>(), 0..300)) {
        let mut bytes = ((body.len() + 1) as u32).to_le_bytes().to_vec();
        bytes.push(kind);
        bytes.extend_from_slice(&body);
        if let Ok(f) = decode(&bytes) {
            // What decodes re-encodes to the same bytes (no two readings of one frame).
            prop_assert_eq!(encode(&f), bytes);
        }
    }

    /// A valid frame cut anywhere or with a byte flipped is an error or (a flip in a free field) another frame.
    #[test]
    fn truncated_or_flipped_frames_never_panic(cut in 0usize..400, flip in 0usize..400, bit in 0u8..8) {
        let full = encode(&Frame::Hello(Box::new(hello())));
        let cut = cut.min(full.len());
        if cut >= HEADER_BYTES {
            let _ = decode(&full[..cut]);
        }
        let mut flipped = full.clone();
        let i = flip % flipped.len();
        flipped[i] ^= 1 << bit;
        if let Ok(Frame::Hello(h)) = decode(&flipped) {
            prop_assert!(!h.verifies(&[3; 32]) || *h == hello(), "a flipped Hello must not verify");
        }
    }
}

#[test]
fn transfer_errors_say_whether_a_retry_can_help() {
    use crate::transfer::TransferError;
    assert!(TransferError::PeerLost("reset".into()).retryable());
    assert!(
        TransferError::Refused { code: RefuseCode::Overloaded.as_str(), reason: String::new() }.retryable()
    );
    assert!(
        !TransferError::Refused { code: RefuseCode::WrongModel.as_str(), reason: String::new() }.retryable()
    );
    assert!(!TransferError::Frame(FrameError::UnknownKind(9)).retryable());
}
