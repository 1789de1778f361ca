"""Checkpoints the engine cannot run exactly are refused with an error naming the tensor or the
config field; what it can run (adapter files beside it, generation_config's eos) runs like transformers."""
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_fixtures import assert_greedy, hf_greedy, save_tiny_llama
from pagedkv.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    model = save_tiny_llama(path)
    return path, model


def copy_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def random_prompt(vocab=384):
    return [random.randrange(vocab) for _ in range(random.randint(5, 40))]   # seeded per test (conftest.py)


Q = "model.layers.1.self_attn.q_proj.weight"


def _set(key, value):
    return lambda t: t.__setitem__(key, value)


BAD_TENSORS = [
    ("q_proj one row", _set(Q, torch.randn(1, 64)), Q),
    ("q_proj transposed-size", _set(Q, torch.randn(64, 32)), Q),
    ("embedding vocab", _set("model.embed_tokens.weight", torch.randn(383, 64)), "model.embed_tokens.weight"),
    ("lm_head vocab", _set("lm_head.weight", torch.randn(385, 64)), "lm_head.weight"),
    ("norm as matrix", _set("model.norm.weight", torch.randn(1, 64)), "model.norm.weight"),
    ("extra tensor", _set("model.layers.0.self_attn.q_norm.weight", torch.randn(16)), "q_norm"),
    ("unexpected bias", _set("model.layers.0.self_attn.k_proj.bias", torch.randn(32)), "k_proj.bias"),
    ("extra layer", _set("model.layers.2.mlp.up_proj.weight", torch.randn(128, 64)), "model.layers.2"),
    ("misnamed", lambda t: t.__setitem__("model.norm.weights", t.pop("model.norm.weight")), "model.norm.weights"),
    ("missing", lambda t: t.pop("model.layers.0.mlp.down_proj.weight"), "down_proj"),
    ("missing shard", lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"), "qkv_proj.weight[2]"),
    ("int8 weight", _set(Q, torch.randint(-128, 127, (64, 64), dtype=torch.int8)), Q),
]


@pytest.mark.parametrize("edit, name", [b[1:] for b in BAD_TENSORS], ids=[b[0] for b in BAD_TENSORS])
def test_bad_tensor_refused_naming_it(tiny, tmp_path, edit, name):
    path = copy_checkpoint(tiny[0], tmp_path / "ckpt", edit_tensors=edit)
    with pytest.raises(ValueError) as info:
        LLM(path)
    assert name in str(info.value)


def test_fewer_layers_in_config_than_in_checkpoint(tiny, tmp_path):
    path = copy_checkpoint(tiny[0], tmp_path / "ckpt", edit_config=lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"model\.layers\.1\."):
        LLM(path)


def _update(**kw):
    return lambda c: c.update(kw)


BAD_CONFIGS = [
    ("gelu", _update(hidden_act="gelu"), "hidden_act"),
    ("mistral with biases", _update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16,
                                    attention_bias=True), "attention_bias"),
    ("llama with window", _update(sliding_window=16), "sliding_window"),
    ("gemma", _update(architectures=["GemmaForCausalLM"], model_type="gemma"), "GemmaForCausalLM"),
    ("qwen2", _update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False),
     "Qwen2ForCausalLM"),
    ("llama type, other model_type", _update(model_type="gemma2"), "model_type"),
    ("no architecture", lambda c: [c.pop("architectures"), c.pop("model_type")], "architectures"),
    ("softcapping", _update(final_logit_softcapping=30.0), "final_logit_softcapping"),
    ("yarn rope", _update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), "yarn"),
    ("llama3 rope incomplete", _update(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
     "low_freq_factor"),
    ("max positions 0", _update(max_position_embeddings=0), "max_position_embeddings"),
    ("heads not divisible", _update(num_key_value_heads=3), "num_key_value_heads"),
    ("vocab float", _update(vocab_size=384.0), "vocab_size"),
    ("missing vocab", lambda c: c.pop("vocab_size"), "vocab_size"),
    ("dtype", _update(dtype="float64"), "dtype"),
    ("quantized", _update(quantization_config={"quant_method": "bitsandbytes", "load_in_8bit": True}),
     "quantization_config"),
]


@pytest.mark.parametrize("edit, name", [b[1:] for b in BAD_CONFIGS], ids=[b[0] for b in BAD_CONFIGS])
def test_config_it_cannot_run_exactly_refused_naming_the_field(tiny, tmp_path, edit, name):
    path = copy_checkpoint(tiny[0], tmp_path / "ckpt", edit_config=edit)
    with pytest.raises(ValueError) as info:
        LLM(path)
    assert name in str(info.value)


@pytest.mark.parametrize("file, text", [("config.json", '{"vocab_size": 384,'), ("config.json", "[1, 2]"),
                                        ("generation_config.json", "{eos")])
def test_unreadable_config_files_refused_naming_them(tiny, tmp_path, file, text):
    path = copy_checkpoint(tiny[0], tmp_path / "ckpt")
    (tmp_path / "ckpt" / file).write_text(text)
    with pytest.raises(ValueError, match=file):
        LLM(path)


def test_adapter_file_beside_the_weights_is_not_loaded(tiny, tmp_path):
    path = copy_checkpoint(tiny[0], tmp_path / "ckpt")
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 64),
               "model.norm.weight": torch.randn(64)}, tmp_path / "ckpt" / "adapter_model.safetensors")
    prompt = random_prompt()
    out = LLM(path).generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert_greedy(tiny[1], prompt, out.token_ids, hf_greedy(tiny[1], prompt, 8))


def test_generation_config_eos_token_id_is_read(tiny, tmp_path):
    """As with Llama-3-Instruct's <|eot_id|>: generation_config.json's eos ends the output."""
    model = tiny[1]
    prompt = random_prompt()
    greedy = hf_greedy(model, prompt, 12)
    stop = greedy[4]
    cut = greedy.index(stop) + 1
    other = next(t for t in range(384) if t not in greedy)       # a second eos that never comes
    path = copy_checkpoint(tiny[0], tmp_path / "ckpt")
    generation = json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [other, stop]}))
    ids = torch.tensor([prompt])
    reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=12, eos_token_id=[other, stop], pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy[:cut] == reference[:cut]
    out = LLM(path).generate(prompt, SamplingParams(max_tokens=12))[0]
    # The output is greedy[:cut] or, past a near-tie, another greedy continuation: it ends at its first eos.
    assert_greedy(model, prompt, out.token_ids, greedy[:len(out.token_ids)])
    ends = [i for i, t in enumerate(out.token_ids) if t in (other, stop)]
    assert ends == [len(out.token_ids) - 1] and out.outputs[0].finish_reason == "stop" or \
        (ends == [] and len(out.token_ids) == 12 and out.outputs[0].finish_reason == "length")


def test_demo_checkpoint_is_a_hugging_face_llama(tmp_path):
    """The demo writes its built-in model without transformers; transformers must read it as the same
    Llama the engine runs (same greedy tokens)."""
    from transformers import LlamaForCausalLM

    from pagedkv.demo import build_tiny_llama

    build_tiny_llama(str(tmp_path), seed=3, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     vocab_size=300)
    model = LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = [5, 17, 200, 3, 9, 41, 77]
    out = LLM(str(tmp_path), device="cpu").generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, prompt, 10)
