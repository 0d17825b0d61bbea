"""Choosing the next token from logits: greedy, temperature, top-k, top-p, with seeded generators.

Adds `SamplingParams` (validated), the logits processors (small callables applied in order), and `sample_next`, the
one function every generation path in minillm calls, so equal logits and equal generator state give equal tokens.
What it leaves out: repetition/presence penalties, min-p, beam search and logprobs.

The pipeline is the one Hugging Face `generate` and vLLM's sampler use, in the same order:

    logits (B, V) --/temperature--> --top-k--> --top-p--> softmax --> multinomial (or argmax when temperature == 0)

A processor never renormalises: it sets removed logits to -inf, and the softmax at the end does the rest.
"""

from __future__ import annotations

import argparse

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from minillm.core.config import (check_device, check_fits_float, check_float, check_instance, check_int, number_kind,
                                 plain_number, short_repr, tensor_kind)

LogitsProcessor = Callable[[torch.Tensor], torch.Tensor]  # (B, V) float logits -> (B, V) float logits

# The smallest temperature that is sampled; 0 < temperature < this is a ValueError (use 0.0 for greedy). Below it
# logits / temperature overflows float32 for ordinary logits (1e-300 turns every logit into +-inf, and the softmax
# into NaN), and the distribution is a one-hot argmax anyway. vLLM clamps to the same 1e-2 for the same reason.
MIN_TEMPERATURE = 1e-2
# What torch.Generator.manual_seed accepts: a signed or unsigned 64-bit integer (anything else is an OverflowError
# deep inside torch, "Overflow when unpacking long long").
# [low, high). subtle: torch's CPU generator keeps the low 32 bits of a seed, so on the CPU seeds that differ by a
# multiple of 2**32 (0 and 2**32, -1 and 2**32 - 1) give the same samples; the HTTP API takes [0, 2**32) only.
SEED_RANGE = (-(2**63), 2**64)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_new_tokens: int = 64  # most tokens to generate; 0 generates nothing
    temperature: float = 1.0  # logits are divided by it; 0.0 means greedy (argmax), the other knobs are then ignored
    top_k: int = 0  # keep the k most likely tokens (ties at the k-th value kept too); 0 = off
    top_p: float = 1.0  # nucleus: keep the smallest most-likely set with probability mass >= top_p; 1.0 = off
    seed: int | None = None  # seeds this request's own torch.Generator; None = the global RNG (not repeatable)
    stop: tuple[str, ...] = ()  # stop when any of these strings appears in the generated text (needs a tokenizer)
    ignore_eos: bool = False  # keep going past the end-of-text token (benchmarks want fixed output lengths)
    n: int = 1  # parallel samples from one prompt (chapter 05 shares their prompt blocks)

    def __post_init__(self) -> None:
        # The plain numbers the fields hold: an int or float subclass's own comparisons are never consulted, and the
        # params keep no object of the caller's (numpy's float64 is stored as a float).
        for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "n"):
            setattr(self, name, plain_number(getattr(self, name)))
            if name != "seed":  # (check_seed has its own range) an int past the float range: float() and str() fail
                check_fits_float(name, getattr(self, name))
        if not _is_int(self.max_new_tokens):
            raise TypeError(f"max_new_tokens must be an int, got {number_kind(self.max_new_tokens)}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {short_repr(self.max_new_tokens)}")
        if not _is_real(self.temperature):
            raise TypeError(f"temperature must be a number, got {number_kind(self.temperature)}")
        self.temperature = float(self.temperature)
        if not self.temperature >= 0.0 or self.temperature == float("inf"):  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature={short_repr(self.temperature)} is below MIN_TEMPERATURE={MIN_TEMPERATURE}: "
                             f"logits / temperature would overflow to inf/nan; use temperature=0.0 for greedy decoding")
        if not _is_int(self.top_k):
            raise TypeError(f"top_k must be an int, got {number_kind(self.top_k)}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {short_repr(self.top_k)}")
        if not _is_real(self.top_p):
            raise TypeError(f"top_p must be a number, got {number_kind(self.top_p)}")
        self.top_p = float(self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            self.seed = check_seed(self.seed)
        if isinstance(self.stop, str):  # a lone string is one stop string, as in vLLM and the OpenAI API
            self.stop = (self.stop,)
        if not isinstance(self.stop, (tuple, list)) or not all(isinstance(s, str) for s in self.stop):
            raise TypeError(f"stop must be a tuple of strings, got {short_repr(self.stop)}")
        self.stop = tuple(self.stop)
        if any(s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {short_repr(self.stop)}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.n):
            raise TypeError(f"n must be an int, got {number_kind(self.n)}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {short_repr(self.n)}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def greedy(cls, max_new_tokens: int = 64, **kwargs) -> "SamplingParams":
        """Deterministic argmax decoding: the setting every equivalence test in minillm uses."""
        return cls(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


def check_seed(seed: object) -> int:
    """`seed` as the plain int it holds if torch.Generator.manual_seed accepts it (an int in SEED_RANGE), else
    TypeError/ValueError naming it."""
    if not _is_int(seed):
        raise TypeError(f"seed must be an int or None, got {number_kind(seed)}")
    seed = int.__index__(seed)  # the plain int: an int subclass's comparisons are not consulted
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"seed must be a 64-bit integer in [-2**63, 2**64), got {short_repr(seed)}")
    return seed


def seed_argument(text: str) -> int:
    """A command line's `--seed` (argparse `type=`): an int `check_seed` accepts, or a usage error naming the value
    (argparse adds the flag), before any work; `type=int` alone lets 2**64 through to fail deep in torch, or be
    ignored by a benchmark that never seeds a generator."""
    try:
        return check_seed(int(text))
    except ValueError as e:  # int() of "abc", or out of range
        raise argparse.ArgumentTypeError(str(e) if "64-bit" in str(e) else f"must be an int, got {text!r}") from None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A torch.Generator on `device` seeded with `seed`, or None (use the global RNG) when seed is None.

    subtle: a CUDA generator and a CPU generator with the same seed draw different numbers, so a seeded run repeats
    exactly on the same device type only.
    """
    device = check_device("device", device, allocates=True)
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(check_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# Logits processors: pure functions on (B, V) logits, and tiny callables that carry their one parameter.


def check_logits(logits: object, ndim: int | None = None) -> torch.Tensor:
    """`logits` if it is a floating-point tensor (..., V) (of `ndim` dimensions when given: 2 is (B, V)); a
    TypeError / ValueError naming it otherwise. Host-only: every processor and sampler starts with it."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {tensor_kind(logits)}")
    if (logits.dim() != ndim) if ndim is not None else (logits.dim() == 0):
        raise ValueError(f"logits must have shape {'(B, V)' if ndim == 2 else '(..., V)'}, got {tuple(logits.shape)}")
    return logits


def check_params(params: object) -> SamplingParams:
    """`params` if it is a SamplingParams; a TypeError naming it otherwise."""
    return check_instance("params", params, SamplingParams, "a SamplingParams")


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature: below 1 sharpens the distribution, above 1 flattens it (softmax(z/T))."""
    check_logits(logits)
    temperature = check_float("temperature", temperature, 0.0, include_minimum=False)  # 0 is greedy: no division
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th), set the rest to -inf. k=0 or k>=V: no-op.

    Worked example: logits [1, 3, 2, 3], k=2 -> the 2nd largest value is 3 -> [-inf, 3, -inf, 3].
    """
    check_logits(logits)
    k = check_int("k", k, 0)
    # BEGIN SOLUTION
    V = logits.size(-1)
    if k <= 0 or k >= V:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1): the k-th largest value of each row
    # subtle: compare with the k-th value instead of scattering topk indices, so ties at the cut are all kept and
    # the result does not depend on topk's arbitrary tie order (Hugging Face's TopKLogitsWarper does the same).
    return logits.masked_fill(logits < kth, float("-inf"))
    # END SOLUTION


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", §3.1).

    Keep, in each row, the smallest set of most-likely tokens whose probabilities sum to at least p; set the rest
    to -inf. Equivalently: sort by probability, descending, and drop a token when the mass of the tokens strictly
    before it already reaches p. The most likely token is always kept. p=1: no-op.
    """
    check_logits(logits)
    p = check_float("p", p, 0.0, 1.0, include_minimum=False)
    # BEGIN SOLUTION
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # (B, V) each
    probs = torch.softmax(sorted_logits.float(), dim=-1)  # (B, V), in sorted order
    mass_before = torch.cumsum(probs, dim=-1) - probs  # (B, V): exclusive prefix sum
    drop_sorted = mass_before >= p  # (B, V); position 0 has mass_before 0 < p ...
    drop_sorted[..., 0] = False  # ... unless p is below float32's smallest number and compares as 0: keep it anyway
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # (B, V) back in vocabulary order
    return logits.masked_fill(drop, float("-inf"))
    # END SOLUTION


@dataclass(frozen=True)
class Temperature:
    temperature: float

    def __post_init__(self) -> None:  # checked when built, not at the first token
        check_float("temperature", self.temperature, 0.0, include_minimum=False)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_temperature(logits, self.temperature)


@dataclass(frozen=True)
class TopK:
    k: int

    def __post_init__(self) -> None:
        check_int("k", self.k, 0)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return top_k_filter(logits, self.k)


@dataclass(frozen=True)
class TopP:
    p: float

    def __post_init__(self) -> None:
        check_float("p", self.p, 0.0, 1.0, include_minimum=False)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return top_p_filter(logits, self.p)


def build_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The processors `params` asks for, in the order they apply: temperature, top-k, top-p (as HF and vLLM)."""
    if check_params(params).is_greedy:
        return []
    procs: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        procs.append(Temperature(params.temperature))
    if params.top_k > 0:
        procs.append(TopK(params.top_k))
    if params.top_p < 1.0:
        procs.append(TopP(params.top_p))
    return procs


def _check_processors(processors: object) -> None:
    if not isinstance(processors, (list, tuple)):  # a dict or a tensor would be iterated as processors
        raise TypeError(f"processors must be a list of logits processors, got {type(processors).__name__}")


def apply_processors(logits: torch.Tensor, processors: Sequence[LogitsProcessor]) -> torch.Tensor:
    """Run the processors left to right; each sees the previous one's output."""
    _check_processors(processors)
    for proc in processors:
        logits = proc(logits)
    return logits


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample_next` draws from: softmax of the processed logits, (B, V) float32."""
    check_logits(logits, 2)
    return torch.softmax(apply_processors(logits.float(), build_processors(params)), dim=-1)


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    processors: Sequence[LogitsProcessor] | None = None,
) -> torch.Tensor:
    """The next token of each row: logits (B, V) -> (B,) int64.

    Greedy (temperature 0) is argmax, first index on ties, as `torch.argmax` and HF's greedy search. Otherwise the
    processors run (by default those `params` asks for; pass `processors` to replace them) and exactly one
    `torch.multinomial` draw per row is made from `generator`, so a seeded request repeats token for token.
    """
    check_logits(logits, 2)
    check_params(params)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if processors is not None:
        _check_processors(processors)
    if params.is_greedy:  # extra processors (a banned-token mask, say) still apply before the argmax
        return torch.argmax(apply_processors(logits, processors or ()), dim=-1)  # (B,)
    procs = build_processors(params) if processors is None else processors
    probs = torch.softmax(apply_processors(logits.float(), procs), dim=-1)  # (B, V)
    try:
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B, 1) -> (B,)
    except RuntimeError as exc:  # torch's own message names neither the row nor the settings that produced it
        bad = (~torch.isfinite(probs).all(dim=-1)).nonzero().flatten().tolist()
        raise ValueError(
            f"cannot sample: probabilities of rows {bad or 'all'} are inf/nan or all zero (temperature="
            f"{params.temperature}, top_k={params.top_k}, top_p={params.top_p}; non-finite logits: "
            f"{int((~torch.isfinite(logits)).sum())}): {exc}"
        ) from exc
