"""pagedkv.engine: a small reference LLM engine on the paged KV cache (continuous batching, prefix
caching, preemption by swap or recompute, n > 1 samples by fork + copy-on-write)."""
from .llm_engine import LLM
from .sampling import SamplingParams
from .sequence import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
