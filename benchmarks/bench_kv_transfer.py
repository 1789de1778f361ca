"""KV block transfer between two engine instances (a prefill server in a subprocess, a decode client in this
process) against a plain NIXL read of the same bytes with the same descriptors, in the same run.

For each KV block size (bytes of one block in one cache tensor: 64 KiB to 2 MiB; a random fp32 Llama with
8 KV heads of 128 dims, so a block of 16 tokens is 64 KiB), each repeat sends a fresh 1025-token prompt:
the prefill instance computes it and lends its 1024 tokens of full blocks, the decode instance receives
them (allocate, NIXL read, identity checks, the done round trip, registration). Printed per block size
(medians over the repeats):

  pagedkv GB/s   bytes / the whole receive (reply in hand to blocks registered)
  read GB/s      bytes / the NIXL read inside it
  plain GB/s     bytes / a plain NIXL READ of the same descriptors from the same remote agent, taken right
                 before or after pagedkv's by turns, while the blocks are lent (descriptor list built, read
                 posted, waited on)
  ratio          pagedkv / plain, the median of each repeat's ratio (the two reads of a repeat are
                 taken back to back); read ratio: the NIXL read alone / plain
  control ms     a request's time on the decode side minus the remote compute and the NIXL read: the
                 control messages, lookups, allocation, checks (handshake excluded), then with the
                 handshake (a new client: NIXL agent, cache registration, fingerprints, connection)

With --overlap: prompts arrive one every few decode steps while earlier ones decode; the decode instance
either transfers each on arrival and then steps on (transfer(), which waits for the remote prefill and the
read) or submits it and steps on (submit() / step(), which read while the engine decodes). Printed per
mode, median over the repeats (modes alternate): the wall time of the workload and the longest pause
between two decode steps of the requests already running.

    python benchmarks/bench_kv_transfer.py
    python benchmarks/bench_kv_transfer.py --block-kib 512 2048 --repeats 9
    python benchmarks/bench_kv_transfer.py --overlap --repeats 5
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pagedkv.engine import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.kv.transfer import KVTransferClient, block_descriptors  # noqa: E402

KV_HEADS, HEAD_DIM, LAYERS, PROMPT_BLOCK_TOKENS = 8, 128, 2, 1024
TOKEN_BYTES = KV_HEADS * HEAD_DIM * 4            # one token of one cache tensor, fp32


def save_model(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
                                      num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                      vocab_size=512, max_position_embeddings=2048)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def start_server(model: str, block_size: int, threads: int, num_blocks: int | None = None):
    num_blocks = num_blocks or blocks_for(block_size)
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv.engine.kv.transfer", model, "--block-size", str(block_size),
                             "--cpu-threads", str(threads), "--num-blocks", str(num_blocks)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    for line in proc.stdout:
        if line.startswith(b"pagedkv-kv-transfer "):
            return proc, line.split()[1].decode()
    raise RuntimeError(f"the prefill server exited with {proc.wait()}")


def blocks_for(block_size: int) -> int:
    """A pool that holds a few prompts at once (each repeat's prompt is new)."""
    return 4 * (PROMPT_BLOCK_TOKENS // block_size + 1)


def plain_read(client: KVTransferClient, runs) -> float:
    """Seconds of a NIXL READ of `runs` with pagedkv's descriptors, from the same remote agent."""
    agent, cache = client.agent, client.cache
    start = time.perf_counter()
    local, remote = block_descriptors(runs, [t.data_ptr() for t in cache.tensors], client.remote["bases"],
                                      cache.block_bytes, cache.device_id, client.remote["device_id"])
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, cache.mem_type),
                                   agent.get_xfer_descs(remote, cache.mem_type), client.remote_name)
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - start
    handle.release()
    if state != "DONE":
        raise RuntimeError(f"plain NIXL read: {state}")
    return elapsed


def measure(model: str, kib: int, repeats: int, threads: int, rng: random.Random) -> dict:
    block_size = kib * 1024 // TOKEN_BYTES
    proc, endpoint = start_server(model, block_size, threads)
    try:
        llm = LLM(model, block_size=block_size, num_blocks=blocks_for(block_size), cpu_threads=threads)
        handshakes = []
        for _ in range(3):
            start = time.perf_counter()
            KVTransferClient(llm, endpoint).close()
            handshakes.append(time.perf_counter() - start)
        rows = []
        for k, v in llm.runner.kv_caches:      # a serving engine's cache pages are mapped: no first-touch faults
            k.zero_()
            v.zero_()
        with KVTransferClient(llm, endpoint) as client:
            start_read, finish_read, plain, turn = client._start_read, client._finish_read, [], {}

            def start_beside_plain(runs):
                """pagedkv's read and a plain one of the same descriptors, both while the blocks are lent
                (the prefill server in the same state), taking turns at going first."""
                turn["plain_first"], turn["runs"] = len(plain) % 2 == 1, runs
                if turn["plain_first"]:
                    plain.append(plain_read(client, runs))
                return start_read(runs)

            def finish_beside_plain(read, block):
                state = finish_read(read, block)
                if state != "PROC" and not turn["plain_first"]:
                    plain.append(plain_read(client, turn["runs"]))
                return state
            client._start_read, client._finish_read = start_beside_plain, finish_beside_plain
            for i in range(repeats + 1):                       # the first is a warm-up
                prompt = [rng.randrange(512) for _ in range(PROMPT_BLOCK_TOKENS + 1)]
                start = time.perf_counter()
                (result,) = client.transfer([prompt])
                total = time.perf_counter() - start
                client.release()
                if result.fallback or result.accepted_blocks != PROMPT_BLOCK_TOKENS // block_size:
                    raise RuntimeError(f"transfer fell back: {result}")
                t = result.timings
                if i:
                    # the plain read ran inside this transfer: not part of pagedkv's control time
                    rows.append(dict(bytes=result.bytes_read, receive=t["receive_s"] - plain[-1],
                                     read=t["read_s"] - plain[-1], plain=plain[-1],
                                     control=total - t["compute_s"] - t["read_s"],
                                     descriptors=len(result.runs) * len(client.cache.tensors)))
                    rows[-1].update(ratio=rows[-1]["plain"] / rows[-1]["receive"],
                                    read_ratio=rows[-1]["plain"] / rows[-1]["read"])
            llm.bm.check_invariants()
    finally:
        proc.kill()
        proc.wait()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["handshake"] = statistics.median(handshakes)
    return med


def overlap(model: str, repeats: int, threads: int, rng: random.Random, num_prompts: int = 8, gap_steps: int = 3,
            max_tokens: int = 24) -> dict:
    block_size = 64 * 1024 // TOKEN_BYTES
    # pools that hold every prompt of the workload at once (the prefill side computes arrivals in batches)
    proc, endpoint = start_server(model, block_size, threads, num_prompts * blocks_for(block_size))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    times: dict = {"transfer": [], "submit": []}
    try:
        llm = LLM(model, block_size=block_size, num_blocks=num_prompts * blocks_for(block_size), cpu_threads=threads)
        with KVTransferClient(llm, endpoint) as client:
            for i in range(2 * repeats + 2):                   # the first pair is a warm-up
                mode = ("transfer", "submit")[i % 2]
                batch = [[rng.randrange(512) for _ in range(PROMPT_BLOCK_TOKENS + 1)] for _ in range(num_prompts)]
                start, last, stall, steps, results = time.perf_counter(), None, 0.0, 0, []
                arrived = 0
                while arrived < num_prompts or client.has_unfinished():
                    if arrived < num_prompts and steps >= arrived * gap_steps:
                        if mode == "transfer":
                            results += client.transfer([batch[arrived]])
                            llm.add_request(batch[arrived], params)
                        else:
                            results.append(client.submit(batch[arrived], params).result)
                        arrived += 1
                    running = llm.has_unfinished()
                    client.step() if mode == "submit" else client.llm.step()
                    now = time.perf_counter()
                    if running and last is not None:
                        stall = max(stall, now - last)
                    last, steps = now, steps + 1
                client.release()
                if any(r.fallback for r in results):
                    raise RuntimeError(f"{mode}: a transfer fell back: {[r.fallback for r in results]}")
                if i >= 2:
                    times[mode].append((time.perf_counter() - start, stall))
                llm.bm.check_invariants()
    finally:
        proc.kill()
        proc.wait()
    return {m: (statistics.median(t for t, _ in v), statistics.median(s for _, s in v)) for m, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-kib", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each instance")
    parser.add_argument("--overlap", action="store_true", help="arrivals during decoding: transfer() vs submit()")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        save_model(model)
        if args.overlap:
            m = overlap(model, args.repeats, args.threads, rng)
            print(f"{'mode':>10} {'wall s':>8} {'longest decode pause ms':>24}")
            for mode, (wall, stall) in m.items():
                print(f"{mode:>10} {wall:>8.3f} {stall * 1e3:>24.1f}")
            print(f"submit / transfer: wall {m['submit'][0] / m['transfer'][0]:.2f}x, "
                  f"longest pause {m['submit'][1] / m['transfer'][1]:.2f}x")
            return
        print(f"{'block':>8} {'MiB/req':>8} {'descs':>6} {'pagedkv GB/s':>13} {'read GB/s':>10} {'plain GB/s':>11} "
              f"{'ratio':>6} {'read ratio':>11} {'control ms':>11} {'+handshake':>11}")
        for kib in args.block_kib:
            m = measure(model, kib, args.repeats, args.threads, rng)
            gb = m["bytes"] / 1e9
            print(f"{kib:>5} KiB {m['bytes'] / 2**20:>8.1f} {m['descriptors']:>6.0f} {gb / m['receive']:>13.2f} "
                  f"{gb / m['read']:>10.2f} {gb / m['plain']:>11.2f} {m['ratio']:>6.2f} {m['read_ratio']:>11.2f} "
                  f"{m['control'] * 1e3:>11.2f} {(m['control'] + m['handshake']) * 1e3:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
