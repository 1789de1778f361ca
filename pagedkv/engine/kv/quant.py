"""Quantised KV caches in the engine (float8, int4): the cache dtype (`kv_cache_dtype`), each layer's K/V
scales (`kv_scale`) and the prefix-cache salt they imply.

``"int4"``: rows of ``pagedkv.ops.reshape_and_cache_int4`` with groups of INT4_GROUP_SIZE (a 4-bit code per
element, an fp16 step and minimum per group; 0.31x of bf16's bytes at head_dim 64) under the rotated rule
below (``kv_scale="rotated"``), no per-head scales; with the recent pool (kv.recent) it keeps 98% of fp32
KV's top-1 tokens on SmolLM2-135M (docs/benchmarks.md).

Scales are float32 tensors, one per KV head of the layer (of this rank's heads under tensor
parallelism), filled in place and never replaced, so a captured or compiled graph holding them stays
valid. The stored value of ``x`` is ``fp8(x / scale)`` (saturating); attention reads
``stored * scale``.

Dynamic rule (``kv_scale="dynamic"``): on a layer's first forward (the engine's first prefill),
``scale[h] = HEADROOM * amax_h / max_finite``, where ``amax_h`` is the largest finite ``|x|`` of that
step's keys (or values) of KV head ``h`` and ``max_finite`` the format's largest finite value (448
for e4m3, 57344 for e5m2): later tokens may exceed the first prompt's range by ``HEADROOM`` times
before they saturate. A head whose first values are all zero gets ``amax_h = MIN_AMAX``. The scales are
never changed afterwards (that would invalidate every cached block). ``"dynamic_tensor"`` is the same
with one scale per layer (the amax over all its heads); a float fixes every scale to it.

Rotated rule (``kv_scale="rotated"``, the default): the dynamic rule applied to keys and values turned
by a per-head rotation ``R`` (Hadamard for a power-of-two head_dim, else a fixed seeded orthogonal
matrix): the layer stores ``k R`` and ``v R``, attends with ``q R`` (``q R . k R = q . k``) and turns the
output back by ``R^T``. The rotation spreads each head's outlier channels over all of them, so one scale
fits every element and fp8's range is spent on the values, not on a few channels: on SmolLM2-135M it
takes fp8 e4m3's top-1 agreement with fp32 KV from 90.5% to 94.7% at the same bytes (docs/benchmarks.md)."""
import hashlib
import math

import torch

KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int4": torch.uint8}
INT4_GROUP_SIZE = 32      # "int4": rows of pagedkv.ops.reshape_and_cache_int4, a step and a minimum per 32 elements
DYNAMIC_MODES = ("rotated", "dynamic", "dynamic_tensor")
DEFAULT_KV_SCALE = "rotated"
HEADROOM = 2.0
MIN_AMAX = 1e-4


def check_kv_cache_dtype(kv_cache_dtype) -> str:
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def check_kv_scale(kv_scale) -> str | float:
    if isinstance(kv_scale, str):
        if kv_scale not in DYNAMIC_MODES:
            raise ValueError(f"kv_scale must be one of {list(DYNAMIC_MODES)} or a float > 0, got {kv_scale!r}")
        return kv_scale
    if isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float)):
        raise TypeError(f"kv_scale must be one of {list(DYNAMIC_MODES)} or a float > 0, got {kv_scale!r}")
    if not (math.isfinite(kv_scale) and kv_scale > 0 and math.isfinite(float(torch.tensor(kv_scale)))):
        raise ValueError(f"kv_scale must be a finite float32 > 0, got {kv_scale!r}")
    return float(kv_scale)


def kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache: the model's for "auto", else the float8 one."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def int4_group_size(head_dim: int) -> int:
    """The int4 rows' group: INT4_GROUP_SIZE, or the largest power of two dividing a head_dim it does not."""
    group = math.gcd(head_dim, INT4_GROUP_SIZE)
    if group < 2:
        raise ValueError(f"kv_cache_dtype='int4' needs an even head_dim, got {head_dim}")
    return group


def kv_cache_width(kv_cache_dtype_name: str, head_dim: int) -> int:
    """The last dimension of the cache tensors: head_dim, or the bytes of an int4 row."""
    if kv_cache_dtype_name == "int4":
        return head_dim // 2 + 4 * (head_dim // int4_group_size(head_dim))
    return head_dim


def kv_rotation(head_dim: int) -> torch.Tensor:
    """The rotated rule's orthogonal [head_dim, head_dim] float32 matrix: the normalised Sylvester
    Hadamard matrix for a power of two (symmetric), else the Q of a QR of a normal matrix seeded 0."""
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        return (h / math.sqrt(head_dim)).float()
    g = torch.Generator().manual_seed(0)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


class LayerKvScales:
    """One layer's K and V scales ([num_kv_heads] float32 on the cache's device) and whether they are
    set; `observe` sets dynamic ones from the first K/V it sees. Under the rotated rule `rotation` is its
    [head_dim, head_dim] matrix (else None): `rotate` turns this step's q, k, v, `unrotate` the output."""

    def __init__(self, num_kv_heads: int, fp8: torch.dtype, kv_scale: str | float, device, head_dim: int = 0):
        self.fp8, self.mode = fp8, kv_scale
        value = 1.0 if isinstance(kv_scale, str) else kv_scale
        self.k_scale = torch.full((num_kv_heads,), value, dtype=torch.float32, device=device)
        self.v_scale = torch.full((num_kv_heads,), value, dtype=torch.float32, device=device)
        self.fixed = not isinstance(kv_scale, str)
        self.rotation = kv_rotation(head_dim).to(device) if kv_scale == "rotated" else None
        # int4 rows carry their own per-group steps: the scales stay 1 and only the rotation applies
        self.int4_group = int4_group_size(head_dim) if fp8 == torch.uint8 else 0
        if self.int4_group:
            self.fixed = True

    def rotate(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each [T, H, head_dim] tensor times the rotation (in its dtype); unchanged without one."""
        if self.rotation is None:
            return xs
        return tuple(x @ self.rotation.to(x.dtype) for x in xs)

    def unrotate(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.rotation is None else out @ self.rotation.to(out.dtype).T

    def observe(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value: [T, num_kv_heads, head_dim] of this step. Sets dynamic float8 scales once."""
        if self.fixed or key.shape[0] == 0:
            return
        limit = torch.finfo(self.fp8).max
        for x, scale in ((key, self.k_scale), (value, self.v_scale)):
            amax = torch.nan_to_num(x.detach().float().abs(), nan=0.0, posinf=0.0).amax(dim=(0, 2))
            if self.mode == "dynamic_tensor":
                amax = amax.amax().expand_as(amax)
            scale.copy_(amax.clamp_min(MIN_AMAX) * (HEADROOM / limit))
        self.fixed = True


def attach_kv_scales(model, kv_cache_dtype_name: str, kv_scale: str | float, device) -> list[LayerKvScales]:
    """Gives each attention layer of `model` its scales (float8 caches; none for "auto")."""
    fp8 = KV_CACHE_DTYPES[kv_cache_dtype_name]
    scales = []
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.kv_scales = None if fp8 is None else LayerKvScales(attn.num_kv_heads, fp8, kv_scale, device,
                                                                attn.head_dim)
        scales.append(attn.kv_scales)
    return scales


def cache_salt(kv_cache_dtype_name: str, scales: list) -> bytes | None:
    """Prefix-cache salt of blocks written under these scales: None for "auto" (no salt), else the
    format and the scales' bytes, or a marker while dynamic ones are still unset (such blocks never
    match blocks written after the scales are set)."""
    if KV_CACHE_DTYPES[kv_cache_dtype_name] is None:
        return None
    digest = hashlib.sha256(kv_cache_dtype_name.encode())
    if any(s.rotation is not None for s in scales):
        digest.update(b"rotated")
    if not all(s.fixed for s in scales):
        return digest.hexdigest().encode() + b":unset"
    for s in scales:
        digest.update(s.k_scale.cpu().numpy().tobytes())
        digest.update(s.v_scale.cpu().numpy().tobytes())
    return digest.hexdigest().encode()
