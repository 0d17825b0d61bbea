"""PagedAttention's storage: per-layer K/V pools of fixed-size blocks, read through block tables.

It adds a cache whose memory is a pool of `num_blocks` blocks of `block_size` token slots per layer, shape
(nb, bs, nh, hs) for K and for V, shared by every sequence of a ragged batch. Before each forward pass the caller
describes the step with a `PagedBatch` (`set_batch`): where each new token's K/V goes (`slot_mapping`), which
blocks each sequence holds (`block_tables`), and how many tokens each has. The model is called with all the
sequences' new tokens flattened into one row, idx (1, N); `attend` writes their K/V at their slots, then runs
attention per sequence (Orca's selective batching: the linear layers see one flat batch, attention does not mix
sequences). Two attention paths give the same numbers: a reference loop over sequences for any mix of prefill
and decode, and a vectorized decode path that gathers every sequence's blocks at once (Kwon et al. §4.1).
What it leaves out: deciding which blocks a sequence gets (`BlockManager`) and a fused kernel (chapter 12).

The cache keeps no per-sequence state between steps: each step's lengths arrive in its `PagedBatch`. So rolling a
sequence back (speculative decoding, chapter 08) is `BlockManager.truncate` alone, and one step may add several
tokens to a sequence (query_len > 1 after a cached context): the ragged path handles any query length. K/V are
stored in the cache's own `dtype` (never read from the model's weights) and converted to the query's dtype on read,
a no-op when they agree. Both attention paths are registered by name in `minillm.paged.backends`: "paged" (the
vectorized decode path for pure-decode steps) and "paged-reference" (the loop, always).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from minillm.core.attention import attention, attention_ref, causal_mask
from minillm.core.config import (CheckedFields, check_device, check_fits_float, check_has_data, check_instance,
                                 check_int, check_int_list, check_tensor_elements, foreign_number, GPTConfig,
                                 plain_number, short_repr, tensor_kind)
from minillm.kvcache.cache import attend_args_fit, check_attend_args
from minillm.paged.backends import register_attention_backend
from minillm.paged.block_manager import BlockManager


@dataclass
class PagedBatch(CheckedFields):
    """The metadata of one forward step over S sequences with N new tokens in total.

    Sequence i contributes query_lens[i] new tokens (N = sum), which sit at the *end* of its context_lens[i]
    tokens: positions context_lens[i] - query_lens[i] .. context_lens[i] - 1. The new tokens appear in idx in
    sequence order.
    """

    slot_mapping: torch.Tensor  # (N,) int64: block * bs + offset where each new token's K/V is written
    block_tables: torch.Tensor  # (S, max_nb) int64: each sequence's blocks in order, padded with -1
    context_lens: torch.Tensor  # (S,) int64: tokens in the cache for each sequence AFTER this step
    query_lens: torch.Tensor  # (S,) int64: new tokens of each sequence in this step
    # Host copies, made once per step so `attend` (called once per layer) never syncs with the device; tuples, so
    # they stay what was checked, like the fixed fields above.
    context_lens_list: tuple[int, ...] = field(init=False, repr=False)
    query_lens_list: tuple[int, ...] = field(init=False, repr=False)
    _decode_cache: tuple | None = field(init=False, repr=False, default=None)  # (bs, flat block ids, mask)
    FIXED = ("slot_mapping", "block_tables", "context_lens", "query_lens", "context_lens_list", "query_lens_list")

    def __post_init__(self) -> None:
        for name in ("slot_mapping", "block_tables", "context_lens", "query_lens"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
                raise TypeError(f"PagedBatch.{name} must be an int64 tensor, got {tensor_kind(t)}")
            check_has_data(f"PagedBatch.{name}", t)  # a meta tensor has a shape but no ids to read
        if self.slot_mapping.dim() != 1:
            raise ValueError(f"slot_mapping must be (N,), one slot per new token, got shape "
                             f"{tuple(self.slot_mapping.shape)}")
        if self.block_tables.dim() != 2:
            raise ValueError(f"block_tables must be (S, max_nb), got shape {tuple(self.block_tables.shape)}")
        S = self.block_tables.shape[0]
        if self.context_lens.shape != (S,) or self.query_lens.shape != (S,):
            raise ValueError(
                f"context_lens {tuple(self.context_lens.shape)} and query_lens {tuple(self.query_lens.shape)} "
                f"must both be ({S},) for {S} block tables"
            )
        self.context_lens_list = tuple(int(x) for x in self.context_lens.tolist())
        self.query_lens_list = tuple(int(x) for x in self.query_lens.tolist())
        if sum(self.query_lens_list) != self.slot_mapping.numel():
            raise ValueError(
                f"query_lens sum to {sum(self.query_lens_list)} but slot_mapping has {self.slot_mapping.numel()} slots"
            )
        for i, (ql, cl) in enumerate(zip(self.query_lens_list, self.context_lens_list)):
            if not 1 <= ql <= cl:
                raise ValueError(f"sequence {i}: need 1 <= query_len <= context_len, got {ql} and {cl}")
        self._checked = True  # its fields are fixed from here (CheckedFields)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token: the vectorized decode path applies."""
        return all(ql == 1 for ql in self.query_lens_list)

    def positions(self) -> torch.Tensor:
        """(1, N) absolute positions of the new tokens, for the model's position embedding."""
        pos = [p for ql, cl in zip(self.query_lens_list, self.context_lens_list) for p in range(cl - ql, cl)]
        return torch.tensor(pos, dtype=torch.int64, device=self.slot_mapping.device).unsqueeze(0)  # (1, N)

    def to(self, device: torch.device | str) -> "PagedBatch":
        device = check_device("device", device, allocates=True)
        return PagedBatch(*(t.to(device) for t in (self.slot_mapping, self.block_tables, self.context_lens,
                                                   self.query_lens)))

    @classmethod
    def build(
        cls,
        manager: BlockManager,
        entries: Sequence[tuple[Hashable, int, int]],
        device: torch.device | str = "cpu",
    ) -> "PagedBatch":
        """The batch for `entries` = [(seq_id, start, num_new), ...]: each sequence computes positions
        start .. start+num_new-1 this step (its blocks must already be allocated by `manager`)."""
        check_instance("manager", manager, BlockManager, "a BlockManager")
        if not isinstance(entries, (list, tuple)):
            raise TypeError(f"entries must be a list of (seq_id, start, num_new), got {type(entries).__name__} "
                            f"{short_repr(entries)}")
        if not entries:
            raise ValueError("a PagedBatch needs at least one sequence, got no entries")
        slots: list[int] = []
        tables: list[list[int]] = []
        ctx, qlen = [], []
        for i, entry in enumerate(entries):
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise TypeError(f"entries[{i}] must be a (seq_id, start, num_new) tuple, got {short_repr(entry)}")
            seq_id, start, num_new = entry
            if not type(start) is type(num_new) is int:  # plain ints (the usual case) cost one test
                start, num_new = check_int(f"entries[{i}] start", start, 0), check_int(f"entries[{i}] num_new", num_new)
            end = start + num_new
            if end > manager.num_tokens(seq_id):
                raise ValueError(f"sequence {seq_id!r} has {manager.num_tokens(seq_id)} tokens, asked up to {end}")
            slots += manager.slot_mapping(seq_id, start, end)
            tables.append(manager.block_table(seq_id))
            ctx.append(end)
            qlen.append(num_new)
        return cls.from_lists(slots, tables, ctx, qlen, device)

    @classmethod
    def from_lists(cls, slot_mapping: Sequence[int], block_tables: Sequence[Sequence[int]],
                   context_lens: Sequence[int], query_lens: Sequence[int],
                   device: torch.device | str = "cpu") -> "PagedBatch":
        """The batch from plain lists (block tables of any lengths, padded here with -1), as tensors on `device`:
        what `build` reads off a block manager, or what chapter 06's executor receives in a `StepInput`. Each list
        holds plain ints (1.5 or True would become another id as a tensor), at least one table: a TypeError /
        ValueError naming it otherwise."""
        for name, values in (("slot_mapping", slot_mapping), ("context_lens", context_lens),
                             ("query_lens", query_lens)):
            check_int_list(name, values)
        if not isinstance(block_tables, (list, tuple)) or not block_tables:
            raise ValueError(f"block_tables must be a non-empty list of block tables, got {short_repr(block_tables)}")
        for i, table in enumerate(block_tables):
            check_int_list(f"block_tables[{i}]", table)
        device = check_device("device", device, allocates=True)
        width = max(len(t) for t in block_tables)
        padded = [list(t) + [-1] * (width - len(t)) for t in block_tables]  # (S, max_nb)
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_t(slot_mapping), as_t(padded), as_t(context_lens), as_t(query_lens))


def write_kv(pool: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Store x (N, nh, hs), the K (or V) of N new tokens, into pool (nb, bs, nh, hs) at flat slots slot_mapping (N,).

    Slot s is block s // bs, offset s % bs, i.e. row s of the pool seen as (nb * bs, nh, hs).
    """
    for name, t in (("pool", pool), ("slot_mapping", slot_mapping), ("x", x)):
        if not isinstance(t, torch.Tensor):  # a cheap test: write_kv runs twice per layer per step
            raise TypeError(f"{name} must be a tensor, got {tensor_kind(t)}")
    if (pool.dim() != 4 or slot_mapping.dtype != torch.long or slot_mapping.dim() != 1
            or x.shape != (slot_mapping.shape[0], *pool.shape[2:])):  # attribute reads only: cheap per layer
        raise ValueError(f"write_kv needs pool (nb, bs, nh, hs), int64 slot_mapping (N,) and x (N, nh, hs), got "
                         f"{tuple(pool.shape)}, {tuple(slot_mapping.shape)} and {tuple(x.shape)}")
    # BEGIN SOLUTION
    nb, bs, nh, hs = pool.shape
    pool.view(nb * bs, nh, hs).index_copy_(0, slot_mapping, x.to(pool.dtype))  # (nb*bs, nh, hs)[slots] = x
    # END SOLUTION


class PagedKVCache:
    """Per-layer block pools plus the step's `PagedBatch`; implements `KVCacheProtocol.attend`."""

    def __init__(
        self,
        config: GPTConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        use_fast_decode: bool = True,
    ):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"PagedKVCache needs a GPTConfig, got {type(config).__name__}")
        num_blocks, block_size = plain_number(num_blocks), plain_number(block_size)  # stored as the plain ints
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if foreign_number(value):  # numpy's int64: the hint every other size check gives
                raise TypeError(f"{name} must be a Python int, got {type(value).__name__} {short_repr(value)}: "
                                "convert it with int()")
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {short_repr(value)}")
            check_fits_float(name, value)  # the size check below prints the shape: no 5000-digit int in it
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:  # an int pool truncates every K and V
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        if not isinstance(use_fast_decode, bool):  # 'no' would read as True
            raise TypeError(f"use_fast_decode must be a bool, got {type(use_fast_decode).__name__}")
        self.device = check_device("device", device, allocates=True)
        self.dtype = dtype
        self.use_fast_decode = use_fast_decode  # False forces the reference loop (for tests and the chapter)
        nh, hs = config.n_head, config.head_size
        shape = (num_blocks, block_size, nh, hs)  # (nb, bs, nh, hs)
        check_tensor_elements("num_blocks x block_size x n_head x head_size", shape)  # before the allocator sees it
        self.k_pools = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(config.n_layer)]
        self.v_pools = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(config.n_layer)]
        self._attn = attention_ref if config.attn_impl == "explicit" else attention
        self.batch: PagedBatch | None = None
        self._scratch_buf: torch.Tensor | None = None  # gather space of the decode path

    @property
    def nbytes(self) -> int:
        """Bytes of all pools: 2 (K, V) * layers * nb * bs * nh * hs * element size."""
        return sum(p.numel() * p.element_size() for p in self.k_pools + self.v_pools)

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def set_batch(self, batch: PagedBatch) -> None:
        """Describe the next forward step (call before every `model(idx, positions, cache=self)`)."""
        if not isinstance(batch, PagedBatch):
            raise TypeError(f"set_batch needs a PagedBatch, got {type(batch).__name__}")
        self.check_batch(batch)
        if batch.slot_mapping.device != self.device:
            batch = batch.to(self.device)
        self.batch = batch

    def check_batch(self, batch: PagedBatch) -> None:
        """A ValueError naming the field unless `batch` fits this pool: each sequence's table holds blocks for its
        context (its first ceil(context_len / bs) entries, block ids of the pool, not the -1 padding), and each new
        token's slot is the one its table gives for its position (block table[pos // bs], offset pos % bs). What
        `PagedBatch.build` reads off a block manager always fits; a batch built by hand that did not would write
        outside the pool (an IndexError inside torch), into another sequence's slots, or attend over a block it
        never wrote, without a word. One host copy of the tables and slots (a few small tensors a step)."""
        check_instance("batch", batch, PagedBatch, "a PagedBatch")
        bs, nb = self.block_size, self.num_blocks
        if not batch.num_seqs:
            raise ValueError("a PagedBatch for a forward needs at least one sequence, got 0")
        tables, slots = batch.block_tables.cpu(), batch.slot_mapping.cpu()  # (S, max_nb), (N,)
        room = tables.shape[1] * bs  # the most tokens a table of max_nb blocks holds
        if max(batch.context_lens_list) > room:  # before (ctx + bs - 1) could overflow int64
            i = max(range(batch.num_seqs), key=batch.context_lens_list.__getitem__)
            raise ValueError(f"context_lens[{i}] = {batch.context_lens_list[i]} does not fit block_tables[{i}]: "
                             f"{tables.shape[1]} blocks of block_size {bs} hold {room} tokens")
        ctx = torch.tensor(batch.context_lens_list)  # (S,)
        used = (ctx + bs - 1) // bs  # (S,) blocks holding each context
        if int(used.max()) > tables.shape[1]:
            i = int(used.argmax())
            raise ValueError(f"block_tables[{i}] holds {tables.shape[1]} blocks, but context_lens[{i}] = {int(ctx[i])} "
                             f"needs {int(used[i])} of block_size {bs}")
        mask = torch.arange(tables.shape[1]) < used[:, None]  # (S, max_nb) the entries the contexts read
        read = tables[mask]  # the block ids the contexts read, sequence after sequence
        if read.numel() and (int(read.min()) < 0 or int(read.max()) >= nb):
            raise ValueError(f"block_tables must hold block ids of the pool [0, {nb}) for every context's blocks, got "
                             f"ids in [{int(read.min())}, {int(read.max())}]")
        owner = torch.arange(batch.num_seqs)[:, None].expand_as(tables)[mask]  # (read,) the sequence of each
        if torch.unique(owner * nb + read).numel() != read.numel():  # a block twice in one table
            i = next(i for i, u in enumerate(used.tolist()) if len(set(tables[i, :u].tolist())) < u)
            raise ValueError(f"block_tables[{i}] lists a block twice among the {int(used[i])} its context reads: "
                             f"{tables[i, :int(used[i])].tolist()} (each block holds different positions)")
        seq = torch.repeat_interleave(torch.arange(batch.num_seqs), torch.tensor(batch.query_lens_list))  # (N,)
        pos = torch.cat([torch.arange(c - q, c) for c, q in zip(batch.context_lens_list, batch.query_lens_list)])
        expected = tables[seq, pos // bs] * bs + pos % bs  # (N,) the slot each new token's table gives it
        if not torch.equal(expected, slots):
            j = int((expected != slots).nonzero()[0])
            raise ValueError(f"slot_mapping[{j}] = {int(slots[j])}, but sequence {int(seq[j])}'s block table puts its "
                             f"position {int(pos[j])} in slot {int(expected[j])}: the slots must follow the tables")
        # A block is shared (a cached prefix, a forked sequence) only while nobody writes it: copy-on-write gives a
        # writer its own copy first. A new token written into a block another sequence reads changes that context.
        readers = torch.bincount(read, minlength=nb)  # (nb,) how many sequences read each block
        shared = readers[slots // bs] > 1  # (N,)
        if bool(shared.any()):
            j = int(shared.nonzero()[0])
            b = int(slots[j]) // bs
            others = sorted({int(o) for o in owner[read == b].tolist()} - {int(seq[j])})
            raise ValueError(f"slot_mapping[{j}] = {int(slots[j])} writes block {b}, which sequence(s) {others} "
                             f"also read: a shared block is copied (copy-on-write) before a sequence writes it")

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds part of a block, each (nb, ...) with the block id in dim 0: here each layer's K
        and V pool (nb, bs, nh, hs). A cache that keeps more per block (the int8 cache's scale pools) adds it here.

        Why one list: copy-on-write (`copy_blocks`) and swapping (`minillm.engine.swap.SwapSpace`) copy exactly
        these, so a block always moves whole, whatever a cache keeps; a tensor missing here would be left behind
        and the block would come back with another request's scales (wrong tokens, no error)."""
        return self.k_pools + self.v_pools

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every tensor of `block_tensors()`."""
        if not isinstance(pairs, (list, tuple)):
            raise TypeError(f"pairs must be a list of (src, dst) block ids, got {type(pairs).__name__} "
                            f"{short_repr(pairs)}")
        for i, pair in enumerate(pairs):
            if len(check_int_list(f"pairs[{i}]", pair)) != 2 or not all(0 <= b < self.num_blocks for b in pair):
                raise ValueError(f"pairs[{i}] must be (src, dst), two block ids in [0, {self.num_blocks}), got "
                                 f"{short_repr(pair)}")
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        for pool in self.block_tensors():
            pool[dst] = pool[src]  # (n_pairs, bs, nh, hs) for K/V, (n_pairs, ...) for whatever else a block holds

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (1, nh, N, hs) for the step's N new tokens -> attention output (1, nh, N, hs)."""
        batch = self.batch
        if batch is None:
            raise ValueError("PagedKVCache.attend called before set_batch(PagedBatch)")
        if torch.is_tensor(q) and (q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != batch.num_tokens):
            raise ValueError(
                f"paged attention expects q of shape (1, nh, N={batch.num_tokens}, hs), got {tuple(q.shape)}: "
                "call the model with every sequence's new tokens flattened into idx (1, N)"
            )
        if not attend_args_fit(self.config, layer_idx, q, k, v):  # a few cheap tests per layer
            check_attend_args(self.config, layer_idx, q, k, v)  # names the bad argument (and passes an int subclass)
        # Write first, then read: a sequence's new tokens must see themselves (and, with prefix caching, blocks
        # another sequence of this same batch is writing in this same layer).
        write_kv(self.k_pools[layer_idx], batch.slot_mapping, k[0].transpose(0, 1))  # (nh, N, hs) -> (N, nh, hs)
        write_kv(self.v_pools[layer_idx], batch.slot_mapping, v[0].transpose(0, 1))  # (nh, N, hs) -> (N, nh, hs)
        if batch.is_decode and self.use_fast_decode:
            return self._attend_decode(layer_idx, q, batch)
        return self._attend_ragged(layer_idx, q, batch)

    def gather(self, layer_idx: int, seq_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of batch sequence `seq_index` read through its block table: each (1, nh, ctx, hs)."""
        ctx, blocks = self._sequence_blocks(layer_idx, seq_index)
        out = []
        for pool in (self.k_pools[layer_idx], self.v_pools[layer_idx]):
            kv = pool.index_select(0, blocks).flatten(0, 1)[:ctx]  # (nblk, bs, nh, hs) -> (ctx, nh, hs)
            out.append(kv.transpose(0, 1).unsqueeze(0))  # (1, nh, ctx, hs)
        return out[0], out[1]

    def _sequence_blocks(self, layer_idx: object, seq_index: object) -> tuple[int, torch.Tensor]:
        """(context length, block ids (nblk,)) of batch sequence `seq_index`, after checking that a batch is set
        (`set_batch`) and both indices are ints in range; a TypeError / ValueError naming them otherwise."""
        if self.batch is None:
            raise ValueError("gather reads the current step's batch: none is set (set_batch first)")
        layer_idx, seq_index = check_int("layer_idx", layer_idx, 0), check_int("seq_index", seq_index, 0)
        if layer_idx >= self.config.n_layer:
            raise ValueError(f"layer_idx must be below n_layer={self.config.n_layer}, got {layer_idx}")
        if seq_index >= self.batch.num_seqs:
            raise ValueError(f"seq_index must be below the batch's {self.batch.num_seqs} sequences, got {seq_index}")
        ctx = self.batch.context_lens_list[seq_index]
        return ctx, self.batch.block_tables[seq_index, :-(-ctx // self.block_size)]  # (nblk,)

    def _scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of at least `numel` elements, reused across layers and steps (grown when too small)."""
        if self._scratch_buf is None or self._scratch_buf.numel() < numel or self._scratch_buf.dtype != dtype:
            self._scratch_buf = torch.empty(numel, dtype=dtype, device=self.device)
        return self._scratch_buf

    def _attend_ragged(self, layer_idx: int, q: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """Reference path: one attention call per sequence, causal within its new tokens."""
        outs = []
        offset = 0
        for i, (ql, ctx) in enumerate(zip(batch.query_lens_list, batch.context_lens_list)):
            k_i, v_i = self.gather(layer_idx, i)  # (1, nh, ctx, hs) each
            q_i = q[:, :, offset : offset + ql]  # (1, nh, ql, hs)
            mask = causal_mask(ql, ctx, device=q.device)  # (ql, ctx): the new tokens are the last ql of ctx
            outs.append(self._attn(q_i, k_i.to(q.dtype), v_i.to(q.dtype), mask))  # (1, nh, ql, hs)
            offset += ql
        return torch.cat(outs, dim=2)  # (1, nh, N, hs)

    def _attend_decode(self, layer_idx: int, q: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """Fast path, one new token per sequence: gather all block tables at once, mask past each length."""
        S, bs = batch.num_seqs, self.block_size
        nblk = -(-max(batch.context_lens_list) // bs)
        L = nblk * bs
        if batch._decode_cache is None or batch._decode_cache[0] != self.block_size:
            # Built once per step, reused by every layer: the flat block ids and the length mask.
            # subtle: -1 padding is clamped to block 0; whatever block 0 holds is masked out below.
            flat_ids = batch.block_tables[:, :nblk].clamp(min=0).reshape(-1)  # (S, nblk) -> (S*nblk,)
            mask = torch.arange(L, device=q.device) < batch.context_lens.unsqueeze(1)  # (S, L): real tokens only
            mask = mask[:, None, None, :]  # (S, 1, 1, L), broadcast over heads and the one query
            if self._attn is attention:
                # subtle: SDPA turns a boolean mask into an additive one on every call; on the CPU that costs
                # more than the attention itself at decode sizes, so build the additive form once per step.
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
            batch._decode_cache = (self.block_size, flat_ids, mask)
        _, flat_ids, mask = batch._decode_cache
        nh, hs = self.config.n_head, self.config.head_size
        n = S * L * nh * hs
        scratch = self._scratch(2 * n, self.dtype)
        kv = []
        for j, pool in enumerate((self.k_pools[layer_idx], self.v_pools[layer_idx])):
            # index_select on whole blocks (rows of nb x (bs*nh*hs)) is one memcpy per block, several times
            # faster than advanced indexing of the 4-D pool. subtle: it writes into a scratch buffer kept across
            # steps; fresh megabyte-sized tensors every layer cost more in page faults than the copy itself.
            g = scratch[j * n : (j + 1) * n].view(S * nblk, bs * nh * hs)  # (S*nblk, bs*nh*hs)
            torch.index_select(pool.view(pool.shape[0], bs * nh * hs), 0, flat_ids, out=g)
            # Heads first as a strided view, no copy: attention reads rows of hs contiguous floats either way.
            kv.append(g.view(S, L, nh, hs).transpose(1, 2).to(q.dtype))  # (S, L, nh, hs) -> (S, nh, L, hs)
        q_s = q[0].transpose(0, 1).unsqueeze(2)  # (nh, S, hs) -> (S, nh, hs) -> (S, nh, 1, hs)
        y = self._attn(q_s, kv[0], kv[1], mask)  # (S, nh, 1, hs)
        return y.squeeze(2).transpose(0, 1).unsqueeze(0)  # (S, nh, hs) -> (nh, S, hs) -> (1, nh, S, hs)


register_attention_backend("paged", PagedKVCache)
register_attention_backend("paged-reference", partial(PagedKVCache, use_fast_decode=False))
