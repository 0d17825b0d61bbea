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

from dataclasses import dataclass, field

from minillm.core.config import GPTConfig


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
        """Raise ValueError if this step could not have come from a planner for this model and pool.

        An executor that receives a step from elsewhere (another process) calls it before touching the pool:
        a bad block id or token then names itself instead of failing inside an index kernel.
        """
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
        blocks = [b for t in self.block_tables for b in t] + [b for p in self.cow_pairs for b in p]
        blocks += [b for _, t in self.swap_out + self.swap_in for b in t]
        bad = [b for b in blocks if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"StepInput names blocks {bad[:4]} outside the pool [0, {num_blocks})")
        for i, (ql, cl, table) in enumerate(zip(self.query_lens, self.context_lens, self.block_tables)):
            if not 1 <= ql <= cl or cl > len(table) * block_size:
                raise ValueError(f"StepInput sequence {i}: query_len {ql}, context_len {cl} and {len(table)} "
                                 f"blocks of {block_size} do not fit together")


def plan(out, block_manager) -> StepInput:
    """The `StepInput` of one scheduled step (`SchedulerOutput`), read off its entries and the block manager.

    Each entry says what it feeds (`fed_tokens()`: positions start .. start + num_new_tokens - 1) and which of its
    rows are sampled (`sample_rows()`, offsets within the entry); chapter 08's verify entry feeds its drafts too and
    samples every draft row, and nothing here knows about it.
    """
    step = StepInput(cow_pairs=list(out.cow_pairs), swap_out=list(out.swap_out), swap_in=list(out.swap_in),
                     swap_discard=list(out.swap_discard))
    offset = 0
    for s in out.scheduled:
        rid, start, n = s.request.request_id, s.start, s.num_new_tokens
        fed = s.fed_tokens()
        assert len(fed) == n, (rid, len(fed), n)
        step.token_ids += fed
        step.positions += range(start, start + n)
        step.slot_mapping += block_manager.slot_mapping(rid, start, start + n)
        step.block_tables.append(block_manager.block_table(rid))
        step.context_lens.append(start + n)
        step.query_lens.append(n)
        step.sample_rows += [offset + r for r in s.sample_rows()]
        offset += n
    return step
