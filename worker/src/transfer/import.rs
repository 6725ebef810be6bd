//! The decode side: fetch one request's missing blocks from a prefill worker into blocks the engine allocated
//! (`Engine::start_import`), then finish the import with the first token. Any failure before Done gives the import
//! up and the engine computes the prompt itself (`import_to_local`); a client that leaves cancels (the caller's
//! abort frees the blocks, and the peer is told).

use std::time::Instant;

use kvgate_shared::hashing::ExtraKeys;
use tokio::sync::oneshot;
use tokio::time::{sleep_until, timeout};

use super::frame::{
    accept_verifies, FirstToken, Frame, Hello, Probe, Progress, MAX_PROBE_BYTES, PROGRESS_SINCE,
};
use super::link::{send_by, send_parting, KvLink, KvTransport, TcpTransport};
use super::{count, count_bytes, unix_ms, TransferError, Transfers};
use crate::engine::{ImportPlan, RequestId, SamplingParams};

const SIDE: &str = "import";

/// What the decode side asks for.
pub struct Want<'a> {
    pub id: RequestId,
    pub prompt: &'a [u32],
    pub extra_keys: &'a ExtraKeys,
    pub params: &'a SamplingParams,
    pub plan: ImportPlan,
    /// The gateway's grant, which the prefill worker checks for this prompt and this worker.
    pub grant: &'a str,
}

/// How a fetch ended.
#[derive(Debug, PartialEq)]
pub enum Fetched {
    /// The import finished: the request decodes here.
    Done { blocks: usize },
    /// The client left (`cancel` fired): the caller aborts the request.
    Cancelled,
    /// The transfer failed: the request now computes here.
    Fallback(TransferError),
}

/// Fetches `want` from `peer`; on failure the request falls back to a local prefill. Counts the outcome.
pub async fn fetch(t: &Transfers, peer: &str, want: Want<'_>, cancel: oneshot::Receiver<()>) -> Fetched {
    let started = Instant::now();
    let transfer_id = rand_id(want.id);
    let result = run(t, peer, &want, transfer_id, cancel).await;
    let outcome = match &result {
        Ok(Some(_)) => "ok",
        Ok(None) => "client_left",
        Err(e) => e.outcome(),
    };
    count(SIDE, outcome);
    match result {
        Ok(Some(blocks)) => {
            metrics::histogram!("kvgate_worker_kv_transfer_seconds", "side" => SIDE)
                .record(started.elapsed().as_secs_f64());
            Fetched::Done { blocks }
        }
        Ok(None) => Fetched::Cancelled,
        Err(e) => {
            let retryable = e.retryable();
            tracing::warn!(peer, transfer = transfer_id, error = %e, retryable, "KV import failed: computing the prompt here");
            count(SIDE, "fallback");
            t.engine.import_to_local(want.id);
            Fetched::Fallback(e)
        }
    }
}

fn rand_id(salt: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(salt);
    h.write_u64(unix_ms());
    h.finish()
}

fn hello(t: &Transfers, want: &Want<'_>, transfer_id: u64) -> Hello {
    let p = want.params;
    let mut h = Hello {
        version: PROGRESS_SINCE,
        transfer_id,
        issued_ms: unix_ms(),
        fingerprint: t.fingerprint,
        block_bytes: t.block_bytes as u32,
        layers: t.layers as u16,
        layer_group: t.layer_group,
        max_frame: t.frame_bytes.max(t.block_bytes) as u32,
        from_block: want.plan.from_block as u32,
        blocks: want.plan.blocks as u32,
        sampling: FirstToken { temperature: p.temperature, top_p: p.top_p, top_k: p.top_k, seed: p.seed },
        extra_keys: want.extra_keys.to_bytes(),
        prompt: want.prompt.to_vec(),
        decode: t.worker_id.clone(),
        grant: want.grant.to_owned(),
        mac: [0; 32],
    };
    h.mac = h.code(&t.key);
    h
}

/// A link to `peer` with `h` sent on it. A pooled link the peer has closed meanwhile fails at once (its reader has
/// seen the end): then a fresh one is made.
async fn connect(
    t: &Transfers,
    peer: &str,
    first: &Frame,
) -> Result<<TcpTransport as KvTransport>::Link, TransferError> {
    let lease = t.lease;
    let mut last = None;
    for _ in 0..2 {
        let mut link = timeout(lease.min(t.stall), t.transport.connect(peer, t.limits(), &t.key))
            .await
            .map_err(|_| TransferError::Connect(format!("{peer}: no connection within {lease:?}")))??;
        match send_by(&mut link, first, tokio::time::Instant::now() + lease, lease).await {
            Ok(()) => return Ok(link),
            Err(e) if link.reused() => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| TransferError::Connect(peer.to_owned())))
}

/// A timed sample of the link to `peer`: `bytes` of padding (at least 4 frames, at most [`MAX_PROBE_BYTES`]), recorded in the import
/// log as a transfer would be (so the next report carries the pair's rate): the bytes after the first Blocks frame
/// over the seconds from it to Done (the first frame's arrival starts the clock, so it is not counted).
pub async fn probe(t: &Transfers, peer: &str, bytes: u32) -> Result<(u64, f64), TransferError> {
    let lease = t.lease;
    let id = rand_id(u64::from(bytes));
    let max_frame = t.frame_bytes.max(t.block_bytes).min(MAX_PROBE_BYTES as usize) as u32;
    let mut p = Probe {
        transfer_id: id,
        issued_ms: unix_ms(),
        // At least 4 frames: the first only starts the clock.
        bytes: bytes.max(max_frame.saturating_mul(4)).min(MAX_PROBE_BYTES),
        max_frame,
        mac: [0; 32],
    };
    p.mac = p.code(&t.key);
    let mut link = connect(t, peer, &Frame::Probe(p)).await?;
    let (mut accepted, mut got, mut first) = (false, 0u64, None::<(Instant, u64)>);
    let deadline = tokio::time::Instant::now() + lease;
    loop {
        let f = tokio::time::timeout_at(deadline, link.recv())
            .await
            .map_err(|_| TransferError::Expired(lease))??;
        match f {
            Frame::Accept { transfer_id, mac } if transfer_id == id && !accepted => {
                if !accept_verifies(&t.key, &p.mac, &mac) {
                    return Err(TransferError::Protocol("the Accept does not verify".into()));
                }
                accepted = true;
            }
            Frame::Refuse { transfer_id, code, reason } if transfer_id == id => {
                return Err(TransferError::Refused { code: code.as_str(), reason });
            }
            Frame::Renew { .. } | Frame::Progress(_) => {}
            Frame::Blocks(b) if b.transfer_id == id && accepted => {
                got += b.payload.len() as u64;
                first.get_or_insert_with(|| (Instant::now(), got));
                if got > u64::from(p.bytes) {
                    return Err(TransferError::Protocol("more probe bytes than asked for".into()));
                }
            }
            Frame::Done(d) if d.transfer_id == id && accepted => {
                if got != u64::from(p.bytes) {
                    return Err(TransferError::Protocol(format!("{got} of {} probe bytes", p.bytes)));
                }
                let (bytes, seconds) =
                    first.map_or((0, 0.0), |(at, n)| (got - n, at.elapsed().as_secs_f64()));
                if bytes > 0 && seconds > 0.0 {
                    t.imports.lock().unwrap_or_else(|e| e.into_inner()).record(peer, bytes, seconds);
                }
                t.transport.give_back(link);
                return Ok((bytes, seconds));
            }
            other => {
                let what = format!("unexpected frame {other:?}");
                return Err(TransferError::Protocol(what.chars().take(200).collect()));
            }
        }
    }
}

/// What the prefill worker has said of its prefill (`Frame::Progress`).
#[derive(Debug, Default)]
struct Steps {
    computed: u32,
    through: u32,
    eta: std::time::Duration,
}

impl Steps {
    /// Takes a Progress frame of a `prompt`-token prompt. `Some(allowance)`: the prefill moved (it computed more,
    /// or started a step past the last one), and the stall timer waits that long from now: the stall timeout plus
    /// twice what the prefill worker expects the step to take (at most a lease: the peer's word, bounded); a
    /// step the worker has not measured gets the stall timeout alone. `None`: nothing moved (a repeat, or a
    /// preempted prefill starting again). `Err`: figures outside the prompt.
    fn advance(
        &mut self,
        p: &Progress,
        prompt: usize,
        stall: std::time::Duration,
        lease: std::time::Duration,
    ) -> Result<Option<std::time::Duration>, TransferError> {
        if p.computed > p.through || p.through as usize > prompt {
            let what = format!("progress {}..{} of a {prompt}-token prompt", p.computed, p.through);
            return Err(TransferError::Protocol(what));
        }
        if p.through <= self.through && p.computed <= self.computed {
            return Ok(None);
        }
        (self.computed, self.through) = (p.computed.max(self.computed), p.through.max(self.through));
        self.eta = std::time::Duration::from_millis(u64::from(p.eta_ms)).min(lease);
        Ok(Some(self.allowance(stall, lease)))
    }

    /// How long the stall timer waits after the latest step began.
    fn allowance(&self, stall: std::time::Duration, lease: std::time::Duration) -> std::time::Duration {
        stall + (2 * self.eta).min(lease)
    }
}

/// `Ok(Some(blocks))`: imported; `Ok(None)`: the client left.
async fn run(
    t: &Transfers,
    peer: &str,
    want: &Want<'_>,
    id: u64,
    mut cancel: oneshot::Receiver<()>,
) -> Result<Option<usize>, TransferError> {
    let lease = t.lease;
    let h = hello(t, want, id);
    let mut link = connect(t, peer, &Frame::Hello(Box::new(h.clone()))).await?;
    let mut received = 0usize;
    let (mut bytes_in, mut first_blocks_at) = (0u64, None::<std::time::Instant>);
    let mut accepted = false;
    let mut silent_until = tokio::time::Instant::now() + lease;
    let mut renew_at = tokio::time::Instant::now() + lease / 3;
    // Progress, not life: Accept, a step of the prefill (Progress), Blocks and Done move it (a Renew says the peer
    // lives, not that KV comes).
    let mut stalled_at = tokio::time::Instant::now() + t.stall;
    let mut steps = Steps::default();
    loop {
        tokio::select! {
            biased;
            _ = &mut cancel => {
                send_parting(&mut link, &Frame::Cancel { transfer_id: id, reason: "the client left".into() }).await;
                return Ok(None);
            }
            f = link.recv() => {
                silent_until = tokio::time::Instant::now() + lease;
                match f? {
                    Frame::Accept { transfer_id, mac } if transfer_id == id && !accepted => {
                        if !accept_verifies(&t.key, &h.mac, &mac) {
                            return Err(TransferError::Protocol("the Accept does not verify".into()));
                        }
                        accepted = true;
                        stalled_at = tokio::time::Instant::now() + t.stall;
                    }
                    Frame::Refuse { transfer_id, code, reason } if transfer_id == id => {
                        return Err(TransferError::Refused { code: code.as_str(), reason });
                    }
                    Frame::Progress(p) if p.transfer_id == id && accepted => {
                        let moved = steps.advance(&p, want.prompt.len(), t.stall, lease)?;
                        tracing::debug!(transfer = id, computed = p.computed, through = p.through, eta_ms = p.eta_ms, ?moved, "KV import: the prefill moved");
                        if let Some(allowance) = moved {
                            stalled_at = tokio::time::Instant::now() + allowance;
                        }
                    }
                    // A Renew of this transfer, or a Renew or Progress a previous transfer on this pooled link
                    // left behind.
                    Frame::Renew { .. } | Frame::Progress(_) => {}
                    Frame::Cancel { transfer_id, reason } if transfer_id == id => {
                        return Err(TransferError::Cancelled(reason));
                    }
                    Frame::Blocks(b) if b.transfer_id == id && accepted => {
                        let layers = b.layers.0 as usize..b.layers.1 as usize;
                        let (n, bytes) = (b.count as usize, b.payload.len());
                        if let Err(e) = t.engine.write_import(want.id, b.first as usize, n, layers, b.payload).await {
                            send_parting(&mut link, &Frame::Cancel { transfer_id: id, reason: e.to_string() }).await;
                            return Err(TransferError::Import(e));
                        }
                        received += n;
                        // Blocks of a step that ended do not cut short the allowance of the step now running.
                        stalled_at = stalled_at.max(tokio::time::Instant::now() + t.stall);
                        bytes_in += bytes as u64;
                        first_blocks_at.get_or_insert_with(std::time::Instant::now);
                        count_bytes(SIDE, bytes, n);
                    }
                    Frame::Done(d) if d.transfer_id == id && accepted => {
                        if let Err(e) = t.engine.finish_import(want.id, d.first_token, d.cached_tokens as usize).await {
                            send_parting(&mut link, &Frame::Cancel { transfer_id: id, reason: e.to_string() }).await;
                            return Err(TransferError::Import(e));
                        }
                        if let Some(at) = first_blocks_at {
                            let mut log = t.imports.lock().unwrap_or_else(|e| e.into_inner());
                            log.record(peer, bytes_in, at.elapsed().as_secs_f64());
                        }
                        send_by(&mut link, &Frame::Ack { transfer_id: id }, silent_until, lease).await?;
                        t.transport.give_back(link);
                        return Ok(Some(received));
                    }
                    other => return Err(TransferError::Protocol(format!("unexpected frame {other:?}").chars().take(200).collect())),
                }
            }
            _ = sleep_until(renew_at) => {
                send_by(&mut link, &Frame::Renew { transfer_id: id }, silent_until, lease).await?;
                renew_at = tokio::time::Instant::now() + lease / 3;
            }
            _ = sleep_until(silent_until) => return Err(TransferError::Expired(lease)),
            _ = sleep_until(stalled_at) => {
                let reason = format!("the prefill made no progress within {:?}", steps.allowance(t.stall, lease));
                send_parting(&mut link, &Frame::Cancel { transfer_id: id, reason }).await;
                return Err(TransferError::Stalled(steps.allowance(t.stall, lease)));
            }
        }
    }
}
