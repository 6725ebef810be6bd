//! State the gateway replicas share through Redis (`--redis-url`), and what a replica does without it.
//!
//! - **Admin state** (weights, class budgets): Redis holds each resource with its version (the admin API's ETag).
//!   A PUT on any replica is a compare-and-set in Redis (a stale `If-Match` from any replica gets 412), announced on
//!   a channel; every replica applies a newer version when the announcement arrives and, whatever happens to the
//!   channel, when its sync loop next reads Redis ([`SYNC_INTERVAL`]), so a change reaches every replica within a
//!   second. The audit line goes to a Redis stream as well as the log. Each replica also keeps the last state in
//!   its state file, so a restart while Redis is down starts from it.
//! - **Redis down**: no request fails because of it. Admin writes answer 503 `shared_state_unavailable` (they
//!   could not be made durable for the other replicas), reads serve the last state; the gauge
//!   `kvgate_gateway_shared_state_mode{mode}` says `redis` or `local`; the sync loop keeps trying (the connection is
//!   re-made at each attempt, at most every [`SYNC_INTERVAL`]) and, when Redis answers again, seeds what it lost
//!   (a Redis that restarted empty gets this replica's state back) and applies what is newer.
//! - **Class budgets**: one token bucket per class in Redis, leased out in chunks (`budgets.rs`); while Redis is
//!   lost each replica refills its own buckets at rate/N (N: live replicas at the last heartbeat).
//! - **Sends** (`--share-sends`): each replica publishes what it routed where, and the others count it as load and
//!   routed prefix until the worker's next report (`sends.rs`).
//! - **Heartbeats**: every sync records this replica in a sorted set and counts the live ones
//!   ([`SharedState::live_replicas`]).
//!
//! Without `--redis-url` the mode is `local` for good and the admin state lives in the state file only.

pub mod budgets;
pub mod redis_store;
pub mod sends;
pub mod sync;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

pub use redis_store::{Commit, RedisStore, RedisTarget, Resource};

/// How often a replica reads the shared state, heartbeats and retries a lost Redis.
pub const SYNC_INTERVAL: Duration = Duration::from_millis(500);

/// The replica's view of the shared state.
pub struct SharedState {
    store: Option<RedisStore>,
    replica_id: String,
    redis_up: AtomicBool,
    live: AtomicUsize,
    /// The replica ids of the last heartbeat (shared sends from others are ignored, `sends.rs`).
    live_ids: std::sync::RwLock<std::collections::HashSet<String>>,
    /// The version of each resource whose invalid value was last ignored (reported once, not every pass).
    ignored: std::sync::Mutex<std::collections::HashMap<&'static str, u64>>,
    wake: Notify,
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl SharedState {
    /// `redis`: where Redis is; `None` is the single-replica, local mode.
    pub fn new(redis: Option<RedisTarget<'_>>, replica_id: String) -> Result<Self, String> {
        let store = redis.map(|t| RedisStore::new(&t)).transpose()?;
        let s = Self {
            store,
            replica_id,
            redis_up: AtomicBool::new(false),
            live: AtomicUsize::new(1),
            live_ids: Default::default(),
            ignored: Default::default(),
            wake: Notify::new(),
        };
        s.publish_mode();
        Ok(s)
    }

    /// The store, when Redis is configured.
    pub fn store(&self) -> Option<&RedisStore> {
        self.store.as_ref()
    }

    /// Whether the last contact with Redis succeeded (false without Redis).
    pub fn redis_up(&self) -> bool {
        self.redis_up.load(Ordering::Acquire)
    }

    /// Live replicas by their heartbeats (1 without Redis, or while it is down: the last count is kept).
    pub fn live_replicas(&self) -> usize {
        self.live.load(Ordering::Acquire).max(1)
    }

    pub fn replica_id(&self) -> &str {
        &self.replica_id
    }

    /// Records the live replicas of the last heartbeat (this one among them).
    pub(crate) fn set_live(&self, ids: Vec<String>) {
        self.live.store(ids.len().max(1), Ordering::Release);
        metrics::gauge!("kvgate_gateway_shared_state_live_replicas").set(ids.len().max(1) as f64);
        *self.live_ids.write().unwrap_or_else(|e| e.into_inner()) = ids.into_iter().collect();
    }

    /// Records that `resource`'s value at `version` was ignored; true the first time for that version.
    pub(crate) fn first_ignored(&self, resource: &'static str, version: u64) -> bool {
        self.ignored.lock().unwrap_or_else(|e| e.into_inner()).insert(resource, version) != Some(version)
    }

    /// Whether `id` had a live heartbeat at the last sync.
    pub fn is_live_replica(&self, id: &str) -> bool {
        self.live_ids.read().unwrap_or_else(|e| e.into_inner()).contains(id)
    }

    /// Wakes the sync loop (a change was announced, or Redis was lost).
    pub(crate) fn wake(&self) {
        self.wake.notify_one();
    }

    /// Waits for [`Self::wake`] or `timeout`.
    pub(crate) async fn wait(&self, timeout: Duration) {
        tokio::select! {
            _ = tokio::time::sleep(timeout) => {}
            _ = self.wake.notified() => {}
        }
    }

    pub(crate) fn set_up(&self, up: bool) {
        if self.redis_up.swap(up, Ordering::AcqRel) != up {
            if up {
                tracing::info!("shared state: Redis reachable, mode redis");
            } else {
                tracing::error!("shared state: Redis unreachable, mode local (admin writes answer 503)");
            }
        }
        self.publish_mode();
    }

    fn publish_mode(&self) {
        let up = self.redis_up();
        metrics::gauge!("kvgate_gateway_shared_state_mode", "mode" => "redis").set(if up {
            1.0
        } else {
            0.0
        });
        metrics::gauge!("kvgate_gateway_shared_state_mode", "mode" => "local").set(if up {
            0.0
        } else {
            1.0
        });
    }

    /// Marks Redis unreachable after a failed command outside the sync loop (an admin write).
    pub fn lost(&self) {
        self.set_up(false);
        self.wake.notify_one();
    }
}

/// An `If-Match` of the admin API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IfMatch {
    /// Absent or `*`: whatever version is stored.
    Any,
    /// `"vN"`.
    Version(u64),
    /// Anything else: matches no version (412).
    Invalid,
}

impl IfMatch {
    pub fn parse(value: Option<&str>) -> Self {
        match value.map(str::trim) {
            None | Some("*") => IfMatch::Any,
            Some(v) => v
                .strip_prefix("\"v")
                .and_then(|v| v.strip_suffix('"'))
                .and_then(|n| n.parse().ok())
                .filter(|v| *v < redis_store::MAX_VERSION)
                .map_or(IfMatch::Invalid, IfMatch::Version),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn if_match_names_a_version_or_any() {
        assert_eq!(IfMatch::parse(None), IfMatch::Any);
        assert_eq!(IfMatch::parse(Some(" * ")), IfMatch::Any);
        assert_eq!(IfMatch::parse(Some("\"v12\"")), IfMatch::Version(12));
        assert_eq!(IfMatch::parse(Some("v12")), IfMatch::Invalid);
        assert_eq!(IfMatch::parse(Some("\"vx\"")), IfMatch::Invalid);
        assert_eq!(IfMatch::parse(Some("\"v9223372036854775808\"")), IfMatch::Invalid, "past MAX_VERSION");
    }

    #[test]
    fn resources_round_trip_their_names() {
        for r in Resource::ALL {
            assert_eq!(Resource::parse(r.name()), Some(r));
        }
        assert_eq!(Resource::parse("other"), None);
    }
}
