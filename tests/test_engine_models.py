"""Mistral, Gemma 2, Qwen3, Gemma 3, gpt-oss and DeepSeek V3 through the same engine as Llama (the registry keyed by config.json's
`architectures`): greedy fp32 output equals transformers' eager attention token for token, with prompts
plus generations several times the sliding window, prefix caching on and off, n > 1; each Gemma 2
feature (window per layer type, attention and final softcaps, query_pre_attn_scalar, tied embeddings)
changes the output and the engine follows transformers through the change; configs it cannot run
exactly are refused naming the field. DeepSeek V3 runs on the latent cache (one tensor per layer), which holds
several times the tokens per byte of a K/V cache of the same model."""
import json
import shutil

import pytest
import torch

from engine_fixtures import hf_greedy, load_hf_eager, save_tiny_model, shared_prefix_prompts
from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.config import ARCHITECTURES, ModelConfig
from pagedkv.engine.models.registry import model_class

MAX_TOKENS = 24          # prompts of 38-56 tokens + 24: up to 10 windows of 8
MODEL_TYPES = ["mistral", "gemma2", "qwen3", "gemma3", "gpt_oss", "deepseek_v3"]
PROMPTS_PER_SYSTEM = {"deepseek_v3": 4}      # 9 prompts; the others 7
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=MODEL_TYPES)
def tiny(request, tmp_path_factory):
    """(model type, checkpoint dir, prompts with shared prefixes, transformers' greedy outputs)."""
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    model = save_tiny_model(path, request.param)
    prompts = shared_prefix_prompts(model.config.vocab_size, per_system=PROMPTS_PER_SYSTEM.get(request.param, 3))
    return request.param, path, prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


def edited_copy(src, dst, **fields):
    """A copy of checkpoint `src` whose config.json has `fields` replaced (None writes null)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers(tiny, device, prefix_caching):
    _, path, prompts, expected = tiny
    llm = LLM(path, device=device, block_size=4, enable_prefix_caching=prefix_caching)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts[::-1], GREEDY)     # the second round hits the prefix cache
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected[::-1]
    stats = llm.stats()
    assert (stats["hits"] > 0) == prefix_caching
    assert stats["used_blocks"] == 0
    llm.bm.check_invariants()


def test_n_samples_share_blocks(tiny):
    _, path, prompts, expected = tiny
    llm = LLM(path, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    outputs = llm.generate(prompts[:3], params)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e] * 3 for e in expected[:3]]
    assert llm.stats()["cow_copies"] > 0
    llm.bm.check_invariants()


def test_the_registry_builds_each_architecture(tiny):
    model_type, path, _, _ = tiny
    llm = LLM(path, block_size=4)
    cfg = llm.model_config
    assert ARCHITECTURES[cfg.architecture].model_type.removesuffix("_text") == model_type
    assert type(llm.model) is model_class(cfg.architecture)
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in llm.model.model.layers]
    if model_type == "mistral":
        assert windows == [8] * cfg.num_layers
    elif model_type == "gemma3":    # transformers' default layer_types: five sliding, then one full
        assert windows == [8, 8, 8, 8, 8, -1]
        model = llm.model.model
        assert [model.layer_ropes[i] is model.local_rotary_emb for i in range(6)] == [True] * 5 + [False]
    elif model_type == "gpt_oss":     # transformers' default layer_types: sliding, full, ...
        assert windows == [8, -1] * (cfg.num_layers // 2)
        assert all(layer.self_attn.sink_logits.dtype == torch.float32 for layer in llm.model.model.layers)
        assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.extra["num_experts_per_tok"] == 2
    elif model_type == "deepseek_v3":    # no window; a latent row of 32 + 8 per token and layer, experts after layer 0
        assert cfg.latent_cache == (32, 8) and cfg.rope_scaling["rope_type"] == "yarn"
        layers = llm.model.model.layers
        assert [type(layer.mlp).__name__ for layer in layers] == ["MLP", "DeepseekV3MoE", "DeepseekV3MoE"]
        assert [latent.shape[1:] for (latent,) in llm.runner.kv_caches] == [(4, 40)] * cfg.num_layers
        assert windows == [None] * cfg.num_layers
    elif model_type == "qwen3":
        assert windows == [-1] * cfg.num_layers and cfg.head_dim == 24
        assert all(hasattr(layer.self_attn, "q_norm") for layer in llm.model.model.layers)
    else:       # transformers' default layer_types: even layers sliding, odd layers full
        assert windows == [8, -1] * (cfg.num_layers // 2)
        assert {layer.self_attn.softcap for layer in llm.model.model.layers} == {3.0}
        assert llm.model.model.layers[0].self_attn.scale == 24 ** -0.5


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_preemption_and_chunked_prefill(tiny, preemption):
    """A pool too small for the batch: sequences are preempted (by swap to host blocks, or by dropping
    their KV and recomputing it) while prompts prefill in chunks of 13 tokens; the tokens stay
    transformers'."""
    model_type, path, prompts, expected = tiny
    swap = dict(num_cpu_blocks=64) if preemption == "swap" else {}
    num_blocks = 14 if model_type == "mistral" else 40       # Mistral's every layer holds only its window
    llm = LLM(path, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=13, **swap)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats[f"preempted_{preemption}"] > 0, stats
    assert stats["used_blocks"] == 0
    llm.bm.check_invariants()


# Config edits, each of which changes a tiny model's greedy output: the engine must follow transformers
# through the edit (so each field is read, and read as transformers reads it).
EDITS = {
    "mistral": {"no window": dict(sliding_window=None), "window 5": dict(sliding_window=5)},
    "gemma2": {"no window": dict(layer_types=["full_attention"] * 4),   # (transformers cannot run a null one)
               "window 11": dict(sliding_window=11),
               "own layer types": dict(layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                    "full_attention"]),
               "no attention softcap": dict(attn_logit_softcapping=None),
               "scale by head_dim": dict(query_pre_attn_scalar=16)},
    "qwen3": {"rope theta 100": dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0})},
    "gemma3": {"local rope theta 100": dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                             "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
               "global rope theta 100": dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                              "full_attention": {"rope_type": "default", "rope_theta": 100.0}}),
               "window 5": dict(sliding_window=5),
               "own layer types": dict(layer_types=["full_attention", "sliding_attention"] * 3)},
    "deepseek_v3": {"rope not interleaved": dict(rope_interleave=False),
                    "one group kept": dict(topk_group=1),
                    "weights not normalised": dict(norm_topk_prob=False),
                    "no yarn": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})},
    "gpt_oss": {"window 5": dict(sliding_window=5),
                "own layer types": dict(layer_types=["full_attention", "sliding_attention"] * 2),
                "one expert a token": dict(num_experts_per_tok=1),
                "swiglu limit 0.5": dict(swiglu_limit=0.5),
                "no yarn": dict(rope_parameters={"rope_type": "default", "rope_theta": 150000.0})},
}


@pytest.mark.parametrize("tiny, edit", [(m, e) for m in MODEL_TYPES for e in EDITS[m]], indirect=["tiny"])
def test_each_field_changes_the_output_and_the_engine_follows(tiny, tmp_path, edit):
    model_type, path, prompts, expected = tiny
    edited = edited_copy(path, tmp_path / "edited", **EDITS[model_type][edit])
    reference = load_hf_eager(edited)
    prompts = prompts[:3]
    want = [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    assert want != expected[:3], f"{edit} does not change this model's output: the check would be void"
    got = LLM(edited, block_size=4).generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == want


@pytest.mark.parametrize("tiny, final_softcap", [("mistral", None), ("gemma2", 4.0), ("gemma2", None),
                                                   ("qwen3", None), ("gemma3", None), ("gpt_oss", None),
                                                   ("deepseek_v3", None)],
                         indirect=["tiny"])
def test_logits_equal_transformers(tiny, tmp_path, final_softcap):
    """The last token's logits (which sampling uses) equal transformers': a greedy check cannot see the
    final softcap, tanh being monotonic."""
    model_type, path, prompts, _ = tiny
    if model_type == "gemma2":
        path = edited_copy(path, tmp_path / "edited", final_logit_softcapping=final_softcap)
    reference = load_hf_eager(path)
    llm = LLM(path, block_size=4)
    seen = []
    compute_logits = llm.model.compute_logits
    llm.model.compute_logits = lambda h: seen.append(compute_logits(h)) or seen[-1]
    for prompt in prompts[:2]:
        llm.generate(prompt, SamplingParams(max_tokens=1))
    got = torch.cat(seen)
    with torch.no_grad():
        want = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts[:2]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if final_softcap is not None:
        assert got.abs().max() < final_softcap
        raw = torch.atanh(got / final_softcap) * final_softcap
        assert raw.abs().max() > final_softcap      # the cap bit: without it some logits would pass it


def test_gemma2_with_tied_embeddings(tmp_path):
    """Gemma 2's default: the LM head is the (unscaled) embedding; the checkpoint has no lm_head.weight."""
    model = save_tiny_model(tmp_path, "gemma2", seed=1, tie_word_embeddings=True, initializer_range=0.05)
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=1, per_system=2)
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    assert len({t for e in expected for t in e}) > 10        # not a degenerate repetition
    outputs = LLM(tmp_path, block_size=4).generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected


def test_absent_fields_take_transformers_defaults():
    """A config.json that omits a field means transformers' class default for the architecture."""
    from transformers import Gemma2Config, MistralConfig

    base = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4)
    for arch, hf_class in (("MistralForCausalLM", MistralConfig), ("Gemma2ForCausalLM", Gemma2Config)):
        cfg = ModelConfig.from_dict(dict(base, architectures=[arch]))
        hf = hf_class(**base)
        assert cfg.head_dim == hf.head_dim and cfg.max_position_embeddings == hf.max_position_embeddings
        assert cfg.tie_word_embeddings == hf.tie_word_embeddings
        layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
        assert cfg.layer_windows == tuple(hf.sliding_window if t == "sliding_attention" else None
                                          for t in layer_types)
        if arch == "Gemma2ForCausalLM":
            assert (cfg.query_pre_attn_scalar, cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == \
                (hf.query_pre_attn_scalar, hf.attn_logit_softcapping, hf.final_logit_softcapping)
            assert cfg.hidden_act == hf.hidden_activation
        else:
            assert cfg.hidden_act == hf.hidden_act and cfg.attn_logit_softcapping is None


GEMMA2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=100, hidden_size=64,
              intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, head_dim=16)
MISTRAL = dict(GEMMA2, architectures=["MistralForCausalLM"], model_type="mistral")
DEEPSEEK_V3 = dict(GEMMA2, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
BAD = [
    ("layer_types too short", dict(GEMMA2, layer_types=["full_attention"] * 3), "layer_types"),
    ("unknown layer type", dict(GEMMA2, layer_types=["full_attention", "chunked_attention"] * 2), "layer_types"),
    ("window 0", dict(GEMMA2, sliding_window=0), "sliding_window"),
    ("window float", dict(MISTRAL, sliding_window=8.0), "sliding_window"),
    ("window bool", dict(MISTRAL, sliding_window=True), "sliding_window"),
    ("negative softcap", dict(GEMMA2, attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    ("infinite final softcap", dict(GEMMA2, final_logit_softcapping=float("inf")), "final_logit_softcapping"),
    ("no query_pre_attn_scalar", dict(GEMMA2, query_pre_attn_scalar=None), "query_pre_attn_scalar"),
    ("bidirectional", dict(GEMMA2, use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma2 gelu exact", dict(GEMMA2, hidden_activation="gelu"), "hidden_activation"),
    ("mistral gelu", dict(MISTRAL, hidden_act="gelu"), "hidden_act"),
    ("mistral attention bias", dict(MISTRAL, attention_bias=True), "attention_bias"),
    ("mistral softcap", dict(MISTRAL, attn_logit_softcapping=30.0), "attn_logit_softcapping"),
    ("type mismatch", dict(GEMMA2, model_type="mistral"), "model_type"),
    ("two architectures", dict(GEMMA2, architectures=["Gemma2ForCausalLM", "LlamaForCausalLM"]), "architectures"),
    ("deepseek v3 softmax scores", dict(DEEPSEEK_V3, scoring_func="softmax"), "scoring_func"),
    ("deepseek v3 greedy top-k", dict(DEEPSEEK_V3, topk_method="greedy"), "topk_method"),
    ("deepseek v3 fp8 weights", dict(DEEPSEEK_V3, quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("deepseek v3 no latent", dict(DEEPSEEK_V3, kv_lora_rank=None), "kv_lora_rank"),
    ("deepseek v3 rope 0", dict(DEEPSEEK_V3, qk_rope_head_dim=0), "qk_rope_head_dim"),
    ("qwen3 sliding", dict(MISTRAL, architectures=["Qwen3ForCausalLM"], model_type="qwen3", sliding_window=None,
                           use_sliding_window=True), "use_sliding_window"),
]


@pytest.mark.parametrize("config, field", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_configs_it_cannot_run_exactly_are_refused_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(config)


def test_model_type_alone_names_the_architecture():
    config = {k: v for k, v in GEMMA2.items() if k != "architectures"}
    assert ModelConfig.from_dict(config).architecture == "Gemma2ForCausalLM"
    assert ModelConfig.from_dict(dict(config, model_type="mistral")).architecture == "MistralForCausalLM"


@pytest.mark.parametrize("layer_types", [None, ["full_attention", "sliding_attention", "sliding_attention",
                                                 "sliding_attention"], ["sliding_attention"] * 4])
def test_kv_group_layout_is_the_managers(layer_types):
    """The engine's groups and shared-tensor slots are pagedkv.kv_cache_groups' (full attention first)."""
    import pagedkv

    config = dict(GEMMA2, sliding_window=16, **({"layer_types": layer_types} if layer_types else {}))
    cfg = ModelConfig.from_dict(config)
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    groups, placement = pagedkv.kv_cache_groups(windows)
    assert sorted(groups, key=lambda w: (w is not None, w or 0)) == cfg.group_windows
    assert [cfg.group_windows[cfg.layer_groups[i]] for i in range(cfg.num_layers)] == windows
    assert [index for _, index in placement] == cfg.layer_cache_slots


def test_gemma2_window_off_on_every_layer_is_full_attention():
    cfg = ModelConfig.from_dict(dict(GEMMA2, layer_types=["full_attention"] * 4, sliding_window=16))
    assert cfg.layer_windows is None and cfg.window(0) is None


def test_reduced_precision_follows_transformers(tiny):
    """bf16: Gemma 2's norm gain 1 + w is rounded to bf16 where transformers multiplies in fp32, so only
    the first tokens are a contract; a late divergence is tolerated, and an early one only at a bf16 tie
    (two logits within two ulps, which any change of summation order may settle either way)."""
    _, path, prompts, _ = tiny
    reference = load_hf_eager(path).to(torch.bfloat16)
    expected = [hf_greedy(reference, p, 8) for p in prompts]
    outputs = LLM(path, dtype=torch.bfloat16, block_size=4).generate(prompts, SamplingParams(max_tokens=8,
                                                                                              ignore_eos=True))
    first_diff = [next((i for i, (a, b) in enumerate(zip(o.token_ids, e)) if a != b), 8)
                  for o, e in zip(outputs, expected)]
    early = [j for j, d in enumerate(first_diff) if d < 3]
    for j in early:       # an early divergence only at a tie in bf16: within two ulps of the best logit
        d, prompt = first_diff[j], prompts[j]
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + expected[j][:d]])).logits[0, -1].float()
        assert logits.max() - logits[outputs[j].token_ids[d]] <= 2 * 2.0 ** (int(logits.max().log2()) - 7), \
            (j, d, first_diff)
    assert len(early) <= 1 and sum(d == 8 for d in first_diff) >= len(prompts) // 2, first_diff


@pytest.mark.parametrize("setting", [dict(num_blocks=64), dict(num_blocks=46, num_cpu_blocks=32,
                                                                  max_num_batched_tokens=13)],
                         ids=["roomy", "swap-chunked"])
@pytest.mark.parametrize("model_type", ["gemma2", "gemma3", "qwen3"])
def test_tensor_parallel(tmp_path, setting, model_type):
    """TP=2 (gloo): each rank holds one of the two KV heads of every layer (the QK norms' weights, one per
    head_dim, are replicated); the step message carries the windowed group's slots and block tables beside
    the full group's, and swaps move both."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = save_tiny_model(tmp_path, model_type)
        if model_type == "qwen3" and "num_cpu_blocks" in setting:     # one KV group: half the pool must swap
            setting = dict(setting, num_blocks=20)
        prompts = shared_prefix_prompts(model.config.vocab_size, per_system=2)
        expected = [hf_greedy(model, p, 12) for p in prompts]
        with LLM(tmp_path, block_size=4, tensor_parallel_size=2, **setting) as llm:
            outputs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
            stats = llm.stats()
        assert [o.token_ids for o in outputs] == expected
        assert stats["preempted_swap"] > 0 if "num_cpu_blocks" in setting else stats["num_preemptions"] == 0
    finally:
        torch.set_num_threads(torch_threads)


@pytest.mark.parametrize("tiny", ["gemma2"], indirect=True)
def test_gemma2_float8_kv_on_shared_cache_tensors(tiny):
    """float8 KV: the layers sharing a cache tensor keep their own scales (each writes its own group's
    blocks); runs through swap and prefix caching, agreement with fp32 KV printed (not a contract)."""
    _, path, prompts, expected = tiny
    llm = LLM(path, block_size=4, kv_cache_dtype="fp8_e4m3", num_blocks=48, num_cpu_blocks=48)
    outputs = llm.generate(prompts, GREEDY)
    assert all(o.error is None and len(o.token_ids) == MAX_TOKENS for o in outputs)
    assert len(llm.runner.kv_caches) == 2 and all(k.dtype == torch.float8_e4m3fn for k, _ in llm.runner.kv_caches)
    scales = [layer.self_attn.kv_scales for layer in llm.model.model.layers]
    assert len({id(s.k_scale) for s in scales}) == len(scales)          # one scale tensor per layer
    same = sum(a == b for o, e in zip(outputs, expected) for a, b in zip(o.token_ids, e))
    agreement = same / (len(prompts) * MAX_TOKENS)
    print(f"gemma2 fp8_e4m3 KV: greedy agreement with fp32 KV {agreement:.2f}, preempted_swap "
          f"{llm.stats()['preempted_swap']}")
    assert llm.stats()["used_blocks"] == 0
    llm.bm.check_invariants()


@pytest.mark.parametrize("tiny", ["qwen3", "gemma3"], indirect=True)
@pytest.mark.parametrize("norm", ["q_norm", "k_norm"])
def test_qk_norm_is_on_the_way(tiny, norm):
    """Qwen3's and Gemma 3's per-head query and key norms are applied: resetting either one's weights changes the
    tokens (so the equality with transformers above could not hold without them)."""
    _, path, prompts, expected = tiny
    llm = LLM(path, block_size=4)
    with torch.no_grad():
        for layer in llm.model.model.layers:
            module = getattr(layer.self_attn, norm)
            module.weight.fill_(1.0)
            if hasattr(module, "after_loading"):      # Gemma's (1 + weight) gain
                module.after_loading()
    got = llm.generate(prompts[:3], GREEDY)
    assert [o.token_ids for o in got] != expected[:3]


@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096, rope_theta=150000.0),                        # gpt-oss
    dict(rope_type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
         original_max_position_embeddings=4096, rope_theta=10000.0),                          # DeepSeek V3
    dict(rope_type="yarn", factor=4.0, mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=256,
         rope_theta=10000.0),
    dict(rope_type="yarn", factor=8.0, attention_factor=0.5, original_max_position_embeddings=64, rope_theta=500.0),
])
def test_yarn_rope_is_transformers(rope):
    """YaRN's frequencies and its cos/sin factor equal transformers' rope initialiser's."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagedkv.engine.models.layers import rope_attention_factor, rope_inv_freq

    hf = dict(vocab_size=100, hidden_size=128, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
              max_position_embeddings=16384, rope_parameters=rope)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](LlamaConfig(**hf), "cpu")
    cfg = ModelConfig.from_dict(dict(hf, architectures=["LlamaForCausalLM"]))
    torch.testing.assert_close(rope_inv_freq(cfg), want_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(want_factor, rel=1e-12)
    assert not torch.equal(rope_inv_freq(cfg), rope_inv_freq(ModelConfig.from_dict(
        dict(hf, architectures=["LlamaForCausalLM"], rope_parameters={"rope_theta": rope["rope_theta"]}))))


@pytest.mark.parametrize("tiny", ["deepseek_v3"], indirect=True)
def test_latent_pool_holds_more_tokens_per_byte(tiny):
    """The same kv_cache_bytes holds kv_lora_rank + qk_rope_head_dim elements per token and layer, where a K/V
    cache of the same model (every head's key of qk_nope + qk_rope and value of v_head_dim) needs
    num_heads * (16 + 8 + 12): 40 against 144, 3.6 times the tokens."""
    import pagedkv

    _, path, prompts, expected = tiny
    budget = 1 << 20
    llm = LLM(path, block_size=4, kv_cache_bytes=budget)
    cfg = llm.model_config
    per_block = pagedkv.mla_block_bytes(num_layers=3, block_size=4, kv_lora_rank=32, qk_rope_head_dim=8,
                                        dtype=torch.float32)
    assert per_block == 3 * 4 * 40 * 4 and llm.num_blocks == budget // per_block
    assert all(len(slot) == 1 and slot[0].shape == (llm.num_blocks, 4, 40) for slot in llm.runner.kv_caches)
    kv_block = 3 * 4 * cfg.num_heads * (16 + 8 + 12) * 4        # the K/V cache's bytes per block
    assert llm.num_blocks >= 3.5 * (budget // kv_block)
    assert [o.token_ids for o in llm.generate(prompts[:2], GREEDY)] == expected[:2]


def test_deepseek_v3_without_q_lora(tmp_path):
    """q_lora_rank null: one q_proj in place of q_a_proj, its norm and q_b_proj."""
    model = save_tiny_model(tmp_path, "deepseek_v3", seed=1, q_lora_rank=None)
    assert model.model.layers[0].self_attn.q_proj is not None
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=1, per_system=2)[:4]
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    llm = LLM(tmp_path, block_size=4)
    assert hasattr(llm.model.model.layers[0].self_attn, "q_proj")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("tiny", ["deepseek_v3"], indirect=True)
@pytest.mark.parametrize("setting, field", [(dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype"),
                                            (dict(tensor_parallel_size=2), "tensor_parallel_size")])
def test_deepseek_v3_refuses_what_the_latent_cache_cannot_take(tiny, setting, field):
    _, path, _, _ = tiny
    with pytest.raises(ValueError, match=field):
        LLM(path, block_size=4, **setting)


@pytest.mark.parametrize("tiny", ["deepseek_v3"], indirect=True)
@pytest.mark.parametrize("fields, message", [(dict(n_group=3), "n_group"), (dict(topk_group=5), "topk_group"),
                                             (dict(num_experts_per_tok=5), "num_experts_per_tok"),
                                             (dict(qk_rope_head_dim=7), "qk_rope_head_dim")])
def test_deepseek_v3_routing_it_cannot_run_is_refused(tiny, tmp_path, fields, message):
    _, path, _, _ = tiny
    with pytest.raises(ValueError, match=message):
        LLM(edited_copy(path, tmp_path / "edited", **fields), block_size=4)


@pytest.mark.parametrize("tiny", ["deepseek_v3"], indirect=True)
def test_deepseek_v3_skips_the_multi_token_prediction_layers(tiny, tmp_path):
    """Layers past num_hidden_layers (DeepSeek V3's MTP module, model.layers.61 in the real checkpoint) are
    not run, as in transformers; any other unknown tensor is still refused."""
    from safetensors.torch import save_file

    _, path, prompts, expected = tiny
    copy = edited_copy(path, tmp_path / "mtp")
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(112, 32)}, copy / "mtp.safetensors")
    assert [o.token_ids for o in LLM(copy, block_size=4).generate(prompts[:2], GREEDY)] == expected[:2]
    save_file({"model.layers.0.mlp.extra.weight": torch.zeros(4)}, copy / "mtp.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra.weight"):
        LLM(copy, block_size=4)


@pytest.mark.parametrize("tiny", ["deepseek_v3"], indirect=True)
@pytest.mark.parametrize("disk", [False, True])
def test_deepseek_v3_latent_blocks_through_the_host_and_disk_tiers(tiny, tmp_path, disk):
    """A pool of 24 blocks (one sequence): each prompt's blocks are pushed out by the next ones, kept in the
    host tier (or, through a small host tier, on disk), and brought back for the second round; the tokens stay
    transformers'."""
    _, path, prompts, expected = tiny
    host_blocks = 8 if disk else 64
    tiers = dict(host_cache_bytes=host_blocks * 3 * 4 * 40 * 4)     # latent blocks: 3 layers x 4 tokens x 40
    if disk:
        tiers.update(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)
    llm = LLM(path, block_size=4, num_blocks=24, max_num_batched_tokens=64, **tiers)
    assert llm.runner.host_tier.shape == (host_blocks, 3, 4, 40)
    for _ in range(2):
        assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected
    stats = llm.stats()
    assert stats["offloaded_blocks"] > 0 and stats["loaded_blocks"] > 0 and stats["host_hit_blocks"] > 0, stats
    assert stats["load_failures"] == 0 and stats["offload_failures"] == 0
    if disk:
        assert stats["disk_writes"] > 0 and stats["disk_reads"] > 0 and stats["disk_hit_blocks"] > 0, stats
    llm.bm.check_invariants()


@pytest.mark.parametrize("tiny", ["deepseek_v3"], indirect=True)
def test_deepseek_v3_latent_blocks_loaded_from_the_host_are_read(tiny, monkeypatch):
    """Without the host-to-device copies the latent blocks a hit revives hold other tokens' rows: the tokens
    change (so the test above sees the loaded bytes)."""
    from pagedkv.engine.execution import model_runner

    _, path, prompts, expected = tiny
    llm = LLM(path, block_size=4, num_blocks=24, max_num_batched_tokens=64, host_cache_bytes=64 * 3 * 4 * 40 * 4)
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected
    monkeypatch.setattr(model_runner, "load_slots", lambda *args, **kwargs: None)
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] != expected
    assert llm.stats()["loaded_blocks"] > 0


@pytest.mark.parametrize("tiny", ["deepseek_v3"], indirect=True)
def test_deepseek_v3_speculative_drafts_on_the_latent_cache(tiny):
    """Prompt-lookup drafts verified several tokens a sequence per step (rows of the latent cache written and
    then rolled back where rejected): transformers' greedy tokens."""
    _, path, prompts, expected = tiny
    llm = LLM(path, block_size=4, speculative="ngram", num_speculative_tokens=3)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
