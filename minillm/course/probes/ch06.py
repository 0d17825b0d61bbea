"""Chapter 06's probes: the admission check at its limits, and every step's schedule of seeded workloads."""

from __future__ import annotations

from minillm.core.sampling import SamplingParams
from minillm.engine.config import EngineConfig
from minillm.engine.request import Request
from minillm.engine.scheduler import Scheduler
from minillm.paged.block_manager import BlockManager
from . import Probe, rng


class _FreeBlocks:
    """A block manager reduced to what `_can_admit` reads: its count of free blocks."""

    def __init__(self, num_free_blocks: int):
        self.num_free_blocks = num_free_blocks


class _ProbeScheduler(Scheduler):
    """The scheduler under test with the probe's own copy of the admission rule (`_can_admit`'s docstring), so
    the schedule probe runs the student's `schedule` but not their `_can_admit`, which has its own probe."""

    def _can_admit(self, req: Request, budget: int, num_tokens: int) -> bool:
        if len(self.running) >= self.config.max_num_seqs or budget <= 0:
            return False
        if not self.config.enable_chunked_prefill and req.num_uncomputed_tokens > budget:
            return False
        needed = self._blocks_for(num_tokens) + (self.watermark_blocks if self.running else 0)
        return self.block_manager.num_free_blocks >= needed


def _request(request_id: str, prompt: list[int], max_new_tokens: int) -> Request:
    return Request(request_id, prompt, SamplingParams.greedy(max_new_tokens, ignore_eos=True))


def can_admit(seed: int) -> list:
    """Random requests (some partly computed) against a batch that is empty, holds 1 or 2, or is full (3);
    budgets of 0, one short of the uncomputed part, exactly it and ample; free blocks one short of the blocks
    needed, exactly them, and one short of / exactly them plus the watermark (1, 2 and 4 blocks); with and
    without chunking. Returns (running, budget, free blocks, admitted) per case."""
    r = rng(seed)
    outs = []
    for chunked in (False, True):
        for num_blocks in (10, 250, 400):  # watermark max(1, num_blocks // 100): 1, 2, 4
            cfg = EngineConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=3, max_num_batched_tokens=64,
                               enable_chunked_prefill=chunked)
            pool = _FreeBlocks(0)
            sched = Scheduler(cfg, pool)
            wm = sched.watermark_blocks
            for num_running in (0, 1, 2, 3):
                prompt = [r.randrange(1, 50) for _ in range(r.randrange(1, 30))]
                req = _request("a", prompt, 4)
                req.num_computed_tokens = r.randrange(0, len(prompt))
                uncomputed = len(prompt) - req.num_computed_tokens
                num_tokens = r.randrange(len(prompt), len(prompt) + 8)
                needed = -(-num_tokens // 4)
                sched.running = [_request(f"x{i}", [1], 1) for i in range(num_running)]
                for budget in (0, uncomputed - 1, uncomputed, 64):
                    for free in (needed - 1, needed, needed + wm - 1, needed + wm):
                        pool.num_free_blocks = free
                        outs.append([len(sched.running), budget, free, sched._can_admit(req, budget, num_tokens)])
    return outs


def _workload(r, cfg: EngineConfig, lengths: list[tuple[int, int]], abort_at: int | None = None) -> list:
    """Requests (prompt length, max new tokens) arriving over the first steps; each step's schedule as data."""
    sched = _ProbeScheduler(cfg, BlockManager(cfg.num_blocks, cfg.block_size))
    pending = [(r.randrange(0, 5), f"r{i}", p, n) for i, (p, n) in enumerate(lengths)]
    pending.sort(key=lambda a: a[0])
    steps = []
    for step in range(200):
        if not (pending or sched.has_unfinished()):
            break
        while pending and pending[0][0] <= step:
            _, rid, p, n = pending.pop(0)
            sched.add(_request(rid, [r.randrange(1, 50) for _ in range(p)], n))
        if step == abort_at and sched.has_unfinished():  # abort whoever is last in line (maybe a swapped one)
            last = ([*sched.swapped] or [*sched.waiting] or sched.running)[-1]
            sched.abort(last.request_id)
        out = sched.schedule()
        sampled = [r.randrange(1, 50) if s.samples else None for s in out.scheduled]
        steps.append({
            "scheduled": [[s.request.request_id, s.start, s.num_new_tokens, s.samples] for s in out.scheduled],
            "preempted": [q.request_id for q in out.preempted],
            "cow": out.cow_pairs, "swap_out": out.swap_out, "swap_in": out.swap_in, "discard": out.swap_discard,
        })
        finished = sched.update(out, sampled, now=float(step))
        steps[-1].update(finished=[q.request_id for q in finished], free=sched.block_manager.num_free_blocks,
                         queues=[[q.request_id for q in queue] for queue in (sched.waiting, sched.running,
                                                                             sched.swapped)])
    return steps


def schedules(seed: int) -> list:
    """Three seeded workloads driven step by step, with the probe's admission rule: small pools that force
    preemption (by recomputation, and by swapping with a swap space that fills up), long prompts chunked under a
    small token budget next to running decodes (a 22-token prompt under a budget of 8 takes three chunks), whole
    prompts without chunking, and an abort. Returns every step's scheduled (request, start, tokens, samples),
    preemptions, copies and swaps, and the queues after it."""
    r = rng(seed)
    cfgs = [
        (EngineConfig(num_blocks=8, block_size=4, max_num_seqs=3, max_num_batched_tokens=8),
         [(22, r.randrange(2, 11))] + [(r.randrange(1, 15), r.randrange(1, 10)) for _ in range(5)], None),
        (EngineConfig(num_blocks=7, block_size=2, max_num_seqs=4, max_num_batched_tokens=12,
                      enable_chunked_prefill=False, preemption_mode="swap", num_swap_blocks=4),
         [(r.randrange(1, 7), r.randrange(1, 7)) for _ in range(6)], 6),
        (EngineConfig(num_blocks=10, block_size=3, max_num_seqs=4, max_num_batched_tokens=10,
                      preemption_mode="swap", num_swap_blocks=6),
         [(r.randrange(1, 17), r.randrange(1, 11)) for _ in range(7)], 9),
    ]
    return [_workload(r, cfg, lengths, abort_at) for cfg, lengths, abort_at in cfgs]


PROBES = {
    "_can_admit": Probe(can_admit),
    "schedule": Probe(schedules),
}
