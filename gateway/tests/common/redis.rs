//! A real `redis-server` for the shared-state tests (installed by `scripts/setup.sh`), and `redis-cli` to play a
//! hostile client of it.

use std::process::{Command, Stdio};

use kvgate_testkit::process::Proc;
use std::time::{Duration, Instant};

/// A `redis-server` on `port`, without persistence, killed on drop.
pub struct Redis {
    _proc: Proc,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    pub fn start(port: u16) -> Self {
        Self::start_with(port, &[])
    }

    /// With extra server arguments (`--user ...` ACLs).
    pub fn start_with(port: u16, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tmp");
        // Killed on drop from here on, also when it never listens.
        let proc = Proc::adopt(
            Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .arg("--dir")
                .arg(dir.path())
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed (scripts/setup.sh)"),
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { _proc: proc, port, _dir: dir }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs one `redis-cli` command (`auth`: user and password); its output.
    pub fn cli(&self, auth: Option<(&str, &str)>, args: &[&str]) -> String {
        let mut c = Command::new("redis-cli");
        c.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some((user, pass)) = auth {
            c.args(["--user", user, "--pass", pass, "--no-auth-warning"]);
        }
        let out = c.args(args).output().expect("redis-cli is installed with redis-server");
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }
}
