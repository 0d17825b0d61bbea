"""The chapter's measurements: KV memory utilisation (the vLLM paper's Figure 2 on our workload) and decode time.

It adds a seeded workload of requests with mixed prompt and output lengths and replays it through the real
`BlockManager`, counting, at every step of every request's life, the token slots reserved against the slots that
hold a real token; and two timings, paged against contiguous decode and paged attention against block size.
What it leaves out: external fragmentation across a real schedule (all reservations are per request here) and
the throughput a scheduler wins from the freed memory (chapter 06).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import torch

from minillm.kvcache.cache import ContiguousKVCache
from minillm.core.model import GPT
from minillm.paged.block_manager import BlockManager, num_blocks_for
from minillm.paged.paged_cache import PagedBatch, PagedKVCache
from minillm.core.timing import compare, measure


@dataclass(frozen=True)
class LengthRequest:
    prompt_len: int  # tokens in the prompt (a system prompt plus the user's message)
    output_len: int  # tokens actually generated before end-of-text
    max_new_tokens: int  # the cap the request asked for (what a contiguous cache reserves for it)


def make_length_workload(
    num_requests: int = 200,
    seed: int = 0,
    prompt_range: tuple[int, int] = (96, 224),
    mean_output: float = 48.0,
    max_new_tokens: int = 128,
    context: int = 256,
) -> list[LengthRequest]:
    """Requests with prompts uniform in prompt_range and outputs exponential around mean_output (at least 4),
    all fitting the context window. A chat-like shape: a long shared system prompt, shorter answers."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    lo, hi = prompt_range
    if not 1 <= lo <= hi < context:
        raise ValueError(f"prompt_range must satisfy 1 <= lo <= hi < context={context}, got {prompt_range}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        p = rng.randint(lo, hi)
        cap = min(max_new_tokens, context - p)
        o = max(4, min(cap, round(rng.expovariate(1.0 / mean_output))))
        out.append(LengthRequest(p, min(o, cap), cap))
    return out


@dataclass
class MemoryUse:
    scheme: str  # "contiguous (max length)", "contiguous (prompt + max_new)", "paged bs=16"
    used_slots: int  # sum over requests and steps of tokens held in the cache
    reserved_slots: int  # sum over requests and steps of slots set aside for them
    max_waste_per_seq: int  # the largest reserved - used seen for one request at one step

    @property
    def utilisation(self) -> float:
        return self.used_slots / self.reserved_slots

    @property
    def waste(self) -> float:
        return 1.0 - self.utilisation


def _lifetime_lengths(r: LengthRequest):
    # The cache holds prompt + t tokens while the (t+1)-th new token is computed; the last one is never fed back.
    return range(r.prompt_len, r.prompt_len + r.output_len)


def contiguous_memory_use(workload: list[LengthRequest], reserve: str = "max_len", context: int = 256) -> MemoryUse:
    """Each request reserves `context` slots ("max_len"), or prompt + max_new_tokens ("max_new"), up front."""
    if reserve not in ("max_len", "max_new"):
        raise ValueError(f"reserve must be 'max_len' or 'max_new', got {reserve!r}")
    used = reserved = worst = 0
    for r in workload:
        slots = context if reserve == "max_len" else r.prompt_len + r.max_new_tokens
        for L in _lifetime_lengths(r):
            used += L
            reserved += slots
            worst = max(worst, slots - L)
    name = "contiguous (max length)" if reserve == "max_len" else "contiguous (prompt + max_new)"
    return MemoryUse(name, used, reserved, worst)


def paged_memory_use(workload: list[LengthRequest], block_size: int) -> MemoryUse:
    """Replay every request through a real `BlockManager`: allocate the prompt, append one token per step."""
    longest = max(r.prompt_len + r.output_len for r in workload)
    manager = BlockManager(num_blocks_for(longest, block_size), block_size)
    used = reserved = worst = 0
    for r in workload:
        manager.allocate("r", [0] * r.prompt_len)
        for L in _lifetime_lengths(r):
            if L > r.prompt_len:
                manager.append_slot("r", 0)
            held = len(manager.block_table("r")) * block_size
            used += L
            reserved += held
            worst = max(worst, held - L)
        manager.free("r")
    assert manager.num_free_blocks == manager.num_blocks
    return MemoryUse(f"paged bs={block_size}", used, reserved, worst)


# ----------------------------------------------------------------------------------------------------- timing


def _decoder_pair(model: GPT, num_seqs: int, prompt_len: int, block_size: int, seed: int = 0):
    """Two stateful closures, each decoding one step for `num_seqs` sequences of the same prompt length:
    one on a ContiguousKVCache, one on a PagedKVCache. Both prefill first (untimed), both feed greedy tokens."""
    cfg, dev = model.config, model.device
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (num_seqs, prompt_len), generator=g).to(dev)  # (S, P)
    dtype = model.lm_head.weight.dtype
    # contiguous
    ccache = ContiguousKVCache(cfg, num_seqs, cfg.block_size, device=dev, dtype=dtype)
    with torch.inference_mode():
        c_tok = model(prompts, cache=ccache)[:, -1].argmax(-1)  # (S,)
    c_state = {"tok": c_tok, "history": [c_tok.tolist()]}

    def contiguous_step():
        with torch.inference_mode():
            logits = model(c_state["tok"].view(-1, 1), positions=ccache.positions(1), cache=ccache)  # (S, 1, V)
            c_state["tok"] = logits[:, -1].argmax(-1)
        c_state["history"].append(c_state["tok"].tolist())  # subtle: one host sync per step, on both sides

    # paged
    nblocks = num_seqs * num_blocks_for(cfg.block_size, block_size) + 1
    manager = BlockManager(nblocks, block_size)
    pcache = PagedKVCache(cfg, nblocks, block_size, device=dev, dtype=dtype)
    for i in range(num_seqs):
        manager.allocate(i, prompts[i].tolist())
    batch = PagedBatch.build(manager, [(i, 0, prompt_len) for i in range(num_seqs)], device=dev)
    pcache.set_batch(batch)
    with torch.inference_mode():
        logits = model(prompts.view(1, -1), positions=batch.positions(), cache=pcache)[0]  # (S*P, V)
    first = logits.view(num_seqs, prompt_len, -1)[:, -1].argmax(-1).tolist()  # (S*P, V) -> (S, P, V) -> (S,)
    p_state = {"tok": first, "history": [first]}

    def paged_step():
        toks = p_state["tok"]
        for i, t in enumerate(toks):
            manager.append_slot(i, t)
        b = PagedBatch.build(manager, [(i, manager.num_tokens(i) - 1, 1) for i in range(num_seqs)], device=dev)
        pcache.set_batch(b)
        with torch.inference_mode():
            out = model(torch.tensor([toks], device=dev), positions=b.positions(), cache=pcache)[0]  # (S, V)
        p_state["tok"] = out.argmax(-1).tolist()
        p_state["history"].append(p_state["tok"])

    def release():
        for i in range(num_seqs):
            manager.free(i)

    def same_tokens() -> bool:
        return c_state["history"] == p_state["history"]

    return contiguous_step, paged_step, release, same_tokens


@dataclass
class DecodeTiming:
    contiguous_s: float  # median seconds for `steps` decode steps on the contiguous cache
    paged_s: float  # the same on the paged cache
    block_size: int
    num_seqs: int
    prompt_len: int
    steps: int
    identical_tokens: bool  # both caches produced the same greedy tokens at every timed step

    @property
    def ratio(self) -> float:
        """paged time / contiguous time: 1.0 = as fast, above 1 = slower."""
        return self.paged_s / self.contiguous_s


def decode_time_ratio(
    model: GPT, num_seqs: int = 8, prompt_len: int = 96, steps: int = 16, block_size: int = 16,
    repeats: int = 5, seed: int = 0,
) -> DecodeTiming:
    """Median time of `steps` batched decode steps, paged vs contiguous, interleaved (`minillm.core.timing.compare`).

    Each timed call continues decoding where the last stopped, on both sides alike, so all repeats together
    cover contexts prompt_len .. prompt_len + (repeats + 1) * steps; that must fit the context window.
    """
    if prompt_len + (repeats + 1) * steps > model.config.block_size:
        raise ValueError(f"prompt_len={prompt_len} + (repeats+1)*steps={(repeats + 1) * steps} exceeds the "
                         f"context window {model.config.block_size}")
    c_step, p_step, release, same_tokens = _decoder_pair(model, num_seqs, prompt_len, block_size, seed)
    try:
        def run(step):
            return lambda: [step() for _ in range(steps)]

        cmp = compare(run(c_step), run(p_step), warmup=1, repeats=repeats, device=model.device)
    finally:
        release()
    return DecodeTiming(cmp.baseline.median, cmp.candidate.median, block_size, num_seqs, prompt_len, steps,
                        same_tokens())


def attention_time_by_block_size(
    model: GPT, block_sizes: tuple[int, ...] = (1, 4, 8, 16, 32, 64), num_seqs: int = 8, context: int = 160,
    repeats: int = 7, calls: int = 10,
) -> dict[int, float]:
    """Median seconds of one layer's paged decode attention (`PagedKVCache.attend`) per block size.

    The same step is replayed (it writes the same K/V into the same slots), so only the attention is timed. The
    block sizes take turns, one timed batch of `calls` attends each per round, so a burst of load on a shared
    machine hits all of them alike instead of one.
    """
    cfg, dev = model.config, model.device
    nh, hs = cfg.n_head, cfg.head_size
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, nh, num_seqs, hs, generator=g).to(dev)  # (1, nh, S, hs)
    k = torch.randn(1, nh, num_seqs, hs, generator=g).to(dev)
    v = torch.randn(1, nh, num_seqs, hs, generator=g).to(dev)
    managers, fns = [], {}
    try:
        for bs in block_sizes:
            nblocks = num_seqs * num_blocks_for(context, bs)
            manager = BlockManager(nblocks, bs)
            managers.append(manager)
            cache = PagedKVCache(cfg, nblocks, bs, device=dev)
            for i in range(num_seqs):
                manager.allocate(i, [0] * context)
            cache.set_batch(PagedBatch.build(manager, [(i, context - 1, 1) for i in range(num_seqs)], device=dev))
            fns[bs] = lambda cache=cache: [cache.attend(0, q, k, v) for _ in range(calls)]
            measure(fns[bs], warmup=1, repeats=1, device=dev)  # warm: the scratch buffer, first-call overheads
        times: dict[int, list[float]] = {bs: [] for bs in block_sizes}
        for _ in range(repeats):
            for bs in block_sizes:
                times[bs].append(measure(fns[bs], warmup=0, repeats=1, device=dev).median / calls)
    finally:
        for manager in managers:
            for i in range(num_seqs):
                if manager.has_seq(i):
                    manager.free(i)
    return {bs: statistics.median(t) for bs, t in times.items()}
