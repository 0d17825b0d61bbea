"""One engine step as plain data: `plan(scheduler_output, block_manager) -> StepInput`, everything a forward needs.

What it adds: a line between the host side of a step (which requests run, which tokens they feed, where their K/V
go: the scheduler and the block manager decide) and the device side (copies, swaps, the forward, the head: the
executor, `minillm.engine.model_runner.ModelRunner`, does them). The `StepInput` in between holds only lists of
ints and block ids, never a `Request` or a manager, so it pickles small and can be sent to another process: a
second rank of chapter 14 runs exactly the step rank 0 planned, from this value alone (vLLM v1's
`SchedulerOutput` -> `ModelRunner.execute_model` split, at this project's size). What it leaves out: tensors built
ahead of time (the executor makes them; a GPU engine would pin and reuse them) and sampling, which stays with the
requests on the rank that owns them (`minillm.engine.sampler`).

    SchedulerOutput (entries, cow pairs, swaps) ──plan──▶ StepInput ──executor.execute──▶ logits (R, V)
      entry.fed_tokens()    -> token_ids, positions, slot_mapping
      block tables          -> block_tables, context_lens, query_lens
      entry.sample_rows()   -> sample_rows (which of the N rows go through the output head)
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from minillm.core.config import GPTConfig, check_int, check_int_list, check_tensor_elements, short_repr
from minillm.engine.scheduler import check_step_output


@dataclass
class StepInput:
    """Everything one forward needs, as plain Python data (N new tokens over S sequences, R sampled rows).

    Order of the device work (`ModelRunner.execute`): swap-outs first (their pool blocks may have been given to
    another request in this very step), then swap-ins, then copy-on-write, then the forward over the N tokens.
    """

    token_ids: list[int] = field(default_factory=list)  # (N,) the fed tokens, sequence after sequence
    positions: list[int] = field(default_factory=list)  # (N,) their absolute positions
    slot_mapping: list[int] = field(default_factory=list)  # (N,) block * bs + offset where each one's K/V goes
    block_tables: list[list[int]] = field(default_factory=list)  # (S, nb_i) each sequence's blocks, in order
    context_lens: list[int] = field(default_factory=list)  # (S,) tokens in the cache per sequence after the step
    query_lens: list[int] = field(default_factory=list)  # (S,) new tokens per sequence (sum = N)
    sample_rows: list[int] = field(default_factory=list)  # (R,) rows of the N whose logits come back, in order
    cow_pairs: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies before the forward
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)  # (key, pool blocks) -> host memory
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)  # (key, pool blocks) <- host memory
    swap_discard: list[str] = field(default_factory=list)  # keys whose host copy is no longer wanted

    @property
    def has_forward(self) -> bool:
        """False for a step that only moves bytes (swaps, discards) or does nothing."""
        return bool(self.token_ids)

    def check(self, config: GPTConfig, num_blocks: int, block_size: int) -> None:
        """Raise TypeError / ValueError if this step could not have come from a planner for this model and pool.

        An executor that receives a step from elsewhere (another process) calls it before touching the pool:
        a bad block id or token then names itself instead of failing inside an index kernel, and a step no
        planner makes (positions that are not each sequence's last query_len positions, a float read as an id)
        is refused instead of computing logits for a context that does not exist.
        """
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be the model's GPTConfig, got {type(config).__name__}")
        num_blocks, block_size = check_int("num_blocks", num_blocks), check_int("block_size", block_size)
        check_tensor_elements("num_blocks x block_size", (num_blocks, block_size))  # a pool past it is a typo
        for name in ("token_ids", "positions", "slot_mapping", "context_lens", "query_lens", "sample_rows"):
            check_int_list(f"StepInput.{name}", getattr(self, name))
        if not isinstance(self.block_tables, list):
            raise TypeError(f"StepInput.block_tables must be a list of block tables, got "
                            f"{type(self.block_tables).__name__}")
        for i, table in enumerate(self.block_tables):
            check_int_list(f"StepInput.block_tables[{i}]", table)
        n, s = len(self.token_ids), len(self.query_lens)
        if len(self.positions) != n or len(self.slot_mapping) != n or sum(self.query_lens) != n:
            raise ValueError(f"StepInput: {n} token_ids, {len(self.positions)} positions, {len(self.slot_mapping)} "
                             f"slots and query_lens summing to {sum(self.query_lens)} must all agree")
        if len(self.block_tables) != s or len(self.context_lens) != s:
            raise ValueError(f"StepInput: {s} query_lens, {len(self.block_tables)} block tables and "
                             f"{len(self.context_lens)} context_lens must all agree")
        for name, values, bound in (("token_ids", self.token_ids, config.vocab_size),
                                    ("positions", self.positions, config.block_size),
                                    ("slot_mapping", self.slot_mapping, num_blocks * block_size),
                                    ("sample_rows", self.sample_rows, n)):
            bad = [v for v in values if not 0 <= v < bound]
            if bad:
                raise ValueError(f"StepInput.{name} has {bad[:4]} outside [0, {bound})")
        if any(a >= b for a, b in zip(self.sample_rows, self.sample_rows[1:])):
            raise ValueError(f"StepInput.sample_rows must be increasing rows (each sampled once, in order), got "
                             f"{self.sample_rows[:8]}")
        cow = _check_pairs(self.cow_pairs)
        swap_blocks = []
        for name in ("swap_out", "swap_in"):
            swap_blocks += _check_swaps(f"StepInput.{name}", getattr(self, name))
        if not isinstance(self.swap_discard, list) or not all(isinstance(k, str) for k in self.swap_discard):
            raise TypeError(f"StepInput.swap_discard must be a list of str keys, got {short_repr(self.swap_discard)}")
        blocks = [b for t in self.block_tables for b in t] + [b for p in cow for b in p] + swap_blocks
        bad = [b for b in blocks if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"StepInput names blocks {bad[:4]} outside the pool [0, {num_blocks})")
        # a block the step writes before its forward (a copy's destination, a swapped-in block) belongs to the one
        # request that gets it: were it in two sequences' tables, the write would change a context another reads
        readers = collections.Counter(b for table in self.block_tables for b in set(table))
        written = [("cow_pairs", dst) for _, dst in cow] + [("swap_in", b) for _, t in self.swap_in for b in t]
        for name, b in written:
            if readers[b] > 1:
                raise ValueError(f"StepInput.{name} writes block {b}, which {readers[b]} sequences' tables read: a "
                                 "block written before the forward belongs to one sequence")
        row = 0
        for i, (ql, cl, table) in enumerate(zip(self.query_lens, self.context_lens, self.block_tables)):
            if not 1 <= ql <= cl or cl > len(table) * block_size:
                raise ValueError(f"StepInput sequence {i}: query_len {ql}, context_len {cl} and {len(table)} "
                                 f"blocks of {block_size} do not fit together")
            if self.positions[row:row + ql] != list(range(cl - ql, cl)):  # the model reads these as the context's
                raise ValueError(f"StepInput sequence {i}: positions {self.positions[row:row + ql][:8]} must be its "
                                 f"last query_len={ql} positions {cl - ql}..{cl - 1} (context_len {cl})")
            row += ql


def check_step_input(step: object) -> StepInput:
    """`step` if it is a StepInput (what `plan` makes and an executor runs); a TypeError naming it otherwise."""
    if not isinstance(step, StepInput):
        raise TypeError(f"step must be a StepInput (plan's output), got {type(step).__name__} {short_repr(step)}")
    return step


def _check_pairs(pairs: object) -> list[tuple[int, int]]:
    """cow_pairs: a list of (src, dst) pairs of ints."""
    if not isinstance(pairs, list):
        raise TypeError(f"StepInput.cow_pairs must be a list of (src, dst) block pairs, got {short_repr(pairs)}")
    for j, p in enumerate(pairs):
        if not isinstance(p, (tuple, list)) or len(p) != 2 or any(type(b) is not int for b in p):
            raise ValueError(f"StepInput.cow_pairs[{j}] must be a (src, dst) pair of block ids, got {short_repr(p)}")
    return pairs  # type: ignore[return-value]


def _check_swaps(name: str, swaps: object) -> list[int]:
    """swap_out / swap_in: a list of (str key, list of block ids); returns every block id they name."""
    if not isinstance(swaps, list):
        raise TypeError(f"{name} must be a list of (key, blocks) entries, got {short_repr(swaps)}")
    blocks: list[int] = []
    for j, entry in enumerate(swaps):
        if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], str):
            raise ValueError(f"{name}[{j}] must be a (str key, block ids) pair, got {short_repr(entry)}")
        check_int_list(f"{name}[{j}] blocks", entry[1])
        blocks += entry[1]
    return blocks


def plan(out, block_manager) -> StepInput:
    """The `StepInput` of one scheduled step (`SchedulerOutput`), read off its entries and the block manager.

    Each entry says what it feeds (`fed_tokens()`: positions start .. start + num_new_tokens - 1) and which of its
    rows are sampled (`sample_rows()`, offsets within the entry); chapter 08's verify entry feeds its drafts too and
    samples every draft row, and nothing here knows about it.
    """
    check_step_output(out)
    if not all(callable(getattr(block_manager, name, None)) for name in ("slot_mapping", "block_table")):
        raise TypeError(f"block_manager must be a BlockManager (chapter 05), got {type(block_manager).__name__}")
    step = StepInput(cow_pairs=list(out.cow_pairs), swap_out=list(out.swap_out), swap_in=list(out.swap_in),
                     swap_discard=list(out.swap_discard))
    offset = 0
    for s in out.scheduled:
        rid, start, n = s.request.request_id, s.start, s.num_new_tokens
        fed = s.fed_tokens()
        if len(fed) != n:  # an entry's request changed since it was scheduled (its checks held when it was built)
            raise ValueError(f"the entry of {rid!r} feeds {n} tokens from position {start}, but its request holds "
                             f"only {len(fed)} of them now")
        step.token_ids += fed
        step.positions += range(start, start + n)
        step.slot_mapping += block_manager.slot_mapping(rid, start, start + n)
        step.block_tables.append(block_manager.block_table(rid))
        step.context_lens.append(start + n)
        step.query_lens.append(n)
        step.sample_rows += [offset + r for r in s.sample_rows()]
        offset += n
    return step
