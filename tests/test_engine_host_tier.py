"""The engine with the prefix cache's host tier (LLM(host_cache_bytes=...)): token for token the output of
the single-tier engine (fp32 greedy) under a pool so small that prefixes go down to the host and come back
many times; the loads are on the path (skipping them changes the tokens); a failed copy costs a recompute,
never a wrong token or a leaked block; tensor parallelism moves each rank's shard of the blocks."""
import random

import pytest
import torch

import pagedkv.engine.execution.model_runner as model_runner
from engine_fixtures import save_tiny_llama
from pagedkv.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
HOST_BYTES = 64 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("host_tier_llama")
    model = save_tiny_llama(path)
    return str(path), model.config.vocab_size


def conversations(vocab: int, seed=0, num=6, system_len=45, turns=3):
    """Rounds of multi-turn chats: each conversation's prompt is its system prompt plus every earlier turn,
    so each round revisits prefixes that the rounds in between pushed out of a small pool."""
    rng = random.Random(seed)
    chats = [[rng.randrange(3, vocab) for _ in range(system_len)] for _ in range(num)]
    rounds = []
    for _ in range(turns):
        for chat in chats:
            chat.extend(rng.randrange(3, vocab) for _ in range(rng.randrange(3, 12)))
        rounds.append([list(c) for c in chats])
    return rounds


def run(llm: LLM, rounds) -> list[list[int]]:
    """Each round one conversation at a time (the pool holds one or two), outputs in order."""
    out = []
    for prompts in rounds:
        for p in prompts:
            out.append(llm.generate([p], GREEDY)[0].token_ids)
    return out


def engines(path, **kwargs):
    common = dict(block_size=8, num_blocks=20, max_num_batched_tokens=32, **kwargs)
    return LLM(path, **common), LLM(path, host_cache_bytes=HOST_BYTES, **common)


def test_tokens_equal_the_single_tier_engine_and_prefixes_come_back_from_the_host(tiny):
    path, vocab = tiny
    rounds = conversations(vocab)
    single, tiered = engines(path)
    want = run(single, rounds)
    assert run(tiered, rounds) == want
    s, t = single.stats(), tiered.stats()
    assert t["offloaded_blocks"] > 0 and t["loaded_blocks"] > 0 and t["host_hit_blocks"] > 0
    assert t["load_failures"] == 0 and t["offload_failures"] == 0
    assert t["cached_prompt_tokens"] > s["cached_prompt_tokens"], "the host tier adds hits the pool lost"
    assert t["used_blocks"] == 0
    tiered.bm.check_invariants()


def test_the_loaded_blocks_are_read(tiny, monkeypatch):
    """Without the host-to-device copies the loaded blocks hold other KV and the tokens change."""
    path, vocab = tiny
    rounds = conversations(vocab, seed=1)
    single, tiered = engines(path)
    want = run(single, rounds)
    monkeypatch.setattr(model_runner, "load_blocks", lambda *args, **kwargs: None)
    assert run(tiered, rounds) != want


@pytest.mark.parametrize("fail", ["offload", "load"])
def test_a_failed_copy_costs_a_recompute_not_a_wrong_token(tiny, monkeypatch, fail):
    path, vocab = tiny
    rounds = conversations(vocab, seed=2)
    single, tiered = engines(path)
    want = run(single, rounds)
    real = getattr(model_runner, f"{fail}_blocks")
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError(f"injected {fail} failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(model_runner, f"{fail}_blocks", flaky)
    got, failures = [], 0
    for prompts in rounds:
        for p in prompts:
            while True:
                try:
                    got.append(tiered.generate([p], GREEDY)[0].token_ids)
                    break
                except RuntimeError as e:
                    assert "injected" in str(e)
                    failures += 1
    assert failures > 0 and got == want
    stats = tiered.stats()
    assert stats["used_blocks"] == 0 and stats[f"{fail}_failures"] > 0
    assert tiered.bm.num_free_host_blocks == tiered.bm.num_host_blocks, "no host slot is left held"
    tiered.bm.check_invariants()


def test_tensor_parallel_ranks_move_their_shards(tiny):
    path, vocab = tiny
    rounds = conversations(vocab, seed=3, num=4, turns=2)
    single = LLM(path, block_size=8, num_blocks=20, max_num_batched_tokens=32, host_cache_bytes=HOST_BYTES)
    want = run(single, rounds)
    with LLM(path, block_size=8, num_blocks=20, max_num_batched_tokens=32, host_cache_bytes=HOST_BYTES,
             tensor_parallel_size=2) as llm:
        assert run(llm, rounds) == want
        assert llm.stats()["loaded_blocks"] > 0


def test_bad_settings_are_refused(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="host_cache_bytes"):
        LLM(path, host_cache_bytes=-1)
    with pytest.raises(TypeError, match="host_cache_bytes"):
        LLM(path, host_cache_bytes=1.5)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(path, host_cache_bytes=HOST_BYTES, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(path, host_cache_bytes=10)


def test_host_tier_is_sized_from_host_cache_bytes(tiny):
    path, _ = tiny
    llm = LLM(path, block_size=8, num_blocks=20, host_cache_bytes=HOST_BYTES)
    per_block = model_runner.kv_cache_block_bytes(llm.model, 8, torch.float32)
    assert llm.bm.num_host_blocks == HOST_BYTES // per_block
    assert tuple(llm.runner.host_tier.shape[:3]) == (HOST_BYTES // per_block, llm.model_config.num_layers, 2)


def test_loads_arrive_layer_by_layer_just_before_each_layer_runs(tiny, monkeypatch):
    """A step's host-tier loads are copied one layer at a time (on a GPU: queued on a side stream, each layer
    waiting for its own event), and layer l's blocks arrive before layer l reads them."""
    path, vocab = tiny
    rounds = conversations(vocab, seed=4)
    single, tiered = engines(path)
    want = run(single, rounds)
    trace = []
    real_load = model_runner.load_blocks

    def load(host, keys, values, mapping, first_layer=0):
        trace.append(("load", first_layer, len(keys)))
        return real_load(host, keys, values, mapping, first_layer)

    monkeypatch.setattr(model_runner, "load_blocks", load)
    for i, layer in enumerate(tiered.model.model.layers):
        def traced(*args, _i=i, _forward=layer.forward, **kwargs):
            trace.append(("layer", _i))
            return _forward(*args, **kwargs)
        monkeypatch.setattr(layer, "forward", traced)
    assert run(tiered, rounds) == want
    loads = [i for i, t in enumerate(trace) if t[0] == "load"]
    assert loads and tiered.stats()["loaded_blocks"] > 0
    for i in loads:
        _, layer, num_caches = trace[i]
        assert num_caches == 1 and trace[i + 1] == ("layer", layer), trace[i - 2:i + 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_loads_on_a_side_stream_give_the_same_tokens(tiny):
    """On a GPU the loads run on a side stream, each layer waiting for its own event: the tokens equal the
    single-tier engine's on the same device, and the loads happened."""
    path, vocab = tiny
    rounds = conversations(vocab, seed=5)
    common = dict(device="cuda", dtype=torch.float32, block_size=8, num_blocks=20, max_num_batched_tokens=32)
    want = run(LLM(path, **common), rounds)
    tiered = LLM(path, host_cache_bytes=HOST_BYTES, **common)
    assert run(tiered, rounds) == want
    assert tiered.stats()["loaded_blocks"] > 0
    assert model_runner.LayerLoads._streams, "the side stream was used"
