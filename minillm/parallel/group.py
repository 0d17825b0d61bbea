"""Process groups the standard way: `torch.distributed` with gloo on the CPU and NCCL on CUDA, on loopback.

What it adds: `init_rank` (join a group, from torchrun's environment or from an explicit loopback address),
`free_port`, `backend_for`, and `run_ranks(fn, world_size, *args)`: start `world_size` processes on the shared
process layer of chapter 06 (`minillm.engine.process`: spawn, heartbeat, death detection, shutdown), make each
one a rank of one group, run `fn(rank, world_size, *args)` in each, and return every rank's result, in rank order.
Tests and notebooks use it; a user outgrowing one box uses `torchrun` instead:

    torchrun --nproc-per-node 2 my_script.py                       # one machine, two ranks
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint host0:29500 my_script.py              # two machines (run on each)

and `init_rank()` with no arguments reads torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.

Failure is an error, never a hang: every group has a timeout (a collective waiting on a dead rank raises after
it), `run_ranks` watches every rank's process and heartbeat, and a rank that raises, dies or falls silent ends
the whole run with a `WorkerDiedError` naming it; no rank outlives the call. What it leaves out: a rendezvous of
its own (torch's TCP store on 127.0.0.1 does it) and any transport but the backend's.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from minillm.core.config import (check_choice, check_float, check_instance, check_int, check_threads, number_kind,
                                 short_repr)
from minillm.engine.process import Inbox, WorkerDiedError, WorkerHandle, receive, stop_all, wait_ready

LOOPBACK = "127.0.0.1"


def backend_for(device: str | torch.device) -> str:
    """"nccl" for CUDA tensors, "gloo" for CPU ones (gloo also moves CUDA tensors, through the host)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or a torch.device, got {type(device).__name__} {device!r}")
    try:
        kind = torch.device(device).type
    except RuntimeError:  # torch's message lists every device type it knows, and not which argument was wrong
        raise ValueError(f"device must name a torch device ('cpu', 'cuda', 'cuda:1'), got {device!r}") from None
    return "nccl" if kind == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it; another process could take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def init_rank(rank: int | None = None, world_size: int | None = None, port: int | None = None,
              backend: str = "gloo", timeout_s: float = 120.0) -> tuple[int, int]:
    """Join the default process group; (rank, world_size).

    With no arguments, from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Otherwise on
    127.0.0.1:`port` (rank 0 hosts the store). `timeout_s` bounds every collective: a rank that died makes the
    others raise after it instead of waiting forever.
    """
    if rank is None:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"init_rank() without arguments reads torchrun's environment, but {missing} are not "
                             "set: launch with torchrun, or pass rank, world_size and port")
        rank, world_size = _rank_from_environment()
    else:
        for name, value in (("rank", rank), ("world_size", world_size), ("port", port)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {number_kind(value)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"port must be in [1, 65535], got {port}")
    _check_backend_and_timeout(backend, timeout_s)
    if dist.is_initialized():
        raise ValueError(f"this process is already rank {dist.get_rank()} of a group of {dist.get_world_size()}; "
                         "call torch.distributed.destroy_process_group() first")
    timeout = datetime.timedelta(seconds=timeout_s)
    if port is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    else:
        store = loopback_store(rank, world_size, port, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return rank, world_size


def _rank_from_environment() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) from torchrun's environment, each checked, and MASTER_PORT checked as a port.

    subtle: torch reads these itself with a bare int() ("invalid literal for int()"), and a RANK at or past
    WORLD_SIZE is not refused at all: that rank connects to the store as a client and waits the whole timeout for
    a group it can never be part of."""
    values = {}
    for name, low in (("RANK", 0), ("WORLD_SIZE", 1), ("MASTER_PORT", 1)):
        text = os.environ[name]
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"the environment variable {name} must be an int, got {text!r}") from None
        if values[name] < low:
            raise ValueError(f"the environment variable {name} must be >= {low}, got {text!r}")
    if values["MASTER_PORT"] > 65535:
        raise ValueError(f"the environment variable MASTER_PORT must be a port in [1, 65535], got "
                         f"{os.environ['MASTER_PORT']!r}")
    if values["RANK"] >= values["WORLD_SIZE"]:
        raise ValueError(f"the environment variable RANK must be in [0, WORLD_SIZE={values['WORLD_SIZE']}), got "
                         f"{values['RANK']}")
    return values["RANK"], values["WORLD_SIZE"]


def _check_backend_and_timeout(backend: str, timeout_s: float) -> None:
    backend = check_choice("backend", backend, ("gloo", "nccl"))
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise ValueError("backend 'nccl' needs CUDA GPUs and a PyTorch built with NCCL; this machine has "
                         f"{'no GPU' if not torch.cuda.is_available() else 'no NCCL'}: use backend='gloo'")
    check_float("timeout_s", timeout_s, minimum=0.0, include_minimum=False)


def loopback_store(rank: int, world_size: int, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's rendezvous (a `TCPStore`) on 127.0.0.1:`port`, hosted by rank 0.

    Subtle: a `TCPStore` that binds its own socket listens on every interface of the machine; rank 0 binds one to
    loopback and hands it over (`master_listen_fd`), so nothing of the group is reachable from outside the box.
    (gloo's own connections already bind the address the store resolves to: 127.0.0.1.)"""
    world_size = check_int("world_size", world_size)
    rank = check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    port = check_int("port", port, 0)
    if port > 65535:
        raise ValueError(f"port must be a TCP port in [0, 65535], got {port}")
    check_instance("timeout", timeout, datetime.timedelta, "a datetime.timedelta")
    if rank != 0:
        return dist.TCPStore(LOOPBACK, port, world_size, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(LOOPBACK, port, world_size, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


# ------------------------------------------------------------------------------------------------- run_ranks


@dataclass
class RankInit:
    """What a rank process starts from (the process layer's init message)."""

    role: str  # "rank0", "rank1", ...
    rank: int
    world_size: int
    port: int
    backend: str
    fn: Callable[..., Any]  # module-level (spawn imports it by name)
    args: tuple = ()
    heartbeat_s: float = 0.5
    num_threads: int = 1  # torch threads per rank: ranks share the machine's cores
    timeout_s: float = 120.0


@dataclass
class RankResult:
    rank: int
    value: Any = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class _RunOnce:
    """A rank's core: join the group, run fn once, send the result, leave the group."""

    def __init__(self, init: RankInit):
        self.init, self.done = init, False

    def handle(self, msg: Any) -> None:
        raise TypeError(f"a rank of run_ranks takes no messages, got {type(msg).__name__}")

    def has_work(self) -> bool:
        return not self.done

    def step(self) -> list[tuple[str, Any]]:
        i = self.init
        init_rank(i.rank, i.world_size, i.port, i.backend, i.timeout_s)
        try:
            start = time.perf_counter()
            value = i.fn(i.rank, i.world_size, *i.args)
            seconds = time.perf_counter() - start
            dist.barrier()  # nobody leaves while another rank may still need it in a collective
        finally:
            dist.destroy_process_group()
        self.done = True
        return [("ctrl", RankResult(i.rank, value, seconds))]


def _setup_rank(init: RankInit, inbox: Inbox):
    return _RunOnce(init), {}


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout_s: float = 300.0,
              num_threads: int = 1) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks of one group; their results, rank order.

    `fn` must be a module-level function and `args` picklable (each rank is a fresh interpreter). Every rank is
    bounded by `timeout_s` (start, run, and each collective); a rank that raises, dies or hangs raises
    `WorkerDiedError` naming it, and every rank process is gone when this returns or raises.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a module-level function, got {type(fn).__name__}")
    if "<" in getattr(fn, "__qualname__", "<"):  # a lambda, a nested function: a spawned rank cannot import it
        raise TypeError(f"fn must be a module-level function (each rank imports it by name), got "
                        f"{getattr(fn, '__qualname__', fn)!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {short_repr(world_size)}")
    _check_backend_and_timeout(backend, timeout_s)
    num_threads = check_threads("num_threads", num_threads)  # each rank sets it: 100000 would crash torch's pool there
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    handles = [WorkerHandle(ctx, RankInit(f"rank{r}", r, world_size, port, backend, fn, tuple(args),
                                          num_threads=num_threads, timeout_s=timeout_s), _setup_rank)
               for r in range(world_size)]
    try:
        wait_ready(handles, timeout_s)
        results: dict[int, RankResult] = {}
        deadline = time.monotonic() + timeout_s
        failures: dict[str, str] = {}
        while len(results) < world_size:
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish "
                                      f"within {timeout_s:.0f} s")
            got, failure = receive(handles, timeout=0.5, liveness_timeout_s=timeout_s, failures=failures)
            for _, msg in got:
                results[msg.rank] = msg
            if failure is not None and len(results) < world_size:
                # One rank's error makes the others' collectives fail a moment later ("connection reset"): wait a
                # little for every report, so the rank that failed first is named beside its consequences.
                time.sleep(1.0)
                _, failure = receive(handles, timeout=1.0, liveness_timeout_s=timeout_s, failures=failures)
                raise WorkerDiedError(f"run_ranks of {getattr(fn, '__name__', fn)!r} (world size {world_size}) "
                                      f"failed:\n{failure}")
        return [results[r].value for r in range(world_size)]
    finally:
        stop_all(handles)
