"""Sampling one step's logits into tokens, on the rank that owns the requests (the executor only returns logits).

What it adds: `Sampler.sample(scheduler_output, logits)`, kept out of the executor so that a step can be executed
anywhere (another process, N ranks of a sharded model) while the requests, their generators and their stop rules
stay in one place. Greedy rows share one argmax; every other row is drawn from its own request's generator, one
draw per token, as when the request runs alone. Chapter 08's `SpeculativeSampler` runs its acceptance rule on the
verify entries' rows and hands every other entry to this one. What it leaves out: sampling on the device in one
batched kernel for mixed parameters (each non-greedy row is its own small call).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from minillm.core.config import check_float_tensor
from minillm.core.sampling import sample_next
from minillm.engine.scheduler import check_step_output


def check_step_logits(out: object, logits: object, rows_of: Callable[[Any], int] = lambda s: 1) -> int:
    """A sampler's arguments: `out` a SchedulerOutput, `logits` a 2-D float tensor (R, V) with the rows the step
    samples (`rows_of(entry)` for each entry that samples: one by default). The number of rows, or a TypeError /
    ValueError naming the argument (not an AttributeError or an assert in the loop)."""
    check_step_output(out)
    rows = sum(rows_of(s) for s in out.scheduled if s.samples)
    check_float_tensor("logits", logits, ndim=2)
    if logits.shape[0] != rows:  # type: ignore[union-attr]
        raise ValueError(f"logits must hold one row per sampled row of the step ({rows}), got "
                         f"{tuple(logits.shape)}")  # type: ignore[union-attr]
    return rows


def _is_greedy(params) -> bool:
    """params.is_greedy, or False if even that raises: the row is then sampled alone, where its failure is caught."""
    try:
        return bool(params.is_greedy)
    except Exception:  # noqa: BLE001 - the per-row path below fails this request with the same exception
        return False


class Sampler:
    """Turns the logits of a step's sampled rows into one token per sampling entry (None for the others)."""

    def sample(self, out, logits: torch.Tensor) -> list[int | None]:
        """One token per sampling request, None for prompt chunks that do not reach the end of their prompt.

        `logits` (R, V) are the rows `plan` asked for, in entry order (one per entry that samples). Greedy rows
        share one argmax (row-wise, so batching cannot change it); every other row is drawn by `sample_next` from
        its own request's generator, exactly one draw per token, as when the request runs alone. A request whose
        sampling raises is failed alone (`state.fail`, finish_reason "error", a message naming it) and gets None;
        the caller finishes and frees it (`Scheduler.update`, the workers), the others go on.
        """
        check_step_logits(out, logits)
        samplers = [s for s in out.scheduled if s.samples]
        tokens: list[int | None] = [None] * len(samplers)
        greedy = [i for i, s in enumerate(samplers) if _is_greedy(s.request.params)]
        if greedy:
            try:
                picked = sample_next(logits[greedy], samplers[greedy[0]].request.params)  # (G,)
                for i, t in zip(greedy, picked.tolist()):
                    tokens[i] = t
            except Exception:  # noqa: BLE001 - redone row by row below, so the failure lands on its own request
                pass
        for i, s in enumerate(samplers):
            if tokens[i] is None:
                req = s.request
                try:
                    tokens[i] = int(sample_next(logits[i : i + 1], req.params, req.generator))  # (1, V) -> (1,)
                except Exception as exc:  # noqa: BLE001 - one request's failure, whatever it is, is its own
                    req.state.fail(f"request {req.request_id!r} failed in sampling: {type(exc).__name__}: {exc}")
        it = iter(tokens)
        return [next(it) if s.samples else None for s in out.scheduled]
