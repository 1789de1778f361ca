"""Requests, sampling parameters and engine settings are checked where they are taken: a bad one raises
TypeError/ValueError naming it, nothing is queued, and the engine goes on serving valid requests."""
import math

import numpy as np
import pytest
import torch

from engine_fixtures import assert_greedy, hf_greedy, save_tiny_llama
from pagedkv.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    model = save_tiny_llama(path)
    return str(path), model


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], block_size=8, num_blocks=16)


def random_prompt(rng, vocab, lo=3, hi=30):
    return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]


def assert_untouched_and_serving(llm, model, rng):
    """Nothing was queued or allocated by the refused call, and a valid prompt still runs exactly."""
    assert not llm.has_unfinished() and not llm.requests
    assert llm.bm.stats()["used_blocks"] == 0 and llm.bm.stats()["num_seqs"] == 0
    prompt = random_prompt(rng, model.config.vocab_size)
    assert_greedy(model, prompt, llm.generate([prompt], GREEDY)[0].token_ids)
    llm.bm.check_invariants()


BAD_PROMPTS = [
    ([5, 2**63, 7], ValueError, "outside the vocabulary"),
    ([5, 384, 7], ValueError, "outside the vocabulary"),       # vocab_size is 384
    ([5, -1, 7], ValueError, "outside the vocabulary"),
    ([3.0, 4.0], TypeError, "prompt[0]"),
    ([3, None], TypeError, "prompt[1]"),
    ([3, True], TypeError, "prompt[1]"),
    ([3, "4"], TypeError, "prompt[1]"),
    ([[3, 4]], TypeError, "prompt"),
    (np.array([3.0, 4.0]), TypeError, "integer"),
    (np.array([[3, 4]]), TypeError, "1-D"),
    (torch.tensor([True, False]), TypeError, "integer"),
    (torch.tensor([3.0, 4.0]), TypeError, "integer"),
    ([], ValueError, "0 tokens"),
    ([7] * 512, ValueError, "512 tokens"),                  # max_position_embeddings is 512
    ("a string", ValueError, "tokenizer"),
]


@pytest.mark.parametrize("prompt, error, words", BAD_PROMPTS, ids=[repr(p)[:30] for p, _, _ in BAD_PROMPTS])
def test_bad_prompt_refused_before_anything_is_queued(tiny, llm, prompt, error, words, rng):
    good = random_prompt(rng, 384)
    with pytest.raises(error, match=None) as info:
        llm.generate([good, prompt, good], GREEDY)        # the good prompts around it are not queued either
    assert words in str(info.value) and "prompts[1]" in str(info.value)
    with pytest.raises(error):
        llm.add_request(prompt, GREEDY)
    assert_untouched_and_serving(llm, tiny[1], rng)


@pytest.mark.parametrize("kind", ["list", "numpy", "numpy-uint8", "torch", "torch-int32", "tuple"])
def test_integer_arrays_and_tensors_are_prompts(tiny, llm, kind, rng):
    prompt = random_prompt(rng, 256)
    as_kind = {"list": list, "numpy": np.array, "numpy-uint8": lambda p: np.array(p, dtype=np.uint8),
               "torch": torch.tensor, "torch-int32": lambda p: torch.tensor(p, dtype=torch.int32),
               "tuple": tuple}[kind]
    expected = hf_greedy(tiny[1], prompt, 6)
    outputs = [llm.generate([as_kind(prompt)], GREEDY)[0],
               llm.generate(as_kind(prompt), GREEDY)[0],                        # a single prompt
               llm.generate([np.int64(t) for t in prompt], GREEDY)[0],
               *llm.generate(torch.tensor([prompt, prompt]), GREEDY)]           # 2-D: one prompt per row
    assert len(outputs) == 5
    for out in outputs:
        assert_greedy(tiny[1], prompt, out.token_ids, expected)
    assert llm.bm.stats()["used_blocks"] == 0


BAD_PARAMS = [
    (dict(temperature=math.nan), ValueError, "temperature"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature=math.inf), ValueError, "temperature"),
    (dict(temperature="1"), TypeError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=math.nan), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(max_tokens=math.nan), TypeError, "max_tokens"),
    (dict(max_tokens=2.5), TypeError, "max_tokens"),
    (dict(max_tokens=2.0), TypeError, "max_tokens"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=True), TypeError, "max_tokens"),
    (dict(n=2.0), TypeError, "n"),
    (dict(n=0), ValueError, "n"),
    (dict(ignore_eos="yes"), TypeError, "ignore_eos"),
    (dict(stop_token_ids=2), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[2.0]), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[-3]), ValueError, "stop_token_ids"),
    (dict(stop_token_ids=None), TypeError, "stop_token_ids"),
]


@pytest.mark.parametrize("kwargs, error, name", BAD_PARAMS, ids=[repr(k) for k, _, _ in BAD_PARAMS])
def test_bad_sampling_params_refused_naming_the_field(kwargs, error, name):
    with pytest.raises(error, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_normalised_and_frozen():
    sp = SamplingParams(temperature=1, top_p=np.float32(0.5), max_tokens=np.int64(3), stop_token_ids=np.array([4, 7]))
    assert sp.stop_token_ids == [4, 7] and type(sp.max_tokens) is int and type(sp.temperature) is float
    with pytest.raises(AttributeError):
        sp.temperature = math.nan       # cannot be made invalid after the checks


@pytest.mark.parametrize("params, error, words", [
    (SamplingParams(stop_token_ids=[384]), ValueError, "stop_token_ids"),
    (SamplingParams(n=65), ValueError, "max_num_seqs"),
    ({"max_tokens": 3}, TypeError, "SamplingParams"),
    ("greedy", TypeError, "sampling_params"),
])
def test_bad_params_for_this_engine_refused(tiny, llm, params, error, words, rng):
    with pytest.raises(error, match=words):
        llm.generate([random_prompt(rng, 384)], params)
    assert_untouched_and_serving(llm, tiny[1], rng)


def test_params_tuple_and_count(tiny, llm, rng):
    prompts = [random_prompt(rng, 384) for _ in range(2)]
    out = llm.generate(prompts, (SamplingParams(max_tokens=2, ignore_eos=True), GREEDY))
    assert [len(o.token_ids) for o in out] == [2, 6]
    for prompt, o in zip(prompts, out):
        assert_greedy(tiny[1], prompt, o.token_ids)
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate(prompts, [GREEDY])
    assert_untouched_and_serving(llm, tiny[1], rng)


def test_step_with_nothing_queued_does_nothing(llm):
    assert llm.step() == [] and llm.stats()["used_blocks"] == 0


BAD_ENGINE = [
    (dict(block_size=0), ValueError, "block_size"),
    (dict(block_size=8.0), TypeError, "block_size"),
    (dict(num_blocks=0), ValueError, "num_blocks"),
    (dict(num_blocks=-4), ValueError, "num_blocks"),
    (dict(num_cpu_blocks=-1), ValueError, "num_cpu_blocks"),
    (dict(num_blocks=2**40), ValueError, "num_blocks"),
    (dict(num_cpu_blocks=2**33), ValueError, "num_cpu_blocks"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    (dict(kv_cache_bytes=-1), ValueError, "kv_cache_bytes"),
    (dict(kv_cache_bytes=100), ValueError, "kv_cache_bytes"),       # less than one block
    (dict(gpu_memory_utilization=0.0), ValueError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=math.nan), ValueError, "gpu_memory_utilization"),
    (dict(dtype="float64"), ValueError, "dtype"),
    (dict(dtype="fp16"), ValueError, "dtype"),
    (dict(dtype=torch.float64), ValueError, "dtype"),
    (dict(dtype=torch.int32), ValueError, "dtype"),
    (dict(device="tpu"), ValueError, "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (dict(device="gpu"), ValueError, "device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    (dict(device="cuda:x"), ValueError, "device must be 'cpu', 'cuda' or 'cuda:N'"),
    (dict(cpu_threads="many"), TypeError, "cpu_threads must be 'auto' or an int >= 1, got 'many'"),
    (dict(cpu_threads=0), ValueError, "cpu_threads must be 'auto' or an int >= 1, got 0"),
    (dict(cpu_threads=2.0), TypeError, "cpu_threads must be 'auto' or an int >= 1"),
    (dict(device="meta"), ValueError, "device"),
    (dict(device=0.5), TypeError, "device"),
    (dict(enable_prefix_caching="no"), TypeError, "enable_prefix_caching"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(history_size=-1), ValueError, "history_size"),
    (dict(pack_cpu_weights=None), TypeError, "pack_cpu_weights"),
]
if not torch.cuda.is_available():
    BAD_ENGINE.append((dict(device="cuda"), ValueError, "CUDA is not available"))


@pytest.mark.parametrize("kwargs, error, words", BAD_ENGINE, ids=[repr(k) for k, _, _ in BAD_ENGINE])
def test_bad_engine_settings_refused_naming_the_argument(tiny, kwargs, error, words):
    with pytest.raises(error, match=words):
        LLM(tiny[0], **kwargs)


@pytest.mark.parametrize("model_path, error, words", [
    (None, TypeError, "model_path must be a str or os.PathLike"),
    (5, TypeError, "model_path must be a str or os.PathLike"),
    ("/nonexistent/pagedkv-model", FileNotFoundError,
     "model_path '/nonexistent/pagedkv-model' is neither a directory nor a .gguf file"),
    ("/nonexistent/model.gguf", FileNotFoundError, "model_path '/nonexistent/model.gguf' is neither a directory"),
])
def test_bad_model_path_refused_naming_it(model_path, error, words):
    with pytest.raises(error, match=words):
        LLM(model_path)


def test_a_directory_without_config_json_is_refused_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model_path '{tmp_path}' has no config.json"):
        LLM(str(tmp_path))


def test_a_bad_item_of_a_sampling_params_list_is_named(tiny, llm, rng):
    prompts = [random_prompt(rng, 384) for _ in range(2)]
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams or None, got dict"):
        llm.generate(prompts, [GREEDY, {"max_tokens": 3}])
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        llm.add_request(prompts[0], {"max_tokens": 3})
    assert_untouched_and_serving(llm, tiny[1], rng)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu"), torch.device("cpu", 0)], ids=str)
def test_device_spellings_run_like_cpu(tiny, device, rng):
    """'cpu:0' and torch.device objects get what 'cpu' gets: float32 and packed projections."""
    llm = LLM(tiny[0], device=device, block_size=8)
    assert next(llm.model.parameters()).dtype == torch.float32
    assert any(type(m).__name__ == "PackedLinear" for m in llm.model.modules()) == \
        any(type(m).__name__ == "PackedLinear" for m in LLM(tiny[0], block_size=8).model.modules())
    prompts = [random_prompt(rng, 384) for _ in range(3)]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert_greedy(tiny[1], prompt, out.token_ids)


def test_history_is_opt_in_and_bounded(tiny, rng):
    prompts = [random_prompt(rng, 384) for _ in range(3)]
    llm = LLM(tiny[0], block_size=8)
    llm.generate(prompts, GREEDY)
    assert len(llm.history) == 0 and llm.num_steps >= 6 and llm.stats()["peak_used_blocks"] > 0
    llm = LLM(tiny[0], block_size=8, history_size=4)
    llm.generate(prompts, GREEDY)
    assert len(llm.history) == 4 and llm.history[-1]["step"] == llm.num_steps - 1
