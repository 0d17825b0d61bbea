"""Every public function, class and method of the chapters (01-15), called with values no caller should pass.

A sweep, not a table: each public function and class of the chapters' packages (found by walking the modules, so a
new one is swept the day it is added), and each public method of each public class on an instance built here,
is called with the same wrong value for every required argument: None, a str, an empty list, NaN, -1, an empty
dict, a tensor, a bare object. The contract is the one the chapters keep for bad input: a TypeError / ValueError
(or FileNotFoundError) from minillm's own checks, or a RuntimeError that says this machine cannot run the thing at
all (no CUDA GPU, no compiler); never an AttributeError, IndexError, KeyError ... from inside the code, and never a
hang. An instance is built afresh for each call, so one bad call cannot leave state that the next one trips on.

Each class with public methods needs a factory below (`INSTANCES`); one without a factory fails the test, so a new
class cannot skip the sweep. `NOT_SWEPT`, `FILE_BACKED` and `PROCESS_BOUND` list what is left out, each with its
reason.
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

PACKAGES = ("core", "tokenizer", "gpt", "naive", "kvcache", "paged", "engine", "disagg",  # chapters 01-07
            "speculative", "quant", "prune", "distill", "kernels", "compile", "parallel", "serve")  # chapters 08-15
BAD_VALUES = {"None": None, "str": "zzz", "empty list": [], "NaN": float("nan"), "-1": -1, "empty dict": {},
              "tensor": "tensor", "object": "object"}  # the tensor and the object are made fresh for each call
NOT_SWEPT = {
    # whole runs: they take minutes with good arguments, and their arguments are checked by the argv / report
    # tests (tests/test_hostile_shared.py) and by the functions they call, swept here
    "main", "run", "run_all", "cold_start",
    # the protocols' empty bodies (the drafters and the caches below implement and check them)
    "minillm.speculative.engine.Drafter", "minillm.core.model.KVCacheProtocol",
}
CALL_SECONDS = 30  # far past any check: a call still running then is a hang (or real work on a bad value)
NO_MACHINE = re.compile(r"needs? a CUDA|CUDA GPU|cannot build|no CUDA|not installed|nvcc|CPU only|cannot export")
DEVICE_CHECK = re.compile(NO_MACHINE.pattern + r"|must be on a CUDA device")  # a GPU-only function's last check

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
def _parallel(name: str):
    """Chapter 14's shards on one rank, in this process (no group: every collective is the identity, counted)."""
    from minillm.parallel import tensor as T

    comm = T.Comm()
    embedding = T.VocabParallelEmbedding(torch.randn(64, 16), 0, comm)
    return {"Comm": lambda: comm, "ColumnParallelLinear": lambda: T.ColumnParallelLinear(torch.randn(8, 16),
                                                                                        torch.randn(8)),
            "RowParallelLinear": lambda: T.RowParallelLinear(torch.randn(16, 8), torch.randn(16), comm),
            "VocabParallelEmbedding": lambda: embedding,
            "VocabParallelHead": lambda: T.VocabParallelHead(embedding, comm),
            "GatherSequence": lambda: T.GatherSequence(nn.Identity(), comm)}[name]()


def _server():
    """Chapter 15's server over an engine whose thread never starts (admission and metrics only)."""
    from minillm.engine import LLM
    from minillm.serve.app import Server

    return Server(LLM(_wide_model(), _tokenizer()), _tokenizer())


INSTANCES.update({
    **{f"minillm.parallel.tensor.{c}": functools.partial(_parallel, c) for c in (
        "Comm", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
        "GatherSequence")},
    "minillm.parallel.pipeline.PipelineStage":
        lambda: __import__("minillm.parallel.pipeline", fromlist=["x"]).PipelineStage(_model(), 0, 1),
    "minillm.serve.app.Server": _server,
    "minillm.serve.async_engine.AsyncEngine": lambda: _server().engine,
    "minillm.serve.metrics.ServerMetrics": lambda: _server().metrics,
})
def _manager():
    """Chapter 05's block manager holding one sequence of five tokens (two blocks)."""
    from minillm.paged.block_manager import BlockManager

    manager = BlockManager(16, 4)
    manager.allocate("s0", [1, 2, 3, 4, 5])
    return manager


def _llm():
    from minillm.engine.llm import LLM

    return LLM(_model(), None, _engine_parts()[0])


def _worker_init(role: str):
    """Chapter 07's worker setup built by hand (no weights inside: the core is given the model itself)."""
    from minillm.disagg.messages import WorkerInit

    return WorkerInit(role=role, model=b"", model_sha256="", device="cpu", num_blocks=16, block_size=4,
                      max_num_seqs=4, max_num_batched_tokens=32, eos_id=None, heartbeat_s=0.5, num_threads=0)


def _new(qualified: str, *args):
    """An instance of minillm.<qualified> built with args."""
    module, name = qualified.rsplit(".", 1)
    return getattr(importlib.import_module(f"minillm.{module}"), name)(*args)


def _stop_checker():
    from minillm.core.sampling import SamplingParams
    from minillm.core.stopping import StopChecker

    return StopChecker(_tokenizer(), SamplingParams.greedy(4, stop=("ab",)))


INSTANCES.update({  # chapters 01-07
    "minillm.core.detokenize.IncrementalText": lambda: _new("core.detokenize.IncrementalText", _tokenizer()),
    "minillm.core.model.GPT": lambda: _new("core.model.GPT", CFG).eval(),  # fresh: a call may change it
    "minillm.core.model.Block": lambda: _new("core.model.Block", CFG, 0),
    "minillm.core.model.CausalSelfAttention": lambda: _new("core.model.CausalSelfAttention", CFG, 0),
    "minillm.core.model.MLP": lambda: _new("core.model.MLP", CFG),
    "minillm.core.sampling.Temperature": lambda: _new("core.sampling.Temperature", 0.5),
    "minillm.core.sampling.TopK": lambda: _new("core.sampling.TopK", 2),
    "minillm.core.sampling.TopP": lambda: _new("core.sampling.TopP", 0.9),
    "minillm.core.stopping.RequestState": _state,
    "minillm.core.stopping.StopChecker": _stop_checker,
    "minillm.tokenizer.bpe.Tokenizer": lambda: _new("tokenizer.default.load_tokenizer"),
    "minillm.gpt.dataset.BatchSampler": lambda: _new("gpt.dataset.BatchSampler", torch.arange(100) % 64, 2, 8),
    "minillm.kvcache.cache.ContiguousKVCache": lambda: _new("kvcache.cache.ContiguousKVCache", CFG, 1, 16),
    "minillm.paged.block_allocator.BlockAllocator": lambda: _new("paged.block_allocator.BlockAllocator", 16),
    "minillm.paged.block_manager.BlockManager": _manager,
    "minillm.paged.generate.PagedGenerator": lambda: _new("paged.generate.PagedGenerator", _model(), 16, 4),
    "minillm.paged.paged_cache.PagedBatch": lambda: _with_batch(_paged_cache()).batch,
    "minillm.paged.paged_cache.PagedKVCache": lambda: _with_batch(_paged_cache()),
    "minillm.paged.prefix_cache.PrefixCachingAllocator": lambda: _new("paged.prefix_cache.PrefixCachingAllocator", 16),
    "minillm.engine.llm.LLM": _llm,
    "minillm.engine.frontend.FrontEnd": _llm,  # the front end of chapter 06's engine (its base holds no state)
    "minillm.engine.core.EngineCore": lambda: _new("engine.core.EngineCore", _llm()),
    "minillm.engine.model_runner.ModelRunner": lambda: _new("engine.model_runner.ModelRunner", _model(), 16, 4),
    "minillm.engine.executor.Executor":  # a protocol: its in-process implementation stands for it
        lambda: _new("engine.model_runner.ModelRunner", _model(), 16, 4),
    "minillm.engine.request.Request": lambda: _request(),
    "minillm.engine.sampler.Sampler": lambda: _new("engine.sampler.Sampler"),
    "minillm.engine.scheduler.ScheduledRequest": lambda: _new("engine.scheduler.ScheduledRequest", _request(), 5, 0),
    "minillm.engine.scheduler.Scheduler": lambda: _new("engine.scheduler.Scheduler", *_engine_parts()),
    "minillm.engine.selective_cache.SelectiveKVCache":
        lambda: _with_batch(_new("engine.selective_cache.SelectiveKVCache", CFG, 16, 4)),
    "minillm.engine.step.StepInput": lambda: _new("engine.step.StepInput"),
    "minillm.engine.swap.SwapSpace": lambda: _new("engine.swap.SwapSpace", _paged_cache()),
    "minillm.engine.process.Inbox": lambda: _new("engine.process.Inbox"),
    "minillm.engine.process.WorkerCore":  # a protocol: chapter 07's prefill core is one
        lambda: _new("disagg.prefill_worker.PrefillCore", _model(), _worker_init("prefill")),
    "minillm.disagg.decode_worker.DecodeCore":
        lambda: _new("disagg.decode_worker.DecodeCore", _model(), _worker_init("decode")),
    "minillm.disagg.prefill_worker.PrefillCore":
        lambda: _new("disagg.prefill_worker.PrefillCore", _model(), _worker_init("prefill")),
})
PROCESS_BOUND = {  # they start or stand for other processes: their chapter's tests drive their methods' arguments
    "minillm.parallel.executor.TensorParallelExecutor": "starts its ranks (tests/test_hostile_14_15.py)",
    "minillm.serve.engine_process.EngineProcess": "starts the engine process (tests/test_serving_engine_process.py)",
    "minillm.serve.engine_process.EngineWorker": "the engine process's side (tests/test_serving_engine_process.py)",
    "minillm.engine.process.WorkerHandle": "starts a worker process (tests/test_executor.py)",
    "minillm.disagg.llm.DisaggregatedLLM": "starts the prefill and decode workers (tests/test_07_disaggregation.py)",
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
    """A bad value as passed: the tensor, the object, the empty list and dict made fresh (a call may keep or change
    what it is given: get_pair_counts fills the dict it is given)."""
    if isinstance(value, (list, dict)):
        return type(value)()
    return torch.zeros(2) if value == "tensor" else object() if value == "object" else value


def _call_once(call, label: str, what: str, gpu_only: bool = False) -> str | None:
    """Run call() under a CALL_SECONDS alarm: None when it raised a clear error, "accepted" when it returned (a
    generator's first item drawn: its checks run there), else the unclear outcome, named. A refusal saying this
    machine cannot run the thing is a clear error, except for a GPU-only function on a machine without a GPU
    (`gpu_only`): there reaching the device check (`DEVICE_CHECK`) means every argument before it was taken, so it
    counts as "accepted"."""
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
    except (TypeError, ValueError, FileNotFoundError, argparse.ArgumentTypeError) as e:  # the last: a flag's type
        return "accepted" if gpu_only and DEVICE_CHECK.search(str(e)) else None
    except RuntimeError as e:
        if NO_MACHINE.search(str(e)):
            return "accepted" if gpu_only else None
        return f"{label} with {what}: RuntimeError {str(e)[:200]}"
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


@pytest.fixture(autouse=True)
def _in_a_temporary_folder(tmp_path, monkeypatch):
    """Every sweep runs in a fresh folder: a path argument of "zzz" (a figure, a report) is written there, never in
    the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("name,fn,n", FUNCTIONS, ids=[f for f, _, _ in FUNCTIONS])
def test_every_public_function_refuses_bad_values_by_name(name, fn, n):
    problem = _call(fn, n, name)
    assert problem is None, problem


@pytest.mark.parametrize("cls,method,n", METHODS, ids=[f"{c}.{m}" for c, m, _ in METHODS])
def test_every_public_method_refuses_bad_values_by_name(cls, method, n):
    if cls in FILE_BACKED or cls in PROCESS_BOUND:
        pytest.skip({**FILE_BACKED, **PROCESS_BOUND}[cls])
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


def _parsed():
    """A checked completion request, as the server's endpoint makes it."""
    from minillm.serve.protocol import parse_completion

    return parse_completion({"model": "m", "prompt": "hello", "max_tokens": 2}, "m", 4096)


def _final_output():
    """A finished request's output, with an arrival and two token times."""
    from minillm.engine.request import RequestOutput

    return RequestOutput("r0", None, [1, 2], [3], [3, 4], True, "length", arrival_time=0.0, token_times=[0.1, 0.2])


def _record():
    """A load generator's record of one request that succeeded: sent at 0, chunks at 0.1 and 0.2, done at 0.25."""
    from minillm.serve.loadgen import RequestRecord

    return RequestRecord(0, 8, 4, send_s=0.0, chunk_s=[0.1, 0.2], done_s=0.25, text="ab", output_tokens=2,
                         success=True)


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
    ("minillm.serve.app.Server", "admit"): lambda i: (_parsed(), 0.0),
    ("minillm.serve.async_engine.AsyncEngine", "submit"): lambda i: ([[1, 2, 3]], _greedy(2), 5),
    ("minillm.serve.metrics.ServerMetrics", "observe_final"): lambda i: (_final_output(), 1.0),
    ("minillm.compile.onnx_peer.OnnxStep", "forward"):
        lambda i: (torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), *[torch.zeros(2, 1, 2, 0, 8) for _ in range(2)]),
}
def _has_seq(manager, seq_id: str = "s9", tokens: tuple = (1, 2, 3)) -> str:
    """seq_id, allocated in `manager` (once: a good call's arguments are built twice per instance)."""
    if not manager.has_seq(seq_id):
        manager.allocate(seq_id, list(tokens))
    return seq_id


def _parked(swap) -> str:
    """The key "a", holding pool block 1's copy in `swap` (once per instance)."""
    if "a" not in swap.stored:
        swap.swap_out("a", [1])
    return "a"


def _swapped(swap):
    """One block of zeros laid out like `swap`'s cache: what `put` takes."""
    from minillm.engine.swap import SwappedKV

    return SwappedKV([t.new_zeros(1, *t.shape[1:]) for t in swap.cache.block_tensors()], 1)


def _in_use_block(allocator) -> int:
    """A block of `allocator` in use and not yet published (a fresh one per call)."""
    return allocator.allocate()


def _prefilled_kv():
    """Chapter 07's hand-off of a 3-token prompt: (n_layer, 2, T, nh, hs)."""
    return torch.zeros(CFG.n_layer, 2, 3, CFG.n_head, CFG.head_size)


GOOD.update({  # chapters 01-07
    ("minillm.core.model.GPT", "hidden"): lambda i: (torch.tensor([[1, 2]]), torch.arange(2)),
    ("minillm.core.stopping.RequestState", "accept_or_fail"): lambda i: ([5], "request 'r0'"),
    ("minillm.engine.llm.LLM", "add_prefilled_request"): lambda i: ([1, 2, 3], _greedy(2), 4, _prefilled_kv()),
    ("minillm.engine.model_runner.ModelRunner", "run"):
        lambda i: (_step_output(), __import__("minillm.paged.block_manager", fromlist=["x"]).BlockManager(16, 4)),
    ("minillm.engine.request.Request", "accept"): lambda i: ([5], 0.0),
    ("minillm.engine.request.Request", "token_slice"): lambda i: (0, 2),
    ("minillm.engine.sampler.Sampler", "sample"): lambda i: (_step_output(), torch.zeros(0, CFG.vocab_size)),
    ("minillm.engine.scheduler.Scheduler", "add_swapped"): lambda i: (_request(), 2),
    ("minillm.engine.scheduler.Scheduler", "claim"): lambda i: (_step_output(), [], lambda j, entry, token: token),
    ("minillm.engine.scheduler.Scheduler", "update"): lambda i: (_step_output(), [], 0.0),
    ("minillm.engine.selective_cache.SelectiveKVCache", "attend"): lambda i: (0, *_qkv()),
    ("minillm.engine.step.StepInput", "check"): lambda i: (CFG, 16, 4),
    ("minillm.engine.swap.SwapSpace", "put"): lambda i: ("a", _swapped(i)),
    ("minillm.engine.swap.SwapSpace", "swap_in"): lambda i: (_parked(i), [2]),
    ("minillm.engine.swap.SwapSpace", "swap_out"): lambda i: ("a", [1]),
    ("minillm.kvcache.cache.ContiguousKVCache", "attend"): lambda i: (0, *_qkv()),
    ("minillm.kvcache.cache.ContiguousKVCache", "attention_mask"): lambda i: (0, 1),
    ("minillm.paged.block_manager.BlockManager", "allocate"): lambda i: ("s1", [1, 2, 3]),
    ("minillm.paged.block_manager.BlockManager", "append_slot"): lambda i: ("s0", 6),
    ("minillm.paged.block_manager.BlockManager", "fork"): lambda i: ("s0", "s1"),
    ("minillm.paged.block_manager.BlockManager", "mark_computed"): lambda i: ("s0", 5),
    ("minillm.paged.block_manager.BlockManager", "slot_mapping"): lambda i: ("s0", 0, 5),
    ("minillm.paged.block_manager.BlockManager", "truncate"): lambda i: ("s0", 4),
    ("minillm.paged.generate.PagedGenerator", "forward"): lambda i: ([(_has_seq(i.manager), 0, 3)], [1, 2, 3]),
    ("minillm.paged.generate.PagedGenerator", "generate"): lambda i: ([1, 2, 3], _greedy(2)),
    ("minillm.paged.paged_cache.PagedKVCache", "attend"): lambda i: (0, *_qkv()),
    ("minillm.paged.paged_cache.PagedKVCache", "gather"): lambda i: (0, 0),
    ("minillm.paged.prefix_cache.PrefixCachingAllocator", "find"): lambda i: (7, -1, [1, 2, 3, 4]),
    ("minillm.paged.prefix_cache.PrefixCachingAllocator", "publish"): lambda i: (_in_use_block(i), 7, -1, [1, 2, 3, 4]),
})
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
    **{(f"minillm.serve.{c}", 1, v): "a perf_counter reading: any finite number of seconds"
       for c in ("app.Server.admit", "metrics.ServerMetrics.observe_final") for v in ("-1", "2**40", "1.5")},
    **{("minillm.compile.fused_engine.FusedEngineModel.fusable", 1, v): "a question: such a row count is not fusable"
       for v in ("-1", "2**40")},
}
_ANY_ID = ("None", "str", "NaN", "-1", "tensor", "object", "True", "2**40", "1.5")  # hashable, unlike [] and {}
ACCEPTED.update({  # chapters 01-07
    **{("minillm.core.stopping.RequestState.accept_or_fail", 0, v): "a bad token fails this request alone, with an "
       "error naming it (tests/test_hostile_shared.py reads it): the engine's other requests go on"
       for v in ONE_AT_A_TIME},
    ("minillm.core.stopping.RequestState.accept_or_fail", 1, "str"): "what is any label for the failure message",
    ("minillm.engine.llm.LLM.add_prefilled_request", 1, "None"): "None is the default SamplingParams (documented)",
    ("minillm.engine.request.Request.accept", 0, "empty list"): "no tokens: nothing to append, nothing finishes",
    **{(f"minillm.engine.{c}", pos, v): "now is any clock's reading in seconds"
       for c, pos in (("request.Request.accept", 1), ("scheduler.Scheduler.update", 2))
       for v in ("-1", "2**40", "1.5")},
    **{(f"minillm.engine.scheduler.Scheduler.{m}", 1, "empty list"): "the good value: an empty step"
       for m in ("claim", "update")},
    **{(f"minillm.engine.swap.SwapSpace.{m}", 0, "str"): "any str is a request id: a new key parks this KV"
       for m in ("put", "swap_out")},
    **{(f"minillm.paged.block_manager.BlockManager.{m}", pos, v): "any hashable is a new sequence's id (documented)"
       for m, pos in (("allocate", 0), ("fork", 1)) for v in _ANY_ID},
    ("minillm.paged.block_manager.BlockManager.append_slot", 1, "2**40"):
        "the block manager stores ids, the vocabulary is the model's to check",
    **{(f"minillm.paged.prefix_cache.PrefixCachingAllocator.{m}", pos, v): "any 64-bit int is a hash (find: a miss)"
       for m, first in (("find", 0), ("publish", 1)) for pos in (first, first + 1) for v in ("-1", "2**40")},
})


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


# ----- functions, one argument at a time, keyword arguments included ------------------------------------------------

@functools.lru_cache(maxsize=None)
def _long_model(seed: int) -> GPT:
    """A model with a window past chapter 08's 64-token timing context (greedy_sweep times its verify there)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=96, n_layer=1, n_head=2, n_embd=16)).eval()


def _draft_model() -> GPT:
    torch.manual_seed(1)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()


def _probs(rows: int):
    return torch.softmax(torch.randn(rows, CFG.vocab_size, generator=torch.Generator().manual_seed(0)), -1)


def _mod(name: str):
    return importlib.import_module(f"minillm.{name}")


def _paged_args():
    """Chapter 05's paged decode arguments: q (S, nh, hs), pools (nb, bs, nh, hs), block tables and lengths, for
    S = 2 sequences of 3 and 5 tokens in blocks of 4."""
    pools = [torch.randn(6, 4, CFG.n_head, CFG.head_size) for _ in range(2)]
    return (torch.randn(2, CFG.n_head, CFG.head_size), *pools, torch.tensor([[0, -1], [1, 2]]), torch.tensor([3, 5]))


def _fresh_path(name: str):
    """A path in a new temporary folder, for a save to write."""
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix="minillm-surface-")) / name


def _saved(kind: str):
    """A checkpoint file saved by the chapter's own save function, in a fresh folder: (path,)."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="minillm-surface-"))
    if kind == "quantized":
        q = _mod("quant.linear").quantize_model(_model(), _mod("quant.linear").QuantConfig("int8"))
        return _mod("quant.checkpoint").save_quantized(q, folder / "q.safetensors")
    pruned = _mod("prune.unstructured").prune_model(_model(), "magnitude", 0.5)
    return _mod("prune.checkpoint").save_pruned(pruned, folder / "p.safetensors", "magnitude")


def _distill_report():
    """The acceptance section of a distillation report: α per draft and γ."""
    return {"acceptance": {name: [{"gamma": 2, "alpha": alpha}] for name, alpha in (("draft", 0.5),
                                                                                   ("draft-distilled", 0.6))}}


def _int4_gemv_args():
    """x (1, 16) and chapter 09's int4 codes of an (8, 16) weight in groups of 8: packed (8, 8) uint8, scale (8, 2)."""
    from minillm.quant.quantize import pack_int4

    return (torch.randn(1, 16), pack_int4(torch.randint(-8, 8, (8, 16), dtype=torch.int8)), torch.rand(8, 2) / 8), \
        {"b": torch.randn(8)}


@functools.lru_cache(maxsize=None)
def _tokenizer():
    """The shipped tokenizer (its code prompts are built from the shipped validation text)."""
    from minillm.tokenizer.default import load_tokenizer

    return load_tokenizer()


_PTXAS = """ptxas info    : Compiling entry function '_Z7softmaxPf' for 'sm_90'
ptxas info    : Function properties for _Z7softmaxPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers, 360 bytes cmem[0]
"""  # one kernel of a `-Xptxas -v` report, as nvcc prints it


GOOD_CALLS = {  # function -> () -> (args, kwargs) of a call that works; every one is swept argument by argument
    "speculative.generate.generate_speculative":
        lambda: ((_model(), _draft_model(), [1, 2, 3], _greedy(3)), {"gamma": 2, "tokenizer": None, "eos_id": None}),
    "speculative.generate.generate_prompt_lookup":
        lambda: ((_model(), [1, 2, 3, 1, 2], _greedy(3)), {"gamma": 2, "ngram": 2, "tokenizer": None, "eos_id": None}),
    "speculative.generate.prompt_lookup_proposals": lambda: (([1, 2, 3, 1, 2], 2), {"ngram": 2}),
    "speculative.sampling.accept_or_resample":
        lambda: ((_probs(3), _probs(2), [1, 2]), {"generator": torch.Generator().manual_seed(0)}),
    "speculative.sampling.accept_greedy": lambda: ((torch.randn(3, CFG.vocab_size), [1, 2]), {"params": _greedy(3)}),
    "speculative.sampling.sample_from_target": lambda: ((_probs(1),), {"generator": torch.Generator()}),
    "quant.quantize.quantize":
        lambda: ((torch.randn(8, 16),), {"bits": 4, "symmetric": True, "granularity": "group", "group_size": 8}),
    "quant.quantize.symmetric_params": lambda: ((torch.randn(8, 16), 8), {"dim": 1}),
    "quant.linear.quantize_model": lambda: ((_model(), _mod("quant.linear").QuantConfig("int8")), {"weights": None}),
    "quant.kv_cache.dequantize_kv":
        lambda: (_mod("quant.kv_cache").quantize_kv(torch.randn(1, 2, 3, 8)), {"dtype": torch.float32,
                                                                               "check_values": True}),
    "quant.outliers.smoothing_scales": lambda: ((torch.rand(16) + 0.1, torch.randn(8, 16)), {"alpha": 0.5}),
    "quant.outliers.smooth_model": lambda: ((_model(), torch.randint(0, 64, (2, 8))), {"alpha": 0.5}),
    "quant.outliers.inject_outliers": lambda: ((_model(), [1, 3]), {"factor": 20.0}),
    "quant.gptq.gptq_quantize":
        lambda: ((torch.randn(8, 16), torch.eye(16)), {"bits": 4, "symmetric": True, "group_size": 8, "damp": 0.01,
                                                         "name": "W"}),
    "quant.gptq.gptq_quantize_model":
        lambda: ((_model(), _mod("quant.linear").QuantConfig("int8"), torch.randint(0, 64, (2, 8))), {"damp": 0.01}),
    "quant.checkpoint.load_quantized": lambda: ((_saved("quantized"),), {"device": "cpu"}),
    "quant.qat.convert_qat":
        lambda: ((_mod("quant.qat").prepare_qat(_model(), _mod("quant.linear").QuantConfig("int8")),),
                 {"config": _mod("quant.linear").QuantConfig("int8")}),
    "quant.w8a8.int8_matmul":
        lambda: ((torch.randint(-5, 5, (2, 16), dtype=torch.int8), torch.randint(-5, 5, (16, 4), dtype=torch.int8)),
                 {"use_int_mm": False}),
    "prune.unstructured.prune_model":
        lambda: ((_model(), "wanda"), {"sparsity": 0.5, "calibration": torch.randint(0, 64, (2, 8)),
                                       "pattern": "unstructured"}),
    "prune.masks.nm_mask": lambda: ((torch.randn(4, 8),), {"n": 2, "m": 4}),
    "prune.masks.is_nm_sparse": lambda: ((torch.randn(4, 8),), {"n": 2, "m": 4}),
    "prune.checkpoint.load_pruned": lambda: ((_saved("pruned"),), {"device": "cpu"}),
    "prune.semi_structured.stored_bytes": lambda: ((torch.randn(8, 16), "dense"), {"element_bytes": 4}),
    "distill.losses.kd_loss": lambda: ((torch.randn(2, 64), torch.randn(2, 64)), {"temperature": 2.0,
                                                                                  "kind": "forward"}),
    "distill.losses.distillation_loss":
        lambda: ((torch.randn(2, 64), torch.randn(2, 64), torch.tensor([1, 2])), {"temperature": 2.0, "kd_weight": 0.5,
                                                                                  "kind": "forward"}),
    "distill.losses.check_layer_pairs": lambda: (([(0, 1)],), {"student_layers": 1, "teacher_layers": 2}),
    "distill.train.DistillObjective":
        lambda: ((_model(),), {"temperature": 2.0, "kd_weight": 0.5, "kind": "forward", "feature_weight": 0.0,
                               "student_config": None, "layer_pairs": None}),
    "kernels.emulator.softmax": lambda: ((torch.randn(2, 8), 1), {"reverse": False}),
    "kernels.emulator.layernorm":
        lambda: ((torch.randn(2, 8), torch.ones(8), torch.zeros(8), 1), {"eps": 1e-5, "reverse": False}),
    "kernels.emulator.bias_gelu": lambda: ((torch.randn(2, 8), torch.zeros(8), 1), {"reverse": False}),
    "compile.decode.StaticDecoder":
        lambda: ((_model(),), {"mode": "eager", "backend": "inductor", "max_len": 16, "batch_size": 1}),
    "compile.fused_step.FusedCPUDecoder": lambda: ((_model(),), {"max_len": 16}),
    "compile.fused_speculative.generate_speculative_fused":
        lambda: ((_mod("compile.fused_step").FusedCPUDecoder(_model(), 16),
                  _mod("compile.fused_step").FusedCPUDecoder(_draft_model(), 16), [1, 2, 3], _greedy(3)),
                 {"gamma": 2, "tokenizer": None, "eos_id": None}),
    "compile.fused_speculative.generate_prompt_lookup_fused":
        lambda: ((_mod("compile.fused_step").FusedCPUDecoder(_model(), 16), [1, 2, 3, 1, 2], _greedy(3)),
                 {"gamma": 2, "ngram": 2, "tokenizer": None, "eos_id": None}),
    "compile.cpu_gemv.FastLinear": lambda: ((16, 8), {"bias": True, "device": "cpu", "dtype": torch.float32}),
    "compile.cpu_gemv.gemv": lambda: ((torch.randn(1, 16), torch.randn(8, 16)), {"b": torch.randn(8)}),
    "compile.mirror.gemv_blocked": lambda: ((torch.randn(1, 16), torch.randn(8, 16)), {"b": torch.randn(8)}),
    "compile.sweep.profile_table":
        lambda: (([{"name": "a", "calls_per_step": 1, "self_us_per_step": 2.0, "share": 1.0}],), {"top": 1}),
    "kernels.build.run_program": lambda: ((["true"], "true"), {"timeout": 10, "cwd": None}),
    "kernels.emulator.attention": lambda: (tuple(torch.randn(1, 2, 4, 8) for _ in range(3)) + (1,), {"reverse": False}),
    "kernels.emulator.int8_gemv":
        lambda: ((torch.randn(1, 16), torch.randint(-127, 128, (8, 16), dtype=torch.int8), torch.rand(8) / 64,
                  torch.randn(8), 1), {"reverse": False}),
    "kernels.emulator.kv_cache_write":
        lambda: ((torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8),
                  torch.tensor([0, 5])), {"reverse": False}),
    "speculative.engine.SpeculativeConfig": lambda: ((), {"method": "draft-model", "gamma": 2, "ngram": 2}),
    "speculative.engine.SpeculativeLLM":
        lambda: ((_model(),), {"tokenizer": None, "config": _engine_parts()[0], "eos_id": None,
                               "speculative": _mod("speculative.engine").SpeculativeConfig("draft-model", gamma=2),
                               "draft": _draft_model()}),
    "quant.linear.QuantConfig":
        lambda: (("w8a8",), {"group_size": 8, "symmetric": True, "quantize_head": False, "use_int_mm": True,
                             "outlier_threshold": 6.0}),
    "quant.checkpoint.save_quantized":
        lambda: ((_mod("quant.linear").quantize_model(_model(), _mod("quant.linear").QuantConfig("int8")),
                  _fresh_path("q.safetensors")), {"method": "rtn"}),
    "prune.checkpoint.save_pruned":
        lambda: ((_mod("prune.unstructured").prune_model(_model(), "magnitude", 0.5), _fresh_path("p.safetensors"),
                  "magnitude"), {"pattern": "unstructured"}),
    "prune.structured.recover":
        lambda: ((_wide_model(), _wide_model(), 2), {"batch_size": 2, "lr": 1e-4, "seed": 0}),
    "quant.qat.finetune_qat":
        lambda: ((_wide_model(), _mod("quant.linear").QuantConfig("int8")), {"steps": 2, "batch_size": 2, "lr": 1e-5,
                                                                         "seed": 0, "fake_quant": True,
                                                                         "distill": False}),
    "distill.losses.FeatureProjection": lambda: ((16, 32, [(0, 1)]), {}),
    "distill.run_state.RecordLog": lambda: ((_fresh_path("log.jsonl"),), {"digest": "", "keys": None}),
    "quant.kv_cache.Int8ContiguousKVCache": lambda: ((CFG, 1, 16), {"device": "cpu"}),
    "quant.kv_cache.FakeQuantContiguousKVCache":
        lambda: ((CFG, 1, 16), {"device": "cpu", "dtype": torch.float32, "use_static_shapes": False}),
    "quant.kv_cache.Int8PagedKVCache": lambda: ((CFG, 8, 4), {"device": "cpu", "dtype": torch.float32}),
    "speculative.verify_cache.VerifyKVCache":
        lambda: ((CFG, 8, 4), {"device": "cpu", "dtype": torch.float32, "use_fast_decode": True}),
    "speculative.bench.chi_square_test":
        lambda: ((torch.tensor([30, 30, 20, 20]), torch.tensor([0.3, 0.3, 0.2, 0.2])), {"bins": 3}),
    "quant.outliers.outlier_report": lambda: (({"a": torch.tensor([1.0, 8.0])},), {"threshold": 6.0}),
    # chapter 08's rule and cost model
    "speculative.sampling.residual_distribution": lambda: ((_probs(2), _probs(2)), {}),
    "speculative.sampling.acceptance_probability": lambda: ((torch.tensor([0.5, 0.2]), torch.tensor([0.4, 0.4])), {}),
    "speculative.generate.sample_draft":
        lambda: ((torch.randn(1, CFG.vocab_size), _mod("core.sampling").SamplingParams(max_new_tokens=2,
                                                                                       temperature=0.8),
                  torch.Generator().manual_seed(0), 0), {}),
    "speculative.bench.expected_tokens_per_call": lambda: ((0.7, 4), {}),
    "speculative.bench.predicted_speedup": lambda: ((0.7, 4, 0.3), {"verify_cost": 1.2}),
    "speculative.bench.chi_square_p_value": lambda: ((3.0, 4), {}),
    # chapter 09's quantizers, W8A8 and GPTQ pieces
    "quant.quantize.quantize_symmetric":
        lambda: ((torch.randn(4, 8), torch.full((4, 1), 0.05), 8), {"check_values": True}),
    "quant.quantize.dequantize_symmetric":
        lambda: ((torch.randint(-127, 128, (4, 8), dtype=torch.int8), torch.full((4, 1), 0.05)),
                 {"check_values": True}),
    "quant.quantize.quantize_asymmetric":
        lambda: ((torch.randn(4, 8), torch.full((4, 1), 0.05), torch.full((4, 1), 128.0), 8), {"check_values": True}),
    "quant.quantize.dequantize_asymmetric":
        lambda: ((torch.randint(0, 256, (4, 8), dtype=torch.uint8), torch.full((4, 1), 0.05),
                  torch.full((4, 1), 128.0)), {"check_values": True}),
    "quant.quantize.asymmetric_params": lambda: ((torch.randn(4, 8), 8), {"dim": 1}),
    "quant.quantize.unpack_int4": lambda: ((torch.randint(0, 256, (4, 4), dtype=torch.uint8), True), {}),
    "quant.quantize.qrange": lambda: ((4, True), {}),
    "quant.w8a8.w8a8_linear":
        lambda: ((torch.randn(2, 16), torch.randint(-127, 128, (8, 16), dtype=torch.int8), torch.rand(8, 1) / 64,
                  torch.randn(8)), {"use_int_mm": False}),
    "quant.w8a8.outlier_columns": lambda: ((torch.randn(2, 16) * 4, 6.0), {}),
    "quant.qat.fake_quantize": lambda: ((torch.randn(8, 16), _mod("quant.linear").QuantConfig("int8")), {}),
    "quant.qat.prepare_qat": lambda: ((_model(), _mod("quant.linear").QuantConfig("int8")), {}),
    "quant.linear.QuantLinear": lambda: ((16, 8, True, _mod("quant.linear").QuantConfig("int8")), {}),
    "quant.linear.QuantLinear.from_linear":
        lambda: ((nn.Linear(16, 8), _mod("quant.linear").QuantConfig("int8")), {"qt": None, "name": "qt"}),
    "quant.gptq.damped": lambda: ((torch.eye(8), 0.01), {}),
    "quant.gptq.output_error": lambda: ((torch.randn(8, 16), torch.randn(8, 16), torch.randn(4, 16)), {}),
    "quant.gptq.check_calibration": lambda: ((_model(), torch.randint(0, 64, (2, 8))), {"who": "calibration"}),
    "quant.gptq.rtn_and_gptq_errors":
        lambda: ((nn.Linear(16, 8), torch.randn(32, 16)), {"bits": 4, "symmetric": True, "group_size": 8}),
    "quant.outliers.input_absmax": lambda: ((_model(), torch.randint(0, 64, (2, 8))), {}),
    # chapter 10's masks and structured pruning
    "prune.masks.magnitude_mask": lambda: ((torch.randn(8, 16), 0.5), {}),
    "prune.masks.wanda_score": lambda: ((torch.randn(8, 16), torch.rand(16)), {}),
    "prune.masks.per_row_mask": lambda: ((torch.randn(8, 16), 0.5), {}),
    "prune.masks.lowest_k_mask": lambda: ((torch.randn(8, 16), 3), {}),
    "prune.masks.num_pruned": lambda: ((16, 0.5), {}),
    "prune.structured.head_scores": lambda: ((_model(), torch.randint(0, 64, (2, 8))), {}),
    "prune.structured.mask_heads": lambda: ((_model(), {0: [1]}), {}),
    "prune.structured.prune_heads": lambda: ((_model(), {0: [1], 1: [0]}), {}),
    "prune.structured.lowest_heads": lambda: ((torch.rand(CFG.n_layer, CFG.n_head), 1), {}),
    "prune.structured.mlp_neuron_scores": lambda: ((_model(), torch.randint(0, 64, (2, 8))), {}),
    "prune.structured.prune_mlp":
        lambda: ((_model(), 0.25, _mod("prune.structured").mlp_neuron_scores(_model(), torch.randint(0, 64, (2, 8)))),
                 {}),
    "prune.unstructured.layer_mask":
        lambda: ((torch.randn(8, 16), "wanda", 0.5, "unstructured", torch.rand(16)), {}),
    # chapter 11's losses and run records
    "distill.losses.feature_loss":
        lambda: ((torch.randn(1, 4, 16), torch.randn(1, 4, 32), nn.Linear(16, 32)), {}),
    "distill.losses.default_layer_pairs": lambda: ((1, 2), {}),
    "distill.run_state.record_digest": lambda: (("", {"step": 1, "loss": 1.0}), {}),
    "distill.run_state.check_record": lambda: (({"step": 1, "loss": 1.0}, ("step", "loss"), "record"), {}),
    # chapter 12's naive twins, mirrors and emulator
    "kernels.naive.layernorm": lambda: ((torch.randn(2, 8), torch.ones(8), torch.zeros(8)), {"eps": 1e-5}),
    "kernels.naive.bias_gelu": lambda: ((torch.randn(2, 8), torch.zeros(8)), {}),
    "kernels.naive.attention": lambda: (tuple(torch.randn(1, 2, 4, 8) for _ in range(3)), {}),
    "kernels.naive.int8_gemv":
        lambda: ((torch.randn(1, 16), torch.randint(-127, 128, (8, 16), dtype=torch.int8), torch.rand(8) / 64),
                 {"bias": torch.randn(8)}),
    "kernels.naive.kv_cache_write":
        lambda: ((torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8),
                  torch.tensor([0, 5])), {}),
    "kernels.naive.paged_attention_decode": lambda: (_paged_args(), {}),
    "kernels.mirror.paged_attention_decode": lambda: (_paged_args(), {"num_warps": 1}),
    "kernels.emulator.paged_attention_decode": lambda: (_paged_args() + (1,), {"reverse": False,
                                                                               "check_indices": True}),
    "compile.cpu_paged.paged_decode_attention": lambda: (_paged_args(), {}),
    "compile.cpu_paged.paged_verify_attention": lambda: (_paged_args() + (torch.tensor([1, 1]),), {}),
    "kernels.mirror.flash_attention":
        lambda: (tuple(torch.randn(1, 2, 4, 8) for _ in range(3)), {"block_q": 16, "block_k": 16}),
    "kernels.mirror.bias_gelu": lambda: ((torch.randn(2, 8), torch.zeros(8)), {"pack": 8}),
    "kernels.mirror.int8_gemv":
        lambda: ((torch.randn(1, 16), torch.randint(-127, 128, (8, 16), dtype=torch.int8), torch.rand(8) / 64),
                 {"bias": torch.randn(8), "pack": 1}),
    "kernels.mirror.kv_cache_write":
        lambda: ((torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8),
                  torch.tensor([0, 5])), {}),
    "kernels.mirror.layernorm_warp":
        lambda: ((torch.randn(2, 8), torch.ones(8), torch.zeros(8)), {"eps": 1e-5, "pack": 1}),
    "kernels.mirror.softmax_online": lambda: ((torch.randn(2, 16),), {"tile": 8, "num_parts": 2}),
    "kernels.bench.relative_error": lambda: ((torch.randn(4), torch.randn(4)), {}),
    # chapter 13's decoders' pieces
    "compile.cpu_gemv.int8_gemv":
        lambda: ((torch.randn(1, 16), torch.randint(-127, 128, (8, 16), dtype=torch.int8), torch.rand(8) / 64),
                 {"b": torch.randn(8)}),
    "compile.decode.integer_ids": lambda: (("token", torch.tensor([1]), 1), {}),
    "compile.decode.decoder_max_len": lambda: ((CFG, 16), {}),
    "compile.decode.check_decoder_room": lambda: ((16, CFG, [1, 2, 3], _greedy(4)), {"truncate": False}),
    "compile.aot.DecodeStep": lambda: ((_model(), 16), {}),
    # the benchmarks' measurements, on tiny models and the fewest repeats
    "speculative.bench.forward_costs":
        lambda: ((_model(), _draft_model(), [1, 2, 3], [1, 2]), {"context": 8, "repeats": 1}),
    "speculative.bench.matmul_costs": lambda: ((_model(), [1, 2]), {"repeats": 1}),
    "speculative.bench.draft_agreement": lambda: ((_model(), _draft_model(), [[1, 2, 3]], [[4, 5]]), {}),
    "speculative.bench.greedy_sweep":
        lambda: ((_long_model(0), _long_model(1), [[1, 2, 3]], 3, [1, 2]), {"repeats": 1}),
    "speculative.bench.prompt_lookup": lambda: ((_model(), [1, 2, 3, 1, 2], 3), {"gamma": 2, "ngram": 2, "repeats": 1}),
    "speculative.bench.sampling_exactness": lambda: ((_model(), _draft_model(), [1, 2, 3]), {"draws": 200, "seed": 0}),
    "speculative.engine_bench.load_point":
        lambda: ((_model(), [[1, 2, 3], [4, 5, 6]], 2, 3, _mod("speculative.engine").SpeculativeConfig(gamma=2)),
                 {"draft": None, "repeats": 1, "attention_backend": "verify", "fused_step": False}),
    "speculative.engine_bench.check_loads": lambda: (([1, 2],), {"requests_per_slot": 2}),
    "distill.bench.acceptance":
        lambda: ((_model(), _draft_model(), [[1, 2, 3]], 3, 2), {"reference": None}),
    "distill.bench.step_cost": lambda: ((_model(), _draft_model(), [[1, 2, 3]], 3), {"repeats": 1}),
    "distill.bench.teacher_continuations": lambda: ((_model(), [[1, 2, 3]], 3), {}),
    "distill.bench.cost_model_speedup": lambda: ((0.7, 4, 0.3), {}),
    "distill.bench.check_prompts":
        lambda: ((_model(), [[1, 2, 3]], "acceptance"), {"new_tokens": 3, "role": "the target"}),
    "distill.train.check_student": lambda: ((_draft_model().config, CFG, "student"), {"window": True}),
    "compile.bench.round_costs":
        lambda: ((_mod("compile.fused_step").FusedCPUDecoder(_model(), 16),
                  _mod("compile.fused_step").FusedCPUDecoder(_draft_model(), 16), 3, 8), {"repeats": 1, "calls": 2}),
    "compile.bench.quantized_fused": lambda: ((_model(), [1, 2, 3], _greedy(3)), {"repeats": 1}),
    "compile.fused_engine.step_costs": lambda: ((_model(),), {"context": 8, "sizes": (1, 2), "repeats": 1, "calls": 2}),
    "compile.mirror.check_plain_model": lambda: ((_model(), "the mirror"), {"handled": ()}),
    "compile.llamacpp.ours_tok_s": lambda: ((lambda: None, 4), {"repeats": 1}),
    "kernels.tour.compare":
        lambda: (("softmax", torch.randn(2, 8), torch.randn(2, 8), torch.float32), {}),
    "compile.sweep.run_case":
        lambda: ((_model(), _mod("compile.sweep").Case("decode", 1, 4)), {"steps": 2, "repeats": 1,
                                                                         "backend": "eager", "seed": 0}),
    # chapter 08's checks, proposers and engine pieces
    "speculative.generate.check_gamma": lambda: ((2,), {"name": "gamma"}),
    "speculative.generate.check_prompt_ids": lambda: (([1, 2], 64), {"max_len": 16, "whose": "the"}),
    "speculative.generate.check_proposal": lambda: (([1, 2], None, 64, False), {}),
    "speculative.generate.check_draft_feed": lambda: (([1, 2, 3, 1, 2], 2, _state(), 4, 16, 64), {}),
    "speculative.generate.lookup": lambda: (([1, 2, 3, 1, 2], 2, 2), {}),
    "speculative.generate.DraftModelProposer": lambda: ((_draft_model(), 16), {}),
    "speculative.generate.PromptLookupProposer": lambda: ((2, 64, torch.device("cpu")), {}),
    "speculative.sampling.check_distributions": lambda: (("p", _probs(2)), {}),
    "speculative.sampling.check_draft_tokens": lambda: (([1, 2], 64), {"name": "draft_tokens"}),
    "speculative.sampling.check_generator": lambda: ((torch.Generator(), torch.device("cpu")), {}),
    "speculative.engine.PromptLookupDrafter": lambda: ((2, 64, torch.device("cpu")), {}),
    "speculative.engine.VerifyEntry": lambda: ((_request(), 3, 2, [1, 2]), {"draft_probs": None}),
    "speculative.engine.SpeculativeScheduler":
        lambda: ((*_engine_parts(), _mod("speculative.engine").PromptLookupDrafter(2, 64, torch.device("cpu")), 2,
                  64), {}),
    "speculative.verify_cache.check_verify_attend":
        lambda: ((INSTANCES["minillm.speculative.verify_cache.VerifyKVCache"](), 0, *_qkv()), {}),
    "speculative.bench.ChiSquare": lambda: ((100.0, 3.0, 2, 0.5, 0.1), {}),
    "speculative.bench.chi_square_quantile": lambda: ((3, 0.05), {}),
    "speculative.engine_bench.crossover":
        lambda: (([{"concurrency": 1, "ratio": 1.2}, {"concurrency": 2, "ratio": 0.8}],), {"key": "ratio"}),
    "speculative.engine_bench.sweep_sizes": lambda: ((True, None), {}),
    # chapter 09's records and references
    "quant.quantize.QuantizedTensor":
        lambda: ((torch.randint(-127, 128, (4, 8), dtype=torch.int8), torch.full((4, 1), 0.05), None, 8, (4, 8)), {}),
    "quant.quantize.QuantizedTensor.from_checked":
        lambda: ((torch.randint(-127, 128, (4, 8), dtype=torch.int8), torch.full((4, 1), 0.05), None, 8, (4, 8)), {}),
    "quant.quantize.check_finite": lambda: (("x", torch.randn(3)), {}),
    "quant.w8a8.int8_matmul_ref":
        lambda: ((torch.randint(-5, 5, (2, 16), dtype=torch.int8), torch.randint(-5, 5, (16, 4), dtype=torch.int8)),
                 {}),
    "quant.w8a8.w8a8_reference": lambda: ((torch.randn(2, CFG.n_embd), _quantized("w8a8", "transformer.h.0.mlp.c_fc")),
                                          {}),
    "quant.w8a8.llm_int8_linear":
        lambda: ((torch.randn(2, CFG.n_embd), _quantized("w8a8", "transformer.h.0.mlp.c_fc"), 6.0), {}),
    "quant.w8a8.llm_int8_reference":
        lambda: ((torch.randn(2, CFG.n_embd), _quantized("w8a8", "transformer.h.0.mlp.c_fc"), 6.0), {}),
    "quant.gptq.gptq_reference":
        lambda: ((torch.randn(8, 16), torch.eye(16)), {"bits": 4, "symmetric": True, "group_size": 8, "damp": 0.01,
                                                         "name": "W"}),
    "quant.linear.check_fp32_model": lambda: ((_model(), "the model"), {"config": None}),
    "quant.qat.qat_codes": lambda: ((torch.randn(8, 16), _mod("quant.linear").QuantConfig("int8")), {}),
    "quant.bench.Case": lambda: (("int8", _mod("quant.linear").QuantConfig("int8")), {"method": "rtn"}),
    # chapter 10's checks
    "prune.masks.check_sparsity": lambda: ((0.5,), {"name": "sparsity"}),
    "prune.masks.check_sparsities": lambda: (((0.5, 0.75),), {"name": "sparsities"}),
    "prune.masks.check_keeps_one": lambda: ((16, 0.5, "a row"), {"name": "sparsity"}),
    "prune.unstructured.check_pattern_sparsity": lambda: (("2:4", 0.5), {}),
    "prune.unstructured.check_prunable": lambda: ((_model(), "the model"), {}),
    "prune.unstructured.block_inputs": lambda: ((_model(), torch.randint(0, 64, (2, 8))), {}),
    "prune.unstructured.input_norms": lambda: ((_model().transformer.h[0], torch.randn(2, 8, CFG.n_embd)), {}),
    "prune.structured.shrink_mlp":
        lambda: ((_model(), [torch.arange(0, 4 * CFG.n_embd, 2) for _ in range(CFG.n_layer)]), {}),
    "prune.bench.block_bytes": lambda: ((_model(), "dense"), {}),
    "prune.bench.torch_prune_agreement": lambda: ((_model(),), {"sparsity": 0.5}),
    # chapter 11's checks and records (not LossParts: a NamedTuple the losses return, holding what it is given)
    "distill.losses.check_targets":
        lambda: (("targets", torch.tensor([1, 2]), (2,), 64, torch.device("cpu")), {}),
    "distill.run_state.check_digest": lambda: (("digest", "0" * 64), {}),
    "distill.bench.alpha_at": lambda: ((_distill_report(), "draft", 2), {}),
    "distill.bench.alpha_gain": lambda: ((_distill_report(), 2), {}),
    # chapter 12's checks, mirrors and the GPU wrappers (on a CPU-only machine a good call reaches the device check)
    "kernels.naive.check_qkv": lambda: (tuple(torch.randn(1, 2, 4, 8) for _ in range(3)), {}),
    "kernels.naive.check_int8_gemv_args":
        lambda: ((torch.randn(1, 16), torch.randint(-127, 128, (8, 16), dtype=torch.int8), torch.rand(8) / 64,
                  torch.randn(8)), {}),
    "kernels.mirror.flash_attention_v3": lambda: (tuple(torch.randn(1, 2, 4, 8) for _ in range(3)), {"p_dtype": None}),
    "kernels.mirror.lane_partials": lambda: ((torch.randn(2, 64),), {"pack": 1}),
    "kernels.mirror.paged_gather": lambda: ((torch.randn(6, 4, 2, 8), torch.tensor([1, 2]), 5), {}),
    "kernels.mirror.online_merge":
        lambda: ((torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([1.0])), {}),
    "kernels.mirror.attend_tile":
        lambda: ((torch.full((2,), -float("inf")), torch.zeros(2), torch.zeros(2, 8), torch.randn(2, 4),
                  torch.randn(4, 8)), {}),
    "kernels.ops.check_head_size": lambda: (("q", 8), {}),
    "kernels.ops.check_slot_range": lambda: ((torch.tensor([0, 5]), 16), {}),
    "kernels.ops.check_paged_tables": lambda: ((2, torch.tensor([[0, -1], [1, 2]]), torch.tensor([3, 5])), {}),
    "kernels.ops.check_block_tables": lambda: ((torch.tensor([[0, -1], [1, 2]]), torch.tensor([3, 5]), 6, 4), {}),
    "kernels.ops.check_paged_args": lambda: (_paged_args(), {}),
    "kernels.ops.check_kv_write_args":
        lambda: ((torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8),
                  torch.tensor([0, 5])), {}),
    "kernels.ops.tensors_overlap": lambda: ((torch.zeros(4), torch.zeros(4)), {}),
    "kernels.ops.softmax": lambda: ((torch.randn(2, 8),), {"version": 4, "out": None}),
    "kernels.ops.layernorm":
        lambda: ((torch.randn(2, 8), torch.ones(8), torch.zeros(8)), {"eps": 1e-5, "version": 4, "out": None}),
    "kernels.ops.bias_gelu": lambda: ((torch.randn(2, 8), torch.zeros(8)), {"version": 2, "out": None}),
    "kernels.ops.attention": lambda: (tuple(torch.randn(1, 2, 4, 8) for _ in range(3)), {"version": 4, "out": None}),
    "kernels.ops.paged_attention_decode":
        lambda: (_paged_args(), {"version": 2, "out": None, "check_tables": True}),
    "kernels.ops.int8_gemv":
        lambda: ((torch.randn(1, 16), torch.randint(-127, 128, (8, 16), dtype=torch.int8), torch.rand(8) / 64),
                 {"bias": torch.randn(8), "version": 3, "out": None}),
    "kernels.ops.kv_cache_write":
        lambda: ((torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8),
                  torch.tensor([0, 5])), {"version": 1, "check_slots": True}),
    "kernels.bench.copy_bandwidth": lambda: ((1 << 20, 1, 2), {}),
    "kernels.bench.matmul_tflops": lambda: ((64, 1, 2), {"dtype": torch.bfloat16}),
    "kernels.bench.time_ms": lambda: ((lambda: None, 1, 2), {"batch_ms": 1.0, "max_calls": 2}),
    "kernels.bench.check_same_shape": lambda: ((torch.zeros(2), torch.zeros(2)), {}),
    "kernels.build.check_command": lambda: ((["true"],), {"name": "cmd"}),
    "kernels.build.check_build_args": lambda: ((_fresh_path("build"), None, 10.0), {}),
    "kernels.build.run_compiler": lambda: ((["true"], "true", 10.0), {}),
    "kernels.tour.cast": lambda: (((torch.randn(2), 3), torch.float16), {}),
    # chapter 13's checks and pieces
    "compile.cpu_gemv.int4_gemv": lambda: _int4_gemv_args(),
    "compile.cpu_paged.check_paged_arguments": lambda: (_paged_args(), {"query_lens": None}),
    "compile.decode.check_backend": lambda: (("eager",), {"arg": "backend"}),
    "compile.decode.check_eval_mode": lambda: ((_model(), "the decoder"), {}),
    "compile.decode.check_id_range": lambda: (("token", torch.tensor([1]), 64, "the vocabulary"), {}),
    "compile.decode.counting_backend": lambda: (("eager", lambda: None), {}),
    "compile.mirror.decode_step_by_hand":
        lambda: ((_model(), *[[torch.zeros(1, CFG.n_head, 16, CFG.head_size) for _ in range(CFG.n_layer)]
                              for _ in range(2)], 1, 0, 0), {}),
    "compile.fused_step.build_cpp_decoder":
        lambda: ((_model(), *[[torch.zeros(1, CFG.n_head, 16, CFG.head_size) for _ in range(CFG.n_layer)]
                              for _ in range(2)]), {}),
    "compile.sweep.Case": lambda: (("decode", 1, 4), {}),
    "compile.sweep.check_backend_and_seed": lambda: (("eager", 0), {}),
    "compile.sweep.check_case": lambda: ((_model(), _mod("compile.sweep").Case("decode", 1, 4), 2), {}),
    "compile.llamacpp.check_rates": lambda: (("rates", {"llama.cpp f32": 10.0, "ours": 5.0}), {}),
    "compile.llamacpp.check_samples": lambda: (("samples", {"llama.cpp f32": [10.0, 11.0], "ours": [1.0, 2.0]}), {}),
    # the benchmarks' pieces, on tiny models and the fewest repeats
    "speculative.bench.encode": lambda: ((_tokenizer(), "def f(x):\n    return x\n"), {}),
    "speculative.bench.code_prompt": lambda: ((_tokenizer(),), {"tokens": 16}),
    "speculative.bench.code_prompts": lambda: ((_tokenizer(), 2), {"tokens": 16}),
    "speculative.engine_bench.code_prompts": lambda: ((_tokenizer(), 2), {"prompt_len": 16, "window": 200}),
    "quant.qat.FakeQuantLinear": lambda: ((16, 8), {"bias": True, "device": "cpu", "dtype": torch.float32}),
    "quant.bench.build":
        lambda: ((_model(), _mod("quant.bench").Case("int8", _mod("quant.linear").QuantConfig("int8")),
                  torch.randint(0, 64, (2, 8))), {"qat_steps": 1}),
    "quant.bench.kv_perplexity":
        lambda: ((_model(), torch.randint(0, 64, (40,)),
                  lambda b, t: _mod("quant.kv_cache").Int8ContiguousKVCache(CFG, b, t)), {"batch_size": 2}),
    "quant.bench.outlier_study":
        lambda: ((_wide_model(), torch.randint(0, 4096, (80,)), torch.randint(0, 4096, (2, 16))), {}),
    "prune.bench.check_harness": lambda: ((_prune_harness(), "the harness"), {}),
    "prune.bench.fifty_percent":
        lambda: ((_wide_model(), torch.randint(0, 4096, (80,)), torch.randint(0, 4096, (2, 16))), {}),
    "distill.bench.report_section": lambda: ((_distill_report(), "acceptance"), {}),
    "distill.bench.val_prompts": lambda: ((2, 8), {}),
    "distill.train.kd_history": lambda: ((None, 1), {"grad_accum": 1}),
    "distill.train.checkpoint_dir": lambda: (("draft", "student"), {}),
    "kernels.naive.check_rows": lambda: (("x", torch.randn(2, 8)), {"weight": torch.ones(8), "bias": torch.zeros(8)}),
    "kernels.build.parse_ptxas": lambda: (("softmax.cu", _PTXAS), {}),
    "compile.sweep.profile_decode":
        lambda: ((_model(),), {"case": _mod("compile.sweep").Case("decode", 1, 4), "steps": 2, "backend": "eager",
                               "top": 3, "seed": 0}),
    "compile.fused_engine.load_point":
        lambda: ((GPT(GPTConfig(vocab_size=4096, block_size=512, n_layer=1, n_head=2, n_embd=32)).eval(), 1),
                 {"repeats": 1, "seed": 0}),
    "compile.bench.pruned_fused": lambda: ((_wide_model(), [1, 2, 3], _greedy(3)), {"fraction": 0.25, "repeats": 1,
                                                                                   "seed": 0}),
    "compile.bench.fused_speculation":
        lambda: ((_model(), _draft_model(), [[1, 2, 3]], [1, 2, 3, 1, 2, 3], 3), {"gamma": 2, "lookup_gamma": 2,
                                                                                 "repeats": 1}),
    # chapter 14's arithmetic, splits and partial attentions
    "parallel.pipeline.bubble_fraction": lambda: ((2, 4), {}),
    "parallel.pipeline.stage_layers": lambda: ((4, 2), {}),
    "parallel.pipeline.measured_bubble":
        lambda: (([_mod("parallel.pipeline").StageEvent(s, mb, s + mb, s + mb + 1.0) for s in range(2)
                   for mb in range(2)], 2), {}),
    "parallel.tensor.column_split": lambda: ((torch.randn(8, 16), torch.randn(8), 0, 2), {}),
    "parallel.tensor.row_split": lambda: ((torch.randn(8, 16), 1, 2), {}),
    "parallel.tensor.row_parallel_forward":
        lambda: ((torch.randn(2, 16), torch.randn(8, 16), torch.randn(8), lambda y: y), {}),
    "parallel.tensor.shard_model": lambda: ((_model(), 0, 2), {"comm": None, "sequence_parallel": False}),
    "parallel.tensor.check_divisible": lambda: ((CFG, 2), {}),
    "parallel.tensor.all_reduce_bytes": lambda: ((8, 16, 2), {"element_size": 4}),
    "parallel.tensor.ring_traffic_per_rank": lambda: ((1024, 2), {}),
    "parallel.bench.link_estimate": lambda: ((CFG, 2), {"element_bytes": 2}),
    "parallel.library.regroup_qkv_rows": lambda: ((torch.randn(3 * 16, 16), 2, 8, 2), {}),
    "parallel.context.block_attention": lambda: (tuple(torch.randn(1, 2, 4, 8) for _ in range(3)) + (True,), {}),
    "parallel.context.merge_attention":
        lambda: ((torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4)), {}),
    "parallel.checks.ring_forward": lambda: ((0, 1, *[torch.randn(1, 2, 4, 8) for _ in range(3)]), {}),
    # chapter 15's protocol and load generator
    "serve.protocol.parse_completion": lambda: (({"model": "m", "prompt": "hi", "max_tokens": 2}, "m", 4096), {}),
    "serve.protocol.parse_chat":
        lambda: (({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "m"), {}),
    "serve.protocol.check_context": lambda: ((10, 5, 256, True), {"prompt_param": "prompt"}),
    "serve.protocol.usage": lambda: ((3, 4), {}),
    "serve.protocol.error_body": lambda: (("bad", "invalid_request_error"), {"param": "n", "code": "x"}),
    "serve.loadgen.arrival_times": lambda: ((4, 2.0), {"burstiness": 1.0, "seed": 0}),
    "serve.loadgen.interarrival_gaps": lambda: ((4, 2.0), {"burstiness": 1.0, "seed": 0}),
    "serve.loadgen.percentile": lambda: (([1.0, 2.0, 3.0], 50.0), {}),
    "serve.loadgen.latency_stats": lambda: (([0.1, 0.2],), {"scale": 1000.0}),
    "serve.loadgen.parse_len_range": lambda: (("10:20", "--input-len"), {}),
    "serve.loadgen.request_body": lambda: (("m", "hi", 4), {}),
    "serve.loadgen.compute_metrics":
        lambda: (([_record()], 1.0), {"slo": _mod("serve.loadgen").SLO(ttft_s=0.5)}),
    "serve.loadgen.goodput": lambda: (([_record()], _mod("serve.loadgen").SLO(ttft_s=0.5), 1.0), {}),
    "serve.loadgen.slo_attainment": lambda: (([_record()], _mod("serve.loadgen").SLO(ttft_s=0.5)), {}),
    "serve.loadgen.default_dataset":
        lambda: ((2,), {"input_len": (8, 16), "output_len": 4, "seed": 0, "tokenizer": _tokenizer(),
                        "context_length": 256}),
}

def _ckpt_dir():
    """A checkpoint folder written by chapter 02's save_checkpoint, in a fresh folder."""
    return _mod("core.checkpoint").save_checkpoint(_model(), _fresh_path("ckpt"))


def _json_file():
    path = _fresh_path("a.json")
    path.write_text('{"a": 1}\n')
    return path


def _ranks() -> dict:
    """A tiny BPE rank table: the 256 bytes and one merge, b"he"."""
    return {**{bytes([i]): i for i in range(256)}, b"he": 256}


def _params():
    """Sampling parameters that use every processor: temperature, top-k and top-p."""
    return _mod("core.sampling").SamplingParams(max_new_tokens=2, temperature=0.8, top_k=5, top_p=0.9, seed=0)


def _cache():
    return _mod("kvcache.cache").ContiguousKVCache(CFG, 1, 16)


def _prefilled_cache():
    """A contiguous cache holding a 3-token prompt's K/V."""
    cache = _cache()
    _mod("kvcache.generate").prefill(_model(), cache, torch.tensor([[1, 2, 3]]))
    return cache


def _kv_pools():
    """Chapter 07's per-layer pools: (num_blocks 4, block_size 4, nh, hs) each."""
    return [torch.randn(4, 4, CFG.n_head, CFG.head_size) for _ in range(CFG.n_layer)]


def _train_config():
    return _mod("gpt.train").TrainConfig(steps=10, warmup_steps=2)


def _workload():
    return [_mod("engine.throughput").WorkloadRequest("r0", 0.0, [1, 2, 3], _greedy(2))]


GOOD_CALLS.update({  # chapters 01-07
    # chapter 01's tokenizer pieces
    "tokenizer.train.train_bpe":
        lambda: (("hello world, hello there", 260), {"pattern": "gpt4", "special_tokens": ("<|endoftext|>",),
                                                     "on_merge": None}),
    "tokenizer.train.train_bpe_naive":
        lambda: (("hello world, hello there", 260), {"pattern": "gpt4", "special_tokens": ("<|endoftext|>",)}),
    "tokenizer.basics.get_pair_counts": lambda: (([1, 2, 1, 2],), {"counts": None, "weight": 1}),
    "tokenizer.basics.merge": lambda: (([1, 2, 1, 2], (1, 2), 256), {}),
    "tokenizer.encode.encode_chunk": lambda: ((b"hello", _ranks()), {}),
    "tokenizer.encode.encode_chunk_fast": lambda: ((b"hello", _ranks()), {}),
    "tokenizer.formats.dump_tiktoken_ranks": lambda: ((_ranks(),), {}),
    "tokenizer.formats.parse_tiktoken_ranks":
        lambda: ((_mod("tokenizer.formats").dump_tiktoken_ranks(_ranks()),), {"source": "<bytes>"}),
    "tokenizer.formats.dump_json":
        lambda: ((_ranks(), "gpt4", {"<|endoftext|>": 257}, "tiny"), {"metadata": None}),
    "tokenizer.formats.parse_json":
        lambda: ((_mod("tokenizer.formats").dump_json(_ranks(), "gpt4", {"<|endoftext|>": 257}, "tiny"),),
                 {"source": "<json>"}),
    "tokenizer.special.raise_if_disallowed": lambda: (("hello", frozenset({"<|endoftext|>"})), {}),
    "tokenizer.special.resolve_special_sets": lambda: ((("<|endoftext|>",), set(), "all"), {}),
    "tokenizer.patterns.split_text": lambda: (("hello world", "gpt4"), {}),
    # chapter 02's attention, checkpoints, weights and training pieces
    "core.attention.attention":
        lambda: (tuple(torch.randn(1, 2, 4, 8) for _ in range(3)), {"mask": None, "is_causal": True}),
    "core.attention.attention_ref":
        lambda: (tuple(torch.randn(1, 2, 4, 8) for _ in range(3)),
                 {"mask": _mod("core.attention").causal_mask(4, 4)}),
    "core.attention.causal_mask": lambda: ((4, 4), {"device": "cpu"}),
    "core.checkpoint.save_checkpoint":
        lambda: ((_model(), _fresh_path("ckpt")), {"extra_metadata": None, "config": None}),
    "core.checkpoint.load_checkpoint": lambda: ((_ckpt_dir(),), {"device": "cpu"}),
    "core.checkpoint.read_config": lambda: ((_ckpt_dir(),), {}),
    "core.weights.load_state_dict_strict":
        lambda: ((GPT(CFG), _mod("core.weights").model_tensors(_model())), {"source": "checkpoint"}),
    "core.weights.model_tensors": lambda: ((_model(),), {}),
    "core.weights.untied_head": lambda: ((_model(),), {}),
    "core.io.atomic_write_bytes": lambda: ((_fresh_path("a.bin"), b"abc"), {}),
    "core.io.atomic_write_text": lambda: ((_fresh_path("a.txt"), "abc"), {"encoding": "utf-8"}),
    "core.io.check_sha256":
        lambda: ((_mod("core.io").with_sha256({}, {"w": torch.ones(2)}), {"w": torch.ones(2)}, "a file"), {}),
    "core.io.read_json_file": lambda: ((_json_file(),), {"what": "JSON file"}),
    "core.formats.model_from_bytes":
        lambda: ((_mod("core.formats").model_to_bytes(_model()),), {"device": "cpu", "expected_sha256": None}),
    "core.hf.hf_state_dict_to_minillm": lambda: ((_mod("core.hf").to_hf_state_dict(_model()),), {}),
    "gpt.dataset.encode_corpus": lambda: ((_tokenizer(), "def f(x):\n    return x\n"), {}),
    "gpt.dataset.fixed_windows": lambda: ((torch.arange(100) % 64, 2, 8), {"seed": 0}),
    "gpt.eval.perplexity":
        lambda: ((_model(), torch.arange(40) % 64), {"block_size": None, "stride": None, "batch_size": 2}),
    "gpt.train.lr_at": lambda: ((_train_config(), 5, 0.5, 0.2), {}),
    "gpt.train.make_optimizer": lambda: ((GPT(CFG), _train_config(), torch.device("cpu")), {}),
    "gpt.train.estimate_loss":
        lambda: ((_model(), torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)), 1,
                  __import__("contextlib").nullcontext), {}),
    # chapter 03's sampling, request lifecycle and naive loop
    "core.sampling.sample_next":
        lambda: ((torch.randn(1, CFG.vocab_size), _params()), {"generator": torch.Generator().manual_seed(0),
                                                               "processors": None}),
    "core.sampling.apply_temperature": lambda: ((torch.randn(2, CFG.vocab_size), 0.8), {}),
    "core.sampling.top_k_filter": lambda: ((torch.randn(2, CFG.vocab_size), 5), {}),
    "core.sampling.top_p_filter": lambda: ((torch.randn(2, CFG.vocab_size), 0.9), {}),
    "core.sampling.probs_from_logits": lambda: ((torch.randn(2, CFG.vocab_size), _params()), {}),
    "core.sampling.make_generator": lambda: ((0,), {"device": "cpu"}),
    "core.sampling.build_processors": lambda: ((_params(),), {}),
    "core.sampling.apply_processors":
        lambda: ((torch.randn(2, CFG.vocab_size), _mod("core.sampling").build_processors(_params())), {}),
    "core.stopping.start_request":
        lambda: ((CFG, [1, 2, 3], _greedy(4)), {"tokenizer": None, "eos_id": None, "device": "cpu",
                                                "truncate": False}),
    "core.stopping.validate_prompt": lambda: (([1, 2, 3], _greedy(4), 64, 32), {"truncate": False}),
    "core.stopping.check_token_ids": lambda: (("prompt_ids", [1, 2, 3], 64), {}),
    "core.stopping.check_eos_id": lambda: ((3, 64), {}),
    "naive.generate.generate_naive_ids":
        lambda: ((_model(), [1, 2, 3], _greedy(3)), {"tokenizer": None, "eos_id": None, "truncate": False}),
    "naive.generate.generate_naive":
        lambda: ((_model(), [1, 2, 3], _params()), {"tokenizer": None, "eos_id": None, "truncate": False}),
    "naive.roofline.decode_cost": lambda: ((CFG, 8), {"dtype": torch.float32}),
    # chapter 04's KV cache
    "kvcache.generate.generate_ids":
        lambda: ((_model(), [1, 2, 3], _greedy(3)), {"tokenizer": None, "eos_id": None, "kv_cache": True,
                                                     "truncate": False, "kv_dtype": torch.float32,
                                                     "decode_fn": None, "prefill_fn": None}),
    "kvcache.generate.prefill": lambda: ((_model(), _cache(), torch.tensor([[1, 2, 3]])), {"positions": None}),
    "kvcache.generate.decode_step":
        lambda: ((_model(), _prefilled_cache(), torch.tensor([[4]])), {"positions": None}),
    "kvcache.generate.static_positions": lambda: ((torch.tensor([0, 1]), 3, 2), {}),
    "kvcache.generate.left_pad": lambda: (([[1, 2], [3]],), {"pad_id": 0}),
    "kvcache.generate.generate_static_batch":
        lambda: ((_model(), [[1, 2, 3], [4, 5]], _greedy(2)), {"tokenizer": None, "eos_id": None, "on_token": None,
                                                               "kv_dtype": torch.float32}),
    "kvcache.cache.kv_cache_bytes": lambda: ((2, 2, 8, 16), {"batch_size": 1, "bytes_per_elem": 4}),
    # chapter 05's paged pieces
    "paged.block_manager.compute_slot_mapping": lambda: (([0, 2], 4, 0, 6), {}),
    "paged.block_manager.num_blocks_for": lambda: ((5, 4), {}),
    "paged.paged_cache.write_kv":
        lambda: ((torch.zeros(4, 4, CFG.n_head, CFG.head_size), torch.tensor([0, 5]),
                  torch.randn(2, CFG.n_head, CFG.head_size)), {}),
    "paged.generate.paged_generate":
        lambda: ((_model(), [1, 2, 3], _greedy(3)), {"tokenizer": None, "eos_id": None, "block_size": 4,
                                                     "num_blocks": None, "kv_dtype": torch.float32}),
    "paged.prefix_cache.hash_block": lambda: ((-1, [1, 2, 3, 4]), {}),
    # chapter 06's engine pieces
    "engine.step.plan": lambda: ((_step_output(), _manager()), {}),
    "engine.throughput.check_workload": lambda: ((_workload(),), {"name": "workload"}),
    "engine.frontend.sample_id": lambda: (("r0", 1), {}),
    "engine.config.resolve_kv_dtype": lambda: (("float32",), {}),
    # chapter 07's KV hand-off and admission
    "disagg.kv_transfer.kv_bytes": lambda: ((CFG, 8), {"dtype": torch.float32}),
    "disagg.kv_transfer.pack_kv": lambda: ((_kv_pools(), _kv_pools(), [0, 2], 6), {}),
    "disagg.kv_transfer.unpack_kv":
        lambda: ((_mod("disagg.kv_transfer").pack_kv(_kv_pools(), _kv_pools(), [0, 2], 6), _kv_pools(), _kv_pools(),
                  [1, 3]), {}),
    "disagg.kv_transfer.payload_to_bytes":
        lambda: ((_mod("disagg.kv_transfer").pack_kv(_kv_pools(), _kv_pools(), [0, 2], 6),), {}),
    "disagg.kv_transfer.payload_from_bytes":
        lambda: (_mod("disagg.kv_transfer").payload_to_bytes(
            _mod("disagg.kv_transfer").pack_kv(_kv_pools(), _kv_pools(), [0, 2], 6)), {}),
    "disagg.decode_worker.max_kv_tokens": lambda: ((3, 4, 32), {}),
    "disagg.decode_worker.admit_handoffs": lambda: (([8, 8], 10, 2, 1, 4, 4), {}),
})

GPU_ONLY = {f"kernels.ops.{op}" for op in ("softmax", "layernorm", "bias_gelu", "attention", "paged_attention_decode",
                                          "int8_gemv", "kv_cache_write")} | {
    f"kernels.bench.{f}" for f in ("copy_bandwidth", "matmul_tflops", "time_ms")}
LABELS = ("who", "role", "name", "where", "what", "source")  # arguments that only name something (check_label)
CHECKER_LABELS = (*LABELS, "whose", "arg", "bound")  # a check_* helper's labels
FUNCTION_ACCEPTS = {  # (function, argument, bad value's name): why the result is right
    **{(f, "tokenizer", "None"): "the default" for f in GOOD_CALLS},
    **{(f, "eos_id", "None"): "the default" for f in GOOD_CALLS},
    **{(f, arg, "None"): "the default (none)" for f, arg in (
        ("speculative.sampling.accept_or_resample", "generator"), ("speculative.sampling.sample_from_target",
        "generator"), ("speculative.sampling.accept_greedy", "params"), ("quant.linear.quantize_model", "weights"),
        ("quant.quantize.symmetric_params", "dim"), ("quant.gptq.gptq_quantize", "group_size"),
        ("quant.qat.convert_qat", "config"), ("prune.unstructured.prune_model", "calibration"),
        ("prune.semi_structured.stored_bytes", "element_bytes"), ("distill.losses.check_layer_pairs",
        "student_layers"), ("distill.losses.check_layer_pairs", "teacher_layers"), ("compile.decode.StaticDecoder",
        "max_len"), ("compile.fused_step.FusedCPUDecoder", "max_len"), ("compile.cpu_gemv.FastLinear", "device"),
        ("compile.cpu_gemv.FastLinear", "dtype"), ("quant.qat.FakeQuantLinear", "device"),
        ("quant.qat.FakeQuantLinear", "dtype"), ("compile.cpu_gemv.gemv", "b"), ("compile.mirror.gemv_blocked", "b"),
        ("kernels.build.run_program", "timeout"), ("kernels.build.run_program", "cwd"),
        ("distill.train.DistillObjective", "student_config"), ("distill.train.DistillObjective", "layer_pairs"),
        ("quant.quantize.quantize", "group_size"))},
    ("kernels.build.run_program", "timeout", "1.5"): "a timeout in seconds",
    ("quant.outliers.inject_outliers", "channels", "empty list"): "no channel to scale: the model unchanged",
    ("distill.losses.check_layer_pairs", "layer_pairs", "empty list"): "no pairs: no feature loss",
    **{(f, "temperature", "2**40"): "a huge temperature is a valid (flat) softening" for f in (
        "distill.losses.kd_loss", "distill.losses.distillation_loss", "distill.train.DistillObjective")},
    **{(f, "temperature", "1.5"): "a valid temperature" for f in GOOD_CALLS},
    **{(f, "factor", v): "a valid factor" for f in GOOD_CALLS for v in ("2**40", "1.5")},
    **{(f, "ngram", "2**40"): "an n-gram longer than any sequence never matches: plain steps, the right tokens"
       for f in ("speculative.generate.generate_prompt_lookup", "speculative.generate.prompt_lookup_proposals",
                 "compile.fused_speculative.generate_prompt_lookup_fused")},
    ("speculative.generate.prompt_lookup_proposals", "ids", "empty list"): "nothing to look up: no proposals",
    ("quant.quantize.symmetric_params", "dim", "-1"): "the last dimension, as torch counts",
    ("quant.linear.quantize_model", "weights", "empty dict"): "no precomputed codes: every layer rounded here",
    **{(f, "damp", v): "a valid (large) damping: the update tends to plain rounding" for f in (
        "quant.gptq.gptq_quantize", "quant.gptq.gptq_quantize_model") for v in ("2**40", "1.5")},
    ("prune.semi_structured.stored_bytes", "element_bytes", "2**40"): "arithmetic on a size: the right product",
    **{("distill.losses.check_layer_pairs", f, "2**40"): "a bound the pairs are within"
       for f in ("student_layers", "teacher_layers")},
    **{("kernels.emulator.layernorm", "eps", v): "a valid (large) epsilon" for v in ("2**40", "1.5")},
    ("compile.sweep.profile_table", "ops", "empty list"): "no operators: an empty table",
    ("compile.sweep.profile_table", "top", "2**40"): "more than there are: every operator shown",
    ("kernels.emulator.int8_gemv", "bias", "None"): "no bias",
    ("speculative.engine.SpeculativeConfig", "ngram", "2**40"): "an n-gram that never matches: plain steps",
    ("speculative.engine.SpeculativeLLM", "config", "None"): "the default engine config",
    **{(f, "path", "str"): "a relative path: written in the working folder (the test's temporary one)"
       for f in ("quant.checkpoint.save_quantized", "prune.checkpoint.save_pruned", "distill.run_state.RecordLog")},
    **{(f, "method", "str"): "free text kept for people (documented)"
       for f in ("quant.checkpoint.save_quantized", "prune.checkpoint.save_pruned")},
    **{("quant.outliers.outlier_report", "threshold", v): "a valid threshold" for v in ("2**40", "1.5")},
    **{("speculative.sampling.acceptance_probability", a, "tensor"): "zeros are probabilities: min(1, p/q) is defined"
       for a in ("p_x", "q_x")},
    ("speculative.generate.sample_draft", "generator", "None"): "the default generator",
    ("speculative.generate.sample_draft", "step", "2**40"): "the step only names the draft in messages",
    **{(f"speculative.bench.{f}", a, v): "the cost model's arithmetic on valid numbers"
       for f, a in (("expected_tokens_per_call", "gamma"), ("predicted_speedup", "gamma"), ("predicted_speedup", "c"),
                    ("predicted_speedup", "verify_cost"), ("chi_square_p_value", "chi2"),
                    ("chi_square_p_value", "dof")) for v in ("2**40", "1.5")},
    **{("quant.quantize.asymmetric_params", "dim", v): "all dimensions / the last one" for v in ("None", "-1")},
    **{("quant.w8a8.outlier_columns", "threshold", v): "a valid threshold" for v in ("2**40", "1.5")},
    **{("quant.gptq.damped", "damp", v): "a valid (large) damping" for v in ("2**40", "1.5")},
    ("quant.gptq.rtn_and_gptq_errors", "group_size", "None"): "per channel",
    ("prune.masks.num_pruned", "n", "2**40"): "arithmetic on a count",
    ("prune.structured.mask_heads", "heads", "empty dict"): "no head masked: the model unchanged",
    ("distill.run_state.record_digest", "record", "empty dict"): "a record of no fields has a digest",
    **{(f, "eps", v): "a valid (large) epsilon" for f in ("kernels.naive.layernorm", "kernels.mirror.layernorm_warp")
       for v in ("2**40", "1.5")},
    **{(f, a, "None"): "no bias" for f, a in (("kernels.naive.int8_gemv", "bias"), ("kernels.mirror.int8_gemv", "bias"),
                                              ("compile.cpu_gemv.int8_gemv", "b"))},
    **{(f"kernels.mirror.{f}", a, "2**40"): "a tile or pack past the row: one tile (the same result)"
       for f, a in (("flash_attention", "block_q"), ("flash_attention", "block_k"), ("bias_gelu", "pack"),
                    ("int8_gemv", "pack"), ("layernorm_warp", "pack"), ("softmax_online", "tile"),
                    ("softmax_online", "num_parts"))},
    ("kernels.mirror.softmax_online", "x", "tensor"): "a row of zeros: the uniform softmax",
    **{("compile.decode.integer_ids", "value", v): "an int64 id: its range is the caller's check (documented)"
       for v in ("-1", "2**40")},
    **{(f, "max_len", "None"): "the default: the context window" for f in ("compile.aot.DecodeStep",
                                                                          "compile.decode.decoder_max_len")},
    ("compile.sweep.run_case", "seed", "2**40"): "a 64-bit seed",
    ("quant.w8a8.w8a8_linear", "bias", "None"): "no bias",
    ("speculative.bench.prompt_lookup", "new_tokens", "2**40"): "capped where the window ends (reported: produced)",
    ("speculative.bench.prompt_lookup", "ngram", "2**40"): "an n-gram that never matches: plain steps",
    **{("speculative.bench.sampling_exactness", "seed", v): "a 64-bit seed" for v in ("-1", "2**40")},
    ("speculative.engine_bench.load_point", "speculative", "None"): "the plain engine, the baseline (documented)",
    **{("distill.bench.cost_model_speedup", a, v): "the cost model's arithmetic" for a in ("gamma", "c")
       for v in ("2**40", "1.5")},
    ("distill.bench.check_prompts", "new_tokens", "None"): "the default: no room asked for",
    **{("compile.mirror.check_plain_model", "handled", v): "no layer handled by the caller" for v in ("empty list",)},
    ("compile.llamacpp.ours_tok_s", "tokens", "2**40"): "arithmetic: tokens over seconds",
    ("quant.linear.QuantConfig", "group_size", "2**40"): "checked against the layers when a model is quantized",
    **{(f, "vocab_size", "2**40"): "a vocabulary bound the ids are within"
       for f in ("speculative.generate.check_prompt_ids", "speculative.generate.check_draft_feed",
                 "distill.losses.check_targets")},
    ("speculative.generate.check_prompt_ids", "max_len", "None"): "the default: no bound",
    ("speculative.generate.check_prompt_ids", "max_len", "2**40"): "a bound the prompt is within",
    **{("speculative.generate.check_proposal", "q", v): "a greedy round reads no q: None comes back in its place"
       for v in ONE_AT_A_TIME},
    **{("speculative.generate.lookup", a, "2**40"): "a γ past the sequence copies what there is; an n-gram longer "
       "than it never matches" for a in ("gamma", "ngram")},
    ("speculative.bench.ChiSquare", "n", "1.5"): "n counts expected draws too: a float (documented)",
    **{("speculative.bench.ChiSquare", a, v): "a valid statistic" for a in ("chi2", "dof") for v in ("2**40", "1.5")
       if (a, v) != ("dof", "1.5")},
    **{(f, "threshold", "1.5"): "a valid outlier threshold" for f in ("quant.w8a8.llm_int8_linear",
                                                                     "quant.w8a8.llm_int8_reference")},
    **{("quant.gptq.gptq_reference", "damp", v): "a valid (large) damping" for v in ("2**40", "1.5")},
    ("kernels.mirror.lane_partials", "pack", "2**40"): "one pack past the row: lane 0 holds the row's sum",
    ("kernels.mirror.attend_tile", "l", "tensor"): "zeros: the running sum's start",
    ("kernels.ops.check_block_tables", "block_size", "2**40"): "a block size within int64 (documented)",
    ("kernels.ops.tensors_overlap", "b", "tensor"): "a question about two tensors: a fresh one shares nothing",
    ("kernels.ops.layernorm", "eps", "1.5"): "a valid (large) epsilon",
    ("kernels.bench.time_ms", "batch_ms", "1.5"): "a valid sample length",
    ("kernels.bench.check_same_shape", "ref", "tensor"): "the same shape as got's: the check passes",
    ("kernels.build.check_build_args", "timeout", "1.5"): "a timeout in seconds",
    **{("compile.sweep.Case", a, "2**40"): "checked against the model's window by check_case" for a in ("batch",
                                                                                                 "tokens")},
    ("compile.cpu_gemv.int4_gemv", "b", "None"): "no bias",
    ("compile.decode.check_id_range", "high", "2**40"): "a bound the ids are within",
    ("compile.sweep.check_backend_and_seed", "seed", "2**40"): "a 64-bit seed",
    ("kernels.bench.check_same_shape", "got", "tensor"): "the same shape as ref's: the check passes",
    ("kernels.bench.time_ms", "batch_ms", "2**40"): "a valid (long) sample, capped by max_calls",
    ("kernels.build.check_build_args", "out_dir", "str"): "a relative folder",
    ("kernels.build.run_compiler", "timeout", "1.5"): "a timeout in seconds",
    ("kernels.mirror.attend_tile", "m", "tensor"): "zeros: a running max like any other",
    ("kernels.mirror.lane_partials", "x", "tensor"): "a row of two zeros: lanes of zeros",
    **{(f, "bias", "None"): "no bias" for f in ("kernels.naive.check_int8_gemv_args", "kernels.ops.int8_gemv")},
    **{(f"kernels.ops.{f}", a, "2**40"): "a pool within int64 (documented)" for f, a in (
        ("check_block_tables", "num_blocks"), ("check_slot_range", "num_slots"))},
    ("kernels.ops.layernorm", "eps", "2**40"): "a valid (large) epsilon",
    ("kernels.ops.softmax", "x", "tensor"): "a CPU row of a valid shape: refused at the device check, by name",
    ("kernels.ops.tensors_overlap", "a", "tensor"): "a question about two tensors: a fresh one shares nothing",
    ("prune.masks.check_keeps_one", "n", "2**40"): "half of a large count keeps one",
    ("quant.gptq.gptq_reference", "group_size", "None"): "per channel",
    ("quant.quantize.check_finite", "x", "tensor"): "zeros are finite",
    **{(f, "threshold", "2**40"): "a valid threshold: no outlier" for f in ("quant.w8a8.llm_int8_linear",
                                                                           "quant.w8a8.llm_int8_reference")},
    ("speculative.bench.ChiSquare", "n", "2**40"): "a valid count of draws",
    ("speculative.bench.chi_square_quantile", "dof", "2**40"): "a valid number of degrees of freedom",
    **{(f, "ngram", "2**40"): "an n-gram that never matches: no drafts" for f in (
        "speculative.engine.PromptLookupDrafter", "speculative.generate.PromptLookupProposer")},
    **{(f, a, "empty list"): "no drafts: a round of the plain step" for f, a in (
        ("speculative.engine.VerifyEntry", "draft_token_ids"), ("speculative.generate.check_proposal", "drafts"),
        ("speculative.sampling.check_draft_tokens", "draft_tokens"))},
    ("speculative.generate.check_draft_feed", "max_len", "2**40"): "a bound the drafts are within",
    ("speculative.generate.lookup", "ids", "empty list"): "nothing to look up: no drafts",
    ("speculative.engine_bench.crossover", "points", "empty list"): "no load measured: no crossover (documented)",
    ("speculative.sampling.check_generator", "generator", "None"): "the default generator",
    ("speculative.bench.encode", "text", "str"): "any text encodes",
    # chapters 14 and 15: sizes past any run are arithmetic on valid numbers; defaults; empty record lists
    **{(f, a, "2**40"): "arithmetic on valid sizes" for f, a in (
        ("parallel.bench.link_estimate", "t"), ("parallel.pipeline.bubble_fraction", "p"),
        ("parallel.pipeline.bubble_fraction", "m"), ("parallel.pipeline.measured_bubble", "p"),
        ("parallel.pipeline.stage_layers", "n_layer"), ("parallel.tensor.all_reduce_bytes", "tokens"),
        ("parallel.tensor.all_reduce_bytes", "n_embd"), ("parallel.tensor.all_reduce_bytes", "n_layer"),
        ("parallel.tensor.ring_traffic_per_rank", "message_bytes"), ("parallel.tensor.ring_traffic_per_rank", "t"),
        ("serve.protocol.check_context", "context_length"), ("serve.protocol.parse_completion", "vocab_size"),
        ("serve.protocol.usage", "prompt_tokens"), ("serve.protocol.usage", "completion_tokens"),
        ("serve.loadgen.request_body", "max_tokens"), ("serve.loadgen.default_dataset", "context_length"))},
    **{(f"parallel.tensor.{f}", "bias", "None"): "no bias" for f in ("column_split", "row_parallel_forward")},
    **{(f"serve.loadgen.{f}", a, v): "a valid rate, burstiness, duration or scale" for f, a in (
        ("arrival_times", "rate"), ("arrival_times", "burstiness"), ("interarrival_gaps", "rate"),
        ("interarrival_gaps", "burstiness"), ("compute_metrics", "duration"), ("goodput", "duration"),
        ("latency_stats", "scale")) for v in ("2**40", "1.5")},
    **{(f"serve.loadgen.{f}", "seed", "2**40"): "a 64-bit seed" for f in ("arrival_times", "interarrival_gaps",
                                                                          "default_dataset")},
    **{(f"serve.loadgen.{f}", "records", "empty list"): "no requests: the metrics of none"
       for f in ("compute_metrics", "goodput", "slo_attainment")},
    ("serve.loadgen.latency_stats", "values", "empty list"): "no values: None (documented)",
    ("serve.loadgen.compute_metrics", "slo", "None"): "no SLO (documented)",
    ("serve.loadgen.percentile", "q", "1.5"): "the 1.5th percentile",
    **{("serve.protocol.error_body", a, "None"): "no param / code (the default)" for a in ("param", "code")},
    **{("serve.protocol.error_body", a, "str"): "any message text" for a in ("message", "type", "param", "code")},
    ("serve.loadgen.request_body", "prompt", "str"): "any prompt text",
    ("serve.loadgen.request_body", "model", "str"): "any model name (the server answers an unknown one)",
    ("serve.loadgen.parse_len_range", "flag", "str"): "a flag's name for messages",
    ("serve.protocol.check_context", "prompt_param", "str"): "a field's name for the 400's param",
    ("quant.bench.build", "qat_steps", "2**40"): "a valid step count (the int8 round-to-nearest case runs none)",
    ("quant.bench.kv_perplexity", "batch_size", "2**40"): "at most every window in one batch",
    **{("distill.train.kd_history", a, "2**40"): "no objective: no records to average" for a in ("every",
                                                                                             "grad_accum")},
    ("kernels.build.parse_ptxas", "text", "str"): "a report naming no kernel: no entries",
    ("compile.sweep.profile_decode", "top", "None"): "every operator (documented)",
    ("compile.sweep.profile_decode", "top", "2**40"): "more than there are: every operator",
    **{(f, "seed", "2**40"): "a 64-bit seed" for f in ("compile.sweep.profile_decode", "compile.bench.pruned_fused",
                                                      "compile.fused_engine.load_point")},
    **{("quant.linear.QuantConfig", "outlier_threshold", v): "a valid threshold (None: off)"
       for v in ("None", "2**40", "1.5")},
    **{(f, "lr", "1.5"): "a large but finite step: two steps of it stay finite here"
       for f in ("prune.structured.recover", "quant.qat.finetune_qat")},
    **{(f, "seed", v): "a 64-bit seed, as torch.Generator takes" for f in ("prune.structured.recover",
                                                                          "quant.qat.finetune_qat")
       for v in ("-1", "2**40")},
}

FUNCTION_ACCEPTS.update({  # chapters 01-07
    **{(f"tokenizer.train.{f}", "special_tokens", "empty dict"): "no special tokens: an empty collection"
       for f in ("train_bpe", "train_bpe_naive")},
    ("tokenizer.basics.get_pair_counts", "ids", "empty list"): "no ids: no pairs",
    ("tokenizer.basics.get_pair_counts", "counts", "empty dict"): "an empty tally to add into (documented)",
    ("tokenizer.basics.get_pair_counts", "weight", "2**40"): "a word's count in a big corpus: a valid weight",
    ("tokenizer.basics.merge", "ids", "empty list"): "no ids: nothing to merge",
    ("tokenizer.basics.merge", "new_id", "2**40"): "merge knows no vocabulary: the trainer numbers new ids",
    ("tokenizer.special.raise_if_disallowed", "disallowed", "empty list"): "nothing disallowed: nothing to find",
    **{("tokenizer.special.resolve_special_sets", a, "empty list"): "no special token named: an empty set"
       for a in ("allowed_special", "disallowed_special")},
    ("tokenizer.patterns.split_text", "pattern", "str"): "a regular expression is a pattern (documented)",
    ("core.io.atomic_write_text", "text", "str"): "any text is written",
    **{(f, "seed", v): "a 64-bit seed, as torch.Generator takes" for f in (
        "gpt.dataset.fixed_windows", "core.sampling.make_generator") for v in ("-1", "2**40")},
    **{(f, "processors", "empty list"): "no processors: the raw logits (documented: they replace params')"
       for f in ("core.sampling.sample_next", "core.sampling.apply_processors")},
    ("core.sampling.apply_temperature", "temperature", "2**40"): "a huge temperature is a valid (flat) softening",
    ("core.sampling.top_k_filter", "k", "2**40"): "a k past the vocabulary keeps every token",
    **{(f, a, "2**40"): "a bound the ids or the prompt are within" for f, a in (
        ("core.stopping.validate_prompt", "vocab_size"), ("core.stopping.validate_prompt", "block_size"),
        ("core.stopping.check_token_ids", "vocab_size"), ("core.stopping.check_eos_id", "vocab_size"))},
    ("core.stopping.start_request", "eos_id", "2**40"): "documented: an eos outside the vocabulary never occurs "
        "(the entry points check an explicit one with check_eos_id)",
    **{(f, a, "2**40"): "arithmetic on valid sizes" for f, a in (
        ("naive.roofline.decode_cost", "context_len"), ("kvcache.cache.kv_cache_bytes", "n_kv_head"),
        ("kvcache.cache.kv_cache_bytes", "head_dim"), ("kvcache.cache.kv_cache_bytes", "num_tokens"),
        ("kvcache.cache.kv_cache_bytes", "batch_size"), ("kvcache.cache.kv_cache_bytes", "bytes_per_elem"),
        ("paged.block_manager.num_blocks_for", "num_tokens"), ("paged.block_manager.num_blocks_for", "block_size"),
        ("disagg.decode_worker.max_kv_tokens", "max_new_tokens"),
        ("disagg.decode_worker.max_kv_tokens", "context_window"),
        *(("disagg.decode_worker.admit_handoffs", a) for a in ("num_free_blocks", "num_reserved_blocks",
                                                                "num_running", "max_num_seqs", "block_size")))},
    ("kvcache.generate.static_positions", "start", "2**40"): "positions are the model's to check (its window)",
    ("kvcache.generate.left_pad", "pad_id", "2**40"): "left_pad knows no vocabulary: the model checks the ids it "
        "embeds",
    ("engine.frontend.sample_id", "index", "2**40"): "any sample index names a sample",
    ("paged.prefix_cache.hash_block", "parent_hash", "2**40"): "any 64-bit int is a hash",
    **{(f"tokenizer.train.{f}", "special_tokens", "empty list"): "no special tokens"
       for f in ("train_bpe", "train_bpe_naive")},
    ("tokenizer.formats.dump_json", "pattern", "str"): "a regular expression is a pattern (documented)",
    **{(f, "text", "str"): "any text" for f in ("tokenizer.special.raise_if_disallowed",
                                                "tokenizer.patterns.split_text", "gpt.dataset.encode_corpus")},
    ("tokenizer.special.resolve_special_sets", "specials", "empty list"): "a tokenizer without special tokens",
    ("core.attention.attention_ref", "mask", "None"): "no mask (the default)",
    ("core.attention.causal_mask", "device", "None"): "torch's default device (the default)",
    **{(f, a, "str"): "a relative path: written in the working folder (the test's temporary one)" for f, a in (
        ("core.checkpoint.save_checkpoint", "path_dir"), ("core.io.atomic_write_bytes", "path"),
        ("core.io.atomic_write_text", "path"))},
    **{(f, "batch_size", "2**40"): "at most every window in one batch" for f in ("gpt.eval.perplexity",
                                                                                 "gpt.train.estimate_loss")},
    ("gpt.train.lr_at", "step", "2**40"): "a step past warm-up: the cosine reads progress",
    ("core.sampling.sample_next", "generator", "None"): "the global RNG (the default)",
    ("core.sampling.make_generator", "seed", "None"): "no seed: None, the global RNG (documented)",
    **{(f"core.sampling.{f}", "logits", "tensor"): "one row of zero logits (V,): valid logits"
       for f in ("apply_temperature", "top_k_filter", "top_p_filter", "apply_processors")},
    ("core.stopping.check_token_ids", "ids", "empty list"): "no ids: an empty list (a prompt's emptiness is "
        "validate_prompt's check)",
    **{(f, a, "2**40"): "arithmetic on valid sizes" for f, a in (
        ("kvcache.cache.kv_cache_bytes", "n_layer"), ("disagg.kv_transfer.kv_bytes", "num_tokens"),
        ("disagg.decode_worker.max_kv_tokens", "num_prompt_tokens"))},
    ("paged.block_manager.compute_slot_mapping", "block_size", "2**40"): "a block size within int64: block 0's "
        "slots",
    ("engine.frontend.sample_id", "request_id", "str"): "any str is a request id",
    ("disagg.decode_worker.admit_handoffs", "waiting_kv_tokens", "empty list"): "nothing waiting: none admitted",
    **{(f"tokenizer.formats.{f}", "ranks", "empty dict"): "a format writer: a table's completeness is checked "
       "where a Tokenizer is built" for f in ("dump_tiktoken_ranks", "dump_json")},
    **{("tokenizer.formats.dump_json", a, "empty dict"): "none (no special tokens, no metadata)"
       for a in ("special_tokens", "metadata")},
    **{("tokenizer.special.resolve_special_sets", a, "empty dict"): "an empty collection of names"
       for a in ("specials", "allowed_special", "disallowed_special")},
    ("core.checkpoint.save_checkpoint", "extra_metadata", "empty dict"): "no training notes",
    ("core.io.check_sha256", "metadata", "empty dict"): "no digest recorded: False, nothing checked (documented)",
    ("core.hf.hf_state_dict_to_minillm", "state", "empty dict"): "nothing to rename: an empty state (the loader "
        "names the missing tensors)",
})

def _function(name: str):
    """The function a GOOD_CALLS key names: "quant.gptq.damped", or a class's method "quant.linear.QuantLinear.
    from_linear"."""
    parts = name.split(".")
    return functools.reduce(getattr, parts[2:], _mod(".".join(parts[:2])))


def _argument_names(name: str) -> list[str]:
    fn = _function(name)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", list(GOOD_CALLS))
def test_every_argument_of_a_public_function_is_checked_by_itself(name):
    fn = _function(name)
    args, kwargs = GOOD_CALLS[name]()
    gpu_only = name in GPU_ONLY and not torch.cuda.is_available()
    if gpu_only:  # the good call gets as far as the device check: every argument is checked before it
        with pytest.raises((RuntimeError, ValueError), match=DEVICE_CHECK):
            fn(*args, **kwargs)
    else:
        fn(*args, **kwargs)  # the good call works
    names = _argument_names(name)
    problems = []
    for index in range(len(args) + len(kwargs)):
        arg = names[index] if index < len(args) else list(kwargs)[index - len(args)]
        if arg in CHECKER_LABELS and name.split(".")[-1].startswith("check_"):
            continue  # a checker's own label: minillm passes it a literal, which only ends up in its messages
        good = args[index] if index < len(args) else kwargs[arg]
        for bad, value in ONE_AT_A_TIME.items():
            if (type(value) is type(good) and value == good) or (isinstance(good, bool) and isinstance(value, bool)):
                continue  # a good value itself: True for a flag

            def call(_index=index, _arg=arg, _value=value):
                a, k = GOOD_CALLS[name]()
                a = list(a)
                if _index < len(a):
                    a[_index] = _make(_value)
                else:
                    k[_arg] = _make(_value)
                return fn(*a, **k)

            problem = _call_once(call, name, f"{arg} = {bad}", gpu_only)
            label = arg in LABELS and bad == "str"  # any text is a right label
            if problem == "accepted" and not label and (name, arg, bad) not in FUNCTION_ACCEPTS:
                problem = f"{name} with {arg} = {bad}: accepted (a result, no error)"
            if problem not in (None, "accepted"):
                problems.append(problem)
    assert not problems, "\n".join(problems)


# ----- records: the benchmarks' sizes ------------------------------------------------------------------------------

SIZE_RECORDS = ("quant.bench", "prune.bench", "distill.bench")


@pytest.mark.parametrize("module", SIZE_RECORDS)
def test_every_field_of_a_benchmark_size_is_checked_when_the_record_is_built(module):
    """A `Sizes` record built by hand (the benchmarks' `SIZES` presets are such records) with one field replaced by
    each bad value: a TypeError / ValueError naming the field, not an error minutes into the run that reads it."""
    import dataclasses

    sizes_type = _mod(module).Sizes
    good = _mod(module).SIZES["quick"]
    problems = []
    for field in dataclasses.fields(sizes_type):
        for bad, value in ONE_AT_A_TIME.items():
            current = getattr(good, field.name)
            if (type(value) is type(current) and value == current) or (isinstance(current, bool)
                                                                          and isinstance(value, bool)):
                continue
            problem = _call_once(lambda: dataclasses.replace(good, **{field.name: _make(value)}), module,
                                 f"Sizes.{field.name} = {bad}")
            accepted = (field.type == "int | None" and value is None) or (bad == "True" and field.type == "bool")
            if problem == "accepted" and not accepted:
                problem = f"{module}.Sizes with {field.name} = {bad}: accepted"
            if problem not in (None, "accepted"):
                problems.append(problem)
    assert not problems, "\n".join(problems)
