"""Chapter 07's two roles on the shared process layer (`minillm.engine.process`): how each worker is set up.

Adds only what is particular to disaggregation: each role's `setup` (the model from the init's bytes, its core,
and the third pipe, "peer", that carries the KV hand-offs from the prefill worker to the decode worker), and the
`WorkerInit` the coordinator sends. Spawning, the loop, heartbeats, the crash hook, death detection and shutdown
are the process layer's, shared with chapter 14's ranks.

    prefill setup: PrefillCore + a "kv-sender" thread: a multi-MB KVHandoff fills the OS pipe and would block
                   until the decode worker read it between two of its steps; prefill must not wait for that
    decode setup:  DecodeCore + a "kv-receiver" thread that puts each fully arrived hand-off into the loop's inbox

The model crosses as safetensors bytes whatever its modules are (`minillm.core.formats`: a plain, quantized, or
pruned GPT), checked against the SHA-256 the coordinator computed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from minillm.core.config import short_repr
from minillm.core.formats import model_from_bytes
from minillm.disagg.decode_worker import DecodeCore
from minillm.disagg.messages import WorkerInit
from minillm.disagg.prefill_worker import PrefillCore
from minillm.engine.process import Inbox, WorkerCore, WorkerDiedError

__all__ = ["WorkerDiedError", "setup_decode", "setup_prefill"]


def _model(init: WorkerInit):
    return model_from_bytes(init.model, init.device, expected_sha256=init.model_sha256 or None)


def setup_prefill(init: WorkerInit, inbox: Inbox, peer: Connection | None
                  ) -> tuple[WorkerCore, dict[str, Callable[[Any], None]]]:
    """The prefill role: its core, and the "peer" route (a sender thread draining a queue into the KV pipe)."""
    if not isinstance(init, WorkerInit) or init.role != "prefill":
        raise TypeError(f"the prefill worker needs a prefill WorkerInit, got {short_repr(init)}")
    core = PrefillCore(_model(init), init)
    outgoing: queue.Queue = queue.Queue()

    def send_peer() -> None:
        while (msg := outgoing.get()) is not None:
            try:
                peer.send(msg)
            except (OSError, ValueError):
                return  # the decode worker is gone; the coordinator will notice

    if peer is not None:
        threading.Thread(target=send_peer, daemon=True, name="kv-sender").start()
    return core, {"peer": outgoing.put}


def setup_decode(init: WorkerInit, inbox: Inbox, peer: Connection | None
                 ) -> tuple[WorkerCore, dict[str, Callable[[Any], None]]]:
    """The decode role: its core, and a receiver thread that hands each arrived KVHandoff to the loop's inbox."""
    if not isinstance(init, WorkerInit) or init.role != "decode":
        raise TypeError(f"the decode worker needs a decode WorkerInit, got {short_repr(init)}")
    core = DecodeCore(_model(init), init)

    def recv_peer() -> None:
        while True:
            try:
                inbox.put(peer.recv())
            except (EOFError, OSError):
                return  # the prefill worker is gone; the coordinator will notice

    if peer is not None:
        threading.Thread(target=recv_peer, daemon=True, name="kv-receiver").start()
    return core, {}
