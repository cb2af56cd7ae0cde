"""Block accounting of the paged KV pool (``sched/kv_blocks.py``): no torch, milliseconds."""
import pytest

from computron.sched.kv_blocks import BlockTables, PoolFull

pytestmark = pytest.mark.unit


def test_slots_follow_the_block_table():
    t = BlockTables(num_blocks=4, block_size=2)
    assert t.append(7, 3) == [0, 1, 2]          # blocks 0, 1
    assert t.append(8, 1) == [4]                # block 2
    assert t.append(7, 2) == [3, 6]             # fills block 1, takes block 3
    assert t.tables == {7: [0, 1, 3], 8: [2]} and t.lengths == {7: 5, 8: 1}
    assert t.slots(7) == [0, 1, 2, 3, 6] and t.used_tokens == 6
    assert (t.used_blocks, t.free_blocks) == (4, 0)
    assert t.blocks_needed(7, 1) == 0 and t.blocks_needed(7, 2) == 1 and t.blocks_needed(9, 5) == 3


def test_full_pool_reserves_nothing_and_grows():
    t = BlockTables(num_blocks=2, block_size=4)
    t.append(1, 5)
    with pytest.raises(PoolFull, match="sequence 2 needs 1 more blocks of 4 tokens; 0 of 2 are free"):
        t.append(2, 1)
    assert 2 not in t.lengths or t.lengths[2] == 0
    t.grow(3)
    assert t.append(2, 1) == [8]
    with pytest.raises(ValueError, match="already has 3 blocks"):
        t.grow(2)


def test_free_reuses_lowest_blocks_first_and_renumber_packs_the_used_ones():
    t = BlockTables(num_blocks=6, block_size=1)
    for sid in range(5):
        t.append(sid, 1)                        # sid i in block i
    assert t.free([0, 2, 99]) == 2 and t.used_blocks == 3
    assert t.append(5, 1) == [0]                # the lowest free block
    assert t.high_water() == 5
    order = t.renumber()                        # used: 0 (sid 5), 1, 3, 4
    assert order == [0, 1, 3, 4]
    assert t.tables == {1: [1], 3: [2], 4: [3], 5: [0]} and t.high_water() == 4
    assert t.append(6, 2) == [4, 5] and t.free_blocks == 0
    t.clear()
    assert (t.used_blocks, t.used_tokens, t.tables) == (0, 0, {})


def test_bad_sizes_name_the_field():
    with pytest.raises(ValueError, match="block_size=0"):
        BlockTables(4, 0)
    with pytest.raises(ValueError, match="num_blocks=-1"):
        BlockTables(-1, 4)
