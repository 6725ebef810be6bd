//! The engine builder: turns a [`ServeConfig`] into the [`ServingModel`] the server serves, once, over the one
//! `Backend` boundary. The only device-specific step is `device::make_backend` (a `Box<dyn Backend>` and what it
//! says of itself); everything after it is written here once for every device: the KV pool and scheduler, the
//! lower KV tiers, the start-up measurement of their speeds (`load_costs`), the engine thread, the KV transfers'
//! parts and the P/D information reports carry.
//!
//! Order (errors surface in it): the model directory (`--synth` writes one), the tokenizer, the weights' identity
//! (read only when an SSD tier or KV transfers need it), the backend, the engine and its tiers, the load costs, the
//! engine thread; then the model id, the device and role metrics, and the transfers.
//!
//! Invariants: runs on a blocking thread (it reads and hashes weights and times copies) and binds no socket (`boot`
//! binds the KV transfer listener once this returns); the engine's pool is `kv_slots / block_size` blocks of the
//! backend's KV memory; a worker without a report secret, or on the simulated engine, has no KV transfers.

use std::sync::Arc;

use kvgate_shared::hashing::HashScheme;
use kvgate_shared::prompt::Prompter;

use super::config::{EngineKind, ModelSource, ServeConfig};
use super::device::{self, DeviceBackend, LoadCostsFrom};
use super::engine_thread::EngineHandle;
use super::load_costs;
use super::state::ServingModel;
use crate::engine::{Backend, Engine, EngineConfig, SchedulerConfig};
use crate::model::synth::{synth_model, SynthSpec};

/// The one engine type of a serving worker, whichever device it computes on.
pub type ServingEngine = Engine<Box<dyn Backend>>;

/// Loads the model `cfg` names and starts its engine thread.
pub fn load(cfg: &ServeConfig, worker_id: &str) -> Result<ServingModel, String> {
    let dir = ensure_model_dir(&cfg.model)?;
    let prompter = prompter(cfg, &dir)?;
    let scheme = HashScheme::new(cfg.block_size, prompter.digest());
    let weights = weights_identity(cfg, &dir)?;
    let made = device::make_backend(cfg, &dir, &prompter)?;
    let adapters = Arc::new(
        adapters(cfg, &dir, made.backend.runs_adapters(), &model_id(cfg)).map_err(|e| e.to_string())?,
    );
    let (max_model_len, device, transfers_kv) = (made.max_model_len, made.device.clone(), made.transfers_kv);
    let engine = engine(cfg, made, scheme, &prompter, weights)?;
    let kv = if transfers_kv { transfer_parts(&engine, weights) } else { None };
    let handle = EngineHandle::spawn(engine, cfg.max_waiting_requests, cfg.kv_transfer_stall_timeout);
    metrics::gauge!("kvgate_worker_device_info", "device" => device.clone()).set(1.0);
    let model_id = model_id(cfg);
    metrics::gauge!("kvgate_worker_role", "role" => cfg.role.as_str()).set(1.0);
    let bs = cfg.block_size as usize;
    let transfer = kv.zip(cfg.report_secret.as_deref()).map(|(parts, secret)| {
        Arc::new(crate::transfer::Transfers {
            key: kvgate_shared::handoff::transfer_key(secret),
            grant_key: kvgate_shared::handoff::grant_key(secret),
            model: model_id.clone(),
            worker_id: worker_id.to_owned(),
            fingerprint: parts.fingerprint,
            block_bytes: parts.block_bytes,
            layers: parts.layers,
            block_size: bs,
            lease: cfg.kv_transfer_lease,
            stall: cfg.kv_transfer_stall_timeout,
            layer_group: cfg.kv_transfer_layer_group,
            frame_bytes: cfg.kv_transfer_frame_bytes,
            export_backlog: cfg.kv_export_backlog_bytes,
            max_prompt_tokens: max_model_len,
            engine: handle.clone(),
            transport: Default::default(),
            imports: Default::default(),
            adapters: {
                let store = adapters.clone();
                Arc::new(move |key: &str| store.by_key(key))
            },
        })
    });
    let pd_info = kvgate_shared::report::PdInfo {
        role: cfg.role,
        transfer_addr: String::new(),
        kv_bytes_per_token: kv.map_or(0, |p| (p.block_bytes / bs) as u32),
        export_groups: kv.map_or(0, |p| p.export_groups(cfg.kv_transfer_layer_group)),
        ..Default::default()
    };
    Ok(ServingModel {
        engine: handle,
        prompter,
        model_id,
        worker_id: worker_id.to_owned(),
        max_model_len,
        scheme,
        device,
        pd_info,
        transfer,
        adapters,
    })
}

/// Why the `--lora` adapters could not be served (none of these is helped by a retry: the flags or files must
/// change).
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    #[error("--lora: this engine does not run LoRA adapters (the simulated engine, or CUDA with no device slots for adapters: --max-gpu-loras)")]
    Unsupported,
    #[error("--lora: the base model: {0}")]
    Model(crate::model::ModelError),
    #[error("--lora: {0}")]
    Adapter(super::adapters::LoadError),
}

/// The adapter store: the `--lora` adapters read, checked against the model in `dir` and pinned; refused on a
/// backend that does not run them, under a name that is the model's own or given twice, or past `--max-loras`.
/// A backend that runs none gets a store that loads none (its reports say 0 slots).
fn adapters(
    cfg: &ServeConfig,
    dir: &std::path::Path,
    runs: bool,
    model_id: &str,
) -> Result<super::adapters::AdapterStore, AdapterError> {
    use super::adapters::AdapterStore;
    if !runs {
        if !cfg.lora.is_empty() {
            return Err(AdapterError::Unsupported);
        }
        return Ok(AdapterStore::new(model_id, None, cfg.max_lora_rank, 0, None));
    }
    let model = crate::model::ModelConfig::from_dir(dir).map_err(AdapterError::Model)?;
    let store =
        AdapterStore::new(model_id, Some(model), cfg.max_lora_rank, cfg.max_loras, cfg.lora_root.clone());
    store.preload(&cfg.lora).map_err(AdapterError::Adapter)?;
    Ok(store)
}

/// Builds the model directory for `--synth` once (written beside, then renamed, so concurrent workers are safe).
fn ensure_model_dir(src: &ModelSource) -> Result<std::path::PathBuf, String> {
    match src {
        ModelSource::Dir(d) => Ok(d.clone()),
        ModelSource::Synth { preset, seed, dir } => {
            if dir.join("config.json").exists() && dir.join("tokenizer.json").exists() {
                return Ok(dir.clone());
            }
            let tmp = dir.with_extension(format!("tmp-{}", std::process::id()));
            synth_model(&tmp, &SynthSpec::new(*preset, *seed)).map_err(|e| e.to_string())?;
            if let Some(parent) = dir.parent() {
                std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
            }
            if std::fs::rename(&tmp, dir).is_err() {
                // Another worker won the race; use its copy.
                let _ = std::fs::remove_dir_all(&tmp);
            }
            Ok(dir.clone())
        }
    }
}

/// The model's tokenizer and chat template, with the tokenize cache `cfg` asks for.
fn prompter(cfg: &ServeConfig, dir: &std::path::Path) -> Result<Arc<Prompter>, String> {
    let prompter = Prompter::from_dir(dir)
        .map_err(|e| e.to_string())?
        .with_segment_cache_tokens(cfg.tokenize_cache_tokens);
    if let Some(why) = prompter.segment_cache_off() {
        tracing::info!(%why, "chat prompts are tokenized whole (no segment cache)");
    }
    if let Some(why) = prompter.long_text_off() {
        tracing::info!(%why, "long text is tokenized whole (no cached chunks)");
    }
    Ok(Arc::new(prompter))
}

/// What the SSD tier's records and KV transfers are valid for besides the scheme and layout: these weights (a
/// simulated engine has none: its profile's name). 0 when neither an SSD tier nor a report secret needs it (the
/// weights are not read then).
fn weights_identity(cfg: &ServeConfig, dir: &std::path::Path) -> Result<u64, String> {
    Ok(match &cfg.engine {
        _ if cfg.disk_kv_bytes == 0 && cfg.report_secret.is_none() => 0,
        EngineKind::Cpu => crate::model::identity::weights_digest(dir)?,
        EngineKind::Sim { profile } => xxhash_rust::xxh3::xxh3_64(profile.to_string_lossy().as_bytes()),
    })
}

/// The engine over `made`'s backend: its pool, the lower KV tiers the flags ask for, and what load-vs-recompute
/// weighs (`weights`: what the SSD tier's records are valid for besides the scheme and KV layout).
fn engine(
    cfg: &ServeConfig,
    made: DeviceBackend,
    scheme: HashScheme,
    prompter: &Arc<Prompter>,
    weights: u64,
) -> Result<ServingEngine, String> {
    let scheduler = SchedulerConfig {
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        max_num_seqs: cfg.max_num_seqs,
    };
    let num_blocks = made.kv_slots / cfg.block_size as usize;
    let engine =
        Engine::new(EngineConfig { num_blocks, scheme, scheduler }, made.backend, Some(prompter.clone()));
    let disk_dir = cfg.disk_kv_path.clone().unwrap_or_default();
    let mut engine = engine.with_host_tier(cfg.host_kv_bytes, cfg.kv_write_policy)?.with_disk_tier(
        &disk_dir,
        cfg.disk_kv_bytes,
        cfg.kv_write_policy,
        weights,
    )?;
    let costs = match made.load_costs {
        LoadCostsFrom::Measured => {
            load_costs::measure(engine.scheduler().kv(), cfg.kv_load_policy, cfg.disk_kv_path.as_deref())
        }
        LoadCostsFrom::Profile(costs) => costs,
    };
    engine.set_load_costs(costs);
    Ok(engine)
}

/// What KV transfers need of the engine: the KV fingerprint, bytes a block, layers, and whether its forward
/// pass lets exports read layers as they are written. `None`: its backend copies no KV blocks.
fn transfer_parts(engine: &ServingEngine, weights: u64) -> Option<TransferParts> {
    let b = engine.backend();
    let block_bytes = b.kv_block_bytes(engine.scheme().block_size as usize)?;
    Some(TransferParts {
        fingerprint: engine.tier_fingerprint(weights, block_bytes),
        block_bytes,
        layers: b.kv_layers(),
        taps_layers: b.taps_layers() && b.kv_layers() >= 2,
    })
}

#[derive(Clone, Copy)]
struct TransferParts {
    fingerprint: u64,
    block_bytes: usize,
    layers: usize,
    taps_layers: bool,
}

impl TransferParts {
    /// Layer groups an export sends while the prefill computes (1: whole blocks after it).
    fn export_groups(&self, layer_group: u16) -> u16 {
        match (self.taps_layers, layer_group) {
            (true, g) if g > 0 => self.layers.div_ceil(g as usize).min(u16::MAX as usize) as u16,
            _ => 1,
        }
    }
}

/// The model id reports and `/v1/models` give: `--model-id`, else the preset's (`kvgate-tiny`) or the directory's
/// name.
fn model_id(cfg: &ServeConfig) -> String {
    cfg.model_id.clone().unwrap_or_else(|| match &cfg.model {
        ModelSource::Synth { preset, .. } => format!("kvgate-{}", format!("{preset:?}").to_lowercase()),
        ModelSource::Dir(d) => d.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::timing::SimProfile;
    use crate::model::synth::Preset;
    use crate::server::config::ServeArgs;

    /// `serve --synth tiny --device cpu --kv-cache-tokens 1000` (its model in `dir`), on `engine`.
    fn config(dir: &std::path::Path, engine: &str, secret: Option<&str>) -> ServeConfig {
        ServeArgs {
            synth: Some(Preset::Tiny),
            synth_dir: Some(dir.join("tiny")),
            device: Some("cpu".into()),
            engine: Some(engine.into()),
            sim_profile: (engine == "sim").then(|| "cpu-small".into()),
            kv_cache_tokens: Some(1000),
            report_secret: secret.map(str::to_owned),
            ..ServeArgs::default()
        }
        .resolve()
        .expect("config")
    }

    #[test]
    fn the_cpu_and_the_simulated_engine_are_assembled_by_the_same_steps() {
        let dir = tempfile::tempdir().expect("tmp");
        let cpu = load(&config(dir.path(), "cpu", Some("s3cret")), "w1").expect("cpu engine");
        let sim = load(&config(dir.path(), "sim", Some("s3cret")), "w2").expect("sim engine");
        for (l, device) in [(&cpu, "cpu"), (&sim, "sim")] {
            assert_eq!(l.device, device);
            assert_eq!(l.model_id, "kvgate-tiny");
            // 1000 tokens: 62 whole blocks of 16, whichever device.
            assert_eq!(l.engine.kv().pool().lock().num_blocks(), 1000 / 16, "{device}");
            assert_eq!(l.scheme.block_size, 16);
        }
        assert_eq!(sim.max_model_len, SimProfile::named_or_file("cpu-small").expect("profile").max_model_len);
        // KV transfers: the CPU engine's blocks move (a secret is set); the simulated engine has none to send.
        let t = cpu.transfer.as_ref().expect("cpu transfers");
        assert_eq!(
            (t.block_size, t.max_prompt_tokens, t.model.as_str()),
            (16, cpu.max_model_len, "kvgate-tiny")
        );
        assert_eq!(cpu.pd_info.kv_bytes_per_token as usize, t.block_bytes / 16);
        assert!(cpu.pd_info.export_groups >= 1);
        assert!(sim.transfer.is_none());
        assert_eq!((sim.pd_info.kv_bytes_per_token, sim.pd_info.export_groups), (0, 0));
        // Without a secret no transfers, but the P/D figures still say what a block costs.
        let plain = load(&config(dir.path(), "cpu", None), "w3").expect("cpu engine");
        assert!(plain.transfer.is_none());
        assert_eq!(plain.pd_info.kv_bytes_per_token, cpu.pd_info.kv_bytes_per_token);
    }

    #[test]
    fn an_unknown_profile_fails_with_the_profiles_own_error() {
        let dir = tempfile::tempdir().expect("tmp");
        let mut cfg = config(dir.path(), "sim", None);
        cfg.engine = EngineKind::Sim { profile: "no-such-profile".into() };
        let err = load(&cfg, "w").err().expect("refused");
        let want = SimProfile::named_or_file("no-such-profile").expect_err("unknown");
        assert_eq!(err, want);
    }
}
