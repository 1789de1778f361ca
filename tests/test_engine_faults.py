"""Fault injection at every point of an engine step: in the block manager's calls (before and after
each), inside the model, in the block moves and in sampling, with an ordinary exception and with
KeyboardInterrupt. A failed step leaves every request as before it and no block allocated; stepping on
gives transformers' greedy output; an interrupted generate() leaves nothing queued."""
import random

import pytest

from engine_fixtures import assert_greedy, hf_greedy, save_tiny_llama, shared_prefix_prompts
from pagedkv.engine import LLM, SamplingParams

MAX_TOKENS = 10


class Fault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    model = save_tiny_llama(path)
    # Fresh prompts each run, drawn until the workload swaps in, forks and chunks (some draws fit the pool
    # without a swap, and then the swap hook points would never be reached).
    for _ in range(50):
        prompts = shared_prefix_prompts(model.config.vocab_size, seed=random.randrange(1 << 30))
        llm = make_engine(str(path))
        llm.generate(*workload(prompts))
        stats = llm.stats()
        if stats["swapped_in"] and stats["cow_copies"]:
            break
    else:
        raise AssertionError("no draw of prompts made the workload swap")
    return str(path), prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts], model


class Injector:
    """Counts calls of one hook point and raises `error` at call number `at` (0: never)."""

    def __init__(self, error=None, at=0):
        self.calls, self.error, self.at, self.fired = 0, error, at, False

    def tick(self):
        self.calls += 1
        if self.calls == self.at:
            self.fired = True
            raise self.error("injected fault")


class FaultyBlockManager:
    """Forwards to the real manager; `method` ticks the injector before or after the real call."""

    def __init__(self, bm, method, after, injector):
        self._bm, self._method, self._after, self._injector = bm, method, after, injector

    def __contains__(self, seq_id):
        return seq_id in self._bm

    def __getattr__(self, name):
        real = getattr(self._bm, name)
        if name != self._method:
            return real

        def call(*args, **kwargs):
            if not self._after:
                self._injector.tick()
            result = real(*args, **kwargs)
            if self._after:
                self._injector.tick()
            return result
        return call


def wrap_method(obj, name, injector, after=False):
    real = getattr(obj, name)

    def call(*args, **kwargs):
        if not after:
            injector.tick()
        result = real(*args, **kwargs)
        if after:
            injector.tick()
        return result
    setattr(obj, name, call)


def inject(llm, point, injector):
    kind, target, after = point
    if kind == "bm":
        llm.bm = llm.scheduler.bm = FaultyBlockManager(llm.bm, target, after, injector)
    elif kind == "model":           # the second layer's MLP: the first layer has written its KV already
        wrap_method(llm.model.model.layers[1].mlp, "forward", injector, after)
    else:
        wrap_method(llm.runner, target, injector, after)


POINTS = [("bm", "swap_in", True), ("bm", "swap_out", True), ("bm", "append_tokens", False),
          ("bm", "append_tokens", True), ("bm", "take_copies", False), ("bm", "allocate", True),
          ("bm", "attention_inputs", True), ("runner", "_move_blocks", True), ("model", "mlp", False),
          ("runner", "_sample", False), ("runner", "_sample", True), ("bm", "mark_computed", True),
          ("bm", "fork", True)]
POINT_IDS = [f"{'after' if a else 'before'}-{t}" for _, t, a in POINTS]


def make_engine(path):
    # A pool that forces preemption by swap, n > 1 (fork, copy-on-write) and chunked prefill.
    return LLM(path, block_size=4, num_blocks=40, num_cpu_blocks=40, max_num_seqs=8, max_num_batched_tokens=48)


def workload(prompts):
    params = [SamplingParams(max_tokens=MAX_TOKENS - i % 3, n=1 + i % 3, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


def check_outputs(model, prompts, outputs, expected, params):
    assert len(outputs) == len(prompts) == len(expected) == len(params)
    for prompt, out, exp, sp in zip(prompts, outputs, expected, params):
        assert out.error is None and len(out.outputs) == sp.n
        for completion in out.outputs:
            assert_greedy(model, prompt, completion.token_ids, exp[:sp.max_tokens])


def count_calls(path, prompts, params, point):
    llm = make_engine(path)
    counter = Injector()
    inject(llm, point, counter)
    llm.generate(prompts, params)
    assert counter.calls > 0, f"the workload never reaches {point}"
    return counter.calls


def state(requests):
    return [(r.error, [(list(s.token_ids), s.status, s.finish_reason) for s in r.seqs]) for r in requests]


@pytest.mark.parametrize("error", [Fault, KeyboardInterrupt])
@pytest.mark.parametrize("point", POINTS, ids=POINT_IDS)
def test_failed_step_leaves_no_trace_and_stepping_on_is_exact(tiny, point, error):
    path, prompts, expected, model = tiny
    prompts, params = workload(prompts)
    at = random.randint(1, count_calls(path, prompts, params, point))
    llm = make_engine(path)
    injector = Injector(error, at)
    inject(llm, point, injector)
    requests = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    while llm.scheduler.has_unfinished():
        before = state(requests)
        try:
            llm.step()
        except error:
            assert injector.fired
            assert state(requests) == [(e, [(t, st if st.name == "FINISHED" else st.__class__.WAITING, fr)
                                             for t, st, fr in seqs]) for e, seqs in before]
            stats = llm.stats()
            assert stats["used_blocks"] == 0 and stats["num_seqs"] == 0
            assert stats["failed_steps"] == 1
            llm.bm.check_invariants()
    assert injector.fired
    check_outputs(model, prompts, [llm._output(r) for r in requests], expected, params)
    stats = llm.stats()
    assert stats["used_blocks"] == 0 and stats["free_cpu_blocks"] == 40 and not llm.requests
    llm.bm.check_invariants()


@pytest.mark.parametrize("error", [Fault, KeyboardInterrupt])
@pytest.mark.parametrize("point", POINTS, ids=POINT_IDS)
def test_interrupted_generate_aborts_its_requests(tiny, point, error):
    path, prompts, expected, model = tiny
    prompts, params = workload(prompts)
    at = random.randint(1, count_calls(path, prompts, params, point))
    llm = make_engine(path)
    injector = Injector(error, at)
    inject(llm, point, injector)
    with pytest.raises(error):
        llm.generate(prompts * 3, params * 3)
    stats = llm.stats()
    assert not llm.scheduler.has_unfinished()
    assert stats["used_blocks"] == 0 and stats["num_seqs"] == 0 and stats["free_cpu_blocks"] == 40
    assert not llm.requests
    llm.bm.check_invariants()
    check_outputs(model, prompts, llm.generate(prompts, params), expected, params)  # the next call runs only its own


def test_abort_frees_blocks_and_keeps_partial_output(tiny):
    path, prompts, expected, model = tiny
    prompts, params = workload(prompts)
    llm = make_engine(path)
    requests = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    victim = random.randrange(len(requests))
    for _ in range(random.randint(1, 6)):
        llm.step()
    assert llm.abort(requests[victim].request_id) is True
    assert llm.abort(requests[victim].request_id) is False         # already gone
    assert llm.abort(10**9) is False
    while llm.has_unfinished():
        llm.step()
    outputs = [llm._output(r) for r in requests]
    aborted = outputs.pop(victim)
    assert aborted.error == "aborted" and all(c.finish_reason in ("abort", "length") for c in aborted.outputs)
    for c in aborted.outputs:
        assert_greedy(model, prompts[victim], c.token_ids, expected[victim][:len(c.token_ids)])
    keep = [i for i in range(len(prompts)) if i != victim]
    check_outputs(model, [prompts[i] for i in keep], outputs, [expected[i] for i in keep], [params[i] for i in keep])
    assert llm.stats()["used_blocks"] == 0 and llm.stats()["free_cpu_blocks"] == 40
    llm.bm.check_invariants()
