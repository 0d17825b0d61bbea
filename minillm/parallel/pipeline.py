"""Pipeline parallelism (GPipe, Huang et al. 2019), forward only: the layers in p stages, micro-batches flowing.

What it adds: `stage_layers` (which blocks each of p ranks holds), `PipelineStage` (one rank's part of a GPT:
the embeddings on the first stage, its blocks, ln_f and the head on the last), and `run_gpipe`, the schedule
each rank runs: for each of m micro-batches, receive the hidden states from the stage before (point-to-point
`recv`), run its blocks, send them to the stage after (`isend`, so the next micro-batch's compute does not wait
for the send). Every rank records (stage, micro-batch, start, end) events; the timeline is drawn from them.

    stage 0 │ F0 F1 F2 F3 .  .  .        a stage idles until the first micro-batch reaches it and after
    stage 1 │ .  F0 F1 F2 F3 .  .        the last one leaves: the "bubble", a share (p - 1) / (m + p - 1)
    stage 2 │ .  .  F0 F1 F2 F3 .        of each stage's time when every step costs the same
    stage 3 │ .  .  .  F0 F1 F2 F3       (p = 4 stages, m = 4 micro-batches: 3 / 7 = 43% idle)

With equal work per micro-batch the makespan is (m + p - 1) steps where one stage alone would be busy m, so
more micro-batches amortize the bubble. Pipelining raises throughput (p micro-batches in flight) but one
micro-batch still passes every stage in turn: its latency does not improve, it gets slightly worse (the sends).
`stage_work_s` replaces each stage's compute by a fixed sleep of known length, so the measured bubble can be set
against the formula without the shared machine's noise (sleeping ranks need no core). What it leaves out: the
backward pass and its schedules (1F1B, interleaved), and uneven stages.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from minillm.core.config import check_float, short_repr, tensor_kind
from minillm.core.model import GPT, require_model
from minillm.core.stopping import check_token_ids
from minillm.kvcache.cache import ContiguousKVCache


def stage_layers(n_layer: int, p: int) -> list[range]:
    """The blocks of each of p stages, as even as possible (the first stages take one more when p does not divide)."""
    if not isinstance(n_layer, int) or isinstance(n_layer, bool) or n_layer < 1:
        raise ValueError(f"n_layer must be a positive int, got {short_repr(n_layer)}")
    if not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= n_layer:
        raise ValueError(f"the number of stages p must be an int in [1, n_layer={n_layer}], got {p!r}")
    base, extra = divmod(n_layer, p)
    bounds = [0]
    for s in range(p):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(p)]


class PipelineStage(nn.Module):
    """Stage `stage` of p: (idx, positions) -> hidden on the first, hidden -> hidden in between, -> logits last."""

    def __init__(self, model: GPT, stage: int, p: int):
        super().__init__()
        self.config = require_model(model, "PipelineStage")
        splits = stage_layers(self.config.n_layer, p)
        if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < p:
            raise ValueError(f"stage must be an int in [0, {p}), got {stage!r}")
        self.stage, self.p = stage, p
        self.layers = splits[stage]
        self.first, self.last = stage == 0, stage == p - 1
        self.wte = model.transformer.wte if self.first else None
        self.wpe = model.transformer.wpe if self.first else None
        self.blocks = nn.ModuleList(model.transformer.h[i] for i in self.layers)
        self.ln_f = model.transformer.ln_f if self.last else None
        self.head = model.lm_head if self.last else None

    @torch.no_grad()
    def forward(self, x: torch.Tensor, start: int = 0, cache=None) -> torch.Tensor:
        """First stage: x = idx (B, T) ids at positions start.. start+T-1. Others: x = hidden (B, T, C).
        The last stage returns logits (B, T, V). `cache`: a KV cache for decoding (each stage fills its own
        layers of it)."""
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"start must be a non-negative int, got {short_repr(start)}")
        if self.first:
            if not isinstance(x, torch.Tensor) or x.dtype != torch.long or x.dim() != 2:
                raise TypeError(f"the first stage takes token ids: an int64 (B, T) tensor, got "
                                f"{tensor_kind(x)} {tuple(getattr(x, 'shape', ()))}")
            T = x.shape[1]
            if start + T > self.config.block_size:
                raise ValueError(f"positions {start}..{start + T - 1} run past the context window "
                                 f"block_size={self.config.block_size}")
            # (values: not on the meta device, where torch.distributed.pipelining infers the stages' shapes)
            if x.numel() and x.device.type != "meta" and (int(x.min()) < 0 or int(x.max()) >= self.config.vocab_size):
                raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got values in "
                                 f"[{int(x.min())}, {int(x.max())}]")
            x = self.wte(x) + self.wpe(torch.arange(start, start + T, device=x.device))  # (B, T, C)
        elif not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.config.n_embd:
            raise ValueError(f"a later stage takes hidden states (B, T, C={self.config.n_embd}), got "
                             f"{tuple(getattr(x, 'shape', ()))}")
        elif not x.is_floating_point():
            raise TypeError(f"a later stage takes floating-point hidden states (B, T, C), got {x.dtype}")
        for block in self.blocks:
            x = block(x, cache)
        return self.head(self.ln_f(x)) if self.last else x


@dataclass
class StageEvent:
    stage: int
    micro_batch: int
    start: float  # time.perf_counter() (CLOCK_MONOTONIC: one clock for every process on the machine)
    end: float


def run_gpipe(stage: PipelineStage, micro_batches: list[torch.Tensor] | int, hidden_shape: tuple[int, ...],
              stage_work_s: float | None = None) -> tuple[list[torch.Tensor], list[StageEvent]]:
    """Run this rank's part of the forward-only GPipe schedule; (the last stage's logits per micro-batch, events).

    `micro_batches`: the first stage's inputs (a list of (b, T) id tensors); other stages pass their count.
    `hidden_shape` (b, T, C) is what flows between stages. `stage_work_s`: sleep this long instead of computing
    (the bubble experiment; the outputs are then the inputs passed along, not logits).
    """
    if not isinstance(stage, PipelineStage):
        raise TypeError(f"stage must be a PipelineStage, got {type(stage).__name__}")
    if stage_work_s is not None:
        stage_work_s = check_float("stage_work_s", stage_work_s, minimum=0.0)
    rank = stage.stage
    if stage.first:
        if not isinstance(micro_batches, list) or not micro_batches:
            raise ValueError("the first stage needs micro_batches: a non-empty list of (b, T) id tensors")
        for j, x in enumerate(micro_batches):  # each must fill the (b, T, C) buffers the next stages receive into
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(hidden_shape[:2]):
                raise ValueError(f"micro_batches[{j}] must be a tensor of shape {tuple(hidden_shape[:2])} "
                                 f"(hidden_shape's b, T), got {getattr(x, 'shape', type(x).__name__)}")
        m = len(micro_batches)
    else:
        m = micro_batches
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"a later stage's micro_batches is their count, a positive int, got {short_repr(m)}")
    dtype = next(stage.parameters()).dtype  # what the stages send: the model's own dtype, not always float32
    outputs, events, pending = [], [], []
    for j in range(m):
        if stage.first:
            x = micro_batches[j]
        else:
            x = torch.empty(hidden_shape, dtype=dtype)
            dist.recv(x, src=rank - 1)
        start = time.perf_counter()
        if stage_work_s is not None:
            time.sleep(stage_work_s)
            y = x if not stage.first else torch.zeros(hidden_shape, dtype=dtype)
        else:
            y = stage(x)
        events.append(StageEvent(rank, j, start, time.perf_counter()))
        if stage.last:
            outputs.append(y)
        else:
            pending.append(dist.isend(y.contiguous(), dst=rank + 1))
    for work in pending:
        work.wait()
    return outputs, events


def pipelined_decode(stage: PipelineStage, prompts: list[list[int]], new_tokens: int
                     ) -> tuple[list[list[int]], list[StageEvent]]:
    """Greedy decode of len(prompts) independent sequences with all of them in flight through the p stages.

    Every rank gets the same `prompts` (equal lengths). Round r: stage 0 feeds each sequence's newest token (its
    prompt in round 0), each stage runs its layers on that sequence's own KV cache and passes the hidden state on,
    the last stage picks the greedy token and sends it back to stage 0. With p sequences in flight each stage
    always has one to work on; with one, p - 1 stages wait for it: pipelining raises throughput, and one
    sequence's time per token stays the sum of all the stages. Returns (the tokens, on stage 0; events).
    """
    if not isinstance(stage, PipelineStage):
        raise TypeError(f"stage must be a PipelineStage, got {type(stage).__name__}")
    rank, p, cfg = stage.stage, stage.p, stage.config
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise ValueError(f"new_tokens must be an int >= 1, got {short_repr(new_tokens)}")
    if not isinstance(prompts, list) or not prompts or not prompts[0]:
        raise ValueError("prompts must be a list of at least one non-empty prompt")
    prompts = [check_token_ids(f"prompts[{i}]", x, cfg.vocab_size) for i, x in enumerate(prompts)]
    T = len(prompts[0])
    if any(len(x) != T for x in prompts):
        raise ValueError("pipelined_decode runs prompts of one length (each sequence is its own batch of 1)")
    caches = [ContiguousKVCache(cfg, 1, T + new_tokens) for _ in prompts]
    dtype = next(stage.parameters()).dtype  # the hidden states travel in the model's dtype
    tokens: list[list[int]] = [[] for _ in prompts]
    events: list[StageEvent] = []
    pending = []  # sends in flight (isend: a stage never blocks on a send, so the ring of stages cannot deadlock)
    for r in range(new_tokens):
        for b in range(len(prompts)):
            start, width = (0, T) if r == 0 else (T + r - 1, 1)
            if stage.first:
                if r == 0:
                    x = torch.tensor([prompts[b]])
                elif p == 1:
                    x = torch.tensor([[tokens[b][-1]]])
                else:
                    x = torch.empty(1, 1, dtype=torch.long)
                    dist.recv(x, src=p - 1)  # the token the last stage picked for this sequence last round
                    tokens[b].append(int(x))
            else:
                x = torch.empty(1, width, cfg.n_embd, dtype=dtype)
                dist.recv(x, src=rank - 1)
            begin = time.perf_counter()
            y = stage(x, start, caches[b])
            events.append(StageEvent(rank, b, begin, time.perf_counter()))
            if stage.last:
                token = y[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
                if p == 1:
                    tokens[b].append(int(token))
                else:
                    pending.append(dist.isend(token, dst=0))
            else:
                pending.append(dist.isend(y.contiguous(), dst=rank + 1))
    if stage.first and p > 1:  # the last round's tokens
        for b in range(len(prompts)):
            x = torch.empty(1, 1, dtype=torch.long)
            dist.recv(x, src=p - 1)
            tokens[b].append(int(x))
    for work in pending:
        work.wait()
    return tokens, events


def bubble_fraction(p: int, m: int) -> float:
    """The formula: each stage idles (p - 1) of the (m + p - 1) equal steps of the schedule."""
    for name, value in (("p", p), ("m", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {short_repr(value)}")
    return (p - 1) / (m + p - 1)


def check_events(events: object) -> None:
    """A ValueError/TypeError naming `events` unless it is a non-empty list of StageEvent with finite times."""
    if not isinstance(events, (list, tuple)) or not events:
        raise ValueError("events must be a non-empty list of StageEvent (every stage's, from run_gpipe)")
    if not all(isinstance(e, StageEvent) for e in events):
        raise TypeError(f"events must hold StageEvent records, got {type(events[0]).__name__}")
    for i, e in enumerate(events):
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (e.stage, e.micro_batch)):
            raise ValueError(f"events[{i}] must have a non-negative int stage and micro_batch, got {e}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (e.start, e.end)):
            raise TypeError(f"events[{i}] must have numbers for start and end, got {e}")
    if not all(math.isfinite(e.start) and math.isfinite(e.end) and e.end >= e.start for e in events):
        raise ValueError("events must have finite times with end >= start")


def measured_bubble(events: list[StageEvent], p: int) -> float:
    """1 - busy / (p * makespan), from every stage's events: the share of stage-time spent waiting."""
    check_events(events)
    if not isinstance(p, int) or isinstance(p, bool) or p < 1 or any(not 0 <= e.stage < p for e in events):
        raise ValueError(f"p must be the number of stages, an int above every event's stage, got {p!r}")
    start = min(e.start for e in events)
    end = max(e.end for e in events)
    busy = sum(e.end - e.start for e in events)
    if end <= start:
        raise ValueError("events must span some time (every event has end > start)")
    return 1.0 - busy / (p * (end - start))
