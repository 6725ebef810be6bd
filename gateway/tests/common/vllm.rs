//! Real vLLM pods for the tests (#42): the quick start of `docs/operating/pods.md` read out of the document and run
//! as written, with only its ports, paths and the `python3` it names replaced. A pod is its own process group (the
//! API server and its engine-core child), killed as a whole on drop.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The vLLM venv's Python (`KVGATE_VLLM_PYTHON`, set by scripts/test.sh when `.venv-vllm` exists); `None` (the
/// test skips) outside CI, a failure in CI.
pub fn python() -> Option<PathBuf> {
    match std::env::var_os("KVGATE_VLLM_PYTHON") {
        Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI needs KVGATE_VLLM_PYTHON (scripts/setup.sh installs it)"
            );
            eprintln!(
                "skipped: KVGATE_VLLM_PYTHON is not set (run ./scripts/test.sh without KVGATE_NO_VLLM)"
            );
            None
        }
    }
}

/// The fenced block that follows `<!-- vllm-quickstart: NAME -->` in the pods page.
pub fn quickstart_block(name: &str) -> String {
    let page = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/operating/pods.md");
    let text = std::fs::read_to_string(&page).expect("docs/operating/pods.md");
    let marker = format!("<!-- vllm-quickstart: {name} -->");
    let after = text.split_once(&marker).unwrap_or_else(|| panic!("no {marker} in pods.md")).1;
    let fence = after.find("```").expect("a fenced block after the marker");
    let body = &after[fence..];
    let start = body.find('\n').expect("fence line") + 1;
    let end = body[start..].find("```").expect("the block's end") + start;
    body[start..end].to_owned()
}

/// Replaces every `from` in `text` (which must hold it) by `to`.
pub fn subst(text: &str, pairs: &[(&str, String)]) -> String {
    let mut out = text.to_owned();
    for (from, to) in pairs {
        assert!(out.contains(from), "the quick start no longer says {from:?}:\n{text}");
        out = out.replace(from, to);
    }
    out
}

/// A process group started from a shell command line, killed (the whole group) on drop.
pub struct Group {
    pub child: Child,
    pub log: PathBuf,
}

impl Group {
    /// Runs `line` under `bash -c` in a new process group, output to `log`.
    pub fn spawn(line: &str, log: &Path, env: &[(&str, &str)]) -> Group {
        use std::os::unix::process::CommandExt;
        let out = std::fs::File::create(log).expect("log file");
        let child = Command::new("bash")
            .arg("-c")
            .arg(line)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .process_group(0)
            .spawn()
            .expect("bash starts");
        Group { child, log: log.to_owned() }
    }

    /// Sends `sig` to the whole group.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on a process group we started; no memory is touched.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(-(self.child.id() as i32), sig);
        }
    }

    /// SIGKILLs the group and reaps the shell.
    pub fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// The last `n` lines of its log.
    pub fn tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until `GET {base}/health` answers 200 (panics with the pod's log after `within`, or if it exited).
pub async fn wait_ready(pod: &mut Group, base: &str, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        if let Ok(Some(status)) = pod.child.try_wait() {
            panic!("the vLLM pod exited ({status}):\n{}", pod.tail(200));
        }
        let health =
            tokio::time::timeout(Duration::from_secs(2), super::try_get(&format!("{base}/health"))).await;
        if let Ok(Some(200)) = health {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < within,
            "the vLLM pod at {base} was not ready in {within:?}:\n{}",
            pod.tail(60)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
