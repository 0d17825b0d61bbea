"""Side by side with llama.cpp on the CPU: the same weights, batch-1 decode, one thread, in one run.

What it does, each step skipped when its output is already in the work directory:
  1. fetch the pinned `llama-cpp-python` source distribution from PyPI (`pip download`; or pass `--sdist FILE`),
     which vendors the llama.cpp sources, and unpack it;
  2. build `llama-bench` with cmake (Release, the host's SIMD: `GGML_NATIVE=ON`), a few minutes on two cores;
  3. export `base` as a Hugging Face GPT-2 directory (config.json, model.safetensors, and vocab.json + merges.txt
     recovered from our tokenizer's ranks), and convert it with llama.cpp's own `convert_hf_to_gguf.py` to GGUF files
     in f32, f16 and q8_0;
  4. interleave, round by round: `llama-bench -t T -p 0 -n N` on each GGUF (its `tg` test: N tokens decoded one at a
     time at batch 1, from an empty context) and our batch-1 decode of N tokens after a one-token prompt, eager
     (chapter 04's `generate_ids`) and with the fused C++ step (`FusedCPUDecoder`), at the same thread count.
It prints each path's median tok/s over the rounds and ours as a fraction of llama.cpp f32, and writes them as JSON.

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
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from minillm.bench.cli import bench_parser, start
from minillm.bench.models import load_model
from minillm.compile.fused_step import FusedCPUDecoder
from minillm.core.hf import to_hf_model
from minillm.core.io import atomic_write_text
from minillm.core.sampling import SamplingParams
from minillm.core.timing import measure
from minillm.kvcache.generate import generate_ids
from minillm.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

PINNED = "llama-cpp-python==0.3.36"  # the sdist this chapter's figures were measured with
TYPES = ("f32", "f16", "q8_0")


def _run(cmd: list[str], cwd: Path | None = None, log: Path | None = None) -> str:
    """Run a command; its output goes to `log` (when given) and is returned; a failure raises naming the command."""
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if log is not None:
        log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr)[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {out.returncode}:\n{tail}")
    return out.stdout


def fetch_sources(work: Path, sdist: Path | None) -> Path:
    """The unpacked llama.cpp tree inside the sdist (downloaded with pip unless `sdist` is given)."""
    if sdist is None:
        found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
        if not found:
            print(f"fetching {PINNED} (source distribution) with pip ...", flush=True)
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PINNED, "-d",
                  str(work)])
            found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
        sdist = found[-1]
    if not sdist.is_file():
        raise ValueError(f"--sdist must be a llama-cpp-python .tar.gz, got {sdist}")
    root = work / sdist.name.removesuffix(".tar.gz")
    if not root.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
    tree = root / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{sdist} has no vendored llama.cpp at {tree}")
    return tree


def build_llama_bench(tree: Path) -> Path:
    """cmake configure + build of the `llama-bench` target; the binary's path."""
    binary = tree / "build" / "bin" / "llama-bench"
    if binary.is_file():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool} on the PATH")
    print("building llama-bench with cmake (a few minutes) ...", flush=True)
    _run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
          "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
         cwd=tree, log=tree / "cmake-configure.log")
    _run(["cmake", "--build", "build", "-j", "--target", "llama-bench"], cwd=tree, log=tree / "cmake-build.log")
    return binary


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, the alphabet of vocab.json and merges.txt (Radford et al. 2019)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list (left, right) in rank order that tiktoken-style ranks imply: each multi-byte token is what BPE
    builds from its bytes using only lower-ranked tokens, stopped when two parts are left."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 30))
            if ranks.get(parts[best] + parts[best + 1], 1 << 30) >= rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not one merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def export_hf_dir(model: Any, tokenizer: Any, out: Path) -> Path:
    """`model` as a Hugging Face GPT-2 directory, with a vocab.json + merges.txt of `tokenizer`: the converter's
    input."""
    out.mkdir(parents=True, exist_ok=True)
    to_hf_model(model).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.setdefault("n_ctx", model.config.block_size)  # the converter reads GPT-2's older name for n_positions
    (out / "config.json").write_text(json.dumps(config, indent=2))
    table = bytes_to_unicode()
    text = lambda b: "".join(table[x] for x in b)  # noqa: E731
    ranks = tokenizer.mergeable_ranks
    vocab = {text(b): r for b, r in ranks.items()} | dict(tokenizer.special_tokens)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    merges = recover_merges(ranks)
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{text(a)} {text(b)}\n" for a, b in merges))
    return out


def convert(tree: Path, hf_dir: Path, outtype: str, out: Path) -> Path:
    """llama.cpp's converter on `hf_dir`, in a child Python (it imports its own `gguf` and `conversion` packages)."""
    if out.is_file():
        return out
    shim = (f"import sys; sys.path[:0] = [{str(tree / 'gguf-py')!r}, {str(tree)!r}]\n"
            "import conversion.base as base\n"
            "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'llama-bpe'  # our split: GPT-4's regex\n"
            "import runpy\n"
            f"sys.argv = ['convert_hf_to_gguf.py', {str(hf_dir)!r}, '--outtype', {outtype!r}, '--outfile', "
            f"{str(out)!r}]\n"
            f"runpy.run_path({str(tree / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    _run([sys.executable, "-c", shim], log=out.with_suffix(".convert.log"))
    return out


def llama_bench_tok_s(binary: Path, gguf: Path, threads: int, tokens: int) -> float:
    """llama-bench's mean tok/s for `tg<tokens>` (batch-1 decode from an empty context), 3 repetitions."""
    out = _run([str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "3", "-o",
                "json"])
    rows = json.loads(out)
    return float(rows[0]["avg_ts"])


def ours_tok_s(run, tokens: int, repeats: int = 3) -> float:
    """tok/s of `run` (one decode of `tokens` tokens): the median of `repeats` timed calls after one warm-up call."""
    return tokens / measure(run, warmup=1, repeats=repeats).median


def build_parser() -> argparse.ArgumentParser:
    # CPU only, like llama-bench here; the same --threads for both sides.
    ap = bench_parser("python -m minillm.compile.llamacpp", __doc__.splitlines()[0], devices=("cpu",), seed=False)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "minillm" / "llamacpp",
                    help="where the sources, the build and the GGUF files go (reused between runs)")
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

    work = args.work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree = fetch_sources(work, args.sdist)
    binary = build_llama_bench(tree)
    loaded = load_model("base", args.device, 0)
    model = loaded.model
    hf_dir = export_hf_dir(model, Tokenizer.load(DEFAULT_TOKENIZER_PATH), work / "base-hf")
    ggufs = {t: convert(tree, hf_dir, t, work / f"base-{t}.gguf") for t in TYPES}

    fused = FusedCPUDecoder(model)
    params = SamplingParams.greedy(args.tokens, ignore_eos=True)
    prompt = [0]
    ours = {"minillm eager (generate_ids)": lambda: generate_ids(model, prompt, params),
            "minillm fused C++ step": lambda: fused.generate_ids(prompt, params)}
    samples: dict[str, list[float]] = {**{f"llama.cpp {t}": [] for t in TYPES}, **{k: [] for k in ours}}
    for r in range(args.rounds):
        for t, path in ggufs.items():
            samples[f"llama.cpp {t}"].append(llama_bench_tok_s(binary, path, args.threads, args.tokens))
        for name, run in ours.items():
            samples[name].append(ours_tok_s(run, args.tokens))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in samples.items()), flush=True)
    median = {k: statistics.median(v) for k, v in samples.items()}
    ref = median["llama.cpp f32"]
    print(f"\nmodel: {loaded.label}; {args.threads} thread(s); {args.tokens} tokens decoded at batch 1; "
          f"medians of {args.rounds} interleaved rounds\n")
    print("| path | tok/s | of llama.cpp f32 |\n|---|---:|---:|")
    for k, v in median.items():
        print(f"| {k} | {v:.0f} | {100 * v / ref:.0f}% |")
    if args.json:
        atomic_write_text(args.json, json.dumps({"model": loaded.label, "threads": args.threads,
                                                 "tokens": args.tokens, "llama_cpp": PINNED, "samples": samples,
                                                 "median_tok_s": median}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
