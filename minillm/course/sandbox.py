"""The grading child's jail, on Linux: run a command where the reference, the network and the rest of the machine's
processes are out of reach, and where nothing it starts outlives it.

`minillm.course.grading` runs this file as a script inside `unshare --mount --net --pid --fork --kill-child`
(plus `--user --map-root-user` when the grader is not root), never imports it, and it imports nothing from minillm:

    python -I sandbox.py SPEC_JSON -- COMMAND...

SPEC_JSON names what to hide and what to keep:

    {"hide": [paths],      each replaced by an empty read-only tmpfs (the reference repository, the student's
                           original folder)
     "scratch": [paths],   each replaced by an empty writable tmpfs (the home directory: caches land there and vanish)
     "keep": [paths],      paths inside a hidden one that the command needs (the Python environment, the shipped
                           checkpoints), bound back read-only at the same place
     "keep_rw": [paths],   the same, bound back writable (the grading work folder)
     "drop_to": uid|null}  a user to become before the command runs (real root only: "nobody")

What each namespace gives: the mount namespace hides the paths from this process tree only; the network namespace
has a loopback (brought up here, for tests that serve on 127.0.0.1) and no route out; the PID namespace makes
this tree's first process its init, and the kernel kills every process in it when that one ends, so a daemon
started with `setsid` dies with the grading child instead of rewriting the grade afterwards. Two ways keep the
command from undoing the mounts: as real root it runs as another user (no capabilities); in a user namespace it
runs in a second, nested one, where the mounts made here are locked together and cannot be unmounted
(mount_namespaces(7), "restrictions on mount namespaces").
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import shutil
import subprocess
import sys
import tempfile

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, stdin=subprocess.DEVNULL)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, req)[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def jail(spec: dict) -> None:
    """Apply `spec` to this (namespaced, privileged) process; the caller then execs the command."""
    hide = [os.path.realpath(p) for p in spec.get("hide", []) if os.path.isdir(p)]
    scratch = [os.path.realpath(p) for p in spec.get("scratch", []) if os.path.isdir(p)]
    covered = hide + scratch
    keep = [(os.path.realpath(p), ro) for key, ro in (("keep", True), ("keep_rw", False))
            for p in spec.get(key, []) if os.path.exists(p)]
    keep = [(k, ro) for k, ro in keep if any(_inside(k, c) for c in covered)]
    _mount("--make-rprivate", "/")
    staging = tempfile.mkdtemp(prefix="minillm-jail-", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    staged = []
    for i, (path, ro) in enumerate(keep):  # park what must stay visible before its parent is covered
        parked = os.path.join(staging, str(i))
        os.makedirs(parked) if os.path.isdir(path) else open(parked, "w").close()
        _mount("--rbind", path, parked)
        staged.append((path, parked, ro))
    for path in hide:
        _mount("-t", "tmpfs", "-o", "size=1m,mode=755", "tmpfs", path)
    for path in scratch:
        _mount("-t", "tmpfs", "-o", "size=256m,mode=1777", "tmpfs", path)
    for path, parked, ro in staged:  # mount points for the kept paths, then the hidden covers turn read-only
        if os.path.isdir(parked):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "a").close()
        _mount("--move", parked, path)
        if ro:
            _mount("-o", "remount,bind,ro", path)
    shutil.rmtree(staging, ignore_errors=True)  # the parked mount points, empty now
    for path in hide:
        _mount("-o", "remount,ro", path)
    _loopback_up()


def main(argv: list[str]) -> int:
    spec_json, sep, *command = argv
    if sep != "--" or not command:
        raise SystemExit("usage: sandbox.py SPEC_JSON -- COMMAND...")
    spec = json.loads(spec_json)
    jail(spec)
    for fd in spec.get("pass_fds", []):
        os.set_inheritable(fd, True)
    uid = spec.get("drop_to")
    if uid is not None:  # real root: become a user without capabilities, who cannot undo the mounts
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:  # a user namespace: a nested one, whose mount namespace holds the mounts above locked
        command = ["unshare", "--user", "--map-root-user", "--mount", "--", *command]
    os.execvp(command[0], command)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
