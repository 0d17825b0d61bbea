"""Toy roles for the process layer's tests (tests/test_executor.py, tests/test_14_parallelism.py): a spawned worker imports its role's setup by
module name, so the roles live in a module of their own, not inside a test function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ToyInit:
    role: str
    heartbeat_s: float
    num_threads: int


class Doubler:
    """Answers every int it is sent with twice that int: the smallest core the loop can run."""

    def __init__(self) -> None:
        self.todo: list[int] = []

    def handle(self, msg: Any) -> None:
        self.todo.append(msg)

    def has_work(self) -> bool:
        return bool(self.todo)

    def step(self) -> list[tuple[str, Any]]:
        done, self.todo = self.todo, []
        return [("ctrl", 2 * x) for x in done]


def setup_doubler(init: ToyInit, inbox: Any):
    return Doubler(), {}


def setup_broken(init: ToyInit, inbox: Any):
    raise ValueError("no model for this role")


def fails_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def listening_addresses(rank: int, world_size: int) -> list[str]:
    """The local IPv4/IPv6 addresses this rank's process listens on (Linux: its socket inodes in /proc/self/fd,
    matched against /proc/net/tcp and tcp6), once the group is up and a collective has run."""
    import os

    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # every connection of the group is made
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # state 0A: LISTEN
                    found.append(cols[1].split(":")[0])
    return found
