"""Qwen3 (dense): the Llama decoder with an RMSNorm over every query and key head (head_dim wide, one weight
shared by the heads) before rope, and an explicit head_dim."""
from .layers import DecoderLayer, QKNormAttention
from .llama import LlamaForCausalLM, LlamaModel


class Qwen3DecoderLayer(DecoderLayer):
    attention_class = QKNormAttention


class Qwen3Model(LlamaModel):
    decoder_layer = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
