//! Admission control: per-class token budgets so one class (a burst of million-token requests) cannot consume
//! another's share.
//!
//! A request's cost is its predicted uncached prompt tokens (a cache hit costs less) plus its `max_tokens` (or the
//! class's expected output). It is reserved at admission and reconciled with the real usage when the request ends
//! ([`Permit::reconcile`]); a permit dropped without being reconciled (an error answer, a failed or timed-out
//! upstream, a client that went away) gives its whole charge back. What is settled is counted per class
//! (`kvgate_gateway_class_tokens_charged_total`) and per class and tenant
//! (`kvgate_gateway_tenant_tokens_charged_total`: tenants are the configured keys' and `anonymous`, so the series
//! are bounded by the key file); permits not yet settled are `kvgate_gateway_admission_permits_held{class}`, which
//! is 0 at rest. A permit names its class, not an index, so a
//! refund after the class set was replaced reaches the right bucket (or none, if the class is gone).
//!
//! Over budget, a request waits in its class queue (FIFO, round-robin across tenants) up to the class's
//! `max_wait`, then gets a 429. The queue is bounded in requests and tokens, and in tenants: past
//! `max_tenant_queues` distinct tenants, further ones share one overflow queue. Each class consumes only its own
//! bucket (unless it may borrow an idle one).

pub mod bucket;
pub mod classes;
mod queue;
mod virtual_time;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

pub use bucket::TokenBucket;
pub use classes::{classify, default_classes, ClassConfig, ClassInput, MatchRule, CLASS_HEADER};
pub use virtual_time::{VirtualAdmission, VirtualOffer};

use queue::{Offer, Queues};

/// The tenant of a request admitted without one (the charged-tokens series' label).
pub const ANONYMOUS: &str = "anonymous";

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

/// One class's budget as seen by the replica: what a lease decision needs (`gateway/src/replicas/budgets.rs`).
#[derive(Clone, Debug, PartialEq)]
pub struct ClassBudget {
    pub name: String,
    /// Configured refill, tokens/s (before any rate scale).
    pub rate: f64,
    pub burst: f64,
    /// Tokens in the local bucket now (negative: debt).
    pub level: f64,
    /// Tokens of the requests waiting in the class queue.
    pub queued_tokens: f64,
    /// Cost of the request at the head of the queue (0: none).
    pub head_cost: f64,
}

/// The admission controller (cheap to clone).
#[derive(Clone)]
pub struct Admission {
    inner: Arc<Mutex<Queues<oneshot::Sender<String>>>>,
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
    /// The tenant it was admitted for (the charged-tokens series' label).
    tenant: String,
    pub waited: Duration,
}

/// Gauge of the permits admitted and not yet settled, per class.
const PERMITS_HELD: &str = "kvgate_gateway_admission_permits_held";

impl Permit {
    fn new(
        admission: &Admission,
        payer: String,
        cost: f64,
        class_name: String,
        tenant: Option<&str>,
        waited: Duration,
    ) -> Self {
        metrics::gauge!(PERMITS_HELD, "class" => class_name.clone()).increment(1.0);
        Permit {
            admission: admission.clone(),
            payer,
            charged: cost,
            settled: false,
            class_name,
            tenant: tenant.unwrap_or(ANONYMOUS).to_owned(),
            waited,
        }
    }

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
        self.admission.lock().adjust(&self.payer, self.charged - actual_cost, Instant::now().into_std());
        let tokens = actual_cost.max(0.0) as u64;
        metrics::counter!("kvgate_gateway_class_tokens_charged_total", "class" => self.class_name.clone())
            .increment(tokens);
        metrics::counter!("kvgate_gateway_tenant_tokens_charged_total", "class" => self.class_name.clone(),
            "tenant" => self.tenant.clone())
        .increment(tokens);
        metrics::gauge!(PERMITS_HELD, "class" => self.class_name.clone()).decrement(1.0);
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
        Self {
            inner: Arc::new(Mutex::new(Queues::new(classes, Instant::now().into_std()))),
            wake: Arc::new(Notify::new()),
            pump: Arc::new(std::sync::OnceLock::new()),
        }
    }

    fn ensure_pump(&self) {
        self.pump.get_or_init(|| {
            tokio::spawn(self.clone().pump());
        });
    }

    fn lock(&self) -> MutexGuard<'_, Queues<oneshot::Sender<String>>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The class configs.
    pub fn classes(&self) -> Vec<ClassConfig> {
        self.lock().classes.iter().map(|c| c.cfg.clone()).collect()
    }

    /// Replaces the class set live; waiters of removed classes are released to their timeout.
    pub fn set_classes(&self, classes: Vec<ClassConfig>) {
        let released = self.lock().set_classes(classes, Instant::now().into_std());
        // Their senders dropped: those `admit` calls end with a timeout rejection at once.
        drop(released);
        self.wake.notify_one();
    }

    /// Scales every class's refill rate (`Queues::set_rate_scale`): 0 while budgets are leased from Redis.
    pub fn set_rate_scale(&self, scale: f64) {
        self.lock().set_rate_scale(scale, Instant::now().into_std());
        self.wake.notify_one();
    }

    /// Adds leased tokens to a class's bucket (negative: gives them up); waiters are served at once.
    pub fn credit(&self, class: &str, tokens: f64) {
        self.lock().credit(class, tokens, Instant::now().into_std());
        if tokens > 0.0 {
            self.wake.notify_one();
        }
    }

    /// Every class's budget now.
    pub fn budgets(&self) -> Vec<ClassBudget> {
        self.lock().budgets(Instant::now().into_std())
    }

    /// Picks the class of a request by the server's rules: (index, name, expected output tokens).
    pub fn classify(&self, input: &ClassInput<'_>) -> (usize, String, u64) {
        self.lock().classify(input)
    }

    /// The class named `name`, for a caller trusted to choose it: (index, name, expected output tokens).
    pub fn class_by_name(&self, name: &str) -> Option<(usize, String, u64)> {
        let inner = self.lock();
        let i = inner.classes.iter().position(|c| c.cfg.name == name)?;
        let c = &inner.classes[i].cfg;
        Some((i, c.name.clone(), c.expected_output_tokens))
    }

    /// The SLOs of class `class` (the default's when there is no such class).
    pub fn class_slo(&self, class: usize) -> crate::routing::Slo {
        self.lock().classes.get(class).map(|c| c.cfg.slo).unwrap_or_default()
    }

    /// Admits a request of `cost` tokens into class `class`, waiting if its budget is spent.
    pub async fn admit(&self, class: usize, tenant: Option<&str>, cost: f64) -> Result<Permit, Rejection> {
        self.ensure_pump();
        let started = Instant::now();
        let (tx, rx) = oneshot::channel();
        let (id, name, max_wait) = {
            let mut inner = self.lock();
            let name = inner.classes.get(class).map_or_else(|| "unknown".to_owned(), |c| c.cfg.name.clone());
            match inner.offer(class, tenant, cost, started.into_std(), tx) {
                Offer::Admitted { payer } => {
                    metrics::histogram!("kvgate_gateway_class_wait_seconds", "class" => name.clone())
                        .record(0.0);
                    return Ok(Permit::new(self, payer, cost, name, tenant, Duration::ZERO));
                }
                Offer::Refused(r) => return Err(r),
                Offer::Queued { id, max_wait } => (id, name, max_wait),
            }
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
                Ok(Permit::new(self, payer, cost, name, tenant, waited))
            }
            _ => {
                drop(waiting);
                let retry = self.lock().retry_after(&name, cost, Instant::now().into_std());
                metrics::counter!("kvgate_gateway_class_rejected_total", "class" => name.clone(), "reason" => "timeout")
                    .increment(1);
                Err(Rejection::Timeout { class: name, retry_after_s: retry })
            }
        }
    }

    /// Serves waiters as budgets refill; sleeps until the next head can be served or something changes.
    async fn pump(self) {
        loop {
            let next =
                self.lock().serve(Instant::now().into_std(), |tx, payer| tx.send(payer.to_owned()).is_ok());
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
        inner.remove(self.id);
        if let Ok(payer) = self.rx.try_recv() {
            // Served by the pump while this future was ending: give the payment back.
            inner.adjust(&payer, self.cost, Instant::now().into_std());
        }
        drop(inner);
        self.admission.wake.notify_one();
    }
}

#[cfg(test)]
mod tests;
