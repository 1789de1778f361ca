"""KV events over ZeroMQ in vLLM's wire format: a subscriber in another process (tests/kv_events_subscriber.py)
rebuilds the index of cached blocks from the socket and must match the engine's cached_blocks(); the
replay socket fills a gap; the payload decodes with vLLM 0.32's own classes when a vLLM install is
available (the interpreter in $PAGEDKV_VLLM_PYTHON, default /work/vllm-venv/bin/python), otherwise with
the subscriber's own copy of the schema."""
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from engine_fixtures import save_tiny_llama, shared_prefix_prompts
from pagedkv.engine import LLM, SamplingParams

zmq = pytest.importorskip("zmq", reason="KV events need pyzmq (pip install 'pagedkv[events]')")
msgspec = pytest.importorskip("msgspec", reason="KV events need msgspec (pip install 'pagedkv[events]')")

from pagedkv.engine.kv.events import END_OF_REPLAY, KVEventPublisher, binds  # noqa: E402

SUBSCRIBER = str(Path(__file__).with_name("kv_events_subscriber.py"))
VLLM_PYTHON = os.environ.get("PAGEDKV_VLLM_PYTHON", "/work/vllm-venv/bin/python")
SCHEMA_UNAVAILABLE = 3       # the subscriber's exit status when --schema vllm cannot import vLLM
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def vllm_python() -> str | None:
    """An interpreter that may have vLLM (this one, or the vLLM venv's), else None."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return VLLM_PYTHON if os.path.exists(VLLM_PYTHON) else None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_events")
    model = save_tiny_llama(path)
    return str(path), shared_prefix_prompts(model.config.vocab_size, per_system=4)


class Subscriber:
    def __init__(self, python, pub, replay, *args):
        self.proc = subprocess.Popen([python, SUBSCRIBER, pub, replay, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line and self.proc.wait() == SCHEMA_UNAVAILABLE:
            pytest.skip(f"vLLM's kv_events classes do not import under {python}")
        assert json.loads(line) == {"ready": True}, line

    def result(self, num_published: int) -> dict:
        out, _ = self.proc.communicate(f"{num_published}\n", timeout=120)
        assert self.proc.returncode == 0, out
        return json.loads(out.strip().splitlines()[-1])


def endpoints(tmp_path):
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


def run_engine(path, prompts, pub, replay, subscriber_args=(), python=sys.executable, **kwargs):
    """Generates in two rounds in a pool small enough to evict, resets the prefix cache between them;
    returns (the subscriber's result, the engine's cached block hashes)."""
    llm = LLM(path, block_size=4, num_blocks=48, kv_events_endpoint=pub, kv_events_replay_endpoint=replay, **kwargs)
    sub = Subscriber(python, pub, replay, *subscriber_args)
    try:
        llm.generate(prompts, PARAMS)
        llm.bm.reset_prefix_cache()
        llm.generate(prompts[::-1], PARAMS)
        llm.kv_events.flush()
        num = llm.kv_events.num_published
        result = sub.result(num)
        cached = sorted(h for h, _ in llm.bm.cached_blocks())
        stats = llm.stats()
    finally:
        llm.close()
        if sub.proc.poll() is None:
            sub.proc.kill()
    assert stats["evictions"] > 0 and stats["events_dropped"] == 0
    assert result["applied"] == num
    return result, cached


@pytest.mark.parametrize("schema", ["own", "vllm"])
def test_subscriber_in_another_process_rebuilds_the_index(tiny, tmp_path, schema):
    path, prompts = tiny
    python = sys.executable
    if schema == "vllm":
        python = vllm_python()
        if python is None:
            pytest.skip(f"no vLLM here nor at {VLLM_PYTHON}")
    pub, replay = endpoints(tmp_path)
    result, cached = run_engine(path, prompts, pub, replay, ["--schema", schema], python=python)
    assert result["hashes"] == cached
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(result["events"])
    assert result["token_ids_ok"] and result["token_ids_sent"] == result["events"]["BlockStored"]
    assert result["ranks"] == [0]


def test_replay_socket_fills_a_gap(tiny, tmp_path):
    path, prompts = tiny
    pub, replay = endpoints(tmp_path)
    result, cached = run_engine(path, prompts, pub, replay, ["--drop", "2,3,7"])
    assert result["dropped"] >= 1 and result["replayed"] >= 1
    assert result["hashes"] == cached


def test_events_without_token_ids(tiny, tmp_path):
    path, prompts = tiny
    pub, replay = endpoints(tmp_path)
    result, cached = run_engine(path, prompts, pub, replay, kv_events_include_token_ids=False)
    assert result["hashes"] == cached and result["token_ids_sent"] == 0


def test_speculative_drafts_are_never_published(tiny, tmp_path):
    """Rejected drafts never enter the prefix cache, so no event names them: the index still matches."""
    path, prompts = tiny
    pub, replay = endpoints(tmp_path)
    result, cached = run_engine(path, prompts, pub, replay, speculative="ngram", num_speculative_tokens=3)
    assert result["hashes"] == cached


def test_wire_format_and_replay_protocol(tmp_path):
    """The raw frames, decoded without any schema: vLLM's layout, topic and sequence numbers."""
    pub_ep, replay_ep = endpoints(tmp_path)
    publisher = KVEventPublisher(pub_ep, replay_ep, topic="kv")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub_ep)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_ep)
    try:
        stored = dict(seq=0, kind="stored", block_hashes=[2**64 - 1, 7], parent_block_hash=None,
                      token_ids=list(range(8)), cache_salt=b"tenant", block_size=4, medium="GPU")
        removed = dict(seq=1, kind="removed", block_hashes=[7], parent_block_hash=None, token_ids=None,
                       cache_salt=None, block_size=4, medium="GPU")
        cleared = dict(seq=2, kind="cleared", block_hashes=[], parent_block_hash=None, token_ids=None,
                       cache_salt=None, block_size=4, medium="GPU")
        publisher.publish([])                  # an empty step sends nothing
        for batch in ([stored], [removed, cleared]):
            publisher.publish(batch)
        publisher.flush()
        assert publisher.num_published == 2
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))   # everything: the subscriber joined late
        frames = [dealer.recv_multipart() for _ in range(3)]
        assert [f[:3] for f in frames] == [[b"", b"kv", (0).to_bytes(8, "big")],
                                           [b"", b"kv", (1).to_bytes(8, "big")], [b"", b"", END_OF_REPLAY]]
        assert frames[2][3] == b""
        first = msgspec.msgpack.decode(frames[0][3])
        ts, events, rank = first
        assert isinstance(ts, float) and rank == 0
        assert events == [{"type": "BlockStored", "block_hashes": [2**64 - 1, 7], "parent_block_hash": None,
                           "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
                           "lora_name": None, "extra_keys": [["tenant"], None]}]
        assert msgspec.msgpack.decode(frames[1][3])[1] == [
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}, {"type": "AllBlocksCleared"}]
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        assert [f[2] for f in (dealer.recv_multipart(), dealer.recv_multipart())] == [(1).to_bytes(8, "big"),
                                                                                    END_OF_REPLAY]
        dealer.send_multipart((b"", b"bad"))        # malformed: ignored, the publisher goes on
        publisher.publish([cleared])
        publisher.flush()
        dealer.send_multipart((b"", (2).to_bytes(8, "big")))
        assert dealer.recv_multipart()[2] == (2).to_bytes(8, "big")
    finally:
        publisher.close()
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
    assert not publisher._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish([cleared])
    with pytest.raises(RuntimeError, match="closed"):
        publisher.flush()
    publisher.close()                               # idempotent


def test_connects_without_a_wildcard_and_binds_with_one():
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/x") and binds("inproc://x")
    assert not binds("tcp://127.0.0.1:5557") and not binds("tcp://router.local:5557")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)           # the consumer binds; the engine's PUB connects to it
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}")
    try:
        got = []
        stop = threading.Event()

        def keep_publishing():          # PUB drops messages until the connection is up
            while not stop.is_set():
                publisher.publish([dict(kind="cleared")])
                stop.wait(0.02)
        thread = threading.Thread(target=keep_publishing)
        thread.start()
        assert sub.poll(10_000)
        got = sub.recv_multipart()
        stop.set()
        thread.join()
        assert got[0] == b"" and len(got[1]) == 8
        assert msgspec.msgpack.decode(got[2])[1] == [{"type": "AllBlocksCleared"}]
    finally:
        publisher.close(linger_s=0)
        sub.close(linger=0)
        ctx.term()


def test_bad_endpoints_and_missing_packages(tiny, tmp_path, monkeypatch):
    path, _ = tiny
    with pytest.raises(ValueError, match="kv_events_endpoint"):
        LLM(path, kv_events_endpoint="localhost:5557")
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        LLM(path, kv_events_replay_endpoint=f"ipc://{tmp_path}/r")
    with pytest.raises(ValueError, match="cannot open"):
        KVEventPublisher("tcp://*:not-a-port")
    monkeypatch.setitem(sys.modules, "zmq", None)
    with pytest.raises(ImportError, match=r"pagedkv\[events\]"):
        LLM(path, kv_events_endpoint=f"ipc://{tmp_path}/p")


def test_events_are_off_unless_asked_for(tiny):
    path, prompts = tiny
    llm = LLM(path, block_size=4)
    assert llm.kv_events is None
    with pytest.raises(ValueError, match="enable_events=False"):
        llm.bm.take_events()


def test_close_stops_the_publisher_and_the_engine_goes_on(tiny, tmp_path):
    path, prompts = tiny
    pub, _ = endpoints(tmp_path)
    with LLM(path, block_size=4, kv_events_endpoint=pub) as llm:
        thread = llm.kv_events._thread
        first = llm.generate(prompts[:2], PARAMS)
    assert not thread.is_alive() and llm.kv_events is None
    assert [o.token_ids for o in llm.generate(prompts[:2], PARAMS)] == [o.token_ids for o in first]
    llm.close()
    assert Counter(t.name for t in threading.enumerate())["pagedkv-kv-events"] == 0
