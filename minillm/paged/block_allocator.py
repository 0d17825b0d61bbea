"""The physical side of paging: a pool of KV blocks handed out from a free list and shared by reference counts.

This module knows block *ids* only; it never touches a tensor (the pools live in `paged_cache.py`) and it knows
nothing of sequences (their block tables live in `block_manager.py`). It adds what an operating system's page
allocator adds to memory: any free block can serve any sequence, so no sequence reserves its maximum length up
front (vLLM, Kwon et al. SOSP 2023, §4.2). What it still leaves out: which block belongs to which sequence, and
reuse of freed blocks by content (prefix caching is a subclass in `prefix_cache.py`).

Invariants (checked by `check_invariants`, relied on by the chapter 06 scheduler):
  1. every block id in [0, num_blocks) is either free (ref count 0, exactly once in the free list) or used
     (ref count >= 1, not in the free list): num_free + num_used == num_blocks;
  2. a failed `allocate` (OutOfBlocks) changes nothing;
  3. `fork`/`free` of a block that is not in use is an error (a double free or a use-after-free), never a
     silent no-op.
"""

from __future__ import annotations

from collections import OrderedDict

from minillm.core.config import check_int, number_kind

MAX_NUM_BLOCKS = 2**31 - 1  # more blocks than any pool could hold; past 2**63 `[0] * num_blocks` itself overflows


class OutOfBlocks(RuntimeError):
    """No free KV block is left. The pool is unchanged, so a scheduler can catch this and preempt someone."""


class BlockStateError(ValueError):
    """A block was used in a state that forbids it: freed twice, forked or written after being freed, unknown id."""


class BlockAllocator:
    """Free list plus reference counts over `num_blocks` physical blocks, numbered 0..num_blocks-1.

    `allocate()` takes a free block (ref count 1); `fork(block)` adds a holder (ref count + 1, used when a child
    sequence shares its parent's blocks); `free(block)` drops one holder and returns the block to the free list
    when the last holder is gone.
    """

    def __init__(self, num_blocks: int):
        num_blocks = check_int("num_blocks", num_blocks)
        if num_blocks > MAX_NUM_BLOCKS:
            raise ValueError(f"num_blocks={num_blocks} is more than a pool can hold (at most {MAX_NUM_BLOCKS})")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        # An OrderedDict is a free list with O(1) removal from the middle (prefix caching revives cached free
        # blocks by id). The head is handed out next; subclasses choose where a released block goes.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    # ----------------------------------------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self.ref_counts[block]

    def is_free(self, block: int) -> bool:
        self._check_id(block)
        return self.ref_counts[block] == 0

    # ----------------------------------------------------------------------------------------------- operations
    def allocate(self) -> int:
        """A free block with ref count 1. Raises OutOfBlocks (changing nothing) when none is free.

        Takes the head of the free list and calls the `self._on_take(block)` hook before handing it out: subclasses
        act there (prefix caching evicts the block's old content so no lookup finds it any more).
        """
        # BEGIN SOLUTION
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self._free.popitem(last=False)  # the head of the free list
        assert self.ref_counts[block] == 0, f"free block {block} has ref count {self.ref_counts[block]}"
        self._on_take(block)
        self.ref_counts[block] = 1
        return block
        # END SOLUTION

    def fork(self, block: int) -> int:
        """One more holder of an in-use block (a sequence sharing it). Returns the new ref count."""
        self.ensure_in_use(block, "fork")
        self.ref_counts[block] += 1
        return self.ref_counts[block]

    def free(self, block: int) -> bool:
        """Drop one holder; True when that was the last and the block went back to the free list."""
        self.ensure_in_use(block, "free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._release(block)
            return True
        return False

    def ensure_in_use(self, block: int, action: str = "use") -> None:
        """Raise BlockStateError unless `block` is a valid id held by someone (ref count >= 1)."""
        self._check_id(block)
        if self.ref_counts[block] == 0:
            raise BlockStateError(f"cannot {action} block {block}: it is free (double free or use after free)")

    # ----------------------------------------------------------------------------------------------- hooks
    def _release(self, block: int) -> None:
        """Put a block whose ref count just reached 0 back on the free list (here: at the tail, FIFO reuse)."""
        self._free[block] = None

    def _on_take(self, block: int) -> None:
        """Called when a free block is handed out again (prefix caching forgets its old content here)."""

    # ----------------------------------------------------------------------------------------------- checks
    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or isinstance(block, bool):
            raise TypeError(f"block id must be an int, got {number_kind(block)}")
        if not 0 <= block < self.num_blocks:
            raise BlockStateError(f"block id {block} is outside the pool [0, {self.num_blocks})")

    def check_invariants(self) -> None:
        """Assert invariant 1 of the module docstring (free list and ref counts agree)."""
        assert all(c >= 0 for c in self.ref_counts), "negative ref count"
        free_by_count = {b for b, c in enumerate(self.ref_counts) if c == 0}
        assert len(self._free) == len(set(self._free)), "a block appears twice in the free list"
        assert set(self._free) == free_by_count, (
            f"free list {sorted(self._free)} disagrees with zero ref counts {sorted(free_by_count)}"
        )
        assert self.num_free + self.num_used == self.num_blocks

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_blocks={self.num_blocks}, num_free={self.num_free})"
