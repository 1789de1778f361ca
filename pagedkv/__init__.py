"""pagedkv: a paged KV cache for LLM inference (block manager + CPU/CUDA kernels)."""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.pagedkv.*)

__version__ = "0.1.0"
