"""Configuration: the model's shape (read from a Hugging Face config.json) and the engine's knobs."""
import json
import os
from dataclasses import dataclass, field

import torch


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None      # {"rope_type": "llama3" | "linear", ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: torch.dtype = torch.float32     # the checkpoint's dtype

    @classmethod
    def from_dict(cls, hf: dict) -> "ModelConfig":
        # transformers >= 5 writes rope_parameters (theta inside); older configs use rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = hf.get("eos_token_id")
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            dtype=getattr(torch, dtype),
        )

    @classmethod
    def from_pretrained(cls, model_path: str) -> "ModelConfig":
        with open(os.path.join(model_path, "config.json")) as f:
            return cls.from_dict(json.load(f))


@dataclass
class EngineConfig:
    device: str = "cpu"
    dtype: torch.dtype | None = None          # None: float32 on CPU, the checkpoint's dtype on CUDA
    block_size: int = 16
    num_blocks: int | None = None             # None: sized from kv_cache_bytes / gpu_memory_utilization
    num_cpu_blocks: int = 0                   # > 0 enables preemption by swap
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    kv_cache_bytes: int = 256 << 20           # CPU budget when num_blocks is None
    gpu_memory_utilization: float = 0.5       # fraction of free GPU memory for the KV cache
