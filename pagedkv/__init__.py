"""pagedkv: a paged KV cache for LLM inference.

- ``pagedkv.BlockManager``: where every token's KV lives (C++; prefix caching, retention priorities
  and pins, CoW, fork, swap, sliding windows and groups of layers).
- ``pagedkv.ops``: ``reshape_and_cache``, ``paged_attention`` (and ``paged_attention_with_lse``),
  ``copy_blocks``, ``swap_blocks``, ``offload_blocks`` / ``load_blocks`` (the host tier), and the model-layer ops ``rms_norm``, ``fused_add_rms_norm``,
  ``silu_and_mul``, ``rotary_embedding``, and MLA's ``concat_and_cache_mla`` / ``paged_attention_mla``
  (``torch.ops.pagedkv.*``, CPU and CUDA).
- ``pagedkv.allocate_kv_cache`` / ``pagedkv.allocate_host_tier`` / ``pagedkv.num_blocks_for``: cache tensors
  and pool sizing (``allocate_mla_cache`` / ``num_mla_blocks_for``: MLA's latent caches).
- ``pagedkv.engine``: a small reference engine for Llama-family models.
"""

from . import _ops_library

_ops_library.load()  # torch.ops.pagedkv.*: the schemas and CPU kernels

from . import _C, _moved, ops  # noqa: E402
from ._C import AllocStatus, BlockManager, hash_block_tokens  # noqa: E402
from ._cuda_kernels import load_cuda_kernels  # noqa: E402
from .cache import (allocate_host_tier, allocate_int4_kv_cache, allocate_kv_cache, allocate_mla_cache, block_bytes,
                    int4_block_bytes, int4_row_bytes, kv_cache_groups, mla_block_bytes, num_blocks_for,
                    num_mla_blocks_for)

_C.built_with_cuda = load_cuda_kernels()
_moved.install()
__version__ = "0.1.0"
__all__ = ["AllocStatus", "BlockManager", "hash_block_tokens", "ops", "allocate_kv_cache", "allocate_host_tier",
           "block_bytes", "kv_cache_groups", "num_blocks_for", "allocate_mla_cache", "mla_block_bytes",
           "num_mla_blocks_for", "allocate_int4_kv_cache", "int4_block_bytes", "int4_row_bytes"]
