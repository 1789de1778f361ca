"""Plain-PyTorch float64 references for the paged-KV ops: gather by block table, masked causal softmax."""
from __future__ import annotations

import math

import torch


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
                    sliding_window=-1, softcap=0.0):
    """Returns (out [T, Hq, D] float64, lse [T, Hq] float64)."""
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
        lse[q0:q1] = torch.logsumexp(logits, dim=-1).transpose(0, 1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)
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
