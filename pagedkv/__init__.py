"""pagedkv: a paged KV cache for LLM inference (block manager + CPU/CUDA kernels)."""
import torch  # noqa: F401  (loads libtorch before the extension)

from ._C import AllocStatus, BlockManager, hash_block_tokens  # also registers torch.ops.pagedkv.*

__version__ = "0.1.0"
__all__ = ["AllocStatus", "BlockManager", "hash_block_tokens"]
