"""Chapter 06: continuous batching. An iteration-level scheduler over chapter 05's paged KV cache.

- `config`: `EngineConfig` (pool size, batch limit, token budget, chunked prefill, preemption mode)
- `request`: `Request`, `RequestStatus` (the lifecycle `Enum`), `RequestOutput` (streamed deltas)
- `scheduler`: `Scheduler` (waiting/running/swapped queues, admission, preemption, chunked prefill; invariants)
- `step`: `StepInput` (one step as plain, picklable data) and `plan(scheduler_output, block_manager)`
- `model_runner`: `ModelRunner`, the in-process executor (`execute(StepInput)`: swaps, copy-on-write, one forward
  over a ragged batch, logits of the sampled rows)
- `executor`: `Executor`, the contract between the engine and what runs its steps (here or on N ranks)
- `process`: the process layer (spawn, loop, heartbeats, death detection, shutdown) of chapter 07's workers and
  chapter 14's ranks, `WorkerDiedError`
- `sampler`: `Sampler` (logits -> one token per sampling request, each on its own generator)
- `selective_cache`: `SelectiveKVCache` (decodes vectorized, prompt chunks looped, in one step)
- `step_models`: `step_model(name, model)`, other implementations of the engine's forward by name (chapter 13's
  "fused-cpp": each short step one C++ call)
- `swap`: `SwapSpace` (the executor's host copies of swapped-out KV blocks, by request id)
- `frontend`: `FrontEnd` (request checks, ids, `RequestOutput`s, `generate`; shared with chapter 07)
- `llm`: `LLM` (`generate`, `add_request`, `step`, `abort`, `has_unfinished`)
- `core`: `EngineCore` (the engine behind a thread-safe inbox and an outbox, for a server's thread)
- `throughput`: the offline comparison (engine, static batching, Hugging Face) that chapter 13 reuses
- `static`: `run_static` (chapter 04's static batching over a whole workload: the baseline)
- `bench`: offline throughput, online latency, the frontier and the chunked-prefill experiment
- `plots`: the scheduling timeline figure; `tour`: the chapter's rows of the tour

Workloads (`make_workload`, presets) and the over-time driver live in the measurement kit, `minillm.bench`.
"""

from minillm.engine.config import EngineConfig
from minillm.engine.executor import Executor
from minillm.engine.llm import LLM
from minillm.engine.model_runner import ModelRunner
from minillm.engine.request import Request, RequestOutput, RequestStatus
from minillm.engine.sampler import Sampler
from minillm.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from minillm.engine.step import StepInput, plan

__all__ = [
    "EngineConfig",
    "Executor",
    "LLM",
    "ModelRunner",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "Sampler",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "StepInput",
    "plan",
]
