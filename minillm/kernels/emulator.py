"""The chapter 12 kernels' own CUDA C++, run on the CPU: every CUDA thread a fiber, one block at a time.

The mirrors check each kernel's algorithm; this runs the kernel itself. `load()` compiles the .cu files with the
host C++ compiler (g++ or clang++) against the stand-in CUDA headers in `csrc/emu/` (the CUDA keywords as plain
C++, `threadIdx`, `__syncthreads` and `__shfl_xor_sync` as fibers that yield at every barrier, see `emu.h`), after
rewriting the two CUDA-only bits of syntax: `kernel<<<grid, block, smem, stream>>>(args)` becomes a call to
`emu::launch`, and `extern __shared__ T name[]` a pointer to the block's dynamic shared memory. The functions below
take CPU tensors and call the same launchers `bindings.cpp` calls on a GPU, so every version's indexing, tiling,
reductions and barriers run for real, in every dtype. `reverse=True` runs each block's threads in the opposite
order, which is how a missing `__syncthreads` usually shows; `build(sources=...)` compiles changed kernel text
beside the real one, and `lib=` runs it.

    from minillm.kernels import emulator
    y = emulator.softmax(torch.randn(7, 1000), version=4)   # compiles once (about 30 s), then milliseconds

What it leaves out: speed (it is slower than the naive op by orders of magnitude, so keep shapes small), races that
no ordering of the threads shows, and the GPU's memory model.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from minillm.core.config import short_repr
from minillm.core.io import check_path
from minillm.kernels.build import CSRC, KERNEL_SOURCES, cache_dir, check_build_args, run_compiler
from minillm.kernels.ops import (_same, _tensor, _version, check_block_tables, check_eps,  # the wrappers' checks
                                 check_head_size, check_kv_write_args, check_paged_args, check_slot_range)

EMU_DIR = CSRC / "emu"
RUNTIME = EMU_DIR / "emu_runtime.cpp"
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_LAUNCH = re.compile(r"(?P<kernel>[A-Za-z_]\w*(?:<[^<>;()]*>)?)<<<(?P<config>.*?)>>>\((?P<args>.*?)\);", re.DOTALL)
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(?P<type>[\w ]+?)\s+(?P<name>\w+)\s*\[\s*\]\s*;")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def find_cxx() -> str | None:
    """The host C++ compiler: $CXX, else g++, else clang++."""
    found = (shutil.which(name) for name in (os.environ.get("CXX"), "g++", "clang++") if name)
    return next((path for path in found if path), None)


def translate(source: str) -> str:
    """A .cu file's text as host C++ for the emulator: launches become emu::launch calls, and the dynamic shared
    memory declaration a pointer into the block's buffer. Everything else compiles as it is."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a .cu file's text (a str), got {type(source).__name__} {short_repr(source)}")
    def launch(m: re.Match) -> str:
        return f"::emu::launch(::emu::LaunchConfig({m['config']}), &{m['kernel']}, {m['args']});"

    def extern_shared(m: re.Match) -> str:
        return f"{m['type']}* {m['name']} = reinterpret_cast<{m['type']}*>(::emu::dynamic_shared_memory());"

    text = _EXTERN_SHARED.sub(extern_shared, source)
    text = _LAUNCH.sub(launch, text)
    if "<<<" in text:
        raise ValueError("a kernel launch the emulator cannot rewrite is left: " + text[text.index("<<<") - 80:][:160])
    return text


def _headers_digest(cxx: str) -> hashlib._Hash:
    """A hash of what every unit depends on besides its own text: the compiler, the shared headers, the runtime and
    this file (its translation and flags)."""
    h = hashlib.sha256(cxx.encode())
    for path in (RUNTIME, *sorted(EMU_DIR.glob("*.h")), CSRC / "common.cuh", CSRC / "kernels.h", Path(__file__)):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h


def _sources_digest(cxx: str, texts: dict[str, str]) -> str:
    h = _headers_digest(cxx)
    for name, text in sorted(texts.items()):
        h.update(name.encode())
        h.update(text.encode())
    return h.hexdigest()[:16]


def _unit_digest(cxx: str, name: str, text: str) -> str:
    """One translation unit's object key: its own text and everything it includes."""
    h = _headers_digest(cxx)
    h.update(name.encode())
    h.update(text.encode())
    return h.hexdigest()[:16]


def object_cache() -> Path:
    """Where `build` keeps each unit's object file, keyed by `_unit_digest`: a library that differs from a cached
    one in a single kernel file (a student's softmax.cu) recompiles that file alone and relinks."""
    return cache_dir() / "emulator" / "objects"


def build(out_dir: str | Path | None = None, jobs: int | None = None, timeout: float = 600.0,
          sources: dict[str, str] | None = None) -> Path:
    """Compile the kernels and the emulator runtime into a shared library (cached by the sources' hash, and each
    file's object by its own, so a change to one file recompiles that file alone) and return its path.

    `sources` replaces the text of kernel files by name ({"attention.cu": text}, the text a str: read a file of
    yours with `Path(...).read_text()`), to try a change (or a planted bug) without touching csrc/. out_dir
    (default: the kernels' cache) must be a folder path, jobs None or a positive int, timeout positive seconds:
    a TypeError / ValueError naming the argument before anything compiles. Raises RuntimeError with the
    compiler's output when something does not compile, or when there is no C++ compiler."""
    texts = {src.name: src.read_text() for src in KERNEL_SOURCES}
    if sources is not None and not isinstance(sources, dict):
        raise TypeError(f"sources must be a dict of kernel file name -> its text, e.g. {{'softmax.cu': text}}, got "
                        f"{type(sources).__name__} {short_repr(sources)}")
    for name, text in (sources or {}).items():
        if name not in texts:
            raise ValueError(f"sources may replace {sorted(texts)}, got {name!r}")
        if not isinstance(text, str):
            raise TypeError(f"sources[{name!r}] must be the file's text (a str), got {type(text).__name__} "
                            f"{short_repr(text)}" + ("; read the file first: path.read_text()"
                                              if isinstance(text, os.PathLike) else ""))
    texts.update(sources or {})
    out_dir, jobs, timeout = check_build_args(cache_dir() / "emulator" if out_dir is None else out_dir, jobs, timeout)
    cxx = find_cxx()
    if cxx is None:
        raise RuntimeError("the kernel emulator needs a C++ compiler (g++ or clang++, or set $CXX); none was found")
    lib = out_dir / f"libminillm_kernels_emu_{_sources_digest(cxx, texts)}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    objects_dir = out_dir / "objects"
    objects_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        work = Path(tmp)
        units = {name: translate(text) for name, text in texts.items()}
        units[RUNTIME.name] = RUNTIME.read_text()
        # subtle: _FORTIFY_SOURCE turns _longjmp into a checked jump that aborts when it lands on another stack,
        # which is every jump between fibers.
        flags = ["-std=c++20", "-O2", "-fPIC", "-U_FORTIFY_SOURCE", "-Wno-unknown-pragmas", f"-I{EMU_DIR}",
                 f"-I{CSRC}"]

        def compile_one(name: str) -> Path:
            stem = Path(name).stem
            obj = objects_dir / f"{stem}-{_unit_digest(cxx, name, units[name])}.o"
            if obj.is_file():
                return obj
            unit = work / (stem + ".cpp")
            unit.write_text(units[name])
            run_compiler([cxx, *flags, "-c", str(unit), "-o", str(work / (stem + ".o"))],
                         f"{cxx} on {unit.name} (emulated)", timeout)
            os.replace(work / (stem + ".o"), obj)  # atomic, like the library below
            return obj

        with ThreadPoolExecutor(max_workers=jobs or min(len(units), os.cpu_count() or 1)) as pool:
            objects = list(pool.map(compile_one, units))
        tmp_lib = work / lib.name
        run_compiler([cxx, "-shared", *map(str, objects), "-o", str(tmp_lib)], "linking the kernel emulator", timeout)
        os.replace(tmp_lib, lib)  # atomic: a concurrent build sees the whole library or none
    return lib


def open_library(path: str | Path) -> ctypes.CDLL:
    """Load a library `build` made (the functions below take it as `lib=`). A missing file is a FileNotFoundError
    naming path, a file that is not a loadable library (or not the emulator's) a ValueError naming it: not ctypes'
    OSError, whose message is the dynamic loader's."""
    path = check_path(path, "path")
    if not path.is_file():
        raise FileNotFoundError(f"path {str(path)!r}: no such file (give a library emulator.build() made)")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise ValueError(f"path {str(path)!r} is not a shared library this process can load: {e}") from e
    if not hasattr(lib, "emu_error_string"):
        raise ValueError(f"path {str(path)!r} is not the kernel emulator's library: it has no emu_error_string")
    lib.emu_error_string.restype = ctypes.c_char_p
    return lib


def load() -> ctypes.CDLL:
    """Build (first call; cached on disk afterwards) and load the emulator library of csrc/, once per process."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = open_library(build())
        return _lib


# ------------------------------------------------------------------------------------------------ the kernels
# Every function below checks every argument before any memory is touched, with the same checks (and messages) as
# the CUDA wrappers of `ops`: a kernel indexes raw memory with the sizes it is given, so a pool smaller than the
# slot mapping, a float32 block table or a value tensor of another dtype would read or write past an allocation and
# corrupt this process's heap, where a GPU would at worst fault the kernel.
def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def _cpu(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        # subtle: a negative or conjugate view keeps its sign in a bit, not in memory: the raw pointer misses it
        if (t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous() or t.is_neg()
                or t.is_conj()):
            raise ValueError(f"{name} must be a contiguous CPU tensor for the emulator, got device {t.device}, "
                             f"layout {t.layout}, shape {tuple(t.shape)}" +
                             (f", strides {t.stride()}" if t.layout == torch.strided else ""))


def _code(t: torch.Tensor, name: str) -> int:
    if t.dtype not in DTYPE_CODES:
        raise ValueError(f"{name}: the kernels take float32, float16 or bfloat16, got {t.dtype}")
    return DTYPE_CODES[t.dtype]


def _reverse(reverse) -> int:
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse must be a bool, got {type(reverse).__name__} {reverse!r}")
    return int(reverse)


def _run(name: str, *args, reverse: bool = False, lib: ctypes.CDLL | None = None) -> None:
    """Call the C entry point emu_<name>; a nonzero cudaError_t becomes a RuntimeError naming the op."""
    rev = _reverse(reverse)
    if lib is not None and not isinstance(lib, ctypes.CDLL):
        raise TypeError(f"lib must be None (the emulator `load` builds) or a ctypes.CDLL of it, got "
                        f"{type(lib).__name__} {lib!r}")
    if lib is not None and not hasattr(lib, f"emu_{name}"):
        raise ValueError(f"lib {lib!r} is not the kernel emulator: it has no emu_{name}")
    lib = lib if lib is not None else load()
    with _lock:  # one launch at a time: the emulator's state is global
        lib.emu_set_reverse(rev)
        err = getattr(lib, f"emu_{name}")(*args)
    if err != 0:
        raise RuntimeError(f"minillm_kernels.{name} failed under the emulator: {lib.emu_error_string(err).decode()}")


def _i64(n: int) -> ctypes.c_int64:
    return ctypes.c_int64(int(n))


def _rows(name: str, x: torch.Tensor, what: str = "(rows, cols)") -> torch.Tensor:
    """x a float tensor of 2 dimensions (the emulator takes the launchers' 2-D view; `ops` flattens, this does not)."""
    _tensor(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D {what}, got shape {tuple(x.shape)}")
    return x


def softmax(x: torch.Tensor, version: int, reverse: bool = False, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """softmax.cu's version `version` on x (rows, cols)."""
    _rows("x", x)
    version = _version("softmax", version)
    _cpu(x=x)
    out = torch.full_like(x, float("nan"))
    _run("softmax", version, _code(x, "x"), _ptr(x), _ptr(out), _i64(x.shape[0]), _i64(x.shape[1]), reverse=reverse,
         lib=lib)
    return out


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, version: int, eps: float = 1e-5,
              reverse: bool = False, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """layernorm.cu's version `version` on x (rows, cols), weight and bias (cols,)."""
    _rows("x", x)
    _same("weight", _tensor("weight", weight), "x", x, (x.shape[1],))
    _same("bias", _tensor("bias", bias), "x", x, (x.shape[1],))
    eps = check_eps(eps)  # subtle: ctypes.c_float(1e300) is inf, and the kernel would return the bias for every row
    version = _version("layernorm", version)
    _cpu(x=x, weight=weight, bias=bias)
    out = torch.full_like(x, float("nan"))
    _run("layernorm", version, _code(x, "x"), _ptr(x), _ptr(weight), _ptr(bias), _ptr(out), _i64(x.shape[0]),
         _i64(x.shape[1]), ctypes.c_float(eps), reverse=reverse, lib=lib)
    return out


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, version: int, reverse: bool = False,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """bias_gelu.cu's version `version` on x (rows, cols), bias (cols,)."""
    _rows("x", x)
    _same("bias", _tensor("bias", bias), "x", x, (x.shape[1],))
    version = _version("bias_gelu", version)
    _cpu(x=x, bias=bias)
    out = torch.full_like(x, float("nan"))
    _run("bias_gelu", version, _code(x, "x"), _ptr(x), _ptr(bias), _ptr(out), _i64(x.shape[0]), _i64(x.shape[1]),
         reverse=reverse, lib=lib)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, version: int, reverse: bool = False,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """attention.cu's version `version`, causal, on q, k, v (B, nh, T, hs), hs <= 128."""
    _tensor("q", q, dim=4)
    check_head_size("q", q.shape[-1])
    _same("k", _tensor("k", k, dim=4), "q", q, tuple(q.shape))
    _same("v", _tensor("v", v, dim=4), "q", q, tuple(q.shape))
    version = _version("attention", version)
    _cpu(q=q, k=k, v=v)
    B, nh, T, hs = q.shape
    out = torch.full_like(q, float("nan"))
    _run("attention", version, _code(q, "q"), _ptr(q), _ptr(k), _ptr(v), _ptr(out), _i64(B * nh), _i64(T), _i64(hs),
         reverse=reverse, lib=lib)
    return out


def paged_attention_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, version: int, reverse: bool = False,
                           lib: ctypes.CDLL | None = None, check_indices: bool = False) -> torch.Tensor:
    """paged_attention.cu's version `version` on q (S, nh, hs), pools (nb, bs, nh, hs), int64 block_tables
    (S, max_nb) and context_lens (S,).

    Shapes, dtypes and negative context lengths are always refused. A block id outside the pool, or a context
    longer than its table holds, makes that sequence's output NaN (the kernel's own guard, which the tests pin);
    `check_indices=True` refuses them instead, with a ValueError naming block_tables or context_lens."""
    _tensor("q", q, dim=3)
    S, nh, hs = q.shape
    check_head_size("q", hs)
    check_paged_args(q, k_pool, v_pool, block_tables, context_lens)
    if k_pool.shape[1] < 1:
        raise ValueError(f"k_pool must be (nb, bs>=1, nh={nh}, hs={hs}), got shape {tuple(k_pool.shape)}")
    version = _version("paged_attention_decode", version)
    if not isinstance(check_indices, bool):
        raise TypeError(f"check_indices must be a bool, got {type(check_indices).__name__} {check_indices!r}")
    _cpu(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, context_lens=context_lens)
    nb, bs = k_pool.shape[:2]
    if S and int(context_lens.min()) < 0:
        raise ValueError(f"context_lens must be >= 0, got {context_lens.tolist()}")
    if check_indices:
        check_block_tables(block_tables, context_lens, nb, bs)
    out = torch.full_like(q, float("nan"))
    _run("paged_attention_decode", version, _code(q, "q"), _ptr(q), _ptr(k_pool), _ptr(v_pool), _ptr(block_tables),
         _ptr(context_lens), _ptr(out), _i64(S), _i64(nh), _i64(hs), _i64(nb), _i64(bs),
         _i64(block_tables.shape[1]), reverse=reverse, lib=lib)
    return out


def int8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, version: int,
              reverse: bool = False, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """int8_gemv.cu's version `version`: x (M, K), int8 w (N, K), scale and bias (N,) -> (M, N)."""
    _rows("x", x, "(M, K)")
    _tensor("w", w, dim=2, dtypes=(torch.int8,))
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be (N, K={x.shape[1]}) to match x {tuple(x.shape)}, got {tuple(w.shape)}")
    N = w.shape[0]
    _same("scale", _tensor("scale", scale), "x", x, (N,))
    if bias is not None:
        _same("bias", _tensor("bias", bias), "x", x, (N,))
    version = _version("int8_gemv", version)
    _cpu(x=x, w=w, scale=scale, bias=bias)
    M, K = x.shape
    out = torch.full((M, N), float("nan"), dtype=x.dtype)
    _run("int8_gemv", version, _code(x, "x"), _ptr(x), _ptr(w), _ptr(scale), _ptr(bias), _ptr(out), _i64(M), _i64(N),
         _i64(K), reverse=reverse, lib=lib)
    return out


def kv_cache_write(key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   slot_mapping: torch.Tensor, reverse: bool = False, lib: ctypes.CDLL | None = None) -> None:
    """kv_write.cu: pool row slot_mapping[t] <- key/value row t (slot -1 skipped), in place; pools (nb, bs, nh, hs).
    Every slot must be -1 or inside the pool (ValueError naming slot_mapping otherwise)."""
    check_kv_write_args(key, value, k_pool, v_pool, slot_mapping)
    _cpu(key=key, value=value, k_pool=k_pool, v_pool=v_pool, slot_mapping=slot_mapping)
    num_slots = k_pool.shape[0] * k_pool.shape[1]
    check_slot_range(slot_mapping, num_slots)
    T, nh, hs = key.shape
    _run("kv_cache_write", _code(key, "key"), _ptr(key), _ptr(value), _ptr(k_pool), _ptr(v_pool), _ptr(slot_mapping),
         _i64(T), _i64(nh), _i64(hs), _i64(num_slots), reverse=reverse, lib=lib)
