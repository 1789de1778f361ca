"""The tensor-parallel step message packs into one int64 tensor and unpacks to the same fields, dtypes and
shapes, whatever the number of KV groups, with or without a forward and speculative rows."""
import dataclasses

import pytest
import torch

from pagedkv.engine.models.layers import AttentionMetadata, KVGroupInputs
from pagedkv.engine.serving.scheduler import ScheduledBatch
from pagedkv.engine.tp.step_message import MOVES, StepMessage


def assert_same(a: StepMessage, b: StepMessage) -> None:
    for f in dataclasses.fields(StepMessage):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, list):
            assert len(x) == len(y), f.name
            pairs = list(zip(x, y))
        elif x is None or isinstance(x, int):
            assert x == y, f.name
            continue
        else:
            pairs = [(x, y)]
        for u, v in pairs:
            assert u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v), f.name


def random_step(rng: torch.Generator, num_groups: int, speculative: bool):
    b = int(torch.randint(1, 6, (), generator=rng))
    query_lens = torch.randint(1, 9, (b,), generator=rng)
    t = int(query_lens.sum())
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).int()
    groups = [(torch.randint(0, 10 ** 6, (t,), generator=rng),
               torch.randint(0, 1000, (b, int(torch.randint(1, 7, (), generator=rng))), generator=rng).int())
              for _ in range(num_groups)]
    seq_lens = (query_lens + torch.randint(0, 50, (b,), generator=rng)).int()
    meta = AttentionMetadata(seq_lens=seq_lens, query_start_loc=starts, max_seq_len=int(seq_lens.max()),
                             groups=[KVGroupInputs(slots, tables) for slots, tables in groups],
                             logits_indices=torch.arange(t) if speculative else None)
    return torch.randint(0, 32000, (t,), generator=rng), torch.arange(t), meta


@pytest.mark.parametrize("num_groups", [1, 2, 3])
@pytest.mark.parametrize("speculative", [False, True])
def test_round_trip(seed, num_groups, speculative):
    rng = torch.Generator().manual_seed(seed)
    for _ in range(20):
        moves = {name: torch.randint(0, 100, (int(torch.randint(0, 4, (), generator=rng)), 2), generator=rng)
                 for name in MOVES}
        message = StepMessage.of(ScheduledBatch(**moves), random_step(rng, num_groups, speculative))
        packed = message.pack()
        assert packed.dtype == torch.int64 and packed.dim() == 1
        back = StepMessage.unpack(packed)
        assert_same(message, back)
        ids, positions, meta = back.step()
        assert len(meta.groups) == num_groups
        assert all(torch.equal(getattr(back, name), moves[name]) for name in MOVES)


def test_a_step_that_only_moves_blocks():
    message = StepMessage.of(ScheduledBatch(swap_in=torch.tensor([(1, 2)]), copies=torch.tensor([(3, 4), (5, 6)]),
                                            loads=torch.tensor([(7, 8)])))
    back = StepMessage.unpack(message.pack())
    assert_same(message, back)
    assert back.step() is None and back.slot_mappings == [] and back.swap_out.shape == (0, 2)
    assert back.loads.tolist() == [[7, 8]] and back.offloads.shape == (0, 2)

