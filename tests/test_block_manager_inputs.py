"""The block manager at its edges: every kind of integer input, hostile values, half-built objects,
whole-batch validation, pending copy-on-write pairs and threads. Each bad call raises a clear Python
exception and leaves the manager exactly as it was."""
import array
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from pagedkv import AllocStatus, BlockManager, _C


def toks(n, start=0):
    return list(range(start, start + n))


def snapshot(bm):
    ids = sorted(i for i in range(-2, 64) if i in bm)
    return (bm.num_free_blocks, bm.num_free_cpu_blocks, bm.stats(),
            {i: (bm.block_table(i), bm.token_ids(i), bm.num_computed_tokens(i), bm.is_swapped(i)) for i in ids})


def two_sequences(num_blocks=8, **kwargs):
    bm = BlockManager(num_blocks, 4, **kwargs)
    bm.allocate(1, toks(10))
    bm.allocate(2, toks(3, 50))
    bm.mark_computed(1, 4)
    return bm


# --- integer inputs ------------------------------------------------------------------------------------

def read_only(a):
    a.flags.writeable = False
    return a


INT_INPUTS = [
    ("list", lambda v: list(v)),
    ("tuple", lambda v: tuple(v)),
    ("numpy int64", lambda v: np.array(v, dtype=np.int64)),
    ("numpy int32", lambda v: np.array(v, dtype=np.int32)),
    ("numpy uint16", lambda v: np.array(v, dtype=np.uint16)),
    ("numpy uint64", lambda v: np.array(v, dtype=np.uint64)),
    ("numpy strided", lambda v: np.repeat(np.array(v, dtype=np.int64), 2)[::2]),
    ("numpy read-only", lambda v: read_only(np.array(v, dtype=np.int64))),
    ("numpy misaligned int64", lambda v: np.frombuffer(b"\0" + np.array(v, dtype=np.int64).tobytes(), np.int64, offset=1)),
    ("numpy reversed view", lambda v: np.array(v[::-1], dtype=np.int64)[::-1]),
    ("numpy scalars in a list", lambda v: [np.int64(x) for x in v]),
    ("array.array", lambda v: array.array("q", v)),
    ("array.array int32", lambda v: array.array("i", v)),
    ("memoryview", lambda v: memoryview(array.array("l", v))),
    ("torch int64", lambda v: torch.tensor(v)),
    ("torch int32 non-contiguous", lambda v: torch.tensor(v, dtype=torch.int32).repeat_interleave(2)[::2]),
    ("torch uint64", lambda v: torch.tensor(v, dtype=torch.uint64)),
    ("torch int16", lambda v: torch.tensor(v, dtype=torch.int16)),
    ("torch uint32", lambda v: torch.tensor(v, dtype=torch.uint32)),
    ("torch int64 strided", lambda v: torch.tensor(v).repeat_interleave(3)[::3]),
    ("torch int64 with a storage offset", lambda v: torch.tensor([0] + list(v))[1:]),
    ("torch int64 expanded", lambda v: torch.tensor(v)[:, None].expand(-1, 2)[:, 1]),
    ("torch int64 column of a 2-D tensor", lambda v: torch.tensor([list(v), list(v)]).t()[:, 0]),
    ("torch int64 parameter", lambda v: torch.nn.Parameter(torch.tensor(v), requires_grad=False)),
]


@pytest.mark.parametrize("name, make", INT_INPUTS, ids=[n for n, _ in INT_INPUTS])
def test_every_integer_container_gives_the_same_result(name, make, seed):
    rng = np.random.default_rng(seed)
    prompt = [int(x) for x in rng.integers(0, 1000, size=int(rng.integers(3, 30)))]
    ref, bm = BlockManager(32, 4), BlockManager(32, 4)
    assert bm.allocate(7, make(prompt)) == ref.allocate(7, prompt)
    assert bm.token_ids(7) == prompt
    assert bm.block_tables(make([7])).tolist() == ref.block_tables([7]).tolist()
    assert bm.slot_mappings(make([7]), make([1])).tolist() == ref.slot_mappings([7], [1]).tolist()
    assert bm.allocate_batch(make([8]), [make(prompt)]) == ref.allocate_batch([8], [prompt])
    assert bm.can_append(make([7, 8])) == ref.can_append([7, 8])
    assert bm.append_tokens(make([7, 8]), make([3, 4])).tolist() == ref.append_tokens([7, 8], [3, 4]).tolist()
    bm.mark_computed(make([7, 8]), make([2, 3]))
    assert bm.num_computed_tokens(8) == 3
    bm.check_invariants()


IN_PLACE_INPUTS = [  # read by the bindings without a copy: the core must copy what it keeps
    ("numpy int64", lambda v: np.array(v, dtype=np.int64)),
    ("torch int64", lambda v: torch.tensor(v, dtype=torch.int64)),
    ("array.array", lambda v: array.array("q", v)),
]


@pytest.mark.parametrize("name, make", IN_PLACE_INPUTS, ids=[n for n, _ in IN_PLACE_INPUTS])
def test_mutating_the_callers_array_afterwards_changes_nothing_inside(name, make, seed):
    rng = np.random.default_rng(seed)
    bs = int(rng.integers(2, 9))
    prompt = [int(x) for x in rng.integers(0, 1000, size=int(rng.integers(3 * bs, 8 * bs)))]
    other = [int(x) for x in rng.integers(1000, 2000, size=len(prompt))]
    bm = BlockManager(64, bs)
    single, batch = make(prompt), make(prompt)
    assert bm.can_allocate(single) == AllocStatus.OK
    bm.allocate(1, single)
    bm.allocate_batch([2], [batch])
    for arr in (single, batch):
        arr[:] = make(other)
    assert bm.token_ids(1) == prompt and bm.token_ids(2) == prompt
    bm.mark_computed([1, 2])
    full_blocks = (len(prompt) - 1) // bs  # the last block is always computed
    assert bm.allocate(3, prompt) == full_blocks * bs  # the cache holds the prompt's content ...
    assert bm.allocate(4, other) == 0                  # ... not what the arrays hold now
    # can_allocate's lookup is reused by allocate only for the same content: a change in between counts.
    probe = make(prompt)
    assert bm.can_allocate(probe) == AllocStatus.OK
    probe[:] = make(other)
    assert bm.allocate(5, probe) == 0 and bm.token_ids(5) == other
    bm.check_invariants()


def test_a_2d_prompts_tensor_is_copied_before_it_changes(seed):
    rng = np.random.default_rng(seed)
    prompts = torch.from_numpy(rng.integers(0, 1000, size=(3, 13)))
    expected = prompts.tolist()
    bm = BlockManager(64, 4)
    bm.allocate_batch([0, 1, 2], prompts)
    prompts.zero_()
    assert [bm.token_ids(i) for i in range(3)] == expected
    bm.check_invariants()


def test_single_ids_may_be_numpy_integers():
    bm = BlockManager(8, 4)
    bm.allocate(1, toks(6))
    bm.mark_computed(np.int64(1), np.int32(4))
    assert bm.num_computed_tokens(1) == 4
    assert bm.slot_mapping(np.int64(1), np.int64(0), np.int64(2)).tolist() == bm.slot_mapping(1, 0, 2).tolist()


NOT_INTEGERS = [
    np.arange(5.0), np.arange(5, dtype=np.float16), array.array("d", [1.0, 2.0]), [1.5, 2.0], [np.float64(1.0)],
    [1, None], torch.ones(3), torch.ones(3, dtype=torch.bfloat16), np.array([True, False]), [True, 2],
    torch.tensor([True]), "abc", b"abc", bytearray(b"ab"), {1: 2}, 3.0, np.array([1 + 2j]),
]


@pytest.mark.parametrize("bad", NOT_INTEGERS, ids=[type(b).__name__ + str(i) for i, b in enumerate(NOT_INTEGERS)])
def test_non_integers_are_a_type_error_and_change_nothing(bad):
    bm = two_sequences()
    before = snapshot(bm)
    with pytest.raises(TypeError):
        bm.allocate(9, bad)
    with pytest.raises(TypeError):
        bm.allocate_batch([9], [bad])
    with pytest.raises(TypeError):
        bm.block_tables(bad)
    assert snapshot(bm) == before


@pytest.mark.parametrize("bad", [
    np.zeros((2, 2), dtype=np.int64), torch.zeros(2, 2, dtype=torch.long), np.int64(3).reshape(()),
    torch.tensor(3), np.array([1, 2], dtype=">i8"),
])
def test_wrong_shapes_and_byte_orders_are_refused(bad):
    bm = two_sequences()
    before = snapshot(bm)
    with pytest.raises((ValueError, TypeError)):
        bm.allocate(9, bad)
    assert snapshot(bm) == before


@pytest.mark.parametrize("call", [
    lambda bm: bm.allocate(9, torch.tensor([5, 2 ** 64 - 1], dtype=torch.uint64)),
    lambda bm: bm.allocate(9, np.array([2 ** 64 - 1], dtype=np.uint64)),
    lambda bm: bm.allocate(9, [1, 2 ** 63]),
    lambda bm: bm.allocate(9, [np.uint64(2 ** 64 - 1)]),
    lambda bm: bm.mark_computed(1, 2 ** 64),
    lambda bm: bm.mark_computed([1], [2 ** 70]),
    lambda bm: bm.block_tables([2 ** 64]),
    lambda bm: bm.free(2 ** 64),
    lambda bm: bm.slot_mapping(1, 0, 2 ** 64),
], ids=["uint64 tensor", "uint64 array", "list", "numpy scalar", "mark_computed", "mark_computed list",
        "block_tables", "free", "slot_mapping"])
def test_integers_outside_int64_are_refused(call):
    bm = two_sequences()
    before = snapshot(bm)
    with pytest.raises((OverflowError, TypeError)):
        call(bm)
    assert snapshot(bm) == before


@pytest.mark.parametrize("call", [
    lambda bm: bm.slot_mapping(1, 0, 10 ** 12),
    lambda bm: bm.slot_mappings([1, 2], [0, 0], [10, 10 ** 12]),
    lambda bm: bm.slot_mappings([1, 2], [0, -(10 ** 12)]),
    lambda bm: bm.block_tables([1], max_blocks=2 ** 31 - 1),
])
def test_huge_ranges_are_refused_before_any_allocation(call):
    bm = two_sequences()
    with pytest.raises(ValueError):
        call(bm)  # would try to allocate terabytes if it allocated before validating


# --- half-built objects ----------------------------------------------------------------------------------

@pytest.mark.parametrize("use", [
    lambda bm: bm.stats(), lambda bm: bm.num_free_blocks, lambda bm: bm.num_blocks, lambda bm: repr(bm),
    lambda bm: bm.allocate(1, [1, 2]), lambda bm: bm.check_invariants(), lambda bm: 1 in bm,
    lambda bm: bm.take_copies(), lambda bm: bm.block_tables([1]),
])
def test_an_uninitialised_manager_raises_instead_of_crashing(use):
    bm = BlockManager.__new__(BlockManager)
    with pytest.raises(TypeError, match="never initialised"):
        use(bm)


def test_a_second_init_is_refused_and_changes_nothing():
    bm = two_sequences()
    before = snapshot(bm)
    with pytest.raises(TypeError, match="initialised manager"):
        bm.__init__(4, 2)
    assert snapshot(bm) == before and bm.block_size == 4
    late = BlockManager.__new__(BlockManager)
    late.__init__(4, 2)  # a first __init__ after __new__ is fine
    assert late.num_free_blocks == 4


def test_subclass_that_skips_init_is_refused():
    class Forgetful(BlockManager):
        def __init__(self):
            pass

    with pytest.raises(TypeError):
        Forgetful().stats()


# --- duplicates and whole-batch validation ----------------------------------------------------------------

@pytest.mark.parametrize("args", [([1, 1], [8, 6]), ([1, 1], None), ([1, 2, 1], [5, 3, 5])])
def test_mark_computed_refuses_duplicate_ids(args):
    bm = two_sequences()
    before = snapshot(bm)
    with pytest.raises(ValueError, match="twice"):
        bm.mark_computed(*args) if args[1] is not None else bm.mark_computed(args[0])
    assert snapshot(bm) == before
    bm.check_invariants()


@pytest.mark.parametrize("ids, prompts, salts, exc, match", [
    ([5, 6, 1], [[1, 2], [3], [4]], None, ValueError, "sequence 1 already exists"),
    ([5, 6, 5], [[1, 2], [3], [4]], None, ValueError, "twice"),
    ([5, 6], [[1, 2], "abc"], None, TypeError, "prompts"),
    ([5, 6], [[1, 2], [3.0]], None, TypeError, "ints"),
    ([5, 6], [[1, 2], [3]], [b"a", 7], TypeError, "cache_salt"),
    ([5, 6], [[1, 2], [3]], [b"a"], ValueError, "one entry per prompt"),
    ([5, 6], [[1, 2], [3]], b"ab", TypeError, "cache_salts"),
    ([5, 6, 7], [[1, 2], [], [3]], None, ValueError, r"prompts\[1\] is empty"),
    ([5, 6], [[1, 2]], None, ValueError, "2 seq_ids but 1 prompts"),
    ([5, 6], [[1, 2], [3, 2 ** 64]], None, OverflowError, "int64"),
])
def test_allocate_batch_validates_the_whole_batch_first(ids, prompts, salts, exc, match):
    bm = two_sequences()
    before = snapshot(bm)
    with pytest.raises(exc, match=match):
        bm.allocate_batch(ids, prompts, cache_salts=salts)
    assert snapshot(bm) == before
    assert 5 not in bm


def test_allocate_batch_checks_ids_even_when_the_pool_is_full():
    bm = BlockManager(3, 4)
    bm.allocate(1, toks(12))  # every block taken
    with pytest.raises(ValueError, match="already exists"):
        bm.allocate_batch([5, 1], [[1], [2]])
    assert bm.allocate_batch([5, 6], [[1], [2]]) == []  # well-formed: admits none, raises nothing


def test_allocate_batch_admits_in_order_until_one_does_not_fit():
    bm = BlockManager(4, 4)
    cached = bm.allocate_batch([1, 2, 3], [toks(8), toks(8, 100), toks(2)])
    assert cached == [0, 0] and 1 in bm and 2 in bm and 3 not in bm
    bm.check_invariants()


# --- pending copy-on-write pairs ------------------------------------------------------------------------

def forked_pair_with_pending_copy(num_cpu_blocks=0):
    bm = BlockManager(8, 4, num_cpu_blocks=num_cpu_blocks)
    bm.allocate(1, toks(6))
    bm.mark_computed(1)
    bm.fork(1, 2)
    shared_last = bm.block_table(1)[-1]
    bm.append_tokens([2], [99])  # 2 copies the shared last block: a pending (shared_last, new) pair
    return bm, shared_last, bm.block_table(2)[-1]


def test_freeing_the_sequence_drops_its_pending_copy():
    bm, _, dst = forked_pair_with_pending_copy()
    bm.free(2)
    assert bm.take_copies().tolist() == []  # the destination is a free block now: copying into it would be wrong
    bm.check_invariants()


def test_pending_copy_survives_while_its_destination_is_held():
    bm, src, dst = forked_pair_with_pending_copy()
    bm.fork(2, 3)  # the copy's destination is now shared by 2 and 3
    bm.free(2)
    assert bm.take_copies().tolist() == [[src, dst]]


def test_swap_out_before_take_copies_reads_the_copy_source():
    bm, src, dst = forked_pair_with_pending_copy(num_cpu_blocks=8)
    table = bm.block_table(2)
    mapping = bm.swap_out([2]).tolist()
    assert [src, mapping[-1][1]] == mapping[-1] and len(mapping) == len(table)
    assert all(g != dst for g, _ in mapping)  # the never-written destination is not read
    assert bm.take_copies().tolist() == []  # its destination was released by the swap
    bm.check_invariants()


def test_swap_out_kv_is_right_whatever_order_the_runner_performs_swaps_and_copies():
    """Simulated KV: each slot holds the prefix it was written for; swap a CoW'd sequence out before the
    runner has done the copy, then do the swap and the copy in either order."""
    for copies_first in (True, False):
        bm, src, dst = forked_pair_with_pending_copy(num_cpu_blocks=8)
        gpu = {b: {} for b in range(8)}
        for p, tok in enumerate(toks(6)):
            gpu[bm.block_table(1)[p // 4]][p % 4] = tuple(toks(6)[: p + 1])
        gpu[dst] = {k: "garbage" for k in range(4)}  # the destination's old contents
        mapping, copies = bm.swap_out([2]).tolist(), bm.take_copies().tolist()
        cpu = {}
        steps = [lambda: [gpu.__setitem__(d, dict(gpu[s])) for s, d in copies],
                 lambda: [cpu.__setitem__(c, dict(gpu[g])) for g, c in mapping]]
        for step in (steps if copies_first else steps[::-1]):
            step()
        table = bm.block_table(2)
        for p in range(6):
            assert cpu[table[p // 4]][p % 4] == tuple(toks(6)[: p + 1])


# --- threads ----------------------------------------------------------------------------------------------

def test_concurrent_python_threads_keep_the_manager_consistent():
    """The manager holds the GIL for the whole of every call, so Python threads are serialised."""
    bm = BlockManager(64, 4, num_cpu_blocks=16)
    errors = []

    def worker(base):
        rng = np.random.default_rng(base)
        try:
            for i in range(300):
                sid = base * 1000 + i
                prompt = rng.integers(0, 3, size=int(rng.integers(1, 12)))
                if bm.allocate_batch([sid], [prompt]):
                    bm.mark_computed(sid)
                    if bm.can_append([sid]):
                        bm.append_tokens([sid], [1])
                    bm.block_tables([sid])
                    bm.free(sid)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    bm.check_invariants()
    assert bm.num_free_blocks == 64


# --- the long fuzz command, short ----------------------------------------------------------------------------

@pytest.mark.parametrize("windows", [[], ["--sliding-window", "0"], ["--groups", "2", "--sliding-window", "4"]],
                         ids=["full", "windows", "hybrid"])
def test_short_fuzz_run_passes(windows, seed):
    """scripts/fuzz_block_manager.py (run with --ops 1000000 before a release) at 20k operations."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(root, "scripts", "fuzz_block_manager.py"), "--ops", "20000",
                           "--seed", str(seed), *windows], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: 20,000 operations" in done.stdout


def test_a_pending_copy_source_is_not_reused_before_the_copy_is_taken():
    """Swap-in (or any allocation) must not overwrite the block a pending copy still has to read."""
    bm = BlockManager(3, 4, num_cpu_blocks=4)
    bm.allocate(9, toks(2, 500))
    bm.swap_out([9])
    bm.allocate(1, toks(6))
    bm.fork(1, 2)
    src = bm.block_table(1)[-1]
    bm.append_tokens([2], [7])
    bm.free(1)  # the source now has no holder
    assert bm.can_swap_in([9]) != AllocStatus.OK  # the only unused block is the pending copy's source
    assert bm.take_copies().tolist() == [[src, bm.block_table(2)[-1]]]
    assert bm.can_swap_in([9]) == AllocStatus.OK
    bm.check_invariants()


def test_allocate_batch_takes_a_2d_array_of_prompts(seed):
    """Rows of a 2-D array are new objects on each access: they must stay alive while being read."""
    prompts = np.random.default_rng(seed).integers(0, 100, size=(6, 7))
    bm, ref = BlockManager(32, 4), BlockManager(32, 4)
    assert bm.allocate_batch(np.arange(6), prompts) == ref.allocate_batch(list(range(6)), prompts.tolist())
    assert [bm.token_ids(i) for i in range(6)] == prompts.tolist()
    assert bm.allocate_batch(np.array([10, 11]), torch.tensor(prompts[:2]), cache_salts=("a", b"b")) == [0, 0]
    with pytest.raises(TypeError, match="prompts must be a list"):
        bm.allocate_batch([20], {5: [1]})
    bm.check_invariants()


HOSTILE = [None, 0, -1, 2, 2 ** 31, 2 ** 63, -(2 ** 63) - 1, 2 ** 64, 1.5, float("nan"), "x", b"y", [], [1], [1, 2, 3],
           [[1]], (1, 2), np.arange(3), np.arange(3.0), np.array([], dtype=np.int64), np.zeros((2, 2), dtype=np.int64),
           np.int64(1), np.uint64(2 ** 64 - 1), torch.arange(3), torch.zeros(0, dtype=torch.long), torch.tensor(1),
           torch.ones(2, device="meta", dtype=torch.long), torch.arange(3, dtype=torch.int8), array.array("b", [1, 2]),
           memoryview(b"ab"), {1: 2}, object(), range(3), True]


def test_every_method_survives_hostile_arguments(seed):
    """Random methods with random junk: each call returns or raises a documented exception, and the
    manager stays consistent (a crash here kills the test run)."""
    rng = np.random.default_rng(seed)
    methods = [m for m in dir(BlockManager) if not m.startswith("_") and callable(getattr(BlockManager, m))]
    for _ in range(3000):
        bm = BlockManager(8, 2, num_cpu_blocks=4)
        bm.allocate(1, [1, 2, 3])
        bm.allocate(2, [1, 2, 3, 4, 5])
        bm.mark_computed(1)
        name = methods[rng.integers(len(methods))]
        args = [HOSTILE[i] for i in rng.integers(len(HOSTILE), size=rng.integers(0, 4))]
        try:
            getattr(bm, name)(*args)
        except (TypeError, ValueError, KeyError, OverflowError) as e:
            assert str(e), name
        except RuntimeError as e:  # only "not enough blocks" is a RuntimeError
            assert "free" in str(e), (name, args, e)
        bm.check_invariants()


# --- tensors through DLPack ------------------------------------------------------------------------------

@pytest.fixture(params=[True, False], ids=["exchange table", "capsules"])
def dlpack_path(request):
    """Both ways tensors cross into and out of _C: torch's DLPack exchange table (torch >= 2.10) and the
    __dlpack__ capsules + torch.from_dlpack that an older torch gets."""
    _C._set_dlpack_exchange(request.param)
    try:
        yield request.param
    finally:
        _C._set_dlpack_exchange(True)


def test_torch_has_the_dlpack_exchange_table():
    assert _C._dlpack_exchange()


def test_results_are_torch_tensors_that_own_their_memory(dlpack_path):
    bm = BlockManager(32, 4, num_cpu_blocks=8)
    bm.allocate(1, torch.arange(9))
    bm.allocate(2, np.arange(5, dtype=np.int32))
    results = {
        "append_tokens": (bm.append_tokens(torch.tensor([1, 2]), [3, 4]), torch.int64, (2,)),
        "block_tables": (bm.block_tables([1, 2], max_blocks=4), torch.int32, (2, 4)),
        "num_tokens": (bm.num_tokens(torch.tensor([1, 2], dtype=torch.int32)), torch.int32, (2,)),
        "slot_mapping": (bm.slot_mapping(1, 0, 10), torch.int64, (10,)),
        "slot_mappings": (bm.slot_mappings([1, 2], [0, 0]), torch.int64, (16,)),
        "take_copies": (bm.take_copies(), torch.int64, (0, 2)),
        "swap_out": (bm.swap_out([2]), torch.int64, (2, 2)),
    }
    for name, t in zip(("slots", "tables", "seq_lens", "query_start_loc"), bm.attention_inputs([1], [8])):
        results[name] = (t, t.dtype, tuple(t.shape))
    expected = {k: v[0].clone() for k, v in results.items()}
    del bm  # the tensors outlive the manager
    for name, (t, dtype, shape) in results.items():
        assert type(t) is torch.Tensor and t.device.type == "cpu", name
        assert t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous(), name
        assert torch.equal(t, expected[name]), name
        t.add_(1)  # writable
        assert torch.equal(t, expected[name] + 1), name
    assert results["slot_mapping"][0].data_ptr() % 64 == 0
    assert results["slot_mapping"][0].tolist()[:3] == [1, 2, 3]


def test_contiguous_int64_tensors_are_read_in_place_and_others_converted(dlpack_path):
    ref, bm = BlockManager(32, 4), BlockManager(32, 4)
    prompt = list(range(100, 113))
    for i, tokens in enumerate([torch.tensor(prompt), torch.tensor(prompt, dtype=torch.int32),
                                torch.tensor(prompt).repeat_interleave(2)[::2], torch.tensor([0] + prompt)[1:]]):
        assert bm.allocate(i, tokens) == ref.allocate(i, prompt)
        assert bm.token_ids(i) == prompt
    bm.mark_computed([0, 1, 2, 3])
    ref.mark_computed([0, 1, 2, 3])
    strided_rows = torch.tensor([prompt, prompt]).t().contiguous().t()  # [2, 13], strides (1, 2)
    assert bm.allocate_batch([10, 11], strided_rows) == ref.allocate_batch([10, 11], [prompt, prompt]) == [12, 12]
    assert bm.token_ids(11) == prompt
    assert bm.block_tables(torch.tensor([0, 1])).tolist() == ref.block_tables([0, 1]).tolist()
    bm.check_invariants()


HOSTILE_TENSOR_CALLS = {
    "meta tokens": "bm.allocate(9, torch.ones(3, device='meta', dtype=torch.long))",
    "meta ids": "bm.block_tables(torch.zeros(2, device='meta', dtype=torch.long))",
    "meta 0-d id": "bm.mark_computed(torch.tensor(1, device='meta'))",
    "meta prompts": "bm.allocate_batch([9], torch.ones(1, 3, device='meta', dtype=torch.long))",
    "meta outcomes": "bm.complete_offloads(torch.ones(0, device='meta', dtype=torch.bool))",
    "sparse tokens": "bm.allocate(9, torch.sparse_coo_tensor([[0, 2]], [1, 2], (4,)))",
    "0-d tokens": "bm.allocate(9, torch.tensor(5))",
    "0-d ids": "bm.num_tokens(torch.tensor(1))",
    "0-d float id": "bm.num_tokens(torch.tensor(1.5))",
    "2-D ids": "bm.block_tables(torch.zeros(2, 2, dtype=torch.long))",
    "3-D prompts": "bm.allocate_batch([9], torch.zeros(1, 2, 2, dtype=torch.long))",
    "float prompts": "bm.allocate_batch([9], torch.zeros(1, 3))",
    "transposed prompts": "bm.allocate_batch([9, 10], torch.arange(6).view(3, 2).t())",
    "float tokens": "bm.allocate(9, torch.ones(3))",
    "nan tokens": "bm.allocate(9, torch.tensor([1.0, float('nan')]))",
    "complex tokens": "bm.allocate(9, torch.ones(3, dtype=torch.complex64))",
    "bool tokens": "bm.allocate(9, torch.tensor([True, False]))",
    "float requiring grad": "bm.allocate(9, torch.ones(3, requires_grad=True))",
    "uint64 huge": "bm.allocate(9, torch.tensor([1, 2 ** 64 - 1], dtype=torch.uint64))",
    "int32 ids unknown": "bm.block_tables(torch.tensor([7, 2 ** 31 - 1], dtype=torch.int32))",
    "int64 extremes": "bm.slot_mappings(torch.tensor([1]), torch.tensor([-2 ** 63]))",
    "uint8 counts": "bm.append_tokens([1], [5, 6], torch.tensor([2], dtype=torch.uint8))",
    "float outcomes": "bm.complete_loads(torch.ones(2))",
    "2-D outcomes": "bm.complete_loads(torch.ones(1, 1, dtype=torch.bool))",
    "int outcomes": "bm.complete_loads(torch.zeros(0, dtype=torch.int16))",
    "numpy 2-D prompts": "bm.allocate_batch([9], np.zeros((1, 3), dtype=np.float64))",
    "numpy object array": "bm.allocate(9, np.array([1, None], dtype=object))",
    "numpy 0-d": "bm.allocate(9, np.array(3))",
    "numpy non-contiguous": "bm.allocate(9, np.arange(12).reshape(3, 4)[:, 1])",
    "fake tokens": "from torch._subclasses.fake_tensor import FakeTensorMode\n"
                   "with FakeTensorMode():\n    fake = torch.arange(3)\nbm.allocate(9, fake)",
    "fake ids": "from torch._subclasses.fake_tensor import FakeTensorMode\n"
                "with FakeTensorMode():\n    fake = torch.arange(2)\nbm.block_tables(fake)",
    "hash of a meta tensor": "pagedkv.hash_block_tokens(torch.ones(4, device='meta', dtype=torch.long))",
}

HOSTILE_TENSOR_SCRIPT = """
import json, sys, numpy as np, torch, pagedkv
from pagedkv import _C
_C._set_dlpack_exchange(sys.argv[1] == "1")
for case, call in json.loads(sys.argv[2]).items():
    print("case", case, flush=True)  # the last one printed names a case that killed the process
    bm = pagedkv.BlockManager(16, 4, num_cpu_blocks=4, num_host_blocks=4)
    bm.allocate(1, [1, 2, 3, 4, 5])
    try:
        exec(call)
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        assert str(e), case
    except RuntimeError as e:
        assert "free" in str(e), (case, e)  # only "not enough blocks" is a RuntimeError
    bm.check_invariants()
print("survived")
"""


@pytest.mark.parametrize("exchange", ["1", "0"], ids=["exchange table", "capsules"])
def test_hostile_tensors_never_abort_the_process(exchange):
    """Hostile tensors and arrays, in a fresh interpreter (a crash fails this test, it does not end the
    run): each call returns or raises a documented exception."""
    done = subprocess.run([sys.executable, "-c", HOSTILE_TENSOR_SCRIPT, exchange, json.dumps(HOSTILE_TENSOR_CALLS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.endswith("survived\n"), (done.stdout[-500:], done.stderr[-3000:])
