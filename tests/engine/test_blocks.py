"""BlockManager, one operation at a time, and every rejected input."""

import numpy as np
import pytest

from pagedvk import NoFreeBlocksError, PagedVKError
from pagedvk.engine.blocks import BlockManager


def test_add_sequence_slots_and_tables():
    m = BlockManager(8, 4)
    w = m.add_sequence("a", [5, 6, 7, 8, 9, 10])
    assert w.slots.dtype == np.int32 and w.num_cached == 0 and w.copies == []
    table = m.block_table("a")
    assert w.slots.tolist() == [table[0] * 4 + i for i in range(4)] + [table[1] * 4, table[1] * 4 + 1]
    tables, lens = m.block_tables(["a"], max_blocks=4)
    assert tables.dtype == lens.dtype == np.int32
    assert tables.tolist() == [table + [-1, -1]] and lens.tolist() == [6]
    assert m.num_free_blocks == 6


def test_append_fills_the_last_block_then_takes_a_new_one():
    m = BlockManager(8, 4)
    m.add_sequence(0, [1, 2, 3])
    w = m.append_tokens(0, [4, 5])
    t = m.block_table(0)
    assert len(t) == 2 and w.slots.tolist() == [t[0] * 4 + 3, t[1] * 4]
    assert m.tokens(0) == [1, 2, 3, 4, 5] and m.seq_len(0) == 5


def test_fork_copies_the_shared_partial_block_once():
    m = BlockManager(8, 4)
    m.add_sequence("p", [1, 2, 3, 4, 5])
    m.fork("p", "c")
    full, partial = m.block_table("p")
    w = m.append_tokens("c", [6])
    new = m.block_table("c")[1]
    assert w.copies == [(partial, new)] and w.slots.tolist() == [new * 4 + 1]
    assert m.block_table("c")[0] == full              # the full block stays shared
    w = m.append_tokens("p", [7])                     # now the parent owns its block alone: no copy
    assert w.copies == [] and w.slots.tolist() == [partial * 4 + 1]
    assert m.stats["forks"] == 1 and m.stats["cow_copies"] == 1


def test_prefix_hit_shares_full_blocks_but_not_the_last_token():
    m = BlockManager(8, 2)
    m.add_sequence(0, [1, 2, 3, 4, 5])
    w = m.add_sequence(1, [1, 2, 3, 4, 9])
    assert w.num_cached == 4 and m.block_table(1)[:2] == m.block_table(0)[:2]
    w = m.add_sequence(2, [1, 2, 3, 4])               # its last token must be computed: one block hit only
    assert w.num_cached == 2 and len(w.slots) == 2
    w = m.add_sequence(3, [7, 2, 3, 4, 5])            # same later blocks, other prefix: no hit
    assert w.num_cached == 0
    assert m.stats["prefix_hit_blocks"] == 3


def test_cached_prefix_tells_what_add_sequence_would_share():
    m = BlockManager(8, 2)
    m.add_sequence(0, [1, 2, 3, 4, 5])
    free = m.num_free_blocks
    assert m.cached_prefix([1, 2, 3, 4, 9, 9]) == (4, 0)   # two blocks in use by sequence 0: none taken from free
    assert m.cached_prefix([1, 2, 3, 4]) == (2, 0)         # not the block holding the last token
    assert m.cached_prefix([1, 2]) == (0, 0) and m.cached_prefix([7, 2, 3]) == (0, 0)
    assert m.num_free_blocks == free and m.stats["prefix_hit_blocks"] == 0   # a query: nothing taken or counted
    m.free(0)                                              # its full blocks stay cached, now free
    assert m.cached_prefix([1, 2, 3, 4, 9]) == (4, 2)
    # the two free hits and one new block: as many as sequence 0 held
    assert m.add_sequence(1, [1, 2, 3, 4, 9]).num_cached == 4 and m.num_free_blocks == free
    assert BlockManager(8, 2, prefix_caching=False).cached_prefix([1, 2, 3]) == (0, 0)
    with pytest.raises(ValueError, match="tokens must hold at least 1 token"):
        m.cached_prefix([])


def test_freed_blocks_stay_cached_until_evicted_lru():
    m = BlockManager(4, 2)
    m.add_sequence(0, [1, 2, 3])
    m.add_sequence(1, [7, 8, 9])
    kept = m.block_table(0)[0]
    m.free(0)
    m.free(1)
    assert m.num_free_blocks == 4
    w = m.add_sequence(2, [1, 2, 5])                  # seq 0's block is found after its free
    assert w.num_cached == 2 and m.block_table(2)[0] == kept
    m.free(2)
    m.add_sequence(3, [4, 4, 4, 4, 4, 4, 4])          # takes every block: the cached ones are evicted
    m.free(3)
    assert m.add_sequence(4, [1, 2, 5]).num_cached == 0


def test_no_prefix_caching():
    m = BlockManager(8, 2, prefix_caching=False)
    m.add_sequence(0, [1, 2, 3])
    assert m.add_sequence(1, [1, 2, 3]).num_cached == 0


def test_out_of_blocks_raises_and_changes_nothing():
    m = BlockManager(2, 2)
    m.add_sequence(0, [1, 2, 3])
    assert issubclass(NoFreeBlocksError, PagedVKError)
    with pytest.raises(NoFreeBlocksError, match="needs 1 free blocks; 0 free"):
        m.append_tokens(0, [4, 5])
    assert m.tokens(0) == [1, 2, 3] and m.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        m.add_sequence(1, [1])
    assert 1 not in m.seqs
    assert m.blocks_to_append(0, 1) == 0 and m.blocks_to_append(0, 2) == 1


def test_swap_out_and_in_restores_the_sequences_and_keeps_sharing():
    m = BlockManager(6, 2, num_host_blocks=4, prefix_caching=False)
    m.add_sequence("p", [1, 2, 3])
    m.fork("p", "c")
    dev = m.block_table("p")
    out = m.swap_out(["p", "c"])
    assert [d for d, _ in out] == dev and m.num_free_blocks == 6
    assert m.is_swapped("p") and m.block_table("p") == m.block_table("c") == [h for _, h in out]
    back = m.swap_in(["c", "p"])
    assert [h for h, _ in back] == [h for _, h in out]
    assert m.block_table("p") == m.block_table("c") == [d for _, d in back]
    assert m.tokens("c") == [1, 2, 3] and m.num_free_blocks == 4


def test_swap_in_shares_a_block_still_in_the_prefix_cache():
    m = BlockManager(6, 2, num_host_blocks=4)
    m.add_sequence("a", [1, 2, 3])
    m.add_sequence("b", [1, 2, 4])                    # shares block 0 with a
    m.swap_out(["a"])
    back = m.swap_in(["a"])
    assert len(back) == 1 and m.block_table("a")[0] == m.block_table("b")[0]


def test_swap_out_without_host_blocks_raises():
    m = BlockManager(4, 2, num_host_blocks=1)
    m.add_sequence(0, [1, 2, 3])
    with pytest.raises(NoFreeBlocksError, match="host"):
        m.swap_out([0])
    assert not m.is_swapped(0)


def test_free_a_swapped_sequence_returns_its_host_blocks():
    m = BlockManager(4, 2, num_host_blocks=2)
    m.add_sequence(0, [1, 2, 3])
    m.swap_out([0])
    m.free(0)
    assert len(m.host.free) == 2 and m.num_free_blocks == 4


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_blocks=0, block_size=4), ValueError, "num_blocks must be >= 1"),
    (dict(num_blocks=4, block_size=0), ValueError, "block_size must be >= 1"),
    (dict(num_blocks=4, block_size=2, num_host_blocks=-1), ValueError, "num_host_blocks must be >= 0"),
    (dict(num_blocks=4.0, block_size=2), TypeError, "num_blocks must be an int"),
    (dict(num_blocks=4, block_size=True), TypeError, "block_size must be an int"),
])
def test_constructor_rejects(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        BlockManager(**kwargs)


def test_rejected_calls():
    m = BlockManager(8, 2, num_host_blocks=4)
    m.add_sequence(0, [1, 2])
    with pytest.raises(ValueError, match="seq_id 0 is already in use"):
        m.add_sequence(0, [1])
    with pytest.raises(ValueError, match="tokens must hold at least 1 token"):
        m.add_sequence(1, [])
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        m.add_sequence(1, [3, -1])
    with pytest.raises(TypeError, match="tokens must be a 1-d sequence of ints"):
        m.add_sequence(1, [1.5])
    with pytest.raises(TypeError, match="tokens must be a 1-d sequence of ints"):
        m.append_tokens(0, [[1]])
    with pytest.raises(ValueError, match="seq_id 9 is not a sequence"):
        m.append_tokens(9, [1])
    with pytest.raises(ValueError, match="seq_id 9 is not a sequence"):
        m.free(9)
    with pytest.raises(ValueError, match="parent_id 9 is not a sequence"):
        m.fork(9, 10)
    with pytest.raises(ValueError, match="child_id 0 is already in use"):
        m.fork(0, 0)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        m.blocks_to_append(0, -1)
    with pytest.raises(ValueError, match="max_blocks must be >= 1"):
        m.block_tables([0], max_blocks=0)
    m.append_tokens(0, [3])
    with pytest.raises(ValueError, match=r"max_blocks must be >= 2 \(the longest table\)"):
        m.block_tables([0], max_blocks=1)
    with pytest.raises(ValueError, match="seq_ids must be a non-empty list of distinct"):
        m.swap_out([0, 0])
    with pytest.raises(ValueError, match="seq_ids must be a non-empty list of distinct"):
        m.swap_out([])
    with pytest.raises(ValueError, match="seq_ids: 0 is resident"):
        m.swap_in([0])
    m.swap_out([0])
    with pytest.raises(ValueError, match="seq_ids: 0 is already swapped out"):
        m.swap_out([0])
    with pytest.raises(ValueError, match="seq_id 0 is swapped out; swap_in first"):
        m.append_tokens(0, [1])
    with pytest.raises(ValueError, match="seq_ids 0 is swapped out"):
        m.block_tables([0])


def test_eviction_takes_the_least_recently_freed_cached_block():
    m = BlockManager(4, 2)
    m.add_sequence(0, [1, 2, 0])
    m.free(0)
    m.add_sequence(1, [3, 4, 0])
    m.free(1)                                         # [3, 4] was freed after [1, 2]
    m.add_sequence(2, [5, 5, 5])                      # two blocks: [1, 2]'s goes, [3, 4]'s stays
    assert m.add_sequence(3, [3, 4, 1]).num_cached == 2
    m.free(3)
    assert m.add_sequence(4, [1, 2, 1]).num_cached == 0
