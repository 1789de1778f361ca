"""The decoder blocks every model module builds from: attention inputs (AttentionMetadata), RMSNorm,
RoPE (incl. Llama-3 scaling), attention through torch.ops.pagedkv (GQA, per-layer window, softcap), the
gated MLP, the decoder layer and the vocabulary-parallel embedding."""
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pagedkv import ops

from ..config import ModelConfig


@dataclass
class KVGroupInputs:
    """One KV group's part of a step: the cache slot of each token's K/V and each sequence's blocks."""
    slot_mapping: torch.Tensor     # [T] int64
    block_tables: torch.Tensor     # [B, M] int32


@dataclass
class AttentionMetadata:
    """Where this step's tokens live: packed over B sequences (prefill and decode mixed). `groups` holds
    each KV group's slots and block tables (one group for Llama; Gemma 2 has a full and a windowed one)."""
    seq_lens: torch.Tensor         # [B] int32, KV length including this step's tokens
    query_start_loc: torch.Tensor  # [B+1] int32
    max_seq_len: int
    groups: list[KVGroupInputs]
    logits_indices: torch.Tensor | None = None   # [R] int64: the tokens whose hidden states are returned
                                                 # (None: each sequence's last token)
    layer_loads: Any = None        # the step's host-tier loads, waited for layer by layer (model_runner.LayerLoads)
    recent: Any = None             # the float8 rule's recent-pool inputs of the step (kv.recent.RecentStepInputs)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with a residual stream, in place: residual += x, then returns norm(residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return yarn_inv_freq(inv_freq, d, cfg.rope_theta, scaling)
    if kind != "llama3":
        raise NotImplementedError(f"rope_type {kind!r} is not supported (default, linear, llama3, yarn are)")
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, scaled)
    return torch.where(wavelen < old_len / high, inv_freq, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those turning more than beta_fast times kept, with a linear ramp between."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations):   # the dimension whose frequency turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (attention_factor, or its mscale rule); 1 otherwise."""
    scaling = cfg.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(scaling["factor"], mscale) / yarn_mscale(scaling["factor"], mscale_all_dim)
    return yarn_mscale(scaling["factor"])


class RotaryEmbedding(nn.Module):
    """Half-split (GPT-NeoX style) rotation, as in Hugging Face Llama: a [max_position, head_dim] table
    of cos then sin per position, rounded to the model's dtype as HF rounds them, applied in place
    by `pagedkv.ops.rotary_embedding`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        device = torch.get_default_device()
        with torch.device("cpu"):   # the same tables on every device
            inv_freq = rope_inv_freq(cfg)
            freqs = torch.arange(cfg.max_position_embeddings).float()[:, None] * inv_freq[None, :]
            cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * rope_attention_factor(cfg)
        self.register_buffer("cos_sin_cache", cos_sin.to(device),
                             persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Rotates x [T, H, D] (head_dim contiguous) in place by each token's position."""
        ops.rotary_embedding(positions, x, self.cos_sin_cache)


class Attention(nn.Module):
    sink_logits = None      # float32 [num_heads] attention sinks (gpt-oss sets them after loading)

    def __init__(self, cfg: ModelConfig, layer: int, tp=None):
        super().__init__()
        self.tp = tp     # tensor parallel: cfg holds this rank's heads, o_proj is row-parallel
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        self.sliding_window = cfg.window(layer) or -1           # the kernels' "no window"
        self.kv_group = cfg.layer_groups[layer]                 # whose block tables and slots it uses
        self.softcap = cfg.attn_logit_softcapping or 0.0        # the kernels' "no softcap"
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.kv_scales = None   # float8 KV cache: this layer's kv_quant.LayerKvScales (set by the runner)
        self.kv_recent = None   # and its full-precision recent tokens: kv.recent.LayerRecentKV (the runner's)
        self.layer_index = layer

    def project(self, positions, x, rope):
        """This step's queries and keys ([T, H + Hkv, D], rotated) and values ([T, Hkv, D]): what a model
        changes (QK-norm, ...) to make them differently."""
        qkv = self.qkv_proj.forward(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        rope.forward(positions, qk)                  # in place: queries and keys in one call
        return qk, v

    def forward(self, positions, x, rope, kv_cache, meta: AttentionMetadata):
        group = meta.groups[self.kv_group]
        qk, v = self.project(positions, x, rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        key_cache, value_cache = kv_cache
        k_scale = v_scale = None
        quant = self.kv_scales
        if quant is not None:
            q, k, v = quant.rotate(q, k, v)          # the rotated rule (else unchanged): q.k is kept
            quant.observe(k, v)                      # dynamic scales: set by the first prefill, then fixed
            k_scale, v_scale = quant.k_scale, quant.v_scale
        torch.ops.pagedkv.reshape_and_cache(k, v, key_cache, value_cache, group.slot_mapping, k_scale, v_scale)
        if self.kv_recent is not None and meta.recent is not None:
            out = self.kv_recent.attend(q, k, v, key_cache, value_cache, k_scale, v_scale, meta.recent, self.scale,
                                        self.softcap, self.sink_logits)
        else:
            out = torch.ops.pagedkv.paged_attention(q, key_cache, value_cache, group.block_tables,
                                                    meta.seq_lens, meta.query_start_loc, self.scale,
                                                    max_seq_len=meta.max_seq_len,
                                                    sliding_window=self.sliding_window, softcap=self.softcap,
                                                    k_scale=k_scale, v_scale=v_scale, sinks=self.sink_logits)
        if quant is not None:
            out = quant.unrotate(out)
        out = self.o_proj.forward(out.reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class QKNormAttention(Attention):
    """Attention with an RMSNorm over every query and key head (one head_dim-wide weight each for the
    queries and the keys) before rope: Qwen3, Gemma 3."""
    norm_class = None       # set below: RMSNorm, or a variant (gemma2.GemmaRMSNorm)

    def __init__(self, cfg: ModelConfig, layer: int, tp=None):
        super().__init__(cfg, layer, tp)
        self.q_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, positions, x, rope):
        qkv = self.qkv_proj.forward(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        # Normalised heads written back into the step's buffer, so rope rotates Q and K in one call.
        q.copy_(self.q_norm.forward(q.reshape(-1, self.head_dim)).view_as(q))
        k.copy_(self.k_norm.forward(k.reshape(-1, self.head_dim)).view_as(k))
        rope.forward(positions, qk)
        return qk, v


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU: ``gelu_tanh(x[..., :d]) * x[..., d:]`` (gate then up), as transformers' gelu_pytorch_tanh."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = {"silu": ops.silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp=None):
        super().__init__()
        self.tp = tp     # tensor parallel: cfg holds this rank's columns, down_proj is row-parallel
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_and_mul = GATED_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        out = self.down_proj.forward(self.act_and_mul(self.gate_up_proj.forward(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    attention_class, mlp_class = Attention, MLP     # what a variant (qwen3.py, gpt_oss.py) replaces

    def __init__(self, cfg: ModelConfig, layer: int, tp=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.mlp_class(cfg, tp)

    def forward(self, positions, h, residual, rope, kv_cache, meta):
        """h: the previous layer's output (the embeddings for the first layer); residual: the stream
        before it (None for the first layer). Returns this layer's (h, residual) the same way."""
        if residual is None:
            residual, h = h, self.input_layernorm.forward(h)
        else:
            h = self.input_layernorm.forward(h, residual)
        h = self.self_attn.forward(positions, h, rope, kv_cache, meta)
        h = self.post_attention_layernorm.forward(h, residual)
        return self.mlp.forward(h), residual


QKNormAttention.norm_class = RMSNorm


class VocabParallelEmbedding(nn.Module):
    """Tensor parallel: this rank's rows of the embedding; tokens outside them embed to zero and an
    all-reduce sums the ranks' rows (exactly: every token has one non-zero term)."""

    def __init__(self, cfg: ModelConfig, tp):
        super().__init__()
        vocab = tp.shard.vocab(cfg)
        self.start, self.stop, self.tp = vocab.start, vocab.stop, tp
        self.weight = nn.Parameter(torch.zeros(tp.shard.vocab_rows(cfg), cfg.hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        h = F.embedding((input_ids - self.start).masked_fill_(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0.0))
