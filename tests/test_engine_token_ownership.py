"""One owner for a sequence's tokens: the Sequence holds them, the block manager holds exactly the prefix
that has KV slots (Scheduler.check_consistency, checked after every step) through prefix caching, chunked
prefill, preemption by swap and by recompute, n > 1, speculative decoding and aborts."""
import random

import pytest

from engine_fixtures import save_tiny_llama, shared_prefix_prompts
from pagedkv.engine import LLM, SamplingParams

SETTINGS = {
    "prefix-swap-chunked": dict(block_size=4, num_blocks=40, num_cpu_blocks=64, max_num_batched_tokens=13),
    "recompute-n3": dict(block_size=8, num_blocks=20, enable_prefix_caching=False),
    "speculative": dict(block_size=4, num_blocks=48, num_cpu_blocks=32, speculative="ngram",
                        num_speculative_tokens=3),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_owner")
    model = save_tiny_llama(path)
    return str(path), model.config.vocab_size


@pytest.mark.parametrize("name", SETTINGS)
def test_block_manager_tokens_are_a_view_of_the_sequence(checkpoint, name):
    path, vocab = checkpoint
    llm = LLM(path, **SETTINGS[name])
    rng = random.Random(f"token-ownership/{name}")   # a fixed draw per setting: the asserted preemptions
                                                     # and copies depend on the prompts and lengths drawn
    prompts = shared_prefix_prompts(vocab, seed=rng.randrange(1000))
    prompts += [p[-5:] * 4 for p in prompts[:3]]          # repetitive: n-gram drafts find matches
    requests = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0 if i % 2 or name == "speculative" else 0.8, ignore_eos=True,
                                max_tokens=rng.randrange(4, 24), n=3 if name == "recompute-n3" and i < 3 else 1)
        requests.append(llm.add_request(prompt, params))
    steps, aborted = 0, False
    while llm.requests:
        llm.step()
        steps += 1
        llm.scheduler.check_consistency()
        if steps == 7 and not aborted:                   # an abort mid-flight leaves the rest consistent
            llm.abort(requests[1].request_id)
            aborted = True
            llm.scheduler.check_consistency()
    stats = llm.stats()
    assert stats["used_blocks"] == 0
    if name == "prefix-swap-chunked":
        assert stats["preempted_swap"] > 0
    if name == "recompute-n3":
        assert stats["preempted_recompute"] > 0 and stats["cow_copies"] > 0
    if name == "speculative":
        assert stats["spec_draft_tokens"] > 0
    llm.bm.check_invariants()


def test_check_consistency_catches_a_divergence(checkpoint):
    path, vocab = checkpoint
    llm = LLM(path, block_size=4, num_blocks=40)
    llm.add_request(list(range(3, 20)), SamplingParams(max_tokens=8, ignore_eos=True))
    llm.step()
    llm.step()
    seq = llm.scheduler.running[0]
    seq.token_ids[2] += 1                                # the Sequence and the manager now disagree
    with pytest.raises(AssertionError, match=f"sequence {seq.seq_id}"):
        llm.scheduler.check_consistency()
