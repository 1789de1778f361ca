"""Receiving one prompt's blocks: allocating the blocks to read into, the NIXL read, each block's identity
check and the registration as cached. A part of KVTransferClient (its state is set by KVTransferClient.__init__)."""
import time

import torch

from pagedkv import AllocStatus

from .protocol import LEASE_MARGIN, KVTransferError, Read, TransferResult, block_chain, block_descriptors, coalesce, new_seq_id, settle_moves


class BlockReceiver:
    """Reads a reply's blocks into this engine's cache, checks and registers them (see KVTransferClient)."""

    def _receive(self, token_ids: list[int], reply: dict, result: TransferResult) -> bool:
        """Reads, checks and registers the blocks of one reply; True when the lease is already let go (done
        answered), else the caller sends done."""
        read = self._begin_receive(token_ids, reply, result)
        if read is None:
            return False
        state = self._finish_read(read, block=True)
        return self._end_receive(token_ids, reply, result, read, state)

    def _begin_receive(self, token_ids: list[int], reply: dict, result: TransferResult) -> "Read | None":
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
        seq_id = new_seq_id(self.llm)
        cached = self.bm.allocate(seq_id, prefix, cache_salt=salt)
        self._held.append(seq_id)
        result.seq_id = seq_id
        settle_moves(self.llm)
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
        read = Read(start=start, end=end, began=time.perf_counter(), deadline=time.monotonic() + self.timeout_s)
        read.handle, read.error = self._start_read(result.runs)
        return read

    def _end_receive(self, token_ids: list[int], reply: dict, result: TransferResult, read: "Read",
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
        expected = block_chain(token_ids, end, bs, self.bm.hash_algo, self.llm.scheduler.cache_salt)
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

    def _finish_read(self, read: "Read", block: bool) -> str:
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
