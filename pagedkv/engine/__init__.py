"""pagedkv.engine: a small reference LLM engine on the paged KV cache (continuous batching, prefix
caching, preemption by swap or recompute, n > 1 samples by fork + copy-on-write).

    from pagedkv.engine import LLM, SamplingParams
    llm = LLM("path/to/llama", device="cuda", num_cpu_blocks=512)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(out[0].text, llm.stats()["hit_rate"])

Files: config (model and engine settings, the model registry), llama (the model, attention through
torch.ops.pagedkv; Mistral is Llama with windows), gemma2 (Gemma 2 from llama's pieces), loader
(safetensors and GGUF checkpoints into the registry's model class), sampling, sequence (sequences, requests, outputs),
scheduler (queues and block-manager decisions), model_runner (block moves, attention inputs, forward,
sampling), llm_engine (the LLM API), tp/ (tensor parallelism) and worker (a tensor-parallel worker's
entry point).
"""
from .llm_engine import LLM
from .sampling import SamplingParams
from .sequence import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
