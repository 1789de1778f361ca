"""Llama-family decoder (RMSNorm, RoPE incl. Llama-3 scaling, GQA, SwiGLU) whose attention reads and
writes the paged KV cache through torch.ops.pagedkv."""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where this step's tokens live: packed over B sequences (prefill and decode mixed)."""
    slot_mapping: torch.Tensor     # [T] int64, cache slot of each token's K/V
    block_tables: torch.Tensor     # [B, M] int32
    seq_lens: torch.Tensor         # [B] int32, KV length including this step's tokens
    query_start_loc: torch.Tensor  # [B+1] int32
    max_seq_len: int


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise NotImplementedError(f"rope_type {kind!r} is not supported (default, linear, llama3 are)")
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, scaled)
    return torch.where(wavelen < old_len / high, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """Half-split (GPT-NeoX style) rotation, as in Hugging Face Llama. With x = [x1, x2] the rotated
    vector is x * [cos, cos] + [x2, x1] * [-sin, sin]; both factors are tabulated per position and
    gathered once per step (`tables`), so each layer's rotation is three ops."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        device = torch.get_default_device()
        with torch.device("cpu"):   # the same tables on every device
            inv_freq = rope_inv_freq(cfg)
            freqs = torch.arange(cfg.max_position_embeddings).float()[:, None] * inv_freq[None, :]
            cos, sin = freqs.cos(), freqs.sin()
        self.register_buffer("cos_cos", torch.cat((cos, cos), dim=-1).to(device), persistent=False)
        self.register_buffer("neg_sin_sin", torch.cat((-sin, sin), dim=-1).to(device), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The two factors for these positions, [T, 1, D] each."""
        return (self.cos_cos[positions].unsqueeze(1).to(dtype), self.neg_sin_sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, H, D], rotated by each token's position (a new tensor)."""
        cos_cos, neg_sin_sin = tables
        t, h, d = x.shape
        swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)    # [x2, x1]
        return torch.addcmul(x * cos_cos, swapped, neg_sin_sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, rope_tables, x, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = RotaryEmbedding.apply(qk, rope_tables).split([self.num_heads, self.num_kv_heads], dim=1)
        key_cache, value_cache = kv_cache
        torch.ops.pagedkv.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.ops.pagedkv.paged_attention(q, key_cache, value_cache, meta.block_tables,
                                                meta.seq_lens, meta.query_start_loc, self.scale,
                                                max_seq_len=meta.max_seq_len)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, rope_tables, h, kv_cache, meta):
        h = h + self.self_attn(rope_tables, self.input_layernorm(h), kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, input_ids, positions, kv_caches, meta):
        """Final hidden states of the last token of every sequence: [B, hidden]."""
        h = self.embed_tokens(input_ids)
        rope_tables = self.rotary_emb.tables(positions, h.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(rope_tables, h, kv_cache, meta)
        if h.shape[0] != meta.seq_lens.shape[0]:       # some sequence has several tokens: keep the last
            h = h[meta.query_start_loc[1:].long() - 1]
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    # Checkpoint names packed into one of our fused projections: name -> (fused name, shard index).
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the last token of every sequence: [B, hidden]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()
