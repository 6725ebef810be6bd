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
    /// Measure the CPU engine and fit the simulated engine's timing model to it; writes a profile (TOML).
    Calibrate {
        /// Model directory to measure.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Or a synthesized preset (written to a temporary directory).
        #[arg(long, value_enum)]
        synth: Option<Preset>,
        /// Where to write the profile (stdout if absent).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Fewer, smaller measurements (seconds instead of a minute).
        #[arg(long)]
        quick: bool,
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
        Command::Calibrate { model, synth, out, quick } => calibrate(model, synth, out, quick),
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

fn calibrate(model: Option<PathBuf>, synth: Option<Preset>, out: Option<PathBuf>, quick: bool) -> ExitCode {
    let tmp = std::env::temp_dir().join(format!("kvgate-calibrate-{}", std::process::id()));
    let (dir, note) = match (model, synth) {
        (Some(d), None) => (d.clone(), format!("model {}", d.display())),
        (None, Some(p)) => {
            if let Err(e) = synth_model(&tmp, &SynthSpec::new(p, 0)) {
                eprintln!("calibrate: {e}");
                return ExitCode::FAILURE;
            }
            (tmp.clone(), format!("synthetic preset {p:?}"))
        }
        _ => {
            eprintln!("calibrate: pass --model DIR or --synth tiny|small");
            return ExitCode::from(2);
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let date = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let result =
        kvgate_worker::model::llama::LlamaModel::load(&dir).map_err(|e| e.to_string()).and_then(|m| {
            kvgate_worker::engine::calibrate::calibrate(
                &m,
                quick,
                &format!("{note}, {threads} threads, {date}"),
            )
        });
    let _ = std::fs::remove_dir_all(&tmp);
    let profile = match result {
        Ok(p) => p,
        Err(e) => {
            eprintln!("calibrate: {e}");
            return ExitCode::FAILURE;
        }
    };
    let text = match toml::to_string(&profile) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("calibrate: {e}");
            return ExitCode::FAILURE;
        }
    };
    match out {
        Some(path) => match std::fs::write(&path, text) {
            Ok(()) => {
                println!("wrote {}", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("calibrate: {}: {e}", path.display());
                ExitCode::FAILURE
            }
        },
        None => {
            print!("{text}");
            ExitCode::SUCCESS
        }
    }
}
