"""Loads a Hugging Face Llama checkpoint (config.json + *.safetensors, sharded or not) into our model."""
import glob
import json
import os

import torch
from safetensors import safe_open

from .config import ModelConfig
from .llama import LlamaForCausalLM


def _safetensors_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    return files


def _shard_range(model, fused: str, shard: int) -> tuple[int, int]:
    """Rows of a fused projection that hold checkpoint shard `shard` (q/k/v or gate/up)."""
    cfg = model.config
    if fused == "qkv_proj":
        sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
    else:
        sizes = [cfg.intermediate_size] * 2
    start = sum(sizes[:shard])
    return start, start + sizes[shard]


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, model_path: str) -> None:
    params = dict(model.named_parameters())
    loaded = set()
    for path in _safetensors_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                tensor = f.get_tensor(name)
                for ckpt_name, (fused, shard) in model.packed_modules.items():
                    if f".{ckpt_name}." in name:
                        target = name.replace(ckpt_name, fused)
                        start, end = _shard_range(model, fused, shard)
                        params[target][start:end].copy_(tensor)
                        loaded.add(f"{target}[{shard}]")
                        break
                else:
                    if name == "lm_head.weight" and model.config.tie_word_embeddings:
                        continue
                    params[name].copy_(tensor)
                    loaded.add(name)
    _check_complete(model, params, loaded)


def _check_complete(model, params, loaded) -> None:
    missing = []
    for name in params:
        fused = next((f for f, _ in model.packed_modules.values() if f".{f}." in name), None)
        if fused is None:
            missing += [name] if name not in loaded else []
        else:
            n = 3 if fused == "qkv_proj" else 2
            missing += [f"{name}[{i}]" for i in range(n) if f"{name}[{i}]" not in loaded]
    if missing:
        raise ValueError(f"checkpoint lacks weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def load_model(model_path: str, device: str, dtype: torch.dtype | str | None = None) -> LlamaForCausalLM:
    """The checkpoint's model on `device`; dtype None means float32 on CPU, the checkpoint's on CUDA."""
    cfg = ModelConfig.from_pretrained(model_path)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    dtype = dtype or (cfg.dtype if device != "cpu" else torch.float32)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)     # parameters are created in their final dtype, on the device
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, model_path)
    return model.to(dtype).eval()
