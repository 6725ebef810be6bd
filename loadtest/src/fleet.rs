//! A local fleet for `compare`, `up` and `demo`: one `kvgate-gateway` and N `kvgate-worker serve` processes on
//! 127.0.0.1, started from the binaries next to this one. Every process it starts is killed when the
//! [`LocalFleet`] is dropped (normal end, error, or Ctrl-C unwinding the task that owns it). Their output goes to
//! log files in `log_dir`, named in every error.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// What the workers compute with.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkerEngine {
    /// The real CPU engine on a synthesized model.
    Cpu,
    /// The simulated engine with a timing profile (name or file).
    Sim { profile: String },
}

/// The fleet to start.
#[derive(Clone, Debug)]
pub struct FleetSpec {
    pub workers: usize,
    pub engine: WorkerEngine,
    /// Synthetic model preset (`tiny`, `small`); the workers synthesize it once if absent.
    pub synth: String,
    /// Where the synthesized model lives (None: the worker's default cache directory).
    pub synth_dir: Option<PathBuf>,
    pub kv_cache_tokens: usize,
    pub policy: String,
    /// `RAYON_NUM_THREADS` of each CPU worker (None: the worker's default, all cores).
    pub worker_threads: Option<usize>,
    pub log_dir: PathBuf,
    /// Where `kvgate-gateway` and `kvgate-worker` are.
    pub bin_dir: PathBuf,
    /// How long to wait for the fleet to be ready.
    pub ready_timeout: Duration,
}

struct Proc {
    name: String,
    log: PathBuf,
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running fleet; dropping it stops every process.
pub struct LocalFleet {
    procs: Vec<Proc>,
    /// The gateway's OpenAI base URL.
    pub gateway: String,
    /// The gateway's control base URL (reports, metrics, worker states).
    pub control: String,
    pub workers: Vec<String>,
    /// The model the fleet serves.
    pub model: String,
}

/// The directory of the running executable (where cargo puts the sibling binaries), or `$KVGATE_BIN_DIR`.
pub fn default_bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVGATE_BIN_DIR") {
        return PathBuf::from(d);
    }
    std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or_default()
}

fn free_port() -> Result<u16, String> {
    kvgate_shared::ports::free_loopback_port().map_err(|e| e.to_string())
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

impl LocalFleet {
    /// Starts the gateway and the workers and waits until the gateway sees every worker healthy with a fresh
    /// cache summary.
    pub async fn start(spec: &FleetSpec) -> Result<Self, String> {
        let bin = |name: &str| -> Result<PathBuf, String> {
            let p = spec.bin_dir.join(name);
            if p.exists() {
                Ok(p)
            } else {
                Err(format!(
                    "{} not found: build it first (cargo build --release -p {name}) or set KVGATE_BIN_DIR",
                    p.display()
                ))
            }
        };
        let (gw_bin, worker_bin) = (bin("kvgate-gateway")?, bin("kvgate-worker")?);
        std::fs::create_dir_all(&spec.log_dir).map_err(|e| format!("{}: {e}", spec.log_dir.display()))?;
        let secret = format!("kvgate-local-{}", std::process::id());
        let (port, cport) = (free_port()?, free_port()?);
        let gateway = format!("http://127.0.0.1:{port}");
        let control = format!("http://127.0.0.1:{cport}");
        let mut fleet =
            Self { procs: Vec::new(), gateway, control, workers: Vec::new(), model: String::new() };
        let mut worker_ports = Vec::new();
        for _ in 0..spec.workers {
            worker_ports.push(free_port()?);
        }
        let mut gw_args: Vec<String> = vec![
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--control-listen".into(),
            format!("127.0.0.1:{cport}"),
            "--report-secret".into(),
            secret.clone(),
            "--policy".into(),
            spec.policy.clone(),
        ];
        for p in &worker_ports {
            gw_args.extend(["--worker".into(), format!("http://127.0.0.1:{p}")]);
        }
        fleet.spawn(&gw_bin, &gw_args, "gateway", &spec.log_dir, &[])?;
        for (i, p) in worker_ports.iter().enumerate() {
            let mut args: Vec<String> = vec![
                "serve".into(),
                "--synth".into(),
                spec.synth.clone(),
                "--host".into(),
                "127.0.0.1".into(),
                "--port".into(),
                p.to_string(),
                "--worker-id".into(),
                format!("w{i}"),
                "--report-to".into(),
                fleet.control.clone(),
                "--report-secret".into(),
                secret.clone(),
                "--kv-cache-tokens".into(),
                spec.kv_cache_tokens.to_string(),
            ];
            if let Some(d) = &spec.synth_dir {
                args.extend(["--synth-dir".into(), d.display().to_string()]);
            }
            if let WorkerEngine::Sim { profile } = &spec.engine {
                args.extend(["--engine".into(), "sim".into(), "--sim-profile".into(), profile.clone()]);
            }
            let threads = spec.worker_threads.map(|t| t.to_string());
            let env: Vec<(&str, &str)> = threads.iter().map(|t| ("RAYON_NUM_THREADS", t.as_str())).collect();
            let url = format!("http://127.0.0.1:{p}");
            fleet.spawn(&worker_bin, &args, &format!("worker-w{i}"), &spec.log_dir, &env)?;
            // The first worker may synthesize the model: let it finish before the others start.
            if i == 0 {
                fleet.wait_http(&format!("{url}/ready"), spec.ready_timeout).await?;
            }
            fleet.workers.push(url);
        }
        for w in fleet.workers.clone() {
            fleet.wait_http(&format!("{w}/ready"), spec.ready_timeout).await?;
        }
        fleet.wait_healthy(spec.workers, spec.ready_timeout).await?;
        fleet.model = crate::client::Client::first_model(&fleet.gateway).await?;
        Ok(fleet)
    }

    fn spawn(
        &mut self,
        bin: &Path,
        args: &[String],
        name: &str,
        dir: &Path,
        env: &[(&str, &str)],
    ) -> Result<(), String> {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(bin);
        cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err).env("RUST_LOG", "warn");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().map_err(|e| format!("starting {}: {e}", bin.display()))?;
        self.procs.push(Proc { name: name.to_owned(), log, child });
        Ok(())
    }

    /// An error if any process has exited.
    fn check_alive(&mut self) -> Result<(), String> {
        for p in &mut self.procs {
            if let Ok(Some(status)) = p.child.try_wait() {
                return Err(format!(
                    "{} exited ({status}); its log {}:\n{}",
                    p.name,
                    p.log.display(),
                    tail(&p.log)
                ));
            }
        }
        Ok(())
    }

    async fn wait_http(&mut self, url: &str, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_alive()?;
            if get_json(url).await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{url} not ready after {timeout:?} (logs in {})", self.log_hint()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_healthy(&mut self, n: usize, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let url = format!("{}/kvgate/v1/workers", self.control);
        loop {
            self.check_alive()?;
            if let Ok(v) = get_json(&url).await {
                let ok = v.as_array().map_or(0, |a| {
                    a.iter().filter(|w| w["healthy"] == true && w["summary_fresh"] == true).count()
                });
                if ok >= n {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the gateway never saw {n} healthy workers (logs in {})",
                    self.log_hint()
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn log_hint(&self) -> String {
        self.procs.first().and_then(|p| p.log.parent()).map_or("?".into(), |d| d.display().to_string())
    }

    /// Stops every process now.
    pub fn stop(mut self) {
        self.procs.clear();
    }
}

/// GET a URL and parse JSON; errors for non-2xx.
pub async fn get_json(url: &str) -> Result<Value, String> {
    let client: HyperClient<_, Full<Bytes>> = HyperClient::builder(TokioExecutor::new()).build_http();
    let req = hyper::Request::get(url).body(Full::new(Bytes::new())).map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(5), client.request(req))
        .await
        .map_err(|_| "timeout".to_string())?
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    if !status.is_success() {
        return Err(format!("{url}: {status}"));
    }
    serde_json::from_slice(&body).map_err(|e| format!("{url}: {e}"))
}
