"""Hostile arguments for chapters 12 (the kernels, run by the CPU emulator) and 13 (the C++ extension and the
compiled decoders): every bad argument is a Python exception naming it, never a signal, a hang or a wrong answer.

The fuzz tests run in a subprocess (`python tests/test_hostile_12_13.py GROUP SEED TRIALS`), because the bug they
guard against is memory corruption: a kernel handed a pool smaller than its slot mapping wrote past the pool, and
the process died at exit (double free, SIGSEGV). A negative return code is that signal. Each trial takes a valid
call of one op, breaks one thing at random (fixed seed) and requires a ValueError/TypeError raised from minillm's
own code whose message names the broken argument (or the argument it must agree with); the raw C++ extension
functions only need to raise (their TORCH_CHECKs are RuntimeErrors). Each op's valid call runs before and after its
trials, so a spec that is wrong in the first place fails too.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import traceback
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the subprocess runs this file as a script
    sys.path.insert(0, str(ROOT))

from helpers import LyingInt, assert_refused_by_minillm, special_files  # noqa: E402
from minillm import GPTConfig  # noqa: E402
from minillm.compile.cpu_gemv import build_problem  # noqa: E402
from minillm.compile.decode import StaticDecoder, integer_ids  # noqa: E402
from minillm.core.model import GPT  # noqa: E402
from minillm.kernels import emulator  # noqa: E402

SEED = 1213
TRIALS = 40  # per op: a few seconds for the emulator's ops (bad calls never launch), about as many for the rest
SUBPROCESS_TIMEOUT_S = 600  # a first build of the emulator and the extension fits in it on two cores
TINY = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=32)
BAD_DTYPES = {  # per kind of argument, dtypes that are never valid for it
    "float": (torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool),
    "f32": (torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool),
    "int64": (torch.int32, torch.float32, torch.float64, torch.int8, torch.bool),
    "int8": (torch.float32, torch.int32, torch.uint8, torch.float16),
    "uint8": (torch.float32, torch.int32, torch.int8, torch.float16),
}


# ----------------------------------------------------------------------------------------------------- the specs
@dataclass
class Spec:
    """One op: a valid call (`good(rng)` -> keyword arguments), the kinds of its tensor arguments, which of their
    dimensions must agree with another argument (arg -> {dim: names any of which the error may name}), and extra
    op-specific bad calls (name -> (rng, args) -> (args, names))."""
    name: str
    fn: Callable[..., Any]
    good: Callable[[random.Random], dict[str, Any]]
    kinds: dict[str, str]
    tied: dict[str, dict[int, tuple[str, ...]]] = field(default_factory=dict)
    extra: dict[str, Callable[[random.Random, dict[str, Any]], tuple[dict[str, Any], tuple[str, ...]]]] = field(
        default_factory=dict)
    num_versions: int = 0  # 0: the op takes no version
    strict: bool = True  # False: any exception will do (the raw C++ functions)
    copies_strided: bool = False  # True: a non-contiguous tensor is copied, not refused (chapter 13's wrappers)


def _rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _float_dtype(rng: random.Random) -> torch.dtype:
    return rng.choice([torch.float32, torch.float16, torch.bfloat16])


def _paged_good(rng: random.Random, dtype: torch.dtype) -> dict[str, Any]:
    """S=2 sequences, nh=2, hs=8 over a pool of nb=4 blocks of bs=2: lengths 3 and 4 in blocks [0, 1] and [2, 3]."""
    return dict(q=_rand(2, 2, 8, dtype=dtype), k_pool=_rand(4, 2, 2, 8, dtype=dtype),
                v_pool=_rand(4, 2, 2, 8, dtype=dtype), block_tables=torch.tensor([[0, 1, -1], [2, 3, -1]]),
                context_lens=torch.tensor([3, 4]))


def _bad_tables(rng: random.Random, args: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A block id a sequence reads outside the pool."""
    tables = args["block_tables"].clone()
    s = rng.randrange(2)
    tables[s, rng.randrange(2)] = rng.choice([-1, -7, 4, 5, 1 << 40])
    return {**args, "block_tables": tables}, ("block_tables",)


def _bad_lens(rng: random.Random, args: dict[str, Any], low: int) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A context length below `low` or longer than the table holds (3 blocks of 2)."""
    lens = args["context_lens"].clone()
    lens[rng.randrange(2)] = rng.choice([low - 1, -5, 7, 100, 1 << 40])
    return {**args, "context_lens": lens}, ("context_lens",)


def _small_pool(rng: random.Random, args: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Pools with fewer blocks than the block tables / slot mapping point into."""
    nb = rng.choice([0, 1, 2]) if "block_tables" in args else rng.choice([0, 1])
    shape = (nb, *args["k_pool"].shape[1:])
    k, v = (torch.zeros(shape, dtype=args["k_pool"].dtype) for _ in range(2))
    return {**args, "k_pool": k, "v_pool": v}, ("block_tables", "slot_mapping")


def _bad_slots(rng: random.Random, args: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    slots = args["slot_mapping"].clone()
    slots[rng.randrange(len(slots))] = rng.choice([-2, -100, 8, 9, 1 << 40])
    return {**args, "slot_mapping": slots}, ("slot_mapping",)


def _head_size(*names: str):
    def bad(rng: random.Random, args: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
        hs = rng.choice([129, 200])
        return {**args, **{n: _rand(*args[n].shape[:-1], hs, dtype=args[n].dtype) for n in names}}, ("head size",)
    return bad


def emulator_specs() -> list[Spec]:
    def paged(**kw):
        return emulator.paged_attention_decode(**kw, check_indices=True)

    def paged_default(**kw):  # the NaN contract for bad block ids; negative lengths are still refused
        return emulator.paged_attention_decode(**kw)

    paged_kinds = dict(q="float", k_pool="float", v_pool="float", block_tables="int64", context_lens="int64")
    paged_tied = dict(q={0: ("q", "block_tables"), 1: ("q", "k_pool"), 2: ("q", "k_pool")},
                      k_pool={1: ("k_pool", "v_pool"), 2: ("k_pool",), 3: ("k_pool",)},
                      v_pool={0: ("v_pool",), 1: ("v_pool",), 2: ("v_pool",), 3: ("v_pool",)},
                      block_tables={0: ("block_tables",)}, context_lens={0: ("context_lens",)})
    kv_tied = dict(key={0: ("key", "value"), 1: ("key", "value"), 2: ("key", "value")},
                   value={0: ("value",), 1: ("value",), 2: ("value",)},
                   k_pool={2: ("k_pool",), 3: ("k_pool",)},
                   v_pool={0: ("v_pool",), 1: ("v_pool",), 2: ("v_pool",), 3: ("v_pool",)},
                   slot_mapping={0: ("slot_mapping",)})
    return [
        Spec("emulator.softmax", emulator.softmax, lambda r: dict(x=_rand(3, 8, dtype=_float_dtype(r))),
             dict(x="float"), num_versions=4),
        Spec("emulator.layernorm", emulator.layernorm,
             lambda r: (lambda d: dict(x=_rand(3, 8, dtype=d), weight=_rand(8, dtype=d), bias=_rand(8, dtype=d)))(
                 _float_dtype(r)),
             dict(x="float", weight="float", bias="float"),
             tied=dict(x={1: ("x", "weight")}, weight={0: ("weight",)}, bias={0: ("bias",)}),
             extra={"eps": lambda r, a: ({**a, "eps": r.choice([0.0, -1.0, "1e-5", True, float("inf"), 1e300,
                                                              float("nan")])}, ("eps",))},
             num_versions=4),
        Spec("emulator.bias_gelu", emulator.bias_gelu,
             lambda r: (lambda d: dict(x=_rand(3, 8, dtype=d), bias=_rand(8, dtype=d)))(_float_dtype(r)),
             dict(x="float", bias="float"), tied=dict(x={1: ("x", "bias")}, bias={0: ("bias",)}), num_versions=2),
        Spec("emulator.attention", emulator.attention,
             lambda r: (lambda d: {n: _rand(1, 2, 5, 8, dtype=d) for n in "qkv"})(_float_dtype(r)),
             dict(q="float", k="float", v="float"),
             tied={"q": {i: ("q", "k") for i in range(4)}, "k": {i: ("k",) for i in range(4)},
                   "v": {i: ("v",) for i in range(4)}},
             extra={"head size": _head_size("q", "k", "v")}, num_versions=4),
        Spec("emulator.paged_attention_decode", paged, lambda r: _paged_good(r, _float_dtype(r)), paged_kinds,
             tied=paged_tied,
             extra={"block id": _bad_tables, "context length": lambda r, a: _bad_lens(r, a, 0),
                    "small pool": _small_pool, "head size": _head_size("q", "k_pool", "v_pool"),
                    "block size 0": lambda r, a: ({**a, "k_pool": a["k_pool"][:, :0].contiguous(),
                                                   "v_pool": a["v_pool"][:, :0].contiguous()}, ("k_pool",))},
             num_versions=2),
        Spec("emulator.paged_attention_decode(default)", paged_default, lambda r: _paged_good(r, torch.float32),
             paged_kinds, tied=paged_tied,
             extra={"negative length": lambda r, a: ({**a, "context_lens": torch.tensor([3, -r.randrange(1, 9)])},
                                                     ("context_lens",))},
             num_versions=2),
        Spec("emulator.int8_gemv", emulator.int8_gemv,
             lambda r: (lambda d: dict(x=_rand(2, 8, dtype=d), w=torch.randint(-127, 128, (3, 8), dtype=torch.int8),
                                       scale=_rand(3, dtype=d), bias=_rand(3, dtype=d)))(_float_dtype(r)),
             dict(x="float", w="int8", scale="float", bias="float"),
             tied=dict(x={1: ("x", "w")}, w={0: ("w", "scale"), 1: ("w",)}, scale={0: ("scale",)},
                       bias={0: ("bias",)}),
             num_versions=3),
        Spec("emulator.kv_cache_write", emulator.kv_cache_write,
             lambda r: (lambda d: dict(key=_rand(3, 2, 8, dtype=d), value=_rand(3, 2, 8, dtype=d),
                                       k_pool=torch.zeros(4, 2, 2, 8, dtype=d), v_pool=torch.zeros(4, 2, 2, 8, dtype=d),
                                       slot_mapping=torch.tensor([0, 5, -1])))(_float_dtype(r)),
             dict(key="float", value="float", k_pool="float", v_pool="float", slot_mapping="int64"),
             tied=kv_tied, extra={"slot": _bad_slots, "small pool": _small_pool}),
    ]


def cpp_specs() -> list[Spec]:
    from minillm.compile.cpu_gemv import gemv, int4_gemv, int8_gemv, load_cpu_ext
    from minillm.compile.cpu_paged import paged_decode_attention, paged_verify_attention

    ext = load_cpu_ext()
    paged_kinds = dict(q="f32", k_pool="f32", v_pool="f32", block_tables="int64", context_lens="int64")
    paged_tied = dict(q={0: ("q", "block_tables"), 1: ("q", "k_pool"), 2: ("q", "k_pool")},
                      k_pool={2: ("k_pool",), 3: ("k_pool",)},
                      v_pool={0: ("v_pool",), 1: ("v_pool",), 2: ("v_pool",), 3: ("v_pool",)},
                      block_tables={0: ("block_tables",)}, context_lens={0: ("context_lens",)})
    paged_extra = {"block id": _bad_tables, "context length": lambda r, a: _bad_lens(r, a, 1),
                   "small pool": _small_pool}
    def verify_good(r: random.Random) -> dict[str, Any]:  # the decode arguments, 2 and 1 queries per sequence
        return {**_paged_good(r, torch.float32), "q": _rand(3, 2, 8), "query_lens": torch.tensor([2, 1])}

    def bad_query_lens(r: random.Random, args: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
        qls = r.choice([[0, 3], [-1, 4], [5, 1], [2, 2], [1, 1], [1 << 40, 1]])  # 0, negative, past ctx, wrong sum
        return {**args, "query_lens": torch.tensor(qls)}, ("query_lens", "q must hold")

    verify_kinds = {**paged_kinds, "query_lens": "int64"}
    verify_tied = {**paged_tied, "q": {0: ("q", "query_lens"), 1: ("q", "k_pool"), 2: ("q", "k_pool")},
                   "query_lens": {0: ("query_lens",)}}
    verify_extra = {**paged_extra, "query length": bad_query_lens}
    gemv_good = lambda r: dict(x=_rand(2, 9), w=_rand(5, 9), b=_rand(5))  # noqa: E731
    gemv_tied = dict(x={1: ("x", "w")}, w={0: ("w", "b"), 1: ("x", "w")}, b={0: ("b",)})
    int8_good = lambda r: dict(x=_rand(2, 9), q=torch.randint(-127, 128, (5, 9), dtype=torch.int8),  # noqa: E731
                               scale=_rand(5).abs(), b=_rand(5))
    int8_kinds = dict(x="f32", q="int8", scale="f32", b="f32")
    int8_tied = dict(x={1: ("x", "q")}, q={0: ("q", "scale"), 1: ("x", "q")}, scale={0: ("scale",)}, b={0: ("b",)})
    int4_good = lambda r: dict(x=_rand(2, 64), packed=torch.randint(0, 256, (5, 32), dtype=torch.uint8),  # noqa: E731
                               scale=_rand(5, 4).abs(), b=_rand(5))  # 4 groups of 16 columns
    int4_kinds = dict(x="f32", packed="uint8", scale="f32", b="f32")
    int4_tied = dict(x={1: ("x", "packed")}, packed={0: ("packed", "scale"), 1: ("x", "packed")},
                     scale={0: ("scale",), 1: ("scale",)}, b={0: ("b",)})
    # The engine's fused step (`FusedDecoder.paged`) over a 2-layer model of nh=2, hs=8, the pools of
    # `_paged_good`: sequence 0 feeds its tokens 1 and 2 (slots 1, 2), sequence 1 its token 3 (slot 7).
    from minillm.compile.fused_engine import FusedEngineModel

    torch.manual_seed(0)
    engine_step = FusedEngineModel(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))
                                   .eval())._cpp

    def fused_good(r: random.Random) -> dict[str, Any]:
        pools = _paged_good(r, torch.float32)
        return dict(tokens=torch.tensor([5, 6, 7]), positions=torch.tensor([1, 2, 3]),
                    slot_mapping=torch.tensor([1, 2, 7]), block_tables=pools["block_tables"],
                    context_lens=pools["context_lens"], query_lens=torch.tensor([2, 1]), k_pool=pools["k_pool"],
                    v_pool=pools["v_pool"])

    def fused_call(tokens, positions, slot_mapping, block_tables, context_lens, query_lens, k_pool, v_pool):
        return engine_step.paged(tokens, positions, slot_mapping, block_tables, context_lens, query_lens,
                                 [k_pool, k_pool], [v_pool, v_pool])

    def fused_bad_rows(r: random.Random, args: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
        name, values = r.choice([("tokens", [-1, 64, 1 << 40]), ("positions", [-1, 16, 1 << 40]),
                                 ("slot_mapping", [0, 3, 8, -1, 1 << 40])])
        bad = args[name].clone()
        bad[r.randrange(3)] = r.choice(values)
        return {**args, name: bad}, (name,)

    fused_kinds = dict(tokens="int64", positions="int64", slot_mapping="int64", block_tables="int64",
                       context_lens="int64", query_lens="int64", k_pool="f32", v_pool="f32")
    fused_tied = dict(tokens={0: ("tokens",)}, positions={0: ("positions",)}, slot_mapping={0: ("slot_mapping",)},
                      block_tables={0: ("block_tables",)}, context_lens={0: ("context_lens",)},
                      query_lens={0: ("query_lens",)}, k_pool={2: ("k_pool",), 3: ("k_pool",)},
                      v_pool={0: ("v_pool",), 2: ("v_pool",), 3: ("v_pool",)})
    return [
        Spec("ext.FusedDecoder.paged (raw)", fused_call, fused_good, fused_kinds, tied=fused_tied,
             extra={**paged_extra, "query length": bad_query_lens, "row": fused_bad_rows}, strict=False),
        Spec("ext.FusedDecoder.head (raw)", lambda h: engine_step.head(h), lambda r: dict(h=_rand(3, 16)),
             dict(h="f32"), tied=dict(h={1: ("h",)}), strict=False),
        Spec("cpu_gemv.int8_gemv", int8_gemv, int8_good, int8_kinds, tied=int8_tied, copies_strided=True),
        Spec("ext.int8_gemv (raw)", lambda x, q, scale, b: ext.int8_gemv(x, q, scale, b), int8_good, int8_kinds,
             tied=int8_tied, strict=False),
        Spec("cpu_gemv.int4_gemv", int4_gemv, int4_good, int4_kinds, tied=int4_tied, copies_strided=True),
        Spec("ext.int4_gemv (raw)", lambda x, packed, scale, b: ext.int4_gemv(x, packed, scale, b), int4_good,
             int4_kinds, tied=int4_tied, strict=False),
        Spec("cpu_gemv.gemv", gemv, gemv_good, dict(x="f32", w="f32", b="f32"), tied=gemv_tied,
             copies_strided=True),
        Spec("ext.gemv (raw)", lambda x, w, b: ext.gemv(x, w, b), gemv_good, dict(x="f32", w="f32", b="f32"),
             tied=gemv_tied, strict=False),
        Spec("cpu_paged.paged_decode_attention", paged_decode_attention, lambda r: _paged_good(r, torch.float32),
             paged_kinds, tied=paged_tied, extra=paged_extra, copies_strided=True),
        Spec("ext.paged_decode_attention (raw)", lambda **kw: ext.paged_decode_attention(*kw.values()),
             lambda r: _paged_good(r, torch.float32), paged_kinds, tied=paged_tied, extra=paged_extra, strict=False),
        Spec("cpu_paged.paged_verify_attention", paged_verify_attention, verify_good, verify_kinds, tied=verify_tied,
             extra=verify_extra, copies_strided=True),
        Spec("ext.paged_verify_attention (raw)", lambda **kw: ext.paged_verify_attention(*kw.values()), verify_good,
             verify_kinds, tied=verify_tied, extra=verify_extra, strict=False),
    ]


def _bad_step_inputs(rng: random.Random, max_len: int) -> tuple[Any, Any, tuple[str, ...]]:
    """A bad (token, positions) pair for a batch-1 decode step and the names its error may give."""
    good_tok, good_pos = torch.tensor([rng.randrange(TINY.vocab_size)]), torch.tensor([rng.randrange(max_len)])
    kind = rng.choice(["float token", "bool token", "py float", "str", "token range", "two tokens", "float pos",
                       "pos range", "pos max_len"])
    if kind == "float token":
        return torch.tensor([rng.choice([1.0, 2.7, -0.5])]), good_pos, ("token",)
    if kind == "bool token":
        return torch.tensor([True]), good_pos, ("token",)
    if kind == "py float":
        return 3.0, good_pos, ("token",)
    if kind == "str":
        return good_tok, "0", ("position",)
    if kind == "token range":
        return torch.tensor([rng.choice([-1, TINY.vocab_size, 1 << 40])]), good_pos, ("token",)
    if kind == "two tokens":
        return torch.tensor([1, 2]), good_pos, ("token",)
    if kind == "float pos":
        return good_tok, torch.tensor([1.5]), ("position",)
    if kind == "pos range":
        return good_tok, torch.tensor([rng.choice([-1, TINY.block_size, 1 << 40])]), ("position",)
    return good_tok, torch.tensor([max_len + rng.randrange(3)]), ("position", "max_len")


def decoder_specs() -> list[Spec]:
    """The decode_fn of every chapter 13 decoder, called with one bad token or position: the fused C++ step, and the
    static decoder eager and compiled (a bad call is refused before anything compiles)."""
    from minillm.compile.fused_step import FusedCPUDecoder

    torch.manual_seed(0)
    model = GPT(TINY).eval()
    decoders = [("FusedCPUDecoder", FusedCPUDecoder(model), TINY.block_size)]
    for mode in ("eager", "compile"):
        decoders.append((f"StaticDecoder({mode})", StaticDecoder(model, mode, backend="aot_eager", max_len=16), 16))
    specs = []
    for name, dec, max_len in decoders:
        def call(token, positions, dec=dec):
            return dec(dec.model, dec.cache, token, positions)

        def bad(rng, args, max_len=max_len):
            token, positions, names = _bad_step_inputs(rng, max_len)
            return dict(token=token, positions=positions), names
        def good(rng, dec=dec):  # every decoder takes the next position only (its cache's length)
            position = dec.cache.length
            return dict(token=torch.tensor([1]), positions=torch.tensor([position]))
        specs.append(Spec(name, call, good, kinds={}, extra={"step input": bad}))
    return specs


# --------------------------------------------------------------------------------------------------- the driver
def _mutate(spec: Spec, rng: random.Random, args: dict[str, Any]) -> tuple[str, dict[str, Any], tuple[str, ...]]:
    """One bad call: (what was broken, the arguments, names the error may give)."""
    kinds = ["type", "dtype", "rank", "size"] + ["strided"] * (not spec.copies_strided) if spec.kinds else []
    kinds += ["version"] * bool(spec.num_versions) + [f"extra:{k}" for k in spec.extra]
    kind = rng.choice(kinds)
    if kind.startswith("extra:"):
        bad, names = spec.extra[kind[6:]](rng, args)
        return kind, bad, names
    if kind == "version":
        return kind, {**args, "version": rng.choice([0, -1, spec.num_versions + 1, 1.0, True, "2"])}, ("version",)
    name = rng.choice(sorted(spec.kinds))
    t = args[name]
    if kind == "type":
        return f"{kind} {name}", {**args, name: t.tolist()}, (name,)
    if kind == "dtype":
        return f"{kind} {name}", {**args, name: t.to(rng.choice(BAD_DTYPES[spec.kinds[name]]))}, (name,)
    if kind == "rank":
        new = t.unsqueeze(0) if rng.random() < 0.5 or t.dim() == 1 else t[..., 0].contiguous()
        return f"{kind} {name}", {**args, name: new}, (name,)
    if kind == "strided":  # the same shape and values, every other element of a wider buffer
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return f"{kind} {name}", {**args, name: wide[..., ::2]}, (name,)
    dims = spec.tied.get(name)
    if not dims:
        return _mutate(spec, rng, args)
    dim = rng.choice(sorted(dims))
    shape = list(t.shape)
    shape[dim] = shape[dim] + 1 if shape[dim] <= 1 or rng.random() < 0.5 else shape[dim] - 1
    new = torch.zeros(shape, dtype=t.dtype) if t.dtype in (torch.int64, torch.int8, torch.uint8) else _rand(*shape,
                                                                                                         dtype=t.dtype)
    return f"{kind} {name}[{dim}]", {**args, name: new}, dims[dim]


def _raised_in_minillm(e: BaseException) -> bool:
    """Whether the exception was raised by a line of minillm (a C++ TORCH_CHECK re-raised as ValueError counts)."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and "/minillm/" in frames[-1].filename.replace(os.sep, "/")


def fuzz(specs: list[Spec], seed: int, trials: int) -> dict[str, Any]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    report: dict[str, Any] = {}
    for spec in specs:
        failures: list[str] = []
        version = {"version": 1} if spec.num_versions else {}
        spec.fn(**spec.good(rng), **version)  # the valid call works (else every trial below proves nothing)
        for _ in range(trials):
            good = {**spec.good(rng), **version}
            what, args, names = _mutate(spec, rng, good)
            try:
                spec.fn(**args)
            except (ValueError, TypeError, RuntimeError) as e:
                msg = str(e)
                if not spec.strict:
                    continue
                if isinstance(e, RuntimeError):  # a launch that failed, or torch's own check: not minillm's
                    failures.append(f"{what}: RuntimeError {msg!r}")
                elif not any(n in msg for n in names):
                    failures.append(f"{what}: message names none of {names}: {type(e).__name__} {msg!r}")
                elif not _raised_in_minillm(e):
                    failures.append(f"{what}: raised outside minillm: {type(e).__name__} {msg!r}")
            except Exception as e:  # noqa: BLE001 (what the test reports: any other exception is a failure)
                failures.append(f"{what}: {type(e).__name__} {e}")
            else:
                failures.append(f"{what}: no error")
        spec.fn(**spec.good(rng), **version)  # and still works after them
        report[spec.name] = {"trials": trials, "failures": failures}
    return report


GROUPS = {"emulator": emulator_specs, "cpp": cpp_specs, "decoders": decoder_specs}


def _run_group(group: str) -> dict[str, Any]:
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), group, str(SEED), str(TRIALS)], cwd=ROOT,
                         capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode >= 0, f"the {group} fuzz died of signal {-res.returncode}:\n{res.stderr[-3000:]}"
    assert res.returncode == 0, f"the {group} fuzz failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def _assert_clean(report: dict[str, Any]) -> None:
    bad = {op: r["failures"] for op, r in report.items() if r["failures"]}
    assert not bad, json.dumps(bad, indent=1)[:6000]


# ----------------------------------------------------------------------------------------------------- the tests
@pytest.mark.skipif(emulator.find_cxx() is None, reason="the kernel emulator needs a C++ compiler (g++ or clang++)")
def test_fuzz_every_emulator_op_raises_naming_the_argument_never_a_signal():
    report = _run_group("emulator")
    assert set(report) == {s.name for s in emulator_specs()}
    _assert_clean(report)


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_fuzz_every_cpp_extension_op_raises_never_a_signal():
    _assert_clean(_run_group("cpp"))


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_fuzz_every_decoder_step_refuses_bad_tokens_and_positions():
    _assert_clean(_run_group("decoders"))


@pytest.mark.skipif(emulator.find_cxx() is None, reason="the kernel emulator needs a C++ compiler (g++ or clang++)")
def test_emulated_kv_cache_write_with_a_small_pool_names_slot_mapping():
    """The regression: pools of 1 block of 2 against slots up to 5 used to write past the pool and corrupt the heap
    (a double free at exit). In a subprocess, so a regression is a signal the test sees, not a dead test runner."""
    code = ("import torch\nfrom minillm.kernels import emulator\n"
            "key = torch.randn(3, 2, 8)\npools = [torch.zeros(1, 2, 2, 8) for _ in range(2)]\n"
            "try:\n    emulator.kv_cache_write(key, key.clone(), *pools, torch.tensor([0, 5, -1]))\n"
            "except ValueError as e:\n    print(e)\n"
            "small = [torch.zeros(4, 2, 1, 8) for _ in range(2)]  # nh=1 rows: smaller than the key's rows\n"
            "try:\n    emulator.kv_cache_write(key, key.clone(), *small, torch.tensor([0, 5, -1]))\n"
            "except ValueError as e:\n    print(e)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode == 0, f"return code {res.returncode}:\n{res.stderr[-3000:]}"
    lines = res.stdout.splitlines()
    assert "slot_mapping must hold -1 or slots 0..1, got values in [-1, 5]" in lines[0]
    assert lines[1].startswith("k_pool must be (nb, bs, nh=2, hs=8)")


@pytest.mark.skipif(emulator.find_cxx() is None, reason="the kernel emulator needs a C++ compiler (g++ or clang++)")
def test_emulator_names_the_bad_argument_before_launching(monkeypatch):
    """What used to reach the launcher as "invalid argument" (or read past a tensor) now names the argument."""
    def refuse(*args, **kwargs):
        raise AssertionError("the emulator launched before checking its arguments")

    monkeypatch.setattr(emulator, "load", refuse)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="softmax: version must be 1..4, got 5"):
        emulator.softmax(x, 5)
    with pytest.raises(ValueError, match=r"x must be 2-D \(rows, cols\), got shape \(3,\)"):
        emulator.softmax(torch.randn(3), 1)
    with pytest.raises(ValueError, match="bias must have x's dtype"):
        emulator.bias_gelu(x, torch.randn(8).half(), 1)
    with pytest.raises(ValueError, match="value must have key's dtype"):
        emulator.kv_cache_write(torch.randn(3, 2, 8), torch.randn(3, 2, 8).half(), torch.zeros(4, 2, 2, 8),
                                torch.zeros(4, 2, 2, 8), torch.tensor([0, 1, 2]))
    args = _paged_good(random.Random(0), torch.float32)
    with pytest.raises(ValueError, match="block_tables must have dtype int64"):
        emulator.paged_attention_decode(**{**args, "block_tables": args["block_tables"].float()}, version=1)
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 9 is outside the pool \[0, 4\)"):
        emulator.paged_attention_decode(**{**args, "block_tables": torch.tensor([[0, 1, -1], [9, 3, -1]])},
                                        version=2, check_indices=True)
    with pytest.raises(ValueError, match="context_lens must be >= 0"):
        emulator.paged_attention_decode(**{**args, "context_lens": torch.tensor([3, -1])}, version=2)
    with pytest.raises(ValueError, match=r"w must be \(N, K=8\)"):
        emulator.int8_gemv(torch.randn(2, 8), torch.zeros(3, 7, dtype=torch.int8), torch.randn(3), None, 1)
    with pytest.raises(TypeError, match="reverse must be a bool"):
        emulator.softmax(x, 1, reverse="yes")
    # 1e300 is inf as the kernel's float (every row its bias), 1e-50 is 0 (a constant row NaN)
    for eps in (float("inf"), 1e300, float("nan"), 1e-50, 0.0):
        with pytest.raises(ValueError, match=r"eps must be a finite number in \[1.17549e-38, 3.40282e\+38\]"):
            emulator.layernorm(x, torch.ones(8), torch.zeros(8), 1, eps=eps)


def test_integer_ids_refuses_what_would_be_truncated():
    assert integer_ids("token", 7, 1).tolist() == [7]
    assert integer_ids("token", torch.tensor([3], dtype=torch.int32), 1).tolist() == [3]
    for bad in (torch.tensor([2.7]), 2.7, torch.tensor([True]), True, "3", None):
        with pytest.raises(TypeError, match="token"):
            integer_ids("token", bad, 1)
    with pytest.raises(ValueError, match=r"token must hold 1 id\(s\), got shape \(2,\)"):
        integer_ids("token", torch.tensor([1, 2]), 1)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_static_decoder_checks_the_step_before_running_it(mode):
    """A float token was truncated by the copy into the int64 buffer; a position past max_len was an IndexError
    inside inductor. Both are refused first, in every mode, so no bad call ever compiles anything."""
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    dec = StaticDecoder(model, mode, backend="aot_eager", max_len=8)
    step = lambda token, pos: dec(model, dec.cache, token, pos)  # noqa: E731
    with pytest.raises(TypeError, match="token must hold integer ids, got dtype torch.float32"):
        step(torch.tensor([2.7]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"positions must be in \[0, max_len=8\).*got \[8\]"):
        step(torch.tensor([1]), torch.tensor([8]))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=512\), got \[512\]"):
        step(torch.tensor([512]), torch.tensor([0]))
    assert dec.compiles == 0 and dec.calls == 0  # nothing ran
    dec.cache.slot.fill_(8)
    with pytest.raises(ValueError, match="cache full: 8 slots used of max_len=8"):
        step(torch.tensor([1]), torch.tensor([7]))


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_fused_decoder_refuses_a_float_token():
    from minillm.compile.fused_step import FusedCPUDecoder

    torch.manual_seed(0)
    dec = FusedCPUDecoder(GPT(TINY).eval())
    with pytest.raises(TypeError, match="token must hold integer ids"):
        dec(dec.model, dec.cache, torch.tensor([2.7]), torch.tensor([0]))
    with pytest.raises(TypeError, match="positions must hold integer ids"):
        dec(dec.model, dec.cache, torch.tensor([2]), torch.tensor([0.0]))
    assert dec.cache.length == 0  # a refused step leaves the cache as it was


def test_cpp_paged_checks_name_the_argument_without_the_extension():
    """The Python-side checks of chapter 13's paged attention run before the extension is even loaded."""
    from minillm.compile.cpu_paged import check_paged_arguments

    args = _paged_good(random.Random(0), torch.float32)
    with pytest.raises(ValueError, match="v_pool must have k_pool's shape"):
        check_paged_arguments(**{**args, "v_pool": torch.zeros(3, 2, 2, 8)})
    with pytest.raises(ValueError, match=r"block_tables: block id 4 of sequence 1 is outside the pool \[0, 4\)"):
        check_paged_arguments(**{**args, "block_tables": torch.tensor([[0, 1, -1], [2, 4, -1]])})
    with pytest.raises(ValueError, match=r"context_lens: context length 0 of sequence 0 is outside \[1, 6\]"):
        check_paged_arguments(**{**args, "context_lens": torch.tensor([0, 4])})


if __name__ == "__main__":  # python tests/test_hostile_12_13.py GROUP SEED TRIALS: one JSON line on stdout
    group, seed, trials = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(fuzz(GROUPS[group](), seed, trials)))


# ----------------------------------------------------------------------------------- the mirrors' arguments
def _mirror_bad_calls():
    """The mirrors' (and the naive twins', and `ops.versions`') bad calls: (id, call, exception, pattern)."""
    from minillm.kernels import bench as kbench
    from minillm.kernels import build
    from minillm.kernels import mirror as M
    from minillm.kernels import tour as ktour
    from minillm.kernels import naive as N
    from minillm.kernels import ops

    X, W, B = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    KP = torch.randn(4, 2, 2, 4)
    state, V = (torch.full((2,), float("-inf")), torch.zeros(2), torch.zeros(2, 4)), torch.randn(2, 5, 4)
    PAGED = (torch.randn(2, 2, 8), torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8), torch.tensor([[0, 1], [2, 3]]),
             torch.tensor([3, 8]))  # S=2 over 4 blocks of 4, two blocks each: 8 tokens at most
    XQ, WQ = torch.randn(2, 64), torch.randint(-127, 128, (5, 64), dtype=torch.int8)
    KEY = torch.randn(3, 2, 8)
    ROW3, W4, B4 = torch.full((1, 4), 3.0), torch.ones(4), torch.zeros(4)  # a constant row: var = 0
    Q0 = torch.zeros(1, 1, 4, 0)  # head size 0

    def POOLS():
        return [torch.zeros(4, 2, 2, 8) for _ in range(2)]
    return [
        ("softmax_online-bool-tile", lambda: M.softmax_online(X, tile=True), TypeError, "tile"),
        ("softmax_online-int-x", lambda: M.softmax_online(X.long()), TypeError, r"\bx\b"),
        ("softmax_online-no-columns", lambda: M.softmax_online(X[:, :0]), ValueError, r"\bx\b"),
        ("warp_tree_sum-31-lanes", lambda: M.warp_tree_sum(torch.randn(4, 31)), ValueError, "partials"),
        ("lane_partials-bool-pack", lambda: M.lane_partials(torch.randn(4, 64), pack=True), TypeError, "pack"),
        ("layernorm_warp-negative-eps", lambda: M.layernorm_warp(X, W, B, eps=-1), ValueError, "eps"),
        ("layernorm_warp-weight-shape", lambda: M.layernorm_warp(X, W[:4], B), ValueError, "weight"),
        ("bias_gelu-zero-pack", lambda: M.bias_gelu(X, B, pack=0), ValueError, "pack"),
        ("bias_gelu-bias-shape", lambda: M.bias_gelu(X, B[:3]), ValueError, "bias"),
        ("flash_attention-negative-block", lambda: M.flash_attention(q, k, v, block_k=-4), ValueError, "block_k"),
        ("flash_attention-kv-shape", lambda: M.flash_attention(q, k[:, :, :4], v[:, :, :4]), ValueError, r"\bk\b"),
        ("flash_attention-3d", lambda: M.flash_attention(q[0], k[0], v[0]), ValueError, r"\bq\b"),
        ("flash_attention_v3-int-p", lambda: M.flash_attention_v3(q, k, v, p_dtype=torch.int8), ValueError,
         "p_dtype"),
        ("paged_gather-bool-context", lambda: M.paged_gather(KP, torch.tensor([0, 1]), True), TypeError,
         "context_len"),
        ("paged_gather-float-table", lambda: M.paged_gather(KP, torch.tensor([0.0, 1.0]), 3), TypeError,
         "block_table"),
        ("paged_gather-outside", lambda: M.paged_gather(KP, torch.tensor([0, 7]), 3), ValueError, "block_table"),
        ("int8_gemv-float-w", lambda: M.int8_gemv(torch.randn(2, 8), torch.randn(6, 8), torch.ones(6)), TypeError,
         r"\bw\b"),
        ("online_merge-floats", lambda: M.online_merge(1.0, 1.0, 2.0, 1.0), TypeError, "m1"),
        ("online_merge-shapes", lambda: M.online_merge(torch.ones(3), torch.ones(3), torch.ones(2), torch.ones(2)),
         ValueError, "m2"),
        ("attend_tile-int-scores", lambda: M.attend_tile(*state, torch.ones(2, 5, dtype=torch.long), V), TypeError,
         r"\bs\b"),
        ("attend_tile-v-rows", lambda: M.attend_tile(*state, torch.ones(2, 5), torch.randn(6, 4)), ValueError,
         r"\bv\b"),
        ("attend_tile-v-leading", lambda: M.attend_tile(*state, torch.ones(2, 5), torch.randn(3, 5, 4)), ValueError,
         r"\bv\b"),
        ("attend_tile-l-shape", lambda: M.attend_tile(state[0], torch.zeros(3), state[2], torch.ones(2, 5), V),
         ValueError, r"\bl\b"),
        ("lane_partials-0d", lambda: M.lane_partials(torch.tensor(1.0)), ValueError, r"\bx\b"),
        ("warp_tree_sum-0d", lambda: M.warp_tree_sum(torch.tensor(1.0)), ValueError, "partials"),
        ("layernorm_warp-inf-eps", lambda: M.layernorm_warp(X, W, B, eps=float("inf")), ValueError, "eps"),
        ("layernorm_warp-eps-past-float32", lambda: M.layernorm_warp(X, W, B, eps=1e300), ValueError, "eps"),
        ("paged_attention_decode-3-warps", lambda: M.paged_attention_decode(*PAGED, num_warps=3), ValueError,
         "num_warps"),
        ("paged_attention_decode-negative-length",
         lambda: M.paged_attention_decode(*PAGED[:4], torch.tensor([-1, 8])), ValueError, "context_lens"),
        ("int8_gemv-scale-shape", lambda: M.int8_gemv(XQ, WQ, torch.rand(4)), ValueError, "scale"),
        ("int8_gemv-bias-shape", lambda: M.int8_gemv(XQ, WQ, torch.rand(5), torch.rand(3)), ValueError, "bias"),
        ("int8_gemv-list-scale", lambda: M.int8_gemv(XQ, WQ, [1.0] * 5), TypeError, "scale"),
        ("kv_cache_write-float-slots", lambda: M.kv_cache_write(KEY, KEY, *POOLS(), torch.tensor([0., 1., 2.])),
         ValueError, "slot_mapping"),
        ("kv_cache_write-head-size", lambda: M.kv_cache_write(KEY[..., :4], KEY[..., :4], *POOLS(),
                                                              torch.tensor([0, 1, 2])), ValueError, "key"),
        ("kv_cache_write-one-slot", lambda: M.kv_cache_write(KEY, KEY, *POOLS(), torch.tensor([0])), ValueError,
         "slot_mapping"),
        ("naive.paged_attention_decode-past-the-table",
         lambda: N.paged_attention_decode(*PAGED[:4], torch.tensor([9, 8])), ValueError, "context_lens"),
        ("naive.paged_attention_decode-block-outside",
         lambda: N.paged_attention_decode(*PAGED[:3], torch.tensor([[0, 9], [2, 3]]), torch.tensor([8, 8])),
         ValueError, "block_tables"),
        ("naive.attention-lengths", lambda: N.attention(torch.randn(1, 2, 7, 4), k[:, :, :5], v[:, :, :5]),
         ValueError, r"\bk\b"),
        ("naive.int8_gemv-scale-shape", lambda: N.int8_gemv(XQ, WQ, torch.rand(4)), ValueError, "scale"),
        ("naive.kv_cache_write-slot-past-the-pool",
         lambda: N.kv_cache_write(KEY, KEY, *POOLS(), torch.tensor([0, 99, -1])), ValueError, "slot_mapping"),
        # before: NaN out of a first tile masked everywhere, NaN out of a +inf state, a float64 result from one
        # float64 argument, a slot written twice (the later won), the values written over the keys of one pool
        ("attend_tile-first-tile-all-masked",
         lambda: M.attend_tile(*state, torch.tensor([[0.0] * 5, [float("-inf")] * 5]), V), ValueError,
         r"\bs\b has a row masked to -inf everywhere"),
        ("attend_tile-pos-inf-score", lambda: M.attend_tile(*state, torch.tensor([[float("inf")] + [0.0] * 4] * 2), V),
         ValueError, r"\bs\b holds \+inf"),
        ("online_merge-pos-inf", lambda: M.online_merge(torch.tensor([float("inf")]), torch.ones(1), torch.zeros(1),
                                                        torch.ones(1)), ValueError, r"m1 holds \+inf"),
        ("softmax_online-pos-inf", lambda: M.softmax_online(torch.tensor([[float("inf"), 0.0]])), ValueError,
         r"\bx\b holds \+inf"),
        ("flash_attention-dtype-mix", lambda: M.flash_attention(q.double(), k, v), TypeError,
         r"\bk\b must have q's dtype torch.float64"),
        ("flash_attention_v3-dtype-mix", lambda: M.flash_attention_v3(q, k, v.half()), TypeError, r"\bv\b"),
        ("naive.attention-dtype-mix", lambda: N.attention(q, k.bfloat16(), v), TypeError, r"\bk\b"),
        ("kv_cache_write-slot-twice", lambda: M.kv_cache_write(KEY, KEY, *POOLS(), torch.tensor([1, 1, 2])),
         ValueError, "slot_mapping names slot 1 2 times"),
        ("kv_cache_write-one-pool-for-both", lambda: (lambda p: M.kv_cache_write(KEY, KEY, p, p,
                                                                                 torch.tensor([0, 1, 2])))(
            torch.zeros(4, 2, 2, 8)), ValueError, "k_pool and v_pool share memory"),
        ("kv_cache_write-key-inside-pool", lambda: (lambda p: M.kv_cache_write(p.view(8, 2, 8)[:3], KEY, p,
                                                                               torch.zeros(4, 2, 2, 8),
                                                                               torch.tensor([4, 5, 6])))(
            torch.zeros(4, 2, 2, 8)), ValueError, "key and k_pool share memory"),
        ("naive.kv_cache_write-slot-twice", lambda: N.kv_cache_write(KEY, KEY, *POOLS(), torch.tensor([-1, 3, 3])),
         ValueError, "slot 3 2 times"),
        ("ops.versions-unknown", lambda: ops.versions("matmul"), ValueError, "op must be one of.*softmax"),
        ("ops.versions-none", lambda: ops.versions(None), TypeError, "op must be.*softmax"),
        # before: torch's AttributeError / broadcast RuntimeError from the naive twins, which now check their
        # arguments with the mirrors' `check_rows` (and ops' `check_eps`); a 2-D table said "got torch.int64"
        ("naive.softmax-list", lambda: N.softmax([[1.0, 2.0]]), TypeError, r"\bx\b must be a floating-point tensor"),
        ("naive.softmax-0d", lambda: N.softmax(torch.tensor(1.0)), ValueError, r"\bx\b must have at least one"),
        ("naive.layernorm-weight-shape", lambda: N.layernorm(X, W[:4], B), ValueError,
         r"weight must have shape \(8,\), x's last dimension, got \(4,\)"),
        ("naive.layernorm-int-bias", lambda: N.layernorm(X, W, B.long()), TypeError, "bias"),
        ("naive.layernorm-negative-eps", lambda: N.layernorm(X, W, B, eps=-1.0), ValueError, "eps"),
        ("naive.bias_gelu-bias-shape", lambda: N.bias_gelu(X, B[:3]), ValueError,
         r"bias must have shape \(8,\), x's last dimension, got \(3,\)"),
        ("naive.bias_gelu-list-x", lambda: N.bias_gelu(X.tolist(), B), TypeError, r"\bx\b"),
        ("paged_gather-2d-table", lambda: M.paged_gather(KP, torch.tensor([[0, 1], [2, 3]]), 3), ValueError,
         r"block_table must be 1-D \(max_nb,\).*got shape \(2, 2\)"),
        ("paged_gather-2d-float-table", lambda: M.paged_gather(KP, torch.zeros(2, 2), 3), TypeError,
         "block_table must be a 1-D integer tensor, got torch.float32"),
        # third hostile run. before: eps = 1e-50 is 0.0 in the float32 every version computes in, and a constant row
        # came back NaN (var + eps = 0) from naive, the mirror and every emulator version; refused everywhere by
        # ops' check_eps (the CUDA wrapper and the emulator before any launch)
        ("na3-layernorm-eps-underflow", lambda: N.layernorm(ROW3, W4, B4, eps=1e-50), ValueError,
         r"eps must be a finite number in \[1.17549e-38, 3.40282e\+38\] .*got 1e-50"),
        ("mi3-layernorm-warp-eps-underflow", lambda: M.layernorm_warp(ROW3, W4, B4, eps=1e-50), ValueError,
         r"eps must be .*got 1e-50"),
        ("emu3-layernorm-eps-underflow", lambda: emulator.layernorm(ROW3, W4, B4, 4, eps=1e-50), ValueError,
         r"eps must be .*got 1e-50"),
        ("ops3-layernorm-eps-underflow", lambda: ops.layernorm(ROW3, W4, B4, eps=1e-50), ValueError,
         r"eps must be .*got 1e-50"),
        ("mi3-layernorm-warp-eps-subnormal", lambda: M.layernorm_warp(ROW3, W4, B4, eps=1e-40), ValueError,
         r"eps must be .*normal .*got 1e-40"),
        # before: ZeroDivisionError from 1 / sqrt(hs); now ops' (and the emulator's) head-size check
        ("mi3-flash-hs-zero", lambda: M.flash_attention(Q0, Q0, Q0), ValueError,
         r"head size q.shape\[-1\] must be 1..128, got 0"),
        ("mi3-flash-v3-hs-zero", lambda: M.flash_attention_v3(Q0, Q0, Q0), ValueError,
         r"head size q.shape\[-1\] must be 1..128, got 0"),
        ("mi3-paged-hs-zero", lambda: M.paged_attention_decode(Q0[0, :, :1], torch.zeros(1, 4, 1, 0),
                                                               torch.zeros(1, 4, 1, 0), torch.tensor([[0]]),
                                                               torch.tensor([3])), ValueError,
         r"head size q.shape\[-1\] must be 1..128, got 0"),
        # before: ctypes' OSError with the dynamic loader's words
        ("emu3-open-library-missing", lambda: emulator.open_library("/nonexistent/lib.so"), FileNotFoundError,
         "path '/nonexistent/lib.so': no such file"),
        ("emu3-open-library-not-a-library", lambda: emulator.open_library(Path(__file__)), ValueError,
         "is not a shared library this process can load"),
        ("emu3-open-library-int", lambda: emulator.open_library(3), TypeError, "path must be a str or os.PathLike"),
        # fourth hostile run. before: subprocess.TimeoutExpired, a str command run as one program name, "'int' object
        # is not iterable", a dict update's ValueError, AttributeErrors ("'PosixPath' object has no attribute
        # 'encode'"), pathlib's FileExistsError, the library written into the current folder for out_dir='', and
        # Python's "unsupported operand type(s) for *: 'float' and 'NoneType'"
        ("build4-run-compiler-timeout", lambda: build.run_compiler(["sleep", "5"], "sleeping", 0.2), RuntimeError,
         r"sleeping ran past its timeout=0.2 s and was stopped:\nsleep 5"),
        ("build4-run-compiler-str", lambda: build.run_compiler("g++ -c a.cpp", "g++", 10.0), TypeError,
         "cmd must be a non-empty list of str arguments"),
        ("build4-nvcc-arch-int", lambda: build.compile_sources_with_nvcc(90, "unused"), TypeError,
         "arch must be an architecture like 'sm_90', or a list of them, got int 90"),
        ("build4-nvcc-sources-int", lambda: build.compile_sources_with_nvcc("sm_90", "unused", sources=90), TypeError,
         "sources must be a list of .cu file paths, got int 90"),
        ("build4-nvcc-sources-missing", lambda: build.compile_sources_with_nvcc("sm_90", "unused",
                                                                                sources=["/nonexistent.cu"]),
         FileNotFoundError, r"sources\[0\] '/nonexistent.cu': no such file"),
        ("build4-nvcc-out-dir-file", lambda: build.compile_sources_with_nvcc("sm_90", Path(__file__)), ValueError,
         "out_dir .* is a file, not a folder"),
        ("build4-nvcc-jobs-zero", lambda: build.compile_sources_with_nvcc("sm_90", "unused", jobs=0), ValueError,
         "jobs must be positive, got 0"),
        ("emu4-build-sources-list", lambda: emulator.build(sources=["softmax.cu"]), TypeError,
         r"sources must be a dict of kernel file name -> its text, .*got list"),
        ("emu4-build-sources-path", lambda: emulator.build(sources={"softmax.cu": Path("my_softmax.cu")}), TypeError,
         r"sources\['softmax.cu'\] must be the file's text \(a str\), got PosixPath.*read the file first"),
        ("emu4-build-out-dir-file", lambda: emulator.build(out_dir=Path(__file__)), ValueError,
         "out_dir .* is a file, not a folder"),
        ("emu4-build-out-dir-empty", lambda: emulator.build(out_dir=""), ValueError, "out_dir must name a folder"),
        ("emu4-build-timeout-zero", lambda: emulator.build(timeout=0), ValueError,
         r"timeout must be in \(0.0, 604800.0\]"),
        ("naive4-gelu-tanh-none", lambda: N.gelu_tanh(None), TypeError,
         r"\bu must be a floating-point tensor, got NoneType"),
        # fifth hostile run: before, torch's RuntimeError, a KeyError, re's TypeError, subprocess's errors
        ("bench5-close-tol-negative", lambda: kbench.close(-1.0), ValueError, r"tol must be in \[0.0, inf\), got -1.0"),
        ("tour5-compare-fp16", lambda: ktour.compare("softmax", torch.ones(2), torch.ones(2), torch.float16),
         ValueError, r"dtype must be one of \[torch.float32, torch.bfloat16\] .*got torch.float16"),
        ("emu5-translate-int", lambda: emulator.translate(123), TypeError,
         r"source must be a .cu file's text \(a str\), got int 123"),
        ("build5-parse-ptxas-bytes", lambda: build.parse_ptxas("a.cu", b"Used 3 registers"), TypeError,
         "text must be the report as a str, got bytes"),
        ("build5-run-compiler-missing", lambda: build.run_compiler(["/nonexistent/cc", "-v"], "cc", 5.0),
         RuntimeError, r"cc: cannot start the program '/nonexistent/cc' \(No such file or directory\)"),
        ("build5-run-compiler-timeout-zero", lambda: build.run_compiler(["true"], "x", 0), ValueError,
         r"timeout must be in \(0.0, 604800.0\], got 0"),
        ("build5-run-compiler-timeout-str", lambda: build.run_compiler(["true"], "x", "5"), TypeError,
         "timeout must be a number, got str '5'"),
        # sixth hostile run: before, a KeyError, and a kernel name nobody knows silently dropping the exact rule
        ("bench6-format-table-empty", lambda: kbench.format_table({}), ValueError,
         r"result must be a report of run\(\) or from_report\(\), .*it lacks \['device'"),
        ("tour6-compare-kernel-unknown", lambda: ktour.compare("gemm", torch.ones(2), torch.ones(2), torch.float32),
         ValueError, r"kernel must be one of \[.*'kv_cache_write'.*\], got 'gemm'"),
        ("tour6-compare-kernel-typo", lambda: ktour.compare("kv_cache_writes", torch.ones(2), torch.ones(2),
                                                             torch.float32), ValueError, "got 'kv_cache_writes'"),
        # seventh hostile run: before, torch's "Tensor on device meta is not on the expected device cpu", a complex
        # block table silently read (the naive twin refused it), complex lengths failing in torch's min()
        ("mirror7-int8-gemv-w-meta", lambda: M.int8_gemv(XQ, WQ.to("meta"), torch.ones(5)), ValueError,
         r"\bw is a meta tensor"),
        ("naive7-int8-gemv-w-meta", lambda: N.int8_gemv(XQ, WQ.to("meta"), torch.ones(5)), ValueError,
         r"\bw is a meta tensor"),
        ("mirror7-paged-block-tables-complex", lambda: M.paged_attention_decode(
            *PAGED[:3], PAGED[3].to(torch.complex64), PAGED[4]), ValueError,
         "block_tables must have dtype int64, got torch.complex64"),
        ("mirror7-paged-context-lens-complex", lambda: M.paged_attention_decode(
            *PAGED[:4], PAGED[4].to(torch.complex64)), ValueError, "context_lens must have dtype int64"),
        ("mirror7-paged-block-tables-int32", lambda: M.paged_attention_decode(*PAGED[:3], PAGED[3].int(), PAGED[4]),
         ValueError, "block_tables must have dtype int64, got torch.int32"),  # as ops and naive take them
        ("ops7-same-device", lambda: ops.check_same_device(x=X, w=None, bias=B.to("meta")), ValueError,
         r"bias must be on x's device cpu, got meta"),
        # seventh hostile run (the llama.cpp formatters' class, here too): before, KeyError 'rows', max() of nothing
        ("bench7-quotes-empty", lambda: kbench.quotes({}), ValueError,
         r"report must be a report holding \['rows'\]; it lacks \['rows'\]"),
        ("bench7-quotes-str", lambda: kbench.quotes("results.json"), TypeError, "report must be a report dict, got str"),
        ("bench7-ladder-row-lacks", lambda: kbench.ladder_table({"rows": [{"kernel": "softmax"}]}), ValueError,
         r"report\['rows'\]\[0\] must be a row holding .*; it lacks \['version', 'shape'"),
        ("bench7-register-quotes-no-kernels", lambda: kbench.quotes({"archs": ["sm_90"], "kernels": [], "nvcc": "13.0",
                                                                      "cpu": "x"}), ValueError,
         r"report\['kernels'\] is empty"),
        # eighth hostile run: before, a sparse scale gave wrong numbers (max error 913), other sparse tensors, mixed
        # dtypes in attend_tile and pools torch cannot write in place failed inside torch, naming nothing
        ("naive8-int8-gemv-scale-sparse", lambda: N.int8_gemv(XQ, WQ, torch.rand(5).to_sparse()), TypeError,
         r"^scale must be a strided \(dense\) tensor, got a torch.sparse_coo one of shape \(5,\)"),
        ("mirror8-int8-gemv-x-sparse", lambda: M.int8_gemv(XQ.to_sparse(), WQ, torch.rand(5)), TypeError,
         r"^x must be a strided \(dense\) tensor"),
        ("naive8-softmax-x-sparse", lambda: N.softmax(X.to_sparse()), TypeError, r"^x must be a strided"),
        ("naive8-kv-write-slots-sparse", lambda: N.kv_cache_write(KEY, KEY.clone(), *POOLS(),
                                                                  torch.tensor([0, 1, 2]).to_sparse()), TypeError,
         r"^slot_mapping must be a strided \(dense\) tensor"),
        ("emu8-kv-write-key-sparse", lambda: emulator.kv_cache_write(KEY.to_sparse(), KEY.clone(), *POOLS(),
                                                                     torch.tensor([0, 1, 2])), TypeError,
         r"^key must be a strided \(dense\) tensor"),
        ("mirror8-tile-v-float64", lambda: M.attend_tile(*state, torch.randn(2, 5), V.double()), TypeError,
         r"^v must have m's dtype torch.float32 \(one state, one precision\), got torch.float64"),
        ("mirror8-tile-m-float64", lambda: M.attend_tile(state[0].double(), *state[1:], torch.randn(2, 5), V),
         TypeError, r"^l must have m's dtype torch.float64 .*got torch.float32"),
        ("naive8-kv-write-k-pool-expanded", lambda: N.kv_cache_write(
            KEY, KEY.clone(), torch.zeros(1, 2, 2, 8).expand(4, 2, 2, 8), torch.zeros(4, 2, 2, 8),
            torch.tensor([0, 1, 2])), ValueError, r"^k_pool is expanded \(shape \(4, 2, 2, 8\), strides \(0,"),
        ("mirror8-kv-write-k-pool-expanded", lambda: M.kv_cache_write(
            KEY, KEY.clone(), torch.zeros(1, 2, 2, 8).expand(4, 2, 2, 8), torch.zeros(4, 2, 2, 8),
            torch.tensor([0, 1, 2])), ValueError, r"^k_pool is expanded"),
        ("mirror8-kv-write-v-pool-inference", lambda: M.kv_cache_write(
            KEY, KEY.clone(), torch.zeros(4, 2, 2, 8), torch.inference_mode()(lambda: torch.zeros(4, 2, 2, 8))(),
            torch.tensor([0, 1, 2])), ValueError, r"^v_pool is an inference tensor"),
        ("naive8-kv-write-k-pool-param", lambda: N.kv_cache_write(
            KEY, KEY.clone(), torch.nn.Parameter(torch.zeros(4, 2, 2, 8)), torch.zeros(4, 2, 2, 8),
            torch.tensor([0, 1, 2])), ValueError, r"^k_pool requires grad"),
        # the CUDA wrappers read raw memory as the emulator does: a negative view would be computed as +x
        ("ops8-softmax-x-negative-view", lambda: ops.softmax(torch._neg_view(X)), ValueError,
         r"^x is a negative \(or conjugate\) view"),
        ("ops8-int8-gemv-scale-negative-view", lambda: ops.int8_gemv(XQ, WQ, torch._neg_view(torch.rand(5))),
         ValueError, r"^scale is a negative \(or conjugate\) view"),
        # ninth hostile run: nested tensors report layout strided, qint8/uint64 tables pass an integer check, and a
        # channels_last pool cannot be viewed as (nb * bs, nh, hs); all refused by name before torch sees them
        ("naive9-int8-gemv-w-nested", lambda: N.int8_gemv(XQ, torch.nested.nested_tensor([WQ]), torch.rand(5)),
         TypeError, r"^w must be a dense tensor"),
        ("mirror9-int8-gemv-w-nested", lambda: M.int8_gemv(XQ, torch.nested.nested_tensor([WQ]), torch.rand(5)),
         TypeError, r"^w must be a dense tensor"),
        ("naive9-layernorm-x-nested", lambda: N.layernorm(torch.nested.nested_tensor([X]), W, B), TypeError,
         r"^x must be a dense tensor"),
        ("mirror9-paged-gather-table-uint64", lambda: M.paged_gather(KP, torch.tensor([1, 0], dtype=torch.uint64), 3),
         TypeError, r"^block_table has dtype torch.uint64"),
        ("mirror9-paged-gather-table-qint8", lambda: M.paged_gather(
            KP, torch.quantize_per_tensor(torch.tensor([1.0, 0.0]), 1.0, 0, torch.qint8), 3), TypeError,
         r"^block_table must be an ordinary \(not quantized\) tensor"),
        ("naive9-kv-write-k-pool-channels-last", lambda: N.kv_cache_write(
            KEY, KEY.clone(), torch.zeros(4, 2, 2, 8).contiguous(memory_format=torch.channels_last),
            torch.zeros(4, 2, 2, 8), torch.tensor([0, 1, 2])), ValueError, r"^k_pool must be contiguous"),
        ("naive9-kv-write-v-pool-channels-last", lambda: N.kv_cache_write(
            KEY, KEY.clone(), torch.zeros(4, 2, 2, 8),
            torch.zeros(4, 2, 2, 8).contiguous(memory_format=torch.channels_last), torch.tensor([0, 1, 2])),
         ValueError, r"^v_pool must be contiguous"),
        ("ops9-tensors-overlap-list", lambda: ops.tensors_overlap([1], XQ), TypeError, r"a must be a torch.Tensor"),
        ("ops9-check-slot-range-num-slots-bool", lambda: ops.check_slot_range(torch.tensor([0]), True), TypeError,
         r"^num_slots must be an int"),
    ]


MIRROR_BAD = _mirror_bad_calls()


@pytest.mark.parametrize("call, err, match", [c[1:] for c in MIRROR_BAD], ids=[c[0] for c in MIRROR_BAD])
def test_the_mirrors_refuse_bad_arguments_naming_them(call, err, match):
    assert_refused_by_minillm(call, err, match)


def _compile_mirror_bad_calls():
    from minillm.compile import bench as cbench
    from minillm.compile import sweep
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.compile.mirror import decode_step_by_hand, gemv_blocked
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.cache import ContiguousKVCache
    from minillm.compile import aot, llamacpp, llamacpp_build
    from minillm.compile.decode import counting_backend
    from minillm.compile.cpu_gemv import int4_gemv, int8_gemv
    from minillm.kvcache.generate import generate_ids
    from minillm.quant.linear import QuantConfig, quantize_model
    from minillm.quant.qat import prepare_qat

    x, w, b = torch.randn(2, 8), torch.randn(6, 8), torch.randn(6)
    model = GPT(TINY).eval()
    cache = ContiguousKVCache(TINY, 1, 8)
    k, v = cache.k, cache.v
    quantized = quantize_model(model, QuantConfig("int8"))
    int8_head = quantize_model(model, QuantConfig("int8", quantize_head=True))
    w8a8 = quantize_model(model, QuantConfig("w8a8"))
    qat = prepare_qat(copy.deepcopy(model), QuantConfig("int8"))
    PREFILL = (sweep.Case("prefill", 1, 4),)

    def static_step(*positions: list[int], batch_size: int = 1) -> None:
        """Steps of a fresh StaticDecoder at these positions (one list per step, one position per row)."""
        dec = StaticDecoder(model, "eager", max_len=8, batch_size=batch_size)
        for pos in positions:
            dec(model, dec.cache, torch.ones(batch_size, dtype=torch.long), torch.tensor(pos))
    return [
        ("gemv_blocked-int-x", lambda: gemv_blocked(x.long(), w, b), TypeError, r"\bx\b"),
        ("gemv_blocked-bool-x", lambda: gemv_blocked(x.bool(), w, b), TypeError, r"\bx\b"),
        ("gemv_blocked-1d-x", lambda: gemv_blocked(x.reshape(-1), w, b), TypeError, r"\bx\b"),
        ("gemv_blocked-list-w", lambda: gemv_blocked(x, w.tolist(), b), TypeError, r"\bw\b"),
        ("gemv_blocked-bias-shape", lambda: gemv_blocked(x, w, b[:2]), ValueError, "agree"),
        ("gemv_blocked-k-mismatch", lambda: gemv_blocked(x, w[:, :3], b), ValueError, "agree"),
        ("decode_step_by_hand-token-out-of-range", lambda: decode_step_by_hand(model, k, v, 512, 0, 0), ValueError,
         "token"),
        ("decode_step_by_hand-slot-out-of-range", lambda: decode_step_by_hand(model, k, v, 1, 0, 8), ValueError,
         "slot"),
        ("decode_step_by_hand-float-token", lambda: decode_step_by_hand(model, k, v, 1.0, 0, 0), TypeError, "token"),
        ("decode_step_by_hand-short-cache", lambda: decode_step_by_hand(model, k[:1], v, 1, 0, 0), ValueError,
         r"\bk\b"),
        ("StaticDecoder-unknown-backend", lambda: StaticDecoder(model, mode="compile", backend="nope"), ValueError,
         "backend"),
        # before: a quantized model's AttributeError, torch's "expected scalar type Long", and k is v silently
        # writing each value over its key (other logits from the second step on)
        ("decode_step_by_hand-quantized-model", lambda: decode_step_by_hand(quantized, k, v, 1, 0, 0), TypeError,
         r"model \(QuantizedGPT\) has transformer.h.0.attn.c_attn = QuantLinear"),
        ("decode_step_by_hand-int-cache", lambda: decode_step_by_hand(model, [t.long() for t in k], v, 1, 0, 0),
         TypeError, r"k\[0\] has dtype torch.int64; the cache must have the model's dtype torch.float32"),
        ("decode_step_by_hand-k-is-v", lambda: decode_step_by_hand(model, k, k, 1, 0, 0), ValueError,
         r"k\[0\] and v\[0\] share memory"),
        ("decode_step_by_hand-one-tensor-twice", lambda: decode_step_by_hand(model, [k[0], k[0]], v, 1, 0, 0),
         ValueError, r"k\[0\] and k\[1\] share memory"),
        ("decode_step_by_hand-layers-disagree", lambda: decode_step_by_hand(model, [k[0], k[1][:, :, :4]], v, 1, 0, 0),
         ValueError, r"k\[1\] must be \(1, nh=2, max_len, hs=16\) like k\[0\]"),
        ("decode_step_by_hand-cache-not-list", lambda: decode_step_by_hand(model, k[0], v, 1, 0, 0), TypeError,
         r"\bk\b must be a list"),
        # before: max_len=10**15 reached the allocator; positions other than the cache length ran silently
        ("StaticDecoder-max-len-past-window", lambda: StaticDecoder(model, "eager", max_len=10**15), ValueError,
         r"max_len=1000000000000000 is past the model's context window block_size=64"),
        ("StaticDecoder-max-len-bool", lambda: StaticDecoder(model, "eager", max_len=True), TypeError, "max_len"),
        ("FusedCPUDecoder-max-len-past-window", lambda: FusedCPUDecoder(model, max_len=65), ValueError,
         "max_len=65 is past"),
        ("StaticDecoder-first-position-not-zero", lambda: static_step([5]), ValueError,
         r"positions \[5\] are not the cache length 0"),
        ("StaticDecoder-position-repeated", lambda: static_step([0], [0]), ValueError,
         r"positions \[0\] are not the cache length 1"),
        ("StaticDecoder-batch-positions-disagree", lambda: static_step([0, 1], batch_size=2), ValueError,
         r"positions \[0, 1\] are not the cache length 0"),
        # before: "max() arg is an empty sequence" and an IndexError inside torch's embedding
        ("sweep.run_case-steps-zero", lambda: sweep.run_case(model, sweep.Case("decode", 1, 4), steps=0, repeats=1,
                                                            backend="eager"), ValueError, "steps must be positive"),
        ("sweep.run_case-past-window", lambda: sweep.run_case(model, sweep.Case("decode", 1, 60), steps=8, repeats=1,
                                                              backend="eager"), ValueError,
         r"60 context tokens \+ steps=8 = 68 positions, past the model's context window block_size=64"),
        ("sweep.run_case-long-prefill", lambda: sweep.run_case(model, sweep.Case("prefill", 1, 65), repeats=1,
                                                               backend="eager"), ValueError, "block_size=64"),
        ("sweep.run_sweep-past-window", lambda: sweep.run_sweep(model, threads=(1,), steps=1, repeats=1,
                                                                cases=(sweep.Case("decode", 1, 64),), backend="eager"),
         ValueError, "block_size=64"),
        # third hostile run. before: "'int' object is not iterable", torch's set_num_threads RuntimeError for True,
        # dynamo's InvalidBackend from a prefill case (decode cases checked it), torch's "manual_seed expected a
        # long", a ZeroDivisionError, AttributeErrors for a model name given as the model
        ("sweep3-threads-int", lambda: sweep.run_sweep(model, threads=2, cases=PREFILL, repeats=1, backend="eager"),
         TypeError, "threads must be a non-empty list or tuple, got int 2"),
        ("sweep3-threads-bool", lambda: sweep.run_sweep(model, threads=(True,), cases=PREFILL, repeats=1,
                                                        backend="eager"), TypeError,
         r"threads\[0\] must be an int, got bool True"),
        ("sweep3-cases-one-case", lambda: sweep.run_sweep(model, threads=(1,), cases=PREFILL[0], backend="eager"),
         TypeError, "cases must be a non-empty list or tuple, got Case"),
        ("sweep3-prefill-backend-unknown", lambda: sweep.run_case(model, PREFILL[0], repeats=1, backend="nope"),
         ValueError, "backend must be one of torch.compile's backends .*got 'nope'"),
        ("sweep3-sweep-backend-unknown", lambda: sweep.run_sweep(model, threads=(1,), cases=PREFILL, backend="nope"),
         ValueError, "got 'nope'"),
        ("sweep3-seed-float", lambda: sweep.run_case(model, sweep.Case("decode", 1, 4), steps=2, repeats=1,
                                                     backend="eager", seed=0.5), TypeError,
         "seed must be an int, got float 0.5"),
        ("profile3-top-negative", lambda: sweep.profile_decode(model, sweep.Case("decode", 1, 4), steps=2,
                                                               backend="eager", top=-1), ValueError,
         "top must be positive, got -1"),
        ("profile3-top-str", lambda: sweep.profile_decode(model, sweep.Case("decode", 1, 4), steps=2, backend="eager",
                                                          top="3"), TypeError, "top must be an int, got str '3'"),
        ("cbench3-streaming-calls-zero", lambda: cbench.weight_streaming_bound(model, repeats=1, calls=0), ValueError,
         "calls must be positive, got 0"),
        ("cbench3-streaming-ways-model-str", lambda: cbench.streaming_ways("base"), TypeError,
         r"streaming_ways \(model\) needs a minillm GPT .*got str"),
        ("cbench3-run-all-model-str", lambda: cbench.run_all("base", False, quick=True), TypeError,
         r"run_all \(model\) needs a minillm GPT .*got str"),
        ("cbench3-run-all-real-text-str", lambda: cbench.run_all(model, "yes", quick=True), TypeError,
         "real_text must be a bool, got str 'yes'"),
        # reviewed as clear, but the message named the decoder's own kv_cache (chapter 04's argument), not max_len
        ("static3-max-len-1-two-tokens", lambda: StaticDecoder(model, "eager", max_len=1).generate_ids(
            [5], SamplingParams.greedy(2)), ValueError,
         r"max_len=1 is too short for this request: a 1-token prompt and max_new_tokens=2 need 2 cache slots"),
        # fourth hostile run. before: dynamo's InvalidBackend from inside torch (and an int name taken), a dynamo
        # UserError at the first compiled step of a model holding a layer it cannot trace, the decoder's max_len
        # named for a prefill case given to profile_decode, numbers out of junk (tokens=-5 gave a negative tok/s),
        # pathlib and subprocess errors for a str command, an unknown GGUF type run through the converter
        ("decode4-counting-backend-unknown", lambda: counting_backend("nope", lambda: None), ValueError,
         r"name must be one of torch.compile's backends \[.*'eager'.*\], got 'nope'"),
        ("decode4-counting-backend-int", lambda: counting_backend(3, lambda: None), TypeError,
         "name must be a torch.compile backend name"),
        ("decode4-counting-backend-on-graph-none", lambda: counting_backend("eager", None), TypeError,
         "on_graph must be a function"),
        ("static4-compile-int8-head", lambda: StaticDecoder(int8_head, "compile", backend="aot_eager"), ValueError,
         r"mode 'compile' cannot trace this model's transformer.wte = QuantEmbedding.*use mode 'eager'"),
        ("static4-compile-w8a8", lambda: StaticDecoder(w8a8, "compile", backend="aot_eager"), ValueError,
         r"transformer.h.0.attn.c_attn = QuantLinear\(mode='w8a8', use_int_mm=True"),
        ("static4-compile-qat", lambda: StaticDecoder(qat, "compile", backend="aot_eager"), ValueError,
         "transformer.h.0.attn.c_attn = FakeQuantLinear"),
        ("by-hand4-qat-model", lambda: decode_step_by_hand(qat, k, v, 1, 0, 0), TypeError,
         r"decode_step_by_hand needs .*transformer.h.0.attn.c_attn = FakeQuantLinear"),
        ("profile4-prefill-case", lambda: sweep.profile_decode(model, sweep.Case("prefill", 1, 60), steps=8,
                                                               backend="eager"), ValueError,
         r"profile_decode profiles decode steps: case must be a decode Case, got 'prefill, T = 60'"),
        ("llamacpp4-ours-tokens-negative", lambda: llamacpp.ours_tok_s(lambda: None, -5), ValueError,
         "tokens must be positive, got -5"),
        ("llamacpp4-ours-tokens-nan", lambda: llamacpp.ours_tok_s(lambda: None, float("nan")), TypeError,
         "tokens must be an int, got float nan"),
        ("llamacpp4-ours-run-none", lambda: llamacpp.ours_tok_s(None, 8), TypeError, "run must be a function"),
        ("llamacpp4-bench-threads-negative", lambda: llamacpp.llama_bench_tok_s(sys.executable, Path(__file__), -1,
                                                                                8), ValueError,
         "threads must be positive, got -1"),
        ("llamacpp4-bench-tokens-str", lambda: llamacpp.llama_bench_tok_s(sys.executable, Path(__file__), 1, "8"),
         TypeError, "tokens must be an int, got str '8'"),
        ("llamacpp4-bench-gguf-missing", lambda: llamacpp.llama_bench_tok_s(sys.executable, "/nonexistent.gguf", 1,
                                                                            8), FileNotFoundError,
         "gguf '/nonexistent.gguf': no such file"),
        ("llb4-convert-unknown-type", lambda: llamacpp_build.convert("tree", "hf", "bogus", "out.gguf"), ValueError,
         r"outtype must be one of \('f32', 'f16', 'q8_0'\), got 'bogus'"),
        ("llb4-run-logged-str", lambda: llamacpp_build.run_logged("echo hi"), TypeError,
         "cmd must be a non-empty list of str arguments, .*got str 'echo hi'"),
        ("llb4-build-target-not-a-tree", lambda: llamacpp_build.build_target(str(ROOT / "no-such-tree"),
                                                                             "llama-bench"), ValueError,
         "tree '.*no-such-tree' is not a llama.cpp source tree"),
        ("llb4-build-target-path-name", lambda: llamacpp_build.build_target(str(ROOT), "../x"), ValueError,
         "target must be a cmake target name"),
        ("llb4-fetch-sources-int-sdist", lambda: llamacpp_build.fetch_sources(str(ROOT / "no-such-work"), 3),
         TypeError, "sdist must be a str or os.PathLike"),
        # fifth hostile run: before, min() of nothing, an unpacking error, a converter child started on a folder,
        # subprocess's and pathlib's FileNotFoundError (after the command ran), an AttributeError
        ("bench5-bound-empty-ways", lambda: cbench.weight_streaming_bound(model, 1, 1, ways=({}, 0)), TypeError,
         r"ways must be None or \(\{way: run\(steps\)\}, bytes\) with at least one way, .*got tuple \(\{\}, 0\)"),
        ("bench5-bound-ways-str", lambda: cbench.weight_streaming_bound(model, 1, 1, ways="fast"), TypeError,
         "ways must be None or .*got str 'fast'"),
        ("llb5-convert-out-dir", lambda: llamacpp_build.convert(str(ROOT), str(ROOT), "f32", str(ROOT)), ValueError,
         "out '.*' is a directory"),
        ("llb5-convert-not-a-tree", lambda: llamacpp_build.convert("/nonexistent/tree", "/nonexistent/hf", "q8_0",
                                                                   str(ROOT / "no-such.gguf")), ValueError,
         r"tree '/nonexistent/tree' is not a llama.cpp source tree \(no convert_hf_to_gguf.py\)"),
        ("llb5-run-logged-cwd-missing", lambda: llamacpp_build.run_logged(["true"], cwd="/nonexistent/dir"),
         ValueError, "cwd '/nonexistent/dir' is not a folder"),
        ("llb5-run-logged-log-dir-missing", lambda: llamacpp_build.run_logged(["true"], log="/nonexistent/dir/l.txt"),
         ValueError, "log '/nonexistent/dir/l.txt': its folder '/nonexistent/dir' does not exist"),
        ("llb5-run-logged-program-missing", lambda: llamacpp_build.run_logged(["/nonexistent/prog"]), RuntimeError,
         "cmd: cannot start the program '/nonexistent/prog'"),
        ("llb5-recover-merges-str", lambda: llamacpp_build.recover_merges("ab"), TypeError,
         "ranks must be a dict of bytes -> int rank .*got str 'ab'"),
        # sixth hostile run: before, sampling params ran and reported identical=False (two samplers' draws)
        ("bench6-pruned-fused-params-sampling", lambda: cbench.pruned_fused(
            model, [1, 2, 3], SamplingParams(max_new_tokens=4, temperature=1.0), repeats=1), ValueError,
         r"params must be greedy \(temperature 0\): pruned_fused compares greedy tokens, got temperature=1.0"),
        ("bench6-pruned-fused-params-str", lambda: cbench.pruned_fused(model, [1, 2, 3], "greedy", repeats=1),
         TypeError, "params must be greedy SamplingParams, got str 'greedy'"),
        # sixth hostile run: before, '/' of a str, a negative GB/s, merges from two tokens of one rank, a hooked model
        # compiled (its hook run by the prefill only) and models flipped to eval mode for good
        ("bench6-bound-bytes-str", lambda: cbench.weight_streaming_bound(model, 1, 1, ways=({"x": lambda s: None},
                                                                                        "many")), TypeError,
         r"ways\[1\] \(the matrices' bytes\) must be an int, got str 'many'"),
        ("bench6-bound-bytes-negative", lambda: cbench.weight_streaming_bound(model, 1, 1, ways=({"x": lambda s: None},
                                                                                            -5)), ValueError,
         r"ways\[1\] \(the matrices' bytes\) must be positive, got -5"),
        ("llb6-recover-merges-dup-ranks", lambda: llamacpp_build.recover_merges({b"a": 0, b"b": 0, b"ab": 1}),
         ValueError, r"ranks must give each token its own rank \(a merge order\), but b'a' and b'b' both have rank 0"),
        ("static6-compile-hooked-model", lambda: StaticDecoder(_zero_mlp_hook(GPT(TINY).eval()), "compile",
                                                               backend="eager"), ValueError,
         r"mode 'compile' builds the step once .*model's transformer.h.1.mlp has one: .*use mode 'eager'"),
        ("sweep6-training-model", lambda: sweep.run_case(GPT(TINY).train(), sweep.Case("decode", 1, 4), steps=2,
                                                          repeats=1, backend="eager"), ValueError,
         "the compile sweep runs the model in eval mode, but the model is in training mode"),
        ("bench6-run-all-training", lambda: cbench.run_all(GPT(TINY).train(), False, quick=True), ValueError,
         r"run_all runs the model in eval mode, .*call model.eval\(\) first"),
        ("bench6-streaming-ways-int8", lambda: cbench.streaming_ways(quantized), TypeError,  # the fused step takes
         r"streaming_ways needs a model of plain .*transformer.h.0.attn.c_attn = QuantLinear"),  # int8 since run 6
        # seventh hostile run: before, the allocator's "can't allocate memory" (4 TB), KeyErrors from the report
        # formatters, count=True taken as 1, torch's device error
        ("static7-batch-size-huge", lambda: StaticDecoder(model, "eager", batch_size=10**9), ValueError,
         r"batch_size x max_len ask for a tensor of shape \(1000000000, 2, 64, 16\)"),
        ("static7-batch-size-float", lambda: StaticDecoder(model, "eager", batch_size=2.0), TypeError,
         "batch_size must be an int, got float 2.0"),
        ("sweep7-decode-batch-huge", lambda: sweep.run_case(model, sweep.Case("decode", 10**9, 4), steps=2, repeats=1,
                                                            backend="eager"), ValueError,
         r"case.batch x case.tokens ask for a tensor of shape \(1000000000,"),
        ("sweep7-prefill-batch-huge", lambda: sweep.run_case(model, sweep.Case("prefill", 10**8, 8), repeats=1,
                                                             backend="eager"), ValueError,
         r"case.batch x case.tokens ask for a tensor of shape \(100000000, 8, 128\)"),
        ("intids7-count-bool", lambda: integer_ids("ids", torch.tensor([1]), True), TypeError,
         "count must be an int, got bool True"),
        ("cmirror7-gemv-blocked-w-meta", lambda: gemv_blocked(x, w.to("meta"), b), ValueError, r"\bw is a meta tensor"),
        ("lc7-format-table-empty", lambda: llamacpp.format_table({}), ValueError,
         r"median must hold 'llama.cpp f32', the rate every other path is a fraction of; it has \[\]"),
        ("lc7-format-table-nan", lambda: llamacpp.format_table({llamacpp.REF: 10.0, "ours": float("nan")}), ValueError,
         r"median\['ours'\] must be a finite number in \(0.0, inf\), got nan"),
        ("lc7-format-table-str", lambda: llamacpp.format_table({llamacpp.REF: 10.0, "ours": "fast"}), TypeError,
         r"median\['ours'\] must be a number, got str 'fast'"),
        ("lc7-format-table-list", lambda: llamacpp.format_table([1.0]), TypeError,
         "median must be a dict of path -> tok/s, got list"),
        ("lc7-format-rounds-empty-list", lambda: llamacpp.format_rounds({llamacpp.REF: []}), ValueError,
         r"samples\['llama.cpp f32'\] must hold at least one value"),
        ("lc7-format-rounds-no-ref", lambda: llamacpp.format_rounds({"ours": [1.0]}), ValueError,
         r"samples must hold 'llama.cpp f32''s rounds; it has \['ours'\]"),
        ("lc7-format-rounds-ragged", lambda: llamacpp.format_rounds({llamacpp.REF: [1.0, 2.0], "ours": [1.0]}),
         ValueError, r"samples\['ours'\] has 1 rounds, the paths before it 2"),
        ("lc7-quotes-empty", lambda: llamacpp.quotes({}), ValueError,
         r"report must be a report of `main --json`, .*it lacks \['median_tok_s', 'samples'"),
        ("lc7-quotes-str", lambda: llamacpp.quotes("report.json"), TypeError,
         "report must be a report dict, got str 'report.json' \\(quotes reads what"),
        ("lc7-quotes-no-eager", lambda: llamacpp.quotes(
            {"median_tok_s": {f"llama.cpp {t}": 1.0 for t in llamacpp.TYPES},
             "samples": {f"llama.cpp {t}": [1.0] for t in llamacpp.TYPES}, "rounds": 1, "threads": 1, "tokens": 8,
             "model": "base", "cpu": "x", "llama_cpp": "y"}), ValueError,
         r"report\['median_tok_s'\] lacks the paths \['minillm eager \(generate_ids\)', 'minillm fused C\+\+ step'\]"),
        ("sweep7-quotes-empty", lambda: sweep.quotes({}), ValueError,
         r"report must be a report holding \['rows'\]; it lacks \['rows'\]"),
        ("sweep7-quotes-no-rows", lambda: sweep.quotes({"rows": []}), ValueError, r"report\['rows'\] is empty"),
        ("sweep7-table-row-lacks", lambda: sweep.sweep_table({"rows": [{"case": "x"}]}), ValueError,
         r"report\['rows'\]\[0\] must be a row holding .*; it lacks \['kind', 'batch'"),
        ("sweep7-table-rows-dict", lambda: sweep.sweep_table({"rows": {}}), TypeError,
         r"report\['rows'\] must be a list of rows, got dict"),
        ("aot7-quotes-empty", lambda: aot.quotes({}), ValueError, r"report must be a report holding \['rows'\]"),
        ("aot7-format-table-list", lambda: aot.format_table([]), TypeError, "report must be a report dict, got list"),
        ("aot7-quotes-two-rows", lambda: aot.quotes(
            {"build_seconds": 1.0, "package_mb": 2.0, "rows": [dict.fromkeys(aot.ROW_KEYS, 1.0)] * 2}), ValueError,
         r"report\['rows'\] must hold one row per path, 5 \(eager, compile_cold"),
        # eighth hostile run: before, torch's "more than one element of the written-to tensor refers to a single
        # memory location", sparse tensors failing inside torch, and a hooked model exported without a word
        ("cmirror8-dsbh-k-expanded", lambda: decode_step_by_hand(model, [t[:, :1].expand_as(t) for t in k], v, 1, 0,
                                                                 0), ValueError, r"^k\[0\] is expanded"),
        ("cmirror8-dsbh-v-sparse", lambda: decode_step_by_hand(model, k, [t.to_sparse() for t in v], 1, 0, 0),
         TypeError, r"^v\[0\] must be a strided \(dense\) tensor"),
        ("cmirror8-gemv-blocked-w-sparse", lambda: gemv_blocked(x, w.to_sparse(), b), TypeError,
         r"^w must be a strided \(dense\) tensor"),
        ("aot8-export-hooked", lambda: (lambda m: (m.transformer.h[0].attn.register_forward_hook(lambda *a: None),
                                                   aot.export_decode_step(m, "/nonexistent/h.pt2")))(
            copy.deepcopy(model)), ValueError, r"^model's transformer.h.0.attn has a forward hook"),
        # ninth hostile run (helper B): FusedCPUDecoder.prefill decoded a changed or hooked model's stale snapshot
        # (silent) and let non-tensors, out-of-vocabulary ids and prompts past the window reach torch; chapter 04's
        # generate took any prefill_fn result; round_costs checked nothing (rows=10**30 hung); step_bytes,
        # quantized_fused's group, the int4/int8 GEMV's inf scale, the "tvm" backend without TVM
        ("fused9-prefill-model-changed", lambda: (lambda m: (lambda d: (
            setattr(m.transformer.h[0].mlp, "c_fc", torch.nn.Linear(32, 128)),
            d.prefill(m, d.cache, torch.tensor([[1, 2]]), torch.arange(2))))(FusedCPUDecoder(m)))(copy.deepcopy(model)),
         ValueError, "was changed since this FusedCPUDecoder was built"),
        ("fused9-prefill-hooked", lambda: (lambda m: (lambda d: (
            m.transformer.h[0].register_forward_hook(lambda *a: None),
            d.prefill(m, d.cache, torch.tensor([[1, 2]]), torch.arange(2))))(FusedCPUDecoder(m)))(copy.deepcopy(model)),
         ValueError, "cannot run forward hooks"),
        ("fused9-prefill-ids-list", lambda: (lambda d: d.prefill(model, d.cache, [[1, 2]], torch.arange(2)))(
            FusedCPUDecoder(model)), TypeError, r"^ids must be an integer tensor, got list"),
        ("fused9-prefill-ids-bool", lambda: (lambda d: d.prefill(model, d.cache, torch.ones(1, 2, dtype=torch.bool),
                                                                 torch.arange(2)))(FusedCPUDecoder(model)),
         TypeError, r"^ids must be an integer tensor, got torch.bool"),
        ("fused9-prefill-ids-meta", lambda: (lambda d: d.prefill(model, d.cache, torch.ones(1, 2, dtype=torch.long,
                                                                                            device="meta"),
                                                                 torch.arange(2)))(FusedCPUDecoder(model)),
         ValueError, r"^ids is a meta tensor"),
        ("fused9-prefill-positions-range", lambda: (lambda d: d.prefill(model, d.cache, torch.tensor([[1, 2]]),
                                                                        range(2)))(FusedCPUDecoder(model)),
         TypeError, r"^positions must be an integer tensor, got range"),
        ("fused9-prefill-long-oov", lambda: (lambda d: d.prefill(model, d.cache, torch.tensor([[*range(20), 600]]),
                                                                 torch.arange(21)))(FusedCPUDecoder(model)),
         ValueError, r"^ids must be token ids in \[0, vocab_size=512\), got 600"),
        ("fused9-prefill-past-window", lambda: (lambda d: d.prefill(model, d.cache, torch.ones(1, 9, dtype=torch.long),
                                                                    torch.arange(9)))(FusedCPUDecoder(model, 8)),
         ValueError, r"^ids must hold 1 to max_len=8 tokens"),
        ("gen9-prefill-fn-1d", lambda: generate_ids(model, [1, 2], SamplingParams.greedy(2),
                                                    prefill_fn=lambda *a: torch.zeros(512)), ValueError,
         r"^prefill_fn's result \(logits\) must have 2 dimensions"),
        ("gen9-prefill-fn-list", lambda: generate_ids(model, [1, 2], SamplingParams.greedy(2),
                                                      prefill_fn=lambda *a: [0.0] * 512), TypeError,
         r"^prefill_fn's result \(logits\) must be a floating-point tensor, got list"),
        ("gen9-prefill-fn-wider", lambda: generate_ids(model, [1, 2], SamplingParams.greedy(2),
                                                       prefill_fn=lambda *a: torch.zeros(1, 513)), ValueError,
         r"^prefill_fn must return logits \(1, vocab_size=512\), got \(1, 513\)"),
        ("gen9-prefill-fn-two-rows", lambda: generate_ids(model, [1, 2], SamplingParams.greedy(2),
                                                          prefill_fn=lambda *a: torch.zeros(2, 512)), ValueError,
         r"^prefill_fn must return logits \(1, vocab_size=512\), got \(2, 512\)"),
        ("gen9-prefill-fn-no-cache-write", lambda: generate_ids(model, [1, 2], SamplingParams.greedy(2),
                                                                prefill_fn=lambda *a: torch.zeros(1, 512)),
         ValueError, r"^prefill_fn must write the prompt's 2 tokens' K/V to the cache, but the cache holds 0"),
        ("rc9-rows-zero", lambda: cbench.round_costs(FusedCPUDecoder(model), FusedCPUDecoder(model), 0, 4, 1, 2),
         ValueError, r"^rows must be positive, got 0"),
        ("rc9-rows-huge", lambda: cbench.round_costs(FusedCPUDecoder(model), FusedCPUDecoder(model), 10**30, 4, 1, 2),
         ValueError, r"^rows must be in \[1, MAX_VERIFY=16\]"),
        ("rc9-rows-bool", lambda: cbench.round_costs(FusedCPUDecoder(model), FusedCPUDecoder(model), True, 4, 1, 2),
         TypeError, r"^rows must be an int, got bool"),
        ("rc9-context-negative", lambda: cbench.round_costs(FusedCPUDecoder(model), FusedCPUDecoder(model), 2, -3, 1,
                                                            2), ValueError, r"^context must be non-negative"),
        ("rc9-context-none", lambda: cbench.round_costs(FusedCPUDecoder(model), FusedCPUDecoder(model), 2, None, 1, 2),
         TypeError, r"^context must be an int"),
        ("rc9-context-no-room", lambda: cbench.round_costs(FusedCPUDecoder(model, 8), FusedCPUDecoder(model), 2, 7, 1,
                                                           2), ValueError, r"^context must leave room .* at most 6"),
        ("rc9-calls-zero", lambda: cbench.round_costs(FusedCPUDecoder(model), FusedCPUDecoder(model), 2, 4, 1, 0),
         ValueError, r"^calls must be positive"),
        ("rc9-repeats-float", lambda: cbench.round_costs(FusedCPUDecoder(model), FusedCPUDecoder(model), 2, 4, 1.5, 2),
         TypeError, r"^repeats must be an int"),
        ("rc9-target-gpt", lambda: cbench.round_costs(model, FusedCPUDecoder(model), 2, 4, 1, 2), TypeError,
         r"^target must be a FusedCPUDecoder, got GPT"),
        ("rc9-draft-none", lambda: cbench.round_costs(FusedCPUDecoder(model), None, 2, 4, 1, 2), TypeError,
         r"^draft must be a FusedCPUDecoder, got NoneType"),
        ("rc9-target-model-changed", lambda: (lambda m: (lambda d: (m.half(), cbench.round_costs(
            d, FusedCPUDecoder(model), 2, 4, 1, 2)))(FusedCPUDecoder(m)))(copy.deepcopy(model)), ValueError,
         "was changed since this FusedCPUDecoder was built"),
        ("bench9-step-bytes-str", lambda: cbench.step_bytes("model"), TypeError,
         r"^step_bytes \(model\) needs a minillm GPT"),
        ("bench9-quantized-fused-odd-width", lambda: cbench.quantized_fused(
            GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=1, n_embd=5)).eval(), [1, 2],
            SamplingParams.greedy(2), repeats=1), ValueError, r"even group size .* widths \[5, 20\]"),
        ("gemv9-int4-inf-scale", lambda: int4_gemv(torch.randn(2, 8), torch.zeros(4, 4, dtype=torch.uint8),
                                                   torch.tensor([[1.0, 1.0]] * 3 + [[float("inf"), 1.0]])),
         ValueError, r"^scale must hold finite values, got inf"),
        ("gemv9-int8-nan-scale", lambda: int8_gemv(torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8),
                                                   torch.tensor([1.0, float("nan"), 1.0, 1.0])),
         ValueError, r"^scale must hold finite values, got nan"),
        *([("backend9-tvm-missing", lambda: StaticDecoder(model, mode="compile", backend="tvm"), ValueError,
            r"backend 'tvm' needs the Python package 'tvm'")] if importlib.util.find_spec("tvm") is None else []),
    ]


COMPILE_MIRROR_BAD = _compile_mirror_bad_calls()


@pytest.mark.parametrize("call, err, match", [c[1:] for c in COMPILE_MIRROR_BAD],
                         ids=[c[0] for c in COMPILE_MIRROR_BAD])
def test_chapter_13_mirrors_refuse_bad_arguments_naming_them(call, err, match):
    assert_refused_by_minillm(call, err, match)


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
@pytest.mark.parametrize("change", ["half", "new Parameter", "new layer", "eps"])
def test_fused_decoder_refuses_a_model_changed_since_it_was_built(change):
    """The C++ step holds the parameters of construction time; after model.half(), a replaced Parameter, a layer
    swapped for another (fourth hostile run: before, the step kept running the old layer's weights) or a LayerNorm's
    eps changed (fifth run: before, ignored) the prefill (the live model) and the step (the snapshot) would
    disagree, so `generate_ids` and the first step of a sequence are refused. An in-place update of a weight is
    seen by the step (same storage) and stays allowed."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    torch.manual_seed(0)
    model = GPT(TINY).eval()
    dec = FusedCPUDecoder(model)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(1.5)  # in place: the step reads the same storage
    params = SamplingParams.greedy(3, ignore_eos=True)
    assert dec.generate_ids([1, 2, 3], params) == generate_ids(model, [1, 2, 3], params)
    if change == "half":
        model.half()
    elif change == "new Parameter":
        fc = model.transformer.h[0].mlp.c_fc
        fc.weight = torch.nn.Parameter(torch.randn_like(fc.weight))
    elif change == "eps":
        model.transformer.ln_f.eps = 1e-3
    else:
        model.transformer.h[0].mlp.c_fc = torch.nn.Linear(TINY.n_embd, 4 * TINY.n_embd)
    with pytest.raises(ValueError, match="build a new FusedCPUDecoder"):
        dec.generate_ids([1, 2, 3], params)
    dec.cache.reset()  # a new sequence, stepped by hand
    with pytest.raises(ValueError, match="build a new FusedCPUDecoder"):
        dec(model, dec.cache, torch.tensor([1]), torch.tensor([0]))


def test_a_kv_write_with_key_and_value_of_different_shapes_names_both():
    # before: the message blamed value alone, while here key is the one that disagrees with the pools
    from minillm.kernels import mirror
    with pytest.raises(ValueError, match=r"key \(3, 2, 4\) and value \(3, 2, 8\)"):
        mirror.kv_cache_write(torch.randn(3, 2, 4), torch.randn(3, 2, 8), torch.zeros(4, 4, 2, 8),
                              torch.zeros(4, 4, 2, 8), torch.tensor([0, 1, 2]))


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_fused_decoder_refuses_a_position_that_is_not_its_cache_length():
    """One sequence without padding: the token written to slot `start` sits at position `start`. Before, position 5
    on an empty cache (and position 0 after a 3-token prefill) ran and returned logits for a sequence that does not
    exist. The refused step leaves the cache as it was; the right position still runs."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    torch.manual_seed(0)
    model = GPT(TINY).eval()
    dec = FusedCPUDecoder(model)
    with pytest.raises(ValueError, match="position 5 is not the cache length 0"):
        dec(model, dec.cache, torch.tensor([1]), torch.tensor([5]))
    assert dec.cache.length == 0
    generate_ids(model, [1, 2, 3], SamplingParams.greedy(1, ignore_eos=True), kv_cache=dec.cache)
    with pytest.raises(ValueError, match="position 0 is not the cache length 3"):
        dec(model, dec.cache, torch.tensor([1]), torch.tensor([0]))
    assert dec.cache.length == 3
    assert dec(model, dec.cache, torch.tensor([1]), torch.tensor([3])).shape == (1, TINY.vocab_size)


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
@pytest.mark.parametrize("grad", [True, False], ids=["F.linear path", "C++ path"])
def test_fast_linear_names_a_bad_input_on_both_paths(grad):
    """Before: torch's "mat1 and mat2 ..." RuntimeErrors (F.linear path) and the C++ check's RuntimeError; a (2, 16)
    input to a 32-wide layer was regrouped into one 32-wide row on the C++ path before its view failed."""
    from minillm.compile.cpu_gemv import fast_cpu_model

    torch.manual_seed(0)
    model = fast_cpu_model(GPT(TINY).eval())
    fc = model.transformer.h[0].mlp.c_fc  # 32 -> 128
    with torch.set_grad_enabled(grad):
        for x in (torch.randn(1, 31), torch.randn(2, 16), torch.tensor(1.0)):
            assert_refused_by_minillm(lambda: fc(x), ValueError, r"x must be \(\.\.\., in_features=32\)")
        assert_refused_by_minillm(lambda: fc(torch.randn(1, 32).double()), TypeError, "x is torch.float64")
        fc.bias = torch.nn.Parameter(torch.zeros(128, dtype=torch.float64))
        assert_refused_by_minillm(lambda: fc(torch.randn(1, 32)), TypeError, "bias")


@pytest.mark.skipif(emulator.find_cxx() is None, reason="the kernel emulator needs a C++ compiler (g++ or clang++)")
def test_emulated_kv_write_refuses_a_slot_twice_and_shared_memory_before_launching(monkeypatch):
    """Before: written, the later token (or the value, or the pool) winning the race. Refused before any launch
    (`load` is made to fail); pools that are two halves of one tensor share no memory and stay allowed."""
    def refuse(*args, **kwargs):
        raise AssertionError("the emulator launched before checking its arguments")

    monkeypatch.setattr(emulator, "load", refuse)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    pool, big = torch.zeros(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
    cases = [((key, value, pool, torch.zeros(4, 4, 2, 8), torch.tensor([1, 1, 2])), "slot_mapping names slot 1"),
             ((key, value, pool, pool, torch.tensor([0, 1, 2])), "k_pool and v_pool share memory"),
             ((big.view(16, 2, 8)[:3], value, big, pool, torch.tensor([4, 5, 6])), "key and k_pool share memory"),
             ((key, pool.view(16, 2, 8)[5:8], big, pool, torch.tensor([0, 1, 2])), "value and v_pool share memory")]
    for args, match in cases:
        assert_refused_by_minillm(lambda: emulator.kv_cache_write(*args), ValueError, match)
    assert_refused_by_minillm(lambda: emulator.softmax(torch.randn(3, 37), 1, lib="libc"), TypeError, "lib must be")
    monkeypatch.undo()
    kv = torch.zeros(2, 4, 4, 2, 8)  # k_pool = kv[0], v_pool = kv[1]: one allocation, two disjoint halves
    emulator.kv_cache_write(key, value, kv[0], kv[1], torch.tensor([3, -1, -1]))
    assert torch.equal(kv[0, 0, 3], key[0]) and torch.equal(kv[1, 0, 3], value[0]) and kv[:, 1:].eq(0).all()


def test_kernel_emulator_softmax_over_no_columns_matches_torch():
    """Kept by design: a (3, 0) input gives a (3, 0) output, as torch.softmax and `ops.softmax` do (nothing to
    normalise, nothing written); the mirror, whose running state needs a first column, refuses it by name."""
    from minillm.kernels import mirror

    if emulator.find_cxx() is not None:
        assert emulator.softmax(torch.randn(3, 0), 1).shape == torch.softmax(torch.randn(3, 0), -1).shape == (3, 0)
    with pytest.raises(ValueError, match=r"\bx\b must have at least one column"):
        mirror.softmax_online(torch.randn(3, 0))


def test_naive_twins_of_no_sequences_or_no_columns_give_empty_results_like_the_others():
    """Before: "stack expects a non-empty TensorList" for S = 0 sequences, and amax's error for rows of no columns.
    Now the shapes and dtypes the mirror (and the emulator, when a C++ compiler is here) return: (0, nh, hs) and
    (rows, 0)."""
    from minillm.kernels import mirror
    from minillm.kernels import naive

    q, pool = torch.zeros(0, 2, 8, dtype=torch.bfloat16), torch.randn(4, 2, 2, 8).bfloat16()
    tables, lens = torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    got = naive.paged_attention_decode(q, pool, pool.clone(), tables, lens)
    want = mirror.paged_attention_decode(q, pool, pool.clone(), tables, lens)
    assert got.shape == want.shape == (0, 2, 8) and got.dtype == want.dtype == torch.bfloat16
    if emulator.find_cxx() is not None:
        assert emulator.paged_attention_decode(q, pool, pool.clone(), tables, lens, 2).shape == (0, 2, 8)
    x = torch.randn(3, 0)
    assert naive.softmax(x).shape == torch.softmax(x, -1).shape == (3, 0)


def test_the_llamacpp_command_names_a_work_path_that_is_a_file(tmp_path, capsys):
    """Before: FileExistsError from pathlib's mkdir. Now a usage error (exit 2) before anything is fetched or
    built."""
    from minillm.compile import llamacpp

    (tmp_path / "f").write_text("x")
    threads = torch.get_num_threads()  # the command sets torch's thread count (--threads) before it checks --work
    try:
        for work in (tmp_path / "f", tmp_path / "f" / "sub"):
            with pytest.raises(SystemExit) as e:
                llamacpp.main(["--work", str(work), "--sdist", str(tmp_path / "n.tgz")])
            assert e.value.code == 2
            assert re.search(f"--work '{tmp_path / 'f'}.*is a file, not a folder", capsys.readouterr().err)
    finally:
        torch.set_num_threads(threads)


def test_layernorm_at_the_smallest_eps_allowed_is_finite_and_right():
    """The floor check_eps keeps, float32's smallest normal number: a constant row (var = 0) gives exactly its bias
    (x - mean = 0, times the finite rsqrt(eps)), other rows what a float64 layer norm gives; in naive, the mirror
    and, with a C++ compiler, every emulator version. One below the floor is refused by all of them."""
    from minillm.kernels import mirror, naive

    tiny = torch.finfo(torch.float32).tiny
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.full((1, 40), 3.0), torch.randn(3, 40, generator=g)])  # row 0 constant
    weight, bias = torch.randn(40, generator=g), torch.randn(40, generator=g)
    want = torch.nn.functional.layer_norm(x.double(), (40,), weight.double(), bias.double(), eps=tiny)
    assert torch.equal(want[0], bias.double())
    runs = {"naive": lambda e: naive.layernorm(x, weight, bias, eps=e),
            "mirror": lambda e: mirror.layernorm_warp(x, weight, bias, eps=e)}
    if emulator.find_cxx() is not None:
        runs.update({f"emulator v{v}": (lambda e, v=v: emulator.layernorm(x, weight, bias, v, eps=e))
                     for v in range(1, 5)})
    for name, run in runs.items():
        got = run(tiny)
        assert torch.isfinite(got).all(), name
        assert torch.equal(got[0], bias), name
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=name)
        assert_refused_by_minillm(lambda: run(tiny / 2), ValueError, "eps must be")


def test_the_sweep_checks_every_argument_before_any_work(monkeypatch):
    """Before: profile_decode(top='3') failed after both profiles ran, and top=-1 returned all operators but the last;
    a prefill case met an unknown backend inside dynamo. Now nothing is built, run or profiled first."""
    from minillm.compile import sweep

    def no_work(*args, **kwargs):
        raise AssertionError("the sweep started working before checking its arguments")

    monkeypatch.setattr(sweep, "_decode_runs", no_work)
    monkeypatch.setattr(sweep, "_prefill_runs", no_work)
    model, decode = GPT(TINY).eval(), sweep.Case("decode", 1, 4)
    for kw, err, match in [(dict(top="3"), TypeError, "top must be an int"), (dict(top=0), ValueError, "top"),
                           (dict(backend="nope"), ValueError, "backend"), (dict(seed=-1), ValueError, "seed")]:
        assert_refused_by_minillm(lambda: sweep.profile_decode(model, decode, steps=2, **{"backend": "eager", **kw}),
                                  err, match)
    for kw, match in [(dict(backend="nope"), "backend"), (dict(seed=0.5), "seed"), (dict(repeats=0), "repeats")]:
        call = {"backend": "eager", **kw}
        assert_refused_by_minillm(lambda: sweep.run_case(model, sweep.Case("prefill", 1, 4), **call), (TypeError,
                                  ValueError), match)
        assert_refused_by_minillm(lambda: sweep.run_sweep(model, threads=(1,), cases=(decode,), steps=2, **call),
                                  (TypeError, ValueError), match)


def test_decoders_name_their_max_len_and_run_with_exactly_enough_room():
    """A decoder's generate_ids needs prompt + max_new_tokens - 1 cache slots (the last token is never fed back).
    One slot short is a ValueError naming max_len (before: chapter 04's message about a kv_cache the caller never
    passed); exactly enough gives the eager generator's tokens."""
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    torch.manual_seed(0)
    model, prompt, params = GPT(TINY).eval(), [3, 1, 4, 1, 5], SamplingParams.greedy(3, ignore_eos=True)
    want = generate_ids(model, prompt, params)
    decoders = [lambda n: StaticDecoder(model, "eager", max_len=n)]
    if build_problem() is None:
        from minillm.compile.fused_step import FusedCPUDecoder
        decoders.append(lambda n: FusedCPUDecoder(model, max_len=n))
    for make in decoders:
        assert_refused_by_minillm(lambda: make(6).generate_ids(prompt, params), ValueError,
                                  r"max_len=6 is too short .*need 7 cache slots; build the decoder with max_len >= 7")
        assert make(7).generate_ids(prompt, params) == want


def test_the_llamacpp_command_names_an_sdist_that_is_not_one(tmp_path, capsys):
    """Before: tarfile's ReadError for a file that is not a tar, and a RuntimeError for a tar without llama.cpp's
    sources; both now a ValueError naming --sdist and the file, before any build."""
    import tarfile

    from minillm.compile import llamacpp

    (tmp_path / "x.tar.gz").write_text("not a tar")
    tarfile.open(tmp_path / "e.tar.gz", "w:gz").close()
    threads = torch.get_num_threads()
    try:  # sixth hostile run: usage errors (exit 2), no longer tracebacks
        for sdist, match in (("x.tar.gz", r"--sdist '.*x\.tar\.gz' is not a readable \.tar\.gz"),
                             ("e.tar.gz", r"--sdist '.*e\.tar\.gz' is not a llama-cpp-python.* no vendored llama.cpp")):
            with pytest.raises(SystemExit) as e:
                llamacpp.main(["--work", str(tmp_path / "w"), "--sdist", str(tmp_path / sdist)])
            assert e.value.code == 2 and re.search(match, capsys.readouterr().err)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------- fourth hostile run
def test_the_tour_compare_refuses_outputs_of_different_shapes():
    """Before: a (1, C) output "agreed" with a (R, C) reference (the subtraction broadcast) and a (C,) with any
    (R, C): (True, 0.0) for outputs the kernel never produced. Equal shapes compare as before."""
    from minillm.kernels import tour as ktour

    ref = torch.randn(3, 4)
    for got in (ref[:1].clone(), ref[0].clone(), ref.t().clone()):
        shape = re.escape(str(tuple(got.shape)))
        assert_refused_by_minillm(lambda: ktour.compare("softmax", got, ref, torch.float32), ValueError,
                                  rf"got and ref must be tensors of the same shape, got {shape} and \(3, 4\)")
    assert ktour.compare("softmax", ref.clone(), ref, torch.float32) == (True, 0.0)
    assert ktour.compare("softmax", ref + 1, ref, torch.float32)[0] is False


def test_hand_written_steps_refuse_a_qat_prepared_model_and_keep_fast_linear():
    """Before: FusedCPUDecoder and decode_step_by_hand ran a QAT-prepared model on its latent float weights, while
    the model itself multiplies by the fake-quantized ones: other logits, no error (FakeQuantLinear is an
    nn.Linear subclass). Only the exact plain types pass now, and FastLinear, nn.Linear's formula in C++."""
    from minillm.compile.mirror import decode_step_by_hand
    from minillm.kvcache.cache import ContiguousKVCache
    from minillm.quant.linear import QuantConfig
    from minillm.quant.qat import prepare_qat

    torch.manual_seed(0)
    model = GPT(TINY).eval()
    qat = prepare_qat(copy.deepcopy(model), QuantConfig("int8"))
    cache = ContiguousKVCache(TINY, 1, 8)
    with torch.inference_mode():  # what the hand-written step would have given differs from what the model computes
        latent = decode_step_by_hand(model, cache.k, cache.v, 7, 0, 0)
        assert not torch.allclose(qat(torch.tensor([[7]]))[0, -1], latent, atol=1e-4)
    assert_refused_by_minillm(lambda: decode_step_by_hand(qat, cache.k, cache.v, 7, 0, 0), TypeError,
                              "transformer.h.0.attn.c_attn = FakeQuantLinear")
    if build_problem() is None:
        from minillm.compile.cpu_gemv import fast_cpu_model
        from minillm.compile.fused_step import FusedCPUDecoder
        from minillm.core.sampling import SamplingParams
        from minillm.kvcache.generate import generate_ids

        assert_refused_by_minillm(lambda: FusedCPUDecoder(qat), TypeError,
                                  r"the fused C\+\+ step needs .*transformer.h.0.attn.c_attn = FakeQuantLinear")
        fast, params = fast_cpu_model(model), SamplingParams.greedy(4, ignore_eos=True)
        assert FusedCPUDecoder(fast).generate_ids([1, 2, 3], params) == generate_ids(model, [1, 2, 3], params)
        with torch.inference_mode():
            torch.testing.assert_close(decode_step_by_hand(fast, cache.k, cache.v, 7, 0, 0), latent)


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_fast_linear_runs_a_strided_weight_through_f_linear():
    """Before: torch's RuntimeError "gemv: x and w must be contiguous" (the C++ check) for a transposed weight, and
    the C++ ValueError for a strided bias. Now such a layer takes F.linear, which reads any strides: same outputs."""
    from minillm.compile.cpu_gemv import FastLinear

    torch.manual_seed(0)
    layer = FastLinear(8, 6)
    layer.weight = torch.nn.Parameter(torch.randn(8, 6).t())  # (6, 8), strided
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight = torch.nn.Parameter(layer.weight.contiguous())
        layer.bias = torch.nn.Parameter(torch.randn(12)[::2])
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_llama_bench_tok_s_refuses_a_report_without_a_positive_rate(tmp_path):
    """Before: whatever llama-bench printed became the number (a negative or NaN avg_ts), or json's
    JSONDecodeError for output that is no report. A stand-in binary prints each report here."""
    from minillm.compile import llamacpp

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    for report, match in [('[{"avg_ts": -3.0}]', "avg_ts=-3.0, not a positive rate"),
                          ('[{"avg_ts": NaN}]', "avg_ts=nan, not a positive rate"),
                          ("not json", "printed no llama-bench JSON report"), ("[]", "printed no llama-bench JSON"),
                          ('[{"avg_ts": 123.5}]', None)]:
        binary = tmp_path / "llama-bench"
        binary.write_text(f"#!/bin/sh\necho '{report}'\n")
        binary.chmod(0o755)
        if match is None:
            assert llamacpp.llama_bench_tok_s(str(binary), str(gguf), 1, 8) == 123.5
        else:
            assert_refused_by_minillm(lambda: llamacpp.llama_bench_tok_s(binary, gguf, 1, 8), ValueError, match)


def test_llamacpp_build_takes_str_paths(tmp_path):
    """Before: AttributeError ("'str' object has no attribute 'is_file'") from fetch_sources and "unsupported operand
    type(s) for /" from build_target for str paths. A fake sdist (the vendored tree's CMakeLists.txt) and a built
    binary stand in for llama.cpp: nothing is downloaded or built."""
    import tarfile

    from minillm.compile import llamacpp_build

    src = tmp_path / "src" / "llama_cpp_python-0.0.0" / "vendor" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    sdist = tmp_path / "llama_cpp_python-0.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(tmp_path / "src" / "llama_cpp_python-0.0.0", arcname="llama_cpp_python-0.0.0")
    (tmp_path / "work").mkdir()
    tree = llamacpp_build.fetch_sources(str(tmp_path / "work"), str(sdist))
    assert tree == tmp_path / "work" / "llama_cpp_python-0.0.0" / "vendor" / "llama.cpp"
    (tree / "build" / "bin").mkdir(parents=True)
    (tree / "build" / "bin" / "llama-bench").write_text("")
    assert llamacpp_build.build_target(str(tree), "llama-bench") == tree / "build" / "bin" / "llama-bench"


def test_export_hf_dir_refuses_what_gpt2_cannot_hold_before_writing(tmp_path):
    """Before: an AssertionError ("layout mismatch") for a quantized model, torch's size-mismatch RuntimeError for a
    shrunk MLP, an AttributeError for tokenizer=None, each after the folder was made. Now a TypeError / ValueError
    naming what is unsupported, and nothing written."""
    from minillm.compile.llamacpp_build import export_hf_dir
    from minillm.prune.structured import prune_heads, shrink_mlp
    from minillm.quant.linear import QuantConfig, quantize_model
    from minillm.quant.qat import prepare_qat
    from minillm.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    torch.manual_seed(0)
    model, tok, out = GPT(TINY).eval(), Tokenizer.load(DEFAULT_TOKENIZER_PATH), tmp_path / "hf"
    cases = [(quantize_model(model, QuantConfig("int8")), tok, TypeError,
              r"export_hf_dir needs .*model \(QuantizedGPT\) has transformer.h.0.attn.c_attn = QuantLinear"),
             (prepare_qat(copy.deepcopy(model), QuantConfig("int8")), tok, TypeError, "= FakeQuantLinear"),
             (prune_heads(model, {0: [1], 1: [0]}), tok, ValueError,
              r"model \(pruned\) has 1 heads of 16 \(n_embd / n_head = 32\)"),
             (shrink_mlp(model, [torch.arange(0, 128, 2)] * 2), tok, ValueError, r"MLP widths \[64, 64\]"),
             (model, None, TypeError, "tokenizer must be a minillm Tokenizer .*got NoneType")]
    for m, t, err, match in cases:
        assert_refused_by_minillm(lambda: export_hf_dir(m, t, str(out)), err, match)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA GPU")
def test_the_kernel_bench_helpers_say_they_need_cuda():
    """Before: torch's AssertionError "Torch not compiled with CUDA enabled" (an AttributeError for
    sleep_cycles_per_ms) from every helper of the chapter 12 benchmark on a machine without a GPU."""
    from minillm.kernels import bench as kbench

    calls = {"sleep_cycles_per_ms": kbench.sleep_cycles_per_ms, "time_ms": lambda: kbench.time_ms(lambda: None, 1, 1),
             "copy_bandwidth": lambda: kbench.copy_bandwidth(1024, 1, 1),
             "matmul_tflops": lambda: kbench.matmul_tflops(8, 1, 1), "cases": lambda: kbench.cases(True),
             "the chapter 12 benchmark": lambda: kbench.run(quick=True)}
    for who, call in calls.items():
        assert_refused_by_minillm(call, RuntimeError, f"{who} needs a CUDA GPU")


# -------------------------------------------------------------------------------------------- fifth hostile run
def test_the_kernel_bench_check_refuses_outputs_of_different_shapes():
    """Before: `close(tol)(got, ref)` broadcast, and a (1, C) output "agreed" with a (3, C) reference (the bug
    fixed in tour.compare, which now shares the check). Equal shapes compare as before."""
    from minillm.kernels import bench as kbench

    ref = torch.randn(3, 4)
    check = kbench.close(1e-3)
    for got in (ref[:1].clone(), ref[0].clone(), torch.ones(1, 4)):
        shape = re.escape(str(tuple(got.shape)))
        assert_refused_by_minillm(lambda: check(got, ref), ValueError,
                                  rf"got and ref must be tensors of the same shape, got {shape} and \(3, 4\)")
    assert check(ref.clone(), ref) is True and check(ref + 1, ref) is False


def test_the_mirrors_take_more_parts_or_a_wider_pack_than_the_row_has():
    """Before: softmax_online(x, 8, 10**8) looped over 10^8 empty parts (a hang) and lane_partials(x, pack=10**9)
    asked the allocator for 3.2e10 zeros of padding. A part past the row's end holds nothing, a pack past it reads
    the whole row into lane 0: the answers, against torch, in well under a second."""
    from minillm.kernels import mirror

    x = torch.randn(2, 8, dtype=torch.float64) * 3
    torch.testing.assert_close(mirror.softmax_online(x, 8, 10**8), torch.softmax(x, dim=-1))
    torch.testing.assert_close(mirror.softmax_online(x, 1, 10**8), torch.softmax(x, dim=-1))
    x = torch.randn(2, 40, dtype=torch.float64)
    lanes = mirror.lane_partials(x, pack=10**9)
    torch.testing.assert_close(lanes[:, 0], x.sum(dim=-1))
    assert lanes.shape == (2, 32) and not lanes[:, 1:].any()


def _eps_model(eps: list[float], dtype: torch.dtype = torch.float32) -> GPT:
    """TINY with context-sensitive weights and these eps on its LayerNorms (h.0.ln_1, h.0.ln_2, h.1..., ln_f)."""
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 3.0 / p.shape[-1] ** 0.5)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == len(eps)
    for m, e in zip(norms, eps):
        m.eps = e
    return model.to(dtype)


EPS = [0.5, 2.0, 1e-3, 0.1, 7.0]  # large and different: the config's 1e-5 gives other logits (max error ~2.7)


def test_step_by_hand_honours_each_layernorm_eps_and_a_float64_model():
    """Before: decode_step_by_hand used config.layer_norm_epsilon for every LayerNorm (max error 2.7 against the
    model with other eps) and computed its LayerNorms in float32 for a float64 model (error 9e-7). Now each
    LayerNorm's own eps, in the model's dtype: the model's own logits."""
    from minillm.compile.mirror import decode_step_by_hand
    from minillm.kvcache.cache import ContiguousKVCache

    for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-10)):
        for eps in (EPS, [TINY.layer_norm_epsilon] * 5):
            model = _eps_model(eps, dtype)
            cache = ContiguousKVCache(TINY, 1, 4, dtype=dtype)
            with torch.inference_mode():
                got = decode_step_by_hand(model, cache.k, cache.v, 5, 0, 0)
                want = model(torch.tensor([[5]]))[0, -1]
            torch.testing.assert_close(got, want, atol=tol, rtol=0)


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_fused_decoder_honours_each_layernorm_eps():
    """Before: the C++ step took config.layer_norm_epsilon for every LayerNorm: other logits and other tokens than
    the model's, no error. Now each LayerNorm's own eps: the model's logits for a first token, and its tokens."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    model = _eps_model(EPS)
    dec = FusedCPUDecoder(model)
    with torch.inference_mode():
        got = dec(model, dec.cache, torch.tensor([5]), torch.tensor([0]))[0]
        want = model(torch.tensor([[5]]))[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    dec.cache.reset()
    params = SamplingParams.greedy(8, ignore_eos=True)
    assert dec.generate_ids([5, 6, 7, 5, 6], params) == generate_ids(model, [5, 6, 7, 5, 6], params)


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_fast_cpu_model_keeps_an_untied_or_quantized_head():
    """Before: a bare AssertionError for a model whose head has its own weight, an AttributeError for a quantized
    head (TiedQuantHead has no `weight`). The copy now keeps either head as the model has it: the same tokens."""
    from minillm.compile.cpu_gemv import fast_cpu_model
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids
    from minillm.quant.linear import QuantConfig, quantize_model

    model = _eps_model([TINY.layer_norm_epsilon] * 5)
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach() * 1.5)
    quantized = quantize_model(model, QuantConfig("int8", quantize_head=True))
    params = SamplingParams.greedy(6, ignore_eos=True)
    for m in (untied, quantized):
        fast = fast_cpu_model(m)
        assert generate_ids(fast, [5, 6, 7], params) == generate_ids(m, [5, 6, 7], params)
    assert fast_cpu_model(untied).lm_head.weight is not fast_cpu_model(untied).transformer.wte.weight
    assert type(fast_cpu_model(quantized).lm_head) is type(quantized.lm_head)


def test_llamacpp_convert_always_converts_and_checks_its_inputs(tmp_path):
    """Before: any file already at `out` (here: not a GGUF at all) was returned as the conversion, without looking
    at tree, hf_dir or outtype: an earlier run's GGUF of another checkpoint would be benchmarked without a word.
    Now it always converts (a stand-in converter here, which writes its arguments) and refuses a folder that is
    not an export first."""
    from minillm.compile.llamacpp_build import convert

    tree, hf = tmp_path / "llama.cpp", tmp_path / "hf"
    (tree / "conversion").mkdir(parents=True)
    (tree / "conversion" / "__init__.py").write_text("")
    (tree / "conversion" / "base.py").write_text("class TextModel:\n    pass\n")
    (tree / "convert_hf_to_gguf.py").write_text(
        "import sys\nopen(sys.argv[sys.argv.index('--outfile') + 1], 'w').write(' '.join(sys.argv[1:4]))\n")
    hf.mkdir()
    out = tmp_path / "m.gguf"
    out.write_text("not a gguf")
    assert_refused_by_minillm(lambda: convert(tree, hf, "q8_0", out), ValueError,
                              r"hf_dir '.*hf' is not a Hugging Face model folder \(no config.json\)")
    (hf / "config.json").write_text("{}")
    assert convert(str(tree), str(hf), "q8_0", str(out)) == out
    assert out.read_text() == f"{hf} --outtype q8_0"


def test_export_hf_dir_refuses_a_tokenizer_of_another_vocab_size(tmp_path):
    """Before: a vocab-512 model was exported with the 4096-token vocab.json of the default tokenizer, no error."""
    from minillm.compile.llamacpp_build import export_hf_dir
    from minillm.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    tok, out = Tokenizer.load(DEFAULT_TOKENIZER_PATH), tmp_path / "hf"
    assert_refused_by_minillm(lambda: export_hf_dir(GPT(TINY).eval(), tok, out), ValueError,
                              "tokenizer has vocab_size=4096, model has vocab_size=512")
    assert not out.exists()


# -------------------------------------------------------------------------------------------- sixth hostile run
def test_an_untied_head_is_exported_untied_to_hf_and_refused_by_export_hf_dir(tmp_path):
    """Before: to_hf_model and export_hf_dir tied the Hugging Face head to wte and dropped the model's own head
    (logits off by 9.7). Now to_hf_model gives the model's logits (tie_word_embeddings=False), a contradicting
    tie_word_embeddings is refused, and export_hf_dir (GPT-2's layout, the GGUF's) refuses the head, writing nothing."""
    from minillm.compile.llamacpp_build import export_hf_dir
    from minillm.core.hf import to_hf_model
    from minillm.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    torch.manual_seed(0)
    model = GPT(TINY).eval()
    model.lm_head.weight = torch.nn.Parameter(torch.randn(TINY.vocab_size, TINY.n_embd) * 0.5)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(to_hf_model(model)(ids).logits, model(ids), atol=1e-4, rtol=0)
        tied = GPT(TINY).eval()
        torch.testing.assert_close(to_hf_model(tied)(ids).logits, tied(ids), atol=1e-4, rtol=0)
    assert_refused_by_minillm(lambda: to_hf_model(model, tie_word_embeddings=True), ValueError,
                              r"tie_word_embeddings=True, but the model's lm_head is untied")
    out = tmp_path / "hf"
    assert_refused_by_minillm(lambda: export_hf_dir(model, Tokenizer.load(DEFAULT_TOKENIZER_PATH), out), ValueError,
                              r"export_hf_dir writes GPT-2's layout, .* model.lm_head has a weight of its own")
    assert not out.exists()


# ------------------------------------------------------------------------ sixth hostile run: chapters 12 and 13
def _zero_mlp_hook(model: GPT) -> GPT:
    """`model` with a forward hook that zeroes block 1's MLP output (other logits than the plain model's)."""
    model.transformer.h[1].mlp.register_forward_hook(lambda mod, args, out: out * 0)
    return model


def test_kernel_checks_keep_infinities_out_of_the_scale_and_take_empty_outputs():
    """Before: one inf in ref made close's tolerance infinite ([inf, 1000] "agreed" with [inf, 0]), and close and
    tour.compare raised torch's max() error on empty tensors. Now ref's infinities must be matched, sign included,
    the tolerance is relative to ref's largest finite magnitude, a NaN never agrees, and empty outputs agree."""
    from minillm.kernels import bench as kbench
    from minillm.kernels import tour as ktour

    inf, nan = float("inf"), float("nan")
    check, ref = kbench.close(1e-3), torch.tensor([inf, 0.0])
    assert check(torch.tensor([inf, 1000.0]), ref) is False
    assert check(torch.tensor([-inf, 0.0]), ref) is False and check(torch.tensor([inf, 0.0]), ref) is True
    assert check(torch.tensor([inf, 5e-4]), ref) is True and check(torch.tensor([inf, 5e-3]), ref) is False
    assert check(torch.tensor([nan, 0.0]), torch.tensor([nan, 0.0])) is False
    assert ktour.compare("softmax", torch.tensor([inf, 1000.0]), ref, torch.float32) == (False, 1000.0)
    assert ktour.compare("softmax", torch.tensor([inf, 5.0]), torch.tensor([-inf, 5.0]), torch.float32)[0] is False
    assert ktour.compare("softmax", ref.clone(), ref, torch.float32) == (True, 0.0)
    empty = torch.zeros(0, 4)
    assert check(empty, empty.clone()) is True
    assert ktour.compare("softmax", empty, empty.clone(), torch.float32) == (True, 0.0)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_static_decoder_runs_hooks_eager_and_refuses_them_once_built(mode):
    """Before: a hook added after mode 'compile' had built its step never ran in the steps, while the prefill ran it:
    other tokens than the model's, silently. Now mode 'eager' runs hooks as the model does (the hooked model's
    tokens), and mode 'compile' refuses a hooked model, and a hook added after the build (before the prefill, and at
    a step), naming the module; with the hook removed it decodes again."""
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    model, prompt, params = _eps_model([TINY.layer_norm_epsilon] * 5), [5, 6, 7, 5, 6], SamplingParams.greedy(
        6, ignore_eos=True)
    plain = generate_ids(model, prompt, params)
    dec = StaticDecoder(model, mode, backend="eager")
    assert dec.generate_ids(prompt, params) == plain
    handle = model.transformer.h[1].mlp.register_forward_hook(lambda mod, args, out: out.flip(-1) * 4)
    hooked = generate_ids(model, prompt, params)
    assert hooked != plain  # the hook matters
    if mode == "eager":
        assert dec.generate_ids(prompt, params) == hooked
    else:
        refused = r"mode 'compile' builds the step once .*transformer.h.1.mlp has one"
        assert_refused_by_minillm(lambda: dec.generate_ids(prompt, params), ValueError, refused)
        assert_refused_by_minillm(lambda: dec(model, dec.cache, torch.tensor([1]), torch.tensor([0])), ValueError,
                                  refused)
        assert_refused_by_minillm(lambda: StaticDecoder(model, mode, backend="eager"), ValueError, refused)
    handle.remove()
    assert dec.generate_ids(prompt, params) == plain


def test_static_decoder_leaves_the_callers_model_in_its_modes():
    """Before: StaticDecoder called model.eval() on the caller's model for good (a model in training lost its dropout
    without a word; export_decode_step restored it). Now every module keeps its mode: generate_ids decodes in eval
    mode (the eval model's tokens) and gives each module its mode back; a step called directly refuses a model in
    training mode (its dropout would run) instead of decoding with it."""
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY.to_dict(), "dropout": 0.3})).train()
    model.transformer.h[0].eval()  # mixed modes, each given back as it was
    modes = [m.training for m in model.modules()]
    prompt, params = [5, 6, 7], SamplingParams.greedy(6, ignore_eos=True)
    want = generate_ids(copy.deepcopy(model).eval(), prompt, params)
    dec = StaticDecoder(model, "eager")
    assert [m.training for m in model.modules()] == modes
    assert dec.generate_ids(prompt, params) == want
    assert [m.training for m in model.modules()] == modes
    assert_refused_by_minillm(lambda: dec(model, dec.cache, torch.tensor([1]), torch.tensor([0])), ValueError,
                              r"a StaticDecoder step runs the model in eval mode, but the model is in training mode")


def _cli_usage_errors() -> list[tuple[str, str, list[str], str]]:
    """(id, module, argv, the flag the usage error must name): values the library refuses, given on the command
    line (before: a traceback, exit 1, after loading the model or starting the build)."""
    return [
        ("cbench-backend", "minillm.compile.bench", ["--backend", "nope", "--quick"], "--backend"),
        ("sweep-threads-list-zero", "minillm.compile.sweep", ["--threads-list", "0"], "--threads-list"),
        ("sweep-threads-list-word", "minillm.compile.sweep", ["--threads-list", "1,x"], "--threads-list"),
        ("sweep-backend", "minillm.compile.sweep", ["--backend", "nope"], "--backend"),
        ("aot-timeout-zero", "minillm.compile.aot", ["--timeout", "0"], "--timeout"),
        ("aot-timeout-nan", "minillm.compile.aot", ["--timeout", "nan"], "--timeout"),
        ("aot-model", "minillm.compile.aot", ["--model", "gpt5"], "--model"),
        ("llamacpp-sdist-missing", "minillm.compile.llamacpp", ["--sdist", "/nonexistent/x.tar.gz"], "--sdist"),
        ("llamacpp-work-file", "minillm.compile.llamacpp", ["--work", __file__], "--work"),
        ("kbench-out-dir", "minillm.kernels.bench", ["--out", str(ROOT)], "--out"),
    ]


@pytest.mark.parametrize("module, argv, flag", [c[1:] for c in _cli_usage_errors()],
                         ids=[c[0] for c in _cli_usage_errors()])
def test_the_chapter_12_13_commands_refuse_bad_flags_as_usage_errors(module, argv, flag, capsys):
    import importlib

    main = importlib.import_module(module).main
    threads = torch.get_num_threads()  # a command sets torch's thread count (--threads) first
    try:
        with pytest.raises(SystemExit) as e:
            main(argv)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err and flag in err.splitlines()[-1] and "Traceback" not in err, err


def test_the_fused_step_refuses_hooks_and_leaves_the_callers_model_in_its_modes():
    """Before: FusedCPUDecoder ran a forward hook in the prefill and never in its C++ steps (other tokens than the
    hooked model's, silently), and switched the caller's model to eval mode for good. Now a hook, added before or
    after construction, is a ValueError naming the module; generate_ids decodes in eval mode and gives each module
    its mode back; a step called directly on a model in training mode is refused."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY.to_dict(), "dropout": 0.3})).train()
    model.transformer.h[0].eval()
    modes = [m.training for m in model.modules()]
    prompt, params = [5, 6, 7], SamplingParams.greedy(6, ignore_eos=True)
    want = generate_ids(copy.deepcopy(model).eval(), prompt, params)
    dec = FusedCPUDecoder(model)
    assert [m.training for m in model.modules()] == modes
    assert dec.generate_ids(prompt, params) == want
    assert [m.training for m in model.modules()] == modes
    assert_refused_by_minillm(lambda: dec(model, dec.cache, torch.tensor([1]), torch.tensor([0])), ValueError,
                              r"a FusedCPUDecoder step runs the model in eval mode, but the model is in training mode")
    model.eval()
    handle = model.transformer.h[1].mlp.register_forward_hook(lambda mod, args, out: out * 2)
    refused = r"the fused C\+\+ step cannot run forward hooks, but the model's transformer.h.1.mlp has one"
    assert_refused_by_minillm(lambda: dec.generate_ids(prompt, params), ValueError, refused)
    assert_refused_by_minillm(lambda: FusedCPUDecoder(model), ValueError, refused)
    handle.remove()
    assert dec.generate_ids(prompt, params) == want


def test_check_package_names_a_file_that_is_not_a_package(tmp_path):
    """Seventh hostile run: before, `aot.check_package` on a text file raised zipfile's BadZipFile ("File is not a
    zip file", no file named; AOTDecoder checked first, its own callers did not). Now a ValueError naming the file,
    FileNotFoundError for no file, TypeError for no path."""
    from minillm.compile.aot import check_package

    text = tmp_path / "cp.pt2"
    text.write_text("x")
    assert_refused_by_minillm(lambda: check_package(text), ValueError,
                              r"path '.*cp.pt2' is not a .pt2 package \(not a zip archive")
    assert_refused_by_minillm(lambda: check_package(tmp_path / "missing.pt2"), FileNotFoundError,
                              "no AOT decode-step package at '.*missing.pt2'")
    assert_refused_by_minillm(lambda: check_package(3), TypeError, "path must be a str or os.PathLike")


def test_c13r8_saving_onto_a_device_or_fifo_is_refused_and_leaves_it_in_place(tmp_path):
    """Eighth hostile run: export_decode_step and a benchmark's write_report (--json) renamed their temp file onto
    the path, replacing a device node (as root: /dev/null) or a FIFO with a regular file. Now a ValueError naming
    path before any work. Private nodes under tmp_path only: a FIFO, and as root a character device like /dev/null."""
    import stat

    from minillm.bench.cli import write_report
    from minillm.compile.aot import export_decode_step

    nodes = special_files(tmp_path, ".pt2")
    for node in nodes:
        kind = stat.S_IFMT(node.lstat().st_mode)
        assert_refused_by_minillm(lambda: export_decode_step(GPT(TINY), node, max_len=8), ValueError,
                                  r"^path '.*' exists and is not a regular file \(a device, FIFO or socket\)")
        assert_refused_by_minillm(lambda: write_report(str(node), {"x": 1}), ValueError,
                                  r"^path '.*' exists and is not a regular file")
        assert stat.S_IFMT(node.lstat().st_mode) == kind


@pytest.mark.parametrize("what", ["missing", "folder", "no-table"])
def test_k12r8_kernels_bench_from_report_that_cannot_be_read_is_a_usage_error(tmp_path, capsys, what):
    """Eighth hostile run: a missing --from-report file, a folder, or a file without the report's table was a
    traceback (FileNotFoundError, IsADirectoryError, ValueError). Now exit 2 naming --from-report."""
    from minillm.kernels import bench as kernels_bench

    path = {"missing": tmp_path / "none.md", "folder": tmp_path, "no-table": tmp_path / "garbage.md"}[what]
    (tmp_path / "garbage.md").write_text("# a report without the table\n")
    with pytest.raises(SystemExit) as exit_:
        kernels_bench.main(["--from-report", str(path)])
    assert exit_.value.code == 2 and "--from-report" in capsys.readouterr().err


# ------------------------------------------------------- eighth hostile run: chapter 13's C++ extension (helper B)
def _b8_cpp_bad_calls():
    """The C++ extension's checked entry points and the fused proposer: (id, call, exception, pattern). Sparse
    tensors are refused before the extension is loaded (`require_cpu_tensors`), so no compiler is needed."""
    from minillm.compile.cpu_gemv import FastLinear, gemv, int8_gemv
    from minillm.compile.cpu_paged import paged_decode_attention, paged_verify_attention
    from minillm.compile.fused_speculative import FusedDraftProposer

    x, w, b = torch.randn(2, 16), torch.randn(8, 16), torch.randn(8)
    q8, s8 = torch.randint(-127, 128, (8, 16), dtype=torch.int8), torch.rand(8)
    q, kp, vp = torch.randn(2, 2, 8), torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
    bt, cl = torch.tensor([[0, 1], [2, 3]]), torch.tensor([3, 8])
    layer = torch.nn.Linear(16, 8)
    layer.__class__ = FastLinear
    return [
        ("gemv-x-sparse", lambda: gemv(x.to_sparse(), w, b), TypeError, r"^x must be a strided \(dense\) tensor"),
        ("gemv-b-sparse", lambda: gemv(x, w, b.to_sparse()), TypeError, r"^b must be a strided \(dense\) tensor"),
        ("int8-gemv-scale-sparse", lambda: int8_gemv(x, q8, s8.to_sparse()), TypeError, r"^scale must be a strided"),
        ("int8-gemv-q-sparse", lambda: int8_gemv(x, q8.to_sparse(), s8), TypeError, r"^q must be a strided"),
        ("paged-k-pool-sparse", lambda: paged_decode_attention(q, kp.to_sparse(), vp, bt, cl), TypeError,
         r"^k_pool must be a strided"),
        ("paged-context-lens-sparse", lambda: paged_decode_attention(q, kp, vp, bt, cl.to_sparse()), TypeError,
         r"^context_lens must be a strided"),
        ("verify-query-lens-sparse", lambda: paged_verify_attention(q, kp, vp, bt, cl, torch.ones(2, dtype=torch.long)
                                                                    .to_sparse()), TypeError,
         r"^query_lens must be a strided"),
        ("fast-linear-x-sparse", lambda: torch.no_grad()(layer)(x.to_sparse()), TypeError,
         r"^x must be a strided \(dense\) tensor"),
        ("proposer-str", lambda: FusedDraftProposer("x"), TypeError,
         r"^draft must be a FusedCPUDecoder \(build one with FusedCPUDecoder\(model\)\), got str"),
    ]


B8_CPP_BAD = _b8_cpp_bad_calls()


@pytest.mark.parametrize("call, err, match", [c[1:] for c in B8_CPP_BAD], ids=[c[0] for c in B8_CPP_BAD])
def test_b8_the_cpp_extension_wrappers_refuse_sparse_tensors_naming_them(call, err, match):
    assert_refused_by_minillm(call, err, match)


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_b8_the_cpp_extension_reads_a_negative_view_by_its_values():
    """A negative view (`torch._neg_view(t)`: values -t, memory t) keeps its sign in a bit the C++ loops' raw
    pointers miss. Before: gemv, int8_gemv, paged_decode_attention and FastLinear computed with +t (max error 917 on
    the int8 GEMV). The wrappers resolve the bit; the raw entry points refuse it, naming the tensor. Each view below
    holds the same values as the plain tensor it replaces, so the results must not change."""
    from minillm.compile.cpu_gemv import FastLinear, gemv, int4_gemv, int8_gemv, load_cpu_ext
    from minillm.compile.cpu_paged import paged_decode_attention, paged_verify_attention

    def same(t: torch.Tensor) -> torch.Tensor:  # t's values, held as a negative view of -t
        return torch._neg_view(-t)

    g = torch.Generator().manual_seed(8)
    x, w, b = torch.randn(3, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    torch.testing.assert_close(gemv(x, w, b), x @ w.T + b)
    for args in ((same(x), w, b), (x, same(w), b), (x, w, same(b))):
        torch.testing.assert_close(gemv(*args), x @ w.T + b)
    q8, s8 = torch.randint(-127, 128, (8, 16), dtype=torch.int8, generator=g), torch.rand(8, generator=g) + 0.5
    ref8 = x @ (q8.float() * s8[:, None]).T + b
    for args in ((same(x), q8, s8, b), (x, same(q8), s8, b), (x, q8, same(s8), b), (x, q8, s8, same(b))):
        torch.testing.assert_close(int8_gemv(*args), ref8)
    packed, s4 = torch.randint(0, 256, (8, 8), dtype=torch.uint8, generator=g), torch.rand(8, 2, generator=g)
    torch.testing.assert_close(int4_gemv(x, packed, same(s4), b), int4_gemv(x, packed, s4, b))
    q, kp, vp = torch.randn(2, 2, 8, generator=g), torch.randn(4, 4, 2, 8, generator=g), torch.randn(4, 4, 2, 8,
                                                                                                     generator=g)
    bt, cl = torch.tensor([[0, 1], [2, 3]]), torch.tensor([3, 8])
    ref = paged_decode_attention(q, kp, vp, bt, cl)
    for i in range(5):
        args = [q, kp, vp, bt, cl]
        args[i] = same(args[i])
        torch.testing.assert_close(paged_decode_attention(*args), ref)
    ql = torch.tensor([1, 1])
    torch.testing.assert_close(paged_verify_attention(same(q), kp, same(vp), bt, cl, same(ql)), ref)
    layer = torch.nn.Linear(16, 8)
    layer.__class__ = FastLinear
    with torch.no_grad():
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer(same(x)), want)
        layer.weight.data = same(layer.weight.data.clone())
        layer.bias.data = same(layer.bias.data.clone())
        torch.testing.assert_close(layer(x), want)
    ext = load_cpu_ext()  # the raw entry points, no Python check in front: refused, naming the tensor
    for call, name in ((lambda: ext.gemv(same(x), w, b), "x"), (lambda: ext.int8_gemv(x, q8, same(s8), b), "scale"),
                       (lambda: ext.paged_decode_attention(q, same(kp), vp, bt, cl), "k_pool")):
        with pytest.raises(ValueError, match=rf"\b{name} is a negative \(or conjugate\) view"):
            call()


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_b8_the_fused_step_reads_negative_view_parameters_by_their_values():
    """Before: FusedCPUDecoder handed a parameter that is a negative view to C++ as its memory (+t). Now the step
    gets its values; and an in-place change of such a parameter (which the step holds a copy of) is noticed."""
    from minillm.compile.fused_step import FusedCPUDecoder

    torch.manual_seed(0)
    model = GPT(TINY).eval()
    viewed = copy.deepcopy(model)
    with torch.no_grad():
        for name in ("transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.bias",
                     "transformer.ln_f.weight"):
            p = viewed.get_parameter(name)
            p.data = torch._neg_view(-p.data)  # the same values, held negated with the sign bit set
    tokens = [5, 6, 7, 8]
    want = FusedCPUDecoder(model).verify(tokens)
    decoder = FusedCPUDecoder(viewed)
    torch.testing.assert_close(decoder.verify(tokens), want)
    with torch.no_grad():
        viewed.transformer.h[0].attn.c_attn.weight.mul_(2.0)
    with pytest.raises(ValueError, match="was changed since this FusedCPUDecoder was built"):
        decoder.check_model_unchanged()


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_b8_a_fused_decoder_takes_one_request_at_a_time():
    """Before: two threads' generate_ids on one FusedCPUDecoder wrote one cache and failed with an AssertionError
    ("layers disagree on the cache length") or decoded a mix. Now a request started while another holds the decoder
    is a ValueError at once (`exclusive`, held here by the test as another thread would hold it)."""
    from minillm.compile.fused_speculative import generate_prompt_lookup_fused, generate_speculative_fused
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams

    target, draft = FusedCPUDecoder(GPT(TINY).eval()), FusedCPUDecoder(GPT(TINY).eval())
    with target.exclusive():
        for call in (lambda: target.generate_ids([1, 2], SamplingParams.greedy(2)),
                     lambda: generate_prompt_lookup_fused(target, [1, 2], SamplingParams.greedy(2)),
                     lambda: generate_speculative_fused(target, draft, [1, 2], SamplingParams.greedy(2))):
            assert_refused_by_minillm(call, ValueError, "already decoding a request in another thread: one call at a "
                                                        "time")
        assert len(draft.generate_ids([1, 2], SamplingParams.greedy(2))) == 2  # the draft was released
    assert len(target.generate_ids([1, 2], SamplingParams.greedy(2))) == 2


def test_b8_llama_bench_tok_s_refuses_a_bool_rate(tmp_path):
    """Before: a report whose avg_ts was `true` became 1.0 tok/s (float(True))."""
    from minillm.compile import llamacpp

    gguf, binary = tmp_path / "m.gguf", tmp_path / "llama-bench"
    gguf.write_bytes(b"")
    binary.write_text("#!/bin/sh\necho '[{\"avg_ts\": true}]'\n")
    binary.chmod(0o755)
    assert_refused_by_minillm(lambda: llamacpp.llama_bench_tok_s(binary, gguf, 1, 8), ValueError,
                              r"printed no llama-bench JSON report with an avg_ts \(avg_ts is a bool, True\)")


def _fake_llama_quantize(tree, script: str):
    """A llama.cpp tree whose built `llama-quantize` is the shell `script` ($1 source, $2 out)."""
    binary = tree / "build" / "bin" / "llama-quantize"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n" + script + "\n")
    binary.chmod(0o755)
    return tree


def test_b9_quantize_gguf_refuses_out_that_is_the_source_and_a_tool_that_writes_nothing(tmp_path):
    """Ninth hostile run: out equal to source (the same path, another spelling of it, a symlink to it) was quantized
    over itself: the tool truncates out before reading the source, so the f32 GGUF was left at 0 bytes; a tool that
    exited 0 without writing out returned a path that did not exist. Now a ValueError naming out before the build
    (the source intact) and a RuntimeError naming the tool; a real write still passes."""
    from minillm.compile import llamacpp_build as lb

    tree = _fake_llama_quantize(tmp_path / "tree", ': > "$2"; cat "$1" > "$2"')
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF" * 64)
    link = tmp_path / "link.gguf"
    link.symlink_to(source)
    for out in (source, tmp_path / "." / "m.gguf", link):
        assert_refused_by_minillm(lambda: lb.quantize_gguf(tree, source, "q4_0", out), ValueError,
                                  r"^out .* is the source GGUF")
    assert source.stat().st_size == 256
    assert lb.quantize_gguf(tree, source, "q4_0", tmp_path / "q.gguf").read_bytes() == b"GGUF" * 64
    noop = _fake_llama_quantize(tmp_path / "noop", "true")
    for out in (tmp_path / "never.gguf", tmp_path / "q.gguf"):  # nothing written; an earlier file left untouched
        assert_refused_by_minillm(lambda: lb.quantize_gguf(noop, source, "q4_0", out), RuntimeError,
                                  r"^llama-quantize exited 0 but wrote no")


def test_b8_kv_writes_check_the_pools_against_the_current_modes():
    """`check_writable` refuses what torch would refuse now, not more: a Parameter pool is written under no_grad,
    an inference pool under inference_mode, as torch writes them (the hostile rows above refuse them otherwise)."""
    from minillm.kernels import mirror as M
    from minillm.kernels import naive as N

    key, slots = torch.randn(3, 2, 8), torch.tensor([0, 5, 2])
    for write in (N.kv_cache_write, M.kv_cache_write):
        pool = torch.nn.Parameter(torch.zeros(4, 2, 2, 8))
        with torch.no_grad():
            write(key, key.clone(), pool, torch.zeros(4, 2, 2, 8), slots)
        torch.testing.assert_close(pool.detach().reshape(8, 2, 8)[slots], key)
        with torch.inference_mode():
            k_pool = torch.zeros(4, 2, 2, 8)
            write(key, key.clone(), k_pool, torch.zeros(4, 2, 2, 8), slots)
        torch.testing.assert_close(k_pool.reshape(8, 2, 8)[slots], key)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_c13r10_the_fused_steps_run_no_quantized_layer_the_layer_itself_refuses(mode, when):
    """Before: a NaN, zero or negative scale in an int8 or int4 model was decoded by FusedCPUDecoder without a word
    (tokens [0, 0, 0, 0]) where the eager model refuses it: the C++ step reads the buffers without the layer's forward,
    which is where the layer checks them. Now the decoders run the layer's own check when they are built and at
    every sequence start, naming the layer; a scale written in place after the decoder was built is caught too."""
    from minillm.compile.fused_engine import FusedEngineModel
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.quant.linear import QuantConfig, quantize_model

    torch.manual_seed(0)
    q = quantize_model(GPT(TINY), QuantConfig(mode, group_size=16)).eval()
    params = SamplingParams.greedy(4, ignore_eos=True)
    dec = FusedCPUDecoder(q) if when == "after" else None
    for bad in (float("nan"), 0.0, -1.0):
        q.transformer.h[1].mlp.c_proj.scale.view(-1)[3] = bad
        match = r"the model's transformer.h.1.mlp.c_proj: scale must hold finite values > 0"
        if when == "before":
            assert_refused_by_minillm(lambda: FusedCPUDecoder(q), ValueError, match)
            assert_refused_by_minillm(lambda: FusedEngineModel(q), ValueError, match)
        else:
            assert_refused_by_minillm(lambda: dec.generate_ids([1, 2, 3], params), ValueError, match)
        q.transformer.h[1].mlp.c_proj.scale.view(-1)[3] = 0.01
    assert FusedCPUDecoder(q).generate_ids([1, 2, 3], params) == (dec or FusedCPUDecoder(q)).generate_ids(
        [1, 2, 3], params)


def test_k12r11_the_attention_mirrors_name_q_or_k_for_an_infinite_value():
    """Before: +inf in q reached the internal check of the running scores and was reported as 's'. Now q and k (or
    k_pool) are checked for +-inf first, by name; NaN still propagates, as in the kernels."""
    from minillm.kernels import mirror

    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    bad = q.clone()
    bad[0, 1, 2, 3] = float("inf")
    for fn in (mirror.flash_attention, mirror.flash_attention_v3):
        assert_refused_by_minillm(lambda: fn(bad, k, v), ValueError, r"^q holds \+inf or -inf")
        assert_refused_by_minillm(lambda: fn(q, -bad, v), ValueError, r"^k holds \+inf or -inf")
    pool = torch.randn(4, 2, 2, 8)
    tables, lens = torch.tensor([[0, 1, -1], [2, 3, -1]]), torch.tensor([3, 4])
    qd = torch.randn(2, 2, 8)
    qd[1, 0, 0] = float("-inf")
    assert_refused_by_minillm(lambda: mirror.paged_attention_decode(qd, pool, pool, tables, lens), ValueError,
                              r"^q holds \+inf or -inf")


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
@pytest.mark.parametrize("change", ["replace-wte", "half-ln_f", "eps", "hook"])
def test_a_streamed_fused_decode_notices_a_model_changed_between_two_tokens(change):
    """Before: FusedCPUDecoder looked at the model once per sequence, but chapter 04's `generate` yields every token,
    so a model changed between two of them decoded on with the C++ step's old tensors. Now every step looks cheaply
    (`model_maybe_changed`) and the next token is a ValueError; an in-place update is followed, as documented."""
    import torch.nn as nn

    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate

    torch.manual_seed(0)
    model = GPT(TINY).eval()
    decoder = FusedCPUDecoder(model)
    stream = generate(model, [5, 6, 7], SamplingParams.greedy(8, ignore_eos=True), kv_cache=decoder.cache,
                      decode_fn=decoder, prefill_fn=decoder.prefill)
    next(stream), next(stream)
    if change == "replace-wte":
        model.transformer.wte.weight = nn.Parameter(torch.randn_like(model.transformer.wte.weight))
    elif change == "half-ln_f":
        model.transformer.ln_f.half()
    elif change == "eps":
        model.transformer.h[1].ln_2.eps = 1e-2
    else:
        model.transformer.h[0].mlp.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="FusedCPUDecoder|cannot run forward hooks"):
        next(stream)


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_a_streamed_fused_decode_follows_an_in_place_update_between_two_tokens():
    """The other half of the contract: an in-place update between two streamed tokens is decoded with, as the model's
    own forward does (the C++ step reads the same memory)."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate

    torch.manual_seed(0)
    model = GPT(TINY).eval()
    twin = copy.deepcopy(model)
    decoder = FusedCPUDecoder(model)
    params = SamplingParams.greedy(6, ignore_eos=True)
    fused = generate(model, [5, 6, 7], params, kv_cache=decoder.cache, decode_fn=decoder, prefill_fn=decoder.prefill)
    eager = generate(twin, [5, 6, 7], params)
    got, want = [next(fused), next(fused)], [next(eager), next(eager)]
    with torch.no_grad():
        for m in (model, twin):
            m.transformer.wte.weight.mul_(-1.5)
    got += list(fused)
    want += list(eager)
    assert got == want


class _ZeroMLP(torch.nn.Module):
    """A class swapped in for a block's MLP (`mlp.__class__ = _ZeroMLP`): the eager model then adds nothing there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def _global_hook():
    """A forward hook on every module (torch's global registry), removed by the caller."""
    return torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)


# Changes to the model that the C++ steps cannot follow and a first version of the per-step look missed (hostile run
# 15): a tensor re-viewed in place (same object, same address), a block added, a global hook, a module given its own
# forward or another class, a public attribute the eager forward reads.
WATCHED_CHANGES = {
    "data-transposed": lambda m: setattr(m.transformer.h[0].attn.c_proj.weight, "data",
                                         m.transformer.h[0].attn.c_proj.weight.data.t()),
    "data-negative-view": lambda m: setattr(m.transformer.h[0].attn.c_proj.weight, "data",
                                            torch._neg_view(m.transformer.h[0].attn.c_proj.weight.data)),
    "data-reshaped": lambda m: setattr(m.transformer.h[1].attn.c_attn.weight, "data",
                                       m.transformer.h[1].attn.c_attn.weight.data.view(32, 96)),
    "block-appended": lambda m: m.transformer.h.append(copy.deepcopy(m.transformer.h[0])),
    "forward-replaced": lambda m: setattr(m.transformer.h[0].mlp, "forward", lambda x: torch.zeros_like(x)),
    "class-swapped": lambda m: setattr(m.transformer.h[0].mlp, "__class__", _ZeroMLP),
    "n_head-attribute": lambda m: setattr(m.transformer.h[0].attn, "n_head", 4),
    "global-hook": lambda m: _global_hook(),
}
WATCHED_SAYS = r"was changed since this (FusedEngineModel|FusedCPUDecoder) was built|cannot run forward hooks"
SMALL = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
_UNDO: list[Callable[[], None]] = []  # what a change to a class must put back: _refused_after runs it


def _refused_after(where: str, model: GPT, change: Callable[[GPT], Any], says: str) -> None:
    """Decode on a fused path, apply `change(model)` at the point `where` names, and require a ValueError matching
    `says` at the next step: "fused-decoder" between two tokens of a streamed chapter-04 `generate` on a
    FusedCPUDecoder; "prefix-hit" at the next `generate` of an engine on FusedEngineModel whose prompts' blocks are
    all cached; "mid-generation" between two steps of its running requests. A global hook `change` returns is
    removed afterwards, and whatever `change` pushed on `_UNDO` (a class it patched) is undone."""
    from minillm.compile.fused_engine import FusedEngineModel
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.engine.config import EngineConfig
    from minillm.engine.llm import LLM
    from minillm.kvcache.generate import generate

    params = SamplingParams.greedy(6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]]  # two full blocks of 4 each
    handle = None
    try:
        if where == "fused-decoder":
            decoder = FusedCPUDecoder(model)
            stream = generate(model, prompts[0], params, kv_cache=decoder.cache, decode_fn=decoder,
                              prefill_fn=decoder.prefill)
            next(stream), next(stream)
            handle = change(model)
            with pytest.raises(ValueError, match=says):
                next(stream)
            return
        llm = LLM(FusedEngineModel(model), None, EngineConfig(num_blocks=64, block_size=4,
                                                              enable_prefix_caching=True))
        if where == "prefix-hit":
            llm.generate(prompts, params)  # the prompts' blocks are cached: the next run starts on full hits
            handle = change(model)
            with pytest.raises(ValueError, match=says):
                llm.generate(prompts, params)
        else:
            for p in prompts:
                llm.add_request(p, params)
            llm.step(), llm.step()
            handle = change(model)
            with pytest.raises(ValueError, match=says):
                llm.step()
    finally:
        if hasattr(handle, "remove"):  # a global hook
            handle.remove()
        while _UNDO:
            _UNDO.pop()()


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
@pytest.mark.parametrize("change", sorted(WATCHED_CHANGES))
@pytest.mark.parametrize("where", ["prefix-hit", "mid-generation", "fused-decoder"])
def test_r15_a_fused_step_refuses_every_change_it_cannot_follow(change, where):
    """Before: the per-step look compared objects and addresses only, and the full check ran only where a sequence
    started without a prefix-cache hit, so each change above decoded the old model with no word when every sequence
    hit the prefix cache, or when it came between two steps of running requests. Now every step looks at views,
    dict sizes, classes, instance attributes and global hooks (`WatchedModel`), and the next step is a ValueError."""
    torch.manual_seed(0)
    _refused_after(where, GPT(SMALL).eval(), WATCHED_CHANGES[change], WATCHED_SAYS)


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
@pytest.mark.parametrize("engine", [False, True])
def test_r15_an_in_place_update_of_a_copied_weight_is_seen(engine):
    """Before: a weight the C++ step had to copy (non-contiguous when the step was built) and then updated in place
    through `.data` (which bumps no version counter the step could see) was never noticed: the step decoded the
    stale copy. Now the copy's values are compared with the model's at every step (`TensorWatch`)."""
    from minillm.compile.fused_engine import FusedEngineModel
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.engine.config import EngineConfig
    from minillm.engine.llm import LLM

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    w = model.transformer.h[0].mlp.c_fc.weight
    w.data = w.data.t().contiguous().t()  # the same values, held column-major: the step reads a copy
    assert not w.is_contiguous()
    params = SamplingParams.greedy(4, ignore_eos=True)
    if engine:
        llm = LLM(FusedEngineModel(model), None, EngineConfig(num_blocks=64, block_size=4))
        run = lambda: llm.generate([[5, 6, 7]], params)  # noqa: E731
    else:
        decoder = FusedCPUDecoder(model)
        run = lambda: decoder.generate_ids([5, 6, 7], params)  # noqa: E731
    run()
    w.data.mul_(-2.0)
    with pytest.raises(ValueError, match=r"transformer.h.0.mlp.c_fc.weight \(and maybe others after it\) was "
                                         r"converted, re-viewed or replaced, .* or a copy of it changed"):
        run()


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_r15_a_replaced_tensor_of_the_same_shape_is_refused_by_name():
    """The mutation run's miss: with the address left out of the watch, `w.data = new` (same shape, dtype) decoded
    the old weights. The message names the tensor."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    decoder = FusedCPUDecoder(model)
    decoder.generate_ids([5, 6, 7], SamplingParams.greedy(2, ignore_eos=True))
    model.transformer.wte.weight.data = torch.randn(128, 32)
    with pytest.raises(ValueError, match=r"transformer.wte.weight \(and maybe others after it\) was converted, "
                                         r"re-viewed or replaced"):
        decoder.generate_ids([5, 6, 7], SamplingParams.greedy(2, ignore_eos=True))


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_r15_private_caches_and_equal_values_are_not_changes():
    """The watch must not cry wolf: a module that keeps a private cache (a new `_name` in its instance dict) and an
    attribute written again with an equal value (`eps = 1e-5`) change nothing the step runs, and decoding goes on
    with the same tokens as the eager model."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    params = SamplingParams.greedy(5, ignore_eos=True)
    decoder = FusedCPUDecoder(model)
    want = generate_ids(model, [5, 6, 7], params)
    model.transformer.h[0].attn._scratch_cache = torch.zeros(3)
    model.transformer.h[1].ln_2.eps = float("1e-5") * 1.0
    model.transformer.h[0].attn.n_head = int("2")
    assert not decoder.model_maybe_changed()
    assert decoder.generate_ids([5, 6, 7], params) == want


class _Plain:
    """A module attribute that compares equal element-wise (a dataclass holding a tensor would): bool() raises."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __eq__(self, other: object) -> Any:
        return self.t == getattr(other, "t", None)


def _swap_dict(module: torch.nn.Module, key: str) -> None:
    """Replace a module's own dict `key` whole with a copy holding the same entries but one changed, as a hostile
    user would (`lin._parameters = {...}`)."""
    old = vars(module)[key]
    new = type(old)(old)
    if key == "_parameters":
        new["weight"] = torch.nn.Parameter(torch.randn_like(old["weight"]))
    elif key == "_modules":
        new[next(iter(new))] = copy.deepcopy(next(iter(old.values())))
    else:  # a hook dict: one hook in it
        new[12345] = lambda *a: None
    vars(module)[key] = new


# Run 16's changes: a module's dicts replaced whole, a method patched on the class, and two inputs that crashed the
# watch itself (a non-str key in an instance dict, an attribute whose == does not give a bool).
WATCHED_CHANGES_R16 = {
    "parameters-dict-replaced": lambda m: _swap_dict(m.transformer.h[0].mlp.c_fc, "_parameters"),
    "modules-dict-replaced": lambda m: _swap_dict(m.transformer.h, "_modules"),
    "forward-hooks-dict-replaced": lambda m: _swap_dict(m.transformer.h[1].mlp, "_forward_hooks"),
    "class-forward-patched": lambda m: setattr(type(m.transformer.h[0].mlp), "forward",
                                               lambda self, x: torch.zeros_like(x)),
    "attribute-with-elementwise-eq": lambda m: setattr(m.transformer.h[0].attn, "bias_note", None),
}


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
@pytest.mark.parametrize("change", sorted(WATCHED_CHANGES_R16))
@pytest.mark.parametrize("where", ["prefix-hit", "mid-generation", "fused-decoder"])
def test_r16_dicts_replaced_whole_and_class_methods_are_watched_too(change, where):
    """Before: the watch held the dicts it recorded, not the attributes holding them, so `lin._parameters = {...}`,
    a `_modules` or hook dict replaced whole, or `type(mlp).forward = ...` decoded the old model silently. Now each
    module's dicts, torch's global hook registries and each class's forward/hidden/logits are watched by identity."""
    from minillm.core.model import MLP

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    if change == "attribute-with-elementwise-eq":
        model.transformer.h[0].attn.bias_note = _Plain(torch.zeros(3))
    forward = MLP.forward
    try:
        _refused_after(where, model, WATCHED_CHANGES_R16[change], WATCHED_SAYS)
    finally:
        MLP.forward = forward


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_r16_the_watch_takes_odd_instance_dicts_and_a_deleted_model():
    """Before: a non-str key in a module's instance dict crashed the watch with AttributeError ('int' object has no
    attribute 'startswith'), at construction and at the next step; `del decoder.model` gave an AttributeError.
    Now the key is not an attribute the step reads (decoding goes on), and deleting the model is refused at the
    `del`, naming it."""
    from minillm.compile.fused_engine import FusedEngineModel
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    vars(model.transformer.h[0])[7] = "seven"
    params = SamplingParams.greedy(4, ignore_eos=True)
    want = generate_ids(model, [5, 6, 7], params)
    decoder = FusedCPUDecoder(model)
    vars(model.transformer.h[1])[(1, 2)] = "a tuple key"
    assert decoder.generate_ids([5, 6, 7], params) == want
    with pytest.raises(AttributeError, match="model cannot be deleted"):
        del decoder.model
    assert decoder.generate_ids([5, 6, 7], params) == want  # still whole

    @dataclasses.dataclass
    class Note:  # a dataclass holding a tensor: == compares the tensors element-wise, and bool() of that raises
        t: torch.Tensor

    model.transformer.h[0].note = Note(torch.zeros(3))
    decoder = FusedCPUDecoder(model)
    model.transformer.h[0].note = Note(torch.zeros(3))  # equal, but the comparison gives no bool: named as a change
    with pytest.raises(ValueError, match=r"transformer.h.0.note changed from"):
        decoder.check_step()
    fused = FusedEngineModel(model)
    h = torch.randn(2, SMALL.n_embd)
    torch.testing.assert_close(fused.logits(h), model.logits(h), rtol=1e-4, atol=1e-4)
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    with pytest.raises(ValueError, match=WATCHED_SAYS):
        fused.logits(h)  # before: the old head's logits, since logits never looked at the model



def _replace_instance_dict(module: torch.nn.Module) -> None:
    """`module.__dict__ = {...}`: a copy of its instance dict with one public attribute changed."""
    new = dict(vars(module))
    new["eps"] = 0.5
    module.__dict__ = new


def _reorder_blocks(model: GPT) -> None:
    """The ModuleList's dict reordered in place: the same keys and blocks, block 1 now runs first."""
    d = model.transformer.h._modules
    d["0"] = d.pop("0")


def _compiled_call(module: torch.nn.Module) -> None:
    """What `module.compile()` sets: `module(x)` runs this instead of forward."""
    module._compiled_call_impl = lambda *a, **k: torch.zeros_like(a[0])


# Run 17's changes: an instance dict replaced whole, blocks reordered, torch's per-instance call attributes, a
# class-level __getattr__, and one block left in training mode (dropout on).
WATCHED_CHANGES_R17 = {
    "instance-dict-replaced": lambda m: _replace_instance_dict(m.transformer.h[1].ln_2),
    "blocks-reordered": _reorder_blocks,
    "compiled-call-impl": lambda m: _compiled_call(m.transformer.h[0].mlp),
    "instance-call-impl": lambda m: setattr(m.transformer.h[0].mlp, "_call_impl", lambda *a, **k: a[0] * 0),
    "class-getattr-patched": lambda m: setattr(type(m.transformer.h[0].mlp), "__getattr__",
                                               lambda self, name: torch.nn.Module.__getattr__(self, name)),
    "block-in-training-mode": lambda m: m.transformer.h[0].train(),
}
R17_SAYS = WATCHED_SAYS + r"|is in training mode"


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
@pytest.mark.parametrize("change", sorted(WATCHED_CHANGES_R17))
@pytest.mark.parametrize("where", ["prefix-hit", "mid-generation", "fused-decoder"])
def test_r17_instance_dicts_child_order_call_attributes_and_training_blocks_are_watched(change, where):
    """Before: each of these decoded the old model silently on the fused paths (the watch held the instance dicts it
    recorded, not the module's current one; it never compared a ModuleList's order; it skipped torch's private call
    attributes; it read the model's own train flag only). Now each is a ValueError at the next step."""
    from minillm.core.model import MLP

    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL.to_dict(), "dropout": 0.2})).eval()
    had_getattr = "__getattr__" in vars(MLP)
    try:
        _refused_after(where, model, WATCHED_CHANGES_R17[change], R17_SAYS)
    finally:
        if not had_getattr and "__getattr__" in vars(MLP):
            del MLP.__getattr__


def _class_property(cls: type, name: str, fn: Callable[[Any], Any]) -> Callable[[], None]:
    """Patch `cls.name` with a property computing `fn(self)`; return what undoes it."""
    had, old = name in vars(cls), vars(cls).get(name)
    setattr(cls, name, property(fn))

    def undo() -> None:
        if had:
            setattr(cls, name, old)
        else:
            delattr(cls, name)
    return undo


class _LoudParameter(torch.nn.Parameter):
    """A Parameter subclass swapped in by `__class__` (same storage, same object): its ops could do anything."""


def _swap_param_class(model: GPT) -> None:
    model.transformer.h[0].mlp.c_fc.weight.__class__ = _LoudParameter


# Run 18's changes: a class attribute outside the watched method names (a property shadowing a parameter or a
# submodule, a submodule set on the class), a Parameter's class swapped, a module's own dropout on a dropout-0 model.
WATCHED_CHANGES_R18 = {
    "attention-c_proj-property": lambda m: _UNDO.append(_class_property(
        type(m.transformer.h[0].attn), "c_proj", lambda self: torch.nn.Identity())),
    "block-ln_2-on-the-class": lambda m: _UNDO.append(_class_property(
        type(m.transformer.h[0]), "ln_2", lambda self: torch.nn.Identity())),
    "parameter-class-swapped": _swap_param_class,
    "own-dropout-training": lambda m: (setattr(m.transformer.h[0].attn, "dropout", 0.5),
                                       m.transformer.h[0].attn.train()),
}


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
@pytest.mark.parametrize("change", sorted(WATCHED_CHANGES_R18))
@pytest.mark.parametrize("where", ["prefix-hit", "mid-generation", "fused-decoder"])
def test_r18_class_attributes_parameter_classes_and_own_dropout_are_watched(change, where):
    """Before: a property or submodule set on a module's class (outside forward/hidden/logits/...; torch's own
    classes are out of scope, as its functions are), a Parameter
    whose __class__ was swapped, and a block with its own dropout put in training mode on a dropout-0 model each
    decoded the old model silently. Now every Python class along each module's MRO is watched attribute by
    attribute, each tensor's class too, and the training check looks for any dropout the model has."""
    torch.manual_seed(0)
    _refused_after(where, GPT(SMALL).eval(), WATCHED_CHANGES_R18[change],
                   WATCHED_SAYS + r"|is in training mode|was changed: its|class was changed")


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_r18_odd_values_and_an_embedding_with_max_norm():
    """Before: an attribute changed to an int past Python's digit limit (or one whose repr raises) made the watch's
    own message fail (the change was seen, the error was Python's); an embedding with max_norm (its forward
    renormalizes the rows) was decoded as stored; a model removed behind the decoder's back with object.__delattr__
    gave an AttributeError mid-stream. Now: a ValueError naming the attribute, a TypeError naming the embedding, and
    the step's own ValueError."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    decoder = FusedCPUDecoder(model)
    model.transformer.h[0].attn.n_head = 10 ** 5000
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.n_head changed from 2 to <a int>"):
        decoder.check_step()
    model = GPT(SMALL).eval()
    model.transformer.wte.max_norm = 1.0
    with pytest.raises(TypeError, match=r"transformer.wte has max_norm=1.0"):
        FusedCPUDecoder(model)
    model = GPT(SMALL).eval()
    decoder = FusedCPUDecoder(model)
    stream = generate(model, [5, 6, 7], SamplingParams.greedy(4, ignore_eos=True), kv_cache=decoder.cache,
                      decode_fn=decoder, prefill_fn=decoder.prefill)
    next(stream)
    object.__delattr__(decoder, "model")
    with pytest.raises(ValueError, match="runs its own model over its own cache"):
        next(stream)


def test_r18_a_kernels_cache_that_is_a_file_is_named(tmp_path, monkeypatch):
    """Before: MINILLM_KERNELS_CACHE naming a file reached pathlib's NotADirectoryError, naming no variable."""
    from minillm.kernels.build import cache_dir

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("MINILLM_KERNELS_CACHE", str(tmp_path / "file"))
    with pytest.raises(ValueError, match="MINILLM_KERNELS_CACHE=.*is not a folder"):
        cache_dir()


class _Shim(torch.nn.Module):
    """A base slipped under MLP (`MLP.__bases__ = (_Shim,)`): its property shadows the c_fc submodule."""

    @property
    def c_fc(self):
        return torch.nn.Identity()


def _swap_bases(model: GPT) -> None:
    from minillm.core.model import MLP

    _UNDO.append(lambda old=MLP.__bases__: setattr(MLP, "__bases__", old))
    MLP.__bases__ = (_Shim,)


def _swap_code(model: GPT) -> None:
    from minillm.core.model import MLP

    old = MLP.forward.__code__
    _UNDO.append(lambda: setattr(MLP.forward, "__code__", old))
    MLP.forward.__code__ = (lambda self, x: x * 0).__code__


# Run 19's changes: a class's bases reassigned, a method's code object replaced, a module's own dropout given as a
# numpy number (its training mode then runs dropout).
WATCHED_CHANGES_R19 = {
    "bases-reassigned": _swap_bases,
    "code-replaced": _swap_code,
    "numpy-dropout-training": lambda m: m.transformer.h[0].attn.train(),
}


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
@pytest.mark.parametrize("change", sorted(WATCHED_CHANGES_R19))
@pytest.mark.parametrize("where", ["prefix-hit", "mid-generation", "fused-decoder"])
def test_r19_bases_code_objects_and_any_dropout_are_watched(change, where):
    """Before: `MLP.__bases__ = (...)`, `MLP.forward.__code__ = ...`, and a block whose own dropout is a numpy
    number put in training mode each decoded the old model silently. Now each class's MRO and each watched
    function's code object are held too, and any dropout value that is not exactly 0 counts."""
    import numpy as np

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    model.transformer.h[0].attn.dropout = np.float32(0.5)
    _refused_after(where, model, WATCHED_CHANGES_R19[change],
                   WATCHED_SAYS + r"|is in training mode|has other bases|code of .* was replaced")


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_r19_what_python_and_torch_write_into_classes_is_no_change():
    """The false alarms of the class watch (it refused the tour's own chapter 13 once): Python stores an empty
    __annotations__ in a class at its first read (help(), typing), and torch.compile's first use in a process
    patches nn.Module.__init__ / __setstate__ and sets a flag on it. None of them changes what a model computes."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.model import MLP
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    params = SamplingParams.greedy(4, ignore_eos=True)
    want = generate_ids(model, [5, 6, 7], params)
    decoder = FusedCPUDecoder(model)
    vars(MLP).get("__annotations__")
    MLP.__annotations__  # noqa: B018 (a read that writes)
    old = {k: vars(torch.nn.Module).get(k) for k in ("__setstate__", "___planted_flag")}
    try:
        torch.nn.Module.__setstate__ = lambda self, state: old["__setstate__"](self, state)
        torch.nn.Module.___planted_flag = True
        assert decoder.generate_ids([5, 6, 7], params) == want
    finally:
        torch.nn.Module.__setstate__ = old["__setstate__"]
        del torch.nn.Module.___planted_flag


def test_r19_a_kernels_cache_under_a_file_or_a_broken_link_is_named(tmp_path, monkeypatch):
    """Before: MINILLM_KERNELS_CACHE under a regular file or on a dangling link reached pathlib's errors."""
    from minillm.kernels.build import cache_dir

    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    for bad in (tmp_path / "file" / "under", tmp_path / "link"):
        monkeypatch.setenv("MINILLM_KERNELS_CACHE", str(bad))
        with pytest.raises(ValueError, match="MINILLM_KERNELS_CACHE=.*is not a folder"):
            cache_dir()


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
@pytest.mark.parametrize("where", ["prefix-hit", "mid-generation", "fused-decoder"])
def test_r20_a_tag_on_the_model_is_named_as_what_it_is(where):
    """Before: a public attribute added to the model (a tag no forward reads) was refused as "the model's
    parameters or buffers were converted or replaced": the watch counts every public attribute (it cannot tell which
    ones a forward reads), so the refusal stays, but the message now opens with what happened."""
    torch.manual_seed(0)
    _refused_after(where, GPT(SMALL).eval(),
                   lambda m: setattr(m, "note", "run 3"),
                   r"^the model was changed since this (FusedEngineModel|FusedCPUDecoder) was built: the model was "
                   r"given 'note'")


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_r20_a_private_tag_is_no_change():
    """What the class doc says a user can do instead of a public tag: a private name the class does not define."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams
    from minillm.kvcache.generate import generate_ids

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    params = SamplingParams.greedy(4, ignore_eos=True)
    want = generate_ids(model, [5, 6, 7], params)
    decoder = FusedCPUDecoder(model)
    model._note = "run 3"
    assert decoder.generate_ids([5, 6, 7], params) == want


@pytest.mark.parametrize("kernel", ["naive", "mirror", "emulator"])
def test_r20_layernorm_takes_a_numpy_eps_as_the_number_it_holds(kernel):
    """Before: eps=np.float32(1e-5) was refused with "eps must be a finite number in [...]" (np.float64 passed: it
    subclasses float). Any real number is read as the float it holds; a str or a tensor is a TypeError naming eps."""
    import numpy as np

    from minillm.kernels import mirror, naive

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    fn = {"naive": lambda e: naive.layernorm(x, w, b, eps=e),
          "mirror": lambda e: mirror.layernorm_warp(x, w, b, eps=e),
          "emulator": lambda e: emulator.layernorm(x, w, b, 1, eps=e)}[kernel]
    for eps in (np.float32(1e-3), np.float16(1e-3), np.int64(1)):
        torch.testing.assert_close(fn(eps), fn(float(eps)), rtol=0, atol=0)
    for bad in ("1e-5", torch.tensor(1e-5), np.bool_(True), None):
        with pytest.raises(TypeError, match=r"^eps must be a real number"):
            fn(bad)
    with pytest.raises(ValueError, match=r"^eps must be within the float range"):
        fn(10 ** 5000)


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_r21_share_memory_is_refused_saying_the_storage_moved():
    """`model.share_memory()` moves every tensor's storage (same values): the C++ step still reads the old storage
    and would miss later in-place updates, so it stays refused, but the message now says a move counts."""
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    decoder = FusedCPUDecoder(model)
    decoder.generate_ids([5, 6, 7], SamplingParams.greedy(2, ignore_eos=True))
    model.share_memory()
    with pytest.raises(ValueError, match=r"transformer.wte.weight \(and maybe others after it\) .* storage moved "
                                         r"\(model.share_memory\(\)"):
        decoder.generate_ids([5, 6, 7], SamplingParams.greedy(2, ignore_eos=True))


def test_r22_thread_counts_are_bounded_everywhere_torch_takes_them():
    """Before: `minillm.compile.sweep --threads-list 100000` (and run_sweep(threads=(100000,))) segfaulted in
    torch's thread pool (10**9 aborted in libgomp): only --threads was bounded. Every count now is, as
    check_threads says (at most 4 per core), before anything runs; so is DisaggConfig.num_threads."""
    from minillm.compile.sweep import run_sweep, thread_counts
    from minillm.disagg.config import DisaggConfig

    most = 4 * (os.cpu_count() or 1)
    with pytest.raises(ValueError, match=rf"^threads\[1\] must be at most {most} "):
        thread_counts(f"1,{most + 1}")
    assert thread_counts(f"1,{most}") == (1, most)
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match=r"^threads\[0\] must be at most"):
        run_sweep(GPT(SMALL).eval(), threads=(100000,), steps=2, repeats=1)
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match=r"^DisaggConfig.num_threads must be at most"):
        DisaggConfig(num_threads=100000)
    with pytest.raises(TypeError, match=r"^DisaggConfig.num_threads must be an int, got bool"):
        DisaggConfig(num_threads=True)
    assert DisaggConfig(num_threads=0).num_threads == 0


def test_r22_max_len_is_read_as_the_int_it_holds():
    """Before: a max_len whose comparisons lie was kept as given, and the decoders' later checks answered nonsense
    ("max_len=1000 is too short ... need 6"). It is compared as the plain int it holds."""
    from minillm.compile.decode import decoder_max_len

    with pytest.raises(ValueError, match=r"^max_len=1000 is past the model's context window block_size=32"):
        decoder_max_len(SMALL, LyingInt(1000))
    assert type(decoder_max_len(SMALL, LyingInt(16))) is int


def test_r23_a_thread_count_that_lies_is_bounded_by_the_int_it_holds():
    """Before: check_threads compared the caller's object, so an int subclass whose comparisons lie passed the
    bound: run_sweep(threads=(LyingInt(100000),)) crashed torch's pool, DisaggConfig stored 10**6 threads, and
    cold_start's subprocess died with exit -11. check_int returns the plain int, and the bounds compare it."""
    from minillm.compile.aot import cold_start
    from minillm.compile.sweep import run_sweep
    from minillm.core.config import check_threads
    from minillm.disagg.config import DisaggConfig

    for call in (lambda: check_threads("threads", LyingInt(100000)),
                 lambda: run_sweep(GPT(SMALL).eval(), threads=(LyingInt(100000),), steps=1, repeats=1),
                 lambda: DisaggConfig(num_threads=LyingInt(10 ** 6)),
                 lambda: cold_start(threads=LyingInt(10 ** 6))):
        with pytest.raises(ValueError, match=r"threads(\[0\])? must be at most"):
            call()
    assert type(DisaggConfig(num_threads=LyingInt(1)).num_threads) is int


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_r23_verify_reads_token_ids_as_every_entry_point_does():
    """Before: FusedCPUDecoder.verify refused numpy ints and met an id past int64 as pybind's "incompatible function
    arguments". It checks ids as prompts are checked (check_token_ids)."""
    import numpy as np

    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.core.sampling import SamplingParams

    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    dec = FusedCPUDecoder(model)
    dec.generate_ids([5, 6, 7], SamplingParams.greedy(2, ignore_eos=True))
    with pytest.raises(ValueError, match=r"^tokens\[0\] = 9223372036854775808 is outside the vocabulary"):
        dec.verify([2 ** 63])
    length = dec.cache.length
    plain = dec.verify([1, 2])
    dec.cache.truncate(length)
    torch.testing.assert_close(dec.verify([np.int64(1), np.int32(2)]), plain, rtol=0, atol=0)


def test_r23_numpy_numbers_are_refused_saying_to_convert():
    """Before: "version must be an int, got int64" and "field 'loss' must be a number, got float32" (it is one)."""
    import numpy as np

    from minillm.core.sampling import SamplingParams
    from minillm.distill.run_state import check_record

    with pytest.raises(ValueError, match=r"must be a number, got float32 .* convert it with int\(\) or float\(\)"):
        check_record({"loss": np.float32(1.0)}, ("loss",), "objective.records[0]")
    with pytest.raises(TypeError, match=r"version must be an int, got int64 .* convert it with int\(\)"):
        emulator.softmax(torch.randn(4, 8), np.int64(2))
    with pytest.raises(TypeError, match=r"^top_k must be an int, got int64 .* convert it"):
        SamplingParams(top_k=np.int64(3))


def test_r23_a_damaged_onnx_metadata_entry_is_named_with_the_file(tmp_path):
    """Before: a flipped byte in a metadata value (protobuf hands non-UTF-8 text back as bytes) was json's
    "Object of type bytes is not JSON serializable"."""
    onnx = pytest.importorskip("onnx")
    from minillm.compile.onnx_peer import graph_sha256

    proto = onnx.ModelProto()
    entry = proto.metadata_props.add()
    entry.key = "minillm_config"
    entry.value = "x"
    proto.metadata_props[0].ParseFromString(b"\n\x0eminillm_config\x12\x02\xff\xfe")
    with pytest.raises(ValueError, match=r"^metadata entry 'minillm_config' = b'\\xff\\xfe' is not UTF-8 text"):
        graph_sha256(proto)


# ------------------------------------------------------------------ a build killed mid-way
# torch's extension loader marks a build with a `lock` file in its build directory and makes every later loader wait
# for it, forever. A build killed by a signal (a test's timeout killed a CLI while it compiled chapter 13's
# extension) left that file, and every later import of the extension hung with no message. `build_lock` holds an
# flock around each load (released by the OS when its holder dies) and clears a baton no live build holds.

def test_build_lock_clears_a_dead_builds_baton_and_excludes_a_live_one(tmp_path):
    import fcntl
    from minillm.kernels.build import build_lock

    (tmp_path / "lock").touch()  # what a killed build leaves
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "minillm.lock", "a") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second builder would wait here, not race
    with open(tmp_path / "minillm.lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on the way out


def test_a_build_that_fails_or_is_interrupted_is_built_again_by_the_next_load(tmp_path):
    """torch records an extension's sources per process before building it and skips the build of a later load
    with the same sources; after a failed or interrupted build (Ctrl-C in a notebook) that load imported a library
    that was never written ("cannot open shared object file"), until the kernel restarted. `build_lock` drops the
    record when the load fails, and keeps it when the load succeeds."""
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

    from minillm.kernels.build import build_lock

    name = "minillm_test_forgotten"
    JIT_EXTENSION_VERSIONER.entries[name] = "recorded before the build"
    with pytest.raises(KeyboardInterrupt), build_lock(tmp_path, name):
        raise KeyboardInterrupt  # the user's interrupt, mid-build
    assert name not in JIT_EXTENSION_VERSIONER.entries
    JIT_EXTENSION_VERSIONER.entries[name] = "recorded before the build"
    with build_lock(tmp_path, name):
        pass  # a load that succeeded
    assert JIT_EXTENSION_VERSIONER.entries.pop(name) == "recorded before the build"


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_a_stale_torch_baton_does_not_hang_the_next_load():
    """End to end, in a fresh process: a `lock` file in the extension's build directory (as a killed build leaves
    it), and the load still completes (from the cache the other tests built, so no new compile)."""
    code = ("from minillm.compile.cpu_gemv import build_flags, load_cpu_ext, sources_digest\n"
            "from minillm.kernels.build import cache_dir\n"
            "d = cache_dir() / f'{build_flags()[1]}-{sources_digest()}'\n"
            "d.mkdir(parents=True, exist_ok=True)\n"
            "(d / 'lock').touch()\n"
            "print(load_cpu_ext().uses_avx2() in (True, False))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
