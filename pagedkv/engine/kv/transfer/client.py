"""The decode instance's side of KV transfer (KVTransferClient): the handshake, then prompts whose missing blocks
the prefill instance computes and this engine reads, checks, registers and decodes."""
import json
import os
import secrets
import time

from ...serving.sampling import SamplingParams
from .connection import PeerConnection
from .protocol import (IDLE_WAIT_S, KVTransferError, PendingTransfer, TransferResult, check_engine, check_fingerprint,
                       fingerprint, require_packages, send)
from .receive import BlockReceiver
from .region import CacheRegion


class KVTransferClient(PeerConnection, BlockReceiver):
    """The decode instance's side: a handshake with one prefill instance (fingerprints compared, its NIXL
    metadata loaded), then generate(): each prompt's missing full blocks are computed remotely, read into
    this engine's cache, checked block by block and registered as cached; the engine then prefills only
    the rest and decodes. Any failure (a dead or silent peer, a failed read, a block whose identity
    differs) leaves the affected blocks to be recomputed locally; nothing is leaked on either side."""

    def __init__(self, llm, endpoint: str, *, timeout_s: float = 10.0, agent_name: str | None = None):
        zmq, nixl_agent, nixl_agent_config = require_packages()
        check_engine(llm)
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
        self.cache = CacheRegion(self.agent, llm)
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
                send(self.socket, {"type": "prefill", "id": self._next_id, "token_ids": token_ids,
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
                    send(self.socket, {"type": "done", "id": None, "lease": lease})
        return results

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
        send(self.socket, {"type": "prefill", "id": self._next_id, "token_ids": token_ids,
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
            send(self.socket, {"type": "done", "id": None, "lease": reply["lease"]})

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
