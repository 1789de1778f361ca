"""Allocation and sizing of per-layer paged KV caches ([num_blocks, block_size, num_kv_heads, head_dim])."""
from __future__ import annotations

import torch

from .validation import check_int

__all__ = ["allocate_kv_cache", "allocate_host_tier", "num_blocks_for", "block_bytes", "kv_cache_groups",
           "allocate_mla_cache", "mla_block_bytes", "num_mla_blocks_for"]

# What the ops accept (float8 caches store quantised KV: reshape_and_cache's k_scale / v_scale).
_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _check_cache_geometry(dtype, **sizes) -> None:
    for name, v in sizes.items():
        check_int(name, v, minimum=1)
    if dtype not in _CACHE_DTYPES:
        raise ValueError("dtype must be torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn or "
                         f"torch.float8_e5m2, got {dtype}")


def block_bytes(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one physical block costs across all layers, keys and values together."""
    _check_cache_geometry(dtype, num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads,
                          head_dim=head_dim)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def num_blocks_for(memory_bytes: int, *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """How many blocks fit in ``memory_bytes`` (keys + values of every layer); 0 when not even one."""
    check_int("memory_bytes", memory_bytes, minimum=0)
    per_block = block_bytes(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, dtype=dtype)
    return int(memory_bytes) // per_block


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                      dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu",
                      pin_memory: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(key_cache, value_cache)`` pair per layer, each ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` and contiguous. Contents are uninitialised: a slot is valid only once written by
    ``reshape_and_cache`` (or copied in by ``copy_blocks`` / ``swap_blocks``). ``pin_memory`` (CPU only)
    makes swaps with a GPU cache asynchronous."""
    _check_cache_geometry(dtype, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                          num_kv_heads=num_kv_heads, head_dim=head_dim)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    pin = pin_memory and torch.device(device).type == "cpu"

    def one():
        return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)

    return [(one(), one()) for _ in range(num_layers)]


def allocate_host_tier(num_host_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                       dtype: torch.dtype = torch.float16, pin_memory: bool | None = None) -> torch.Tensor:
    """The block-major host tier that ``ops.offload_blocks`` / ``ops.load_blocks`` move blocks to and from:
    ``[num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` on the CPU, one contiguous
    region per block (keys then values of every layer), so a block moves as one unit. ``pin_memory``
    (default: when CUDA is available) is required for a GPU's caches. Contents are uninitialised."""
    _check_cache_geometry(dtype, num_host_blocks=num_host_blocks, num_layers=num_layers, block_size=block_size,
                          num_kv_heads=num_kv_heads, head_dim=head_dim)
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    return torch.empty((num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype,
                       pin_memory=pin)


def kv_cache_groups(layer_windows) -> tuple[list, list[tuple[int, int]]]:
    """Groups of layers for a BlockManager(group_windows=...), from each layer's attention window (tokens;
    None: full attention), e.g. Gemma 2's alternating ``[4096, None, 4096, None, ...]``.

    Returns ``(group_windows, placement)``: one window per group, full attention first (the manager's KV
    events describe group 0, and a prefix hit needs every block of the full-attention group), then each
    distinct window, smallest first; and for each layer ``(group, index)``, its group and its rank among
    that group's layers. Layers of one group share the group's block tables; when every group has the
    same number of layers, layer ``index`` of every group can share one cache tensor (a block id belongs
    to one group at a time), so the cache has ``len(layer_windows) // len(group_windows)`` tensors and a
    block id costs that many layers' bytes.
    """
    windows = [w if w is None else check_int(f"layer_windows[{i}] (tokens; None: full attention)", w, minimum=1)
               for i, w in enumerate(layer_windows)]
    if not windows:
        raise ValueError("layer_windows is empty")
    group_windows = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    placement, sizes = [], [0] * len(group_windows)
    for w in windows:
        g = group_windows.index(w)
        placement.append((g, sizes[g]))
        sizes[g] += 1
    return group_windows, placement


# ---------------------------------------------------------------------------------------------------
# MLA (DeepSeek V2/V3, Kimi K2): one latent cache per layer, [num_blocks, block_size, kv_lora_rank +
# qk_rope_head_dim], one row per token and no separate V. The block manager is the same: a block still
# holds block_size tokens; only the bytes per block change, so a pool is sized by the same division.

def mla_block_bytes(*, num_layers: int, block_size: int, kv_lora_rank: int, qk_rope_head_dim: int,
                    dtype: torch.dtype) -> int:
    """Bytes one physical block of an MLA model's latent caches costs across all layers:
    ``num_layers * block_size * (kv_lora_rank + qk_rope_head_dim) * itemsize`` (one row per token and layer;
    the heads share it, so ``num_heads`` does not appear)."""
    _check_cache_geometry(dtype, num_layers=num_layers, block_size=block_size, kv_lora_rank=kv_lora_rank)
    check_int("qk_rope_head_dim", qk_rope_head_dim, minimum=0)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * block_size * (kv_lora_rank + qk_rope_head_dim) * itemsize


def num_mla_blocks_for(memory_bytes: int, *, num_layers: int, block_size: int, kv_lora_rank: int,
                       qk_rope_head_dim: int, dtype: torch.dtype) -> int:
    """How many blocks of latent caches (every layer) fit in ``memory_bytes``; 0 when not even one."""
    check_int("memory_bytes", memory_bytes, minimum=0)
    return int(memory_bytes) // mla_block_bytes(num_layers=num_layers, block_size=block_size,
                                                kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                                                dtype=dtype)


def allocate_mla_cache(num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int, qk_rope_head_dim: int,
                       *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                       pin_memory: bool = False) -> list[torch.Tensor]:
    """One latent cache per layer, ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, contiguous
    and uninitialised (``ops.concat_and_cache_mla`` writes it, ``ops.paged_attention_mla`` reads it).
    ``swap_blocks`` moves its blocks as they are: ``swap_blocks(cache, cpu_cache, mapping)`` swaps, and
    ``swap_blocks(cache, cache, bm.take_copies())`` makes the block manager's copy-on-write copies.
    ``pin_memory`` (CPU only) makes swaps with a GPU cache asynchronous."""
    _check_cache_geometry(dtype, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                          kv_lora_rank=kv_lora_rank)
    check_int("qk_rope_head_dim", qk_rope_head_dim, minimum=0)
    shape = (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)
    pin = pin_memory and torch.device(device).type == "cpu"
    return [torch.empty(shape, dtype=dtype, device=device, pin_memory=pin) for _ in range(num_layers)]
