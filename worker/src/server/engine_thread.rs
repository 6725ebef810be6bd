//! The engine runs on its own OS thread (its steps are seconds of blocking math); HTTP handlers talk to it through
//! an [`EngineHandle`]: submit a request and receive its step outputs on a channel, abort it, read statistics.
//!
//! The thread blocks on the command channel when idle, and between steps drains every pending command, so an
//! abort (client gone) frees the request's blocks before the next step. A receiver that has gone away aborts its
//! request too. A step that plans nothing while work is held (a queue head waiting for blocks that imports hold,
//! an export held back by its full buffer) waits up to [`STALLED_STEP_WAIT`] for a command instead of stepping
//! again at once: nothing spins while it waits.
//!
//! Liveness: if the thread ends for any reason (a panic in a step included), [`EngineHandle::is_alive`] turns
//! false and [`EngineHandle::died`] resolves, so the server fails its probes and exits non-zero instead of
//! answering 503 to every request while its reports go on.
//!
//! Fault injection (tests only): `KVGATE_FAULT_ENGINE_PANIC_AFTER_STEPS=N` makes the thread panic after N steps.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

use crate::engine::scheduler::SchedulerCounters;
use crate::engine::{
    AdmitError, Backend, Engine, EngineRequest, EngineStats, ExportBacklog, ExportProgress, ExportSink,
    ImportError, ImportPlan, KvChunk, RequestId, StepOutput,
};
use crate::kv::{KvManager, SharedPool};

enum Cmd {
    Add {
        req: EngineRequest,
        events: mpsc::UnboundedSender<StepOutput>,
        admitted: oneshot::Sender<Result<(), Refusal>>,
    },
    Abort(RequestId),
    AbortAll,
    /// The prefill side of a hand-off: `Add` whose blocks from `from_block` leave on its outputs.
    AddExport {
        req: EngineRequest,
        from_block: usize,
        layer_group: usize,
        backlog: Arc<ExportBacklog>,
        progress: watch::Sender<ExportProgress>,
        events: mpsc::UnboundedSender<StepOutput>,
        admitted: oneshot::Sender<Result<(), Refusal>>,
    },
    /// The decode side: allocate and park (`Engine::start_import`); outputs go to `events` once it runs. Without
    /// room (slots, blocks, or requests waiting ahead) it waits its turn, up to the import wait; then it is refused.
    StartImport {
        req: EngineRequest,
        events: mpsc::UnboundedSender<StepOutput>,
        reply: oneshot::Sender<Result<ImportPlan, Refusal>>,
    },
    WriteImport {
        id: RequestId,
        first: usize,
        count: usize,
        layers: std::ops::Range<usize>,
        bytes: Vec<u8>,
        reply: oneshot::Sender<Result<(), ImportError>>,
    },
    FinishImport {
        id: RequestId,
        first_token: u32,
        cached_tokens: usize,
        reply: oneshot::Sender<Result<(), ImportError>>,
    },
    /// The import failed: compute the prompt here.
    ImportToLocal(RequestId),
}

/// Longest wait for a command after a step that planned nothing while the engine held work (then it steps again:
/// time alone may make a waiting request ready, as a tier read's deadline does).
pub const STALLED_STEP_WAIT: Duration = Duration::from_millis(5);

/// Why a request was not queued.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    Invalid(AdmitError),
    QueueFull { waiting: usize },
    EngineGone,
}

/// Statistics the engine thread publishes after every step.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineSnapshot {
    pub stats: EngineStats,
    /// Prompt tokens computed (not served from cache) since start.
    pub prefill_tokens: u64,
    /// Tokens generated since start.
    pub decode_tokens: u64,
    pub steps: u64,
    /// Seconds of the steps that computed prompt tokens.
    pub prefill_step_s: f64,
    /// Seconds of the steps that carried decodes, and the part of them prefill chunks added (each mixed step's
    /// time less the decode-only step time below).
    pub decode_carrying_s: f64,
    pub stalled_s: f64,
    /// Moving average (1/8 new) of the decode-only steps' time; 0 before the first.
    pub decode_step_s: f64,
    /// Prefill-carrying steps' seconds against their prompt tokens and attention area (`prefill_fit`), from the
    /// shapes the engine timed at start (`Engine::time_prefill_shapes`) on.
    pub prefill_fit: super::prefill_fit::PrefillFit,
    /// Decode-only steps' seconds against their batch and context (`decode_fit`).
    pub decode_fit: kvgate_shared::decode_fit::DecodeFit,
}

/// Handle to the engine thread (cheap to clone).
#[derive(Clone)]
pub struct EngineHandle {
    tx: std_mpsc::Sender<Cmd>,
    snapshot: Arc<Mutex<EngineSnapshot>>,
    /// The KV bookkeeping (pool and tiers), for reports.
    kv: KvManager,
    next_id: Arc<AtomicU64>,
    alive: watch::Receiver<bool>,
}

/// Marks the engine dead when the thread ends, however it ends (unwinding included).
struct AliveGuard(watch::Sender<bool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        let _ = self.0.send(false);
    }
}

impl EngineHandle {
    /// Starts the thread that owns `engine`.
    /// `max_waiting`: requests queued (imports waiting for room included) before `QueueFull`; `import_wait`: the
    /// longest an import waits for room before it is refused (`AdmitError::NoRoom`).
    pub fn spawn<B: Backend + 'static>(engine: Engine<B>, max_waiting: usize, import_wait: Duration) -> Self {
        let (tx, rx) = std_mpsc::channel();
        let snapshot = Arc::new(Mutex::new(EngineSnapshot::default()));
        let kv = engine.scheduler().kv().clone();
        let p = snapshot.clone();
        let (alive_tx, alive) = watch::channel(true);
        let panic_after =
            std::env::var("KVGATE_FAULT_ENGINE_PANIC_AFTER_STEPS").ok().and_then(|v| v.parse().ok());
        let (started_tx, started) = std_mpsc::channel();
        std::thread::Builder::new()
            .name("kvgate-engine".into())
            .spawn(move || {
                let _guard = AliveGuard(alive_tx);
                let limits = Limits { max_waiting, import_wait };
                run(engine, rx, p, limits, panic_after, started_tx);
                tracing::error!("the engine thread ended");
            })
            .unwrap_or_else(|e| panic!("cannot start the engine thread: {e}"));
        // The engine serves once it has measured its prefill cost (a thread that died meanwhile says so as well).
        let _ = started.recv();
        Self { tx, snapshot, kv, next_id: Arc::new(AtomicU64::new(1)), alive }
    }

    /// Whether the engine thread still runs.
    pub fn is_alive(&self) -> bool {
        *self.alive.borrow()
    }

    /// Resolves when the engine thread has ended.
    pub async fn died(&self) {
        let mut rx = self.alive.clone();
        let _ = rx.wait_for(|alive| !*alive).await;
    }

    /// A fresh request id.
    pub fn next_id(&self) -> RequestId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Queues a request; its outputs arrive on the returned channel.
    pub async fn submit(&self, req: EngineRequest) -> Result<mpsc::UnboundedReceiver<StepOutput>, Refusal> {
        let (events, rx) = mpsc::unbounded_channel();
        let (admitted, ack) = oneshot::channel();
        self.tx.send(Cmd::Add { req, events, admitted }).map_err(|_| Refusal::EngineGone)?;
        ack.await.map_err(|_| Refusal::EngineGone)??;
        Ok(rx)
    }

    /// Queues the prefill side of a hand-off: its outputs carry the KV of blocks `from_block..` as it is written;
    /// its prefill waits while `backlog` (what the caller has not sent on yet) is at its bound.
    pub async fn submit_export(
        &self,
        req: EngineRequest,
        from_block: usize,
        layer_group: usize,
        backlog: Arc<ExportBacklog>,
    ) -> Result<(mpsc::UnboundedReceiver<StepOutput>, watch::Receiver<ExportProgress>), Refusal> {
        let (events, rx) = mpsc::unbounded_channel();
        let (progress, steps) = watch::channel(ExportProgress::default());
        let (admitted, ack) = oneshot::channel();
        let cmd = Cmd::AddExport { req, from_block, layer_group, backlog, progress, events, admitted };
        self.tx.send(cmd).map_err(|_| Refusal::EngineGone)?;
        ack.await.map_err(|_| Refusal::EngineGone)??;
        Ok((rx, steps))
    }

    /// Allocates the decode side of a hand-off; its outputs arrive on the channel once the import finishes (or it
    /// falls back to computing here).
    pub async fn start_import(
        &self,
        req: EngineRequest,
    ) -> Result<(ImportPlan, mpsc::UnboundedReceiver<StepOutput>), Refusal> {
        let (events, rx) = mpsc::unbounded_channel();
        let (reply, ack) = oneshot::channel();
        self.tx.send(Cmd::StartImport { req, events, reply }).map_err(|_| Refusal::EngineGone)?;
        let plan = ack.await.map_err(|_| Refusal::EngineGone)??;
        Ok((plan, rx))
    }

    /// Writes imported blocks (`Engine::write_import`).
    pub async fn write_import(
        &self,
        id: RequestId,
        first: usize,
        count: usize,
        layers: std::ops::Range<usize>,
        bytes: Vec<u8>,
    ) -> Result<(), ImportError> {
        let (reply, ack) = oneshot::channel();
        let cmd = Cmd::WriteImport { id, first, count, layers, bytes, reply };
        self.tx.send(cmd).map_err(|_| ImportError::EngineGone)?;
        ack.await.map_err(|_| ImportError::EngineGone)?
    }

    /// Ends an import with the first token (`Engine::finish_import`).
    pub async fn finish_import(
        &self,
        id: RequestId,
        first_token: u32,
        cached_tokens: usize,
    ) -> Result<(), ImportError> {
        let (reply, ack) = oneshot::channel();
        let cmd = Cmd::FinishImport { id, first_token, cached_tokens, reply };
        self.tx.send(cmd).map_err(|_| ImportError::EngineGone)?;
        ack.await.map_err(|_| ImportError::EngineGone)?
    }

    /// Gives an import up: the prompt is computed here.
    pub fn import_to_local(&self, id: RequestId) {
        let _ = self.tx.send(Cmd::ImportToLocal(id));
    }

    /// Aborts a request (no-op if it already ended).
    pub fn abort(&self, id: RequestId) {
        let _ = self.tx.send(Cmd::Abort(id));
    }

    /// Aborts everything (end of the shutdown grace period).
    pub fn abort_all(&self) {
        let _ = self.tx.send(Cmd::AbortAll);
    }

    pub fn snapshot(&self) -> EngineSnapshot {
        *self.snapshot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The block pool (reports read its cached hashes).
    pub fn pool(&self) -> &SharedPool {
        self.kv.pool()
    }

    /// The KV bookkeeping: the pool and its lower tiers.
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }
}

fn run<B: Backend>(
    mut engine: Engine<B>,
    rx: std_mpsc::Receiver<Cmd>,
    snapshot: Arc<Mutex<EngineSnapshot>>,
    limits: Limits,
    panic_after_steps: Option<u64>,
    started: std_mpsc::Sender<()>,
) {
    let mut q = Queues { senders: HashMap::new(), imports: VecDeque::new(), limits };
    let mut totals = EngineSnapshot::default();
    for (tokens, area, secs) in engine.time_prefill_shapes() {
        totals.prefill_fit.observe(tokens, area, secs);
    }
    let (per_token_s, attention_s) = totals.prefill_fit.coefficients();
    engine.set_prefill_cost(per_token_s, attention_s);
    tracing::info!(per_token_s, attention_s, "prefill cost measured at start");
    let _ = started.send(());
    // The figures before any request (a restarted worker's recovered SSD tier among them).
    publish(&engine, &mut totals, &snapshot);
    let mut stalled = false;
    loop {
        q.start_imports(&mut engine);
        if !engine.has_work() && q.imports.is_empty() {
            match rx.recv() {
                Ok(cmd) => handle(&mut engine, &mut q, cmd),
                Err(_) => return,
            }
        } else if stalled || !engine.has_work() {
            match rx.recv_timeout(STALLED_STEP_WAIT) {
                Ok(cmd) => handle(&mut engine, &mut q, cmd),
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => handle(&mut engine, &mut q, cmd),
                Err(std_mpsc::TryRecvError::Empty) => break,
                Err(std_mpsc::TryRecvError::Disconnected) => return,
            }
        }
        q.start_imports(&mut engine);
        if !engine.has_work() {
            // Commands alone (an abort that emptied the engine) change the figures too.
            publish(&engine, &mut totals, &snapshot);
            continue;
        }
        if panic_after_steps.is_some_and(|n| totals.steps >= n) {
            panic!("fault injection: KVGATE_FAULT_ENGINE_PANIC_AFTER_STEPS");
        }
        let before = engine.scheduler().counters();
        let started = Instant::now();
        let outputs = engine.step();
        let after = engine.scheduler().counters();
        let computed = after.scheduled_tokens - before.scheduled_tokens;
        let elapsed = started.elapsed().as_secs_f64();
        let holds = after.export_holds - before.export_holds;
        if holds > 0 {
            metrics::counter!("kvgate_worker_kv_export_holds_total").increment(holds);
        }
        stalled = computed == 0 && outputs.is_empty();
        if stalled {
            metrics::counter!("kvgate_worker_engine_stalled_steps_total").increment(1);
            continue;
        }
        engine.observe_prefill(computed, elapsed);
        let generated = outputs.iter().filter(|o| o.token.is_some()).count() as u64;
        totals.decode_tokens += generated;
        totals.prefill_tokens += computed.saturating_sub(generated);
        totals.steps += 1;
        time_step(&mut totals, StepWork::between(&before, &after), elapsed);
        let (per_token_s, attention_s) = totals.prefill_fit.coefficients();
        engine.set_prefill_cost(per_token_s, attention_s);
        // EngineSnapshot before the outputs go out: a client that reads the metrics after its response sees this step.
        publish(&engine, &mut totals, &snapshot);
        let mut aborted = false;
        for o in outputs {
            let done = o.finished.is_some();
            let id = o.id;
            let gone = q.senders.get(&id).is_none_or(|tx| tx.send(o).is_err());
            if done {
                q.senders.remove(&id);
            } else if gone {
                // Nobody listens any more (client disconnected): free its blocks now.
                abort_counted(&mut engine, id);
                q.senders.remove(&id);
                aborted = true;
            }
        }
        if aborted {
            publish(&engine, &mut totals, &snapshot);
        }
        tracing::trace!(
            computed,
            generated,
            elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
            "engine step"
        );
    }
}

/// What one step computed (differences of the scheduler's counters across it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepWork {
    /// Decode chunks (one token each).
    pub decodes: u64,
    /// Tokens computed, decodes included.
    pub computed: u64,
    /// The attention area of its prompt chunks.
    pub area: u64,
    /// The KV tokens its decode chunks attended to.
    pub context: u64,
}

impl StepWork {
    /// The step between two readings of the scheduler's counters.
    pub fn between(before: &SchedulerCounters, after: &SchedulerCounters) -> Self {
        Self {
            decodes: after.decode_chunks - before.decode_chunks,
            computed: after.scheduled_tokens - before.scheduled_tokens,
            area: after.prefill_area - before.prefill_area,
            context: after.decode_context - before.decode_context,
        }
    }
}

/// Adds one step's time to the step-timing sums and the prefill and decode fits.
pub fn time_step(t: &mut EngineSnapshot, step: StepWork, elapsed: f64) {
    let StepWork { decodes, computed, area, context } = step;
    let prefill = computed > decodes;
    if prefill {
        t.prefill_step_s += elapsed;
        t.prefill_fit.observe((computed - decodes) as f64, area as f64, elapsed);
    }
    if decodes == 0 {
        return;
    }
    t.decode_carrying_s += elapsed;
    if prefill {
        t.stalled_s += (elapsed - t.decode_step_s).max(0.0);
    } else {
        t.decode_fit.observe(decodes as f64, context as f64, elapsed);
        if t.decode_step_s == 0.0 {
            t.decode_step_s = elapsed;
        } else {
            t.decode_step_s += (elapsed - t.decode_step_s) / 8.0;
        }
    }
}

fn publish<B: Backend>(engine: &Engine<B>, totals: &mut EngineSnapshot, snapshot: &Mutex<EngineSnapshot>) {
    totals.stats = engine.stats();
    *snapshot.lock().unwrap_or_else(|e| e.into_inner()) = *totals;
}

fn handle<B: Backend>(engine: &mut Engine<B>, q: &mut Queues, cmd: Cmd) {
    let (senders, max_waiting) = (&mut q.senders, q.limits.max_waiting);
    match cmd {
        Cmd::Add { req, events, admitted } => {
            admit(engine, senders, max_waiting, req.id, events, admitted, |e| e.add_request(req));
        }
        Cmd::AddExport { req, from_block, layer_group, backlog, progress, events, admitted } => {
            let id = req.id;
            // Blocks go out on the request's own channel, so they always precede its first token.
            let tx = events.clone();
            let sink = ExportSink::new(
                Arc::new(move |kv: KvChunk| {
                    let _ = tx.send(StepOutput {
                        id,
                        token: None,
                        finished: None,
                        prompt_tokens: 0,
                        cached_tokens: 0,
                        completion_tokens: 0,
                        queued_s: None,
                        logprobs: None,
                        kv: Some(kv),
                    });
                }),
                backlog,
            )
            .with_progress(progress);
            admit(engine, senders, max_waiting, id, events, admitted, |e| {
                e.add_export(req, from_block, layer_group, sink)
            });
        }
        Cmd::StartImport { req, events, reply } => {
            let waiting = engine.scheduler().num_waiting() + q.imports.len();
            if waiting >= max_waiting {
                let _ = reply.send(Err(Refusal::QueueFull { waiting }));
                return;
            }
            // What can never run is refused now, not after the wait.
            if let Err(e) = engine.validate(&req) {
                let _ = reply.send(Err(Refusal::Invalid(e)));
                return;
            }
            // In turn: behind the imports already waiting for room.
            q.imports.push_back(PendingImport { req, events, reply, since: Instant::now() });
            q.start_imports(engine);
        }
        Cmd::WriteImport { id, first, count, layers, bytes, reply } => {
            let _ = reply.send(engine.write_import(id, first, count, layers, &bytes));
        }
        Cmd::FinishImport { id, first_token, cached_tokens, reply } => {
            match engine.finish_import(id, first_token, cached_tokens) {
                Ok(o) => {
                    let done = o.finished.is_some();
                    let gone = senders.get(&id).is_none_or(|tx| tx.send(o).is_err());
                    if done || gone {
                        senders.remove(&id);
                    }
                    if gone && !done {
                        abort_counted(engine, id);
                    }
                    let _ = reply.send(Ok(()));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            }
        }
        Cmd::ImportToLocal(id) => {
            if let Some(kept) = engine.import_to_local(id) {
                metrics::counter!("kvgate_worker_kv_import_kept_tokens_total").increment(kept as u64);
            }
        }
        Cmd::Abort(id) => {
            abort_counted(engine, id);
            senders.remove(&id);
            q.imports.retain(|p| p.req.id != id);
        }
        Cmd::AbortAll => {
            for (id, _) in senders.drain() {
                engine.abort(id);
            }
            for p in q.imports.drain(..) {
                let _ = p.reply.send(Err(Refusal::EngineGone));
            }
        }
    }
}

/// What the engine thread's loop holds besides the engine.
struct Limits {
    max_waiting: usize,
    import_wait: Duration,
}

/// An import waiting for room (`Cmd::StartImport`).
struct PendingImport {
    req: EngineRequest,
    events: mpsc::UnboundedSender<StepOutput>,
    reply: oneshot::Sender<Result<ImportPlan, Refusal>>,
    since: Instant,
}

struct Queues {
    senders: HashMap<RequestId, mpsc::UnboundedSender<StepOutput>>,
    /// Imports waiting for room, first come first served.
    imports: VecDeque<PendingImport>,
    limits: Limits,
}

impl Queues {
    /// Starts the waiting imports that fit now, in order; refuses (`NoRoom`) those that waited past the import
    /// wait, and drops those whose caller stopped waiting.
    fn start_imports<B: Backend>(&mut self, engine: &mut Engine<B>) {
        let now = Instant::now();
        self.imports.retain(|p| !p.reply.is_closed());
        while let Some(p) = self.imports.front() {
            if !engine.import_room(p.req.prompt.len()) {
                break;
            }
            let Some(p) = self.imports.pop_front() else { break };
            let id = p.req.id;
            match engine.start_import(p.req) {
                Ok(plan) => {
                    self.senders.insert(id, p.events);
                    if p.reply.send(Ok(plan)).is_err() {
                        engine.abort(id);
                        self.senders.remove(&id);
                    }
                }
                Err(e) => {
                    let _ = p.reply.send(Err(Refusal::Invalid(e)));
                }
            }
        }
        let wait = self.limits.import_wait;
        while self.imports.front().is_some_and(|p| now.duration_since(p.since) >= wait) {
            if let Some(p) = self.imports.pop_front() {
                metrics::counter!("kvgate_worker_kv_import_room_timeouts_total").increment(1);
                let _ =
                    p.reply.send(Err(Refusal::Invalid(AdmitError::NoRoom("no room for the import in time"))));
            }
        }
        metrics::gauge!("kvgate_worker_kv_imports_waiting").set(self.imports.len() as f64);
    }
}

/// Aborts a request whose client left, counting what the engine had computed for it in the usage counters a
/// finished request's answer counts (`server/api.rs`'s `Timing::finish`): a stream the client abandoned still
/// cost its prefill and the tokens generated before the abort (`Computed`).
fn abort_counted<B: Backend>(engine: &mut Engine<B>, id: RequestId) {
    let Some(c) = engine.abort_computed(id) else { return };
    metrics::counter!("kvgate_worker_prompt_tokens_total").increment(c.prompt_tokens as u64);
    metrics::counter!("kvgate_worker_cached_prompt_tokens_total").increment(c.cached_tokens as u64);
    metrics::counter!("kvgate_worker_completion_tokens_total").increment(c.completion_tokens as u64);
}

/// Queues a request with `add` unless the waiting queue is full; its outputs go to `events` once admitted. A caller
/// that stopped waiting for the answer gets its request aborted at once.
fn admit<B: Backend>(
    engine: &mut Engine<B>,
    senders: &mut HashMap<RequestId, mpsc::UnboundedSender<StepOutput>>,
    max_waiting: usize,
    id: RequestId,
    events: mpsc::UnboundedSender<StepOutput>,
    admitted: oneshot::Sender<Result<(), Refusal>>,
    add: impl FnOnce(&mut Engine<B>) -> Result<(), AdmitError>,
) {
    let waiting = engine.scheduler().num_waiting();
    if waiting >= max_waiting {
        let _ = admitted.send(Err(Refusal::QueueFull { waiting }));
        return;
    }
    match add(engine) {
        Ok(()) => {
            senders.insert(id, events);
            if admitted.send(Ok(())).is_err() {
                engine.abort(id);
                senders.remove(&id);
            }
        }
        Err(e) => {
            let _ = admitted.send(Err(Refusal::Invalid(e)));
        }
    }
}
