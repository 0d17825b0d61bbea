"""Our server beside llama.cpp's `llama-server`: the same model, the same prompts, the same load, in one run.

What it does, each build step skipped when its output is already in the work directory (chapter 13's, shared):
  1. fetch the pinned `llama-cpp-python` sdist and unpack its vendored llama.cpp (`minillm.compile.llamacpp_build`,
     shared with chapter 13);
  2. build `llama-server` with cmake (Release, the host's SIMD, no web UI, no curl/openssl: the build never reaches
     the network), a few minutes on two cores;
  3. export `base` as a Hugging Face GPT-2 directory and convert it to GGUF (f32, and q8_0 with `--types`);
  4. start both servers as child processes on free loopback ports: `python -m minillm serve` and `llama-server`
     on the f32 GGUF (one more llama-server per extra type), each waited for on /health for a bounded time and
     killed with its process group at the end whatever happens;
  5. check that they serve the same model: `/tokenize` on every prompt must give our tokenizer's ids, then a few
     greedy completions (temperature 0, the same prompt text, 16 tokens, ignore_eos) must mostly agree, as text
     from both servers' /v1/completions and as token ids (llama-server's /completion vs our engine in this
     process). Reported, not asserted: the two sum floating point in different orders, so a near-tie between two
     logits can go either way and the rest of that completion differs;
  6. run chapter 15's load generator (`minillm.serve.loadgen.run_benchmark`, streamed /v1/completions, no
     retries; raw httpx by default, see below) with one workload against each server in turn, interleaved per
     load level (ours, then llama.cpp, at concurrency 1, then both at 4, ...; and at Poisson rates with `--rates`),
     and print output throughput, TTFT/TPOT/ITL p50/p90/p99 and goodput at the SLO as a Markdown table.

How it is made fair: the same weights (the GGUF is converted from `base`'s own tensors, f32 as ours), the same
prompt texts and output lengths (one seeded workload, ignore_eos so every request generates exactly its tokens,
greedy), the same number of compute threads (`torch.set_num_threads(T)` in our server, `--threads T
--threads-batch T` for llama-server), the same number of concurrent sequences (our `--max-num-seqs S`,
llama-server's `-np S` slots with `-c S*256`, 256 tokens each, base's context) and the same step budget (our
`--max-num-batched-tokens 512`, llama-server's `-b 512 -ub 512`), each server in its own process with the client
in a third, and the same load generator for both, measured from outside over HTTP. What would tilt it is turned
off: llama-server's prompt cache (`--no-cache-prompt`, `--cache-ram 0`: the workload is sent once per load level,
so a cached prompt would skip its prefill from the second level on) and our prefix cache (off by default).
llama-server's tokenizer settings are overridden to ours: the converter leaves BOS/EOS unset, and llama.cpp
would then prepend a BOS (token 11) to every prompt and treat token 11 as end of text (and, with ignore_eos, ban
it), so it runs with `add_bos_token=false` and `<|endoftext|>` as BOS/EOS (`--override-kv`). Both servers share
the cores with the client, so the client's own CPU time is in both sides' numbers alike; the servers not being
measured sit idle (under 1% of a core).

The client is the load generator's raw httpx one by default (`--backend http`), not the openai client: this
llama-server closes the connection after every streamed response while its headers say keep-alive (its chunked
content provider returns false at the end of a stream, which cpp-httplib takes as a failed write), so a client
that pools connections (openai's, which reads each stream to its end and returns the connection to the pool) now
and then sends its next request on a connection the server is closing and gets "Server disconnected without
sending a response": with retries off, about one request in a hundred or two failed that way here. The httpx
backend stops reading at `[DONE]`, before the stream's last (empty) chunk, so httpx closes the connection instead
of pooling it, for both servers alike: no request failed that way in any run here.

Optional and never in CI: it needs cmake, a C++ compiler, network for the sdist (or `--sdist FILE`), and
transformers + numpy for the converter. Everything listens on 127.0.0.1 only.

The command: `python -m minillm.serve.peer [--work DIR] [--sdist FILE] [--threads 1] [--slots 16]
[--concurrencies 1,4,16] [--rates 4,8,16] [--num-prompts 32] [--output-len 64] [--slo-ttft-ms 500]
[--slo-tpot-ms 30] [--types f32,q8_0] [--backend http] [--llama-no-repack] [--json FILE] [--no-records]`
(`--threads`, `--device`, `--seed` and `--json` are every benchmark's, `minillm.bench.cli`; one thread by default:
on a two-core machine it leaves a core for the client). `quotes(report)` turns a saved report into the table and
numbers chapter 15's text shows (`minillm.course.results`). The default SLO, TTFT <= 500 ms and TPOT <= 30 ms, is
sized for `base` on two cores: unloaded, both servers answer in about 30 ms and then take 1-5 ms a token, so it
allows a 16-way batch's prefill and decode (about 450 ms and 12-25 ms at 16 in flight) but not a queue that keeps
growing; every request's chunk times are in the JSON (unless `--no-records`), so goodput at another SLO can be
recomputed from it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from minillm.bench.cli import bench_parser, cpu_description, start, write_report
from minillm.bench.tables import markdown_table
from minillm.bench.models import load_model
from minillm.compile.llamacpp_build import PINNED, build_target, convert, export_hf_dir, fetch_sources
from minillm.core.config import check_instance, reads_report, short_repr
from minillm.core.corpus import SEPARATOR
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.serve.loadgen import (BACKENDS, DEFAULT_INPUT_LEN, SLO, make_workload, parse_len_range, parse_rates,
                                   run_benchmark)
from minillm.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

MODEL = "base"  # the shipped model both servers serve
CONTEXT = 256  # tokens per sequence: base's block_size, and each llama-server slot's share of -c
BLOCK_SIZE = 16  # our KV block (EngineConfig's default)
STEP_TOKENS = 512  # tokens per step: our max_num_batched_tokens and llama-server's -b/-ub
AGREE_TOKENS = 16  # tokens of each agreement completion
TYPES = ("f32", "f16", "q8_0")
OURS = "minillm"


# ============================================================================================ the two servers


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's pick); the server binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def llama_server_command(binary: Path, gguf: Path, port: int, threads: int, slots: int,
                         eos_id: int, repack: bool = True) -> list[str]:
    """llama-server on `gguf`, loopback only, with the settings the module docstring explains; `repack=False`
    adds `--no-repack` (quantized weights stay in the file's layout, see `--llama-no-repack`)."""
    overrides = f"tokenizer.ggml.add_bos_token=bool:false,tokenizer.ggml.bos_token_id=int:{eos_id}," \
                f"tokenizer.ggml.eos_token_id=int:{eos_id}"
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", MODEL,
            "--threads", str(threads), "--threads-batch", str(threads), "-np", str(slots), "-c", str(slots * CONTEXT),
            "--no-kv-unified", "-b", str(STEP_TOKENS), "-ub", str(STEP_TOKENS), "--no-cache-prompt", "--cache-ram",
            "0", "--no-webui", "--offline", "--fit", "off", "--override-kv", overrides] + ([] if repack else
                                                                                           ["--no-repack"])


def minillm_server_command(port: int, threads: int, slots: int, engine_core: str = "process") -> list[str]:
    """`minillm serve` of `base` with as many sequences and as big a step as llama-server gets, KV for them all."""
    num_blocks = max(512, math.ceil(slots * CONTEXT / BLOCK_SIZE))
    return [sys.executable, "-m", "minillm", "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--max-num-seqs", str(slots), "--max-num-batched-tokens", str(STEP_TOKENS),
            "--num-blocks", str(num_blocks), "--engine-core", engine_core]


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the process group (our server drains, llama-server exits), then SIGKILL after `grace` s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(grace)


@contextlib.contextmanager
def launched(name: str, cmd: list[str], port: int, log: Path, timeout: float) -> Iterator[str]:
    """Start `cmd` in its own process group (output to `log`), wait until GET /health answers 200 (at most
    `timeout` s; a process that exits first fails at once, quoting its log) and yield its base URL; on leaving,
    however it is left, the group is terminated and then killed."""
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} before it was ready; the end of "
                                   f"{log}:\n{log.read_text(errors='replace')[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not answer {url}/health with 200 within {timeout} s; see {log}")
            time.sleep(0.2)
        yield url
    finally:
        _stop(proc)


# ============================================================================================ same model?


def _check_url(name: str, url: object) -> str:
    """A server's base URL: a str starting with http:// or https://."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{name} must be a server's base URL like 'http://127.0.0.1:8080', got {short_repr(url)}")
    return str.__str__(url)


def _check_prompts(prompts: object) -> list[str]:
    """A non-empty list (or tuple) of prompt strings."""
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"prompts must be a non-empty list of str, got {short_repr(prompts)}")
    return list(prompts)


def _check_runs(runs: object) -> list[dict[str, Any]]:
    """`run_all`'s runs: a list of dicts, each with a "load", a "server" and a "report" holding "metrics"."""
    if not isinstance(runs, (list, tuple)):
        raise TypeError(f"runs must be a list of run records, got {type(runs).__name__} {short_repr(runs)}")
    for i, run in enumerate(runs):
        if (not isinstance(run, dict) or not {"load", "server", "report"} <= set(run)
                or not isinstance(run["report"], dict) or not isinstance(run["report"].get("metrics"), dict)):
            raise ValueError(f"runs[{i}] must be a run record with 'load', 'server' and a 'report' holding "
                             f"'metrics', got {short_repr(run)}")
    return list(runs)


def check_tokenization(url: str, prompts: Sequence[str], tokenizer: Any) -> dict[str, Any]:
    """llama-server's /tokenize of each prompt against our tokenizer's ids; with add_special as its completions
    use it, so a BOS it would prepend shows up as a mismatch."""
    url = _check_url("url", url)
    prompts = _check_prompts(prompts)
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"tokenizer must have an encode(text) method, got {type(tokenizer).__name__}")
    same, mismatches = 0, []
    for i, text in enumerate(prompts):
        theirs = httpx.post(url + "/tokenize", json={"content": text, "add_special": True}, timeout=30.0)
        theirs.raise_for_status()
        ids, ours = theirs.json()["tokens"], tokenizer.encode(text)
        at = _first_difference(ours, ids)
        if at is None:
            same += 1
        else:
            mismatches.append({"prompt": i, "first_difference": at, "ours": ours[at:at + 5], "theirs": ids[at:at + 5],
                               "lengths": [len(ours), len(ids)]})
    return {"prompts": len(prompts), "identical": same, "mismatches": mismatches}


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first index where the sequences differ (the shorter one's length if one is a prefix); None if equal."""
    if list(a) == list(b):
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _complete_text(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60.0)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def check_agreement(ours_url: str, theirs_url: str, prompts: Sequence[str], llm: Any,
                    max_tokens: int = AGREE_TOKENS) -> dict[str, Any]:
    """Greedy completions of `prompts` from both servers: identical texts (/v1/completions of each) and identical
    token ids (llama-server's /completion with return_tokens vs `llm`, our engine, in this process)."""
    ours_url, theirs_url = _check_url("ours_url", ours_url), _check_url("theirs_url", theirs_url)
    prompts = _check_prompts(prompts)
    check_instance("llm", llm, LLM, "our engine, an LLM")
    params = SamplingParams.greedy(max_tokens, ignore_eos=True)
    outs = llm.generate(list(prompts), params)
    rows = []
    for i, prompt in enumerate(prompts):
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "return_tokens": True, "cache_prompt": False}
        response = httpx.post(theirs_url + "/completion", json=body, timeout=60.0)
        response.raise_for_status()
        native = response.json()
        text_ours, text_theirs = _complete_text(ours_url, prompt, max_tokens), _complete_text(theirs_url, prompt,
                                                                                              max_tokens)
        ours_ids = outs[i].output_token_ids
        rows.append({"prompt": i, "prompt_tokens_ours": len(outs[i].prompt_token_ids),
                     "prompt_tokens_theirs": native.get("tokens_evaluated"),
                     "ids_ours": ours_ids, "ids_theirs": native.get("tokens"),
                     "ids_first_difference": _first_difference(ours_ids, native.get("tokens") or []),
                     "text_ours": text_ours, "text_theirs": text_theirs,
                     "text_identical": text_ours == text_theirs})
    n = len(rows)
    same_ids = sum(r["ids_first_difference"] is None for r in rows)
    same_text = sum(r["text_identical"] for r in rows)
    return {"completions": n, "max_tokens": max_tokens, "identical_ids": same_ids, "identical_texts": same_text,
            "identical_ids_fraction": same_ids / n, "identical_texts_fraction": same_text / n, "rows": rows}


# ============================================================================================ the table


def _triple(stats: dict[str, float] | None) -> str:
    return "-" if not stats else " / ".join(f"{stats[q]:.1f}" for q in ("p50", "p90", "p99"))


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    """One Markdown row per (load level, server), latencies p50 / p90 / p99 in ms."""
    rows = []
    for run in _check_runs(runs):
        m = run["report"]["metrics"]
        rows.append([str(run["load"]), run["server"], f"{m['completed']}/{m['completed'] + m['failed']}",
                     f"{m['output_throughput']:.0f}", f"{m['request_throughput']:.2f}", _triple(m["ttft_ms"]),
                     _triple(m["tpot_ms"]), _triple(m["itl_ms"]), f"{m['goodput']:.2f}",
                     f"{100 * m['slo_attainment']:.0f}%"])
    return markdown_table(["load", "server", "ok", "out tok/s", "req/s", "TTFT ms p50/p90/p99", "TPOT ms p50/p90/p99",
                           "ITL ms p50/p90/p99", "goodput req/s", "SLO met"], rows, "llrrrlllrr")


def _load_key(load: str) -> str:
    """"c1" for the load "c=1", "r8" for "8 req/s": the names `quotes` gives a load level's values."""
    return "c" + load.removeprefix("c=") if load.startswith("c=") else "r" + load.removesuffix(" req/s")


def _server_key(server: str) -> str:
    """"ours" for our server, "f32" for "llama.cpp f32"."""
    return "ours" if server == OURS else server.removeprefix("llama.cpp ")


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What chapter 15's text quotes from a saved report (`minillm.course.results`): the table "runs"
    (`format_table`), and single values: the machine ("cpu", "date"), the workload ("num_prompts", "output_len",
    "slots", "slo_ttft_ms", "slo_tpot_ms"), per llama.cpp type ("f32", "q8_0") how
    many prompts /tokenize gave our ids ("TYPE_tokenize" = "64 of 64") and how many greedy completions matched
    ("TYPE_agree"), and per load level (`_load_key`) and server (`_server_key`: "ours", "f32") its "..._tok_s",
    "..._goodput", "..._slo" and its TTFT, TPOT and ITL percentiles ("..._ttft_p50", "..._tpot_p90", "..._itl_p99"),
    with for each llama.cpp type our output tokens/s and goodput over its own ("LOAD_TYPE_tok_ratio" = "1.55x",
    "LOAD_TYPE_goodput_ratio")."""
    w = report["workload"]
    out = {"runs": format_table(report["runs"]), "cpu": report["cpu"], "date": report["date"],
           "num_prompts": str(w["num_prompts"]), "output_len": str(w["output_len"]), "slots": str(report["slots"]),
           "slo_ttft_ms": f"{report['slo_ms']['ttft']:g} ms", "slo_tpot_ms": f"{report['slo_ms']['tpot']:g} ms"}
    for name, tok in report["tokenization"].items():
        agree = report["agreement"][name]
        out[f"{_server_key(name)}_tokenize"] = f"{tok['identical']} of {tok['prompts']}"
        out[f"{_server_key(name)}_agree"] = f"{agree['identical_ids']} of {agree['completions']}"
    by_load: dict[str, dict[str, dict[str, Any]]] = {}
    for run in report["runs"]:
        m = run["report"]["metrics"]
        by_load.setdefault(run["load"], {})[run["server"]] = m
        key = f"{_load_key(run['load'])}_{_server_key(run['server'])}"
        out |= {f"{key}_tok_s": f"{m['output_throughput']:.0f}", f"{key}_goodput": f"{m['goodput']:.2f}",
                f"{key}_slo": f"{100 * m['slo_attainment']:.0f}%"}
        for stat in ("ttft", "tpot", "itl"):  # as the table prints them
            out |= {f"{key}_{stat}_{q}": f"{m[f'{stat}_ms'][q]:.1f} ms" for q in ("p50", "p90", "p99")}
    for load, servers in by_load.items():
        ours = servers[OURS]
        for name, m in servers.items():
            if name != OURS:
                key = f"{_load_key(load)}_{_server_key(name)}"
                out[f"{key}_tok_ratio"] = f"{ours['output_throughput'] / m['output_throughput']:.2f}x"
                out[f"{key}_goodput_ratio"] = f"{ours['goodput'] / m['goodput']:.2f}x" if m["goodput"] else "inf"
    return out


def ratios(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per load level: our output throughput over each llama-server's."""
    out: dict[str, dict[str, float]] = {}
    by_load: dict[str, dict[str, float]] = {}
    for run in _check_runs(runs):
        by_load.setdefault(run["load"], {})[run["server"]] = run["report"]["metrics"]["output_throughput"]
    for load, servers in by_load.items():
        ours = servers.get(OURS)
        out[load] = {name: ours / tput for name, tput in servers.items() if name != OURS and ours and tput}
    return out


# ============================================================================================ the command


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must list integers >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = bench_parser("python -m minillm.serve.peer", __doc__.splitlines()[0], devices=("cpu",))
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "minillm" / "llamacpp",
                    help="where the sources, the build, the GGUF files and the server logs go (chapter 13's)")
    ap.add_argument("--sdist", type=Path, default=None, help=f"a {PINNED} .tar.gz instead of downloading it")
    ap.add_argument("--types", default="f32", help=f"GGUF types llama-server runs, comma list of {TYPES} "
                                                    "(default f32: the same numbers as ours)")
    ap.add_argument("--engine-core", default="process", choices=("process", "thread"),
                    help="where our server runs its engine core (default: a process of its own)")
    ap.add_argument("--slots", type=int, default=16, help="concurrent sequences: our --max-num-seqs, llama-server's "
                                                          "-np (default 16)")
    ap.add_argument("--concurrencies", default="1,4,16", help="closed-loop load levels: requests in flight "
                                                              "(default 1,4,16; '' for none)")
    ap.add_argument("--rates", default="", help="open-loop load levels: Poisson request rates in req/s "
                                                "(comma list; default none)")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per run (default 32)")
    ap.add_argument("--input-len", default=f"{DEFAULT_INPUT_LEN[0]}:{DEFAULT_INPUT_LEN[1]}",
                    help="prompt tokens, N or LO:HI (default %(default)s)")
    ap.add_argument("--output-len", type=int, default=64, help="tokens generated per request (default 64)")
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0, help="TTFT bound for goodput (default 500)")
    ap.add_argument("--slo-tpot-ms", type=float, default=30.0, help="TPOT bound for goodput (default 30)")
    ap.add_argument("--agree-prompts", type=int, default=8, help="greedy completions compared (default 8)")
    ap.add_argument("--backend", default="http", choices=BACKENDS,
                    help="the load generator's client (default http: raw httpx; see the module docstring on openai)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    ap.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for each /health")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="run llama-server with --no-repack: quantized weights keep the file's layout instead of "
                         "its CPU-specific ones (AMX where the CPU reports it; on a virtual machine whose CPU "
                         "reports AMX, llama-server died of SIGILL at start with repacking on)")
    ap.add_argument("--no-records", action="store_true",
                    help="leave each run's per-request records and latency samples out of the JSON (metrics only)")
    return ap


def _check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[tuple[str, Any]]]:
    """The GGUF types and the load levels [("c=4", ("concurrency", 4)), ("2 req/s", ("rate", 2.0))], or a usage
    error naming the flag."""
    try:
        types = [t.strip() for t in args.types.split(",") if t.strip()]
        if not types or any(t not in TYPES for t in types):
            raise ValueError(f"--types must list some of {TYPES}, got {args.types!r}")
        levels = [(f"c={c}", ("concurrency", c)) for c in
                  (_ints(args.concurrencies, "--concurrencies") if args.concurrencies.strip() else [])]
        levels += [(f"{r:g} req/s", ("rate", r)) for r in
                   (parse_rates(args.rates, "--rates") if args.rates.strip() else [])]
        if not levels:
            raise ValueError("give at least one load level: --concurrencies and/or --rates")
        for name in ("slots", "num_prompts", "output_len", "agree_prompts"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "timeout", "startup_timeout"):
            if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
        args.input_len = parse_len_range(args.input_len, "--input-len")
    except ValueError as exc:
        ap.error(str(exc))
    return types, levels


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = start(ap, argv)
    types, levels = _check(ap, args)
    slo = SLO(ttft_s=args.slo_ttft_ms / 1e3, tpot_s=args.slo_tpot_ms / 1e3)

    work = args.work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree = fetch_sources(work, args.sdist)
    binary = build_target(tree, "llama-server")
    loaded = load_model(MODEL, "cpu", 0)
    tokenizer = Tokenizer.load(DEFAULT_TOKENIZER_PATH)
    hf_dir = export_hf_dir(loaded.model, tokenizer, work / f"{MODEL}-hf")
    ggufs = {t: convert(tree, hf_dir, t, work / f"{MODEL}-{t}.gguf") for t in types}
    eos_id = tokenizer.special_tokens[SEPARATOR]

    workload = make_workload("default", args.num_prompts, args.input_len, args.output_len, args.seed,
                             tokenizer=tokenizer, context_length=CONTEXT)
    names = [OURS, *(f"llama.cpp {t}" for t in types)]
    ports: dict[str, int] = {}
    while len(set(ports.values())) < len(names):  # the kernel's picks, distinct
        ports = {name: free_port() for name in names}
    commands = {OURS: minillm_server_command(ports[OURS], args.threads, args.slots, args.engine_core)}
    commands |= {f"llama.cpp {t}": llama_server_command(binary, ggufs[t], ports[f"llama.cpp {t}"], args.threads,
                                                        args.slots, eos_id, not args.llama_no_repack)
                 for t in types}
    report: dict[str, Any] = {"model": loaded.label, "llama_cpp": PINNED, "cpu": cpu_description(),
                              "threads": args.threads, "slots": args.slots, "backend": args.backend,
                              "engine_core": args.engine_core, "llama_repack": not args.llama_no_repack,
                              "commands": commands,
                              "workload": {"dataset": workload.dataset, "num_prompts": len(workload),
                                           "prompt_tokens": sum(workload.prompt_lens),
                                           "output_len": args.output_len, "seed": args.seed},
                              "slo_ms": {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(launched(name, cmd, ports[name],
                                                   work / f"server-{name.replace(' ', '-')}.log",
                                                   args.startup_timeout))
                for name, cmd in commands.items()}
        print("servers up: " + ", ".join(f"{k} {v}" for k, v in urls.items()), flush=True)

        llm = stack.enter_context(LLM(loaded.model, tokenizer, EngineConfig(max_num_seqs=args.slots)))
        agree_prompts = workload.prompts[:args.agree_prompts]
        report["tokenization"], report["agreement"] = {}, {}
        for t in types:
            name = f"llama.cpp {t}"
            tok = report["tokenization"][name] = check_tokenization(urls[name], workload.prompts, tokenizer)
            agr = report["agreement"][name] = check_agreement(urls[OURS], urls[name], agree_prompts, llm)
            print(f"{name}: /tokenize gives our ids on {tok['identical']}/{tok['prompts']} prompts; greedy "
                  f"{AGREE_TOKENS}-token completions identical: {agr['identical_ids']}/{agr['completions']} by token "
                  f"ids, {agr['identical_texts']}/{agr['completions']} by text (first differences at "
                  f"{[r['ids_first_difference'] for r in agr['rows'] if r['ids_first_difference'] is not None]})",
                  flush=True)

        runs = []
        for label, (kind, value) in levels:
            for name, url in urls.items():
                kwargs = {"concurrency": value} if kind == "concurrency" else {"rate": value}
                result = run_benchmark(url, workload, model=MODEL, slo=slo, timeout=args.timeout, seed=args.seed,
                                       backend=args.backend, **kwargs)
                m = result["metrics"]
                print(f"{label:>10} {name:<15} {m['output_throughput']:7.1f} out tok/s, TTFT p50 "
                      f"{(m['ttft_ms'] or {}).get('p50', float('nan')):7.1f} ms, TPOT p50 "
                      f"{(m['tpot_ms'] or {}).get('p50', float('nan')):6.2f} ms, {m['failed']} failed", flush=True)
                runs.append({"load": label, "server": name, "report": result})
    report["runs"] = runs
    report["output_throughput_ratio"] = ratios(runs)

    print(f"\nmodel: {loaded.label}; {report['cpu']}; {args.threads} compute thread(s) each; {args.slots} slots; "
          f"{len(workload)} prompts of {min(workload.prompt_lens)}-{max(workload.prompt_lens)} tokens, "
          f"{args.output_len} output tokens each (greedy, ignore_eos); SLO: TTFT <= {args.slo_ttft_ms:g} ms and "
          f"TPOT <= {args.slo_tpot_ms:g} ms\n")
    print(format_table(runs), end="")
    print("\nours / llama.cpp, output tok/s: " + "; ".join(
        f"{load}: " + ", ".join(f"{100 * r:.0f}% of {name}" for name, r in rs.items())
        for load, rs in report["output_throughput_ratio"].items()))
    if args.json:
        if args.no_records:
            for run in runs:
                run["report"] = {k: v for k, v in run["report"].items() if k not in ("records", "samples")}
        write_report(args.json, report)
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
