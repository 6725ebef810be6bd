//! Class budgets shared by the replicas: one token bucket per class in Redis, leased out in chunks, so N replicas
//! admit a class's budget once, not N times, without a Redis round trip per request.
//!
//! Each replica's local buckets stop refilling by themselves while Redis is reachable (rate scale 0) and are fed
//! by leases instead: every [`LEASE_INTERVAL`] a replica looks at each class; with requests waiting it takes what
//! its local bucket lacks to cover them (at most up to the burst) from the class's bucket in Redis; idle, it keeps
//! a float of [`FLOAT_S`] of the class's rate (so a lone request is admitted without waiting for a lease) and
//! gives the rest back. Refunds (a request that cost less than reserved) land in the local bucket and flow back
//! with the surplus. The bucket in Redis refills at the class's rate on Redis's own clock (`TIME`), so replicas'
//! clocks do not matter. Fairness inside a class stays local.
//!
//! Redis lost: the local buckets refill at rate/N (N: live replicas at the last heartbeat) until it is back.

use std::time::Duration;

use redis::RedisError;

use super::redis_store::RedisStore;
use super::SharedState;
use crate::admission::{Admission, ClassBudget};

/// What the lease loop touches, and nothing else (`state::GatewayState` implements it).
pub trait BudgetsHost: Send + Sync + 'static {
    fn shared(&self) -> &SharedState;
    fn admission(&self) -> &Admission;
}

/// How often leases are taken and returned.
pub const LEASE_INTERVAL: Duration = Duration::from_millis(50);
/// Seconds of a class's rate an idle replica keeps in its local bucket.
pub const FLOAT_S: f64 = 0.1;

/// A class's bucket in Redis, refilled on Redis's clock (`TIME`) up to the burst; a missing bucket starts full.
/// KEYS = bucket; ARGV = op (`take` or `give`), n, rate, burst. `take` grants up to n tokens (what is there, never
/// below zero) and returns the grant; `give` puts n back (capped at the burst) and returns 0.
///
/// What is read back is checked like admin input (Redis is shared infrastructure): a level that is not a number,
/// NaN or above the burst counts as a bucket at its burst (so no write can mint more than one burst), a negative
/// one as empty (`take` never leaves one: no write can starve the class), and a time in the future or more than a
/// day old as now (no refill from it).
const BUCKET: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local b = redis.call('HMGET', KEYS[1], 'level', 't')
local n, rate, burst = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local level = tonumber(b[1])
if level == nil or level ~= level or level > burst then level = burst end
if level < 0 then level = 0 end
local last = tonumber(b[2])
if last == nil or last ~= last or last > now or last < now - 86400000 then last = now end
if now > last then level = math.min(burst, level + (now - last) * rate / 1000) end
local out = 0
if ARGV[1] == 'take' then
  out = math.floor(math.min(n, math.max(level, 0)))
  level = level - out
else
  level = math.min(burst, level + n)
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 't', tostring(now))
redis.call('PEXPIRE', KEYS[1], 3600000)
return out
";

/// What a replica should do with one class's lease: positive, take that many tokens; negative, give that many back.
pub fn lease_delta(b: &ClassBudget) -> f64 {
    let float = (b.rate * FLOAT_S).min(b.burst);
    let need = if b.queued_tokens > 0.0 { b.queued_tokens.max(b.head_cost) } else { float };
    let target = need.min(b.burst).max(float);
    let delta = target - b.level;
    if delta > 0.0 {
        delta.floor()
    } else if b.queued_tokens == 0.0 && b.level > 2.0 * float {
        // Idle with more than twice the float: give all but the float back.
        -(b.level - float).floor()
    } else {
        0.0
    }
}

fn bucket_key(store: &RedisStore, class: &str) -> String {
    store.key(&format!("budget:{class}"))
}

async fn bucket(store: &RedisStore, b: &ClassBudget, op: &str, n: f64) -> Result<f64, RedisError> {
    let args = [op.to_owned(), n.to_string(), b.rate.to_string(), b.burst.to_string()];
    let out: i64 = store.eval(BUCKET, &[bucket_key(store, &b.name)], &args).await?;
    // Never more than was asked for, whatever the script returned.
    Ok((out.max(0) as f64).min(n.max(0.0)))
}

async fn take(store: &RedisStore, b: &ClassBudget, want: f64) -> Result<f64, RedisError> {
    bucket(store, b, "take", want).await
}

async fn give(store: &RedisStore, b: &ClassBudget, n: f64) -> Result<(), RedisError> {
    bucket(store, b, "give", n).await.map(|_| ())
}

/// One round over the classes while Redis is up.
async fn lease_once(state: &impl BudgetsHost, store: &RedisStore) -> Result<(), RedisError> {
    for b in state.admission().budgets() {
        let delta = lease_delta(&b);
        if delta > 0.0 {
            let granted = take(store, &b, delta).await?;
            if granted > 0.0 {
                state.admission().credit(&b.name, granted);
            }
        } else if delta < 0.0 {
            // Debit here first: a failed give-back loses tokens (fewer admitted), never mints them.
            state.admission().credit(&b.name, delta);
            give(store, &b, -delta).await?;
        }
        metrics::gauge!("kvgate_gateway_class_budget_tokens", "class" => b.name.clone()).set(b.level);
    }
    Ok(())
}

/// The lease loop: runs for the life of the gateway when Redis is configured. The rate scale follows the mode:
/// 0 while Redis is reachable (leases feed the buckets), 1/N while it is not.
pub async fn run<H: BudgetsHost>(state: std::sync::Arc<H>) {
    let Some(store) = state.shared().store() else { return };
    let mut leasing = false;
    loop {
        if state.shared().redis_up() {
            state.admission().set_rate_scale(0.0);
            if !leasing {
                // Entering leased mode (at start: a full local burst per replica would let N replicas admit N
                // bursts): what the local buckets hold goes back to the shared ones (capped at their burst there).
                leasing = true;
                for b in state.admission().budgets() {
                    if b.level > 0.0 {
                        state.admission().credit(&b.name, -b.level.floor());
                        if let Err(e) = give(store, &b, b.level.floor()).await {
                            tracing::debug!(error = %e, "shared budgets: give-back failed");
                        }
                    }
                }
            }
            if let Err(e) = lease_once(state.as_ref(), store).await {
                tracing::debug!(error = %e, "shared budgets: lease failed");
                state.shared().lost();
            }
        } else {
            leasing = false;
            state.admission().set_rate_scale(1.0 / state.shared().live_replicas() as f64);
            for b in state.admission().budgets() {
                metrics::gauge!("kvgate_gateway_class_budget_tokens", "class" => b.name.clone()).set(b.level);
            }
        }
        tokio::time::sleep(LEASE_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(level: f64, queued: f64, head: f64) -> ClassBudget {
        ClassBudget {
            name: "c".into(),
            rate: 2000.0,
            burst: 4000.0,
            level,
            queued_tokens: queued,
            head_cost: head,
        }
    }

    #[test]
    fn leases_cover_what_waits_up_to_the_burst_and_idle_surplus_goes_back() {
        // Waiting 3,000 tokens with 500 here: take 2,500.
        assert_eq!(lease_delta(&budget(500.0, 3000.0, 300.0)), 2500.0);
        // Waiting more than the burst: fill to the burst.
        assert_eq!(lease_delta(&budget(0.0, 90_000.0, 300.0)), 4000.0);
        // A head costing more than the burst: fill to the burst (a full bucket admits it, in debt).
        assert_eq!(lease_delta(&budget(1000.0, 9000.0, 9000.0)), 3000.0);
        // Idle: keep a float of 0.1 s of rate (200), take it if missing.
        assert_eq!(lease_delta(&budget(0.0, 0.0, 0.0)), 200.0);
        assert_eq!(lease_delta(&budget(300.0, 0.0, 0.0)), 0.0, "within twice the float: keep it");
        assert_eq!(lease_delta(&budget(3000.0, 0.0, 0.0)), -2800.0, "idle surplus goes back");
        // In debt (a big request went through): take what brings it to the float.
        assert_eq!(lease_delta(&budget(-1000.0, 0.0, 0.0)), 1200.0);
    }
}
