//! The response body relayed to the client chunk by chunk and metered (`meter.rs`: completion tokens sent, the
//! `usage` at the end, a usage chunk the client did not ask for taken out). Between chunks the worker has
//! `--stream-idle-timeout`; before the first one, what is left of the first-byte budget if that is longer (a
//! stream's first chunk brings its first token). The client leaving is noticed while the worker is silent, not at
//! the next write, until a body of declared length is all out (then the client is done with it). A completed stream records its time per output token, and how far the split decision's
//! prediction was from it.

use std::time::Instant;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::{Attempt, Outcome};
use crate::errors::{ApiError, GatewayErrors};
use crate::serve::downstream::{unless_client_leaves, Downstream};
use crate::serve::meter::Meter;

/// What the body's relay knows of the response.
pub(super) struct Relay {
    pub status: u16,
    pub sse: bool,
    /// The body's declared length (`content-length`, passed on to the client), when it has one.
    pub length: Option<u64>,
    /// When the request went out.
    pub sent_at: Instant,
}

impl Relay {
    /// The outcome of a body the client stopped reading (it left): what was sent until then is charged (a whole
    /// answer: its usage, if its end was read already).
    fn cut(&self, meter: &mut Meter) -> Outcome {
        let usage = if self.sse { None } else { meter.finish_usage() };
        Outcome::Responded {
            status: self.status,
            usage,
            tokens_sent: meter.tokens_sent(),
            whole: !self.sse,
            completed: false,
            stalled: false,
        }
    }
}

pub(super) async fn relay<D: Downstream>(
    down: &mut D,
    a: &Attempt<'_>,
    r: Relay,
    mut body: Incoming,
) -> Outcome {
    let mut meter = Meter::new(r.sse, a.strip_usage);
    let mut tpot = TpotClock::default();
    let (mut stalled, mut completed, mut first) = (false, true, true);
    let mut written = 0u64;
    loop {
        // A worker sends a stream's headers at once and its first chunk with the first token: until then the
        // request may still be queued or in prefill, which the first-byte budget covers, not the idle timeout.
        let wait = match first {
            true => a.idle_timeout.max(a.first_byte_timeout.saturating_sub(r.sent_at.elapsed())),
            false => a.idle_timeout,
        };
        // The client may leave while the worker is silent (a split's decode worker waits for the prompt's KV
        // before its first token): noticed now, not at the next write, so the worker drops the request at once.
        // Once a body of declared length is all out, the client has its whole answer and may send its next request
        // on the connection at once: it is not watched then, as watching reads from the connection (a byte of that
        // next request would be taken: its method read as `OST`, a 404).
        let next = tokio::time::timeout(wait, body.frame());
        let next = match r.length.is_some_and(|n| written >= n) {
            true => next.await,
            false => match unless_client_leaves(down, next).await {
                Some(next) => next,
                None => return r.cut(&mut meter),
            },
        };
        match next {
            Ok(None) => break,
            Ok(Some(Ok(frame))) => {
                first = false;
                if let Ok(data) = frame.into_data() {
                    let out = meter.feed(&data);
                    tpot.saw(meter.tokens_sent(), Instant::now());
                    written += out.len() as u64;
                    if !out.is_empty() && down.write_body(Some(out), false).await.is_err() {
                        // Dropping the upstream body closes that connection, and the worker aborts the request.
                        return r.cut(&mut meter);
                    }
                }
            }
            Ok(Some(Err(e))) => {
                tracing::warn!(worker = %a.worker_id, error = %e, "upstream failed mid-response");
                completed = false;
                if r.sse {
                    let err =
                        ApiError::bad_gateway(a.worker_id, &format!("the worker failed mid-stream: {e}"));
                    write_sse_error(down, &err).await;
                }
                break;
            }
            Err(_) => {
                tracing::warn!(worker = %a.worker_id, waited = ?wait, first, "upstream stream went silent");
                (completed, stalled) = (false, true);
                if r.sse {
                    let mut err = ApiError::upstream_timeout(a.worker_id, wait);
                    err.message = match first {
                        true => format!(
                            "worker {} sent no token within {:.1?} of the request (the first-byte timeout)",
                            a.worker_id,
                            r.sent_at.elapsed()
                        ),
                        false => format!(
                            "worker {} sent nothing for {:.1?} mid-stream (--stream-idle-timeout)",
                            a.worker_id, wait
                        ),
                    };
                    write_sse_error(down, &err).await;
                }
                break;
            }
        }
    }
    let rest = meter.finish();
    if !rest.is_empty() {
        let _ = down.write_body(Some(rest), false).await;
    }
    let _ = down.write_body(None, true).await;
    if completed && r.sse {
        record_stream_timing(a, &r, &tpot);
    }
    let usage = if completed { meter.usage() } else { None };
    Outcome::Responded {
        status: r.status,
        usage,
        tokens_sent: meter.tokens_sent(),
        whole: !r.sse,
        completed,
        stalled,
    }
}

/// A completed stream's TPOT, and the split prediction's error against what the client saw.
fn record_stream_timing(a: &Attempt<'_>, r: &Relay, tpot: &TpotClock) {
    if let Some(s) = tpot.seconds() {
        metrics::histogram!("kvgate_gateway_tpot_seconds", "path" => a.path_label()).record(s);
    }
    let (Some((ttft, tpot_s)), Some(first)) = (a.predicted, tpot.first_at()) else { return };
    let seen_ttft = first.duration_since(r.sent_at).as_secs_f64();
    metrics::histogram!("kvgate_gateway_split_prediction_error_seconds", "term" => "ttft")
        .record((seen_ttft - ttft).abs());
    if let Some(seen) = tpot.seconds() {
        metrics::histogram!("kvgate_gateway_split_prediction_error_seconds", "term" => "tpot")
            .record((seen - tpot_s).abs());
    }
    tracing::debug!(worker = %a.worker_id, predicted_ttft = ttft, seen_ttft, predicted_tpot = tpot_s,
        seen_tpot = ?tpot.seconds(), "split prediction vs outcome");
}

/// A stream's time per output token as the client sees it: from the chunk that brought its first token to the one
/// that brought its last, over the tokens between (none for fewer than 2 tokens).
#[derive(Default)]
struct TpotClock {
    first: Option<(u64, Instant)>,
    last: Option<(u64, Instant)>,
}

impl TpotClock {
    fn saw(&mut self, tokens: u64, at: Instant) {
        if tokens == 0 || self.last.is_some_and(|(n, _)| n == tokens) {
            return;
        }
        self.first.get_or_insert((tokens, at));
        self.last = Some((tokens, at));
    }

    /// When the first token arrived.
    fn first_at(&self) -> Option<Instant> {
        self.first.map(|f| f.1)
    }

    fn seconds(&self) -> Option<f64> {
        let ((n0, t0), (n1, t1)) = (self.first?, self.last?);
        (n1 > n0).then(|| t1.duration_since(t0).as_secs_f64() / (n1 - n0) as f64)
    }
}

async fn write_sse_error<D: Downstream>(down: &mut D, err: &ApiError) {
    metrics::counter!("kvgate_gateway_errors_total", "code" => err.code).increment(1);
    let event = Bytes::from(format!("data: {}\n\n", err.body().to_json()));
    let _ = down.write_body(Some(event), false).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tpot_counts_from_the_first_token_to_the_last() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut c = TpotClock::default();
        c.saw(0, at(0)); // the role chunk: no token yet
        c.saw(1, at(500)); // the first token, after the prefill
        assert_eq!(c.seconds(), None, "one token has no TPOT");
        c.saw(1, at(510)); // a chunk without a token
        c.saw(3, at(540));
        c.saw(5, at(580));
        assert!((c.seconds().expect("tpot") - 0.020).abs() < 1e-9, "80 ms over 4 tokens after the first");
    }
}
