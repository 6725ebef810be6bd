//! One launcher for real processes in tests and benches: [`spawn`] starts a command with its stdout piped, waits
//! (within a deadline) for a line containing a needle, keeps the lines seen until then, and drains the rest on a
//! thread so the child never blocks on a full pipe. [`Proc`] kills and reaps the child on drop, so every test stops
//! what it started, also when it panics.
//!
//! Binaries are found, never built ([`bin`]): `cargo nextest run --workspace` / `cargo test --workspace` build every
//! binary of the workspace before a test runs.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::time::{Duration, Instant};

/// The signals tests send ([`Proc::signal`]).
pub mod signal {
    pub use libc::{SIGCONT, SIGINT, SIGKILL, SIGSTOP, SIGTERM};
}

/// How long [`spawn`] waits for the ready line by default.
pub const READY_WITHIN: Duration = Duration::from_secs(60);

/// A child process, killed (and reaped) on drop.
pub struct Proc {
    pub child: Child,
    /// Its HTTP base URL, when the caller knows it (`http://127.0.0.1:PORT`).
    pub base: String,
    pub port: u16,
    /// Its own data directory, removed with it.
    pub data: Option<tempfile::TempDir>,
    /// The stdout lines it printed up to and including its ready line.
    pub seen: Vec<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Proc {
    /// Takes charge of a child started otherwise (one without a ready line): killed and reaped on drop.
    pub fn adopt(child: Child) -> Self {
        Self { child, base: String::new(), port: 0, data: None, seen: Vec::new() }
    }

    /// Kills and reaps it (again: a no-op).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends it a signal (`libc::SIGTERM`, ...).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on a child we own; no memory is touched.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "kill({sig})");
    }

    /// With its base URL on `port` of 127.0.0.1.
    pub fn on_port(mut self, port: u16) -> Self {
        self.port = port;
        self.base = format!("http://127.0.0.1:{port}");
        self
    }

    /// What followed `marker` on the first line seen that holds it (trimmed).
    pub fn after(&self, marker: &str) -> Option<&str> {
        self.seen.iter().find_map(|l| l.split(marker).nth(1)).map(str::trim)
    }
}

/// Why a process did not become ready.
#[derive(Debug)]
pub enum NotReady {
    /// It closed its stdout (exited) first; the lines it printed.
    Exited(Vec<String>),
    /// No ready line within the deadline.
    TimedOut(Vec<String>),
}

/// Starts `cmd` (stdout piped, `RUST_LOG=warn` unless the command sets it) and waits up to `within` for a stdout
/// line containing `ready`. On failure the child is killed.
pub fn spawn(mut cmd: Command, ready: &str, within: Duration) -> Result<Proc, NotReady> {
    if !cmd.get_envs().any(|(k, _)| k == "RUST_LOG") {
        cmd.env("RUST_LOG", "warn");
    }
    let child =
        cmd.stdout(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("spawn {:?}: {e}", cmd.get_program()));
    let mut proc = Proc::adopt(child);
    let stdout = proc.child.stdout.take().expect("stdout piped");
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + within;
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                let done = line.contains(ready);
                proc.seen.push(line);
                if done {
                    // Keep draining so the child never blocks on a full pipe.
                    std::thread::spawn(move || while rx.recv().is_ok() {});
                    return Ok(proc);
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(NotReady::Exited(std::mem::take(&mut proc.seen)))
            }
            Err(RecvTimeoutError::Timeout) => return Err(NotReady::TimedOut(std::mem::take(&mut proc.seen))),
        }
    }
}

/// [`spawn`] within [`READY_WITHIN`], panicking when the process does not become ready.
pub fn start(cmd: Command, ready: &str) -> Proc {
    let program = cmd.get_program().to_owned();
    spawn(cmd, ready, READY_WITHIN).unwrap_or_else(|e| panic!("{program:?} printed no {ready:?} line: {e:?}"))
}

/// A free loopback port below the ephemeral range (`kvgate_shared::ports`).
pub fn free_port() -> u16 {
    kvgate_shared::ports::free_loopback_port().expect("a free loopback port")
}

/// The workspace's binary `name` in the target directory of the running test (`target/<profile>/<name>`).
/// Never builds it: the workspace test command has (a lone `cargo test -p <crate>` may need
/// `cargo build --workspace --bins` first, which the panic says).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let dir = exe.parent().and_then(|p| p.parent()).expect("the target directory");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run the workspace's tests (`cargo nextest run --workspace`), or `cargo build --workspace \
         --bins` first",
        path.display()
    );
    path
}

/// The workspace's release binaries for a bench, built first (`cargo build --release` of the named binaries: a
/// bench must measure the code it was built from), as a function from a binary name to its path.
pub fn release_bins(names: &[&str]) -> impl Fn(&str) -> String {
    let root = workspace_root();
    let mut args = vec!["build", "--release", "-q"];
    for n in names {
        args.extend(["--bin", n]);
    }
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(&root)
        .args(&args)
        .status()
        .expect("cargo");
    assert!(status.success(), "building the release binaries {names:?}");
    move |n: &str| root.join("target/release").join(n).display().to_string()
}

/// The workspace's root directory (this crate's parent).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}
