//! The paged engine's logits against candle-transformers' dense implementations on the same synthesized weights:
//! one prefill, chunked prefill, decode steps, batches, and Qwen2's biases. Tolerance 1e-4 relative (f32).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama, qwen2};
use kvgate_worker::model::llama::{KvStore, LlamaModel, SeqChunk};
use kvgate_worker::model::synth::{synth_model, Preset, SynthSpec};
use kvgate_worker::model::Architecture;

const TOL: f32 = 1e-4;

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn assert_close(ours: &[f32], reference: &[f32], what: &str) {
    let e = rel_err(ours, reference);
    assert!(e <= TOL, "{what}: relative error {e:e} > {TOL:e}");
}

/// The reference model: a dense forward with its own KV cache.
enum Reference {
    Llama(llama::Llama, llama::Cache),
    Qwen2(qwen2::ModelForCausalLM),
}

impl Reference {
    fn load(dir: &Path, arch: Architecture) -> Self {
        let files = [dir.join("model.safetensors")];
        // SAFETY (of the mmap): the files are test fixtures nobody modifies while mapped.
        #[allow(unsafe_code)]
        let vb =
            unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu).expect("vb") };
        let text = std::fs::read_to_string(dir.join("config.json")).expect("config");
        match arch {
            Architecture::Qwen2 => {
                let cfg: qwen2::Config = serde_json::from_str(&text).expect("qwen2 config");
                Reference::Qwen2(qwen2::ModelForCausalLM::new(&cfg, vb).expect("qwen2"))
            }
            _ => {
                let cfg: llama::LlamaConfig = serde_json::from_str(&text).expect("llama config");
                let cfg = cfg.into_config(false);
                let cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).expect("cache");
                Reference::Llama(llama::Llama::load(vb, &cfg).expect("llama"), cache)
            }
        }
    }

    /// Logits of the last of `tokens`, which continue the `pos` tokens already fed.
    fn step(&mut self, tokens: &[u32], pos: usize) -> Vec<f32> {
        let input = Tensor::new(tokens, &Device::Cpu).expect("t").unsqueeze(0).expect("u");
        let logits = match self {
            Reference::Llama(m, cache) => m.forward(&input, pos, cache).expect("forward"),
            Reference::Qwen2(m) => m.forward(&input, pos).expect("forward"),
        };
        logits.flatten_all().expect("f").to_vec1::<f32>().expect("v")
    }
}

/// Our model with a trivially paged store: `n` sequences, each owning slots `i * span .. (i + 1) * span`, laid
/// out in scattered 16-slot blocks to exercise the gather.
struct Ours {
    model: LlamaModel,
    kv: KvStore,
    slots: Vec<Vec<usize>>,
}

impl Ours {
    fn new(dir: &Path, n_seqs: usize, span: usize) -> Self {
        let model = LlamaModel::load(dir).expect("loads");
        let blocks_per_seq = span / 16;
        let total_blocks = n_seqs * blocks_per_seq;
        let kv = model.new_kv_store(total_blocks * 16);
        // Interleave blocks across sequences (block b of seq i is pool block b * n_seqs + (n_seqs - 1 - i)).
        let slots = (0..n_seqs)
            .map(|i| (0..span).map(|p| ((p / 16) * n_seqs + (n_seqs - 1 - i)) * 16 + p % 16).collect())
            .collect();
        Self { model, kv, slots }
    }

    fn run(&mut self, parts: &[(usize, &[u32], usize)]) -> Vec<Vec<f32>> {
        let chunks: Vec<SeqChunk<'_>> = parts
            .iter()
            .map(|(seq, tokens, start)| SeqChunk {
                tokens,
                start: *start,
                slots: &self.slots[*seq],
                want_logits: true,
                adapter: None,
            })
            .collect();
        self.model
            .forward(&chunks, &mut self.kv)
            .expect("forward")
            .into_iter()
            .map(|l| l.expect("logits"))
            .collect()
    }
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::MIN), |(bi, bv), (i, x)| if *x > bv { (i, *x) } else { (bi, bv) }).0
        as u32
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919)) % 500).collect()
}

fn model_dir(arch: Architecture) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    synth_model(dir.path(), &SynthSpec { architecture: arch, ..SynthSpec::new(Preset::Tiny, 5) })
        .expect("synth");
    dir
}

fn prefill_chunked_and_decode(arch: Architecture) {
    let dir = model_dir(arch);
    let p = prompt(83, 1); // 5 full blocks + 3 tokens
                           // One prefill, then 6 decode steps.
    let mut r = Reference::load(dir.path(), arch);
    let mut ours = Ours::new(dir.path(), 1, 256);
    let mut want = r.step(&p, 0);
    let got = ours.run(&[(0, &p, 0)]).remove(0);
    assert_close(&got, &want, "one-shot prefill");
    for step in 0..6 {
        let pos = p.len() + step;
        let t = argmax(&want);
        want = r.step(&[t], pos);
        let got = ours.run(&[(0, &[t], pos)]).remove(0);
        assert_close(&got, &want, &format!("decode step {step}"));
    }
    // Chunked prefill (chunks of 20, 17, 46 tokens) ends at the same logits as one prefill.
    let mut r = Reference::load(dir.path(), arch);
    let want = r.step(&p, 0);
    let mut ours = Ours::new(dir.path(), 1, 256);
    let mut got = Vec::new();
    for (a, b) in [(0, 20), (20, 37), (37, 83)] {
        got = ours.run(&[(0, &p[a..b], a)]).remove(0);
    }
    assert_close(&got, &want, "chunked prefill");
}

#[test]
fn llama3_matches_reference() {
    prefill_chunked_and_decode(Architecture::Llama);
}

#[test]
fn qwen2_with_biases_matches_reference() {
    prefill_chunked_and_decode(Architecture::Qwen2);
}

#[test]
fn long_prompt_crosses_query_tiles() {
    // 600 tokens: three query tiles of the chunk's attention.
    let dir = model_dir(Architecture::Llama);
    let p = prompt(600, 3);
    let want = Reference::load(dir.path(), Architecture::Llama).step(&p, 0);
    let got = Ours::new(dir.path(), 1, 640).run(&[(0, &p, 0)]).remove(0);
    assert_close(&got, &want, "600-token prefill");
}

#[test]
fn batched_equals_alone() {
    let dir = model_dir(Architecture::Llama);
    let (a, b, c) = (prompt(40, 1), prompt(70, 2), prompt(5, 3));
    let alone: Vec<Vec<f32>> =
        [&a, &b, &c].iter().map(|p| Reference::load(dir.path(), Architecture::Llama).step(p, 0)).collect();
    // Mixed batch: a whole, b's first chunk, c whole; then b's second chunk with a decode of a.
    let mut ours = Ours::new(dir.path(), 3, 128);
    let first = ours.run(&[(0, &a, 0), (1, &b[..30], 0), (2, &c, 0)]);
    assert_close(&first[0], &alone[0], "a in a batch");
    assert_close(&first[2], &alone[2], "c in a batch");
    let next_a = argmax(&first[0]);
    let second = ours.run(&[(1, &b[30..], 30), (0, &[next_a], 40)]);
    assert_close(&second[0], &alone[1], "b chunked inside batches");
    let mut ra = Reference::load(dir.path(), Architecture::Llama);
    ra.step(&a, 0);
    let want = ra.step(&[next_a], 40);
    assert_close(&second[1], &want, "a's decode in a batch");
    // Three decodes at different context lengths in one batch (the batched, padded decode attention).
    let mut rb = Reference::load(dir.path(), Architecture::Llama);
    rb.step(&b, 0);
    let mut rc = Reference::load(dir.path(), Architecture::Llama);
    rc.step(&c, 0);
    let (ta, tb, tc) = (argmax(&second[1]), argmax(&second[0]), argmax(&first[2]));
    let third = ours.run(&[(2, &[tc], 5), (0, &[ta], 41), (1, &[tb], 70)]);
    assert_close(&third[0], &rc.step(&[tc], 5), "c decode, batched");
    assert_close(&third[1], &ra.step(&[ta], 41), "a decode, batched");
    assert_close(&third[2], &rb.step(&[tb], 70), "b decode, batched");
}

#[test]
fn mistral_matches_reference() {
    // Mistral is Llama's math (no sliding window: refused at load when active).
    prefill_chunked_and_decode(Architecture::Mistral);
}
