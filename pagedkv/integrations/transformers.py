"""pagedkv's paged attention inside transformers' continuous batching (``model.generate_batch``).

    import pagedkv.integrations.transformers as pagedkv_hf
    pagedkv_hf.enable()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="paged|eager")
    outputs = model.generate_batch(prompts, GenerationConfig(max_new_tokens=64, do_sample=False))

Continuous batching runs its eager attention under the key ``"paged|eager"`` (a model loaded with
``"eager"`` is switched to it; ``"sdpa"`` and flash models keep their own attention). ``enable()``
registers pagedkv's function under that key and ``disable()`` puts transformers' own back; a
``"paged|eager"`` forward outside continuous batching still runs transformers' function.

Where the keys and values come from (transformers 5.25 and 5.23):

- Full-attention layers, zero copy. transformers writes the step's keys and values into its own pages
  (its ``index_copy_``) but no longer gathers each sequence's whole history back out of them:
  ``paged_attention`` reads the pages in place through block tables built from transformers' read
  indices. A layer's pages are a contiguous ``[pages, page_size, num_kv_heads, head_dim]`` view of
  transformers' cache buffer (K and V pages of every layer of the group alternate, so block ``b`` of
  the group is page ``b * 2 * num_layers`` of each layer's view).
- Sliding-window layers, one copy (transformers'). Their cache is a ring buffer of the window per
  sequence, and a chunk of a prefill overwrites entries that its own earlier queries still attend to
  before attention runs, so the pages alone cannot answer: ``paged_attention`` reads the window's keys
  and values that transformers gathers before it writes, as a cache of one-token blocks.
- Gemma 2's logit softcapping is applied (transformers' own ``"paged|eager"`` ignores it). Layers
  pagedkv cannot compute (attention sinks, bidirectional attention, dropout, compressed latent caches,
  a keyword argument it does not know) raise ``NotImplementedError`` naming what is missing.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from pagedkv import ops

__all__ = ["ATTN_IMPLEMENTATION", "enable", "disable", "enabled", "paged_attention_forward"]

ATTN_IMPLEMENTATION = "paged|eager"   # the only eager key continuous batching accepts
_MIN_VERSION = (5, 23)
_LAYER = "pagedkv_cache_layer"        # kwargs entry: the cache allocator that holds this layer's pages

# Keyword arguments continuous batching passes that leave the attention's result unchanged (its inputs
# are read from them, or they concern other parts of the model).
_METADATA = frozenset({"position_ids", "use_cache", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                       "max_length_k", "read_index", "write_index", "block_table", "is_causal",
                       "logits_indices", "logits_processor_args"})
_COMPUTED = frozenset({"scaling", "dropout", "sliding_window", "softcap"})

_lock = threading.Lock()
_saved: dict[str, Any] = {}           # transformers' own "forward" and PagedAttentionCache "update"
_api: dict[str, Any] = {}             # transformers' classes, once imported


def _transformers_api() -> dict[str, Any]:
    """transformers' attention registry and cache classes, checked to be a release this module knows."""
    if _api:
        return _api
    try:
        import transformers
    except ImportError as e:
        raise ImportError('pagedkv.integrations.transformers needs transformers: pip install '
                          '"pagedkv[transformers]"') from e
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    try:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        from transformers.generation.continuous_batching.cache_allocators import (
            FullAttentionCacheAllocator, SlidingAttentionCacheAllocator)
        from transformers.modeling_utils import AttentionInterface
    except ImportError as e:
        raise ImportError(f"pagedkv.integrations.transformers needs transformers >= "
                          f"{'.'.join(map(str, _MIN_VERSION))} (continuous batching with cache allocators); "
                          f"found {transformers.__version__}") from e
    if version < _MIN_VERSION or ATTN_IMPLEMENTATION not in AttentionInterface._global_mapping:
        raise ImportError(f"pagedkv.integrations.transformers needs transformers >= "
                          f"{'.'.join(map(str, _MIN_VERSION))}; found {transformers.__version__}")
    _api.update(interface=AttentionInterface, cache=PagedAttentionCache, full=FullAttentionCacheAllocator,
                sliding=SlidingAttentionCacheAllocator)
    return _api


def enable() -> None:
    """Makes continuous batching (``generate_batch``, ``init_continuous_batching``) compute the attention of
    ``"paged|eager"`` models with pagedkv's ``paged_attention``. Process-wide; idempotent. Call it before
    generation starts, not while a continuous batching manager is running."""
    with _lock:
        if _saved:
            return
        api = _transformers_api()
        _saved["forward"] = api["interface"]._global_mapping[ATTN_IMPLEMENTATION]
        _saved["update"] = api["cache"].__dict__["update"]
        api["cache"].update = _update
        api["interface"].register(ATTN_IMPLEMENTATION, paged_attention_forward)


def disable() -> None:
    """Puts transformers' own ``"paged|eager"`` attention and cache update back. Idempotent."""
    with _lock:
        if not _saved:
            return
        api = _transformers_api()
        api["interface"].register(ATTN_IMPLEMENTATION, _saved.pop("forward"))
        api["cache"].update = _saved.pop("update")


def enabled() -> bool:
    """Whether ``enable()`` is in effect."""
    return bool(_saved)


def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
            kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``PagedAttentionCache.update`` while enabled: transformers' own for models on other attentions and
    for the flash block-table path, ``_update_for_pagedkv`` for ``"paged|eager"`` models."""
    if getattr(self.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION or \
            kwargs.get("block_table") is not None:
        return _stock_update()(self, key_states, value_states, layer_idx, kwargs)
    return _update_for_pagedkv(self, key_states, value_states, layer_idx, kwargs)


def _update_for_pagedkv(cache: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                        kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cache update, which also names the layer's allocator to the attention function and,
    on full-attention layers, writes the step's keys and values without reading the history back."""
    stock = _stock_update()
    layer = cache.layer_to_allocator[layer_idx]
    kwargs[_LAYER] = layer
    if type(layer) is not _api["full"]:
        return stock(cache, key_states, value_states, layer_idx, kwargs)   # ring buffers: read, then write
    # An empty read index is transformers' own write-only path; the attention reads the pages instead.
    read_index = kwargs["read_index"]
    kwargs["read_index"] = [r[:0] if i == layer.index else r for i, r in enumerate(read_index)]
    try:
        return stock(cache, key_states, value_states, layer_idx, kwargs)
    finally:
        kwargs["read_index"] = read_index


def _stock_update() -> Callable[..., Any]:
    return _saved.get("update") or _api["cache"].__dict__["update"]


@torch.compiler.disable   # transformers' cache views and the op's host-side checks stay out of graphs
def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[1, Hq, T, D]`` packed over the batch's
    sequences, ``key`` / ``value`` what the cache update returned; returns ``([1, T, Hq, D], None)``. The
    causal and window mask continuous batching builds is not read: ``paged_attention`` applies both."""
    layer_idx: int = getattr(module, "layer_idx")
    cache = kwargs.pop("cache", None)
    if cache is not None:   # releases whose attention function updates the cache itself (5.23)
        key, value = _update_for_pagedkv(cache, key, value, layer_idx, kwargs)
    layer = kwargs.pop(_LAYER, None)
    if layer is None:       # not continuous batching: transformers' own function
        return _stock_forward()(module, query, key, value, attention_mask, **kwargs)
    scale, window, softcap = _check_supported(module, layer, query, kwargs)
    q = query[0].transpose(0, 1)                                        # [T, Hq, D]
    key_cache, value_cache, block_tables, seq_lens, query_start_loc = _attention_inputs(
        layer, layer_idx, key, value, q.size(0), kwargs)
    out = ops.paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                              max_seq_len=max(int(kwargs["max_length_k"]), q.size(0)),
                              sliding_window=window, softcap=softcap)
    return out.unsqueeze(0), None


def _stock_forward() -> Callable[..., Any]:
    if "forward" in _saved:
        return _saved["forward"]
    from transformers.integrations.eager_paged import eager_paged_attention_forward
    return eager_paged_attention_forward


def _check_supported(module: torch.nn.Module, layer: Any, query: torch.Tensor,
                     kwargs: dict[str, Any]) -> tuple[float, int, float]:
    """(scale, sliding_window or -1, softcap or 0) of this layer, or NotImplementedError for attention
    that paged_attention does not compute."""
    name = type(module).__name__
    fix = ("; call pagedkv.integrations.transformers.disable() to run this model with transformers' own "
           "attention")
    if hasattr(module, "sinks") or kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{name} has attention sinks, which pagedkv's paged_attention does not "
                                  f"compute{fix}")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(f"{name} attends bidirectionally; paged_attention is causal{fix}")
    if kwargs.get("dropout"):
        raise NotImplementedError(f"{name} asks for attention dropout {kwargs['dropout']} (training); "
                                  f"paged_attention is for inference{fix}")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _METADATA | _COMPUTED)
    if unknown:
        raise NotImplementedError(f"{name} passes {unknown} to its attention function, which pagedkv does "
                                  f"not know how to honour{fix}")
    if type(layer) not in (_api["full"], _api["sliding"]):
        raise NotImplementedError(f"{name} layer {module.layer_idx} keeps its cache in a "
                                  f"{type(layer).__name__}; pagedkv reads full-attention pages and "
                                  f"sliding-window buffers only{fix}")
    if query.dim() != 4 or query.size(0) != 1:
        raise ValueError(f"continuous batching packs every sequence into one row: query must be "
                         f"[1, num_heads, num_tokens, head_dim], got {tuple(query.shape)}")
    window = layer.sliding_window if type(layer) is _api["sliding"] else None
    asked = kwargs.get("sliding_window")
    if asked is not None and asked != window:
        raise NotImplementedError(f"{name} layer {module.layer_idx} attends over a window of {asked} tokens "
                                  f"but transformers' cache keeps {'all of them' if window is None else window}"
                                  f"{fix}")
    scaling = kwargs.get("scaling")
    softcap = kwargs.get("softcap")
    return (float(scaling) if scaling is not None else query.size(-1) ** -0.5,
            window if window is not None else -1,
            float(softcap) if softcap else 0.0)


def _attention_inputs(layer: Any, layer_idx: int, key: torch.Tensor, value: torch.Tensor, num_tokens: int,
                      kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """(key_cache, value_cache, block_tables, seq_lens, query_start_loc) for paged_attention, built on the
    device from transformers' cumulative lengths and indices (no host sync). One extra row at the end holds
    the padding tokens a captured or compiled step may carry past the last sequence: it reads block 0,
    which exists, and its output is never used."""
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    if type(layer) is _api["full"]:
        key_cache, value_cache = layer.get_cache_for_block_table(layer_idx)
        block_size = layer.tokens_per_page
        read = kwargs["read_index"][layer.index]
        # Without reads, every sequence starts at position 0 and the write index lists all its slots.
        index = read if read.numel() > 0 else kwargs["write_index"][layer.index]
    else:
        # [total_k, 1, Hkv, D]: transformers' gathered window, a one-token block per key.
        key_cache = key[0].transpose(0, 1).contiguous().unsqueeze(1)
        value_cache = value[0].transpose(0, 1).contiguous().unsqueeze(1)
        block_size, index = 1, None
    width = max(math.ceil(int(kwargs["max_length_k"]) / block_size), math.ceil(num_tokens / block_size), 1)
    device = cu_k.device
    rows = cu_k[:-1].long()[:, None] + torch.arange(width, device=device) * block_size
    if index is None:
        tables = rows.clamp_(max=key_cache.size(0) - 1)
    else:                   # the slot of each block's first token, as a page of the layer's view
        tables = torch.div(index[rows.clamp_(max=index.numel() - 1)], block_size, rounding_mode="floor")
    tables = torch.cat([tables.int(), torch.zeros(1, width, dtype=torch.int32, device=device)])
    total = torch.full((1,), num_tokens, dtype=torch.int32, device=device)
    seq_lens = torch.cat([(cu_k[1:] - cu_k[:-1]).int(), total - cu_q[-1:].int()])
    query_start_loc = torch.cat([cu_q.int(), total])
    return key_cache, value_cache, tables, seq_lens, query_start_loc
