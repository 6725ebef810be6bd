//! The replica's side of the shared state's upkeep: the sync loop (heartbeat, seed what Redis lacks, apply what is
//! newer) and the change subscription that wakes it. Spawned on the control runtime for the life of the gateway.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use super::redis_store::{parse_version, RedisStore, Resource, Stored, COMMAND_TIMEOUT};
use super::sends::SendsHost;
use super::{now_ms, SYNC_INTERVAL};
use crate::admission::ClassConfig;
use crate::routing::Weights;

/// What the sync loop touches (`state::GatewayState` implements it): the replicated resources, read as JSON and
/// applied when newer, the drains, the local copy in the state file; and, through [`SendsHost`], the shared-state
/// connection and the sends.
pub trait SyncHost: SendsHost {
    /// A resource's version and value as this replica holds it.
    fn resource_json(&self, r: Resource) -> (u64, String);
    fn weights_version(&self) -> u64;
    /// Applies weights of `version`; false if not newer.
    fn apply_weights(&self, w: Weights, version: u64) -> bool;
    fn classes_version(&self) -> u64;
    fn apply_classes(&self, c: Vec<ClassConfig>, version: u64) -> bool;
    fn set_drains(&self, ids: Vec<String>, version: u64) -> bool;
    /// Marks the drained workers in the registry.
    fn apply_drains(&self);
    /// Writes the admin state file (when there is one).
    fn save_local_copy(&self);
    /// `--max-workers` (the most drains a value may name).
    fn max_workers(&self) -> usize;
}

/// Applies a resource read from Redis when it is newer than what this replica has. Values are validated like an
/// admin PUT (Redis is shared infrastructure; a bad value is never applied). Returns false when the value is not
/// valid.
pub fn apply_remote(state: &impl SyncHost, r: Resource, version: u64, value: &str) -> bool {
    match r {
        Resource::Weights => match serde_json::from_str::<Weights>(value) {
            Ok(w) if w.validate().is_empty() => {
                if version > state.weights_version() && state.apply_weights(w, version) {
                    tracing::info!(version, "shared state: weights from another replica applied");
                    state.save_local_copy();
                }
                true
            }
            _ => false,
        },
        Resource::Drains => match serde_json::from_str::<Vec<String>>(value) {
            Ok(ids)
                if ids.len() <= state.max_workers()
                    && ids.iter().all(|i| !i.is_empty() && i.len() <= 256) =>
            {
                if state.set_drains(ids, version) {
                    tracing::info!(version, "shared state: drained workers from another replica applied");
                }
                true
            }
            _ => false,
        },
        Resource::Budgets => match serde_json::from_str::<Vec<ClassConfig>>(value) {
            Ok(c) if crate::admission::classes::validate(&c).is_empty() => {
                if version > state.classes_version() && state.apply_classes(c, version) {
                    tracing::info!(version, "shared state: budgets from another replica applied");
                    state.save_local_copy();
                }
                true
            }
            _ => false,
        },
    }
}

fn count_invalid(r: Resource, action: &'static str) {
    metrics::counter!("kvgate_gateway_shared_state_invalid_total", "resource" => r.name(), "action" => action)
        .increment(1);
}

/// Replaces a resource Redis holds in a form no replica writes (a version that is not an integer below
/// `MAX_VERSION`, a value that is not JSON text) with this replica's, under a version past both the stored one
/// (when it is a version) and this replica's, only if it is still what was read: one bad write cannot leave every
/// admin change failing its compare-and-set, and a replica's valid write in between is never replaced.
async fn heal(
    state: &impl SyncHost,
    store: &RedisStore,
    r: Resource,
    raw_version: &[u8],
) -> Result<(), redis::RedisError> {
    count_invalid(r, "replaced");
    tracing::error!(
        resource = r.name(),
        "shared state: corrupt version or value in Redis, replaced by this replica's"
    );
    let (own, value) = state.resource_json(r);
    let stored = parse_version(raw_version).unwrap_or(0);
    let version = own.max(stored) + 1;
    let audit = serde_json::json!({"replica": state.shared().replica_id(), "resource": r.name(),
        "reset": "the stored version or value was corrupt"})
    .to_string();
    if store.heal(r, raw_version, version, &value, &audit).await? {
        // Now this replica's own value is stored at `version`.
        let _ = apply_remote(state, r, version, &value);
    }
    Ok(())
}

/// One pass: heartbeat, seed what Redis lacks, apply what is newer, replace what is corrupt; a value that is JSON
/// but fails validation is not applied (logged and counted: it may be a newer replica's, during an upgrade).
async fn sync_once(state: &impl SyncHost, store: &RedisStore) -> Result<(), redis::RedisError> {
    let shared = state.shared();
    let live = store.heartbeat(shared.replica_id(), now_ms()).await?;
    shared.set_live(live);
    for r in Resource::ALL {
        match store.get(r).await? {
            Stored::Valid(version, value) => {
                if serde_json::from_str::<serde::de::IgnoredAny>(&value).is_err() {
                    heal(state, store, r, version.to_string().as_bytes()).await?;
                } else if !apply_remote(state, r, version, &value) && shared.first_ignored(r.name(), version)
                {
                    count_invalid(r, "ignored");
                    tracing::error!(
                        version,
                        resource = r.name(),
                        "shared state: invalid value in Redis, ignored"
                    );
                }
            }
            Stored::Corrupt { raw_version } => heal(state, store, r, &raw_version).await?,
            Stored::Missing => {
                let (version, value) = state.resource_json(r);
                if store.seed(r, version, &value).await? {
                    tracing::info!(
                        resource = r.name(),
                        version,
                        "shared state: seeded Redis from this replica"
                    );
                }
            }
        }
    }
    state.apply_drains();
    Ok(())
}

/// The sync loop and the change subscription; runs for the life of the gateway (spawned on the control runtime).
pub async fn run<H: SyncHost>(state: Arc<H>) {
    let Some(store) = state.shared().store() else { return };
    let sub = state.clone();
    tokio::spawn(async move { subscribe(sub).await });
    tokio::spawn(super::sends::publish(state.clone()));
    loop {
        let up = sync_once(state.as_ref(), store).await;
        if let Err(e) = &up {
            tracing::debug!(error = %e, "shared state: sync failed");
        }
        state.shared().set_up(up.is_ok());
        state.shared().wait(SYNC_INTERVAL).await;
    }
}

/// Listens on the change channel (and wakes the sync loop at each announcement) and on the sends channel (applies
/// the other replicas' sends); reconnects with backoff (0.5 s doubling to 8 s).
async fn subscribe<H: SyncHost>(state: Arc<H>) {
    let Some(store) = state.shared().store() else { return };
    let sends_channel = store.key("sends");
    let mut backoff = Duration::from_millis(500);
    loop {
        let attempt = async {
            let mut pubsub = store.client().get_async_pubsub().await?;
            pubsub.subscribe(store.channel()).await?;
            if state.sharer().is_some() {
                pubsub.subscribe(&sends_channel).await?;
            }
            Ok::<_, redis::RedisError>(pubsub)
        };
        match tokio::time::timeout(COMMAND_TIMEOUT, attempt).await {
            Ok(Ok(mut pubsub)) => {
                backoff = Duration::from_millis(500);
                let mut messages = pubsub.on_message();
                while let Some(m) = messages.next().await {
                    if m.get_channel_name() == sends_channel {
                        super::sends::apply(state.as_ref(), m.get_payload_bytes());
                        continue;
                    }
                    let payload: String = m.get_payload().unwrap_or_default();
                    tracing::debug!(change = %payload, "shared state: change announced");
                    state.shared().wake();
                }
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "shared state: cannot subscribe"),
            Err(_) => tracing::debug!("shared state: subscribing timed out"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(8));
    }
}
