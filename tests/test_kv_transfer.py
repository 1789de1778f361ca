"""KV transfer between two engine instances over NIXL: a prefill server in a subprocess, a decode client
here. The decode engine's greedy tokens equal a single instance's; a killed, paused or lying prefill
instance costs a recompute and leaks no block or pin on either side."""
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("nixl._api", reason="KV transfer needs nixl (pip install 'pagedkv[nixl]')")
pytest.importorskip("zmq", reason="KV transfer needs pyzmq")

from engine_fixtures import save_tiny_llama  # noqa: E402

from pagedkv.engine import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.kv.transfer import FingerprintMismatch, KVTransferClient, KVTransferError, coalesce

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, UCX_NET_DEVICES="lo", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
GREEDY = SamplingParams(max_tokens=6, temperature=0)
BS = 16


def start_server(model, *args):
    """A prefill instance in a subprocess; returns (process, endpoint)."""
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv.engine.kv.transfer", str(model), "--cpu-threads", "1",
                             "--block-size", str(BS), *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=ENV, cwd=ROOT)
    for line in proc.stdout:
        if line.startswith(b"pagedkv-kv-transfer "):
            return proc, line.split()[1].decode()
    raise RuntimeError(f"the prefill server exited with {proc.wait()}")


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait()


def prompts(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvt") / "tiny"
    save_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def server(model):
    proc, endpoint = start_server(model)
    yield endpoint
    stop(proc)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of a single instance."""
    llm = LLM(model, cpu_threads=1, block_size=BS)
    return lambda ps: [o.token_ids for o in llm.generate(ps, GREEDY)]


def decode_engine(model, **kwargs):
    return LLM(model, cpu_threads=1, block_size=BS, **kwargs)


def assert_no_leak(llm):
    llm.bm.check_invariants()
    assert llm.bm.num_free_blocks == llm.bm.num_blocks
    assert llm.bm.num_pinned_blocks == 0


def test_remote_prefill_is_token_exact(model, server, reference):
    batch = prompts(0, [70, 33, 16, 100, 48])
    llm = decode_engine(model)
    with KVTransferClient(llm, server) as client:
        out = client.generate(batch, GREEDY)
        assert [o.token_ids for o in out] == reference(batch)
        received = [r.accepted_blocks for r in client.last_transfers]
        assert received == [4, 2, 0, 6, 2]          # all full blocks but the last, which decode computes
        assert all(r.fallback is None for r in client.last_transfers)
        # The received blocks were prefix hits of the admitted prompts: only the rest was computed here.
        assert llm.stats()["cached_prompt_tokens"] == BS * sum(received)
        stats = client.server_stats()
        assert stats["active_leases"] == 0 and stats["pinned_blocks"] == 0
    assert_no_leak(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["int4"])
def test_quantised_blocks_cross_bit_exactly(model, kv_cache_dtype):
    """int4 rows (their steps and minima inside the rows): with every key read from the int4 cache, a decode
    instance fed the remote blocks answers exactly as a single instance of the same format."""
    plain = dict(kv_recent_tokens=0, kv_first_block=False)
    proc, endpoint = start_server(model, "--kv-cache-dtype", kv_cache_dtype, "--kv-recent-tokens", "0",
                                  "--no-kv-first-block")
    try:
        batch = prompts(9, [70, 40, 100])
        single = decode_engine(model, kv_cache_dtype=kv_cache_dtype, **plain)
        want = [o.token_ids for o in single.generate(batch, GREEDY)]
        llm = decode_engine(model, kv_cache_dtype=kv_cache_dtype, **plain)
        with KVTransferClient(llm, endpoint) as client:
            out = client.generate(batch, GREEDY)
            assert [r.accepted_blocks for r in client.last_transfers] == [4, 2, 6], [r.fallback for r in client.last_transfers]
            assert [o.token_ids for o in out] == want
        assert_no_leak(llm)
        with pytest.raises(FingerprintMismatch, match="kv_dtype|cache_layout"):   # the other format is refused
            other = "int4" if kv_cache_dtype != "int4" else "fp8_e4m3"
            KVTransferClient(decode_engine(model, kv_cache_dtype=other, **plain), endpoint)
    finally:
        stop(proc)


def test_partial_local_hit_reads_only_the_rest(model, server, reference):
    head, tail = prompts(1, [48, 60])
    llm = decode_engine(model)
    llm.generate([head], GREEDY)                       # its 3 full blocks are cached here
    with KVTransferClient(llm, server) as client:
        out = client.generate([head + tail], GREEDY)
        (result,) = client.last_transfers
        assert (result.local_blocks, result.read_blocks, result.accepted_blocks) == (3, 3, 3)
        assert result.bytes_read == 3 * client.cache.block_bytes * len(client.cache.tensors)
    assert [o.token_ids for o in out] == reference([head + tail])
    assert_no_leak(llm)


def test_repeated_prompt_is_read_once(model, server, reference):
    (prompt,) = prompts(5, [60])
    llm = decode_engine(model)
    with KVTransferClient(llm, server) as client:
        out = client.generate([prompt, prompt], GREEDY)
        assert [(r.read_blocks, r.accepted_blocks) for r in client.last_transfers] == [(3, 3), (0, 0)]
        assert client.server_stats()["pinned_blocks"] == 0
    assert [o.token_ids for o in out] == reference([prompt, prompt])
    assert_no_leak(llm)


def test_malformed_replies_are_refused(model, server, reference):
    batch = prompts(6, [70, 70, 70])
    llm = decode_engine(model)
    with KVTransferClient(llm, server) as client:
        receive, calls = client._receive, []

        def malformed(token_ids, reply, result):     # a prefill instance that lies about its blocks
            calls.append(reply)
            if len(calls) == 1:
                reply["blocks"][0] = client.remote["num_blocks"]
            elif len(calls) == 2:
                reply["blocks"].append(reply["blocks"][-1])
            else:
                reply["identities"] = reply["identities"][:1]
            receive(token_ids, reply, result)
        client._receive = malformed
        out = client.generate(batch, GREEDY)
        assert all(r.accepted_blocks == 0 and "malformed" in r.fallback for r in client.last_transfers)
        assert client.server_stats()["pinned_blocks"] == 0
    assert [o.token_ids for o in out] == reference(batch)
    assert_no_leak(llm)


def test_block_whose_identity_differs_is_recomputed(model, server, reference):
    (prompt,) = prompts(2, [90])
    llm = decode_engine(model)
    with KVTransferClient(llm, server) as client:
        receive = client._receive

        def tampered(token_ids, reply, result):     # the prefill side describes block 3 as other tokens
            reply["identities"][3]["tokens"][0] ^= 1
            receive(token_ids, reply, result)
        client._receive = tampered
        out = client.generate([prompt], GREEDY)
        (result,) = client.last_transfers
        assert result.read_blocks == 5 and result.accepted_blocks == 3 and "block 3" in result.fallback
        assert llm.stats()["cached_prompt_tokens"] == 3 * BS
        assert client.server_stats()["pinned_blocks"] == 0
    assert [o.token_ids for o in out] == reference([prompt])
    assert_no_leak(llm)


@pytest.mark.parametrize("drive", ["generate", "run"])
def test_prefill_killed_mid_transfer_falls_back_to_recompute(model, reference, drive):
    """generate() transfers then decodes; run() submits and reads while the engine steps: either way the
    read of the dead peer's memory fails and the prompts are recomputed."""
    proc, endpoint = start_server(model)
    try:
        batch = prompts(3, [80, 50])
        llm = decode_engine(model)
        with KVTransferClient(llm, endpoint, timeout_s=5) as client:
            read = client._start_read

            def kill_then_read(runs):                 # the lease is granted, the bytes are not read yet
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                return read(runs)
            client._start_read = kill_then_read
            start = time.monotonic()
            out = getattr(client, drive)(batch, GREEDY)
            # run() may read one prompt's blocks before the other's reply came: that reply never comes and
            # waits out timeout_s (5 s); nothing waits longer
            assert time.monotonic() - start < (5 if drive == "generate" else 9)
            # the read of the dead peer's memory ends in state ERR (UCX: remote disconnect), not in a hang
            assert all(r.accepted_blocks == 0 and r.fallback for r in client.last_transfers)
            assert any("NIXL read failed" in r.fallback for r in client.last_transfers)
            assert llm.stats()["cached_prompt_tokens"] == 0
        assert [o.token_ids for o in out] == reference(batch)
        assert_no_leak(llm)
    finally:
        stop(proc)


def test_lost_reply_times_out_and_the_lease_ends(model, reference):
    proc, endpoint = start_server(model, "--lease-s", "1")
    try:
        batch = prompts(4, [64])
        llm = decode_engine(model)
        with KVTransferClient(llm, endpoint, timeout_s=2) as client:
            proc.send_signal(signal.SIGSTOP)         # the request is never answered in time
            out = client.generate(batch, GREEDY)
            assert "timeout" in client.last_transfers[0].fallback
            assert [o.token_ids for o in out] == reference(batch)
            assert_no_leak(llm)
            proc.send_signal(signal.SIGCONT)         # it computes the prompt late and lends its blocks ...
            deadline = time.monotonic() + 20
            while True:
                stats = client.server_stats()
                if stats and stats["prefills"] == 1 and stats["active_leases"] == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            # ... under a lease nobody confirms: it ends, and the pin with it.
            assert stats["leases"] == 1 and stats["expired"] == 1 and stats["pinned_blocks"] == 0
    finally:
        stop(proc)


def test_fingerprint_mismatch_names_the_field(model, server, tmp_path):
    with pytest.raises(FingerprintMismatch, match="'block_size'") as info:
        KVTransferClient(LLM(model, cpu_threads=1, block_size=8), server)
    assert info.value.field == "block_size"
    other = tmp_path / "other"
    save_tiny_llama(other, seed=1)
    with pytest.raises(FingerprintMismatch, match="'model'"):
        KVTransferClient(decode_engine(other), server)
    with pytest.raises(FingerprintMismatch, match="'kv_dtype'"):
        KVTransferClient(decode_engine(model, kv_cache_dtype="fp8_e4m3", kv_scale=1.0), server)


def test_no_server_is_a_clear_error(model):
    with pytest.raises(KVTransferError, match="no answer"):
        KVTransferClient(decode_engine(model), "tcp://127.0.0.1:9", timeout_s=0.5)


def test_hostile_messages_get_errors_and_change_nothing(model, server):
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server)
    bad = [b"not json", b"[1, 2]", b'{"type": "nope", "id": 1}', b'{"type": "prefill", "id": 2}',
           b'{"type": "prefill", "id": 3, "token_ids": [1, 99999]}',
           b'{"type": "prefill", "id": 4, "token_ids": [1.5, 2]}',
           b'{"type": "prefill", "id": 5, "token_ids": [1, 2], "first_block": -1}',
           b'{"type": "done", "id": 6, "lease": "ffff"}']
    for body in bad:
        sock.send(body)
    replies = []
    for _ in bad:
        assert sock.poll(20000)
        replies.append(sock.recv_json())
    ctx.destroy(0)
    assert sum(r["type"] == "error" for r in replies) == 7
    assert [r for r in replies if r["type"] == "done"] == [{"type": "done", "id": 6, "held": False}]
    with KVTransferClient(decode_engine(model), server) as client:
        stats = client.server_stats()
        assert stats["bad_requests"] == 7 and stats["pinned_blocks"] == 0


def test_coalesce_runs():
    assert coalesce([4, 5, 6, 9, 10], [1, 2, 3, 7, 9]) == [(4, 1, 3), (9, 7, 1), (10, 9, 1)]
    assert coalesce([], []) == []


def test_missing_nixl_is_an_import_error_saying_what_to_install():
    code = ("import sys; sys.modules['nixl'] = None; sys.modules['nixl._api'] = None\n"
            "from pagedkv.engine.kv.transfer import KVTransferServer\n"
            "try:\n    KVTransferServer(None)\nexcept ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert 'pip install "pagedkv[nixl]"' in done.stdout, done.stderr


def test_bad_arguments_are_refused_before_anything_starts(model, server):
    llm = decode_engine(model)
    with pytest.raises(ValueError, match="timeout_s"):
        KVTransferClient(llm, server, timeout_s=0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVTransferClient(decode_engine(model, enable_prefix_caching=False), server)
    from pagedkv.engine.kv.transfer import KVTransferServer
    with pytest.raises(ValueError, match="lease_s"):
        KVTransferServer(llm, lease_s=float("nan"))
    with KVTransferClient(llm, server) as client:
        before = client.server_stats()["prefills"]
        for bad in ([1.5, 2], [10**9], "text needs a tokenizer", [], [float("nan")] * 40):
            with pytest.raises((TypeError, ValueError)):
                client.generate([bad], GREEDY)
            with pytest.raises((TypeError, ValueError)):
                client.submit(bad, GREEDY)
            with pytest.raises((TypeError, ValueError)):
                client.run([list(range(40)), bad], GREEDY)       # nothing is sent unless every prompt is good
        with pytest.raises(TypeError):
            client.submit(list(range(40)), {"max_tokens": 3})
        assert not client.has_unfinished() and client.server_stats()["prefills"] == before
    assert_no_leak(llm)


def test_a_late_read_needs_the_lease_confirmed(model, server, reference, monkeypatch):
    from pagedkv.engine.kv.transfer import receive

    batch = prompts(7, [50])
    monkeypatch.setattr(receive, "LEASE_MARGIN", 0.0)      # every read counts as late: done must confirm
    llm = decode_engine(model)
    with KVTransferClient(llm, server) as client:
        out = client.generate(batch, GREEDY)
        (result,) = client.last_transfers
        assert result.accepted_blocks == 3 and result.fallback is None and "done_s" in result.timings
    assert [o.token_ids for o in out] == reference(batch)
    assert_no_leak(llm)


def test_blocks_read_after_the_lease_ended_are_not_registered(model, reference):
    proc, endpoint = start_server(model, "--lease-s", "0.001")
    try:
        batch = prompts(8, [50])
        llm = decode_engine(model)
        with KVTransferClient(llm, endpoint) as client:
            out = client.generate(batch, GREEDY)
            (result,) = client.last_transfers
            assert result.accepted_blocks == 0 and "lease ended" in result.fallback
            assert llm.stats()["cached_prompt_tokens"] == 0
            stats = client.server_stats()
            assert stats["expired"] == 1 and stats["pinned_blocks"] == 0
        assert [o.token_ids for o in out] == reference(batch)
        assert_no_leak(llm)
    finally:
        stop(proc)


def test_host_tier_hits_count_as_local(model, server, reference):
    head, tail, *others = prompts(9, [48, 60, 120, 120, 120])
    llm = decode_engine(model, num_blocks=24, host_cache_bytes=1 << 20)
    llm.generate([head], GREEDY)
    llm.generate(others, GREEDY)                       # head's blocks leave the device for the host tier
    device, host = llm.bm.lookup(head + tail)[:2]
    assert host > 0
    with KVTransferClient(llm, server) as client:
        out = client.generate([head + tail], GREEDY)
        (result,) = client.last_transfers
        assert result.local_blocks == device + host == 3 and result.accepted_blocks == 3
    assert [o.token_ids for o in out] == reference([head + tail])
    llm.bm.check_invariants()
    assert llm.bm.num_pinned_blocks == 0 and llm.bm.num_free_blocks == llm.bm.num_blocks


def test_submitted_transfers_overlap_the_engines_decoding(model, reference):
    proc, endpoint = start_server(model)
    try:
        first, second = prompts(11, [70, 90])
        long = SamplingParams(max_tokens=12, temperature=0)
        llm = decode_engine(model)
        with KVTransferClient(llm, endpoint, timeout_s=30) as client:
            a = client.submit(first, long)
            while a.request is None or not llm._output(a.request).token_ids:
                client.step()
            assert a.result.accepted_blocks == 4 and a.result.fallback is None
            proc.send_signal(signal.SIGSTOP)          # the second prompt's prefill waits ...
            b = client.submit(second, GREEDY)
            before = len(llm._output(a.request).token_ids)
            for _ in range(4):
                client.step()
            assert b.request is None, "its blocks are not in yet"
            assert len(llm._output(a.request).token_ids) == before + 4, "... while the first one decodes"
            proc.send_signal(signal.SIGCONT)
            while client.has_unfinished():
                client.step()
            assert b.result.accepted_blocks == 5 and b.result.fallback is None
            single = LLM(model, cpu_threads=1, block_size=BS)
            assert llm._output(a.request).token_ids == single.generate([first], long)[0].token_ids
            assert llm._output(b.request).token_ids == reference([second])[0]
            assert client._held == [] and client.server_stats()["pinned_blocks"] == 0
        assert_no_leak(llm)
    finally:
        stop(proc)


def test_run_is_token_exact_with_local_hits_repeats_and_short_prompts(model, server, reference):
    batch = prompts(12, [60, 10, 75])
    batch.append(list(batch[0]))                       # the same prompt again: one read, then a local hit
    llm = decode_engine(model)
    with KVTransferClient(llm, server) as client:
        out = client.run(batch, GREEDY)
        results = client.last_transfers
        assert results[1].read_blocks == 0 and results[1].fallback is None      # under one block: local
        assert results[0].accepted_blocks == 3 and results[2].accepted_blocks == 4
        # the copy reads its own blocks when both replies are handled in one step, else the first's serve it
        assert results[3].fallback is None and results[3].read_blocks in (0, 3)
        assert llm.stats()["cached_prompt_tokens"] >= 3 * 48
    assert [o.token_ids for o in out] == reference(batch)
    assert_no_leak(llm)
