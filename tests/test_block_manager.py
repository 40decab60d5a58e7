"""BlockManager: hand-checked cases and hypothesis property tests over random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.errors import ConfigError
from workbench.kv.block_manager import BlockManager
from workbench.request import Sequence


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)


def test_allocate_append_free_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(0, list(range(10)))  # 10 tokens -> 3 blocks
    assert bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.append_slots(a, 12)  # still 3 blocks
    assert bm.num_used_blocks == 3
    assert bm.append_slots(a, 13)  # a 4th block
    assert bm.num_used_blocks == 4
    assert not bm.append_slots(a, 40)  # needs 6 more, only 4 free: nothing changes
    assert len(a.block_table) == 4
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == []
    bm.check_invariants([])


def test_allocate_fails_without_side_effects() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate(seq_of(0, [1] * 12))
    b = seq_of(1, [2] * 8)
    assert not bm.allocate(b)
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert not bm.allocate(seq_of(2, [3] * 2), watermark_blocks=1)
    assert bm.allocate(seq_of(2, [3] * 2))


def test_prefix_hit_reuses_blocks_and_leaves_one_token() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = seq_of(0, list(range(10)))  # blocks [0-3] [4-7] [8,9]
    assert bm.allocate(a)
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2  # the two full blocks
    b = seq_of(1, list(range(8)) + [50, 51, 52])  # shares the two full blocks
    assert bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    # a prompt that is exactly the cached 8 tokens: the last block is recomputed (one token at least)
    c = seq_of(2, list(range(8)))
    assert bm.num_cached_prefix_tokens(c) == 4
    # a different first block: no hit even if the second block's tokens match (chained hash)
    d = seq_of(3, [99, 1, 2, 3] + list(range(4, 8)) + [0])
    assert bm.num_cached_prefix_tokens(d) == 0
    assert bm.num_hit_tokens == 8
    bm.check_invariants([a.block_table, b.block_table])


def test_freed_cached_blocks_are_evicted_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = seq_of(0, [1, 2, 3, 4, 5])  # 3 blocks, 2 full
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)  # freed last block first: evictable order = block of [3,4], then [1,2]
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2 and bm.num_evictable_blocks == 2
    b = seq_of(1, [7, 7, 7, 7, 7, 7])  # needs 3 blocks: 2 empty ones, then evicts the LRU cached one
    bm.allocate(b)
    assert bm.num_evictions == 1 and bm.num_cached_blocks == 1
    # the [3,4] block (freed first) is gone; [1,2] survives and is still a hit
    c = seq_of(2, [1, 2, 9])
    assert bm.num_cached_prefix_tokens(c) == 2
    e = seq_of(3, [1, 2, 3, 4, 9])
    assert bm.num_cached_prefix_tokens(e) == 2
    bm.check_invariants([b.block_table])


def test_contiguous_configuration() -> None:
    bm = BlockManager(num_blocks=2, block_size=64)  # max_model_len 64, 2 slots
    a, b, c = seq_of(0, [1] * 60), seq_of(1, [2]), seq_of(2, [3])
    assert bm.allocate(a) and bm.allocate(b) and not bm.allocate(c)
    assert bm.append_slots(a, 64) and not bm.append_slots(a, 65)


def test_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        BlockManager(4, 0)
    with pytest.raises(ConfigError, match="num_blocks"):
        BlockManager(-1, 16)


# ---- property tests ----------------------------------------------------------------------------------------
# operations: (kind, seq index, amount); tokens come from a tiny alphabet so that prefixes collide often
OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "compute", "grow", "free", "preempt"]),
        st.integers(0, 5),
        st.integers(1, 9),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(1, 12),
    caching=st.booleans(),
    prompt_seed=st.integers(0, 3),
)
def test_random_operations_keep_the_books(
    ops: list[tuple[str, int, int]], block_size: int, num_blocks: int, caching: bool, prompt_seed: int
) -> None:
    bm = BlockManager(num_blocks, block_size, caching)
    live: dict[int, Sequence] = {}
    # what each live block should contain: (block id, offset) -> token, written only by its owner
    contents: dict[tuple[int, int], int] = {}
    next_id = 0
    for kind, idx, amount in ops:
        if kind == "admit":
            tokens = [(prompt_seed + j * (idx % 2 + 1)) % 3 for j in range(amount + idx)]
            seq = seq_of(next_id, tokens)
            next_id += 1
            free_before = bm.num_free_blocks
            if bm.allocate(seq):
                live[seq.seq_id] = seq
                assert seq.num_computed_tokens % block_size == 0
                assert seq.num_computed_tokens < seq.num_tokens
                # hit blocks hold exactly this sequence's tokens
                for p in range(seq.num_computed_tokens):
                    block_id = seq.block_table[p // block_size]
                    assert contents[(block_id, p % block_size)] == seq.token_at(p)
            else:
                assert seq.block_table == [] and bm.num_free_blocks == free_before
        elif live:
            seq = list(live.values())[idx % len(live)]
            if kind == "compute":
                # write the next `amount` positions (the only writes a runner does), then append a token
                end = min(seq.num_computed_tokens + amount, len(seq.block_table) * block_size, seq.num_tokens)
                for p in range(seq.num_computed_tokens, end):
                    block = bm.blocks[seq.block_table[p // block_size]]
                    assert block.ref_count == 1, "write into a shared block"
                    assert block.hash is None, "write into a cached block"
                    contents[(block.block_id, p % block_size)] = seq.token_at(p)
                seq.num_computed_tokens = end
                bm.mark_computed(seq)
                if end == seq.num_tokens:
                    seq.output_token_ids.append(amount % 3)
            elif kind == "grow":
                before = list(seq.block_table)
                ok = bm.append_slots(seq, seq.num_tokens + amount)
                assert seq.block_table[: len(before)] == before
                if not ok:
                    assert seq.block_table == before
            else:  # free / preempt
                bm.free(seq)
                del live[seq.seq_id]
        tables = [s.block_table for s in live.values()]
        bm.check_invariants(tables)  # ref counts == holders, free lists consistent, no block twice
        used = {b for t in tables for b in t}
        assert bm.num_used_blocks == len(used)  # no leak
        assert bm.num_free_blocks + bm.num_used_blocks == num_blocks
        for block in bm.blocks:
            if block.ref_count > 1:
                assert block.hash is not None, "a shared block must be a full, cached (immutable) block"
            if block.hash is not None:  # a cached block's content is what it was registered with
                for off, tok in enumerate(block.token_ids):
                    assert contents[(block.block_id, off)] == tok
    for seq in list(live.values()):
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks
    bm.check_invariants([])


def test_double_free_is_detected() -> None:
    bm = BlockManager(4, 2)
    seq = seq_of(0, [1, 2, 3])
    bm.allocate(seq)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(seq)
