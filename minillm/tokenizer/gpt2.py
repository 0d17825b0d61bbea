"""Real GPT-2 ranks, offline: find OpenAI's GPT-2 rank file on this machine, or fetch it once as a setup step.

What it adds: `find_gpt2_ranks` (look, never download), `fetch_gpt2_ranks` (the explicit setup step behind
`minillm tokenizer fetch-gpt2`) and `load_gpt2_tokenizer`. What it leaves out: any download at run time; tests
and the tour skip, saying why, when no rank file is found.

Where the ranks can be, in the order they are tried:
  1. the file named by the environment variable MINILLM_GPT2_RANKS;
  2. tiktoken's cache (TIKTOKEN_CACHE_DIR, DATA_GYM_CACHE_DIR, or <tmp>/data-gym-cache), where tiktoken keeps
     `r50k_base.tiktoken` under the sha1 of its URL once `tiktoken.get_encoding("r50k_base")` ran online;
     r50k_base has exactly GPT-2's ranks;
  3. minillm's cache, MINILLM_CACHE_DIR or ~/.cache/minillm (XDG_CACHE_HOME respected), file gpt2.tiktoken.
Every candidate must have the published sha256 of the GPT-2 rank file (the one tiktoken checks for r50k_base).

The fetch: OpenAI's `openai-whisper` source distribution on PyPI ships the same file as
`whisper/assets/gpt2.tiktoken`. `pip download --no-deps --no-binary :all: openai-whisper==20250625` fetches the
sdist through pip's ordinary channel (and proxy settings); we extract that one member, check its hash and write it
atomically into minillm's cache. Whisper itself is never installed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from minillm.core.io import atomic_write_bytes
from minillm.tokenizer.bpe import Tokenizer
from minillm.tokenizer.patterns import GPT2_SPLIT_PATTERN

GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
GPT2_SPECIAL_TOKENS = {"<|endoftext|>": 50256}
WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_MEMBER_SUFFIX = "/whisper/assets/gpt2.tiktoken"
ENV_VAR = "MINILLM_GPT2_RANKS"


def minillm_cache_dir() -> Path:
    if os.environ.get("MINILLM_CACHE_DIR"):
        return Path(os.environ["MINILLM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minillm"


def tiktoken_cache_file() -> Path:
    """Where tiktoken caches r50k_base.tiktoken (mirrors `tiktoken.load.read_file_cached`)."""
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    if not cache_dir:
        cache_dir = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return Path(cache_dir) / hashlib.sha1(R50K_URL.encode()).hexdigest()


def _has_gpt2_hash(path: Path) -> bool:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() == GPT2_RANKS_SHA256
    except OSError:
        return False


def find_gpt2_ranks() -> Path | None:
    """The path of a verified GPT-2 rank file on this machine, or None. Never downloads anything."""
    env = os.environ.get(ENV_VAR)
    if env:
        path = Path(env)
        if not path.is_file():
            raise ValueError(f"{ENV_VAR}={env!r} does not name a file")
        if not _has_gpt2_hash(path):
            raise ValueError(f"{ENV_VAR}={env!r} is not the GPT-2 rank file (sha256 differs from {GPT2_RANKS_SHA256})")
        return path
    for path in (tiktoken_cache_file(), minillm_cache_dir() / "gpt2.tiktoken"):
        if path.is_file() and _has_gpt2_hash(path):
            return path
    return None


def load_gpt2_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """GPT-2's tokenizer (50,257 ids) from a local rank file; ValueError with the fix if none is found."""
    if path is None:
        path = find_gpt2_ranks()
        if path is None:
            raise ValueError("no GPT-2 rank file found; run `minillm tokenizer fetch-gpt2` once (needs PyPI access) "
                             f"or set {ENV_VAR} to a gpt2.tiktoken / r50k_base.tiktoken file")
    return Tokenizer.from_tiktoken(path, pattern=GPT2_SPLIT_PATTERN, special_tokens=GPT2_SPECIAL_TOKENS, name="gpt2")


def fetch_gpt2_ranks(dest: str | os.PathLike | None = None, force: bool = False, verbose: bool = False) -> Path:
    """Setup step: pip-download the openai-whisper sdist, extract gpt2.tiktoken, verify it, write it atomically."""
    dest = Path(dest) if dest is not None else minillm_cache_dir() / "gpt2.tiktoken"
    if dest.is_file() and _has_gpt2_hash(dest) and not force:
        return dest
    with tempfile.TemporaryDirectory(prefix="minillm-whisper-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", WHISPER_SDIST, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=not verbose, text=True)
        if proc.returncode != 0:
            detail = (proc.stderr or "")[-2000:] if not verbose else ""
            raise RuntimeError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}\n{detail}")
        sdists = sorted(Path(tmp).glob("openai_whisper-*.tar.gz")) + sorted(Path(tmp).glob("openai-whisper-*.tar.gz"))
        if not sdists:
            raise RuntimeError(f"pip download left no openai-whisper sdist in {tmp}: {os.listdir(tmp)}")
        with tarfile.open(sdists[0], "r:gz") as tar:
            member = next((m for m in tar.getmembers() if m.isfile() and m.name.endswith(WHISPER_MEMBER_SUFFIX)), None)
            if member is None:
                raise RuntimeError(f"{sdists[0].name} holds no *{WHISPER_MEMBER_SUFFIX}")
            data = tar.extractfile(member).read()  # read the bytes only: nothing from the archive lands on disk
    digest = hashlib.sha256(data).hexdigest()
    if digest != GPT2_RANKS_SHA256:
        raise RuntimeError(f"the extracted gpt2.tiktoken has sha256 {digest}, expected {GPT2_RANKS_SHA256}")
    return atomic_write_bytes(dest, data)
