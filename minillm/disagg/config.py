"""`DisaggConfig`: the sizes and timeouts of a disaggregated serving instance; nothing about the model.

Separate from chapter 06's `EngineConfig` because the two workers are sized separately (the point of
disaggregation: DistServe and Splitwise give each phase its own resources), and because a multi-process engine has
timeouts a single process does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from minillm.core.config import check_int, check_threads


@dataclass
class DisaggConfig:
    num_blocks: int = 256  # blocks in the DECODE worker's pool (it holds every running request's KV)
    block_size: int = 16  # tokens per block, the same in both pools
    max_num_seqs: int = 32  # decode batch limit (and the most prompts one prefill step takes)
    max_num_batched_tokens: int = 512  # prompt tokens one prefill step may take (one prompt always fits)
    # where both workers run ("auto": the model's device), unless prefill_device / decode_device say otherwise
    device: str = "auto"
    prefill_device: str | None = None  # e.g. "cuda:0": the point of disaggregation is two devices
    decode_device: str | None = None  # e.g. "cuda:1"
    num_threads: int = 1  # torch threads per worker (on a 2-core CPU: one core each); 0 = torch's default
    heartbeat_s: float = 0.5  # how often each worker says it is alive
    liveness_timeout_s: float = 30.0  # silence after which a worker counts as hung
    startup_timeout_s: float = 300.0  # spawning a worker imports torch (seconds; minutes on a starved CPU)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            setattr(self, name, check_int(f"DisaggConfig.{name}", getattr(self, name)))  # stored as the plain int
        self.num_threads = threads = check_int("DisaggConfig.num_threads", self.num_threads, 0)  # a plain int
        if threads > 0:  # 0 leaves torch's default; past 4 per core torch's pool stalls or crashes
            check_threads("DisaggConfig.num_threads", threads)
        for name in ("heartbeat_s", "liveness_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DisaggConfig.{name} must be positive, got {getattr(self, name)!r}")
        if self.liveness_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(f"liveness_timeout_s={self.liveness_timeout_s} must exceed two heartbeats "
                             f"(heartbeat_s={self.heartbeat_s}), or a healthy worker would look hung")
