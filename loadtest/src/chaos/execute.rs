//! The fault executor of a chaos run and its scrapes: each fault of the schedule carried out at its start and
//! undone at its end; a process's counters scraped just before it is killed (so what it charged or computed is
//! not lost with it, and the stretch between the scrape and the kill is known: [`Blind`]); and, after the run, what
//! is still held ([`held`]).
//!
//! Invariants: faults run one at a time, in schedule order; every fault that could not be carried out as
//! scheduled says why in the notes (a run never claims a fault it did not inject); the tiered worker's SSD
//! directory is freed at the fault's end even when filling it failed half-way.

use std::io::Write;
use std::time::Duration;

use serde_json::Value;

use super::charges::{add_charged, add_computed, Blind, Counters};
use super::deploy::{Deployment, Managed, PREFILL};
use super::drive::{burst_loop, slow_loop, Drive};
use super::schedule::{Fault, FaultKind};

/// Why a fault could not be carried out or undone (recorded in the run's notes; the run goes on: the next fault is
/// independent, so nothing is retried).
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// The SSD directory is not a tmpfs of the run's own (no right to mount one).
    #[error("no tmpfs of its own to fill ({0})")]
    NoTmpfs(String),
    /// Filling or freeing the directory failed other than by a full filesystem.
    #[error("after {written} bytes: {source}")]
    Fill { written: u64, source: std::io::Error },
    #[error("freeing the filler: {0}")]
    Free(std::io::Error),
    /// Signalling or restarting a process failed (its message names it).
    #[error("{0}")]
    Process(String),
}

/// How long a prefill kill waits for a transfer in flight before it kills anyway (and says so).
pub const PREFILL_KILL_WAIT: Duration = Duration::from_secs(4);

/// What the executor saw: a line per fault worth reading, the counters of the process lives it ended, and the
/// stretches those counters could not see.
#[derive(Default)]
pub struct Executed {
    pub notes: Vec<String>,
    pub counters: Counters,
    pub blind: Vec<Blind>,
}

/// One process's `/metrics` text (`base`: its HTTP URL, or a gateway's control URL).
/// Within 5 s, body included: every await of the executor is bounded.
pub async fn metrics_text(base: &str) -> Result<String, String> {
    use http_body_util::BodyExt;
    let client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let req = hyper::Request::get(format!("{base}/metrics"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .map_err(|e| e.to_string())?;
    let read = async {
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        resp.into_body().collect().await.map(|b| b.to_bytes()).map_err(|e| e.to_string())
    };
    let body =
        tokio::time::timeout(Duration::from_secs(5), read).await.map_err(|_| "timeout".to_string())??;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// A metric's value in an exposition (`series`: the name with its labels, as printed).
pub fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

impl Executed {
    /// Scrapes worker `i` and kills it, recording the blind stretch between.
    async fn kill_worker(&mut self, d: &mut Deployment, i: usize, now: f64) {
        let w = &mut d.workers[i];
        match metrics_text(&w.url).await {
            Ok(m) => add_computed(&m, &mut self.counters),
            Err(e) => self.notes.push(format!("{}: not scraped before its kill ({e})", w.name)),
        }
        w.kill();
        self.blind.push(Blind { process: format!("w{i}"), from_s: now - 1.0, to_s: now + 0.5 });
    }

    /// Scrapes gateway replica `i` and kills it.
    async fn kill_gateway(&mut self, d: &mut Deployment, i: usize, now: f64) {
        match metrics_text(&d.controls[i]).await {
            Ok(m) => add_charged(&m, &mut self.counters),
            Err(e) => self.notes.push(format!("gateway-{i}: not scraped before its kill ({e})")),
        }
        d.gateways[i].kill();
        self.blind.push(Blind { process: format!("gateway-{i}"), from_s: now - 1.0, to_s: now + 0.5 });
    }

    /// Every live process's counters, at the end of the run.
    pub async fn scrape_all(&mut self, d: &Deployment) {
        for (i, c) in d.controls.iter().enumerate() {
            match metrics_text(c).await {
                Ok(m) => add_charged(&m, &mut self.counters),
                Err(e) => self.notes.push(format!("gateway-{i}: not scraped at the end ({e})")),
            }
        }
        for w in &d.workers {
            match metrics_text(&w.url).await {
                Ok(m) => add_computed(&m, &mut self.counters),
                Err(e) => self.notes.push(format!("{}: not scraped at the end ({e})", w.name)),
            }
        }
    }
}

/// Waits (up to [`PREFILL_KILL_WAIT`]) until the prefill worker holds a transfer lease: the kill then lands mid-
/// transfer. The leases it held, or `None` if none came.
async fn await_transfer(p: &Managed) -> Option<f64> {
    let until = tokio::time::Instant::now() + PREFILL_KILL_WAIT;
    while tokio::time::Instant::now() < until {
        if let Ok(m) = metrics_text(&p.url).await {
            if let Some(n) = value(&m, "kvgate_worker_kv_transfer_leases").filter(|n| *n > 0.0) {
                return Some(n);
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// A worker's SSD tier: (blocks written, writes dropped) so far.
async fn disk_writes(w: &Managed) -> Option<(f64, f64)> {
    let m = metrics_text(&w.url).await.ok()?;
    Some((
        value(&m, "kvgate_worker_disk_kv_written_blocks")?,
        value(&m, "kvgate_worker_disk_kv_dropped_writes")?,
    ))
}

/// The filler of a full SSD directory.
const FILLER: &str = "chaos-filler";

/// Writes a filler into `dir` until its filesystem is full: the bytes written.
fn fill(dir: &std::path::Path) -> Result<u64, FaultError> {
    let mut f =
        std::fs::File::create(dir.join(FILLER)).map_err(|source| FaultError::Fill { written: 0, source })?;
    let chunk = vec![0u8; 1 << 20];
    let mut written = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => return Ok(written),
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(28) => return Ok(written), // ENOSPC: full
            Err(source) => return Err(FaultError::Fill { written, source }),
        }
    }
}

/// The executor's state across faults.
struct Executor<'a> {
    ex: Executed,
    drive: &'a Drive,
    seed: u64,
    tenants: usize,
    /// The client loops a fault started (slow readers, a burst), awaited at the end.
    clients: Vec<tokio::task::JoinHandle<()>>,
    /// The SSD tier's (written, dropped) when it was filled.
    disk_before: Option<(f64, f64)>,
}

impl Executor<'_> {
    fn now(&self) -> f64 {
        self.drive.started.elapsed().as_secs_f64()
    }

    /// Carries out fault `f`.
    async fn start(&mut self, d: &mut Deployment, f: &Fault) -> Result<(), FaultError> {
        match f.kind {
            FaultKind::KillWorker => self.ex.kill_worker(d, f.target, self.now()).await,
            FaultKind::KillPrefill => {
                let held = await_transfer(&d.workers[PREFILL]).await;
                let at = self.now();
                self.ex.kill_worker(d, f.target, at).await;
                self.ex.notes.push(match held {
                    Some(n) => format!("kill_prefill at {at:.1} s: killed holding {n} transfer lease(s)"),
                    None => format!(
                        "kill_prefill at {at:.1} s: no transfer in flight within {PREFILL_KILL_WAIT:?}; killed idle"
                    ),
                });
            }
            FaultKind::StopWorker => return d.workers[f.target].signal("-STOP").map_err(FaultError::Process),
            FaultKind::RestartRedis => d.redis.kill(),
            FaultKind::RestartGateway => self.ex.kill_gateway(d, f.target, self.now()).await,
            FaultKind::FillSsd => {
                if let Err(why) = &d.ssd_mounted {
                    return Err(FaultError::NoTmpfs(why.clone()));
                }
                self.disk_before = disk_writes(&d.workers[f.target]).await;
                let n = fill(&d.ssd_dir)?;
                let at = self.now();
                self.ex
                    .notes
                    .push(format!("fill_ssd at {at:.1} s: {} MiB written, the tmpfs is full", n >> 20));
            }
            FaultKind::SlowClients => {
                for i in 0..8 {
                    let tenant = i % self.tenants;
                    let l = slow_loop(self.drive.clone(), tenant, self.seed + i as u64, f.end_s);
                    self.clients.push(tokio::spawn(l));
                }
            }
            FaultKind::BudgetBurst => {
                for i in 0..4 {
                    let l = burst_loop(self.drive.clone(), f.target, self.seed + i, f.end_s);
                    self.clients.push(tokio::spawn(l));
                }
            }
        }
        Ok(())
    }

    /// Undoes fault `f`.
    async fn end(&mut self, d: &mut Deployment, f: &Fault) -> Result<(), FaultError> {
        match f.kind {
            FaultKind::KillWorker | FaultKind::KillPrefill => {
                d.workers[f.target].restart().map_err(FaultError::Process)
            }
            FaultKind::StopWorker => d.workers[f.target].signal("-CONT").map_err(FaultError::Process),
            FaultKind::RestartRedis => d.redis.restart().map_err(FaultError::Process),
            FaultKind::RestartGateway => d.gateways[f.target].restart().map_err(FaultError::Process),
            FaultKind::FillSsd => {
                if let (Some(b), Some(a)) = (self.disk_before.take(), disk_writes(&d.workers[f.target]).await)
                {
                    self.ex.notes.push(format!(
                        "fill_ssd: while full, the SSD tier wrote {} blocks and dropped {} writes",
                        a.0 - b.0,
                        a.1 - b.1
                    ));
                }
                match std::fs::remove_file(d.ssd_dir.join(FILLER)) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(FaultError::Free(e)),
                    _ => Ok(()),
                }
            }
            FaultKind::SlowClients | FaultKind::BudgetBurst => Ok(()),
        }
    }
}

/// Carries out the schedule: each fault at its start, undone at its end.
pub async fn execute(
    d: &tokio::sync::Mutex<Deployment>,
    drive: &Drive,
    faults: &[Fault],
    seed: u64,
    tenants: usize,
) -> Executed {
    let mut x =
        Executor { ex: Executed::default(), drive, seed, tenants, clients: Vec::new(), disk_before: None };
    for f in faults {
        tokio::time::sleep(Duration::from_secs_f64((f.start_s - x.now()).max(0.0))).await;
        eprintln!("fault {} on {} at {:.1} s", f.kind.as_str(), f.target, f.start_s);
        if let Err(e) = x.start(&mut *d.lock().await, f).await {
            x.ex.notes.push(format!("{} at {:.1} s could not start: {e}", f.kind.as_str(), f.start_s));
        }
        tokio::time::sleep(Duration::from_secs_f64((f.end_s - x.now()).max(0.0))).await;
        if let Err(e) = x.end(&mut *d.lock().await, f).await {
            x.ex.notes.push(format!("{} could not end: {e}", f.kind.as_str()));
        }
        eprintln!("fault {} ended at {:.1} s", f.kind.as_str(), x.now());
    }
    for c in x.clients.drain(..) {
        let _ = c.await;
    }
    x.ex
}

/// What is still held after the quiet period: each worker's KV blocks not all free, requests queued or running,
/// transfer leases, imports waiting or export staging; each replica's in-flight requests or admission permits.
pub async fn held(d: &Deployment) -> Vec<String> {
    let mut out = Vec::new();
    for w in &d.workers {
        let text = match metrics_text(&w.url).await {
            Ok(t) => t,
            Err(e) => {
                out.push(format!("{}: no metrics ({e})", w.name));
                continue;
            }
        };
        let m = |s: &str| value(&text, s);
        let (total, free) =
            (m("kvgate_worker_kv_blocks{state=\"total\"}"), m("kvgate_worker_kv_blocks{state=\"free\"}"));
        if total != free {
            out.push(format!("{}: KV blocks free {free:?} of {total:?} after the quiet period", w.name));
        }
        for series in [
            "kvgate_worker_queue_requests{state=\"waiting\"}",
            "kvgate_worker_queue_requests{state=\"running\"}",
            "kvgate_worker_kv_transfer_leases",
            "kvgate_worker_kv_imports_waiting",
            "kvgate_worker_kv_export_backlog_bytes",
        ] {
            let n = m(series).unwrap_or(0.0);
            if n != 0.0 {
                out.push(format!("{}: {series} is {n} after the quiet period", w.name));
            }
        }
    }
    for c in &d.controls {
        if let Ok(Value::Array(ws)) = crate::fleet::get_json(&format!("{c}/kvgate/v1/workers")).await {
            for w in ws {
                if w["inflight"].as_u64().unwrap_or(0) != 0 {
                    out.push(format!(
                        "{c}: worker {} has {} in flight after the quiet period",
                        w["id"], w["inflight"]
                    ));
                }
            }
        }
        match metrics_text(c).await {
            Ok(text) => {
                for l in text.lines().filter(|l| l.starts_with("kvgate_gateway_admission_permits_held{")) {
                    if l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) != Some(0.0) {
                        out.push(format!("{c}: {l} after the quiet period"));
                    }
                }
            }
            Err(e) => out.push(format!("{c}: no metrics ({e})")),
        }
    }
    out
}
