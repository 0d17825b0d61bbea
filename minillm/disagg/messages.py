"""The messages the coordinator, the prefill worker and the decode worker exchange: plain data, nothing else.

Three pipes connect the three processes:

    coordinator <--ctrl--> prefill worker --peer (KV hand-off)--> decode worker <--ctrl--> coordinator

Every message is a small dataclass of ints, floats, strings and bytes, pickled by `multiprocessing.Connection`
between processes this package started itself (never loaded from a file). The model crosses as safetensors bytes
inside `WorkerInit` (`minillm.core.formats`), so no code object travels. The process layer's own messages
(Ready, Heartbeat, Shutdown, CrashAfter, WorkerFailed) are `minillm.engine.process`'s. What it leaves out:
versioning of the protocol, and a transport other than an OS pipe (a real deployment uses NCCL/RDMA for the KV
and RPC for control).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minillm.disagg.kv_transfer import KVHeader
from minillm.core.sampling import SamplingParams


@dataclass
class WorkerInit:
    """Everything a worker process needs to start: its role, the model as bytes, and the sizes of its pool."""

    role: str  # "prefill" or "decode"
    model: bytes  # safetensors bytes whose header names the model's format (minillm.core.formats.model_to_bytes)
    model_sha256: str  # their digest, checked on arrival ("" skips the check: tests that build a core by hand)
    device: str  # "cpu", "cuda", "cuda:1", ...
    num_blocks: int  # blocks in this worker's own KV pool
    block_size: int  # tokens per block (both workers must agree for the payload layout to be meaningful)
    max_num_seqs: int  # decode: most sequences decoded together; prefill: most prompts in one prefill step
    max_num_batched_tokens: int  # prefill: most prompt tokens in one prefill step
    eos_id: int | None  # end-of-text id: the workers stop a request on it unless params.ignore_eos
    heartbeat_s: float  # how often a worker says it is alive
    num_threads: int  # torch intra-op threads in this worker (0 = leave torch's default)
    kv_dtype: str = "float32"  # how this worker's KV pool stores K/V (a name; both workers must agree)


@dataclass
class PrefillRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Abort:
    """The coordinator stopped these requests (a stop string matched, or the user aborted): drop them."""

    request_ids: list[str]


@dataclass
class StepRecord:
    """One model step of one worker, for the timeline: what ran, when, on how many tokens, for whom."""

    role: str  # "prefill" or "decode"
    kind: str  # "prefill" or "decode"
    start: float  # perf_counter seconds
    end: float
    num_tokens: int  # tokens through the model in this step
    request_ids: list[str] = field(default_factory=list)


@dataclass
class FirstTokens:
    """Prefill worker -> coordinator: the first sampled token of each prompt of one prefill step.

    `finished` is True when that token already ends the request (max_new_tokens == 1, or eos): nothing is handed
    off for it.
    """

    items: list[tuple[str, int, bool]]  # (request_id, token_id, finished)
    step: StepRecord
    # (request_id, message): requests this step failed alone (their sampling or start raised); the worker goes on
    errors: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class KVHandoff:
    """Prefill worker -> decode worker: a prompt's KV and what decoding needs to continue exactly where it left off."""

    request_id: str
    prompt_ids: list[int]
    first_token: int  # sampled by the prefill worker; its KV is computed by the decode worker's first step
    params: SamplingParams
    generator_state: bytes | None  # the request's torch.Generator state AFTER the first draw (None: no seed)
    header: KVHeader
    data: bytes  # the payload, len(data) == header.nbytes == kv_bytes(config, len(prompt_ids), dtype)
    sent_time: float  # perf_counter when the prefill worker started sending


@dataclass
class TransferRecord:
    """Decode worker -> coordinator: one hand-off received: how many KV bytes and how long it took."""

    request_id: str
    nbytes: int  # KV payload bytes (the formula), without the small header
    sent_time: float
    received_time: float  # the decode worker has the bytes
    unpacked_time: float  # ... and has written them into its own blocks


@dataclass
class DecodeTokens:
    """Decode worker -> coordinator: one decode step's new tokens, plus hand-offs received since the last step."""

    items: list[tuple[str, int, bool]]  # (request_id, token_id, finished)
    step: StepRecord
    transfers: list[TransferRecord] = field(default_factory=list)
    # (request_id, message): requests failed alone in this step or at admission; the worker goes on with the rest
    errors: list[tuple[str, str]] = field(default_factory=list)
