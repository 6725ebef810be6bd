//! The prefill side: the KV transfer listener. Each link serves transfers one after another; each transfer is a
//! checked Hello, an export in the engine, its blocks streamed as the prefill writes them, and Done with the first
//! token, all under a lease (see the module above). Every way out of a transfer aborts its engine request unless it
//! finished, so the pool returns to its baseline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_shared::hashing::ExtraKeys;
use tokio::net::TcpListener;
use tokio::time::sleep_until;

use super::frame::{
    accept_code, Done, Frame, Hello, Probe, Progress, RefuseCode, MAX_PROBE_BYTES, PROGRESS_SINCE, VERSION,
};
use super::link::{send_by, send_parting, KvLink, TcpLink, IDLE_TIMEOUT};
use super::{count, count_bytes, unix_ms, TransferError, Transfers};
use crate::engine::{EngineRequest, ExportBacklog, FinishReason, SamplingParams, StepOutput};
use crate::server::engine_thread::{EngineHandle, Refusal};

const SIDE: &str = "export";

/// Most links a listener holds from one peer address (a decode worker opens one per concurrent transfer and pools
/// up to `link::MAX_IDLE_PER_PEER`); one more is closed at once.
pub const MAX_LINKS_PER_PEER: usize = 64;
/// Most links a listener holds in all.
pub const MAX_LINKS: usize = 512;
/// Most link probes a listener answers per minute (a probe sends up to `MAX_PROBE_BYTES` for 61 bytes asked);
/// past it a Probe is refused `overloaded`. One runs at a time.
pub const MAX_PROBES_PER_MINUTE: u32 = 6;

/// Most grants a listener remembers as served (each for its window, `handoff::ASSERTION_WINDOW_MS`); past it a
/// Hello is refused `overloaded` rather than a grant forgotten early.
pub const MAX_SEEN_GRANTS: usize = 65_536;

/// What a listener keeps across its links: the address grants name it by, links by peer address, probes in the
/// current minute, the grants it has served.
#[derive(Default)]
pub struct ListenerState {
    /// `host:port` decode workers reach it at (what the gateway's grants name as the peer).
    pub reach: String,
    links: std::sync::Mutex<(usize, std::collections::HashMap<std::net::IpAddr, usize>)>,
    probes: std::sync::Mutex<(Option<Instant>, u32, bool)>,
    grants: std::sync::Mutex<std::collections::HashMap<[u8; 32], u64>>,
}

/// A link's place in the listener's counts, given back when the link ends.
struct LinkSlot<'a> {
    state: &'a ListenerState,
    ip: std::net::IpAddr,
}

impl ListenerState {
    /// A slot for a link from `ip`, or which cap refused it.
    fn take(&self, ip: std::net::IpAddr) -> Result<LinkSlot<'_>, &'static str> {
        let mut g = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let (total, by_ip) = &mut *g;
        if *total >= MAX_LINKS {
            return Err("total");
        }
        let n = by_ip.entry(ip).or_default();
        if *n >= MAX_LINKS_PER_PEER {
            return Err("per_peer");
        }
        *n += 1;
        *total += 1;
        Ok(LinkSlot { state: self, ip })
    }

    /// Records a grant's one use: `Err` if it was served already or the memory is full.
    fn use_grant(&self, g: kvgate_shared::handoff::Granted, now_ms: u64) -> Result<(), (RefuseCode, String)> {
        let mut seen = self.grants.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains_key(&g.code) {
            return Err((RefuseCode::Unauthorized, "the grant was used already".into()));
        }
        if seen.len() >= MAX_SEEN_GRANTS {
            let window = kvgate_shared::handoff::ASSERTION_WINDOW_MS;
            seen.retain(|_, issued| issued.saturating_add(window) >= now_ms);
        }
        if seen.len() >= MAX_SEEN_GRANTS {
            return Err((
                RefuseCode::Overloaded,
                format!("{MAX_SEEN_GRANTS} grants served within the window"),
            ));
        }
        seen.insert(g.code, g.issued_ms);
        Ok(())
    }

    /// Whether a probe may run now (under the minute's budget, none running); `Err` is the refusal's reason.
    fn start_probe(&self, now: Instant) -> Result<ProbeSlot<'_>, String> {
        let mut g = self.probes.lock().unwrap_or_else(|e| e.into_inner());
        let (since, count, running) = &mut *g;
        if *running {
            return Err("another link probe is running".into());
        }
        if since.is_none_or(|s| now.duration_since(s) >= Duration::from_secs(60)) {
            *since = Some(now);
            *count = 0;
        }
        if *count >= MAX_PROBES_PER_MINUTE {
            return Err(format!("{MAX_PROBES_PER_MINUTE} probes this minute already"));
        }
        *count += 1;
        *running = true;
        Ok(ProbeSlot(self))
    }
}

impl Drop for LinkSlot<'_> {
    fn drop(&mut self) {
        let mut g = self.state.links.lock().unwrap_or_else(|e| e.into_inner());
        let (total, by_ip) = &mut *g;
        *total = total.saturating_sub(1);
        if let Some(n) = by_ip.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                by_ip.remove(&self.ip);
            }
        }
    }
}

struct ProbeSlot<'a>(&'a ListenerState);

impl Drop for ProbeSlot<'_> {
    fn drop(&mut self) {
        self.0.probes.lock().unwrap_or_else(|e| e.into_inner()).2 = false;
    }
}

fn refused_link(reason: &'static str) {
    metrics::counter!("kvgate_worker_kv_links_refused_total", "reason" => reason).increment(1);
}

/// Accepts links until the process ends: each within the caps, handshaken (the dialer proves the key before
/// anything else is read), then served.
pub async fn serve(listener: TcpListener, t: Arc<Transfers>, reach: String) {
    let state = Arc::new(ListenerState { reach, ..Default::default() });
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "KV transfer listener: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (t, state) = (t.clone(), state.clone());
        tokio::spawn(async move {
            let _slot = match state.take(from.ip()) {
                Ok(s) => s,
                Err(cap) => {
                    tracing::warn!(peer = %from, cap, "KV transfer listener: too many links; closing");
                    return refused_link(cap);
                }
            };
            let link = match TcpLink::accept(stream, from.to_string(), t.listener_limits(), &t.key).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(peer = %from, error = %e, "KV transfer listener: handshake failed");
                    return refused_link(if matches!(e, TransferError::Refused { .. }) {
                        "unauthorized"
                    } else {
                        "handshake"
                    });
                }
            };
            serve_link(link, &t, &state).await
        });
    }
}

/// Transfers on one link, until it breaks, idles out or a transfer ends badly.
pub async fn serve_link<L: KvLink>(mut link: L, t: &Transfers, state: &ListenerState) {
    loop {
        let first = match tokio::time::timeout(2 * IDLE_TIMEOUT, link.recv()).await {
            Ok(Ok(Frame::Hello(h))) => h,
            Ok(Ok(Frame::Probe(p))) => match answer_probe(&mut link, t, state, &p).await {
                Ok(()) => {
                    count("probe", "ok");
                    continue;
                }
                Err(e) => {
                    count("probe", e.outcome());
                    tracing::warn!(transfer = p.transfer_id, error = %e, "KV link probe ended early");
                    return;
                }
            },
            Ok(Ok(other)) => {
                tracing::warn!(frame = ?kind(&other), "KV transfer: expected Hello; closing the link");
                return;
            }
            Ok(Err(_)) | Err(_) => return,
        };
        let started = Instant::now();
        match export(&mut link, t, state, &first).await {
            Ok(blocks) => {
                count(SIDE, "ok");
                metrics::histogram!("kvgate_worker_kv_transfer_seconds", "side" => SIDE)
                    .record(started.elapsed().as_secs_f64());
                tracing::debug!(transfer = first.transfer_id, blocks, "KV export done");
            }
            Err(e) => {
                count(SIDE, e.outcome());
                tracing::warn!(transfer = first.transfer_id, error = %e, "KV export ended early");
                return;
            }
        }
    }
}

fn kind(f: &Frame) -> &'static str {
    match f {
        Frame::Hello(_) => "hello",
        Frame::Accept { .. } => "accept",
        Frame::Refuse { .. } => "refuse",
        Frame::Blocks(_) => "blocks",
        Frame::Done(_) => "done",
        Frame::Renew { .. } => "renew",
        Frame::Cancel { .. } => "cancel",
        Frame::Ack { .. } => "ack",
        Frame::Probe(_) => "probe",
        Frame::Progress(_) => "progress",
    }
}

/// Answers a link probe: checked like a Hello (the code, the clock, the size), then Accept, `bytes` of zeros in
/// Blocks frames of at most the asker's frame size, and Done. Nothing of the engine is touched.
async fn answer_probe<L: KvLink>(
    link: &mut L,
    t: &Transfers,
    state: &ListenerState,
    p: &Probe,
) -> Result<(), TransferError> {
    let id = p.transfer_id;
    let slot = state.start_probe(Instant::now());
    let refusal = if let Err(why) = &slot {
        Some((RefuseCode::Overloaded, why.clone()))
    } else if !p.verifies(&t.key) {
        Some((RefuseCode::Unauthorized, "the Probe does not verify under this worker's key".to_owned()))
    } else if let Err(r) = fresh(p.issued_ms, unix_ms()) {
        Some(r)
    } else if p.bytes == 0 || p.bytes > MAX_PROBE_BYTES || p.max_frame == 0 {
        Some((RefuseCode::Invalid, format!("a probe of {} bytes in frames of {}", p.bytes, p.max_frame)))
    } else {
        None
    };
    if let Some((code, reason)) = refusal {
        return Err(refuse(link, id, code, reason).await);
    }
    let deadline = tokio::time::Instant::now() + t.lease;
    let accept = Frame::Accept { transfer_id: id, mac: accept_code(&t.key, &p.mac) };
    send_by(link, &accept, deadline, t.lease).await?;
    let chunk = (p.max_frame as usize).min(t.frame_bytes.max(1)).min(p.bytes as usize);
    let zeros = vec![0u8; chunk];
    let mut left = p.bytes as usize;
    while left > 0 {
        let n = left.min(chunk);
        let write = link.send_blocks(id, 0, 1, (0, 1), &zeros[..n]);
        tokio::time::timeout_at(deadline, write).await.map_err(|_| TransferError::Expired(t.lease))??;
        left -= n;
    }
    let done = Done { transfer_id: id, first_token: 0, prompt_tokens: 0, cached_tokens: 0 };
    send_by(link, &Frame::Done(done), deadline, t.lease).await
}

/// A frame issued within the assertion window of this worker's clock (a replay window, not a forever).
fn fresh(issued_ms: u64, now_ms: u64) -> Result<(), (RefuseCode, String)> {
    let skew = now_ms.abs_diff(issued_ms);
    if skew > kvgate_shared::handoff::ASSERTION_WINDOW_MS {
        return Err((RefuseCode::Unauthorized, format!("issued {skew} ms away from this worker's clock")));
    }
    Ok(())
}

/// Checks a Hello against this worker: the code, the gateway's grant (for this prompt, the decode worker it names,
/// this worker; not served before), the model and layout, the bounds. `Err` is what to refuse with.
pub fn check(
    t: &Transfers,
    state: &ListenerState,
    h: &Hello,
    now_ms: u64,
) -> Result<ExtraKeys, (RefuseCode, String)> {
    if !h.verifies(&t.key) {
        return Err((RefuseCode::Unauthorized, "the Hello does not verify under this worker's key".into()));
    }
    let keys = ExtraKeys::from_bytes(&h.extra_keys)
        .ok_or((RefuseCode::Invalid, "extra keys are malformed".into()))?;
    // A LoRA adapter's request was granted under the adapter's name (the `model` its client gave).
    let adapter_name = super::adapter_key(&keys).and_then(|k| k.rsplit_once('@')).map(|(name, _)| name);
    let g = kvgate_shared::handoff::GrantFor {
        model: adapter_name.unwrap_or(&t.model),
        peer: &state.reach,
        decode: &h.decode,
        prompt: &h.prompt,
    };
    let granted = kvgate_shared::handoff::verify_prefill_grant_with(&t.grant_key, &h.grant, &g, now_ms)
        .map_err(|e| (RefuseCode::Unauthorized, format!("the grant: {e}")))?;
    if !(VERSION..=PROGRESS_SINCE).contains(&h.version) {
        let speaks = format!("{VERSION} to {PROGRESS_SINCE}");
        return Err((RefuseCode::Invalid, format!("version {} (this worker speaks {speaks})", h.version)));
    }
    fresh(h.issued_ms, now_ms)?;
    if h.fingerprint != t.fingerprint
        || h.block_bytes as usize != t.block_bytes
        || h.layers as usize != t.layers
    {
        return Err((
            RefuseCode::WrongModel,
            format!(
                "KV of fingerprint {:016x} ({} bytes a block, {} layers); this worker's is {:016x} ({}, {})",
                h.fingerprint, h.block_bytes, h.layers, t.fingerprint, t.block_bytes, t.layers
            ),
        ));
    }
    let blocks = h.prompt.len().div_ceil(t.block_size);
    if h.prompt.is_empty() || h.blocks as usize != blocks || h.from_block as usize >= blocks {
        return Err((
            RefuseCode::Invalid,
            format!("blocks {}..{} of a {}-token prompt", h.from_block, h.blocks, h.prompt.len()),
        ));
    }
    if (h.max_frame as usize) < t.block_bytes {
        return Err((RefuseCode::Invalid, format!("frames of {} bytes cannot hold a block", h.max_frame)));
    }
    state.use_grant(granted, now_ms)?;
    Ok(keys)
}

/// Aborts the engine request when a transfer ends before its request did.
struct Abort<'a> {
    engine: &'a EngineHandle,
    id: u64,
    armed: bool,
}

impl Drop for Abort<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.engine.abort(self.id);
        }
    }
}

/// However the export ends, what it still held is no longer waiting (the gauge comes back to its baseline).
struct Drained(Arc<ExportBacklog>);

impl Drop for Drained {
    fn drop(&mut self) {
        self.0.drain();
    }
}

/// Counts the active leases.
struct Lease;

impl Lease {
    fn take() -> Self {
        metrics::gauge!("kvgate_worker_kv_transfer_leases").increment(1.0);
        Lease
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        metrics::gauge!("kvgate_worker_kv_transfer_leases").decrement(1.0);
    }
}

async fn refuse<L: KvLink>(link: &mut L, id: u64, code: RefuseCode, reason: String) -> TransferError {
    send_parting(link, &Frame::Refuse { transfer_id: id, code, reason: reason.clone() }).await;
    TransferError::Refused { code: code.as_str(), reason }
}

/// One transfer; the blocks sent.
async fn export<L: KvLink>(
    link: &mut L,
    t: &Transfers,
    state: &ListenerState,
    h: &Hello,
) -> Result<usize, TransferError> {
    let id = h.transfer_id;
    let keys = match check(t, state, h, unix_ms()) {
        Ok(k) => k,
        Err((code, reason)) => return Err(refuse(link, id, code, reason).await),
    };
    let params = SamplingParams {
        max_tokens: 1,
        temperature: h.sampling.temperature,
        top_p: h.sampling.top_p,
        top_k: h.sampling.top_k,
        seed: h.sampling.seed,
        ..SamplingParams::default()
    };
    // A LoRA adapter's prompt is computed with the adapter, which this worker must hold under the same key (the
    // same files): the KV is the adapter's, keyed by it on both sides.
    let adapter = match super::adapter_key(&keys).map(str::to_owned) {
        None => None,
        Some(key) => {
            let lookup = t.adapters.clone();
            let found = tokio::task::spawn_blocking(move || lookup(&key)).await.ok().flatten();
            match found {
                Some(a) => Some(a),
                None => {
                    let reason =
                        "this worker does not hold the request's LoRA adapter (or holds other files)";
                    return Err(refuse(link, id, RefuseCode::WrongModel, reason.into()).await);
                }
            }
        }
    };
    let rid = t.engine.next_id();
    let req = EngineRequest { id: rid, prompt: h.prompt.clone(), params, extra_keys: keys, adapter };
    let group = if h.layer_group > 0 { h.layer_group } else { t.layer_group };
    let backlog = Arc::new(ExportBacklog::new(t.export_backlog));
    let _drained = Drained(backlog.clone());
    let (mut rx, mut steps) =
        match t.engine.submit_export(req, h.from_block as usize, group as usize, backlog.clone()).await {
            Ok(r) => r,
            Err(Refusal::QueueFull { waiting }) => {
                return Err(refuse(link, id, RefuseCode::Overloaded, format!("{waiting} requests wait")).await)
            }
            Err(Refusal::Invalid(e)) => {
                return Err(refuse(link, id, RefuseCode::Invalid, e.to_string()).await)
            }
            Err(Refusal::EngineGone) => {
                return Err(refuse(link, id, RefuseCode::Failed, "the engine stopped".into()).await)
            }
        };
    let mut guard = Abort { engine: &t.engine, id: rid, armed: true };
    let _lease = Lease::take();
    let accept = Frame::Accept { transfer_id: id, mac: accept_code(&t.key, &h.mac) };
    send_by(link, &accept, tokio::time::Instant::now() + t.lease, t.lease).await?;
    let mut until = tokio::time::Instant::now() + t.lease;
    let mut renew_at = tokio::time::Instant::now() + t.lease / 3;
    let (mut sent, mut first) = (0usize, None::<StepOutput>);
    // Fault injection: the export's outputs are not read until then (a prefill queued or stuck, still renewing).
    let mut held_until = fault_hold().map(|d| tokio::time::Instant::now() + d);
    // Each step of the prefill is announced to a decode worker that reads Progress (its stall timer then waits
    // for a prefill that moves, not for the first block).
    let mut progress = h.version >= PROGRESS_SINCE;
    loop {
        tokio::select! {
            biased;
            f = link.recv() => match f? {
                Frame::Renew { transfer_id } if transfer_id == id => until = tokio::time::Instant::now() + t.lease,
                Frame::Cancel { transfer_id, reason } if transfer_id == id => return Err(TransferError::Cancelled(reason)),
                Frame::Ack { transfer_id } if transfer_id == id && first.is_some() => {
                    guard.armed = false;
                    return Ok(sent);
                }
                other => return Err(TransferError::Protocol(format!("unexpected {} frame", kind(&other)))),
            },
            _ = sleep_until(held_until.unwrap_or_else(tokio::time::Instant::now)), if held_until.is_some() => {
                held_until = None;
            },
            r = steps.changed(), if progress && first.is_none() && held_until.is_none() => {
                if r.is_err() {
                    progress = false;
                    continue;
                }
                let p = *steps.borrow_and_update();
                let tokens = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
                let eta_ms = (p.eta_s * 1e3).clamp(0.0, f64::from(u32::MAX)) as u32;
                let frame = Progress { transfer_id: id, computed: tokens(p.computed), through: tokens(p.through), eta_ms };
                send_by(link, &Frame::Progress(frame), until, t.lease).await?;
            },
            o = rx.recv(), if first.is_none() && held_until.is_none() => {
                let Some(o) = o else {
                    send_parting(link, &Frame::Cancel { transfer_id: id, reason: "the engine dropped the request".into() }).await;
                    return Err(TransferError::Engine("the request was dropped".into()));
                };
                if let Some(kv) = &o.kv {
                    let write = send_chunk(link, id, kv, h.max_frame as usize, t.block_bytes / t.layers.max(1));
                    tokio::time::timeout_at(until, write).await.map_err(|_| TransferError::Expired(t.lease))??;
                    backlog.sent(kv.bytes.len());
                    sent += kv.count;
                    count_bytes(SIDE, kv.bytes.len(), kv.count);
                    if let Some((after, pause)) = fault_pause().filter(|(after, _)| sent >= *after && sent - kv.count < *after) {
                        tracing::warn!(after, ?pause, "fault injection: pausing the export");
                        tokio::time::sleep(pause).await;
                    }
                }
                match (&o.finished, o.token) {
                    (None, _) => {}
                    (Some(_), Some(token)) => {
                        guard.armed = false;
                        let done = Done {
                            transfer_id: id,
                            first_token: token,
                            prompt_tokens: o.prompt_tokens as u32,
                            cached_tokens: o.cached_tokens as u32,
                        };
                        send_by(link, &Frame::Done(done), until, t.lease).await?;
                        first = Some(o);
                    }
                    (Some(reason), None) => {
                        let reason = format!("the prefill failed: {}", finish_text(reason));
                        send_parting(link, &Frame::Cancel { transfer_id: id, reason: reason.clone() }).await;
                        return Err(TransferError::Engine(reason));
                    }
                }
            },
            _ = sleep_until(renew_at), if first.is_none() => {
                // A prefill waiting behind others sends nothing for a while: say it is alive.
                send_by(link, &Frame::Renew { transfer_id: id }, until, t.lease).await?;
                renew_at = tokio::time::Instant::now() + t.lease / 3;
            },
            _ = sleep_until(until) => {
                metrics::counter!("kvgate_worker_kv_transfer_leases_expired_total").increment(1);
                send_parting(link, &Frame::Cancel { transfer_id: id, reason: "the lease lapsed".into() }).await;
                return Err(TransferError::Expired(t.lease));
            },
        }
    }
}

/// How a prefill that ended without a token reads in its Cancel frame: `FinishReason`'s `Debug` as it read when the
/// backend's error was a `String` (`Error("<message>")`), so the text peers and their logs see is unchanged.
fn finish_text(reason: &FinishReason) -> String {
    match reason {
        FinishReason::Error(e) => format!("Error({:?})", e.message()),
        other => format!("{other:?}"),
    }
}

/// Fault injection (tests only): `KVGATE_FAULT_EXPORT_PAUSE=<blocks>:<ms>` stalls an export for `ms` once it has
/// sent `blocks` blocks (neither reading nor writing the link), as a stuck prefill worker would.
fn fault_pause() -> Option<(usize, Duration)> {
    let v = std::env::var("KVGATE_FAULT_EXPORT_PAUSE").ok()?;
    let (blocks, ms) = v.split_once(':')?;
    Some((blocks.parse().ok()?, Duration::from_millis(ms.parse().ok()?)))
}

/// Fault injection (tests only): `KVGATE_FAULT_EXPORT_HOLD=<ms>` leaves an export's KV unread for `ms` after its
/// Accept while the link still renews its lease, as a prefill worker whose prefill is queued or stuck would.
fn fault_hold() -> Option<Duration> {
    let ms = std::env::var("KVGATE_FAULT_EXPORT_HOLD").ok()?;
    Some(Duration::from_millis(ms.parse().ok()?))
}

/// Sends a chunk's blocks in frames of at most `max_frame` payload bytes (at least one block each).
async fn send_chunk<L: KvLink>(
    link: &mut L,
    id: u64,
    kv: &crate::engine::KvChunk,
    max_frame: usize,
    layer_bytes: usize,
) -> Result<(), TransferError> {
    let per_block = kv.layers.len() * layer_bytes;
    if per_block == 0 || kv.bytes.len() != per_block * kv.count {
        return Err(TransferError::Engine(format!("{} bytes for {} blocks", kv.bytes.len(), kv.count)));
    }
    let per_frame = (max_frame / per_block).max(1);
    let layers = (kv.layers.start as u16, kv.layers.end as u16);
    for (i, part) in kv.bytes.chunks(per_frame * per_block).enumerate() {
        let first = (kv.first + i * per_frame) as u32;
        link.send_blocks(id, first, (part.len() / per_block) as u32, layers, part).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::BackendError;

    #[test]
    fn a_failed_prefill_reads_in_its_cancel_frame_as_before_the_typed_error() {
        let e = BackendError::Device("synchronize: \"CUDA_ERROR_ILLEGAL_ADDRESS\"".into());
        assert_eq!(
            finish_text(&FinishReason::Error(e)),
            r#"Error("synchronize: \"CUDA_ERROR_ILLEGAL_ADDRESS\"")"#
        );
        assert_eq!(finish_text(&FinishReason::Abort), "Abort");
        assert_eq!(finish_text(&FinishReason::Stop(None)), "Stop(None)");
    }
}
