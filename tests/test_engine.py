"""End-to-end tests of pagedkv.engine: greedy output equals Hugging Face transformers token for token,
through prefix caching, preemption (swap and recompute) and n > 1 samples sharing blocks."""

import copy
import random

import pytest
import torch

from engine_fixtures import hf_greedy, save_tiny_llama, shared_prefix_prompts
from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.serving.sampling import sample

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, HF model, prompts with shared prefixes, HF greedy outputs)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    model = save_tiny_llama(path)
    prompts = shared_prefix_prompts(model.config.vocab_size)
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    return str(path), model, prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers(tiny, device, prefix_caching):
    path, _, prompts, expected = tiny
    llm = LLM(path, device=device, block_size=8, enable_prefix_caching=prefix_caching)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts[::-1], GREEDY)   # a second round: the cache holds every prompt now
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected[::-1]
    stats = llm.stats()
    if prefix_caching:
        assert stats["cached_prompt_tokens"] > 0 and stats["hits"] > 0
    else:
        assert stats["cached_prompt_tokens"] == 0
    assert stats["used_blocks"] == 0, "every block is freed when its sequences finish"
    llm.bm.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_cpu_blocks", [64, 0], ids=["swap", "recompute"])
def test_preemption_keeps_output_exact(tiny, device, num_cpu_blocks):
    path, _, prompts, expected = tiny
    # 7 prompts of up to ~57 tokens + 20 generated, block_size 8: ~10 blocks each, the pool holds ~2.
    llm = LLM(path, device=device, block_size=8, num_blocks=24, num_cpu_blocks=num_cpu_blocks)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    if num_cpu_blocks:
        assert stats["preempted_swap"] > 0 and stats["swapped_in"] > 0
    else:
        assert stats["preempted_recompute"] > 0 and stats["preempted_swap"] == 0
    assert stats["used_blocks"] == 0
    llm.bm.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
def test_n_samples_fork_and_copy_on_write(tiny, device):
    path, _, prompts, expected = tiny
    llm = LLM(path, device=device, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    outputs = llm.generate(prompts[:3], params)
    for out, exp in zip(outputs, expected[:3]):
        assert len(out.outputs) == 3
        assert all(c.token_ids == exp for c in out.outputs)
    assert llm.stats()["cow_copies"] > 0      # prompt lengths are not multiples of the block size
    assert llm.stats()["prefill_tokens"] <= sum(len(p) for p in prompts[:3])   # one prefill per prompt


@pytest.mark.parametrize("num_cpu_blocks", [64, 0], ids=["swap", "recompute"])
def test_n_samples_under_preemption(tiny, num_cpu_blocks):
    path, _, prompts, expected = tiny
    llm = LLM(path, block_size=8, num_blocks=24, num_cpu_blocks=num_cpu_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    outputs = llm.generate(prompts[:4], params)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected[:4]]
    stats = llm.stats()
    assert stats["preempted_swap" if num_cpu_blocks else "preempted_recompute"] > 0
    assert stats["used_blocks"] == 0
    llm.bm.check_invariants()


@pytest.mark.parametrize("num_cpu_blocks", [40, 0], ids=["swap", "recompute"])
def test_mixed_workload_in_a_tight_pool(tiny, num_cpu_blocks):
    """Different n and max_tokens per request, a small block size and a pool that forces preemption."""
    path, _, prompts, expected = tiny
    llm = LLM(path, block_size=4, num_blocks=40, num_cpu_blocks=num_cpu_blocks, max_num_seqs=8)
    params = [SamplingParams(max_tokens=min(5 + 3 * i, MAX_TOKENS), n=1 + i % 3, ignore_eos=True)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    for out, exp, sp in zip(outputs, expected, params):
        assert out.error is None
        assert [c.token_ids for c in out.outputs] == [exp[:sp.max_tokens]] * sp.n
    stats = llm.stats()
    assert stats["preempted_swap"] + stats["preempted_recompute"] > 0 and stats["cow_copies"] > 0
    assert stats["used_blocks"] == 0 and stats["free_cpu_blocks"] == num_cpu_blocks
    llm.bm.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [5, 16, 41])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prefill_matches_transformers(tiny, device, budget, prefix_caching):
    """Prompts of 38-56 tokens under a token budget smaller than a prompt: each prompt is prefilled in
    chunks over several steps, next to other sequences' decodes, and n > 1 forks only at its end."""
    path, _, prompts, expected = tiny
    llm = LLM(path, device=device, block_size=8, enable_prefix_caching=prefix_caching,
              max_num_batched_tokens=budget, history_size=10_000)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=2))
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected]
    steps = llm.history
    assert all(h["tokens"] <= max(budget, h["decodes"]) for h in steps)   # decodes always run
    assert any(h["tokens"] == budget and h["decodes"] < budget for h in steps)   # budget-sized chunks
    assert sum(h["tokens"] for h in steps) == llm.stats()["prefill_tokens"] + llm.stats()["decode_tokens"]
    assert llm.stats()["used_blocks"] == 0
    llm.bm.check_invariants()


@pytest.mark.parametrize("num_cpu_blocks", [64, 0], ids=["swap", "recompute"])
def test_chunked_prefill_under_preemption(tiny, num_cpu_blocks):
    path, _, prompts, expected = tiny
    llm = LLM(path, block_size=8, num_blocks=24, num_cpu_blocks=num_cpu_blocks, max_num_batched_tokens=12)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats["preempted_swap" if num_cpu_blocks else "preempted_recompute"] > 0
    assert stats["used_blocks"] == 0
    llm.bm.check_invariants()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_follows_transformers(tiny, dtype):
    """bf16 / fp16 weights and KV (fused layer ops rounding where HF rounds, packed projections off as
    they are fp32-only): greedy tokens follow HF's model in the same dtype. Exact equality over a whole
    generation is not a contract in reduced precision, so a late divergence is tolerated."""
    path, model, prompts, _ = tiny
    reference = copy.deepcopy(model).to(dtype)          # the fixture's model stays fp32
    expected = [hf_greedy(reference, p, 8) for p in prompts]
    llm = LLM(path, dtype=dtype, block_size=8)
    outputs = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
    first_diff = [next((i for i, (a, b) in enumerate(zip(out, exp)) if a != b), 8)
                  for out, exp in zip(outputs, expected)]
    assert min(first_diff) >= 4 and sum(d == 8 for d in first_diff) >= len(prompts) - 1, first_diff


def test_random_configurations_match_reference(tiny):
    """Random block sizes, pool sizes (some too small), swap space, caching, n, max_tokens, token budgets
    (some below a prompt's length: chunked prefill) and
    packed or plain CPU projections: every output is the reference's prefix (or fails with a clear
    error), and nothing leaks."""
    path, _, prompts, expected = tiny
    rng = random.Random(0)
    errors = 0
    for _ in range(30):
        bs = rng.choice([1, 2, 4, 8, 16])
        need = max(-(-(len(p) + MAX_TOKENS) // bs) for p in prompts)
        num_blocks = rng.randint(max(1, need // 2), need * 2)
        llm = LLM(path, block_size=bs, num_blocks=num_blocks, num_cpu_blocks=rng.choice([0, num_blocks]),
                  enable_prefix_caching=rng.random() < 0.7, max_num_seqs=rng.randint(3, 16),
                  max_num_batched_tokens=rng.choice([7, 24, 64, 4096]), pack_cpu_weights=rng.random() < 0.5)
        idx = [rng.randrange(len(prompts)) for _ in range(rng.randint(1, 10))]
        params = [SamplingParams(max_tokens=rng.randint(1, MAX_TOKENS), n=rng.choice([1, 1, 2, 3]), ignore_eos=True)
                  for _ in idx]
        for out, i, sp in zip(llm.generate([prompts[i] for i in idx], params), idx, params):
            if out.error:
                errors += 1
                assert any(m in out.error for m in ("never fit", "outgrew", "max_num_seqs")), out.error
                assert all(c.token_ids == expected[i][:len(c.token_ids)] for c in out.outputs)
            else:
                assert [c.token_ids for c in out.outputs] == [expected[i][:sp.max_tokens]] * sp.n
        assert llm.stats()["used_blocks"] == 0 and llm.stats()["num_seqs"] == 0
        llm.bm.check_invariants()
    assert errors > 0     # some pools were too small, and that was reported per request


def test_random_sampling_is_seeded(tiny):
    path, model, prompts, _ = tiny
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, n=3)
    runs = [[c.token_ids for o in LLM(path, seed=7).generate(prompts[:2], params) for c in o.outputs]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(t) == 8 and all(0 <= x < model.config.vocab_size for x in t) for t in runs[0])
    assert len({tuple(t) for t in runs[0]}) > 1


def test_prompt_that_never_fits_fails_alone(tiny):
    path, _, prompts, expected = tiny
    llm = LLM(path, block_size=8, num_blocks=12)
    outputs = llm.generate([list(range(3, 200)), prompts[1]], GREEDY)
    assert outputs[0].error and "never fit" in outputs[0].error and outputs[0].token_ids == []
    assert outputs[1].error is None and outputs[1].token_ids == expected[1]


def test_sequence_outgrowing_the_pool_fails_with_partial_output(tiny):
    path, _, prompts, expected = tiny
    llm = LLM(path, block_size=8, num_blocks=8, num_cpu_blocks=16)     # 64 tokens at most
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert "outgrew" in out.error and out.outputs[0].finish_reason == "error"
    assert len(prompts[1]) + len(out.token_ids) == 65     # 64 tokens of KV + the last sampled token
    assert out.token_ids == expected[1][:len(out.token_ids)]
    assert llm.stats()["used_blocks"] == 0


def test_stop_tokens_and_max_tokens(tiny):
    path, _, prompts, expected = tiny
    llm = LLM(path, block_size=8)
    stop = expected[0][4]
    cut = expected[0].index(stop) + 1
    out = llm.generate([prompts[0], prompts[1]],
                       [SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop]), SamplingParams(max_tokens=3)])
    assert out[0].token_ids == expected[0][:cut] and out[0].outputs[0].finish_reason == "stop"
    assert out[1].token_ids == expected[1][:3] and out[1].outputs[0].finish_reason == "length"


def test_llama3_rope_tied_embeddings_sharded_checkpoint(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    model = save_tiny_llama(tmp_path, seed=1, tie_word_embeddings=True, rope_scaling=rope,
                            rope_theta=500000.0, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=1, num_systems=1, per_system=2, system_len=70)
    llm = LLM(str(tmp_path), block_size=16)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


def test_string_prompts_with_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = save_tiny_llama(tmp_path)
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(model.config.vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(str(tmp_path))
    out = llm.generate(["w5 w9 w30 w7", "w5 w9 w31"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert out[0].prompt_token_ids == [8, 12, 33, 10]
    assert out[0].token_ids == hf_greedy(model, [8, 12, 33, 10], 5)
    assert out[0].text == tok.decode(out[0].token_ids)


def test_sampler_temperature_and_top_p():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    greedy = sample(logits, torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0]), gen)
    assert greedy.tolist() == [1, 0]
    # top_p tiny keeps only the most likely token, whatever the temperature.
    nucleus = sample(logits, torch.tensor([5.0, 5.0]), torch.tensor([1e-3, 1e-3]), gen)
    assert nucleus.tolist() == [1, 0]
    draws = torch.stack([sample(logits, torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]), gen)
                         for _ in range(200)])
    assert set(draws[:, 0].tolist()) > {1}       # temperature 1 explores beyond the argmax
