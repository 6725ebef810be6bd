//! kvgate-loadtest: load generation, trace replay, the virtual-time simulator and the demo (issues #7 and #8).
//! Until those land, the binary says what exists and where it is tracked.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kvgate-loadtest", version, about = "kvgate load generator, simulator and demo")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build a local fleet and compare routing policies on a multi-turn workload (the README's main command).
    Demo,
}

fn main() {
    let cli = Cli::parse();
    match cli.command {
        Command::Demo => {
            println!(
                "kvgate demo: not available yet.\n\
                 What exists today: the shared protocol crate (block hashing, worker reports, prompt rendering, \
                 OpenAI types) and its tests: run ./scripts/test.sh.\n\
                 The demo (gateway + 3 CPU workers, round_robin vs cache_aware on a multi-turn workload) arrives with \
                 issue #8 as `kvgate-loadtest demo`, which this same command will then run."
            );
        }
    }
}
