//! Admission in virtual time, for the simulator: the gateway's own admission state machine (`queue.rs`: buckets,
//! tenant-fair queues, borrowing, queue limits) driven by the caller's clock instead of tokio timers. The caller
//! serves waiters when [`VirtualAdmission::serve`] says the next one can go, expires them at their deadline, and
//! settles each admitted request with its real cost, as the gateway's `Permit` does.

use std::collections::HashMap;
use std::time::Instant;

use super::queue::{Offer, Queues};
use super::{ClassConfig, ClassInput, Rejection};

/// What became of a request offered to [`VirtualAdmission::offer`].
#[derive(Clone, Debug, PartialEq)]
pub enum VirtualOffer {
    /// Admitted now; `payer` is the class whose bucket paid (settle with it).
    Admitted {
        payer: String,
    },
    /// Waiting; refused with a timeout unless served before `deadline`.
    Queued {
        deadline: Instant,
    },
    Refused(Rejection),
}

/// Per-class budgets and queues of one simulated gateway.
pub struct VirtualAdmission {
    queues: Queues<u64>,
    /// Request id -> (waiter id, class name, cost) while it waits.
    waiting: HashMap<u64, (u64, String, f64)>,
}

impl VirtualAdmission {
    pub fn new(classes: Vec<ClassConfig>, now: Instant) -> Self {
        Self { queues: Queues::new(classes, now), waiting: HashMap::new() }
    }

    /// The class of a request by the server's rules: (index, name, expected output tokens).
    pub fn classify(&self, input: &ClassInput<'_>) -> (usize, String, u64) {
        self.queues.classify(input)
    }

    /// Offers request `request` of `cost` tokens to class `class`.
    pub fn offer(
        &mut self,
        class: usize,
        tenant: Option<&str>,
        cost: f64,
        request: u64,
        now: Instant,
    ) -> VirtualOffer {
        match self.queues.offer(class, tenant, cost, now, request) {
            Offer::Admitted { payer } => VirtualOffer::Admitted { payer },
            Offer::Refused(r) => VirtualOffer::Refused(r),
            Offer::Queued { id, max_wait } => {
                let name = self.queues.classes[class].cfg.name.clone();
                self.waiting.insert(request, (id, name, cost));
                VirtualOffer::Queued { deadline: now + max_wait }
            }
        }
    }

    /// Serves the waiters the budgets allow at `now`: `(request, payer)` for each, in service order; and when the
    /// next waiter could be served (`None`: nobody waits or no refill will ever serve the head).
    pub fn serve(&mut self, now: Instant) -> (Vec<(u64, String)>, Option<Instant>) {
        let mut served = Vec::new();
        let next = self.queues.serve(now, |request, payer| {
            served.push((request, payer.to_owned()));
            true
        });
        for (r, _) in &served {
            self.waiting.remove(r);
        }
        (served, next.map(|d| now + d))
    }

    /// Request `request` reached its deadline still waiting: it leaves the queue, refused with a timeout. `None`
    /// if it is not waiting (already served).
    pub fn expire(&mut self, request: u64, now: Instant) -> Option<Rejection> {
        let (id, class, cost) = self.waiting.remove(&request)?;
        self.queues.remove(id);
        let retry_after_s = self.queues.retry_after(&class, cost, now);
        Some(Rejection::Timeout { class, retry_after_s })
    }

    /// Settles an admitted request: refunds `charged - actual` to `payer` (charges more if negative).
    pub fn settle(&mut self, payer: &str, charged: f64, actual: f64, now: Instant) {
        self.queues.adjust(payer, charged - actual, now);
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The admission tests' class, with a queue of two.
    fn class(name: &str, rate: f64, burst: f64, max_wait_ms: u64) -> ClassConfig {
        ClassConfig {
            max_queued_requests: 2,
            ..crate::admission::tests::class(name, rate, burst, max_wait_ms)
        }
    }

    #[test]
    fn waits_for_the_refill_then_times_out_in_virtual_time() {
        let t0 = Instant::now();
        let mut a = VirtualAdmission::new(vec![class("c", 100.0, 100.0, 2_000)], t0);
        assert_eq!(a.offer(0, None, 100.0, 1, t0), VirtualOffer::Admitted { payer: "c".into() });
        // 50 tokens more: served after 0.5 s of refill.
        let VirtualOffer::Queued { deadline } = a.offer(0, None, 50.0, 2, t0) else { panic!("queued") };
        assert_eq!(deadline, t0 + Duration::from_secs(2));
        // 500 tokens behind it: more than the 100-token bucket ever holds.
        assert!(matches!(a.offer(0, None, 500.0, 3, t0), VirtualOffer::Queued { .. }));
        // The queue holds two: a fourth is refused at once.
        assert!(matches!(a.offer(0, None, 1.0, 4, t0), VirtualOffer::Refused(Rejection::QueueFull { .. })));
        let (served, next) = a.serve(t0);
        assert!(served.is_empty());
        let next = next.expect("the head can be served later");
        assert!((next - t0).as_secs_f64() > 0.49 && (next - t0).as_secs_f64() < 0.51, "{:?}", next - t0);
        let (served, _) = a.serve(next);
        assert_eq!(served, vec![(2, "c".to_owned())]);
        assert_eq!(a.waiting(), 1);
        assert!(matches!(a.expire(3, deadline), Some(Rejection::Timeout { .. })));
        assert_eq!(a.expire(2, deadline), None, "served requests do not expire");
        assert_eq!(a.waiting(), 0);
    }

    #[test]
    fn settling_refunds_what_a_cache_hit_saved() {
        let t0 = Instant::now();
        let mut a = VirtualAdmission::new(vec![class("c", 1.0, 1_000.0, 10_000)], t0);
        assert!(matches!(a.offer(0, None, 1_000.0, 1, t0), VirtualOffer::Admitted { .. }));
        assert!(matches!(a.offer(0, None, 600.0, 2, t0), VirtualOffer::Queued { .. }));
        // The first one cost 400 (a cache hit): 600 come back and the waiter is served at once.
        a.settle("c", 1_000.0, 400.0, t0);
        assert_eq!(a.serve(t0).0, vec![(2, "c".to_owned())]);
    }
}
