"""The float8 rule's full-precision recent tokens (pagedkv.engine.kv.recent): each query reads its latest
`window` tokens and its sequence's first block in the model's dtype and the rest from the float8 cache.

RecentPool + LayerRecentKV over several steps (prefills by chunks, decodes, prefix hits that start past
position 0, rejected drafts, a pool too small for every sequence) against a float64 reference that reads
each key exactly as the rule says; and the engine: with a window longer than every sequence the float8
engine's answers are fp32 KV's, and the real model keeps >= 99% of fp32 KV's top-1 tokens."""
import pytest
import torch

from pagedkv import ops
from pagedkv.engine.kv.recent import LayerRecentKV, RecentPool

FP8 = torch.float8_e4m3fn


class Sim:
    """Sequences of random K/V, a float8 paged cache with per-head scales, and what the rule should read."""

    def __init__(self, lengths, block_size, heads, kv_heads, dim, seed):
        g = torch.Generator().manual_seed(seed)
        self.bs, self.heads, self.kv_heads, self.dim, self.g = block_size, heads, kv_heads, dim, g
        self.k = [torch.randn(n, kv_heads, dim, generator=g) * 2 for n in lengths]
        self.v = [torch.randn(n, kv_heads, dim, generator=g) for n in lengths]
        blocks = [-(-n // block_size) for n in lengths]
        perm = torch.randperm(sum(blocks) + 3, generator=g).tolist()
        self.tables, i = [], 0
        for b in blocks:
            self.tables.append(perm[i:i + b])
            i += b
        self.width = max(blocks)
        shape = (sum(blocks) + 3, block_size, kv_heads, dim)
        self.kc = torch.full(shape, float("nan")).to(FP8)      # unwritten slots are NaN: never read
        self.vc = torch.full(shape, float("nan")).to(FP8)
        self.k_scale = torch.rand(kv_heads, generator=g) * 0.02 + 0.01
        self.v_scale = torch.rand(kv_heads, generator=g) * 0.01 + 0.005
        self.exact = [torch.zeros(n, dtype=torch.bool) for n in lengths]   # keys with a full-precision copy

    def slots(self, seq, s, e):
        t = self.tables[seq]
        return torch.tensor([t[p // self.bs] * self.bs + p % self.bs for p in range(s, e)], dtype=torch.int64)

    def write_fp8(self, seq, s, e):
        ops.reshape_and_cache(self.k[seq][s:e], self.v[seq][s:e], self.kc, self.vc, self.slots(seq, s, e),
                              self.k_scale, self.v_scale)

    def table_tensor(self, seqs):
        return torch.tensor([self.tables[i] + [0] * (self.width - len(self.tables[i])) for i in seqs],
                            dtype=torch.int32)

    def reference(self, seq, q, s, e, window, first, plain):
        """float64 attention of q (rows at positions [s, e)) with each key as the rule reads it."""
        kf = self.kc.float() * self.k_scale.view(1, 1, -1, 1)
        vf = self.vc.float() * self.v_scale.view(1, 1, -1, 1)
        idx = self.slots(seq, 0, e)
        k8, v8 = kf.view(-1, self.kv_heads, self.dim)[idx], vf.view(-1, self.kv_heads, self.dim)[idx]
        out = torch.empty(e - s, self.heads, self.dim, dtype=torch.float64)
        group = self.heads // self.kv_heads
        for r, p in enumerate(range(s, e)):
            j = torch.arange(p + 1)
            hot = ~torch.tensor(plain) & ((j < first) | (p - j < window)) & self.exact[seq][:p + 1]
            keys = torch.where(hot.view(-1, 1, 1), self.k[seq][:p + 1], k8[:p + 1]).double()
            vals = torch.where(hot.view(-1, 1, 1), self.v[seq][:p + 1], v8[:p + 1]).double()
            keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
            logits = torch.einsum("hd,jhd->hj", q[r].double(), keys) * self.dim ** -0.5
            out[r] = torch.einsum("hj,jhd->hd", logits.softmax(-1), vals)
        return out


def run_steps(sim, pool, layer, steps, window, first):
    """steps: lists of (seq, s, e); each step writes [s, e) and attends. Returns the largest error."""
    worst = 0.0
    for step in steps:
        seqs = [x[0] for x in step]
        for seq, s, e in step:
            sim.write_fp8(seq, s, e)
        inputs = pool.prepare(seqs, [x[1] for x in step], [x[2] for x in step], sim.table_tensor(seqs))
        plain = {seq for seq in seqs if seq not in pool.entries}
        k = torch.cat([sim.k[seq][s:e] for seq, s, e in step])
        v = torch.cat([sim.v[seq][s:e] for seq, s, e in step])
        q = torch.randn(k.shape[0], sim.heads, sim.dim, generator=sim.g)
        out = layer.attend(q, k, v, sim.kc, sim.vc, sim.k_scale, sim.v_scale, inputs, sim.dim ** -0.5, 0.0, None)
        row = 0
        for seq, s, e in step:
            if seq not in plain:
                sim.exact[seq][s:e] = True
            else:
                sim.exact[seq][:e] = False
            ref = sim.reference(seq, q[row:row + e - s], s, e, window, first, seq in plain)
            worst = max(worst, (out[row:row + e - s].double() - ref).abs().max().item())
            row += e - s
    return worst


def schedule(lengths, chunk, starts):
    """Prefill each sequence from starts[i] by chunks of `chunk` (all sequences each step), then decode."""
    pos, steps = list(starts), []
    while any(p < n for p, n in zip(pos, lengths)):
        step = []
        for i, (p, n) in enumerate(zip(pos, lengths)):
            if p < n:
                e = min(n, p + (chunk if p < n - 8 else 1))
                step.append((i, p, e))
                pos[i] = e
        steps.append(step)
    return steps


@pytest.mark.parametrize("window,first_block", [(6, True), (6, False), (0, True), (20, True), (1, True)])
@pytest.mark.parametrize("block_size", [4, 8])
def test_recent_rule_reads_each_key_as_the_rule_says(window, first_block, block_size):
    lengths, starts = [37, 5, 61, 23], [0, 0, 0, 0]
    sim = Sim(lengths, block_size, heads=4, kv_heads=2, dim=16, seed=window * 10 + block_size)
    pool = RecentPool(200, block_size, window, first_block, "cpu")
    layer = LayerRecentKV(*torch.empty(2, 200, block_size, 2, 16).unbind(0), window)
    assert run_steps(sim, pool, layer, schedule(lengths, 9, starts), window,
                     block_size if first_block else 0) < 2e-5
    assert pool.entries and set(pool.entries) == set(range(len(lengths)))


@pytest.mark.parametrize("first_block", [True, False])
def test_prefix_hits_read_float8_until_their_own_tokens(first_block):
    """A sequence that starts past 0 (its KV came from the prefix cache, in float8 only) reads those keys
    from the float8 cache (warmed copies), and its own tokens at full precision."""
    bs, window, lengths, starts = 4, 10, [50, 31], [24, 13]
    sim = Sim(lengths, bs, heads=2, kv_heads=1, dim=8, seed=3)
    for i, s in enumerate(starts):
        sim.write_fp8(i, 0, s)
    pool = RecentPool(64, bs, window, first_block, "cpu")
    layer = LayerRecentKV(*torch.empty(2, 64, bs, 1, 8).unbind(0), window)
    assert run_steps(sim, pool, layer, schedule(lengths, 5, starts), window, bs if first_block else 0) < 2e-5


def test_rejected_drafts_and_a_recompute_rewrite_their_positions():
    bs, window = 4, 7
    sim = Sim([40], bs, heads=2, kv_heads=1, dim=8, seed=5)
    pool = RecentPool(32, bs, window, True, "cpu")
    layer = LayerRecentKV(*torch.empty(2, 32, bs, 1, 8).unbind(0), window)
    steps = [[(0, 0, 12)], [(0, 12, 17)], [(0, 14, 16)], [(0, 16, 20)], [(0, 0, 9)], [(0, 9, 30)], [(0, 30, 31)]]
    assert run_steps(sim, pool, layer, steps, window, bs) < 2e-5


def test_a_pool_too_small_leaves_a_sequence_on_float8_and_stays_exact():
    bs, window, lengths = 4, 8, [30, 30, 30]
    sim = Sim(lengths, bs, heads=2, kv_heads=1, dim=8, seed=7)
    pool = RecentPool(RecentPool.blocks_needed(2, 8, bs, window) - 6, bs, window, True, "cpu")
    layer = LayerRecentKV(*torch.empty(2, pool.num_blocks, bs, 1, 8).unbind(0), window)
    assert run_steps(sim, pool, layer, schedule(lengths, 8, [0, 0, 0]), window, bs) < 2e-5
    assert len(pool.entries) < len(lengths)      # someone ran on float8 alone


def test_first_blocks_are_shared_by_their_tokens():
    pool = RecentPool(16, 4, 4, True, "cpu")
    tokens = {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 9], 2: [7, 2, 3, 4]}
    tables = torch.arange(6, dtype=torch.int32).view(3, 2)
    pool.prepare([0, 1, 2], [0, 0, 0], [5, 5, 4], tables, first_tokens=lambda i: tokens[i][:4])
    e = pool.entries
    assert e[0].first == e[1].first != e[2].first
    pool.reset()
    assert sorted(pool.free) == list(range(16)) and not pool.entries and not pool.firsts
