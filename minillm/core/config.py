"""`GPTConfig`: the shape of a GPT-2-architecture model, validated, with named presets.

A config says how big the model is and nothing about how it runs: sampling, caches and engines have configs of
their own in later chapters.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import json
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass
from collections.abc import Collection
from typing import Any, Callable

import numpy as np
import torch


def check_fits_float(name: str, value: Any) -> None:
    """A ValueError naming `name` when `value` is an int past the float range (|value| > ~1.8e308); anything else
    passes (the caller checks the type).

    subtle: Python's ints have no bound and its floats do: math.isfinite(10**400), float(10**400), 10**400 / 2 and
    0.5 ** 10**400 all raise OverflowError, which names no argument. The message gives the size, not the digits
    (str() of an int past 4300 digits is itself an error).
    """
    if isinstance(value, int) and abs(int.__index__(value)) > sys.float_info.max:  # the plain int's size
        raise ValueError(f"{name} must be within the float range (|{name}| <= {sys.float_info.max:.3g}), got an "
                         f"int of about {int(value.bit_length() * math.log10(2)) + 1} digits")


def check_label(name: str, value: Any) -> str:
    """`value` as the plain str it holds: a label that only names something in messages (a caller, a layer, a
    record's place); a TypeError naming `name` otherwise, before a message would print a tensor or an object's repr
    where a name belongs."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str (a name for messages), got {type(value).__name__}")
    return str.__str__(value)


class CheckedFields:
    """Mixin for a record checked once, when it is built (`__post_init__` ends with `self._checked = True`): after
    that, a field named in `FIXED` cannot be reassigned (dataclasses' FrozenInstanceError naming it), since a value
    set later would skip the checks and fail deep inside whatever reads it. Build a new record instead."""

    FIXED: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.FIXED and self.__dict__.get("_checked", False):
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: a {type(self).__name__} is "
                                                  "checked when it is built; build a new one")
        object.__setattr__(self, name, value)


def check_instance(name: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """`value` if it is an instance of `kind`; a TypeError naming `name` and `what` it must be otherwise (before an
    attribute of it is read: "'NoneType' object has no attribute 'config'" names neither)."""
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {short_repr(value)}")
    return value


def check_tensor_dict(name: str, tensors: Any) -> dict:
    """`tensors` if it is a dict of str name -> torch tensor (a state dict, a checkpoint's tensors); a TypeError
    naming `name` and the first entry that is not one otherwise (before `.items()` or a key's `.startswith`)."""
    if not isinstance(tensors, dict):
        raise TypeError(f"{name} must be a dict of name -> torch.Tensor, got {type(tensors).__name__} "
                        f"{short_repr(tensors)}")
    for key, value in tensors.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must map str names to tensors; entry {short_repr(key)} is "
                            f"{type(key).__name__} -> {tensor_kind(value)}")
    return tensors


def check_int_list(name: str, values: Any) -> list | tuple:
    """`values` if it is a list (or tuple) of plain ints within int64 (a float, a bool or None is no id, position or
    count: 3.7 would be read as 3 by a tensor, True as 1); a TypeError / ValueError naming the first entry that is
    not one."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of ints, got {type(values).__name__} {short_repr(values)}")
    for j, v in enumerate(values):
        if type(v) is not int:
            raise TypeError(f"{name}[{j}] must be an int, got {type(v).__name__} {short_repr(v)}")
        if not -2**63 <= v < 2**63:  # an int64 tensor holds it
            raise ValueError(f"{name}[{j}] = {v} is outside int64")
    return values


def check_bool(name: str, value: Any) -> bool:
    """`value` as a plain bool if it is a bool (a numpy bool too); a TypeError naming `name` otherwise. A flag read by
    truthiness would take 'no', an empty list or NaN for an answer without a word."""
    if isinstance(value, np.bool_):  # subtle: numpy 2 names the type "bool", not "bool_": test the type itself
        return bool(value)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {short_repr(value)}")
    return bool(value)


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """Raise TypeError unless `value` is an int (bool excluded), ValueError if it is below `minimum` or past the
    float range (`check_fits_float`). Returns the plain int it holds (an int subclass's own comparisons and
    conversions are never consulted), for the callers that go on comparing or passing it on.

    The one place the package's configs and sizes check their integer fields; the message names the field.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        if foreign_number(value):
            raise TypeError(f"{name} must be a Python int, got {type(value).__name__} {short_repr(value)}: convert it "
                            "with int()")
        raise TypeError(f"{name} must be an int, got {number_kind(value)}")
    value = int.__index__(value)  # the plain int an int subclass holds: its own comparisons are not consulted
    check_fits_float(name, value)  # sizes, counts and exponents meet floats downstream (powers, ratios, x / 2)
    if value < minimum:
        bound = {1: "positive", 0: "non-negative"}.get(minimum)
        raise ValueError(f"{name} must be {bound or f'>= {minimum}'}, got {value}")
    return value


def check_choice(name: str, value: Any, choices: Collection[str]) -> str:
    """`value` as the plain str it holds when it is one of `choices` (names: a mode, a method, a kind); a TypeError
    naming `name` for anything but a str, a ValueError listing the choices for any other str.

    subtle: `value in choices` asks the value itself: a numpy array answers with an array ("truth value ... is
    ambiguous"), and an object (or a str subclass) whose `==` always says True matches the first choice and is then
    read as it. The type comes first, then the plain str (`str.__str__`) is what is compared and returned."""
    shown = choices if isinstance(choices, (tuple, list)) else sorted(choices)  # a tuple prints as written
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {shown} (a str), got {type(value).__name__} {short_repr(value)}")
    plain = str.__str__(value)
    if plain not in choices:
        raise ValueError(f"{name} must be one of {shown}, got {short_repr(plain)}")
    return plain


def tensor_kind(x: Any) -> str:
    """What an error message calls a value given where a tensor was expected: a tensor's dtype ("torch.int64"),
    anything else's type with its module ("numpy.ndarray", "list").

    subtle: `getattr(x, "dtype", ...)` would name a numpy array by its own dtype, "float32", and the message
    "x must be a floating-point tensor, got float32" would read as if a float32 tensor had been refused.
    """
    if isinstance(x, torch.Tensor):
        return str(x.dtype)
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# Unsigned ints past uint8: no op in this package computes with them (torch cannot promote them: "Promotion for
# uint16, uint32, uint64 types is not supported"). float8 (floating point, one byte) is refused by `check_strided`
# too, and quantized dtypes (qint8, quint8, ...) by `t.is_quantized`.
UNSUPPORTED_DTYPES = frozenset({torch.uint16, torch.uint32, torch.uint64})


def check_strided(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` unchanged, or a TypeError naming `name` when it is not a plain dense tensor of a dtype torch computes in:
    a sparse one (`t.to_sparse()`, COO or CSR) or an MKL-DNN one has the dtype, device and shape every other check
    looks at, then fails inside torch ("Could not run 'aten::...' with arguments from the 'SparseCPU' backend"), or
    worse, broadcasts as something else and returns wrong numbers.

    subtle: a nested tensor (`torch.nested.nested_tensor`) reports `layout == torch.strided` and fails later with
    "NestedTensorImpl doesn't support sizes"; a quantized one (qint8) is strided too, and neither is floating point
    nor an ordinary int. Both are refused here, and so are `UNSUPPORTED_DTYPES` (uint16/32/64) and float8, a
    storage format ("isfinite" not implemented for 'Float8_e4m3fn'). Anything but a tensor is a TypeError too."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor, got {tensor_kind(t)}")
    if t.is_nested:
        raise TypeError(f"{name} must be a dense tensor, got a nested tensor of {t.size(0)} components; "
                        "pass one of them (.unbind()) or pad them into one tensor (.to_padded_tensor(0.0))")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a strided (dense) tensor, got a {t.layout} one of shape {tuple(t.shape)}; "
                        "call .to_dense() first")
    if t.is_quantized:
        raise TypeError(f"{name} must be an ordinary (not quantized) tensor, got a {t.dtype} one of shape "
                        f"{tuple(t.shape)}; call .dequantize() (or .int_repr() for its codes) first")
    if t.dtype in UNSUPPORTED_DTYPES or (t.is_floating_point() and t.element_size() == 1):
        raise TypeError(f"{name} has dtype {t.dtype}, which torch cannot compute with here (shape "
                        f"{tuple(t.shape)}); cast it first (float32 for values, int64 for ids and indices)")
    return t


def check_linear_input(x: object, in_features: int) -> torch.Tensor:
    """x (..., K) a strided floating-point tensor with K = in_features, the input of a linear layer: a TypeError
    naming its dtype (an integer x would be read as codes by a quantized layer), a ValueError naming its shape
    (torch's "mat1 and mat2 shapes cannot be multiplied" names neither x nor the layer)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor of activations, got {tensor_kind(x)}")
    check_strided("x", x)  # a sparse x: torch's "reshape is not implemented for sparse tensors"
    in_features = check_int("in_features", in_features)
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x must have shape (..., {in_features}), got {tuple(x.shape)}")
    return x


def check_has_data(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` unchanged, or a ValueError naming `name` when it is a meta tensor: a shape and a dtype without values; a
    TypeError when it is not a strided (dense) tensor (`check_strided`: a sparse one's values are not where torch's
    dense ops read them).

    Every check that reads values (a range, NaN, a row sum) and every `.item()` fails on one deep inside torch, with
    torch's message; this says which argument it was, up front. Host-only: the device is known without a sync.
    """
    check_strided(name, t)
    if t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (shape {tuple(t.shape)}): it has no values to read; give a tensor "
                         "on a real device")
    return t


def check_module_has_data(name: str, module: Any) -> None:
    """A ValueError naming `name` and the tensor when any parameter or buffer of the torch module `module` is a meta
    tensor (a model built on the meta device, or moved there with `.to("meta")`), a TypeError when one is sparse
    (`check_has_data`), before anything reads it; a TypeError naming `name` when it is not a torch module."""
    check_instance(name, module, torch.nn.Module, "a torch module (nn.Module)")
    for key, t in [*module.named_parameters(), *module.named_buffers()]:
        check_has_data(f"{name} tensor {short_repr(key)}", t)


def check_writable(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` unchanged, or a ValueError naming `name` when torch would refuse an in-place write into it (a cache or a
    pool that a step writes with torch ops): an expanded tensor (a stride of 0 over a dimension of more than one
    element: those elements share one memory location, so the write would land twice), an inference tensor
    outside inference mode, or a tensor that requires grad while grad mode is on. Torch's own errors ("more than
    one element of the written-to tensor refers to a single memory location", "Inplace update to inference tensor
    outside InferenceMode") name no argument. The modes are read now, so the check matches the call it guards."""
    check_strided(name, t)  # a tensor at all, and one with strides to read
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        raise ValueError(f"{name} is expanded (shape {tuple(t.shape)}, strides {t.stride()}): its elements share "
                         "memory, so a write would land on several of them; pass a tensor of its own (.clone())")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{name} is an inference tensor (made under torch.inference_mode()) and cannot be written "
                         "outside it: write under torch.inference_mode(), or pass a .clone() made outside it")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, so it cannot be written in place while grad mode is on: write "
                         "under torch.no_grad(), or pass a tensor that does not require grad (.detach())")
    return t


def is_float_compute(x: Any) -> bool:
    """Whether `x` is a floating-point tensor of a dtype torch computes in: float16, bfloat16, float32, float64.
    float8 (one byte) is floating point too, but a storage format: most ops refuse it deep inside torch."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.element_size() >= 2


def check_float_tensor(name: str, x: Any, ndim: int | None = None, values: bool = True) -> torch.Tensor:
    """`x` if it is a strided (dense, not sparse) floating-point torch tensor of a dtype torch computes in (not
    float8), holding values (not a meta tensor; `values=False` for a caller that only slices or reshapes, where a
    meta tensor's shape is enough), of `ndim` dimensions when given; TypeError / ValueError naming `name`
    otherwise."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor_kind(x)}")
    if not is_float_compute(x):
        raise TypeError(f"{name} must be a floating-point tensor torch computes in (float16, bfloat16, float32 or "
                        f"float64), got {x.dtype}: float8 is a storage format, cast it first")
    check_strided(name, x)  # values=False too: a sparse tensor cannot be sliced or reshaped either
    if values:
        check_has_data(name, x)
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_device(name: str, device: Any, allocates: bool = False) -> torch.device:
    """`device` (a str or torch.device) as a torch.device; a TypeError / ValueError naming `name` and the value when
    it is neither, or a string torch cannot read ('gpu0'): torch's "Invalid device string" names no argument. With
    `allocates` (a cache or a layer about to allocate there), CUDA without a GPU is a ValueError too, not torch's
    AssertionError at the allocation."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device like 'cpu' or 'cuda:0', got {type(device).__name__} "
                        f"{short_repr(device)}")
    try:
        device = torch.device(device if isinstance(device, torch.device) else str.__str__(device))
    except RuntimeError as e:
        raise ValueError(f"{name} must be a device like 'cpu', 'cuda' or 'cuda:0', got {short_repr(device)}") from e
    if device.type == "meta":  # tensors there have shapes but no values: nothing could run or be read
        raise ValueError(f"{name} must be a device that holds values, like 'cpu' or 'cuda', got 'meta'")
    if allocates and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} {str(device)!r} requested but torch.cuda.is_available() is False")
    if allocates and device.type not in ("cpu", "cuda"):  # 'mps', 'xla': torch's own error names no argument
        raise ValueError(f"{name} must be 'cpu' or a CUDA device (what minillm runs on), got {str(device)!r}")
    return device


def check_linear_args(in_features: Any, out_features: Any, bias: Any, device: Any, dtype: Any
                      ) -> tuple[int, int, bool, torch.device | None, torch.dtype | None]:
    """nn.Linear's arguments for a subclass of it, checked (its own are not: True makes one input, 2**40 fails in the
    allocator naming nothing, bias='no' gives a bias, device 'zzz' is torch's unnamed RuntimeError): plain positive
    sizes of a weight within MAX_TENSOR_ELEMENTS, bias a bool, device None or one that can allocate, dtype None or
    a floating-point torch.dtype. The plain values, or a TypeError / ValueError naming the argument."""
    in_features, out_features = check_int("in_features", in_features), check_int("out_features", out_features)
    check_tensor_elements("out_features x in_features", (out_features, in_features))
    bias = check_bool("bias", bias)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {short_repr(dtype)}")
    device = None if device is None else check_device("device", device, allocates=True)
    return in_features, out_features, bias, device, dtype


def plain_int(value: Any) -> int | None:
    """The plain int an integer holds: a Python int (an int subclass's own value: its comparisons and conversions
    are never consulted) or a numpy integer; None for anything else, bool included (True is no index or token id)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int.__index__(value) if isinstance(value, int) else int(value)


def plain_number(value: Any) -> Any:
    """The plain int or float an int or float (or a subclass of one: numpy's float64, a class of the caller's own)
    holds, so that a check compares, and the caller stores, a value whose comparisons and conversions cannot lie;
    anything else is returned as it is, for the caller's type check to refuse. bool stays a bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return value


def short_repr(value: Any) -> str:
    """`value` as an error message shows it: its repr cut to 80 characters, an int past 256 bits by its size (str()
    of an int past 4300 digits is itself an error), and a value whose repr fails by its type. An int or float
    subclass of the caller's own shows the plain number it holds (its repr may lie); numpy's keep theirs."""
    if type(value).__module__ != "numpy":
        value = plain_number(value)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an int of {value.bit_length()} bits"
    try:
        return f"{value!r:.80}"
    except Exception:  # a repr that fails names its type only
        return f"a value of type {type(value).__name__}"


def foreign_number(value: Any) -> bool:
    """Whether `value` is a real number of a type other than Python's int and float (bool aside): numpy's float32
    and int64, a Fraction, a Decimal (numpy's float64 is a float, so it is not one). The checks below refuse them with a
    message saying to convert, rather than "must be a number".

    Why not take them: a number checked here is stored (in configs, metadata, JSON files), and a numpy float32 there
    would compute in float32 or fail to serialize much later, far from the call that passed it."""
    return isinstance(value, (numbers.Real, decimal.Decimal)) and not isinstance(value, (int, float, bool))


def number_kind(value: Any) -> str:
    """`value` described for a message refusing it as a number: its type and a short repr, and for a real number of
    another type (`foreign_number`: numpy's float32, a Fraction) how to convert it."""
    if isinstance(value, int) and int.__index__(value).bit_length() > 256:  # str() past 4300 digits is an error
        text = f"an int of {int.__index__(value).bit_length()} bits"
    else:
        text = f"{type(value).__name__} {short_repr(value)}"  # short_repr never raises
    return text + (" (a Python int or float is needed: convert it with int() or float())"
                   if foreign_number(value) else "")


def check_float(name: str, value: Any, minimum: float | None = None, maximum: float | None = None,
                include_minimum: bool = True, include_maximum: bool = True) -> int | float:
    """Raise TypeError unless `value` is a real number (bool excluded), ValueError if it is NaN, infinite, an int past
    the float range (`check_fits_float`) or outside [minimum, maximum] (an open end where include_* is False). The
    message names the field and the allowed range. Returns the plain int or float it holds (as `check_int` does),
    for the callers that go on comparing, computing with or storing it.

    subtle: every comparison with NaN is False, so `if x < 0: raise` lets NaN through; check finiteness first.
    subtle: a float subclass may define its own `<`, so a check that compares the caller's object can be told that
    0.5 < 1e-9; the plain float (`float.__float__`) it holds cannot lie.
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        if foreign_number(value):
            raise TypeError(f"{name} must be a Python int or float, got {type(value).__name__} {short_repr(value)}: "
                            "convert it with float()")
        raise TypeError(f"{name} must be a number, got {number_kind(value)}")
    # the plain number a subclass holds (numpy's float64 is a float subclass too): its comparisons are not consulted
    value = plain_number(value)
    low = "" if minimum is None else f"{'[' if include_minimum else '('}{minimum}"
    high = "" if maximum is None else f"{maximum}{']' if include_maximum else ')'}"
    where = f" in {low or '(-inf'}, {high or 'inf)'}" if (low or high) else ""
    check_fits_float(name, value)  # before math.isfinite, which raises OverflowError on such an int
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{where}, got {value}")
    if minimum is not None and (value < minimum or (value == minimum and not include_minimum)):
        raise ValueError(f"{name} must be{where}, got {value}")
    if maximum is not None and (value > maximum or (value == maximum and not include_maximum)):
        raise ValueError(f"{name} must be{where}, got {value}")
    return value


def check_sequence(name: str, value: Any) -> tuple:
    """`value` as a tuple if it is a non-empty list or tuple; a TypeError naming `name` for anything else, a
    ValueError for an empty one. The caller checks the items (`check_int`, `check_float`), naming each `name[i]`.

    subtle: a str is a sequence too: sparsities='0.5' would be read one character at a time, '0', '.', '5'.
    """
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple, got {type(value).__name__} {short_repr(value)}")
    if not value:
        raise ValueError(f"{name} must hold at least one value, got an empty {type(value).__name__}")
    return tuple(value)


def check_fits_window(what: str, prompt_len: int, new_tokens: int, block_size: int, model: str = "the model") -> None:
    """A ValueError naming `what` (a prompt), its length, `new_tokens` and `model`'s window unless new_tokens tokens
    generated after prompt_len fit the window uncut: the loop feeds prompt_len + new_tokens - 1 positions.

    subtle: generation past the window is not an error, it stops early (`minillm.core.stopping.validate_prompt` caps
    it), so a benchmark counting new_tokens per prompt would time, and compare, tokens that were never generated.
    """
    prompt_len, block_size = check_int("prompt_len", prompt_len), check_int("block_size", block_size)
    need = prompt_len + check_int("new_tokens", new_tokens) - 1
    if need > block_size:
        raise ValueError(f"{what} has {prompt_len} tokens: with new_tokens={new_tokens} it needs {need} positions, "
                         f"more than {model}'s context window block_size={block_size}")


def check_fit_windows(prompts: Any, new_tokens: int, windows: Any) -> None:
    """`check_fits_window` for each (name, length) of `prompts` against each (model's role, block_size) of
    `windows`: a benchmark whose runs would stop early at a window would count tokens never generated."""
    for what, length in prompts:
        for role, block_size in windows:
            check_fits_window(what, length, new_tokens, block_size, role)


# The most elements one tensor that a size argument chose may hold: 2^31, 8 GiB in fp32, 55x the largest weight of
# the `gpt2` preset (its 50257 x 768 embedding). Past it a size is a typo, not a model.
MAX_TENSOR_ELEMENTS = 2**31


def check_tensor_elements(names: str, shape: tuple[int, ...], limit: int = MAX_TENSOR_ELEMENTS) -> None:
    """A ValueError naming `names` (the arguments that chose the size, "batch_size x max_len") and the shape when a
    tensor of `shape` (ints, checked already) would hold more than `limit` elements, before it is allocated.

    subtle: QuantLinear(10**6, 10**6, ...) passes every int check, then fails inside torch's allocator ("can't
    allocate memory"), naming no argument; on a machine big enough it succeeds and swaps the machine to a halt.
    """
    numel = math.prod(shape)
    if numel > limit:  # ints within the float range each, but their product may not be (1e200 x 1e200)
        count = f"{numel:.3g}" if numel <= sys.float_info.max else f"about 2**{numel.bit_length() - 1}"
        raise ValueError(f"{names} ask for a tensor of shape {tuple(shape)} ({count} elements), past the "
                         f"{limit:.3g} one tensor may hold (MAX_TENSOR_ELEMENTS); lower {names}")


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: past it a timeout is a typo (2**40 s overflows the OS's clock)


def check_timeout(timeout: Any, name: str = "timeout") -> float:
    """A timeout in seconds (a build, a compiler, a child process) in (0, MAX_TIMEOUT_S], as the plain number; a
    TypeError / ValueError naming `name` otherwise (subprocess's own OverflowError, "timestamp too large", names
    nothing)."""
    return check_float(name, timeout, 0.0, MAX_TIMEOUT_S, include_minimum=False)


def check_threads(name: str, threads: Any) -> int:
    """`threads` (torch's thread count, for `torch.set_num_threads`) if it is an int in [1, 4 x os.cpu_count()], else
    a TypeError / ValueError naming `name`.

    subtle: past a few threads per core they only stall, and torch.set_num_threads(100000) fails in the allocator
    (MemoryError, "can't allocate memory") naming nothing."""
    threads = check_int(name, threads)  # the plain int: one whose comparisons lie cannot pass the bound
    most = 4 * (os.cpu_count() or 1)
    if threads > most:
        raise ValueError(f"{name} must be at most {most} (4 per core of this machine's {os.cpu_count()}), got "
                         f"{threads}")
    return threads


def check_report(name: str, report: Any, keys: tuple[str, ...], rows: str | None = None,
                 row_keys: tuple[str, ...] = ()) -> dict:
    """`report` (a benchmark's report, as its `--json` wrote it) if it is a dict holding every one of `keys`, and,
    when `rows` names one of them, that entry a list of dicts each holding every one of `row_keys`; a TypeError /
    ValueError naming `name` and what it lacks otherwise.

    subtle: a report read back from a file (edited, truncated to {}, or another command's) would otherwise fail in
    the middle of a table as a bare KeyError ('rows'), naming neither the report nor what it should have held."""
    if not isinstance(report, dict):
        raise TypeError(f"{name} must be a report dict, got {type(report).__name__} {short_repr(report)}")
    missing = [key for key in keys if key not in report]
    if missing:
        raise ValueError(f"{name} must be a report holding {list(keys)}; it lacks {missing} (another command's?)")
    if rows is not None:
        if not isinstance(report[rows], list):
            raise TypeError(f"{name}[{rows!r}] must be a list of rows, got {type(report[rows]).__name__}")
        for i, row in enumerate(report[rows]):
            if not isinstance(row, dict):
                raise TypeError(f"{name}[{rows!r}][{i}] must be a row (a dict), got {type(row).__name__} "
                                f"{short_repr(row)}")
            lacking = [key for key in row_keys if key not in row]
            if lacking:
                raise ValueError(f"{name}[{rows!r}][{i}] must be a row holding {list(row_keys)}; it lacks {lacking}")
    return report


# What Python itself says when a value is not the container it was read as ("'NoneType' object is not
# subscriptable", "'<' not supported between ..."): a report missing a part, not a check of ours.
_SHAPE_ERRORS = re.compile(r"not subscriptable|not iterable|has no len|unsupported operand|not supported between|"
                           r"indices must be integers|must be real number|not callable|unhashable type")


def reads_report(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for a function that formats or quotes a benchmark's report (its first argument: a dict, as the
    benchmark's `--json` wrote it). Anything but a dict is a TypeError naming the function; a part the report
    lacks deep inside, a KeyError ('rows'), an IndexError (an empty list of rounds), an AttributeError or Python's
    own TypeError (None where a row was due), becomes a ValueError naming the function and what was missing,
    chained to the original. The checks the function makes itself (`check_report`) pass through as they are.

    subtle: a report read back from a file may be another command's, an older version's, or edited by hand; a
    table built from it would otherwise fail in its middle with a bare KeyError naming neither the report nor the
    function that read it."""
    @functools.wraps(fn)
    def reader(report: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(report, dict):
            raise TypeError(f"report must be a report dict, got {type(report).__name__} {short_repr(report)} "
                            f"({fn.__name__} reads what the benchmark's --json wrote)")
        try:
            return fn(report, *args, **kwargs)
        except (KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"{fn.__name__}: the report lacks a part it reads ({type(e).__name__}: {e}); it is not "
                             "a complete report of this benchmark's --json run (another command's, or an older "
                             "version's?)") from e
        except TypeError as e:
            if not _SHAPE_ERRORS.search(str(e)):
                raise
            raise ValueError(f"{fn.__name__}: a part of the report is not what the benchmark writes ({e}); it is not "
                             "a complete report of this benchmark's --json run") from e

    reader.reads_report = True  # type: ignore[attr-defined]  # for the tests that feed every reader bad reports
    return reader


@dataclass
class GPTConfig:
    vocab_size: int = 4096  # number of token ids; the embedding and the tied output head have this many rows
    block_size: int = 256  # context window: the most positions the learned position embedding covers
    n_layer: int = 6  # transformer blocks
    n_head: int = 8  # attention heads per block; n_embd must divide evenly
    n_embd: int = 256  # residual stream width C
    dropout: float = 0.0  # training-time dropout on the embeddings and on each residual branch
    layer_norm_epsilon: float = 1e-5  # GPT-2's value; Hugging Face calls it layer_norm_epsilon too
    attn_impl: str = "sdpa"  # "sdpa" (fused, PyTorch) or "explicit" (attention_ref): the two must agree
    # Width of one attention head. None (every shipped model): n_embd / n_head, GPT-2's rule. Set only when heads
    # were removed (chapter 10's head pruning): n_head heads of head_dim each, n_head * head_dim < n_embd.
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            # stored as the plain int: an int subclass's own comparisons and repr never reach the model
            setattr(self, name, check_int(f"GPTConfig.{name}", getattr(self, name)))
        if self.head_dim is None and self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.head_dim is not None:
            self.head_dim = check_int("GPTConfig.head_dim", self.head_dim)
        self.dropout = check_float("GPTConfig.dropout", self.dropout, 0.0, 1.0, include_maximum=False)
        self.layer_norm_epsilon = check_float("GPTConfig.layer_norm_epsilon", self.layer_norm_epsilon, 0.0,
                                              include_minimum=False)
        self.attn_impl = check_choice("attn_impl", self.attn_impl, ("sdpa", "explicit"))

    @property
    def head_size(self) -> int:
        """hs: the width of one attention head (n_embd / n_head unless head_dim says otherwise)."""
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def attn_dim(self) -> int:
        """nh * hs: the width of the heads side by side (n_embd, unless heads were pruned away)."""
        return self.n_head * self.head_size

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "GPTConfig":
        """A named preset, optionally with fields overridden (`GPTConfig.from_name("base", dropout=0.1)`)."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a GPTConfig preset's name (a str), one of {sorted(PRESETS)}, got "
                            f"{type(name).__name__}")
        name = str.__str__(name)  # the plain str: a str subclass's == is not consulted
        if name not in PRESETS:
            raise ValueError(f"unknown GPTConfig preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["head_dim"] is None:  # GPT-2's rule: every config written before head pruning existed stays the same
            del d["head_dim"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPTConfig":
        if not isinstance(d, dict):
            raise TypeError(f"GPTConfig.from_dict needs a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {unknown}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# Named presets. `base` and `draft` are the two checkpoints minillm ships (chapter 02 trains them); `tiny` is for
# tests; `gpt2` is the real 124M model's shape, for users who load its weights from a Hugging Face directory.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=32),
    "draft": dict(vocab_size=4096, block_size=256, n_layer=2, n_head=4, n_embd=128),
    "base": dict(vocab_size=4096, block_size=256, n_layer=6, n_head=8, n_embd=256),
    "gpt2": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}
