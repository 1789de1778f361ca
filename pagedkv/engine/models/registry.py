"""The model registry: each Hugging Face architecture the engine runs, what it reads from config.json and
the model module that runs it. Adding an architecture is its module in this folder plus one line here.
Imports nothing from the model modules (they are named by string and imported when first built)."""
import importlib
from dataclasses import dataclass

# config.json fields that change the maths of a Llama-family model, with the only value this engine runs
# (absent counts as that value). Anything else is refused, naming the field.
MATHS_FIELDS = {"hidden_act": "silu", "sliding_window": None, "use_sliding_window": False,
                "attn_logit_softcapping": None, "final_logit_softcapping": None, "query_pre_attn_scalar": None,
                "partial_rotary_factor": 1.0, "logits_scaling": None, "qk_norm": False, "use_qk_norm": False,
                "quantization_config": None}


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture the engine runs: what it reads from config.json, and the model class
    that runs it."""
    model_type: str
    model_class: str           # "module.Class" in this folder (a name: the model modules import config, which imports this)
    fixed: dict                # fields with the only value the engine runs (absent counts as that value)
    defaults: dict             # transformers' class defaults of fields the engine reads, when absent
    read: frozenset = frozenset()   # the architecture's own fields the engine runs (windows, softcaps, ...)
    activation: str = "silu"        # the MLP gate's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    global_every: int = 2           # without layer_types: every global_every-th layer is full attention
    extra: frozenset = frozenset()  # fields passed on as ModelConfig.extra, checked by the model module
    latent_cache: bool = False      # MLA: one latent cache row per token and layer (ModelConfig.latent_cache)


# Gemma 2 and 3: the fields with the only value the engine runs, and the fields it reads.
GEMMA_FIXED = {"hidden_activation": "gelu_pytorch_tanh", "use_bidirectional_attention": False,
               "partial_rotary_factor": 1.0, "quantization_config": None, "mlp_bias": False,
               "qk_norm": False, "use_qk_norm": False, "logits_scaling": None}
GEMMA_READ = frozenset({"sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                        "final_logit_softcapping"})

# DeepSeek V3's fields the engine reads, with transformers' DeepseekV3Config defaults.
DEEPSEEK_V3_DEFAULTS = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                        "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 2048, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                        "norm_topk_prob": True, "first_k_dense_replace": 3, "rope_interleave": True,
                        "max_position_embeddings": 4096, "rope_theta": 10000.0}

# The model registry, keyed by config.json's `architectures`. Mistral is Llama with every layer windowed;
# Gemma 2 alternates windowed and full layers; Gemma 3 has five windowed layers per full one, with a rope
# of their own; gpt-oss alternates 128-token windowed layers and full ones, with attention sinks and experts;
# DeepSeek V3 has multi-head latent attention (one latent cache row per token) and routed plus shared experts.
ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("llama", "llama.LlamaForCausalLM", MATHS_FIELDS, {}),
    "MistralForCausalLM": Architecture(
        "mistral", "llama.LlamaForCausalLM",
        {**{k: v for k, v in MATHS_FIELDS.items() if k != "sliding_window"}, "attention_bias": False,
         "mlp_bias": False},
        {"sliding_window": 4096, "max_position_embeddings": 131072},
        frozenset({"sliding_window"})),
    "Qwen3ForCausalLM": Architecture("qwen3", "qwen3.Qwen3ForCausalLM", MATHS_FIELDS,
                                     {"head_dim": 128, "max_position_embeddings": 32768}),
    "Gemma2ForCausalLM": Architecture(
        "gemma2", "gemma2.Gemma2ForCausalLM",
        GEMMA_FIXED,
        {"sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
         "final_logit_softcapping": 30.0, "head_dim": 256, "max_position_embeddings": 8192,
         "tie_word_embeddings": True},
        GEMMA_READ, activation="gelu_pytorch_tanh"),
    "Gemma3ForCausalLM": Architecture(
        "gemma3_text", "gemma3.Gemma3ForCausalLM", GEMMA_FIXED,
        {"sliding_window": 4096, "query_pre_attn_scalar": 256, "head_dim": 256, "max_position_embeddings": 131072,
         "tie_word_embeddings": True, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0},
        GEMMA_READ | {"rope_local_base_freq"}, activation="gelu_pytorch_tanh", global_every=6),
    "GptOssForCausalLM": Architecture(
        "gpt_oss", "gpt_oss.GptOssForCausalLM",
        {k: v for k, v in MATHS_FIELDS.items() if k not in ("sliding_window", "quantization_config")},
        {"sliding_window": 128, "head_dim": 64, "attention_bias": True, "max_position_embeddings": 131072,
         "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
         "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 4096}},
        frozenset({"sliding_window", "layer_types"}),
        extra=frozenset({"num_local_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"})),
    "DeepseekV3ForCausalLM": Architecture(
        "deepseek_v3", "deepseek_v3.DeepseekV3ForCausalLM",
        {**MATHS_FIELDS, "scoring_func": "sigmoid",
         "topk_method": "noaux_tc", "moe_layer_freq": 1, "pretraining_tp": 1},
        DEEPSEEK_V3_DEFAULTS, extra=frozenset(DEEPSEEK_V3_DEFAULTS) - {"max_position_embeddings", "rope_theta"},
        latent_cache=True),
}


def model_class(architecture: str) -> type:
    """The nn.Module class that runs `architecture` (a key of ARCHITECTURES)."""
    module, cls = ARCHITECTURES[architecture].model_class.rsplit(".", 1)
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)
