"""Building the kernels: JIT-compile csrc/ into torch.ops.minillm_kernels once, and compile each kernel alone.

It adds `load_kernels()`, which builds the extension for the running GPU's architecture only (a short build) into a
cache directory and loads it, once per process; and `compile_sources_with_nvcc(arch, out_dir)`, which compiles each
kernel .cu file by itself with `nvcc -Xptxas -v` and reads the registers and spills of every kernel from ptxas's
report. The kernel files include no torch header, so the second runs wherever nvcc does, GPU or not.
What it leaves out: ahead-of-time wheels (setup.py / CUDAExtension); a JIT build is enough for a course.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import fcntl  # POSIX file locks (build_lock)
except ImportError:  # Windows
    fcntl = None

from minillm.core.config import check_bool, check_label, check_threads, check_timeout, short_repr
from minillm.core.io import check_output_dir, check_path

CSRC = Path(__file__).resolve().parent / "csrc"
BINDINGS = CSRC / "bindings.cpp"
# Each kernel file and the __global__ functions it must define (the compile test checks ptxas saw every one).
KERNELS: dict[str, tuple[str, ...]] = {
    "softmax.cu": ("softmax_v1_kernel", "softmax_v2_kernel", "softmax_v3_kernel", "softmax_v4_kernel"),
    "layernorm.cu": ("layernorm_v1_kernel", "layernorm_v2_kernel", "layernorm_v3_kernel", "layernorm_v4_kernel"),
    "bias_gelu.cu": ("bias_gelu_v1_kernel", "bias_gelu_v2_kernel", "bias_gelu_tail_kernel"),
    "attention.cu": ("attention_v1_kernel", "attention_v2_kernel", "attention_v3_kernel",
                     "attention_v4_kernel"),
    "paged_attention.cu": ("paged_attention_v1_kernel", "paged_attention_v2_kernel"),
    "int8_gemv.cu": ("int8_gemv_v1_kernel", "int8_gemv_v2_kernel", "int8_gemv_v3_kernel"),
    "kv_write.cu": ("kv_write_v1_kernel",),
}
KERNEL_SOURCES: tuple[Path, ...] = tuple(CSRC / name for name in KERNELS)
# The defines torch.utils.cpp_extension passes to nvcc, so the standalone compile sees what the JIT build sees.
TORCH_NVCC_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr")

_lock = threading.Lock()
_loaded = False


def cache_dir() -> Path:
    """Where builds go: $MINILLM_KERNELS_CACHE, else $XDG_CACHE_HOME/minillm/kernels (~/.cache by default)."""
    if os.environ.get("MINILLM_KERNELS_CACHE"):
        path = Path(os.environ["MINILLM_KERNELS_CACHE"])
        blocked = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocked is not None or (path.is_symlink() and not path.exists()):  # pathlib's errors name no variable
            raise ValueError(f"MINILLM_KERNELS_CACHE={str(path)!r} is not a folder (a file, a broken link, or under "
                             "a file): point it at a folder for the compiled kernels (it is made if missing)")
        return path
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "minillm" / "kernels"


@contextlib.contextmanager
def build_lock(build_dir: Path, name: str | None = None) -> Iterator[None]:
    """Hold an OS lock on `build_dir` around one `torch.utils.cpp_extension.load` into it (waiting while another live
    process builds there), and clear a baton left by a dead build first. When the load of extension `name` fails or
    is interrupted, this process's record of it is dropped, so the next load builds again (`forget_build`).

    subtle: torch's loader marks a build in progress with a file named `lock` in the build directory, and every
    other loader waits, with no message and no time limit, until that file is gone. A build killed by a signal (a
    timeout, SIGTERM, a closed terminal) never removes it, so every later import would hang. minillm's loaders take
    an flock on `minillm.lock` first, which the OS drops when its holder dies: a `lock` file found while holding it
    was left by a build that died, and is removed. Where there is no flock (Windows, a file system that refuses
    it), torch's baton alone guards the build, as before."""
    build_dir = check_path(build_dir, "build_dir")
    if name is not None:
        name = check_label("name", name)
    with _forgetting_on_failure(name), _locked(build_dir):
        yield


@contextlib.contextmanager
def _forgetting_on_failure(name: str | None) -> Iterator[None]:
    try:
        yield
    except BaseException:  # KeyboardInterrupt too: a notebook's interrupt during the minute-long first build
        if name is not None:
            forget_build(name)
        raise


def forget_build(name: str) -> None:
    """Drop this process's record of building extension `name`, so the next `load` of it builds again.

    subtle: torch's loader records each extension's source hash per process before it builds, and a later load with
    the same sources skips the build ("no modifications detected") and imports the library. After a build that
    failed or was interrupted (Ctrl-C in a notebook) there is no library: every retry in that process would fail
    with "cannot open shared object file", naming a path, until the kernel restarts."""
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

    if not isinstance(name, str):
        raise TypeError(f"name must be an extension's name (a str), got {type(name).__name__} {short_repr(name)}")
    JIT_EXTENSION_VERSIONER.entries.pop(str.__str__(name), None)


_HELD = threading.local()  # the build folders this thread holds `build_lock` on


@contextlib.contextmanager
def _locked(build_dir: Path) -> Iterator[None]:
    """`build_lock`'s flock on `build_dir`, clearing a dead build's baton. Re-entrant within a thread: a nested
    `build_lock` on a folder this thread holds goes straight in (a second flock through another open file would wait
    for this thread itself, forever); another thread waits as another process does."""
    held = _HELD.__dict__.setdefault("dirs", set())
    key = os.path.realpath(build_dir)
    if fcntl is None or key in held:  # Windows, or this thread holds it already
        yield
        return
    held.add(key)
    try:
        with _flocked(build_dir):
            yield
    finally:
        held.discard(key)


@contextlib.contextmanager
def _flocked(build_dir: Path) -> Iterator[None]:
    """The flock itself (see `_locked`)."""
    with open(build_dir / "minillm.lock", "a") as held:
        try:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another live process is building here: say so, then wait for it
                print(f"waiting for another process's build in {build_dir}", file=sys.stderr, flush=True)
                fcntl.flock(held, fcntl.LOCK_EX)  # released by the OS if that process dies
        except OSError:  # no flock on this file system (some network mounts): torch's baton alone
            yield
            return
        try:
            (build_dir / "lock").unlink(missing_ok=True)  # a dead build's baton: no live minillm build holds it
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def find_cuda_home() -> Path | None:
    """The CUDA toolkit's root: the first of $CUDA_HOME, $CUDA_PATH, nvcc's grandparent, /usr/local/cuda and
    /usr/local/cuda-* (newest first) that holds include/cuda_runtime.h and bin/nvcc.

    subtle: the nvcc on the PATH may be a wrapper script (/usr/local/bin/nvcc running
    /usr/local/cuda-13.0/bin/nvcc); its grandparent /usr/local holds no CUDA headers, yet it is torch's own guess.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    on_path = shutil.which("nvcc")
    if on_path:
        candidates += [str(Path(on_path).resolve().parent.parent), str(Path(on_path).parent.parent)]
    candidates += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime.h").is_file() and (Path(c) / "bin" / "nvcc").is_file():
            return Path(c)
    return None


def find_nvcc() -> str | None:
    """nvcc on the PATH, else the toolkit's (`find_cuda_home`)."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = find_cuda_home()
    return str(home / "bin" / "nvcc") if home is not None else None


def load_kernels(verbose: bool = False):
    """Build (first call; cached on disk afterwards) and load the extension; return `torch.ops.minillm_kernels`.

    Raises RuntimeError saying what is missing when there is no CUDA device, no CUDA build of torch, or no nvcc.
    The build targets the current device's compute capability only (TORCH_CUDA_ARCH_LIST for the call), so one
    build took 26 s on a 16-core H200 machine; torch's loader rebuilds by itself when a source file changes.
    """
    global _loaded
    verbose = check_bool("verbose", verbose)
    with _lock:
        if _loaded:
            return torch.ops.minillm_kernels
        if torch.version.cuda is None:
            raise RuntimeError(f"the chapter 12 kernels need a CUDA build of torch; this one is {torch.__version__} "
                               "(CPU only). The CPU mirrors in minillm.kernels.mirror run anywhere.")
        if not torch.cuda.is_available():
            raise RuntimeError("the chapter 12 kernels need a CUDA GPU: torch.cuda.is_available() is False")
        cuda_home = find_cuda_home()
        if cuda_home is None:
            raise RuntimeError("the chapter 12 kernels are compiled on first use and need the CUDA toolkit (nvcc and "
                               "its headers): none found on the PATH, under $CUDA_HOME or in /usr/local/cuda*; install "
                               f"the one matching torch.version.cuda={torch.version.cuda}")
        from torch.utils import cpp_extension  # torch's own submodule: heavy, needed only when building

        torch_home = cpp_extension.CUDA_HOME
        if torch_home is None or not (Path(torch_home) / "include" / "cuda_runtime.h").is_file():
            # subtle: torch guessed a directory without CUDA headers (see find_cuda_home); its build reads this
            # module attribute each time it needs a CUDA path, so pointing it at the real toolkit fixes the build.
            cpp_extension.CUDA_HOME = str(cuda_home)

        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}.{minor}"
        tag = f"torch-{torch.__version__}-cuda-{torch.version.cuda}-sm{major}{minor}".replace("+", "_")
        build_dir = cache_dir() / tag
        build_dir.mkdir(parents=True, exist_ok=True)
        previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # subtle: read by the build, so set only around the call
        try:
            with build_lock(build_dir, "minillm_kernels"):  # a killed build's baton is cleared, not waited on forever
                cpp_extension.load(
                    name="minillm_kernels",
                    sources=[str(p) for p in (*KERNEL_SOURCES, BINDINGS)],
                    extra_cflags=["-O2"],
                    extra_cuda_cflags=["-O3", "-lineinfo"],
                    build_directory=str(build_dir),
                    verbose=verbose,
                    with_cuda=True,
                    is_python_module=False,  # TORCH_LIBRARY registers the ops; the .so is loaded into torch.ops
                )
        finally:
            if previous is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = previous
        _loaded = True
        return torch.ops.minillm_kernels


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel instantiation compiled for one architecture."""

    source: str  # "softmax.cu"
    arch: str  # "sm_90"
    kernel: str  # the mangled name, e.g. _ZN7minillm17softmax_v1_kernelIfEEvPKT_PS2_ll
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_frame: int  # bytes


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+a?)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(source: str, text: str) -> list[KernelResources]:
    """KernelResources for every entry function in a `-Xptxas -v` report `text` (a str: a TypeError naming it
    otherwise), one entry per kernel and arch; `source` (a label) names the file each entry came from."""
    source = check_label("source", source)
    if not isinstance(text, str):
        raise TypeError(f"text must be the report as a str, got {type(text).__name__} {short_repr(text)}")
    found: list[KernelResources] = []
    kernel = arch = None
    props: tuple[int, int, int] | None = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            kernel, arch, props = m.group(1), m.group(2), None
        elif (m := _PROPS.search(line)) and kernel is not None:
            props = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _REGS.search(line)) and kernel is not None and arch is not None:
            stack, stores, loads = props if props is not None else (0, 0, 0)
            found.append(KernelResources(source, arch, kernel, int(m.group(1)), stores, loads, stack))
            kernel = arch = None
    return found


def _arch_list(arch: str | Sequence[str]) -> list[str]:
    if not isinstance(arch, (str, list, tuple)):
        raise TypeError(f"arch must be an architecture like 'sm_90', or a list of them, got {type(arch).__name__} "
                        f"{arch!r}")
    archs = [arch] if isinstance(arch, str) else list(arch)
    for a in archs:
        if not isinstance(a, str) or not re.fullmatch(r"sm_\d{2,3}a?", a):
            raise ValueError(f"arch must look like 'sm_90', got {short_repr(a)}")
    if not archs:
        raise ValueError("arch names no architecture")
    return archs


def check_command(cmd: object, name: str = "cmd") -> list[str]:
    """`cmd` as a list of str, the arguments of one process (run without a shell); a TypeError naming `name`
    otherwise. subtle: a string would be taken as the program's name, spaces and all ("echo hi" is no program),
    and a list of one string per character by `list(cmd)`."""
    if not isinstance(cmd, (list, tuple)) or not cmd or not all(isinstance(a, (str, os.PathLike)) for a in cmd):
        raise TypeError(f"{name} must be a non-empty list of str arguments, e.g. ['g++', '-c', 'a.cpp'], got "
                        f"{type(cmd).__name__} {short_repr(cmd)}")
    args = [os.fspath(a) for a in cmd]
    for i, arg in enumerate(args):  # the OS takes C strings: subprocess's "embedded null byte" names no argument
        if "\0" in (arg if isinstance(arg, str) else arg.decode("latin-1")):
            raise ValueError(f"{name}[{i}] holds a NUL character, which no program argument can: {short_repr(arg)}")
    return args


def check_build_args(out_dir: object, jobs: object, timeout: object) -> tuple[Path, int | None, float]:
    """out_dir as a Path, after checking what every build here takes: out_dir a folder path (not '', the current
    folder by accident; not a file, nor under one), jobs None or a positive int (at most 4 per core), timeout
    positive seconds. A TypeError / ValueError naming the argument, before anything is compiled. Returns (the
    folder, jobs, timeout), the numbers as the plain int / float they hold."""
    if isinstance(out_dir, str) and str.__str__(out_dir) == "":  # a numpy array's == is no bool
        raise ValueError("out_dir must name a folder, got ''")
    out = check_path(out_dir, "out_dir")
    check_output_dir(out, "out_dir")
    if jobs is not None:
        jobs = check_threads("jobs", jobs)  # compile threads: at most 4 per core, as for torch's own threads
    timeout = check_timeout(timeout)
    return out, jobs, timeout


def run_program(cmd: list[str], what: str, timeout: float | None = None, cwd: str | os.PathLike | None = None
                ) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd), or a RuntimeError naming
    `what` and the program when it cannot be started at all (no such program, not executable): subprocess's
    FileNotFoundError names neither. The arguments are checked first: cmd by `check_command` (a non-empty list of
    str without NUL characters), what a str, timeout None or positive seconds (`check_timeout`: 2**40 s would be
    subprocess's OverflowError), cwd None or an existing folder; a TypeError / ValueError naming the argument
    otherwise."""
    cmd = check_command(cmd)
    what = check_label("what", what)
    if timeout is not None:
        timeout = check_timeout(timeout)
    if cwd is not None:
        cwd = check_path(cwd, "cwd")
        if not cwd.is_dir():
            raise ValueError(f"cwd {str(cwd)!r} is not a folder: the program would have nowhere to run")
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except OSError as e:
        raise RuntimeError(f"{what}: cannot start the program {cmd[0]!r} ({e.strerror or e})") from e


def run_compiler(cmd: Sequence[str], what: str, timeout: float) -> str:
    """Run a compiler command; return its stdout + stderr, or raise RuntimeError naming `what` with the command
    and the compiler's output (its last 6,000 characters) when it fails, cannot start, or runs past `timeout`
    seconds (positive: a ValueError naming it otherwise)."""
    cmd = check_command(cmd)
    timeout = check_timeout(timeout)
    try:
        proc = run_program(cmd, what, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{what} ran past its timeout={timeout} s and was stopped:\n{' '.join(cmd)}") from e
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{' '.join(cmd)}\n{output[-6000:]}")
    return output


def compile_sources_with_nvcc(
    arch: str | Sequence[str],
    out_dir: str | Path,
    sources: Sequence[Path] = KERNEL_SOURCES,
    jobs: int | None = None,
    timeout: float = 300.0,
) -> list[KernelResources]:
    """Compile each kernel file by itself (`nvcc -c -Xptxas -v`) for `arch` ("sm_90" or several) into out_dir.

    The files are compiled in `jobs` threads (nvcc is a separate process). Returns every kernel's registers and
    spills; raises RuntimeError with nvcc's output when a file does not compile, and when nvcc is missing. The
    arguments are checked first: a TypeError / ValueError naming the bad one (FileNotFoundError for a source that
    is not there), before nvcc is looked for.
    """
    archs = _arch_list(arch)
    out, jobs, timeout = check_build_args(out_dir, jobs, timeout)
    if not isinstance(sources, (list, tuple)):
        raise TypeError(f"sources must be a list of .cu file paths, got {type(sources).__name__} {short_repr(sources)}")
    sources = [check_path(src, f"sources[{i}]") for i, src in enumerate(sources)]
    for i, src in enumerate(sources):
        if not src.is_file():
            raise FileNotFoundError(f"sources[{i}] {str(src)!r}: no such file")
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc is not on the PATH (nor under CUDA_HOME): cannot compile the kernels")
    out.mkdir(parents=True, exist_ok=True)
    gencode = [f"-gencode=arch=compute_{a[3:].rstrip('a')},code={a}" for a in archs]

    def one(src: Path) -> list[KernelResources]:
        cmd = [nvcc, "-c", "-std=c++17", "-O3", *TORCH_NVCC_FLAGS, *gencode, "-Xptxas", "-v",
               "-o", str(out / (src.stem + ".o")), str(src)]
        return parse_ptxas(src.name, run_compiler(cmd, f"nvcc on {src.name}", timeout))

    with ThreadPoolExecutor(max_workers=jobs or max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        results = list(pool.map(one, sources))
    return [r for rs in results for r in rs]
