"""The whole batch-1 decode step on the CPU in one C++ call: chapter 13's answer to llama.cpp.

What it adds: `FusedCPUDecoder(model)`, a `decode_fn` for chapter 04's `generate` (like `StaticDecoder`) whose every
token is one call into `csrc/decode_cpu.cpp`: embeddings, each block's layernorms, GEMVs (the C++ GEMV of
`cpu_gemv`), attention over the cache and GELU, the final layernorm and the tied head, with no PyTorch operator in
between. A prompt of up to MAX_VERIFY tokens is prefilled by the C++ step too (`verify`: one call, each weight
matrix walked once for all its rows); a longer one by the model itself (PyTorch's GEMM is the right tool for hundreds
of rows). Either way into the decoder's own `ContiguousKVCache`, whose K/V tensors the C++ step reads and appends to
in place.

Why: after the C++ GEMV, a step of `base` still spends more time in the ~150 operator calls between its products
(dispatch, allocation, Python) than in the products themselves. A step that is one call leaves the weights' streaming
as nearly all of it, which is how llama.cpp runs (chapter 13 measures both side by side).

Chapter 09's int8 and int4 models run too: a block linear that is a weight-only int8 `QuantLinear` (symmetric, one
scale per output channel: what `quantize_model(model, QuantConfig("int8"))` makes of every block linear) runs the C++
int8 GEMV, y = scale * (q x) + b over its int8 codes, reading one byte per weight instead of four; an int4 one
(`QuantConfig("int4")`: symmetric, one scale per row and group of columns, codes packed two per byte) runs the int4
GEMV, y = sum over groups of scale * (q x) + b, reading half a byte per weight, the codes unpacked in registers. The
embeddings and the tied head stay float32, as `quantize_model` leaves them by default. Its logits are the quantized
model's own to float rounding (the products are in float32, as QuantLinear's), its greedy tokens the eager quantized
model's (tested).

What it leaves out: batches (chapter 06's engine runs its own fused step, `fused_engine`), several threads, and any other kind of
layer: chapter 09's asymmetric and W8A8 QuantLinear, a quantized embedding and head, QAT-prepared layers, and float
weights other than float32 get a TypeError naming the layer. The C++ step holds the model's own parameter (and code
and scale) storage, not a copy: change them in place and it sees them. Anything else
(`model.half()`, a new Parameter or buffer, `param.data = ...`, a layer swapped for another, a LayerNorm's `eps`
changed) leaves the step with a snapshot the model no longer holds, while the prefill runs the model as it is now: the
decoder notices and raises a ValueError; build a new FusedCPUDecoder then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module

from minillm.compile.cpu_gemv import as_cpp_reads, cpp_errors_as_value_errors, load_cpu_ext
from minillm.compile.decode import (check_decoder_room, check_eval_mode, decoder_max_len, eval_mode, hooked_module,
                                    integer_ids)
from minillm.compile.mirror import check_plain_model
from minillm.core.config import check_has_data, short_repr, tensor_kind
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams
from minillm.core.stopping import check_token_ids
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate_ids, prefill
from minillm.quant.linear import QuantLinear

_MISSING = object()  # what `WatchedModel` reads for an attribute that was deleted
# What `WatchedModel` watches besides the model's tensors: the dicts a module keeps its parts and forward hooks in,
# torch's global forward-hook registries, and the methods a module's class runs when the model computes.
MODULE_DICTS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
                "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
                "_compiled_call_impl")  # the last: what `module.compile()` makes `module(x)` run instead
GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")
METHODS = ("forward", "hidden", "logits", "__call__", "_call_impl", "__getattr__", "__getattribute__")
_TRAINING = operator.attrgetter("training")
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python (its dict is watched; builtins' are not)
_UNWATCHED_CLASS_KEYS = frozenset({"__init__", "__new__", "__setstate__", "__getstate__", "__doc__",
                                   "__annotations__", "__dict__", "__weakref__", "__module__", "__qualname__",
                                   "__init_subclass__", "__subclasshook__", "__repr__", "__dir__"})
_MRO = operator.attrgetter("__mro__")
_CODE = operator.attrgetter("__code__")


def _public(key: object) -> bool:
    """Whether an instance-dict key is a public attribute (a str not starting with "_", not the train/eval flag)."""
    return isinstance(key, str) and not key.startswith("_") and key != "training"


def _watched_key(module: nn.Module, key: object) -> bool:
    """Whether a key added to `module`'s instance dict can change what it computes: a public attribute, or any name
    its class defines (`_call_impl` set on one module shadows the class's); other private names are caches."""
    return _public(key) or (isinstance(key, str) and hasattr(type(module), key))


def _positive(value: object) -> bool:
    """Whether a module's `dropout` attribute may drop anything: not None and not exactly 0 (a numpy number, a bool,
    a 0-d tensor count too; a value float() refuses is counted as dropout, to be safe)."""
    if value is None:
        return False
    try:
        return float(value) != 0
    except Exception:
        return True


def _watched_class_key(key: object) -> bool:
    """Whether a class attribute can change what a module computes. Not: what only builds or describes an object
    (`__init__`, `__new__`, `__setstate__`, `__doc__`, `__annotations__`, which Python stores at its first read), nor
    torch's own bookkeeping (names starting with "___": torch.compile patches `nn.Module.__init__` and sets a flag
    the first time it runs in a process)."""
    return isinstance(key, str) and key not in _UNWATCHED_CLASS_KEYS and not key.startswith("___")


def _short(value: object) -> str:
    """repr(value) cut to 40 characters for a message; a value whose repr fails (a raising __repr__, an int past
    Python's digit limit) is named by its type."""
    try:
        return repr(value)[:40]
    except Exception:
        return f"<a {type(value).__name__}>"


def _equal(a: object, b: object) -> bool:
    """a == b as one bool, False where the comparison itself fails (a dataclass holding a tensor compares it
    element-wise, and bool() of that raises): such a value is then a change, which names it."""
    try:
        return bool(a == b)
    except Exception:
        return False


def _plain_value(v: object, depth: int = 0) -> bool:
    """Whether `v` compares by value with `==` to a bool (numbers, strings, tuples of them, dtypes, configs), so a
    module attribute holding it may be compared that way; any other attribute (and a tuple nested past 4 levels)
    is compared by identity."""
    return isinstance(v, (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)) or (
        isinstance(v, tuple) and depth < 4 and all(_plain_value(x, depth + 1) for x in v)) or \
        dataclasses.is_dataclass(v)

LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # a block's linears, the C++ step's order
QUANT_FORM = ("chapter 09's weight-only int8 QuantLinear (symmetric, one float32 scale per output channel, int8 codes, "
             "a float32 bias) and its int4 one (symmetric, group-wise, codes packed two per byte)")
_NO_SCALE = torch.empty(0)  # what the C++ step takes for "this linear is float32"
MAX_VERIFY = 16  # most tokens one `verify` call takes (the C++ step's kMaxRows: its scratch holds this many rows)


def _plain(module: nn.Module, name: str) -> list[torch.Tensor]:
    """[weight, bias] of a float32 CPU linear or layernorm (`check_plain_model` has checked the layer's type);
    TypeError naming `name` for other dtypes, devices or a missing bias."""
    tensors = [module.weight, module.bias]
    for t in tensors:
        if t is None or t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"the fused C++ step needs float32 CPU weights with biases; {name} has "
                            f"{None if t is None else (t.dtype, t.device.type)}")
    return [as_cpp_reads(t.detach()) for t in tensors]


def _quantized(layer: QuantLinear, name: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([codes, bias], scale) of a weight-only QuantLinear the C++ step runs, the model's own storage (a view, not a
    copy, where contiguous and not a negative view, `as_cpp_reads`): int8 (symmetric, per channel) gives codes
    (out, in) int8 and scale (out,); int4 (symmetric, group-wise) gives packed codes (out, in/2) uint8 and scale
    (out, groups). TypeError naming `name` and what differs for any other QuantLinear (asymmetric, W8A8, a cast or
    replaced buffer, no bias, not on the CPU)."""
    c, q, scale, bias = layer.config, layer.qweight, layer.scale, layer.bias
    out, n = layer.out_features, layer.in_features
    int4 = c.mode == "int4"
    codes = (torch.uint8, (out, n // 2)) if int4 else (torch.int8, (out, n))
    groups = n // c.group_size if int4 else 1
    if c.mode not in ("int8", "int4") or not c.symmetric or layer.zero is not None:
        problem = f"mode={c.mode!r}, symmetric={c.symmetric}"
    elif int4 and c.group_size % 2:  # two codes a byte: an odd group would share a byte with the next group
        problem = f"an odd group_size={c.group_size} (the step unpacks whole bytes, two codes each, per group)"
    elif q.dtype != codes[0] or tuple(q.shape) != codes[1]:
        problem = f"codes {q.dtype} {tuple(q.shape)}, want {codes[0]} {codes[1]}"
    elif scale.dtype != torch.float32 or tuple(scale.shape) != (out, groups):
        problem = f"scale {scale.dtype} {tuple(scale.shape)}, want torch.float32 ({out}, {groups})"
    elif bias is None or bias.dtype != torch.float32 or tuple(bias.shape) != (out,):
        problem = "no bias" if bias is None else f"bias {bias.dtype} {tuple(bias.shape)}"
    elif any(t.device.type != "cpu" for t in (q, scale, bias)):
        problem = f"buffers on {q.device}, {scale.device}, {bias.device}"
    else:
        _checked_buffers(layer, name)  # the form is the step's; now the values, as the layer's forward checks them
        scale = as_cpp_reads(scale.detach())
        return [as_cpp_reads(q.detach()), as_cpp_reads(bias.detach())], scale if int4 else scale.view(-1)
    raise TypeError(f"the fused C++ step runs float32 nn.Linear layers and {QUANT_FORM}; {name} = QuantLinear "
                    f"with {problem}: run the float model, or one quantized with QuantConfig('int8') or "
                    "QuantConfig('int4')")


def _checked_buffers(layer: QuantLinear, name: str) -> None:
    """The QuantLinear's own check of its buffers (`check_buffers`: shapes, then finite scales > 0 and a finite bias;
    a microsecond when nothing changed since the last check), its error naming the layer `name`. The C++ step reads
    the buffers without the layer's forward, which is where the eager model runs this check: without it a NaN, zero
    or negative scale would decode garbage without a word."""
    try:
        layer.check_buffers()
    except (TypeError, ValueError) as e:
        raise type(e)(f"the model's {name}: {e}") from e


def _check_caches(cfg, k: object, v: object) -> list[tuple[int, int, str]]:
    """k and v: lists of one contiguous float32 CPU tensor (1, nh, max_len, hs) per block, all of one max_len >= 1,
    or both empty, none sharing memory with another; a TypeError / ValueError naming them (the C++ step's own check
    is a RuntimeError). Returns their memory spans (start, end, name)."""
    for name, caches in (("k", k), ("v", v)):
        if not isinstance(caches, list):
            raise TypeError(f"{name} must be a list of one cache tensor per block (or []), got "
                            f"{type(caches).__name__} {short_repr(caches)}")
    if len(k) != len(v) or len(k) not in (0, cfg.n_layer):  # type: ignore[arg-type]
        raise ValueError(f"k and v must hold one cache tensor per block ({cfg.n_layer}) each, or none (an engine's "
                         f"decoder), got {len(k)} and {len(v)}")  # type: ignore[arg-type]
    max_len = None
    for name, caches in (("k", k), ("v", v)):
        for i, t in enumerate(caches):  # type: ignore[arg-type]
            where = f"{name}[{i}]"
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu":
                raise TypeError(f"{where} must be a float32 CPU tensor, got {tensor_kind(t)}")
            check_has_data(where, t)
            max_len = t.shape[2] if max_len is None and t.dim() == 4 else max_len
            shape = (1, cfg.n_head, max_len, cfg.head_size)
            if tuple(t.shape) != shape or not max_len:
                raise ValueError(f"{where} must have shape (1, nh={cfg.n_head}, max_len, hs={cfg.head_size}) with "
                                 f"max_len >= 1, every cache the same, got {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{where} must be contiguous (the C++ step reads its memory), got strides "
                                 f"{t.stride()}")
    named = [(f"{name}[{i}]", t) for name, caches in (("k", k), ("v", v)) for i, t in enumerate(caches)]  # type: ignore
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), where) for where, t in named)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):  # sorted by start: overlaps are neighbours
        if start < end:
            raise ValueError(f"{a} and {b} share memory: each block's K and V must be a cache of its own (the step "
                             "would write one layer's keys over another's)")
    return spans


def _check_caches_apart(model: GPT, spans: list[tuple[int, int, str]]) -> None:
    """No cache shares memory with the model's own tensors: the step writes the caches, and would write the model."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        for start, end, where in spans:
            if start < hi and lo < end:
                raise ValueError(f"{where} shares memory with the model's {name}: the step writes its caches, and "
                                 "would change the model's weights for good")


def build_cpp_decoder(model: GPT, k: list[torch.Tensor], v: list[torch.Tensor]) -> tuple[Any, int, int]:
    """The C++ `FusedDecoder` over `model`'s own tensors (their storage, `as_cpp_reads`), with the contiguous caches
    `k`, `v` (one (1, nh, max_len, hs) tensor per block) or none (empty lists: the engine's decoder, `paged` only);
    and how many block linears run int8 and int4. Every layer is checked first: a TypeError names any the C++ step
    cannot run (`check_plain_model`, `_plain`, `_quantized`)."""
    require_model(model, "the fused C++ step")
    quantized = {f"transformer.h.{i}.{n}" for i, block in enumerate(model.transformer.h) for n in LINEARS
                 if isinstance(block.get_submodule(n), QuantLinear)}  # checked by `_quantized` below
    check_plain_model(model, "the fused C++ step", handled=quantized)
    _check_caches_apart(model, _check_caches(model.config, k, v))
    tr = model.transformer
    for name in ("wte", "wpe"):  # an embedding that renormalizes the rows it looks up is another function
        if getattr(tr, name).max_norm is not None:
            raise TypeError(f"the fused C++ step reads embedding rows as stored, but transformer.{name} has max_norm="
                            f"{getattr(tr, name).max_norm!r} (its forward renormalizes them): set it to None, or "
                            "decode with chapter 04's generate_ids")
    if model.lm_head.weight.dtype != torch.float32 or tr.wpe.weight.dtype != torch.float32:
        raise TypeError(f"the fused C++ step needs float32 embeddings, got {model.lm_head.weight.dtype}")
    glob = [tr.wte.weight.detach(), tr.wpe.weight.detach(), *_plain(tr.ln_f, "transformer.ln_f"),
            model.lm_head.weight.detach()]  # as_cpp_reads below: the C++ step reads raw memory
    layers: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []  # one per block linear, in LINEARS' order: _NO_SCALE for a float32 one
    int4 = 0  # how many of the quantized linears are int4
    for i, block in enumerate(tr.h):
        for name in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            module, where = block.get_submodule(name), f"transformer.h.{i}.{name}"
            if where in quantized:
                codes_and_bias, scale = _quantized(module, where)
                layers += codes_and_bias
                scales.append(scale)
                int4 += module.config.mode == "int4"
            else:
                layers += _plain(module, where)
                if name in LINEARS:
                    scales.append(_NO_SCALE)
    eps = [float(block.get_submodule(n).eps) for block in tr.h for n in ("ln_1", "ln_2")] + [float(tr.ln_f.eps)]
    cfg = model.config
    cpp = load_cpu_ext().FusedDecoder([as_cpp_reads(t) for t in glob], layers, k, v, cfg.n_head, cfg.head_size, eps,
                                      scales)
    return cpp, len(quantized) - int4, int4


class WatchedModel:
    """What a C++ step over a model's own tensors must notice, since it reads them through raw pointers and calls no
    module: the model's tensors converted, replaced or re-viewed since it was built, and anything else that changes
    what the model computes (a layer swapped, added or given another class or `forward`, an eps, an attribute such
    as `n_head`, the config, a forward hook). It cannot tell which attributes a forward reads, so any public one
    set or added counts, a tag (`model.note = "run 3"`) too; a private name (`model._note`) that the class does not
    define is left out, as torch's own caches are. In-place updates of the values are not a change: the step reads
    the same memory (and compares the values of the few tensors it had to copy). Call `_watch_model()` once
    `self.model` is set, before building the step; then `model_maybe_changed()` (cheap, every step) and
    `check_model_unchanged()` (names what changed)."""

    model: GPT

    def __delattr__(self, name: str) -> None:
        if name == "model":  # the step holds the model's tensors: there is no decoder without it
            raise AttributeError(f"a {type(self).__name__}'s model cannot be deleted (its C++ step reads the model's "
                                 f"tensors): drop the {type(self).__name__} instead")
        super().__delattr__(name)

    def _watch_model(self) -> None:
        self._named_modules = list(self.model.named_modules())
        self._check_no_hooks()
        self._model_modules = [m for _, m in self._named_modules]
        self._quantized = [(name, m) for name, m in self._named_modules if isinstance(m, QuantLinear)]
        self._model_id, self._config = id(self.model), self.model.config.to_dict()  # `model` is a plain attribute
        self._config_copy = dataclasses.replace(self.model.config)
        self._record_objects()
        # every tensor's view of memory and, where the step reads a copy, its values: in C++ (`TensorWatch`).
        named = [(f"{name}.{key}" if name else key, t) for name, m in self._named_modules
                 for d in (m._parameters, m._buffers) for key, t in d.items() if t is not None]
        self._tensor_names = [n for n, _ in named]
        self._watch = load_cpu_ext().TensorWatch([t for _, t in named], [as_cpp_reads(t.detach()) for _, t in named])

    def _record_objects(self) -> None:
        """Note what the model's modules hold now, for `_what_changed` (in Python, saying what moved) and for the
        C++ `ObjectWatch` that `model_maybe_changed` asks at every step (identities and sizes, in C): every
        parameter, buffer and child module in the dict its module keeps it in, and each dict's size (a block
        appended to `transformer.h` is a new key); each module's class, its public attributes (eps, n_head,
        in_features, a QuantLinear's config) and its instance dict's size (a `forward` assigned to one module is a
        new key there); its forward-hook dicts and torch's global ones, empty."""
        named_dicts = [(name, d) for name, m in self._named_modules for d in (m._parameters, m._buffers, m._modules)]
        self._dicts = [d for _, d in named_dicts]
        slots = [(d, key, obj, f"{name}.{key}" if name else key) for name, d in named_dicts for key, obj in d.items()]
        self._slot_dicts, self._slot_keys, self._slot_objs, self._slot_names = ([s[i] for s in slots]
                                                                                for i in range(4))
        modules = self._model_modules
        self._types = [type(m) for m in modules]
        attrs = [(vars(m), k, v, f"{name}.{k}" if name else k) for name, m in self._named_modules
                 for k, v in vars(m).items() if _public(k)]
        self._attrs = attrs
        self._instance_names = {(id(m), k) for m in modules for k in vars(m)}
        # the dicts themselves, held by their module (`lin._parameters = {...}` replaces one whole) and by torch's
        # module (its global hook registries), and the methods each class runs (`nn.Linear.forward = ...`)
        self._containers = [(vars(m), key, vars(m)[key], f"{name or 'the model'}.{key}")
                            for name, m in self._named_modules for key in MODULE_DICTS if key in vars(m)] + [
            (vars(nn_module), key, vars(nn_module)[key], f"torch.nn.modules.module.{key}") for key in GLOBAL_HOOKS]
        classes = list(dict.fromkeys(self._types))
        self._methods = [(cls, name, getattr(cls, name)) for cls in classes for name in METHODS if hasattr(cls, name)]
        self._method_classes, self._method_names, self._method_objs = ([m[i] for m in self._methods] for i in range(3))
        hook_dicts = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)] + [
            vars(nn_module)[key] for key in GLOBAL_HOOKS]
        sized = [(d, len(d)) for d in self._dicts + [vars(m) for m in modules] + hook_dicts]
        held = [(d, k, o) for d, k, o, _ in slots] + [a[:3] for a in attrs] + [c[:3] for c in self._containers]
        self._instance_dicts = [vars(m) for m in modules]  # `module.__dict__ = {...}` replaces one whole
        self._child_orders = [(m._modules, list(m._modules)) for m in modules]  # a ModuleList runs in this order
        tensors = [o for _, _, o, _ in slots if isinstance(o, torch.Tensor)]
        owned = list(zip(modules, self._types, self._instance_dicts)) + [(t, type(t), vars(t)) for t in tensors]
        self._tensor_types = [(t, type(t)) for t in tensors]  # a Parameter's class swapped for a subclass
        # every Python class along each module's MRO (and a tensor subclass's own), attribute by attribute (a
        # property set on `MLP`), and each class's MRO (`MLP.__bases__ = (Shim,)`); torch's own classes are left
        # out, as its functions are (torch writes into nn.Module's dict itself: torch.compile's first use patches it)
        mro = dict.fromkeys(c for c in [c for cls in classes for c in cls.__mro__] +
                            [c for t in tensors for c in type(t).__mro__]
                            if c.__flags__ & _HEAP_TYPE and not c.__module__.startswith("torch"))
        for c in mro:
            getattr(c, "__annotations__", None)  # Python stores an empty one at the first read: read it before
        self._class_dicts = [(c, {k: v for k, v in vars(c).items() if _watched_class_key(k)}) for c in mro]
        self._mro_classes = list(mro)
        self._mro_values = [c.__mro__ for c in mro]
        functions = [v for _, d in self._class_dicts for v in d.values() if hasattr(v, "__code__")]
        self._functions, self._codes = functions, [f.__code__ for f in functions]  # `MLP.forward.__code__ = ...`
        class_held = [(c, k, v) for c, d in self._class_dicts for k, v in d.items()]
        self._objects = load_cpu_ext().ObjectWatch(held, sized, self._child_orders, owned, class_held,
                                                   [(c, len(vars(c))) for c in mro])  # an added key fires it too
        # dropout runs in training mode: the config's, an nn.Dropout's, or a module's own `dropout` (a class's too)
        self._has_dropout = self.model.config.dropout > 0 or any(
            (isinstance(m, nn.Dropout) and _positive(m.p)) or _positive(getattr(m, "dropout", None))
            for m in modules)

    def _what_changed(self) -> str | None:
        """What changed in the model since it was recorded, in words, or None (see the class doc); in Python, so
        only when `model_maybe_changed` said something may have, or in `check_model_unchanged`."""
        model = getattr(self, "model", None)  # `del decoder.model` is a replacement by nothing
        if id(model) != self._model_id:
            return "replaced"
        if model.config != self._config_copy:
            return "config"
        for (name, m), was in zip(self._named_modules, self._instance_dicts):
            if vars(m) is not was:
                return f"{name or 'the model'}.__dict__ was replaced whole"
        for cls, mro in zip(self._mro_classes, self._mro_values):
            if cls.__mro__ is not mro:
                return f"the class {cls.__module__}.{cls.__qualname__} has other bases now"
        for f, code in zip(self._functions, self._codes):
            if f.__code__ is not code:
                return f"the code of {f.__module__}.{f.__qualname__} was replaced"
        for cls, was in self._class_dicts:
            now = {k: v for k, v in vars(cls).items() if _watched_class_key(k)}
            key = next((k for k in set(now) | set(was) if now.get(k, _MISSING) is not was.get(k, _MISSING)), None)
            if key is not None:
                return f"the class {cls.__module__}.{cls.__qualname__} was changed: its {short_repr(key)}"
        for t, was in self._tensor_types:
            if type(t) is not was:
                return f"a tensor's class was changed from {was.__name__} to {type(t).__name__}"
        for (name, _), (children, order) in zip(self._named_modules, self._child_orders):
            if list(children) != order:
                return f"{name or 'the model'}'s children were reordered or renamed: {list(children)[:8]}"
        for instance, key, was, path in self._containers:
            if instance.get(key) is not was:
                return f"{path} is another dict (replaced whole)"
        for cls, name, was in self._methods:
            if getattr(cls, name, None) is not was:
                return f"{cls.__name__}.{name} was replaced (on the class)"
        held_now = list(map(dict.get, self._slot_dicts, self._slot_keys))  # what each dict holds under each key now
        if any(map(operator.is_not, held_now, self._slot_objs)):
            i = next(i for i, (a, b) in enumerate(zip(held_now, self._slot_objs)) if a is not b)
            return f"{self._slot_names[i]} is another object (a layer or tensor replaced or removed)"
        if sum(map(len, self._dicts)) != len(self._slot_keys):
            return "a layer, parameter or buffer was added"
        types = list(map(type, self._model_modules))
        if types != self._types:
            i = next(i for i, (a, b) in enumerate(zip(types, self._types)) if a is not b)
            return (f"{self._named_modules[i][0] or 'the model'} is now a {types[i].__name__}, not a "
                    f"{self._types[i].__name__}")
        for instance, key, was, path in self._attrs:
            now = instance.get(key, _MISSING)
            if now is not was and not (_plain_value(was) and _plain_value(now) and _equal(now, was)):
                return f"{path} changed from {_short(was)} to {'nothing' if now is _MISSING else _short(now)}"
        added = [(name, k) for name, m in self._named_modules for k in vars(m)
                 if (id(m), k) not in self._instance_names and _watched_key(m, k)]
        if added:  # a method assigned to one module, or a new attribute its code may read
            return f"{added[0][0] or 'the model'} was given {added[0][1]!r} of its own"
        i = self._watch.changed()
        if i >= 0:
            return (f"{self._tensor_names[i]} (and maybe others after it) was converted, re-viewed or replaced, its "
                    "storage moved (model.share_memory() and a `.data` assignment move it, even with the same "
                    "values), or a copy of it changed")
        return None

    def model_maybe_changed(self) -> bool:
        """Whether the model may have changed since the step was built, looked at cheaply (a few µs for `base`: the
        comparisons run in C++, `ObjectWatch` and `TensorWatch`), so it can run at every step. In-place updates
        pass (the C++ step sees them). True means: run `check_model_unchanged`, which says what changed."""
        model = getattr(self, "model", None)
        if id(model) != self._model_id or model.config != self._config_copy:
            return True
        if any(map(operator.is_not, map(getattr, self._method_classes, self._method_names), self._method_objs)):
            return True
        if any(map(operator.is_not, map(_MRO, self._mro_classes), self._mro_values)) or any(
                map(operator.is_not, map(_CODE, self._functions), self._codes)):
            return True
        if self._objects.changed():
            if self._what_changed() is None and hooked_module(self._named_modules) is None:
                self._record_objects()  # nothing the step runs changed (an equal value written again, a module's
                return False  # private cache): look from here on
            return True
        return self._watch.changed() >= 0

    def check_step(self) -> None:
        """What every C++ step runs first: the cheap look (`model_maybe_changed`), the full check with its message
        when that fired, every module in eval mode when the model has dropout (a block left in training mode would
        run it in the model's forward, never in the C++ step), and each quantized layer's own check of its buffers
        (about a microsecond each when none was written since: a scale written in place keeps its storage, so only
        its values show it turned NaN)."""
        if self.model_maybe_changed():
            self.check_model_unchanged()
        if self._has_dropout and any(map(_TRAINING, self._model_modules)):  # (no dropout: no effect)
            name = next(n for n, m in self._named_modules if m.training) or "the model"
            raise ValueError(f"a {type(self).__name__} step runs the model in eval mode, but its {name} is in "
                             "training mode (the model has dropout, which its forward runs in training mode and "
                             "the C++ step never does): call model.eval() first")
        for layer_name, layer in self._quantized:
            _checked_buffers(layer, layer_name)

    def check_model_unchanged(self) -> None:
        """ValueError unless the model is still what the C++ step was built on (see the class doc), and every
        quantized layer's buffers pass the layer's own check (`_checked_buffers`: a scale written in place keeps its
        storage, so the tensor watch alone would not see it turn NaN or negative)."""
        name = type(self).__name__
        what = self._what_changed()
        if what == "replaced":  # the old model is still held (`_model_modules`): ids are not reused
            raise ValueError(f"this {name}'s model was replaced after it was built; its C++ step still holds the old "
                             f"model's tensors: build a new {name}(model)")
        if what == "config":
            raise ValueError(f"the model's config was changed since this {name} was built (the C++ step has the "
                             f"shapes it had then): build a new {name}(model)")
        self._check_no_hooks()
        for layer_name, layer in self._quantized:
            _checked_buffers(layer, layer_name)
        if what is not None:
            raise ValueError(f"the model was changed since this {name} was built: {what}. Its C++ step still holds "
                             "the model as it was then (its tensors, shapes and code), and cannot tell whether a "
                             f"changed or added attribute matters to the model's forward: build a new {name}(model)")

    def _check_no_hooks(self) -> None:
        """A ValueError naming the first module with a forward hook (or saying a global one is set): the C++ step
        never calls the modules, so a hook would run where the model's own forward does (a long prefill) and
        silently not in the C++ steps (`hooked_module`)."""
        hooked = hooked_module(self._named_modules)
        if hooked is not None:
            raise ValueError(f"the fused C++ step cannot run forward hooks, but the model's {hooked} has one: remove "
                             "it, or decode with chapter 04's generate_ids, which runs hooks")


class FusedCPUDecoder(WatchedModel):
    """Batch-1 decode of a float32 CPU GPT, one C++ call per token; pass it as `decode_fn` with `kv_cache=self.cache`.

    `max_len` sizes the cache (default and most: the model's context window). Greedy tokens equal the eager generator's
    (tested); logits agree to float rounding (the sums run in another order). Block linears that are chapter 09's
    weight-only int8 or int4 QuantLinear (`quantize_model(model, QuantConfig("int8"))`, `QuantConfig("int4")`) run
    the C++ int8 or int4 GEMV; the rest of the model stays float32 (`int8_linears` and `int4_linears` count them).
    The step reads the parameters and buffers the model held at construction (their storage: in-place updates are
    seen; a non-contiguous or negative-view one is copied, and its values are compared at every step) and each
    LayerNorm's own eps. One request at a time: one started in another thread meanwhile is a ValueError
    (`exclusive`). If the model changes afterwards in any other way (`WatchedModel`: a tensor converted, replaced or
    re-viewed, `model.half()`, a layer swapped, added or given another `forward`, an eps or attribute changed), the
    next step raises a ValueError naming what changed (also between two tokens of a streamed `generate`): build a
    new FusedCPUDecoder. Any other quantized layer (asymmetric, W8A8, a
    quantized head) or a QAT-prepared model is a TypeError naming the layer (`_quantized`, `check_plain_model`).
    A forward hook on any module is a ValueError (the C++ step calls no module, so the hook would run in the prefill
    only). `generate_ids` decodes in eval mode and gives the model its own mode back; a step called directly on a
    model in training mode is a ValueError.
    """

    def __init__(self, model: GPT, max_len: int | None = None):
        if not isinstance(model, GPT):
            raise TypeError(f"FusedCPUDecoder needs a minillm GPT, got {type(model).__name__}")
        if model.device.type != "cpu":
            raise ValueError(f"FusedCPUDecoder runs on the CPU, the model is on {model.device}")
        self.model = model  # its train/eval mode is the caller's: generate_ids decodes in eval mode, then restores it
        self._watch_model()
        self.max_len = decoder_max_len(model.config, max_len)  # at most block_size: slot j holds position j
        self.cache = ContiguousKVCache(model.config, 1, self.max_len)  # float32, dynamic: `attend` for the prefill
        self._busy = threading.Lock()  # one request at a time: the step writes one cache (`exclusive`)
        self._cpp, self.int8_linears, self.int4_linears = build_cpp_decoder(model, self.cache.k, self.cache.v)

    def __call__(self, model: GPT, cache: ContiguousKVCache, token: torch.Tensor, positions: torch.Tensor
                 ) -> torch.Tensor:
        """The `decode_fn` of chapter 04's `generate`: logits (1, V) for one token (1,) at positions (1,)."""
        if model is not getattr(self, "model", None) or cache is not self.cache:
            raise ValueError("a FusedCPUDecoder runs its own model over its own cache: pass kv_cache=decoder.cache")
        check_eval_mode(model, "a FusedCPUDecoder step")  # the C++ step has no dropout; the prefill must not either
        self.check_step()  # at every token: `generate` yields each one, and the model may change between two
        token = integer_ids("token", token, 1)  # subtle: int() of a float token would truncate it silently
        positions = integer_ids("positions", positions, 1)
        start = cache.length
        with cpp_errors_as_value_errors():  # the C++ range checks: token id, position, a full cache
            logits = self._cpp.step(int(token), int(positions), start)  # (1, V); K/V written at slot `start`
        cache.mark_written(1)
        return logits

    def verify(self, tokens: list[int]) -> torch.Tensor:
        """Logits (n, V) of n = len(tokens) token ids (1 to MAX_VERIFY) fed after what the cache holds, at positions
        length..length+n-1, in ONE C++ call: one token is `step`, several `FusedDecoder::verify` (each weight
        matrix walked once for all n rows; row i attends to the cache and rows 0..i). Their K/V are appended and the
        cache marked written; a caller that rejects rows rolls back with `cache.truncate`. Speculative decoding's
        verify and its draft's steps (`fused_speculative`). Unlike `__call__`, it never re-checks the model's
        fingerprint: call `check_model_unchanged()` once per sequence first."""
        check_eval_mode(self.model, "a FusedCPUDecoder verify")
        # plain ints in the vocabulary (numpy ints too): pybind would truncate a float, and meet an int past int64
        # with its own "incompatible function arguments"
        tokens = check_token_ids("tokens", tokens, self.model.config.vocab_size)
        if not 1 <= len(tokens) <= MAX_VERIFY:
            raise ValueError(f"tokens must hold 1 to {MAX_VERIFY} token ids, got {len(tokens)}")
        start = self.cache.length
        with cpp_errors_as_value_errors():  # the C++ range checks: token ids, positions, room in the cache
            if len(tokens) == 1:
                logits = self._cpp.step(tokens[0], start, start)  # (1, V)
            else:
                logits = self._cpp.verify(tokens, start, start)  # (n, V)
        self.cache.mark_written(len(tokens))
        return logits

    @contextlib.contextmanager
    def exclusive(self) -> Iterator["FusedCPUDecoder"]:
        """Holds this decoder for one request (`generate_ids`, and the fused speculative decoders' requests): a
        request started meanwhile in another thread is a ValueError, not two sequences written into one cache (which
        fails later, in the middle of a step, or worse, decodes a mix of the two). Non-blocking: it never waits."""
        if not self._busy.acquire(blocking=False):
            raise ValueError("this FusedCPUDecoder is already decoding a request in another thread: one call at a "
                             "time (it holds one cache); build one FusedCPUDecoder per thread")
        try:
            yield self
        finally:
            self._busy.release()

    def generate_ids(self, prompt_ids: Any, params: SamplingParams, **kwargs: Any) -> list[int]:
        """Chapter 04's `generate_ids` with this step: the prompt prefilled by `prefill`, every later token in C++;
        in eval mode, the model's own mode given back afterwards. One request at a time (`exclusive`)."""
        self.check_model_unchanged()  # before the prefill, which would run the changed model
        check_decoder_room(self.max_len, self.model.config, prompt_ids, params, kwargs.get("truncate", False))
        with self.exclusive(), eval_mode(self.model):
            return generate_ids(self.model, prompt_ids, params, kv_cache=self.cache, decode_fn=self,
                                prefill_fn=self.prefill, **kwargs)

    def prefill(self, model: GPT, cache: ContiguousKVCache, ids: torch.Tensor, positions: torch.Tensor
                ) -> torch.Tensor:
        """The `prefill_fn` of chapter 04's `generate`: logits (1, V) of the prompt ids (1, T)'s last token, its K/V
        written to the empty cache. A prompt of up to MAX_VERIFY tokens is one C++ call (`verify`: each weight
        matrix walked once for all its rows); a longer one is the model's own forward, PyTorch's GEMM being the
        right tool for hundreds of rows. Why the short path: a quantized model's forward de-quantizes every matrix
        first, which for a one-token prompt of `base` in int4 costs as much as twenty fused steps."""
        if model is not self.model or cache is not self.cache:
            raise ValueError("a FusedCPUDecoder runs its own model over its own cache: pass kv_cache=decoder.cache")
        self.check_model_unchanged()  # it starts every sequence: the C++ step would run a snapshot, the model a hook
        check_eval_mode(model, "a FusedCPUDecoder prefill")
        for name, t in (("ids", ids), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
                raise TypeError(f"{name} must be an integer tensor, got {tensor_kind(t)}")
            check_has_data(name, t)
        if cache.length != 0 or ids.dim() != 2 or ids.shape[0] != 1 or positions.dim() != 1 or \
                positions.tolist() != list(range(ids.shape[1])):
            raise ValueError(f"prefill takes one prompt ids (1, T) at positions 0..T-1 into an empty cache, got ids "
                             f"{tuple(ids.shape)} into a cache holding {cache.length} tokens")
        tokens, vocab = ids[0].tolist(), model.config.vocab_size
        if not 1 <= len(tokens) <= self.max_len:  # the long path's forward would fail in F.embedding past the window
            raise ValueError(f"ids must hold 1 to max_len={self.max_len} tokens (the decoder's window), got "
                             f"{len(tokens)}")
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"ids must be token ids in [0, vocab_size={vocab}), got {bad}")
        if len(tokens) <= MAX_VERIFY:
            return self.verify(tokens)[-1:]  # (T, V) -> the last row (1, V)
        return prefill(model, cache, torch.tensor([tokens]), torch.arange(len(tokens)))
