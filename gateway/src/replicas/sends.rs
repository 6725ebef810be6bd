//! The replicas' shared sends (`--share-sends`, on by default with `--redis-url`): what each replica routed where,
//! so a replica does not send the first requests of a new prefix, or a burst, to a worker the others just loaded
//! or away from one they just warmed.
//!
//! Each send is recorded locally (`Registry::record_sent`) and handed to [`SendSharer::share`], which never blocks
//! the request: it queues the send (bounded; full: dropped and counted). The publisher task takes whatever is queued
//! at once (up to [`MAX_BATCH`]) and publishes it as one message on `{prefix}:sends`, so a send leaves as soon as
//! the task runs and a burst leaves in few messages. Every replica's change subscription receives the messages;
//! a replica skips its own, checks each send against `SharedSend`'s limits and applies it with
//! `Registry::record_shared_send`: load until the worker's next report, the prompt's overlay points, the ring key.
//!
//! Why immediately and not batched on a timer: in the simulator (docs/benchmarks/replicas.md, "Gateway replicas
//! and shared sends") a 10 ms delay already gives back about a quarter of what sharing gains at TTFT p50.
//!
//! Message (JSON): `{"from": replica id, "nonce": per-process random, "sends": [{"worker", "points": [u64],
//! "uncached_tokens", "session"}]}`. While Redis is unreachable sends are dropped (counted), never buffered.
//!
//! Redis is shared infrastructure, so a received message is believed only within bounds (each refusal counted in
//! `kvgate_gateway_shared_sends_total{event}`): at most [`MAX_MESSAGE_BYTES`], [`MAX_BATCH`] sends and
//! [`MAX_MESSAGE_POINTS`] overlay points (so one message costs a bounded time under the registry lock), from a
//! replica whose heartbeat is live (`unknown_replica` otherwise), each send within `SharedSend`'s limits; what it
//! adds as load expires on its own (`SharedLoad`).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Instant;

use kvgate_router::registry::{Registry, SharedSend};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::SharedState;

/// What the sends' tasks touch, and nothing else: the shared-state connection, the sharer, the registry
/// (`state::GatewayState` implements it; this module does not import the state).
pub trait SendsHost: Send + Sync + 'static {
    fn shared(&self) -> &SharedState;
    fn sharer(&self) -> Option<&SendSharer>;
    fn registry(&self) -> std::sync::MutexGuard<'_, Registry>;
}

/// Sends queued for the publisher at most; more are dropped (counted).
pub const QUEUE: usize = 4096;
/// Sends per published message at most.
pub const MAX_BATCH: usize = 64;
/// Overlay points per message at most (the publisher splits batches to stay under it).
pub const MAX_MESSAGE_POINTS: usize = 8192;
/// A received message longer than this is ignored (8,192 points and 64 sends are under 250 KB of JSON).
pub const MAX_MESSAGE_BYTES: usize = 512 << 10;

/// One published message.
#[derive(Debug, Serialize, Deserialize)]
pub struct SendBatch {
    pub from: String,
    pub nonce: u64,
    pub sends: Vec<SharedSend>,
}

/// The sending side, held by the gateway state when sends are shared.
pub struct SendSharer {
    tx: mpsc::Sender<SharedSend>,
    rx: Mutex<Option<mpsc::Receiver<SharedSend>>>,
    /// Tells this process's messages from another replica's of the same id.
    nonce: u64,
}

fn count(event: &'static str, n: u64) {
    metrics::counter!("kvgate_gateway_shared_sends_total", "event" => event).increment(n);
}

impl Default for SendSharer {
    fn default() -> Self {
        Self::new()
    }
}

impl SendSharer {
    pub fn new() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        // std's RandomState is seeded from the OS at random; the time and pid only add to it.
        let t =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let nonce = RandomState::new().hash_one((std::process::id(), t));
        Self { tx, rx: Mutex::new(Some(rx)), nonce }
    }

    pub fn nonce(&self) -> u64 {
        self.nonce
    }

    /// Queues a send for the other replicas; never waits.
    pub fn share(&self, send: SharedSend) {
        if self.tx.try_send(send).is_err() {
            count("dropped", 1);
        }
    }
}

/// Publishes queued sends until the gateway stops (spawned on the control runtime with the sync loop).
pub async fn publish<H: SendsHost>(state: Arc<H>) {
    let (Some(store), Some(sharer)) = (state.shared().store(), state.sharer()) else { return };
    let Some(mut rx) = sharer.rx.lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
    let channel = store.key("sends");
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        if !state.shared().redis_up() {
            count("dropped", batch.len() as u64);
            batch.clear();
            continue;
        }
        for sends in split(std::mem::take(&mut batch)) {
            let n = sends.len() as u64;
            let msg = SendBatch { from: state.shared().replica_id().to_owned(), nonce: sharer.nonce, sends };
            let payload = serde_json::to_string(&msg).unwrap_or_default();
            match store.publish(&channel, &payload).await {
                Ok(()) => count("published", n),
                Err(e) => {
                    tracing::debug!(error = %e, "shared sends: publish failed");
                    count("dropped", n);
                }
            }
        }
    }
}

/// Cuts a batch into messages of at most [`MAX_MESSAGE_POINTS`] points (a send is never split).
pub fn split(sends: Vec<SharedSend>) -> Vec<Vec<SharedSend>> {
    let mut out: Vec<Vec<SharedSend>> = Vec::new();
    let mut points = 0;
    for s in sends {
        let p = s.points.len();
        match out.last_mut() {
            Some(last) if points + p <= MAX_MESSAGE_POINTS => {
                points += p;
                last.push(s);
            }
            _ => {
                points = p;
                out.push(vec![s]);
            }
        }
    }
    out
}

/// What a received message holds for this replica.
#[derive(Debug, PartialEq)]
pub enum Received {
    /// This process's own message, back from the channel.
    Own,
    /// Too long, not a message, more sends than [`MAX_BATCH`] or points than [`MAX_MESSAGE_POINTS`]: ignored
    /// whole.
    Invalid,
    /// From a replica with no live heartbeat: ignored whole.
    UnknownReplica,
    /// The sends to apply, and how many were dropped for being over `SharedSend`'s limits.
    Sends(Vec<SharedSend>, u64),
}

/// Decodes and checks a message (`own_nonce`: this process's; `live`: whether a replica id has a live heartbeat).
pub fn decode(payload: &[u8], own_nonce: u64, live: impl Fn(&str) -> bool) -> Received {
    if payload.len() > MAX_MESSAGE_BYTES {
        return Received::Invalid;
    }
    let Ok(msg) = serde_json::from_slice::<SendBatch>(payload) else {
        return Received::Invalid;
    };
    if msg.nonce == own_nonce {
        return Received::Own;
    }
    if msg.sends.len() > MAX_BATCH
        || msg.sends.iter().map(|s| s.points.len()).sum::<usize>() > MAX_MESSAGE_POINTS
    {
        return Received::Invalid;
    }
    if !live(&msg.from) {
        return Received::UnknownReplica;
    }
    let total = msg.sends.len() as u64;
    let valid: Vec<SharedSend> = msg.sends.into_iter().filter(SharedSend::valid).collect();
    let dropped = total - valid.len() as u64;
    Received::Sends(valid, dropped)
}

/// Applies a message received on `{prefix}:sends` (not this process's own; invalid sends skipped and counted).
pub fn apply(state: &impl SendsHost, payload: &[u8]) {
    let Some(sharer) = state.sharer() else { return };
    let (sends, invalid) = match decode(payload, sharer.nonce, |id| state.shared().is_live_replica(id)) {
        Received::Own => return,
        Received::Invalid => {
            count("invalid", 1);
            return;
        }
        Received::UnknownReplica => {
            // A replica that started since the last sync, or no replica at all: refresh the live set now (its
            // next sends are believed once its heartbeat is seen).
            count("unknown_replica", 1);
            state.shared().wake();
            return;
        }
        Received::Sends(s, invalid) => (s, invalid),
    };
    let now = Instant::now();
    let (mut applied, mut unknown) = (0, 0);
    {
        let mut reg = state.registry();
        for s in &sends {
            if reg.record_shared_send(s, now) {
                applied += 1;
            } else {
                unknown += 1;
            }
        }
    }
    count("applied", applied);
    count("unknown_worker", unknown);
    count("invalid", invalid);
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::hashing::BlockHash;

    fn message(nonce: u64, sends: Vec<SharedSend>) -> Vec<u8> {
        serde_json::to_vec(&SendBatch { from: "a".into(), nonce, sends }).expect("json")
    }

    #[test]
    fn messages_are_checked_before_anything_is_applied() {
        let hashes: Vec<BlockHash> = (0..20).map(BlockHash).collect();
        let good = SharedSend::new("w0", &hashes, 300, Some(7));
        assert_eq!(good.points, vec![BlockHash(7), BlockHash(15), BlockHash(19)]);
        let mut bad = good.clone();
        bad.uncached_tokens = SharedSend::MAX_TOKENS + 1;
        let live = |id: &str| id == "a";
        match decode(&message(1, vec![good.clone(), bad]), 2, live) {
            Received::Sends(s, dropped) => assert_eq!((s, dropped), (vec![good.clone()], 1)),
            other => panic!("{other:?}"),
        }
        assert_eq!(decode(&message(2, vec![good.clone()]), 2, live), Received::Own);
        assert_eq!(decode(b"{not json", 2, live), Received::Invalid);
        assert_eq!(decode(&message(1, vec![good.clone(); MAX_BATCH + 1]), 2, live), Received::Invalid);
        let mut long = message(1, vec![good.clone()]);
        long.resize(MAX_MESSAGE_BYTES + 1, b' ');
        assert_eq!(decode(&long, 2, live), Received::Invalid);
        // Within the send count but over the message's points: ignored whole.
        let wide = SharedSend::new("w0", &(0..32_768).map(BlockHash).collect::<Vec<_>>(), 1, None);
        assert_eq!(wide.points.len(), SharedSend::MAX_POINTS);
        assert_eq!(decode(&message(1, vec![wide.clone(); 3]), 2, live), Received::Invalid);
        // From a replica nobody has a heartbeat of.
        let stranger =
            serde_json::to_vec(&SendBatch { from: "x".into(), nonce: 1, sends: vec![good] }).expect("json");
        assert_eq!(decode(&stranger, 2, live), Received::UnknownReplica);
        // The publisher's split keeps every message under the points limit, sends whole and in order.
        let parts = split(vec![wide.clone(); 5]);
        assert_eq!(parts.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 2, 1]);
        assert!(parts.iter().all(|p| p.iter().map(|s| s.points.len()).sum::<usize>() <= MAX_MESSAGE_POINTS));
        // A worker id over its limit, and an empty one, are dropped.
        let mut odd = SharedSend::new(&"x".repeat(SharedSend::MAX_WORKER_ID + 1), &hashes, 1, None);
        assert!(!odd.valid());
        odd.worker = String::new();
        assert!(!odd.valid());
    }
}
