"""Configuration: the model's shape (read from a Hugging Face config.json, refusing what the engine
cannot run exactly) and the engine's knobs (checked when made)."""
import json
import math
import os
from dataclasses import dataclass, field

import torch

from pagedkv.cache import kv_cache_groups
from pagedkv.validation import check_bool, check_float, check_int

from .kv.quant import check_kv_cache_dtype, check_kv_scale
from .models.registry import ARCHITECTURES, Architecture
from .serving.speculative import check_speculative

INT32_MAX = 2**31 - 1        # the block manager counts blocks and tokens per block in int32
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_KEYS = {"default": set(), "linear": {"factor"},
             "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
             "yarn": {"factor", "original_max_position_embeddings"}}


def parse_dtype(dtype, name: str = "dtype") -> torch.dtype | None:
    """None, a torch float dtype the ops support, or its name ("float32", "float16", "bfloat16")."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"{name} must be one of {sorted(DTYPES)} or a torch.dtype, got {dtype!r}")
        return DTYPES[dtype]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype or one of {sorted(DTYPES)}, got {dtype!r}")
    if dtype not in DTYPES.values():
        raise ValueError(f"{name} must be one of torch.float32, torch.float16, torch.bfloat16, got {dtype}")
    return dtype


def parse_device(device) -> torch.device:
    """A torch.device or its string ("cpu", "cuda", "cuda:1", ...): CPU, or CUDA when it is available."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available (device='cpu' runs on the CPU)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


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
    architecture: str = "LlamaForCausalLM"  # a key of ARCHITECTURES
    hidden_act: str = "silu"               # the MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    layer_windows: tuple | None = None     # per layer: its sliding window in tokens, None for full attention
                                           # (None: every layer full)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None   # attention scale query_pre_attn_scalar ** -0.5 (else head_dim)
    sliding_rope: tuple | None = None      # (rope_theta, rope_scaling) of the windowed layers where they have
                                           # their own (Gemma 3); None: every layer's rope is the one above
    extra: dict = field(default_factory=dict)   # the architecture's own config.json fields its model module
                                                # reads (Architecture.extra: experts, routing, ...)
    latent_cache: tuple | None = None      # MLA: (kv_lora_rank, qk_rope_head_dim), each layer's cache one latent
                                           # row per token of their sum; None: a key and a value cache per layer

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window in tokens (a query sees itself and the window - 1 tokens before
        it), or None for full attention."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    @property
    def kv_cache_groups(self) -> tuple[list, list[tuple[int, int]]]:
        """pagedkv.kv_cache_groups of the layers' windows: the KV cache's groups of layers (full attention
        first, then each window, smallest first; one group for Llama ([None]) and Mistral ([window])), and
        each layer's (group, index among the group's layers)."""
        return kv_cache_groups([self.window(i) for i in range(self.num_layers)])

    @property
    def group_windows(self) -> list:
        """The window of each KV group (None: full attention)."""
        return self.kv_cache_groups[0]

    @property
    def layer_groups(self) -> list[int]:
        """Each layer's index into group_windows."""
        return [g for g, _ in self.kv_cache_groups[1]]

    @property
    def layer_cache_slots(self) -> list[int]:
        """Each layer's KV cache tensor: layer i of every group shares tensor i (a block id belongs to one
        group at a time, so its bytes serve whichever group holds it); max layers per group tensors."""
        return [index for _, index in self.kv_cache_groups[1]]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_dict(cls, hf: dict, generation: dict | None = None) -> "ModelConfig":
        """From config.json (and generation_config.json, whose eos_token_id wins as in transformers).
        Raises ValueError naming the field for anything the engine would not run exactly."""
        architecture = _check_architecture(hf)
        arch = ARCHITECTURES[architecture]
        for name, default in arch.fixed.items():
            if hf.get(name) is not None and hf[name] != default:
                raise ValueError(f"config.json: {name}={hf[name]!r} is not supported (the engine runs "
                                 f"{name}={default!r} only for {architecture})")
        _check_quantization(hf, arch)
        hf = {**arch.defaults, **hf}

        def need(name):
            if name not in hf:
                raise ValueError(f"config.json lacks {name!r}")
            return hf[name]

        def positive(name, value):
            try:
                return check_int(f"config.json {name}", value, minimum=1)
            except TypeError as e:
                raise ValueError(str(e)) from None

        num_heads = positive("num_attention_heads", need("num_attention_heads"))
        hidden = positive("hidden_size", need("hidden_size"))
        num_kv_heads = positive("num_key_value_heads", hf.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"config.json: num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        latent_cache = None
        if arch.latent_cache:      # MLA: rope turns the rope part of each head only (transformers' head_dim)
            latent_cache = (positive("kv_lora_rank", hf.get("kv_lora_rank")),
                            positive("qk_rope_head_dim", hf.get("qk_rope_head_dim")))
            head_dim = latent_cache[1]
        else:
            head_dim = positive("head_dim", hf.get("head_dim") or hidden // num_heads)
        max_pos = positive("max_position_embeddings", hf.get("max_position_embeddings", 2048))
        if max_pos < 2:
            raise ValueError(f"config.json: max_position_embeddings must be >= 2, got {max_pos}")
        theta, rope_scaling, sliding_rope = _rope(hf, arch)
        eps = hf.get("rms_norm_eps", 1e-6)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"config.json: rms_norm_eps must be a positive number, got {eps!r}")
        flags = {}
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            if not isinstance(hf.get(name, False), bool):
                raise ValueError(f"config.json: {name} must be true or false, got {hf[name]!r}")
            flags[name] = hf.get(name, False)
        eos_source = generation if generation and "eos_token_id" in generation else hf
        eos = eos_source.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
        if not isinstance(eos, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in eos):
            raise ValueError(f"{'generation_config.json' if eos_source is generation else 'config.json'}: eos_token_id "
                             f"must be an int or a list of ints, got {eos_source['eos_token_id']!r}")
        dtype_name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        if dtype_name not in DTYPES:
            raise ValueError(f"config.json: dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
        num_layers = positive("num_hidden_layers", need("num_hidden_layers"))
        return cls(
            vocab_size=positive("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=positive("intermediate_size", need("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(eps),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            eos_token_ids=list(eos),
            dtype=DTYPES[dtype_name],
            architecture=architecture,
            hidden_act=arch.activation,
            layer_windows=_layer_windows(hf, arch, num_layers),
            sliding_rope=sliding_rope,
            extra={name: hf[name] for name in arch.extra if name in hf},
            latent_cache=latent_cache,
            **_architecture_numbers(hf, arch),
            **flags,
        )

    @classmethod
    def from_pretrained(cls, model_path: str) -> "ModelConfig":
        generation_path = os.path.join(model_path, "generation_config.json")
        generation = _read_json(generation_path) if os.path.exists(generation_path) else None
        config_path = os.path.join(model_path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"model_path {model_path!r} has no config.json (a Hugging Face checkpoint "
                                    "directory holds config.json and *.safetensors)")
        return cls.from_dict(_read_json(config_path), generation)


def _read_json(path: str) -> dict:
    with open(path) as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _check_architecture(hf: dict) -> str:
    """The ARCHITECTURES key config.json names (by `architectures`, or by `model_type` alone)."""
    archs, model_type = hf.get("architectures"), hf.get("model_type")
    known = ", ".join(ARCHITECTURES)
    if archs is None and model_type is None:
        raise ValueError(f"config.json names neither architectures nor model_type ({known} expected)")
    if archs is not None:
        if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in ARCHITECTURES):
            raise ValueError(f"config.json: architectures={archs!r} is not supported (one of {known})")
        architecture = archs[0]
    else:
        architecture = next((a for a, spec in ARCHITECTURES.items() if spec.model_type == model_type), None)
        if architecture is None:
            raise ValueError(f"config.json: model_type={model_type!r} is not supported "
                             f"({', '.join(a.model_type for a in ARCHITECTURES.values())} are)")
    expected = ARCHITECTURES[architecture].model_type
    if model_type is not None and model_type != expected:
        raise ValueError(f"config.json: model_type={model_type!r} does not match architectures={archs!r} "
                         f"(model_type {expected!r} expected)")
    return architecture


def _check_quantization(hf: dict, arch: Architecture) -> None:
    """An architecture whose fixed fields leave quantization_config free (gpt-oss) may carry MXFP4 weights,
    dequantised at load; no other scheme."""
    quant = hf.get("quantization_config")
    if quant is None or "quantization_config" in arch.fixed:
        return
    if not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4":
        raise ValueError(f"config.json: quantization_config={quant!r} is not supported (MXFP4 weights are: "
                         f"quant_method 'mxfp4', dequantised at load)")


def _positive_number(name: str, value, integer: bool = False):
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"config.json: {name} must be a positive {'integer' if integer else 'number'} or "
                         f"null, got {value!r}")
    return value


def _layer_windows(hf: dict, arch: Architecture, num_layers: int) -> tuple | None:
    """Each layer's window: every layer's for Mistral, per `layer_types` for Gemma 2 (default: even layers
    sliding, odd ones full, as transformers); None when no layer has one."""
    if "sliding_window" not in arch.read or hf.get("sliding_window") is None:
        return None
    window = _positive_number("sliding_window", hf["sliding_window"], integer=True)
    if "layer_types" not in arch.read:
        return (window,) * num_layers
    types = hf.get("layer_types")
    if types is None:    # transformers' default: every `global_every`-th layer full, the others sliding
        types = [LAYER_TYPES[0 if (i + 1) % arch.global_every == 0 else 1] for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"config.json: layer_types must list {num_layers} of {LAYER_TYPES} (one per layer), "
                         f"got {types!r}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(windows) else None


def _architecture_numbers(hf: dict, arch: Architecture) -> dict:
    """Softcaps and the attention scale's query_pre_attn_scalar, where the architecture has them."""
    out = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        if name not in arch.read:
            continue
        if hf.get(name) is not None:
            out[name] = float(_positive_number(name, hf[name]))
        elif name == "query_pre_attn_scalar":     # transformers' Gemma 2 has no scale without it
            raise ValueError("config.json: query_pre_attn_scalar must be a positive number, got None")
    return out


def _rope(hf: dict, arch: Architecture) -> tuple[float, dict | None, tuple | None]:
    """(rope_theta, rope_scaling) of the full-attention layers, and those of the sliding ones where they
    differ (Gemma 3: rope_parameters keyed by layer type, or rope_local_base_freq in older configs)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params and set(params) <= set(LAYER_TYPES):
        if "layer_types" not in arch.read:
            raise ValueError(f"config.json: rope_parameters per layer type are not supported for {hf['architectures']}")
        full = _rope_of(params.get("full_attention") or {}, hf)
        return (*full, _rope_of(params["sliding_attention"], hf) if "sliding_attention" in params else None)
    full = _rope_of(dict(params or hf.get("rope_scaling") or {}), hf)
    local = hf.get("rope_local_base_freq") if "rope_local_base_freq" in arch.read else None
    return (*full, None if local is None else _rope_of({"rope_theta": local}, hf))


def _rope_of(rope: dict, hf: dict) -> tuple[float, dict | None]:
    # transformers >= 5 writes rope_parameters (theta inside); older configs use rope_theta + rope_scaling.
    rope = dict(rope)
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in ROPE_KEYS:
        raise ValueError(f"config.json: rope_type {rope_type!r} is not supported ({', '.join(ROPE_KEYS)} are)")
    missing = ROPE_KEYS[rope_type] - rope.keys()
    if missing:
        raise ValueError(f"config.json: rope_type {rope_type!r} needs {sorted(missing)}")
    if rope.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ValueError(f"config.json: partial_rotary_factor={rope['partial_rotary_factor']!r} is not "
                         f"supported (the engine rotates whole heads)")
    return float(theta), None if rope_type == "default" else {**rope, "rope_type": rope_type}


@dataclass
class EngineConfig:
    """The engine's knobs; each is checked here (TypeError/ValueError naming it)."""
    device: torch.device | str = "cpu"
    dtype: torch.dtype | str | None = None    # None: float32 on CPU, the checkpoint's dtype on CUDA
    block_size: int = 16
    num_blocks: int | None = None             # None: sized from kv_cache_bytes / gpu_memory_utilization
    num_cpu_blocks: int = 0                   # > 0 enables preemption by swap
    host_cache_bytes: int = 0                 # > 0: the prefix cache keeps evicted blocks in host memory
    disk_cache_dir: str | None = None         # with disk_cache_bytes > 0: host entries evicted go to disk here
    disk_cache_bytes: int = 0
    disk_cache_persist: bool = False          # keep the records in a named file and restore them at start
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    kv_cache_bytes: int = 256 << 20           # CPU budget when num_blocks is None
    gpu_memory_utilization: float = 0.5       # fraction of free GPU memory for the KV cache
    tensor_parallel_size: int = 1             # > 1: the model sharded over this many processes
    distributed_backend: str | None = None    # None: nccl on CUDA, gloo on CPU
    speculative: str | None = None            # "ngram": prompt-lookup drafts (greedy and sampled requests)
    num_speculative_tokens: int = 0           # drafts per step and sequence (speculative="ngram")
    prompt_lookup_min: int = 1                # n-gram sizes the lookup tries, longest first
    prompt_lookup_max: int = 3
    kv_cache_dtype: str = "auto"              # "auto" (the model's dtype), "fp8_e4m3", "fp8_e5m2"
    kv_scale: str | float = "rotated"         # float8 KV: "rotated" (per-head rotation, then "dynamic"),
                                              # "dynamic" (per layer and KV head), or a fixed scale
    kv_recent_tokens: int = 256               # float8 KV: each query's latest N tokens read in the model's
    kv_first_block: bool = True               # dtype, and its sequence's first block (0 / False: off)

    def __post_init__(self):
        self.device = parse_device(self.device)
        self.dtype = parse_dtype(self.dtype)
        self.block_size = check_int("block_size", self.block_size, minimum=1, maximum=INT32_MAX)
        if self.num_blocks is not None:
            self.num_blocks = check_int("num_blocks", self.num_blocks, minimum=1, maximum=INT32_MAX)
        self.num_cpu_blocks = check_int("num_cpu_blocks", self.num_cpu_blocks, minimum=0, maximum=INT32_MAX)
        self.host_cache_bytes = check_int("host_cache_bytes", self.host_cache_bytes, minimum=0)
        self.enable_prefix_caching = check_bool("enable_prefix_caching", self.enable_prefix_caching)
        self.disk_cache_bytes = check_int("disk_cache_bytes", self.disk_cache_bytes, minimum=0)
        if self.disk_cache_dir is not None:
            if not isinstance(self.disk_cache_dir, (str, os.PathLike)):
                raise TypeError(f"disk_cache_dir must be a str or os.PathLike (a directory), got {self.disk_cache_dir!r}")
            self.disk_cache_dir = os.fspath(self.disk_cache_dir)
            if not os.path.isdir(self.disk_cache_dir):
                raise ValueError(f"disk_cache_dir {self.disk_cache_dir!r} is not an existing directory")
        if (self.disk_cache_dir is None) != (self.disk_cache_bytes == 0):
            raise ValueError("the disk tier needs both disk_cache_dir and disk_cache_bytes > 0 (or neither), got "
                             f"disk_cache_dir={self.disk_cache_dir!r}, disk_cache_bytes={self.disk_cache_bytes}")
        if not isinstance(self.disk_cache_persist, bool):
            raise TypeError(f"disk_cache_persist must be a bool, got {self.disk_cache_persist!r}")
        if self.disk_cache_persist and not self.disk_cache_bytes:
            raise ValueError("disk_cache_persist=True needs the disk tier (disk_cache_dir and disk_cache_bytes > 0)")
        if self.disk_cache_bytes and not self.host_cache_bytes:
            raise ValueError("disk_cache_bytes > 0 needs host_cache_bytes > 0 (disk records are written from and "
                             "read into the host tier)")
        if self.host_cache_bytes and not self.enable_prefix_caching:
            raise ValueError("host_cache_bytes > 0 needs enable_prefix_caching=True (the host tier is part of "
                             "the prefix cache)")
        self.max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        self.kv_cache_bytes = check_int("kv_cache_bytes", self.kv_cache_bytes, minimum=1)
        self.gpu_memory_utilization = check_float("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.tensor_parallel_size = check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        if self.disk_cache_bytes and self.tensor_parallel_size > 1:
            raise ValueError("disk_cache_bytes > 0 is not supported with tensor_parallel_size > 1 (each rank would "
                             "need its own disk records); use the host tier alone")
        if self.distributed_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"distributed_backend must be None, 'gloo' or 'nccl', got {self.distributed_backend!r}")
        if self.distributed_backend == "nccl" and self.device.type != "cuda":
            raise ValueError("distributed_backend='nccl' needs device='cuda'")
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)
        self.kv_scale = check_kv_scale(self.kv_scale)
        self.kv_recent_tokens = check_int("kv_recent_tokens", self.kv_recent_tokens, minimum=0, maximum=INT32_MAX)
        self.kv_first_block = check_bool("kv_first_block", self.kv_first_block)
        (self.speculative, self.num_speculative_tokens, self.prompt_lookup_min,
         self.prompt_lookup_max) = check_speculative(self.speculative, self.num_speculative_tokens,
                                                     self.prompt_lookup_min, self.prompt_lookup_max)
