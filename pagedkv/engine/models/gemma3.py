"""Gemma 3 (text) on Gemma 2's pieces: the same decoder layer, norms and scaled embeddings, with an RMSNorm
(Gemma's, by 1 + weight) over every query and key head before rope, no softcaps by default, five local
layers per global one, and a rope of its own for the local (sliding-window) layers."""
import dataclasses

from .gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model, GemmaRMSNorm
from .layers import QKNormAttention, RotaryEmbedding


class Gemma3Attention(QKNormAttention):
    norm_class = GemmaRMSNorm


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma3Model(Gemma2Model):
    decoder_layer = Gemma3DecoderLayer

    def __init__(self, cfg, tp=None):
        super().__init__(cfg, tp)
        if cfg.sliding_rope is not None:
            theta, scaling = cfg.sliding_rope
            self.local_rotary_emb = RotaryEmbedding(dataclasses.replace(cfg, rope_theta=theta, rope_scaling=scaling))
            self.layer_ropes = [self.rotary_emb if cfg.window(i) is None else self.local_rotary_emb
                                for i in range(cfg.num_layers)]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model
