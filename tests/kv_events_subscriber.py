"""A KV-event subscriber run in its own process by test_kv_events_publisher.py, written as a consumer of
vLLM's events would be: SUB on the publisher, DEALER on its replay socket, payloads decoded by
msgspec.msgpack.Decoder(type=KVEventBatch) with vLLM's own classes (--schema vllm) or with the schema
written out below (--schema own). It rebuilds the index of cached block hashes from the events.

    python kv_events_subscriber.py PUB_ENDPOINT REPLAY_ENDPOINT [--schema own|vllm] [--drop 2,3]

Prints {"ready": true} once connected; then reads one line from stdin, the number of batches published,
makes sure it has applied batches 0 .. N-1 (asking the replay socket for any it missed) and prints the
index and counters as one JSON line. --drop ignores the first delivery of those batch numbers (a gap).
"""
import argparse
import json
import sys
from collections import Counter

import msgspec
import zmq

END = -1


def own_schema():
    """vLLM 0.32's layout, written out here independently of pagedkv's encoder: an array-like batch
    [ts, events, data_parallel_rank] of maps tagged by "type"."""
    block_hash = bytes | int
    opts = dict(tag=True, omit_defaults=True)
    stored = msgspec.defstruct("BlockStored", [
        ("block_hashes", list[block_hash]), ("parent_block_hash", block_hash | None), ("token_ids", list[int]),
        ("block_size", int), ("lora_id", int | None), ("medium", str | None), ("lora_name", str | None),
        ("extra_keys", list[tuple | None] | None, None)], **opts)
    removed = msgspec.defstruct("BlockRemoved", [("block_hashes", list[block_hash]), ("medium", str | None)], **opts)
    cleared = msgspec.defstruct("AllBlocksCleared", [], **opts)
    return msgspec.defstruct("KVEventBatch", [("ts", float), ("events", list[stored | removed | cleared]),
                                              ("data_parallel_rank", int | None, None)],
                             array_like=True, omit_defaults=True)


def vllm_schema():
    try:
        from vllm.distributed.kv_events import KVEventBatch
    except Exception as e:          # noqa: BLE001 (a broken vLLM install fails in many ways)
        print(f"cannot import vLLM's KV-event classes: {e!r}", file=sys.stderr)
        sys.exit(3)
    return KVEventBatch


class Index:
    def __init__(self, batch_type):
        self.decoder = msgspec.msgpack.Decoder(type=batch_type)
        self.hashes = Counter()
        self.counts = Counter()        # events by type
        self.token_ids_ok = True       # every stored event has block_size tokens per block (or none)
        self.token_ids_sent = 0
        self.ranks = set()

    def apply(self, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        self.ranks.add(batch.data_parallel_rank)
        for e in batch.events:
            kind = type(e).__name__
            self.counts[kind] += 1
            if kind == "BlockStored":
                self.hashes.update(e.block_hashes)
                if e.token_ids:
                    self.token_ids_sent += 1
                    self.token_ids_ok &= len(e.token_ids) == len(e.block_hashes) * e.block_size
            elif kind == "BlockRemoved":
                self.hashes.subtract(e.block_hashes)
                self.hashes = +self.hashes
            elif kind == "AllBlocksCleared":
                self.hashes.clear()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("pub")
    parser.add_argument("replay")
    parser.add_argument("--schema", choices=["own", "vllm"], default="own")
    parser.add_argument("--drop", default="")
    parser.add_argument("--topic", default="")
    args = parser.parse_args()
    to_drop = {int(s) for s in args.drop.split(",") if s}
    index = Index(vllm_schema() if args.schema == "vllm" else own_schema())

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(args.pub)
    sub.setsockopt_string(zmq.SUBSCRIBE, args.topic)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(args.replay)
    stats = Counter()
    next_seq = 0

    def fetch_from(start):
        nonlocal next_seq
        replay.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            _, topic, seq_bytes, payload = replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END:
                return
            assert topic == args.topic.encode(), topic
            if seq == next_seq:
                index.apply(payload)
                next_seq += 1
                stats["replayed"] += 1

    print(json.dumps({"ready": True}), flush=True)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    total = None
    while total is None or next_seq < total:
        ready = dict(poller.poll(100))
        if sub in ready:
            topic, seq_bytes, payload = sub.recv_multipart()
            assert topic == args.topic.encode(), topic
            seq = int.from_bytes(seq_bytes, "big")
            stats["received"] += 1
            if seq in to_drop:
                to_drop.discard(seq)
                stats["dropped"] += 1
                continue
            if seq > next_seq:
                fetch_from(next_seq)
            if seq == next_seq:
                index.apply(payload)
                next_seq += 1
        if sys.stdin.fileno() in ready and total is None:
            total = int(sys.stdin.readline())
            if next_seq < total:
                fetch_from(next_seq)
    print(json.dumps({"hashes": sorted(index.hashes.elements()), "events": dict(index.counts),
                      "token_ids_ok": index.token_ids_ok, "token_ids_sent": index.token_ids_sent,
                      "ranks": sorted(index.ranks), "applied": next_seq, **stats}), flush=True)
    sub.close(linger=0)
    replay.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
