"""Tensor parallelism inside chapter 06's engine: an `Executor` over t ranks, the scheduler untouched.

What it adds: `TensorParallelExecutor`, which meets chapter 06's executor contract (`minillm.engine.executor`), so
`LLM(model, tok, EngineConfig(tensor_parallel_size=t))` runs continuous batching, preemption, prefix caching and
speculation exactly as in one process:

    rank 0 (the engine's process)                         ranks 1 .. t-1 (spawned on the process layer)
    scheduler -> plan -> StepInput ──to every rank's pipe──▶ StepInput.check, then the same execute:
    execute on shard 0 + its own KV pool  ◀──all-reduces──▶ shard r + its own KV pool (nh/t heads)
    logits (R, V) after the head's all-gather -> Sampler (the requests, their generators: rank 0 only)

The step travels on the process layer's control pipe (pickled plain data, as every worker message), not as a
gloo broadcast: a rank waiting for its next step then waits in the process layer's loop, which beats its
heartbeat and never times out, however long the engine sits idle; gloo carries only the forward's collectives,
each bounded by the group's timeout.

Each rank holds its shard (`minillm.parallel.tensor.shard_model`) and a paged KV pool of nh/t heads with the same
block ids: the block manager on rank 0 decides for all of them, so swaps and copy-on-write, which are step data,
happen on every rank's own share of the blocks. The model crosses to the ranks as safetensors bytes
(`minillm.core.formats`), and each rank shards it on arrival.

Failure is an error, never a hang: every collective has the group's timeout, rank 0 polls the ranks' processes and
heartbeats before each step, and a rank that died turns the step's error into a `WorkerDiedError` naming it; any
error inside a step closes the executor (the ranks could be mid-collective). `close()` (also at garbage
collection and interpreter exit) stops the ranks for sure, without waiting for a rank-0 join that can only fail.
A script that builds one (or calls `LLM(..., EngineConfig(tensor_parallel_size=t))`) must keep its top level under
`if __name__ == "__main__":`: each spawned rank imports the script's module again.
What it leaves out: several engines with tensor parallelism in one process at a time (the default process group
is one per process), a prefilled arrival's KV (chapter 07's hand-off would have to be split by heads), and
running under torchrun (this executor spawns its own ranks; `init_rank` and `shard_model` are the torchrun way).
"""

from __future__ import annotations

import datetime
import multiprocessing
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from minillm.core.config import check_float, short_repr
from minillm.core.formats import model_from_bytes, model_to_bytes, sha256
from minillm.core.model import require_model
from minillm.engine.model_runner import ModelRunner
from minillm.engine.process import Inbox, WorkerDiedError, WorkerHandle, receive, stop_all, wait_ready
from minillm.engine.step import StepInput
from minillm.parallel.group import free_port, init_rank
from minillm.parallel.tensor import shard_model


@dataclass
class TPRankInit:
    """What rank r of a tensor-parallel engine starts from."""

    role: str  # "rank1", ...
    rank: int
    world_size: int
    port: int
    model: bytes  # the whole model (minillm.core.formats); the rank keeps its shard
    model_sha256: str
    num_blocks: int
    block_size: int
    kv_dtype: str
    attention_backend: str
    device: str
    timeout_s: float  # each collective of a step
    startup_timeout_s: float  # joining the group
    heartbeat_s: float = 0.5
    num_threads: int = 1


class _RankCore:
    """Ranks 1..t-1: each StepInput rank 0 sends is checked and executed on this shard, in order."""

    def __init__(self, init: TPRankInit):
        self.init = init
        model = model_from_bytes(init.model, "cpu", expected_sha256=init.model_sha256)
        self.config = require_model(model, "tensor-parallel rank")
        shard = shard_model(model, init.rank, init.world_size).to(init.device)  # before joining: fail alone
        shard.comm.group = _join(init.rank, init.world_size, init.port, init.startup_timeout_s, init.timeout_s)
        self.runner = ModelRunner(shard, init.num_blocks, init.block_size, device=init.device,
                                  kv_dtype=init.kv_dtype, attention_backend=init.attention_backend)
        self.steps: list[StepInput] = []

    def handle(self, msg: Any) -> None:
        if not isinstance(msg, StepInput):
            raise TypeError(f"a tensor-parallel rank takes StepInputs, got {type(msg).__name__}")
        msg.check(self.config, self.init.num_blocks, self.init.block_size)
        self.steps.append(msg)

    def has_work(self) -> bool:
        return bool(self.steps)

    def step(self) -> list[tuple[str, Any]]:
        self.runner.execute(self.steps.pop(0))  # the logits are rank 0's (every rank computes them: all-gather)
        return []


def _join(rank: int, t: int, port: int, startup_timeout_s: float, timeout_s: float):
    """Join the default group (the rendezvous may wait for slow starters: `startup_timeout_s`), then make the group
    the shards' collectives run in, bounded by `timeout_s` each. Every rank calls it, in the same order."""
    init_rank(rank, t, port, "gloo", startup_timeout_s)
    return dist.new_group(list(range(t)), timeout=datetime.timedelta(seconds=timeout_s))


def _setup_rank(init: TPRankInit, inbox: Inbox):
    return _RankCore(init), {}


def _close(handles: list[WorkerHandle], joined: list[bool], joiner: list[threading.Thread]) -> None:
    """Stop the ranks' processes for sure, then leave the group (after rank 0's join finished, if it started)."""
    stop_all(handles)
    for thread in joiner:
        # Rank 0's join may still wait in the rendezvous for a rank that died while starting; with every other
        # rank stopped it can only fail (at startup_timeout_s), never leave a live group, so close() does not
        # wait for it: the daemon thread is abandoned after a moment.
        thread.join(timeout=5.0)
    if joined[0] and dist.is_initialized():
        dist.destroy_process_group()
    joined[0] = False


class _Rank0Swaps:
    """Rank 0's swap space as the engine sees it: readable, but a prefilled arrival's whole KV is refused."""

    def __init__(self, inner):
        self.inner = inner

    def put(self, key: str, kv: Any) -> None:
        raise ValueError(f"request {short_repr(key)}: the tensor-parallel engine does not take prefilled requests "
                         f"(chapter 07's hand-off): their KV would have to be split by heads across the ranks")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TensorParallelExecutor:
    """The executor contract (`minillm.engine.executor.Executor`) over `tensor_parallel_size` ranks of gloo."""

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device | str | None = None,
                 kv_dtype: torch.dtype | str = torch.float32, attention_backend: str = "selective",
                 tensor_parallel_size: int = 2, timeout_s: float = 300.0, startup_timeout_s: float = 600.0):
        """`timeout_s` bounds each collective of a step (and a rank's silence); `startup_timeout_s` the ranks'
        start (a fresh interpreter importing torch, on a busy machine, can take a while)."""
        config = require_model(model, "TensorParallelExecutor")
        t = tensor_parallel_size
        # checked here: a rank would fail alone
        timeout_s = check_float("timeout_s", timeout_s, minimum=0.0, include_minimum=False)
        startup_timeout_s = check_float("startup_timeout_s", startup_timeout_s, minimum=0.0, include_minimum=False)
        if dist.is_initialized():
            raise ValueError("this process is already in a torch.distributed group (another tensor-parallel engine, "
                             "or torchrun): close that engine first; one tensor-parallel engine per process")
        device = torch.device(device) if device is not None else model.device
        if device.type != "cpu":
            raise ValueError(f"the tensor-parallel engine runs its ranks on the CPU with gloo here, got device "
                             f"{device}")
        shard = shard_model(model, 0, t)  # first: a model t ranks cannot share fails here, before any spawn
        # ... and so does a pool or backend the runner refuses (num_blocks, kv_dtype, attention_backend)
        runner = ModelRunner(shard, num_blocks, block_size, device=device, kv_dtype=kv_dtype,
                             attention_backend=attention_backend)
        self.tensor_parallel_size = t
        self.config = config
        self.num_blocks, self.block_size = num_blocks, block_size
        self.liveness_timeout_s = timeout_s
        data = model_to_bytes(model)
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        kv_name = str(kv_dtype).removeprefix("torch.") if isinstance(kv_dtype, torch.dtype) else kv_dtype
        self._handles: list[WorkerHandle] = []
        self._joined = [False]
        self._joiner: list[threading.Thread] = []
        self._finalizer = weakref.finalize(self, _close, self._handles, self._joined, self._joiner)
        for r in range(1, t):
            init = TPRankInit(f"rank{r}", r, t, port, data, sha256(data), num_blocks, block_size, kv_name,
                              attention_backend, str(device), timeout_s, startup_timeout_s)
            self._handles.append(WorkerHandle(ctx, init, _setup_rank))
        # Rank 0 joins from a thread: joining blocks until every rank has, and the ranks join in their setup,
        # before they say Ready. Meanwhile wait_ready watches them, so a rank that dies while starting is named.
        errors: list[BaseException] = []
        done: list[bool] = []

        def join() -> None:
            try:
                self._joined[0] = True  # from here on, close() must leave the group
                shard.comm.group = _join(0, t, port, startup_timeout_s, timeout_s)
                done.append(True)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the constructor's thread
                errors.append(exc)

        self._joiner.append(threading.Thread(target=join, daemon=True, name="rank0-join"))
        self._joiner[0].start()
        try:
            wait_ready(self._handles, startup_timeout_s)
            self._joiner[0].join(startup_timeout_s)
            if errors or not done:
                raise WorkerDiedError(f"rank 0 could not join the group of {t}: {errors[0] if errors else 'timeout'}")
            self.runner = runner
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------------------- the contract
    @property
    def kv_dtype(self) -> torch.dtype:
        return self.runner.kv_dtype

    @property
    def num_forward_calls(self) -> int:
        return self.runner.num_forward_calls

    @property
    def swap_space(self) -> "_Rank0Swaps":
        """Rank 0's share of the swapped KV (every rank holds its own share of each swapped request's heads)."""
        return _Rank0Swaps(self.runner.swap_space)

    @property
    def comm(self):
        """Rank 0's collective counters (`minillm.parallel.tensor.Comm`)."""
        return self.runner.model.comm

    def execute(self, step: StepInput) -> torch.Tensor | None:
        self._check_ranks()
        try:
            for h in self._handles:  # every rank gets the step before rank 0 starts its collectives
                h.send(step)
            return self.runner.execute(step)
        except BaseException as exc:  # the ranks may be mid-collective: this group cannot go on
            # a rank that died makes rank 0's collective fail at once; the OS may take a moment to reap it
            failure, deadline = None, time.monotonic() + 5.0
            while failure is None and time.monotonic() < deadline:
                _, failure = receive(self._handles, 0.2, self.liveness_timeout_s)
            self.close()
            raise WorkerDiedError(f"the tensor-parallel step failed and the executor is closed: "
                                  f"{failure or f'{type(exc).__name__}: {exc}'}") from exc

    def _check_ranks(self) -> None:
        """Read the ranks' heartbeats; a rank that died, raised or fell silent is a WorkerDiedError naming it."""
        if self.closed:
            raise ValueError("this tensor-parallel executor is closed")
        _, failure = receive(self._handles, 0.0, self.liveness_timeout_s)  # heartbeats, deaths, silence
        if failure is not None:
            self.close()
            raise WorkerDiedError(f"{failure}; the tensor-parallel engine cannot go on")

    def close(self) -> None:
        """Let the ranks go and stop their processes (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
