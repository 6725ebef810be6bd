//! The byte-moving boundary of KV transfers, and its TCP implementation.
//!
//! [`KvLink`] is one connection between two workers: send a frame, send a block range's payload without copying
//! it, receive the next frame. [`KvTransport`] makes and pools links to peers. The protocol (`export`, `import`)
//! is written against these two traits only, so an RDMA-class backend (NIXL, Mooncake's transfer engine) can stand
//! in later by writing Blocks payloads straight into the peer's staging memory.
//!
//! TCP: plain sockets with `TCP_NODELAY`; each link's reads run on a task of their own that decodes frames into a
//! small bounded channel (so receiving is cancel-safe and a slow consumer pushes back on the sender through TCP);
//! a Blocks frame goes out as its 33-byte head then the payload slice, no copy. The pool keeps up to
//! [`MAX_IDLE_PER_PEER`] idle links per peer for [`IDLE_TIMEOUT`].

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::frame::{self, Frame, Limits, HEADER_BYTES};
use super::TransferError;

/// Idle links kept per peer.
pub const MAX_IDLE_PER_PEER: usize = 4;
/// How long an idle link is kept (a prefill worker closes links idle for twice this).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Frames decoded ahead of their consumer per link.
const READ_AHEAD_FRAMES: usize = 2;
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
    fn connect(
        &self,
        peer: &str,
        limits: Limits,
    ) -> impl Future<Output = Result<Self::Link, TransferError>> + Send;
    fn give_back(&self, link: Self::Link);
}

/// A TCP link.
pub struct TcpLink {
    peer: String,
    frames: mpsc::Receiver<Result<Frame, TransferError>>,
    writer: OwnedWriteHalf,
    reader: tokio::task::JoinHandle<()>,
    reused: bool,
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

async fn read_frame(r: &mut (impl AsyncRead + Unpin), limits: &Limits) -> Result<Frame, TransferError> {
    let mut head = [0u8; HEADER_BYTES];
    if let Err(e) = r.read_exact(&mut head).await {
        return Err(TransferError::PeerLost(e.to_string()));
    }
    let (kind, len) = frame::decode_header(&head, limits)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(|e| TransferError::PeerLost(e.to_string()))?;
    Ok(frame::decode_body(kind, &body)?)
}

impl TcpLink {
    /// A link over `stream`, reading frames within `limits`.
    pub fn new(stream: TcpStream, peer: String, limits: Limits) -> Self {
        let _ = stream.set_nodelay(true);
        let (mut rd, writer) = stream.into_split();
        let (tx, frames) = mpsc::channel(READ_AHEAD_FRAMES);
        let reader = tokio::spawn(async move {
            loop {
                let f = read_frame(&mut rd, &limits).await;
                let stop = f.is_err();
                if tx.send(f).await.is_err() || stop {
                    return;
                }
            }
        });
        Self { peer, frames, writer, reader, reused: false }
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<(), TransferError> {
        self.writer.write_all(bytes).await.map_err(|e| TransferError::PeerLost(e.to_string()))
    }
}

impl KvLink for TcpLink {
    async fn send(&mut self, f: &Frame) -> Result<(), TransferError> {
        self.write(&frame::encode(f)).await
    }

    async fn send_blocks(
        &mut self,
        id: u64,
        first: u32,
        count: u32,
        layers: (u16, u16),
        payload: &[u8],
    ) -> Result<(), TransferError> {
        self.write(&frame::blocks_head(id, first, count, layers, payload)).await?;
        self.write(payload).await
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

    async fn connect(&self, peer: &str, limits: Limits) -> Result<TcpLink, TransferError> {
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
        Ok(TcpLink::new(stream, peer.to_owned(), limits))
    }

    fn give_back(&self, link: TcpLink) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.entry(link.peer.clone()).or_default();
        if list.len() < MAX_IDLE_PER_PEER {
            list.push((link, Instant::now()));
        }
    }
}
