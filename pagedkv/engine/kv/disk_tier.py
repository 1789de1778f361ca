"""The engine's disk tier: host-tier blocks written to and read from a DiskStore by one background thread.

The block manager decides (write-backs of host entries about to be evicted, clean-ahead writes of the
coldest host entries, prefetches of the waiting prompts' disk-resident blocks into host slots); this class
runs those transfers beside the model and reports their outcomes. The step never waits on the disk: writes
complete whenever they are done, and a prompt whose blocks are being read waits in the queue (others are
admitted past it) until they are on the host, where its admission finds them as host hits. Only when
nothing else can run does the step wait for a read.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedkv import BlockManager
from pagedkv.disk_store import DiskStore, restore_records

# How many waiting prompts are looked up for disk hits per step (the lookup is a walk of the prefix trie).
PREFETCH_WINDOW = 64


class DiskTier:
    def __init__(self, directory: str, num_records: int, host_tier: torch.Tensor, block_size: int, fingerprint: str,
                 device: torch.device = torch.device("cpu"), persist: bool = False):
        record_bytes = host_tier[0].numel() * host_tier.element_size()
        self.store = DiskStore(directory, num_records, record_bytes, block_size=block_size, fingerprint=fingerprint,
                               persist=persist)
        self.host_tier = host_tier
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-disk")
        self._writes: Future | None = None
        self._reads: Future | None = None
        self.waiting_for_reads: set[int] = set()    # sequences whose disk blocks are being read
        self._looked_up: set[int] = set()           # waiting sequences already prefetched for
        self.closed = False

    def restore(self, bm: BlockManager) -> int:
        """Registers the records an earlier engine left in a persistent store (the manager's disk tier holds
        nothing yet); returns how many."""
        return restore_records(bm, self.store)

    # ---- each step -----------------------------------------------------------------------------------
    def before_step(self, bm: BlockManager, waiting, cache_salt, write_budget: int, must_progress: bool) -> None:
        """Confirms the transfers that finished, then starts the next ones: write-backs (queued by host
        evictions and clean ahead, up to write_budget), and reads of the waiting prompts' disk blocks.
        must_progress: nothing else can run this step, so a read in flight is waited for."""
        self._complete(bm, wait_for_reads=must_progress and self._reads is not None)
        if self._writes is None:
            bm.plan_disk_writes(write_budget)
            pairs = bm.take_disk_writes()
            if len(pairs):
                self._writes = self._pool.submit(self._write_batch, *self._writes_of(bm, pairs))
        if self._reads is None:
            waiting_ids = {s.seq_id for s in waiting}
            self._looked_up &= waiting_ids
            wait = set()
            for seq in list(waiting)[:PREFETCH_WINDOW]:
                if seq.seq_id in self._looked_up:
                    continue
                self._looked_up.add(seq.seq_id)
                if bm.prefetch(seq.token_ids, cache_salt=cache_salt):
                    wait.add(seq.seq_id)
            pairs = bm.take_disk_reads()
            if len(pairs):
                identities = [bm.disk_record_identity(r) for r in pairs[:, 0].tolist()]
                self._reads = self._pool.submit(self._read_batch, pairs.tolist(), identities)
                self.waiting_for_reads = wait
                if must_progress:
                    self._complete(bm, wait_for_reads=True)

    def close(self, bm: BlockManager) -> None:
        """Waits for the transfers in flight, confirms them and releases the file. Idempotent."""
        if self.closed:
            return
        self._complete(bm, wait_for_reads=True, wait_for_writes=True)
        if self.store.persistent:
            self._flush_host_tier(bm)
        self._pool.shutdown(wait=True)
        self.store.close()
        self.closed = True

    def _flush_host_tier(self, bm: BlockManager) -> None:
        """A persistent cache keeps what the host tier holds and the disk lacks too: one synchronous round of
        writes of every dirty host entry (the disk evicts its coldest records for them, as always)."""
        if bm.plan_disk_writes(bm.num_host_blocks):
            bm.complete_disk_writes(self._write_batch(*self._writes_of(bm, bm.take_disk_writes())))

    def _writes_of(self, bm: BlockManager, pairs: torch.Tensor):
        """(pairs, identities, salts) of taken writes, for _write_batch; their host slots ready to read."""
        records = pairs[:, 1].tolist()
        identities = [bm.disk_record_identity(r) for r in records]
        # block 0's salt goes into its header, so that a restarted engine can restore the block
        salts = [bm.disk_record_salt(r) if i[1] is None else b"" for r, i in zip(records, identities)]
        if self.device.type == "cuda":
            # Offloads into these host slots may still be in flight on the GPU (clean ahead queues them without
            # waiting): the thread reads the slots only once they have landed.
            torch.cuda.current_stream(self.device).synchronize()
        return pairs.tolist(), identities, salts

    # ---- the background thread -----------------------------------------------------------------------
    def _write_batch(self, pairs: list[list[int]], identities, salts) -> list[bool]:
        oks = []
        for (slot, record), identity, salt in zip(pairs, identities, salts):
            try:
                self.store.write(record, self.host_tier[slot], identity, salt)
                oks.append(True)
            except OSError:
                oks.append(False)
        return oks

    def _read_batch(self, pairs: list[list[int]], identities) -> list[bool]:
        return [self.store.read(record, self.host_tier[slot], identity)
                for (record, slot), identity in zip(pairs, identities)]

    def _complete(self, bm: BlockManager, *, wait_for_reads: bool = False, wait_for_writes: bool = False) -> None:
        if self._writes is not None and (wait_for_writes or self._writes.done()):
            bm.complete_disk_writes(_outcomes(self._writes))
            self._writes = None
        if self._reads is not None and (wait_for_reads or self._reads.done()):
            bm.complete_disk_reads(_outcomes(self._reads))
            self._reads = None
            self.waiting_for_reads = set()


def _outcomes(future: Future) -> list[bool] | bool:
    """The batch's outcomes; all failed when the thread raised (a bug or an I/O error outside a record)."""
    try:
        return future.result()
    except Exception:
        return False
