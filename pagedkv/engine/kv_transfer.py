"""KV block transfer between two engine instances (disaggregated prefill): a prefill instance computes
prompts and lends their full blocks under a lease; a decode instance reads the blocks its prefix cache
lacks over NIXL straight into its own KV cache, checks each block's identity, registers the blocks as
cached and decodes. Control messages travel over ZeroMQ, KV bytes over NIXL (UCX).

Optional: needs nixl and pyzmq (pip install "pagedkv[nixl]"). docs/design.md ("KV transfer") has the
protocol and its failure rules."""
import argparse
import json
import os
import secrets
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedkv import AllocStatus, hash_block_tokens

from .kv_identity import kv_fingerprint
from .sampling import SamplingParams
from .scheduler import ScheduledBatch

PROTOCOL = 1
LEASE_MARGIN = 0.5    # a read ended within this share of the lease (from the request) needs no confirmation
WIRE_UP_S = 10.0      # how long the server drives the transport for a connecting decode instance
IDLE_WAIT_S = 0.005   # how long KVTransferClient.step() with nothing to run waits for a reply

__all__ = ["KVTransferServer", "KVTransferClient", "KVTransferError", "FingerprintMismatch", "PendingTransfer", "fingerprint",
           "check_fingerprint", "require_packages"]


class KVTransferError(RuntimeError):
    """A transfer session could not be set up (no answer to the handshake, a peer refusing it)."""


class FingerprintMismatch(KVTransferError):
    """The two instances' KV caches are not interchangeable; `field` names the first field that differs."""

    def __init__(self, field_name: str, local, remote):
        super().__init__(f"KV transfer peers differ in {field_name!r}: local {local!r}, remote {remote!r}")
        self.field = field_name


def require_packages():
    """(zmq, nixl_agent, nixl_agent_config), or an ImportError saying what to install."""
    try:
        import zmq
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-untyped]
    except ImportError:
        raise ImportError('KV transfer needs nixl and pyzmq: pip install "pagedkv[nixl]" '
                          "(or pip install nixl pyzmq)") from None
    return zmq, nixl_agent, nixl_agent_config


# ---- what both sides must agree on ---------------------------------------------------------------------
def _check_engine(llm) -> None:
    if llm.tp is not None:
        raise ValueError("KV transfer serves single-process engines (tensor_parallel_size=1)")
    if not llm.config.enable_prefix_caching:
        raise ValueError("KV transfer needs enable_prefix_caching=True: received blocks are registered in the "
                         "prefix cache, lent blocks are pinned there")
    if llm.model_config.group_windows != [None]:
        raise ValueError(f"KV transfer serves models with full attention in every layer (one KV group); this "
                         f"model's layer windows are {llm.model_config.group_windows}")


def fingerprint(llm) -> dict:
    """What makes two instances' blocks interchangeable (kv_identity.kv_fingerprint and the protocol
    version): a block read from one means the same in the other only when every field is equal."""
    return kv_fingerprint(llm, protocol=PROTOCOL)


def check_fingerprint(local: dict, remote: dict) -> None:
    """FingerprintMismatch naming the first field whose values differ (or that one side lacks)."""
    for name in sorted(set(local) | set(remote), key=lambda k: (k != "protocol", k)):
        if local.get(name) != remote.get(name):
            raise FingerprintMismatch(name, local.get(name), remote.get(name))


def _chain(token_ids: list[int], num_blocks: int, block_size: int, algo, salt) -> list[int]:
    """The chained hashes of the first num_blocks full blocks (the prefix cache's block hashes)."""
    hashes, parent = [], None
    for i in range(num_blocks):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = (hash_block_tokens(block, None, algo=algo, cache_salt=salt) if i == 0
                  else hash_block_tokens(block, parent, algo=algo))
        hashes.append(parent)
    return hashes


def _settle_moves(llm) -> None:
    """Performs and confirms the host-tier copies an allocation outside a step queued (write-backs of the
    blocks it took, loads of its host hits), as a step does before its attention."""
    if llm.bm.host_tier_enabled:
        moves = ScheduledBatch(offloads=llm.bm.take_offloads(), loads=llm.bm.take_loads())
        llm.runner.move_blocks(moves)
        llm.bm.complete_offloads(True)
        llm.bm.complete_loads(True)


def _new_seq_id(llm) -> int:
    """A sequence id the engine never hands out (its ids only grow)."""
    seq_id = llm.scheduler.next_seq_id
    llm.scheduler.next_seq_id += 1
    return seq_id


class _CacheRegion:
    """One engine's KV cache tensors registered with a NIXL agent, and their block geometry."""

    def __init__(self, agent, llm):
        self.tensors = [t for pair in llm.runner.kv_caches for t in pair]
        self.num_blocks = self.tensors[0].shape[0]
        self.block_bytes = self.tensors[0][0].numel() * self.tensors[0].element_size()
        self.mem_type = "VRAM" if self.tensors[0].is_cuda else "DRAM"
        self.device_id = self.tensors[0].device.index or 0
        self.agent = agent
        self.reg = agent.register_memory(self.tensors)

    def deregister(self) -> None:
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None

    def describe(self) -> dict:
        return {"bases": [t.data_ptr() for t in self.tensors], "block_bytes": self.block_bytes,
                "num_blocks": self.num_blocks, "device_id": self.device_id}


def coalesce(local_blocks: list[int], remote_blocks: list[int]) -> list[tuple[int, int, int]]:
    """Runs (local first block, remote first block, length) where both block lists go up by one."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local_blocks, remote_blocks):
        if runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == rb:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lb, rb, 1))
    return runs


def block_descriptors(runs, local_bases, remote_bases, block_bytes, local_dev=0, remote_dev=0):
    """NIXL descriptor arrays [n, 3] (address, bytes, device) for local and remote: one per cache tensor
    and run of contiguous blocks."""
    local, remote = [], []
    for lbase, rbase in zip(local_bases, remote_bases):
        for lb, rb, n in runs:
            local.append((lbase + lb * block_bytes, n * block_bytes, local_dev))
            remote.append((rbase + rb * block_bytes, n * block_bytes, remote_dev))
    return np.array(local, dtype=np.uint64).reshape(-1, 3), np.array(remote, dtype=np.uint64).reshape(-1, 3)


def _send(sock, message: dict, *frames: bytes, identity: bytes | None = None) -> None:
    parts = ([identity] if identity is not None else []) + [json.dumps(message).encode(), *frames]
    sock.send_multipart(parts)


# ---- prefill side ----------------------------------------------------------------------------------------
@dataclass
class _Lease:
    seq_id: int
    expires: float          # on the block manager's clock
    num_blocks: int


class KVTransferServer:
    """The prefill instance's side: answers the handshake with its fingerprint and NIXL metadata, computes
    the prompts decode instances send, pins their full blocks under a lease (ending `lease_s` later on
    the block manager's clock, which the server advances by the time that passes) and lets the pin go
    when the decode side says done or the lease ends.

    Runs in the prefill engine's thread: call serve() (until stop() from a signal handler or another
    thread) or poll() from your own loop."""

    def __init__(self, llm, endpoint: str = "tcp://127.0.0.1:0", *, lease_s: float = 30.0,
                 agent_name: str | None = None):
        zmq, nixl_agent, nixl_agent_config = require_packages()
        _check_engine(llm)
        if not (isinstance(lease_s, (int, float)) and lease_s > 0):
            raise ValueError(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        self.llm, self.bm, self.lease_s = llm, llm.bm, float(lease_s)
        self.name = agent_name or f"pagedkv-prefill-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.cache = _CacheRegion(self.agent, llm)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)
        self.endpoint = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.leases: dict[str, _Lease] = {}
        self.stats = dict(prefills=0, leases=0, released=0, expired=0, bad_requests=0)
        self._last_tick = time.monotonic()
        self._wire_up_until = 0.0       # a decode instance is connecting: drive the transport until then
        self._stopped = False
        self._zmq = zmq

    def _tick(self) -> None:
        """Advances the manager's clock by the time since the last tick and ends the leases past their end."""
        now = time.monotonic()
        self.bm.set_time(self.bm.now + max(now - self._last_tick, 0.0))
        self._last_tick = now
        for lease_id in [k for k, v in self.leases.items() if v.expires <= self.bm.now]:
            self._release(lease_id)
            self.stats["expired"] += 1

    def _release(self, lease_id: str) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        if self.bm.is_pinned(lease.seq_id):
            self.bm.unpin(lease.seq_id)
        return True

    def serve(self, poll_s: float = 0.05) -> None:
        """Answers requests until stop()."""
        self._stopped = False
        while not self._stopped:
            self.poll(poll_s)

    def stop(self) -> None:
        self._stopped = True

    def poll(self, timeout_s: float = 0.0) -> int:
        """Handles the messages that arrive within timeout_s (the prompts of all of them computed as one
        batch); returns how many it handled."""
        self._tick()
        messages = []
        if self._wait(timeout_s):
            while True:
                try:
                    messages.append(self.socket.recv_multipart(self._zmq.NOBLOCK))
                except self._zmq.Again:
                    break
        prefills = []
        for parts in messages:
            identity, body = parts[0], parts[1] if len(parts) > 1 else b""
            msg = None
            try:
                msg = json.loads(body)
                if not isinstance(msg, dict):
                    raise ValueError("a message is a JSON object")
                kind = msg.get("type")
                if kind == "prefill":
                    prefills.append((identity, msg, self._check_prefill(msg)))
                else:
                    self._answer(identity, kind, msg)
            except (ValueError, TypeError, KeyError) as e:
                self.stats["bad_requests"] += 1
                reply = {"type": "error", "id": msg.get("id") if isinstance(msg, dict) else None, "error": str(e)}
                _send(self.socket, reply, identity=identity)
        if prefills:
            self._prefill(prefills)
        self._tick()
        return len(messages)

    def _wait(self, timeout_s: float) -> bool:
        """Whether a message arrived within timeout_s. While a decode instance connects and while blocks
        are lent, this loop drives NIXL's transport (UCX's wire-up over TCP needs the target's progress):
        the agent runs no progress thread, which would keep a core busy for the server's whole life, not
        only while a connection or a read may need it."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.leases and time.monotonic() >= self._wire_up_until:
                return bool(self.socket.poll(max(int((deadline - time.monotonic()) * 1000), 0)))
            self.agent.get_new_notifs()
            if self.socket.poll(1) or time.monotonic() >= deadline:
                return bool(self.socket.poll(0))

    def _answer(self, identity: bytes, kind, msg: dict) -> None:
        if kind == "hello":
            reply = {"type": "hello", "id": msg.get("id"), "fingerprint": fingerprint(self.llm),
                     "agent": self.name, "cache": self.cache.describe(), "lease_s": self.lease_s}
            _send(self.socket, reply, self.agent.get_agent_metadata(), identity=identity)
            self._wire_up_until = time.monotonic() + WIRE_UP_S
        elif kind == "connected":
            self._wire_up_until = 0.0
            _send(self.socket, {"type": "connected", "id": msg.get("id")}, identity=identity)
        elif kind == "done":
            held = self._release(str(msg["lease"]))
            self.stats["released"] += held
            _send(self.socket, {"type": "done", "id": msg.get("id"), "held": held}, identity=identity)
        elif kind == "stats":
            _send(self.socket, {"type": "stats", "id": msg.get("id"), "active_leases": len(self.leases),
                                "pinned_blocks": self.bm.num_pinned_blocks, "free_blocks": self.bm.num_free_blocks,
                                **self.stats}, identity=identity)
        else:
            raise ValueError(f"unknown message type {kind!r}")

    def _check_prefill(self, msg: dict) -> list[int]:
        token_ids, _ = self.llm._check_request(msg["token_ids"], SamplingParams(max_tokens=1))
        first = msg.get("first_block", 0)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"first_block must be an int >= 0, got {first!r}")
        return token_ids

    def _prefill(self, prefills) -> None:
        """Computes the prompts (one generate call, one token each), then lends each one's full blocks."""
        start = time.perf_counter()
        try:
            self.llm.generate([ids for _, _, ids in prefills], SamplingParams(max_tokens=1, ignore_eos=True))
        except Exception as e:
            for identity, msg, _ in prefills:
                _send(self.socket, {"type": "error", "id": msg.get("id"), "error": f"prefill failed: {e}"},
                      identity=identity)
            return
        self.stats["prefills"] += len(prefills)
        compute_s = time.perf_counter() - start
        for identity, msg, token_ids in prefills:
            _send(self.socket, dict(self._lend(msg, token_ids), compute_s=compute_s), identity=identity)

    def _lend(self, msg: dict, token_ids: list[int]) -> dict:
        """Pins the prompt's cached full blocks (those a prefix hit may take: all but the last block) and
        describes blocks first_block.. of them with their identities."""
        bs, salt = self.llm.config.block_size, self.llm.scheduler.cache_salt
        reply = {"type": "prefill", "id": msg.get("id"), "first_block": msg.get("first_block", 0), "blocks": []}
        hittable = (len(token_ids) - 1) // bs
        if hittable <= reply["first_block"]:
            return reply
        prefix = token_ids[:hittable * bs + 1]     # its blocks can all hit; one fresh block for the last token
        if self.bm.can_allocate(prefix, cache_salt=salt) != AllocStatus.OK:
            return reply
        seq_id = _new_seq_id(self.llm)
        cached = self.bm.allocate(seq_id, prefix, cache_salt=salt)
        try:
            _settle_moves(self.llm)
            num_blocks = cached // bs
            if num_blocks <= reply["first_block"] or self._pin(seq_id) < num_blocks:
                if self.bm.is_pinned(seq_id):
                    self.bm.unpin(seq_id)
                return reply
            table = self.bm.block_table(seq_id)[:num_blocks]
        finally:
            self.bm.free(seq_id)
        lease_id = secrets.token_hex(8)
        self.leases[lease_id] = _Lease(seq_id, self.bm.now + self.lease_s, num_blocks)
        self.stats["leases"] += 1
        hashes = _chain(token_ids, num_blocks, bs, self.bm.hash_algo, salt)
        first = reply["first_block"]
        reply.update(lease=lease_id, lease_s=self.lease_s, blocks=table[first:], identities=[
            {"tokens": token_ids[i * bs:(i + 1) * bs], "hash": hashes[i], "parent": hashes[i - 1] if i else None}
            for i in range(first, num_blocks)])
        return reply

    def _pin(self, seq_id: int) -> int:
        """Blocks pinned for the sequence; 0 when pins would exceed the manager's max_pinned_blocks (the
        prompt is then lent nothing, and the decode side computes it)."""
        try:
            return self.bm.pin(seq_id)
        except RuntimeError:
            return 0

    def close(self) -> None:
        """Ends every lease (unpins), closes the socket and deregisters the cache. Idempotent."""
        for lease_id in list(self.leases):
            self._release(lease_id)
        self.cache.deregister()
        self.socket.close(0)
        self.context.term()

    def __enter__(self) -> "KVTransferServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- decode side -----------------------------------------------------------------------------------------
@dataclass
class _Read:
    """A NIXL read in flight: blocks [start, end) of the prompt."""
    start: int
    end: int
    began: float
    deadline: float
    handle: object = None
    error: str | None = None


@dataclass
class PendingTransfer:
    """One prompt submit() is bringing in: `request` is its engine Request once added."""
    prompt: object
    token_ids: list
    params: SamplingParams
    result: "TransferResult"
    reply: dict | None = None
    read: _Read | None = None
    request: object = None


@dataclass
class TransferResult:
    """What one prompt took from the prefill instance: blocks hit locally, read remotely and accepted, and
    why the rest (if any) is recomputed."""
    local_blocks: int = 0
    read_blocks: int = 0
    accepted_blocks: int = 0
    bytes_read: int = 0
    fallback: str | None = None     # None: everything wanted was received
    seq_id: int | None = None       # the sequence holding the received blocks until the prompt is admitted
    runs: list = field(default_factory=list)     # what was read: (local block, remote block, count) runs
    sent_at: float = 0.0                         # time.monotonic() when the request went out
    timings: dict = field(default_factory=dict)  # seconds: prefill_s (request to reply), compute_s (the
                                                 # remote generate), receive_s (reply to registered), read_s


class KVTransferClient:
    """The decode instance's side: a handshake with one prefill instance (fingerprints compared, its NIXL
    metadata loaded), then generate(): each prompt's missing full blocks are computed remotely, read into
    this engine's cache, checked block by block and registered as cached; the engine then prefills only
    the rest and decodes. Any failure (a dead or silent peer, a failed read, a block whose identity
    differs) leaves the affected blocks to be recomputed locally; nothing is leaked on either side."""

    def __init__(self, llm, endpoint: str, *, timeout_s: float = 10.0, agent_name: str | None = None):
        zmq, nixl_agent, nixl_agent_config = require_packages()
        _check_engine(llm)
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.llm, self.bm, self.timeout_s = llm, llm.bm, float(timeout_s)
        self._zmq = zmq
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.endpoint = endpoint
        self._next_id = 0
        self.name = agent_name or f"pagedkv-decode-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.cache = _CacheRegion(self.agent, llm)
        self._held: list[int] = []           # sequences holding received blocks until their prompt is admitted
        self._submitted: dict[int, PendingTransfer] = {}   # submit(): awaiting the prefill instance's reply
        self._inbox: dict[int, dict] = {}                  # their replies, received and not yet handled
        self._reading: list[PendingTransfer] = []          # their NIXL reads in flight
        self._admitted: dict[int, PendingTransfer] = {}    # engine request id -> its transfer, until it ends
        try:
            t0 = time.perf_counter()
            reply, frames = self._request({"type": "hello", "fingerprint": fingerprint(llm)})
            if reply is None:
                raise KVTransferError(f"no answer from a KV transfer server at {endpoint} within {timeout_s} s")
            check_fingerprint(fingerprint(llm), reply["fingerprint"])
            self.remote_name = self.agent.add_remote_agent(frames[0])  # type: ignore[attr-defined]
            if isinstance(self.remote_name, bytes):
                self.remote_name = self.remote_name.decode()
            self.remote = reply["cache"]
            self._connect()
            self.handshake_s = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        """Sets up the NIXL connection now, not in the first read: a read of a few bytes of the remote cache
        into a scratch buffer, while the server drives its side of the wire-up."""
        self.agent.make_connection(self.remote_name)
        scratch = torch.empty(64, dtype=torch.uint8, device=self.cache.tensors[0].device)
        reg = self.agent.register_memory(scratch)
        try:
            local = np.array([(scratch.data_ptr(), 64, self.cache.device_id)], dtype=np.uint64)
            remote = np.array([(self.remote["bases"][0], 64, self.remote["device_id"])], dtype=np.uint64)
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.cache.mem_type),
                                                self.agent.get_xfer_descs(remote, self.cache.mem_type),
                                                self.remote_name)
            deadline = time.monotonic() + self.timeout_s
            state = self.agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            handle.release()
            if state != "DONE":
                raise KVTransferError(f"NIXL could not read from the prefill instance at {self.endpoint}: {state}")
        finally:
            self.agent.deregister_memory(reg)
        self._request({"type": "connected"})

    # ---- messages
    def _request(self, message: dict, timeout_s: float | None = None):
        """Sends a message and waits for the reply with its id (replies to older requests are dropped);
        (None, []) after the timeout."""
        self._next_id += 1
        message = dict(message, id=self._next_id)
        _send(self.socket, message)
        return self._wait({self._next_id}, timeout_s)[self._next_id]

    def _wait(self, ids: set, timeout_s: float | None = None) -> dict:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        replies: dict = {i: (None, []) for i in ids}
        pending = set(ids)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(int(left * 1000) + 1):
                break
            parts = self.socket.recv_multipart()
            try:
                msg = json.loads(parts[0])
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("id") in pending:
                replies[msg["id"]] = (msg, parts[1:])
                pending.discard(msg["id"])
            elif isinstance(msg, dict) and msg.get("id") in self._submitted:
                self._inbox[msg["id"]] = msg      # an asynchronous request's reply: step() takes it
        return replies

    def server_stats(self) -> dict | None:
        """The prefill server's counters (leases held, pinned blocks, ...), or None without an answer."""
        return self._request({"type": "stats"})[0]

    # ---- transfer
    def transfer(self, prompts) -> list[TransferResult]:
        """Brings each prompt's full blocks that this engine's prefix cache lacks from the prefill instance
        (which computes them) into this cache, registered as cached; the blocks are held by a sequence of
        the result until release() (generate() admits the prompts, then releases)."""
        prompts = [self.llm._check_request(p, None)[0] for p in self.llm._prompt_list(prompts)]
        bs, salt = self.llm.config.block_size, self.llm.scheduler.cache_salt
        results, ids = [], {}
        for i, token_ids in enumerate(prompts):
            hit = self.bm.lookup(token_ids, cache_salt=salt)      # device blocks, then host-tier blocks, ...
            result = TransferResult(local_blocks=hit[0] + hit[1])
            results.append(result)
            if (len(token_ids) - 1) // bs > result.local_blocks:
                self._next_id += 1
                ids[self._next_id] = i
                result.sent_at = time.monotonic()
                _send(self.socket, {"type": "prefill", "id": self._next_id, "token_ids": token_ids,
                                    "first_block": result.local_blocks})
        t0 = time.perf_counter()
        replies = self._wait(set(ids)) if ids else {}
        leases = []       # to let go once every prompt's blocks are in: the pins are not needed after the reads
        try:
            for request_id, i in ids.items():
                reply, _ = replies[request_id]
                results[i].timings["prefill_s"] = time.perf_counter() - t0      # the remote compute included
                if reply is not None and "compute_s" in reply:
                    results[i].timings["compute_s"] = reply["compute_s"]
                if reply is None:
                    results[i].fallback = "no answer from the prefill instance (timeout)"
                elif reply.get("type") != "prefill":
                    results[i].fallback = f"prefill instance: {reply.get('error', reply)}"
                else:
                    start = time.perf_counter()
                    leases.append(reply.get("lease"))
                    if self._receive(prompts[i], reply, results[i]):
                        leases.pop()
                    results[i].timings["receive_s"] = time.perf_counter() - start
        finally:
            for lease in leases:
                if lease is not None:
                    _send(self.socket, {"type": "done", "id": None, "lease": lease})
        return results

    def _receive(self, token_ids: list[int], reply: dict, result: TransferResult) -> bool:
        """Reads, checks and registers the blocks of one reply; True when the lease is already let go (done
        answered), else the caller sends done."""
        read = self._begin_receive(token_ids, reply, result)
        if read is None:
            return False
        state = self._finish_read(read, block=True)
        return self._end_receive(token_ids, reply, result, read, state)

    def _begin_receive(self, token_ids: list[int], reply: dict, result: TransferResult) -> "_Read | None":
        """Checks a reply, allocates the blocks to receive into and starts their NIXL read; None when there is
        nothing to read (result.fallback says why, if anything went wrong)."""
        bs, salt = self.llm.config.block_size, self.llm.scheduler.cache_salt
        remote_blocks, identities = reply.get("blocks"), reply.get("identities", [])
        first = result.local_blocks
        if not isinstance(remote_blocks, list) or not remote_blocks:
            result.fallback = "the prefill instance lent no blocks"
            return None
        end = first + len(remote_blocks)
        if (reply.get("first_block") != first or end > (len(token_ids) - 1) // bs
                or not isinstance(identities, list) or len(identities) != len(remote_blocks)
                or any(type(b) is not int or not 0 <= b < self.remote["num_blocks"] for b in remote_blocks)):
            result.fallback = "malformed reply: blocks outside the prompt's or the prefill instance's pool"
            return None
        prefix = token_ids[:end * bs + 1]        # all `end` blocks may hit; the extra token's block is not read
        if self.bm.can_allocate(prefix, cache_salt=salt) != AllocStatus.OK:
            result.fallback = "no free blocks to receive into"
            return None
        seq_id = _new_seq_id(self.llm)
        cached = self.bm.allocate(seq_id, prefix, cache_salt=salt)
        self._held.append(seq_id)
        result.seq_id = seq_id
        _settle_moves(self.llm)
        if cached < first * bs:
            result.fallback = "blocks hit locally when the request went out were evicted before the reply"
            return None
        start = cached // bs                      # blocks cached meanwhile are not read again
        if start >= end:
            return None
        table = self.bm.block_table(seq_id)
        result.runs = coalesce(table[start:end], remote_blocks[start - first:])
        result.read_blocks = end - start
        result.bytes_read = (end - start) * self.cache.block_bytes * len(self.cache.tensors)
        read = _Read(start=start, end=end, began=time.perf_counter(), deadline=time.monotonic() + self.timeout_s)
        read.handle, read.error = self._start_read(result.runs)
        return read

    def _end_receive(self, token_ids: list[int], reply: dict, result: TransferResult, read: "_Read",
                     state: str) -> bool:
        """After the read ended (state "DONE" or why not): checks the blocks' identities and the lease and
        registers what is good. True when the lease is already let go."""
        bs, lease, released = self.llm.config.block_size, reply.get("lease"), False
        result.timings["read_s"] = time.perf_counter() - read.began
        if state != "DONE":
            result.fallback = read.error or f"NIXL read failed: {state if state != 'PROC' else 'timeout'}"
            return False
        good = self._check_identities(token_ids, reply.get("identities", []), result.local_blocks, read.end)
        if not self._within_lease(reply, result):
            t0 = time.perf_counter()
            done, _ = self._request({"type": "done", "lease": lease})
            result.timings["done_s"] = time.perf_counter() - t0
            if done is None or not done.get("held"):
                result.fallback = "the lease ended before the read was confirmed"
                return True
            released = True
        if good < read.end:
            result.fallback = f"block {good} differs from the prompt's (tokens or chained hash)"
        if good > read.start:
            self.bm.mark_computed(result.seq_id, good * bs)
        result.accepted_blocks = max(good - read.start, 0)
        return released

    @staticmethod
    def _within_lease(reply: dict, result: TransferResult) -> bool:
        """Whether the read surely ended while the prefill side held the blocks: the lease began after the
        request was sent, so less than half the lease since then on this clock is well inside it. Else the
        server must confirm (done's answer) that the lease was still held."""
        lease_s = reply.get("lease_s")
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not lease_s > 0:
            return False
        return time.monotonic() - result.sent_at < LEASE_MARGIN * lease_s

    def _check_identities(self, token_ids: list[int], identities: list, first: int, end: int) -> int:
        """The end of the leading blocks whose sent tokens, parent and chained hash equal this prompt's."""
        bs = self.llm.config.block_size
        expected = _chain(token_ids, end, bs, self.bm.hash_algo, self.llm.scheduler.cache_salt)
        for i in range(first, end):
            sent = identities[i - first] if i - first < len(identities) else None
            if (not isinstance(sent, dict) or sent.get("tokens") != token_ids[i * bs:(i + 1) * bs]
                    or sent.get("hash") != expected[i] or sent.get("parent") != (expected[i - 1] if i else None)):
                return i
        return end

    def _start_read(self, runs: list[tuple[int, int, int]]):
        """Posts the NIXL READ of runs of remote blocks into local ones (one descriptor per cache tensor and
        run): (handle, None), or (None, why not)."""
        if self.llm.runner.device.type == "cuda":
            torch.cuda.synchronize(self.llm.runner.device)     # host-tier copies done before the read lands
        local, remote = block_descriptors(runs, [t.data_ptr() for t in self.cache.tensors], self.remote["bases"],
                                          self.cache.block_bytes, self.cache.device_id, self.remote["device_id"])
        try:
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.cache.mem_type),
                                                self.agent.get_xfer_descs(remote, self.cache.mem_type),
                                                self.remote_name)
        except Exception as e:
            return None, f"NIXL could not prepare the read: {e}"
        try:
            state = self.agent.transfer(handle)
        except Exception as e:
            self._abandon(handle)
            return None, f"NIXL read failed: ERR ({e})"
        if state not in ("PROC", "DONE"):
            self._abandon(handle)
            return None, f"NIXL read failed: {state}"
        return handle, None

    def _finish_read(self, read: "_Read", block: bool) -> str:
        """The read's state: "DONE", "PROC" (still running; only when not block and before its deadline) or
        why it failed. A read that ended is released; one that failed or ran out of time is abandoned."""
        if read.handle is None:
            return read.error or "ERR"
        try:
            state = self.agent.check_xfer_state(read.handle)
            while block and state == "PROC" and time.monotonic() < read.deadline:
                state = self.agent.check_xfer_state(read.handle)
        except Exception as e:
            state = f"ERR ({e})"
        if state == "PROC" and time.monotonic() < read.deadline:
            return state
        handle, read.handle = read.handle, None
        if state == "DONE":
            handle.release()
        else:
            self._abandon(handle)
            read.error = f"NIXL read failed: {state if state != 'PROC' else 'timeout'}"
        return state

    def _abandon(self, handle) -> None:
        """Stops a failed or late read. Until NIXL has stopped it, its destination blocks may still be
        written, so they are never handed out: the engine is closed to further transfers if it cannot."""
        try:
            handle.release()
        except Exception as e:
            raise KVTransferError(f"a NIXL read could not be stopped ({e}); its destination blocks stay held") from e

    def release(self, results: list[TransferResult] | None = None) -> None:
        """Frees the sequences holding received blocks (their blocks stay cached, as any freed prefix)."""
        seqs = self._held if results is None else [r.seq_id for r in results if r.seq_id is not None]
        for seq_id in list(seqs):
            if seq_id in self.bm:
                self.bm.free(seq_id)
            if seq_id in self._held:
                self._held.remove(seq_id)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False):
        """LLM.generate on this (decode) engine after transfer(prompts): the prompts' blocks computed by the
        prefill instance are prefix hits here. Returns the outputs; `last_transfers` holds what each prompt
        received."""
        self.last_transfers = self.transfer(prompts)
        try:
            return self.llm.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        finally:
            self.release(self.last_transfers)

    # ---- asynchronous: transfers overlap this engine's steps
    def submit(self, prompt, params: SamplingParams | None = None) -> "PendingTransfer":
        """Starts bringing the prompt's missing full blocks from the prefill instance and returns at once:
        the request goes out now; step() starts the NIXL read when the blocks are lent and, once they are
        read and checked, adds the prompt to the engine (`pending.request`), while the engine keeps running
        the requests it has. A prompt with nothing to fetch is added at once; a failure (no answer in
        timeout_s, a failed read, a block that differs) adds it to be recomputed (`pending.result.fallback`)."""
        token_ids, params = self.llm._check_request(prompt, params)
        return self._submit(prompt, token_ids, params)

    def _submit(self, prompt, token_ids: list[int], params: SamplingParams) -> "PendingTransfer":
        bs, salt = self.llm.config.block_size, self.llm.scheduler.cache_salt
        hit = self.bm.lookup(token_ids, cache_salt=salt)
        pending = PendingTransfer(prompt, token_ids, params, TransferResult(local_blocks=hit[0] + hit[1]))
        if (len(token_ids) - 1) // bs <= pending.result.local_blocks:
            self._admit(pending)
            return pending
        self._next_id += 1
        pending.result.sent_at = time.monotonic()
        _send(self.socket, {"type": "prefill", "id": self._next_id, "token_ids": token_ids,
                            "first_block": pending.result.local_blocks})
        self._submitted[self._next_id] = pending
        return pending

    def step(self) -> list:
        """Advances every submitted transfer without waiting (replies received start their reads, finished
        reads are checked and registered and their prompts added to the engine, requests past timeout_s fall
        back), then runs one engine step when the engine has work. Returns the engine requests that ended."""
        self._progress()
        if not self.llm.has_unfinished():
            self._idle()
            return []
        finished = self.llm.step()
        for request in finished:
            pending = self._admitted.pop(request.request_id, None)
            if pending is not None:
                self.release([pending.result])
        return finished

    def has_unfinished(self) -> bool:
        """Transfers in progress or engine requests not finished."""
        return bool(self._submitted or self._reading or self.llm.has_unfinished())

    def run(self, prompts, sampling_params=None) -> list:
        """submit() every prompt, then step() until all are done: the outputs in prompt order, as
        LLM.generate returns them. Prefill and transfer of later prompts overlap the decoding of earlier
        ones; `last_transfers` holds what each prompt received."""
        pendings = [self._submit(*checked) for checked in self.llm._checked_requests(prompts, sampling_params)]
        try:
            while self.has_unfinished():
                self.step()
        except BaseException:
            for pending in pendings:
                if pending.request is not None:
                    self.llm.abort(pending.request.request_id)
            raise
        self.last_transfers = [p.result for p in pendings]
        return [self.llm._output(p.request) for p in pendings]

    def _progress(self) -> None:
        while self._submitted and self.socket.poll(0):      # file the replies that arrived
            parts = self.socket.recv_multipart()
            try:
                msg = json.loads(parts[0])
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("id") in self._submitted:
                self._inbox[msg["id"]] = msg
        now = time.monotonic()
        for request_id, pending in list(self._submitted.items()):
            reply = self._inbox.pop(request_id, None)
            if reply is None and now - pending.result.sent_at <= self.timeout_s:
                continue
            del self._submitted[request_id]
            result = pending.result
            result.timings["prefill_s"] = now - result.sent_at
            if reply is None:
                result.fallback = "no answer from the prefill instance (timeout)"
            elif reply.get("type") != "prefill":
                result.fallback = f"prefill instance: {reply.get('error', reply)}"
            else:
                if "compute_s" in reply:
                    result.timings["compute_s"] = reply["compute_s"]
                pending.reply = reply
                pending.read = self._begin_receive(pending.token_ids, reply, result)
                if pending.read is not None:
                    self._reading.append(pending)
                    continue
                self._let_go(reply)
            self._admit(pending)
        for pending in list(self._reading):
            self._read_ended(pending, self._finish_read(pending.read, block=False))

    def _read_ended(self, pending: "PendingTransfer", state: str) -> None:
        """A polled read's state: once it ended, its blocks are checked and registered, its prompt added."""
        if state == "PROC":
            return
        self._reading.remove(pending)
        if not self._end_receive(pending.token_ids, pending.reply, pending.result, pending.read, state):
            self._let_go(pending.reply)
        self._admit(pending)

    def _idle(self) -> None:
        """Nothing for the engine to run: waits for the next transfer event instead of spinning (the prefill
        instance may share this machine's cores): a finished read, else a reply, for at most IDLE_WAIT_S."""
        if self._reading:
            pending = self._reading[0]
            self._read_ended(pending, self._finish_read(pending.read, block=True))
        elif self._submitted:
            self.socket.poll(int(IDLE_WAIT_S * 1000))

    def _let_go(self, reply: dict) -> None:
        if reply.get("lease") is not None:
            _send(self.socket, {"type": "done", "id": None, "lease": reply["lease"]})

    def _admit(self, pending: "PendingTransfer") -> None:
        pending.request = self.llm._queue(pending.prompt, pending.token_ids, pending.params)
        self._admitted[pending.request.request_id] = pending

    def close(self) -> None:
        """Frees held sequences, closes the socket and deregisters the cache. Idempotent."""
        for pending in self._reading:     # reads in flight end before their blocks are freed
            self._finish_read(pending.read, block=True)
        self._reading.clear()
        self.release()
        self.cache.deregister()
        if not self.socket.closed:
            self.socket.close(0)
            self.context.term()

    def __enter__(self) -> "KVTransferClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- a prefill instance from the command line -------------------------------------------------------------
def main(argv=None) -> None:
    """python -m pagedkv.engine.kv_transfer MODEL [--endpoint ...]: serves MODEL as a prefill instance;
    prints "pagedkv-kv-transfer ENDPOINT" once it serves."""
    from .llm_engine import LLM

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model")
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:0")
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--cpu-threads", default="auto")
    args = parser.parse_args(argv)
    threads = args.cpu_threads if args.cpu_threads == "auto" else int(args.cpu_threads)
    llm = LLM(args.model, block_size=args.block_size, num_blocks=args.num_blocks, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, cpu_threads=threads)
    with KVTransferServer(llm, args.endpoint, lease_s=args.lease_s) as server:
        print(f"pagedkv-kv-transfer {server.endpoint}", flush=True)
        try:
            server.serve()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
