"""The GPT-2 architecture from scratch: embeddings, pre-LayerNorm blocks, causal attention, GELU MLP, tied head.

Parameter names follow Hugging Face's `GPT2LMHeadModel` (`transformer.h.0.attn.c_attn.weight`, ...), so its state
dicts load key for key (see `minillm.core.hf`; only the Conv1D weights need a transpose). The model stays plain eager
PyTorch: later chapters speed it up from the call site (a KV cache passed to `forward`, quantized linears swapped
in, `torch.compile` around it), never by branching in here.

What it leaves out: it knows nothing about caching except the one hook below. With `cache=None` every call
recomputes attention over all T positions (chapter 03's naive loop); with a cache, each layer hands its new
q, k, v to `cache.attend`, which stores k, v and attends over everything kept so far (chapters 04 and 05).

Shape legend for the whole package: B batch, T time (tokens), C channels (n_embd), nh heads, hs head size,
V vocabulary; nb blocks and bs block size for the paged cache.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.attention import attention, attention_ref
from minillm.core.config import check_bool, check_float, check_instance, check_int, GPTConfig, tensor_kind
from minillm.core.device import resolve_device
from minillm.core.hf import read_hf
from minillm.core.weights import load_state_dict_strict


@runtime_checkable
class KVCacheProtocol(Protocol):
    """What a KV cache must offer the model: store this step's keys and values, attend over all kept ones.

    `attend(layer_idx, q, k, v)` gets q, k, v of shape (B, nh, T, hs) for the T *new* tokens of this forward call,
    writes k and v into its storage for layer `layer_idx`, and returns the attention output (B, nh, T, hs) of the
    new queries over every key and value the cache now holds for that sequence, causally. A cache keeps its own
    per-step metadata (lengths, block tables, padding masks); the model never looks inside.
    """

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout with probability p while training; at inference, x itself without a call into torch.

    An `nn.Dropout` module in eval mode is a no-op too, but still a module call: 19 of them per forward cost about
    4% of a batch-1 decode step on the CPU (measured in chapter 04). So the model applies dropout functionally,
    and only when it does something. `training` and `p` are checked on the training path only (TypeError /
    ValueError naming them): inference stays one identity test.
    """
    if training is False:
        return x
    if check_bool("training", training) and check_float("p", p, 0.0, 1.0) > 0:
        return F.dropout(x, p, training=True)
    return x


_ID_DTYPES = (torch.int64, torch.int32)  # what an embedding takes as indices


def check_ids(name: str, t: object, what: str = "") -> torch.Tensor:
    """`t` if it is an int64 (or int32) tensor: token ids or positions, as the embeddings index with them; a
    TypeError naming `name` otherwise. Host-only: the type, not the values."""
    if not isinstance(t, torch.Tensor) or t.dtype not in _ID_DTYPES:
        raise TypeError(f"{name} must be an int64 tensor{what}, got {tensor_kind(t)}")
    return t


def check_activations(name: str, x: object, width: int, ndim: int | None = 3) -> torch.Tensor:
    """`x` if it is a floating-point tensor (B, T, width) (with `ndim=None`, any (..., width)): what a layer of the
    model reads. A TypeError / ValueError naming `name` otherwise, instead of torch's "mat1 and mat2 shapes cannot
    be multiplied" from inside the layer. Host-only and cheap (a few attribute reads): it runs in every layer."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor of activations, got {tensor_kind(x)}")
    if (x.dim() != ndim if ndim is not None else x.dim() == 0) or x.shape[-1] != width:
        raise ValueError(f"{name} must have shape {'(B, T, C)' if ndim == 3 else '(..., C)'} with C={width}, got "
                         f"{tuple(x.shape)}")
    return x


def check_hidden_args(idx: object, positions: object, collect: object) -> None:
    """`GPT.hidden`'s arguments, on the host (no values read, no sync): idx an int64 (B, T) tensor, positions an
    int64 tensor, collect None or a list; a TypeError / ValueError naming the argument."""
    if check_ids("idx", idx, " of token ids").dim() != 2:
        raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")  # type: ignore[union-attr]
    check_ids("positions", positions)
    if collect is not None and not isinstance(collect, list):
        raise TypeError(f"collect must be None or a list (each block's output is appended), got "
                        f"{type(collect).__name__}")


def check_cache(cache: object) -> None:
    """A TypeError unless `cache` is None or has an `attend` method (`KVCacheProtocol`), before a layer calls it."""
    if cache is not None and not callable(getattr(cache, "attend", None)):
        raise TypeError(f"cache must be None or a KV cache with an attend(layer_idx, q, k, v) method, got "
                        f"{type(cache).__name__}")


def check_layer_args(config: object, layer_idx: object = 0) -> None:
    """A layer's constructor arguments: config a GPTConfig, layer_idx a non-negative int (the cache's layer slot);
    a TypeError / ValueError naming the argument before a field of the config is read."""
    check_instance("config", config, GPTConfig, "a GPTConfig")
    check_int("layer_idx", layer_idx, 0)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        check_layer_args(config, layer_idx)
        super().__init__()
        self.n_embd = config.n_embd  # C: the width of x
        self.n_head = config.n_head
        self.head_size = config.head_size
        self.attn_dim = config.attn_dim  # nh * hs: n_embd for GPT-2, less once heads are pruned (chapter 10)
        self.layer_idx = layer_idx
        self.attn_impl = config.attn_impl
        self.c_attn = nn.Linear(config.n_embd, 3 * self.attn_dim)  # q, k, v projections in one matmul
        self.c_proj = nn.Linear(self.attn_dim, config.n_embd)
        self.dropout = config.dropout  # residual dropout probability, training only

    def forward(self, x: torch.Tensor, cache: KVCacheProtocol | None = None) -> torch.Tensor:
        B, T, C = check_activations("x", x, self.n_embd).shape
        check_cache(cache)
        nh, hs, A = self.n_head, self.head_size, self.attn_dim  # A = nh * hs (= C unless heads were pruned)
        q, k, v = self.c_attn(x).split(A, dim=2)  # 3 x (B, T, A)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            y = cache.attend(self.layer_idx, q, k, v)  # (B, nh, T, hs)
        elif self.attn_impl == "sdpa":
            y = attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T), True = may attend
            y = attention_ref(q, k, v, mask)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, A)  # (B, nh, T, hs) -> (B, T, A): heads side by side
        return dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        check_layer_args(config)
        super().__init__()
        self.n_embd = config.n_embd  # C: the width of x
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = config.dropout  # residual dropout probability, training only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_activations("x", x, self.n_embd, ndim=None)  # (..., C)
        # GPT-2's "gelu_new" is the tanh approximation of GELU (Hendrycks & Gimpel 2016, eq. in §2).
        h = F.gelu(self.c_fc(x), approximate="tanh")  # (B, T, 4C)
        return dropout(self.c_proj(h), self.dropout, self.training)  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        check_layer_args(config, layer_idx)
        super().__init__()
        self.n_embd = config.n_embd  # C: the width of x
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCacheProtocol | None = None) -> torch.Tensor:
        check_activations("x", x, self.n_embd)  # (B, T, C)
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT needs a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embedding (V, C)
                wpe=nn.Embedding(config.block_size, config.n_embd),  # learned position embedding (block_size, C)
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        # GPT-2 paper §2.3: scale the residual projections by 1/sqrt(N) with N residual layers (2 per block).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @classmethod
    def from_hf(cls, source, n_head: int | None = None, device: str | torch.device = "cpu", **config_overrides) -> "GPT":
        """A GPT (eval mode, fp32) with the weights of a Hugging Face GPT-2 (chapter 02).

        source: a `GPT2LMHeadModel` / `GPT2Model`, a state dict of one (then pass `n_head`), or a directory holding
        config.json + model.safetensors (see `minillm.core.hf.read_hf`). `config_overrides` set GPTConfig fields
        such as attn_impl. Missing, extra or mis-shaped tensors raise ValueError naming the key and both shapes.
        """
        config, tensors, label = read_hf(source, n_head=n_head, **config_overrides)
        model = cls(config)
        load_state_dict_strict(model, tensors, source=label)
        return model.to(resolve_device(device)).eval()

    @property
    def device(self) -> torch.device:
        return self.transformer.wte.weight.device

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (the tied head counted once); `non_embedding` drops the position embedding, as GPT-2 does."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def check_inputs(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Validate what `forward` is given; return the positions to use, shaped (1, T) or (B, T).

        Types and shapes are checked on the host for free. Ids and positions must also lie inside the vocabulary and
        the context window, which needs their values: one host sync, done here once per call. Loops that validated
        their prompts already (every generator and the engine, at their entry points) skip this by calling
        `hidden` + `logits` directly, so a decode step never waits on the host (chapter 13 captures it whole).
        """
        check_ids("idx", idx, " of token ids")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        B, T = idx.shape
        cfg = self.config
        if T == 0:
            raise ValueError("idx has no tokens (T=0)")
        if positions is None:
            if T > cfg.block_size:
                raise ValueError(f"sequence length {T} exceeds the context window block_size={cfg.block_size}")
            positions = torch.arange(T, device=idx.device)  # (T,)
        check_ids("positions", positions)
        shape = tuple(positions.shape)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)  # (1, T), broadcast over the batch
        if positions.dim() != 2 or positions.size(1) != T or positions.size(0) not in (1, B):
            raise ValueError(f"positions must have shape (T,), (1, T) or (B, T) for idx {tuple(idx.shape)}, "
                             f"got {shape}")
        if idx.numel() == 0:  # an empty batch (B = 0): nothing to range-check
            return positions
        # Both range checks with one host sync (one .tolist() of four numbers), not four separate int(...) reads.
        lo, hi = torch.aminmax(idx)
        pos_lo, pos_hi = torch.aminmax(positions)
        lo, hi, pos_lo, pos_hi = torch.stack([lo.long(), hi.long(), pos_lo.long(), pos_hi.long()]).tolist()
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"idx holds token id {lo if lo < 0 else hi}, which is outside the vocabulary "
                             f"[0, {cfg.vocab_size})")
        if pos_lo < 0 or pos_hi >= cfg.block_size:
            raise ValueError(f"position {pos_lo if pos_lo < 0 else pos_hi} is outside the context window "
                             f"block_size={cfg.block_size}")
        return positions

    def hidden(self, idx: torch.Tensor, positions: torch.Tensor, cache: KVCacheProtocol | None = None,
               collect: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Final hidden states (after ln_f): idx (B, T), positions (B or 1, T) -> (B, T, C). No host sync.

        The caller has validated idx and positions (see `check_inputs`); only their types are checked here, on the
        host. Shapes stay whatever the caller gives, so a fixed-shape decode step can be compiled or captured in a
        CUDA graph. Chapters that need features rather than logits (distillation's feature matching) read them
        here: pass a list as `collect` and each block's output (B, T, C), before ln_f, is appended to it, n_layer
        tensors in order; no forward hooks needed.
        """
        check_hidden_args(idx, positions, collect)  # types only: the values were checked by the caller
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)  # (B, T, C) + (B or 1, T, C)
        x = dropout(x, self.config.dropout, self.training)  # embedding dropout (training only)
        for block in self.transformer.h:
            x = block(x, cache)  # (B, T, C)
            if collect is not None:
                collect.append(x)
        return self.transformer.ln_f(x)  # (B, T, C)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the rows a caller chose: h (..., C) -> (..., V).

        The head is the largest matmul of a small model (V = 4096 rows against C = 256 in `base`), so the engine and
        speculative verification pick the rows they sample from first (`model.logits(h[:, -1])`) instead of computing
        logits for every prompt position and throwing most away.
        """
        return self.lm_head(check_activations("h", h, self.config.n_embd, ndim=None))

    def forward(
        self,
        idx: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCacheProtocol | None = None,
    ) -> torch.Tensor:
        """Logits for every position: idx (B, T) int64 token ids -> (B, T, V). The checked entry point.

        `positions` (B, T) or (T,) are the absolute positions of the tokens (default 0..T-1); a cache-driven caller
        passes where the new tokens sit in their sequences. `cache` implements `KVCacheProtocol`. Bad ids, positions
        or shapes raise ValueError/TypeError naming them (`check_inputs`); `hidden` + `logits` is the unchecked path.
        """
        positions = self.check_inputs(idx, positions)
        return self.logits(self.hidden(idx, positions, cache))  # (B, T, V)


def require_model(model: object, who: str) -> GPTConfig:
    """The model's config, after checking that `model` offers GPT's interface; a TypeError naming `who` otherwise.

    Loops, caches and the engine accept any module with the interface (`config`, `hidden`, `logits`, `device`): a
    `GPT`, a quantized copy of one (chapter 09) or a wrapper; they never demand the `GPT` class itself.
    """
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or not isinstance(config, GPTConfig) or not all(
            callable(getattr(model, name, None)) for name in ("hidden", "logits")):
        raise TypeError(f"{who} needs a minillm GPT (a module with a GPTConfig `config`, `hidden` and `logits`), "
                        f"got {type(model).__name__}")
    return config
