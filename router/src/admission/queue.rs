//! The admission state machine, clock-free and synchronous: class buckets, tenant-fair FIFO queues, the
//! admit-at-once / queue / refuse decision and serving queue heads as budgets refill. The gateway's async
//! [`super::Admission`] wraps it with oneshot channels and tokio timers; the simulator's
//! [`super::VirtualAdmission`] drives it in virtual time. Every method takes `now`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{classes, ClassConfig, ClassInput, Rejection, TokenBucket, OVERFLOW_TENANT};

/// A queued request; `token` is whatever the driver needs to wake it (a channel, a request id).
pub(crate) struct Waiter<T> {
    pub id: u64,
    pub cost: f64,
    pub token: T,
}

pub(crate) struct ClassState<T> {
    pub cfg: ClassConfig,
    pub bucket: TokenBucket,
    /// Tenants in round-robin order, each with its FIFO of waiters.
    pub(crate) queues: VecDeque<(String, VecDeque<Waiter<T>>)>,
    pub queued_requests: usize,
    queued_tokens: f64,
}

impl<T> ClassState<T> {
    fn new(cfg: ClassConfig, now: Instant) -> Self {
        Self {
            bucket: TokenBucket::new(cfg.refill_tokens_per_s, cfg.burst_tokens, now),
            cfg,
            queues: VecDeque::new(),
            queued_requests: 0,
            queued_tokens: 0.0,
        }
    }

    fn head_cost(&self) -> Option<f64> {
        self.queues.front().and_then(|(_, q)| q.front()).map(|w| w.cost)
    }

    fn pop_head(&mut self) -> Option<Waiter<T>> {
        let (tenant, mut q) = self.queues.pop_front()?;
        let w = q.pop_front();
        if !q.is_empty() {
            self.queues.push_back((tenant, q));
        }
        if let Some(w) = &w {
            self.queued_requests -= 1;
            self.queued_tokens -= w.cost;
        }
        w
    }

    fn remove(&mut self, id: u64) -> Option<Waiter<T>> {
        let mut found = None;
        for (_, q) in &mut self.queues {
            if let Some(pos) = q.iter().position(|w| w.id == id) {
                found = q.remove(pos);
                break;
            }
        }
        if let Some(w) = &found {
            self.queued_requests -= 1;
            self.queued_tokens -= w.cost;
        }
        self.queues.retain(|(_, q)| !q.is_empty());
        found
    }
}

/// What [`Queues::offer`] did with a request.
pub(crate) enum Offer {
    /// Admitted at once; the named class's bucket paid.
    Admitted {
        payer: String,
    },
    /// Waiting in its class queue under `id`, at most `max_wait`.
    Queued {
        id: u64,
        max_wait: Duration,
    },
    Refused(Rejection),
}

/// All classes' buckets and queues.
pub(crate) struct Queues<T> {
    pub classes: Vec<ClassState<T>>,
    next_id: u64,
    /// Multiplies every class's refill rate (see [`Queues::set_rate_scale`]).
    rate_scale: f64,
}

impl<T> Queues<T> {
    pub fn new(classes: Vec<ClassConfig>, now: Instant) -> Self {
        Self {
            classes: classes.into_iter().map(|cfg| ClassState::new(cfg, now)).collect(),
            next_id: 0,
            rate_scale: 1.0,
        }
    }

    /// Scales every class's refill: 1 refills at the configured rate (one replica); 0 refills only through
    /// [`Queues::credit`] (budgets leased from a bucket the replicas share); 1/N while that bucket is unreachable.
    pub fn set_rate_scale(&mut self, scale: f64, now: Instant) {
        let scale = if scale.is_finite() { scale.clamp(0.0, 1.0) } else { 1.0 };
        if scale == self.rate_scale {
            return;
        }
        self.rate_scale = scale;
        for c in &mut self.classes {
            c.bucket.reconfigure(c.cfg.refill_tokens_per_s * scale, c.cfg.burst_tokens, now);
        }
    }

    /// Adds `tokens` (negative: removes) to class `name`'s bucket, capped at its burst; false if no such class.
    pub fn credit(&mut self, name: &str, tokens: f64, now: Instant) -> bool {
        match self.classes.iter_mut().find(|c| c.cfg.name == name) {
            Some(c) => {
                c.bucket.adjust(tokens, now);
                true
            }
            None => false,
        }
    }

    /// Each class's budget as a lease decision needs it.
    pub fn budgets(&mut self, now: Instant) -> Vec<super::ClassBudget> {
        self.classes
            .iter_mut()
            .map(|c| super::ClassBudget {
                name: c.cfg.name.clone(),
                rate: c.cfg.refill_tokens_per_s,
                burst: c.cfg.burst_tokens,
                level: c.bucket.level(now),
                queued_tokens: c.queued_tokens,
                head_cost: c.head_cost().unwrap_or(0.0),
            })
            .collect()
    }

    /// Replaces the class set; classes kept by name keep their bucket level and queue. Waiters of removed classes
    /// are returned (their drivers release them to their timeout).
    pub fn set_classes(&mut self, classes: Vec<ClassConfig>, now: Instant) -> Vec<Waiter<T>> {
        let mut old: Vec<ClassState<T>> = std::mem::take(&mut self.classes);
        self.classes = classes
            .into_iter()
            .map(|cfg| match old.iter().position(|o| o.cfg.name == cfg.name) {
                Some(i) => {
                    let mut s = old.swap_remove(i);
                    s.bucket.reconfigure(cfg.refill_tokens_per_s * self.rate_scale, cfg.burst_tokens, now);
                    s.cfg = cfg;
                    s
                }
                None => {
                    let mut s = ClassState::new(cfg, now);
                    s.bucket.reconfigure(
                        s.cfg.refill_tokens_per_s * self.rate_scale,
                        s.cfg.burst_tokens,
                        now,
                    );
                    s
                }
            })
            .collect();
        old.into_iter().flat_map(|mut c| std::iter::from_fn(move || c.pop_head())).collect()
    }

    /// The class of a request by the server's rules: (index, name, expected output tokens).
    pub fn classify(&self, input: &ClassInput<'_>) -> (usize, String, u64) {
        let i = classes::classify_by(self.classes.iter().map(|c| &c.cfg), input);
        match self.classes.get(i) {
            Some(c) => (i, c.cfg.name.clone(), c.cfg.expected_output_tokens),
            None => (0, "none".into(), 0),
        }
    }

    /// Takes `cost` for class `i` from its own bucket, or, if the class may borrow, from an idle class (empty
    /// queue, full bucket). Returns the index of the class that paid.
    fn take(&mut self, i: usize, cost: f64, now: Instant) -> Option<usize> {
        if self.classes[i].bucket.try_take(cost, now) {
            return Some(i);
        }
        if !self.classes[i].cfg.borrow_idle {
            return None;
        }
        let lender = (0..self.classes.len()).find(|&j| {
            let c = &mut self.classes[j];
            j != i
                && c.queued_requests == 0
                && c.bucket.level(now) >= c.cfg.burst_tokens
                && c.bucket.can_take(cost, now)
        })?;
        self.classes[lender].bucket.try_take(cost, now).then_some(lender)
    }

    /// A request of `cost` tokens for class `class`: admitted at once when nobody waits and the budget allows,
    /// refused when the queue is full (requests or tokens), else queued under the tenant's FIFO (past
    /// `max_tenant_queues` tenants, in the shared overflow queue). `token` is kept only when queued.
    pub fn offer(&mut self, class: usize, tenant: Option<&str>, cost: f64, now: Instant, token: T) -> Offer {
        let id = self.next_id;
        self.next_id += 1;
        if class >= self.classes.len() {
            return Offer::Refused(Rejection::QueueFull { class: "unknown".into(), retry_after_s: 1 });
        }
        let name = self.classes[class].cfg.name.clone();
        if self.classes[class].queued_requests == 0 {
            if let Some(payer) = self.take(class, cost, now) {
                metrics::counter!("kvgate_gateway_class_admitted_total", "class" => name).increment(1);
                return Offer::Admitted { payer: self.classes[payer].cfg.name.clone() };
            }
        }
        let c = &mut self.classes[class];
        if c.queued_requests + 1 > c.cfg.max_queued_requests
            || c.queued_tokens + cost > c.cfg.max_queued_tokens.max(cost.min(c.cfg.burst_tokens))
        {
            metrics::counter!("kvgate_gateway_class_rejected_total", "class" => name.clone(), "reason" => "queue_full")
                .increment(1);
            let retry_after_s = retry_after(&mut c.bucket, cost, now);
            return Offer::Refused(Rejection::QueueFull { class: name, retry_after_s });
        }
        let mut tenant = tenant.unwrap_or("");
        if c.queues.len() >= c.cfg.max_tenant_queues && !c.queues.iter().any(|(t, _)| t == tenant) {
            metrics::counter!("kvgate_gateway_class_tenant_overflow_total", "class" => name.clone())
                .increment(1);
            tenant = OVERFLOW_TENANT;
        }
        let w = Waiter { id, cost, token };
        match c.queues.iter_mut().find(|(t, _)| t == tenant) {
            Some((_, q)) => q.push_back(w),
            None => c.queues.push_back((tenant.to_owned(), VecDeque::from([w]))),
        }
        c.queued_requests += 1;
        c.queued_tokens += cost;
        metrics::counter!("kvgate_gateway_class_queued_total", "class" => name).increment(1);
        Offer::Queued { id, max_wait: Duration::from_millis(c.cfg.max_wait_ms) }
    }

    /// Serves queue heads the budgets allow now: `deliver(token, payer)` for each (false: the waiter is gone, its
    /// payment goes back). Returns how long until the next head could be served, if any waits.
    pub fn serve(&mut self, now: Instant, mut deliver: impl FnMut(T, &str) -> bool) -> Option<Duration> {
        let mut next: Option<Duration> = None;
        for i in 0..self.classes.len() {
            while let Some(cost) = self.classes[i].head_cost() {
                if let Some(payer) = self.take(i, cost, now) {
                    if let Some(w) = self.classes[i].pop_head() {
                        if !deliver(w.token, &self.classes[payer].cfg.name) {
                            self.classes[payer].bucket.adjust(w.cost, now);
                        }
                    }
                } else {
                    if let Some(d) = self.classes[i].bucket.wait_for(cost, now) {
                        next = Some(next.map_or(d, |n| n.min(d)));
                    }
                    break;
                }
            }
            let c = &mut self.classes[i];
            metrics::gauge!("kvgate_gateway_class_bucket_tokens", "class" => c.cfg.name.clone())
                .set(c.bucket.level(now));
            metrics::gauge!("kvgate_gateway_class_queued_requests", "class" => c.cfg.name.clone())
                .set(c.queued_requests as f64);
        }
        next
    }

    /// Takes waiter `id` out of its queue (it timed out or left).
    pub fn remove(&mut self, id: u64) -> Option<Waiter<T>> {
        self.classes.iter_mut().find_map(|c| c.remove(id))
    }

    /// Gives `delta` tokens back to class `payer` (negative: charges more).
    pub fn adjust(&mut self, payer: &str, delta: f64, now: Instant) {
        if let Some(c) = self.classes.iter_mut().find(|c| c.cfg.name == payer) {
            c.bucket.adjust(delta, now);
        }
    }

    /// Seconds a refused request should wait before trying again (Retry-After).
    pub fn retry_after(&mut self, class: &str, cost: f64, now: Instant) -> u32 {
        match self.classes.iter_mut().find(|c| c.cfg.name == class) {
            Some(c) => retry_after(&mut c.bucket, cost, now),
            None => 1,
        }
    }
}

fn retry_after(bucket: &mut TokenBucket, cost: f64, now: Instant) -> u32 {
    bucket.wait_for(cost, now).map_or(60, |d| d.as_secs_f64().ceil().clamp(1.0, 3600.0) as u32)
}
