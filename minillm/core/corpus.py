"""The embedded default corpus: Python's own standard-library sources, so nothing is ever downloaded.

What it adds: a deterministic text corpus (about 4.2 MB) built from a fixed, sorted list of top-level stdlib
modules of the running Python, with a train/validation split, a content hash and a size. What it leaves out:
anything beyond plain text (no shuffling, no document sampling, no streaming of large files); `load_corpus(path)`
takes any UTF-8 text file instead.

Layout of the text: the module files in the sorted order of `STDLIB_MODULES`, each read as UTF-8 (undecodable
bytes become U+FFFD), joined with the separator `<|endoftext|>` between files. Files missing on the running
Python are skipped silently, so the list may name modules a future Python drops.

Split: every 20th file of the list (indices 19, 39, ...) is held out for validation (7 files, 8.4% of the
bytes on 3.11); `train_text` and `val_text` are the two groups joined the same way. Holding out whole files, spread over
the alphabet, keeps the validation text unseen at the level of files and as varied as the training text.

Measured on CPython 3.11.7: 143 files, `num_bytes` = 4,197,927 (UTF-8 bytes of `text`; train 3,845,939, val
351,975), sha256 of the UTF-8 `text` =
17e221b9411ccc3417d0452555a00053fad65aa70b3b795e98b42f98380e0d7c. The hash
differs across Python versions (3.10, 3.12, 3.13 ship different sources for the same modules), so anything that
must be bit-identical across machines (the shipped tokenizer) records the hash it was built from.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from minillm.core.config import check_choice, short_repr

SEPARATOR = "<|endoftext|>"  # also the special token of the shipped tokenizer
VAL_EVERY = 20  # every 20th file (index % 20 == 19) is validation text

# Top-level modules present in CPython 3.10, 3.11, 3.12 and 3.13 (sorted, so the order is fixed), minus
# generated platform files (`_sysconfigdata_*`) and `this.py` (rot13 prose). About 4.2 MB on 3.11.
STDLIB_MODULES: tuple[str, ...] = (
    "__future__.py", "_aix_support.py", "_collections_abc.py", "_compat_pickle.py", "_compression.py",
    "_markupbase.py", "_osx_support.py", "_py_abc.py", "_pydecimal.py", "_pyio.py", "_sitebuiltins.py",
    "_strptime.py", "_threading_local.py", "_weakrefset.py", "abc.py", "antigravity.py", "argparse.py", "ast.py",
    "base64.py", "bdb.py", "bisect.py", "bz2.py", "cProfile.py", "calendar.py", "cmd.py", "code.py", "codecs.py",
    "codeop.py", "colorsys.py", "compileall.py", "configparser.py", "contextlib.py", "contextvars.py", "copy.py",
    "copyreg.py", "csv.py", "dataclasses.py", "datetime.py", "decimal.py", "difflib.py", "dis.py", "doctest.py",
    "enum.py", "filecmp.py", "fileinput.py", "fnmatch.py", "fractions.py", "ftplib.py", "functools.py",
    "genericpath.py", "getopt.py", "getpass.py", "gettext.py", "glob.py", "graphlib.py", "gzip.py", "hashlib.py",
    "heapq.py", "hmac.py", "imaplib.py", "inspect.py", "io.py", "ipaddress.py", "keyword.py", "linecache.py",
    "locale.py", "lzma.py", "mailbox.py", "mimetypes.py", "modulefinder.py", "netrc.py", "ntpath.py",
    "nturl2path.py", "numbers.py", "opcode.py", "operator.py", "optparse.py", "os.py", "pdb.py", "pickle.py",
    "pickletools.py", "pkgutil.py", "platform.py", "plistlib.py", "poplib.py", "posixpath.py", "pprint.py",
    "profile.py", "pstats.py", "pty.py", "py_compile.py", "pyclbr.py", "pydoc.py", "queue.py", "quopri.py",
    "random.py", "reprlib.py", "rlcompleter.py", "runpy.py", "sched.py", "secrets.py", "selectors.py", "shelve.py",
    "shlex.py", "shutil.py", "signal.py", "site.py", "smtplib.py", "socket.py", "socketserver.py",
    "sre_compile.py", "sre_constants.py", "sre_parse.py", "ssl.py", "stat.py", "statistics.py", "string.py",
    "stringprep.py", "struct.py", "subprocess.py", "symtable.py", "tabnanny.py", "tarfile.py", "tempfile.py",
    "textwrap.py", "threading.py", "timeit.py", "token.py", "tokenize.py", "trace.py", "traceback.py",
    "tracemalloc.py", "tty.py", "turtle.py", "types.py", "typing.py", "uuid.py", "warnings.py", "wave.py",
    "weakref.py", "webbrowser.py", "zipapp.py", "zipimport.py",
)  # fmt: skip


@dataclass(frozen=True)
class Corpus:
    text: str  # the whole corpus
    train_text: str  # training split
    val_text: str  # held-out validation split
    sha256: str  # hex sha256 of text.encode("utf-8")
    num_bytes: int  # len(text.encode("utf-8"))
    files: tuple[str, ...]  # the files it was built from, in order
    source: str  # "stdlib:<python version>" or the path of a user file

    def __repr__(self) -> str:  # the text is megabytes: never print it
        return (
            f"Corpus(source={self.source!r}, files={len(self.files)}, num_bytes={self.num_bytes:,}, "
            f"sha256={self.sha256[:16]}...)"
        )


def stdlib_dir() -> Path:
    """Where the running Python keeps its pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _default_corpus() -> Corpus:
    root = stdlib_dir()
    names: list[str] = []
    texts: list[str] = []
    for name in sorted(STDLIB_MODULES):
        path = root / name
        if not path.is_file():  # a module a future Python dropped: skip, by design
            continue
        names.append(name)
        texts.append(path.read_bytes().decode("utf-8", errors="replace"))
    if not texts:
        raise RuntimeError(f"no standard-library sources found under {root}; pass a corpus path instead")
    train = [t for i, t in enumerate(texts) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [t for i, t in enumerate(texts) if i % VAL_EVERY == VAL_EVERY - 1]
    version = ".".join(map(str, sys.version_info[:3]))
    joined = [SEPARATOR.join(part) for part in (texts, train, val)]
    return _make_corpus(*joined, tuple(names), f"stdlib:{version}")


def _make_corpus(text: str, train: str, val: str, files: tuple[str, ...], source: str) -> Corpus:
    data = text.encode("utf-8")
    return Corpus(text, train, val, hashlib.sha256(data).hexdigest(), len(data), files, source)


def _split_user_text(text: str, val_fraction: float = 0.05) -> tuple[str, str]:
    """Hold out the last ~5% of a single file, cut at a line break so no line is torn in two."""
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.rfind("\n", 0, cut)
    if newline > 0:
        cut = newline + 1
    return text[:cut], text[cut:]


def load_corpus(path: str | os.PathLike | None = None) -> Corpus:
    """The default stdlib corpus (path=None), or any UTF-8 text file, with a deterministic train/val split.

    The default corpus is built once per process and cached. A user file must decode as UTF-8 (strictly: a
    corpus that silently turns into replacement characters would train a tokenizer on garbage).
    """
    if path is None:
        return _default_corpus()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"corpus path must be a str or os.PathLike, got {type(path).__name__}")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"corpus file not found: {str(p)!r}")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus file {str(p)!r} is not valid UTF-8 (byte offset {e.start}): {e.reason}") from e
    if not text:
        raise ValueError(f"corpus file {str(p)!r} is empty")
    train, val = _split_user_text(text)
    return _make_corpus(text, train, val, (str(p),), str(p))


def take_bytes(text: str, num_bytes: int) -> str:
    """The longest prefix of `text` whose UTF-8 encoding has at most `num_bytes` bytes (never splits a character)."""
    if not isinstance(num_bytes, int) or num_bytes < 0:
        raise ValueError(f"num_bytes must be a non-negative int, got {short_repr(num_bytes)}")
    data = text.encode("utf-8")
    if len(data) <= num_bytes:
        return text
    # subtle: cutting the bytes may split a multi-byte character; "ignore" drops the torn tail only.
    return data[:num_bytes].decode("utf-8", errors="ignore")


def corpus_sample(num_bytes: int, path: str | os.PathLike | None = None, split: str = "train") -> str:
    """A prefix of at most `num_bytes` UTF-8 bytes of the chosen split of a corpus."""
    split = check_choice("split", split, ("train", "val", "all"))
    c = load_corpus(path)
    text = {"train": c.train_text, "val": c.val_text, "all": c.text}[split]
    return take_bytes(text, num_bytes)
