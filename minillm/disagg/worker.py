"""The process layer: start a worker with the "spawn" context, run its loop, watch it, and stop it for sure.

Adds what a second process needs that a function call does not: the model shipped as safetensors bytes, a ready
handshake, a heartbeat thread, a death detector (the process sentinel), a test hook that kills the worker, and a
shutdown that escalates from a polite message to SIGTERM to SIGKILL. What it leaves out: restarting a dead
worker (the coordinator fails the requests it held instead) and more than one worker per role.

The worker's main loop (`worker_main`) is the same for both roles; the role's `core` object does the model work:

    while True:
        read every waiting message (block up to heartbeat_s when there is no work)
        Shutdown -> return;  CrashAfter -> arm the test hook;  anything else -> core.handle(msg)
        if core.has_work(): send every message of core.step()

Why "spawn": a forked child inherits the parent's threads and locks (torch's OpenMP pool among them) in whatever
state they were, and can deadlock; a spawned child starts a fresh interpreter and imports what it needs.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import torch

from minillm.core.config import GPTConfig
from minillm.core.model import GPT
from minillm.disagg.decode_worker import DecodeCore
from minillm.disagg.messages import CRASH_EXIT_CODE, CrashAfter, Heartbeat, Ready, Shutdown, WorkerFailed, WorkerInit
from minillm.disagg.prefill_worker import PrefillCore


class WorkerDiedError(RuntimeError):
    """A worker process died, hung or raised; the requests it held cannot finish."""


# ------------------------------------------------------------------------------------------------- the model


def model_to_bytes(model: GPT) -> tuple[dict, bytes]:
    """(config dict, safetensors bytes): how the model crosses to a worker. Loading it back runs no code."""
    from safetensors.torch import save

    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    # subtle: lm_head.weight IS transformer.wte.weight (tied); safetensors refuses shared storage, and the
    # receiver re-ties it by constructing GPT, so it is dropped here and checked missing there.
    state.pop("lm_head.weight", None)
    return model.config.to_dict(), save(state)


def model_from_bytes(config: dict, weights: bytes, device: str | torch.device = "cpu") -> GPT:
    from safetensors.torch import load

    model = GPT(GPTConfig.from_dict(config))
    missing, unexpected = model.load_state_dict(load(weights), strict=False)
    if missing != ["lm_head.weight"] or unexpected:
        raise ValueError(f"worker weights do not match the config: missing {missing}, unexpected {unexpected}")
    return model.to(device).eval()


# ------------------------------------------------------------------------------------------------- the child


class WorkerCore(Protocol):
    """A role's model work. `step()` returns (destination, message) pairs; destination is "ctrl" or "peer"."""

    def handle(self, msg: Any) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[tuple[str, Any]]: ...


class _Outbox:
    """Sends to one connection from several threads (main loop + heartbeat), one message at a time."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: Any) -> None:
        with self.lock:
            self.conn.send(msg)


def _make_core(init: WorkerInit, model: GPT) -> WorkerCore:
    return PrefillCore(model, init) if init.role == "prefill" else DecodeCore(model, init)


def worker_main(role: str, ctrl: Connection, peer: Connection | None) -> None:
    """Entry point of a worker process (must be a module-level function: "spawn" imports it by name).

    The first message on `ctrl` is the `WorkerInit` (model bytes included). subtle: it is not a Process argument,
    because "spawn" writes the arguments into a pipe that the child drains only after importing torch, so
    `Process.start()` would block for the whole import and the two workers would start one after the other.
    """
    out = _Outbox(ctrl)
    try:
        init = ctrl.recv()
        if not isinstance(init, WorkerInit) or init.role != role:
            raise TypeError(f"{role} worker expected its WorkerInit first, got {type(init).__name__}")
        if init.num_threads > 0:
            torch.set_num_threads(init.num_threads)
        core = _make_core(init, model_from_bytes(init.config, init.weights, init.device))
        stop = threading.Event()
        out.send(Ready(init.role, os.getpid()))

        def beat() -> None:  # a thread, so a long forward pass does not look like a hang
            while not stop.wait(init.heartbeat_s):
                try:
                    out.send(Heartbeat(init.role, time.perf_counter()))
                except (OSError, ValueError):  # the coordinator is gone; the main loop will notice too
                    return

        threading.Thread(target=beat, daemon=True, name=f"{init.role}-heartbeat").start()

        # The prefill worker sends hand-offs from a thread: a multi-MB KV message fills the OS pipe and would
        # block until the decode worker reads it between two of its steps; prefill must not wait for that.
        peer_queue: queue.Queue = queue.Queue()
        if init.role == "prefill" and peer is not None:
            def send_peer() -> None:
                while (msg := peer_queue.get()) is not None:
                    try:
                        peer.send(msg)
                    except (OSError, ValueError):
                        return

            threading.Thread(target=send_peer, daemon=True, name="kv-sender").start()

        # The decode worker reads hand-offs on a thread too: `wait` reports the pipe readable at the first byte,
        # and a recv() in the main loop would then block until the last byte of a multi-MB message arrived,
        # stalling every running decode for as long as the sender takes.
        inbox: queue.Queue = queue.Queue()
        wake_r, wake_w = os.pipe()  # the receiver thread pokes this so the main loop's wait() wakes up
        if init.role == "decode" and peer is not None:
            def recv_peer() -> None:
                while True:
                    try:
                        inbox.put(peer.recv())
                    except (EOFError, OSError):
                        return  # the prefill worker is gone; the coordinator will notice
                    os.write(wake_w, b"x")

            threading.Thread(target=recv_peer, daemon=True, name="kv-receiver").start()

        crash_after: int | None = None
        while True:
            ready = wait([ctrl, wake_r], timeout=0 if core.has_work() else init.heartbeat_s)
            if wake_r in ready:
                os.read(wake_r, 65536)
            while not inbox.empty():  # admit every hand-off that has fully arrived before the next step
                core.handle(inbox.get_nowait())
            while ctrl.poll():
                try:
                    msg = ctrl.recv()
                except EOFError:  # the coordinator is gone: nobody is left to serve
                    return
                if isinstance(msg, Shutdown):
                    # subtle: skip interpreter teardown (seconds, with torch loaded, on a busy CPU): nothing
                    # here needs flushing, and the OS closes the pipes.
                    os._exit(0)
                if isinstance(msg, CrashAfter):
                    crash_after = msg.steps
                    continue
                core.handle(msg)
            if crash_after is not None and crash_after <= 0:
                os._exit(CRASH_EXIT_CODE)  # test hook: die like a segfault would, without cleanup
            if core.has_work():
                for dest, msg in core.step():
                    if dest == "peer":
                        peer_queue.put(msg)
                    else:
                        out.send(msg)
                if crash_after is not None:
                    crash_after -= 1
    except (KeyboardInterrupt, BrokenPipeError, EOFError):
        return
    except BaseException:
        try:
            out.send(WorkerFailed(role, traceback.format_exc()))
        except (OSError, ValueError):
            pass
        raise


# ------------------------------------------------------------------------------------------------- the parent


class WorkerHandle:
    """The coordinator's view of one worker: its process, its control pipe, and when it last spoke."""

    def __init__(self, ctx, init: WorkerInit, peer: Connection | None):
        self.role = init.role
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=worker_main, args=(init.role, child_conn, peer), name=f"minillm-{init.role}-worker", daemon=True
        )
        self.process.start()
        child_conn.close()  # only the child holds its end now, so the child's death reads as EOF here
        self.last_seen = time.monotonic()
        self.pid: int | None = None
        # The init (megabytes of weights) fills the pipe until the child, done importing torch, reads it: send it
        # from a thread so both workers import at once, and so a child that never reads cannot hang us
        # (wait_ready's timeout and the process sentinel decide).
        self._init_thread = threading.Thread(target=self._send_init, args=(init,), daemon=True,
                                             name=f"{init.role}-init")
        self._init_thread.start()

    def _send_init(self, init: WorkerInit) -> None:
        try:
            self.conn.send(init)
        except (OSError, ValueError):
            pass  # the child died before reading; wait_ready reports how

    def describe(self) -> str:
        code = self.process.exitcode
        if code is None:
            return f"{self.role} worker (pid {self.process.pid}) is alive"
        if code == CRASH_EXIT_CODE:
            return f"{self.role} worker (pid {self.process.pid}) exited with code {code} (test hook CrashAfter)"
        if code < 0:
            return f"{self.role} worker (pid {self.process.pid}) was killed by signal {-code}"
        return f"{self.role} worker (pid {self.process.pid}) exited with code {code}"

    def send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError) as exc:
            raise WorkerDiedError(f"cannot reach the {self.describe()}: {exc}") from exc

    def request_stop(self) -> None:
        """Ask politely (a Shutdown message); `stop` makes sure."""
        # subtle: never write while the init thread may still be writing: the two messages would interleave.
        if self.process.is_alive() and not self._init_thread.is_alive():
            try:
                self.conn.send(Shutdown())
            except (OSError, ValueError):
                pass

    def stop(self, timeout: float = 5.0) -> None:
        """Shutdown message, then SIGTERM, then SIGKILL: after this the process is gone, whatever it was doing."""
        if self.process.is_alive():
            self.request_stop()
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self.conn.close()


def wait_ready(handles: list[WorkerHandle], timeout: float) -> None:
    """Block until every worker said Ready; a worker that fails to start raises WorkerDiedError with its traceback."""
    deadline = time.monotonic() + timeout
    pending = {h.role: h for h in handles}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerDiedError(f"workers {sorted(pending)} not ready after {timeout:.0f} s")
        by_conn = {h.conn: h for h in pending.values()}
        by_sentinel = {h.process.sentinel: h for h in pending.values()}
        for obj in wait(list(by_conn) + list(by_sentinel), timeout=left):
            if obj in by_conn:
                h = by_conn[obj]
                try:
                    msg = h.conn.recv()
                except EOFError:
                    h.process.join(1.0)
                    raise WorkerDiedError(f"{h.describe()} before it was ready") from None
                if isinstance(msg, WorkerFailed):
                    raise WorkerDiedError(f"{h.role} worker failed to start:\n{msg.traceback}")
                if isinstance(msg, Ready):
                    h.pid = msg.pid
                    h.last_seen = time.monotonic()
                    pending.pop(h.role, None)
            elif by_sentinel[obj].role in pending and not by_sentinel[obj].conn.poll():
                h = by_sentinel[obj]
                h.process.join(1.0)
                raise WorkerDiedError(f"{h.describe()} before it was ready")
