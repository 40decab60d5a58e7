"""Paged KV-cache bookkeeping in plain Python: free list, reference counts and prefix caching.

The pool has ``num_blocks`` blocks of ``block_size`` token slots. A sequence's ``block_table`` lists its
blocks in position order, so the slot of position ``p`` is ``block_table[p // block_size] * block_size +
p % block_size`` (the model runner computes that; this module never touches tensors).

Prefix caching (``enable_prefix_caching``). A *full* block whose K/V have been computed is identified by a
hash chained over its tokens and its predecessor's hash: ``h_i = hash((h_{i-1}, tokens of block i))``, so
equal hashes mean equal whole prefixes. Such a block is registered in a hash table and stays there after
its last user frees it (ref count 0, "cached free"); a later sequence with the same prefix takes it again
(a hit: those tokens are not recomputed). When no truly empty block is left, the least recently freed
cached block is evicted (LRU) and reused. The token tuple is stored beside the hash and compared on a hit,
so a hash collision can never serve wrong K/V.

Write safety: a block that is registered (full) or shared (ref count > 1) is immutable. A sequence only
writes positions ``>= num_computed_tokens``; a hit always ends on a block boundary, so the block being
written is the sequence's own private, partial (unregistered) last block. ``check_invariants`` verifies the
bookkeeping and the property tests call it after every operation.

The "contiguous" cache of the engine is this same manager with ``block_size = max_model_len`` and
``num_blocks = max_num_seqs`` and no prefix caching: one block per sequence, reserved at admission.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from workbench.config import ceil_div, check_positive_ints
from workbench.request import Sequence


class Block:
    """One KV block: its id, reference count and, once full and registered, its prefix hash and tokens."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.hash is not None})"


class BlockManager:
    """Allocates KV blocks to sequences; optionally shares full blocks across sequences by prefix hash."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        check_positive_ints(self, ("num_blocks", "block_size"))
        self.enable_prefix_caching = bool(enable_prefix_caching)
        # Blocks are made when first taken (ids in order), so a pool sized from an accelerator's memory (millions of
        # blocks) costs what the run uses: ``blocks`` holds the ids taken so far, ids from len(blocks) on are fresh.
        self.blocks: list[Block] = []
        self._empty: deque[int] = deque()  # ref 0, no hash, taken before (fresh ids are taken first, then these)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, registered; oldest first (LRU)
        self._hash_to_block: dict[int, int] = {}
        # cumulative counters
        self.num_hit_tokens = 0  # prompt/recompute tokens served from the prefix cache
        self.num_evictions = 0

    # ---- counters ----------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user: empty ones plus cached ones that may be evicted."""
        return self.num_blocks - len(self.blocks) + len(self._empty) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or free)."""
        return len(self._hash_to_block)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return ceil_div(num_tokens, self.block_size)

    # ---- low level ---------------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if len(self.blocks) < self.num_blocks:  # a fresh block: before any freed one, as a free list 0..n-1 would be
            block_id = len(self.blocks)
            self.blocks.append(Block(block_id))
        elif self._empty:
            block_id = self._empty.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently freed
            block = self.blocks[block_id]
            del self._hash_to_block[block.hash]  # type: ignore[arg-type]
            block.hash = block.token_ids = None
            self.num_evictions += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def _acquire_cached(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._evictable[block_id] = None  # most recently freed goes last
            else:
                self._empty.append(block_id)

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """The chained hashes of the first ``num_full_blocks`` blocks of ``seq`` (memoised on the seq): each block's
        tokens hashed with its predecessor's hash (-1 for the first)."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash((hashes[-1] if hashes else -1, tuple(seq.token_slice(i * bs, (i + 1) * bs)))))
        return hashes

    def _lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, max_blocks)
        hits: list[int] = []
        bs = self.block_size
        for i in range(max_blocks):
            block_id = self._hash_to_block.get(hashes[i])
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(seq.token_slice(i * bs, (i + 1) * bs)):
                break  # a hash collision: never serve another prefix's K/V
            hits.append(block_id)
        return hits

    # ---- sequence level ----------------------------------------------------------------------------------
    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that ``allocate`` would take from the prefix cache now (no side effect)."""
        return len(self._lookup_prefix(seq)) * self.block_size

    def allocate(self, seq: Sequence, watermark_blocks: int = 0) -> bool:
        """Give a waiting sequence blocks for all its current tokens, reusing cached prefix blocks.

        On success sets ``seq.block_table``, ``seq.num_cached_tokens`` and ``seq.num_computed_tokens`` (the
        hit tokens, a multiple of ``block_size``, always fewer than ``seq.num_tokens``) and returns True.
        On failure (not enough free blocks beyond ``watermark_blocks``) changes nothing and returns False.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds KV blocks")
        hits = self._lookup_prefix(seq)
        num_new = self.num_blocks_for(seq.num_tokens) - len(hits)
        hits_from_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if num_new + hits_from_free > self.num_free_blocks - watermark_blocks:
            return False
        for block_id in hits:
            self._acquire_cached(block_id)
        seq.block_table = hits + [self._take_free_block() for _ in range(num_new)]
        seq.num_committed_blocks = len(hits)
        hit_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens = hit_tokens
        self.num_hit_tokens += hit_tokens
        return True

    def append_slots(self, seq: Sequence, num_positions: int) -> bool:
        """Grow ``seq.block_table`` to cover positions ``[0, num_positions)``; False, unchanged, if short."""
        needed = self.num_blocks_for(num_positions) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def truncate(self, seq: Sequence, num_positions: int) -> None:
        """Shrink ``seq.block_table`` to the blocks of positions ``[0, num_positions)``, returning the rest to the
        pool: speculative decoding's rollback of rejected positions. The blocks dropped lie beyond the computed
        positions, so they are private and unregistered (checked)."""
        keep = self.num_blocks_for(num_positions)
        if keep < seq.num_committed_blocks:
            raise RuntimeError(f"truncate of sequence {seq.seq_id} to {num_positions} positions drops a cached block")
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            if block.ref_count != 1 or block.hash is not None:
                raise RuntimeError(f"truncate of sequence {seq.seq_id}: {block} is shared or cached")
            self._release(block_id)

    def mark_computed(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache (call after each step)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_committed_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_committed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            h = hashes[i]
            if block.hash is not None or h in self._hash_to_block:
                continue  # registered already, or an identical block of another sequence is cached
            block.hash = h
            block.token_ids = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            self._hash_to_block[h] = block.block_id
        seq.num_committed_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release all blocks of ``seq`` (last block first, so a prefix's tail is evicted before its head)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_committed_blocks = 0

    # ---- checks ------------------------------------------------------------------------------------------
    def check_invariants(self, block_tables: list[list[int]] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent.

        With ``block_tables`` (those of all live sequences), also checks that each block's ref count equals
        the number of tables holding it, and that no table holds a block twice.
        """
        empty, evictable = set(self._empty), set(self._evictable)
        assert len(empty) == len(self._empty), "a block is twice in the free list"
        assert not (empty & evictable), "a block is both empty and cached-free"
        for block in self.blocks:
            free = block.block_id in empty or block.block_id in evictable
            assert block.ref_count >= 0, f"negative ref count on {block}"
            assert (block.ref_count == 0) == free, f"{block} free-list membership disagrees with its ref count"
            if block.block_id in empty:
                assert block.hash is None, f"{block} is empty but carries a hash"
            if block.block_id in evictable:
                assert block.hash is not None, f"{block} is cached-free without a hash"
            if block.hash is not None:
                assert self._hash_to_block.get(block.hash) == block.block_id, f"{block} hash not in the table"
                assert block.token_ids is not None and len(block.token_ids) == self.block_size
        assert len(self._hash_to_block) == sum(b.hash is not None for b in self.blocks)
        if block_tables is not None:
            counts = [0] * len(self.blocks)
            for table in block_tables:
                assert len(set(table)) == len(table), f"a block appears twice in one table {table}"
                for block_id in table:
                    counts[block_id] += 1
            for block in self.blocks:
                assert counts[block.block_id] == block.ref_count, (
                    f"{block}: ref count {block.ref_count} but held by {counts[block.block_id]} sequences"
                )
