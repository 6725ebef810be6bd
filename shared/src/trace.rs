//! Request traces: the W3C `traceparent` header, spans, and their export to an OpenTelemetry collector over OTLP/HTTP
//! (protobuf, `POST {endpoint}/v1/traces`), written here rather than through the OpenTelemetry SDK (a few hundred
//! lines against a large, fast-moving dependency tree).
//!
//! Invariants: tracing never blocks or fails a request. A finished span goes into a bounded queue
//! ([`MAX_QUEUED_SPANS`]) with `try_send`; when it is full the span is dropped and counted. One exporter thread
//! batches spans ([`MAX_BATCH_SPANS`], or what came within [`FLUSH_EVERY`]) and posts them with short timeouts
//! ([`EXPORT_TIMEOUT`]); a failed post drops its batch (counted) and never retries into the queue. Nothing is
//! allocated per peer input beyond the span being recorded: a `traceparent` that is not exactly W3C version 00 is
//! ignored (the request starts a new trace), and attribute strings are cut at [`MAX_ATTRIBUTE_BYTES`].
//!
//! Sampling: a request without a `traceparent`, or (unless upstream sampling is trusted) one whose `traceparent`
//! says sampled, is traced with the configured ratio; one that says not sampled is not; with upstream sampling
//! trusted (the workers trust their gateway) a sampled `traceparent` is always traced. The decision travels on in
//! the flags.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";
/// Spans waiting for the exporter; past it new spans are dropped (counted).
pub const MAX_QUEUED_SPANS: usize = 8192;
/// Most spans in one export request.
pub const MAX_BATCH_SPANS: usize = 512;
/// A batch is sent at least this often while spans arrive.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// Connect, write and read timeout of one export request.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest attribute string kept (cut at a character boundary).
pub const MAX_ATTRIBUTE_BYTES: usize = 256;

/// A trace id and the span a child hangs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

fn hex_to<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl TraceContext {
    /// A `traceparent` value of version 00 (lower-case hex, ids not all zero); anything else is `None`.
    pub fn parse(header: &str) -> Option<Self> {
        let mut parts = header.trim().split('-');
        let (v, t, s, f) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if v != "00" || parts.next().is_some() {
            return None;
        }
        let trace_id = hex_to::<16>(t).filter(|id| id.iter().any(|b| *b != 0))?;
        let span_id = hex_to::<8>(s).filter(|id| id.iter().any(|b| *b != 0))?;
        let flags = hex_to::<1>(f)?[0];
        Some(Self { trace_id, span_id, sampled: flags & 1 == 1 })
    }

    /// The `traceparent` value naming `span_id` of this trace as the parent.
    pub fn header_for(&self, span_id: [u8; 8]) -> String {
        format!("00-{}-{}-{:02x}", hex(&self.trace_id), hex(&span_id), u8::from(self.sampled))
    }

    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }
}

/// Random ids (a per-process random key hashed with a counter: unique, unpredictable enough for tracing).
pub fn new_id<const N: usize>() -> [u8; N] {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let keys = KEYS.get_or_init(RandomState::new);
    let mut out = [0u8; N];
    for chunk in out.chunks_mut(8) {
        let mut h = keys.build_hasher();
        h.write_u64(NEXT.fetch_add(1, Ordering::Relaxed));
        chunk.copy_from_slice(&h.finish().to_le_bytes()[..chunk.len()]);
    }
    if out.iter().all(|b| *b == 0) {
        out[0] = 1;
    }
    out
}

/// Unix nanoseconds of `at` (a monotonic instant mapped through one wall-clock reading per process).
pub fn unix_nanos(at: Instant) -> u64 {
    static BASE: OnceLock<(Instant, u64)> = OnceLock::new();
    let (i0, n0) = *BASE.get_or_init(|| {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        (Instant::now(), now)
    });
    match at.checked_duration_since(i0) {
        Some(d) => n0.saturating_add(d.as_nanos() as u64),
        None => n0.saturating_sub(i0.duration_since(at).as_nanos() as u64),
    }
}

/// An attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Str(String),
    Int(i64),
    Bool(bool),
    F64(f64),
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        let mut end = s.len().min(MAX_ATTRIBUTE_BYTES);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        Value::Str(s[..end].to_owned())
    }
}
impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::from(s.as_str())
    }
}
impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}
impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(v.min(i64::MAX as u64) as i64)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}

/// OpenTelemetry's span kinds used here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

/// A finished span.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent: Option<[u8; 8]>,
    pub name: &'static str,
    pub kind: Kind,
    pub start: Instant,
    pub end: Instant,
    pub attributes: Vec<(&'static str, Value)>,
    /// The operation failed (OTLP status code ERROR).
    pub error: bool,
}

impl Span {
    /// A span of `trace` under `parent` (`None`: a root span).
    pub fn new(
        trace_id: [u8; 16],
        parent: Option<[u8; 8]>,
        name: &'static str,
        kind: Kind,
        start: Instant,
        end: Instant,
    ) -> Self {
        Self {
            trace_id,
            span_id: new_id(),
            parent,
            name,
            kind,
            start,
            end,
            attributes: Vec::new(),
            error: false,
        }
    }

    pub fn attr(mut self, key: &'static str, value: impl Into<Value>) -> Self {
        self.attributes.push((key, value.into()));
        self
    }
}

/// Where and how spans are exported.
#[derive(Clone, Debug)]
pub struct ExportConfig {
    /// Base URL of the collector's OTLP/HTTP receiver (`http://collector:4318`); spans go to `/v1/traces` under it.
    pub endpoint: String,
    /// `service.name` of the spans' resource.
    pub service: String,
    /// More resource attributes (`service.instance.id`, ...).
    pub resource: Vec<(&'static str, String)>,
}

/// What went wrong setting up or exporting traces.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TraceError {
    /// `--otlp-endpoint` is not `http://host[:port][/base]` (configuration: a retry cannot help).
    #[error("OTLP endpoint {endpoint:?}: {why}")]
    Endpoint { endpoint: String, why: &'static str },
    /// `--trace-sample-ratio` is not in [0, 1].
    #[error("trace sample ratio {0} is not in [0, 1]")]
    Ratio(f64),
    /// The exporter thread could not start.
    #[error("cannot start the trace exporter: {0}")]
    Spawn(String),
    /// An export request did not reach the collector (it may be up again for the next batch).
    #[error("the collector at {target} is unreachable: {why}")]
    Unreachable { target: String, why: String },
    /// The collector answered a status other than 2xx (a 5xx or 429 may pass later, a 4xx will not).
    #[error("the collector at {target} answered {status}")]
    Refused { target: String, status: String },
}

impl TraceError {
    /// Whether sending again later may succeed (the exporter itself never resends a batch: it is dropped).
    pub fn retryable(&self) -> bool {
        match self {
            TraceError::Unreachable { .. } => true,
            TraceError::Refused { status, .. } => status.starts_with('5') || status == "429",
            TraceError::Endpoint { .. } | TraceError::Ratio(_) | TraceError::Spawn(_) => false,
        }
    }
}

/// Counters of the exporter (the binaries publish them as metrics).
#[derive(Debug, Default)]
pub struct Counters {
    pub exported: AtomicU64,
    /// Dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Dropped because their export request failed.
    pub failed: AtomicU64,
}

/// Records spans; [`Tracer::off`] records nothing.
#[derive(Clone, Debug)]
pub struct Tracer {
    tx: Option<SyncSender<Span>>,
    ratio: f64,
    /// A sampled `traceparent` is traced whatever the ratio (see [`Tracer::trusting_upstream_sampling`]).
    trust_upstream: bool,
    counters: Arc<Counters>,
}

impl Default for Tracer {
    fn default() -> Self {
        Self::off()
    }
}

impl Tracer {
    /// A tracer that records nothing.
    pub fn off() -> Self {
        Self { tx: None, ratio: 0.0, trust_upstream: true, counters: Arc::default() }
    }

    /// A binary's tracer: off without an endpoint, else exporting as `service` (instance `instance`).
    pub fn from_flags(
        endpoint: Option<&str>,
        service: &str,
        instance: &str,
        ratio: f64,
    ) -> Result<Self, TraceError> {
        let Some(endpoint) = endpoint else { return Ok(Self::off()) };
        let cfg = ExportConfig {
            endpoint: endpoint.to_owned(),
            service: service.to_owned(),
            resource: vec![("service.instance.id", instance.to_owned())],
        };
        Self::start(cfg, ratio)
    }

    /// Starts the exporter thread for `cfg`; requests without a `traceparent` are traced with probability `ratio`.
    pub fn start(cfg: ExportConfig, ratio: f64) -> Result<Self, TraceError> {
        let target = Target::parse(&cfg.endpoint)?;
        if !(0.0..=1.0).contains(&ratio) {
            return Err(TraceError::Ratio(ratio));
        }
        let (tx, rx) = sync_channel(MAX_QUEUED_SPANS);
        let counters = Arc::new(Counters::default());
        let c = counters.clone();
        std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || export_loop(rx, target, cfg, c))
            .map_err(|e| TraceError::Spawn(e.to_string()))?;
        Ok(Self { tx: Some(tx), ratio, trust_upstream: true, counters })
    }

    /// Whether a `traceparent` that says sampled is traced whatever the ratio (`true`, the default: the caller is
    /// a trusted tier, as the gateway is for its workers), or drawn by the ratio like any other request (`false`:
    /// a client may not make every request of its own traced and so fill the export queue).
    pub fn trusting_upstream_sampling(mut self, trust: bool) -> Self {
        self.trust_upstream = trust;
        self
    }

    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The context a request is traced in: its `traceparent`'s (when sampled), else a new trace with the ratio's
    /// chance; `None`: not traced.
    pub fn context(&self, traceparent: Option<&str>) -> Option<TraceContext> {
        self.tx.as_ref()?;
        let draw = || u64::from_le_bytes(new_id::<8>()) as f64 / u64::MAX as f64;
        match traceparent.and_then(TraceContext::parse) {
            Some(c) if self.trust_upstream => c.sampled.then_some(c),
            // Untrusted: the client's trace is kept as the parent, and a sampled one is traced by the ratio's draw
            // (a client may decline tracing, never force it).
            Some(c) => (c.sampled && draw() < self.ratio).then_some(c),
            None => (draw() < self.ratio).then(|| TraceContext {
                trace_id: new_id(),
                span_id: [0; 8],
                sampled: true,
            }),
        }
    }

    /// Queues a finished span (never waits; dropped and counted when the queue is full).
    pub fn record(&self, span: Span) {
        let Some(tx) = &self.tx else { return };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = tx.try_send(span) {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The parent a child of context `c` names: its span, or none for a new trace's root.
pub fn parent_of(c: &TraceContext) -> Option<[u8; 8]> {
    c.span_id.iter().any(|b| *b != 0).then_some(c.span_id)
}

/// `http://host:port[/base]`.
#[derive(Clone, Debug)]
struct Target {
    host: String,
    port: u16,
    path: String,
}

impl Target {
    fn parse(endpoint: &str) -> Result<Self, TraceError> {
        let bad = |why| TraceError::Endpoint { endpoint: endpoint.to_owned(), why };
        let rest =
            endpoint.strip_prefix("http://").ok_or(bad("not http://host:port (https is not supported)"))?;
        let (authority, base) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse::<u16>().map_err(|_| bad("bad port"))?),
            None => (authority, 4318),
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let base = base.trim_end_matches('/');
        let path = if base.is_empty() { "/v1/traces".to_owned() } else { format!("/{base}/v1/traces") };
        Ok(Self { host: host.trim_matches(['[', ']']).to_owned(), port, path })
    }

    fn post(&self, body: &[u8]) -> Result<(), TraceError> {
        let target = format!("{}:{}", self.host, self.port);
        let unreachable = |e: &dyn std::fmt::Display| TraceError::Unreachable {
            target: target.clone(),
            why: e.to_string(),
        };
        let addr = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| unreachable(&e))?
            .next()
            .ok_or_else(|| unreachable(&"the host resolves to nothing"))?;
        let mut s = TcpStream::connect_timeout(&addr, EXPORT_TIMEOUT).map_err(|e| unreachable(&e))?;
        s.set_write_timeout(Some(EXPORT_TIMEOUT)).map_err(|e| unreachable(&e))?;
        s.set_read_timeout(Some(EXPORT_TIMEOUT)).map_err(|e| unreachable(&e))?;
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/x-protobuf\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            self.path,
            self.host,
            self.port,
            body.len()
        );
        s.write_all(head.as_bytes()).and_then(|_| s.write_all(body)).map_err(|e| unreachable(&e))?;
        let mut status = [0u8; 12];
        s.read_exact(&mut status).map_err(|e| unreachable(&e))?;
        match &status[9..10] {
            b"2" => Ok(()),
            _ => Err(TraceError::Refused {
                target,
                status: String::from_utf8_lossy(&status[9..12]).into_owned(),
            }),
        }
    }
}

fn export_loop(rx: Receiver<Span>, target: Target, cfg: ExportConfig, counters: Arc<Counters>) {
    let mut batch = Vec::with_capacity(MAX_BATCH_SPANS);
    let mut since = Instant::now();
    loop {
        let closed = match rx.recv_timeout(FLUSH_EVERY) {
            Ok(s) => {
                if batch.is_empty() {
                    since = Instant::now();
                }
                batch.push(s);
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        let due = batch.len() >= MAX_BATCH_SPANS || (!batch.is_empty() && since.elapsed() >= FLUSH_EVERY);
        if due || (closed && !batch.is_empty()) {
            let body = encode(&cfg, &batch);
            let n = batch.len() as u64;
            match target.post(&body) {
                Ok(()) => counters.exported.fetch_add(n, Ordering::Relaxed),
                Err(e) => {
                    eprintln!("kvgate: {n} spans dropped (retryable: {}): {e}", e.retryable());
                    counters.failed.fetch_add(n, Ordering::Relaxed)
                }
            };
            batch.clear();
        }
        if closed {
            return;
        }
    }
}

/// Protobuf writing for the few OTLP messages used (field numbers from opentelemetry-proto's trace/v1, common/v1,
/// resource/v1 and collector/trace/v1).
mod pb {
    pub fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    pub fn tag(out: &mut Vec<u8>, field: u32, wire: u8) {
        varint(out, (u64::from(field) << 3) | u64::from(wire));
    }
    pub fn bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
        tag(out, field, 2);
        varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }
    pub fn message(out: &mut Vec<u8>, field: u32, write: impl FnOnce(&mut Vec<u8>)) {
        let mut inner = Vec::new();
        write(&mut inner);
        bytes(out, field, &inner);
    }
    pub fn fixed64(out: &mut Vec<u8>, field: u32, v: u64) {
        tag(out, field, 1);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
        tag(out, field, 0);
        varint(out, v);
    }
}

fn key_value(out: &mut Vec<u8>, field: u32, key: &str, value: &Value) {
    pb::message(out, field, |kv| {
        pb::bytes(kv, 1, key.as_bytes());
        pb::message(kv, 2, |any| match value {
            Value::Str(s) => pb::bytes(any, 1, s.as_bytes()),
            Value::Bool(b) => pb::uint(any, 2, u64::from(*b)),
            Value::Int(i) => pb::uint(any, 3, *i as u64),
            Value::F64(f) => pb::fixed64(any, 4, f.to_bits()),
        });
    });
}

/// An `ExportTraceServiceRequest` of `spans` under one resource.
pub fn encode(cfg: &ExportConfig, spans: &[Span]) -> Vec<u8> {
    let mut out = Vec::new();
    pb::message(&mut out, 1, |rs| {
        pb::message(rs, 1, |res| {
            key_value(res, 1, "service.name", &Value::from(cfg.service.as_str()));
            for (k, v) in &cfg.resource {
                key_value(res, 1, k, &Value::from(v.as_str()));
            }
        });
        pb::message(rs, 2, |ss| {
            pb::message(ss, 1, |scope| {
                pb::bytes(scope, 1, b"kvgate");
                pb::bytes(scope, 2, env!("CARGO_PKG_VERSION").as_bytes());
            });
            for s in spans {
                pb::message(ss, 2, |sp| {
                    pb::bytes(sp, 1, &s.trace_id);
                    pb::bytes(sp, 2, &s.span_id);
                    if let Some(p) = s.parent {
                        pb::bytes(sp, 4, &p);
                    }
                    pb::bytes(sp, 5, s.name.as_bytes());
                    pb::uint(sp, 6, s.kind as u64);
                    pb::fixed64(sp, 7, unix_nanos(s.start));
                    pb::fixed64(sp, 8, unix_nanos(s.end.max(s.start)));
                    for (k, v) in &s.attributes {
                        key_value(sp, 9, k, v);
                    }
                    pb::message(sp, 15, |st| pb::uint(st, 3, if s.error { 2 } else { 1 }));
                });
            }
        });
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_is_parsed_strictly_and_written_back() {
        let h = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = TraceContext::parse(h).expect("valid");
        assert!(c.sampled);
        assert_eq!(c.header_for(c.span_id), h);
        assert!(
            !TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
                .expect("ok")
                .sampled
        );
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ids_are_distinct_and_never_zero() {
        let ids: std::collections::HashSet<[u8; 8]> = (0..10_000).map(|_| new_id()).collect();
        assert_eq!(ids.len(), 10_000);
        assert!(ids.iter().all(|i| i.iter().any(|b| *b != 0)));
    }

    #[test]
    fn endpoints_and_attribute_bounds() {
        let t = Target::parse("http://collector:4318").expect("ok");
        assert_eq!((t.host.as_str(), t.port, t.path.as_str()), ("collector", 4318, "/v1/traces"));
        assert_eq!(Target::parse("http://127.0.0.1:9/otlp/").expect("ok").path, "/otlp/v1/traces");
        assert!(Target::parse("https://c:4318").is_err() && Target::parse("http://:1").is_err());
        let cfg = ExportConfig { endpoint: "http://c".into(), service: "s".into(), resource: vec![] };
        assert!(matches!(Tracer::start(cfg, 2.0), Err(TraceError::Ratio(_))));
        let closed =
            Target::parse("http://127.0.0.1:9").expect("ok").post(b"x").expect_err("nothing listens on 9");
        assert!(closed.retryable(), "{closed}");
        assert!(!TraceError::Refused { target: "c".into(), status: "400".into() }.retryable());
        assert!(Tracer::from_flags(None, "s", "i", 1.0).is_ok_and(|t| !t.enabled()));
        let long = "é".repeat(400);
        let Value::Str(s) = Value::from(long.as_str()) else { unreachable!() };
        assert!(s.len() <= MAX_ATTRIBUTE_BYTES && s.chars().all(|c| c == 'é'));
    }

    #[test]
    fn a_clients_sampled_flag_is_drawn_by_the_ratio_unless_upstream_sampling_is_trusted() {
        let sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let (tx, _rx) = sync_channel(1);
        let never = Tracer { tx: Some(tx), ratio: 0.0, trust_upstream: true, counters: Arc::default() };
        assert!(never.context(Some(sampled)).is_some(), "trusted: the flag decides");
        let never = never.trusting_upstream_sampling(false);
        assert!(
            (0..200).all(|_| never.context(Some(sampled)).is_none()),
            "untrusted: ratio 0 traces nothing"
        );
        let always = Tracer { ratio: 1.0, ..never };
        let c = always.context(Some(sampled)).expect("ratio 1 traces");
        assert_eq!(
            parent_of(&c),
            Some(TraceContext::parse(sampled).expect("ok").span_id),
            "the client's parent"
        );
    }

    #[test]
    fn a_full_queue_drops_and_counts_rather_than_waits() {
        // An exporter that never drains: a closed port, queue of MAX_QUEUED_SPANS.
        let (tx, _rx) = sync_channel(2);
        let t = Tracer { tx: Some(tx), ratio: 1.0, trust_upstream: true, counters: Arc::default() };
        let now = Instant::now();
        for _ in 0..5 {
            t.record(Span::new(new_id(), None, "x", Kind::Internal, now, now));
        }
        assert_eq!(t.counters().dropped.load(Ordering::Relaxed), 3);
        assert!(Tracer::off()
            .context(Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"))
            .is_none());
    }
}
