//! vLLM's KV event wire format, pinned: golden frames encoded by vLLM 0.33.0's own event classes
//! (`tests/golden/vllm_kv_events.py`), in both encodings vLLM has shipped (events as maps, and as tagged arrays),
//! must decode to exactly what the generator recorded; and frames a real vLLM pod published and replayed
//! (`tests/golden/vllm_kv_events_live.py`), which must keep the index where the pod's own `cached_tokens` says.

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
    assert_eq!(frames.len(), 8);
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
                        block_hashes,
                        parent,
                        token_ids,
                        block_size,
                        medium,
                        keyed_from,
                        lora,
                        ..
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
                    if let Some(l) = want.get("lora") {
                        assert_eq!(lora.as_deref(), l.as_str(), "{name}");
                    }
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

/// A LoRA adapter's blocks (vLLM 0.33's frame) are indexed under the adapter's name, as the gateway hashes a
/// request for that adapter on a pod: never as the base model's blocks; an event keyed by more (a salt) is not.
#[test]
fn a_golden_lora_batch_indexes_the_adapters_blocks_under_its_name() {
    use kvgate_router::registry::event_index::{Applied, EventIndex};
    use kvgate_shared::hashing::{BlockHasher, ExtraKey, ExtraKeys, HashScheme};
    let golden: Value = serde_json::from_str(include_str!("golden/vllm_kv_events.json")).expect("golden");
    let frame = golden["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .find(|f| f["name"] == "map-events/lora")
        .expect("frame");
    let payload = unhex(frame["payload_hex"].as_str().expect("payload"));
    let (seq, batch) = decode_frames(&[b"kv-events", &3i64.to_be_bytes(), &payload]).expect("decode");
    let scheme = HashScheme::new(16, 5);
    let tokens: Vec<u32> = (1000..1048).collect();
    let lora = ExtraKeys::none().with(ExtraKey::LoraAdapter("sql-lora".into()));
    let as_lora = BlockHasher::new(&scheme, &lora).hash_blocks(&tokens);
    let as_base = BlockHasher::new(&scheme, &ExtraKeys::none()).hash_blocks(&tokens);
    let mut ix = EventIndex::new(&scheme);
    assert_eq!(ix.apply(seq, &batch), Applied::InOrder);
    assert!(ix.holds(as_lora[0]) && ix.holds(as_lora[1]), "the adapter's two blocks under its name");
    assert!(!ix.holds(as_lora[2]), "the salted third block is not rebuilt");
    assert!(as_base.iter().all(|h| !ix.holds(*h)), "never as the base model's blocks");
    assert_eq!(ix.len(), 2, "the nameless adapter's block is not indexed either");
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

/// A batch missed on the live stream is fetched from the pod's replay socket, so the index keeps what the missed
/// batch stored instead of being cleared. The batches are the ones a real vLLM pod published and replayed
/// (`golden/vllm_kv_events_live.json`, seq 16-21: a prompt stored, the same salted, four more that evict); a libzmq
/// PUB sends them live without batch 18 (the first eviction prompt's blocks), a ROUTER answers replays as vLLM's does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missed_batch_is_replayed_instead_of_clearing_the_index() {
    use kvgate_gateway::pods::vllm_subscriber::follow;
    use kvgate_router::registry::event_index::EventIndex;
    use kvgate_shared::hashing::{BlockHash, HashScheme};
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};
    let Some(py) = common::python("pyzmq") else { return };
    let (port, replay_port) = (common::free_port(), common::free_port());
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/vllm_kv_events_live.json");
    let g: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("golden")).expect("golden");
    let frames: Vec<(i64, Vec<u8>)> = g["replay"]["frames"]
        .as_array()
        .expect("replayed frames")
        .iter()
        .map(|f| (f["seq"].as_i64().expect("seq"), unhex(f["payload_hex"].as_str().expect("payload"))))
        .filter(|(seq, _)| (16..=21).contains(seq))
        .collect();
    assert_eq!(frames.len(), 6);
    // What the index holds after every batch in order, and after the same with batch 18 lost (cleared at the gap).
    let scheme = HashScheme::new(32, 0);
    let held = |skip_to_clear: bool| -> HashSet<BlockHash> {
        let mut ix = EventIndex::new(&scheme);
        for (seq, payload) in &frames {
            if skip_to_clear && *seq == 18 {
                ix.clear();
                continue;
            }
            let (_, batch) = decode_frames(&[b"kv-events", &seq.to_be_bytes(), payload]).expect("decodes");
            ix.apply(*seq, &batch);
        }
        ix.hashes().collect()
    };
    let (want, without_replay) = (held(false), held(true));
    assert!(!want.is_empty() && want != without_replay, "the missed batch matters");
    let script = format!(
        r#"
import json, time, zmq
frames = [(f["seq"], bytes.fromhex(f["payload_hex"])) for f in json.load(open({path:?}))["replay"]["frames"]
          if 16 <= f["seq"] <= 21]
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB); pub.bind("tcp://127.0.0.1:{port}")
rep = ctx.socket(zmq.ROUTER); rep.bind("tcp://127.0.0.1:{replay_port}")
start = time.time()
while time.time() < start + 10:
    # The first batch over and over until the subscriber has joined, then the rest once, without batch 18.
    live = frames[:1] if time.time() < start + 3 else [f for f in frames if f[0] != 18]
    for seq, payload in live:
        pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
    while rep.poll(0):
        ident, _, first = rep.recv_multipart()
        for seq, payload in frames:
            if seq >= int.from_bytes(first, "big"):
                rep.send_multipart([ident, b"", b"kv-events", seq.to_bytes(8, "big"), payload])
        rep.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
    time.sleep(0.2)
"#
    );
    let mut publisher =
        std::process::Command::new(py).arg("-c").arg(script).spawn().expect("python publisher");
    let set: Arc<Mutex<HashSet<BlockHash>>> = Arc::default();
    let sink = set.clone();
    let task = tokio::spawn(follow(
        format!("tcp://127.0.0.1:{port}"),
        Some(format!("tcp://127.0.0.1:{replay_port}")),
        "kv-events".into(),
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
    let got = set.lock().expect("set").clone();
    assert!(ok, "batch 18 came from the replay socket: {} held, {} wanted", got.len(), want.len());
}

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
