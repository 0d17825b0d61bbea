"""Block tables: which physical blocks hold each sequence's tokens, with sharing (fork) and copy-on-write.

It adds the logical side of paging on top of `BlockAllocator`: a sequence's token at position p lives in slot
p % bs of block `block_table[p // bs]`, so a sequence grows one block at a time instead of reserving its maximum
length, and sequences can share blocks (n parallel samples share the prompt; requests share a cached system
prompt). What it leaves out: tensors (the K/V pools and the copy itself are in `paged_cache.py`) and scheduling
(who runs, who waits, who is preempted: chapter 06).

Invariants (checked by `check_invariants`):
  1. the allocator's invariants (free + used = total, no block twice in the free list);
  2. the ref count of every block equals the number of block tables holding it (a cached free block: 0);
  3. a sequence of L tokens holds exactly ceil(L / bs) blocks, none twice;
  4. a block is written only while its ref count is 1: `append_slot` copies a shared last block first
     (copy-on-write, Kwon et al. §4.4), and only full blocks, which are never written again, are ever cached;
  5. a sequence's `block_hashes` cover only full, computed blocks: len(block_hashes) <= num_computed // bs.

Rolling back (`truncate`, for speculative decoding's rejected draft tokens, chapter 08) keeps all five: blocks past
the new length are released, and a cached block that becomes partial is unpublished before anyone can write it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from minillm.core.config import check_int, number_kind, plain_int, short_repr
from minillm.paged.block_allocator import BlockAllocator, OutOfBlocks
from minillm.paged.prefix_cache import ROOT_HASH, PrefixCachingAllocator, check_token_list, hash_block


def compute_slot_mapping(block_table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Flat slots (block * bs + offset) of positions start..end-1 of a sequence with this block table.

    Worked example: bs = 4, block_table = [7, 2]; positions 3, 4, 5 live in block 7 offset 3 and block 2 offsets
    0 and 1, so the slots are [7*4+3, 2*4+0, 2*4+1] = [31, 8, 9].
    """
    if not isinstance(block_table, (list, tuple)):
        raise TypeError(f"block_table must be a list of block ids, got {type(block_table).__name__}")
    if not type(block_size) is type(start) is type(end) is int:  # one cheap test when all three are plain ints
        block_size = check_int("block_size", block_size)
        start, end = check_int("start", start, 0), check_int("end", end, 0)
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    if end > len(block_table) * block_size:
        raise ValueError(f"position {end - 1} is past the {len(block_table)} blocks of size {block_size} held")
    # BEGIN SOLUTION
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    # END SOLUTION


def _check_token_id(token_id: object) -> int:
    """`append_slot`'s token: the plain int a token id holds (numpy ints too); a TypeError for a bool, a float or
    anything else, a ValueError for a negative id, naming it."""
    plain = plain_int(token_id)
    if plain is None:
        raise TypeError(f"token_id must be an int token id, got {type(token_id).__name__} {short_repr(token_id)}")
    if plain < 0:
        raise ValueError(f"token_id must be a token id >= 0, got {plain}")
    return plain


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): the blocks a sequence of that length holds."""
    if type(num_tokens) is not int or num_tokens < 0:  # type tests first: the scheduler asks this every step
        check_int("num_tokens", num_tokens, 0)  # -1 would need no block, 1.5 part of one
    if type(block_size) is not int or block_size < 1:
        check_int("block_size", block_size)
    return -(-num_tokens // block_size)


@dataclass
class _Seq:
    block_table: list[int]
    token_ids: list[int]
    num_computed: int  # leading tokens whose K/V are in the cache
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the leading full, computed blocks


class BlockManager:
    """Per-sequence block tables over one `BlockAllocator` (a `PrefixCachingAllocator` with prefix caching)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {short_repr(block_size)}")
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.allocator: BlockAllocator = (
            PrefixCachingAllocator(num_blocks) if self.enable_prefix_caching else BlockAllocator(num_blocks)
        )
        self._seqs: dict[Hashable, _Seq] = {}

    # ----------------------------------------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).block_table)

    def token_ids(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).token_ids)

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._get(seq_id).token_ids)

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_computed

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Slots of positions start..end-1 of `seq_id` (where their K/V are written / read)."""
        return compute_slot_mapping(self._get(seq_id).block_table, self.block_size, start, end)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a prompt of `num_tokens` fits now (conservative: cache hits could only need fewer blocks)."""
        return num_blocks_for(num_tokens, self.block_size) <= self.allocator.num_free

    def can_append(self, seq_id: Hashable) -> bool:
        """Whether `append_slot(seq_id, ...)` can succeed: it needs a free block for a new block or a copy."""
        seq = self._get(seq_id)
        if len(seq.token_ids) % self.block_size == 0 or self.allocator.ref_count(seq.block_table[-1]) > 1:
            return self.allocator.num_free >= 1
        return True

    # ----------------------------------------------------------------------------------------------- lifecycle
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Give a new sequence blocks for its prompt; return num_cached_tokens (prefill tokens to skip).

        With prefix caching, leading full blocks already cached are shared instead of allocated. subtle: the
        last prompt token is never served from the cache, because its forward pass yields the logits of the
        first new token; so at most the full blocks within token_ids[:-1] are hits. Raises OutOfBlocks and
        changes nothing if the blocks do not fit. `seq_id` is any hashable; `token_ids` a list of ints >= 0.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        tokens = check_token_list("token_ids", token_ids)
        if not tokens:
            raise ValueError(f"sequence {seq_id!r} needs at least one prompt token, got none")
        bs = self.block_size
        hits: list[int] = []
        hashes: list[int] = []
        if self.enable_prefix_caching:
            alloc = self.allocator
            assert isinstance(alloc, PrefixCachingAllocator)
            parent = ROOT_HASH
            for i in range((len(tokens) - 1) // bs):
                chunk = tokens[i * bs : (i + 1) * bs]
                h = hash_block(parent, chunk)
                block = alloc.find(h, parent, chunk)
                if block is None:
                    break
                hits.append(block)
                hashes.append(h)
                parent = h
        # Count every free block this needs (fresh ones, and hits revived from the free list) before touching
        # anything, so OutOfBlocks leaves the pool exactly as it was.
        num_new = num_blocks_for(len(tokens), bs) - len(hits)
        revived = sum(1 for b in hits if self.allocator.ref_count(b) == 0)
        if num_new + revived > self.allocator.num_free:
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {num_new + revived} free blocks, {self.allocator.num_free} are free"
            )
        for b in hits:
            self.allocator.acquire(b)  # type: ignore[attr-defined]
        table = hits + [self.allocator.allocate() for _ in range(num_new)]
        num_cached = len(hits) * bs
        self._seqs[seq_id] = _Seq(table, tokens, num_computed=num_cached, block_hashes=hashes)
        return num_cached

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """Record that the K/V of the first `num_tokens` tokens are now in the cache (after a forward pass).

        With prefix caching this is when full blocks become findable by other requests: never earlier, so a
        request can never hit a block whose K/V has not been written yet (chunked prefill, chapter 06).
        `append_slot` calls it for every token before the appended one.
        """
        seq = self._get(seq_id)
        if type(num_tokens) is not int:  # cheap: once per request per step
            num_tokens = check_int("num_tokens", num_tokens, 0)  # the TypeError naming it (an int subclass passes)
        if not seq.num_computed <= num_tokens <= len(seq.token_ids):
            raise ValueError(
                f"num_tokens={num_tokens} must lie in [{seq.num_computed}, {len(seq.token_ids)}] for {seq_id!r}"
            )
        seq.num_computed = num_tokens
        if self.enable_prefix_caching:
            self._publish_full_blocks(seq)

    def append_slot(self, seq_id: Hashable, token_id: int) -> list[tuple[int, int]]:
        """Append one token (its K/V is computed by the next forward); return copy-on-write (src, dst) pairs.

        Contract: every token already in the sequence has been computed (the new token was sampled from the
        last one's logits). A new block is allocated when the last one is full; a shared last block is copied
        first. The caller must copy the K/V of each returned pair (`PagedKVCache.copy_blocks`) before the next
        forward. Raises OutOfBlocks, changing nothing, when a block is needed and none is free.
        """
        seq = self._get(seq_id)
        if type(token_id) is not int or token_id < 0:  # cheap: once per token; the vocabulary is the model's to check
            token_id = _check_token_id(token_id)
        if len(seq.token_ids) > seq.num_computed:
            self.mark_computed(seq_id, len(seq.token_ids))
        pairs: list[tuple[int, int]] = []
        if len(seq.token_ids) % self.block_size == 0:
            seq.block_table.append(self.allocator.allocate())  # the last block is full: start a new one
        else:
            pairs = self._copy_on_write(seq)
        seq.token_ids.append(token_id)
        return pairs

    def _copy_on_write(self, seq: _Seq) -> list[tuple[int, int]]:
        """Make the sequence's (partly filled) last block private before it is written; return [(src, dst)] or []."""
        # BEGIN SOLUTION
        src = seq.block_table[-1]
        if self.allocator.ref_count(src) == 1:
            return []  # sole holder: write in place
        dst = self.allocator.allocate()  # may raise OutOfBlocks: nothing has changed yet
        self.allocator.free(src)  # one holder fewer; the others keep the original
        seq.block_table[-1] = dst
        return [(src, dst)]
        # END SOLUTION

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens of a sequence and release the blocks that become empty.

        Speculative decoding (chapter 08) appends k draft tokens, verifies them in one forward, and rolls back the
        rejected ones with this. Nothing is copied and no K/V is cleared: the kept slots still hold their K/V, and
        the next `append_slot` writes the next token at position num_tokens. What stays consistent:
          - ref counts: a dropped block loses this sequence's hold only; a block shared with a fork keeps the other
            holders' content (their tables are untouched);
          - copy-on-write: a kept last block that is shared stays shared, so the next `append_slot` copies it first
            (invariant 4), never writing the other holders' tokens in place;
          - prefix cache: a block published as full that becomes partial is unpublished, so no prefix lookup finds
            it again. subtle: even when it is shared (its other holders still need its content), because the
            other holders may leave before this sequence's next append, which would then write it in place: an
            unfindable block can only cost a future miss, a findable one being overwritten would be a wrong hit.
            Dropped full blocks stay cached (their K/V is still correct for their tokens), as after `free`.
        Truncating to 0 leaves a sequence with no blocks; appending to it starts a new block. An unknown sequence
        or a length outside 0..num_tokens raises ValueError naming it (a non-int, TypeError) and changes nothing.
        """
        seq = self._get(seq_id)
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
            raise TypeError(f"num_tokens must be an int, got {number_kind(num_tokens)}")
        if not 0 <= num_tokens <= len(seq.token_ids):
            raise ValueError(f"cannot truncate sequence {seq_id!r} to num_tokens={num_tokens}: it holds "
                             f"{len(seq.token_ids)} tokens (allowed: 0..{len(seq.token_ids)})")
        bs = self.block_size
        keep = num_blocks_for(num_tokens, bs)
        for b in reversed(seq.block_table[keep:]):  # last block first, as in `free`
            self.allocator.free(b)
        del seq.block_table[keep:]
        del seq.token_ids[num_tokens:]
        seq.num_computed = min(seq.num_computed, num_tokens)
        del seq.block_hashes[num_tokens // bs:]  # only blocks that are still full keep their hash (invariant 5)
        if num_tokens % bs and isinstance(self.allocator, PrefixCachingAllocator):
            self.allocator.unpublish(seq.block_table[-1])  # now partial: the next append writes into it

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """A child sequence that shares every block of its parent (ref counts + 1); writes then copy on write."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        for b in parent.block_table:
            self.allocator.fork(b)
        self._seqs[child_id] = _Seq(
            list(parent.block_table), list(parent.token_ids), parent.num_computed, list(parent.block_hashes)
        )

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence: release its blocks (last block first, so with prefix caching the prompt's head is
        evicted last: it is the part other requests are likeliest to share)."""
        seq = self._get(seq_id)
        for b in reversed(seq.block_table):
            self.allocator.free(b)
        del self._seqs[seq_id]

    # ----------------------------------------------------------------------------------------------- internals
    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r} (never allocated, or already freed)") from None

    def _publish_full_blocks(self, seq: _Seq) -> None:
        alloc = self.allocator
        assert isinstance(alloc, PrefixCachingAllocator)
        bs = self.block_size
        while len(seq.block_hashes) < seq.num_computed // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            chunk = seq.token_ids[i * bs : (i + 1) * bs]
            h = hash_block(parent, chunk)
            alloc.publish(seq.block_table[i], h, parent, chunk)
            seq.block_hashes.append(h)

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants 1-3 and 5."""
        self.allocator.check_invariants()
        holders = [0] * self.num_blocks
        for sid, seq in self._seqs.items():
            assert len(seq.block_table) == num_blocks_for(len(seq.token_ids), self.block_size), (
                f"sequence {sid!r}: {len(seq.token_ids)} tokens in {len(seq.block_table)} blocks"
            )
            assert len(set(seq.block_table)) == len(seq.block_table), f"sequence {sid!r} holds a block twice"
            assert len(seq.block_hashes) <= seq.num_computed // self.block_size, (
                f"sequence {sid!r}: {len(seq.block_hashes)} hashed blocks but {seq.num_computed} computed tokens"
            )
            for b in seq.block_table:
                holders[b] += 1
        for b, n in enumerate(holders):
            assert self.allocator.ref_counts[b] == n, (
                f"block {b}: ref count {self.allocator.ref_counts[b]}, held by {n} tables"
            )
