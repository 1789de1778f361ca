"""Windowed attention in the engine under pressure: Mistral (every layer windowed) and Gemma 2 (windowed
and full layers) keep transformers' greedy output token for token with windows of 5 to 16 tokens (some
not a multiple of the block size) over prompts plus generations several times the window, through
preemption by swap and by recompute, chunked prefill, prefix caching and n > 1."""
import json
import random
import shutil

import pytest

from engine_fixtures import hf_greedy, load_hf_eager, save_tiny_model, shared_prefix_prompts
from pagedkv.engine import LLM, SamplingParams

MAX_TOKENS = 32
WINDOWS = [5, 8, 16]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{model type: saved checkpoint dir} (window 8)."""
    out = {}
    for model_type in ("mistral", "gemma2"):
        path = tmp_path_factory.mktemp(f"window_{model_type}")
        save_tiny_model(path, model_type)
        out[model_type] = path
    return out


@pytest.fixture(scope="module")
def windowed(request, checkpoints, tmp_path_factory):
    """(checkpoint dir with the window asked for, prompts, transformers' greedy outputs)."""
    model_type, window = request.param
    path = tmp_path_factory.mktemp(f"{model_type}_w{window}")
    shutil.rmtree(path)
    shutil.copytree(checkpoints[model_type], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, sliding_window=window)))
    reference = load_hf_eager(path)
    prompts = shared_prefix_prompts(config["vocab_size"], seed=window, per_system=2)
    return path, prompts, [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]


CASES = [(m, w) for m in ("mistral", "gemma2") for w in WINDOWS]
IDS = [f"{m}-w{w}" for m, w in CASES]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def check_clean(llm):
    stats = llm.stats()
    assert stats["used_blocks"] == 0 and stats["num_seqs"] == 0
    llm.bm.check_invariants()
    return stats


@pytest.mark.parametrize("windowed", CASES, ids=IDS, indirect=True)
@pytest.mark.parametrize("num_cpu_blocks", [48, 0], ids=["swap", "recompute"])
def test_preemption_keeps_output_exact(windowed, num_cpu_blocks):
    path, prompts, expected = windowed
    # 5 prompts of 38-56 tokens + 32 generated at block size 4: up to 22 blocks each; the pool holds ~2.
    llm = LLM(path, block_size=4, num_blocks=48, num_cpu_blocks=num_cpu_blocks)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    stats = check_clean(llm)
    assert stats["preempted_swap" if num_cpu_blocks else "preempted_recompute"] > 0


@pytest.mark.parametrize("windowed", CASES, ids=IDS, indirect=True)
@pytest.mark.parametrize("budget", [3, 13])
def test_chunked_prefill_across_windows(windowed, budget):
    """Prefill chunks of 3 or 13 tokens: chunk edges fall inside and across windows and blocks."""
    path, prompts, expected = windowed
    llm = LLM(path, block_size=4, max_num_batched_tokens=budget)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=2))
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected]
    check_clean(llm)


@pytest.mark.parametrize("windowed", [("gemma2", 5), ("mistral", 16)], ids=["gemma2-w5", "mistral-w16"],
                         indirect=True)
def test_random_configurations(windowed):
    """Random block sizes, pools (some too small), swap space, caching, n, token budgets: every output
    is transformers' prefix (or fails with a clear error), nothing leaks."""
    path, prompts, expected = windowed
    rng = random.Random(7)
    for _ in range(8):
        bs = rng.choice([1, 2, 4, 8])
        need = max(-(-(len(p) + MAX_TOKENS) // bs) for p in prompts)
        num_blocks = rng.randint(need, need * 3)
        llm = LLM(path, block_size=bs, num_blocks=num_blocks, num_cpu_blocks=rng.choice([0, num_blocks]),
                  enable_prefix_caching=rng.random() < 0.7, max_num_seqs=rng.randint(2, 8),
                  max_num_batched_tokens=rng.choice([7, 24, 4096]))
        idx = [rng.randrange(len(prompts)) for _ in range(rng.randint(2, 6))]
        params = [SamplingParams(max_tokens=rng.randint(1, MAX_TOKENS), n=rng.choice([1, 2]), ignore_eos=True)
                  for _ in idx]
        for out, i, sp in zip(llm.generate([prompts[i] for i in idx], params), idx, params):
            assert out.error is None
            assert [c.token_ids for c in out.outputs] == [expected[i][:sp.max_tokens]] * sp.n
        check_clean(llm)
