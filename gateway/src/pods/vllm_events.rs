//! vLLM's KV event stream, decoded: what a vLLM pod started with `--kv-events-config` publishes on its ZMQ PUB
//! socket (frames: topic, an 8-byte big-endian sequence number, a msgpack payload) and sends back from its replay
//! socket. The payload is an `EventBatch` (`[ts, events, data_parallel_rank]`); each event is `BlockStored`,
//! `BlockRemoved` or `AllBlocksCleared`, tagged by class name, as a map (`{"type": "BlockStored", ...}`, vLLM 0.33)
//! or as an array (`["BlockStored", ...]`, older releases). Block hashes are vLLM's own (64-bit integers or sha256
//! bytes); a stored event carries its blocks' token ids, from which kvgate rebuilds its own chained hashes.
//!
//! Null is not a key: a real pod sends `lora_id`, `lora_name` as null and `extra_keys` as one entry per block, null
//! for a block of tokens alone; the first non-null entry is where the event's blocks stop being rebuildable
//! (`keyed_from`). `group_idx` / `kv_cache_spec_kind` say which KV cache group (full attention or another kind).
//!
//! The wire format is pinned by frames a real vLLM pod published (`tests/golden/vllm_kv_events_live.py`) and by
//! frames encoded with vLLM's own classes (`tests/golden/vllm_kv_events.py`).
//! Every field is checked: a frame over [`MAX_FRAME_BYTES`], nested deeper than [`MAX_DEPTH`], with more than
//! [`MAX_EVENTS`] events or a malformed field is refused whole with a [`EventError`]; unknown event types are
//! skipped (counted), so a newer vLLM's additions do not stop the stream.

use rmpv::Value;

/// Largest payload decoded (a step that stores a 1M-token prompt is about 5 MB).
pub const MAX_FRAME_BYTES: usize = 8 << 20;
/// Deepest nesting accepted, in rmpv's count (a batch with extra keys needs 6; rmpv counts its values too).
pub const MAX_DEPTH: usize = 16;
/// Most events in one batch.
pub const MAX_EVENTS: usize = 65_536;
/// Longest block hash in bytes (vLLM's are 8-byte integers or 32-byte sha256 digests).
pub const MAX_HASH_BYTES: usize = 64;

pub use kvgate_router::registry::kv_events::{CacheGroup, EventBatch, ExternalHash, KvEvent};

/// Why a frame was refused (the subscriber counts these by kind and resyncs; never retried as is).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventError {
    /// Not three frames, or a sequence number that is not 8 bytes.
    Framing(String),
    TooLarge(usize),
    /// Not msgpack, or nested deeper than [`MAX_DEPTH`].
    Msgpack(String),
    /// Valid msgpack that is not an event batch.
    Shape(String),
}

impl std::fmt::Display for EventError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EventError::Framing(m) => write!(f, "vLLM KV event framing: {m}"),
            EventError::TooLarge(n) => {
                write!(f, "vLLM KV event payload of {n} bytes (limit {MAX_FRAME_BYTES})")
            }
            EventError::Msgpack(m) => write!(f, "vLLM KV event payload is not msgpack: {m}"),
            EventError::Shape(m) => write!(f, "vLLM KV event batch: {m}"),
        }
    }
}

impl EventError {
    /// A short name for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            EventError::Framing(_) => "framing",
            EventError::TooLarge(_) => "too_large",
            EventError::Msgpack(_) => "msgpack",
            EventError::Shape(_) => "shape",
        }
    }
}

fn shape(m: impl Into<String>) -> EventError {
    EventError::Shape(m.into())
}

/// The sequence number of a PUB frame's second part (big-endian, signed: the replay's end marker is -1).
pub fn sequence(bytes: &[u8]) -> Result<i64, EventError> {
    let b: [u8; 8] =
        bytes.try_into().map_err(|_| EventError::Framing(format!("{}-byte sequence", bytes.len())))?;
    Ok(i64::from_be_bytes(b))
}

/// Decodes one published message: `[topic, sequence, payload]`.
pub fn decode_frames(parts: &[&[u8]]) -> Result<(i64, EventBatch), EventError> {
    let [_topic, seq, payload] = parts else {
        return Err(EventError::Framing(format!("{} parts, expected 3", parts.len())));
    };
    Ok((sequence(seq)?, decode_batch(payload)?))
}

/// Decodes an `EventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, EventError> {
    if payload.len() > MAX_FRAME_BYTES {
        return Err(EventError::TooLarge(payload.len()));
    }
    let mut rd = payload;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| EventError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(EventError::Msgpack(format!("{} bytes after the batch", rd.len())));
    }
    let Value::Array(fields) = v else { return Err(shape("not an array")) };
    let ts = match fields.first() {
        Some(Value::F64(t)) => *t,
        Some(Value::F32(t)) => f64::from(*t),
        Some(v) if v.as_i64().is_some() => v.as_i64().unwrap_or(0) as f64,
        _ => return Err(shape("ts is not a number")),
    };
    let Some(Value::Array(raw)) = fields.get(1) else { return Err(shape("events is not an array")) };
    if raw.len() > MAX_EVENTS {
        return Err(shape(format!("{} events (limit {MAX_EVENTS})", raw.len())));
    }
    let data_parallel_rank = match fields.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| shape("data_parallel_rank is not an integer"))?),
    };
    let mut events = Vec::with_capacity(raw.len());
    let mut unknown = 0;
    for e in raw {
        match decode_event(e)? {
            Some(ev) => events.push(ev),
            None => unknown += 1,
        }
    }
    Ok(EventBatch { ts, events, data_parallel_rank, unknown })
}

/// An event's fields by name, from either encoding (array: by vLLM's field order).
struct Fields<'a> {
    tag: &'a str,
    named: Vec<(&'a str, &'a Value)>,
}

const STORED_ORDER: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
];
const REMOVED_ORDER: &[&str] = &["block_hashes", "medium", "group_idx"];

impl<'a> Fields<'a> {
    fn of(v: &'a Value) -> Result<Self, EventError> {
        match v {
            Value::Map(kv) => {
                let mut tag = None;
                let mut named = Vec::with_capacity(kv.len());
                for (k, v) in kv {
                    let k = k.as_str().ok_or_else(|| shape("an event key is not a string"))?;
                    if k == "type" {
                        tag = Some(v.as_str().ok_or_else(|| shape("an event type is not a string"))?);
                    } else {
                        named.push((k, v));
                    }
                }
                Ok(Fields { tag: tag.ok_or_else(|| shape("an event without a type"))?, named })
            }
            Value::Array(items) => {
                let tag =
                    items.first().and_then(Value::as_str).ok_or_else(|| shape("an event without a tag"))?;
                let order = match tag {
                    "BlockStored" => STORED_ORDER,
                    "BlockRemoved" => REMOVED_ORDER,
                    _ => &[],
                };
                let named = order.iter().copied().zip(items.iter().skip(1)).collect();
                Ok(Fields { tag, named })
            }
            _ => Err(shape("an event is neither a map nor an array")),
        }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.named.iter().find(|(k, _)| *k == name).map(|(_, v)| *v).filter(|v| !v.is_nil())
    }
}

fn hash(v: &Value) -> Result<ExternalHash, EventError> {
    match v {
        Value::Binary(b) if !b.is_empty() && b.len() <= MAX_HASH_BYTES => Ok(ExternalHash::Bytes(b.clone())),
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(ExternalHash::Int(u)),
            (None, Some(s)) => Ok(ExternalHash::Int(s as u64)),
            _ => Err(shape("a block hash out of range")),
        },
        _ => Err(shape("a block hash is neither an integer nor 1-64 bytes")),
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<ExternalHash>, EventError> {
    match v {
        Some(Value::Array(a)) => a.iter().map(hash).collect(),
        _ => Err(shape("block_hashes is not an array")),
    }
}

fn medium(f: &Fields<'_>) -> Result<Option<String>, EventError> {
    match f.get("medium") {
        None => Ok(None),
        Some(v) => Ok(Some(v.as_str().ok_or_else(|| shape("medium is not a string"))?.to_owned())),
    }
}

/// The index of the first block whose `extra_keys` entry is not null (nor an empty list).
/// The first block keyed by more than its tokens and `lora` (an event's adapter: vLLM lists its bare name as each
/// block's extra key, `[name]`); `None`: every block is its tokens (and the adapter) alone.
fn keyed_from(v: Option<&Value>, lora: Option<&str>) -> Result<Option<usize>, EventError> {
    let only_lora = |a: &[Value]| matches!((a, lora), ([Value::String(n)], Some(l)) if n.as_str() == Some(l));
    match v {
        None => Ok(None),
        Some(Value::Array(per_block)) => Ok(per_block.iter().position(|k| match k {
            Value::Nil => false,
            Value::Array(a) => !a.is_empty() && !only_lora(a),
            _ => true,
        })),
        Some(_) => Err(shape("extra_keys is not an array")),
    }
}

/// vLLM's KV cache spec kinds whose blocks are a prefix a request reuses whole.
const FULL_ATTENTION_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

fn group(f: &Fields<'_>) -> Result<CacheGroup, EventError> {
    let idx = match f.get("group_idx") {
        None => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| shape("group_idx is not an integer"))?),
    };
    let full_attention = match f.get("kv_cache_spec_kind") {
        None => None,
        Some(v) => {
            let kind = v.as_str().ok_or_else(|| shape("kv_cache_spec_kind is not a string"))?;
            Some(FULL_ATTENTION_KINDS.contains(&kind))
        }
    };
    Ok(CacheGroup { idx, full_attention })
}

fn decode_event(v: &Value) -> Result<Option<KvEvent>, EventError> {
    let f = Fields::of(v)?;
    match f.tag {
        "BlockStored" => {
            let block_hashes = hashes(f.get("block_hashes"))?;
            let parent = f.get("parent_block_hash").map(hash).transpose()?;
            let block_size = f
                .get("block_size")
                .and_then(Value::as_u64)
                .filter(|b| (1..=4096).contains(b))
                .ok_or_else(|| shape("block_size is not an integer in 1..=4096"))?
                as usize;
            let Some(Value::Array(t)) = f.get("token_ids") else {
                return Err(shape("token_ids is not an array"));
            };
            let token_ids = t
                .iter()
                .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| shape("a token id is not a 32-bit unsigned integer"))?;
            if token_ids.len() != block_hashes.len() * block_size {
                return Err(shape(format!(
                    "{} token ids for {} blocks of {block_size}",
                    token_ids.len(),
                    block_hashes.len()
                )));
            }
            // A LoRA adapter keys every block by its name (rebuilt under that name, as the gateway keys a pod's
            // adapter); an adapter without a name cannot be rebuilt. Otherwise the first block with an extra key
            // other than the adapter's (vLLM sends one entry per block, null for a block of tokens alone).
            let lora = match f.get("lora_name") {
                None => None,
                Some(Value::String(n)) => match n.as_str() {
                    Some(n) if !n.is_empty() && n.len() <= kvgate_shared::report::MAX_ADAPTER_NAME_BYTES => {
                        Some(n.to_owned())
                    }
                    _ => return Err(shape("lora_name is not a name of 1 to 256 bytes")),
                },
                Some(_) => return Err(shape("lora_name is not a string")),
            };
            let keyed_from = match (&lora, f.get("lora_id")) {
                (None, Some(_)) => Some(0),
                _ => keyed_from(f.get("extra_keys"), lora.as_deref())?,
            };
            Ok(Some(KvEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                medium: medium(&f)?,
                keyed_from,
                lora,
                group: group(&f)?,
            }))
        }
        "BlockRemoved" => Ok(Some(KvEvent::Removed {
            block_hashes: hashes(f.get("block_hashes"))?,
            medium: medium(&f)?,
            group: group(&f)?,
        })),
        "AllBlocksCleared" => Ok(Some(KvEvent::AllCleared)),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).expect("encode");
        out
    }

    #[test]
    fn hostile_payloads_are_refused_whole_and_unknown_events_skipped() {
        assert!(matches!(decode_batch(&vec![0x90; MAX_FRAME_BYTES + 1]), Err(EventError::TooLarge(_))));
        assert!(matches!(decode_batch(&[0x92]), Err(EventError::Msgpack(_))));
        assert!(decode_batch(&[0xc1]).is_err());
        // Nested past the depth limit.
        let deep = [0x91u8; 64];
        assert!(matches!(decode_batch(&deep), Err(EventError::Msgpack(_))));
        // A header claiming four billion elements with nothing behind it allocates nothing and fails.
        assert!(matches!(decode_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff]), Err(EventError::Msgpack(_))));
        let batch =
            |events: Vec<Value>| Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::Nil]);
        let stored = |tokens: usize| {
            Value::Array(vec![
                "BlockStored".into(),
                Value::Array(vec![Value::from(1u64)]),
                Value::Nil,
                Value::Array((0..tokens).map(|t| Value::from(t as u64)).collect()),
                Value::from(16u64),
            ])
        };
        let r = decode_batch(&enc(&batch(vec![stored(15)])));
        assert!(matches!(r, Err(EventError::Shape(_))), "{r:?}");
        let ok = decode_batch(&enc(&batch(vec![stored(16), Value::Array(vec!["BlockMoved".into()])])))
            .expect("ok");
        assert_eq!((ok.events.len(), ok.unknown), (1, 1));
        let neg = Value::Array(vec!["BlockRemoved".into(), Value::Array(vec![Value::from(-5i64)])]);
        let b = decode_batch(&enc(&batch(vec![neg]))).expect("ok");
        assert_eq!(
            b.events,
            vec![KvEvent::Removed {
                block_hashes: vec![ExternalHash::Int(-5i64 as u64)],
                medium: None,
                group: CacheGroup::default()
            }]
        );
        let bad_token = Value::Array(vec![
            "BlockStored".into(),
            Value::Array(vec![Value::from(1u64)]),
            Value::Nil,
            Value::Array(vec![Value::from(1u64 << 40); 16]),
            Value::from(16u64),
        ]);
        assert!(decode_batch(&enc(&batch(vec![bad_token]))).is_err());
        assert!(matches!(decode_frames(&[b"", b"1234567", b""]), Err(EventError::Framing(_))));
        assert!(matches!(decode_frames(&[b"", b""]), Err(EventError::Framing(_))));
        assert_eq!(sequence(&(-1i64).to_be_bytes()), Ok(-1));
    }
}
