//! A model's tensors as they are stored (f32, bf16 or f16 bytes, straight from the safetensors files), for loaders
//! that want no f32 copy of the model on the host: the CUDA engine uploads bf16/f16 bytes as they are when its
//! dtype matches and converts on the device a piece at a time otherwise (`cuda::weights::GpuWeights::from_stored`),
//! so loading needs host memory of about the files' size, not twice it in f32.
//!
//! The format (safetensors): an 8-byte little-endian header length, a JSON header `{name: {"dtype", "shape",
//! "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data. Every field is checked: a header longer
//! than [`MAX_HEADER_BYTES`] or past the file, offsets outside the data or out of order, a byte count that is not the
//! shape's times the dtype's size, an unknown dtype, a shape the config does not call for: each is a
//! [`ModelError`] naming the file and tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::weights::model_files;
use super::ModelError;

/// Longest safetensors header read.
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

/// How a tensor's values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDtype {
    F32,
    BF16,
    F16,
}

impl StoredDtype {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "F32" => Some(Self::F32),
            "BF16" => Some(Self::BF16),
            "F16" => Some(Self::F16),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::BF16 | Self::F16 => 2,
        }
    }
}

/// One tensor's bytes as stored.
#[derive(Clone, Copy, Debug)]
pub struct Stored<'a> {
    pub dtype: StoredDtype,
    pub bytes: &'a [u8],
}

impl Stored<'_> {
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Values `range` as f32 (exact from bf16 and f16).
    pub fn f32_range(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        let size = self.dtype.size();
        let bytes = &self.bytes[range.start * size..range.end * size];
        match self.dtype {
            StoredDtype::F32 => {
                bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            }
            StoredDtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect(),
            StoredDtype::F16 => {
                bytes.chunks_exact(2).map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect()
            }
        }
    }

    /// Every value as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        self.f32_range(0..self.len())
    }
}

/// IEEE half precision to f32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        // Subnormal: man x 2^-24, exact in f32.
        (0, m) => {
            return f32::from_bits(sign) + (m as f32) * 2f32.powi(-24) * if sign != 0 { -1.0 } else { 1.0 }
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

#[derive(Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

/// A tensor's place: which file, its dtype, shape and byte range in that file.
#[derive(Clone, Debug)]
struct Place {
    file: usize,
    dtype: StoredDtype,
    shape: Vec<usize>,
    range: std::ops::Range<usize>,
}

/// Every tensor of a model directory's safetensors files, with the files' bytes.
pub struct StoredTensors {
    files: Vec<(PathBuf, Vec<u8>)>,
    places: HashMap<String, Place>,
}

impl std::fmt::Debug for StoredTensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoredTensors({} files, {} tensors)", self.files.len(), self.places.len())
    }
}

fn file_err(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::File { file: path.display().to_string(), reason: reason.into() }
}

/// The tensors of one file's header, checked against the file's length.
fn parse(path: &Path, bytes: &[u8], file: usize) -> Result<Vec<(String, Place)>, ModelError> {
    let Some(len) = bytes.get(..8) else { return Err(file_err(path, "shorter than a safetensors header")) };
    let header_len = u64::from_le_bytes(len.try_into().unwrap_or([0; 8]));
    if header_len > MAX_HEADER_BYTES || 8 + header_len > bytes.len() as u64 {
        return Err(file_err(path, format!("header of {header_len} bytes does not fit the file")));
    }
    let data_start = 8 + header_len as usize;
    let header: HashMap<String, serde_json::Value> = serde_json::from_slice(&bytes[8..data_start])
        .map_err(|e| file_err(path, format!("header is not valid JSON: {e}")))?;
    let data_len = (bytes.len() - data_start) as u64;
    let mut out = Vec::with_capacity(header.len());
    for (name, v) in header {
        if name == "__metadata__" {
            continue;
        }
        let bad = |reason: String| ModelError::Tensor {
            file: path.display().to_string(),
            tensor: name.clone(),
            reason,
        };
        let e: Entry = serde_json::from_value(v).map_err(|e| bad(format!("bad header entry: {e}")))?;
        let dtype = StoredDtype::parse(&e.dtype)
            .ok_or_else(|| bad(format!("dtype {} (expected F32, BF16 or F16)", e.dtype)))?;
        let [begin, end] = e.data_offsets;
        if begin > end || end > data_len {
            return Err(bad(format!("data offsets {begin}..{end} outside the {data_len} data bytes")));
        }
        let numel = e.shape.iter().try_fold(1u64, |n, d| n.checked_mul(*d as u64));
        if numel.and_then(|n| n.checked_mul(dtype.size() as u64)) != Some(end - begin) {
            return Err(bad(format!("{} bytes for shape {:?} of {}", end - begin, e.shape, e.dtype)));
        }
        let range = data_start + begin as usize..data_start + end as usize;
        out.push((name, Place { file, dtype, shape: e.shape, range }));
    }
    Ok(out)
}

impl StoredTensors {
    /// Reads every safetensors file of `dir` (`model.safetensors` or the index's shards) and checks their headers.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let mut files = Vec::new();
        let mut places = HashMap::new();
        for (i, path) in model_files(dir)?.into_iter().enumerate() {
            let bytes = std::fs::read(&path).map_err(|e| file_err(&path, e.to_string()))?;
            for (name, place) in parse(&path, &bytes, i)? {
                if places.insert(name.clone(), place).is_some() {
                    return Err(ModelError::Tensor {
                        file: path.display().to_string(),
                        tensor: name,
                        reason: "stored in two files".into(),
                    });
                }
            }
            files.push((path, bytes));
        }
        Ok(Self { files, places })
    }

    /// Bytes of every file read.
    pub fn bytes(&self) -> usize {
        self.files.iter().map(|(_, b)| b.len()).sum()
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Stored<'_>, ModelError> {
        let p = self.places.get(name).ok_or_else(|| ModelError::Tensor {
            file: "model.safetensors".into(),
            tensor: name.to_owned(),
            reason: "missing".into(),
        })?;
        let (path, bytes) = &self.files[p.file];
        if p.shape != shape {
            return Err(ModelError::Tensor {
                file: path.display().to_string(),
                tensor: name.to_owned(),
                reason: format!("shape {:?}, config says {shape:?}", p.shape),
            });
        }
        Ok(Stored { dtype: p.dtype, bytes: &bytes[p.range.clone()] })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synth::{synth_model, Preset, SynthSpec};
    use crate::model::{ModelConfig, ModelWeights};

    fn values(t: &candle_core::Tensor) -> Vec<f32> {
        t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("f32")
    }

    #[test]
    fn stored_bytes_give_the_loaders_values_for_every_dtype_and_sharding() {
        for (dtype, shards) in [("bfloat16", 1), ("float16", 3), ("float32", 2)] {
            let dir = tempfile::tempdir().expect("tmp");
            let spec = SynthSpec { dtype: dtype.into(), shards, ..SynthSpec::new(Preset::Tiny, 3) };
            synth_model(dir.path(), &spec).expect("synth");
            let cfg = ModelConfig::from_dir(dir.path()).expect("config");
            let reference = ModelWeights::load(dir.path(), &cfg).expect("candle's loader");
            let st = StoredTensors::open(dir.path()).expect("opens");
            let (h, q) = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim);
            let embed = st.get("model.embed_tokens.weight", &[cfg.vocab_size, h]).expect("embed");
            let want = if dtype == "float32" {
                StoredDtype::F32
            } else if dtype == "bfloat16" {
                StoredDtype::BF16
            } else {
                StoredDtype::F16
            };
            assert_eq!(embed.dtype, want, "{dtype}: stored as written, not converted");
            assert_eq!(embed.to_f32(), values(&reference.embed_tokens), "{dtype}");
            let qp = st.get("model.layers.1.self_attn.q_proj.weight", &[q, h]).expect("q");
            assert_eq!(qp.to_f32(), values(&reference.layers[1].q_proj), "{dtype} x{shards}");
            assert_eq!(qp.f32_range(5..9), values(&reference.layers[1].q_proj)[5..9].to_vec());
            let file_bytes: u64 = model_files(dir.path())
                .expect("files")
                .iter()
                .map(|p| std::fs::metadata(p).expect("meta").len())
                .sum();
            assert_eq!(st.bytes() as u64, file_bytes, "what is held is the files, nothing more");
            let e = st.get("model.norm.weight", &[h + 1]).expect_err("shape");
            assert!(e.to_string().contains("config says"), "{e}");
            assert!(st.get("nope", &[1]).is_err());
        }
    }

    #[test]
    fn half_precision_converts_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x8001), -(2f32.powi(-24)));
        assert!(f16_to_f32(0x7c00).is_infinite() && f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x3555), 0.33325195);
    }

    #[test]
    fn a_hostile_file_is_refused_with_its_reason() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("model.safetensors");
        let write = |header: &str, data: usize| {
            let mut b = (header.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(header.as_bytes());
            b.extend(std::iter::repeat_n(0u8, data));
            std::fs::write(&path, b).expect("write");
        };
        for (header, data, why) in [
            (r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, 4, "outside"),
            (r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8, "bytes for shape"),
            (r#"{"a":{"dtype":"I8","shape":[8],"data_offsets":[0,8]}}"#, 8, "dtype"),
            (r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#, 8, "outside"),
            (
                r#"{"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}}"#,
                8,
                "bytes for shape",
            ),
            ("not json", 8, "JSON"),
        ] {
            write(header, data);
            let e = StoredTensors::open(dir.path()).expect_err(why);
            assert!(e.to_string().contains(why), "{header}: {e}");
        }
        std::fs::write(&path, (u64::MAX).to_le_bytes()).expect("write");
        assert!(StoredTensors::open(dir.path())
            .expect_err("huge header")
            .to_string()
            .contains("does not fit"));
    }
}
