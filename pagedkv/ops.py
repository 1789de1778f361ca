"""Python entry points of the paged-KV ops (``torch.ops.pagedkv.*``) and their fake (meta) kernels.

The cache of one layer is a pair ``key_cache, value_cache``, each ``[num_blocks, block_size,
num_kv_heads, head_dim]`` (NHD, as FlashAttention / FlashInfer / vLLM's flash layout). Token position
``p`` of a sequence lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
Supported dtypes: float32, float16, bfloat16 (fp32 accumulation). Every op runs on CPU and CUDA,
works under ``torch.compile(fullgraph=True)``, and CUDA kernels never synchronise the host. Bad
arguments raise ``RuntimeError`` naming the argument before anything is written (a real meta tensor
next to CPU / CUDA ones included: it would otherwise route the call to the fake kernel, a no-op).
"""
from __future__ import annotations

import torch

from . import _ops_library

_ops_library.load()  # registers torch.ops.pagedkv.*

__all__ = ["reshape_and_cache", "paged_attention", "paged_attention_with_lse", "copy_blocks", "swap_blocks",
           "offload_blocks", "load_blocks", "cpu_attention_isa", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
           "concat_and_cache_mla", "paged_attention_mla", "paged_attention_mla_with_lse",
           "reshape_and_cache_int4", "paged_attention_int4", "paged_attention_int4_with_lse", "int4_kv_dequantize"]

_ops = torch.ops.pagedkv


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Writes this step's keys and values into their cache slots, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``, same dtype as the caches (or any of float32 /
            float16 / bfloat16 for a float8 cache); any strides.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` with any strides on
            the first three dimensions and a contiguous ``head_dim``, so the caches other engines allocate
            are written in place: vLLM's one tensor per layer with K|V interleaved in each cell
            (``x[..., :D]``, ``x[..., D:]``), FlashInfer's ``[pages, 2, page, Hkv, D]`` (``x[:, 0]``,
            ``x[:, 1]``), an HND ``[pages, Hkv, page, D]`` tensor ``.transpose(1, 2)``. K and V may be views
            of one buffer when no element is in both (decided exactly; see the reference). Dtypes
            float32, float16, bfloat16, or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (then each
            element is stored as ``fp8(x / scale)``, saturated at the format's largest finite value,
            rounded to nearest even; NaN stays NaN; bit-identical to ``(x.float() / scale).clamp(-max,
            max).to(dtype)``).
        k_scale, v_scale: float8 caches only: float32 tensors of shape ``[]`` (one scale) or
            ``[num_kv_heads]``, on the inputs' device; None means 1. Tensors, not floats, so a captured
            or compiled graph need not change when they do. On CPU they must be finite and > 0 (a GPU
            check would sync: there a bad scale stores inf/NaN).
        slot_mapping: ``[T]`` int32 or int64; token ``t`` goes to slot ``slot_mapping[t]``; a negative
            slot is padding and is skipped. On CPU an out-of-range slot raises before anything is
            written; CUDA kernels cannot raise and skip such slots. On CPU a slot given twice raises too.
            The caches must share no element with each other or with the inputs.

    Example::

        slots = torch.tensor([0, 1, 17, -1])            # block 0 offsets 0, 1; block 1 offset 1 (bs=16)
        reshape_and_cache(k, v, key_cache, value_cache, slots)
        kv = torch.empty(num_blocks, 16, num_kv_heads, 2 * head_dim)   # vLLM's per-layer cache
        reshape_and_cache(k, v, kv[..., :head_dim], kv[..., head_dim:], slots.int())
    """
    _ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, max_seq_len: int = -1, sliding_window: int = -1,
                    softcap: float = 0.0, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed queries over a paged KV cache (decode and prefill in one batch).

    Args:
        query: ``[T, num_q_heads, head_dim]`` packed over ``B`` sequences (``head_dim`` contiguous or
            not; a copy is made when not). ``num_q_heads % num_kv_heads == 0`` (GQA / MQA).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, query's dtype,
            or both ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (any query dtype): element ``x`` is
            read as ``float(x) * scale`` of its KV head and everything else is computed in float32.
            Views as in :func:`reshape_and_cache` (vLLM's interleaved cells, FlashInfer's pages, HND),
            read in place, with one condition: ``key_cache`` and ``value_cache`` have the same strides
            (true of every such layout). Both are only read, so they may even overlap (transformers'
            page views of one buffer do).
        block_tables: ``[B, M]`` int32; row ``b`` maps logical block ``i`` of sequence ``b`` to a
            physical block. Entries past a sequence's length are never read (may be anything).
        seq_lens: ``[B]`` int32, the KV length of each sequence *including* this step's tokens (which
            ``reshape_and_cache`` has already written).
        query_start_loc: ``[B + 1]`` int32; sequence ``b`` owns query rows
            ``query_start_loc[b]:query_start_loc[b + 1]``.
        scale: multiplies ``q . k`` (usually ``head_dim ** -0.5``); finite and > 0.
        max_seq_len: optional upper bound on ``seq_lens`` used by the CUDA kernel to size its split-K
            launch without reading ``seq_lens`` on the host (default: ``M * block_size``). A too small
            value only costs speed, never correctness. Ignored on CPU.
        sliding_window: when > 0, a query at position ``p`` sees keys in ``(p - sliding_window, p]``;
            -1 disables it.
        softcap: when > 0, logits become ``softcap * tanh(logit / softcap)`` (after ``scale``); finite
            and >= 0.
        k_scale, v_scale: float8 caches only, the scales they were written with (see
            :func:`reshape_and_cache`): float32 ``[]`` or ``[num_kv_heads]`` on the query's device; None
            means 1. On CPU they must be finite and > 0.
        sinks: attention sinks (gpt-oss): float32 ``[num_q_heads]`` on the query's device, or None. Each
            head's softmax runs over its visible logits and one extra logit ``sinks[h]`` that carries no
            value: ``out = sum_k e^(s_k) v_k / (e^(sinks[h]) + sum_k e^(s_k))``. The sink is neither scaled
            nor softcapped (transformers' gpt-oss concatenates it to the scaled, masked logits). A row
            that sees no key gives 0. On CPU the values must be finite (CUDA cannot check them).

    Masking is causal and bottom-right aligned: query ``j`` of sequence ``b`` with ``q_len`` queries
    sits at position ``seq_lens[b] - q_len + j``. Decode is ``q_len == 1``. A masked key contributes
    nothing, even when its cached key or value is inf or NaN. On CPU the metadata is copied before it
    is checked, so a caller's thread writing it meanwhile cannot make the kernel read outside the cache.

    Returns:
        ``[T, num_q_heads, head_dim]``, query's dtype, contiguous.

    Example::

        # two sequences: a decode step (KV length 37) and a 5-token prefill over a 11-token prefix
        qsl = torch.tensor([0, 1, 6], dtype=torch.int32)
        seq_lens = torch.tensor([37, 16], dtype=torch.int32)
        out = paged_attention(q, key_cache, value_cache, block_tables, seq_lens, qsl, 128 ** -0.5)
    """
    return _ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                max_seq_len=max_seq_len, sliding_window=sliding_window, softcap=softcap,
                                k_scale=k_scale, v_scale=v_scale, sinks=sinks)


def paged_attention_with_lse(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                             scale: float, *, max_seq_len: int = -1, sliding_window: int = -1,
                             softcap: float = 0.0, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None,
                             sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`paged_attention`, and also returns the log-sum-exp of each query row's logits.

    Returns:
        ``(out, lse)``: ``out`` as in :func:`paged_attention`; ``lse`` ``[T, num_q_heads]`` float32,
        natural log of ``sum_k exp(logit_k)`` over the visible keys (``-inf`` when there are none).
        Two results over disjoint key sets merge as ``o = (w1 o1 + w2 o2) / (w1 + w2)`` with
        ``w_i = exp(lse_i - max(lse_1, lse_2))`` (e.g. cascade / shared-prefix attention).
        With ``sinks``, the sink is part of the normaliser: ``lse = log(e^(sinks[h]) + sum_k e^(s_k))``
        (``sinks[h]`` for a row that sees no key). A merge stays exact when exactly one of the merged
        parts carries the sink: pass ``sinks`` to one call only (e.g. the shared prefix's), never to both.
    """
    return _ops.paged_attention_with_lse(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                         scale, max_seq_len=max_seq_len, sliding_window=sliding_window,
                                         softcap=softcap, k_scale=k_scale, v_scale=v_scale, sinks=sinks)


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copies whole blocks inside each layer's cache (copy-on-write after a fork), in place.

    Args:
        key_caches, value_caches: one cache per layer, all with the same ``num_blocks`` and device.
        block_mapping: ``[n, 2]`` int64 ``(src, dst)`` block pairs applied to every layer. Destinations
            must be distinct and must not be sources of other pairs. On CPU (or a CPU mapping with CUDA
            caches) out-of-range ids, repeated destinations and chains raise before anything is copied;
            a CUDA mapping is not checked (out-of-range ids are skipped, the rest is undefined).
        The caches must be distinct tensors that share no memory.

    Example::

        copy_blocks([k for k, _ in kv], [v for _, v in kv], bm.take_copies())
    """
    _ops.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies blocks ``src[i] -> dst[j]`` for each ``(i, j)`` in ``block_mapping``, in place.

    ``src`` and ``dst`` are caches (or any tensors blocked on dim 0) that agree in every dimension but
    the first and in dtype; they may be on different devices (GPU <-> CPU swap) or the same one. On CUDA
    the copies are ``cudaMemcpyAsync`` on the current stream; pin the CPU tensor for truly async copies.
    ``block_mapping``: ``[n, 2]`` int64 on the CPU; ids are range-checked and destinations must be
    distinct; when ``src`` is ``dst`` (blocks moved within one pool) no destination may be a source.
    Only CPU and CUDA tensors; ``src`` and ``dst`` are the same tensor or share no memory.

    Example::

        swap_blocks(gpu_key_cache, cpu_key_cache, bm.swap_out([seq_id]))
    """
    _ops.swap_blocks(src, dst, block_mapping)


def offload_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], host_cache: torch.Tensor,
                   block_mapping: torch.Tensor, first_layer: int = 0) -> None:
    """Copies whole blocks of every given layer from the paged caches into the host tier, in place.

    Args:
        key_caches, value_caches: contiguous caches of layers ``first_layer ..`` (as ``copy_blocks`` takes
            them), on the CPU or a GPU.
        host_cache: the block-major host tier, ``[num_host_blocks, num_layers, 2, block_size,
            num_kv_heads, head_dim]`` on the CPU (``pagedkv.allocate_host_tier``): slot ``s`` holds the key
            and value blocks of every layer of one block in one contiguous region. Pinned when the caches
            are on a GPU: the kernel writes it in place, one launch per layer on the current stream.
        block_mapping: ``[n, 2]`` int64 on the CPU, ``(device block, host slot)`` pairs (a
            ``BlockManager``'s ``take_offloads()``); ids are range-checked, host slots must be distinct.
        first_layer: the host-tier layer of ``key_caches[0]`` (copy a subset of the layers).
    """
    _ops.offload_blocks(key_caches, value_caches, host_cache, block_mapping, first_layer)


def load_blocks(host_cache: torch.Tensor, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: torch.Tensor, first_layer: int = 0) -> None:
    """Copies whole blocks from the host tier into the paged caches of every given layer, in place.

    Arguments as ``offload_blocks``; ``block_mapping`` pairs are ``(host slot, device block)`` (a
    ``BlockManager``'s ``take_loads()``), device blocks distinct. On a GPU, loading one layer at a time
    (``first_layer=l`` with that layer's caches) on a side stream lets layer ``l + 1`` arrive while layer
    ``l`` computes.
    """
    _ops.load_blocks(host_cache, key_caches, value_caches, block_mapping, first_layer)


def cpu_attention_isa() -> str:
    """The copy of the CPU attention kernels that runs on this machine: "amx", "avx512", "avx2" (x86-64),
    "neon_bf16", "sve", "neon" (aarch64) or "baseline" (the portable copy, any CPU), chosen at run time from
    what the CPU has."""
    return _ops_library.cpu_attention_isa()


# ---------------------------------------------------------------------------------------------------
# Model-layer ops: the glue of a Llama-family decoder layer, one kernel each (fp32 math, rounded to
# the tensor's dtype where Hugging Face's Llama rounds). They exist because at decode batch sizes a
# chain of small ATen ops costs more than the matrix multiplies around it.

def rms_norm(input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``weight * input / sqrt(mean(input ** 2, -1) + epsilon)`` over the last dimension (a new tensor).

    ``input`` ``[..., hidden]``, ``weight`` ``[hidden]`` of input's dtype.
    """
    return _ops.rms_norm(input, weight, epsilon)


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """In place: ``residual += input``, then ``input = rms_norm(residual, weight, epsilon)``.

    The pre-norm residual stream of a decoder layer in one pass. ``input`` and ``residual`` are
    contiguous, same shape and dtype, and share no memory with each other or with ``weight``: passing
    one tensor as both raises a ``RuntimeError`` saying they are the same tensor.

    Example::

        residual = h.clone()
        for layer in layers:            # h: this layer's output, residual: the running sum
            fused_add_rms_norm(h, residual, norm.weight, 1e-6)
    """
    _ops.fused_add_rms_norm(input, residual, weight, epsilon)


def silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(input[..., :d]) * input[..., d:]`` for ``input`` ``[..., 2 * d]`` (gate then up)."""
    return _ops.silu_and_mul(input)


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotates ``x`` in place by each token's position (half-split RoPE, as GPT-NeoX / HF Llama).

    Args:
        positions: ``[T]`` int64.
        x: ``[T, num_heads, head_dim]`` with a contiguous ``head_dim`` (other strides free, so the
            query and key parts of a fused QKV projection can be rotated in one call), no two elements
            in the same memory (not an ``expand``-ed view), sharing no memory with the other arguments.
            Rounded where HF's Llama rounds: ``x * cos`` and ``rotate_half(x) * sin`` each in x's dtype
            (cos / sin cast to it first), then their sum.
        cos_sin_cache: ``[max_position, head_dim]``: ``cos`` of the ``head_dim / 2`` frequencies, then
            their ``sin``; any float dtype, values used as stored. On CPU a position outside
            ``[0, max_position)`` raises before anything is written; CUDA kernels cannot raise and
            leave such tokens unrotated.
    """
    _ops.rotary_embedding(positions, x, cos_sin_cache)


# ---------------------------------------------------------------------------------------------------
# MLA (multi-head latent attention: DeepSeek V2/V3, Kimi K2). One latent cache per layer,
# ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (e.g. 512 + 64 = 576): row ``slot`` holds the
# token's normalised latent ``kv_c`` then its rope key ``k_pe``, one "head", no separate V. Same slots,
# block tables and block manager as the K/V caches. Layout and mapping to vLLM / FlashInfer: docs/reference.md.

def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         kv_cache_dtype: str = "auto", scale: torch.Tensor | None = None) -> None:
    """Writes each token's latent and rope key into its latent cache row, in place (vLLM's op of that name).

    The signature is vLLM's ``concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
    scale)`` (``torch.ops._C_cache_ops``), so a vLLM call site works unchanged, with its last two arguments
    optional: ``kv_cache_dtype`` defaults to ``"auto"`` and ``scale`` to None (1).

    Args:
        kv_c: ``[T, kv_lora_rank]``, any strides (e.g. a slice of the fused down-projection's output).
        k_pe: ``[T, rope_dim]``, any strides (e.g. ``k_pe.squeeze(1)`` of a ``[T, 1, rope_dim]`` tensor);
            kv_c's dtype.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, any strides on the first two
            dimensions and contiguous rows; kv_c's dtype, or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``
            (then each element is stored as ``fp8(x / scale)``, saturated and rounded to nearest even, as
            :func:`reshape_and_cache` stores them). vLLM allocates its float8 caches as uint8: pass
            ``kv_cache.view(torch.float8_e4m3fn)``; a uint8 cache raises.
        slot_mapping: ``[T]`` int32 or int64; token ``t`` goes to slot ``slot_mapping[t]`` (row
            ``slot % block_size`` of block ``slot // block_size``); a negative slot is padding, skipped. On
            CPU an out-of-range slot or a slot given twice raises before anything is written; CUDA kernels
            cannot raise and skip out-of-range slots (reported under ``PAGEDKV_CHECK_INDICES=1``).
        kv_cache_dtype: ``"auto"`` (the format is kv_cache's dtype), or vLLM's names ``"fp8"`` /
            ``"fp8_e4m3"`` (kv_cache must be float8_e4m3fn) and ``"fp8_e5m2"`` (float8_e5m2).
        scale: float8 caches: a float32 tensor of shape ``[]`` or ``[1]`` on the inputs' device (None means
            1; on CPU finite and > 0). Ignored by 16/32-bit caches, as in vLLM (which passes its layer's
            ``_k_scale`` whatever the cache dtype).

    Example::

        kv_cache = torch.empty(num_blocks, 16, 512 + 64, dtype=torch.bfloat16)
        concat_and_cache_mla(kv_c, k_pe.squeeze(1), kv_cache, slots)          # kv_c [T, 512], k_pe [T, 1, 64]
    """
    _ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)


def paged_attention_mla(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, kv_lora_rank: int, *,
                        kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal MLA attention in absorbed form over a paged latent cache (decode and prefill in one batch).

    Each query head attends with its absorbed query (``q_nope @ W_UK`` then ``q_pe``) to the latent rows:
    the logit is ``scale * query . row`` over the whole row (latent and rope parts: K), the output the
    softmax-weighted sum of the rows' first ``kv_lora_rank`` elements (the latent: V, read from the same
    bytes). Multiply the output by ``W_UV`` per head for the attention's value.

    Args:
        query: ``[T, num_heads, kv_lora_rank + rope_dim]`` packed over ``B`` sequences, fp32 / fp16 / bf16.
        kv_cache: the latent cache of :func:`concat_and_cache_mla` (query's dtype or float8), read in place.
        block_tables, seq_lens, query_start_loc: as :func:`paged_attention` (int32; entries past a
            sequence's length are never read; ``seq_lens`` counts this step's tokens, already written).
        scale: multiplies ``q . k``; finite and > 0. For DeepSeek V3: ``(qk_nope_head_dim +
            qk_rope_head_dim) ** -0.5`` = ``192 ** -0.5`` (times the YaRN mscale factor squared, if used).
        kv_lora_rank: the latent's width (512 for DeepSeek V2/V3 and Kimi K2): the V part of each row.
        kv_scale: float8 caches only, the scale they were written with: float32 ``[]`` or ``[1]`` on
            query's device; None means 1 (K and V are the same bytes, so one scale).

    Masking is causal and bottom-right aligned as in :func:`paged_attention`: query ``j`` of a sequence with
    ``q_len`` queries sits at position ``seq_lens[b] - q_len + j`` and reads rows ``0..`` that position
    only; no other cache row is read.

    Returns:
        ``[T, num_heads, kv_lora_rank]``, query's dtype, contiguous.

    Example::

        out = paged_attention_mla(q, kv_cache, block_tables, seq_lens, qsl, 192 ** -0.5, 512)
    """
    return _ops.paged_attention_mla(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, kv_lora_rank,
                                    kv_scale=kv_scale)


def paged_attention_mla_with_lse(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                                 kv_lora_rank: int, *,
                                 kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`paged_attention_mla`, and also returns the log-sum-exp of each query row's logits.

    Returns:
        ``(out, lse)``: ``out`` as in :func:`paged_attention_mla`; ``lse`` ``[T, num_heads]`` float32, as
        in :func:`paged_attention_with_lse` (natural log; ``-inf`` when no row is visible), so partial
        results over disjoint key sets merge the same way.
    """
    return _ops.paged_attention_mla_with_lse(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                                             kv_lora_rank, kv_scale=kv_scale)


# ---------------------------------------------------------------------------------------------------
# Fake (meta) kernels: shapes only, for torch.compile and FakeTensor tracing.

def _check_not_mixed_with_meta(op: str, **tensors) -> None:
    """A real meta tensor next to CPU / CUDA ones routes the call here, to a kernel that computes and
    writes nothing: refuse instead. (FakeTensors report the device they stand for, never meta.)"""
    flat: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors.items():
        if t is None:              # an optional tensor not given
            continue
        if isinstance(t, (list, tuple)):
            flat.extend((f"{name}[{i}]", x) for i, x in enumerate(t))
        else:
            flat.append((name, t))
    meta = next((name for name, t in flat if t.device.type == "meta"), None)
    real = next(((name, t.device) for name, t in flat if t.device.type != "meta"), None)
    if meta is not None and real is not None:
        raise RuntimeError(f"pagedkv.{op}: {meta} is on meta but {real[0]} is on {real[1]}; the ops run on CPU "
                           f"and CUDA tensors (meta only when every tensor is meta)")


def _check_not_the_same_tensor(op: str, written: str, a: torch.Tensor, other: str, b: torch.Tensor) -> None:
    """The kernels' check, for the fake (meta) path too: one tensor passed as two arguments."""
    if a is b:
        raise RuntimeError(f"pagedkv.{op}: {written} and {other} are the same tensor (they share memory); "
                           f"{written} is written in place while {other} is read, so pass two distinct tensors "
                           "(clone one)")


@torch.library.register_fake("pagedkv::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    _check_not_mixed_with_meta("reshape_and_cache", key=key, value=value, key_cache=key_cache,
                               value_cache=value_cache, slot_mapping=slot_mapping)
    _check_not_the_same_tensor("reshape_and_cache", "value_cache", value_cache, "key_cache", key_cache)
    return None


@torch.library.register_fake("pagedkv::paged_attention")
def _paged_attention_fake(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                          max_seq_len=-1, sliding_window=-1, softcap=0.0, k_scale=None, v_scale=None, sinks=None):
    _check_not_mixed_with_meta("paged_attention", query=query, key_cache=key_cache, value_cache=value_cache,
                               block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
                               sinks=sinks)
    return query.new_empty(query.shape)


@torch.library.register_fake("pagedkv::paged_attention_with_lse")
def _paged_attention_with_lse_fake(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                   *, max_seq_len=-1, sliding_window=-1, softcap=0.0, k_scale=None,
                                   v_scale=None, sinks=None):
    _check_not_mixed_with_meta("paged_attention_with_lse", query=query, key_cache=key_cache,
                               value_cache=value_cache, block_tables=block_tables, seq_lens=seq_lens,
                               query_start_loc=query_start_loc, sinks=sinks)
    return query.new_empty(query.shape), query.new_empty(query.shape[:2], dtype=torch.float32)


@torch.library.register_fake("pagedkv::copy_blocks")
def _copy_blocks_fake(key_caches, value_caches, block_mapping):
    _check_not_mixed_with_meta("copy_blocks", key_caches=key_caches, value_caches=value_caches,
                               block_mapping=block_mapping)
    return None


@torch.library.register_fake("pagedkv::swap_blocks")
def _swap_blocks_fake(src, dst, block_mapping):
    _check_not_mixed_with_meta("swap_blocks", src=src, dst=dst)  # block_mapping always lives on the CPU
    return None


@torch.library.register_fake("pagedkv::offload_blocks")
def _offload_blocks_fake(key_caches, value_caches, host_cache, block_mapping, first_layer=0):
    _check_not_mixed_with_meta("offload_blocks", key_caches=key_caches, value_caches=value_caches,
                               host_cache=host_cache)
    return None


@torch.library.register_fake("pagedkv::load_blocks")
def _load_blocks_fake(host_cache, key_caches, value_caches, block_mapping, first_layer=0):
    _check_not_mixed_with_meta("load_blocks", key_caches=key_caches, value_caches=value_caches,
                               host_cache=host_cache)
    return None


@torch.library.register_fake("pagedkv::rms_norm")
def _rms_norm_fake(input, weight, epsilon):
    _check_not_mixed_with_meta("rms_norm", input=input, weight=weight)
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.register_fake("pagedkv::fused_add_rms_norm")
def _fused_add_rms_norm_fake(input, residual, weight, epsilon):
    _check_not_mixed_with_meta("fused_add_rms_norm", input=input, residual=residual, weight=weight)
    _check_not_the_same_tensor("fused_add_rms_norm", "input", input, "residual", residual)
    return None


@torch.library.register_fake("pagedkv::silu_and_mul")
def _silu_and_mul_fake(input):
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


@torch.library.register_fake("pagedkv::rotary_embedding")
def _rotary_embedding_fake(positions, x, cos_sin_cache):
    _check_not_mixed_with_meta("rotary_embedding", positions=positions, x=x, cos_sin_cache=cos_sin_cache)
    return None


@torch.library.register_fake("pagedkv::concat_and_cache_mla")
def _concat_and_cache_mla_fake(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype="auto", scale=None):
    _check_not_mixed_with_meta("concat_and_cache_mla", kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache,
                               slot_mapping=slot_mapping)
    _check_not_the_same_tensor("concat_and_cache_mla", "kv_cache", kv_cache, "kv_c", kv_c)
    return None


def _paged_attention_mla_shape(op, query, kv_cache, block_tables, seq_lens, query_start_loc, kv_lora_rank):
    _check_not_mixed_with_meta(op, query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens,
                               query_start_loc=query_start_loc)
    if query.dim() != 3 or kv_cache.dim() != 3 or not 0 < kv_lora_rank <= kv_cache.shape[2]:
        raise RuntimeError(f"pagedkv.{op}: query must be [num_tokens, num_heads, kv_lora_rank + rope_dim] and "
                           f"kv_cache [num_blocks, block_size, kv_lora_rank + rope_dim] with 0 < kv_lora_rank <= "
                           f"the row width, got shapes {tuple(query.shape)}, {tuple(kv_cache.shape)} and "
                           f"kv_lora_rank {kv_lora_rank}")
    return (query.shape[0], query.shape[1], kv_lora_rank)


@torch.library.register_fake("pagedkv::paged_attention_mla")
def _paged_attention_mla_fake(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, kv_lora_rank, *,
                              kv_scale=None):
    shape = _paged_attention_mla_shape("paged_attention_mla", query, kv_cache, block_tables, seq_lens,
                                       query_start_loc, kv_lora_rank)
    return query.new_empty(shape)


@torch.library.register_fake("pagedkv::paged_attention_mla_with_lse")
def _paged_attention_mla_with_lse_fake(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                                       kv_lora_rank, *, kv_scale=None):
    shape = _paged_attention_mla_shape("paged_attention_mla_with_lse", query, kv_cache, block_tables, seq_lens,
                                       query_start_loc, kv_lora_rank)
    return query.new_empty(shape), query.new_empty(shape[:2], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------
# int4 KV: uint8 caches [num_blocks, block_size, num_kv_heads, head_dim // 2 + 4 * (head_dim // group_size)].
# A row holds head_dim 4-bit codes (element 2i in the low nibble of byte i), then per group of group_size
# elements its fp16 step and fp16 minimum; element x of a group reads back as code * step + minimum, where
# step = fp16((max - min) / 15), minimum = fp16(min) and code = clamp(round_half_even((x - minimum) / step), 0, 15).


def reshape_and_cache_int4(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor, group_size: int) -> None:
    """Quantises this step's keys and values ``[T, num_kv_heads, head_dim]`` (float32 / float16 / bfloat16,
    any strides) into their slots of two int4 caches (uint8, rows as above; any block, token and head strides,
    rows contiguous), in place. ``group_size`` is even and divides ``head_dim``. Slots as
    :func:`reshape_and_cache` takes them (negative: padding, skipped)."""
    _ops.reshape_and_cache_int4(key, value, key_cache, value_cache, slot_mapping, group_size)


def paged_attention_int4(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         scale: float, group_size: int, *, max_seq_len: int = -1, sliding_window: int = -1,
                         softcap: float = 0.0) -> torch.Tensor:
    """:func:`paged_attention` over int4 caches written by :func:`reshape_and_cache_int4` with the same
    ``group_size``: each visible key and value row is read back as ``code * step + minimum`` in float32;
    queries and output in query's dtype (GQA, sliding window and softcap as there)."""
    return _ops.paged_attention_int4(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                     group_size, max_seq_len=max_seq_len, sliding_window=sliding_window,
                                     softcap=softcap)


def paged_attention_int4_with_lse(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                  query_start_loc: torch.Tensor, scale: float, group_size: int, *,
                                  max_seq_len: int = -1, sliding_window: int = -1,
                                  softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention_int4` and each row's natural-log log-sum-exp ``[T, num_q_heads]`` float32
    (as :func:`paged_attention_with_lse`), so partial attentions over disjoint keys merge exactly."""
    return _ops.paged_attention_int4_with_lse(query, key_cache, value_cache, block_tables, seq_lens,
                                              query_start_loc, scale, group_size, max_seq_len=max_seq_len,
                                              sliding_window=sliding_window, softcap=softcap)


def int4_kv_dequantize(rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """int4 rows ``[..., row_bytes]`` (uint8) -> their float32 values ``[..., head_dim]`` (plain torch)."""
    head_dim = 2 * rows.shape[-1] * group_size // (group_size + 8)     # row_bytes = D / 2 + 4 D / group_size
    groups = head_dim // group_size
    codes = rows[..., :head_dim // 2]
    codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).float()
    meta = rows[..., head_dim // 2:].contiguous().view(torch.float16).float().unflatten(-1, (groups, 2))
    step, low = meta[..., :1], meta[..., 1:]
    return (codes.unflatten(-1, (groups, group_size)) * step + low).flatten(-2)


def _int4_fake_checks(op, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc):
    _check_not_mixed_with_meta(op, query=query, key_cache=key_cache, value_cache=value_cache,
                               block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)


@torch.library.register_fake("pagedkv::reshape_and_cache_int4")
def _reshape_and_cache_int4_fake(key, value, key_cache, value_cache, slot_mapping, group_size):
    _check_not_mixed_with_meta("reshape_and_cache_int4", key=key, value=value, key_cache=key_cache,
                               value_cache=value_cache, slot_mapping=slot_mapping)
    _check_not_the_same_tensor("reshape_and_cache_int4", "value_cache", value_cache, "key_cache", key_cache)
    return None


@torch.library.register_fake("pagedkv::paged_attention_int4")
def _paged_attention_int4_fake(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                               group_size, *, max_seq_len=-1, sliding_window=-1, softcap=0.0):
    _int4_fake_checks("paged_attention_int4", query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    return query.new_empty(query.shape)


@torch.library.register_fake("pagedkv::paged_attention_int4_with_lse")
def _paged_attention_int4_with_lse_fake(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                        scale, group_size, *, max_seq_len=-1, sliding_window=-1, softcap=0.0):
    _int4_fake_checks("paged_attention_int4_with_lse", query, key_cache, value_cache, block_tables, seq_lens,
                      query_start_loc)
    return query.new_empty(query.shape), query.new_empty(query.shape[:2], dtype=torch.float32)
