"""Chapter 14's checks as rank functions: what each rank of a group runs to prove a form equal to one process.

What it adds: module-level functions `fn(rank, world_size, ...)` for `run_ranks` (a spawned rank imports its
function by name, so they cannot live inside a test, a notebook cell or the tour), and `parallel_suite`, which
runs all of them in one group, since starting t ranks costs seconds:

- `tp_forward`: the hand-written tensor-parallel shard's logits, its collectives and its parameter count
- `sp_forward`: the same with Megatron sequence parallelism (reduce-scatter + all-gather along the sequence)
- `torch_tp_forward`: PyTorch's `parallelize_module` plan beside the hand-written shard, counted by CommDebugMode
- `ring_forward`: ring attention over this rank's chunk of the sequence
- `pp_forward`, `pp_decode`: pipeline stages (GPipe over micro-batches; greedy decode with sequences in flight)
- `pp_bubble`: the bubble experiment, every stage step a fixed sleep (known work, no shared-core noise)

The tests, the tour and the notebook compare their results with the single-process model.
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.core.config import check_float_tensor, check_int, GPTConfig
from minillm.core.formats import model_from_bytes
from minillm.core.model import GPT
from minillm.parallel.context import ring_attention
from minillm.parallel.library import count_collectives, gpipe_with_torch, parallelize_with_torch
from minillm.parallel.pipeline import PipelineStage, pipelined_decode, run_gpipe
from minillm.parallel.tensor import sequence_parallel_logits, shard_model


def tp_forward(rank: int, world_size: int, model_bytes: bytes, idx: torch.Tensor) -> dict[str, Any]:
    """Shard the model, run one forward of idx (B, T): logits (B, T, V), collectives, parameters, heads."""
    shard = shard_model(model_from_bytes(model_bytes), rank, world_size)
    with torch.no_grad():
        logits = shard(idx)
    params = sum(p.numel() for p in shard.parameters())
    return {"logits": logits, "calls": dict(shard.comm.calls), "bytes": dict(shard.comm.bytes), "params": params,
            "n_head": shard.config.n_head}


def sp_forward(rank: int, world_size: int, model_bytes: bytes, idx: torch.Tensor) -> dict[str, Any]:
    """The Megatron-SP shard's logits (B, T, V) on every rank, and its collectives."""
    shard = shard_model(model_from_bytes(model_bytes), rank, world_size, sequence_parallel=True)
    return {"logits": sequence_parallel_logits(shard, idx), "calls": dict(shard.comm.calls),
            "bytes": dict(shard.comm.bytes)}


def torch_tp_forward(rank: int, world_size: int, model_bytes: bytes, idx: torch.Tensor) -> dict[str, Any]:
    """PyTorch's parallelize_module plan and the hand-written shards on the same group: both logits, both counts."""
    from torch.distributed.device_mesh import init_device_mesh

    model = model_from_bytes(model_bytes)
    lib = parallelize_with_torch(model, init_device_mesh("cpu", (world_size,)))
    hand = shard_model(model, rank, world_size)
    with torch.no_grad():
        lib_logits, counts = count_collectives(lib, idx)
        hand_logits = hand(idx)
    lib_logits = lib_logits.full_tensor() if hasattr(lib_logits, "full_tensor") else lib_logits
    return {"library": torch.as_tensor(lib_logits).detach().clone(), "hand": hand_logits, "counts": counts,
            "hand_calls": dict(hand.comm.calls)}


def ring_forward(rank: int, world_size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v (B, nh, T, hs) whole; this rank attends its chunk of T through the ring: (B, nh, T/t, hs)."""
    world_size = check_int("world_size", world_size)
    rank = check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, t, ndim=4)
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"q, k and v must have one shape (B, nh, T, hs), got {tuple(q.shape)}, {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    T = q.shape[2]
    if T % world_size:
        raise ValueError(f"ring_forward splits T={T} tokens into {world_size} equal chunks: T must divide evenly")
    mine = slice(rank * T // world_size, (rank + 1) * T // world_size)
    return ring_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine])


def pp_forward(rank: int, world_size: int, model_bytes: bytes, idx: torch.Tensor, m: int) -> dict[str, Any]:
    """One GPipe stage over idx (B, T) split into m micro-batches: the last stage's logits, the events, the layers."""
    model = model_from_bytes(model_bytes)
    stage = PipelineStage(model, rank, world_size)
    micro = list(idx.chunk(m)) if rank == 0 else m
    b, T = idx.shape[0] // m, idx.shape[1]
    outputs, events = run_gpipe(stage, micro, (b, T, model.config.n_embd))
    return {"logits": torch.cat(outputs) if outputs else None, "events": events, "layers": list(stage.layers)}


def pp_bubble(rank: int, world_size: int, m: int, work_s: float) -> list:
    """One stage of the bubble experiment on a toy model: every step sleeps `work_s` instead of computing."""
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=world_size, n_head=1, n_embd=8))
    micro = [torch.zeros(1, 4, dtype=torch.long)] * m if rank == 0 else m
    _, events = run_gpipe(PipelineStage(model, rank, world_size), micro, (1, 4, 8), stage_work_s=work_s)
    return events


def pp_decode(rank: int, world_size: int, model_bytes: bytes, prompts: list[list[int]], new_tokens: int
              ) -> dict[str, Any]:
    """One stage of the pipelined greedy decode, every sequence in flight; the tokens come back on stage 0."""
    stage = PipelineStage(model_from_bytes(model_bytes), rank, world_size)
    tokens, events = pipelined_decode(stage, prompts, new_tokens)
    return {"tokens": tokens, "events": events}


def parallel_suite(rank: int, world_size: int, model_bytes: bytes, idx: torch.Tensor, pp_idx: torch.Tensor,
                   qkv: tuple[torch.Tensor, ...], bubble_m: int, bubble_work_s: float = 0.05,
                   library: bool = True) -> dict[str, Any]:
    """Every check above in one group: tensor and sequence parallelism on idx, ring attention on qkv, and (when the
    model has a layer per rank) GPipe and pipelined decode on pp_idx; the bubble experiment with `bubble_m`
    micro-batches. `library`: also PyTorch's plans (parallelize_module, ScheduleGPipe), a few seconds more."""
    n_layer = model_from_bytes(model_bytes).config.n_layer
    out = {"tp": tp_forward(rank, world_size, model_bytes, idx), "sp": sp_forward(rank, world_size, model_bytes, idx),
           "ring": ring_forward(rank, world_size, *qkv),
           "bubble": pp_bubble(rank, world_size, bubble_m, bubble_work_s)}
    if library:
        out["library"] = torch_tp_forward(rank, world_size, model_bytes, idx)
    if n_layer >= world_size:
        out["pp"] = pp_forward(rank, world_size, model_bytes, pp_idx, 2)
        out["pp_decode"] = pp_decode(rank, world_size, model_bytes, pp_idx.tolist(), 6)
        if library:
            model = model_from_bytes(model_bytes)
            out["pp_library"] = gpipe_with_torch(model, rank, world_size, pp_idx if rank == 0 else None, 2)
    return out
