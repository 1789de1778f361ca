"""pagedkv.engine: a small reference LLM engine on the paged KV cache (continuous batching, prefix
caching, preemption by swap or recompute, n > 1 samples by fork + copy-on-write).

    from pagedkv.engine import LLM, SamplingParams
    llm = LLM("path/to/llama", device="cuda", num_cpu_blocks=512)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(out[0].text, llm.stats()["hit_rate"])

Rooms, one concept each (every folder's docstring says what it owns and what it may import;
tests/test_import_graph.py checks it):
  config.py     the model's and the engine's settings, shared by every room
  models/       one module per architecture over shared decoder blocks, and the registry
  checkpoints/  safetensors and GGUF checkpoints, tokenizers, chat templates
  kv/           the KV beyond the pool: disk tier, transfer, fingerprint, events, fp8 scales
  serving/      the LLM API, scheduler, sequences, sampling, speculation, metrics
  execution/    the model runner and CPU weight packing
  tp/           tensor parallelism and its workers' entry point
"""
from .serving.llm_engine import LLM
from .serving.sampling import SamplingParams
from .serving.sequence import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
