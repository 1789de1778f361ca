"""The baseline: a plain-Python block manager following the seeds' algorithm (nano-vllm's
block_manager.py as described in shared/seeds/000_*.txt): a deque free list, a used set, a
hash -> block dict, chained xxh64 over numpy token bytes. Used only as the benchmark's contender."""
from collections import deque

import numpy as np
import xxhash


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id):
        self.block_id, self.ref_count, self.hash, self.token_ids = block_id, 0, -1, []


class Seq:
    def __init__(self, token_ids, block_size):
        self.token_ids = list(token_ids)
        self.block_size = block_size
        self.block_table = []
        self.num_cached_tokens = 0

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_blocks(self):
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i):
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]


class SeedsBlockManager:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id = {}
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()

    @staticmethod
    def compute_hash(token_ids, prefix=-1):
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids).tobytes())
        return h.intdigest()

    def _take(self, block_id):
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.ref_count, block.hash, block.token_ids = 1, -1, []
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _release(self, block_id):
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq):
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq):
        h, cache_miss = -1, False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h) if len(token_ids) == self.block_size else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids or i == seq.num_blocks - 1:
                cache_miss = True
            if cache_miss:
                block = self._take(self.free_block_ids[0])
            else:
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._take(block_id)
            if h != -1:
                block.hash, block.token_ids = h, token_ids
                self.hash_to_block_id[h] = block.block_id
            seq.block_table.append(block.block_id)

    def deallocate(self, seq):
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._release(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq):
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq):
        block_table = seq.block_table
        last = self.blocks[block_table[-1]]
        if len(seq) % self.block_size == 1:
            block_table.append(self._take(self.free_block_ids[0]).block_id)
        elif len(seq) % self.block_size == 0:
            token_ids = seq.block(seq.num_blocks - 1)
            prefix = self.blocks[block_table[-2]].hash if len(block_table) > 1 else -1
            h = self.compute_hash(token_ids, prefix)
            last.hash, last.token_ids = h, token_ids
            self.hash_to_block_id[h] = last.block_id
