"""The engine with a float8 KV cache (kv_cache_dtype="fp8_e4m3" / "fp8_e5m2", kv_scale="dynamic" or
fixed): end to end with prefix caching on and off, preemption by swap and by recompute, TP=2 (each rank
its heads' scales), the dynamic scale rule, the rotated rule against it and the default (rotated, with
each query's latest tokens and the first block at full precision) on the real model,
scales and rule in the prefix-cache salt, argument checks."""
import pytest
import torch

from engine_fixtures import tiny_llama_and_outputs
from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.kv.quant import HEADROOM

MAX_TOKENS = 12
PLAIN = dict(kv_recent_tokens=0, kv_first_block=False)     # every key from the float8 cache
ROTATED_MIN_TOP1, ROTATED_MAX_KL = 0.935, 0.015  # the rotated rule alone on the text (measured 94.8%, 1.2e-2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_and_outputs(tmp_path_factory, "tiny_llama_fp8", MAX_TOKENS)


def greedy_outputs(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(a, b):
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    return same / sum(len(s) for s in a)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("setting", [
    dict(enable_prefix_caching=True, num_cpu_blocks=64, max_num_batched_tokens=20, num_blocks=24),
    dict(enable_prefix_caching=False, num_cpu_blocks=0, max_num_batched_tokens=4096, num_blocks=12),
    dict(enable_prefix_caching=True, num_cpu_blocks=0, max_num_batched_tokens=4096, num_blocks=200),
], ids=["prefix-swap-chunked", "noprefix-recompute", "prefix-roomy"])
@pytest.mark.parametrize("rule", ["default", "plain"])
def test_fp8_engine_end_to_end(tiny, kv_cache_dtype, setting, rule, capsys):
    path, prompts, expected = tiny
    llm = LLM(path, block_size=8, kv_cache_dtype=kv_cache_dtype, **setting, **(PLAIN if rule == "plain" else {}))
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    assert all(k.dtype == fp8 and v.dtype == fp8 for k, v in llm.runner.kv_caches)
    got = greedy_outputs(llm, prompts)
    assert [len(g) for g in got] == [MAX_TOKENS] * len(prompts)
    rate = agreement(got, expected)
    with capsys.disabled():
        print(f"\n{kv_cache_dtype} {setting}: greedy agreement with fp32 KV {rate:.2f}")
    again = greedy_outputs(llm, prompts[::-1])[::-1]    # a second round over a warm cache: same scales
    if rule == "plain":     # a hit reads exactly the bytes a cold run wrote
        assert again == got
    else:                   # a hit's latest tokens are read from float8 (their full-precision copies are gone)
        assert [len(g) for g in again] == [MAX_TOKENS] * len(prompts)
    stats = llm.stats()
    assert stats["used_blocks"] == 0
    if setting["num_blocks"] < 100:
        assert stats["preempted_swap" if setting["num_cpu_blocks"] else "preempted_recompute"] > 0
    if setting["enable_prefix_caching"]:
        assert stats["cached_prompt_tokens"] > 0
    llm.bm.check_invariants()


def test_dynamic_scales_follow_the_rule_and_stay_fixed(tiny):
    path, prompts, _ = tiny
    llm = LLM(path, block_size=8, kv_cache_dtype="fp8_e4m3")
    scales = llm.runner.kv_scales
    assert not any(s.fixed for s in scales) and llm.scheduler.cache_salt.endswith(b":unset")
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert all(s.fixed for s in scales)
    first = [(s.k_scale.clone(), s.v_scale.clone()) for s in scales]
    assert all(k.shape == (2,) and (k > 0).all() and (v > 0).all() for k, v in first)
    llm.generate(prompts[1:], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert all(torch.equal(k, s.k_scale) and torch.equal(v, s.v_scale) for (k, v), s in zip(first, scales))
    salt = llm.scheduler.cache_salt
    assert salt is not None and not salt.endswith(b":unset")


def test_dynamic_scale_rule_on_known_values():
    from pagedkv.engine.kv.quant import LayerKvScales
    s = LayerKvScales(2, torch.float8_e4m3fn, "dynamic", "cpu")
    key = torch.zeros(5, 2, 4)
    key[3, 0, 1] = -7.0
    key[1, 1, 2] = float("nan")          # ignored
    value = torch.ones(5, 2, 4) * 3.0
    s.observe(key, value)
    torch.testing.assert_close(s.k_scale, torch.tensor([7.0 * HEADROOM / 448, 1e-4 * HEADROOM / 448]))
    torch.testing.assert_close(s.v_scale, torch.full((2,), 3.0 * HEADROOM / 448))
    s.observe(key * 100, value * 100)    # never changed afterwards
    torch.testing.assert_close(s.v_scale, torch.full((2,), 3.0 * HEADROOM / 448))
    t = LayerKvScales(2, torch.float8_e5m2, "dynamic_tensor", "cpu")
    t.observe(key, value)
    torch.testing.assert_close(t.k_scale, torch.full((2,), 7.0 * HEADROOM / 57344))


def test_scales_are_part_of_the_prefix_cache_identity(tiny):
    path, prompts, _ = tiny
    salts = []
    for kv_scale in [0.05, 0.1]:
        llm = LLM(path, block_size=8, kv_cache_dtype="fp8_e4m3", kv_scale=kv_scale)
        assert all(torch.all(s.k_scale == kv_scale) for s in llm.runner.kv_scales)
        greedy_outputs(llm, prompts[:2])
        salts.append(llm.scheduler.cache_salt)
        # Blocks cached under these scales hit for this engine's salt, and never under another salt.
        tokens = prompts[0]
        assert llm.bm.can_allocate(tokens, cache_salt=salts[-1]).name != "NEVER"
    assert salts[0] != salts[1]
    auto = LLM(path, block_size=8)
    assert auto.scheduler.cache_salt is None


def test_fp8_kv_arguments_are_checked(tiny):
    path, _, _ = tiny
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(path, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_scale must be"):
        LLM(path, kv_cache_dtype="fp8_e4m3", kv_scale="static")
    with pytest.raises(ValueError, match="kv_scale must be a finite"):
        LLM(path, kv_cache_dtype="fp8_e4m3", kv_scale=-1.0)
    with pytest.raises(TypeError, match="kv_scale must be"):
        LLM(path, kv_cache_dtype="fp8_e4m3", kv_scale=True)


def test_fp8_kv_holds_four_times_the_blocks_of_fp32(tiny):
    path, _, _ = tiny
    budget = 1 << 20
    fp32 = LLM(path, block_size=8, kv_cache_bytes=budget, max_num_seqs=1024)
    fp8 = LLM(path, block_size=8, kv_cache_bytes=budget, max_num_seqs=1024, kv_cache_dtype="fp8_e5m2", **PLAIN)
    assert fp8.num_blocks == 4 * fp32.num_blocks
    from pagedkv.engine.execution.model_runner import kv_cache_block_bytes, recent_pool_bytes
    default = LLM(path, block_size=8, kv_cache_bytes=budget, max_num_seqs=1024, kv_cache_dtype="fp8_e5m2")
    recent = recent_pool_bytes(default.runner.model, default.config)
    assert 0 < recent <= budget // 4, "the recent pool takes at most a quarter of the budget"
    block = kv_cache_block_bytes(default.runner.model, 8, torch.float8_e5m2)
    assert default.num_blocks == (budget - recent) // block


def test_tp2_fp8_each_rank_its_heads_scales(tiny):
    path, prompts, _ = tiny
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = LLM(path, block_size=8, kv_cache_dtype="fp8_e4m3")
        want = greedy_outputs(single, prompts)
        with LLM(path, block_size=8, kv_cache_dtype="fp8_e4m3", tensor_parallel_size=2) as llm:
            got = greedy_outputs(llm, prompts)
            assert [len(g) for g in got] == [MAX_TOKENS] * len(prompts)
            for mine, whole in zip(llm.runner.kv_scales, single.runner.kv_scales):
                assert mine.k_scale.shape == (1,), "rank 0 holds one of the two KV heads"
                torch.testing.assert_close(mine.k_scale, whole.k_scale[:1], rtol=1e-4, atol=0)
                torch.testing.assert_close(mine.v_scale, whole.v_scale[:1], rtol=1e-4, atol=0)
            assert agreement(got, want) >= 0.75
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("head_dim", [64, 48])
def test_kv_rotation_is_orthogonal_and_keeps_q_dot_k(head_dim):
    from pagedkv.engine.kv.quant import LayerKvScales, kv_rotation
    r = kv_rotation(head_dim).double()
    torch.testing.assert_close(r @ r.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-6, rtol=0)
    s = LayerKvScales(2, torch.float8_e4m3fn, "rotated", "cpu", head_dim)
    q, k, v = (torch.randn(5, 2, head_dim) for _ in range(3))
    qr, kr, vr = s.rotate(q, k, v)
    torch.testing.assert_close((qr * kr).sum(-1), (q * k).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.unrotate(vr), v, atol=1e-5, rtol=1e-5)
    assert LayerKvScales(2, torch.float8_e4m3fn, "dynamic", "cpu", head_dim).rotate(q) == (q,)


def test_rotated_rule_is_the_default_and_the_dynamic_rule_stays_selectable(tiny):
    path, prompts, _ = tiny
    salts = {}
    for kv_scale in ["rotated", "dynamic"]:
        kwargs = dict(PLAIN) if kv_scale == "rotated" else dict(kv_scale=kv_scale, **PLAIN)
        llm = LLM(path, block_size=8, kv_cache_dtype="fp8_e4m3", **kwargs)
        assert all((s.rotation is not None) == (kv_scale == "rotated") for s in llm.runner.kv_scales)
        got = greedy_outputs(llm, prompts)      # random weights: accuracy is the real-model test's
        assert [len(g) for g in got] == [MAX_TOKENS] * len(prompts)
        assert greedy_outputs(llm, prompts[::-1])[::-1] == got, "a warm cache under the same rule"
        salts[kv_scale] = llm.scheduler.cache_salt
    assert salts["rotated"] != salts["dynamic"], "blocks of one rule never hit under the other"


def test_fp8_default_keeps_the_real_models_predictions():
    """Teacher forcing over the license text the model's package ships (2215 tokens, chunks of 512) on
    SmolLM2-135M, fp32 weights: top-1 agreement and KL per token of fp8 e4m3 KV against fp32 KV. The
    default rule (rotated, each query's latest 256 tokens and the first block at full precision) keeps
    >= 99% with KL <= 5e-3; the rotated rule alone and the per-head dynamic one stay selectable (measured:
    99.4% / 2.2e-4, 94.8% / 1.2e-2, 90.3% / 3.9e-2; docs/benchmarks.md)."""
    from pagedkv.demo.chat_workload import SMOLLM2_INSTALL, license_text, smollm2_path
    model = smollm2_path()
    if model is None:
        pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}")
    from pagedkv.engine.checkpoints.loader import open_checkpoint
    ids = open_checkpoint(model).tokenizer().encode(license_text()).ids
    reference = torch.log_softmax(LLM(model).prompt_logits(ids, chunk_size=512), -1)
    measured = {}
    for name, kwargs in [("default", {}), ("rotated", PLAIN), ("dynamic", dict(kv_scale="dynamic", **PLAIN))]:
        logits = LLM(model, kv_cache_dtype="fp8_e4m3", **kwargs).prompt_logits(ids, chunk_size=512)
        got = torch.log_softmax(logits, -1)
        kl = (reference.exp() * (reference - got)).sum(-1).mean().item()
        top1 = (reference.argmax(-1) == got.argmax(-1)).float().mean().item()
        measured[name] = (top1, kl)
    print(f"\nfp8 e4m3 KV vs fp32 KV (top-1, KL/token): {measured}")
    assert measured["default"][0] >= 0.99 and measured["default"][1] <= 5e-3, measured
    (top1, kl), (old_top1, old_kl) = measured["rotated"], measured["dynamic"]
    assert top1 >= ROTATED_MIN_TOP1 and kl <= ROTATED_MAX_KL, measured
    assert top1 >= old_top1 + 0.02 and kl <= old_kl * 0.6, measured
