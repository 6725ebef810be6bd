//! What the gateway's process benches share, over the workspace's test kit (`kvgate-testkit`): release binaries,
//! free ports, processes killed on drop, timed requests, the one percentile; and the benches' small request.
#![allow(dead_code, unused_imports)]

use std::process::Command;

pub use kvgate_testkit::http::{client as http, timed, Http};
pub use kvgate_testkit::percentile;
pub use kvgate_testkit::process::{free_port as port, Proc};

/// A 4-token completion (`max_tokens` 1) whose prompt varies with `i`.
pub fn small_body(i: u32) -> String {
    format!(
        "{{\"model\":\"kvgate-tiny\",\"prompt\":[{},{},{},{}],\"max_tokens\":1}}",
        i % 500,
        (i * 7) % 500,
        (i * 13) % 500,
        (i * 31) % 500
    )
}

/// Starts `bin` with `args` (logging errors only) and waits for a stdout line containing `needle`.
pub fn start(bin: &str, args: &[String], needle: &str) -> Proc {
    let mut cmd = Command::new(bin);
    cmd.args(args).env("RUST_LOG", "error");
    kvgate_testkit::process::start(cmd, needle)
}

/// Builds the worker's and the gateway's release binaries and returns a function from a binary name to its path.
pub fn release_bins() -> impl Fn(&str) -> String {
    kvgate_testkit::process::release_bins(&["kvgate-worker", "kvgate-gateway"])
}
