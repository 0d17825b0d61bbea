"""Every public function, class and method of chapters 08-13, called with values no caller should pass.

A sweep, not a table: each public function and class of the chapters' packages (found by walking the modules, so a
new one is swept the day it is added), and each public method of each public class on an instance built here,
is called with the same wrong value for every required argument: None, a str, an empty list, NaN, -1, an empty
dict, a tensor, a bare object. The contract is the one the chapters keep for bad input: a TypeError / ValueError
(or FileNotFoundError) from minillm's own checks, or a RuntimeError that says this machine cannot run the thing at
all (no CUDA GPU, no compiler); never an AttributeError, IndexError, KeyError ... from inside the code, and never a
hang. An instance is built afresh for each call, so one bad call cannot leave state that the next one trips on.

Each class with public methods needs a factory below (`INSTANCES`); one without a factory fails the test, so a new
class cannot skip the sweep. `NOT_SWEPT` lists what is left out, each with its reason.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import pkgutil
import re
import signal
import threading

import pytest
import torch
import torch.nn as nn

from minillm.core.config import GPTConfig
from minillm.core.model import GPT

PACKAGES = ("speculative", "quant", "prune", "distill", "kernels", "compile")  # chapters 08-13
BAD_VALUES = {"None": None, "str": "zzz", "empty list": [], "NaN": float("nan"), "-1": -1, "empty dict": {},
              "tensor": "tensor", "object": "object"}  # the tensor and the object are made fresh for each call
NOT_SWEPT = {
    # whole runs: they take minutes with good arguments, and their arguments are checked by the argv / report
    # tests (tests/test_hostile_shared.py) and by the functions they call, swept here
    "main", "run", "run_all", "cold_start",
    # the Drafter protocol's empty bodies (the engine's drafters below implement and check them)
    "minillm.speculative.engine.Drafter",
}
CALL_SECONDS = 30  # far past any check: a call still running then is a hang (or real work on a bad value)
NO_MACHINE = re.compile(r"needs? a CUDA|CUDA GPU|cannot build|no CUDA|not installed|nvcc|CPU only|cannot export")

CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16)


@functools.lru_cache(maxsize=None)
def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).eval()


def _state():
    """A RequestState for the proposers, of a greedy request."""
    from minillm.core.sampling import SamplingParams
    from minillm.core.stopping import start_request

    return start_request(CFG, [1, 2, 3, 1, 2], SamplingParams.greedy(4), None, None)


def _engine_parts():
    from minillm.engine.config import EngineConfig
    from minillm.paged.block_manager import BlockManager

    return EngineConfig(num_blocks=16, block_size=4), BlockManager(16, 4)


def _draft_proposer():
    from minillm.speculative.generate import DraftModelProposer

    p = DraftModelProposer(_model(), 16)
    p.prefill([1, 2, 3, 1, 2])
    return p


def _fused_draft_proposer():
    from minillm.compile.fused_speculative import FusedDraftProposer
    from minillm.compile.fused_step import FusedCPUDecoder

    p = FusedDraftProposer(FusedCPUDecoder(_model(), max_len=16))
    p.prefill([1, 2, 3, 1, 2])
    return p


def _speculative_scheduler():
    from minillm.speculative.engine import PromptLookupDrafter, SpeculativeScheduler

    config, blocks = _engine_parts()
    return SpeculativeScheduler(config, blocks, PromptLookupDrafter(2, CFG.vocab_size, torch.device("cpu")), 2,
                                CFG.vocab_size)


def _quantized(kind: str, module: str):
    from minillm.quant.linear import QuantConfig, quantize_model

    q = quantize_model(_model(), QuantConfig(kind, group_size=8, quantize_head=True))
    return dict(q.named_modules())[module]


@functools.lru_cache(maxsize=None)
def _wide_model() -> GPT:
    """A model for the prune benchmark's validation text (the shipped tokenizer's 4096 ids), with room for its
    prompts and generations."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()


def _prune_harness():
    from minillm.prune import bench

    return bench.Harness(_wide_model(), False, bench.Sizes(256, 2, 4, 4, 1, 2, (0.5,), 128, (0.25,), 1, False, 1, 1), 0)


def _record_log():
    import tempfile
    from pathlib import Path

    from minillm.distill.run_state import RecordLog

    return RecordLog(Path(tempfile.mkdtemp(prefix="minillm-surface-")) / "log.jsonl")


def _with_batch(cache):
    """A paged cache holding a step's batch: one sequence, one new token in slot 0 (what `attend` reads)."""
    from minillm.paged.paged_cache import PagedBatch

    one = torch.tensor([1])
    cache.set_batch(PagedBatch(torch.tensor([0]), torch.tensor([[0]]), one, one))
    return cache


def _cpp_verify_cache():
    from minillm.compile.cpu_paged import CppVerifyKVCache

    return _with_batch(CppVerifyKVCache(CFG, 16, 4))


INSTANCES = {
    "minillm.speculative.engine.PromptLookupDrafter":
        lambda: __import__("minillm.speculative.engine", fromlist=["x"]).PromptLookupDrafter(
            2, CFG.vocab_size, torch.device("cpu")),
    "minillm.speculative.engine.DraftModelDrafter":
        lambda: __import__("minillm.speculative.engine", fromlist=["x"]).DraftModelDrafter(_model()),
    "minillm.speculative.engine.SpeculativeScheduler": _speculative_scheduler,
    "minillm.speculative.engine.SpeculativeSampler":
        lambda: __import__("minillm.speculative.engine", fromlist=["x"]).SpeculativeSampler(),
    "minillm.speculative.generate.DraftModelProposer": _draft_proposer,
    "minillm.speculative.generate.PromptLookupProposer":
        lambda: __import__("minillm.speculative.generate", fromlist=["x"]).PromptLookupProposer(
            2, CFG.vocab_size, torch.device("cpu")),
    "minillm.speculative.verify_cache.VerifyKVCache":
        lambda: _with_batch(__import__("minillm.speculative.verify_cache", fromlist=["x"]).VerifyKVCache(CFG, 16, 4)),
    "minillm.quant.kv_cache.Int8ContiguousKVCache":
        lambda: __import__("minillm.quant.kv_cache", fromlist=["x"]).Int8ContiguousKVCache(CFG, 1, 16),
    "minillm.quant.kv_cache.FakeQuantContiguousKVCache":
        lambda: __import__("minillm.quant.kv_cache", fromlist=["x"]).FakeQuantContiguousKVCache(CFG, 1, 16),
    "minillm.quant.kv_cache.Int8PagedKVCache":
        lambda: _with_batch(__import__("minillm.quant.kv_cache", fromlist=["x"]).Int8PagedKVCache(CFG, 16, 4)),
    "minillm.quant.linear.QuantLinear": lambda: _quantized("int8", "transformer.h.0.mlp.c_fc"),
    "minillm.quant.linear.QuantEmbedding": lambda: _quantized("int8", "transformer.wte"),
    "minillm.quant.linear.TiedQuantHead": lambda: _quantized("int8", "lm_head"),
    "minillm.quant.qat.FakeQuantLinear":
        lambda: dict(__import__("minillm.quant.qat", fromlist=["x"]).prepare_qat(
            _model(), __import__("minillm.quant.linear", fromlist=["x"]).QuantConfig("int8")).named_modules())[
            "transformer.h.0.mlp.c_fc"],
    "minillm.prune.bench.Harness": _prune_harness,
    "minillm.prune.semi_structured.SemiStructuredLinear":
        lambda: __import__("minillm.prune.semi_structured", fromlist=["x"]).SemiStructuredLinear(nn.Linear(16, 8)),
    "minillm.distill.losses.FeatureProjection":
        lambda: __import__("minillm.distill.losses", fromlist=["x"]).FeatureProjection(16, 16, [(0, 1)]),
    "minillm.distill.run_state.RecordLog": _record_log,
    "minillm.distill.train.DistillObjective":
        lambda: __import__("minillm.distill.train", fromlist=["x"]).DistillObjective(_model()),
    "minillm.compile.aot.DecodeStep": lambda: __import__("minillm.compile.aot", fromlist=["x"]).DecodeStep(
        _model(), 16),
    "minillm.compile.cpu_gemv.FastLinear": lambda: __import__("minillm.compile.cpu_gemv", fromlist=["x"]).FastLinear(
        16, 8),
    "minillm.compile.cpu_paged.CppVerifyKVCache": _cpp_verify_cache,
    "minillm.compile.decode.StaticDecoder": lambda: __import__("minillm.compile.decode", fromlist=["x"]).StaticDecoder(
        _model(), "eager", max_len=16),
    "minillm.compile.fused_engine.FusedEngineModel":
        lambda: __import__("minillm.compile.fused_engine", fromlist=["x"]).FusedEngineModel(_model()),
    "minillm.compile.fused_speculative.FusedDraftProposer": _fused_draft_proposer,
    "minillm.compile.fused_step.FusedCPUDecoder":
        lambda: __import__("minillm.compile.fused_step", fromlist=["x"]).FusedCPUDecoder(_model(), max_len=16),
    "minillm.compile.onnx_peer.OnnxStep": lambda: __import__("minillm.compile.onnx_peer", fromlist=["x"]).OnnxStep(
        _model()),
}
FILE_BACKED = {  # built from an exported file: the tests of their chapter sweep their methods' arguments
    "minillm.compile.aot.AOTDecoder": "an AOTInductor package takes tens of seconds to build "
                                      "(tests/test_compile_aot.py checks generate's arguments)",
    "minillm.compile.onnx_peer.OnnxDecoder": "an ONNX export needs the optional onnx packages "
                                             "(tests/test_compile_onnx.py checks generate's arguments)",
}


def _required(fn, bound: bool) -> int:
    params = list(inspect.signature(fn).parameters.values())[(1 if bound else 0):]
    return sum(1 for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _surface() -> tuple[list[tuple[str, object, int]], list[tuple[str, str, int]]]:
    """(functions and classes: (qualified name, object, required arguments)), (methods: (class name, method name,
    required arguments)), from walking the chapters' modules."""
    functions, methods = [], []
    for pkg in PACKAGES:
        package = importlib.import_module(f"minillm.{pkg}")
        for info in pkgutil.iter_modules(package.__path__):
            name = f"minillm.{pkg}.{info.name}"
            module = importlib.import_module(name)
            for attr, obj in vars(module).items():
                qualified = f"{name}.{attr}"
                if (attr.startswith("_") or attr in NOT_SWEPT or qualified in NOT_SWEPT
                        or getattr(obj, "__module__", None) != name):
                    continue
                if inspect.isclass(obj) and issubclass(obj, BaseException):
                    continue
                if (inspect.isfunction(obj) or inspect.isclass(obj)) and (n := _required(obj, False)):
                    functions.append((qualified, obj, n))
                if not inspect.isclass(obj):
                    continue
                for method, value in vars(obj).items():
                    if method.startswith("_") and method != "__call__":
                        continue
                    if isinstance(value, (staticmethod, classmethod)):
                        if n := _required(value.__func__, isinstance(value, classmethod)):
                            functions.append((f"{qualified}.{method}", getattr(obj, method), n))
                    elif inspect.isfunction(value) and (n := _required(value, True)):
                        methods.append((qualified, method, n))
    return functions, methods


FUNCTIONS, METHODS = _surface()


class _Hang(Exception):
    pass


def _make(value):
    """A bad value as passed: the tensor and the object made fresh (a call may keep or change what it is given)."""
    return torch.zeros(2) if value == "tensor" else object() if value == "object" else value


def _call_once(call, label: str, what: str) -> str | None:
    """Run call() under a CALL_SECONDS alarm: None when it raised a clear error, "accepted" when it returned (a
    generator's first item drawn: its checks run there), else the unclear outcome, named."""
    def alarm(*_):
        raise _Hang()

    main = threading.current_thread() is threading.main_thread()
    if main:
        previous = signal.signal(signal.SIGALRM, alarm)
        signal.alarm(CALL_SECONDS)
    try:
        out = call()
        if inspect.isgenerator(out):
            next(out, None)
        return "accepted"
    except (TypeError, ValueError, FileNotFoundError, argparse.ArgumentTypeError):  # the last: a CLI flag's type
        return None
    except RuntimeError as e:
        return None if NO_MACHINE.search(str(e)) else f"{label} with {what}: RuntimeError {str(e)[:200]}"
    except _Hang:
        return f"{label} with {what}: still running after {CALL_SECONDS} s"
    except Exception as e:  # noqa: BLE001 - the point: anything else is an unclear error
        return f"{label} with {what}: {type(e).__name__}: {str(e)[:200]}"
    finally:
        if main:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _call(fn, n: int, label: str) -> str | None:
    """Call fn with each bad value for all of its n required arguments; the first unclear outcome, or None."""
    for name, value in BAD_VALUES.items():
        problem = _call_once(lambda: fn(*[_make(value) for _ in range(n)]), label, name)
        if problem not in (None, "accepted"):
            return problem
    return None


def test_the_sweep_reaches_every_chapter():
    """The walk finds the public surface (a broken walk would pass everything by finding nothing)."""
    assert len(FUNCTIONS) > 150 and len(METHODS) > 40, (len(FUNCTIONS), len(METHODS))
    assert {name.split(".")[1] for name, _, _ in FUNCTIONS} == set(PACKAGES)


@pytest.mark.parametrize("name,fn,n", FUNCTIONS, ids=[f for f, _, _ in FUNCTIONS])
def test_every_public_function_refuses_bad_values_by_name(name, fn, n):
    problem = _call(fn, n, name)
    assert problem is None, problem


@pytest.mark.parametrize("cls,method,n", METHODS, ids=[f"{c}.{m}" for c, m, _ in METHODS])
def test_every_public_method_refuses_bad_values_by_name(cls, method, n):
    if cls in FILE_BACKED:
        pytest.skip(FILE_BACKED[cls])
    assert cls in INSTANCES, f"{cls} has public methods but no factory in INSTANCES: add one so they are swept"
    try:
        INSTANCES[cls]()
    except RuntimeError as e:
        if NO_MACHINE.search(str(e)):
            pytest.skip(f"{cls} cannot be built here: {e}")
        raise

    def call(*args):
        return getattr(INSTANCES[cls](), method)(*args)

    problem = _call(call, n, f"{cls}.{method}")
    assert problem is None, problem


# ----- one argument at a time -------------------------------------------------------------------------------------
# The sweep above gives every argument the same bad value, so the first argument checked answers for all. Here each
# method is called with a good call's arguments (`GOOD`), one of them replaced by each bad value in turn: an argument
# read before it is checked, or never checked, fails here even when an earlier one is checked.

def _request():
    from minillm.core.sampling import SamplingParams
    from minillm.engine.request import Request

    return Request("r0", [1, 2, 3, 1, 2], SamplingParams.greedy(4))


def _qkv():
    return tuple(torch.randn(1, CFG.n_head, 1, CFG.head_size) for _ in range(3))  # (B, nh, T, hs)


def _greedy(n: int):
    from minillm.core.sampling import SamplingParams

    return SamplingParams.greedy(n)


def _paged_cache():
    from minillm.paged.paged_cache import PagedKVCache

    return PagedKVCache(CFG, 16, 4)


def _step_output():
    from minillm.engine.scheduler import SchedulerOutput

    return SchedulerOutput()


GOOD = {  # (class, method) -> instance -> the arguments of a call that works
    ("minillm.speculative.engine.PromptLookupDrafter", "propose"): lambda i: (_request(), 2),
    ("minillm.speculative.engine.PromptLookupDrafter", "rollback"): lambda i: (_request(), 2),
    ("minillm.speculative.engine.PromptLookupDrafter", "release"): lambda i: ("r0",),
    ("minillm.speculative.engine.DraftModelDrafter", "propose"): lambda i: (_request(), 2),
    ("minillm.speculative.engine.DraftModelDrafter", "rollback"): lambda i: (_request(), 2),
    ("minillm.speculative.engine.DraftModelDrafter", "release"): lambda i: ("r0",),
    ("minillm.speculative.engine.SpeculativeScheduler", "update"): lambda i: (_step_output(), [], 0.0),
    ("minillm.speculative.engine.SpeculativeScheduler", "abort"): lambda i: ("r0",),
    ("minillm.speculative.engine.SpeculativeSampler", "sample"): lambda i: (_step_output(), torch.zeros(0, 64)),
    ("minillm.speculative.generate.DraftModelProposer", "prefill"): lambda i: ([1, 2, 3],),
    ("minillm.speculative.generate.DraftModelProposer", "propose"): lambda i: ([1, 2, 3, 1, 2], 2, _state()),
    ("minillm.speculative.generate.DraftModelProposer", "rollback"): lambda i: (2,),
    ("minillm.speculative.generate.PromptLookupProposer", "prefill"): lambda i: ([1, 2, 3],),
    ("minillm.speculative.generate.PromptLookupProposer", "propose"): lambda i: ([1, 2, 3, 1, 2], 2, _state()),
    ("minillm.speculative.generate.PromptLookupProposer", "rollback"): lambda i: (2,),
    ("minillm.quant.kv_cache.Int8ContiguousKVCache", "attend"): lambda i: (0, *_qkv()),
    ("minillm.quant.kv_cache.FakeQuantContiguousKVCache", "attend"): lambda i: (0, *_qkv()),
    ("minillm.speculative.verify_cache.VerifyKVCache", "attend"): lambda i: (0, *_qkv()),
    ("minillm.quant.kv_cache.Int8PagedKVCache", "attend"): lambda i: (0, *_qkv()),
    ("minillm.quant.kv_cache.Int8PagedKVCache", "gather"): lambda i: (0, 0),
    ("minillm.compile.cpu_paged.CppVerifyKVCache", "attend"): lambda i: (0, *_qkv()),
    ("minillm.compile.fused_engine.FusedEngineModel", "fusable"): lambda i: (_with_batch(_paged_cache()), 1),
    ("minillm.compile.fused_step.FusedCPUDecoder", "__call__"):
        lambda i: (i.model, i.cache, torch.tensor([1]), torch.tensor([0])),
    ("minillm.compile.fused_step.FusedCPUDecoder", "prefill"):
        lambda i: (i.model, i.cache, torch.tensor([[1, 2]]), torch.arange(2)),
    ("minillm.quant.linear.QuantLinear", "forward"): lambda i: (torch.randn(1, CFG.n_embd),),
    ("minillm.quant.linear.QuantEmbedding", "forward"): lambda i: (torch.tensor([[1, 2]]),),
    ("minillm.quant.linear.TiedQuantHead", "forward"): lambda i: (torch.randn(1, CFG.n_embd),),
    ("minillm.quant.qat.FakeQuantLinear", "forward"): lambda i: (torch.randn(1, CFG.n_embd),),
    ("minillm.prune.bench.Harness", "check_pruned"): lambda i: (i.model, "quality"),
    ("minillm.distill.losses.FeatureProjection", "forward"):
        lambda i: ([torch.randn(1, 4, 16)] * 2, [torch.randn(1, 4, 16)] * 2),
    ("minillm.distill.run_state.RecordLog", "__call__"): lambda i: ({"step": 1, "loss": 1.0},),
    ("minillm.distill.train.DistillObjective", "forward"):
        lambda i: (_model(), torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 4]])),
    ("minillm.compile.aot.DecodeStep", "forward"): lambda i: (torch.tensor([[1]]), torch.tensor([[0]])),
    ("minillm.compile.cpu_gemv.FastLinear", "forward"): lambda i: (torch.randn(1, 16),),
    ("minillm.compile.cpu_gemv.FastLinear", "check_input"): lambda i: (torch.randn(1, 16),),
    ("minillm.compile.decode.StaticDecoder", "__call__"):
        lambda i: (i.model, i.cache, torch.tensor([1]), torch.tensor([0])),
    ("minillm.compile.decode.StaticDecoder", "generate_ids"): lambda i: ([1, 2, 3], _greedy(2)),
    ("minillm.compile.fused_engine.FusedEngineModel", "hidden"): lambda i: (torch.tensor([[1, 2]]), torch.arange(2)),
    ("minillm.compile.fused_engine.FusedEngineModel", "logits"): lambda i: (torch.randn(1, CFG.n_embd),),
    ("minillm.compile.fused_speculative.FusedDraftProposer", "prefill"): lambda i: ([1, 2, 3],),
    ("minillm.compile.fused_speculative.FusedDraftProposer", "propose"): lambda i: ([1, 2, 3, 1, 2], 2, _state()),
    ("minillm.compile.fused_speculative.FusedDraftProposer", "rollback"): lambda i: (2,),
    ("minillm.compile.fused_step.FusedCPUDecoder", "verify"): lambda i: ([1, 2],),
    ("minillm.compile.fused_step.FusedCPUDecoder", "generate_ids"): lambda i: ([1, 2, 3], _greedy(2)),
    ("minillm.compile.onnx_peer.OnnxStep", "forward"):
        lambda i: (torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), *[torch.zeros(2, 1, 2, 0, 8) for _ in range(2)]),
}
LEFT_TO_CHAPTER_TESTS = {(c, m) for c in FILE_BACKED for m in ("generate", "generate_ids")}
ONE_AT_A_TIME = {**BAD_VALUES, "True": True, "2**40": 2**40, "1.5": 1.5}
ACCEPTED = {  # (class.method, argument position, bad value's name): why it is a right answer, not a silent one
    **{(f"minillm.speculative.{c}.rollback", 0, "2**40"): "a length past the cache keeps every token"
       for c in ("generate.DraftModelProposer", "generate.PromptLookupProposer")},
    **{(f"minillm.speculative.engine.{c}.rollback", 1, "2**40"): "a length past the cache keeps every token"
       for c in ("DraftModelDrafter", "PromptLookupDrafter")},
    ("minillm.compile.fused_speculative.FusedDraftProposer.rollback", 0, "2**40"): "keeps every token",
    **{("minillm.speculative.engine.SpeculativeScheduler.update", 2, v): "now is any clock's reading in seconds"
       for v in ("-1", "2**40", "1.5")},
    ("minillm.distill.run_state.RecordLog.__call__", 0, "empty dict"): "a log built without keys takes any record",
    **{("minillm.compile.fused_engine.FusedEngineModel.fusable", 0, v): "a question: no paged cache is not fusable"
       for v in ONE_AT_A_TIME},
    **{(f"minillm.speculative.engine.{c}", 0, "str"): "an unknown request id: nothing to drop (documented)"
       for c in ("PromptLookupDrafter.release", "DraftModelDrafter.release", "SpeculativeScheduler.abort")},
    ("minillm.speculative.engine.SpeculativeScheduler.update", 1, "empty list"): "the good value: an empty step",
    ("minillm.prune.bench.Harness.check_pruned", 1, "str"): "who is a label for messages",
    **{("minillm.compile.fused_engine.FusedEngineModel.fusable", 1, v): "a question: such a row count is not fusable"
       for v in ("-1", "2**40")},
}


def _one_at_a_time(cls: str, method: str) -> list[str]:
    problems = []
    good = GOOD[(cls, method)]
    instance = INSTANCES[cls]()
    out = getattr(instance, method)(*good(instance))  # the good call works (else the sweep below proves nothing)
    if inspect.isgenerator(out):
        list(out)
    for pos in range(len(good(instance))):
        for name, value in ONE_AT_A_TIME.items():
            def call(*_, _pos=pos, _value=value):
                inst = INSTANCES[cls]()
                args = list(good(inst))
                args[_pos] = _make(_value)
                out = getattr(inst, method)(*args)
                if inspect.isgenerator(out):
                    next(out, None)
                return out

            label = f"{cls}.{method}"
            problem = _call_once(call, label, f"argument {pos} = {name}")
            if problem == "accepted" and (label, pos, name) not in ACCEPTED:
                problem = f"{label} with argument {pos} = {name}: accepted (a result, no error)"
            if problem not in (None, "accepted"):
                problems.append(problem)
    return problems


@pytest.mark.parametrize("cls,method", list(GOOD), ids=[f"{c}.{m}" for c, m in GOOD])
def test_every_argument_of_a_public_method_is_checked_by_itself(cls, method):
    problems = _one_at_a_time(cls, method)
    assert not problems, "\n".join(problems)


def test_every_public_method_of_many_arguments_has_a_good_call():
    """A method with two or more arguments is swept one argument at a time: it needs a good call in GOOD (the
    methods of file-backed and GPU-only classes, and the caches' attend that needs a step's batch, are left to their
    chapters' tests)."""
    left = {(c, m) for c, m, n in METHODS if n >= 2} - set(GOOD) - LEFT_TO_CHAPTER_TESTS
    assert not left, f"methods without a good call in GOOD: {sorted(left)}"
