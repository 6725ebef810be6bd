//! A token bucket with debt: refills at `rate` tokens/s up to `burst`; a request costing more than the burst is
//! admitted when the bucket is full and leaves it negative (in debt), so a giant request is never starved forever
//! and still pays for itself before the class admits more.
//!
//! Pure: the clock is passed in.

use std::time::{Duration, Instant};

/// One class's budget.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    level: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(rate_per_s: f64, burst: f64, now: Instant) -> Self {
        Self { rate: rate_per_s.max(0.0), burst: burst.max(1.0), level: burst.max(1.0), last: now }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.level = (self.level + dt * self.rate).min(self.burst);
        self.last = now;
    }

    /// Tokens available now (negative: debt).
    pub fn level(&mut self, now: Instant) -> f64 {
        self.refill(now);
        self.level
    }

    /// Changes rate and burst, keeping the level (capped at the new burst).
    pub fn reconfigure(&mut self, rate_per_s: f64, burst: f64, now: Instant) {
        self.refill(now);
        self.rate = rate_per_s.max(0.0);
        self.burst = burst.max(1.0);
        self.level = self.level.min(self.burst);
    }

    /// Whether `cost` can be taken now: the level covers it, or the cost exceeds the burst and the bucket is full.
    pub fn can_take(&mut self, cost: f64, now: Instant) -> bool {
        self.refill(now);
        self.level >= cost || (cost > self.burst && self.level >= self.burst)
    }

    /// Takes `cost` if [`Self::can_take`].
    pub fn try_take(&mut self, cost: f64, now: Instant) -> bool {
        if self.can_take(cost, now) {
            self.level -= cost;
            true
        } else {
            false
        }
    }

    /// Gives tokens back (a refund, negative: a further charge) after the real usage is known.
    pub fn adjust(&mut self, delta: f64, now: Instant) {
        self.refill(now);
        self.level = (self.level + delta).min(self.burst);
    }

    /// How long until `cost` can be taken (None: never, the rate is zero).
    pub fn wait_for(&mut self, cost: f64, now: Instant) -> Option<Duration> {
        if self.can_take(cost, now) {
            return Some(Duration::ZERO);
        }
        if self.rate <= 0.0 {
            return None;
        }
        let target = cost.min(self.burst);
        Some(Duration::from_secs_f64(((target - self.level) / self.rate).max(0.0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refills_caps_and_goes_into_debt_for_giants() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(100.0, 1000.0, t0);
        assert!(b.try_take(600.0, t0));
        assert!(!b.try_take(600.0, t0));
        assert_eq!(b.wait_for(600.0, t0), Some(Duration::from_secs(2)));
        assert!(b.try_take(600.0, t0 + Duration::from_secs(2)));
        // A request bigger than the burst waits for a full bucket, then leaves debt.
        let t1 = t0 + Duration::from_secs(100);
        assert_eq!(b.level(t1), 1000.0);
        assert!(b.try_take(5000.0, t1));
        assert_eq!(b.level(t1), -4000.0);
        assert!(!b.can_take(1.0, t1 + Duration::from_secs(40)));
        assert!(b.can_take(1.0, t1 + Duration::from_secs(41)));
        // Refund after usage.
        b.adjust(2000.0, t1 + Duration::from_secs(41));
        assert_eq!(
            b.level(t1 + Duration::from_secs(41)),
            1000.0,
            "a refund never lifts the level past the burst"
        );
    }
}
