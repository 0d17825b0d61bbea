"""The process layer: start a worker process, run its loop, watch it, and stop it for sure, whatever its role.

Adds what a second process needs that a function call does not: a ready handshake, a heartbeat thread, a death
detector (the process sentinel), a test hook that kills the worker, clear errors (`WorkerDiedError` naming the
worker and how it ended) and a shutdown that escalates from a polite message to SIGTERM to SIGKILL. Chapter 07's
prefill and decode workers run on it, and so do chapter 14's ranks: a role is a `setup` function that builds its
`WorkerCore` from the init message, and nothing here knows what the core does. The model crosses inside the
init message as safetensors bytes (`minillm.core.formats`), never as pickled code. What it leaves out:
restarting a dead worker (the parent fails the work it held instead) and any transport but OS pipes.

The loop every worker runs (`worker_main`):

    init = first message on ctrl;  core, routes = setup(init, inbox, *args);  send Ready
    while True:
        wait for ctrl or the inbox (block up to heartbeat_s when there is no work)
        inbox messages (from the role's own threads, e.g. a peer pipe's reader) -> core.handle(msg)
        ctrl messages: Shutdown -> exit;  CrashAfter -> arm the test hook;  anything else -> core.handle(msg)
        if core.has_work(): for (dest, msg) in core.step(): "ctrl" -> the parent, else routes[dest](msg)

The parent side: `WorkerHandle` starts one (and sends its init from a thread), `wait_ready` waits for the
handshake, `receive` collects messages and says which worker died, raised or fell silent.

Why "spawn": a forked child inherits the parent's threads and locks (torch's OpenMP pool among them) in whatever
state they were, and can deadlock; a spawned child starts a fresh interpreter and imports what it needs.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import torch

from minillm.core.config import MAX_TIMEOUT_S, check_bool, check_float, check_int, check_timeout, short_repr

# Exit code of a worker that `CrashAfter` made die on purpose (tests use it to tell a planned death from a bug).
CRASH_EXIT_CODE = 17


class WorkerDiedError(RuntimeError):
    """A worker process died, hung or raised; the work it held cannot finish."""


# ------------------------------------------------------------------------------------------------- messages


@dataclass
class Ready:
    role: str
    pid: int


@dataclass
class Heartbeat:
    role: str
    time: float  # time.perf_counter() in the worker (CLOCK_MONOTONIC on Linux: one clock for every process)


@dataclass
class Shutdown:
    """Exit at the next loop turn, without interpreter teardown (os._exit): whatever a role still had queued for
    its own threads (a prefill worker's unsent hand-offs) is dropped; the parent stops a worker only when it no
    longer needs its work."""


@dataclass
class CrashAfter:
    """Test hook: die with os._exit(CRASH_EXIT_CODE) after this many more steps (0 = at the next loop turn)."""

    steps: int


@dataclass
class WorkerFailed:
    """A worker raised: the parent fails the work it held with this traceback."""

    role: str
    traceback: str


class WorkerInitLike(Protocol):
    """What the loop reads off a role's init message (chapter 07's `WorkerInit` is one)."""

    role: str  # the worker's name ("prefill", "decode", "rank1", ...)
    heartbeat_s: float  # how often it says it is alive
    num_threads: int  # torch intra-op threads in it (0 = leave torch's default)


class WorkerCore(Protocol):
    """A role's work. `step()` returns (destination, message) pairs: "ctrl" (the parent) or a name in `routes`."""

    def handle(self, msg: Any) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[tuple[str, Any]]: ...


# A role's setup: (init, inbox, *extra args given to WorkerHandle) -> (core, {destination: send function})
Setup = Callable[..., tuple[WorkerCore, dict[str, Callable[[Any], None]]]]


def check_worker_init(init: Any) -> None:
    """`init` a role's init message (`WorkerInitLike`): a non-empty str `role`, a positive `heartbeat_s` and an int
    `num_threads` >= 0; a TypeError / ValueError naming the field, here, not in a child process that would die of
    it before it could say so."""
    role = getattr(init, "role", None)
    if not isinstance(role, str) or not role:
        raise TypeError(f"init must be a role's init message with a str role (WorkerInitLike), got "
                        f"{type(init).__name__} {short_repr(init)}")
    check_float("init.heartbeat_s", getattr(init, "heartbeat_s", None), 0.0, include_minimum=False)
    check_int("init.num_threads", getattr(init, "num_threads", None), 0)


def check_setup(setup: Any) -> None:
    """A role's setup function (module-level: a spawned child imports it by name)."""
    if not callable(setup):
        raise TypeError(f"setup must be a role's setup function, got {type(setup).__name__} {short_repr(setup)}")


def check_handles(handles: Any) -> list[WorkerHandle]:
    """`handles` a list (or tuple) of WorkerHandles; a TypeError naming the first entry that is not one."""
    if not isinstance(handles, (list, tuple)):
        raise TypeError(f"handles must be a list of WorkerHandles, got {type(handles).__name__} {short_repr(handles)}")
    for i, h in enumerate(handles):
        if not isinstance(h, WorkerHandle):
            raise TypeError(f"handles[{i}] must be a WorkerHandle, got {type(h).__name__} {short_repr(h)}")
    return handles  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------- the child


class _Outbox:
    """Sends to one connection from several threads (main loop + heartbeat), one message at a time."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: Any) -> None:
        with self.lock:
            self.conn.send(msg)


class Inbox:
    """Messages a role's own threads receive (a peer pipe's reader): queued here, and the main loop woken.

    subtle: a reader thread, not the main loop, calls the peer pipe's recv(): `wait` reports a pipe readable at
    its first byte, and a recv() in the main loop would then block until the last byte of a multi-MB message
    arrived, stalling every step for as long as the sender takes."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self.fd, self._wake = os.pipe()  # the main loop waits on fd; put() writes a byte to wake it
        os.set_blocking(self.fd, False)

    def put(self, msg: Any) -> None:
        self._queue.put(msg)
        os.write(self._wake, b"x")

    def drain(self) -> list[Any]:
        """Every message that has fully arrived, in order (never blocks)."""
        try:
            os.read(self.fd, 65536)
        except BlockingIOError:
            pass
        got = []
        while True:
            try:
                got.append(self._queue.get_nowait())
            except queue.Empty:
                return got


def worker_main(role: str, ctrl: Connection, setup: Setup, *args: Any) -> None:
    """Entry point of a worker process (module-level, like `setup`: "spawn" imports both by name).

    The first message on `ctrl` is the init. subtle: it is not a Process argument, because "spawn" writes the
    arguments into a pipe that the child drains only after importing torch, so `Process.start()` would block for
    the whole import and several workers would start one after the other.
    """
    if not isinstance(role, str):
        raise TypeError(f"role must be the worker's name (a str), got {type(role).__name__} {short_repr(role)}")
    if not isinstance(ctrl, Connection):
        raise TypeError(f"ctrl must be the worker's end of its control Pipe (a Connection), got {type(ctrl).__name__}")
    check_setup(setup)
    out = _Outbox(ctrl)
    try:
        try:
            init = ctrl.recv()
        except EOFError:  # the parent went away before sending the init: nothing to do
            return
        if getattr(init, "role", None) != role:
            raise TypeError(f"{role} worker expected its init message first, got {type(init).__name__}")
        if init.num_threads > 0:
            torch.set_num_threads(init.num_threads)
        inbox = Inbox()
        core, routes = setup(init, inbox, *args)
        stop = threading.Event()
        out.send(Ready(role, os.getpid()))

        def beat() -> None:  # a thread, so a long forward pass does not look like a hang
            while not stop.wait(init.heartbeat_s):
                try:
                    out.send(Heartbeat(role, time.perf_counter()))
                except (OSError, ValueError):  # the parent is gone; the main loop will notice too
                    return

        threading.Thread(target=beat, daemon=True, name=f"{role}-heartbeat").start()
        crash_after: int | None = None
        while True:
            wait([ctrl, inbox.fd], timeout=0 if core.has_work() else init.heartbeat_s)
            for msg in inbox.drain():  # admit everything that has fully arrived before the next step
                core.handle(msg)
            while ctrl.poll():
                try:
                    msg = ctrl.recv()
                except EOFError:  # the parent is gone: nobody is left to serve
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
                    out.send(msg) if dest == "ctrl" else routes[dest](msg)
                if crash_after is not None:
                    crash_after -= 1
    except KeyboardInterrupt:
        return
    except BaseException:  # a role's setup or step failed (a closed peer pipe included): tell the parent
        try:
            out.send(WorkerFailed(role, traceback.format_exc()))
        except (OSError, ValueError):
            return  # the parent is gone too: nobody is left to tell
        sys.exit(1)  # the parent has the traceback and reports it; printing it here as well would repeat it


# ------------------------------------------------------------------------------------------------- the parent


class WorkerHandle:
    """The parent's view of one worker: its process, its control pipe, and when it last spoke.

    `setup` and `args` go to `worker_main` in the child (module-level function, picklable arguments such as pipe
    ends); `init` is sent as the first message, from a thread. A daemonic worker is killed when the parent exits
    but may not start processes of its own; `daemon=False` allows that, and then the parent must `stop` it."""

    def __init__(self, ctx, init: WorkerInitLike, setup: Setup, *args: Any, daemon: bool = True):
        if not all(callable(getattr(ctx, name, None)) for name in ("Pipe", "Process")):
            raise TypeError(f"ctx must be a multiprocessing context (multiprocessing.get_context('spawn')), got "
                            f"{type(ctx).__name__} {short_repr(ctx)}")
        check_worker_init(init)
        check_setup(setup)
        daemon = check_bool("daemon", daemon)
        self.role = init.role
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_main, args=(init.role, child_conn, setup, *args),
                                   name=f"minillm-{init.role}-worker", daemon=daemon)
        self.process.start()
        child_conn.close()  # only the child holds its end now, so the child's death reads as EOF here
        self.last_seen = time.monotonic()
        self.pid: int | None = None
        # The init (megabytes of weights) fills the pipe until the child, done importing torch, reads it: send it
        # from a thread so every worker imports at once, and so a child that never reads cannot hang us
        # (wait_ready's timeout and the process sentinel decide).
        self._init_thread = threading.Thread(target=self._send_init, args=(init,), daemon=True,
                                             name=f"{init.role}-init")
        self._init_thread.start()

    def _send_init(self, init: Any) -> None:
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
        timeout = check_float("timeout", timeout, 0.0, MAX_TIMEOUT_S)
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


def stop_all(handles: list[WorkerHandle]) -> None:
    """Stop every worker for sure, asking all first so they exit in parallel (module-level, so a
    `weakref.finalize` that calls it holds no reference to its owner)."""
    for h in check_handles(handles):
        h.request_stop()
    for h in handles:
        h.stop()


def wait_ready(handles: list[WorkerHandle], timeout: float) -> None:
    """Block until every worker said Ready; a worker that fails to start raises WorkerDiedError with its traceback."""
    check_handles(handles)
    timeout = check_timeout(timeout)
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


def receive(handles: list[WorkerHandle], timeout: float, liveness_timeout_s: float,
            failures: dict[str, str] | None = None) -> tuple[list[tuple[WorkerHandle, Any]], str | None]:
    """Wait up to `timeout` s for any worker to speak; (every message received, in order per worker, what failed).

    Heartbeats are consumed here (they only move `last_seen`). The failure is None while every worker is fine,
    else a sentence per worker that died (its sentinel fired), raised (WorkerFailed: messages it sent before are
    still returned) or sent nothing, not even a heartbeat, for `liveness_timeout_s`, joined by blank lines.
    `failures` (role -> sentence) carries what earlier calls found, so a worker's traceback is not replaced by
    "exited with code 1" once its process is gone."""
    check_handles(handles)
    timeout = check_float("timeout", timeout, 0.0, MAX_TIMEOUT_S)  # 0: only what has arrived already
    liveness_timeout_s = check_float("liveness_timeout_s", liveness_timeout_s, 0.0, include_minimum=False)
    if failures is not None and not isinstance(failures, dict):
        raise TypeError(f"failures must be a dict (role -> what happened) or None, got {type(failures).__name__}")
    wait([h.conn for h in handles] + [h.process.sentinel for h in handles], timeout=timeout)
    got: list[tuple[WorkerHandle, Any]] = []
    failures = {} if failures is None else failures  # role -> what happened to it (the first account kept)
    for h in handles:
        while True:
            try:
                if not h.conn.poll():
                    break
                msg = h.conn.recv()
            except (EOFError, OSError):
                break  # the process is gone; its sentinel says how, below
            h.last_seen = time.monotonic()
            if isinstance(msg, WorkerFailed):
                failures.setdefault(h.role, f"the {msg.role} worker raised:\n{msg.traceback}")
                break
            if not isinstance(msg, Heartbeat):
                got.append((h, msg))
    for h in handles:
        if h.role in failures:
            continue
        if not h.process.is_alive():
            h.process.join(1.0)
            failures[h.role] = f"the {h.describe()}"
        elif time.monotonic() - h.last_seen > liveness_timeout_s:
            failures[h.role] = (f"the {h.role} worker (pid {h.process.pid}) sent nothing, not even a heartbeat, for "
                                f"{time.monotonic() - h.last_seen:.1f} s (liveness_timeout_s={liveness_timeout_s}): "
                                "it looks hung")
    return got, "\n\n".join(failures.values()) or None
