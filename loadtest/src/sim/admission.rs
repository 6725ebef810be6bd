//! The gateway's admission classes in the simulated fleet: the router crate's [`VirtualAdmission`] (the gateway's
//! own buckets and tenant-fair queues) plus what the event loop needs around it: the requests waiting with their
//! prepared prompts, their deadlines, and when the next waiter can be served. Virtual seconds in, virtual seconds
//! out.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use kvgate_router::admission::{ClassConfig, ClassInput, VirtualAdmission, VirtualOffer};
use kvgate_router::routing::RingKey;
use kvgate_shared::hashing::BlockHash;

/// A request prepared for routing (the gateway's view), kept while it waits for its class budget.
pub struct Ready {
    pub request: usize,
    pub arrival: f64,
    pub tokens: Vec<u32>,
    pub hashes: Vec<BlockHash>,
    pub ring: RingKey,
    pub max_tokens: u32,
    pub class: String,
    /// Tokens reserved at admission (predicted uncached prompt + output).
    pub cost: f64,
}

/// An admitted request's reservation, settled with its real cost when it finishes.
#[derive(Clone, Debug)]
pub struct Reservation {
    pub payer: String,
    pub charged: f64,
}

/// What one [`SimAdmission::pump`] did.
pub struct Pumped {
    /// Admitted now, in service order.
    pub served: Vec<(Ready, Reservation)>,
    /// Waited `max_wait` without budget: refused.
    pub timed_out: Vec<Ready>,
}

/// What became of an offered request.
pub enum Admitted {
    Now(Ready, Reservation),
    Waiting,
    /// The class queue is full.
    Refused,
}

pub struct SimAdmission {
    admission: VirtualAdmission,
    base: Instant,
    waiting: HashMap<usize, Ready>,
    /// (deadline in µs of virtual time, request).
    deadlines: BTreeSet<(u64, usize)>,
    /// When the head of some queue can next be served (virtual seconds).
    next_serve: Option<f64>,
}

impl SimAdmission {
    pub fn new(classes: Vec<ClassConfig>, base: Instant) -> Self {
        Self {
            admission: VirtualAdmission::new(classes, base),
            base,
            waiting: HashMap::new(),
            deadlines: BTreeSet::new(),
            next_serve: None,
        }
    }

    fn instant(&self, t: f64) -> Instant {
        self.base + Duration::from_secs_f64(t.max(0.0))
    }

    /// The class a request falls in (the gateway's rules): its name and index.
    pub fn classify(&self, prompt_tokens: usize, max_tokens: u32, model: &str) -> (usize, String) {
        let input = ClassInput {
            prompt_tokens: prompt_tokens as u64,
            max_tokens: Some(u64::from(max_tokens)),
            model,
            reasoning: false,
        };
        let (i, name, _) = self.admission.classify(&input);
        (i, name)
    }

    /// Offers a prepared request to class `class` at virtual time `t`.
    pub fn offer(&mut self, class: usize, ready: Ready, t: f64) -> Admitted {
        let now = self.instant(t);
        match self.admission.offer(class, None, ready.cost, ready.request as u64, now) {
            VirtualOffer::Admitted { payer } => {
                let charged = ready.cost;
                Admitted::Now(ready, Reservation { payer, charged })
            }
            VirtualOffer::Refused(_) => Admitted::Refused,
            VirtualOffer::Queued { deadline } => {
                let at = (deadline - self.base).as_micros() as u64;
                self.deadlines.insert((at, ready.request));
                self.waiting.insert(ready.request, ready);
                Admitted::Waiting
            }
        }
    }

    /// The next admission event: serving a queue head or a deadline, whichever is first.
    pub fn next_event(&self) -> f64 {
        let deadline = self.deadlines.first().map_or(f64::INFINITY, |(us, _)| *us as f64 / 1e6);
        self.next_serve.unwrap_or(f64::INFINITY).min(deadline)
    }

    /// Serves the waiters the budgets allow at `t` (with their reservations), refuses the ones whose deadline
    /// passed, and notes when the next waiter can be served. Call after an offer that queued, after a settle,
    /// and at [`Self::next_event`].
    pub fn pump(&mut self, t: f64) -> Pumped {
        let now = self.instant(t);
        let (served, next) = self.admission.serve(now);
        let served: Vec<(Ready, Reservation)> = served
            .into_iter()
            .filter_map(|(request, payer)| {
                let ready = self.waiting.remove(&(request as usize))?;
                let charged = ready.cost;
                Some((ready, Reservation { payer, charged }))
            })
            .collect();
        let now_us = (now - self.base).as_micros() as u64;
        let mut expired = Vec::new();
        while let Some(&(at, request)) = self.deadlines.first() {
            if at > now_us {
                break;
            }
            self.deadlines.pop_first();
            if let (Some(_timeout), Some(ready)) =
                (self.admission.expire(request as u64, now), self.waiting.remove(&request))
            {
                expired.push(ready);
            }
        }
        self.deadlines.retain(|(_, r)| self.waiting.contains_key(r));
        // An expiry can unblock the next head at once; otherwise the refill decides.
        self.next_serve = if self.waiting.is_empty() {
            None
        } else if expired.is_empty() {
            // At least 100 µs ahead, as the gateway's pump sleeps: a refill rounding short cannot spin the loop.
            next.map(|n| (n - self.base).as_secs_f64().max(t + 1e-4))
        } else {
            Some(t)
        };
        Pumped { served, timed_out: expired }
    }

    /// Settles a finished request's reservation with its real cost at `t` (then [`Self::pump`]).
    pub fn settle(&mut self, r: &Reservation, actual: f64, t: f64) {
        let now = self.instant(t);
        self.admission.settle(&r.payer, r.charged, actual, now);
    }

    /// Requests waiting for their class budget.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}
