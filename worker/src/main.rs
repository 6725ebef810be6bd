//! kvgate-worker: `serve` runs the OpenAI server over the engine; `synth-model` writes random-weight models in the
//! Hugging Face format.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvgate_worker::model::synth::{synth_model, Preset, SynthSpec};
use kvgate_worker::model::{Architecture, ModelConfig};
use kvgate_worker::server::config::ServeArgs;

#[derive(Parser)]
#[command(name = "kvgate-worker", version, about = "kvgate inference worker")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Arch {
    Llama,
    Mistral,
    Qwen2,
}

#[derive(Subcommand)]
enum Command {
    /// Write a random-initialised model (config, safetensors, tokenizer, chat template) to a directory.
    SynthModel {
        /// Output directory (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// Size: `tiny` for unit tests, `small` for demos.
        #[arg(long, value_enum, default_value_t = Preset::Small)]
        preset: Preset,
        /// Seed: the same seed writes byte-identical files.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Architecture written to config.json.
        #[arg(long, value_enum, default_value_t = Arch::Llama)]
        arch: Arch,
        /// Stored dtype: float32, bfloat16 or float16.
        #[arg(long, default_value = "float32")]
        dtype: String,
        /// Number of safetensors shards (1 = a single model.safetensors).
        #[arg(long, default_value_t = 1)]
        shards: usize,
    },
    /// Serve the OpenAI API (flags also from KVGATE_WORKER_* environment variables and a TOML file).
    Serve(Box<ServeArgs>),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::SynthModel { out, preset, seed, arch, dtype, shards } => {
            let architecture = match arch {
                Arch::Llama => Architecture::Llama,
                Arch::Mistral => Architecture::Mistral,
                Arch::Qwen2 => Architecture::Qwen2,
            };
            let spec = SynthSpec { preset, seed, architecture, dtype, shards };
            match synth_model(&out, &spec).and_then(|_| ModelConfig::from_dir(&out)) {
                Ok(cfg) => {
                    println!(
                        "wrote {} ({:?}, {} layers, hidden {}, vocab {}, {:.1}M parameters)",
                        out.display(),
                        preset,
                        cfg.num_hidden_layers,
                        cfg.hidden_size,
                        cfg.vocab_size,
                        cfg.num_params() as f64 / 1e6
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("synth-model: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Serve(args) => {
            let cfg = match args.resolve() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("kvgate-worker serve: {e}");
                    return ExitCode::from(2);
                }
            };
            init_logging(cfg.log_json);
            let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("kvgate-worker serve: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(kvgate_worker::server::serve(cfg)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("kvgate-worker serve: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
