"""The decode step with fixed shapes, then compiled by `torch.compile` or captured as a CUDA graph.

What it adds: `StaticDecoder(model, mode)`, a decode step that chapter 04's `generate` takes as its `decode_fn`:

    mode "eager"        the step as written, over a static-shape cache (every tensor's shape fixed by max_len)
    mode "compile"      torch.compile(step, fullgraph=True, dynamic=False): one graph for every token, built by the
                        backend (inductor by default: generated C++ for the CPU)
    mode "cuda-graph"   the eager step captured once as a CUDA graph and replayed per token: one launch instead of
                        the step's hundred-odd kernel launches

A static-shape cache (`ContiguousKVCache(use_static_shapes=True)`, chapter 04) writes at a device-side slot counter
and attends over all max_len slots under a mask, so the step reads no Python value that changes from token to token:
nothing for a compiled graph to guard on, and nothing a captured graph would freeze. The step's inputs (the token
and its position) are copied into fixed buffers first, so a captured graph always reads the same memory.

`compiles` counts the graphs the backend built (1 for a whole generation, whatever its length: the tests hold
this) and `first_call_seconds` is the first decode call's wall time, compile included. `batch_size` > 1 gives the
step of a static batch (chapter 04), B rows advancing together, for the benchmarks and tests that time and check
batched decode (`minillm.compile.sweep`); chapter 04's `generate` drives batch 1. What it leaves out: the prefill (it
runs eager: its length changes from prompt to prompt) and the engine's ragged steps.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module

from minillm.core.config import (check_choice, check_has_data, check_int, check_label, check_tensor_elements,
                                 GPTConfig, plain_int, short_repr, tensor_kind)
from minillm.core.model import GPT
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import validate_prompt
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate_ids
from minillm.quant.linear import QuantEmbedding, QuantLinear
from minillm.quant.qat import FakeQuantLinear

MODES = ("eager", "compile", "cuda-graph")


def integer_ids(name: str, value: Any, count: int) -> torch.Tensor:
    """`value` as a tensor of `count` integer ids: a TypeError naming `name` for a float, bool or non-tensor (a float
    token would be truncated silently by the copy into an int64 buffer), a ValueError for the wrong count (`count`
    itself a positive int: True is no count)."""
    name = check_label("name", name)
    count = check_int("count", count)
    if plain_int(value) is not None:  # a Python or numpy int (a token id, as prompts take them)
        value = plain_int(value)  # the plain int: torch would fail past int64 naming nothing ("Overflow ...")
        if not -2**63 <= value < 2**63:
            raise ValueError(f"{name} must be an int64 id, got {short_repr(value)}")
        value = torch.tensor([value])
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of integer ids, got {type(value).__name__} {short_repr(value)}")
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(f"{name} must hold integer ids, got dtype {value.dtype}")
    check_has_data(name, value)
    if value.numel() != count:
        raise ValueError(f"{name} must hold {count} id(s), got shape {tuple(value.shape)}")
    return value


def tracing() -> bool:
    """True while torch.export, torch.compile or the TorchScript tracer runs a step: checks that read tensor values
    into Python (`check_id_range`) run only outside, since a traced step has no values (and would keep one guard
    for one value). Type and shape checks run either way."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def check_id_range(name: str, ids: torch.Tensor, high: int, bound: str) -> None:
    """A ValueError naming `name` when an id of the integer tensor `ids` is outside [0, high) (`bound` says what
    `high` is: "vocab_size=64"), before an embedding or a cache write indexes with it (an IndexError naming
    nothing). One host sync; skipped while tracing."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be a tensor of integer ids, got {tensor_kind(ids)}")
    high = check_int("high", high, 0)
    if tracing() or check_has_data(name, ids).numel() == 0:  # check_has_data: a meta tensor has no ids to read
        return
    low, top = int(ids.min()), int(ids.max())
    if low < 0 or top >= high:
        raise ValueError(f"{name} must be in [0, {bound}), got {short_repr(ids.tolist())}")


def _check_config(config: Any) -> None:
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be the model's GPTConfig, got {type(config).__name__}")


def decoder_max_len(config: GPTConfig, max_len: Any) -> int:
    """The cache length of a chapter 13 decoder (`StaticDecoder`, `FusedCPUDecoder`): the context window
    `config.block_size` when None, else an int in [1, block_size]; a TypeError / ValueError naming max_len otherwise.

    Why at most block_size: the decoders' rows have no left padding, so the token at slot j sits at position j, and
    positions stop at block_size - 1 (the learned position embedding ends there): slots past it could never be
    written. Refused here, a max_len of 10**15 never reaches the allocator."""
    _check_config(config)
    if max_len is None:
        return config.block_size
    max_len = check_int("max_len", max_len)  # the plain int (of an int subclass too) every later check compares
    if max_len > config.block_size:
        raise ValueError(f"max_len={max_len} is past the model's context window block_size={config.block_size}: "
                         "positions stop there, so those slots could never be used; pass max_len <= block_size")
    return max_len


def check_decoder_room(max_len: int, config: GPTConfig, prompt_ids: Any, params: SamplingParams,
                       truncate: bool = False) -> None:
    """A decoder's cache of `max_len` slots holds this request (the prompt and every generated token but the last,
    chapter 04's count), or a ValueError naming max_len, the decoder's own argument: `generate` would name its
    `kv_cache`, which the caller of a decoder's generate_ids never passed. The prompt and params are checked as
    `generate` checks them (`validate_prompt`: the window cap and truncate included)."""
    max_len = check_int("max_len", max_len)  # the plain int it holds
    _check_config(config)
    if max_len > config.block_size:
        raise ValueError(f"max_len={max_len} is past the model's context window block_size={config.block_size}")
    ids, max_new = validate_prompt(prompt_ids, params, config.vocab_size, config.block_size, truncate)
    needed = max(len(ids) + max_new - 1, 1)
    if needed > max_len:
        raise ValueError(f"max_len={max_len} is too short for this request: a {len(ids)}-token prompt and "
                         f"max_new_tokens={max_new} need {needed} cache slots; build the decoder with "
                         f"max_len >= {needed}")


def compile_problem() -> str | None:
    """None when `torch.compile` with inductor can build a CPU graph here, else why not: dynamo does not support
    this Python/PyTorch, or there is no C++ compiler for the code inductor generates. The notebook and callers that
    treat compilation as optional check this first, as chapter 13's C++ paths check `cpu_gemv.build_problem`."""
    if not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported():
        return "torch.compile (dynamo) is not supported on this Python/PyTorch"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "inductor's CPU backend needs a C++ compiler (c++ or g++) on the PATH"
    return None


# Backends dynamo registers by name whose compiler is an optional package (imported only at the first call).
BACKEND_PACKAGES = {"tvm": "tvm", "openxla": "torch_xla", "openxla_eval": "torch_xla"}


def check_backend(name: str, arg: str = "backend") -> str:
    """A TypeError / ValueError naming `arg` (the caller's argument) unless `name` is a backend name dynamo knows
    (torch.compile would raise its InvalidBackend only at the first call, from inside torch) whose package is
    installed (`BACKEND_PACKAGES`: dynamo lists "tvm" without TVM, and fails at the first call). Returns the plain
    str, which callers pass on to torch (a str subclass's own methods never reach it)."""
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())  # every registered name, the debug ones ("eager", "aot_eager") included
    if not isinstance(name, str):
        raise TypeError(f"{arg} must be a torch.compile backend name, one of {known}, got {type(name).__name__} "
                        f"{short_repr(name)}")
    name = str.__str__(name)  # the plain str: a str subclass whose == says True would pass `in known`
    if name not in known:
        raise ValueError(f"{arg} must be one of torch.compile's backends {known}, got {name!r}")
    package = BACKEND_PACKAGES.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"{arg} {name!r} needs the Python package {package!r}, which is not installed: pick "
                         "another backend (inductor, the default, needs none)")
    return name


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Run the body with `model` in eval mode (dropout off), then give every module back the mode it had: a decoder
    decodes in eval mode without switching the caller's model for good. A TypeError unless `model` is a torch
    module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch module, got {type(model).__name__}")
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


def check_eval_mode(model: nn.Module, who: str) -> None:
    """A ValueError naming `who` when `model` is in training mode, where its dropout would run: steps that are
    compared with (or stand in for) the model's eval-mode outputs need model.eval() first; a TypeError naming `who`
    when `model` is not a torch module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who} needs a torch module, got {type(model).__name__}")
    if model.training:
        raise ValueError(f"{who} runs the model in eval mode, but the model is in training mode (its dropout would "
                         "run): call model.eval() first")


def hooked_module(named_modules: Iterable[tuple[str, nn.Module]]) -> str | None:
    """The first of `named_modules` ((name, module) pairs, as `model.named_modules()` gives) with a forward hook or
    forward pre-hook, by name, or "every module" for a global one (`register_module_forward_hook`); None if none.
    A step built once from the model (a compiled graph, a captured CUDA graph, the fused C++ step) cannot follow a
    hook added later, nor one removed; the eager step runs them as the model does. A TypeError for a pair that is
    not (name, module)."""
    if isinstance(named_modules, (str, bytes)) or not isinstance(named_modules, Iterable):
        raise TypeError(f"named_modules must be (name, module) pairs, as model.named_modules() gives, got "
                        f"{type(named_modules).__name__}")
    named_modules = list(named_modules)
    for i, pair in enumerate(named_modules):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], nn.Module)):
            raise TypeError(f"named_modules[{i}] must be a (name, module) pair, got {type(pair).__name__}")
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:  # private, but the only record of them
        return "every module (a global forward hook)"
    for name, m in named_modules:
        if m._forward_hooks or m._forward_pre_hooks:
            return name or "the model itself"
    return None


def own_code(fn: Callable) -> Callable:
    """`fn` (a function, or a method bound to its object) through a copy of its function with a code object of its
    own, for `torch.compile`.

    subtle: dynamo keeps compiled graphs, and its limit of 8 recompilations, per code object, and never frees them:
    every decoder compiling the class's one `_step` (every sweep case its one `forward`) adds a graph to the same
    entry, and with fullgraph=True the 9th of a process failed ("FailOnRecompileLimitHit"). A copy per decoder keeps
    each one's graphs apart, and they go when the copy goes. A TypeError for anything but a Python function or a
    method."""
    if not isinstance(fn, (types.FunctionType, types.MethodType)) or not isinstance(
            getattr(fn, "__func__", fn), types.FunctionType):
        raise TypeError(f"fn must be a Python function or method, got {type(fn).__name__}")
    bound = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                              func.__closure__)
    return types.MethodType(copy, bound) if bound is not None else copy


def counting_backend(name: str, on_graph: Callable[[], None]) -> Callable[..., Any]:
    """dynamo's backend `name` for `torch.compile(backend=...)`, calling `on_graph()` each time it builds a graph.
    Both are checked here (a TypeError / ValueError naming them), not at the first compiled call."""
    from torch._dynamo import lookup_backend

    name = check_backend(name, "name")
    if not callable(on_graph):
        raise TypeError(f"on_graph must be a function of no arguments, got {type(on_graph).__name__} {on_graph!r}")
    inner = lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        on_graph()
        return inner(gm, example_inputs)
    return backend


def uncompilable_layer(model: nn.Module) -> str | None:
    """The first layer of `model` that `torch.compile(fullgraph=True)` cannot trace, as "name = what", or None.

    Each reads a tensor's values into Python in its forward, a data-dependent branch dynamo refuses (a UserError
    at the first compiled step): chapter 09's QAT-prepared FakeQuantLinear (its check for finite weights), the
    quantized embedding and head QuantEmbedding (its token-id range check), and a W8A8 QuantLinear with
    use_int_mm (the probe of torch._int_mm) or an outlier_threshold (the outlier columns it picks)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch module, got {type(model).__name__}")
    for name, m in model.named_modules():
        if isinstance(m, (FakeQuantLinear, QuantEmbedding)):
            return f"{name} = {type(m).__name__}"
        if isinstance(m, QuantLinear) and m.config.mode == "w8a8" and (m.config.use_int_mm
                                                                        or m.config.outlier_threshold is not None):
            return (f"{name} = QuantLinear(mode='w8a8', use_int_mm={m.config.use_int_mm}, "
                    f"outlier_threshold={m.config.outlier_threshold})")
    return None


class StaticDecoder:
    """A decode step over its own static-shape cache of `batch_size` rows; at batch 1, pass it to chapter 04's
    `generate` as `decode_fn` with `kv_cache=self.cache` (or call `generate_ids`).

    `max_len` sizes the cache (default and most: the model's context window, `decoder_max_len`). Each step appends:
    its positions must be the cache's length (minus a row's left padding), as in `generate`.

    The model's mode is left as the caller set it: `generate_ids` decodes in eval mode and switches every module back
    afterwards; a step called directly (`generate(..., decode_fn=decoder)`) refuses a model in training mode. Modes
    "compile" and "cuda-graph" build the step once, so they refuse a model with forward hooks (or pre-hooks) on its
    submodules, at construction and at any later step: the built step would never run a hook added afterwards (nor
    stop running one removed), while the eager prefill would. Mode "eager" runs the hooks, as the model does."""

    def __init__(self, model: GPT, mode: str = "compile", backend: str = "inductor", max_len: int | None = None,
                 batch_size: int = 1):
        if not isinstance(model, GPT):
            raise TypeError(f"StaticDecoder needs a minillm GPT, got {type(model).__name__}")
        mode = check_choice("mode", mode, MODES)
        if mode == "cuda-graph" and model.device.type != "cuda":
            raise ValueError(f"mode 'cuda-graph' needs the model on a CUDA device, got {model.device}")
        backend = check_backend(backend)  # in every mode: a wrong name is refused, not kept unused until mode changes
        if mode == "compile":
            layer = uncompilable_layer(model)
            if layer is not None:
                raise ValueError(f"mode 'compile' cannot trace this model's {layer}: its forward reads tensor values "
                                 "into Python, which torch.compile(fullgraph=True) refuses; use mode 'eager'")
        self.model = model
        self.mode, self.backend = mode, backend
        self._submodules = list(model.named_modules())[1:]  # the model's own hooks never run: generate calls hidden()
        self._check_hooks()
        self.max_len = decoder_max_len(model.config, max_len)
        batch_size = check_int("batch_size", batch_size)
        cfg = model.config  # each layer's K and V: refused here, not by the allocator (batch_size=10**9 is 4 TB)
        check_tensor_elements("batch_size x max_len", (batch_size, cfg.n_head, self.max_len, cfg.head_size))
        device = model.device
        self.cache = ContiguousKVCache(cfg, batch_size, self.max_len, device=device, use_static_shapes=True)
        self.batch_size = batch_size
        self._token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # the step's fixed input buffers
        self._position = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.compiles = 0
        self.calls = 0
        self.first_call_seconds: float | None = None
        self._graph: Any = None
        self._graph_out: torch.Tensor | None = None
        if mode == "compile":
            self._run = torch.compile(own_code(self._step), fullgraph=True, dynamic=False,
                                      backend=self._counting_backend())
        else:
            self._run = self._step

    def _check_hooks(self) -> None:
        """Modes "compile" and "cuda-graph": a ValueError naming the first submodule with a forward hook (see the
        class doc); cheap enough for every step (a look at each submodule's two hook dicts)."""
        hooked = hooked_module(self._submodules) if self.mode != "eager" else None
        if hooked is not None:
            raise ValueError(f"mode {self.mode!r} builds the step once and cannot follow forward hooks, but the "
                             f"model's {hooked} has one: remove it, or use mode 'eager', which runs hooks")

    def _step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """(B, 1) tokens and positions -> logits (B, V), over the static cache."""
        h = self.model.hidden(token, position, self.cache)  # (B, 1, C)
        return self.model.logits(h[:, -1])  # (B, V)

    def _counting_backend(self):
        def count() -> None:
            self.compiles += 1  # a second graph for the same step is a recompilation: something it guards on changed
        return counting_backend(self.backend, count)

    def _capture(self) -> None:
        """Record one step as a CUDA graph. Warm-up steps run first on a side stream (as PyTorch requires); they
        write to the cache past its current length, which the rollback below forgets (no query reads those slots)."""
        length = self.cache.length
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                self._step(self._token, self._position)
        torch.cuda.current_stream().wait_stream(side)
        self.cache.truncate(length)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph), torch.inference_mode():
            self._graph_out = self._step(self._token, self._position)  # recorded, not run: replay runs it
        self.cache.truncate(length)
        self.compiles += 1

    @torch.inference_mode()
    def __call__(self, model: GPT, cache: ContiguousKVCache, token: torch.Tensor, positions: torch.Tensor
                 ) -> torch.Tensor:
        """The `decode_fn` of chapter 04's `generate`: logits (B, V) for one token per row (B,) at positions (B,)
        (B = batch_size; 1 in `generate`)."""
        if model is not self.model or cache is not self.cache:
            raise ValueError("a StaticDecoder runs its own model over its own cache: pass kv_cache=decoder.cache")
        check_eval_mode(model, "a StaticDecoder step")  # generate_ids switches for its generation, and back
        self._check_hooks()
        for name, ids in (("token", token), ("positions", positions)):
            if isinstance(ids, torch.Tensor) and ids.numel() != self.batch_size:
                size = short_repr(self.batch_size)
                raise ValueError(f"a StaticDecoder of batch_size {size} takes {size} token(s) and position(s) a "
                                 f"step, got {name} of shape {tuple(ids.shape)}")
        token = integer_ids("token", token, self.batch_size)
        positions = integer_ids("positions", positions, self.batch_size)
        self._check_range(token, positions)
        self._token.copy_(token.view(-1, 1))
        self._position.copy_(positions.view(-1, 1))
        t0 = time.perf_counter() if self.calls == 0 else 0.0
        if self.mode == "cuda-graph":
            if self._graph is None:
                self._capture()
            self._graph.replay()
            out = self._graph_out.clone()  # the graph's output buffer is overwritten by the next replay
        else:
            out = self._run(self._token, self._position)
        if self.calls == 0:
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            self.first_call_seconds = time.perf_counter() - t0
        self.calls += 1
        return out

    def _check_range(self, token: torch.Tensor, positions: torch.Tensor) -> None:
        """Token ids in the vocabulary, positions below max_len and the context window, a free slot, and each row's
        position its cache length (minus that row's left padding): checked here, because past them the step indexes
        outside the embeddings or the cache (an IndexError inside the compiled graph, or a CUDA assert), or computes
        logits for a sequence that does not exist (position 5 on an empty cache, position 0 twice). subtle: one host
        sync (four small tensors, read together)."""
        B = self.batch_size
        ids = torch.cat([token.reshape(-1).cpu(), positions.reshape(-1).cpu(), self.cache.pad_lens.cpu(),
                         self.cache.slot.reshape(1).cpu()])
        tokens, pos, pads, slot = ids[:B], ids[B:2 * B], ids[2 * B:3 * B], int(ids[-1])
        vocab, window = self.model.config.vocab_size, self.model.config.block_size
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, vocab_size={vocab}), got {tokens.tolist()}")
        if int(pos.min()) < 0 or int(pos.max()) >= min(self.max_len, window):
            raise ValueError(f"positions must be in [0, max_len={self.max_len}) and inside the context window "
                             f"(block_size={window}), got {pos.tolist()}")
        if slot >= self.max_len:
            raise ValueError(f"cache full: {slot} slots used of max_len={self.max_len}; nothing more can be decoded")
        # The step writes at slot `slot` and attends over slots 0..slot: the token there sits at position
        # slot - padding, as the fused C++ step checks too (its "position ... is not the cache length").
        expected = slot - pads  # (B,)
        if not torch.equal(pos, expected):
            raise ValueError(f"positions {pos.tolist()} are not the cache length {slot} (each row's next position: "
                             f"{expected.tolist()}): a step appends at the cache's end; truncate the cache first to "
                             "decode from an earlier position")

    def generate_ids(self, prompt_ids: Any, params: SamplingParams, **kwargs: Any) -> list[int]:
        """Chapter 04's `generate_ids` with this step: the prompt prefilled eager, every later token through it; in
        eval mode, the model's modes given back afterwards."""
        if self.batch_size != 1:
            raise ValueError(f"generate_ids streams one sequence; this StaticDecoder has batch_size "
                             f"{short_repr(self.batch_size)}")
        check_decoder_room(self.max_len, self.model.config, prompt_ids, params, kwargs.get("truncate", False))
        self._check_hooks()  # before the prefill, which would run the hook
        with eval_mode(self.model):
            return generate_ids(self.model, prompt_ids, params, kv_cache=self.cache, decode_fn=self, **kwargs)
