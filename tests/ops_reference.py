"""What the op tests share: plain-PyTorch float64 references for the paged-KV ops (gather by block
table, masked causal softmax), the devices and tolerances, random paged batches, and a switch between
the ISA copies of the CPU attention kernels."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from pagedkv import _ops_library


def gather_sequence_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] rows of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:seq_len]


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Returns updated copies of the caches."""
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep]
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep]
    return key_cache, value_cache


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                    sliding_window=-1, softcap=0.0, sinks=None):
    """Returns (out [T, Hq, D] float64, lse [T, Hq] float64). sinks [Hq]: one more logit per head in the
    normaliser, carrying no value (gpt-oss; transformers concatenates it to the masked logits)."""
    num_tokens, num_q_heads, head_dim = query.shape
    group = num_q_heads // key_cache.shape[2]
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=torch.float64)
    for b in range(seq_lens.shape[0]):
        q0, q1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len, q_len = int(seq_lens[b]), q1 - q0
        if q_len == 0:
            continue
        k = gather_sequence_kv(key_cache.cpu(), block_tables[b].cpu(), seq_len).double()
        v = gather_sequence_kv(value_cache.cpu(), block_tables[b].cpu(), seq_len).double()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q0:q1].cpu().double()
        logits = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len).view(-1, 1)
        k_pos = torch.arange(seq_len).view(1, -1)
        visible = k_pos <= q_pos
        if sliding_window > 0:
            visible &= k_pos > q_pos - sliding_window
        logits = logits.masked_fill(~visible, -math.inf)
        if sinks is None:
            lse[q0:q1] = torch.logsumexp(logits, dim=-1).transpose(0, 1)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)
        else:
            sink = sinks.cpu().double().view(-1, 1, 1).expand(-1, q_len, 1)
            row_lse = torch.logsumexp(torch.cat((logits, sink), dim=-1), dim=-1, keepdim=True)
            lse[q0:q1] = row_lse[..., 0].transpose(0, 1)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.exp(logits - row_lse), v)
    return out, lse


def copy_blocks(key_caches, value_caches, block_mapping):
    """Returns updated copies of every layer's caches."""
    keys = [c.clone() for c in key_caches]
    values = [c.clone() for c in value_caches]
    for src, dst in block_mapping.tolist():
        for k, v in zip(keys, values):
            k[dst] = k[src]
            v[dst] = v[src]
    return keys, values


def swap_blocks(src, dst, block_mapping):
    """Returns an updated copy of dst."""
    dst = dst.clone()
    for s, d in block_mapping.tolist():
        dst[d] = src[s].to(dst.device)
    return dst


# --------------------------------------------------------------------------------------------------
# Shared by the op tests: devices, tolerances, random paged batches

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))]
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOLERANCE = {F32: 2e-5, F16: 3e-3, BF16: 2e-2}  # atol = rtol against the float64 reference


LAYER_TOLERANCE = {F32: 2e-5, F16: 4e-3, BF16: 3e-2}  # model-layer ops (rounded where HF rounds)


def assert_close(actual, expected, dtype, what="", tolerance=TOLERANCE):
    tol = tolerance[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=tol, rtol=tol,
                               msg=lambda m: f"{what}: {m}")


class PagedBatch:
    """A random batch of sequences over a random paged cache: sequence b has prefix[b] cached tokens
    and q_lens[b] new query tokens (all already in the cache). Block tables are padded with
    out-of-range ids past each sequence's length, which the kernels must never read."""

    def __init__(self, prefixes, q_lens, *, block_size, num_kv_heads, group, head_dim, dtype, device,
                 query_layout="contiguous"):
        self.seq_lens_list = [p + q for p, q in zip(prefixes, q_lens)]
        blocks_per_seq = [-(-n // block_size) for n in self.seq_lens_list]
        self.num_blocks = sum(blocks_per_seq) + 3
        width = max(blocks_per_seq) + 2
        perm = torch.randperm(self.num_blocks)
        tables = torch.randint(self.num_blocks, self.num_blocks + 1000, (len(q_lens), width))
        used = 0
        for b, n in enumerate(blocks_per_seq):
            tables[b, :n] = perm[used:used + n]
            used += n
        shape = (self.num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.randn(shape, dtype=dtype, device=device)
        self.value_cache = torch.randn(shape, dtype=dtype, device=device)
        self.block_tables = tables.to(torch.int32).to(device)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32, device=device)
        self.query_start_loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                                            device=device)
        num_tokens, num_q_heads = sum(q_lens), num_kv_heads * group
        if query_layout == "contiguous":
            self.query = torch.randn(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
        elif query_layout == "strided_tokens":  # head_dim contiguous, rows spaced apart
            self.query = torch.randn(num_tokens, num_q_heads, 2 * head_dim, dtype=dtype, device=device)[..., :head_dim]
        else:  # "transposed": head_dim not contiguous
            self.query = torch.randn(num_tokens, head_dim, num_q_heads, dtype=dtype, device=device).transpose(1, 2)
        self.scale = head_dim ** -0.5

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def reference(self, **kwargs):
        return paged_attention(*self.args(), **kwargs)


CPU_ISAS = _ops_library.cpu_attention_isas()  # the copies of the CPU attention kernels this CPU runs, best first


@contextlib.contextmanager
def cpu_attention_isa(isa):
    """Runs the given copy of the CPU attention kernels inside the block ("avx512", "avx2", "baseline")."""
    _ops_library.set_cpu_attention_isa(isa)
    try:
        yield
    finally:
        _ops_library.set_cpu_attention_isa("auto")


def cos_sin_cache(max_position, head_dim, dtype=torch.float32, device="cpu"):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype=dtype, device=device)


def small_batch(device="cpu", dtype=torch.float32) -> "PagedBatch":
    """Three sequences (a decode, a fresh prefill, a prefill over a cached prefix) for argument tests."""
    return PagedBatch([5, 0, 20], [1, 4, 3], block_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=dtype,
                      device=device)
