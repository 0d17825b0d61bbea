"""Side by side with llama.cpp on the CPU: the same weights, batch-1 decode, one thread, in one run.

What it does, each step skipped when its output is already in the work directory:
  1. fetch the pinned `llama-cpp-python` source distribution from PyPI (`pip download`; or pass `--sdist FILE`),
     which vendors the llama.cpp sources, and unpack it;
  2. build `llama-bench` with cmake (Release, the host's SIMD: `GGML_NATIVE=ON`), a few minutes on two cores;
  3. export `base` as a Hugging Face GPT-2 directory (config.json, model.safetensors, and vocab.json + merges.txt
     recovered from our tokenizer's ranks), and convert it with llama.cpp's own `convert_hf_to_gguf.py` to GGUF files
     in f32, f16 and q8_0, and with llama.cpp's `llama-quantize` (built too) the f32 file to q4_0;
  4. interleave, round by round: `llama-bench -t T -p 0 -n N` on each GGUF (its `tg` test: N tokens decoded one at a
     time at batch 1, from an empty context) and our batch-1 decode of N tokens after a one-token prompt, eager
     (chapter 04's `generate_ids`) and with the fused C++ step (`FusedCPUDecoder`), in float32, on chapter 09's
     int8 and int4 weight-only models (the C++ int8 and int4 GEMVs, beside llama.cpp's q8_0 and q4_0), and with
     chapter 08's speculative decoding on it (chapter 11's `draft-distilled` proposing 4 tokens on its own fused
     step, `base` verifying 5 in one C++ call: `generate_speculative_fused`, the same greedy tokens), at the same
     thread count.
It prints each path's median tok/s over the rounds and ours as a fraction of llama.cpp f32, and with `--json` writes
every round's tok/s and the medians (`minillm.bench.cli.write_report`, with the machine and the command); `quotes`
turns that report into the table and the figures chapters 09 and 13 quote.

Optional and never in CI: it needs cmake, a C++ compiler, network for the sdist (or the file), transformers (a dev
extra) and numpy for the converter. The GGUF's vocabulary is ours (4,096 byte-level tokens); llama.cpp's converter
only knows the pre-tokenizers of published models, so this script names the GPT-4-style split ("llama-bpe", the
regex our tokenizer uses) for it. `llama-bench` times random token ids and never tokenizes text.

The command: `python -m minillm.compile.llamacpp [--work DIR] [--sdist FILE] [--threads 1] [--tokens 128]
[--rounds 3] [--json FILE]` (`--threads`, `--device` and `--json` are every benchmark's, `minillm.bench.cli`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path
from typing import Callable

from minillm.bench.cli import bench_parser, cli_type, start, write_report
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.compile.fused_speculative import generate_speculative_fused
from minillm.compile.fused_step import FusedCPUDecoder
from minillm.core.sampling import SamplingParams
from minillm.compile.llamacpp_build import (OUTTYPES, PINNED, QUANTIZED_TYPES, run_logged, build_llama_bench, convert,
                                            export_hf_dir, fetch_sources, quantize_gguf)
from minillm.core.config import check_float, check_int, check_sequence, reads_report, short_repr
from minillm.core.io import check_output_dir, check_path
from minillm.core.timing import check_repeats, measure
from minillm.kvcache.generate import generate_ids
from minillm.quant.linear import QuantConfig, quantize_model
from minillm.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

TYPES = OUTTYPES + QUANTIZED_TYPES  # f32, f16 and q8_0 from the converter, q4_0 by llama-quantize from the f32 file
# What a report of `main --json` holds, every one quoted (`write_report` adds "cpu").
REPORT_KEYS = ("median_tok_s", "samples", "rounds", "threads", "tokens", "model", "cpu", "llama_cpp")
REF = "llama.cpp f32"  # the path every other one is a fraction of
EAGER, FUSED = "minillm eager (generate_ids)", "minillm fused C++ step"
FUSED_INT8 = "minillm fused C++ step, int8 weights"  # chapter 09's int8 weight-only model, beside llama.cpp's q8_0
FUSED_INT4 = "minillm fused C++ step, int4 weights"  # its int4 group-wise model (groups of 128), beside q4_0
FUSED_SPEC = "minillm fused C++ step, speculative"  # draft-distilled proposes 4 on its fused step, base verifies
SPEC_GAMMA = 4  # chapter 13's γ for the distilled draft (the tour's and `compile.bench`'s)


def llama_bench_tok_s(binary: str | os.PathLike, gguf: str | os.PathLike, threads: int, tokens: int) -> float:
    """llama-bench's mean tok/s for `tg<tokens>` (batch-1 decode from an empty context), 3 repetitions. The files
    must exist and threads and tokens be positive ints; llama-bench's report must hold a positive finite avg_ts. A
    TypeError / ValueError (FileNotFoundError for a missing file) naming the argument otherwise."""
    for name, path in (("binary", binary), ("gguf", gguf)):
        if not check_path(path, name).is_file():
            raise FileNotFoundError(f"{name} {str(path)!r}: no such file")
    threads = check_int("threads", threads)
    tokens = check_int("tokens", tokens)
    out = run_logged([str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "3", "-o",
                "json"])
    try:
        avg_ts = json.loads(out)[0]["avg_ts"]
        if isinstance(avg_ts, bool):  # subtle: float(true) is 1.0, a rate nobody measured
            raise TypeError(f"avg_ts is a bool, {avg_ts}")
        tok_s = float(avg_ts)
    except (ValueError, TypeError, LookupError) as e:
        raise ValueError(f"binary {str(binary)!r} printed no llama-bench JSON report with an avg_ts ({e}): "
                         f"{out[:200]!r}") from e
    if not math.isfinite(tok_s) or tok_s <= 0:
        raise ValueError(f"binary {str(binary)!r} reported avg_ts={tok_s}, not a positive rate")
    return tok_s


def ours_tok_s(run: Callable[[], object], tokens: int, repeats: int = 3) -> float:
    """tok/s of `run` (one decode of `tokens` tokens, a positive int): the median of `repeats` (a positive int)
    timed calls after one warm-up call."""
    if not callable(run):
        raise TypeError(f"run must be a function of no arguments (one decode), got {type(run).__name__}")
    tokens = check_int("tokens", tokens)
    repeats = check_repeats("repeats", repeats)
    return tokens / measure(run, warmup=1, repeats=repeats).median


def build_parser() -> argparse.ArgumentParser:
    # CPU only, like llama-bench here; the same --threads for both sides.
    ap = bench_parser("python -m minillm.compile.llamacpp", __doc__.splitlines()[0], devices=("cpu",), seed=False)
    ap.add_argument("--work", type=cli_type(lambda text: check_path(text, "--work")),  # '' is no folder, not the cwd
                    default=Path.home() / ".cache" / "minillm" / "llamacpp",
                    help="where the sources, the build (reused between runs) and the GGUF files go")
    ap.add_argument("--sdist", type=Path, default=None, help=f"a {PINNED} .tar.gz instead of downloading it")
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded per measurement (llama-bench -n)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = start(ap, argv)
    for name in ("tokens", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    try:  # a file at --work, or no --sdist file: usage errors now, not minutes into the build
        check_output_dir(Path(args.work).expanduser(), "--work")
        if args.sdist is not None and not args.sdist.is_file():
            raise ValueError(f"--sdist must be a {PINNED} .tar.gz file, got {str(args.sdist)!r}: no such file")
    except ValueError as e:
        ap.error(str(e))

    work = Path(args.work).expanduser().resolve()
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # /proc/x, a read-only place: a usage error naming the flag, not a traceback
        ap.error(f"--work {str(work)!r} cannot be made: {e.strerror or e}")
    try:
        tree = fetch_sources(work, args.sdist)
    except ValueError as e:  # a --sdist that is no readable tar, or holds no llama.cpp (a download's is not a flag)
        if args.sdist is None:
            raise
        ap.error(str(e))
    binary = build_llama_bench(tree)
    loaded = load_model("base", args.device, 0)
    model = loaded.model
    hf_dir = export_hf_dir(model, Tokenizer.load(DEFAULT_TOKENIZER_PATH), work / "base-hf")
    ggufs = {t: convert(tree, hf_dir, t, work / f"base-{t}.gguf") for t in OUTTYPES}
    ggufs.update({t: quantize_gguf(tree, ggufs["f32"], t, work / f"base-{t}.gguf") for t in QUANTIZED_TYPES})

    fused = FusedCPUDecoder(model)
    fused_int8 = FusedCPUDecoder(quantize_model(model, QuantConfig("int8")).eval())
    fused_int4 = FusedCPUDecoder(quantize_model(model, QuantConfig("int4")).eval())
    draft = FusedCPUDecoder(load_model("draft-distilled", args.device, 0).model.eval())
    params = SamplingParams.greedy(args.tokens, ignore_eos=True)
    prompt = [0]
    want = fused.generate_ids(prompt, params)
    if generate_speculative_fused(fused, draft, prompt, params, gamma=SPEC_GAMMA)[0] != want:
        raise RuntimeError("speculative decoding on the fused step gave other greedy tokens than the fused step alone")
    ours = {EAGER: lambda: generate_ids(model, prompt, params), FUSED: lambda: fused.generate_ids(prompt, params),
            FUSED_INT8: lambda: fused_int8.generate_ids(prompt, params),
            FUSED_INT4: lambda: fused_int4.generate_ids(prompt, params),
            FUSED_SPEC: lambda: generate_speculative_fused(fused, draft, prompt, params, gamma=SPEC_GAMMA)}
    samples: dict[str, list[float]] = {**{f"llama.cpp {t}": [] for t in TYPES}, **{k: [] for k in ours}}
    for r in range(args.rounds):
        for t, path in ggufs.items():
            samples[f"llama.cpp {t}"].append(llama_bench_tok_s(binary, path, args.threads, args.tokens))
        for name, run in ours.items():
            samples[name].append(ours_tok_s(run, args.tokens))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in samples.items()), flush=True)
    median = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\nmodel: {loaded.label}; {args.threads} thread(s); {args.tokens} tokens decoded at batch 1; "
          f"medians of {args.rounds} interleaved rounds\n")
    print(format_table(median), end="")
    write_report(args.json, {"model": loaded.label, "threads": args.threads, "tokens": args.tokens,
                             "rounds": args.rounds, "llama_cpp": PINNED, "samples": samples, "median_tok_s": median})
    return 0


def _paths(name: str, table: dict) -> list[str]:
    """The keys of `table` (the paths, "llama.cpp f32", "ours fused"...), in order, as plain strs (a str subclass's
    own methods are never called when a table prints them); a TypeError naming `name` for a key that is not a str."""
    for path in table:
        if not isinstance(path, str):
            raise TypeError(f"{name} must be keyed by path names (str), got a key of type {type(path).__name__}")
    return [str.__str__(path) for path in table]


def check_rates(name: str, rates: object) -> dict[str, float]:
    """`rates` (path -> median tok/s) if it is a dict of positive finite numbers holding llama.cpp f32's (`REF`,
    what every other path is a fraction of); a TypeError / ValueError naming `name` and the entry otherwise, not a
    KeyError or a division by zero in the middle of a table."""
    if not isinstance(rates, dict):
        raise TypeError(f"{name} must be a dict of path -> tok/s, got {type(rates).__name__} {short_repr(rates)}")
    if REF not in rates:
        raise ValueError(f"{name} must hold {REF!r}, the rate every other path is a fraction of; it has "
                         f"{_paths(name, rates)}")
    return {path: check_float(f"{name}[{path!r}]", rate, 0.0, include_minimum=False)
            for path, rate in zip(_paths(name, rates), rates.values())}


def check_samples(name: str, samples: object) -> dict[str, list[float]]:
    """`samples` (path -> one tok/s per round) if it is a dict holding llama.cpp f32 (`REF`) whose values are
    non-empty lists of positive finite numbers, one per round, all as long; a TypeError / ValueError naming `name`
    and the entry otherwise."""
    if not isinstance(samples, dict):
        raise TypeError(f"{name} must be a dict of path -> tok/s per round, got {type(samples).__name__} "
                        f"{short_repr(samples)}")
    if REF not in samples:
        raise ValueError(f"{name} must hold {REF!r}'s rounds; it has {_paths(name, samples)}")
    rounds, plain = None, {}
    for path, values in zip(_paths(name, samples), samples.values()):
        where = f"{name}[{path!r}]"
        values = check_sequence(where, values)
        rounds = len(values) if rounds is None else rounds
        if len(values) != rounds:
            raise ValueError(f"{where} has {len(values)} rounds, the paths before it {rounds}: one tok/s per round")
        plain[path] = [check_float(f"{where}[{r}]", rate, 0.0, include_minimum=False) for r, rate in enumerate(values)]
    return plain


def format_table(median: dict[str, float]) -> str:
    """The Markdown table of each path's tok/s (`median`: path -> tok/s, holding llama.cpp f32) and its fraction of
    llama.cpp f32's, one row per path in the dict's order, ending with a newline (`check_rates` first)."""
    plain = check_rates("median", median)  # the plain floats: a caller's float subclass is never formatted
    ref = plain[REF]
    return markdown_table(["path", "tok/s", "of llama.cpp f32"],
                          [[k, f"{v:,.0f}", f"{100 * v / ref:.0f}%"] for k, v in plain.items()])


def format_rounds(samples: dict[str, list[float]]) -> str:
    """The Markdown table of every round's tok/s (`samples`: path -> one tok/s per round), one row per round
    (`check_samples` first)."""
    plain = check_samples("samples", samples)  # the plain floats: a caller's float subclass is never formatted
    n = len(plain[REF])
    return markdown_table(["round", *plain], [[str(r + 1), *(f"{v[r]:,.0f}" for v in plain.values())]
                                              for r in range(n)], "r" * (len(plain) + 1))


@reads_report
def quotes(report: dict) -> dict[str, str]:
    """What the chapter texts quote from a report of `main --json`: the medians' table ("table") and the rounds'
    ("per_round"); llama.cpp's tok/s per type (`f32_tok_s`, `f16_tok_s`, `q8_0_tok_s`, `q4_0_tok_s`) and each
    other type over its f32 (`f16_vs_f32`, "1.90x"); ours as a fraction of llama.cpp f32 (`fused_of_f32`, `eager_of_f32`, "84%"), their
    range over the rounds, each round's ours over the same round's llama.cpp f32 (`..._min`, `..._max`); the fused
    step over the eager generator (`fused_vs_eager`); the int8 fused step's figures (`fused_int8_...` as above, and
    `fused_int8_vs_q8_0`, `fused_int8_vs_fused`) and the int4 one's (`fused_int4_...`, `fused_int4_vs_q4_0`,
    `fused_int4_vs_fused`, `fused_int4_vs_int8`) and the speculative one's (`fused_spec_...`, `fused_spec_vs_fused`)
    when the run has them; llama.cpp f32's range over the rounds (`f32_min`,
    `f32_max`); and the run's settings (`rounds`, `threads`, `tokens`, `model`, `cpu`, `llama_cpp`).
    A report that lacks any of these (or holds no rate where one is due) is a TypeError / ValueError naming it."""
    missing = [key for key in REPORT_KEYS if key not in report]
    if missing:
        raise ValueError(f"report must be a report of `main --json`, holding {list(REPORT_KEYS)}; it lacks {missing}")
    median = check_rates("report['median_tok_s']", report["median_tok_s"])
    samples = check_samples("report['samples']", report["samples"])
    needed = [f"llama.cpp {t}" for t in TYPES] + [EAGER, FUSED] + [p for p in (FUSED_INT8, FUSED_INT4, FUSED_SPEC)
                                                                     if p in median]
    for name, d in (("report['median_tok_s']", median), ("report['samples']", samples)):
        lacking = [path for path in needed if path not in d]
        if lacking:
            raise ValueError(f"{name} lacks the paths {lacking}; it has {sorted(d)}")
    ref = median[REF]
    out = {"table": format_table(median), "per_round": format_rounds(samples)}
    for t in TYPES:
        out[f"{t}_tok_s"] = f"{median[f'llama.cpp {t}']:,.0f}"
        if t != "f32":
            out[f"{t}_vs_f32"] = f"{median[f'llama.cpp {t}'] / ref:.2f}x"
    paths = [("fused", FUSED), ("eager", EAGER)] + [(k, p) for k, p in (("fused_int8", FUSED_INT8),
                                                                         ("fused_int4", FUSED_INT4),
                                                                         ("fused_spec", FUSED_SPEC)) if p in median]
    for key, path in paths:
        out[f"{key}_tok_s"] = f"{median[path]:,.0f}"
        out[f"{key}_of_f32"] = f"{100 * median[path] / ref:.0f}%"
        per_round = [100 * a / b for a, b in zip(samples[path], samples[REF])]
        out[f"{key}_of_f32_min"], out[f"{key}_of_f32_max"] = f"{min(per_round):.0f}%", f"{max(per_round):.0f}%"
    out["fused_vs_eager"] = f"{median[FUSED] / median[EAGER]:.2f}x"
    if FUSED_INT8 in median:  # int8 against llama.cpp's q8_0 (8-bit weights, 32-wide blocks), and over our f32 step
        out["fused_int8_vs_q8_0"] = f"{median[FUSED_INT8] / median['llama.cpp q8_0']:.2f}x"
        out["fused_int8_vs_fused"] = f"{median[FUSED_INT8] / median[FUSED]:.2f}x"
    if FUSED_INT4 in median:  # int4 against llama.cpp's q4_0 (4-bit weights, 32-wide blocks), and over our int8 step
        out["fused_int4_vs_q4_0"] = f"{median[FUSED_INT4] / median['llama.cpp q4_0']:.2f}x"
        out["fused_int4_vs_fused"] = f"{median[FUSED_INT4] / median[FUSED]:.2f}x"
        if FUSED_INT8 in median:
            out["fused_int4_vs_int8"] = f"{median[FUSED_INT4] / median[FUSED_INT8]:.2f}x"
    if FUSED_SPEC in median:  # speculation on the fused step over the fused step alone, same rounds
        out["fused_spec_vs_fused"] = f"{median[FUSED_SPEC] / median[FUSED]:.2f}x"
    out["f32_min"], out["f32_max"] = f"{min(samples[REF]):,.0f}", f"{max(samples[REF]):,.0f}"
    for key in ("rounds", "threads", "tokens", "model", "cpu", "llama_cpp"):
        out[key] = str(report[key])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
