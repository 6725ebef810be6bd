//! Admission control: per-class token budgets so one class (a burst of million-token requests) cannot consume
//! another's share.
//!
//! A request's cost is its predicted uncached prompt tokens (a cache hit costs less) plus its `max_tokens` (or the
//! class's expected output). It is reserved at admission and reconciled with the real usage when the request ends
//! ([`Permit::reconcile`]); a permit dropped without being reconciled (an error answer, a failed or timed-out
//! upstream, a client that went away) gives its whole charge back. A permit names its class, not an index, so a
//! refund after the class set was replaced reaches the right bucket (or none, if the class is gone).
//!
//! Over budget, a request waits in its class queue (FIFO, round-robin across tenants) up to the class's
//! `max_wait`, then gets a 429. The queue is bounded in requests and tokens, and in tenants: past
//! `max_tenant_queues` distinct tenants, further ones share one overflow queue. Each class consumes only its own
//! bucket (unless it may borrow an idle one).

pub mod bucket;
pub mod classes;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

pub use bucket::TokenBucket;
pub use classes::{classify, default_classes, ClassConfig, ClassInput, MatchRule, CLASS_HEADER};

/// The queue tenants share once a class has `max_tenant_queues` of them.
pub const OVERFLOW_TENANT: &str = "\u{0}overflow";

/// Why a request was not admitted.
#[derive(Clone, Debug, PartialEq)]
pub enum Rejection {
    /// The class queue is full (requests or tokens).
    QueueFull { class: String, retry_after_s: u32 },
    /// Waited `max_wait` without budget.
    Timeout { class: String, retry_after_s: u32 },
}

struct Waiter {
    id: u64,
    cost: f64,
    /// Receives the name of the class whose bucket paid.
    tx: oneshot::Sender<String>,
}

struct ClassState {
    cfg: ClassConfig,
    bucket: TokenBucket,
    /// Tenants in round-robin order, each with its FIFO of waiters.
    queues: VecDeque<(String, VecDeque<Waiter>)>,
    queued_requests: usize,
    queued_tokens: f64,
}

impl ClassState {
    fn new(cfg: ClassConfig, now: std::time::Instant) -> Self {
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

    fn pop_head(&mut self) -> Option<Waiter> {
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

    fn remove(&mut self, id: u64) {
        for (_, q) in &mut self.queues {
            if let Some(pos) = q.iter().position(|w| w.id == id) {
                if let Some(w) = q.remove(pos) {
                    self.queued_requests -= 1;
                    self.queued_tokens -= w.cost;
                }
            }
        }
        self.queues.retain(|(_, q)| !q.is_empty());
    }
}

struct Inner {
    classes: Vec<ClassState>,
    next_id: u64,
}

impl Inner {
    /// Takes `cost` for class `i` from its own bucket, or, if the class may borrow, from an idle class (empty
    /// queue, full bucket). Returns the index of the class that paid (valid while the lock is held).
    fn take(&mut self, i: usize, cost: f64, now: std::time::Instant) -> Option<usize> {
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
}

/// The admission controller (cheap to clone).
#[derive(Clone)]
pub struct Admission {
    inner: Arc<Mutex<Inner>>,
    wake: Arc<Notify>,
    pump: Arc<std::sync::OnceLock<()>>,
}

/// An admitted request's reservation. Dropped without [`Permit::reconcile`], it refunds its whole charge.
#[derive(Debug)]
pub struct Permit {
    admission: Admission,
    /// The class whose bucket paid (its own, or an idle one it borrowed from), by name.
    payer: String,
    charged: f64,
    settled: bool,
    pub class_name: String,
    pub waited: Duration,
}

impl Permit {
    /// Settles the reservation with the real cost (refund if lower, further charge if higher).
    pub fn reconcile(mut self, actual_cost: f64) {
        self.settle(actual_cost);
    }

    /// Tokens reserved.
    pub fn charged(&self) -> f64 {
        self.charged
    }

    fn settle(&mut self, actual_cost: f64) {
        if std::mem::replace(&mut self.settled, true) {
            return;
        }
        let delta = self.charged - actual_cost;
        let mut inner = self.admission.lock();
        if let Some(c) = inner.classes.iter_mut().find(|c| c.cfg.name == self.payer) {
            c.bucket.adjust(delta, Instant::now().into_std());
        }
        drop(inner);
        metrics::counter!("kvgate_gateway_class_tokens_charged_total", "class" => self.class_name.clone())
            .increment(actual_cost.max(0.0) as u64);
        self.admission.wake.notify_one();
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.settled {
            metrics::counter!("kvgate_gateway_class_refunds_total", "class" => self.class_name.clone())
                .increment(1);
            self.settle(0.0);
        }
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission").field("classes", &self.lock().classes.len()).finish()
    }
}

impl Admission {
    /// A controller over `classes`. Its pump starts on the tokio runtime of the first `admit`.
    pub fn new(classes: Vec<ClassConfig>) -> Self {
        let now = Instant::now().into_std();
        let classes = classes.into_iter().map(|cfg| ClassState::new(cfg, now)).collect();
        Self {
            inner: Arc::new(Mutex::new(Inner { classes, next_id: 0 })),
            wake: Arc::new(Notify::new()),
            pump: Arc::new(std::sync::OnceLock::new()),
        }
    }

    fn ensure_pump(&self) {
        self.pump.get_or_init(|| {
            tokio::spawn(self.clone().pump());
        });
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The class configs.
    pub fn classes(&self) -> Vec<ClassConfig> {
        self.lock().classes.iter().map(|c| c.cfg.clone()).collect()
    }

    /// Replaces the class set live; waiters of removed classes are released to their timeout.
    pub fn set_classes(&self, classes: Vec<ClassConfig>) {
        let now = Instant::now().into_std();
        let mut inner = self.lock();
        let mut old: Vec<ClassState> = std::mem::take(&mut inner.classes);
        inner.classes = classes
            .into_iter()
            .map(|cfg| match old.iter().position(|o| o.cfg.name == cfg.name) {
                Some(i) => {
                    let mut s = old.swap_remove(i);
                    s.bucket.reconfigure(cfg.refill_tokens_per_s, cfg.burst_tokens, now);
                    s.cfg = cfg;
                    s
                }
                None => ClassState::new(cfg, now),
            })
            .collect();
        drop(inner);
        self.wake.notify_one();
    }

    /// Picks the class of a request by the server's rules: (index, name, expected output tokens).
    pub fn classify(&self, input: &ClassInput<'_>) -> (usize, String, u64) {
        let inner = self.lock();
        let i = classes::classify_by(inner.classes.iter().map(|c| &c.cfg), input);
        match inner.classes.get(i) {
            Some(c) => (i, c.cfg.name.clone(), c.cfg.expected_output_tokens),
            None => (0, "none".into(), 0),
        }
    }

    /// The class named `name`, for a caller trusted to choose it: (index, name, expected output tokens).
    pub fn class_by_name(&self, name: &str) -> Option<(usize, String, u64)> {
        let inner = self.lock();
        let i = inner.classes.iter().position(|c| c.cfg.name == name)?;
        let c = &inner.classes[i].cfg;
        Some((i, c.name.clone(), c.expected_output_tokens))
    }

    /// Admits a request of `cost` tokens into class `class`, waiting if its budget is spent.
    pub async fn admit(&self, class: usize, tenant: Option<&str>, cost: f64) -> Result<Permit, Rejection> {
        self.ensure_pump();
        let started = Instant::now();
        let (rx, id, name, max_wait) = {
            let mut inner = self.lock();
            let id = inner.next_id;
            inner.next_id += 1;
            if class >= inner.classes.len() {
                return Err(Rejection::QueueFull { class: "unknown".into(), retry_after_s: 1 });
            }
            let now = started.into_std();
            let name = inner.classes[class].cfg.name.clone();
            // Nobody waiting and budget available: admit at once.
            if inner.classes[class].queued_requests == 0 {
                if let Some(payer) = inner.take(class, cost, now) {
                    metrics::counter!("kvgate_gateway_class_admitted_total", "class" => name.clone())
                        .increment(1);
                    metrics::histogram!("kvgate_gateway_class_wait_seconds", "class" => name.clone())
                        .record(0.0);
                    return Ok(Permit {
                        admission: self.clone(),
                        payer: inner.classes[payer].cfg.name.clone(),
                        charged: cost,
                        settled: false,
                        class_name: name,
                        waited: Duration::ZERO,
                    });
                }
            }
            let c = &mut inner.classes[class];
            if c.queued_requests + 1 > c.cfg.max_queued_requests
                || c.queued_tokens + cost > c.cfg.max_queued_tokens.max(cost.min(c.cfg.burst_tokens))
            {
                metrics::counter!("kvgate_gateway_class_rejected_total", "class" => name.clone(), "reason" => "queue_full")
                    .increment(1);
                let retry = retry_after(&mut c.bucket, cost, now);
                return Err(Rejection::QueueFull { class: name, retry_after_s: retry });
            }
            let (tx, rx) = oneshot::channel();
            let mut tenant = tenant.unwrap_or("");
            if c.queues.len() >= c.cfg.max_tenant_queues && !c.queues.iter().any(|(t, _)| t == tenant) {
                metrics::counter!("kvgate_gateway_class_tenant_overflow_total", "class" => name.clone())
                    .increment(1);
                tenant = OVERFLOW_TENANT;
            }
            match c.queues.iter_mut().find(|(t, _)| t == tenant) {
                Some((_, q)) => q.push_back(Waiter { id, cost, tx }),
                None => c.queues.push_back((tenant.to_owned(), VecDeque::from([Waiter { id, cost, tx }]))),
            }
            c.queued_requests += 1;
            c.queued_tokens += cost;
            metrics::counter!("kvgate_gateway_class_queued_total", "class" => name.clone()).increment(1);
            (rx, id, name, Duration::from_millis(c.cfg.max_wait_ms))
        };
        self.wake.notify_one();
        let mut waiting = Queued { admission: self, id, cost, rx, served: false };
        match tokio::time::timeout(max_wait, &mut waiting.rx).await {
            Ok(Ok(payer)) => {
                waiting.served = true;
                let waited = started.elapsed();
                metrics::counter!("kvgate_gateway_class_admitted_total", "class" => name.clone())
                    .increment(1);
                metrics::histogram!("kvgate_gateway_class_wait_seconds", "class" => name.clone())
                    .record(waited.as_secs_f64());
                Ok(Permit {
                    admission: self.clone(),
                    payer,
                    charged: cost,
                    settled: false,
                    class_name: name,
                    waited,
                })
            }
            _ => {
                drop(waiting);
                let mut inner = self.lock();
                let now = Instant::now().into_std();
                let retry = match inner.classes.iter_mut().find(|c| c.cfg.name == name) {
                    Some(c) => retry_after(&mut c.bucket, cost, now),
                    None => 1,
                };
                metrics::counter!("kvgate_gateway_class_rejected_total", "class" => name.clone(), "reason" => "timeout")
                    .increment(1);
                Err(Rejection::Timeout { class: name, retry_after_s: retry })
            }
        }
    }

    /// Serves waiters as budgets refill; sleeps until the next head can be served or something changes.
    async fn pump(self) {
        loop {
            let next = {
                let mut inner = self.lock();
                let now = Instant::now().into_std();
                let mut next: Option<Duration> = None;
                for i in 0..inner.classes.len() {
                    while let Some(cost) = inner.classes[i].head_cost() {
                        if let Some(payer) = inner.take(i, cost, now) {
                            if let Some(w) = inner.classes[i].pop_head() {
                                if w.tx.send(inner.classes[payer].cfg.name.clone()).is_err() {
                                    // The waiter timed out meanwhile: give its tokens back.
                                    inner.classes[payer].bucket.adjust(w.cost, now);
                                }
                            }
                        } else {
                            if let Some(d) = inner.classes[i].bucket.wait_for(cost, now) {
                                next = Some(next.map_or(d, |n| n.min(d)));
                            }
                            break;
                        }
                    }
                    let c = &mut inner.classes[i];
                    metrics::gauge!("kvgate_gateway_class_bucket_tokens", "class" => c.cfg.name.clone())
                        .set(c.bucket.level(now));
                    metrics::gauge!("kvgate_gateway_class_queued_requests", "class" => c.cfg.name.clone())
                        .set(c.queued_requests as f64);
                }
                next
            };
            let sleep = next.unwrap_or(Duration::from_secs(3600)).max(Duration::from_micros(100));
            tokio::select! {
                _ = tokio::time::sleep(sleep) => {}
                _ = self.wake.notified() => {}
            }
        }
    }
}

/// A request waiting in a class queue. If its `admit` future ends without being served (it timed out, or it was
/// dropped because the client went away), its waiter leaves the queue at once (a dead waiter must not hold a queue
/// slot), and a payment the pump made in the meantime goes back to the class that paid.
struct Queued<'a> {
    admission: &'a Admission,
    id: u64,
    cost: f64,
    rx: oneshot::Receiver<String>,
    served: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.served {
            return;
        }
        let mut inner = self.admission.lock();
        for c in &mut inner.classes {
            c.remove(self.id);
        }
        if let Ok(payer) = self.rx.try_recv() {
            let now = Instant::now().into_std();
            if let Some(c) = inner.classes.iter_mut().find(|c| c.cfg.name == payer) {
                c.bucket.adjust(self.cost, now);
            }
        }
        drop(inner);
        self.admission.wake.notify_one();
    }
}

fn retry_after(bucket: &mut TokenBucket, cost: f64, now: std::time::Instant) -> u32 {
    bucket.wait_for(cost, now).map_or(60, |d| d.as_secs_f64().ceil().clamp(1.0, 3600.0) as u32)
}

#[cfg(test)]
mod tests;
