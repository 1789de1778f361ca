"""GGUF checkpoints (llama.cpp's one-file format) of the architectures in GGUF_ARCHITECTURES (llama, qwen3,
gemma3, gpt-oss, deepseek2): the config, the tokenizer and the chat template from the file's metadata, the
weights dequantised by the `gguf` package under their Hugging Face names, with what llama.cpp's converter
changed undone. Everything is checked before any weight is read, so a bad file fails fast and clearly."""
import os
from dataclasses import dataclass, field

import numpy as np
import torch

# The tensor types this loader reads: floats and the llama.cpp block quantisations the `gguf` package
# dequantises (numpy), each turned into the engine's dtype.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4")

# llama.cpp's tensor names -> Hugging Face's (blk.N.* -> model.layers.N.*).
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's four norms a layer: llama.cpp calls the one before the MLP ffn_norm.
GEMMA_LAYER_NAMES = {**LAYER_NAMES, **QK_NORM_NAMES, "post_attention_norm": "post_attention_layernorm",
                     "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# gpt-oss: the router is ffn_gate_inp, the norm after attention post_attention_norm.
GPT_OSS_LAYER_NAMES = {**{k: v for k, v in LAYER_NAMES.items() if not k.startswith("ffn_")},
                       "post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"}
# gpt-oss's tensors whose Hugging Face form is not the stored one: "<name>.<kind>" -> (Hugging Face leaf, layout).
# The converter splits the experts' interleaved gate_up_proj [E, hidden, 2 * inter] (gate the even columns)
# into ffn_gate_exps and ffn_up_exps [E, inter, hidden] (or stacks them, gate first, as ffn_gate_up_exps) and
# stores down_proj [E, inter, hidden] transposed; `read` puts them back.
GPT_OSS_TENSORS = {
    "attn_sinks.weight": ("self_attn.sinks", "plain"),
    "ffn_down_exps.weight": ("mlp.experts.down_proj", "transpose"),
    "ffn_down_exps.bias": ("mlp.experts.down_proj_bias", "plain"),
    "ffn_gate_exps.weight": ("mlp.experts.gate_up_proj", "gate"),
    "ffn_up_exps.weight": ("mlp.experts.gate_up_proj", "up"),
    "ffn_gate_exps.bias": ("mlp.experts.gate_up_proj_bias", "gate"),
    "ffn_up_exps.bias": ("mlp.experts.gate_up_proj_bias", "up"),
    "ffn_gate_up_exps.weight": ("mlp.experts.gate_up_proj", "gate_up"),
    "ffn_gate_up_exps.bias": ("mlp.experts.gate_up_proj_bias", "gate_up"),
}

# DeepSeek V3 (llama.cpp's deepseek2): multi-head latent attention, dense leading layers, routed + shared experts.
DEEPSEEK2_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}
# The converter stacks the routed experts ([E, ...], one tensor per projection) and, for llama.cpp's absorbed
# attention, splits kv_b_proj per head into k_b (the key rows, transposed: [H, kv_lora_rank, nope]) and v_b
# ([H, v, kv_lora_rank]); `read` takes expert i out of its stack and puts kv_b_proj back together.
DEEPSEEK2_TENSORS = {
    "ffn_gate_exps.weight": ("mlp.experts.{}.gate_proj.weight", "expert"),
    "ffn_up_exps.weight": ("mlp.experts.{}.up_proj.weight", "expert"),
    "ffn_down_exps.weight": ("mlp.experts.{}.down_proj.weight", "expert"),
    "exp_probs_b.bias": ("mlp.gate.e_score_correction_bias", "plain"),
    "attn_k_b.weight": ("self_attn.kv_b_proj.weight", "gate"),
    "attn_v_b.weight": ("self_attn.kv_b_proj.weight", "up"),
}
SIGMOID_GATING = 2        # {arch}.expert_gating_func: 1 softmax, 2 sigmoid
YARN_LOG_MUL_PER_MSCALE = 0.1    # the converter writes rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim


@dataclass(frozen=True)
class GGUFArchitecture:
    """What llama.cpp's converter (convert_hf_to_gguf.py) does to one architecture, so the loader can undo
    it: the metadata keys are `<general.architecture>.*`."""
    hf_architecture: str        # config.json's architectures[0]
    model_type: str
    layer_names: dict           # blk.N.<name> -> model.layers.N.<name>
    permuted_rope: bool         # q/k rows interleaved per head (llama's converter; NEOX-rope models are not)
    norm_shift: float = 0.0     # added to every *norm.weight (Gemma's norms scale by 1 + weight; llama.cpp's by weight)
    layer_tensors: dict = field(default_factory=dict)   # "<name>.<kind>" -> (leaf, layout) stored in another form


GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", LAYER_NAMES, permuted_rope=True),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", {**LAYER_NAMES, **QK_NORM_NAMES}, permuted_rope=False),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", "gemma3_text", GEMMA_LAYER_NAMES, permuted_rope=False,
                               norm_shift=1.0),
    "gpt-oss": GGUFArchitecture("GptOssForCausalLM", "gpt_oss", GPT_OSS_LAYER_NAMES, permuted_rope=False,
                                layer_tensors=GPT_OSS_TENSORS),
    "deepseek2": GGUFArchitecture("DeepseekV3ForCausalLM", "deepseek_v3", DEEPSEEK2_LAYER_NAMES, permuted_rope=False,
                                  layer_tensors=DEEPSEEK2_TENSORS),
}
# llama.cpp runs Gemma 3's sliding-window layers with this rope base unless the file names one
# (gemma3.rope.freq_base_swa), and every sixth layer full unless gemma3.attention.sliding_window_pattern says.
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_PATTERN = 6
GEMMA3_27B_LAYERS = 62      # llama.cpp scales Gemma 3 27B's queries by (hidden / heads) ** -0.5, others by head_dim's

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as llama.cpp applies them before the byte-level BPE.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    "default": [_GPT2_SPLIT], "gpt2": [_GPT2_SPLIT],
    # Every digit its own piece first (SmolLM's own tokenizer.json: Digits(individual_digits=True)).
    "smollm": [r"\p{N}", _GPT2_SPLIT], "starcoder": [r"\p{N}", _GPT2_SPLIT], "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT], "llama3": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],     # Qwen 2 and 3: llama 3's split with single digits
}
CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4     # tokenizer.ggml.token_type values


def is_gguf(path) -> bool:
    return os.path.isfile(path) and str(path).endswith(".gguf")


@dataclass
class TensorInfo:
    gguf_name: str
    name: str                 # the Hugging Face name the engine's loader expects
    shape: tuple              # Hugging Face order: [out, in]
    qtype: str
    tensor: object            # the gguf ReaderTensor (memory-mapped); a gate/up pair's gate half
    layout: str = "plain"     # how read() makes the Hugging Face tensor: plain, transpose, gate + up, gate_up
    up: object = None         # a gate/up pair's up half (deepseek2's kv_b: k_b, then v_b)
    index: int = 0            # an expert's place in its stack


class GGUFFile:
    """One GGUF file, opened and checked: `config` (a Hugging Face config.json dict), `tensors` (name ->
    TensorInfo), the tokenizer's metadata and the chat template. Reading it maps the file; no weight is
    dequantised until `read` asks for it."""

    def __init__(self, path: str):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ImportError("reading GGUF files needs the gguf package: pip install gguf "
                              "(or pagedkv[engine])") from None
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        try:
            self.reader = GGUFReader(self.path)
        except Exception as e:      # a bad magic, a truncated header, a broken field table
            raise ValueError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
        self.metadata = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = field if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                                  "tokenizer.ggml.token_type") else field.contents()
        arch = self.metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"{self.path}: general.architecture is {arch!r}; pagedkv reads GGUF files of "
                             f"{', '.join(GGUF_ARCHITECTURES)} (llama covers Llama, Mistral, SmolLM, TinyLlama, "
                             f"... as llama.cpp tags them)")
        self.arch_name, self.arch = arch, GGUF_ARCHITECTURES[arch]
        self._stack = None          # (ReaderTensor, its values): the expert stack read last
        self.config = self._config()
        self.tensors = self._tensors(size)

    # ---- metadata ----------------------------------------------------------------------------------
    def _get(self, key: str, default=None, required: bool = True):
        full = f"{self.arch_name}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if required and default is None:
            raise ValueError(f"{self.path}: metadata lacks {full!r}")
        return default

    def _config(self) -> dict:
        if self.arch_name == "deepseek2":
            return self._deepseek2_config()
        num_heads = self._get("attention.head_count")
        if isinstance(num_heads, list):
            raise ValueError(f"{self.path}: {self.arch_name}.attention.head_count varies per layer; not supported")
        hidden = self._get("embedding_length")
        head_dim = self._get("attention.key_length", hidden // num_heads, required=False)
        rope_dim = self._get("rope.dimension_count", head_dim, required=False)
        if rope_dim != head_dim:
            raise ValueError(f"{self.path}: {self.arch_name}.rope.dimension_count={rope_dim} rotates part of "
                             f"each {head_dim}-wide head; pagedkv rotates whole heads")
        if self._get("attention.value_length", head_dim, required=False) != head_dim:
            raise ValueError(f"{self.path}: {self.arch_name}.attention.value_length differs from key_length; "
                             f"not supported")
        experts = self._get("expert_count", 0, required=False)
        if experts and self.arch_name != "gpt-oss":
            raise ValueError(f"{self.path}: a mixture-of-experts model ({self.arch_name}.expert_count="
                             f"{experts}); not supported")
        scaling = self._get("rope.scaling.type", "none", required=False)
        rope = {}
        if scaling == "linear":
            rope = {"rope_scaling": {"rope_type": "linear", "factor": float(self._get("rope.scaling.factor"))}}
        elif scaling == "yarn" and self.arch_name == "gpt-oss":
            rope = {"rope_scaling": {
                "rope_type": "yarn", "factor": float(self._get("rope.scaling.factor")),
                "original_max_position_embeddings": self._get("rope.scaling.original_context_length"),
                "beta_fast": float(self._get("rope.scaling.yarn_beta_fast", 32.0, required=False)),
                "beta_slow": float(self._get("rope.scaling.yarn_beta_slow", 1.0, required=False)),
                "truncate": False}}        # gpt-oss's own config: the correction range is not rounded
        elif scaling not in ("none", None):
            raise ValueError(f"{self.path}: {self.arch_name}.rope.scaling.type={scaling!r} is not supported "
                             f"(none, linear are{', yarn' if self.arch_name == 'gpt-oss' else ''})")
        config = {
            **self._common_config(num_heads, eps=1e-5),
            "num_key_value_heads": self._get("attention.head_count_kv", num_heads, required=False),
            "head_dim": head_dim, **rope,
            "rope_theta": float(self._get("rope.freq_base", 10000.0, required=False)),
        }
        if self.arch_name == "gemma3":
            config.update(self._gemma3_config(config))
        elif self.arch_name == "gpt-oss":
            config.update(self._gpt_oss_config(config))
        return config

    def _common_config(self, num_heads: int, eps: float) -> dict:
        """The fields every architecture reads alike; `eps` the norm epsilon when the file names none."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        eos = [self.metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if k in self.metadata]
        return {
            "architectures": [self.arch.hf_architecture], "model_type": self.arch.model_type,
            "num_hidden_layers": self._get("block_count"), "hidden_size": self._get("embedding_length"),
            "intermediate_size": self._get("feed_forward_length"), "num_attention_heads": num_heads,
            "vocab_size": self._get("vocab_size", len(tokens.data) if tokens is not None else None),
            "max_position_embeddings": self._get("context_length", 2048, required=False),
            "rms_norm_eps": float(self._get("attention.layer_norm_rms_epsilon", eps, required=False)),
            "eos_token_id": sorted(set(eos)), "torch_dtype": "float32",
        }

    def _deepseek2_config(self) -> dict:
        """DeepSeek V3's config from deepseek2.* metadata. The converter writes the latent attention as
        llama.cpp's MQA (head_count_kv 1, key_length kv_lora_rank + rope) and the per-head sizes under
        key_length_mla / value_length_mla; files without those carry the per-head sizes in key_length /
        value_length."""
        num_heads = self._get("attention.head_count")
        if isinstance(num_heads, list):
            raise ValueError(f"{self.path}: deepseek2.attention.head_count varies per layer; not supported")
        config = self._common_config(num_heads, eps=1e-6)
        gating = self._get("expert_gating_func", SIGMOID_GATING, required=False)
        if gating != SIGMOID_GATING:
            raise ValueError(f"{self.path}: deepseek2.expert_gating_func={gating} (softmax: DeepSeek V2's "
                             f"routing); pagedkv runs DeepSeek V3's sigmoid routing only")
        rope_dim = self._get("rope.dimension_count")
        if "deepseek2.attention.key_length_mla" in self.metadata:
            qk_dim, v_dim = self._get("attention.key_length_mla"), self._get("attention.value_length_mla")
        else:
            qk_dim, v_dim = self._get("attention.key_length"), self._get("attention.value_length")
        theta = float(self._get("rope.freq_base", 10000.0, required=False))
        rope = {"rope_type": "default", "rope_theta": theta}
        scaling = self._get("rope.scaling.type", "none", required=False)
        if scaling == "yarn":
            log_mul = self._get("rope.scaling.yarn_log_multiplier", 0.0, required=False)
            mscale = round(log_mul / YARN_LOG_MUL_PER_MSCALE, 6)     # llama.cpp's one mscale: both of transformers'
            rope = {"rope_type": "yarn", "rope_theta": theta, "factor": float(self._get("rope.scaling.factor")),
                    "original_max_position_embeddings": self._get("rope.scaling.original_context_length"),
                    "beta_fast": float(self._get("rope.scaling.yarn_beta_fast", 32.0, required=False)),
                    "beta_slow": float(self._get("rope.scaling.yarn_beta_slow", 1.0, required=False)),
                    "mscale": mscale, "mscale_all_dim": mscale}
        elif scaling not in ("none", None):
            raise ValueError(f"{self.path}: deepseek2.rope.scaling.type={scaling!r} is not supported (none, yarn are)")
        config.update({
            "num_key_value_heads": num_heads, "kv_lora_rank": self._get("attention.kv_lora_rank"),
            "q_lora_rank": self._get("attention.q_lora_rank", 0, required=False) or None,
            "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": qk_dim - rope_dim, "v_head_dim": v_dim,
            "n_routed_experts": self._get("expert_count"), "num_experts_per_tok": self._get("expert_used_count"),
            "moe_intermediate_size": self._get("expert_feed_forward_length"),
            "n_shared_experts": self._get("expert_shared_count", 0, required=False),
            "first_k_dense_replace": self._get("leading_dense_block_count", 0, required=False),
            "routed_scaling_factor": float(self._get("expert_weights_scale", 1.0, required=False)),
            "norm_topk_prob": bool(self._get("expert_weights_norm", False, required=False)),
            "n_group": self._get("expert_group_count", 1, required=False),
            "topk_group": self._get("expert_group_used_count", 1, required=False),
            "rope_interleave": True,      # llama.cpp's deepseek2 rope turns adjacent pairs, as DeepSeek's weights
            "rope_parameters": rope,
        })
        return config

    def _gpt_oss_config(self, config: dict) -> dict:
        """gpt-oss's experts and window (every other layer windowed, the first among them, as llama.cpp and
        transformers alike), its rope under rope_parameters (the key its config reads)."""
        scaling = config.pop("rope_scaling", None) or {"rope_type": "default"}
        return {"num_local_experts": self._get("expert_count"),
                "num_experts_per_tok": self._get("expert_used_count"),
                "intermediate_size": self._get("expert_feed_forward_length", config["intermediate_size"],
                                               required=False),
                "sliding_window": self._get("attention.sliding_window"),
                "rope_parameters": {**scaling, "rope_theta": config["rope_theta"]}}

    def _gemma3_config(self, config: dict) -> dict:
        """Gemma 3's windows, local rope, attention scale and softcaps, as llama.cpp reads them."""
        layers = config["num_hidden_layers"]
        out = {"query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"]
                                         if layers == GEMMA3_27B_LAYERS else config["head_dim"]),
               "rope_local_base_freq": float(self._get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE,
                                                       required=False)),
               "final_logit_softcapping": self._get("final_logit_softcapping", 0, required=False) or None,
               "attn_logit_softcapping": self._get("attn_logit_softcapping", 0, required=False) or None}
        window = self._get("attention.sliding_window", 0, required=False)
        out["sliding_window"] = window or None
        pattern = self._get("attention.sliding_window_pattern", GEMMA3_PATTERN, required=False)
        if isinstance(pattern, list):         # per layer: True for a sliding-window layer
            if len(pattern) != layers:
                raise ValueError(f"{self.path}: gemma3.attention.sliding_window_pattern lists {len(pattern)} "
                                 f"layers, the file has {layers}")
            sliding = [bool(p) for p in pattern]
        elif isinstance(pattern, int) and pattern >= 1:   # every pattern-th layer full, as llama.cpp's swa pattern
            sliding = [(i + 1) % pattern != 0 for i in range(layers)]
        else:
            raise ValueError(f"{self.path}: gemma3.attention.sliding_window_pattern={pattern!r} is neither a "
                             f"positive integer nor a list of booleans")
        out["layer_types"] = ["sliding_attention" if s and window else "full_attention" for s in sliding]
        return out

    def _tensors(self, file_size: int) -> dict:
        cfg = self.config
        tensors, halves = {}, {}
        for t in self.reader.tensors:
            qtype = t.tensor_type.name
            if qtype not in SUPPORTED_TYPES:
                raise ValueError(f"{self.path}: tensor {t.name!r} is {qtype}; pagedkv reads "
                                 f"{', '.join(SUPPORTED_TYPES)}")
            if t.data_offset + t.n_bytes > file_size:
                raise ValueError(f"{self.path} is truncated: tensor {t.name!r} ends at byte "
                                 f"{t.data_offset + t.n_bytes}, the file has {file_size}")
            name, layout = hf_name(t.name, self.arch.layer_names, self.arch.layer_tensors)
            if name is None:
                raise ValueError(f"{self.path}: tensor {t.name!r} is not part of a {self.arch_name} model "
                                 f"this engine runs")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))   # GGUF lists dimensions innermost first
            if layout == "expert":      # one tensor per expert, each a view of the stack
                for i in range(shape[0]):
                    tensors[name.format(i)] = TensorInfo(t.name, name.format(i), shape[1:], qtype, t, layout, index=i)
                continue
            if layout == "up":
                halves.setdefault(name, [None, None])[1] = (t, shape)
                continue
            if layout == "gate":
                halves.setdefault(name, [None, None])[0] = (t, shape)
                continue
            if name in tensors:
                raise ValueError(f"{self.path}: tensor {t.name!r} appears twice")
            tensors[name] = TensorInfo(t.name, name, hf_shape(shape, layout), qtype, t, layout)
        for name, (gate, up) in halves.items():
            if gate is None or up is None:
                have = (gate or up)[0].name
                raise ValueError(f"{self.path}: tensor {have!r} has no {'up' if up is None else 'gate'} half")
            if gate[1] != up[1] and self.arch_name != "deepseek2":
                raise ValueError(f"{self.path}: tensors {gate[0].name!r} {list(gate[1])} and {up[0].name!r} "
                                 f"{list(up[1])} differ in shape")
            if name in tensors:
                raise ValueError(f"{self.path}: tensor {gate[0].name!r} appears twice (split and stacked)")
            layout = "kv_b" if self.arch_name == "deepseek2" else "gate"
            shape = kv_b_shape(gate[1], up[1]) if layout == "kv_b" else hf_shape(gate[1], "gate")
            tensors[name] = TensorInfo(gate[0].name, name, shape, gate[0].tensor_type.name, gate[0], layout, up[0])
        embed = tensors.get("model.embed_tokens.weight")
        if embed is None:
            raise ValueError(f"{self.path}: no token_embd.weight tensor")
        if embed.shape != (cfg["vocab_size"], cfg["hidden_size"]):
            raise ValueError(f"{self.path}: token_embd.weight is {list(embed.shape)}, the metadata says "
                             f"[{cfg['vocab_size']}, {cfg['hidden_size']}] (vocab_size, embedding_length)")
        cfg["tie_word_embeddings"] = "lm_head.weight" not in tensors
        cfg["attention_bias"] = any(n.endswith("q_proj.bias") for n in tensors)
        cfg["mlp_bias"] = any(n.endswith("gate_proj.bias") for n in tensors)
        return tensors

    # ---- weights -----------------------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` (Hugging Face name) in float32, Hugging Face layout: dequantised by the gguf
        package, for q_proj / k_proj with llama.cpp's rope row order undone (llama), for norms with the
        converter's shift taken off (Gemma)."""
        from gguf.quants import dequantize

        info = self.tensors[name]

        def values(t):
            if self._stack is not None and self._stack[0] is t:     # the experts of one stack, read in turn
                return self._stack[1]
            stored = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            return torch.from_numpy(np.array(stored.reshape(shape)))    # a copy: the map stays read-only

        weight = values(info.tensor)
        if info.layout == "expert":
            self._stack = (info.tensor, weight)
            return weight[info.index].clone()
        self._stack = None
        if info.layout == "kv_b":          # k_b [H, rank, nope] and v_b [H, v, rank] -> [H * (nope + v), rank]
            k_b, v_b = weight.transpose(1, 2), values(info.up)
            return torch.cat((k_b, v_b), dim=1).reshape(info.shape).contiguous()
        if info.layout == "transpose":
            return weight.transpose(-1, -2).contiguous()
        if info.layout in ("gate", "gate_up"):
            gate, up = (weight, values(info.up)) if info.layout == "gate" else weight.chunk(2, dim=1)
            pairs = torch.stack((gate, up), dim=2).flatten(1, 2)       # rows gate 0, up 0, gate 1, ...
            return pairs.transpose(1, 2).contiguous() if pairs.dim() == 3 else pairs
        if self.arch.norm_shift and name.endswith("norm.weight"):
            weight -= self.arch.norm_shift
        if not self.arch.permuted_rope:
            return weight
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            weight = unpermute_rope_rows(weight, self.config["num_attention_heads"])
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            weight = unpermute_rope_rows(weight, self.config["num_key_value_heads"])
        return weight

    # ---- tokenizer and chat ------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    def special_tokens(self) -> dict:
        """bos_token / eos_token / unk_token / pad_token as strings (None when the file names none)."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        out = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            token_id = self.metadata.get(f"tokenizer.ggml.{key}")
            out[name] = None if tokens is None or token_id is None else str(tokens.contents(token_id))
        return out

    def tokenizer(self):
        """The file's byte-level BPE tokenizer (`tokenizers.Tokenizer`): vocabulary and merges from the
        metadata, control tokens as special tokens, the pre-tokenizer split `tokenizer.ggml.pre` names,
        BOS added to plain prompts when `tokenizer.ggml.add_bos_token` says so."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

        kind = self.metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{self.path}: tokenizer.ggml.model={kind!r}; pagedkv builds byte-level BPE "
                             f"('gpt2') tokenizers from GGUF files")
        tokens = [str(t) for t in self.metadata["tokenizer.ggml.tokens"].contents()]
        merges_field = self.metadata.get("tokenizer.ggml.merges")
        if merges_field is None:
            raise ValueError(f"{self.path}: a byte-level BPE tokenizer without tokenizer.ggml.merges")
        merges = [tuple(m.split(" ", 1)) for m in merges_field.contents()]
        types_field = self.metadata.get("tokenizer.ggml.token_type")
        types = list(types_field.contents()) if types_field is not None else [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError(f"{self.path}: tokenizer.ggml.tokens lists a token twice")
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        pre = self.metadata.get("tokenizer.ggml.pre", "default")
        splits = PRE_TOKENIZER_SPLITS.get(pre)
        if splits is None:
            import warnings
            warnings.warn(f"{self.path}: tokenizer.ggml.pre={pre!r} is not one pagedkv knows; text is split "
                          f"as GPT-2 splits it", stacklevel=2)
            splits = PRE_TOKENIZER_SPLITS["default"]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == CONTROL_TOKEN])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == USER_DEFINED_TOKEN])
        bos = self.special_tokens()["bos_token"]
        if self.metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            bos_id = self.metadata["tokenizer.ggml.bos_token_id"]
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, bos_id)])
        return tok


def hf_name(gguf_name: str, layer_names: dict = LAYER_NAMES, layer_tensors: dict | None = None):
    """(Hugging Face name, layout) of a llama.cpp tensor name, or (None, None) for one the architecture (its
    `layer_names`, and `layer_tensors` stored in another form) does not have."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None, None
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}", "plain"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None, None
    prefix = f"model.layers.{int(parts[1])}"
    if f"{parts[2]}.{kind}" in (layer_tensors or {}):
        leaf, layout = layer_tensors[f"{parts[2]}.{kind}"]
        return f"{prefix}.{leaf}", layout
    if parts[2] in layer_names:
        return f"{prefix}.{layer_names[parts[2]]}.{kind}", "plain"
    return None, None


def kv_b_shape(k_b: tuple, v_b: tuple) -> tuple:
    """kv_b_proj's shape [H * (nope + v), rank] from k_b [H, rank, nope] and v_b [H, v, rank]."""
    return (k_b[0] * (k_b[2] + v_b[1]), k_b[1])


def hf_shape(stored: tuple, layout: str) -> tuple:
    """The Hugging Face shape of a tensor stored as `stored` (Hugging Face order) in `layout`."""
    if layout == "transpose":
        return (*stored[:-2], stored[-1], stored[-2])
    if layout == "gate":              # one half [E, inter(, hidden)] of [E, hidden, 2 * inter] / [E, 2 * inter]
        return (stored[0], stored[2], 2 * stored[1]) if len(stored) == 3 else (stored[0], 2 * stored[1])
    if layout == "gate_up":           # [E, 2 * inter(, hidden)]
        return (stored[0], stored[2], stored[1]) if len(stored) == 3 else stored
    return stored


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from the half-split rotation of Hugging Face
    (first half, second half) to interleaved pairs (row 2i, 2i + 1) for its own rope; this puts them back."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2)
            .reshape(weight.shape).contiguous())


def permute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's order from Hugging Face's (the converter's permutation; unpermute_rope_rows inverts it)."""
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).transpose(1, 2)
            .reshape(weight.shape).contiguous())
