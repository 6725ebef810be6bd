//! The fleet in virtual time: simulated workers (the real engine: scheduler, block manager, prefix cache, with the
//! timing model in place of the math) behind the gateway's real registry and routing policy.
//!
//! Three kinds of event, in virtual seconds, earliest first (at equal times: step ends, then reports, then
//! arrivals):
//! - **arrival**: the gateway hashes the prompt and routes it through the gateway's own `Router::route` (views from
//!   its registry, the policy, the send recorded: load + overlay) and the chosen worker queues the request;
//! - **step end**: a worker's outputs are delivered (first tokens give TTFT; finished requests leave the gateway's
//!   in-flight count) and it starts its next step, which takes the time the timing model says;
//! - **report**: every interval, at its own phase, a worker's queue figures and the Bloom summary of its cache are
//!   ingested by the registry exactly as a `POST /kvgate/v1/report` would be. The gateway never reads live state.
//!
//! With several gateway replicas (`SimConfig::gateway_replicas`) each has its own registry and ring-key sketch,
//! requests are spread over them in turn, and every worker reports to all of them; with `share_sends` each send
//! reaches the other replicas `share_delay_s` later as the gateway shares it (a fourth kind of event, applied before
//! an arrival at the same time).
//!
//! A step's effects on the cache are applied when it starts (the engine is a library call), its outputs delivered
//! when it ends; a report taken during a step sees the step's blocks already cached, which is what a real worker's
//! report, built between steps, shows one step later.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvgate_router::registry::{Registry, SentTicket, SharedSend};
use kvgate_router::route::{RouteInput, Router};
use kvgate_router::routing::{RingKey, RingKeys, RoutingPolicy};
use kvgate_shared::hashing::{BlockHash, BlockHasher, ExtraKeys};
use kvgate_shared::report::Throughput;
use kvgate_worker::engine::sim::{SimBackend, SimClock};
use kvgate_worker::engine::{Engine, EngineConfig, EngineRequest, FinishReason, SamplingParams, StepOutput};
use kvgate_worker::report::{summarise_tiers, ReportSource};
use kvgate_worker::server::engine_thread::{time_step, EngineSnapshot, StepWork};
use kvgate_worker::server::reporter::step_timing;

use super::adapters::{key as adapter_key, Resident, Rule};
use super::admission::{Admitted, Pumped, Ready, Reservation, SimAdmission};
use super::SimConfig;
use crate::trace::{expand_prompt, Trace};
use kvgate_router::placement::{place, Choice, PlaceConfig};
use kvgate_shared::hashing::ExtraKey;
use kvgate_shared::prompt::SplitMix64;

/// The model id every simulated worker serves.
pub const SIM_MODEL: &str = "sim";

/// What one replay measured.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub completed: u64,
    /// Refused by the engine (too long for the model or the KV pool) or with no healthy worker.
    pub rejected: u64,
    pub errors: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Seconds from arrival to first token, per completed request.
    pub ttft_s: Vec<f64>,
    /// Seconds per output token after the first, per completed request of two tokens or more.
    pub tpot_s: Vec<f64>,
    /// Seconds from arrival to the last token, per completed request.
    pub e2e_s: Vec<f64>,
    /// Completion tokens of all completed requests, and of those that met the SLOs (`SimConfig::slo`).
    pub completion_tokens: u64,
    pub good_tokens: u64,
    /// Completed requests that met the SLOs.
    pub slo_met: u64,
    /// Seconds each worker spent in steps.
    pub busy_s: Vec<f64>,
    /// Virtual time of the last event.
    pub end_s: f64,
    pub routes: BTreeMap<String, u64>,
    pub preemptions: u64,
    pub evictions: u64,
    pub host_stored_bytes: u64,
    pub host_hit_blocks: u64,
    pub disk_read_blocks: u64,
    /// Lower-tier tokens load-vs-recompute chose to compute again.
    pub recomputed_tokens: u64,
    /// Per admission class (empty without classes).
    pub classes: BTreeMap<String, ClassOutcome>,
    /// (predicted, actual) TTFT seconds of the requests the measured guard predicted one for.
    pub ttft_predicted: Vec<(f64, f64)>,
    /// LoRA adapters loaded on workers, and adapters unloaded for them (`SimConfig::adapters`).
    pub adapter_loads: u64,
    pub adapter_evictions: u64,
}

/// One admission class's requests.
#[derive(Clone, Debug, Default)]
pub struct ClassOutcome {
    pub completed: u64,
    /// Refused at arrival: the class queue was full (the gateway answers 429 `class_budget_exceeded`).
    pub refused: u64,
    /// Waited `max_wait` without budget (429 `class_budget_exceeded` too).
    pub timed_out: u64,
    /// Seconds from arrival (admission wait included) to first token.
    pub ttft_s: Vec<f64>,
    /// Seconds waited for the class budget, per admitted request.
    pub wait_s: Vec<f64>,
}

struct SimWorker {
    engine: Engine<SimBackend>,
    source: ReportSource,
    /// When the running step ends (`None`: idle).
    busy_until: Option<f64>,
    pending: Vec<StepOutput>,
    next_report: f64,
    seq: u64,
    /// Step figures since the start, as the engine thread keeps them (`EngineSnapshot`), and their value at the
    /// last report: reports carry the interval's throughput and step timings as a real worker's do.
    totals: EngineSnapshot,
    reported: EngineSnapshot,
    reported_at: f64,
    /// Its resident LoRA adapters (`SimConfig::adapters`).
    lora: Resident,
    /// Requests waiting for an adapter load, with when it completes.
    loading: Vec<(f64, EngineRequest)>,
    /// When each adapter's latest load here completes.
    load_ready: HashMap<String, f64>,
}

struct InFlight {
    arrival: f64,
    /// When its first token came (`None`: not yet).
    first_at: Option<f64>,
    prompt_tokens: usize,
    /// The send as recorded by each replica that recorded it: (replica, ticket).
    tickets: Vec<(usize, SentTicket)>,
    /// The admission class and reservation (with classes).
    class: Option<(String, Reservation)>,
    /// The measured guard's predicted TTFT on the pick (0: none predicted).
    predicted_ttft_s: f64,
}

/// Replays `trace` (arrival `i` at `(timestamp_i - timestamp_0) * time_scale` seconds) through the fleet.
pub fn replay(trace: &Trace, cfg: &SimConfig, time_scale: f64, policy: Box<dyn RoutingPolicy>) -> Outcome {
    Fleet::new(cfg, Router::new(policy)).run(trace, time_scale)
}

struct Fleet<'a> {
    cfg: &'a SimConfig,
    /// The gateway's one routing entry point (`kvgate_router::route`).
    router: Router,
    /// One registry per gateway replica (`SimConfig::gateway_replicas`).
    registries: Vec<Registry>,
    workers: Vec<SimWorker>,
    hasher: BlockHasher,
    base: Instant,
    inflight: HashMap<u64, InFlight>,
    /// Each replica's ring-key chooser.
    ring_keys: Vec<RingKeys>,
    /// The gateway's admission classes (`None`: no admission, every request routed at arrival).
    admission: Option<SimAdmission>,
    /// Sends on their way to the other replicas (`share_sends`): (when they arrive, sending replica, send), in
    /// time order (one delay for all).
    shared: VecDeque<(f64, usize, SharedSend)>,
    /// Each trace request's LoRA adapter (empty without `SimConfig::adapters`).
    adapter_of: Vec<Option<String>>,
    /// The `random_holder` rule's draws.
    rng: SplitMix64,
    _ssd: Option<tempfile::TempDir>,
    /// A moving mean of completed requests' output tokens (what the gateway learns of a class's output).
    learned_output: f64,
    out: Outcome,
}

/// The output the simulated gateway expects before any request completed (the gateway's default expected output).
const FIRST_EXPECTED_OUTPUT: f64 = 256.0;
/// Weight of a completed request in the learned output.
const LEARN_WEIGHT: f64 = 0.05;

impl<'a> Fleet<'a> {
    fn new(cfg: &'a SimConfig, router: Router) -> Self {
        let scheme = cfg.scheme();
        let n = cfg.workers;
        let base = Instant::now();
        // The SSD tiers' segment files (records without K/V bytes: the simulator keeps none), removed at the end.
        let ssd = (cfg.disk_kv_tokens_per_worker > 0)
            .then(|| tempfile::tempdir().unwrap_or_else(|e| panic!("simulated SSD tier: {e}")));
        let workers = (0..n)
            .map(|i| {
                let backend = SimBackend::new(cfg.vocab as usize, cfg.profile.max_model_len, Vec::new())
                    .with_timing(cfg.timing_of(i), SimClock::Virtual);
                let engine_cfg = EngineConfig {
                    num_blocks: cfg.kv_tokens_of(i) / scheme.block_size as usize,
                    scheme,
                    scheduler: cfg.scheduler.clone(),
                };
                let id = format!("sim-{i}");
                let bytes = cfg.host_kv_tokens_per_worker * backend.kv_bytes_per_token;
                let disk_bytes = (cfg.disk_kv_tokens_per_worker * backend.kv_bytes_per_token) as u64;
                let mut engine = Engine::new(engine_cfg, backend, None);
                engine.set_load_costs(cfg.timing_of(i).load_costs(cfg.kv_load_policy));
                let ssd_dir = ssd.as_ref().map(|d| d.path().join(format!("w{i}"))).unwrap_or_default();
                let engine = engine
                    .with_host_tier(bytes, cfg.kv_write_policy)
                    .and_then(|e| e.with_inline_disk_tier(&ssd_dir, disk_bytes, cfg.kv_write_policy, 0));
                let engine = match engine {
                    Ok(e) => e,
                    Err(e) => panic!("simulated KV tiers: {e}"),
                };
                SimWorker {
                    engine,
                    source: ReportSource {
                        advertise_url: format!("http://{id}.sim.invalid"),
                        worker_id: id,
                        model_id: SIM_MODEL.into(),
                        scheme,
                        granularity: cfg.summary_granularity,
                        fp_rate: cfg.bloom_fp_rate,
                        instance_id: i as u64 + 1,
                        max_model_len: u32::MAX,
                        pd: Default::default(),
                    },
                    busy_until: None,
                    pending: Vec::new(),
                    // Every worker reports at t = 0 (registration), then at its own phase.
                    next_report: 0.0,
                    seq: 0,
                    totals: EngineSnapshot::default(),
                    reported: EngineSnapshot::default(),
                    reported_at: 0.0,
                    lora: Resident::new(cfg.adapters.as_ref().map_or(0, |a| a.slots)),
                    loading: Vec::new(),
                    load_ready: HashMap::new(),
                }
            })
            .collect();
        Self {
            cfg,
            router,
            registries: (0..cfg.gateway_replicas.max(1)).map(|_| Registry::new(cfg.registry)).collect(),
            workers,
            hasher: BlockHasher::new(&scheme, &ExtraKeys::none()),
            base,
            inflight: HashMap::new(),
            ring_keys: (0..cfg.gateway_replicas.max(1))
                .map(|_| RingKeys::new(cfg.ring_sketch_entries, cfg.ring_hub_fanout))
                .collect(),
            admission: (!cfg.classes.is_empty()).then(|| SimAdmission::new(cfg.classes.clone(), base)),
            shared: VecDeque::new(),
            adapter_of: Vec::new(),
            rng: SplitMix64::new(0x5349_4D4C),
            _ssd: ssd,
            learned_output: FIRST_EXPECTED_OUTPUT,
            out: Outcome { busy_s: vec![0.0; n], ..Outcome::default() },
        }
    }

    fn instant(&self, t: f64) -> Instant {
        self.base + Duration::from_secs_f64(t.max(0.0))
    }

    fn run(mut self, trace: &Trace, time_scale: f64) -> Outcome {
        let t0 = trace.requests.first().map_or(0, |r| r.timestamp_ms);
        let arrival = |i: usize| (trace.requests[i].timestamp_ms - t0) as f64 / 1000.0 * time_scale;
        if let Some(a) = &self.cfg.adapters {
            self.adapter_of = a.adapters_of(trace);
        }
        let mut next = 0;
        loop {
            let t_arr = if next < trace.requests.len() { arrival(next) } else { f64::INFINITY };
            let step = argmin(self.workers.iter().map(|w| w.busy_until.unwrap_or(f64::INFINITY)));
            let loaded = argmin(
                self.workers.iter().map(|w| w.loading.iter().map(|l| l.0).fold(f64::INFINITY, f64::min)),
            );
            let waiting = self.admission.as_ref().is_some_and(|a| a.waiting() > 0);
            let idle = step.1.is_infinite()
                && loaded.1.is_infinite()
                && !waiting
                && self.shared.is_empty()
                && self.workers.iter().all(|w| !w.engine.has_work());
            if t_arr.is_infinite() && idle {
                break;
            }
            let report = argmin(self.workers.iter().map(|w| w.next_report));
            let t_adm = self.admission.as_ref().map_or(f64::INFINITY, SimAdmission::next_event);
            let t_share = self.shared.front().map_or(f64::INFINITY, |s| s.0);
            if t_share <= step.1 && t_share <= report.1 && t_share <= t_adm && t_share <= t_arr {
                self.apply_shared(t_share);
            } else if loaded.1 <= step.1 && loaded.1 <= report.1 && loaded.1 <= t_adm && loaded.1 <= t_arr {
                self.adapter_loaded(loaded.0, loaded.1);
            } else if step.1 <= report.1 && step.1 <= t_adm && step.1 <= t_arr {
                self.finish_step(step.0, step.1);
            } else if report.1 <= t_adm && report.1 <= t_arr {
                self.report(report.0, report.1);
            } else if t_adm <= t_arr {
                self.pump_admission(t_adm);
            } else {
                self.arrive(trace, next, t_arr);
                next += 1;
            }
        }
        for w in &self.workers {
            let s = w.engine.stats();
            self.out.preemptions += s.preemptions;
            self.out.evictions += s.evictions;
            self.out.host_stored_bytes += s.host.stored_bytes;
            self.out.host_hit_blocks += s.host.hit_blocks;
            self.out.disk_read_blocks += s.disk.read_blocks;
            let d = w.engine.scheduler().kv().decisions();
            self.out.recomputed_tokens += d.recomputed_tokens.load(std::sync::atomic::Ordering::Relaxed);
        }
        self.out
    }

    /// A request arrives at the gateway: prepared (hashes, ring key), then admitted by its class budget (priced
    /// by a dry run of the routing decision, as the proxy does) or, without classes, routed at once.
    fn arrive(&mut self, trace: &Trace, i: usize, t: f64) {
        let r = &trace.requests[i];
        let tokens = expand_prompt(r, self.cfg.vocab);
        let hashes = match self.adapter(i) {
            // An adapter's blocks are keyed by it, as a kvgate worker and the gateway key them.
            Some(a) => BlockHasher::new(&self.cfg.scheme(), &adapter_keys(a)).hash_blocks(&tokens),
            None => self.hasher.hash_blocks(&tokens),
        };
        let replica = self.replica(i);
        let ring = self.ring_keys[replica].route_key(None, &hashes, &tokens, true);
        let max_tokens = r.output_length.max(1) as u32;
        let Some(adm) = &self.admission else {
            self.dispatch(i, t, t, &tokens, &hashes, ring, max_tokens, None);
            return;
        };
        let (class_idx, class) = adm.classify(tokens.len(), max_tokens, SIM_MODEL);
        let adapter = self.adapter(i).map(str::to_owned);
        let input = self.route_input(&tokens, &hashes, ring, adapter.as_deref());
        // An adapter nobody holds is priced as a whole prompt (the placement loads it at dispatch).
        let priced = self.router.dry_run(&self.registries[replica], &input, 1, self.instant(t));
        let uncached = match (priced, adapter) {
            (Some(p), _) => p.uncached_tokens,
            (None, Some(_)) => tokens.len() as u64,
            (None, None) => {
                self.out.rejected += 1;
                return;
            }
        };
        let cost = (uncached + u64::from(max_tokens)) as f64;
        let ready =
            Ready { request: i, arrival: t, tokens, hashes, ring, max_tokens, class: class.clone(), cost };
        let Some(adm) = self.admission.as_mut() else { return };
        match adm.offer(class_idx, ready, t) {
            Admitted::Now(ready, reservation) => self.dispatch_ready(ready, reservation, t),
            Admitted::Waiting => self.pump_admission(t),
            Admitted::Refused => {
                self.out.rejected += 1;
                self.out.classes.entry(class).or_default().refused += 1;
            }
        }
    }

    /// The gateway replica request `i` reaches (a load balancer spreading requests evenly).
    fn replica(&self, i: usize) -> usize {
        i % self.registries.len()
    }

    fn route_input<'h>(
        &self,
        tokens: &[u32],
        hashes: &'h [BlockHash],
        ring: RingKey,
        adapter: Option<&'h str>,
    ) -> RouteInput<'h> {
        RouteInput {
            model: SIM_MODEL,
            hashes,
            prompt_tokens: tokens.len(),
            session_key: ring.key,
            shared_blocks: ring.shared_blocks,
            block_size: self.cfg.block_size as usize,
            only: None,
            adapter,
            // What the gateway knows of the output before it is produced: the completed requests' mean (its
            // learned output; the trace's own output length is not shown to the policy), and the SLOs.
            output_tokens: self.learned_output.round() as u64,
            slo: self.cfg.slo,
        }
    }

    /// Request `i`'s adapter, if any.
    fn adapter(&self, i: usize) -> Option<&str> {
        self.adapter_of.get(i).and_then(|a| a.as_deref())
    }

    /// Serves the class queues at `t` and refuses waiters past their deadline.
    fn pump_admission(&mut self, t: f64) {
        let Some(adm) = self.admission.as_mut() else { return };
        let Pumped { served, timed_out } = adm.pump(t);
        for ready in timed_out {
            self.out.rejected += 1;
            self.out.classes.entry(ready.class).or_default().timed_out += 1;
        }
        for (ready, reservation) in served {
            self.dispatch_ready(ready, reservation, t);
        }
    }

    fn dispatch_ready(&mut self, ready: Ready, reservation: Reservation, t: f64) {
        let class = Some((ready.class, reservation));
        let (tokens, hashes) = (ready.tokens, ready.hashes);
        self.dispatch(ready.request, ready.arrival, t, &tokens, &hashes, ready.ring, ready.max_tokens, class);
    }

    /// Routes request `i` (arrived at `arrival`) at `t` on the registry as it is now, and queues it on the pick.
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        i: usize,
        arrival: f64,
        t: f64,
        tokens: &[u32],
        hashes: &[BlockHash],
        ring: RingKey,
        max_tokens: u32,
        class: Option<(String, Reservation)>,
    ) {
        if let Some((name, _)) = &class {
            self.out.classes.entry(name.clone()).or_default().wait_s.push(t - arrival);
        }
        let now = self.instant(t);
        let replica = self.replica(i);
        let adapter = self.adapter(i).map(str::to_owned);
        let input = self.route_input(tokens, hashes, ring, adapter.as_deref());
        let pinned = match self.place_adapter(replica, &input, now) {
            Ok(p) => p,
            Err(()) => {
                self.refuse(class, t);
                return;
            }
        };
        let only: Vec<String> = pinned
            .map(|w| {
                vec![kvgate_router::input::url_address(&self.registries[replica].workers()[w].url).to_owned()]
            })
            .unwrap_or_default();
        let mut input = self.route_input(tokens, hashes, ring, adapter.as_deref());
        if pinned.is_some() {
            // The placement chose this worker; it may not hold the adapter yet (it loads it below).
            input = RouteInput { only: Some(&only), adapter: None, ..input };
        }
        let routed = self.router.route(&mut self.registries[replica], &input, 1, now);
        let Some(ticket) = routed.as_ref().and_then(|r| r.ticket) else {
            self.refuse(class, t);
            return;
        };
        let uncached = routed.as_ref().map_or(0, |r| r.uncached_tokens);
        let predicted_ttft_s = routed.as_ref().map_or(0.0, |r| {
            let pick = r.candidates.first().map(|c| c.id.as_str());
            r.terms.iter().find(|x| Some(x.worker.as_str()) == pick).map_or(0.0, |x| x.predicted_ttft_s)
        });
        let reason = routed.map_or("none", |r| r.reason.as_str());
        // Registry indices are worker indices: every simulated worker registers at t = 0 and none is forgotten.
        let w = ticket.idx;
        let tickets = vec![(replica, ticket)];
        if self.cfg.share_sends && self.registries.len() > 1 {
            let send = SharedSend::new(&self.workers[w].source.worker_id, hashes, uncached, Some(ring.key));
            self.shared.push_back((t + self.cfg.share_delay_s, replica, send));
        }
        *self.out.routes.entry(reason.to_owned()).or_default() += 1;
        let params =
            SamplingParams { max_tokens, temperature: 0.0, ignore_eos: true, ..SamplingParams::default() };
        let req = EngineRequest {
            id: i as u64,
            prompt: tokens.to_vec(),
            params,
            // The simulated engine runs no adapter math; its blocks are keyed by the adapter all the same.
            extra_keys: adapter.as_deref().map_or_else(ExtraKeys::none, adapter_keys),
            adapter: None,
        };
        let flight = InFlight {
            arrival,
            first_at: None,
            prompt_tokens: tokens.len(),
            tickets,
            class,
            predicted_ttft_s,
        };
        if let Some(name) = &adapter {
            let ready = self.ensure_adapter(w, replica, name, t);
            if ready > t {
                self.inflight.insert(i as u64, flight);
                self.workers[w].loading.push((ready, req));
                return;
            }
        }
        self.workers[w].engine.backend_mut().set_now(t);
        match self.workers[w].engine.add_request(req) {
            Ok(()) => {
                self.inflight.insert(i as u64, flight);
                if self.workers[w].busy_until.is_none() {
                    self.start_step(w, t);
                }
            }
            Err(e) => {
                tracing::debug!(request = i, error = %e, "simulated worker refused the request");
                for (q, ticket) in flight.tickets {
                    self.registries[q].record_done(ticket);
                }
                self.refuse(flight.class, t);
            }
        }
    }

    /// The oldest send in flight between replicas reaches the others.
    fn apply_shared(&mut self, t: f64) {
        let Some((_, from, send)) = self.shared.pop_front() else { return };
        let now = self.instant(t);
        for (_, reg) in self.registries.iter_mut().enumerate().filter(|(q, _)| *q != from) {
            reg.record_shared_send(&send, now);
        }
    }

    /// A request that got no worker: counted, and its reservation refunded.
    fn refuse(&mut self, class: Option<(String, Reservation)>, t: f64) {
        self.out.rejected += 1;
        if let (Some((_, r)), Some(adm)) = (class, self.admission.as_mut()) {
            adm.settle(&r, 0.0, t);
            self.pump_admission(t);
        }
    }

    fn finish_step(&mut self, w: usize, t: f64) {
        self.workers[w].busy_until = None;
        let outputs = std::mem::take(&mut self.workers[w].pending);
        for o in outputs {
            self.deliver(o, t);
        }
        self.start_step(w, t);
    }

    fn deliver(&mut self, o: StepOutput, t: f64) {
        let Some(f) = self.inflight.get_mut(&o.id) else { return };
        if o.token.is_some() && f.first_at.is_none() {
            f.first_at = Some(t);
            self.out.ttft_s.push(t - f.arrival);
            if f.predicted_ttft_s > 0.0 {
                self.out.ttft_predicted.push((f.predicted_ttft_s, t - f.arrival));
            }
            if let Some((class, _)) = &f.class {
                self.out.classes.entry(class.clone()).or_default().ttft_s.push(t - f.arrival);
            }
        }
        if let Some(reason) = o.finished {
            if let Some(f) = self.inflight.remove(&o.id) {
                self.account_slo(&f, o.completion_tokens, t);
                for (q, ticket) in f.tickets {
                    self.registries[q].record_done(ticket);
                }
                if let (Some((class, r)), Some(adm)) = (f.class, self.admission.as_mut()) {
                    // The real cost, as the proxy reconciles it from the response's usage.
                    let actual =
                        (o.prompt_tokens.saturating_sub(o.cached_tokens) + o.completion_tokens) as f64;
                    adm.settle(&r, actual, t);
                    self.out.classes.entry(class).or_default().completed += 1;
                    self.pump_admission(t);
                }
            }
            if matches!(reason, FinishReason::Error(_)) {
                self.out.errors += 1;
            }
            self.out.completed += 1;
            self.out.prompt_tokens += o.prompt_tokens as u64;
            self.out.cached_tokens += o.cached_tokens as u64;
        }
        self.out.end_s = self.out.end_s.max(t);
    }

    /// A finished request's TPOT, E2E and whether its tokens count as goodput (`SimConfig::slo`).
    fn account_slo(&mut self, f: &InFlight, completion: usize, t: f64) {
        let Some(first) = f.first_at else { return };
        let ttft = first - f.arrival;
        let tpot = (completion > 1).then(|| (t - first) / (completion - 1) as f64);
        self.out.tpot_s.extend(tpot);
        self.out.e2e_s.push(t - f.arrival);
        self.out.completion_tokens += completion as u64;
        self.learned_output += LEARN_WEIGHT * (completion as f64 - self.learned_output);
        if self.cfg.slo.met(f.prompt_tokens, ttft, tpot) {
            self.out.slo_met += 1;
            self.out.good_tokens += completion as u64;
        }
    }

    /// Runs the worker's next step if it has work. A plan can come out empty (the only running sequence was
    /// preempted to make room); the next call admits it again, so a few tries always make progress.
    fn start_step(&mut self, w: usize, t: f64) {
        let worker = &mut self.workers[w];
        for _ in 0..4 {
            if !worker.engine.has_work() {
                return;
            }
            let before = worker.engine.scheduler().counters();
            worker.engine.backend_mut().set_now(t);
            let outputs = worker.engine.step();
            let dt = worker.engine.backend_mut().take_elapsed();
            let after = worker.engine.scheduler().counters();
            let computed = after.scheduled_tokens - before.scheduled_tokens;
            if computed == 0 && outputs.is_empty() {
                continue;
            }
            // The engine thread's bookkeeping of the step (what the worker's report measures).
            let generated = outputs.iter().filter(|o| o.token.is_some()).count() as u64;
            let totals = &mut worker.totals;
            totals.decode_tokens += generated;
            totals.prefill_tokens += computed.saturating_sub(generated);
            totals.steps += 1;
            time_step(totals, StepWork::between(&before, &after), dt);
            self.out.busy_s[w] += dt;
            worker.busy_until = Some(t + dt);
            worker.pending = outputs;
            return;
        }
    }

    /// Where the adapter request `input` goes under the configured rule: `Ok(None)` among the holders (the routing
    /// policy picks), `Ok(Some(w))` pinned to worker `w` (which loads the adapter if it lacks it), `Err` nowhere.
    fn place_adapter(
        &mut self,
        replica: usize,
        input: &RouteInput<'_>,
        now: Instant,
    ) -> Result<Option<usize>, ()> {
        let (Some(sim), Some(name)) = (&self.cfg.adapters, input.adapter) else { return Ok(None) };
        let reg = &self.registries[replica];
        let healthy = |reg: &Registry| -> Vec<(usize, u64)> {
            let (views, index) = reg.views(input.model, input.hashes, None, now);
            let per_request = self.cfg.weights.per_request_tokens;
            views
                .iter()
                .zip(index)
                .filter(|(v, _)| v.healthy)
                .map(|(v, i)| (i, v.load.cost(per_request)))
                .collect()
        };
        match sim.rule {
            Rule::Cost => {
                let cfg = PlaceConfig { default_load_s: sim.load_s, ..PlaceConfig::default() };
                match place(reg, input, true, &cfg, now).map(|p| p.choice) {
                    None | Some(Choice::Holders) => Ok(None),
                    Some(Choice::Load { wref, .. }) => reg.find(wref).map(Some).ok_or(()),
                    Some(Choice::Nowhere) => Err(()),
                }
            }
            Rule::Anywhere => {
                let blind = RouteInput { adapter: None, ..*input };
                let pick = self
                    .router
                    .dry_run(reg, &blind, 1, now)
                    .and_then(|r| r.candidates.first().map(|c| c.wref));
                pick.and_then(|w| reg.find(w)).map(Some).ok_or(())
            }
            Rule::RandomHolder => {
                let all = healthy(reg);
                let holders: Vec<usize> =
                    all.iter().map(|(i, _)| *i).filter(|i| reg.workers()[*i].lora.holds(name, now)).collect();
                let pool = if holders.is_empty() { all.iter().map(|(i, _)| *i).collect() } else { holders };
                match pool.len() {
                    0 => Err(()),
                    n => Ok(Some(pool[self.rng.below(n as u64) as usize])),
                }
            }
            Rule::LeastLoaded => {
                healthy(reg).into_iter().min_by_key(|(_, cost)| *cost).map(|(i, _)| Some(i)).ok_or(())
            }
        }
    }

    /// Worker `w` gets adapter `name` for a request at `t`: loaded if it lacks it (the gateway's replica
    /// `replica` records the load), else used. Returns when the request may start (a load in progress delays it).
    fn ensure_adapter(&mut self, w: usize, replica: usize, name: &str, t: f64) -> f64 {
        let load_s = self.cfg.adapters.as_ref().map_or(0.0, |a| a.load_s);
        let worker = &mut self.workers[w];
        if worker.lora.holds(name) {
            worker.lora.touch(name);
            return worker.load_ready.get(name).copied().unwrap_or(t).max(t);
        }
        if worker.lora.load(name).is_some() {
            self.out.adapter_evictions += 1;
        }
        self.out.adapter_loads += 1;
        let ready = t + load_s;
        worker.load_ready.insert(name.to_owned(), ready);
        let now = self.instant(t);
        let reg = &mut self.registries[replica];
        if let Some(r) = reg.worker_ref(w) {
            reg.record_adapter_load(r, name, Ok(Some(adapter_key(name))), load_s, now);
        }
        ready
    }

    /// The earliest adapter load on worker `w` completed at `t`: its waiting request joins the engine.
    fn adapter_loaded(&mut self, w: usize, t: f64) {
        let worker = &mut self.workers[w];
        let Some(j) =
            worker.loading.iter().enumerate().min_by(|a, b| a.1 .0.total_cmp(&b.1 .0)).map(|(j, _)| j)
        else {
            return;
        };
        let (_, req) = worker.loading.swap_remove(j);
        let id = req.id;
        worker.engine.backend_mut().set_now(t);
        if let Err(e) = worker.engine.add_request(req) {
            tracing::debug!(request = id, error = %e, "simulated worker refused the request");
            if let Some(f) = self.inflight.remove(&id) {
                for (q, ticket) in f.tickets {
                    self.registries[q].record_done(ticket);
                }
                self.refuse(f.class, t);
            }
            return;
        }
        if self.workers[w].busy_until.is_none() {
            self.start_step(w, t);
        }
    }

    fn report(&mut self, w: usize, t: f64) {
        let now = self.instant(t);
        let n = self.workers.len() as f64;
        let interval = self.cfg.report_interval_s;
        let worker = &mut self.workers[w];
        worker.seq += 1;
        let stats = worker.engine.stats();
        let kv = worker.engine.scheduler().kv();
        let summaries = summarise_tiers(kv, worker.source.granularity, worker.source.fp_rate);
        let secs = (t - worker.reported_at).max(1e-3);
        let (prev, totals) = (&worker.reported, &worker.totals);
        let throughput = Throughput {
            prefill_tokens_per_s: totals.prefill_tokens.saturating_sub(prev.prefill_tokens) as f64 / secs,
            decode_tokens_per_s: totals.decode_tokens.saturating_sub(prev.decode_tokens) as f64 / secs,
        };
        let mut report =
            worker.source.assemble(worker.seq, (t * 1000.0) as u64, &stats, throughput, summaries, false);
        report.pd.timing = step_timing(prev, totals);
        report.lora = worker.lora.info();
        (worker.reported, worker.reported_at) = (worker.totals, t);
        let fingerprint = worker.source.scheme.fingerprint();
        // The first report registers the worker at t = 0; later ones come at phase w / n of the interval.
        worker.next_report =
            if worker.seq == 1 { interval * (1.0 + w as f64 / n) } else { worker.next_report + interval };
        for reg in &mut self.registries {
            reg.ingest(report.clone(), Some(fingerprint), now);
            if worker.seq == 1 {
                debug_assert_eq!(reg.workers()[w].id, worker.source.worker_id);
            }
        }
    }
}

/// The extra keys of adapter `name`'s blocks.
fn adapter_keys(name: &str) -> ExtraKeys {
    ExtraKeys::none().with(ExtraKey::LoraAdapter(adapter_key(name)))
}

/// Index and value of the smallest element (ties: the first).
fn argmin(values: impl Iterator<Item = f64>) -> (usize, f64) {
    values.enumerate().fold((0, f64::INFINITY), |best, (i, v)| if v < best.1 { (i, v) } else { best })
}
