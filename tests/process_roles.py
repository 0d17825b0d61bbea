"""Toy roles for the process layer's tests (tests/test_executor.py): a spawned worker imports its role's setup by
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


def tp_forward(rank: int, world_size: int, model_bytes: bytes, idx) -> dict:
    """One rank of chapter 14's tensor-parallel check: shard the model, run one forward, report logits and comms."""
    import torch

    from minillm.core.formats import model_from_bytes
    from minillm.parallel.tensor import shard_model

    shard = shard_model(model_from_bytes(model_bytes), rank, world_size)
    with torch.no_grad():
        logits = shard(idx)
    params = sum(p.numel() for p in shard.parameters())
    return {"logits": logits, "calls": dict(shard.comm.calls), "bytes": dict(shard.comm.bytes), "params": params,
            "n_head": shard.config.n_head}


def fails_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank
