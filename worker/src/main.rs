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
    /// Write a random LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors) for a model.
    SynthLora {
        /// Output directory (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// The base model's directory (its config.json gives the shapes).
        #[arg(long)]
        model: PathBuf,
        /// Rank.
        #[arg(long, default_value_t = 8)]
        rank: usize,
        /// `lora_alpha` (the update is scaled by alpha / rank).
        #[arg(long, default_value_t = 16.0)]
        alpha: f64,
        /// Seed: the same seed writes identical files.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Every B matrix 0: the adapter changes nothing.
        #[arg(long)]
        zero: bool,
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
        /// Engine to measure: `cpu`, or `cuda[:N]` (the model in --dtype on that GPU).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Storage dtype on CUDA: bfloat16, float16 or float32.
        #[arg(long, default_value = "bfloat16")]
        dtype: String,
        /// On CUDA: measure the built-in Llama-3-8B shape with random weights made on the GPU (no model files).
        #[arg(long)]
        llama3_8b: bool,
        /// Profile name written into the file (default `calibrated-<device>`).
        #[arg(long)]
        name: Option<String>,
        /// Refit from recorded measurements instead of measuring (`prefill 2048@0: 0.0595s, decode b8@2048:
        /// 0.00653s, ...`, as a profile's `source` lists them); with --max-model-len and --note.
        #[arg(long)]
        points: Option<String>,
        /// With --points: the model's context length.
        #[arg(long, default_value_t = 131_072)]
        max_model_len: usize,
        /// With --points: where the measurements came from (written to the profile's source).
        #[arg(long, default_value = "")]
        note: String,
    },
    /// Check every CUDA kernel against its CPU reference on random inputs (f32 and bf16); exits 1 on a failure.
    GpuSelftest {
        /// GPU ordinal.
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// Also write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Run the logits scenarios (one-shot, decode, chunked, cached prefix, mixed batch) on the GPU and the CPU
    /// engine; writes logits-<dtype>.{bin,json} for the comparison with HF transformers.
    GpuLogits {
        #[arg(long)]
        model: PathBuf,
        #[arg(long, default_value = "float32")]
        dtype: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// A LoRA adapter (`NAME=DIR`, repeatable; two exercise a batch of two adapters): the script's sequences run
        /// with them (`cuda::check::LORA_OF_SEQ`) and the files are `logits-<dtype>-lora.*`.
        #[arg(long = "lora")]
        lora: Vec<String>,
        /// Adapters the CUDA engine keeps in device memory (fewer than `--lora`: sub-batches and evictions).
        #[arg(long, default_value_t = 2)]
        gpu_lora_slots: usize,
    },
    /// Benchmark the CUDA engine on the Llama-3-8B shape (random bf16 weights made on the GPU); prints JSON.
    GpuBench {
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// Fewer points (up to 8K prefill, batches 1 and 64).
        #[arg(long)]
        quick: bool,
        /// Also write the JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Only the kernels (copy, GEMM, decode and prefill attention); no model.
        #[arg(long)]
        kernels_only: bool,
    },
    /// Compile every CUDA kernel source with NVRTC (no GPU needed; libnvrtc on the loader path).
    CompileKernels {
        /// Target architectures, comma-separated.
        #[arg(long, default_value = "sm_80,sm_90", value_delimiter = ',')]
        arch: Vec<String>,
    },
    /// Serve the OpenAI API (flags also from KVGATE_WORKER_* environment variables and a TOML file).
    Serve(Box<ServeArgs>),
}

fn main() -> ExitCode {
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let mut cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let (Command::Serve(args), Some(("serve", m))) = (&mut cli.command, matches.subcommand()) {
        // Values clap filled in from their defaults lose to the TOML file.
        args.layers = kvgate_shared::settings::Layers::from_matches(m);
    }
    match cli.command {
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
        Command::SynthLora { out, model, rank, alpha, seed, zero } => {
            use kvgate_worker::model::lora::{synth_lora, LoraSpec, Target};
            let base = model.display().to_string();
            let spec = LoraSpec { base: &base, rank, alpha, targets: &Target::ALL, seed, zero };
            match ModelConfig::from_dir(&model).and_then(|cfg| synth_lora(&out, &cfg, &spec)) {
                Ok(()) => {
                    println!(
                        "wrote {} (rank {rank}, alpha {alpha}, q/k/v/o and MLP projections)",
                        out.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("synth-lora: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Calibrate { points: Some(points), name, out, max_model_len, note, .. } => {
            let profile = kvgate_worker::engine::calibrate::fit_points(&points).map(|timing| {
                kvgate_worker::engine::timing::SimProfile {
                    name: name.unwrap_or_else(|| "refit".into()),
                    source: format!("kvgate-worker calibrate --points, {note}; points: {points}"),
                    max_model_len,
                    timing,
                }
            });
            write_profile(profile, out)
        }
        Command::Calibrate { model, synth, out, quick, device, dtype, llama3_8b, name, .. } => {
            calibrate(CalibrateArgs { model, synth, out, quick, device, dtype, llama3_8b, name })
        }
        Command::GpuSelftest { gpu, json } => gpu_selftest(gpu, json),
        Command::GpuLogits { model, dtype, out, gpu, lora, gpu_lora_slots } => {
            let Some(dt) = kvgate_worker::cuda::DType::parse(&dtype) else {
                eprintln!("gpu-logits: unknown dtype {dtype}");
                return ExitCode::from(2);
            };
            let mut run = kvgate_worker::cuda::check::LoraRun { adapters: Vec::new(), slots: gpu_lora_slots };
            for l in &lora {
                match l.split_once('=') {
                    Some((name, dir)) if !name.is_empty() && !dir.is_empty() => {
                        run.adapters.push((name.to_owned(), PathBuf::from(dir)))
                    }
                    _ => {
                        eprintln!("gpu-logits: --lora {l:?}: expected NAME=DIR");
                        return ExitCode::from(2);
                    }
                }
            }
            match kvgate_worker::cuda::check::logits(&model, gpu, dt, &out, true, &run) {
                Ok(summary) => {
                    println!("{}", summary["vs_cpu_f32"]);
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("gpu-logits: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::GpuBench { gpu, quick, json, kernels_only } => {
            match kvgate_worker::cuda::check::bench(gpu, quick, kernels_only) {
                Ok(report) => {
                    let text = serde_json::to_string_pretty(&report).unwrap_or_default();
                    println!("{text}");
                    if let Some(p) = json {
                        if let Err(e) = std::fs::write(&p, text) {
                            eprintln!("gpu-bench: {}: {e}", p.display());
                            return ExitCode::FAILURE;
                        }
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("gpu-bench: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::CompileKernels { arch } => {
            let archs: Vec<&str> = arch.iter().map(String::as_str).collect();
            let version = kvgate_worker::cuda::compile::nvrtc_version();
            match (version, kvgate_worker::cuda::compile::compile_all(&archs)) {
                (Ok((major, minor)), Ok(n)) => {
                    println!("compiled {n} kernels with NVRTC {major}.{minor} for {}", arch.join(","));
                    ExitCode::SUCCESS
                }
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!("compile-kernels: {e}");
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

struct CalibrateArgs {
    model: Option<PathBuf>,
    synth: Option<Preset>,
    out: Option<PathBuf>,
    quick: bool,
    device: String,
    dtype: String,
    llama3_8b: bool,
    name: Option<String>,
}

fn gpu_selftest(gpu: usize, json: Option<PathBuf>) -> ExitCode {
    let cases = match kvgate_worker::cuda::selftest::run(gpu) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpu-selftest: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("{:<22} {:<9} {:>11} {:>9} {:>5}  shape", "kernel", "dtype", "rel err", "tol", "ok");
    for c in &cases {
        println!(
            "{:<22} {:<9} {:>11.3e} {:>9.0e} {:>5}  {}",
            c.kernel,
            c.dtype,
            c.rel_err,
            c.tolerance,
            if c.pass { "yes" } else { "NO" },
            c.shape
        );
    }
    let failed = cases.iter().filter(|c| !c.pass).count();
    println!("{} cases, {failed} failed", cases.len());
    if let Some(p) = json {
        let _ = std::fs::write(&p, serde_json::to_string_pretty(&cases).unwrap_or_default());
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn calibrate(a: CalibrateArgs) -> ExitCode {
    use kvgate_worker::cuda::{backend::GpuModel, CudaBackend, DType, DeviceChoice};
    use kvgate_worker::engine::calibrate::{self, Points};
    let device = match DeviceChoice::parse(&a.device) {
        Ok(d) => d.resolve(),
        Err(e) => {
            eprintln!("calibrate: {e}");
            return ExitCode::from(2);
        }
    };
    let tmp = std::env::temp_dir().join(format!("kvgate-calibrate-{}", std::process::id()));
    let (dir, note) = match (a.model, a.synth, a.llama3_8b) {
        (Some(d), None, false) => (Some(d.clone()), format!("model {}", d.display())),
        (None, Some(p), false) => {
            if let Err(e) = synth_model(&tmp, &SynthSpec::new(p, 0)) {
                eprintln!("calibrate: {e}");
                return ExitCode::FAILURE;
            }
            (Some(tmp.clone()), format!("synthetic preset {p:?}"))
        }
        (None, None, true) if matches!(device, DeviceChoice::Cuda(_)) => {
            (None, "Llama-3-8B shape, random weights".to_string())
        }
        _ => {
            eprintln!("calibrate: pass one of --model DIR, --synth tiny|small, or --llama3-8b (CUDA only)");
            return ExitCode::from(2);
        }
    };
    let date = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let reps = if a.quick { 1 } else { 3 };
    let result = match device {
        DeviceChoice::Cuda(n) => {
            let points = Points::gpu(a.quick);
            let Some(dt) = DType::parse(&a.dtype) else {
                eprintln!("calibrate: unknown dtype {}", a.dtype);
                return ExitCode::from(2);
            };
            let loaded = match &dir {
                Some(d) => GpuModel::from_dir(d, n, dt),
                None => GpuModel::random(kvgate_worker::cuda::check::llama3_8b(), n, dt, 1),
            };
            loaded
                .and_then(|l| CudaBackend::new(l, points.slots().next_multiple_of(16) + 16, 16))
                .map_err(|e| e.to_string())
                .and_then(|mut b| {
                    let note = format!("{note}, {}, {date}", b.describe());
                    let name = a.name.clone().unwrap_or_else(|| "calibrated-cuda".into());
                    calibrate::calibrate(&mut b, &points, reps, &name, &note).map_err(|e| e.to_string())
                })
        }
        _ => {
            // The threads the CPU engine computes on (RAYON_NUM_THREADS, else the cores), not the machine's cores.
            let threads = candle_core::utils::get_num_threads();
            let Some(d) = &dir else { return ExitCode::from(2) };
            let points = Points::cpu(a.quick);
            kvgate_worker::model::llama::LlamaModel::load(d).map_err(|e| e.to_string()).and_then(|m| {
                let mut b = kvgate_worker::engine::CpuBackend::new(m, points.slots());
                let name = a.name.clone().unwrap_or_else(|| "calibrated-cpu".into());
                calibrate::calibrate(
                    &mut b,
                    &points,
                    reps,
                    &name,
                    &format!("{note}, {threads} threads, {date}"),
                )
                .map_err(|e| e.to_string())
            })
        }
    };
    let _ = std::fs::remove_dir_all(&tmp);
    write_profile(result, a.out)
}

fn write_profile(
    result: Result<kvgate_worker::engine::timing::SimProfile, String>,
    out: Option<PathBuf>,
) -> ExitCode {
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
