"""Float64 PyTorch references of the MLA ops (the latent cache write and absorbed-form attention over it)
and a random paged batch over a latent cache whose unread bytes are NaN."""
from __future__ import annotations

import math

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def latent_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_slots, width] view of a latent cache (a copy when its strides do not allow a view)."""
    return kv_cache.reshape(-1, kv_cache.shape[-1])


def stored_latent(kv_c, k_pe, cache_dtype, scale=None):
    """The cache elements concat_and_cache_mla stores for these inputs: the concatenated row, or for a
    float8 cache fp8(x / scale) saturated (torch's own conversion of the clamped fp32 value)."""
    row = torch.cat([kv_c, k_pe], dim=-1)
    if cache_dtype not in FP8_MAX:
        return row.to(cache_dtype)
    s = 1.0 if scale is None else float(scale.reshape(-1)[0])
    m = FP8_MAX[cache_dtype]
    return (row.float() / s).clamp(-m, m).to(cache_dtype)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, scale=None):
    """Returns an updated copy of the cache (contiguous)."""
    cache = kv_cache.clone(memory_format=torch.contiguous_format)
    keep = slot_mapping >= 0
    rows = cache.view(-1, cache.shape[-1])
    rows[slot_mapping[keep].long()] = stored_latent(kv_c[keep], k_pe[keep], cache.dtype, scale)
    return cache


def paged_attention_mla(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, kv_lora_rank,
                        kv_scale=None):
    """Returns (out [T, H, kv_lora_rank] float64, lse [T, H] float64)."""
    num_tokens, num_heads, width = query.shape
    block_size = kv_cache.shape[1]
    s = 1.0 if kv_scale is None else float(kv_scale.reshape(-1)[0])
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float64)
    cache = kv_cache.cpu()
    for b in range(seq_lens.shape[0]):
        q0, q1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len, q_len = int(seq_lens[b]), q1 - q0
        if q_len == 0:
            continue
        blocks = block_tables[b, :-(-seq_len // block_size)].long().cpu()
        rows = cache[blocks].reshape(-1, width)[:seq_len].double() * s
        q = query[q0:q1].cpu().double()
        logits = torch.einsum("qhd,kd->hqk", q, rows) * scale
        visible = torch.arange(seq_len).view(1, -1) <= torch.arange(seq_len - q_len, seq_len).view(-1, 1)
        logits = logits.masked_fill(~visible, -math.inf)
        lse[q0:q1] = torch.logsumexp(logits, dim=-1).transpose(0, 1)
        out[q0:q1] = torch.einsum("hqk,kd->qhd", torch.softmax(logits, dim=-1), rows[:, :kv_lora_rank])
    return out, lse


class LatentBatch:
    """Sequences over a random paged latent cache: sequence b has prefixes[b] cached tokens and q_lens[b]
    queries (their rows written too). Every row no query may read (unused blocks, the tail of each last
    block) is NaN, and block table entries past a sequence's length are out of range."""

    def __init__(self, prefixes, q_lens, *, block_size, num_heads, kv_lora_rank, rope_dim, dtype,
                 cache_dtype=None, kv_scale=None, device="cpu"):
        cache_dtype = cache_dtype or dtype
        self.kv_lora_rank, self.width = kv_lora_rank, kv_lora_rank + rope_dim
        self.seq_lens_list = [p + q for p, q in zip(prefixes, q_lens)]
        blocks_per_seq = [-(-n // block_size) for n in self.seq_lens_list]
        self.num_blocks = sum(blocks_per_seq) + 3
        width_bt = max(blocks_per_seq) + 2
        perm = torch.randperm(self.num_blocks)
        tables = torch.randint(self.num_blocks, self.num_blocks + 1000, (len(q_lens), width_bt))
        slots, used = [], 0
        for b, n in enumerate(blocks_per_seq):
            tables[b, :n] = perm[used:used + n]
            used += n
            slots += [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(self.seq_lens_list[b])]
        self.kv_c = torch.randn(len(slots), kv_lora_rank, dtype=dtype, device=device)
        self.k_pe = torch.randn(len(slots), rope_dim, dtype=dtype, device=device)
        self.kv_scale = kv_scale
        self.kv_cache = torch.full((self.num_blocks, block_size, self.width), math.nan, device=device).to(cache_dtype)
        self.slots = torch.tensor(slots, device=device)
        torch.ops.pagedkv.concat_and_cache_mla(self.kv_c, self.k_pe, self.kv_cache, self.slots, "auto", kv_scale)
        self.block_tables = tables.to(torch.int32).to(device)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32, device=device)
        self.query_start_loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                                            device=device)
        self.query = torch.randn(sum(q_lens), num_heads, self.width, dtype=dtype, device=device)
        self.scale = self.width ** -0.5

    def args(self):
        return (self.query, self.kv_cache, self.block_tables, self.seq_lens, self.query_start_loc, self.scale,
                self.kv_lora_rank)

    def reference(self):
        return paged_attention_mla(*self.args(), kv_scale=self.kv_scale)
