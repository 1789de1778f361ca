"""GGUF checkpoints on small files written here with the gguf package's own writer: the loaded model equals
its safetensors twin token for token, q/k rows come back in Hugging Face order, quantised tensors equal
the gguf package's dequantisation, the tokenizer is built from the metadata, and bad files fail clearly
before any weight is read."""
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from engine_fixtures import save_tiny_llama, save_tiny_model  # noqa: E402
from pagedkv.engine import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.checkpoints.gguf import GGUFFile, permute_rope_rows, unpermute_rope_rows  # noqa: E402
from pagedkv.engine.checkpoints.loader import open_checkpoint  # noqa: E402

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
QK_NORM = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# llama.cpp's converter (convert_hf_to_gguf.py), per architecture: its layer tensor names, whether it
# interleaves q/k rows for its rope (LlamaModel does; Qwen3 and Gemma 3 run NEOX rope on Hugging Face's
# order and keep it), what it adds to every *norm.weight (Gemma 3: 1, so that llama.cpp scales by the
# weight alone where Gemma scales by 1 + weight).
CONVERTER = {
    "llama": (LAYER, True, 0.0),
    "qwen3": ({**LAYER, **QK_NORM}, False, 0.0),
    "gemma3": ({**LAYER, **QK_NORM, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}, False, 1.0),
    "gpt-oss": ({**LAYER, "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}, False, 0.0),
    "deepseek2": ({**LAYER, "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
                   "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
                   "self_attn.kv_a_layernorm": "attn_kv_a_norm", "mlp.gate": "ffn_gate_inp",
                   "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                   "mlp.shared_experts.down_proj": "ffn_down_shexp"}, False, 0.0),
}


def deepseek2_tensors(state: dict, cfg: dict) -> dict:
    """DeepSeek V3's experts and kv_b_proj as llama.cpp's converter writes them (from the checkpoint's
    per-expert tensors): each projection's experts stacked, ffn_{gate,up,down}_exps [E, ...]; kv_b_proj
    split per head into attn_k_b (key rows, transposed: [H, kv_lora_rank, nope]) and attn_v_b
    ([H, v, kv_lora_rank]); the router's correction bias as exp_probs_b.bias. Returns the remaining
    Hugging Face tensors and the converted ones under their GGUF names."""
    rest, out, experts = {}, {}, {}
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name, tensor in state.items():
        parts = name.split(".")
        if ".mlp.experts." in name:                 # model.layers.L.mlp.experts.I.P.weight
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = tensor
        elif name.endswith("kv_b_proj.weight"):
            k_b, v_b = tensor.view(heads, nope + v, -1).split([nope, v], dim=1)
            out[f"blk.{parts[2]}.attn_k_b.weight"] = k_b.transpose(1, 2)
            out[f"blk.{parts[2]}.attn_v_b.weight"] = v_b
        elif name.endswith("e_score_correction_bias"):
            out[f"blk.{parts[2]}.exp_probs_b.bias"] = tensor
        else:
            rest[name] = tensor
    for (layer, proj), stack in experts.items():
        gname = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"
        out[gname] = torch.stack([stack[i] for i in sorted(stack)])
    return rest, out


def write_deepseek2_metadata(writer, cfg: dict) -> None:
    """deepseek2.* as the converter writes them: the latent attention as MQA (one KV head, keys
    kv_lora_rank + rope wide, values kv_lora_rank), the per-head sizes under *_mla, experts and routing,
    YaRN with yarn_log_multiplier = 0.1 * mscale_all_dim."""
    rope = cfg["rope_parameters"]
    r, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    writer.add_head_count_kv(1)
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(r)
    writer.add_key_length(r + rope_dim)
    writer.add_value_length(r)
    writer.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
    writer.add_value_length_mla(cfg["v_head_dim"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["norm_topk_prob"]:
        writer.add_expert_weights_norm(True)
    writer.add_expert_group_count(cfg["n_group"])
    writer.add_expert_group_used_count(cfg["topk_group"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_rope_dimension_count(rope_dim)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def gpt_oss_experts(layer: str, rest: str, tensor: torch.Tensor, fuse: bool = False) -> dict:
    """gpt-oss's sinks and experts as llama.cpp's converter writes them: sinks as attn_sinks.weight; the
    interleaved gate_up_proj [E, hidden, 2 * inter] transposed and split into its even (gate) and odd (up)
    rows, ffn_gate_exps / ffn_up_exps [E, inter, hidden] (stacked, gate first, as ffn_gate_up_exps when
    `fuse`), their bias likewise; down_proj transposed to [E, hidden, inter]."""
    blk = f"blk.{layer}"
    if rest == "self_attn.sinks":
        return {f"{blk}.attn_sinks.weight": tensor}
    if rest == "mlp.experts.down_proj":
        return {f"{blk}.ffn_down_exps.weight": tensor.transpose(-1, -2)}
    if rest == "mlp.experts.down_proj_bias":
        return {f"{blk}.ffn_down_exps.bias": tensor}
    kind = "bias" if rest.endswith("_bias") else "weight"
    w = tensor if kind == "bias" else tensor.transpose(-1, -2)
    gate, up = w[:, ::2], w[:, 1::2]
    if fuse:
        return {f"{blk}.ffn_gate_up_exps.{kind}": torch.cat((gate, up), dim=1)}
    return {f"{blk}.ffn_gate_exps.{kind}": gate, f"{blk}.ffn_up_exps.{kind}": up}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_vocab(size: int):
    """A byte-level BPE vocabulary of `size` tokens: the 256 byte symbols, a few merges, three control
    tokens, filler tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    letters = "etaoinsrh"
    merges = [f"{a} {b}" for a in letters for b in letters] + ["Ġ t", "Ġ a", "Ġt h", "Ġth e"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [3, 3, 3]
    while len(tokens) < size:
        tokens.append(f"<filler{len(tokens)}>")
        types.append(5)
    return tokens, types, merges


def write_gguf(path, state: dict, cfg: dict, *, quant: dict | None = None, arch="llama", vocab=None,
               drop=(), extra_tensors=None, metadata_vocab=None, fuse_gate_up=False):
    """Writes the Hugging Face state dict `state` (config `cfg`) as llama.cpp's converter would for `arch`
    (CONVERTER: tensor names, q/k rows permuted for its rope, norms shifted; metadata under `arch`.*),
    tensors of `quant` (gguf name -> type) quantised by the gguf package. An `arch` outside CONVERTER is
    written as llama."""
    quant = quant or {}
    layer_names, permute, norm_shift = CONVERTER.get(arch, CONVERTER["llama"])
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    if arch == "deepseek2":
        write_deepseek2_metadata(writer, cfg)
    else:
        writer.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "head_dim" in cfg and arch in ("qwen3", "gemma3", "gpt-oss"):    # the converter writes the config's head_dim
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if arch == "gemma3":       # the window; the local rope base and the layer pattern are llama.cpp's fixed ones
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gpt-oss":      # experts, window (the pattern is llama.cpp's fixed every other layer), YaRN
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_expert_count(cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["intermediate_size"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(metadata_vocab or cfg["vocab_size"])
    tokens, types, merges = vocab or byte_level_vocab(cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    converted = {}
    if arch == "deepseek2":
        state, converted = deepseek2_tensors(state, cfg)
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            if arch == "gpt-oss" and (rest.startswith("mlp.experts.") or rest == "self_attn.sinks"):
                converted.update(gpt_oss_experts(layer, rest, tensor, fuse_gate_up))
                continue
            module, kind = rest.rsplit(".", 1)
            converted[f"blk.{layer}.{layer_names[module]}.{kind}"] = tensor
        else:
            converted[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                       "lm_head.weight": "output.weight"}[name]] = tensor
    for gname, tensor in converted.items():
        if gname in drop:
            continue
        w = tensor.float()
        if gname.endswith("norm.weight"):
            w = w + norm_shift
        if permute and ".attn_q." in gname:
            w = permute_rope_rows(w, cfg["num_attention_heads"])
        elif permute and ".attn_k." in gname:
            w = permute_rope_rows(w, cfg["num_key_value_heads"])
        w = w.numpy()
        qtype = quant.get(gname)
        if qtype is None:
            writer.add_tensor(gname, w)
        else:
            data = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
    for gname, (data, qtype) in (extra_tensors or {}).items():
        writer.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama saved as safetensors and as an all-float32 GGUF file."""
    folder = tmp_path_factory.mktemp("tiny")
    model = save_tiny_llama(folder, vocab_size=512)
    state = {k: v for k, v in model.state_dict().items()}
    cfg = model.config.to_dict()
    path = folder / "tiny.gguf"
    write_gguf(path, state, cfg)
    return folder, path, state, cfg


def test_rope_row_permutation_round_trips():
    w = torch.randn(4 * 16, 24)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(w, 4), 4), w)
    assert not torch.equal(permute_rope_rows(w, 4), w)


def test_gguf_weights_equal_the_checkpoint(tiny):
    folder, path, state, cfg = tiny
    ckpt = open_checkpoint(path)
    read = {name: r() for name, _, r in ckpt.tensors()}
    assert read.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(read[name], tensor), name       # q/k rows back in Hugging Face order
    assert ckpt.config.num_heads == cfg["num_attention_heads"] and ckpt.config.num_kv_heads == 2
    assert ckpt.config.tie_word_embeddings is False


def test_gguf_engine_equals_safetensors_engine(tiny):
    folder, path, _, _ = tiny
    prompts = [[5, 17, 300, 42, 8], list(range(40, 75))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM(folder).generate(prompts, params)]
    assert [o.token_ids for o in LLM(path).generate(prompts, params)] == expected


def test_without_the_unpermutation_the_model_differs(tiny, tmp_path):
    """The q/k rows must be put back: a file whose rows were not permuted loads a different model."""
    folder, _, state, cfg = tiny
    unpermuted = dict(state)
    for name in state:
        if "q_proj" in name:
            unpermuted[name] = unpermute_rope_rows(state[name], cfg["num_attention_heads"])
        elif "k_proj" in name:
            unpermuted[name] = unpermute_rope_rows(state[name], cfg["num_key_value_heads"])
    path = tmp_path / "wrong.gguf"
    write_gguf(path, unpermuted, cfg)       # the writer permutes: the loader's unpermute gives `unpermuted`
    prompts = [list(range(40, 75))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert LLM(path).generate(prompts, params)[0].token_ids != LLM(folder).generate(prompts, params)[0].token_ids


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"])
def test_quantised_tensors_equal_the_gguf_dequantisation(tiny, tmp_path, qtype):
    _, _, state, cfg = tiny
    q = getattr(gguf.GGMLQuantizationType, qtype)
    path = tmp_path / f"{qtype}.gguf"
    write_gguf(path, state, cfg, quant={"blk.0.ffn_up.weight": q, "blk.1.attn_k.weight": q})
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}
    read = {name: r() for name, _, r in open_checkpoint(path).tensors()}
    up = stored["blk.0.ffn_up.weight"]
    assert up.tensor_type == q
    expected = torch.from_numpy(gguf.quants.dequantize(up.data, up.tensor_type).copy())
    assert torch.equal(read["model.layers.0.mlp.up_proj.weight"], expected)
    k = stored["blk.1.attn_k.weight"]
    expected_k = unpermute_rope_rows(torch.from_numpy(gguf.quants.dequantize(k.data, k.tensor_type).copy()), 2)
    assert torch.equal(read["model.layers.1.self_attn.k_proj.weight"], expected_k)
    if qtype != "BF16":
        assert not torch.equal(expected, state["model.layers.0.mlp.up_proj.weight"])   # it was quantised
    assert torch.allclose(expected, state["model.layers.0.mlp.up_proj.weight"], atol=0.1)


def _twin(tmp_path, model_type, arch, **overrides):
    """A tiny random `model_type` saved as safetensors and written as llama.cpp's converter writes `arch`."""
    model = save_tiny_model(tmp_path, model_type, vocab_size=512, **overrides)
    cfg = model.config.to_dict()
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, dict(model.state_dict()), cfg, arch=arch)
    return model, path


def _same_tokens(folder, path):
    prompts = [[5, 17, 300, 42, 8], list(range(40, 75))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM(folder).generate(prompts, params)]
    assert [o.token_ids for o in LLM(path).generate(prompts, params)] == expected


def test_qwen3_gguf_equals_its_safetensors_twin(tmp_path):
    model, path = _twin(tmp_path, "qwen3", "qwen3")
    ckpt = open_checkpoint(path)
    assert ckpt.config.architecture == "Qwen3ForCausalLM" and ckpt.config.head_dim == 24
    read = {name: r() for name, _, r in ckpt.tensors()}
    state = model.state_dict()
    assert read.keys() == {k for k in state if k != "lm_head.weight" or not model.config.tie_word_embeddings}
    for name, tensor in read.items():
        assert torch.equal(tensor, state[name]), name      # q/k rows as stored: no permutation to undo
    assert any(".q_norm." in n for n in read) and any(".k_norm." in n for n in read)
    _same_tokens(tmp_path, path)


def test_gemma3_gguf_equals_its_safetensors_twin(tmp_path):
    # llama.cpp scales Gemma 3's queries by head_dim ** -0.5 (27B aside): the twin's query_pre_attn_scalar
    # is head_dim so that the GGUF file describes it.
    model, path = _twin(tmp_path, "gemma3", "gemma3", query_pre_attn_scalar=16)
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.head_dim == 16 and cfg.query_pre_attn_scalar == 16
    assert cfg.layer_windows == (8, 8, 8, 8, 8, None)
    assert cfg.sliding_rope == (10000.0, None) and cfg.rope_theta == 1000000.0
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings is False
    read = {name: r() for name, _, r in ckpt.tensors()}
    state = model.state_dict()
    assert read.keys() == state.keys()
    for name, tensor in read.items():       # norms back to Gemma's (1 + weight) form: the converter's + 1 undone
        assert torch.allclose(tensor, state[name], atol=1e-6), name
    _same_tokens(tmp_path, path)


def test_gemma3_norms_keep_the_converter_shift_unless_undone(tmp_path):
    """The + 1 llama.cpp's converter adds to Gemma's norms must come off: a file written without it loads a
    different model."""
    model = save_tiny_model(tmp_path, "gemma3", vocab_size=512, query_pre_attn_scalar=16)
    state = {k: (v - 1.0 if k.endswith("norm.weight") else v) for k, v in model.state_dict().items()}
    path = tmp_path / "unshifted.gguf"
    write_gguf(path, state, model.config.to_dict(), arch="gemma3")   # the writer's + 1 gives back the raw norms
    prompts = [list(range(40, 75))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert LLM(path).generate(prompts, params)[0].token_ids != LLM(tmp_path).generate(prompts, params)[0].token_ids


@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_gpt_oss_gguf_equals_its_safetensors_twin(tmp_path, fuse_gate_up):
    model = save_tiny_model(tmp_path, "gpt_oss", vocab_size=512)
    cfg = model.config.to_dict()
    path = tmp_path / "gpt-oss.gguf"
    write_gguf(path, dict(model.state_dict()), cfg, arch="gpt-oss", fuse_gate_up=fuse_gate_up)
    ckpt = open_checkpoint(path)
    c = ckpt.config
    assert c.architecture == "GptOssForCausalLM" and c.attention_bias and c.head_dim == 16
    assert c.layer_windows == (8, None, 8, None)
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["factor"] == 8.0 and c.rope_theta == 150000.0
    assert c.extra["num_local_experts"] == 4 and c.extra["num_experts_per_tok"] == 2
    read = {name: r() for name, _, r in ckpt.tensors()}
    state = model.state_dict()
    assert read.keys() == {k for k in state if k != "lm_head.weight" or not model.config.tie_word_embeddings}
    for name, tensor in read.items():       # experts interleaved and transposed back, sinks by name
        assert torch.equal(tensor, state[name]), name
    _same_tokens(tmp_path, path)


def test_gpt_oss_mxfp4_experts_equal_the_gguf_dequantisation(tmp_path):
    model = save_tiny_model(tmp_path, "gpt_oss", vocab_size=512)
    state = model.state_dict()
    path = tmp_path / "mxfp4.gguf"
    mx = gguf.GGMLQuantizationType.MXFP4
    write_gguf(path, dict(state), model.config.to_dict(), arch="gpt-oss",
               quant={f"blk.0.ffn_{p}_exps.weight": mx for p in ("gate", "up", "down")})
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert stored["blk.0.ffn_gate_exps.weight"].tensor_type == mx

    def deq(name):
        t = stored[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(
            *reversed(t.shape.tolist()))
    read = {name: r() for name, _, r in open_checkpoint(path).tensors()}
    gate_up = read["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[..., ::2], deq("blk.0.ffn_gate_exps.weight").transpose(1, 2))
    assert torch.equal(gate_up[..., 1::2], deq("blk.0.ffn_up_exps.weight").transpose(1, 2))
    down = read["model.layers.0.mlp.experts.down_proj"]
    assert torch.equal(down, deq("blk.0.ffn_down_exps.weight").transpose(1, 2))
    assert not torch.equal(down, state["model.layers.0.mlp.experts.down_proj"])     # it was quantised
    assert torch.allclose(down, state["model.layers.0.mlp.experts.down_proj"], atol=0.5, rtol=0.3)
    LLM(path).generate([[5, 17, 300]], SamplingParams(max_tokens=4, ignore_eos=True))   # it runs


def test_deepseek2_gguf_equals_its_safetensors_twin(tmp_path):
    # llama.cpp's deepseek2 keeps one YaRN mscale (yarn_log_multiplier): the twin's mscale equals its mscale_all_dim.
    rope = dict(rope_type="yarn", factor=8.0, beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
                original_max_position_embeddings=64, rope_theta=10000.0)
    model = save_tiny_model(tmp_path, "deepseek_v3", vocab_size=512, rope_parameters=rope)
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "model.safetensors"))      # what the converter reads: experts one by one
    path = tmp_path / "deepseek2.gguf"
    write_gguf(path, state, model.config.to_dict(), arch="deepseek2")
    ckpt = open_checkpoint(path)
    c = ckpt.config
    assert c.architecture == "DeepseekV3ForCausalLM" and c.latent_cache == (32, 8) and c.num_kv_heads == 4
    assert c.extra["qk_nope_head_dim"] == 16 and c.extra["v_head_dim"] == 12 and c.extra["q_lora_rank"] == 48
    assert c.extra["first_k_dense_replace"] == 1 and c.extra["n_group"] == 4 and c.extra["topk_group"] == 2
    assert c.rope_scaling["mscale"] == c.rope_scaling["mscale_all_dim"] == 0.707
    read = {name: r() for name, _, r in ckpt.tensors()}
    assert read.keys() == state.keys()
    for name, tensor in state.items():        # kv_b_proj rebuilt from k_b / v_b, experts out of their stacks
        assert torch.equal(read[name], tensor), name
    _same_tokens(tmp_path, path)


def test_deepseek2_with_softmax_routing_is_refused(tmp_path):
    """DeepSeek V2's softmax routing (expert_gating_func 1) is not the engine's; the file names the field."""
    model = save_tiny_model(tmp_path, "deepseek_v3", vocab_size=512)
    from safetensors.torch import load_file
    path = tmp_path / "softmax.gguf"
    write_gguf(path, load_file(str(tmp_path / "model.safetensors")), model.config.to_dict(), arch="deepseek2")
    field = gguf.GGUFReader(str(path), "r+").fields["deepseek2.expert_gating_func"]
    field.parts[-1][0] = int(gguf.ExpertGatingFuncType.SOFTMAX)       # written through the map
    with pytest.raises(ValueError, match="expert_gating_func=1"):
        open_checkpoint(path)


def test_tokenizer_and_template_from_the_metadata(tiny):
    _, path, _, _ = tiny
    ckpt = open_checkpoint(path)
    tok = ckpt.tokenizer()
    text = "the heat 123 <|im_end|>"
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert "<|im_end|>" in enc.tokens and "1" in enc.tokens and "2" in enc.tokens     # digits one by one
    assert enc.tokens[:5] == ["th", "e", "Ġ", "h", "ea"]      # the merges, in their rank order
    rendered = ckpt.chat_template().render([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ckpt.config.eos_token_ids == [tok.token_to_id("<|im_end|>")]


def test_chat_on_a_gguf_model_stops_at_the_end_of_turn(tiny):
    _, path, _, _ = tiny
    llm = LLM(path)
    eos = llm.tokenizer.token_to_id("<|im_end|>")
    out = llm.chat([{"role": "user", "content": "hi there"}], SamplingParams(max_tokens=8))[0]
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False).ids
    assert eos not in out.token_ids[:-1]
    with pytest.raises(ValueError, match="content"):
        llm.chat([{"role": "user"}])
    with pytest.raises(TypeError, match="conversation"):
        llm.chat("hello")


def _bad(tmp_path, tiny, **kwargs):
    _, _, state, cfg = tiny
    path = tmp_path / "bad.gguf"
    write_gguf(path, state, cfg, **kwargs)
    return path


def test_other_architectures_are_refused(tmp_path, tiny):
    with pytest.raises(ValueError, match="general.architecture is 'qwen2'"):
        open_checkpoint(_bad(tmp_path, tiny, arch="qwen2"))


def test_unknown_quantisation_types_are_refused(tmp_path, tiny):
    blob = np.zeros((4, 66), dtype=np.uint8)       # 4 rows of one IQ2_XXS block (256 values, 66 bytes)
    path = _bad(tmp_path, tiny, extra_tensors={"blk.0.ffn_extra.weight": (blob, gguf.GGMLQuantizationType.IQ2_XXS)})
    with pytest.raises(ValueError, match="is IQ2_XXS; pagedkv reads"):
        open_checkpoint(path)


def test_a_truncated_file_is_refused(tmp_path, tiny):
    path = _bad(tmp_path, tiny)
    size = os.path.getsize(path)
    for keep in (size - 100, size // 2, 64):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(path.read_bytes()[:keep])
        with pytest.raises(ValueError, match="truncated|not a readable GGUF"):
            open_checkpoint(cut)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        (tmp_path / "text.gguf").write_text("hello")
        open_checkpoint(tmp_path / "text.gguf")


def test_metadata_that_disagrees_with_the_tensors_is_refused(tmp_path, tiny):
    with pytest.raises(ValueError, match="token_embd.weight is .*metadata says"):
        open_checkpoint(_bad(tmp_path, tiny, metadata_vocab=1000))
    with pytest.raises(ValueError, match="lacks weights"):
        LLM(_bad(tmp_path, tiny, drop=("blk.1.ffn_down.weight",)))


def test_the_file_is_checked_before_weights_are_read(tmp_path, tiny, monkeypatch):
    """A bad tensor type anywhere in the file fails before any tensor is dequantised."""
    calls = []
    monkeypatch.setattr(GGUFFile, "read", lambda self, name: calls.append(name))
    blob = np.zeros((4, 66), dtype=np.uint8)
    path = _bad(tmp_path, tiny, extra_tensors={"blk.0.ffn_extra.weight": (blob, gguf.GGMLQuantizationType.IQ2_XXS)})
    with pytest.raises(ValueError):
        LLM(path)
    assert calls == []


def test_the_qwen2_pre_tokenizer_splits_digits_one_by_one(tiny):
    """Qwen 2 / 3 files name `tokenizer.ggml.pre` qwen2: llama 3's split, with each digit its own piece."""
    _, path, _, _ = tiny
    f = GGUFFile(path)
    f.metadata["tokenizer.ggml.pre"] = "qwen2"
    pieces = [p for p, _ in f.tokenizer().pre_tokenizer.pre_tokenize_str("the 2024 heat's")]
    assert pieces == ["the", "Ġ", "2", "0", "2", "4", "Ġheat", "'s"]
