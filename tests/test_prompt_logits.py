"""LLM.prompt_logits (teacher-forced logits through chunked prefill over the paged cache) against
transformers' full forward, on a one-group model and on Gemma 2's windowed + full groups; bad input is an
error that leaves the engine as it was."""
import pytest
import torch

from engine_fixtures import save_tiny_model
from pagedkv.engine import LLM, SamplingParams


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_prompt_logits_equal_a_full_forward(tmp_path, model_type, chunk_size, rng):
    hf = save_tiny_model(tmp_path, model_type)
    llm = LLM(tmp_path, num_blocks=64)
    ids = [rng.randrange(3, 384) for _ in range(40)]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = llm.prompt_logits(ids, chunk_size=chunk_size)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_bad_input_leaves_the_engine_as_it_was(tmp_path):
    save_tiny_model(tmp_path, "llama")
    llm = LLM(tmp_path, num_blocks=8)            # 128 token slots
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    fresh = LLM(tmp_path, num_blocks=8).generate([[5, 6, 7]], params)[0].token_ids
    free = llm.bm.num_free_blocks
    for bad, error in [([], ValueError), ([1, 10**12], ValueError), ([1, -1], ValueError), ([1.5], TypeError),
                       ("text", TypeError), (list(range(1, 200)), ValueError)]:
        with pytest.raises(error):
            llm.prompt_logits(bad)
        assert llm.bm.num_free_blocks == free
    with pytest.raises(ValueError):
        llm.prompt_logits([1, 2], chunk_size=0)
    first = llm.prompt_logits(list(range(1, 100)))
    assert llm.bm.num_free_blocks == free
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == fresh
    torch.testing.assert_close(llm.prompt_logits(list(range(1, 100))), first, rtol=0, atol=0)
    llm.bm.check_invariants()
