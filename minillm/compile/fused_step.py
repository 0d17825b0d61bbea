"""The whole batch-1 decode step on the CPU in one C++ call: chapter 13's answer to llama.cpp.

What it adds: `FusedCPUDecoder(model)`, a `decode_fn` for chapter 04's `generate` (like `StaticDecoder`) whose every
token is one call into `csrc/decode_cpu.cpp`: embeddings, each block's layernorms, GEMVs (the C++ GEMV of
`cpu_gemv`), attention over the cache and GELU, the final layernorm and the tied head, with no PyTorch operator in
between. The prompt is prefilled by the model itself (PyTorch's GEMM is the right tool for hundreds of rows) into the
decoder's own `ContiguousKVCache`, whose K/V tensors the C++ step then reads and appends to in place.

Why: after the C++ GEMV, a step of `base` still spends more time in the ~150 operator calls between its products
(dispatch, allocation, Python) than in the products themselves. A step that is one call leaves the weights' streaming
as nearly all of it, which is how llama.cpp runs (chapter 13 measures both side by side).

What it leaves out: batches (chapter 06's engine keeps `fast_cpu_model`), several threads, and any model whose
linears are not plain float32 (chapter 09's quantized and QAT-prepared layers): those get a TypeError naming the
layer. The C++ step holds the model's own parameter storage, not a copy: change the weights in place and it sees
them. Anything else (`model.half()`, a new Parameter, `param.data = ...`, a layer swapped for another, a LayerNorm's
`eps` changed) leaves the step with a snapshot the model no longer holds, while the prefill runs the model as it is
now: the decoder notices and raises a ValueError; build a new FusedCPUDecoder then.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from minillm.compile.cpu_gemv import cpp_errors_as_value_errors, load_cpu_ext
from minillm.compile.decode import check_decoder_room, decoder_max_len, integer_ids
from minillm.compile.mirror import check_plain_model
from minillm.core.model import GPT
from minillm.core.sampling import SamplingParams
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate_ids


def _plain(module: nn.Module, name: str) -> list[torch.Tensor]:
    """[weight, bias] of a float32 CPU linear or layernorm (`check_plain_model` has checked the layer's type);
    TypeError naming `name` for other dtypes, devices or a missing bias."""
    tensors = [module.weight, module.bias]
    for t in tensors:
        if t is None or t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"the fused C++ step needs float32 CPU weights with biases; {name} has "
                            f"{None if t is None else (t.dtype, t.device.type)}")
    return [t.detach().contiguous() for t in tensors]


def model_fingerprint(modules: list[nn.Module]) -> list[tuple[Any, ...]]:
    """What the C++ step's snapshot depends on, for `modules` (the model's, listed once at construction), cheap to
    take at every sequence: per module the submodules it holds now (a layer swapped for another,
    `block.mlp.c_fc = nn.Linear(...)`, is another object there), a LayerNorm's eps (the step took its value), and
    per parameter its identity, dtype, device and storage address, and, where the step had to copy it (a
    non-contiguous parameter), its in-place version counter too. An in-place update of a contiguous weight keeps all
    of these: the step holds the same storage and sees it."""
    return [(tuple((name, id(child)) for name, child in m._modules.items()),
             m.eps if isinstance(m, nn.LayerNorm) else None,
             tuple((name, None if p is None else (id(p), p.dtype, p.device, p.data_ptr(),
                                                  None if p.is_contiguous() else p._version))
                   for name, p in m._parameters.items()))
            for m in modules]


class FusedCPUDecoder:
    """Batch-1 decode of a float32 CPU GPT, one C++ call per token; pass it as `decode_fn` with `kv_cache=self.cache`.

    `max_len` sizes the cache (default and most: the model's context window). Greedy tokens equal the eager generator's
    (tested); logits agree to float rounding (the sums run in another order).
    The step reads the parameters the model held at construction (their storage: in-place updates are seen) and each
    LayerNorm's own eps. If the model's parameters are converted or replaced afterwards (`model.half()`, a new
    Parameter, a layer swapped for another) or an eps is changed, the next `generate_ids` or the first step of the
    next sequence raises a ValueError: build a new FusedCPUDecoder. A quantized or QAT-prepared model is a TypeError
    naming the layer (`check_plain_model`).
    """

    def __init__(self, model: GPT, max_len: int | None = None):
        if not isinstance(model, GPT):
            raise TypeError(f"FusedCPUDecoder needs a minillm GPT, got {type(model).__name__}")
        if model.device.type != "cpu":
            raise ValueError(f"FusedCPUDecoder runs on the CPU, the model is on {model.device}")
        cfg = model.config
        check_plain_model(model, "the fused C++ step")
        self.model = model.eval()
        self.max_len = decoder_max_len(cfg, max_len)  # at most block_size: slot j holds position j
        self.cache = ContiguousKVCache(cfg, 1, self.max_len)  # float32, dynamic: `attend` for the prefill
        tr = model.transformer
        if model.lm_head.weight.dtype != torch.float32 or tr.wpe.weight.dtype != torch.float32:
            raise TypeError(f"the fused C++ step needs float32 embeddings, got {model.lm_head.weight.dtype}")
        glob = [tr.wte.weight.detach(), tr.wpe.weight.detach(), *_plain(tr.ln_f, "transformer.ln_f"),
                model.lm_head.weight.detach()]
        layers: list[torch.Tensor] = []
        for i, block in enumerate(tr.h):
            for name in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
                layers += _plain(block.get_submodule(name), f"transformer.h.{i}.{name}")
        self._model_modules = list(model.modules())
        self._fingerprint = model_fingerprint(self._model_modules)
        self._last_start = math.inf  # the cache length at the last step (a check runs when it does not grow)
        eps = [float(block.get_submodule(n).eps) for block in tr.h for n in ("ln_1", "ln_2")] + [float(tr.ln_f.eps)]
        self._cpp: Any = load_cpu_ext().FusedDecoder([t.contiguous() for t in glob], layers, self.cache.k,
                                                     self.cache.v, cfg.n_head, cfg.head_size, eps)

    def __call__(self, model: GPT, cache: ContiguousKVCache, token: torch.Tensor, positions: torch.Tensor
                 ) -> torch.Tensor:
        """The `decode_fn` of chapter 04's `generate`: logits (1, V) for one token (1,) at positions (1,)."""
        if model is not self.model or cache is not self.cache:
            raise ValueError("a FusedCPUDecoder runs its own model over its own cache: pass kv_cache=decoder.cache")
        if cache.length <= self._last_start:  # a new sequence (the cache was reset): look once per sequence, since
            self.check_model_unchanged()  # the fingerprint costs ~5% of a token's step if taken at every token
        self._last_start = cache.length
        token = integer_ids("token", token, 1)  # subtle: int() of a float token would truncate it silently
        positions = integer_ids("positions", positions, 1)
        start = cache.length
        with cpp_errors_as_value_errors():  # the C++ range checks: token id, position, a full cache
            logits = self._cpp.step(int(token), int(positions), start)  # (1, V); K/V written at slot `start`
        cache.mark_written(1)
        return logits

    def check_model_unchanged(self) -> None:
        """ValueError unless the model still holds the parameters the C++ step was built on (see the class doc)."""
        if model_fingerprint(self._model_modules) != self._fingerprint:
            raise ValueError("the model's parameters were converted or replaced since this FusedCPUDecoder was "
                             "built (e.g. model.half(), a new Parameter, a layer swapped for another or a "
                             "LayerNorm's eps changed); its C++ step still holds the old ones: build a new "
                             "FusedCPUDecoder(model)")

    def generate_ids(self, prompt_ids: Any, params: SamplingParams, **kwargs: Any) -> list[int]:
        """Chapter 04's `generate_ids` with this step: the prompt prefilled by the model, every later token in C++."""
        self.check_model_unchanged()  # before the prefill, which would run the changed model
        check_decoder_room(self.max_len, self.model.config, prompt_ids, params, kwargs.get("truncate", False))
        return generate_ids(self.model, prompt_ids, params, kv_cache=self.cache, decode_fn=self, **kwargs)
