//! The byte-moving boundary of KV transfers, and its TCP implementation.
//!
//! [`KvLink`] is one connection between two workers: send a frame, send a block range's payload without copying
//! it, receive the next frame. [`KvTransport`] makes and pools links to peers. The protocol (`export`, `import`)
//! is written against these two traits only, so an RDMA-class backend (NIXL, Mooncake's transfer engine) can stand
//! in later by writing Blocks payloads straight into the peer's staging memory.
//!
//! TCP: plain sockets with `TCP_NODELAY`. A link starts with the handshake (`frame` module docs: Challenge, Open,
//! Opened, fixed sizes, within [`HANDSHAKE_TIMEOUT`]): nothing else is read before the dialer has proved it holds
//! the key, and every frame after it is sealed under the link's session key with a per-direction sequence number.
//! Each link's reads run on a task of their own that checks and decodes frames into a small bounded channel (so
//! receiving is cancel-safe and a slow consumer pushes back on the sender through TCP); a Blocks frame goes out as
//! its head, the payload slice (no copy) and its MAC. The pool keeps up to [`MAX_IDLE_PER_PEER`] idle links per
//! peer for [`IDLE_TIMEOUT`].

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::frame::{self, Direction, Frame, Limits, HEADER_BYTES, NONCE_BYTES};
use super::TransferError;

/// Idle links kept per peer.
pub const MAX_IDLE_PER_PEER: usize = 4;
/// How long an idle link is kept (a prefill worker closes links idle for twice this).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Frames decoded ahead of their consumer per link.
const READ_AHEAD_FRAMES: usize = 2;
/// Longest a link's handshake may take, on either side (a dialer that connects and sends nothing is dropped then).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for a parting frame (Cancel, Refuse) to go out before the link is dropped anyway.
pub const PARTING_WAIT: Duration = Duration::from_secs(1);

/// Sends `f`, giving up at `deadline`: a peer that stopped reading fills the socket, and no send may wait for it
/// forever (`lease` names the limit in the error).
pub async fn send_by<L: KvLink>(
    link: &mut L,
    f: &Frame,
    deadline: tokio::time::Instant,
    lease: Duration,
) -> Result<(), TransferError> {
    tokio::time::timeout_at(deadline, link.send(f)).await.map_err(|_| TransferError::Expired(lease))?
}

/// Sends a parting frame if it goes out within [`PARTING_WAIT`]; the link is dropped either way.
pub async fn send_parting<L: KvLink>(link: &mut L, f: &Frame) {
    let _ = tokio::time::timeout(PARTING_WAIT, link.send(f)).await;
}

/// One connection to a peer.
pub trait KvLink: Send {
    /// Sends one frame.
    fn send(&mut self, f: &Frame) -> impl Future<Output = Result<(), TransferError>> + Send;
    /// Sends blocks `first..first + count`, layers `layers`, of transfer `id`, from `payload`.
    fn send_blocks(
        &mut self,
        id: u64,
        first: u32,
        count: u32,
        layers: (u16, u16),
        payload: &[u8],
    ) -> impl Future<Output = Result<(), TransferError>> + Send;
    /// The next frame from the peer (cancel-safe).
    fn recv(&mut self) -> impl Future<Output = Result<Frame, TransferError>> + Send;
    /// Whether the link served an earlier transfer (it came from a pool).
    fn reused(&self) -> bool;
}

/// Makes links to peers, and takes back the healthy ones after a transfer.
pub trait KvTransport: Send + Sync {
    type Link: KvLink;
    /// A link to `peer` (pooled, or new and handshaken under `key`).
    fn connect(
        &self,
        peer: &str,
        limits: Limits,
        key: &[u8; 32],
    ) -> impl Future<Output = Result<Self::Link, TransferError>> + Send;
    fn give_back(&self, link: Self::Link);
}

/// A TCP link, after its handshake.
pub struct TcpLink {
    peer: String,
    frames: mpsc::Receiver<Result<Frame, TransferError>>,
    writer: OwnedWriteHalf,
    reader: tokio::task::JoinHandle<()>,
    reused: bool,
    session: [u8; 32],
    send_dir: Direction,
    send_seq: u64,
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

async fn read_frame(
    r: &mut (impl AsyncRead + Unpin),
    limits: &Limits,
    session: &[u8; 32],
    dir: Direction,
    seq: u64,
) -> Result<Frame, TransferError> {
    let mut head = [0u8; HEADER_BYTES];
    if let Err(e) = r.read_exact(&mut head).await {
        return Err(TransferError::PeerLost(e.to_string()));
    }
    let (kind, len) = frame::decode_header(&head, limits)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(|e| TransferError::PeerLost(e.to_string()))?;
    Ok(frame::open_frame(session, dir, seq, kind, &body)?)
}

fn lost(e: std::io::Error) -> TransferError {
    TransferError::PeerLost(e.to_string())
}

/// A fresh handshake nonce (unpredictable: keyed by the process's random state).
fn nonce() -> [u8; NONCE_BYTES] {
    kvgate_shared::trace::new_id::<NONCE_BYTES>()
}

impl TcpLink {
    /// The listener's side of a new connection: Challenge, a verified Open, Opened, within [`HANDSHAKE_TIMEOUT`].
    /// `Err(Refused)` (code `unauthorized`) when the dialer does not prove the key; nothing larger than an Open is
    /// read before it does.
    pub async fn accept(
        stream: TcpStream,
        peer: String,
        limits: Limits,
        key: &[u8; 32],
    ) -> Result<Self, TransferError> {
        let mut stream = stream;
        let handshake = async {
            let ours = nonce();
            stream.write_all(&frame::challenge(&ours)).await.map_err(lost)?;
            let mut open = [0u8; frame::OPEN_BYTES];
            stream.read_exact(&mut open).await.map_err(lost)?;
            let Some(theirs) = frame::verify_open(key, &ours, &open) else {
                return Err(TransferError::Refused {
                    code: frame::RefuseCode::Unauthorized.as_str(),
                    reason: "the dialer's Open does not verify under this worker's key".into(),
                });
            };
            stream.write_all(&frame::opened(key, &ours, &theirs)).await.map_err(lost)?;
            Ok(frame::session_key(key, &ours, &theirs))
        };
        let session = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
            .await
            .map_err(|_| TransferError::Expired(HANDSHAKE_TIMEOUT))??;
        Ok(Self::start(stream, peer, limits, session, Direction::ToDialer))
    }

    /// The dialer's side: a Challenge, Open, a verified Opened, within [`HANDSHAKE_TIMEOUT`]. `Err(Protocol)` when
    /// the listener does not prove the key.
    pub async fn dial(
        stream: TcpStream,
        peer: String,
        limits: Limits,
        key: &[u8; 32],
    ) -> Result<Self, TransferError> {
        let mut stream = stream;
        let handshake = async {
            let mut c = [0u8; frame::CHALLENGE_BYTES];
            stream.read_exact(&mut c).await.map_err(lost)?;
            let theirs = frame::read_challenge(&c)?;
            let ours = nonce();
            stream.write_all(&frame::open(key, &theirs, &ours)).await.map_err(lost)?;
            let mut o = [0u8; frame::OPENED_BYTES];
            stream.read_exact(&mut o).await.map_err(lost)?;
            if !frame::verify_opened(key, &theirs, &ours, &o) {
                return Err(TransferError::Protocol("the listener's Opened does not verify".into()));
            }
            Ok(frame::session_key(key, &theirs, &ours))
        };
        let session = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
            .await
            .map_err(|_| TransferError::Expired(HANDSHAKE_TIMEOUT))??;
        Ok(Self::start(stream, peer, limits, session, Direction::ToListener))
    }

    /// The link over a handshaken `stream`: frames are sealed going `send_dir`, checked coming the other way.
    fn start(
        stream: TcpStream,
        peer: String,
        limits: Limits,
        session: [u8; 32],
        send_dir: Direction,
    ) -> Self {
        let _ = stream.set_nodelay(true);
        let recv_dir = match send_dir {
            Direction::ToDialer => Direction::ToListener,
            Direction::ToListener => Direction::ToDialer,
        };
        let (mut rd, writer) = stream.into_split();
        let (tx, frames) = mpsc::channel(READ_AHEAD_FRAMES);
        let reader = tokio::spawn(async move {
            for seq in 0u64.. {
                let f = read_frame(&mut rd, &limits, &session, recv_dir, seq).await;
                let stop = f.is_err();
                if tx.send(f).await.is_err() || stop {
                    return;
                }
            }
        });
        Self { peer, frames, writer, reader, reused: false, session, send_dir, send_seq: 0 }
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Seals and writes `frame` (an encoded frame or a Blocks head), then `payload`, then the MAC.
    async fn write_sealed(&mut self, frame: Vec<u8>, payload: &[u8]) -> Result<(), TransferError> {
        let (head, mac) = frame::seal_frame(&self.session, self.send_dir, self.send_seq, frame, payload);
        self.send_seq += 1;
        self.writer.write_all(&head).await.map_err(lost)?;
        if !payload.is_empty() {
            self.writer.write_all(payload).await.map_err(lost)?;
        }
        self.writer.write_all(&mac).await.map_err(lost)
    }
}

impl KvLink for TcpLink {
    async fn send(&mut self, f: &Frame) -> Result<(), TransferError> {
        self.write_sealed(frame::encode(f), &[]).await
    }

    async fn send_blocks(
        &mut self,
        id: u64,
        first: u32,
        count: u32,
        layers: (u16, u16),
        payload: &[u8],
    ) -> Result<(), TransferError> {
        self.write_sealed(frame::blocks_head(id, first, count, layers, payload), payload).await
    }

    async fn recv(&mut self) -> Result<Frame, TransferError> {
        match self.frames.recv().await {
            Some(f) => f,
            None => Err(TransferError::PeerLost("the connection closed".into())),
        }
    }

    fn reused(&self) -> bool {
        self.reused
    }
}

/// TCP links to peers, pooled.
#[derive(Default)]
pub struct TcpTransport {
    idle: Mutex<HashMap<String, Vec<(TcpLink, Instant)>>>,
}

impl KvTransport for TcpTransport {
    type Link = TcpLink;

    async fn connect(&self, peer: &str, limits: Limits, key: &[u8; 32]) -> Result<TcpLink, TransferError> {
        let pooled = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let list = idle.entry(peer.to_owned()).or_default();
            list.retain(|(l, at)| at.elapsed() < IDLE_TIMEOUT && !l.reader.is_finished());
            list.pop().map(|(l, _)| l)
        };
        if let Some(mut l) = pooled {
            l.reused = true;
            return Ok(l);
        }
        let stream =
            TcpStream::connect(peer).await.map_err(|e| TransferError::Connect(format!("{peer}: {e}")))?;
        TcpLink::dial(stream, peer.to_owned(), limits, key).await
    }

    fn give_back(&self, link: TcpLink) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.entry(link.peer.clone()).or_default();
        if list.len() < MAX_IDLE_PER_PEER {
            list.push((link, Instant::now()));
        }
    }
}
