"""Speculative decoding support: several tokens per sequence in one append, lookahead room, truncate."""
import pytest

from pagedkv import AllocStatus, BlockManager


def toks(n, start=0):
    return list(range(start, start + n))


def test_append_with_counts_gives_a_slot_per_token_in_order():
    bm, ref = BlockManager(16, 4), BlockManager(16, 4)
    for m in (bm, ref):
        m.allocate(1, toks(3))
        m.allocate(2, toks(6, 100))
    slots = bm.append_tokens([1, 2], [7, 8, 9, 10, 11], counts=[3, 2]).tolist()
    one_by_one = [ref.append_token(1, t) for t in (7, 8, 9)] + [ref.append_token(2, t) for t in (10, 11)]
    assert slots == one_by_one
    assert bm.token_ids(1) == toks(3) + [7, 8, 9] and bm.block_table(1) == ref.block_table(1)
    assert bm.append_tokens([1, 2], [], counts=[0, 0]).tolist() == []
    bm.check_invariants()


def test_can_append_counts_lookahead_slots():
    bm = BlockManager(3, 4)
    bm.allocate(1, toks(3))  # one block, one free slot in it
    assert bm.can_append([1], num_lookahead_slots=4)       # 5 tokens: this block + 1 more
    assert bm.can_append([1], num_lookahead_slots=8)       # 9 tokens: + 2 more
    assert not bm.can_append([1], num_lookahead_slots=9)   # 10 tokens: + 3 more, only 2 free
    bm.append_tokens([1], toks(9, 50), counts=[9])
    assert bm.num_free_blocks == 0
    with pytest.raises(ValueError, match="num_lookahead_slots"):
        bm.can_append([1], num_lookahead_slots=-1)


def test_can_swap_in_counts_lookahead_slots():
    bm = BlockManager(3, 4, num_cpu_blocks=4)
    bm.allocate(1, toks(8))
    bm.swap_out([1])
    assert bm.can_swap_in([1]) == AllocStatus.OK
    assert bm.can_swap_in([1], num_lookahead_slots=4) == AllocStatus.OK
    assert bm.can_swap_in([1], num_lookahead_slots=5) == AllocStatus.NEVER


def test_truncate_releases_blocks_past_the_kept_tokens():
    bm = BlockManager(8, 4)
    bm.allocate(1, toks(5))
    bm.append_tokens([1], toks(6, 50), counts=[6])  # 11 tokens, 3 blocks
    assert bm.num_free_blocks == 5
    bm.truncate(1, 4)  # exactly one full block left
    assert bm.num_tokens(1) == 4 and len(bm.block_table(1)) == 1 and bm.num_free_blocks == 7
    bm.truncate([1], [2])
    assert bm.token_ids(1) == [0, 1]
    bm.check_invariants()


def test_truncate_into_a_cached_block_copies_before_the_next_write():
    bm = BlockManager(8, 4)
    bm.allocate(1, toks(8))
    bm.mark_computed(1)  # both blocks cached
    cached_block = bm.block_table(1)[1]
    bm.truncate(1, 6)
    bm.append_tokens([1], [99])  # must not overwrite the cached KV of tokens 4..7 in place
    assert bm.block_table(1)[1] != cached_block
    assert bm.take_copies().tolist() == [[cached_block, bm.block_table(1)[1]]]
    bm.allocate(2, toks(9))
    assert bm.block_table(2)[:2] == [bm.block_table(1)[0], cached_block]  # still a hit for others
    bm.check_invariants()


def test_rejected_tokens_never_enter_the_prefix_cache():
    bm = BlockManager(8, 4)
    bm.allocate(1, toks(3))
    bm.mark_computed(1)
    bm.append_tokens([1], [3, 70, 71, 72, 73], counts=[5])  # input token 3 + four drafts
    bm.truncate(1, 5)  # accepted: 3 and 70
    bm.mark_computed(1)
    assert bm.token_ids(1) == [0, 1, 2, 3, 70]
    assert bm.allocate(2, [0, 1, 2, 3, 70, 71, 72, 73, 5]) == 4  # only the accepted full block hits


@pytest.mark.parametrize("call, exc", [
    (lambda bm: bm.truncate(1, 0), ValueError),
    (lambda bm: bm.truncate(1, 99), ValueError),
    (lambda bm: bm.truncate([1, 1], [2, 2]), ValueError),
    (lambda bm: bm.truncate([1, 2], [2]), ValueError),
    (lambda bm: bm.truncate(9, 2), KeyError),
    (lambda bm: bm.truncate(1, [2]), TypeError),
    (lambda bm: bm.append_tokens([1, 2], [1, 2, 3], counts=[1, 1]), ValueError),
    (lambda bm: bm.append_tokens([1, 2], [1, 2], counts=[2]), ValueError),
    (lambda bm: bm.append_tokens([1], [1], counts=[-1]), ValueError),
    (lambda bm: bm.append_tokens([1], [1] * 40, counts=[40]), RuntimeError),
])
def test_bad_speculative_calls_change_nothing(call, exc):
    bm = BlockManager(8, 4)
    bm.allocate(1, toks(5))
    bm.allocate(2, toks(3, 9))
    before = (bm.num_free_blocks, bm.stats(), [bm.token_ids(i) for i in (1, 2)], [bm.block_table(i) for i in (1, 2)])
    with pytest.raises(exc):
        call(bm)
    assert before == (bm.num_free_blocks, bm.stats(), [bm.token_ids(i) for i in (1, 2)],
                      [bm.block_table(i) for i in (1, 2)])
