//! The prefill side: the KV transfer listener. Each link serves transfers one after another; each transfer is a
//! checked Hello, an export in the engine, its blocks streamed as the prefill writes them, and Done with the first
//! token, all under a lease (see the module above). Every way out of a transfer aborts its engine request unless it
//! finished, so the pool returns to its baseline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_shared::hashing::ExtraKeys;
use tokio::net::TcpListener;
use tokio::time::sleep_until;

use super::frame::{accept_code, Done, Frame, Hello, Probe, RefuseCode, MAX_PROBE_BYTES, VERSION};
use super::link::{send_by, send_parting, KvLink, TcpLink, IDLE_TIMEOUT};
use super::{count, count_bytes, unix_ms, TransferError, Transfers};
use crate::engine::{EngineRequest, SamplingParams, StepOutput};
use crate::server::engine_thread::{EngineHandle, Refusal};

const SIDE: &str = "export";

/// Accepts links until the process ends.
pub async fn serve(listener: TcpListener, t: Arc<Transfers>) {
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "KV transfer listener: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let link = TcpLink::new(stream, from.to_string(), t.limits());
        let t = t.clone();
        tokio::spawn(async move { serve_link(link, &t).await });
    }
}

/// Transfers on one link, until it breaks, idles out or a transfer ends badly.
pub async fn serve_link<L: KvLink>(mut link: L, t: &Transfers) {
    loop {
        let first = match tokio::time::timeout(2 * IDLE_TIMEOUT, link.recv()).await {
            Ok(Ok(Frame::Hello(h))) => h,
            Ok(Ok(Frame::Probe(p))) => match answer_probe(&mut link, t, &p).await {
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
        match export(&mut link, t, &first).await {
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
    }
}

/// Answers a link probe: checked like a Hello (the code, the clock, the size), then Accept, `bytes` of zeros in
/// Blocks frames of at most the asker's frame size, and Done. Nothing of the engine is touched.
async fn answer_probe<L: KvLink>(link: &mut L, t: &Transfers, p: &Probe) -> Result<(), TransferError> {
    let id = p.transfer_id;
    let refusal = if !p.verifies(&t.key) {
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

/// Checks a Hello against this worker: the code, the model and layout, the bounds. `Err` is what to refuse with.
pub fn check(t: &Transfers, h: &Hello, now_ms: u64) -> Result<ExtraKeys, (RefuseCode, String)> {
    if !h.verifies(&t.key) {
        return Err((RefuseCode::Unauthorized, "the Hello does not verify under this worker's key".into()));
    }
    if h.version != VERSION {
        return Err((RefuseCode::Invalid, format!("version {} (this worker speaks {VERSION})", h.version)));
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
    ExtraKeys::from_bytes(&h.extra_keys).ok_or((RefuseCode::Invalid, "extra keys are malformed".into()))
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
async fn export<L: KvLink>(link: &mut L, t: &Transfers, h: &Hello) -> Result<usize, TransferError> {
    let id = h.transfer_id;
    let keys = match check(t, h, unix_ms()) {
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
    let rid = t.engine.next_id();
    let req = EngineRequest { id: rid, prompt: h.prompt.clone(), params, extra_keys: keys };
    let group = if h.layer_group > 0 { h.layer_group } else { t.layer_group };
    let mut rx = match t.engine.submit_export(req, h.from_block as usize, group as usize).await {
        Ok(rx) => rx,
        Err(Refusal::QueueFull { waiting }) => {
            return Err(refuse(link, id, RefuseCode::Overloaded, format!("{waiting} requests wait")).await)
        }
        Err(Refusal::Invalid(e)) => return Err(refuse(link, id, RefuseCode::Invalid, e.to_string()).await),
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
            o = rx.recv(), if first.is_none() => {
                let Some(o) = o else {
                    send_parting(link, &Frame::Cancel { transfer_id: id, reason: "the engine dropped the request".into() }).await;
                    return Err(TransferError::Engine("the request was dropped".into()));
                };
                if let Some(kv) = &o.kv {
                    let write = send_chunk(link, id, kv, h.max_frame as usize, t.block_bytes / t.layers.max(1));
                    tokio::time::timeout_at(until, write).await.map_err(|_| TransferError::Expired(t.lease))??;
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
                        let reason = format!("the prefill failed: {reason:?}");
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

/// Fault injection (tests only): `KVGATE_FAULT_EXPORT_PAUSE=<blocks>:<ms>` stalls an export for `ms` once it has
/// sent `blocks` blocks (neither reading nor writing the link), as a stuck prefill worker would.
fn fault_pause() -> Option<(usize, Duration)> {
    let v = std::env::var("KVGATE_FAULT_EXPORT_PAUSE").ok()?;
    let (blocks, ms) = v.split_once(':')?;
    Some((blocks.parse().ok()?, Duration::from_millis(ms.parse().ok()?)))
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
