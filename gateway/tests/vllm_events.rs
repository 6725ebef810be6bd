//! vLLM's KV event wire format, pinned: golden frames encoded by vLLM 0.33.0's own event classes
//! (`tests/golden/vllm_kv_events.py`), in both encodings vLLM has shipped (events as maps, and as tagged arrays),
//! must decode to exactly what the generator recorded.

use kvgate_gateway::vllm_events::{decode_frames, ExternalHash, KvEvent};
use serde_json::Value;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

fn hash_name(h: &ExternalHash) -> String {
    match h {
        ExternalHash::Int(i) => format!("i:{i}"),
        ExternalHash::Bytes(b) => format!("b:{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>()),
    }
}

#[test]
fn golden_frames_from_vllm_decode_exactly() {
    let golden: Value =
        serde_json::from_str(include_str!("golden/vllm_kv_events.json")).expect("golden frames parse");
    assert_eq!(golden["vllm_version"], "0.33.0");
    let frames = golden["frames"].as_array().expect("frames");
    assert_eq!(frames.len(), 6);
    for f in frames {
        let name = f["name"].as_str().expect("name");
        let topic = unhex(f["topic_hex"].as_str().expect("topic"));
        let seq = (f["seq"].as_i64().expect("seq")).to_be_bytes();
        let payload = unhex(f["payload_hex"].as_str().expect("payload"));
        let (got_seq, batch) =
            decode_frames(&[&topic, &seq, &payload]).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = &f["expect"];
        assert_eq!(got_seq, f["seq"].as_i64().expect("seq"), "{name}");
        assert_eq!(batch.ts, want["ts"].as_f64().expect("ts"), "{name}");
        assert_eq!(batch.data_parallel_rank, want["dp_rank"].as_i64(), "{name}");
        assert_eq!(batch.unknown, 0, "{name}");
        let events = want["events"].as_array().expect("events");
        assert_eq!(batch.events.len(), events.len(), "{name}");
        for (got, want) in batch.events.iter().zip(events) {
            match (got, want["type"].as_str().expect("type")) {
                (
                    KvEvent::Stored { block_hashes, parent, token_ids, block_size, medium, keyed },
                    "stored",
                ) => {
                    let names: Vec<String> = block_hashes.iter().map(hash_name).collect();
                    let want_names: Vec<String> = want["hashes"]
                        .as_array()
                        .expect("hashes")
                        .iter()
                        .map(|h| h.as_str().expect("hash").to_owned())
                        .collect();
                    assert_eq!(names, want_names, "{name}");
                    assert_eq!(parent.as_ref().map(hash_name).as_deref(), want["parent"].as_str(), "{name}");
                    let want_tokens: Vec<u32> = want["tokens"]
                        .as_array()
                        .expect("tokens")
                        .iter()
                        .map(|t| t.as_u64().expect("token") as u32)
                        .collect();
                    assert_eq!(token_ids, &want_tokens, "{name}");
                    assert_eq!(*block_size as u64, want["block_size"].as_u64().expect("bs"), "{name}");
                    assert_eq!(medium.as_deref(), want["medium"].as_str(), "{name}");
                    assert_eq!(*keyed, want["keyed"].as_bool().expect("keyed"), "{name}");
                }
                (KvEvent::Removed { block_hashes, medium }, "removed") => {
                    let names: Vec<String> = block_hashes.iter().map(hash_name).collect();
                    let want_names: Vec<&str> = want["hashes"]
                        .as_array()
                        .expect("hashes")
                        .iter()
                        .map(|h| h.as_str().expect("h"))
                        .collect();
                    assert_eq!(names, want_names, "{name}");
                    assert_eq!(medium.as_deref(), want["medium"].as_str(), "{name}");
                }
                (KvEvent::AllCleared, "cleared") => {}
                (got, want) => panic!("{name}: decoded {got:?}, expected a {want} event"),
            }
        }
    }
}

#[test]
fn a_golden_batch_indexes_vllm_blocks_under_kvgate_hashes() {
    use kvgate_gateway::vllm_index::{Applied, EventIndex};
    use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
    let golden: Value = serde_json::from_str(include_str!("golden/vllm_kv_events.json")).expect("golden");
    let frame = golden["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .find(|f| f["name"] == "map-events/int-hashes")
        .expect("frame");
    let payload = unhex(frame["payload_hex"].as_str().expect("payload"));
    let (seq, batch) = decode_frames(&[b"kv-events", &7i64.to_be_bytes(), &payload]).expect("decode");
    let scheme = HashScheme::new(16, 5);
    let tokens: Vec<u32> = (1000..1048).collect();
    let want = BlockHasher::new(&scheme, &ExtraKeys::none()).hash_blocks(&tokens);
    // Apply the batch without its last two events (a removal and a clear) to see the three stored blocks.
    let mut stores = batch.clone();
    stores.events.truncate(2);
    let mut ix = EventIndex::new(&scheme);
    assert_eq!(ix.apply(seq, &stores), Applied::InOrder);
    assert!(want.iter().all(|h| ix.holds(*h)), "vLLM's three blocks under kvgate's hashes");
    // The whole batch: block 3 removed, then everything cleared.
    let mut ix = EventIndex::new(&scheme);
    let mut first3 = batch.clone();
    first3.events.truncate(3);
    ix.apply(seq, &first3);
    assert!(ix.holds(want[0]) && ix.holds(want[1]) && !ix.holds(want[2]));
    ix.apply(seq + 1, &batch);
    assert!(ix.is_empty());
}
