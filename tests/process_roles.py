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



def torch_tp_forward(rank: int, world_size: int, model_bytes: bytes, idx) -> dict:
    """One rank of the check that PyTorch's parallelize_module plan equals the hand-written shards."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from minillm.core.formats import model_from_bytes
    from minillm.parallel.library import count_collectives, parallelize_with_torch
    from minillm.parallel.tensor import shard_model

    model = model_from_bytes(model_bytes)
    mesh = init_device_mesh("cpu", (world_size,))
    lib = parallelize_with_torch(model, mesh)
    hand = shard_model(model, rank, world_size)
    with torch.no_grad():
        lib_logits, counts = count_collectives(lib, idx)
        hand_logits = hand(idx)
    lib_logits = lib_logits.full_tensor() if hasattr(lib_logits, "full_tensor") else lib_logits
    return {"library": torch.as_tensor(lib_logits).detach().clone(), "hand": hand_logits, "counts": counts,
            "hand_calls": dict(hand.comm.calls)}


def pp_forward(rank: int, world_size: int, model_bytes: bytes, idx, m: int) -> dict:
    """One stage of chapter 14's pipeline check: idx split into m micro-batches along the batch."""
    import torch

    from minillm.core.formats import model_from_bytes
    from minillm.parallel.pipeline import PipelineStage, run_gpipe

    model = model_from_bytes(model_bytes)
    stage = PipelineStage(model, rank, world_size)
    micro = list(idx.chunk(m)) if rank == 0 else m
    b, T = idx.shape[0] // m, idx.shape[1]
    outputs, events = run_gpipe(stage, micro, (b, T, model.config.n_embd))
    return {"logits": torch.cat(outputs) if outputs else None, "events": events, "layers": list(stage.layers)}


def pp_bubble(rank: int, world_size: int, m: int, work_s: float) -> list:
    """One stage of the bubble experiment: every step sleeps work_s instead of computing."""
    from minillm.core.config import GPTConfig
    from minillm.core.model import GPT
    from minillm.parallel.pipeline import PipelineStage, run_gpipe

    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=world_size, n_head=1, n_embd=8))
    import torch

    micro = [torch.zeros(1, 4, dtype=torch.long)] * m if rank == 0 else m
    _, events = run_gpipe(PipelineStage(model, rank, world_size), micro, (1, 4, 8), stage_work_s=work_s)
    return events


def sp_forward(rank: int, world_size: int, model_bytes: bytes, idx) -> dict:
    """One rank of the sequence-parallel check: the Megatron-SP shard's logits and its collectives."""
    from minillm.core.formats import model_from_bytes
    from minillm.parallel.tensor import sequence_parallel_logits, shard_model

    shard = shard_model(model_from_bytes(model_bytes), rank, world_size, sequence_parallel=True)
    return {"logits": sequence_parallel_logits(shard, idx), "calls": dict(shard.comm.calls),
            "bytes": dict(shard.comm.bytes)}


def ring_forward(rank: int, world_size: int, q, k, v):
    """One rank of the ring-attention check: its chunk of the sequence in, its chunk of the output out."""
    from minillm.parallel.context import ring_attention

    T = q.shape[2]
    mine = slice(rank * T // world_size, (rank + 1) * T // world_size)
    return ring_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine])


def parallel_suite(rank: int, world_size: int, model_bytes: bytes, idx, pp_idx, qkv, bubble_m: int) -> dict:
    """Every chapter 14 check one group of ranks can make, in one spawn (spawning costs seconds per rank):
    tensor, sequence and library tensor parallelism, ring attention, and (when the model has enough layers for
    the ranks) the pipeline's logits, plus the bubble experiment."""
    out = {"tp": tp_forward(rank, world_size, model_bytes, idx), "sp": sp_forward(rank, world_size, model_bytes, idx),
           "ring": ring_forward(rank, world_size, *qkv),
           "library": torch_tp_forward(rank, world_size, model_bytes, idx)}
    from minillm.core.formats import model_from_bytes

    if model_from_bytes(model_bytes).config.n_layer >= world_size:
        out["pp"] = pp_forward(rank, world_size, model_bytes, pp_idx, 2)
    out["bubble"] = pp_bubble(rank, world_size, bubble_m, 0.05)
    if "pp" in out:
        from minillm.parallel.library import gpipe_with_torch

        model = model_from_bytes(model_bytes)
        out["pp_library"] = gpipe_with_torch(model, rank, world_size, pp_idx if rank == 0 else None, 2)
        out["pp_decode"] = pp_decode(rank, world_size, model_bytes, [list(row) for row in pp_idx.tolist()], 6)
    return out


def pp_decode(rank: int, world_size: int, model_bytes: bytes, prompts: list, new_tokens: int) -> dict:
    """One stage of the pipelined decode: every sequence in flight, tokens back on stage 0."""
    from minillm.core.formats import model_from_bytes
    from minillm.parallel.pipeline import PipelineStage, pipelined_decode

    stage = PipelineStage(model_from_bytes(model_bytes), rank, world_size)
    tokens, events = pipelined_decode(stage, prompts, new_tokens)
    return {"tokens": tokens, "events": events}
