//! The deployment a chaos run drives, on 127.0.0.1 only: a `redis-server`, gateway replicas sharing it (classes
//! with budgets, an API key per tenant, shared sends), and kvgate workers reporting to every replica: `w0` and `w1`
//! on the simulated engine (`w1` with host-DRAM and SSD KV tiers, its SSD directory a small tmpfs of its own so a
//! fault can fill it), `w2` a prefill worker and `w3` a decode worker on the CPU engine (the tiny model's real
//! math: only it moves KV), so the gateway's split policy can send a request's prompt to `w2` and its decode to
//! `w3`. Each process can be killed, stopped, continued and started again on the same ports, as the fault executor
//! needs; all of them are killed, and the tmpfs unmounted, when the [`Deployment`] is dropped.
//!
//! Invariants: a process started again gets the same arguments, ports and data directory; every process's output
//! goes to a log file under the run's directory, named in every error.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The tenants' API keys (`chaos-key-<i>`, tenant `t<i>`, each its own forced cache salt).
pub fn tenant_key(i: usize) -> String {
    format!("chaos-key-{i}-0123456789abcdef")
}

/// The class a budget burst names (`x-kvgate-class`): a small budget every tenant may choose.
pub const BURST_CLASS: &str = "burst";

/// The report secret every process shares.
const SECRET: &str = "chaos-report-secret";

/// The worker with host-DRAM and SSD tiers, the prefill worker and the decode worker (indices into `workers`).
pub const TIERED: usize = 1;
pub const PREFILL: usize = 2;
pub const DECODE: usize = 3;
/// The tiered worker's host-DRAM tier: small, so that it lets blocks go to the SSD tier from the first minute.
const HOST_TIER_BYTES: u64 = 16 << 20;
/// The tiered worker's SSD tier, and the tmpfs its directory is (room for the tier and a little more: a fault
/// fills the rest).
const SSD_TIER_BYTES: u64 = 64 << 20;
const SSD_FS_BYTES: u64 = 96 << 20;
/// The CPU workers' KV pool, in tokens (about 0.9 KiB a token for the tiny model).
const CPU_KV_TOKENS: &str = "24576";

/// A restartable process.
pub struct Managed {
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
    /// Its HTTP base URL (or `host:port` for Redis).
    pub url: String,
}

impl Managed {
    fn start(&mut self) -> Result<(), String> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("{}: {e}", self.log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("{}: {e}", self.program.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends a signal (SIGSTOP, SIGCONT) to the running process.
    pub fn signal(&self, sig: &str) -> Result<(), String> {
        let pid = self.pid().ok_or_else(|| format!("{} is not running", self.name))?;
        let ok = Command::new("kill").args([sig, &pid.to_string()]).status().map_err(|e| e.to_string())?;
        ok.success().then_some(()).ok_or_else(|| format!("kill {sig} {}", self.name))
    }

    /// Starts it again (after `kill`).
    pub fn restart(&mut self) -> Result<(), String> {
        self.kill();
        self.start()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What to start.
#[derive(Clone, Debug)]
pub struct DeploySpec {
    pub bin_dir: PathBuf,
    pub dir: PathBuf,
    pub gateways: usize,
    pub workers: usize,
    pub tenants: usize,
    /// The simulated workers' timing profile.
    pub profile: String,
}

/// The running deployment.
pub struct Deployment {
    pub redis: Managed,
    pub gateways: Vec<Managed>,
    /// Each gateway's control URL.
    pub controls: Vec<String>,
    pub workers: Vec<Managed>,
    /// The tiered worker's SSD directory, and whether it is a tmpfs of its own (`Err`: why not, e.g. no
    /// permission to mount; then no fault can fill it).
    pub ssd_dir: PathBuf,
    pub ssd_mounted: Result<(), String>,
}

impl Drop for Deployment {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.kill();
        }
        if self.ssd_mounted.is_ok() {
            let _ = Command::new("umount").arg("-l").arg(&self.ssd_dir).status();
        }
    }
}

/// Mounts a tmpfs of `bytes` at `dir` (a chaos run's own directory).
fn mount_tmpfs(dir: &Path, bytes: u64) -> Result<(), String> {
    let out = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
        .arg(dir)
        .output()
        .map_err(|e| format!("mount: {e}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!("mount -t tmpfs: {}", String::from_utf8_lossy(&out.stderr).trim())),
    }
}

fn port() -> Result<u16, String> {
    kvgate_shared::ports::free_loopback_port().map_err(|e| e.to_string())
}

fn managed(name: &str, program: PathBuf, args: Vec<String>, dir: &Path, url: String) -> Managed {
    Managed { name: name.into(), program, args, log: dir.join(format!("{name}.log")), child: None, url }
}

/// The gateway's configuration file: the default classes' shapes with budgets the run stays within, and the
/// burst class.
fn gateway_toml(dir: &Path, tenants: usize) -> Result<(PathBuf, PathBuf), String> {
    let classes = format!(
        "[[classes]]\nname = \"short\"\nrefill_tokens_per_s = 2000000\nburst_tokens = 4000000\n\
         [classes.match]\nmax_prompt_tokens = 8192\n\n\
         [[classes]]\nname = \"long\"\nrefill_tokens_per_s = 2000000\nburst_tokens = 4000000\n\n\
         [[classes]]\nname = \"{BURST_CLASS}\"\nrefill_tokens_per_s = 200\nburst_tokens = 400\nmax_wait_ms = 200\n\
         [classes.match]\nmodels = [\"no-model-matches-this\"]\n"
    );
    let config = dir.join("gateway.toml");
    std::fs::write(&config, classes).map_err(|e| e.to_string())?;
    let mut keys = String::new();
    for i in 0..tenants {
        keys.push_str(&format!(
            "[[keys]]\nkey = \"{}\"\ntenant = \"t{i}\"\nclasses = [\"{BURST_CLASS}\"]\ncache_salt = \"t{i}\"\n\n",
            tenant_key(i)
        ));
    }
    let keys_file = dir.join("keys.toml");
    std::fs::write(&keys_file, keys).map_err(|e| e.to_string())?;
    Ok((config, keys_file))
}

impl Deployment {
    /// Starts everything and waits until every replica lists every worker healthy.
    pub async fn start(spec: &DeploySpec) -> Result<Self, String> {
        std::fs::create_dir_all(&spec.dir).map_err(|e| e.to_string())?;
        let rport = port()?;
        let rdir = spec.dir.join("redis");
        std::fs::create_dir_all(&rdir).map_err(|e| e.to_string())?;
        let redis_args =
            ["--port", &rport.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
                .iter()
                .map(|s| s.to_string())
                .chain(["--dir".into(), rdir.display().to_string()])
                .collect();
        let mut redis = managed(
            "redis",
            PathBuf::from("redis-server"),
            redis_args,
            &spec.dir,
            format!("127.0.0.1:{rport}"),
        );
        redis.start()?;
        let (config, keys) = gateway_toml(&spec.dir, spec.tenants)?;
        let mut gateways = Vec::new();
        let mut controls = Vec::new();
        for i in 0..spec.gateways {
            let (p, c) = (port()?, port()?);
            let args: Vec<String> = [
                "--listen",
                &format!("127.0.0.1:{p}"),
                "--control-listen",
                &format!("127.0.0.1:{c}"),
                "--report-secret",
                SECRET,
                "--redis-url",
                &format!("redis://127.0.0.1:{rport}"),
                "--share-sends",
                "true",
                "--replica-id",
                &format!("g{i}"),
                "--state-file",
                "off",
                "--config",
                &config.display().to_string(),
                "--api-keys-file",
                &keys.display().to_string(),
                "--require-api-key",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let mut g = managed(
                &format!("gateway-{i}"),
                spec.bin_dir.join("kvgate-gateway"),
                args,
                &spec.dir,
                format!("http://127.0.0.1:{p}"),
            );
            g.start()?;
            gateways.push(g);
            controls.push(format!("http://127.0.0.1:{c}"));
        }
        let report_to = controls.join(",");
        let ssd_dir = spec.dir.join("ssd-w1");
        std::fs::create_dir_all(&ssd_dir).map_err(|e| e.to_string())?;
        let ssd_mounted = mount_tmpfs(&ssd_dir, SSD_FS_BYTES);
        let mut workers = Vec::new();
        for i in 0..spec.workers {
            let p = port()?;
            let mut args: Vec<String> = [
                "serve",
                "--synth",
                "tiny",
                "--synth-dir",
                &spec.dir.join("synth").display().to_string(),
                "--host",
                "127.0.0.1",
                "--port",
                &p.to_string(),
                "--worker-id",
                &format!("w{i}"),
                "--report-to",
                &report_to,
                "--report-secret",
                SECRET,
                "--report-interval",
                "250ms",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            args.extend(worker_args(i, spec, &ssd_dir)?);
            let mut w = managed(
                &format!("worker-w{i}"),
                spec.bin_dir.join("kvgate-worker"),
                args,
                &spec.dir,
                format!("http://127.0.0.1:{p}"),
            );
            w.start()?;
            workers.push(w);
            if i == 0 {
                // The first writes the synthetic model the others read.
                wait_ok(&format!("{}/ready", workers[0].url), Duration::from_secs(120)).await?;
            }
        }
        let d = Self { redis, gateways, controls, workers, ssd_dir, ssd_mounted };
        for c in &d.controls {
            d.wait_workers(c, spec.workers, Duration::from_secs(120)).await?;
        }
        Ok(d)
    }

    /// Waits until the replica with control URL `control` lists `n` healthy workers with fresh summaries and is
    /// ready.
    pub async fn wait_workers(&self, control: &str, n: usize, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let healthy =
                crate::fleet::get_json(&format!("{control}/kvgate/v1/workers")).await.ok().map_or(0, |v| {
                    v.as_array().map_or(0, |a| {
                        a.iter().filter(|w| w["healthy"] == true && w["summary_fresh"] == true).count()
                    })
                });
            if healthy >= n && wait_ok(&format!("{control}/ready"), Duration::ZERO).await.is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("{control} lists {healthy} of {n} workers healthy after {within:?}"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// What worker `i` is: its engine and role, and the tiered one's tiers.
fn worker_args(i: usize, spec: &DeploySpec, ssd: &Path) -> Result<Vec<String>, String> {
    // The CPU engine's KV pool is real memory, touched as it fills: CPU_KV_TOKENS of the tiny model's stay inside
    // the workers' memory bound (`run.rs`). The simulated engine's holds no tensors.
    let cpu = |role: &str| {
        ["--engine", "cpu", "--role", role, "--kv-cache-tokens", CPU_KV_TOKENS].map(String::from).to_vec()
    };
    let mut args: Vec<String> = match i {
        PREFILL => cpu("prefill"),
        DECODE => cpu("decode"),
        _ => ["--engine", "sim", "--sim-profile", &spec.profile, "--kv-cache-tokens", "65536"]
            .map(String::from)
            .to_vec(),
    };
    if i == PREFILL {
        // A fixed port: a restarted prefill worker is found where it was.
        args.extend(["--kv-transfer-port".into(), port()?.to_string()]);
    }
    if i == TIERED {
        args.extend(["--host-kv-bytes".into(), HOST_TIER_BYTES.to_string(), "--disk-kv-bytes".into()]);
        args.push(SSD_TIER_BYTES.to_string());
        args.push("--disk-kv-path".into());
        args.push(ssd.display().to_string());
    }
    Ok(args)
}

/// Waits until `GET url` answers 2xx (`within` zero: one try).
pub async fn wait_ok(url: &str, within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        let req = hyper::Request::get(url).body(http_body_util::Full::new(bytes::Bytes::new()));
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
        if let Ok(req) = req {
            if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(2), client.request(req)).await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(format!("{url} did not answer 2xx within {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
