"""The executor interface: what the engine asks of whatever runs its steps, in this process or across N of them.

What it adds: `Executor`, the one contract between the host side of a step (the scheduler and the planner, which
decide) and the device side (which moves bytes and runs the model). The engine (`LLM.step`) talks to its executor
through it alone, so a different executor plugs in as `LLM.runner_cls` without the scheduler, the planner or the
sampler changing:

    in-process (chapter 06): `ModelRunner` owns the KV pool and runs `execute(step)` here
    multi-process (chapter 14): rank 0 schedules and plans as always; its executor broadcasts the `StepInput`
        (plain data), every rank executes it on its shard and its own KV pool, and the logits come back to rank 0,
        where the sampler draws the tokens from the requests' generators

The contract:

    executor = runner_cls(model, num_blocks, block_size, device=..., kv_dtype=..., attention_backend=...)
    executor.execute(step: StepInput) -> logits (R, V) of step.sample_rows, or None for a step with no tokens
    executor.swap_space      the host copies of swapped-out KV, by request id (`SwapSpace`); the engine puts a
                             prefilled arrival's KV there (chapter 07's hand-off) before its swap-in is planned
    executor.kv_dtype        the pool's dtype (a prefilled arrival's KV is converted to it)
    executor.num_forward_calls  how many forwards ran (the engine's stall detector watches it)
    executor.close()         release processes and pools (idempotent; a no-op in process)

`executor_factory(config, runner_cls)` picks what `LLM` builds: `runner_cls` itself in one process, chapter 14's
`TensorParallelExecutor` for `EngineConfig(tensor_parallel_size=t)` (imported by name: chapter 14 sits above this
layer and may import it, never the other way round).

What it leaves out: asynchronous execution (vLLM v1 overlaps planning step t+1 with executing step t; here
`execute` returns when the step is done).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from minillm.core.config import check_instance
from minillm.engine.config import EngineConfig
from minillm.engine.model_runner import ModelRunner
from minillm.engine.step import StepInput
from minillm.engine.swap import SwapSpace

TENSOR_PARALLEL = "minillm.parallel.executor"  # chapter 14's module, imported on first use


@runtime_checkable
class Executor(Protocol):
    """Runs planned steps (see the module docstring for the constructor every `runner_cls` takes)."""

    kv_dtype: torch.dtype
    num_forward_calls: int

    @property
    def swap_space(self) -> SwapSpace: ...

    def execute(self, step: StepInput) -> torch.Tensor | None: ...

    def close(self) -> None: ...


def executor_factory(config, runner_cls: Callable[..., Executor]) -> Callable[..., Executor]:
    """What builds the engine's executor: `runner_cls` for one process, the tensor-parallel executor for t > 1."""
    check_instance("config", config, EngineConfig, "an EngineConfig")
    if not callable(runner_cls):
        raise TypeError(f"runner_cls must be an executor class (like ModelRunner), got {type(runner_cls).__name__}")
    t = config.tensor_parallel_size
    if t == 1:
        return runner_cls
    if runner_cls is not ModelRunner:
        raise ValueError(f"tensor_parallel_size={t} runs chapter 14's executor; this engine brings its own "
                         f"({getattr(runner_cls, '__name__', runner_cls)}), which runs in one process")
    return functools.partial(importlib.import_module(TENSOR_PARALLEL).TensorParallelExecutor, tensor_parallel_size=t)
