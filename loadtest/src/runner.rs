//! Runs a [`Plan`] against one endpoint, open loop (each job starts at its time) or closed loop (`concurrency`
//! jobs in flight, the next starting when one ends), and collects a [`RequestRecord`] per request.
//!
//! Bounded: no request is issued after `duration` or beyond `max_requests`; requests still running at the deadline
//! get `request_timeout` to finish, then the run ends regardless.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::client::{Client, Prompt, RequestRecord};
use crate::workload::{Job, Plan};

/// How jobs are started.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    /// At their planned times.
    Open,
    /// `n` at a time, back to back.
    Closed(usize),
}

/// Limits and display.
#[derive(Clone, Copy, Debug)]
pub struct RunOptions {
    pub mode: Mode,
    /// Issue nothing after this long.
    pub duration: Duration,
    /// Issue at most this many requests.
    pub max_requests: usize,
    /// A one-line progress bar on stderr (only when stderr is a terminal).
    pub progress: bool,
    /// Grace for requests in flight at the deadline.
    pub request_timeout: Duration,
    /// Send token-id prompts as text, one word per id (`client::ids_as_text`), for servers that refuse token ids.
    pub text_prompts: bool,
}

/// Every request's record and the run's wall time.
#[derive(Clone, Debug, Default)]
pub struct RunOutput {
    pub records: Vec<RequestRecord>,
    pub wall_s: f64,
}

struct Shared {
    client: Client,
    start: Instant,
    deadline: Instant,
    max_requests: usize,
    text_prompts: bool,
    issued: AtomicUsize,
    next_id: AtomicU64,
    done: AtomicUsize,
    errors: AtomicUsize,
    records: Mutex<Vec<RequestRecord>>,
}

impl Shared {
    /// Takes a request slot; `None` once the run's bounds are reached.
    fn take_slot(&self) -> Option<u64> {
        if Instant::now() >= self.deadline {
            return None;
        }
        let n = self.issued.fetch_add(1, Ordering::AcqRel);
        if n >= self.max_requests {
            return None;
        }
        Some(self.next_id.fetch_add(1, Ordering::AcqRel))
    }

    async fn send(
        &self,
        id: u64,
        prompt: &Prompt,
        max_tokens: u32,
        user: Option<&str>,
        tag: &str,
        turn: Option<usize>,
    ) -> String {
        let start_s = self.start.elapsed().as_secs_f64();
        let (mut rec, text) = self.client.send(prompt, max_tokens, user).await;
        rec.id = id;
        rec.tag = tag.to_owned();
        rec.user = user.map(str::to_owned);
        rec.turn = turn;
        rec.start_s = start_s;
        if !rec.ok() {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.done.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut r) = self.records.lock() {
            r.push(rec);
        }
        text
    }

    async fn run_job(&self, job: &Job) {
        match job {
            Job::Single(s) => {
                let Some(id) = self.take_slot() else { return };
                let prompt = if self.text_prompts {
                    Prompt::Text(crate::client::ids_as_text(&s.prompt))
                } else {
                    Prompt::Tokens(s.prompt.clone())
                };
                self.send(id, &prompt, s.max_tokens, s.user.as_deref(), &s.tag, None).await;
            }
            Job::Session(s) => {
                let mut messages: Vec<Value> = vec![json!({"role": "system", "content": s.system})];
                for (turn, q) in s.questions.iter().enumerate() {
                    if turn > 0 {
                        let think = Duration::from_secs_f64(s.think_s.get(turn).copied().unwrap_or(0.0));
                        tokio::time::sleep(think).await;
                    }
                    let Some(id) = self.take_slot() else { return };
                    messages.push(json!({"role": "user", "content": q}));
                    let prompt = Prompt::Chat(messages.clone());
                    let answer =
                        self.send(id, &prompt, s.max_tokens, Some(&s.user), &s.tag, Some(turn)).await;
                    messages.push(json!({"role": "assistant", "content": answer}));
                }
            }
        }
    }
}

/// Runs the plan; returns when every job is done or the bounds are reached.
pub async fn run(client: Client, plan: &Plan, opts: RunOptions) -> RunOutput {
    let start = Instant::now();
    let total = plan.requests().min(opts.max_requests);
    let shared = Arc::new(Shared {
        client,
        start,
        deadline: start + opts.duration,
        max_requests: opts.max_requests,
        text_prompts: opts.text_prompts,
        issued: AtomicUsize::new(0),
        next_id: AtomicU64::new(0),
        done: AtomicUsize::new(0),
        errors: AtomicUsize::new(0),
        records: Mutex::new(Vec::new()),
    });
    let jobs: Arc<Vec<Job>> = Arc::new(plan.jobs.clone());
    let mut set = tokio::task::JoinSet::new();
    match opts.mode {
        Mode::Open => {
            for i in 0..jobs.len() {
                let (shared, jobs) = (shared.clone(), jobs.clone());
                set.spawn(async move {
                    let at = start + Duration::from_secs_f64(jobs[i].at_s().max(0.0));
                    tokio::time::sleep_until(at.into()).await;
                    shared.run_job(&jobs[i]).await;
                });
            }
        }
        Mode::Closed(n) => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..n.max(1) {
                let (shared, jobs, next) = (shared.clone(), jobs.clone(), next.clone());
                set.spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::AcqRel);
                        let Some(job) = jobs.get(i) else { break };
                        if Instant::now() >= shared.deadline
                            || shared.issued.load(Ordering::Acquire) >= shared.max_requests
                        {
                            break;
                        }
                        shared.run_job(job).await;
                    }
                });
            }
        }
    }
    let progress = (opts.progress && std::io::stderr().is_terminal()).then(|| {
        let shared = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                draw_progress(&shared, total);
            }
        })
    });
    let hard_stop = start + opts.duration + opts.request_timeout + Duration::from_secs(5);
    loop {
        match tokio::time::timeout_at(hard_stop.into(), set.join_next()).await {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => {
                set.abort_all();
                break;
            }
        }
    }
    if let Some(p) = progress {
        p.abort();
        draw_progress(&shared, total);
        eprintln!();
    }
    let mut records = shared.records.lock().map(|mut r| std::mem::take(&mut *r)).unwrap_or_default();
    records.sort_by_key(|r| r.id);
    RunOutput { records, wall_s: start.elapsed().as_secs_f64() }
}

fn draw_progress(shared: &Shared, total: usize) {
    let done = shared.done.load(Ordering::Relaxed);
    let errors = shared.errors.load(Ordering::Relaxed);
    let width = 30;
    let filled = (done * width).checked_div(total).map_or(width, |f| f.min(width));
    let mut err = std::io::stderr().lock();
    let _ = write!(
        err,
        "\r[{}{}] {done}/{total} requests, {errors} errors, {:.1} s ",
        "=".repeat(filled),
        " ".repeat(width - filled),
        shared.start.elapsed().as_secs_f64()
    );
    let _ = err.flush();
}
