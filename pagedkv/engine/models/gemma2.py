"""Gemma 2 on llama.py's pieces: the same attention (per-layer sliding window, logit softcapping, scale
query_pre_attn_scalar ** -0.5), GeGLU MLP and RoPE; what differs is here: RMSNorm by (1 + weight), the
embeddings scaled by sqrt(hidden_size), a norm after attention and around the MLP, and the final logits
softcapped (LlamaForCausalLM.compute_logits reads final_logit_softcapping)."""
import torch

from pagedkv import ops

from ..config import ModelConfig
from .layers import MLP, Attention, RMSNorm
from .llama import LlamaForCausalLM, LlamaModel


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w scales by (1 + w); the gain 1 + w is kept beside the weight
    (after_loading refreshes it), so a forward costs what Llama's does. In fp32 this is transformers'
    maths; in reduced precision the gain is rounded to the dtype, where transformers multiplies in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        with torch.no_grad():
            self.weight.zero_()
        self.register_buffer("gain", torch.ones(dim), persistent=False)

    def after_loading(self) -> None:
        self.gain = (1.0 + self.weight.detach().float()).to(self.weight.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            return ops.rms_norm(x, self.gain, self.eps)
        ops.fused_add_rms_norm(x, residual, self.gain, self.eps)
        return x


class Gemma2DecoderLayer(torch.nn.Module):
    attention_class = Attention      # what a variant (gemma3.py) replaces

    def __init__(self, cfg: ModelConfig, layer: int, tp=None):
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)   # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = self.attention_class(cfg, layer, tp)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = MLP(cfg, tp)
        self.post_feedforward_layernorm = norm()

    def forward(self, positions, h, residual, rope, kv_cache, meta):
        """As llama.DecoderLayer: (h, residual) in, (h, residual) out; the residual additions are fused
        into the norm that follows them (input_layernorm of the next layer for the MLP's)."""
        if residual is None:
            residual, h = h, self.input_layernorm.forward(h)
        else:
            h = self.input_layernorm.forward(h, residual)
        h = self.post_attention_layernorm.forward(self.self_attn.forward(positions, h, rope, kv_cache, meta))
        h = self.pre_feedforward_layernorm.forward(h, residual)
        return self.post_feedforward_layernorm.forward(self.mlp.forward(h)), residual


class Gemma2Model(LlamaModel):
    decoder_layer, norm_class = Gemma2DecoderLayer, GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, tp=None):
        super().__init__(cfg, tp)
        # sqrt(hidden) rounded to the model's dtype, as transformers does (55.4256 becomes 55.5 in bf16).
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_class = Gemma2Model
