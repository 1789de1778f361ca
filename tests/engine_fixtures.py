"""Helpers for the engine tests: tiny random Hugging Face Llamas (and Mistrals, Gemma 2s, Qwen3s, Gemma 3s,
gpt-oss, DeepSeek V3s) saved to disk, and their greedy output."""
import random

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=384, max_position_embeddings=512, initializer_range=0.2)


def save_tiny_llama(path, seed=0, max_shard_size=None, **overrides):
    """Saves a random LlamaForCausalLM (float32) to `path`; returns it in eval mode on CPU."""
    model = build_tiny_model("llama", seed=seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return never_stop(model)


# Windowed models: the window is small against the prompts plus generations; Gemma 2's softcaps and
# query_pre_attn_scalar are small / off head_dim so that each one changes the output, and its LM head is
# untied (a tiny random Gemma 2 with tied embeddings repeats its last input token).
TINY_MISTRAL = dict(TINY, sliding_window=8)
TINY_GEMMA2 = dict(TINY, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                   final_logit_softcapping=4.0, num_hidden_layers=4, tie_word_embeddings=False)
# Qwen3: head_dim apart from hidden_size / num_attention_heads, and random QK-norm weights.
TINY_QWEN3 = dict(TINY, head_dim=24)
# Gemma 3: five sliding layers per full one (transformers' default layer_types), the local and global ropes
# of transformers' defaults (10k and 1M), no softcaps.
TINY_GEMMA3 = dict(TINY, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=6,
                   tie_word_embeddings=False)
# gpt-oss: four experts, two per token, windowed and full layers alternating, YaRN rope over an original
# context of 64 (so the prompts reach its interpolated frequencies); the sinks drawn wide (transformers' init gives them the weights' small spread) so each one matters.
TINY_GPT_OSS = dict(TINY, head_dim=16, sliding_window=8, num_hidden_layers=4, num_local_experts=4,
                    num_experts_per_tok=2,
                    rope_parameters=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=64, rope_theta=150000.0))

# DeepSeek V3: one dense layer then two MoE layers (eight experts in four groups, two groups kept, two experts a
# token, one shared), q_lora_rank set, a latent of 32 beside a rope key of 8 (qk 16 + 8, v 12), YaRN rope over an
# original context of 64 whose mscale and mscale_all_dim differ (so both the rope's factor and the softmax
# scale's are on), random score correction biases.
TINY_DEEPSEEK_V3 = dict(TINY, num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1,
                        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                        rope_parameters=dict(rope_type="yarn", factor=8.0, beta_fast=32, beta_slow=1, mscale=0.707,
                                             mscale_all_dim=1.0, original_max_position_embeddings=64,
                                             rope_theta=10000.0))


def build_tiny_model(model_type="llama", seed=0, **overrides):
    """A random float32 Llama / Mistral / Gemma 2 / Qwen3 ForCausalLM in eval mode on CPU. The others
    than Llama use eager attention (transformers' reference maths) and random norm weights too,
    so Gemma 2's (1 + weight) is exercised."""
    import transformers

    torch.manual_seed(seed)
    if model_type == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides})).eval()
    else:
        base, config_name, name = {"mistral": (TINY_MISTRAL, "Mistral", "Mistral"),
                                   "gemma2": (TINY_GEMMA2, "Gemma2", "Gemma2"),
                                   "qwen3": (TINY_QWEN3, "Qwen3", "Qwen3"),
                                   "gemma3": (TINY_GEMMA3, "Gemma3Text", "Gemma3"),
                                   "gpt_oss": (TINY_GPT_OSS, "GptOss", "GptOss"),
                                   "deepseek_v3": (TINY_DEEPSEEK_V3, "DeepseekV3", "DeepseekV3")}[model_type]
        config = getattr(transformers, f"{config_name}Config")(**{**base, **overrides})
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"    # the experts' reference loop (MoE models)
        model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
                elif param_name.endswith("sinks"):
                    param.normal_(0.0, 2.0)
            for buffer_name, buffer in model.named_buffers():
                if buffer_name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.3)
    return model


def never_stop(model):
    """`model`, its generation config set to never stop early (the reference runs every token)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_tiny_model(path, model_type="llama", seed=0, **overrides):
    """Saves `build_tiny_model(model_type, seed, **overrides)` to `path` and returns it."""
    if model_type == "llama":
        return save_tiny_llama(path, seed=seed, **overrides)
    model = build_tiny_model(model_type, seed=seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    return never_stop(model)


def load_hf_eager(path):
    """The checkpoint at `path` in transformers, eager attention, never stopping early (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, device="cpu") -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


# Two logits closer than this are a tie that float rounding may settle either way (the engine's logits
# differ from transformers' by about 1e-5 on the tiny models; half their top-2 gaps exceed 0.3).
GREEDY_ATOL = 1e-3


@torch.no_grad()
def assert_greedy(model, prompt: list[int], tokens: list[int], expected: list[int] | None = None) -> None:
    """`tokens` are a greedy continuation of `prompt` under `model`, for any prompt drawn: equal to
    transformers' greedy output `expected` (computed when not given; same length), or, from the first
    token where the two part at a near-tie, every token is within GREEDY_ATOL of the best logit given the
    tokens before it."""
    tokens, prompt = list(tokens), list(prompt)
    expected = hf_greedy(model, prompt, len(tokens)) if expected is None else list(expected)
    assert len(tokens) == len(expected), f"{len(tokens)} tokens {tokens}, transformers' greedy output {expected}"
    if tokens == expected or not tokens:
        return
    logits = model(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    for i, (row, token) in enumerate(zip(logits, tokens)):
        short = float(row.max() - row[token])
        assert short <= GREEDY_ATOL, (f"token {i} of {tokens} is {token}, {short:.3g} below the best logit "
                                      f"(transformers' greedy output: {expected})")


def shared_prefix_prompts(vocab_size: int, seed=0, num_systems=2, per_system=3, system_len=37):
    """Prompts built from a few 'system prompts' plus distinct user suffixes of varying length, and one
    exact duplicate, so the prefix cache has full-block hits and partial-block misses."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab_size) for _ in range(system_len)] for _ in range(num_systems)]
    prompts = [sys + [rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 20))]
               for sys in systems for _ in range(per_system)]
    return prompts + [list(prompts[0])]


def tiny_llama_and_outputs(tmp_path_factory, name, max_new_tokens, **overrides):
    """(checkpoint dir, prompts with shared prefixes, their HF greedy outputs) of a tiny random Llama."""
    path = tmp_path_factory.mktemp(name)
    model = save_tiny_llama(path, **overrides)
    prompts = shared_prefix_prompts(model.config.vocab_size)
    return str(path), prompts, [hf_greedy(model, p, max_new_tokens) for p in prompts]
