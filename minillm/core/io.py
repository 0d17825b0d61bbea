"""Writing files so that a crash never leaves half of one behind (temp file, then rename), and reading them back
with errors that name the file.

`os.replace` is atomic on POSIX and Windows when source and target share a directory, so a reader sees either the
old file or the new one, never a torn mix. Checkpoints are safetensors: loading them runs no code. A safetensors
file can carry a digest of its own content in its metadata (`with_sha256` at save, `check_sha256` on load), so a
byte changed after saving is found: an atomic write protects against a crash, the digest against everything later.
"""

from __future__ import annotations

import hashlib
import json
import io
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch

from minillm.core.config import check_instance, check_label, check_tensor_dict, short_repr


def check_path(path: object, name: str) -> Path:
    """`path` as a Path if it is a str or an os.PathLike; a TypeError naming `name` and what was given otherwise (a
    number or bytes would reach pathlib, whose message names no argument), a ValueError naming it for "" and for a
    path no file system can hold (`check_path_fits`).

    subtle: Path("") is Path("."), the working directory: an empty argument (`--export ''`, a variable left unset)
    would read or write there without a word."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike naming a file, got {type(path).__name__} "
                        f"{short_repr(path)}")
    if not os.fspath(path):
        raise ValueError(f"{name} must name a path, got an empty string (which would mean the working directory)")
    check_path_fits(os.fsdecode(path), name)
    return Path(path)


MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: the OS refuses a longer path ("File name too long")
MAX_NAME_BYTES = 255  # NAME_MAX: one file or folder name, in bytes (Linux, macOS and Windows alike)


def check_path_fits(text: str, name: str) -> None:
    """A ValueError naming `name` for a path no file system can hold: a NUL character, more than MAX_PATH_CHARS
    characters, or a name in it longer than MAX_NAME_BYTES. The OS would refuse each later, deep inside a write, as
    "embedded null byte" or "File name too long", naming no argument."""
    name = check_label("name", name)
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a path as a str, got {type(text).__name__} {short_repr(text)}")
    if "\0" in text:
        raise ValueError(f"{name} holds a NUL character, which no path can: {short_repr(text)}")
    if len(text) > MAX_PATH_CHARS:
        raise ValueError(f"{name} is {len(text)} characters long, past the {MAX_PATH_CHARS} a path may have: "
                         f"{text!r:.60}...")
    for part in Path(text).parts:
        size = len(part.encode("utf-8", "surrogateescape"))
        if size > MAX_NAME_BYTES:
            raise ValueError(f"{name} holds a name of {size} bytes, past the {MAX_NAME_BYTES} a file system allows: "
                             f"{part!r:.60}...")


def check_output_file(path: str | os.PathLike | None, flag: str, suffixes: tuple[str, ...] = ()) -> Path | None:
    """Check an output path a command will write when its work is done, before the work starts.

    A directory, a path ending in a separator, "." or ".." (a folder's name: Path("dir/") would be the file "dir",
    and "missing/.." names a folder once "missing" is made), a parent that is a file, or a wrong suffix is a
    ValueError naming `flag` (e.g. "--plot") and the path, so minutes of benchmarking or training are never lost to
    `IsADirectoryError` at the end; so is an existing path that is no regular file (`check_replaceable`: a device,
    FIFO or socket). A path that is not a str or os.PathLike is a TypeError naming `flag`. None passes.
    """
    if path is None or (isinstance(path, str) and str.__str__(path) == ""):  # the type first: an array's == is none
        return None
    out = check_path(path, flag)
    text = os.fsdecode(os.fspath(path))
    if text.endswith(("/", os.sep)) or os.path.basename(text) in (".", ".."):
        raise ValueError(f"{flag} must name a file, got {path!r}")
    if out.is_dir():
        raise ValueError(f"{flag} {str(out)!r} is a directory; give a file path inside it, e.g. "
                         f"{str(out / ('result' + (suffixes[0] if suffixes else '')))!r}")
    check_replaceable(out, flag)
    if suffixes and out.suffix not in suffixes:
        raise ValueError(f"{flag} {str(out)!r} must end in {' or '.join(suffixes)}")
    _check_parents(out, out.parents, flag, "directory")
    return out


def check_replaceable(path: Path, name: str) -> None:
    """A ValueError naming `name` and `path` when `path` exists and is neither a regular file nor a folder (a
    character or block device, a FIFO, a socket; a symlink is judged by what it points to).

    subtle: the atomic writers rename a temp file onto the path, which replaces whatever is there: saving onto
    /dev/null as root would turn the machine's /dev/null into a regular file. A folder is left to the callers, whose
    messages say what to give instead (os.replace refuses it anyway)."""
    path = check_path(path, check_label("name", name))
    try:
        mode = path.stat().st_mode
    except OSError:  # no such path (or a dangling link): nothing to replace
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ValueError(f"{name} {str(path)!r} exists and is not a regular file (a device, FIFO or socket): "
                         "writing there would replace it; give a file path")


def _check_parents(out: Path, candidates, name: str, word: str) -> None:
    """The nearest of `candidates` (out's parents, nearest first) that exists must be a folder: a ValueError naming
    `name`, `out` and the file in the way otherwise."""
    for p in candidates:
        if p.exists():
            if not p.is_dir():
                raise ValueError(f"{name} {str(out)!r}: {str(p)!r} is a file, not a {word}")
            break


def check_output_dir(path: str | os.PathLike | None, name: str) -> Path | None:
    """Check a folder a command will write into, before the work starts: a path that is a file, or lies under a
    file, is a ValueError naming `name` and the path (minutes of training are never lost to it at the end)."""
    if path is None:
        return None
    out = check_path(path, name)
    _check_parents(out, (out, *out.parents), name, "folder")
    return out


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (temp file in the same directory, fsync, rename). An existing `path` that is
    no regular file (a device, FIFO or socket) is a ValueError naming path, before anything is written
    (`check_replaceable`: the rename would replace the device itself)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    path = check_path(path, "path")
    check_replaceable(path, "path")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # subtle: mkstemp creates the file 0600; give it the mode a plain open() would (0666 minus the umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    try:
        data = text.encode(check_label("encoding", encoding))
    except LookupError as e:  # codecs' own error names no argument
        raise ValueError(f"encoding must be a codec's name, got {encoding!r}") from e
    return atomic_write_bytes(path, data)


def atomic_save_figure(fig: Any, path: str | os.PathLike, **savefig_kwargs: Any) -> Path:
    """Write a matplotlib figure as PNG atomically (rendered in memory, then renamed into place). Returns the path."""
    if not callable(getattr(fig, "savefig", None)):
        raise TypeError(f"fig must be a matplotlib figure (with savefig), got {type(fig).__name__} {short_repr(fig)}")
    check_path(path, "path")  # before the figure is rendered
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig_kwargs)
    return atomic_write_bytes(path, buf.getvalue())


def atomic_save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> Path:
    """Save a flat dict of tensors as safetensors, atomically. Tensors are made contiguous and moved to the CPU."""
    from safetensors.torch import save

    check_tensor_dict("tensors", tensors)
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return atomic_write_bytes(path, save(flat, metadata=metadata))


SHA256_FIELD = "sha256"  # the metadata field holding `content_sha256` of a safetensors file's other fields + tensors


def content_sha256(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Hex SHA-256 of what a safetensors file holds: its metadata fields (sorted; the "sha256" field itself left
    out), then every tensor in name order as its name, dtype and shape (JSON) followed by its raw bytes.

    subtle: not a digest of the file's bytes. The digest is stored inside the file (its header), and the same model
    must give the same digest in a file and in the bytes `minillm.core.formats` sends to a worker; hashing the
    content also makes the digest independent of how the header happens to be laid out. The dtype and shape are
    hashed with the bytes, so fp16 bytes relabelled, or one tensor reshaped, change the digest too.
    """
    check_tensor_dict("tensors", tensors)
    h = hashlib.sha256()
    fields = {k: v for k, v in (metadata or {}).items() if k != SHA256_FIELD}
    h.update(json.dumps(fields, sort_keys=True).encode("utf-8"))
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode("utf-8"))
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the raw bytes, whatever the dtype (bf16 too)
    return h.hexdigest()


def with_sha256(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """`metadata` plus the "sha256" field: `content_sha256` of these tensors and every other field of `metadata`."""
    return {**metadata, SHA256_FIELD: content_sha256(tensors, metadata)}


def check_sha256(metadata: dict[str, str], tensors: dict[str, torch.Tensor], where: str) -> bool:
    """Recompute the digest `with_sha256` stored; a mismatch is a ValueError naming `where` (the file).

    Returns False, checking nothing, when the metadata has no "sha256" field (a file written before digests were
    recorded), True when the digest was there and matches.
    """
    want = check_instance("metadata", metadata, dict, "a dict of str metadata").get(SHA256_FIELD)
    if want is None:
        return False
    got = content_sha256(tensors, metadata)
    if got != want:
        raise ValueError(f"{where}: the content does not match the sha256 recorded in its metadata ({got[:16]}... "
                         f"!= {str(want)[:16]}...): the tensors or the metadata changed after saving (a damaged or "
                         "edited file)")
    return True


def read_json_file(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Parse a JSON file; a truncated or corrupt one is a ValueError naming the file (json's own error does not)."""
    check_label("what", what)
    path = Path(path)
    try:
        return json.loads(path.read_bytes())
    # ValueError: json's decode error, and an int of more digits than Python converts; RecursionError: nesting past
    # the parser's depth. Each names the file here, not only the position.
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON (truncated or corrupt?): {e}") from e


def read_safetensors_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a safetensors file onto the CPU; a truncated or corrupt one is a ValueError naming the file.

    safetensors raises its own `SafetensorError` ("Error while deserializing header: ...") with no path in it, and a
    caller holding several files (weights, optimizer) could not say which one broke.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, RuntimeError) as e:  # ValueError/RuntimeError: bad dtype or shape data
        raise ValueError(f"{str(path)!r} is not a valid safetensors file (truncated or corrupt?): {e}") from e


def read_format_metadata(path: str | os.PathLike, fmt: str, version: str, hint: str) -> dict[str, str]:
    """The string metadata of a safetensors file that declares itself `fmt` at `version` (read from the header alone).

    A `path` that is not a str or os.PathLike is a TypeError naming it; a missing file is FileNotFoundError; a torn
    or corrupt one, a header without {"format": fmt} (`hint` says what loads such a file instead) or another
    format_version is a ValueError naming the file.
    """
    from safetensors import SafetensorError, safe_open

    path = check_path(path, "path")
    if not path.is_file():
        raise FileNotFoundError(f"no {fmt} file at {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{str(path)!r} is not a valid safetensors file (truncated or corrupt?): {e}") from e
    if not meta or meta.get("format") != fmt:
        raise ValueError(f"{str(path)!r} has no {fmt} metadata (format != {fmt!r}); {hint}")
    if meta.get("format_version") != version:
        raise ValueError(f"{str(path)!r} has format_version {meta.get('format_version')!r}; this code reads "
                         f"{short_repr(version)}")
    return dict(meta)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (new names, renames) to disk; a no-op where directories cannot be opened (Windows).

    subtle: fsync on a file makes its bytes durable, not its name; after a crash a renamed file or directory can
    be missing unless the directory holding the name is fsynced too.
    """
    path = check_path(path, "path")
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"path {str(path)!r} does not exist: no directory to flush")
        raise ValueError(f"path {str(path)!r} is not a directory: fsync_dir flushes a folder's entries")
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
