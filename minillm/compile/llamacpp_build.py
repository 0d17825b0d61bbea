"""Building llama.cpp from a pinned source distribution, and our model as its GGUF: the pieces chapter 13's
side-by-side (`llamacpp`, llama-bench) and chapter 15's (`minillm.serve.peer`, llama-server) share.

`fetch_sources` downloads (or takes) the pinned `llama-cpp-python` sdist, which vendors llama.cpp's sources, and
unpacks it; `build_target` builds one of its cmake targets (Release, the host's SIMD, no network: no curl, no web
UI); `export_hf_dir` writes `base` as a Hugging Face GPT-2 directory with a vocab.json and merges.txt recovered from
our tokenizer's ranks (`recover_merges`), and `convert` runs llama.cpp's own converter on it to a GGUF file.
Optional tools: nothing in CI calls them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Any

from minillm.compile.mirror import check_plain_model
from minillm.core.config import short_repr
from minillm.core.hf import to_hf_model
from minillm.core.io import check_output_dir, check_output_file, check_path
from minillm.core.model import require_model
from minillm.core.weights import untied_head
from minillm.kernels.build import check_command, run_program
from minillm.tokenizer import Tokenizer

PINNED = "llama-cpp-python==0.3.36"  # the sdist this chapter's figures were measured with
OUTTYPES = ("f32", "f16", "q8_0")  # the GGUF types `convert` writes (llama.cpp's converter's --outtype)
QUANTIZED_TYPES = ("q4_0",)  # the types `quantize_gguf` writes from an f32 GGUF (llama-quantize): 4-bit, 32-wide blocks


def run_logged(cmd: list[str], cwd: str | os.PathLike | None = None, log: str | os.PathLike | None = None) -> str:
    """Run a command (a list of str arguments, no shell) in the folder `cwd`; its output goes to the file `log`
    (when given) and is returned. A cwd that is no folder, or a log that is one or whose folder does not exist, is a
    ValueError naming it, before the command runs; a failure, or a program that cannot start, a RuntimeError naming
    the command."""
    cmd = check_command(cmd)
    cwd = None if cwd is None else check_path(cwd, "cwd")
    if cwd is not None and not cwd.is_dir():
        raise ValueError(f"cwd {str(cwd)!r} is not a folder: the command would have nowhere to run")
    log = check_output_file(log, "log")
    if log is not None and not log.parent.is_dir():
        raise ValueError(f"log {str(log)!r}: its folder {str(log.parent)!r} does not exist")
    out = run_program(cmd, "cmd", cwd=cwd)
    if log is not None:
        log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr)[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {out.returncode}:\n{tail}")
    return out.stdout


def _run_writing(cmd: list[str], out: Path, log: Path, tool: str) -> str:
    """`run_logged(cmd, log=log)` for a tool that must write the file `out`: a RuntimeError naming `tool` when it
    exits 0 but leaves no new file there (nothing written, or the file from before untouched), rather than returning
    a path that does not exist or holds an earlier run's output."""
    before = out.stat().st_mtime_ns if out.is_file() else None
    text = run_logged(cmd, log=log)
    if not out.is_file() or out.stat().st_mtime_ns == before:
        raise RuntimeError(f"{tool} exited 0 but wrote no {str(out)!r} (its log: {str(log)!r})")
    return text


def _same_file(a: Path, b: Path) -> bool:
    """Whether the paths `a` and `b` name one file: the same path once resolved (symlinks, "." and ".."), or, both
    existing, one file under two names (`os.path.samefile`: a hard link, a bind mount)."""
    return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))


def fetch_sources(work: str | os.PathLike, sdist: str | os.PathLike | None) -> Path:
    """The unpacked llama.cpp tree inside the sdist (downloaded with pip into the folder `work` unless `sdist` is
    given). A given sdist that is not a readable tar, or holds no vendored llama.cpp, is a ValueError naming --sdist
    and the file."""
    work = check_path(work, "work")
    sdist = None if sdist is None else check_path(sdist, "sdist")
    what = "--sdist" if sdist is not None else "the downloaded sdist"
    if sdist is None:
        found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
        if not found:
            print(f"fetching {PINNED} (source distribution) with pip ...", flush=True)
            run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PINNED, "-d",
                  str(work)])
            found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
        sdist = found[-1]
    if not sdist.is_file():
        raise ValueError(f"--sdist must be a llama-cpp-python .tar.gz, got {sdist}")
    root = work / sdist.name.removesuffix(".tar.gz")
    if not root.is_dir():
        try:
            with tarfile.open(sdist) as tar:
                tar.extractall(work, filter="data")
        except tarfile.TarError as e:
            raise ValueError(f"{what} {str(sdist)!r} is not a readable .tar.gz (a {PINNED} source distribution): "
                             f"{e}") from e
    tree = root / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        raise ValueError(f"{what} {str(sdist)!r} is not a {PINNED} source distribution: it unpacks no vendored "
                         f"llama.cpp at {tree}")
    return tree


def build_target(tree: str | os.PathLike, target: str) -> Path:
    """cmake configure + build of one llama.cpp target (`llama-bench`, `llama-server`) in `tree` (`fetch_sources`'
    result); the binary's path.

    One build directory serves every target: configured with the server's sources in (LLAMA_BUILD_SERVER=ON) but
    no web UI (neither built with npm nor downloaded), so no step of the build reaches the network."""
    tree = check_path(tree, "tree")
    if not isinstance(target, str) or not re.fullmatch(r"[\w.-]+", target):
        raise ValueError(f"target must be a cmake target name like 'llama-bench', got {target!r}")
    binary = tree / "build" / "bin" / target
    if not binary.is_file() and not (tree / "CMakeLists.txt").is_file():
        raise ValueError(f"tree {str(tree)!r} is not a llama.cpp source tree (no CMakeLists.txt): pass what "
                         "fetch_sources returns")
    if binary.is_file():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool} on the PATH")
    print(f"building {target} with cmake (a few minutes) ...", flush=True)
    run_logged(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
               cwd=tree, log=tree / "cmake-configure.log")
    run_logged(["cmake", "--build", "build", "-j", "--target", target], cwd=tree,
               log=tree / f"cmake-build-{target}.log")
    return binary


def build_llama_bench(tree: Path) -> Path:
    """cmake configure + build of the `llama-bench` target; the binary's path."""
    return build_target(tree, "llama-bench")


def quantize_gguf(tree: str | os.PathLike, source: str | os.PathLike, qtype: str, out: str | os.PathLike) -> Path:
    """llama.cpp's `llama-quantize` (built on first use) from the GGUF file `source` (an f32 one of `convert`) to
    `out` of type `qtype` (one of QUANTIZED_TYPES: types the converter cannot write), its log beside it; always
    quantizes, over any file at `out` (as `convert`). A missing source, or an `out` that is a folder or the source
    itself (or its log would be: the tool truncates out before reading the source), is a ValueError /
    FileNotFoundError naming it, before the build; a tool that writes no out, a RuntimeError (`_run_writing`)."""
    if not isinstance(qtype, str) or qtype not in QUANTIZED_TYPES:
        raise ValueError(f"qtype must be one of {QUANTIZED_TYPES}, got {qtype!r}")
    source, out = check_path(source, "source"), check_path(out, "out")
    if not source.is_file():
        raise FileNotFoundError(f"source {str(source)!r}: no such GGUF file")
    check_output_file(out, "out")
    log = out.with_suffix(".quantize.log")
    for name, path in (("out", out), ("out's log", log)):
        if _same_file(path, source):
            raise ValueError(f"{name} {str(path)!r} is the source GGUF {str(source)!r}: quantizing would destroy it; "
                             "give out another path")
    binary = build_target(tree, "llama-quantize")
    _run_writing([str(binary), str(source), str(out), qtype], out, log, "llama-quantize")
    return out


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
    builds from its bytes using only lower-ranked tokens, stopped when two parts are left. ranks: a dict of bytes
    -> int (`Tokenizer.mergeable_ranks`), one rank per token (a TypeError / ValueError naming it otherwise: two
    tokens of one rank have no merge order)."""
    if not isinstance(ranks, dict) or not all(isinstance(t, bytes) and isinstance(r, int) and not isinstance(r, bool)
                                              for t, r in ranks.items()):
        raise TypeError(f"ranks must be a dict of bytes -> int rank (Tokenizer.mergeable_ranks), got "
                        f"{type(ranks).__name__} {short_repr(ranks)}")
    owner: dict[int, bytes] = {}
    for token, rank in ranks.items():
        if owner.setdefault(rank, token) != token:
            raise ValueError(f"ranks must give each token its own rank (a merge order), but {owner[rank]!r} and "
                             f"{short_repr(token)} both have rank {rank}")
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
            raise ValueError(f"token {short_repr(token)} (rank {rank}) is not one merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def export_hf_dir(model: Any, tokenizer: Tokenizer, out: str | os.PathLike) -> Path:
    """`model` as a Hugging Face GPT-2 directory `out`, with a vocab.json + merges.txt of `tokenizer` (a minillm
    Tokenizer): the converter's input. GPT-2's layout has plain float layers, heads n_embd / n_head wide and MLPs
    4 * n_embd wide: a quantized, QAT-prepared or structurally pruned model (chapters 09 and 10) is a TypeError /
    ValueError naming what it has instead, before anything is written; so is an output head with a weight of its own
    (GPT-2's layout, and the GGUF converted from it, tie the head to the token embedding), and a tokenizer whose
    vocab_size is not the model's (its ids would name other rows of the embedding, or none)."""
    cfg = require_model(model, "export_hf_dir")
    check_plain_model(model, "export_hf_dir")
    if untied_head(model):
        raise ValueError("export_hf_dir writes GPT-2's layout, whose output head is the token embedding (so is the "
                         "GGUF converted from it), but model.lm_head has a weight of its own (other values than "
                         "transformer.wte's): the exported model would give other logits")
    widths = [block.mlp.c_fc.out_features for block in model.transformer.h]
    if cfg.attn_dim != cfg.n_embd or any(w != 4 * cfg.n_embd for w in widths):
        raise ValueError(f"export_hf_dir writes Hugging Face GPT-2, whose heads are n_embd / n_head wide and MLPs "
                         f"4 * n_embd = {4 * cfg.n_embd} wide; model (pruned) has {cfg.n_head} heads of "
                         f"{cfg.head_size} (n_embd / n_head = {cfg.n_embd // cfg.n_head}) and MLP widths {widths}: "
                         "export the unpruned model")
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a minillm Tokenizer (its ranks become vocab.json and merges.txt), got "
                        f"{type(tokenizer).__name__}")
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"tokenizer has vocab_size={tokenizer.vocab_size}, model has vocab_size={cfg.vocab_size}: "
                         "export a model with the tokenizer it was trained with")
    out = check_path(out, "out")
    check_output_dir(out, "out")
    hf = to_hf_model(model)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
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


def convert(tree: str | os.PathLike, hf_dir: str | os.PathLike, outtype: str, out: str | os.PathLike) -> Path:
    """llama.cpp's converter on `hf_dir` (`export_hf_dir`'s folder), in a child Python (it imports its own `gguf`
    and `conversion` packages), to the GGUF file `out` of type `outtype` (one of OUTTYPES); its log beside it.

    It always converts, over any file at `out`: a GGUF left by an earlier run may hold another checkpoint, and
    reusing it would benchmark that one without a word (a conversion is quick next to the build). A tree without
    llama.cpp's converter, an hf_dir without config.json, or an `out` that is a folder is a ValueError naming it,
    before the child starts; out's folder is made. A converter that writes no out is a RuntimeError (`_run_writing`)."""
    if not isinstance(outtype, str) or outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    tree, hf_dir, out = check_path(tree, "tree"), check_path(hf_dir, "hf_dir"), check_path(out, "out")
    check_output_file(out, "out")
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise ValueError(f"tree {str(tree)!r} is not a llama.cpp source tree (no convert_hf_to_gguf.py): pass what "
                         "fetch_sources returns")
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"hf_dir {str(hf_dir)!r} is not a Hugging Face model folder (no config.json): pass what "
                         "export_hf_dir returns")
    out.parent.mkdir(parents=True, exist_ok=True)
    shim = (f"import sys; sys.path[:0] = [{str(tree / 'gguf-py')!r}, {str(tree)!r}]\n"
            "import conversion.base as base\n"
            "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'llama-bpe'  # our split: GPT-4's regex\n"
            "import runpy\n"
            f"sys.argv = ['convert_hf_to_gguf.py', {str(hf_dir)!r}, '--outtype', {outtype!r}, '--outfile', "
            f"{str(out)!r}]\nrunpy.run_path({str(tree / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    _run_writing([sys.executable, "-c", shim], out, out.with_suffix(".convert.log"), "convert_hf_to_gguf.py")
    return out
