//! What a request is charged, and the code that settles each attempt's outcome by those rules: the permit
//! reconciled, the worker's faults recorded, what the answer teaches kept.
//!
//! A request reserves its price at admission (`exchange::price`). It is then charged what the workers computed for
//! it:
//! - a completed response: its `usage` (uncached prompt + completion tokens; a response without usage: the price);
//! - a stream that ended early (the client left, the worker failed or went silent): the uncached prompt (the
//!   prefill ran) plus every completion token sent, counted from the stream (`meter.rs`); a whole answer whose
//!   client left mid-body: its price (it was computed before it was sent);
//! - a request a worker accepted but that never answered: on the first-byte timeout, and for a stream whose
//!   client left before the first token, the uncached prompt (the gateway cannot see whether prefill began, so it
//!   assumes it did); a whole (not streamed) answer whose client left: its price (it may have been all but done);
//! - a fallback worker's uncached prompt is its own prefix match's, at the fallback (`Router::record_fallback`);
//! - a pod's usage is believed up to the prompt plus the output the request may have (`Priced::cap`): the output
//!   of every choice a request asks for (`n`, `best_of`), each at most its `max_tokens` (else the model's context);
//! - a completed answer teaches its class's output length per choice, never past what one choice may have;
//! - what an endpoint picker's proxy reports (`epp/follow.rs`) is the proxy's word, not the gateway's own sight:
//!   its timeouts and stalls charge as above but mark no pod faulted (a stream held silent must not take a pod out
//!   of every client's rotation);
//! - refunded in full only when no worker computed anything: refusals, connection failures, error answers, and
//!   every refusal before a worker was tried (admission, validation, no worker).
//!
//! Streams are asked for their usage (`stream_options.include_usage`) even when the client did not ask, so even a
//! pod that does not report is charged its real output; the usage chunk is then taken out of what the client sees.
//! A request routed by load (not tokenized here) is priced from its body's size; its usage settles it the same way.

use std::time::{Duration, Instant};

use kvgate_router::route::Candidate;

use crate::admission::Permit;
use crate::errors::{ApiError, GatewayErrors};
use crate::registry::Fault;
use crate::serve::host::ServeHost;
use crate::serve::meter::UsageSeen;
use crate::serve::prepare::PreparedRequest;
use crate::serve::stages::{Ctx, Prepared, Priced, CLIENT_CLOSED};
use crate::serve::upstream::Outcome;

/// What a request that a worker answered with a 2xx is charged (module docs): its `usage` when the response carried
/// one; else a `completed` response the `price` reserved, and one cut short the predicted `uncached` prompt plus the
/// completion tokens it `sent`.
///
/// What a pod says is bounded by `cap` (the prompt plus the output the request may have: a pod's numbers are input
/// like any other, and an absurd usage must not put the class in debt for ever).
pub fn charge(
    price: f64,
    uncached: u64,
    usage: Option<UsageSeen>,
    sent: u64,
    completed: bool,
    cap: u64,
) -> f64 {
    let sent = sent.min(cap);
    let tokens = match usage {
        Some(u) => u.prompt.saturating_sub(u.cached).saturating_add(u.completion.max(sent)),
        None if completed => return price,
        None => uncached.saturating_add(sent),
    };
    tokens.min(cap) as f64
}

/// Longest silence between two logged prompt-length mismatches (`kvgate_gateway_prompt_token_mismatches_total`
/// counts every one).
pub const MISMATCH_LOG_EVERY: Duration = Duration::from_secs(60);

/// The prompt the gateway tokenized against the prompt tokens the worker says it computed: a difference means the
/// gateway's chat template or tokenizer drifted from the pod's, and so its block hashes (a template change on the
/// pods, a tokenizer directory that is not theirs). Counted per model; logged at most every [`MISMATCH_LOG_EVERY`].
fn check_prompt_length(p: &PreparedRequest, usage: &UsageSeen, worker: &str) {
    if !p.tokenized || usage.prompt == p.ids.len() as u64 {
        return;
    }
    metrics::counter!("kvgate_gateway_prompt_token_mismatches_total", "model" => p.fields.model.clone())
        .increment(1);
    static LAST_LOG: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
    let mut last = LAST_LOG.lock().unwrap_or_else(|e| e.into_inner());
    if last.is_none_or(|t| t.elapsed() >= MISMATCH_LOG_EVERY) {
        *last = Some(Instant::now());
        tracing::warn!(model = %p.fields.model, %worker, gateway = p.ids.len(), worker_reported = usage.prompt,
            "prompt token count differs from the worker's: the gateway's chat template or tokenizer is not the pod's");
    }
}

/// One attempt's answer, to settle.
pub struct Settle<'a> {
    pub host: &'a dyn ServeHost,
    pub prep: &'a Prepared,
    pub priced: &'a Priced<'a>,
    pub t: &'a Candidate,
    /// This attempt's uncached prompt tokens (its own prefix match's).
    pub uncached: u64,
    pub first_byte: Duration,
    /// The cached tokens the decision predicted.
    pub predicted: usize,
    /// `t` is known to be the worker that served (an endpoint picker's proxy may report one the gateway did not
    /// rank: then no worker's index is credited).
    pub served_known: bool,
    /// The outcome is what an endpoint picker's proxy reported, not what the gateway saw: it faults no worker.
    pub proxied: bool,
}

impl Settle<'_> {
    /// `Some`: the request is over (the permit taken); `None`: try the next candidate (the permit kept).
    pub fn settle(
        &self,
        ctx: &mut Ctx,
        outcome: Outcome,
        permit: &mut Option<Permit>,
        refused_for: &mut Option<Duration>,
    ) -> Option<Result<(), ApiError>> {
        let (t, priced) = (self.t, self.priced);
        match outcome {
            Outcome::Responded { status, usage, tokens_sent, whole, completed, stalled } => {
                ctx.status = status;
                if stalled {
                    self.fault(Fault::Timeout);
                }
                self.usage_seen(usage.as_ref());
                let permit = permit.take()?;
                if (200..300).contains(&status) {
                    self.served(usage.as_ref(), completed);
                    // A whole (not streamed) answer was computed before it was sent, however it ended.
                    let computed = completed || whole;
                    permit.reconcile(charge(
                        priced.cost,
                        self.uncached,
                        usage,
                        tokens_sent,
                        computed,
                        priced.cap,
                    ));
                    if !completed {
                        self.partial();
                    }
                }
                // An error answer drops the permit: a full refund (the worker computed nothing).
                Some(Ok(()))
            }
            Outcome::ConnectFailed(e) => {
                tracing::warn!(worker = %t.id, error = %e, "no response; trying the next worker");
                self.host.registry().record_fault(t.wref, Fault::Refused, Instant::now());
                None
            }
            Outcome::Refused { code, retry_after } => {
                tracing::info!(worker = %t.id, %code, ?retry_after, "worker refused; trying the next worker");
                self.host.registry().record_busy(t.wref, Instant::now() + retry_after);
                *refused_for = Some(refused_for.map_or(retry_after, |r| r.min(retry_after)));
                None
            }
            Outcome::TimedOut => {
                tracing::warn!(worker = %t.id, after = ?self.first_byte, proxied = self.proxied,
                    "first-byte timeout: worker suspect (unless a proxy reported it)");
                self.fault(Fault::Timeout);
                // The worker had the request: its prefill is charged.
                permit.take()?.reconcile(self.uncached as f64);
                Some(Err(ApiError::upstream_timeout(&t.id, self.first_byte)))
            }
            Outcome::ClientGone => {
                ctx.status = CLIENT_CLOSED;
                // A stream's first token was not out yet: its prefill. A whole answer may have been all but done
                // when the client left: its price.
                let charge = if self.prep.stream { self.uncached as f64 } else { priced.cost };
                permit.take()?.reconcile(charge);
                self.partial();
                Some(Ok(()))
            }
            Outcome::Failed(e) => Some(Err(e)),
        }
    }

    /// Marks the worker faulted, when the gateway saw the fault itself.
    fn fault(&self, f: Fault) {
        if self.proxied {
            metrics::counter!("kvgate_gateway_epp_unconfirmed_faults_total").increment(1);
            return;
        }
        self.host.registry().record_fault(self.t.wref, f, Instant::now());
    }

    /// A usage read from any answer: the cache it reports against the prediction, the prompt length against ours.
    fn usage_seen(&self, usage: Option<&UsageSeen>) {
        let (Some(u), Some(p)) = (usage, &self.prep.prompt) else { return };
        metrics::counter!("kvgate_gateway_reported_cached_tokens_total").increment(u.cached);
        metrics::counter!("kvgate_gateway_predicted_cached_tokens_total").increment(self.predicted as u64);
        check_prompt_length(p, u, &self.t.id);
    }

    /// A 2xx answer: the pod has the prompt's KV now (an approximate index credits it only on success), and a
    /// completed generation teaches its class's output length.
    fn served(&self, usage: Option<&UsageSeen>, completed: bool) {
        let Some(p) = &self.prep.prompt else { return };
        if self.served_known {
            self.host.registry().record_served(self.t.wref, &p.hashes);
        }
        if let (Some(u), true) = (usage, completed) {
            // Per choice, and never past what one choice may have: a pod's numbers (or a proxy's) are input.
            let per_choice = u.completion / self.priced.choices.max(1);
            self.host
                .learned_outputs()
                .learn(&self.priced.class_name, per_choice.min(self.priced.output_cap));
        }
    }

    fn partial(&self) {
        metrics::counter!("kvgate_gateway_class_partial_charges_total", "class" => self.priced.class_name.clone())
            .increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_charged_what_was_computed() {
        let usage = UsageSeen { prompt: 1000, completion: 40, cached: 600 };
        // Completed: its usage (uncached prompt + completion); without one, the price reserved.
        let cap = 3000;
        assert_eq!(charge(2400.0, 400, Some(usage), 40, true, cap), 440.0);
        assert_eq!(charge(2400.0, 400, None, 40, true, cap), 2400.0);
        // Cut short: the predicted uncached prompt and what was sent; a usage seen wins (never below what was sent).
        assert_eq!(charge(2400.0, 400, None, 50, false, cap), 450.0);
        assert_eq!(
            charge(2400.0, 400, None, 0, false, cap),
            400.0,
            "left before the first token: the prefill"
        );
        assert_eq!(charge(2400.0, 400, Some(usage), 55, false, cap), 455.0);
        // A hostile pod's numbers: no overflow, no charge past the cap.
        let absurd = UsageSeen { prompt: u64::MAX, completion: u64::MAX, cached: 0 };
        assert_eq!(charge(2400.0, 400, Some(absurd), u64::MAX, true, cap), 3000.0);
        assert_eq!(charge(2400.0, u64::MAX, None, u64::MAX, false, cap), 3000.0);
    }
}
