"""Speculative decoding by prompt lookup: the proposer against a brute-force reference, greedy acceptance,
and the engine's greedy output token for token identical with speculation on and off (and equal to
transformers), through prefix caching, chunked prefill, preemption by swap and recompute, n > 1 and
requests that sample."""
import math
import random
from collections import Counter

import pytest
import torch

from engine_fixtures import hf_greedy, save_tiny_llama
from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.serving.speculative import NgramProposer, accept_greedy, accept_sampled, check_speculative

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
MAX_TOKENS = 24


def reference_proposal(tokens, k, lookup_min, lookup_max, limit):
    """Longest n first, latest earlier occurrence (one with a token after it): the k tokens after it."""
    limit = min(k, limit)
    if limit <= 0:
        return []
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + limit]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_ngram_proposer_matches_brute_force(seed):
    rng = random.Random(seed)
    # Tokens whose int32 bytes repeat (0x01010101 ...) make the byte search find matches off a token
    # boundary; a small alphabet makes n-grams recur.
    alphabet = [rng.choice([1, 257, 65793, 16843009, 0, 2, 513]) for _ in range(4)] + [rng.randrange(1 << 20)]
    for _ in range(300):
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(0, 40))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi, limit = lo + rng.randrange(0, 3), rng.randrange(-1, 8)
        got = NgramProposer(k, lo, hi).propose(tokens, limit)
        assert got == reference_proposal(tokens, k, lo, hi, limit), (tokens, k, lo, hi, limit)


def test_ngram_proposer_examples():
    p = NgramProposer(3, 1, 2)
    assert p.propose([5, 6, 7, 8, 5, 6], 10) == [7, 8, 5]       # bigram (5, 6) recurs
    assert p.propose([5, 6, 7, 5, 9, 6, 1, 6], 10) == [1, 6]    # latest occurrence of 6 wins
    assert p.propose([1, 2, 3, 4], 10) == []
    assert p.propose([7, 7], 10) == [7]
    assert p.propose([5, 6, 7, 8, 5, 6], 1) == [7]


def test_accept_greedy():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]   # all accepted, plus the bonus token
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]          # the model's token replaces a miss
    assert accept_greedy([4], [3, 8]) == [3]
    assert accept_greedy([], [2]) == [2]


def test_accept_sampled_keeps_the_model_distribution():
    """Speculative sampling with a one-hot draft: the first token is distributed as probs[0], and after
    an accepted first draft the next one as probs[1], whatever the drafts are."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0], [0.1, 0.5, 0.1, 0.2, 0.1], [0.2] * 5])
    trials = 8000
    first, second = Counter(), Counter()
    for _ in range(trials):
        out = accept_sampled(probs, [1, 3], gen)
        assert 1 <= len(out) <= 3 and out[:-1] == [1, 3][:len(out) - 1]    # kept drafts, then one drawn
        first[out[0]] += 1
        if out[0] == 1:
            second[out[1]] += 1

    def close(counts, total, dist):
        return all(abs(counts[t] / total - p) <= 4.5 * math.sqrt(p * (1 - p) / total) + 1e-12
                   for t, p in enumerate(dist.tolist()))
    assert close(first, trials, probs[0]) and close(second, first[1], probs[1])
    assert accept_sampled(probs, [3, 0], gen)[0] != 3               # probability 0: never kept
    certain = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    assert accept_sampled(certain, [1], gen) == [1, 0]              # probability 1: always kept


def test_speculative_settings_are_checked():
    assert check_speculative("ngram", 4, 1, 3) == ("ngram", 4, 1, 3)
    with pytest.raises(ValueError, match="speculative must be"):
        check_speculative("eagle", 4, 1, 3)
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        check_speculative("ngram", 0, 1, 3)
    with pytest.raises(ValueError, match="needs speculative"):
        check_speculative(None, 2, 1, 3)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        check_speculative("ngram", 2, 3, 2)
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        check_speculative("ngram", 2.0, 1, 3)


def repetitive_prompts(vocab_size, seed=0):
    """Prompts that repeat a phrase (lookup finds drafts in them) and random ones, some sharing a prefix."""
    rng = random.Random(seed)
    phrase = [rng.randrange(3, vocab_size) for _ in range(7)]
    shared = [rng.randrange(3, vocab_size) for _ in range(21)]
    prompts = [phrase * 4 + [rng.randrange(3, vocab_size)], shared + phrase * 2, shared + phrase * 2 + phrase[:3]]
    prompts += [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    return prompts + [list(prompts[1])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_spec")
    model = save_tiny_llama(path, initializer_range=0.05)    # its greedy outputs often repeat themselves
    prompts = repetitive_prompts(model.config.vocab_size)
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    return str(path), prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SPEC = dict(speculative="ngram", num_speculative_tokens=4)


def check_accepted(llm):
    stats = llm.stats()
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert stats["used_blocks"] == 0
    llm.bm.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_output_identical_with_speculation(tiny, device, prefix_caching):
    path, prompts, expected = tiny
    spec = LLM(path, device=device, block_size=8, enable_prefix_caching=prefix_caching, **SPEC)
    plain = LLM(path, device=device, block_size=8, enable_prefix_caching=prefix_caching)
    for round_prompts, round_expected in ((prompts, expected), (prompts[::-1], expected[::-1])):
        got = [o.token_ids for o in spec.generate(round_prompts, GREEDY)]
        assert got == [o.token_ids for o in plain.generate(round_prompts, GREEDY)]
        assert got == round_expected
    check_accepted(spec)
    # Accepted drafts save decode passes: fewer (sequence, step) pairs decode the same outputs.
    assert spec.stats()["decode_tokens"] - spec.stats()["spec_draft_tokens"] < plain.stats()["decode_tokens"]
    if prefix_caching:
        # Rejected drafts never reach the prefix cache: both engines cache exactly the same blocks.
        assert set(spec.bm.cached_blocks()) == set(plain.bm.cached_blocks())
        assert spec.stats()["hits"] > 0


@pytest.mark.parametrize("num_cpu_blocks", [64, 0], ids=["swap", "recompute"])
@pytest.mark.parametrize("n", [1, 2])
def test_speculation_under_preemption_and_forks(tiny, num_cpu_blocks, n):
    path, prompts, expected = tiny
    llm = LLM(path, block_size=4, num_blocks=40, num_cpu_blocks=num_cpu_blocks, max_num_seqs=8, **SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
    outputs = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e] * n for e in expected]
    stats = llm.stats()
    assert stats["preempted_swap" if num_cpu_blocks else "preempted_recompute"] > 0
    assert stats["free_cpu_blocks"] == num_cpu_blocks
    check_accepted(llm)


@pytest.mark.parametrize("budget", [6, 13])
def test_speculation_with_chunked_prefill_and_a_token_budget(tiny, budget):
    path, prompts, expected = tiny
    llm = LLM(path, block_size=8, max_num_batched_tokens=budget, history_size=10_000, **SPEC)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(h["tokens"] <= max(budget, h["decodes"]) for h in llm.history)   # drafts fit the budget
    assert sum(h["tokens"] for h in llm.history) == llm.stats()["prefill_tokens"] + llm.stats()["decode_tokens"]
    check_accepted(llm)


def test_max_tokens_stop_tokens_and_model_length(tiny):
    """Accepted drafts stop at max_tokens and at a stop token exactly as one-token decoding does."""
    path, prompts, expected = tiny
    llm = LLM(path, block_size=8, **SPEC)
    for max_tokens in (1, 2, 5, 11):
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        assert [o.token_ids for o in outs] == [e[:max_tokens] for e in expected]
    stop = expected[0][9]
    outs = llm.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop]))
    assert outs[0].token_ids == expected[0][:expected[0].index(stop) + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    check_accepted(llm)


def test_model_length_bounds_drafts(tmp_path):
    save_tiny_llama(tmp_path, max_position_embeddings=40, initializer_range=0.05)
    prompt = [5, 6, 7, 8] * 8 + [5]
    plain = LLM(tmp_path, block_size=4).generate(prompt, GREEDY)
    spec = LLM(tmp_path, block_size=4, **SPEC).generate(prompt, GREEDY)
    assert spec[0].token_ids == plain[0].token_ids and len(spec[0].token_ids) == 40 - len(prompt)
    assert spec[0].outputs[0].finish_reason == "length"


def test_sampled_requests_speculate_next_to_greedy_ones(tiny):
    """Greedy requests stay exact next to sampled ones; sampled ones speculate too (speculative sampling),
    reproducibly for a seed, and a near-greedy temperature follows the greedy output."""
    path, prompts, expected = tiny
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    params = [GREEDY, sampled] * (len(prompts) // 2) + [GREEDY] * (len(prompts) % 2)
    runs = []
    for _ in range(2):
        llm = LLM(path, block_size=8, seed=3, **SPEC)
        runs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)])
        check_accepted(llm)
    assert runs[0] == runs[1]
    for i, (out, exp) in enumerate(zip(runs[0], expected)):
        assert out == [exp] if i % 2 == 0 else all(len(c) == MAX_TOKENS for c in out) and len(out) == 2
    cold = SamplingParams(temperature=1e-4, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(path, block_size=8, **SPEC)
    assert [o.token_ids for o in llm.generate(prompts, cold)] == expected
    check_accepted(llm)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_reduced_precision_agreement(tiny, dtype):
    """bf16: the verifying forward rounds differently from one-token decodes, so a near-tie may flip;
    the outputs must still agree on most tokens."""
    path, prompts, _ = tiny
    spec = LLM(path, dtype=dtype, block_size=8, **SPEC).generate(prompts, GREEDY)
    plain = LLM(path, dtype=dtype, block_size=8).generate(prompts, GREEDY)
    same = sum(a == b for s, p in zip(spec, plain) for a, b in zip(s.token_ids, p.token_ids))
    assert same >= 0.8 * len(prompts) * MAX_TOKENS


@pytest.mark.parametrize("point", [("bm", "truncate", False), ("bm", "truncate", True), ("bm", "can_append", True),
                                   ("bm", "append_tokens", True), ("runner", "_sample", True),
                                   ("bm", "mark_computed", False)],
                         ids=lambda p: f"{'after' if p[2] else 'before'}-{p[1]}")
def test_failed_speculative_step_is_rolled_back(tiny, point):
    """A step that raises around the speculative calls leaves no block behind and no draft in any
    sequence; stepping on gives the exact output."""
    from test_engine_faults import Fault, Injector, inject
    path, prompts, expected = tiny
    llm = LLM(path, block_size=4, num_blocks=40, num_cpu_blocks=40, max_num_seqs=8, **SPEC)
    inject(llm, point, Injector(Fault, at=3))
    requests = [llm.add_request(p, GREEDY) for p in prompts]
    failures = 0
    while llm.has_unfinished():
        try:
            llm.step()
        except Fault:
            failures += 1
            assert llm.stats()["used_blocks"] == 0 and all(r.seqs[0].prefilled is False for r in requests
                                                           if not r.finished)
            llm.bm.check_invariants()
    assert failures == 1
    assert [llm._output(r).token_ids for r in requests] == expected
    check_accepted(llm)
