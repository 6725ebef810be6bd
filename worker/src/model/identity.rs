//! A model directory's identity: one number that changes when the weights do, so KV written for one model is never
//! served for another (the SSD tier keys its records with it: a fine-tune with the same shape, or bf16 weights
//! replaced by f16 ones, in the same directory must not find the old model's blocks).
//!
//! Digest (xxh3, in this order): `config.json` whole; then for every `*.safetensors` file, by name: its name, its
//! size, its header (the 8-byte length and the JSON of names, dtypes, shapes and offsets) and, for every tensor
//! (up to [`MAX_TENSORS`] a file, evenly chosen beyond), the first and the last [`WINDOW_BYTES`] of its data (all
//! of a smaller one). The header alone would miss a fine-tune (same names, shapes and offsets); a fine-tune, even
//! one that touches a single layer or only the norms, changes the values of whole tensors, so a window of each
//! tensor catches it, while a restart reads a few MiB instead of the whole model.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

/// Bytes of one window (at each end of a tensor's data).
pub const WINDOW_BYTES: u64 = 4096;
/// Most tensors of a file sampled (a real model has hundreds to a few thousand).
pub const MAX_TENSORS: usize = 65_536;
/// Largest safetensors header read (the format's own limit is 100 MB).
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

fn io(path: &Path, e: impl std::fmt::Display) -> String {
    format!("{}: {e}", path.display())
}

fn read_at(f: &File, path: &Path, offset: u64, len: u64) -> Result<Vec<u8>, String> {
    let mut buf = vec![0u8; len as usize];
    f.read_exact_at(&mut buf, offset).map_err(|e| io(path, e))?;
    Ok(buf)
}

fn digest_safetensors(h: &mut Xxh3, path: &Path) -> Result<(), String> {
    let f = File::open(path).map_err(|e| io(path, e))?;
    let size = f.metadata().map_err(|e| io(path, e))?.len();
    h.update(&size.to_le_bytes());
    if size < 8 {
        return Err(io(path, "not a safetensors file (shorter than its header length)"));
    }
    let head_len = u64::from_le_bytes(read_at(&f, path, 0, 8)?.try_into().unwrap_or([0; 8]));
    if head_len > MAX_HEADER_BYTES || 8 + head_len > size {
        return Err(io(path, format!("a safetensors header of {head_len} bytes does not fit the file")));
    }
    let header = read_at(&f, path, 0, 8 + head_len)?;
    h.update(&header);
    let start = 8 + head_len;
    // Each tensor's data range, in file order.
    let json: serde_json::Value =
        serde_json::from_slice(&header[8..]).map_err(|e| io(path, format!("safetensors header: {e}")))?;
    let mut ranges: Vec<(u64, u64)> = json
        .as_object()
        .map(|m| {
            m.values()
                .filter_map(|t| {
                    let o = t.get("data_offsets")?.as_array()?;
                    Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?))
                })
                .filter(|(b, e)| b < e && start.checked_add(*e).is_some_and(|end| end <= size))
                .collect()
        })
        .unwrap_or_default();
    ranges.sort_unstable();
    let step = ranges.len().div_ceil(MAX_TENSORS).max(1);
    for &(b, e) in ranges.iter().step_by(step) {
        let (b, e) = (start + b, start + e);
        if e - b <= 2 * WINDOW_BYTES {
            h.update(&read_at(&f, path, b, e - b)?);
        } else {
            h.update(&read_at(&f, path, b, WINDOW_BYTES)?);
            h.update(&read_at(&f, path, e - WINDOW_BYTES, WINDOW_BYTES)?);
        }
    }
    Ok(())
}

/// The identity of the model in `dir` (see the module docs).
pub fn weights_digest(dir: &Path) -> Result<u64, String> {
    let mut h = Xxh3::new();
    h.update(b"kvgate/model-identity/v1");
    let config = dir.join("config.json");
    h.update(&std::fs::read(&config).map_err(|e| io(&config, e))?);
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    for path in files {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        digest_safetensors(&mut h, &path)?;
    }
    Ok(h.digest())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synth::{synth_model, Preset, SynthSpec};

    fn synth(dir: &Path, seed: u64, dtype: &str) {
        let spec = SynthSpec { dtype: dtype.into(), ..SynthSpec::new(Preset::Tiny, seed) };
        synth_model(dir, &spec).expect("synth");
    }

    #[test]
    fn the_identity_follows_the_weights_not_the_path() {
        let a = tempfile::tempdir().expect("tmp");
        let b = tempfile::tempdir().expect("tmp");
        synth(a.path(), 1, "float32");
        synth(b.path(), 1, "float32");
        let one = weights_digest(a.path()).expect("digest");
        assert_eq!(one, weights_digest(b.path()).expect("digest"), "same weights elsewhere: same identity");
        // Other weights of the same shape (a fine-tune), or another dtype, in the same directory.
        synth(a.path(), 2, "float32");
        let two = weights_digest(a.path()).expect("digest");
        assert_ne!(one, two);
        synth(a.path(), 2, "bfloat16");
        let bf16 = weights_digest(a.path()).expect("digest");
        assert_ne!(two, bf16);
        // One value of one small tensor changed in place (a fine-tune of the norms): caught.
        let file = a.path().join("model.safetensors");
        let mut bytes = std::fs::read(&file).expect("read");
        let head = u64::from_le_bytes(bytes[..8].try_into().expect("8")) as usize;
        let json: serde_json::Value = serde_json::from_slice(&bytes[8..8 + head]).expect("header");
        let norm = json
            .as_object()
            .expect("map")
            .iter()
            .find(|(k, _)| k.ends_with("norm.weight"))
            .expect("a norm")
            .1;
        let end = norm["data_offsets"][1].as_u64().expect("end") as usize;
        bytes[8 + head + end - 1] ^= 0x01;
        std::fs::write(&file, &bytes).expect("write");
        assert_ne!(bf16, weights_digest(a.path()).expect("digest"));
        assert!(weights_digest(&a.path().join("missing")).is_err());
    }
}
