"""Qwen3 (dense): the Llama decoder with an RMSNorm over every query and key head (head_dim wide, one weight
shared by the heads) before rope, and an explicit head_dim."""
from ..config import ModelConfig
from .layers import Attention, DecoderLayer, RMSNorm
from .llama import LlamaForCausalLM, LlamaModel


class Qwen3Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, tp=None):
        super().__init__(cfg, layer, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, positions, x, rope):
        qkv = self.qkv_proj.forward(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        # Normalised heads written back into the step's buffer, so rope rotates Q and K in one call.
        q.copy_(self.q_norm.forward(q.reshape(-1, self.head_dim)).view_as(q))
        k.copy_(self.k_norm.forward(k.reshape(-1, self.head_dim)).view_as(k))
        rope.forward(positions, qk)
        return qk, v


class Qwen3DecoderLayer(DecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
