"""Prefix caching: full KV blocks found again by the hash of their tokens and of everything before them.

It adds, on top of `BlockAllocator`, a table hash -> block for every *full, computed* block. A new request whose
prompt starts with the same tokens (a shared system prompt) picks those blocks up instead of recomputing them; the
prefill tokens it skips are its `num_cached_tokens`. A cached block whose last holder left stays on the free list
*with its content*: it is reused by content while it waits there, and evicted least-recently-used when a fresh
block is needed. What it leaves out: partial blocks are never cached (their content still changes), and the hash
is Python's 64-bit tuple hash, so a lookup also compares the tokens and the parent hash to rule out collisions.

Invariants (on top of the allocator's):
  4. `_hash_to_block` and `_block_to_key` describe the same set of blocks, one hash per block;
  5. the hash of block i of a sequence is hash_block(hash of block i-1, tokens of block i), the first block's
     parent being ROOT_HASH, so equal hashes mean equal whole prefixes (vLLM's "hash chain", Kwon et al. §4.4);
  6. on the free list, uncached blocks sit before cached ones, and cached ones in order of release:
     the head is the next to be handed out, so the least recently used cached block is evicted first.
"""

from __future__ import annotations

from collections.abc import Sequence

from minillm.core.config import check_int, plain_int, short_repr
from minillm.paged.block_allocator import BlockAllocator, BlockStateError

ROOT_HASH = -1  # the parent hash of a sequence's first block; an int so hashes agree across processes


def check_token_list(name: str, tokens: object) -> list[int]:
    """`tokens` (a list or tuple of token ids: ints >= 0, numpy ints too) as a list of plain ints; a TypeError /
    ValueError naming `name` and the first bad entry (True would be stored as token 1, 2.7 as 2). The vocabulary is
    the model's to check: a block manager stores ids."""
    if not isinstance(tokens, (list, tuple)):
        raise TypeError(f"{name} must be a list of int token ids, got {type(tokens).__name__} {short_repr(tokens)}")
    out = [plain_int(t) for t in tokens]
    for j, t in enumerate(out):
        if t is None:
            raise TypeError(f"{name}[{j}] must be an int token id, got {type(tokens[j]).__name__} "
                            f"{short_repr(tokens[j])}")
        if t < 0:
            raise ValueError(f"{name}[{j}] must be a token id >= 0, got {t}")
    return out


def check_hash(name: str, value: object) -> int:
    """A block hash (or parent hash): a plain int within Python's 64-bit hash range; a TypeError / ValueError
    naming `name` otherwise (a str or None would be a key no chain ever produces: a silent miss)."""
    if type(value) is not int:
        value = check_int(name, value, -2**63)
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{name} must be a 64-bit hash in [-2**63, 2**63), got {short_repr(value)}")
    return value


def _check_block_key(block_hash: object, parent_hash: object, tokens: object) -> tuple[int, int, tuple[int, ...]]:
    """`find` / `publish`'s (block_hash, parent_hash, tokens), checked: a full block holds at least one token."""
    toks = tuple(check_token_list("tokens", tokens))
    if not toks:
        raise ValueError("tokens must hold the block's tokens (a full block), got none")
    return check_hash("block_hash", block_hash), check_hash("parent_hash", parent_hash), toks


def hash_block(parent_hash: int, tokens: Sequence[int]) -> int:
    """The chained hash of one full block: hash(parent_hash, tuple(tokens)).

    subtle: tuples of ints hash the same in every Python process (only str/bytes hashing is salted by
    PYTHONHASHSEED), so a prefill worker and a decode worker (chapter 07) compute the same chain.
    """
    if type(parent_hash) is not int:  # type tests first, the full checks on failure: called once per full block
        check_hash("parent_hash", parent_hash)  # a str or None would start a chain no other block shares
    key = tuple(tokens) if isinstance(tokens, (list, tuple)) else None
    if not key or not all(type(t) is int for t in key):
        key = tuple(check_token_list("tokens", tokens))
        if not key:
            raise ValueError("tokens must be a full block's ids, got an empty list")
    return hash((parent_hash, key))


class PrefixCachingAllocator(BlockAllocator):
    """A `BlockAllocator` that remembers the content of full blocks and hands them out again by hash."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._hash_to_block: dict[int, int] = {}
        self._block_to_key: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # block -> (hash, parent, tokens)
        self.num_evictions = 0  # cached blocks whose content was dropped to make room
        self.num_hits = 0  # blocks handed out again by content

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is findable by hash (in use or waiting on the free list)."""
        return len(self._hash_to_block)

    def block_hash(self, block: int) -> int | None:
        key = self._block_to_key.get(block)
        return None if key is None else key[0]

    def find(self, block_hash: int, parent_hash: int, tokens: Sequence[int]) -> int | None:
        """The block holding exactly this (parent, tokens) content, or None. Changes nothing."""
        block_hash, parent_hash, tokens = _check_block_key(block_hash, parent_hash, tokens)
        block = self._hash_to_block.get(block_hash)
        if block is None:
            return None
        _, parent, toks = self._block_to_key[block]
        if parent != parent_hash or toks != tokens:  # a 64-bit hash collision: treat as a miss
            return None
        return block

    def acquire(self, block: int) -> None:
        """Take one more hold on a cached block found by `find`; revive it from the free list if nobody held it."""
        if block not in self._block_to_key:
            raise BlockStateError(f"block {block} is not a cached block")
        if self.ref_counts[block] == 0:
            del self._free[block]  # revive: it leaves the free list with its content intact
        self.ref_counts[block] += 1
        self.num_hits += 1

    def publish(self, block: int, block_hash: int, parent_hash: int, tokens: Sequence[int]) -> bool:
        """Make a full, computed, in-use block findable by its hash. False if that content is cached already."""
        self.ensure_in_use(block, "publish")
        block_hash, parent_hash, tokens = _check_block_key(block_hash, parent_hash, tokens)
        if block in self._block_to_key:
            assert self._block_to_key[block][0] == block_hash, f"block {block} published under two hashes"
            return False
        if block_hash in self._hash_to_block:
            # Another block computed the same content first (two requests prefilled it in parallel). Keep that
            # one; this block stays uncached and is freed like any other.
            return False
        self._hash_to_block[block_hash] = block
        self._block_to_key[block] = (block_hash, parent_hash, tokens)
        return True

    def unpublish(self, block: int) -> bool:
        """Make a cached block unfindable (its content is about to change); False if it was not cached.

        `BlockManager.truncate` calls it when a full, published block becomes partial again: the sequence will
        write new tokens into it, so a later prompt with the old tokens must not find it.
        """
        self.ensure_in_use(block, "unpublish")
        key = self._block_to_key.pop(block, None)
        if key is None:
            return False
        del self._hash_to_block[key[0]]
        return True

    def _release(self, block: int) -> None:
        self._free[block] = None  # tail: the most recently used cached block is evicted last
        if block not in self._block_to_key:
            self._free.move_to_end(block, last=False)  # head: plain blocks are reused before evicting content

    def _on_take(self, block: int) -> None:
        key = self._block_to_key.pop(block, None)
        if key is not None:  # the block is evicted: its content is about to be overwritten
            del self._hash_to_block[key[0]]
            self.num_evictions += 1

    def check_invariants(self) -> None:
        super().check_invariants()
        assert len(self._hash_to_block) == len(self._block_to_key)
        for h, b in self._hash_to_block.items():
            assert self._block_to_key[b][0] == h, f"block {b} maps back to another hash"
        seen_cached = False
        for b in self._free:  # invariant 6: uncached blocks first, then cached ones
            cached = b in self._block_to_key
            assert cached or not seen_cached, f"uncached free block {b} sits behind a cached one"
            seen_cached |= cached
