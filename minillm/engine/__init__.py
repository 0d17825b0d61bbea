"""Chapter 06: continuous batching. An iteration-level scheduler over chapter 05's paged KV cache.

- `config`: `EngineConfig` (pool size, batch limit, token budget, chunked prefill, preemption mode)
- `request`: `Request`, `RequestStatus` (the lifecycle `Enum`), `RequestOutput` (streamed deltas)
- `scheduler`: `Scheduler` (waiting/running/swapped queues, admission, preemption, chunked prefill; invariants)
- `model_runner`: `ModelRunner` (one forward over a ragged batch, per-request sampling)
- `selective_cache`: `SelectiveKVCache` (decodes vectorized, prompt chunks looped, in one step)
- `swap`: `SwapSpace` (preemption by swapping KV blocks to CPU memory)
- `frontend`: `FrontEnd` (request checks, ids, `RequestOutput`s, `generate`; shared with chapter 07)
- `llm`: `LLM` (`generate`, `add_request`, `step`, `abort`, `has_unfinished`)
- `static`: `run_static` (chapter 04's static batching over a whole workload: the baseline)
- `bench`: offline throughput, online latency, the frontier and the chunked-prefill experiment
- `plots`: the scheduling timeline figure; `tour`: the chapter's rows of the tour

Workloads (`make_workload`, presets) and the over-time driver live in the measurement kit, `minillm.bench`.
"""

from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM
from minillm.engine.model_runner import ModelRunner
from minillm.engine.request import Request, RequestOutput, RequestStatus
from minillm.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = [
    "EngineConfig",
    "LLM",
    "ModelRunner",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
]
