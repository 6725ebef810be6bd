//! The public listener's accept loop, in front of pingora's HTTP handling: the guard against slow and idle
//! clients that pingora 0.9 does not have on its own (its header read only has a per-read timeout, so a client
//! trickling one byte every few seconds holds a connection forever, and it has no connection cap).
//!
//! For every connection:
//! - over `--max-connections` open connections, a new one gets a 503 and is closed;
//! - before each request the header is read here, whole, with a deadline: the first byte must come within
//!   `--header-read-timeout` on a new connection (`--keepalive-timeout` on a reused one; silence then just closes
//!   it), and the rest of the header within `--header-read-timeout` of the first byte (else 408 and close); a
//!   header over [`MAX_HEADER_BYTES`] gets 431;
//! - the bytes read are handed to pingora's HTTP/1 session as if it had read them itself (its pipelined-prefix
//!   hook), and the connection is reused for as long as pingora says it may;
//! - a request pipelined behind another (sent before its answer, RFC 9112 §9.3.2) is answered in its turn: the
//!   bytes pingora read past the first request are parsed as the next one (pingora reads the rest of that header
//!   itself, each read within its own timeout).
//!
//! The request body has its own total deadline in `exchange.rs` (`--request-read-timeout`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::BytesMut;
use pingora::apps::HttpServerApp;
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::Stream;
use pingora::proxy::HttpProxy;
use pingora::server::{ListenFds, ShutdownWatch};
use pingora::services::Service;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::serve::proxy::Gateway;

/// Largest request header accepted.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// The limits of the listener.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub keepalive_timeout: Duration,
}

/// The public listener as a pingora service.
pub struct PublicListener {
    listener: std::sync::Mutex<Option<std::net::TcpListener>>,
    app: Arc<HttpProxy<Gateway>>,
    limits: ConnLimits,
    threads: usize,
}

impl PublicListener {
    /// Binds `addr` now (so a busy port fails at start, not later in a pingora thread).
    pub fn bind(
        addr: &str,
        app: HttpProxy<Gateway>,
        limits: ConnLimits,
        threads: usize,
    ) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        Ok(Self { listener: std::sync::Mutex::new(Some(listener)), app: Arc::new(app), limits, threads })
    }
}

#[async_trait]
impl Service for PublicListener {
    async fn start_service(&mut self, _fds: Option<ListenFds>, mut shutdown: ShutdownWatch, _per_fd: usize) {
        let std_listener = self.listener.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(listener) = std_listener.and_then(|l| tokio::net::TcpListener::from_std(l).ok()) else {
            tracing::error!("the public listener cannot start");
            return;
        };
        let slots = Arc::new(Semaphore::new(self.limits.max_connections));
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = shutdown.changed() => {
                    if *shutdown.borrow() { break } else { continue }
                }
            };
            let tcp = match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            match slots.clone().try_acquire_owned() {
                Ok(slot) => {
                    let (app, limits, shutdown) = (self.app.clone(), self.limits, shutdown.clone());
                    tokio::spawn(async move {
                        serve_connection(tcp, app, limits, shutdown).await;
                        drop(slot);
                    });
                }
                Err(_) => {
                    metrics::counter!("kvgate_gateway_connections_refused_total").increment(1);
                    tokio::spawn(refuse(
                        tcp,
                        503,
                        "too_many_connections",
                        "the gateway is at --max-connections",
                    ));
                }
            }
        }
        tracing::info!("public listener stopped accepting");
    }

    fn name(&self) -> &str {
        "kvgate public listener"
    }

    fn threads(&self) -> Option<usize> {
        Some(self.threads)
    }
}

/// Writes an OpenAI-style error and closes the connection.
async fn refuse<S: tokio::io::AsyncWrite + Unpin>(mut io: S, status: u16, code: &str, message: &str) {
    let (reason, kind) = match status {
        408 => ("Request Timeout", "invalid_request_error"),
        431 => ("Request Header Fields Too Large", "invalid_request_error"),
        _ => ("Service Unavailable", "server_error"),
    };
    metrics::counter!("kvgate_gateway_errors_total", "code" => code.to_owned()).increment(1);
    let body = kvgate_shared::openai::ErrorBody::new(kind, code, message, None).to_json();
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = io.write_all(head.as_bytes()).await;
        let _ = io.write_all(body.as_bytes()).await;
        let _ = io.shutdown().await;
    })
    .await;
}

/// Why no request header was read.
#[derive(Debug, PartialEq, Eq)]
enum HeadError {
    /// Closed, or silent past the wait for a first byte: close quietly.
    Gone,
    /// The header started but did not finish in time.
    Timeout,
    TooLarge,
}

/// Reads one request header (and whatever body bytes came with it) within the deadlines.
async fn read_head<S: tokio::io::AsyncRead + Unpin>(
    io: &mut S,
    first_byte_wait: Duration,
    header_timeout: Duration,
) -> Result<BytesMut, HeadError> {
    let mut buf = BytesMut::with_capacity(4096);
    match tokio::time::timeout(first_byte_wait, io.read_buf(&mut buf)).await {
        Ok(Ok(n)) if n > 0 => {}
        _ => return Err(HeadError::Gone),
    }
    let deadline = Instant::now() + header_timeout;
    let mut scanned: usize = 0;
    loop {
        // The end of the header: an empty line (searched only in what is new, with 3 bytes of overlap).
        if buf[scanned.saturating_sub(3)..].windows(4).any(|w| w == b"\r\n\r\n") {
            return Ok(buf);
        }
        scanned = buf.len();
        if buf.len() > MAX_HEADER_BYTES {
            return Err(HeadError::TooLarge);
        }
        match tokio::time::timeout_at(deadline, io.read_buf(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {}
            Ok(_) => return Err(HeadError::Gone),
            Err(_) => return Err(HeadError::Timeout),
        }
    }
}

/// Whether a finished request left the next, pipelined one's bytes to its reuse. pingora 0.9.1 keeps them in the
/// settings' private `pipelined_prefix` and offers no getter; its derived `Debug` names the field. Pinned by
/// `tests/faults_clients.rs` (a pipelined request gets its answer), which fails if this stops seeing the prefix.
fn holds_pipelined_request(s: &pingora::apps::HttpPersistentSettings) -> bool {
    format!("{s:?}").contains("pipelined_prefix: Some(")
}

async fn serve_connection(
    tcp: tokio::net::TcpStream,
    app: Arc<HttpProxy<Gateway>>,
    limits: ConnLimits,
    shutdown: ShutdownWatch,
) {
    let mut stream: Stream = Box::new(L4Stream::from(tcp));
    let mut settings = None;
    let mut first_wait = limits.header_read_timeout;
    loop {
        // A request pipelined behind the last one (RFC 9112 §9.3.2) is already read, in pingora's hands: it is
        // parsed from there, not waited for on the socket (where nothing more may come: the client waits for its
        // answers).
        if settings.as_ref().is_some_and(holds_pipelined_request) {
            let mut session = ServerSession::new_http1(stream);
            if let Some(s) = settings.take() {
                pingora::apps::HttpPersistentSettings::apply_to_session(s, &mut session);
            }
            metrics::counter!("kvgate_gateway_pipelined_requests_total").increment(1);
            match app.process_new_http(session, &shutdown).await {
                Some(reused) => (stream, settings) = reused.consume(),
                None => return,
            }
            continue;
        }
        let head = match read_head(&mut stream, first_wait, limits.header_read_timeout).await {
            Ok(h) => h,
            Err(HeadError::Gone) => return,
            Err(HeadError::Timeout) => {
                let msg = "the request header did not arrive in time (--header-read-timeout)";
                return refuse(stream, 408, "request_timeout", msg).await;
            }
            Err(HeadError::TooLarge) => {
                let msg = format!("the request header is over {MAX_HEADER_BYTES} bytes");
                return refuse(stream, 431, "header_too_large", &msg).await;
            }
        };
        let mut session = ServerSession::new_http1(stream);
        if let Some(s) = settings.take() {
            pingora::apps::HttpPersistentSettings::apply_to_session(s, &mut session);
        }
        session.set_pipelined_prefix(head);
        let keepalive =
            if *shutdown.borrow() { None } else { Some(limits.keepalive_timeout.as_secs().max(1)) };
        session.set_keepalive(keepalive);
        match app.process_new_http(session, &shutdown).await {
            Some(reused) => {
                let (s, set) = reused.consume();
                stream = s;
                settings = set;
                first_wait = limits.keepalive_timeout;
            }
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn headers_must_arrive_whole_in_time() {
        let t = Duration::from_secs(2);
        let mut whole = tokio_test_reader(&[b"GET / HTTP/1.1\r\nhost: x\r\n\r\nBODY"], Duration::ZERO);
        assert_eq!(
            &read_head(&mut whole, t, t).await.expect("whole")[..],
            b"GET / HTTP/1.1\r\nhost: x\r\n\r\nBODY"
        );
        // Trickled over 3 s with a 2 s deadline after the first byte.
        let mut trickle = tokio_test_reader(&[b"G", b"E", b"T", b" /"], Duration::from_secs(1));
        assert_eq!(read_head(&mut trickle, t, t).await.expect_err("slow"), HeadError::Timeout);
        let mut silent = tokio_test_reader(&[], Duration::ZERO);
        assert_eq!(read_head(&mut silent, t, t).await.expect_err("idle"), HeadError::Gone);
    }

    /// A reader that yields `chunks` one by one, `gap` apart, then stays open and silent.
    fn tokio_test_reader(chunks: &[&[u8]], gap: Duration) -> impl tokio::io::AsyncRead + Unpin {
        let (mut tx, rx) = tokio::io::duplex(1 << 16);
        let chunks: Vec<Vec<u8>> = chunks.iter().map(|c| c.to_vec()).collect();
        tokio::spawn(async move {
            for c in chunks {
                tokio::time::sleep(gap).await;
                let _ = tx.write_all(&c).await;
            }
            std::future::pending::<()>().await;
            drop(tx);
        });
        rx
    }
}
