//! The backend boundary: a boxed backend behaves exactly as the backend itself (the server's one engine type,
//! `Engine<Box<dyn Backend>>`, relies on it), and a failed forward ends its batch with the typed error.

use kvgate_shared::hashing::HashScheme;

use super::sim::{SimBackend, SimClock};
use super::tests::{drain, req};
use super::timing::TimingModel;
use super::*;
use crate::model::llama::LlamaModel;
use crate::model::synth::{synth_model, Preset, SynthSpec};

fn config(num_blocks: usize) -> EngineConfig {
    EngineConfig {
        num_blocks,
        scheme: HashScheme::new(4, 1),
        scheduler: SchedulerConfig { max_num_batched_tokens: 32, max_num_seqs: 4 },
    }
}

/// Everything a backend says of itself without computing.
fn described(b: &dyn Backend) -> String {
    format!(
        "{} {} {:?} {} {:?} {} {:?} {} {} {}",
        b.vocab_size(),
        b.max_model_len(),
        b.eos_token_ids(),
        b.needs_slots(),
        b.kv_block_bytes(16),
        b.kv_layout(),
        b.clock_s(),
        b.times_transfers(),
        b.taps_layers(),
        b.kv_layers()
    )
}

#[test]
fn a_boxed_backend_says_what_the_backend_says() {
    let timing = TimingModel {
        prefill_base_s: 0.01,
        prefill_per_token_s: 1e-4,
        prefill_attention_s: 0.0,
        decode_base_s: 0.25,
        decode_per_seq_s: 0.0,
        decode_per_kv_token_s: 0.0,
        host_load_s_per_byte: 0.0,
        disk_load_s_per_byte: 0.0,
    };
    let sim = SimBackend::new(1000, 4096, vec![0]).with_timing(timing, SimClock::Virtual);
    let boxed: Box<dyn Backend> = Box::new(sim.clone());
    assert_eq!(described(&boxed), described(&sim));
    assert!(!boxed.needs_slots() && !boxed.times_transfers() && boxed.clock_s() == Some(0.0));

    let dir = tempfile::tempdir().expect("tmp");
    synth_model(dir.path(), &SynthSpec::new(Preset::Tiny, 3)).expect("synth");
    let cpu = || CpuBackend::new(LlamaModel::load(dir.path()).expect("model"), 64);
    let (mut plain, mut boxed): (CpuBackend, Box<dyn Backend>) = (cpu(), Box::new(cpu()));
    assert_eq!(described(&boxed), described(&plain));
    assert!(boxed.taps_layers() && boxed.kv_layers() >= 2, "the CPU backend's layer taps are not defaults");
    let bytes = vec![1u8; plain.kv_block_bytes(16).expect("copies blocks")];
    for b in [&mut plain as &mut dyn Backend, &mut boxed] {
        b.write_kv_blocks(&[(1, &bytes)], 16).expect("write");
        assert_eq!(b.read_kv_blocks(&[1], 16).expect("read"), vec![bytes.clone()]);
        let layers = b.read_kv_layers(&[1], 0..1, 16).expect("one layer");
        assert_eq!(layers.len(), bytes.len() / b.kv_layers());
        let e = b.read_kv_blocks(&[99], 16).expect_err("past the pool");
        assert_eq!((e.fault(), e.to_string()), (Fault::Request, "slots 1584..1600 past 64".to_string()));
    }
}

#[test]
fn an_engine_over_a_boxed_backend_serves_the_same_tokens() {
    let sim = || SimBackend::new(1000, 4096, vec![0]);
    let mut plain = Engine::new(config(64), sim(), None);
    let mut boxed = Engine::new(config(64), Box::new(sim()) as Box<dyn Backend>, None);
    for id in 0..12u64 {
        let prompt: Vec<u32> = (0..(5 + id as u32 * 7)).map(|i| (i * 31 + id as u32) % 999 + 1).collect();
        plain.add_request(req(id, prompt.clone(), 6)).expect("admit");
        boxed.add_request(req(id, prompt, 6)).expect("admit");
    }
    assert_eq!(drain(&mut boxed), drain(&mut plain));
    assert_eq!(boxed.stats(), plain.stats());
}

/// A simulated backend whose forward fails.
struct Failing(SimBackend, BackendError);

impl Backend for Failing {
    fn forward(&mut self, _items: &[BatchItem<'_>]) -> Result<Vec<Option<Next>>, BackendError> {
        Err(self.1.clone())
    }
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn max_model_len(&self) -> usize {
        self.0.max_model_len()
    }
    fn eos_token_ids(&self) -> Vec<u32> {
        self.0.eos_token_ids()
    }
}

#[test]
fn a_failed_forward_ends_every_sequence_of_its_batch_with_the_typed_error() {
    let oom = BackendError::OutOfDeviceMemory("allocate 512 MiB: CUDA_ERROR_OUT_OF_MEMORY".into());
    let backend: Box<dyn Backend> = Box::new(Failing(SimBackend::new(1000, 4096, vec![0]), oom.clone()));
    let mut e = Engine::new(config(64), backend, None);
    e.add_request(req(1, vec![5; 9], 4)).expect("admit");
    e.add_request(req(2, vec![6; 3], 4)).expect("admit");
    let out = e.step();
    assert_eq!(out.len(), 2);
    for o in out {
        assert_eq!((o.token, o.finished), (None, Some(FinishReason::Error(oom.clone()))));
    }
    assert!(!e.has_work());
    assert_eq!(e.stats().blocks_free, 64, "their blocks are back");
}

#[test]
fn arguments_the_engine_built_are_its_own_fault_with_the_backends_text() {
    let refused = BackendError::InvalidInput("slot outside the KV store".into());
    let backend: Box<dyn Backend> = Box::new(Failing(SimBackend::new(1000, 4096, vec![0]), refused));
    let mut e = Engine::new(config(64), backend, None);
    e.add_request(req(1, vec![5; 9], 4)).expect("admit");
    let out = e.step();
    let want = BackendError::Internal("slot outside the KV store".into());
    assert_eq!(out[0].finished, Some(FinishReason::Error(want)));
    assert_eq!(want_fault(&out[0].finished), Some(Fault::Engine));
}

fn want_fault(f: &Option<FinishReason>) -> Option<Fault> {
    match f {
        Some(FinishReason::Error(e)) => Some(e.fault()),
        _ => None,
    }
}
