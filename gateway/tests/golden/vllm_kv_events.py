#!/usr/bin/env python3
"""Golden vLLM KV event frames for kvgate's decoder (gateway/src/foreign/vllm_events.rs).

The event classes are taken from vLLM's own source, not rewritten: this script reads the class definitions out of
`vllm/distributed/kv_events.py` of a vLLM source tree (an sdist from PyPI), executes them with msgspec, and encodes
batches the way vLLM's ZmqEventPublisher does (msgspec.msgpack.Encoder; frames: topic, 8-byte big-endian sequence,
payload). Output: vllm_kv_events.json next to this file, one entry per frame with what the decoder must find.

usage: vllm_kv_events.py PATH/TO/vllm/distributed/kv_events.py VLLM_VERSION
(needs msgspec; generated with vLLM 0.33.0 and msgspec 0.23.0)
"""
import ast
import hashlib
import sys
from typing import Any

import msgspec

from golden_io import write_golden

WANT = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch")


def load_classes(path, array_like_events=False):
    tree = ast.parse(open(path).read())
    body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in WANT]
    if array_like_events:
        # The older wire format (vLLM before events became maps): events as tagged arrays.
        for n in body:
            if n.name == "KVCacheEvent":
                n.keywords.append(ast.keyword(arg="array_like", value=ast.Constant(True)))
    mod = ast.Module(body=body, type_ignores=[])
    ns = {"msgspec": msgspec, "Any": Any, "ExternalBlockHash": bytes | int}
    exec(compile(ast.fix_missing_locations(mod), path, "exec"), ns)
    return ns


def frames(ns, fmt):
    BS, BR, AC, B = ns["BlockStored"], ns["BlockRemoved"], ns["AllBlocksCleared"], ns["KVEventBatch"]
    enc = msgspec.msgpack.Encoder()
    toks = list(range(1000, 1048))
    out = []

    def add(name, seq, batch, expect, topic=b""):
        out.append({"name": f"{fmt}/{name}", "topic_hex": topic.hex(), "seq": seq,
                    "payload_hex": enc.encode(batch).hex(), "expect": expect})

    # Three blocks stored in two events (the second chained to the first's last), one removed, then cleared.
    add("int-hashes", 7, B(ts=1.5, events=[
        BS(block_hashes=[11, 12], parent_block_hash=None, token_ids=toks[:32], block_size=16, lora_id=None,
           medium="GPU", lora_name=None),
        BS(block_hashes=[13], parent_block_hash=12, token_ids=toks[32:48], block_size=16, lora_id=None,
           medium="GPU", lora_name=None),
        BR(block_hashes=[13], medium="GPU"),
        AC(),
    ]), {"ts": 1.5, "dp_rank": None, "events": [
        {"type": "stored", "hashes": ["i:11", "i:12"], "parent": None, "tokens": toks[:32], "block_size": 16,
         "medium": "GPU", "keyed": False},
        {"type": "stored", "hashes": ["i:13"], "parent": "i:12", "tokens": toks[32:48], "block_size": 16,
         "medium": "GPU", "keyed": False},
        {"type": "removed", "hashes": ["i:13"], "medium": "GPU"},
        {"type": "cleared"},
    ]}, topic=b"kv-events")
    # sha256 block hashes (bytes), a data-parallel rank, a 64-bit hash with the top bit set.
    h1 = hashlib.sha256(b"one").digest()
    h2 = hashlib.sha256(b"two").digest()
    add("bytes-hashes", 8, B(ts=2.25, events=[
        BS(block_hashes=[h1, h2], parent_block_hash=None, token_ids=toks[:32], block_size=16, lora_id=None,
           medium=None, lora_name=None),
        BR(block_hashes=[h2, 2**64 - 5], medium="CPU"),
    ], data_parallel_rank=1), {"ts": 2.25, "dp_rank": 1, "events": [
        {"type": "stored", "hashes": ["b:" + h1.hex(), "b:" + h2.hex()], "parent": None, "tokens": toks[:32],
         "block_size": 16, "medium": None, "keyed": False},
        {"type": "removed", "hashes": ["b:" + h2.hex(), f"i:{2**64 - 5}"], "medium": "CPU"},
    ]})
    # Blocks hashed with extra keys (a LoRA, a cache salt): kvgate cannot rebuild those hashes.
    add("extra-keys", 9, B(ts=3.0, events=[
        BS(block_hashes=[21], parent_block_hash=None, token_ids=toks[:16], block_size=16, lora_id=3,
           medium="GPU", lora_name="adapter", extra_keys=[("adapter", "salt")]),
    ]), {"ts": 3.0, "dp_rank": None, "events": [
        {"type": "stored", "hashes": ["i:21"], "parent": None, "tokens": toks[:16], "block_size": 16,
         "medium": "GPU", "keyed": True},
    ]})
    # A LoRA adapter's blocks alone: vLLM lists the adapter's bare name as each block's extra key
    # (`to_event_extra_keys`); kvgate rebuilds them under the adapter's name. An adapter without a name cannot be.
    add("lora", 10, B(ts=3.5, events=[
        BS(block_hashes=[31, 32], parent_block_hash=None, token_ids=toks[:32], block_size=16, lora_id=1,
           medium="GPU", lora_name="sql-lora", extra_keys=[("sql-lora",), ("sql-lora",)]),
        BS(block_hashes=[33], parent_block_hash=32, token_ids=toks[32:48], block_size=16, lora_id=1,
           medium="GPU", lora_name="sql-lora", extra_keys=[("sql-lora", "salt")]),
        BS(block_hashes=[34], parent_block_hash=None, token_ids=toks[:16], block_size=16, lora_id=2,
           medium="GPU", lora_name=None),
    ]), {"ts": 3.5, "dp_rank": None, "events": [
        {"type": "stored", "hashes": ["i:31", "i:32"], "parent": None, "tokens": toks[:32], "block_size": 16,
         "medium": "GPU", "keyed": False, "lora": "sql-lora"},
        {"type": "stored", "hashes": ["i:33"], "parent": "i:32", "tokens": toks[32:48], "block_size": 16,
         "medium": "GPU", "keyed": True, "lora": "sql-lora"},
        {"type": "stored", "hashes": ["i:34"], "parent": None, "tokens": toks[:16], "block_size": 16,
         "medium": "GPU", "keyed": True, "lora": None},
    ]})
    return out


def main():
    path, version = sys.argv[1], sys.argv[2]
    out = {"vllm_version": version, "msgspec_version": msgspec.__version__, "frames": []}
    out["frames"] += frames(load_classes(path), "map-events")
    out["frames"] += frames(load_classes(path, array_like_events=True), "array-events")
    dst = write_golden("vllm_kv_events.json", out)
    print(f"{len(out['frames'])} frames -> {dst}")


if __name__ == "__main__":
    main()
