"""Loads a checkpoint into the model its architecture names (models.registry): a Hugging Face folder (config.json +
*.safetensors, sharded or not) or a llama-architecture GGUF file (gguf.py). Every tensor must be one the
model has, with exactly its shape, and every weight must be there."""
import glob
import json
import os

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .chat import ChatTemplate
from ..config import ModelConfig
from . import mxfp4
from .gguf import GGUFFile, is_gguf
from ..models.registry import model_class
from ..tp.shard import ZERO


FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}     # safetensors' names


class Checkpoint:
    """A model on disk: its config, its tensors under Hugging Face names, its tokenizer and chat template."""
    config: ModelConfig

    def tensors(self):
        """(name, shape, read) per stored tensor; read(index=None) gives the tensor, or its piece at
        `index` (a tuple of slices)."""
        raise NotImplementedError

    def tokenizer(self):
        """A `tokenizers.Tokenizer`, or None when the checkpoint has none."""
        raise NotImplementedError

    def chat_template(self) -> ChatTemplate | None:
        raise NotImplementedError


class SafetensorsCheckpoint(Checkpoint):
    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model_path {path!r} is neither a directory nor a .gguf file")
        self.path = path
        self.config = ModelConfig.from_pretrained(path)

    def tensors(self):
        files = _safetensors_files(self.path)
        where = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                where.update(dict.fromkeys(f.keys(), file))
        pairs = mxfp4.pair_tensors(where)         # MXFP4 experts (gpt-oss): dequantised below
        paired = {name for pair in pairs.values() for name in pair}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name in paired:
                        continue
                    stored = f.get_slice(name)
                    if stored.get_dtype() not in FLOAT_DTYPES:     # quantized or integer: unusable weights
                        raise ValueError(f"checkpoint tensor {name!r} is {stored.get_dtype()}; the engine loads "
                                         f"floating-point weights only ({', '.join(sorted(FLOAT_DTYPES))}), "
                                         f"and MXFP4 pairs (*_blocks + *_scales)")

                    def read(index=None, f=f, name=name, stored=stored):
                        return f.get_tensor(name) if index is None else stored[index]
                    yield name, tuple(stored.get_shape()), read
        for name, (blocks, scales) in sorted(pairs.items()):
            with safe_open(where[blocks], framework="pt") as f:
                shape = f.get_slice(blocks).get_shape()        # [..., rows, groups, 16]

            def read(index=None, blocks=blocks, scales=scales):
                with safe_open(where[blocks], framework="pt") as fb, safe_open(where[scales], framework="pt") as fs:
                    weight = mxfp4.dequantize(fb.get_tensor(blocks), fs.get_tensor(scales))
                return weight if index is None else weight[index]
            yield name, (*shape[:-3], shape[-2] * 32, shape[-3]), read

    def tokenizer(self):
        path = os.path.join(self.path, "tokenizer.json")
        if not os.path.exists(path):
            return None
        from tokenizers import Tokenizer
        return Tokenizer.from_file(path)

    def chat_template(self) -> ChatTemplate | None:
        return ChatTemplate.from_model_dir(self.path)


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: str):
        self.file = GGUFFile(path)
        self.config = ModelConfig.from_dict(self.file.config)

    def tensors(self):
        for name, info in tqdm(self.file.tensors.items(), desc="dequantising", unit="tensor", leave=False):
            def read(index=None, name=name):
                weight = self.file.read(name)
                return weight if index is None else weight[index]
            yield name, info.shape, read

    def tokenizer(self):
        return self.file.tokenizer()

    def chat_template(self) -> ChatTemplate | None:
        source = self.file.chat_template
        return None if source is None else ChatTemplate(source, self.file.special_tokens())


def open_checkpoint(model_path) -> Checkpoint:
    """A Hugging Face folder or a .gguf file, its config read and checked (no weight read yet)."""
    model_path = os.fspath(model_path)
    return GGUFCheckpoint(model_path) if is_gguf(model_path) else SafetensorsCheckpoint(model_path)


def _safetensors_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    # Adapters (PEFT's adapter_model.safetensors) live beside the weights but are not weights.
    files = sorted(f for f in glob.glob(os.path.join(model_path, "*.safetensors"))
                   if not os.path.basename(f).startswith("adapter_"))
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


def _target(model, params: dict, name: str) -> tuple[torch.Tensor, str]:
    """The parameter slice a checkpoint tensor fills, and the name recorded as loaded."""
    for ckpt_name, (fused, shard) in model.packed_modules.items():
        if f".{ckpt_name}." in name:
            target = name.replace(ckpt_name, fused)
            if target not in params:
                break
            start, end = _shard_range(model, fused, shard)
            return params[target][start:end], f"{target}[{shard}]"
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} is not a weight of this model (config.json: "
                         f"{model.config.num_layers} layers, attention_bias={model.config.attention_bias}, "
                         f"mlp_bias={model.config.mlp_bias}, tie_word_embeddings={model.config.tie_word_embeddings})")
    return params[name], name


@torch.no_grad()
def load_weights(model: torch.nn.Module, checkpoint: Checkpoint) -> None:
    """Under tensor parallelism (model.tp), each rank reads only its piece of every sharded tensor."""
    params = dict(model.named_parameters())
    shard = None if model.tp is None else model.tp.shard
    full_config = checkpoint.config
    loaded = set()
    for name, shape, read in checkpoint.tensors():
        if name.endswith("rotary_emb.inv_freq"):     # recomputed from the config
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if model.unused_checkpoint_tensor(name):
            continue
        target, loaded_name = _target(model, params, name)
        piece = None if shard is None else shard.piece(name, full_config)
        expected = list(target.shape)
        if isinstance(piece, tuple):           # (dim, this rank's range, full length)
            expected[piece[0]] = piece[2]
        if shape != tuple(expected):
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(shape)}, the model expects "
                             f"{expected} (from the checkpoint's config)")
        if loaded_name in loaded:
            raise ValueError(f"checkpoint tensor {name!r} appears twice")
        if piece is None:
            target.copy_(read())
        elif piece == ZERO:                    # a row-parallel bias: added once, by rank 0
            target.zero_()
        else:
            dim, rows, _ = piece
            if len(rows) < target.shape[dim]:    # the last rank's rows past the vocabulary
                target.zero_()
            index = (slice(None),) * dim + (slice(rows.start, rows.stop),)
            target.narrow(dim, 0, len(rows)).copy_(read(index))
        loaded.add(loaded_name)
    _check_complete(model, params, loaded)
    for module in model.modules():
        if hasattr(module, "after_loading"):     # values derived from weights (Gemma 2's norm gains)
            module.after_loading()


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


def load_model(checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype | None = None,
               tp=None) -> torch.nn.Module:
    """The checkpoint's model on `device` (this rank's shard of it with a TensorParallel `tp`); dtype
    None means float32 on CPU, the checkpoint's on CUDA."""
    cfg = checkpoint.config
    dtype = dtype or (cfg.dtype if device.type != "cpu" else torch.float32)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)     # parameters are created in their final dtype, on the device
    try:
        with torch.device(device):
            model = model_class(cfg.architecture)(cfg, tp)
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, checkpoint)
    return model.to(dtype).eval()
