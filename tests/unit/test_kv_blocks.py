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


def _admit(t, sid, prompt, seed=""):
    """What the pool does for a joining prompt: attach its cached prefix, reserve the rest, register it."""
    cached = t.attach(sid, prompt, seed)
    t.append(sid, len(prompt) - cached)
    t.register(sid, prompt, seed)
    return cached


def test_a_cached_prefix_is_shared_and_reference_counted():
    t = BlockTables(num_blocks=8, block_size=2)
    system = [1, 2, 3, 4, 5]
    assert _admit(t, 0, system + [6]) == 0 and t.tables[0] == [0, 1, 2] and t.cached_blocks == 3
    assert _admit(t, 1, system + [7, 8]) == 4       # blocks 0, 1; token 5 on is its own
    assert t.tables[1][:2] == [0, 1] and t.lengths[1] == 7 and t.slots(1)[:4] == [0, 1, 2, 3]
    assert t.used_blocks == 5 and t.free_blocks == 3
    assert t.free([0]) == 1                          # blocks 0 and 1 still held by sequence 1
    assert t.used_blocks == 4 and t.free_blocks == 4 and t.cached_blocks == 4
    assert t.free([1]) == 4 and t.used_blocks == 0 and t.cached_blocks == 4  # freed, still cached
    assert _admit(t, 2, system + [6, 9]) == 6        # all three blocks of sequence 0's prompt
    assert t.tables[2][:3] == [0, 1, 2]


def test_the_last_prompt_token_is_always_computed():
    t = BlockTables(num_blocks=8, block_size=2)
    _admit(t, 0, [1, 2, 3, 4])
    assert t.attach(1, [1, 2, 3, 4], "") == 2        # (4 - 1) // 2 blocks: the 4th token makes the logits
    assert t.attach(2, [1, 2], "") == 0 and t.attach(3, [1], "") == 0
    assert t.attach(4, [1, 2, 3, 4, 5], "") == 4


def test_hashes_chain_the_whole_prefix_and_adapters_seed_them():
    t = BlockTables(num_blocks=16, block_size=2)
    h = t.block_hashes([1, 2, 3, 4, 5])
    assert len(h) == 2 and len(set(h)) == 2
    assert t.block_hashes([9, 9, 3, 4])[1] != h[1]     # same 2nd block, another first: another hash
    assert t.block_hashes([1, 2, 3, 4], "lora-a")[0] != h[0]
    _admit(t, 0, [1, 2, 3, 4, 5])
    assert t.attach(1, [9, 9, 3, 4, 5], "") == 0     # only the chain from token 0 counts
    assert t.attach(2, [1, 2, 3, 4, 5], "lora-a") == 0  # an adapter never shares with the bare model
    assert t.attach(3, [1, 2, 3, 4, 5], None) == 0   # no cache (a scored prompt)
    _admit(t, 4, [1, 2, 3, 4, 5], "lora-a")
    assert t.attach(5, [1, 2, 3, 4, 6], "lora-a") == 4 and t.tables[5] == t.tables[4][:2]
    with pytest.raises(ValueError, match="already has blocks"):
        t.attach(5, [1, 2, 3], "")


def test_appends_take_free_blocks_first_then_evict_least_recently_used():
    t = BlockTables(num_blocks=5, block_size=2)
    _admit(t, 0, [1, 2, 3])                          # blocks 0 (cached), 1
    _admit(t, 1, [7, 8, 9])                          # blocks 2 (cached), 3
    t.free([0])
    t.free([1])                                      # cached, idle: block 0, then block 2
    assert t.free_blocks == 5 and t.cached_blocks == 2
    assert t.append(2, 6) == [2 * b + i for b in (1, 3, 4) for i in range(2)]  # the truly free ones
    assert t.cached_blocks == 2
    assert t.append(2, 2) == [0, 1] and t.cached_blocks == 1  # then the least recently freed: block 0
    assert t.attach(3, [1, 2, 3], "") == 0 and t.attach(4, [7, 8, 9], "") == 2
    with pytest.raises(PoolFull, match="0 of 5 are free"):
        t.append(5, 1)                               # block 2 is held again: nothing to evict


def test_renumber_drops_idle_cached_blocks_and_moves_shared_ones_once():
    t = BlockTables(num_blocks=8, block_size=2)
    _admit(t, 0, [5, 6, 7])                          # blocks 0, 1
    _admit(t, 1, [1, 2, 3, 4, 9])                    # blocks 2, 3 (cached), 4
    _admit(t, 2, [1, 2, 3, 4, 8])                    # shares 2, 3; takes 5
    t.free([0])                                      # block 0 idle (cached), 1 free
    assert t.renumber() == [2, 3, 4, 5]              # the held blocks, a shared one once
    assert t.tables == {1: [0, 1, 2], 2: [0, 1, 3]} and t.cached_blocks == 2 and t.free_blocks == 4
    assert t.attach(3, [5, 6, 7], "") == 0           # the idle block left the cache
    assert t.attach(4, [1, 2, 3, 4, 0], "") == 4 and t.tables[4] == [0, 1]
    t.forget_cache()                                 # held blocks stay held, nothing is found any more
    assert t.cached_blocks == 0 and t.used_blocks == 4 and t.attach(5, [1, 2, 3, 4, 0], "") == 0
    t.clear()
    assert (t.used_blocks, t.cached_blocks, t.free_blocks) == (0, 0, 8)
