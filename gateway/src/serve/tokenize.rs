//! A bounded pool of threads for CPU-heavy request work (JSON parsing, chat templates, tokenization, hashing), so
//! a few megabyte prompts never occupy the proxy's threads: `/health` and small requests keep their latency while
//! huge prompts are tokenized. Jobs wait in a bounded queue; when it is full the request gets 503
//! `tokenizer_busy` at once instead of piling up memory.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

type Job = Box<dyn FnOnce() + Send>;

/// Why a job did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolError {
    /// The queue is full.
    Busy,
    /// The job panicked or the pool is gone.
    Failed,
}

/// The pool (cheap to share behind an `Arc`).
pub struct TokenizePool {
    tx: SyncSender<Job>,
    threads: usize,
}

impl std::fmt::Debug for TokenizePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizePool").field("threads", &self.threads).finish()
    }
}

impl TokenizePool {
    /// `threads` workers and at most `queue` waiting jobs.
    pub fn new(threads: usize, queue: usize) -> Self {
        let (tx, rx) = sync_channel::<Job>(queue);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let spawned =
                std::thread::Builder::new().name(format!("kvgate-tokenize-{i}")).spawn(move || work(&rx));
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start a tokenize thread");
            }
        }
        Self { tx, threads: threads.max(1) }
    }

    /// Queues `f` for a pool thread now (or refuses it now, if the queue is full); the future yields its result.
    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> impl std::future::Future<Output = Result<T, PoolError>> + Send + 'static {
        let (done, result) = oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = done.send(f());
        });
        let queued = match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                metrics::counter!("kvgate_gateway_tokenize_rejected_total").increment(1);
                Err(PoolError::Busy)
            }
            Err(TrySendError::Disconnected(_)) => Err(PoolError::Failed),
        };
        async move {
            queued?;
            result.await.map_err(|_| PoolError::Failed)
        }
    }
}

fn work(rx: &Mutex<Receiver<Job>>) {
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(|e| e.into_inner());
            rx.recv()
        };
        match job {
            // A panicking job drops its sender (the caller sees Failed); the thread goes on.
            Ok(job) => {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                    tracing::error!("a tokenize job panicked");
                }
            }
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn runs_jobs_and_refuses_past_the_queue() {
        let pool = TokenizePool::new(1, 1);
        assert_eq!(pool.run(|| 2 + 2).await, Ok(4));
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (started_tx, started) = oneshot::channel();
        let blocker = pool.run(move || {
            let _ = started_tx.send(());
            let _ = wait.recv_timeout(Duration::from_secs(5));
        });
        started.await.expect("running");
        // One job runs, one waits in the queue, the third is refused at once.
        let queued = pool.run(|| 1);
        assert_eq!(pool.run(|| 2).await, Err(PoolError::Busy));
        release.send(()).expect("release");
        blocker.await.expect("ran");
        assert_eq!(queued.await, Ok(1));
        assert_eq!(pool.run(|| -> u8 { panic!("boom") }).await, Err(PoolError::Failed));
        assert_eq!(pool.run(|| 7).await, Ok(7), "the thread survived the panic");
    }
}
