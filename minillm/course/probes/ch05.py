"""Chapter 05's probes: the block allocator, slot mapping, copy-on-write and the pool write, on seeded workloads."""

from __future__ import annotations

import torch

from minillm.paged.block_allocator import BlockAllocator, OutOfBlocks
from minillm.paged.block_manager import BlockManager, compute_slot_mapping
from minillm.paged.paged_cache import write_kv
from . import Probe, generator, outcome, rng


class _RecordingAllocator(BlockAllocator):
    """The allocator under test, with an `_on_take` hook that records which blocks were handed out again."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.taken: list[int] = []

    def _on_take(self, block: int) -> None:
        self.taken.append(block)


class _PlainAllocator(BlockAllocator):
    """The probe's own `allocate` (head of the free list, ref count 1), so the copy-on-write probe does not run
    the student's `allocate`, which has its own probe."""

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks("no free block")
        block, _ = self._free.popitem(last=False)
        self.ref_counts[block] = 1
        return block


def allocate(seed: int) -> list:
    """Random allocate / fork / free operations on small pools, run past exhaustion (OutOfBlocks, changing
    nothing) and through reuse of freed blocks (FIFO order, the `_on_take` hook). Returns each operation's result
    with the pool's ref counts and free count after it, and every block the hook saw."""
    r = rng(seed)
    outs = []
    for num_blocks in (1, r.randrange(3, 7), r.randrange(6, 10)):
        alloc = _RecordingAllocator(num_blocks)
        held: list[int] = []  # one entry per holder: a forked block is in it twice
        steps = []
        for _ in range(5 * num_blocks):
            op = r.choice(("allocate", "allocate", "allocate", "free", "fork")) if held else "allocate"
            if op == "allocate":
                got = outcome(alloc.allocate)
                if isinstance(got, int):
                    held.append(got)
            elif op == "fork":
                held.append(r.choice(held))
                got = alloc.fork(held[-1])
            else:
                got = alloc.free(held.pop(r.randrange(len(held))))
            steps.append([op, got, list(alloc.ref_counts), alloc.num_free])
        outs.append([steps, alloc.taken])
    return outs


def slot_mappings(seed: int) -> list:
    """Random block tables (distinct ids, out of order) and block sizes, with ranges that are empty, start or end
    on block boundaries, cross several blocks, or cover the whole table; plus the docstring's worked example."""
    r = rng(seed)
    outs = [compute_slot_mapping([7, 2], 4, 3, 6)]
    for bs in (1, 2, 3, 4, 8):
        table = r.sample(range(40), r.randrange(1, 6))
        n = len(table) * bs
        ranges = [(0, n), (0, 0), (n, n), (bs, min(n, 2 * bs)), (bs - 1, n)]
        for _ in range(3):
            start = r.randrange(0, n + 1)
            ranges.append((start, r.randrange(start, n + 1)))
        outs.append([table, bs, [compute_slot_mapping(table, bs, s, e) for s, e in ranges]])
    return outs


def copy_on_write(seed: int) -> list:
    """Sequences forked from random parents (lengths inside blocks and on block boundaries), then tokens appended
    in a random order: a shared, partly filled last block is copied (its source keeping the other holders), a
    private one written in place, and a copy with no free block left raises OutOfBlocks. The manager runs on the
    probe's own allocator. Returns each append's copy pairs, then the block tables and ref counts."""
    r = rng(seed)
    outs = []
    for num_blocks, bs, lengths in ((r.randrange(8, 12), 4, (5, 7)), (r.randrange(10, 14), 3, (6,)),
                                    (r.randrange(5, 7), 2, (3, 4, 5))):
        manager = BlockManager(num_blocks, bs)
        manager.allocator = _PlainAllocator(num_blocks)
        manager.allocate("p", [r.randrange(50) for _ in range(r.choice(lengths))])
        seqs = ["p"]
        for i in range(r.randrange(1, 4)):
            child = f"c{i}"
            manager.fork(r.choice(seqs), child)
            seqs.append(child)
        steps = []
        for _ in range(3 * len(seqs)):
            sid = r.choice(seqs)
            steps.append([sid, outcome(lambda: manager.append_slot(sid, r.randrange(50)))])
        outs.append([steps, {s: manager.block_table(s) for s in seqs}, list(manager.allocator.ref_counts)])
    return outs


def pool_writes(seed: int) -> list:
    """Random K (N, nh, hs) written into random pools (nb, bs, nh, hs) with nb != bs at distinct random slots (a
    whole block, a block's tail, scattered slots, none), into float32 and float64 pools. Returns the pools."""
    g = generator(seed)
    outs = []
    for nb, bs, nh, hs, dtype in ((5, 3, 2, 4, torch.float32), (3, 4, 1, 2, torch.float64),
                                  (6, 2, 2, 3, torch.float32)):
        pool = torch.randn(nb, bs, nh, hs, generator=g, dtype=dtype)
        perm = torch.randperm(nb * bs, generator=g)
        for slots in (torch.arange(bs, 2 * bs), torch.tensor([bs - 1, 2 * bs + 1]), perm[: nb * bs // 2],
                      perm[:0]):
            write_kv(pool, slots, torch.randn(len(slots), nh, hs, generator=g))
            outs.append(pool.clone())
    return outs


PROBES = {
    "allocate": Probe(allocate),
    "compute_slot_mapping": Probe(slot_mappings),
    "_copy_on_write": Probe(copy_on_write),
    "write_kv": Probe(pool_writes),
}
