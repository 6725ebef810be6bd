//! The endpoint picker (`--epp-listen`): kvgate as the Endpoint Picker of an Envoy-based Kubernetes inference
//! gateway (Gateway API Inference Extension, `docs/proposals/004-endpoint-picker-protocol`). The proxy (Envoy,
//! through its `ext_proc` filter) streams each request to the picker over gRPC; the picker runs the proxy path's
//! stages on it (tokenize, hash, price, admit, route: `serve::exchange`) and answers with the pick instead of
//! forwarding, then follows the pod's answer through (to meter and settle it) as the proxy path does.
//!
//! One stream is one request, in two phases, each its own file:
//! 1. [`pick`]: the request headers, then its body (buffered here, within `--max-body-bytes` and
//!    `--request-read-timeout`), decided; answered with the `x-gateway-destination-endpoint` header and the same
//!    value in the `envoy.lb` dynamic metadata (the pick, then the fallbacks), the headers and body the pod gets, or
//!    an immediate answer (503 when no endpoint can serve, 429 when the class budget sheds it, the gateway's other
//!    errors as they are);
//! 2. [`follow`]: the response passed back and settled on the endpoint that served.
//!
//! The messages are built and read in [`wire`]; the stream's two directions and the request as the stages read it
//! live in [`io`]. The gRPC health service answers `liveness` (always, once listening), and `""`, the ext_proc
//! service's name, `readiness` and `inference-extension` (the names GIE's charts and conformance manifests probe)
//! once the gateway knows a model's tokenizer.
//!
//! Body modes: `FULL_DUPLEX_STREAMED` (the protocol's reference) and `BUFFERED` for the request (`STREAMED` and
//! `NONE` do not give the whole body before the pick, `BUFFERED_PARTIAL` may never end it: refused with a 500 that
//! says so); `FULL_DUPLEX_STREAMED`, `BUFFERED`, `STREAMED` or `NONE` (charged the request's price: no usage is
//! seen) for the response.
//!
//! TLS: with `--epp-tls-cert` / `--epp-tls-key` the port serves gRPC over TLS (Envoy Gateway dials pickers that
//! way), else HTTP/2 cleartext (Istio, a hand-written Envoy); with `--epp-client-ca` too, mutual TLS.
//!
//! Who may drive it: [`auth`] (a token in each stream's metadata, mutual TLS, or a loopback address / a network
//! said to admit only the proxies).
//!
//! Invariants: at most `--epp-max-streams` streams are decided or followed at once, holding at most
//! `--epp-max-buffered-bytes` of request bodies between them (past either: 503 `epp_overloaded`); a stream's first
//! message must come within `--header-read-timeout`; every stream's in-flight
//! slot and permit are given back when it ends, however it ends.

pub mod auth;
pub mod follow;
pub mod io;
pub mod pick;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{processing_request::Request, ProcessingRequest};
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::{Status, Streaming};

use crate::errors::ApiError;
use crate::serve::host::ServeHost;
use crate::serve::spans::RequestTrace;
use crate::serve::stages::Ctx;
use io::{EppClient, StreamIo};
use wire::BodyMode;

/// Answers queued per stream before the picker waits for the proxy to take them.
pub const ANSWER_QUEUE: usize = 16;
/// The gRPC service name the proxy calls.
pub const SERVICE_NAME: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// How often readiness is brought up to date.
pub const READINESS_EVERY: Duration = Duration::from_secs(1);

/// The ext_proc service.
pub struct Picker {
    host: Arc<dyn ServeHost>,
    streams: Arc<Semaphore>,
    /// Request body bytes buffered across all streams (`--epp-max-buffered-bytes`).
    bodies: Arc<Semaphore>,
}

impl Picker {
    fn token(&self) -> Option<&str> {
        self.host.cfg().epp_auth.token.as_deref()
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<wire::Message, Status>>;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        // Before anything of the stream is read or held.
        auth::check(self.token(), request.metadata())?;
        let (tx, rx) = mpsc::channel(ANSWER_QUEUE);
        let io = StreamIo::new(request.into_inner(), tx, self.host.cfg().stream_idle_timeout);
        let (host, bodies) = (self.host.clone(), self.bodies.clone());
        let held = self.streams.clone().try_acquire_owned();
        tokio::spawn(async move {
            let _held = match held {
                Ok(p) => p,
                Err(_) => return overloaded(io, host.cfg().header_read_timeout).await,
            };
            run(host, io, bodies).await;
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// Past `--epp-max-streams`: the request is answered 503 without being read.
async fn overloaded(mut io: StreamIo, within: Duration) {
    let e = ApiError::unavailable("epp_overloaded", "the endpoint picker is at --epp-max-streams; retry");
    if let Ok(Some(_)) = tokio::time::timeout(within, io.next()).await {
        io.send([pick::refusal(&e)]).await;
    }
}

/// One stream, from the request headers to the answer's end.
async fn run(host: Arc<dyn ServeHost>, mut io: StreamIo, bodies: Arc<Semaphore>) {
    // The proxy sends the headers as it opens the stream: one that stays silent does not keep its slot.
    let Ok(Some(first)) = tokio::time::timeout(host.cfg().header_read_timeout, io.next()).await else {
        return;
    };
    let (request_mode, response_mode) = wire::body_modes(&first);
    let subset = wire::subset_hint(first.metadata_context.as_ref());
    let Some(Request::RequestHeaders(h)) = first.request else {
        io.fail(Status::invalid_argument("the first message of a stream must be the request headers")).await;
        return;
    };
    let headers = wire::header_list(&h);
    let method = wire::header_text(&headers, ":method").unwrap_or("").to_owned();
    let path = wire::header_text(&headers, ":path").unwrap_or("").split('?').next().unwrap_or("").to_owned();
    let mut ctx = Ctx::new();
    let traceparent = wire::header_text(&headers, kvgate_shared::trace::TRACEPARENT);
    ctx.trace = RequestTrace::begin(host.tracer(), traceparent);
    let refused = match (method.as_str(), request_mode, response_mode) {
        ("POST", BodyMode::Streamed | BodyMode::None | BodyMode::Unsupported, _) => Some(ApiError::internal(
            "the proxy's request_body_mode does not give the picker the whole body before the pick (STREAMED, \
             NONE, BUFFERED_PARTIAL): use FULL_DUPLEX_STREAMED or BUFFERED",
        )),
        ("POST", _, BodyMode::Unsupported) => Some(ApiError::internal(
            "the proxy's response_body_mode is not one the picker follows: use FULL_DUPLEX_STREAMED, BUFFERED, \
             STREAMED or NONE",
        )),
        ("POST", _, _) => None,
        _ => Some(ApiError::not_found_route(&path)),
    };
    let buffered = request_mode == BodyMode::Buffered;
    if let Some(e) = refused {
        ctx.status = e.status;
        io.send([pick::refusal(&e)]).await;
    } else if buffered && !h.end_of_stream && !io.send([wire::headers_continue(true)]).await {
        ctx.status = stages_closed();
    } else {
        let mut client = EppClient {
            io: &mut io,
            headers: io::header_map(&headers),
            body_done: h.end_of_stream,
            trailers: false,
            buffered,
            bodies,
            body_held: None,
        };
        let trusted = pick::trusted_sent(&headers);
        let decided = pick::decide(&host, &mut client, &mut ctx, &path, subset, trusted).await;
        let trailers = client.trailers;
        // The body's bytes stay counted until the stream ends (the pick's body and the prepared one hold them).
        let _body_held = client.body_held.take();
        match decided {
            Err(e) => {
                ctx.status = e.status;
                io.send([pick::refusal(&e)]).await;
            }
            Ok(None) => {}
            Ok(Some(p)) => {
                if io.send(pick::answers(&p, buffered, trailers)).await {
                    follow::follow(&host, &mut io, &mut ctx, p, response_mode).await;
                }
            }
        }
    }
    let status = follow::closed_status(&ctx);
    if let Some(t) = &ctx.trace {
        t.end(host.tracer(), &path, status, ctx.route, &ctx.class, ctx.worker.as_deref());
    }
    metrics::counter!("kvgate_gateway_epp_requests_total", "route" => ctx.route, "status" => status.to_string(),
        "class" => ctx.class.clone())
    .increment(1);
    metrics::histogram!("kvgate_gateway_epp_request_seconds").record(ctx.started.elapsed().as_secs_f64());
}

fn stages_closed() -> u16 {
    crate::serve::stages::CLIENT_CLOSED
}

/// Why the picker did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A TLS file could not be read (fix the path or its permissions; retrying as is does not help).
    #[error("{path}: {source}")]
    TlsFile { path: String, source: std::io::Error },
    /// The certificate, key or client CA is not usable PEM (retrying does not help).
    #[error("--epp-tls-cert / --epp-tls-key / --epp-client-ca: {0}")]
    TlsConfig(String),
    /// The address could not be bound (another process holds the port: a retry may help once it is free).
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    /// Its thread or runtime could not be made (the process is out of resources).
    #[error("cannot start its runtime: {0}")]
    Runtime(std::io::Error),
    /// It did not say it listens within 10 s.
    #[error("the endpoint picker did not start")]
    NotStarted,
}

impl StartError {
    /// Whether starting again, unchanged, may succeed.
    pub fn retryable(&self) -> bool {
        matches!(self, StartError::Bind { .. } | StartError::NotStarted)
    }
}

/// Starts the picker on its own thread and runtime: the ext_proc service and the gRPC health service on `addr`.
/// Returns once it listens (or could not).
pub fn spawn(
    host: Arc<dyn ServeHost>,
    addr: &str,
    max_streams: usize,
    threads: usize,
) -> Result<(), StartError> {
    let addr = addr.to_owned();
    let tls = match &host.cfg().epp_tls {
        None => None,
        Some((cert, key)) => {
            let read = |p: &std::path::Path| {
                std::fs::read(p)
                    .map_err(|source| StartError::TlsFile { path: p.display().to_string(), source })
            };
            let identity = tonic::transport::Identity::from_pem(read(cert)?, read(key)?);
            let mut tls = tonic::transport::ServerTlsConfig::new().identity(identity);
            if let Some(ca) = &host.cfg().epp_auth.client_ca {
                let ca = read(ca)?;
                if !String::from_utf8_lossy(&ca).contains("-----BEGIN CERTIFICATE-----") {
                    return Err(StartError::TlsConfig("the client CA file holds no PEM certificate".into()));
                }
                tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(ca));
            }
            // Refused at start, not at the first connection.
            tonic::transport::Server::builder()
                .tls_config(tls.clone())
                .map_err(|e| StartError::TlsConfig(e.to_string()))?;
            Some(tls)
        }
    };
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("kvgate-epp".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads.max(1))
                .thread_name("kvgate-epp")
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return drop(ready_tx.send(Err(StartError::Runtime(e)))),
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::bind(&addr).await {
                    Ok(l) => l,
                    Err(source) => return drop(ready_tx.send(Err(StartError::Bind { addr, source }))),
                };
                let _ = ready_tx.send(Ok(()));
                serve(host, listener, max_streams, tls).await;
            });
        })
        .map_err(StartError::Runtime)?;
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap_or(Err(StartError::NotStarted))
}

/// Serves the picker and its health on `listener` until the process ends (over TLS with `tls`).
pub async fn serve(
    host: Arc<dyn ServeHost>,
    listener: tokio::net::TcpListener,
    max_streams: usize,
    tls: Option<tonic::transport::ServerTlsConfig>,
) {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_service_status("liveness", tonic_health::ServingStatus::Serving).await;
    let readiness_host = host.clone();
    tokio::spawn(async move {
        let mut was = None;
        loop {
            let ready = !readiness_host.warming_up();
            if was != Some(ready) {
                let status = if ready {
                    tonic_health::ServingStatus::Serving
                } else {
                    tonic_health::ServingStatus::NotServing
                };
                for name in ["", SERVICE_NAME, "readiness", "inference-extension"] {
                    reporter.set_service_status(name, status).await;
                }
                was = Some(ready);
            }
            tokio::time::sleep(READINESS_EVERY).await;
        }
    });
    let max_message = host.cfg().max_body_bytes.saturating_add(64 * 1024);
    let bodies = Arc::new(Semaphore::new(host.cfg().epp_max_buffered_bytes.min(Semaphore::MAX_PERMITS)));
    let picker =
        Picker { host, streams: Arc::new(Semaphore::new(max_streams.min(Semaphore::MAX_PERMITS))), bodies };
    let service = ExternalProcessorServer::new(picker).max_decoding_message_size(max_message);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = match builder.tls_config(tls) {
            Ok(b) => b,
            Err(e) => {
                return tracing::error!(error = %e, "endpoint picker: the TLS certificate or key is not usable")
            }
        };
    }
    let served = builder
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        // Streams past --epp-max-streams are answered 503; past this many more on one connection, refused by HTTP/2.
        .max_concurrent_streams(Some(u32::try_from(max_streams.saturating_add(64)).unwrap_or(u32::MAX)))
        .add_service(health)
        .add_service(service)
        // Without TCP_NODELAY each answer waits out the peer's delayed ACK (about 40 ms a request on loopback).
        .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true)))
        .await;
    if let Err(e) = served {
        tracing::error!(error = %e, "endpoint picker listener failed");
    }
}
