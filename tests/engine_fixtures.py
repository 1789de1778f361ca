"""Helpers for the engine tests: tiny random Hugging Face Llamas saved to disk, and their greedy output."""
import random

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=384, max_position_embeddings=512, initializer_range=0.2)


def save_tiny_llama(path, seed=0, max_shard_size=None, **overrides):
    """Saves a random LlamaForCausalLM (float32) to `path`; returns it in eval mode on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    model.generation_config.eos_token_id = None    # the reference never stops early
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, device="cpu") -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


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
