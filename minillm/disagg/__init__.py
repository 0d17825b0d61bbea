"""Chapter 07: disaggregated prefill and decode (DistServe, Splitwise) in two worker processes with a KV hand-off.

- `kv_transfer`: `pack_kv` / `unpack_kv` (paged blocks <-> one (L, 2, T, nh, hs) payload), bytes on the wire,
  `kv_bytes` (the formula the payload must equal)
- `messages`: the plain-data messages between the coordinator and the two workers
- `worker`: the two roles' setups on chapter 06's process layer (`minillm.engine.process`: spawn, loop,
  heartbeats, crash hook, shutdown, `WorkerDiedError`)
- `prefill_worker` / `decode_worker`: each role's model work; `admit_handoffs` (the decode side's admission)
- `config`: `DisaggConfig` (pool sizes, devices, threads, heartbeat and liveness timeouts)
- `llm`: `DisaggregatedLLM` (chapter 06's `generate` surface)
- `bench`: the prefill-heavy workload under colocated, chunked-prefill and disaggregated serving, and its timeline
- `tour`: the chapter's rows of the tour
"""

from minillm.disagg.decode_worker import admit_handoffs, max_kv_tokens
from minillm.disagg.kv_transfer import KVHeader, kv_bytes, pack_kv, payload_from_bytes, payload_to_bytes, unpack_kv
from minillm.disagg.config import DisaggConfig
from minillm.disagg.llm import DisaggregatedLLM
from minillm.engine.process import WorkerDiedError

__all__ = [
    "DisaggConfig",
    "DisaggregatedLLM",
    "KVHeader",
    "WorkerDiedError",
    "admit_handoffs",
    "kv_bytes",
    "max_kv_tokens",
    "pack_kv",
    "payload_from_bytes",
    "payload_to_bytes",
    "unpack_kv",
]
