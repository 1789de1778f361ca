"""float8 KV with its most sensitive tokens at full precision: each query's latest `window` tokens and its
sequence's first block (the tokens attention sinks on) are read in the model's dtype, every other token
from the float8 cache.

Every token is still written to the float8 cache (so the prefix cache, the host and disk tiers, swaps and
transfers see one format and nothing else changes); a small pool of model-dtype blocks, the *recent pool*,
holds for each running sequence its first block and the blocks of its latest `window` tokens, written
beside the float8 copy. A layer then attends in up to three parts over disjoint keys and merges them by
their log-sum-exp (exact):

* first block: keys ``[0, min(S, p + 1))`` (``S`` = block_size, or 0 when turned off), each query row as its
  own one-block sequence;
* window: keys ``(p - window, p]`` at or after ``S``, the recent pool's blocks through a block table that
  starts at block ``S / block_size`` (positions shift uniformly, so causality and the sliding window hold);
* the rest: float8 keys ``[S, p - window]``, through the sequence's block table from block ``S / block_size``
  with ``seq_len = L - window - S`` for the rows that have any (bottom-right alignment then gives query
  ``p`` exactly the keys up to ``p - window``).

The pool's blocks belong to the runner, not the block manager: a sequence's entry is made when it first
runs and kept while it runs; entries of sequences that stop running are dropped, oldest first, when the pool
needs their blocks. Where full-precision values of a needed position are missing (a prefix-cache hit, a
swap-in, a recompute, an entry dropped) they are *warmed* from the float8 cache (dequantised), so those few
positions read the float8 value, as without this rule. On SmolLM2-135M this rule with window 256 keeps
99.2-99.4% of fp32 KV's top-1 tokens against 94.7% for the rotated float8 rule alone (docs/reference.md)."""
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pagedkv import ops


@dataclass
class RecentStepInputs:
    """One step's indices into the recent pool (built by RecentPool.prepare, read by every layer)."""
    slots: torch.Tensor              # [T] int64: the recent-pool slot each step token is written to
    warm_src: torch.Tensor           # [N] int64: float8 cache slots dequantised into ...
    warm_dst: torch.Tensor           # [N] int64: ... these recent-pool slots before attention
    first_rows: torch.Tensor | None      # [Rf] int64 rows that read a first block (None: every row)
    first_tables: torch.Tensor           # [Rf, 1] int32: each such row's first block
    first_lens: torch.Tensor             # [Rf] int32: keys of it the row sees, min(S, p + 1)
    first_starts: torch.Tensor           # [Rf + 1] int32
    window_rows: torch.Tensor | None     # [Rw] int64 rows with p >= S (None: every row)
    window_tables: torch.Tensor
    window_lens: torch.Tensor
    window_starts: torch.Tensor
    cold_rows: torch.Tensor | None   # [Rc] int64 rows that see float8 keys (None: every row)
    cold_tables: torch.Tensor
    cold_lens: torch.Tensor
    cold_starts: torch.Tensor


_ROWS = ("first_rows", "window_rows", "cold_rows")


def to_wire(step: "RecentStepInputs | None") -> list[torch.Tensor]:
    """The step's inputs as tensors (the tensor-parallel step message): rows None (every row) as empty,
    which is unambiguous, since a part without rows has no sequences either."""
    if step is None:
        return []
    return [torch.empty(0, dtype=torch.int64) if getattr(step, f.name) is None else getattr(step, f.name)
            for f in dataclasses.fields(RecentStepInputs)]


def from_wire(tensors: list[torch.Tensor]) -> "RecentStepInputs | None":
    if not tensors:
        return None
    values = dict(zip((f.name for f in dataclasses.fields(RecentStepInputs)), tensors))
    for rows, lens in zip(_ROWS, ("first_lens", "window_lens", "cold_lens")):
        if not values[rows].numel() and values[lens].numel():
            values[rows] = None
    return RecentStepInputs(**values)


class _PoolFull(Exception):
    pass


class _Entry:
    __slots__ = ("first", "first_key", "first_valid", "blocks", "valid_from", "valid_to")

    def __init__(self):
        self.first = None          # the recent-pool block holding the first block's tokens
        self.first_key = None      # their token ids when the block is shared by content (RecentPool.firsts)
        self.first_valid = 0       # its positions [0, first_valid) hold full-precision values
        self.blocks = {}           # logical block -> recent-pool block (window blocks, at or after S)
        self.valid_from = 0        # window positions [valid_from, valid_to) hold full-precision values
        self.valid_to = 0


class RecentPool:
    """The recent pool's bookkeeping (host side) for one KV group of full-attention layers."""

    def __init__(self, num_blocks: int, block_size: int, window: int, first_block: bool, device):
        self.num_blocks, self.block_size, self.window = num_blocks, block_size, window
        self.first = block_size if first_block else 0
        self.device = device
        self.free = list(range(num_blocks - 1, -1, -1))
        self.entries: "OrderedDict[int, _Entry]" = OrderedDict()
        # Full first blocks by their token ids (their KV depends on nothing else): [block, users, complete].
        # Kept after their last user, oldest dropped first, so a prefix-cache hit finds its first block.
        self.firsts: "OrderedDict[tuple, list]" = OrderedDict()

    @staticmethod
    def blocks_needed(max_num_seqs: int, max_num_batched_tokens: int, block_size: int, window: int) -> int:
        """Blocks that every step of max_num_seqs sequences and max_num_batched_tokens tokens fits in: per
        sequence its first block, its window's blocks and two partial ones; plus the step's new tokens."""
        per_seq = 1 + -(-max(window - 1, 0) // block_size) + 2
        return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)

    def _take(self, busy: set) -> int:
        """A free block: dropping kept first blocks no one uses, then the entries of sequences not in the step
        (least recently run first); _PoolFull when every block is the step's."""
        while not self.free:
            unused = next((k for k, f in self.firsts.items() if f[1] == 0), None)
            if unused is not None:
                self.free.append(self.firsts.pop(unused)[0])
                continue
            victim = next((k for k in self.entries if k not in busy), None)
            if victim is None:
                raise _PoolFull
            self._drop(self.entries.pop(victim))
        return self.free.pop()

    def _drop(self, entry: _Entry) -> None:
        if entry.first_key is not None:
            self.firsts[entry.first_key][1] -= 1
        elif entry.first is not None:
            self.free.append(entry.first)
        self.free.extend(entry.blocks.values())

    def _attach_first(self, entry: _Entry, tokens, busy: set) -> None:
        key = tuple(tokens) if tokens is not None and len(tokens) == self.first else None
        shared = self.firsts.get(key) if key is not None else None
        if shared is None:
            entry.first = self._take(busy)
            if key is not None:
                self.firsts[key] = [entry.first, 1, False]
        else:
            self.firsts.move_to_end(key)
            shared[1] += 1
            entry.first = shared[0]
            entry.first_valid = self.first if shared[2] else 0
        entry.first_key = key

    def reset(self) -> None:
        for entry in self.entries.values():
            self._drop(entry)
        self.entries.clear()
        self.free.extend(f[0] for f in self.firsts.values())
        self.firsts.clear()

    def prepare(self, seq_ids, starts, ends, tables: torch.Tensor, first_tokens=None) -> RecentStepInputs:
        """The step whose sequence i has queries at positions [starts[i], ends[i]); `tables` are their float8
        block tables ([B, M] int32, host); first_tokens(seq_id) gives a sequence's first block_size token
        ids (or fewer), asked once per sequence. Allocates and releases recent-pool blocks; a sequence the
        pool cannot hold this step (every block in use by the step's others) reads float8 keys only."""
        bs, w, S = self.block_size, self.window, self.first
        S_blocks = S // bs
        busy = set(seq_ids)
        rows = tables.tolist()
        slots, warm_src, warm_dst = [], [], []
        first_rows, first_tables, first_lens = [], [], []
        win_rows, win_tables, win_lens, win_starts = [], [], [], [0]
        cold_rows, cold_tables, cold_lens, cold_starts = [], [], [], [0]
        row = 0
        for seq_id, s, e, table in zip(seq_ids, starts, ends, rows):
            entry = self._entry_for_step(seq_id, s, e, busy, first_tokens)
            if entry is None:       # the plain float8 attention over every key, no full-precision copy
                slots.extend([-1] * (e - s))
                cold_rows.extend(range(row, row + e - s))
                cold_tables.append(table)
                cold_lens.append(e)
                cold_starts.append(cold_starts[-1] + e - s)
                row += e - s
                continue

            def hot_slot(p):
                if p < S:
                    return entry.first * bs + p
                return entry.blocks[p // bs] * bs + p % bs if w else -1     # -1: no copy (reshape_and_cache)

            def cold_slot(p):
                return table[p // bs] * bs + p % bs

            a = max(S, s - w + 1)   # window positions this step reads before it writes [s, e)
            if S:                   # the first block's positions before s without full-precision values
                for p in range(entry.first_valid, min(S, s)):
                    warm_src.append(cold_slot(p))
                    warm_dst.append(hot_slot(p))
                entry.first_valid = max(entry.first_valid, min(S, e))
                if entry.first_key is not None and entry.first_valid >= S:
                    self.firsts[entry.first_key][2] = True
                first_rows.extend(range(row, row + e - s))
                first_tables.extend([entry.first] * (e - s))
                first_lens.extend(min(S, p + 1) for p in range(s, e))
            if w:
                warm_from = max(a, entry.valid_to) if entry.valid_from <= a else a
                for p in range(warm_from, s):
                    warm_src.append(cold_slot(p))
                    warm_dst.append(hot_slot(p))
                entry.valid_from, entry.valid_to = a, max(e, a)
            slots.extend(hot_slot(p) for p in range(s, e))
            if w and e > S:         # window rows: p >= S, seen through a table shifted by S
                j0 = max(S - s, 0)
                win_rows.extend(range(row + j0, row + e - s))
                win_tables.append([entry.blocks.get(lb, 0) for lb in range(S_blocks, (e - 1) // bs + 1)])
                win_lens.append(e - S)
                win_starts.append(win_starts[-1] + e - s - j0)
            if e > S + w:           # rows with float8 keys: p >= S + w
                j0 = max(S + w - s, 0)
                cold_rows.extend(range(row + j0, row + e - s))
                cold_tables.append(table[S_blocks:])
                cold_lens.append(e - w - S)
                cold_starts.append(cold_starts[-1] + e - s - j0)
            row += e - s

        dev = self.device

        def ints(x, dtype=torch.int32):
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        def table_tensor(t):
            if not t:
                return torch.zeros(0, 1, dtype=torch.int32, device=dev)
            width = max(len(r) for r in t) or 1
            return ints([r + [0] * (width - len(r)) for r in t])

        def subset(r):
            return None if len(r) == row else ints(r, torch.int64)

        return RecentStepInputs(
            slots=ints(slots, torch.int64), warm_src=ints(warm_src, torch.int64), warm_dst=ints(warm_dst, torch.int64),
            first_rows=subset(first_rows), first_tables=ints(first_tables).view(-1, 1),
            first_lens=ints(first_lens), first_starts=ints(list(range(len(first_rows) + 1))),
            window_rows=subset(win_rows), window_tables=table_tensor(win_tables), window_lens=ints(win_lens),
            window_starts=ints(win_starts),
            cold_rows=subset(cold_rows), cold_tables=table_tensor(cold_tables), cold_lens=ints(cold_lens),
            cold_starts=ints(cold_starts))

    def _entry_for_step(self, seq_id, s: int, e: int, busy: set, first_tokens) -> "_Entry | None":
        """seq_id's entry with the blocks its step [s, e) reads and writes (None: the pool cannot hold them)."""
        bs, w, S = self.block_size, self.window, self.first
        entry = self.entries.pop(seq_id, None) or _Entry()
        self.entries[seq_id] = entry          # most recently used last
        entry.first_valid = min(entry.first_valid, s)
        if s < entry.valid_to:                # a recompute, or drafts rejected: [s, ...) is written again
            entry.valid_to = s
        if entry.valid_from > entry.valid_to:
            entry.valid_from = entry.valid_to = s
        a = max(S, s - w + 1)
        keep_from = max(a - bs, 0) // bs      # a block of margin for rejected drafts
        for lb in [lb for lb in entry.blocks if lb < keep_from]:
            self.free.append(entry.blocks.pop(lb))
        try:
            if S and entry.first is None:
                self._attach_first(entry, first_tokens(seq_id) if first_tokens else None, busy)
            for lb in range(a // bs, (e - 1) // bs + 1) if w else ():
                if lb not in entry.blocks:
                    entry.blocks[lb] = self._take(busy)
        except _PoolFull:
            self._drop(self.entries.pop(seq_id))
            return None
        return entry

class LayerRecentKV:
    """One layer's recent pool (keys and values, [num_blocks, block_size, num_kv_heads, head_dim] in the
    model's dtype) and its attention over the three parts."""

    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor, window: int):
        self.key_cache, self.value_cache, self.window = key_cache, value_cache, window

    def attend(self, q, k, v, key_cache, value_cache, k_scale, v_scale, step: RecentStepInputs, scale: float,
               softcap: float, sinks) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] of this step (already written to the float8 cache) -> [T, H, D]."""
        hk, hv = self.key_cache, self.value_cache
        if step.warm_src.numel():
            heads, dim = hk.shape[2], hk.shape[3]
            for src_cache, dst_cache, s in ((key_cache, hk, k_scale), (value_cache, hv, v_scale)):
                src = src_cache.view(-1, heads, dim).index_select(0, step.warm_src).float() * s.view(1, -1, 1)
                dst_cache.view(-1, heads, dim).index_copy_(0, step.warm_dst, src.to(dst_cache.dtype))
        ops.reshape_and_cache(k, v, hk, hv, step.slots)
        parts = []

        def part(rows, key_cache, value_cache, tables, lens, starts, **kw):
            if lens.numel():
                qp = q if rows is None else q.index_select(0, rows)
                parts.append((rows, *ops.paged_attention_with_lse(qp, key_cache, value_cache, tables, lens, starts,
                                                                  scale, softcap=softcap, **kw)))

        part(step.first_rows, hk, hv, step.first_tables, step.first_lens, step.first_starts)
        part(step.window_rows, hk, hv, step.window_tables, step.window_lens, step.window_starts,
             sliding_window=self.window)
        part(step.cold_rows, key_cache, value_cache, step.cold_tables, step.cold_lens, step.cold_starts,
             k_scale=k_scale, v_scale=v_scale)
        if sinks is not None:   # a learned sink (gpt-oss) is one more logit that carries no value
            parts.append((None, torch.zeros_like(q), sinks.float().expand(q.shape[0], -1)))
        return merge_parts(parts, q.shape, q.dtype)


def merge_parts(parts, shape, dtype) -> torch.Tensor:
    """Softmax results over disjoint key sets, each (rows or None for all, out [R, H, D], lse [R, H]),
    merged by their log-sum-exp into [T, H, D]."""
    T, H, D = shape
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    lses = torch.full((len(parts), T, H), float("-inf"), dtype=torch.float32, device=parts[0][1].device)
    for i, (rows, _, lse) in enumerate(parts):
        if rows is None:
            lses[i] = lse
        else:
            lses[i].index_copy_(0, rows, lse)
    top = lses.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - top)                       # [P, T, H]
    total = weights.sum(dim=0)
    out = torch.zeros(T, H, D, dtype=torch.float32, device=lses.device)
    for i, (rows, o, _) in enumerate(parts):
        if rows is None:
            out.add_(o.float() * weights[i].unsqueeze(-1))
        else:
            out.index_add_(0, rows, o.float() * weights[i].index_select(0, rows).unsqueeze(-1))
    return (out / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).to(dtype)
