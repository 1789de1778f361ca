"""KV-cache events over ZeroMQ in vLLM's wire format, so that consumers of vLLM's events (KV-aware
routers) read pagedkv unchanged.

Wire format (as vLLM's ZmqEventPublisher): each engine step with events is one PUB multipart message
(topic, 8-byte big-endian batch sequence number counting from 0, msgpack payload); the payload is an
array-like batch [ts, events, data_parallel_rank] whose events are maps tagged by "type":
"BlockStored", "BlockRemoved" or "AllBlocksCleared" (vLLM 0.32's KVEventBatch decodes it). An
endpoint with a wildcard (tcp://*:5557), an ipc:// or inproc:// endpoint binds, any other connects.
The optional replay endpoint is a ROUTER: a request (empty delimiter frame, 8-byte big-endian sequence
number N) is answered with every buffered batch from N on, each as (empty, topic, sequence number,
payload), then (empty, empty topic, -1 as 8 signed bytes, empty payload).

Optional: needs pyzmq and msgspec (pip install "pagedkv[events]"). Encoding and sending happen in a
background thread; close() sends what is queued and stops it."""
import logging
import queue
import threading
import time
from collections import deque

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def require_packages():
    try:
        import msgspec
        import zmq
    except ImportError:
        raise ImportError('kv_events_endpoint needs pyzmq and msgspec: pip install "pagedkv[events]" '
                          "(or pip install pyzmq msgspec)") from None
    return zmq, msgspec


def wire_schema(msgspec):
    """The msgspec structs of the wire format (vLLM's field order and tags), built lazily so that
    importing this module needs no msgspec."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple | None] | None = None    # per block; block 0's holds the cache_salt

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(Event):
        pass

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard (tcp://*:5557, ::), ipc:// or inproc:// endpoint, connect any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes block-manager events (the dicts of BlockManager.take_events()) batch by batch.

    include_token_ids=False sends every BlockStored with an empty token_ids list: a subscriber still
    learns which block hashes are cached (and can match hashes it computes itself), not the tokens."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 include_token_ids: bool = True, buffer_steps: int = 10_000, hwm: int = 100_000,
                 data_parallel_rank: int = 0):
        zmq, msgspec = require_packages()
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"kv_events_endpoint must be a ZeroMQ endpoint such as 'tcp://*:5557', got {endpoint!r}")
        if replay_endpoint is not None and (not isinstance(replay_endpoint, str) or "://" not in replay_endpoint):
            raise ValueError(f"kv_events_replay_endpoint must be a ZeroMQ endpoint such as 'tcp://*:5558', "
                             f"got {replay_endpoint!r}")
        if not isinstance(topic, str):
            raise TypeError(f"kv_events_topic must be a str, got {topic!r}")
        self._zmq = zmq
        self._schema = wire_schema(msgspec)
        self._encoder = msgspec.msgpack.Encoder()
        self.topic = topic.encode()
        self.include_token_ids = include_token_ids
        self.data_parallel_rank = data_parallel_rank
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            (self._pub.bind if binds(endpoint) else self._pub.connect)(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"KV events: cannot open {endpoint!r} / {replay_endpoint!r}: {e}") from None
        # The sockets are used only by the thread from here on (ZeroMQ sockets are not thread-safe).
        self._queue: queue.Queue = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.num_published = 0          # batches sent; the next one has this sequence number
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[dict]) -> None:
        """Queues one batch (one engine step's events); the thread encodes and sends it."""
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed")
        if events:
            self._queue.put((time.time(), events))

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every queued batch has been sent."""
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed")
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self, linger_s: float = 1.0) -> None:
        """Sends what is queued, stops the thread and closes the sockets (waiting up to linger_s for
        subscribers to take the last messages)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._close_sockets(linger_ms=int(linger_s * 1000))

    def _close_sockets(self, linger_ms: int = 0) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger_ms)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    logger.exception("KV events: replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                payload = self._encoder.encode(self._batch(*item))
                seq = self.num_published
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_published = seq + 1
            except Exception:
                logger.exception("KV events: publishing a batch failed")

    def _batch(self, ts: float, events: list[dict]):
        batch_type, stored, removed, cleared = self._schema
        out = []
        for e in events:
            if e["kind"] == "stored":
                salt = e["cache_salt"]
                extra = None if salt is None else [(_salt_str(salt),)] + [None] * (len(e["block_hashes"]) - 1)
                out.append(stored(block_hashes=e["block_hashes"], parent_block_hash=e["parent_block_hash"],
                                  token_ids=e["token_ids"] if self.include_token_ids else [],
                                  block_size=e["block_size"], lora_id=None, medium=e["medium"], lora_name=None,
                                  extra_keys=extra))
            elif e["kind"] == "removed":
                out.append(removed(block_hashes=e["block_hashes"], medium=e["medium"]))
            else:
                out.append(cleared())
        return batch_type(ts=ts, events=out, data_parallel_rank=self.data_parallel_rank)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignoring a malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))


def _salt_str(salt: bytes) -> str | bytes:
    """A cache_salt as vLLM sends it (a string) when it is UTF-8, else its bytes."""
    try:
        return salt.decode()
    except UnicodeDecodeError:
        return salt
