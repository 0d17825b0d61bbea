"""Seeded synthetic workloads: Poisson arrivals, prompt and output lengths drawn from simple distributions.

One generator (`make_workload`) and named presets on top of it (`workload("mixed", n, seed, rate)`), shared by
chapter 06's benchmarks, chapter 07 (disaggregation) and chapter 15 (serving load generator), so every chapter
measures on the same requests; `eval_prompts` gives single prompts of chosen lengths from the same text. A workload is a list of `WorkloadRequest` (arrival offset in seconds,
prompt ids, sampling params with a fixed output length: `ignore_eos=True`, so the work is known in advance and the
comparison between engines is on equal terms). What it leaves out: real traces (ShareGPT, Azure) and bursts.

Length distributions are written as short strings (or built with `LengthDist`):
    "fixed:64"                 every request 64 tokens
    "uniform:16:128"           uniform integer in [16, 128]
    "lognormal:48:0.8:8:200"   lognormal with median 48 and sigma 0.8, clipped to [8, 200] (long-tailed, like chat)
    "choice:8,32,128"          one of the listed lengths, equally likely
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from minillm.core.config import check_choice, check_int, short_repr
from minillm.core.sampling import SamplingParams
from minillm.gpt.dataset import default_eval_tokens

DIST_KINDS = ("fixed", "uniform", "lognormal", "choice")


@dataclass(frozen=True)
class LengthDist:
    kind: str  # one of DIST_KINDS
    args: tuple[float, ...] = field(default_factory=tuple)  # fixed: (n,); uniform: (lo, hi); lognormal: (median,
    #   sigma, lo, hi); choice: (n1, n2, ...)

    def __post_init__(self) -> None:
        need = {"fixed": 1, "uniform": 2, "lognormal": 4}
        object.__setattr__(self, "kind", check_choice("length distribution kind", self.kind, DIST_KINDS))  # frozen
        if self.kind in need and len(self.args) != need[self.kind]:
            raise ValueError(f"{self.kind} needs {need[self.kind]} numbers, got {self.args!r}")
        if self.kind == "choice" and not self.args:
            raise ValueError("choice needs at least one length")
        ints = self.args if self.kind != "lognormal" else (self.args[0], self.args[2], self.args[3])
        if any(a < 1 for a in ints):
            raise ValueError(f"lengths must be >= 1, got {self.kind}:{self.args}")
        if self.kind == "uniform" and self.args[0] > self.args[1]:
            raise ValueError(f"uniform needs lo <= hi, got {self.args}")
        if self.kind == "lognormal" and (self.args[1] < 0 or self.args[2] > self.args[3]):
            raise ValueError(f"lognormal needs sigma >= 0 and lo <= hi, got {self.args}")

    @classmethod
    def parse(cls, spec: "str | int | LengthDist") -> "LengthDist":
        if isinstance(spec, LengthDist):
            return spec
        if isinstance(spec, int) and not isinstance(spec, bool):
            return cls("fixed", (spec,))
        if not isinstance(spec, str):
            raise TypeError(f"a length distribution is a string like 'uniform:16:128', got {spec!r}")
        kind, _, rest = spec.partition(":")
        sep = "," if kind == "choice" else ":"
        try:
            args = tuple(float(x) for x in rest.split(sep)) if rest else ()
        except ValueError:
            raise ValueError(f"cannot parse length distribution {spec!r}") from None
        return cls(kind, args)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        a = self.args
        if self.kind == "fixed":
            x = np.full(n, a[0])
        elif self.kind == "uniform":
            x = rng.integers(int(a[0]), int(a[1]) + 1, size=n)
        elif self.kind == "lognormal":
            x = np.clip(np.round(rng.lognormal(math.log(a[0]), a[1], size=n)), a[2], a[3])
        else:
            x = rng.choice(np.asarray(a), size=n)
        return [int(v) for v in x]

    @property
    def max(self) -> int:
        return int(max(self.args) if self.kind in ("fixed", "choice") else self.args[-1])


@dataclass
class WorkloadRequest:
    request_id: str
    arrival_time: float  # seconds after the start of the run (0 for every request of an offline workload)
    prompt_token_ids: list[int]
    params: SamplingParams  # max_new_tokens = the output length; ignore_eos, so exactly that many are generated

    @property
    def output_len(self) -> int:
        return self.params.max_new_tokens


def make_workload(
    n: int,
    rate: float = math.inf,
    prompt_len_dist: "str | int | LengthDist" = "uniform:16:128",
    output_len_dist: "str | int | LengthDist" = "lognormal:48:0.8:8:200",
    seed: int = 0,
    vocab_size: int = 4096,
    token_source: Sequence[int] | None = None,
    temperature: float = 0.0,
) -> list[WorkloadRequest]:
    """`n` requests with Poisson arrivals at `rate` requests/s (inf: all at t=0, an offline batch).

    Prompts are windows of `token_source` (e.g. `minillm.gpt.dataset.default_eval_tokens(...)`, real text) when given,
    else uniform random ids below `vocab_size`. Greedy by default; with temperature > 0 each request gets its own
    seed (seed * 100003 + index), so the run repeats exactly. Same arguments, same workload, on every machine.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int, got {short_repr(n)}")
    if not (isinstance(rate, (int, float)) and rate > 0):
        raise ValueError(f"rate must be a positive number of requests/s (math.inf for offline), got {short_repr(rate)}")
    if type(seed) is not int or not 0 <= seed < 2**63:  # numpy's generator refuses a negative seed in its own words
        raise ValueError(f"seed must be an int in [0, 2**63) (the workload's generator), got {short_repr(seed)}")
    pdist, odist = LengthDist.parse(prompt_len_dist), LengthDist.parse(output_len_dist)
    rng = np.random.default_rng(seed)
    if math.isinf(rate):
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))  # Poisson process: exponential gaps
        arrivals -= arrivals[0]  # the first request arrives at t=0
    plens, olens = pdist.sample(rng, n), odist.sample(rng, n)
    source = None if token_source is None else np.asarray(token_source, dtype=np.int64)
    if source is not None and len(source) <= pdist.max:
        raise ValueError(f"token_source has {len(source)} tokens, fewer than the longest prompt {pdist.max}")
    out = []
    for i in range(n):
        if source is not None:
            start = int(rng.integers(0, len(source) - plens[i]))
            prompt = source[start : start + plens[i]].tolist()
        else:
            prompt = rng.integers(0, vocab_size, size=plens[i]).tolist()
        params = SamplingParams(
            max_new_tokens=olens[i], temperature=temperature, ignore_eos=True,
            seed=None if temperature == 0 else seed * 100003 + i,
        )
        out.append(WorkloadRequest(f"req-{i}", float(arrivals[i]), [int(t) for t in prompt], params))
    return out


@dataclass(frozen=True)
class Preset:
    prompt_len: str  # a LengthDist spec
    output_len: str  # a LengthDist spec
    real_text: bool  # prompts are windows of the validation text (else random ids below the vocabulary size)
    about: str  # who uses it, and why this shape


PRESETS: dict[str, Preset] = {
    "mixed": Preset("uniform:16:96", "lognormal:40:0.8:8:160", True,
                    "chapter 06: mixed prompts, long-tailed outputs (chat-like); throughput and the frontier"),
    "prefill-heavy": Preset("uniform:160:224", "fixed:32", False,
                            "chapter 07: long prompts, short outputs; prompts keep arriving while others decode"),
    "small-pool": Preset("uniform:4:64", "uniform:4:40", False,
                         "chapter 06: agreement with each request alone through a pool small enough to preempt"),
    "decodes": Preset("uniform:8:16", "fixed:60", False,
                      "chapter 06: short prompts, long outputs; the running decodes a long prompt interrupts"),
}
TEXT_TOKENS = 20_000  # validation tokens the real-text presets draw their prompt windows from


def workload(name: str, n: int, seed: int = 0, rate: float = math.inf, vocab_size: int = 4096,
             prompt_len: "str | int | None" = None, output_len: "str | int | None" = None) -> list[WorkloadRequest]:
    """`n` requests of preset `name` (see PRESETS), arriving at `rate`/s (inf: offline); lengths may be overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown workload preset {name!r}; presets: {sorted(PRESETS)}")
    p = PRESETS[name]
    source = default_eval_tokens(TEXT_TOKENS).tolist() if p.real_text else None
    return make_workload(n, rate, p.prompt_len if prompt_len is None else prompt_len,
                         p.output_len if output_len is None else output_len, seed=seed, vocab_size=vocab_size,
                         token_source=source)


def eval_prompts(lengths: Sequence[int], vocab_size: int, real_text: bool, seed: int = 0) -> list[list[int]]:
    """One prompt per length: consecutive stretches of the validation text (`real_text`, for trained weights), else
    seeded random ids below `vocab_size` (a random-init model reads noise either way)."""
    if real_text:
        tokens = default_eval_tokens(sum(lengths)).tolist()
        starts = np.cumsum([0, *lengths])
        return [tokens[a:b] for a, b in zip(starts[:-1], starts[1:])]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def check_load_list(loads: object, name: str = "loads", most: int | None = None) -> list[int]:
    """`loads` (the numbers of requests a benchmark runs at once, one measurement each) as a list if it is a
    non-empty list or tuple of positive ints, each at most `most` when given; a TypeError/ValueError naming `name`
    (and the entry) otherwise, checked before any model loads (a load of 2**40 would build its requests until memory
    ran out)."""
    if most is not None:
        most = check_int("most", most)
    if isinstance(loads, (str, bytes)) or not isinstance(loads, (list, tuple)) or not loads:
        raise ValueError(f"{name} must be a non-empty list of positive ints, got {short_repr(loads)}")
    plain = []  # the plain ints: an int subclass's own comparisons are not consulted
    for i, load in enumerate(loads):
        load = check_int(f"{name}[{i}]", load)
        if most is not None and load > most:
            raise ValueError(f"{name}[{i}] must be at most {most} requests at once, got {load}")
        plain.append(load)
    return plain
