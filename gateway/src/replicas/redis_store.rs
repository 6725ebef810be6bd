//! The Redis side of the replicas' shared state: one connection (re-made on failure, every command bounded by
//! [`COMMAND_TIMEOUT`]), the admin resources as versioned hashes changed by compare-and-set in one Lua script, the
//! change channel, the audit stream and the replicas' heartbeats.
//!
//! Keys (all under `--redis-prefix`, default `kvgate`):
//! - `{p}:admin:weights`, `{p}:admin:budgets`, `{p}:admin:drains`: hashes `{version, value}` (`value`: the resource as JSON, exactly
//!   as the admin API shows it; never decoded in Lua, so no float is re-formatted);
//! - `{p}:admin:changes`: pub/sub channel, one message `resource:version` per change;
//! - `{p}:admin:audit`: stream of audit lines (capped at about [`AUDIT_MAX_LEN`] entries);
//! - `{p}:replicas`: sorted set, replica id -> last heartbeat (unix ms); members silent for a minute are removed;
//! - `{p}:budget:{class}`: hashes `{level, t}`, a class's shared token bucket (`budgets.rs`);
//! - `{p}:sends`: pub/sub channel of the replicas' sends (`sends.rs`).

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{Client, IntoConnectionInfo, RedisError, Value};
use tokio::sync::Mutex;

/// Longest a single command may take before the replica treats Redis as unreachable.
pub const COMMAND_TIMEOUT: Duration = Duration::from_millis(800);
/// Audit stream length kept (approximately: `XADD MAXLEN ~`).
pub const AUDIT_MAX_LEN: u64 = 10_000;
/// A replica whose heartbeat is older than this is not counted as live.
pub const LIVE_WINDOW_MS: u64 = 3_000;
/// Most live replicas read from a heartbeat (more are not believed).
pub const MAX_REPLICAS: usize = 1024;
/// Longest replica id believed.
pub const MAX_REPLICA_ID: usize = 256;

/// An admin resource kept in Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    Weights,
    Budgets,
    /// Worker ids an operator drained through the admin API (a sorted JSON array).
    Drains,
}

impl Resource {
    pub const ALL: [Resource; 3] = [Resource::Weights, Resource::Budgets, Resource::Drains];

    pub fn name(self) -> &'static str {
        match self {
            Resource::Weights => "weights",
            Resource::Budgets => "budgets",
            Resource::Drains => "drains",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == s)
    }
}

/// The result of a compare-and-set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Commit {
    /// Written; the new version.
    Done(u64),
    /// The stored version is not the expected one (it is this).
    Stale(u64),
    /// The stored version is the last one below [`MAX_VERSION`] (written by someone else than the replicas: they
    /// would need 2^52 changes): nothing more can be committed until an operator resets the resource.
    Exhausted(u64),
}

/// Versions are integers below this. Lua numbers are doubles, exact up to 2^53, so a version past it (say 2^63,
/// written by anyone who reaches Redis) would make `v + 1 == v` and every compare-and-set fail. A version at or past
/// it, or one that is not an integer, is no version a replica wrote: [`Stored::Corrupt`].
pub const MAX_VERSION: u64 = 1 << 52;

/// Compare-and-set of a resource: KEYS = hash, channel, audit stream; ARGV = expected version (`*`: any), value,
/// resource name, audit line, audit cap, [`MAX_VERSION`], the writer's own version (below `MAX_VERSION - 1`). A
/// corrupt stored version counts as the writer's own (so the write goes through and replaces it). Returns
/// `{1, new version}`, `{0, current version}` (stale) or `{2, current version}` (no version left below the cap).
const CAS: &str = r"
local max = tonumber(ARGV[6])
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if v == nil or v ~= v or v < 0 or v >= max or v ~= math.floor(v) then
  v = tonumber(ARGV[7])
end
if ARGV[1] ~= '*' and tonumber(ARGV[1]) ~= v then
  return {0, v}
end
if v + 1 >= max then
  return {2, v}
end
redis.call('HSET', KEYS[1], 'version', string.format('%d', v + 1), 'value', ARGV[2])
redis.call('PUBLISH', KEYS[2], ARGV[3] .. ':' .. string.format('%d', v + 1))
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'line', ARGV[4])
return {1, v + 1}
";

/// Replaces a corrupt resource, only if its stored version is still exactly what was read (so a replica's valid
/// write in between is never overwritten): KEYS = hash, channel, audit stream; ARGV = the version as read (`''`:
/// none), value, new version, resource name, audit line, audit cap. Returns 1 when it wrote.
const HEAL: &str = r"
local raw = redis.call('HGET', KEYS[1], 'version') or ''
if raw ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'version', ARGV[3], 'value', ARGV[2])
redis.call('PUBLISH', KEYS[2], ARGV[4] .. ':' .. ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'line', ARGV[5])
return 1
";

/// A resource as Redis holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stored {
    Missing,
    Valid(u64, String),
    /// Nothing a replica wrote: a version that is not an integer below [`MAX_VERSION`], a value that is not text,
    /// or one of the two without the other. `raw_version`: the version field as read (for [`RedisStore::heal`]).
    Corrupt {
        raw_version: Vec<u8>,
    },
}

/// A stored version as a replica may believe it.
pub fn parse_version(raw: &[u8]) -> Option<u64> {
    std::str::from_utf8(raw).ok()?.parse::<u64>().ok().filter(|v| *v < MAX_VERSION)
}

/// Seeds a resource that Redis does not hold yet (a first replica, or a Redis that came back empty): KEYS = hash;
/// ARGV = version, value. Returns 1 when it wrote.
const SEED: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'value', ARGV[2])
return 1
";

/// How to reach Redis: the URL, the key prefix, and credentials given apart from the URL (they win over its own).
#[derive(Clone, Debug)]
pub struct RedisTarget<'a> {
    pub url: &'a str,
    pub prefix: &'a str,
    pub username: Option<&'a str>,
    pub password: Option<&'a str>,
}

/// Where the replicas' shared state lives.
pub struct RedisStore {
    client: Client,
    prefix: String,
    conn: Mutex<Option<MultiplexedConnection>>,
}

fn timeout_error() -> RedisError {
    RedisError::from(std::io::Error::new(std::io::ErrorKind::TimedOut, "redis command timed out"))
}

impl RedisStore {
    /// Parses the URL (`redis://[:password@]host:port[/db]`, `rediss://` for TLS) and adds the credentials;
    /// connects lazily.
    pub fn new(t: &RedisTarget<'_>) -> Result<Self, String> {
        let mut info = t.url.into_connection_info().map_err(|e| format!("redis-url: {e}"))?;
        if let Some(u) = t.username {
            info.redis.username = Some(u.to_owned());
        }
        if let Some(p) = t.password {
            info.redis.password = Some(p.to_owned());
        }
        let client = Client::open(info).map_err(|e| format!("redis-url: {e}"))?;
        Ok(Self { client, prefix: t.prefix.to_owned(), conn: Mutex::new(None) })
    }

    pub fn key(&self, suffix: &str) -> String {
        format!("{}:{suffix}", self.prefix)
    }

    pub fn resource_key(&self, r: Resource) -> String {
        self.key(&format!("admin:{}", r.name()))
    }

    pub fn channel(&self) -> String {
        self.key("admin:changes")
    }

    /// The connection, made if there is none (bounded by [`COMMAND_TIMEOUT`]).
    async fn connection(&self) -> Result<MultiplexedConnection, RedisError> {
        let mut g = self.conn.lock().await;
        if let Some(c) = g.as_ref() {
            return Ok(c.clone());
        }
        let c = tokio::time::timeout(COMMAND_TIMEOUT, self.client.get_multiplexed_async_connection())
            .await
            .map_err(|_| timeout_error())??;
        *g = Some(c.clone());
        Ok(c)
    }

    /// Runs one command; any failure drops the connection so the next call makes a new one.
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, RedisError> {
        let mut c = self.connection().await?;
        let r = match tokio::time::timeout(COMMAND_TIMEOUT, cmd.query_async::<T>(&mut c)).await {
            Ok(r) => r,
            Err(_) => Err(timeout_error()),
        };
        if r.is_err() {
            *self.conn.lock().await = None;
        }
        r
    }

    /// Runs a Lua script (`EVAL`) over `keys` and `args`.
    pub async fn eval<T: redis::FromRedisValue>(
        &self,
        script: &str,
        keys: &[String],
        args: &[String],
    ) -> Result<T, RedisError> {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(script).arg(keys.len()).arg(keys).arg(args);
        self.query(&cmd).await
    }

    /// `PUBLISH channel payload`.
    pub async fn publish(&self, channel: &str, payload: &str) -> Result<(), RedisError> {
        self.query::<Value>(redis::cmd("PUBLISH").arg(channel).arg(payload)).await.map(|_| ())
    }

    /// `PING`.
    pub async fn ping(&self) -> Result<(), RedisError> {
        self.query::<Value>(&redis::cmd("PING")).await.map(|_| ())
    }

    /// The stored version and value of a resource.
    pub async fn get(&self, r: Resource) -> Result<Stored, RedisError> {
        let (v, value): (Option<Vec<u8>>, Option<Vec<u8>>) =
            self.query(redis::cmd("HMGET").arg(self.resource_key(r)).arg("version").arg("value")).await?;
        Ok(match (v, value) {
            (None, None) => Stored::Missing,
            (Some(raw), Some(value)) => match (parse_version(&raw), String::from_utf8(value)) {
                (Some(v), Ok(value)) => Stored::Valid(v, value),
                _ => Stored::Corrupt { raw_version: raw },
            },
            (raw, _) => Stored::Corrupt { raw_version: raw.unwrap_or_default() },
        })
    }

    /// Compare-and-set (`expected` `None`: whatever is stored); `own`: the writer's version of the resource (what a
    /// corrupt stored version counts as).
    pub async fn commit(
        &self,
        r: Resource,
        expected: Option<u64>,
        own: u64,
        value: &str,
        audit: &str,
    ) -> Result<Commit, RedisError> {
        let expected = expected.map_or_else(|| "*".to_owned(), |v| v.to_string());
        let (done, version): (u8, u64) = self
            .query(
                redis::cmd("EVAL")
                    .arg(CAS)
                    .arg(3)
                    .arg(self.resource_key(r))
                    .arg(self.channel())
                    .arg(self.key("admin:audit"))
                    .arg(expected)
                    .arg(value)
                    .arg(r.name())
                    .arg(audit)
                    .arg(AUDIT_MAX_LEN)
                    .arg(MAX_VERSION)
                    .arg(own.min(MAX_VERSION - 2)),
            )
            .await?;
        Ok(match done {
            1 => Commit::Done(version),
            2 => Commit::Exhausted(version),
            _ => Commit::Stale(version),
        })
    }

    /// Replaces a corrupt resource with `value` at `version`, unless its version field is no longer `raw_version`
    /// (someone wrote since it was read); true when it wrote.
    pub async fn heal(
        &self,
        r: Resource,
        raw_version: &[u8],
        version: u64,
        value: &str,
        audit: &str,
    ) -> Result<bool, RedisError> {
        let wrote: u8 = self
            .query(
                redis::cmd("EVAL")
                    .arg(HEAL)
                    .arg(3)
                    .arg(self.resource_key(r))
                    .arg(self.channel())
                    .arg(self.key("admin:audit"))
                    .arg(raw_version)
                    .arg(value)
                    .arg(version.min(MAX_VERSION - 1))
                    .arg(r.name())
                    .arg(audit)
                    .arg(AUDIT_MAX_LEN),
            )
            .await?;
        Ok(wrote == 1)
    }

    /// Stores `value` at `version` unless Redis holds the resource already; true when it wrote.
    pub async fn seed(&self, r: Resource, version: u64, value: &str) -> Result<bool, RedisError> {
        let wrote: u8 = self
            .query(redis::cmd("EVAL").arg(SEED).arg(1).arg(self.resource_key(r)).arg(version).arg(value))
            .await?;
        Ok(wrote == 1)
    }

    /// Records this replica's heartbeat and returns the live replicas' ids (this one included; at most
    /// [`MAX_REPLICAS`], each at most [`MAX_REPLICA_ID`] bytes: longer ones are not believed).
    pub async fn heartbeat(&self, replica: &str, now_ms: u64) -> Result<Vec<String>, RedisError> {
        let key = self.key("replicas");
        let mut pipe = redis::pipe();
        pipe.cmd("ZADD").arg(&key).arg(now_ms).arg(replica).ignore();
        pipe.cmd("ZREMRANGEBYSCORE").arg(&key).arg("-inf").arg(now_ms.saturating_sub(60_000)).ignore();
        // A heartbeat stamped in the future is nobody's (it would stay "live" for ever): removed, never counted.
        pipe.cmd("ZREMRANGEBYSCORE")
            .arg(&key)
            .arg(format!("({}", now_ms + LIVE_WINDOW_MS))
            .arg("+inf")
            .ignore();
        pipe.cmd("ZRANGEBYSCORE")
            .arg(&key)
            .arg(now_ms.saturating_sub(LIVE_WINDOW_MS))
            .arg(now_ms + LIVE_WINDOW_MS)
            .arg("LIMIT")
            .arg(0)
            .arg(MAX_REPLICAS);
        let mut c = self.connection().await?;
        let r = match tokio::time::timeout(COMMAND_TIMEOUT, pipe.query_async::<(Vec<Vec<u8>>,)>(&mut c)).await
        {
            Ok(r) => r.map(|(ids,)| {
                let mut ids: Vec<String> = ids
                    .into_iter()
                    .filter(|i| i.len() <= MAX_REPLICA_ID)
                    .filter_map(|i| String::from_utf8(i).ok())
                    .collect();
                if !ids.iter().any(|i| i == replica) {
                    ids.push(replica.to_owned());
                }
                ids
            }),
            Err(_) => Err(timeout_error()),
        };
        if r.is_err() {
            *self.conn.lock().await = None;
        }
        r
    }

    /// The client, for the change subscription (a connection of its own).
    pub fn client(&self) -> &Client {
        &self.client
    }
}
