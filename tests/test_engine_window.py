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


CASES = [(m, w) for m in ("mistral", "gemma2") for w in (5, 8, 16)]
IDS = [f"{m}-w{w}" for m, w in CASES]
# A Mistral whose window is well below its prompts never outgrows the pool once admitted (it releases a
# block for each one it takes), so it is preempted only with windows near the prompts' lengths.
PREEMPTED = [("mistral", 24), ("mistral", 40), ("gemma2", 5), ("gemma2", 8), ("gemma2", 16)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def check_clean(llm):
    stats = llm.stats()
    assert stats["used_blocks"] == 0 and stats["num_seqs"] == 0
    llm.bm.check_invariants()
    return stats


@pytest.mark.parametrize("windowed", PREEMPTED, ids=[f"{m}-w{w}" for m, w in PREEMPTED], indirect=True)
@pytest.mark.parametrize("num_cpu_blocks", [48, 0], ids=["swap", "recompute"])
def test_preemption_keeps_output_exact(windowed, num_cpu_blocks):
    path, prompts, expected = windowed
    # 5 prompts of 38-56 tokens + 32 generated at block size 4: up to 22 blocks each in every group. A
    # sequence is (re)admitted with a block per 4 tokens in every group, released only once computed, so
    # the pool holds one whole sequence per group (Gemma 2: 2 x 22) and a little more.
    num_blocks = 48 if path.name.startswith("gemma2") else 32
    llm = LLM(path, block_size=4, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks)
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
    """Random block sizes, pools (down to one whole sequence in every group: what a recomputed sequence
    takes), swap space, caching, n, token budgets: every output is transformers', nothing leaks."""
    path, prompts, expected = windowed
    rng = random.Random(7)
    groups = 2 if path.name.startswith("gemma2") else 1
    for _ in range(8):
        bs = rng.choice([1, 2, 4, 8])
        need = groups * max(-(-(len(p) + MAX_TOKENS) // bs) for p in prompts)
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


@pytest.mark.parametrize("windowed", [("mistral", 8), ("gemma2", 8)], ids=["mistral-w8", "gemma2-w8"],
                         indirect=True)
@pytest.mark.parametrize("block_size", [4, 3])
def test_blocks_held_stay_within_the_window(windowed, block_size):
    """One sequence decoding far past its window: a windowed group holds the blocks overlapping its last
    `window` positions (at most window // block_size + 2), the full-attention group (Gemma 2) every block."""
    path, prompts, expected = windowed
    window, prompt = 8, prompts[0]
    llm = LLM(path, block_size=block_size, enable_prefix_caching=False, history_size=1000)
    assert llm.bm.group_windows == llm.model_config.group_windows
    out = llm.generate(prompt, GREEDY)[0]
    assert out.token_ids == expected[0]
    full_layers = llm.model_config.group_windows[0] is None
    decode_steps = list(llm.history)[1:-1]          # after the prefill, before the end frees everything
    assert len(decode_steps) == MAX_TOKENS - 2
    for i, step in enumerate(decode_steps):
        length = len(prompt) + 1 + i                 # tokens with KV after this step
        full = -(-length // block_size)
        windowed_bound = window // block_size + 2
        assert step["used_blocks"] <= (full if full_layers else 0) + windowed_bound, (i, step)
    assert decode_steps[-1]["used_blocks"] < (2 if full_layers else 1) * full   # something was released
    check_clean(llm)


def test_gemma2_layers_share_cache_tensors(checkpoints, tmp_path):
    """Layer i of each group shares tensor i: half the tensors, so a byte budget holds twice the block
    ids of the same model with every layer full (one group)."""
    path = checkpoints["gemma2"]
    llm = LLM(path, block_size=4, kv_cache_bytes=1 << 20)
    cfg = llm.model_config
    assert cfg.group_windows == [None, 8] and llm.bm.num_groups == 2
    assert len(llm.runner.kv_caches) == cfg.num_layers // 2
    shutil.copytree(path, tmp_path / "full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    (tmp_path / "full" / "config.json").write_text(json.dumps(dict(config, layer_types=["full_attention"] * 4)))
    full = LLM(tmp_path / "full", block_size=4, kv_cache_bytes=1 << 20)
    assert full.bm.num_groups == 1 and len(full.runner.kv_caches) == cfg.num_layers
    assert llm.num_blocks == 2 * full.num_blocks


@pytest.mark.parametrize("windowed", [("mistral", 8), ("gemma2", 5)], ids=["mistral-w8", "gemma2-w5"],
                         indirect=True)
def test_speculative_decoding_with_windows(windowed):
    """Prompt-lookup drafts verified over windowed layers; rejected drafts roll back without touching
    what the window released."""
    path, prompts, expected = windowed
    llm = LLM(path, block_size=4, speculative="ngram", num_speculative_tokens=3)
    repeated = [p[-6:] * 5 for p in prompts[:3]]        # repetitive prompts: lookup finds drafts
    reference = load_hf_eager(path)
    want = [hf_greedy(reference, p, MAX_TOKENS) for p in repeated]
    outputs = llm.generate(prompts + repeated, GREEDY)
    assert [o.token_ids for o in outputs] == expected + want
    assert llm.stats()["spec_draft_tokens"] > 0
    check_clean(llm)


@pytest.mark.parametrize("model_type, groups", [("mistral", 1), ("gemma2", 2)])
def test_budget_sized_pool_holds_a_full_length_sequence_per_group(checkpoints, model_type, groups):
    """A roomy byte budget is capped at what max_num_seqs full-length sequences are admitted with: a
    block per block_size tokens in every group."""
    llm = LLM(checkpoints[model_type], block_size=4, max_num_seqs=1, kv_cache_bytes=1 << 30)
    assert llm.num_blocks == groups * -(-llm.max_model_len // 4)
    prompt = [3 + i % 300 for i in range(llm.max_model_len - 8)]     # the longest sequence the model takes
    out = llm.generate(prompt, SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert out.error is None and len(out.token_ids) == 7


@pytest.mark.parametrize("windowed", [("mistral", 8), ("mistral", 5), ("gemma2", 8)],
                         ids=["mistral-w8", "mistral-w5", "gemma2-w8"], indirect=True)
@pytest.mark.parametrize("budget", [4, 9])
def test_prompts_longer_than_the_pool_prefill_in_chunks(windowed, budget):
    """A pool smaller than a whole prompt (Mistral), or than a prompt in both groups (Gemma 2): the prompt
    is admitted by its first chunk and reserves each later one as its window releases the oldest blocks;
    preemption by recompute readmits it the same way. Output still equals transformers'."""
    path, prompts, expected = windowed
    gemma2 = path.name.startswith("gemma2")
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = -(-longest // 4) + 6 if gemma2 else 10     # Gemma 2: the full group's blocks + a few
    llm = LLM(path, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget)
    # Whole, a prompt (Mistral) or a full-length sequence readmitted after recompute (Gemma 2) would not fit.
    assert llm.bm.blocks_held(max(map(len, prompts)) if not gemma2 else longest) > num_blocks
    requests = [llm.add_request(p, GREEDY) for p in prompts]
    while llm.has_unfinished():
        llm.step()
        llm.scheduler.check_consistency()       # the manager's tokens stay each sequence's prefix
    assert [r.error for r in requests] == [None] * len(prompts)
    assert [r.seqs[0].output_token_ids for r in requests] == expected
    stats = check_clean(llm)
    assert stats["preempted_recompute"] > 0 or not gemma2
