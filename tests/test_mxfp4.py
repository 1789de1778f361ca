"""MXFP4 checkpoints (gpt-oss's experts): dequantisation equals transformers' on random codes and
exponents, malformed pairs are refused naming the tensor, and config.json's quantization_config is read."""
import pytest
import torch

from pagedkv.engine.checkpoints import mxfp4
from pagedkv.engine.config import ModelConfig


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 8, 2), (2, 5, 4)])
def test_dequantize_is_transformers(shape):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(sum(shape))
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 136, shape, dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    got = mxfp4.dequantize(blocks, scales)
    assert got.shape == want.shape == (shape[0], shape[2] * 32, shape[1])
    assert torch.equal(got, want)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight in gpt-oss's layout [E, cols, rows] to MXFP4 blocks [E, rows, cols / 32, 16] and scales:
    each group's exponent the smallest that fits its largest value under 6, codes rounded to nearest."""
    groups = weight.transpose(1, 2).unflatten(-1, (-1, 32))                       # [E, rows, G, 32]
    top = groups.abs().amax(-1).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    lut = torch.tensor(mxfp4.E2M1_VALUES)
    codes = (groups / torch.exp2(exponent)[..., None] - lut[:, None, None, None, None]).abs().argmin(0).to(torch.uint8)
    codes = codes.unflatten(-1, (16, 2))
    return codes[..., 0] | (codes[..., 1] << 4), (exponent + 127).to(torch.uint8)


def test_quantize_round_trips():
    weight = torch.randn(2, 64, 12)
    blocks, scales = quantize(weight)
    back = mxfp4.dequantize(blocks, scales)
    assert back.shape == weight.shape
    assert ((back - weight).abs() <= weight.abs().amax() / 6).all()      # within the e2m1 grid's step
    assert torch.equal(mxfp4.dequantize(*quantize(back)), back)         # grid values are exact


def test_half_pairs_and_bad_tensors_are_refused():
    with pytest.raises(ValueError, match="down_proj_scales"):
        mxfp4.pair_tensors(["a.down_proj_blocks"])
    with pytest.raises(ValueError, match="down_proj_blocks"):
        mxfp4.pair_tensors(["a.down_proj_scales"])
    assert mxfp4.pair_tensors(["w_blocks", "w_scales", "x"]) == {"w": ("w_blocks", "w_scales")}
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(torch.zeros(1, 2, 1, 16, dtype=torch.uint8), torch.zeros(1, 1, 1, dtype=torch.uint8))



GPT_OSS = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=100, hidden_size=64,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_quantization_config_only_mxfp4_and_only_gpt_oss():
    ModelConfig.from_dict(dict(GPT_OSS, quantization_config={"quant_method": "mxfp4"}))
    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_dict(dict(GPT_OSS, quantization_config={"quant_method": "gptq"}))
    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_dict(dict(GPT_OSS, architectures=["LlamaForCausalLM"], model_type="llama",
                                   quantization_config={"quant_method": "mxfp4"}))


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_equals_transformers(tmp_path):
    """Experts stored as MXFP4 pairs (as gpt-oss ships them) load dequantised: greedy tokens equal
    transformers' on the same (dequantised) weights."""
    import json

    from safetensors.torch import load_file, save_file

    from engine_fixtures import build_tiny_model, hf_greedy, never_stop, shared_prefix_prompts
    from pagedkv.engine import LLM, SamplingParams

    model = build_tiny_model("gpt_oss")
    packed = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = quantize(param.data)
                param.copy_(mxfp4.dequantize(blocks, scales))
                packed[name] = (blocks, scales)
    model.save_pretrained(tmp_path)
    never_stop(model)
    weights = load_file(tmp_path / "model.safetensors")
    for name, (blocks, scales) in packed.items():
        del weights[name]
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    prompts = shared_prefix_prompts(model.config.vocab_size)[:4]
    expected = [hf_greedy(model, p, 16) for p in prompts]
    outputs = LLM(tmp_path, block_size=4).generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                                           ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
