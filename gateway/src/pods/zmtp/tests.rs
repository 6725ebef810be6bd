//! The ZMTP client against a scripted peer over an in-memory pipe: the handshake, subscriptions, messages short
//! and long, PING/PONG, and hostile peers (huge frame headers, endless multi-part messages, wrong socket types,
//! not ZMTP at all). Interop with real libzmq is tested in `tests/vllm_events.rs`.

use super::*;
use tokio::io::{duplex, DuplexStream};

/// The peer's end: greets as ZMTP 3.1 and sends READY with `socket_type`; returns the client's READY body.
async fn peer_handshake(peer: &mut DuplexStream, socket_type: &str) -> Vec<u8> {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    peer.write_all(&g).await.expect("greeting");
    let mut theirs = [0u8; 64];
    peer.read_exact(&mut theirs).await.expect("client greeting");
    assert_eq!((theirs[0], theirs[9], theirs[10], &theirs[12..16]), (0xFF, 0x7F, 3, b"NULL".as_slice()));
    let mut ready = command_body("READY");
    push_property(&mut ready, "Socket-Type", socket_type.as_bytes());
    peer.write_all(&[COMMAND, ready.len() as u8]).await.expect("ready");
    peer.write_all(&ready).await.expect("ready");
    read_peer_frame(peer).await.1
}

async fn read_peer_frame(peer: &mut DuplexStream) -> (u8, Vec<u8>) {
    let flags = peer.read_u8().await.expect("flags");
    let len = if flags & LONG != 0 {
        peer.read_u64().await.expect("len")
    } else {
        u64::from(peer.read_u8().await.expect("len"))
    };
    let mut body = vec![0u8; len as usize];
    peer.read_exact(&mut body).await.expect("body");
    (flags, body)
}

async fn client(
    kind: Kind,
    peer_type: &'static str,
) -> (io::Result<Socket<DuplexStream>>, DuplexStream, Vec<u8>) {
    let (a, mut b) = duplex(1 << 20);
    let peer = tokio::spawn(async move {
        let ready = peer_handshake(&mut b, peer_type).await;
        (b, ready)
    });
    let sock = Socket::handshake(a, kind).await;
    let (b, ready) = peer.await.expect("peer");
    (sock, b, ready)
}

#[tokio::test]
async fn a_sub_socket_greets_subscribes_and_reads_messages_short_long_and_after_a_ping() {
    let (sock, mut peer, ready) = client(Kind::Sub, "PUB").await;
    let mut sock = sock.expect("handshake");
    let (name, props) = parse_command(&ready).expect("command");
    assert_eq!(name, b"READY");
    assert_eq!(properties(props).expect("props"), vec![(b"Socket-Type".as_slice(), b"SUB".as_slice())]);
    sock.subscribe(b"kv").await.expect("subscribe");
    assert_eq!(read_peer_frame(&mut peer).await, (0, vec![1, b'k', b'v']));

    // A PING first (TTL 0, context "ab"): answered with a PONG echoing the context.
    let mut ping = command_body("PING");
    ping.extend_from_slice(&[0, 0, b'a', b'b']);
    peer.write_all(&[COMMAND, ping.len() as u8]).await.expect("ping");
    peer.write_all(&ping).await.expect("ping");
    // Then [topic, 8-byte sequence, a 300-byte payload in a long frame].
    peer.write_all(&[MORE, 2, b'k', b'v', MORE, 8]).await.expect("frames");
    peer.write_all(&7i64.to_be_bytes()).await.expect("seq");
    peer.write_all(&[LONG]).await.expect("long");
    peer.write_all(&300u64.to_be_bytes()).await.expect("len");
    peer.write_all(&[9u8; 300]).await.expect("payload");
    let msg = sock.recv().await.expect("message");
    assert_eq!(msg.len(), 3);
    assert_eq!(
        (&msg[0][..], &msg[1][..], msg[2].len()),
        (b"kv".as_slice(), 7i64.to_be_bytes().as_slice(), 300)
    );
    let (flags, pong) = read_peer_frame(&mut peer).await;
    assert_eq!(flags, COMMAND);
    assert_eq!(parse_command(&pong).expect("pong"), (b"PONG".as_slice(), b"ab".as_slice()));
}

#[tokio::test]
async fn a_dealer_sends_multi_part_messages_long_frames_included() {
    let (sock, mut peer, _) = client(Kind::Dealer, "ROUTER").await;
    let mut sock = sock.expect("handshake");
    let big = vec![5u8; 1000];
    sock.send(&[b"", &3i64.to_be_bytes(), &big]).await.expect("send");
    assert_eq!(read_peer_frame(&mut peer).await, (MORE, vec![]));
    assert_eq!(read_peer_frame(&mut peer).await, (MORE, 3i64.to_be_bytes().to_vec()));
    assert_eq!(read_peer_frame(&mut peer).await, (LONG, big));
}

#[tokio::test]
async fn hostile_peers_end_the_connection_without_buffering_what_they_claim() {
    // A frame header claiming 2^60 bytes: refused at once, nothing allocated.
    let (sock, mut peer, _) = client(Kind::Sub, "PUB").await;
    let mut sock = sock.expect("handshake");
    peer.write_all(&[LONG]).await.expect("flags");
    peer.write_all(&(1u64 << 60).to_be_bytes()).await.expect("len");
    let e = sock.recv().await.expect_err("refused");
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");

    // One byte over the frame limit: refused too.
    let (sock, mut peer, _) = client(Kind::Sub, "PUB").await;
    let mut sock = sock.expect("handshake");
    peer.write_all(&[LONG]).await.expect("flags");
    peer.write_all(&(MAX_FRAME_BYTES + 1).to_be_bytes()).await.expect("len");
    assert!(sock.recv().await.is_err());

    // A PING with a long context: the PONG echoes 16 bytes of it, not all.
    let (sock, mut peer, _) = client(Kind::Sub, "PUB").await;
    let mut sock = sock.expect("handshake");
    let mut ping = command_body("PING");
    ping.extend_from_slice(&[0, 0]);
    ping.extend_from_slice(&[7u8; 200]);
    peer.write_all(&[COMMAND, ping.len() as u8]).await.expect("ping");
    peer.write_all(&ping).await.expect("ping");
    peer.write_all(&[0, 1, b'x']).await.expect("message");
    assert_eq!(sock.recv().await.expect("message"), vec![Bytes::from_static(b"x")]);
    let (_, pong) = read_peer_frame(&mut peer).await;
    assert_eq!(parse_command(&pong).expect("pong"), (b"PONG".as_slice(), [7u8; 16].as_slice()));

    // A message that never ends: refused after MAX_FRAMES frames.
    let (sock, mut peer, _) = client(Kind::Sub, "PUB").await;
    let mut sock = sock.expect("handshake");
    for _ in 0..=MAX_FRAMES {
        peer.write_all(&[MORE, 1, b'x']).await.expect("frame");
    }
    assert!(sock.recv().await.is_err());

    // Unknown flag bits.
    let (sock, mut peer, _) = client(Kind::Sub, "PUB").await;
    let mut sock = sock.expect("handshake");
    peer.write_all(&[0x80, 0]).await.expect("frame");
    assert!(sock.recv().await.is_err());

    // A socket type ZMTP does not pair with SUB.
    let (sock, _peer, _) = client(Kind::Sub, "REQ").await;
    assert!(sock.is_err());

    // Not ZMTP at all (an HTTP server): refused at the greeting.
    let (a, mut b) = duplex(4096);
    let peer = tokio::spawn(async move {
        b.write_all(&[b'H'; 64]).await.expect("write");
        let mut g = [0u8; 64];
        let _ = b.read_exact(&mut g).await;
        b
    });
    assert!(Socket::handshake(a, Kind::Sub).await.is_err());
    drop(peer.await);

    // Cut-short commands and properties are errors, not panics.
    assert!(parse_command(&[]).is_err());
    assert!(parse_command(&[9, b'R']).is_err());
    assert!(properties(&[11, b'S']).is_err());
    assert!(properties(&[1, b'a', 0, 0, 0, 9, b'x']).is_err());
}
