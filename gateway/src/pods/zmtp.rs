//! A minimal ZMTP 3.0 client (ZeroMQ's wire protocol, rfc.zeromq.org/spec/23, NULL security) for the two sockets
//! the gateway opens to inference pods: SUB to their KV event publisher and DEALER to their replay socket
//! (`vllm_subscriber`). Written here rather than taken from a general ZeroMQ library so that what a pod sends is
//! bounded before it is buffered: a frame longer than [`MAX_FRAME_BYTES`], a message of more than [`MAX_FRAMES`]
//! frames or [`MAX_MESSAGE_BYTES`] ends the connection with an error before anything is allocated for it (the `zeromq` crate used before reserved
//! whatever length a frame header claimed, so one hostile header could abort the gateway). It greets as ZMTP 3.0,
//! which libzmq peers (vLLM's pyzmq, SGLang's) speak to, subscribes with 3.0 subscription messages, and answers
//! PING with PONG; TCP keepalive notices a peer that vanished. No background task: the caller's `recv` drives the
//! connection.

use std::io;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Longest frame accepted: the event decoder's limit (`vllm_events::MAX_FRAME_BYTES`; a vLLM batch with the token
/// ids of a million-token prompt is a few MB).
pub const MAX_FRAME_BYTES: u64 = crate::pods::vllm_events::MAX_FRAME_BYTES as u64;
/// Most frames in one message (vLLM's are 3, a replayed one 4).
pub const MAX_FRAMES: usize = 16;
/// Largest message, all frames together (checked before a frame is read).
pub const MAX_MESSAGE_BYTES: u64 = 2 * MAX_FRAME_BYTES;
/// Longest connect plus greeting plus READY exchange.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// TCP keepalive on the connection: probes after this much silence, then every [`KEEPALIVE_INTERVAL`], and the
/// connection is dropped after [`KEEPALIVE_RETRIES`] unanswered ones, so a pod that vanished without closing
/// (node lost, network cut) is noticed within about a minute instead of never (the stream is quiet while idle).
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
pub const KEEPALIVE_RETRIES: u32 = 3;
/// Longest PING context echoed in a PONG (ZMTP 3.1: at most 16 bytes).
const MAX_PING_CONTEXT: usize = 16;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// The socket types this client can be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sub,
    Dealer,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Sub => "SUB",
            Kind::Dealer => "DEALER",
        }
    }

    /// Peer socket types ZMTP allows for this one.
    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            Kind::Sub => matches!(peer, b"PUB" | b"XPUB"),
            Kind::Dealer => matches!(peer, b"ROUTER" | b"DEALER" | b"REP"),
        }
    }
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// One ZMTP connection.
pub struct Socket<S> {
    io: BufReader<S>,
}

impl Socket<TcpStream> {
    /// Connects to `tcp://host:port` (`tcp://[v6]:port`) and completes the handshake as `kind`.
    pub async fn connect(endpoint: &str, kind: Kind) -> io::Result<Self> {
        let addr = endpoint.strip_prefix("tcp://").ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("not a tcp:// endpoint: {endpoint}"))
        })?;
        let work = async {
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let keepalive = socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_INTERVAL)
                .with_retries(KEEPALIVE_RETRIES);
            socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive)?;
            Socket::handshake(stream, kind).await
        };
        tokio::time::timeout(HANDSHAKE_TIMEOUT, work)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "ZMTP handshake timed out"))?
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Socket<S> {
    /// Greets the peer over `stream` and exchanges READY commands.
    pub async fn handshake(stream: S, kind: Kind) -> io::Result<Self> {
        let mut sock = Socket { io: BufReader::new(stream) };
        let mut greeting = [0u8; 64];
        greeting[0] = 0xFF;
        greeting[9] = 0x7F;
        greeting[10] = 3; // version 3.0
        greeting[12..16].copy_from_slice(b"NULL");
        sock.io.get_mut().write_all(&greeting).await?;
        let mut peer = [0u8; 64];
        sock.io.read_exact(&mut peer).await?;
        if peer[0] != 0xFF || peer[9] != 0x7F {
            return Err(invalid("not a ZMTP peer"));
        }
        if peer[10] < 3 {
            return Err(invalid(format!("ZMTP version {}.{} is too old", peer[10], peer[11])));
        }
        let mechanism = &peer[12..32];
        if mechanism.split(|b| *b == 0).next() != Some(b"NULL".as_slice()) {
            return Err(invalid("the peer wants a security mechanism other than NULL"));
        }
        let mut ready = command_body("READY");
        push_property(&mut ready, "Socket-Type", kind.name().as_bytes());
        sock.write_frame(COMMAND, &ready).await?;
        sock.io.get_mut().flush().await?;
        let (flags, body) = sock.read_frame(MAX_FRAME_BYTES).await?;
        if flags & COMMAND == 0 {
            return Err(invalid("the peer sent a message before READY"));
        }
        let (name, props) = parse_command(&body)?;
        match name {
            b"READY" => {}
            b"ERROR" => return Err(invalid(format!("the peer refused: {}", String::from_utf8_lossy(props)))),
            _ => return Err(invalid("the peer sent another command before READY")),
        }
        let peer_type = properties(props)?.into_iter().find(|(n, _)| n.eq_ignore_ascii_case(b"Socket-Type"));
        match peer_type {
            Some((_, t)) if kind.accepts(t) => Ok(sock),
            Some((_, t)) => {
                Err(invalid(format!("a {} cannot talk to a {}", kind.name(), String::from_utf8_lossy(t))))
            }
            None => Err(invalid("the peer's READY has no Socket-Type")),
        }
    }

    /// Subscribes to messages whose first frame starts with `topic` (a SUB socket; ZMTP 3.0 form).
    pub async fn subscribe(&mut self, topic: &[u8]) -> io::Result<()> {
        let mut body = Vec::with_capacity(topic.len() + 1);
        body.push(1);
        body.extend_from_slice(topic);
        self.write_frame(0, &body).await?;
        self.io.get_mut().flush().await
    }

    /// Sends one message of these frames.
    pub async fn send(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { MORE } else { 0 };
            self.write_frame(more, f).await?;
        }
        self.io.get_mut().flush().await
    }

    /// The next message (its frames); PINGs on the way are answered, other commands skipped.
    pub async fn recv(&mut self) -> io::Result<Vec<Bytes>> {
        let (mut frames, mut total) = (Vec::new(), 0u64);
        loop {
            let (flags, body) = self.read_frame(MAX_MESSAGE_BYTES - total).await?;
            if flags & COMMAND != 0 {
                if !frames.is_empty() {
                    return Err(invalid("a command inside a multi-part message"));
                }
                let (name, rest) = parse_command(&body)?;
                match name {
                    b"PING" => {
                        // TTL (2 bytes), then the context the PONG must echo.
                        let mut pong = command_body("PONG");
                        let context = rest.get(2..).unwrap_or_default();
                        pong.extend_from_slice(&context[..context.len().min(MAX_PING_CONTEXT)]);
                        self.write_frame(COMMAND, &pong).await?;
                        self.io.get_mut().flush().await?;
                    }
                    b"ERROR" => {
                        return Err(invalid(format!(
                            "the peer sent ERROR: {}",
                            String::from_utf8_lossy(rest)
                        )))
                    }
                    _ => {}
                }
                continue;
            }
            total += body.len() as u64;
            if frames.len() >= MAX_FRAMES {
                return Err(invalid(format!(
                    "a message over {MAX_FRAMES} frames or {MAX_MESSAGE_BYTES} bytes"
                )));
            }
            frames.push(body);
            if flags & MORE == 0 {
                return Ok(frames);
            }
        }
    }

    /// One frame of at most `limit` (and [`MAX_FRAME_BYTES`]) bytes; a longer one is refused before anything is
    /// allocated for it.
    async fn read_frame(&mut self, limit: u64) -> io::Result<(u8, Bytes)> {
        let flags = self.io.read_u8().await?;
        if flags & !(MORE | LONG | COMMAND) != 0 {
            return Err(invalid(format!("frame flags {flags:#04x}")));
        }
        let len =
            if flags & LONG != 0 { self.io.read_u64().await? } else { u64::from(self.io.read_u8().await?) };
        let limit = limit.min(MAX_FRAME_BYTES);
        if len > limit {
            return Err(invalid(format!("a frame of {len} bytes (at most {limit} here)")));
        }
        let mut body = vec![0u8; len as usize];
        self.io.read_exact(&mut body).await?;
        Ok((flags, Bytes::from(body)))
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> io::Result<()> {
        let w = self.io.get_mut();
        if body.len() > 255 {
            w.write_all(&[flags | LONG]).await?;
            w.write_all(&(body.len() as u64).to_be_bytes()).await?;
        } else {
            w.write_all(&[flags, body.len() as u8]).await?;
        }
        w.write_all(body).await
    }
}

fn command_body(name: &str) -> Vec<u8> {
    let mut b = vec![name.len() as u8];
    b.extend_from_slice(name.as_bytes());
    b
}

fn push_property(b: &mut Vec<u8>, name: &str, value: &[u8]) {
    b.push(name.len() as u8);
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(&(value.len() as u32).to_be_bytes());
    b.extend_from_slice(value);
}

/// A command's name and the rest of its body.
fn parse_command(body: &[u8]) -> io::Result<(&[u8], &[u8])> {
    let n = usize::from(*body.first().ok_or_else(|| invalid("an empty command"))?);
    let name = body.get(1..1 + n).ok_or_else(|| invalid("a command's name is cut short"))?;
    Ok((name, &body[1 + n..]))
}

/// The (name, value) properties of a READY command.
fn properties(mut b: &[u8]) -> io::Result<Vec<(&[u8], &[u8])>> {
    let mut out = Vec::new();
    let cut = || invalid("a READY property is cut short");
    while let Some(&n) = b.first() {
        let name = b.get(1..1 + usize::from(n)).ok_or_else(cut)?;
        b = &b[1 + usize::from(n)..];
        let len = u32::from_be_bytes(b.get(..4).ok_or_else(cut)?.try_into().map_err(|_| cut())?) as usize;
        let end = len.checked_add(4).ok_or_else(cut)?;
        let value = b.get(4..end).ok_or_else(cut)?;
        b = &b[end..];
        out.push((name, value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
