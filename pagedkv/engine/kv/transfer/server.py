"""The prefill instance's side of KV transfer (KVTransferServer): computes prompts and lends their blocks."""
import json
import os
import secrets
import time

from pagedkv import AllocStatus

from ...serving.sampling import SamplingParams
from .protocol import (WIRE_UP_S, Lease, block_chain, check_engine, fingerprint, new_seq_id, require_packages, send,
                       settle_moves)
from .region import CacheRegion


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
        check_engine(llm)
        if not (isinstance(lease_s, (int, float)) and lease_s > 0):
            raise ValueError(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        self.llm, self.bm, self.lease_s = llm, llm.bm, float(lease_s)
        self.name = agent_name or f"pagedkv-prefill-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.cache = CacheRegion(self.agent, llm)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)
        self.endpoint = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.leases: dict[str, Lease] = {}
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
                send(self.socket, reply, identity=identity)
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
            send(self.socket, reply, self.agent.get_agent_metadata(), identity=identity)
            self._wire_up_until = time.monotonic() + WIRE_UP_S
        elif kind == "connected":
            self._wire_up_until = 0.0
            send(self.socket, {"type": "connected", "id": msg.get("id")}, identity=identity)
        elif kind == "done":
            held = self._release(str(msg["lease"]))
            self.stats["released"] += held
            send(self.socket, {"type": "done", "id": msg.get("id"), "held": held}, identity=identity)
        elif kind == "stats":
            send(self.socket, {"type": "stats", "id": msg.get("id"), "active_leases": len(self.leases),
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
                send(self.socket, {"type": "error", "id": msg.get("id"), "error": f"prefill failed: {e}"},
                      identity=identity)
            return
        self.stats["prefills"] += len(prefills)
        compute_s = time.perf_counter() - start
        for identity, msg, token_ids in prefills:
            send(self.socket, dict(self._lend(msg, token_ids), compute_s=compute_s), identity=identity)

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
        seq_id = new_seq_id(self.llm)
        cached = self.bm.allocate(seq_id, prefix, cache_salt=salt)
        try:
            settle_moves(self.llm)
            num_blocks = cached // bs
            if num_blocks <= reply["first_block"] or self._pin(seq_id) < num_blocks:
                if self.bm.is_pinned(seq_id):
                    self.bm.unpin(seq_id)
                return reply
            table = self.bm.block_table(seq_id)[:num_blocks]
        finally:
            self.bm.free(seq_id)
        lease_id = secrets.token_hex(8)
        self.leases[lease_id] = Lease(seq_id, self.bm.now + self.lease_s, num_blocks)
        self.stats["leases"] += 1
        hashes = block_chain(token_ids, num_blocks, bs, self.bm.hash_algo, salt)
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
