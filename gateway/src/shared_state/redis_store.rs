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
use redis::{Client, RedisError, Value};
use tokio::sync::Mutex;

/// Longest a single command may take before the replica treats Redis as unreachable.
pub const COMMAND_TIMEOUT: Duration = Duration::from_millis(800);
/// Audit stream length kept (approximately: `XADD MAXLEN ~`).
pub const AUDIT_MAX_LEN: u64 = 10_000;
/// A replica whose heartbeat is older than this is not counted as live.
pub const LIVE_WINDOW_MS: u64 = 3_000;

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
}

/// Compare-and-set of a resource: KEYS = hash, channel, audit stream; ARGV = expected version (`*`: any), value,
/// resource name, audit line, audit cap. Returns `{1, new version}` or `{0, current version}`.
const CAS: &str = r"
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if ARGV[1] ~= '*' and tonumber(ARGV[1]) ~= v then
  return {0, v}
end
redis.call('HSET', KEYS[1], 'version', v + 1, 'value', ARGV[2])
redis.call('PUBLISH', KEYS[2], ARGV[3] .. ':' .. (v + 1))
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'line', ARGV[4])
return {1, v + 1}
";

/// Seeds a resource that Redis does not hold yet (a first replica, or a Redis that came back empty): KEYS = hash;
/// ARGV = version, value. Returns 1 when it wrote.
const SEED: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'value', ARGV[2])
return 1
";

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
    /// Parses the URL (`redis://[:password@]host:port[/db]`, `rediss://` for TLS); connects lazily.
    pub fn new(url: &str, prefix: &str) -> Result<Self, String> {
        let client = Client::open(url).map_err(|e| format!("redis-url: {e}"))?;
        Ok(Self { client, prefix: prefix.to_owned(), conn: Mutex::new(None) })
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

    /// The stored version and value of a resource (`None`: not stored).
    pub async fn get(&self, r: Resource) -> Result<Option<(u64, String)>, RedisError> {
        let (v, value): (Option<u64>, Option<String>) =
            self.query(redis::cmd("HMGET").arg(self.resource_key(r)).arg("version").arg("value")).await?;
        Ok(v.zip(value))
    }

    /// Compare-and-set (`expected` `None`: whatever is stored).
    pub async fn commit(
        &self,
        r: Resource,
        expected: Option<u64>,
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
                    .arg(AUDIT_MAX_LEN),
            )
            .await?;
        Ok(if done == 1 { Commit::Done(version) } else { Commit::Stale(version) })
    }

    /// Stores `value` at `version` unless Redis holds the resource already; true when it wrote.
    pub async fn seed(&self, r: Resource, version: u64, value: &str) -> Result<bool, RedisError> {
        let wrote: u8 = self
            .query(redis::cmd("EVAL").arg(SEED).arg(1).arg(self.resource_key(r)).arg(version).arg(value))
            .await?;
        Ok(wrote == 1)
    }

    /// Records this replica's heartbeat and returns how many replicas are live (this one included).
    pub async fn heartbeat(&self, replica: &str, now_ms: u64) -> Result<usize, RedisError> {
        let key = self.key("replicas");
        let mut pipe = redis::pipe();
        pipe.cmd("ZADD").arg(&key).arg(now_ms).arg(replica).ignore();
        pipe.cmd("ZREMRANGEBYSCORE").arg(&key).arg("-inf").arg(now_ms.saturating_sub(60_000)).ignore();
        pipe.cmd("ZCOUNT").arg(&key).arg(now_ms.saturating_sub(LIVE_WINDOW_MS)).arg("+inf");
        let mut c = self.connection().await?;
        let r = match tokio::time::timeout(COMMAND_TIMEOUT, pipe.query_async::<(usize,)>(&mut c)).await {
            Ok(r) => r.map(|(n,)| n.max(1)),
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
