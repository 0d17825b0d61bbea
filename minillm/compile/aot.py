"""The batch-1 decode step compiled ahead of time: one `.pt2` file that decodes in a fresh process, and cold start.

What it adds: `torch.compile` builds its graph in the process that runs it, at the first decode step, every time a
process starts (a warm inductor cache only skips part of it). `export_decode_step` does the work once, ahead of
time: `torch.export` captures `StaticDecoder`'s step as a graph, AOTInductor (`torch._inductor`) compiles it to a
shared library, and `aoti_compile_and_package` packs the library, the weights and the KV cache into one `.pt2` file.
`AOTDecoder(path)` loads that file (`aoti_load_package`) and generates, with no checkpoint, no `GPT` and no compiler:

    export_decode_step(model, "step.pt2")     ahead of time: export + AOTInductor build (tens of seconds)
    AOTDecoder("step.pt2").generate_ids(...)  any later process: load the library, then token by token

    package entry:  token (1, 1), position (1, 1)  ──step──▶  logits (1, V)
    package state:  K, V (1, nh, max_len, hs) per layer, written in place at slot = position

Design choices (the package is usable alone, and is one static-shape graph):
  - the KV cache is the exported module's buffers, mutated in place (`index_copy_`): AOTInductor keeps mutated
    buffers as the loaded model's own state, so it persists from call to call and never crosses the call boundary;
  - the write slot is the token's position, an input, not a buffer: at batch 1 without left padding slot ==
    position (what `StaticDecoder` checks), so K and V are the only state and a new request needs no reset: it
    writes from slot 0 again, and the causal mask hides every stale slot past the query;
  - the prompt goes through the same step one token at a time (prefill of n tokens = n steps). A second entry for
    prefill could not share the cache: each model in a package owns its buffers. The price is n matrix-vector
    steps instead of one matrix-matrix forward, a few milliseconds for a chat-length prompt on `base`;
  - the package carries its `GPTConfig` and max_len in its metadata, so the decoder checks prompts and applies
    chapter 04's stopping rules (`start_request`, `sample_next`, `RequestState.accept`) without the model;
  - like every file minillm saves, it carries a sha256 of its content (a zip member, `DIGEST_NAME`, written by
    the export over every other member: library, weights, metadata), checked on load: a damaged or edited package
    is a ValueError naming the file, never other tokens.

`cold_start` measures, each path in a fresh Python subprocess, process start to the first token and to the whole
generation: eager (load `base`, chapter 04's `generate`), `torch.compile` with a cold and then a warm inductor cache
(`StaticDecoder(mode="compile")`), and the AOT package; the tokens must be identical. What it leaves out: batches,
CUDA (the export here is for the CPU), and quantized layers that `torch.compile` cannot trace either
(`uncompilable_layer`). The command: `python -m minillm.compile.aot [--threads N] [--quick] [--json FILE]`;
`quotes(report)` gives the table and the figures chapter 13's text includes from the saved report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn
from filelock import FileLock

from minillm.bench.cli import bench_parser, cli_type, start, write_report
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.bench.workload import eval_prompts
from minillm.compile.decode import (StaticDecoder, check_decoder_room, check_id_range, compile_problem, decoder_max_len,
                                    eval_mode, hooked_module, uncompilable_layer)
from minillm.core.config import (PRESETS, GPTConfig, check_choice, check_fits_window, check_int, check_module_has_data,
                                 check_report, check_threads, check_timeout, reads_report, short_repr, tensor_kind)
from minillm.core.io import (SHA256_FIELD, atomic_write_bytes, check_output_file, check_path, check_sha256,
                             with_sha256)
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, check_seed, sample_next
from minillm.core.stopping import RequestState, check_eos_id, check_token_ids, start_request
from minillm.core.timing import check_repeats
from minillm.gpt.pretrained import SHIPPED_PRESETS
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate
from minillm.naive.generate import collect

FORMAT = "minillm-aot-decode-step/1"  # the package's metadata names its format, so a stranger .pt2 is refused
DIGEST_NAME = "minillm_sha256.json"  # a member of the .pt2's top folder: the sha256 of every other member
MODEL_NAMES = sorted({*SHIPPED_PRESETS, *PRESETS})  # what cold_start (and --model) can load
PATHS = ("eager", "compile, cold cache", "compile, warm cache", "AOT package, cold cache", "AOT package, warm cache")
CHILD_MARK = "AOT-CHILD "  # the line of a child's stdout that carries its result
PROMPT_LEN = 16  # cold_start's prompt: validation text (the shipped weights) or seeded ids, as chapter 13's bench


def aot_problem() -> str | None:
    """None when torch.export + AOTInductor can build a CPU package here, else why not (no `torch.export` or
    `aoti_compile_and_package` in this PyTorch, or `compile_problem`: dynamo unsupported, no C++ compiler)."""
    if not hasattr(torch, "export") or not hasattr(torch._inductor, "aoti_compile_and_package"):
        return "this PyTorch has no torch.export / torch._inductor.aoti_compile_and_package (AOTInductor)"
    return compile_problem()


class DecodeStep(nn.Module):
    """StaticDecoder's step as a module to export: token (1, 1), position (1, 1) -> logits (1, V), over a
    static-shape cache of `max_len` slots whose K and V tensors are this module's buffers (k0, v0, k1, ...)."""

    def __init__(self, model: GPT, max_len: int):
        super().__init__()
        max_len = decoder_max_len(require_model(model, "DecodeStep"), max_len)
        self.model = model
        self.cache = ContiguousKVCache(model.config, 1, max_len, device=model.device, use_static_shapes=True)
        for i in range(model.config.n_layer):
            self.register_buffer(f"k{i}", self.cache.k[i])  # (1, nh, max_len, hs)
            self.register_buffer(f"v{i}", self.cache.v[i])

    def forward(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        for name, t in (("token", token), ("position", position)):  # static checks: export traces through them
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (1, 1) or t.dtype != torch.int64:
                raise TypeError(f"{name} must be a (1, 1) int64 tensor, got {tensor_kind(t)}"
                                + (f" of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else ""))
        check_id_range("token", token, self.model.config.vocab_size, f"vocab_size={self.model.config.vocab_size}")
        check_id_range("position", position, self.cache.max_len, f"max_len={self.cache.max_len}")  # the slot too
        cache, n = self.cache, self.model.config.n_layer
        # subtle: export traces with stand-ins for the module's buffers; the cache's own lists would still hold the
        # real tensors, which export lifts as constants (their writes lost). Rebound here, the step writes the buffers.
        cache.k = [getattr(self, f"k{i}") for i in range(n)]
        cache.v = [getattr(self, f"v{i}") for i in range(n)]
        cache.slot = position.reshape(()).clone()  # batch 1, no padding: the write slot is the position
        cache._mask = None  # built again by layer 0 from this step's slot
        h = self.model.hidden(token, position, cache)  # (1, 1, C)
        return self.model.logits(h[:, -1])  # (1, V)


def export_decode_step(model: GPT, path: str | os.PathLike, max_len: int | None = None) -> Path:
    """Export `model`'s batch-1 static decode step and package it with AOTInductor as one `.pt2` file at `path`
    (written atomically: built in a temporary folder, then renamed into place). Returns the path.

    `max_len` sizes the package's cache (default: the context window, `decoder_max_len`). The model must be a CPU
    GPT with values (not meta), no forward hook on its modules (as `StaticDecoder`) and no layer `torch.compile`
    cannot trace (`uncompilable_layer`); it is exported in eval mode, and its modules' modes are left as they were.
    The package records the sha256 of its content (`DIGEST_NAME`), which `AOTDecoder` checks. Takes tens of
    seconds: AOTInductor compiles the generated C++ here, once.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a minillm GPT, got {type(model).__name__}")
    check_module_has_data("model", model)
    if model.device.type != "cpu":
        raise ValueError(f"model must be on the CPU (this chapter's AOT package is a CPU library), got {model.device}")
    layer = uncompilable_layer(model)
    if layer is not None:
        raise ValueError(f"model's {layer} cannot be exported: its forward reads tensor values into Python")
    hooked = hooked_module(list(model.named_modules())[1:])  # as StaticDecoder: the step calls hidden(), not forward
    if hooked is not None:
        raise ValueError(f"model's {hooked} has a forward hook: the package would run it frozen as traced (or not "
                         "at all), and never follow it afterwards; remove the hook before exporting")
    check_path(path, "path")
    out = check_output_file(path, "path", (".pt2",))
    max_len = decoder_max_len(model.config, max_len)
    problem = aot_problem()
    if problem is not None:
        raise RuntimeError(f"cannot build an AOTInductor package here: {problem}")
    metadata = {"minillm_format": FORMAT, "minillm_config": json.dumps(model.config.to_dict()),
                "minillm_max_len": str(max_len)}
    with eval_mode(model):
        step = DecodeStep(model, max_len)
        example = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))  # token, position
        with torch.no_grad():
            exported = torch.export.export(step, example)
        with tempfile.TemporaryDirectory(prefix="minillm-aot-") as tmp, _export_lock():
            built = torch._inductor.aoti_compile_and_package(
                exported, package_path=os.path.join(tmp, "step.pt2"),
                inductor_configs={"aot_inductor.metadata": metadata})
            with zipfile.ZipFile(built, "a") as z:
                _check_built_metadata(z, metadata)
                digest = with_sha256({"minillm_format": FORMAT}, _package_members(z, built, skip=None))
                z.writestr(_digest_member(z), json.dumps(digest))
            return atomic_write_bytes(out, Path(built).read_bytes())


def _export_lock() -> FileLock:
    """One export at a time per inductor cache folder (a lock file inside it), across processes.

    subtle: AOTInductor writes the step's generated files into the shared inductor cache under a name that hashes the
    graph, and packs them into the .pt2 afterwards, outside its own lock. Two processes exporting the same model at
    once (two pytest workers, two terminals) rewrite each other's files while the other packs them: a package with
    an empty `*_metadata.json` member, which loads with a JSON parse error. The exports are CPU-bound compiler runs
    anyway, so running them one after another costs little."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # torch >= 2.5
    except ImportError:
        from torch._inductor.runtime.runtime_utils import cache_dir  # older
    folder = cache_dir()
    os.makedirs(folder, exist_ok=True)
    return FileLock(os.path.join(folder, "minillm-aot-export.lock"))


def _check_built_metadata(z: zipfile.ZipFile, metadata: dict[str, str]) -> None:
    """Every `*_metadata.json` member of a freshly built package `z` holds the metadata it was built with: a
    RuntimeError, before anything is written, if another process (not a minillm export, which `_export_lock` orders)
    rewrote AOTInductor's cache files while this package was packed."""
    for name in z.namelist():
        if not name.endswith("_metadata.json"):
            continue
        try:
            found = json.loads(z.read(name))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            found = f"unreadable ({e})"
        if not isinstance(found, dict) or any(found.get(k) != v for k, v in metadata.items()):
            raise RuntimeError(f"AOTInductor packed a damaged {name!r}: another process compiled the same graph in "
                               "the inductor cache at the same time; export again")


def _digest_member(z: zipfile.ZipFile) -> str:
    """Where `export_decode_step` writes the digest in the freshly built package `z`: inside its top folder
    ("step/"), where torch's loader wants every member."""
    return z.namelist()[0].split("/")[0] + "/" + DIGEST_NAME


def _find_digest(z: zipfile.ZipFile, where: str) -> str | None:
    """The digest member of the package `z` (`where` names the file), found by its name wherever it lies; None
    when there is none: a package exported before digests were recorded.

    subtle: not looked up in the first member's folder, where the export put it: a member prepended to an edited
    package would move that folder, and the package would pass for one that records no digest (checking nothing).
    Found by name, the digest is checked, and the prepended member, which it does not cover, fails it. Two
    digest members are a ValueError: which one the export wrote cannot be told."""
    found = [name for name in z.namelist() if name.rsplit("/", 1)[-1] == DIGEST_NAME]
    if len(found) > 1:
        raise ValueError(f"{where} holds {len(found)} digest members ({found}), where export_decode_step writes "
                         "one: a damaged or edited package")
    return found[0] if found else None


def _check_digest_fields(digest: Any, where: str, member: str) -> None:
    """A digest member that is there is the complete one `export_decode_step` writes: a JSON object with "sha256"
    = 64 lowercase hex digits and "minillm_format" = FORMAT (every field a string); anything less is a ValueError
    naming the file and the field. subtle: a package that records no digest is one WITHOUT the member (exported
    before digests were recorded); one that holds it without its sha256 was edited, and read as "records none" it
    would load edited weights unchecked."""
    if not isinstance(digest, dict):
        raise ValueError(f"{where}: its {member!r} is not the digest export_decode_step writes (a JSON object), got "
                         f"a JSON {type(digest).__name__}: a damaged or edited package")
    for field, want, valid in ((SHA256_FIELD, "64 hex digits", lambda v: re.fullmatch(r"[0-9a-f]{64}", v)),
                               ("minillm_format", repr(FORMAT), lambda v: v == FORMAT)):
        value = digest.get(field)
        if not isinstance(value, str) or not valid(value):
            got = repr(value) if field in digest else "no such field"
            raise ValueError(f"{where}: its {member!r} has no valid {field!r} field (got {got}; export_decode_step "
                             f"writes {want}): a damaged or edited package (one exported before digests were "
                             f"recorded has no {DIGEST_NAME} at all)")
    other = next((k for k, v in digest.items() if not isinstance(v, str)), None)
    if other is not None:
        raise ValueError(f"{where}: its {member!r} field {other!r} is not a string (got {digest[other]!r}): a "
                         "damaged or edited package")


def _package_members(z: zipfile.ZipFile, path: str | os.PathLike, skip: str | None) -> dict[str, torch.Tensor]:
    """Every member of the package `z` (at `path`) but the digest (`skip`; None while exporting, before it is
    written), as uint8 tensors by name: the content that `minillm.core.io.content_sha256` hashes, as it hashes a
    checkpoint's tensors. A member whose bytes fail the zip's own CRC check is a ValueError naming the file."""
    members = {}
    for name in z.namelist():
        if name == skip:
            continue
        try:
            data = bytearray(z.read(name))
        except (zipfile.BadZipFile, OSError, EOFError) as e:  # zlib's errors are OSError subclasses here too
            raise ValueError(f"path {str(path)!r} is a damaged package: member {name!r} cannot be read ({e})") from e
        members[name] = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    return members


def check_package(path: str | os.PathLike) -> bool:
    """Recompute the sha256 `export_decode_step` recorded in the package at `path` (`DIGEST_NAME`); a mismatch,
    an unreadable member, a file that is no zip archive or an empty one, and a digest member that is there but
    incomplete (no valid "sha256" or "minillm_format" field) or not alone, are each a ValueError naming the file
    (FileNotFoundError for no file). False, checking nothing more, only for a package with no digest member at all
    (exported before digests were recorded: it still loads, as checkpoints without one do); True when it matches.
    Reads the whole file once (about a tenth of a second for `base`'s package)."""
    p = check_path(path, "path")
    if not p.is_file():
        raise FileNotFoundError(f"no AOT decode-step package at {str(p)!r}")
    where = f"path {str(p)!r}"
    try:  # subtle: zipfile.is_zipfile reads only the archive's last record; opening it can still fail
        package = zipfile.ZipFile(p)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{where} is not a .pt2 package (not a zip archive: truncated or another file?): {e}") from e
    with package as z:
        if not z.namelist():  # torch's loader would refuse it too, naming no file
            raise ValueError(f"{where} is not a .pt2 package (an empty zip archive)")
        member = _find_digest(z, where)
        if member is None:
            return False
        try:
            digest = json.loads(z.read(member))
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, RecursionError) as e:  # ValueError: json's, digits
            raise ValueError(f"{where}: its {member!r} cannot be read ({type(e).__name__}: {str(e)[:100]}): a damaged "
                             "package") from e
        _check_digest_fields(digest, where, member)
        return check_sha256(digest, _package_members(z, p, skip=member), where)


class AOTDecoder:
    """A package from `export_decode_step`, loaded; `generate` / `generate_ids` are chapter 04's, without the model.

    `config` (the exported model's `GPTConfig`) and `max_len` come from the package's metadata. The package holds one
    KV cache, so one stream runs at a time: starting another generation ends the one before it (its next step is a
    RuntimeError, never tokens computed over the other request's cache). Its sha256 is checked first
    (`check_package`): a damaged or edited package is a ValueError naming the file.

    subtle: `aoti_load_package` (torch 2.13) first probes this CPU's vector instruction sets by compiling small C++
    test programs (`torch._inductor.cpu_vec_isa`), only to warn if the package was built for another; the results
    are cached in the inductor cache (TORCHINDUCTOR_CACHE_DIR). So the first load on a machine costs seconds of
    compiler runs and later loads none; with no C++ compiler the probe fails and torch loads the library directly
    (a warning, "Loading outdated pt2 file"). The library itself is never rebuilt.
    """

    def __init__(self, path: str | os.PathLike):
        p = check_path(path, "path")
        check_package(p)  # a file, a zip, its digest: before the library is loaded, a damaged package never runs
        try:
            self._runner = torch._inductor.aoti_load_package(str(p))
        except RuntimeError as e:
            raise ValueError(f"path {str(p)!r} could not be loaded as an AOTInductor package: {e}") from e
        meta = self._runner.get_metadata()
        if meta.get("minillm_format") != FORMAT:
            raise ValueError(f"path {str(p)!r} is not a minillm decode-step package (metadata minillm_format = "
                             f"{meta.get('minillm_format')!r}, expected {FORMAT!r}); build one with "
                             "export_decode_step")
        self.path = p
        try:  # signed by the digest, but a package from before digests is not: its fields are read with care
            self.config = GPTConfig.from_dict(json.loads(meta["minillm_config"]))
            self.max_len = int(meta["minillm_max_len"])
            if not 1 <= self.max_len <= self.config.block_size:
                raise ValueError(f"minillm_max_len={self.max_len} is outside [1, block_size="
                                 f"{self.config.block_size}]")
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"path {str(p)!r}: its metadata fields minillm_config and minillm_max_len cannot be "
                             f"read ({type(e).__name__}: {str(e)[:100]}): a damaged package") from e
        self._token = torch.zeros(1, 1, dtype=torch.long)  # the step's inputs, refilled per token
        self._position = torch.zeros(1, 1, dtype=torch.long)
        self._request = 0  # the stream allowed to step; a new generate() takes the cache from the one before

    def _step(self, token_id: int, position: int, request: int) -> torch.Tensor:
        """One call of the package: logits (1, V) for token_id at position (its K/V written at slot position)."""
        if request != self._request:
            raise RuntimeError("this generation was ended by a later generate() on the same AOTDecoder: the package "
                               "holds one KV cache; finish (or drop) one stream before starting the next")
        self._token.fill_(token_id)
        self._position.fill_(position)
        try:
            logits = self._runner(self._token, self._position)
        except RuntimeError as e:  # the compiled graph's own checks: a signed config that is not the graph's
            raise ValueError(f"the package {str(self.path)!r} failed a step (token {token_id}, position {position}): "
                             f"its metadata does not describe its compiled graph? {str(e).splitlines()[0][:200]}"
                             ) from e
        if tuple(logits.shape[-1:]) != (self.config.vocab_size,):
            raise ValueError(f"the package {str(self.path)!r} gives logits of shape {tuple(logits.shape)}, but its "
                             f"metadata says vocab_size={self.config.vocab_size}: a re-signed or damaged package")
        return logits

    def generate(self, prompt_ids: Any, params: SamplingParams, tokenizer: Any = None, eos_id: int | None = None,
                 truncate: bool = False) -> Iterator[int]:
        """Stream generated token ids as chapter 04's `generate` does (same checks, same stop rules, the finish
        reason as the generator's return value); the prompt goes through the package's step token by token.
        Everything is checked here, before the first token."""
        check_eos_id(eos_id, self.config.vocab_size)
        state = start_request(self.config, prompt_ids, params, tokenizer, eos_id, truncate=truncate)
        if params.n != 1:
            raise ValueError(f"an AOTDecoder streams one sequence; got n={params.n} parallel samples")
        check_decoder_room(self.max_len, self.config, prompt_ids, params, truncate)
        self._request += 1
        return self._stream(state, self._request)

    def _stream(self, state: RequestState, request: int) -> Iterator[int]:
        if state.finished:  # max_new_tokens == 0
            return state.finish_reason
        for pos, token_id in enumerate(state.prompt_ids):  # prefill: the prompt through the step, one at a time
            logits = self._step(token_id, pos, request)  # (1, V); only the last prompt token's is sampled
        pos = len(state.prompt_ids)
        while True:
            token_id = int(sample_next(logits, state.params, state.generator))
            yield token_id
            if state.accept([token_id]):
                return state.finish_reason
            logits = self._step(token_id, pos, request)  # (1, V)
            pos += 1

    def generate_ids(self, prompt_ids: Any, params: SamplingParams, tokenizer: Any = None,
                     eos_id: int | None = None, truncate: bool = False) -> list[int]:
        """`generate`, collected into a list of the new token ids."""
        return collect(self.generate(prompt_ids, params, tokenizer, eos_id, truncate))[0]


# ----- cold start -----------------------------------------------------------------------------------------------

CHILD_CODE = ("import json, sys; from minillm.compile.aot import CHILD_MARK, child_main; "
              "print(CHILD_MARK + json.dumps(child_main(sys.stdin.read())), flush=True)")
REFUSALS = {e.__name__: e for e in (TypeError, ValueError, FileNotFoundError)}  # the child's checks' errors


def check_child_spec(spec: object) -> str:
    """A cold-start run's spec, checked where it is written (`run_fresh`) and where it is read (`run_child`): a dict
    with a known "mode" and the fields that mode needs, each a value the child can run: threads (`check_threads`),
    new_tokens a positive int, prompt a non-empty list of token ids (in the named model's vocabulary; an "aot"
    package's is checked when it loads), name a model `load_model` knows and seed a 64-bit int, package an existing
    file. Its mode, or a TypeError / ValueError (FileNotFoundError for the package) naming the field, so that a bad
    value is refused here rather than as the child's traceback."""
    if not isinstance(spec, dict):
        raise TypeError(f"spec must be a cold-start run's dict, got {type(spec).__name__}")
    mode = check_choice("spec['mode']", spec.get("mode"), ("eager", "compile", "aot"))
    need = ("threads", "new_tokens", "prompt") + (("package",) if mode == "aot" else ("name", "seed"))
    if missing := [key for key in need if key not in spec]:
        raise ValueError(f"spec for mode {mode!r} must hold {list(need)}; it lacks {missing}")
    check_threads("spec['threads']", spec["threads"])
    check_int("spec['new_tokens']", spec["new_tokens"])
    vocab = 2**63  # an aot package's vocabulary is its own: ids are checked as ints here, in range when it loads
    if mode == "aot":
        package = check_path(spec["package"], "spec['package']")
        if not package.is_file():
            raise FileNotFoundError(f"spec['package'] {str(package)!r}: no such file (export_decode_step writes one)")
    else:
        name = check_choice("spec['name']", spec["name"], MODEL_NAMES)
        check_seed(check_int("spec['seed']", spec["seed"], 0))
        vocab = GPTConfig.from_name(SHIPPED_PRESETS.get(name, name)).vocab_size
    if not check_token_ids("spec['prompt']", spec["prompt"], vocab):
        raise ValueError("spec['prompt'] must hold at least one token id, got []")
    return mode


def check_env(env: object) -> dict[str, str]:
    """Extra environment variables for a child process: None (none) or a dict of str names to str values; a
    TypeError / ValueError naming env otherwise (subprocess's own errors name no variable)."""
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise TypeError(f"env must be a dict of environment variables (str to str) or None, got {type(env).__name__}")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"env must map str names to str values, got {short_repr(key)}: {type(value).__name__}")
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise ValueError(f"env holds a variable the OS cannot set: {short_repr(key)}={short_repr(value)}")
    return {str.__str__(k): str.__str__(v) for k, v in env.items()}


def child_main(text: str) -> dict[str, Any]:
    """A child's `run_child` on the JSON spec `text`: its result, or, when a check refused the spec (a value only the
    child could check: a prompt past the model's window, new_tokens past the package's max_len, a file that is no
    package), {"refused": [error type, message]} for `run_fresh` to raise as that error in the parent."""
    try:
        return run_child(json.loads(text))
    except tuple(REFUSALS.values()) as e:
        return {"refused": [next(name for name, kind in REFUSALS.items() if isinstance(e, kind)), str(e)]}


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The body of one cold-start subprocess: `spec["mode"]` "eager", "compile" or "aot" generates `spec["prompt"]`
    greedily for `spec["new_tokens"]` tokens on `spec["threads"]` threads. Returns time.monotonic() stamps (one
    clock for every process on the machine): imports done, ready (model loaded / package loaded), after each token.
    A spec that lacks a field or holds a wrong one is a TypeError / ValueError naming it (`cold_start` writes it)."""
    imported = time.monotonic()
    mode = check_child_spec(spec)
    torch.set_num_threads(check_threads("spec['threads']", spec["threads"]))
    params = SamplingParams.greedy(spec["new_tokens"], ignore_eos=True)
    if mode == "aot":
        stream = AOTDecoder(spec["package"]).generate(spec["prompt"], params)
    else:
        model = load_model(spec["name"], seed=spec["seed"]).model
        if mode == "eager":
            stream = generate(model, spec["prompt"], params)
        else:  # the compile happens at the first decode step: the prefill runs eager
            dec = StaticDecoder(model, "compile")
            stream = generate(model, spec["prompt"], params, kv_cache=dec.cache, decode_fn=dec)
    ready = time.monotonic()
    tokens, stamps = [], []
    for token_id in stream:
        tokens.append(token_id)
        stamps.append(time.monotonic())
    return {"imported": imported, "ready": ready, "token_times": stamps, "tokens": tokens}


def run_fresh(spec: dict[str, Any], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`run_child(spec)` in a fresh Python subprocess (this interpreter, local only), killed with its process group
    past `timeout` seconds (a RuntimeError). Times are seconds from just before the process was started. spec is
    checked here as the child checks it (`check_child_spec`), env (extra variables) by `check_env`; what only the
    child can check (the model's window, the package itself) comes back as the child's TypeError / ValueError /
    FileNotFoundError, raised here (`child_main`). A child that fails otherwise is a RuntimeError with its stderr."""
    mode = check_child_spec(spec)
    timeout = check_timeout(timeout)
    env = {**os.environ, **check_env(env)}
    try:
        text = json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as e:  # a tensor, a set, NaN: the child could not read it back
        raise ValueError(f"spec must hold only JSON values (it goes to the child as JSON): {e}") from None
    t0 = time.monotonic()
    # the spec on stdin: a long prompt would not fit the OS's limit on a command line
    proc = subprocess.Popen([sys.executable, "-c", CHILD_CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(input=text, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the child and any compile workers it started
        proc.communicate()
        raise RuntimeError(f"the {mode} cold-start run took longer than timeout={timeout} s") from None
    lines = [line for line in out.splitlines() if line.startswith(CHILD_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {mode} cold-start run failed (exit {proc.returncode}): {err[-2000:]}")
    r = json.loads(lines[-1][len(CHILD_MARK):])
    if "refused" in r:  # the child's own check of a value the parent could not check: raised here as itself
        kind, message = r["refused"]
        raise REFUSALS.get(kind, ValueError)(f"the {mode} cold-start run refused its spec: {message}")
    times = [t - t0 for t in r["token_times"]]
    return {"imports": r["imported"] - t0, "ready": r["ready"] - t0, "first_token": times[0],
            "second_token": times[1] if len(times) > 1 else times[0], "all_tokens": times[-1], "tokens": r["tokens"]}


def cold_start(name: str = "base", new_tokens: int = 32, repeats: int = 3, threads: int = 1, seed: int = 0,
               timeout: float = 600.0) -> dict[str, Any]:
    """Process start to first token and to `new_tokens` greedy tokens for each of `PATHS`, each run in a fresh
    subprocess on `threads` torch threads, medians of `repeats`. Each repeat: eager; compile with a new empty
    TORCHINDUCTOR_CACHE_DIR, then again with that same cache; the AOT package likewise with a new cache, then the
    same again (loading probes the CPU through that cache, see `AOTDecoder`). The package is exported first, here
    (its build time is reported: the cost moved ahead of time). Every argument is checked before any work; a run past
    `timeout` seconds is killed (a RuntimeError)."""
    name = check_choice("name", name, MODEL_NAMES)
    new_tokens = check_int("new_tokens", new_tokens)
    repeats = check_repeats("repeats", repeats)
    threads = check_threads("threads", threads)  # each subprocess sets it: 100000 would crash torch's pool there
    seed = check_seed(check_int("seed", seed, 0))  # [0, 2**64): torch's generator's range
    timeout = check_timeout(timeout)
    check_fits_window(f"the {PROMPT_LEN}-token prompt", PROMPT_LEN, new_tokens,
                      GPTConfig.from_name(SHIPPED_PRESETS.get(name, name)).block_size, name)
    problem = aot_problem()
    if problem is not None:
        raise RuntimeError(f"cold_start needs torch.compile and AOTInductor: {problem}")
    loaded = load_model(name, seed=seed)
    prompt = eval_prompts([PROMPT_LEN], loaded.model.config.vocab_size, loaded.trained, seed)[0]
    work = Path(tempfile.mkdtemp(prefix="minillm-cold-start-"))
    try:
        package = work / "step.pt2"
        t = time.perf_counter()
        export_decode_step(loaded.model, package)
        build_seconds = time.perf_counter() - t
        spec = {"name": name, "seed": seed, "prompt": prompt, "new_tokens": new_tokens, "threads": threads,
                "package": str(package)}
        # one thread for inductor's own compile workers too, so a cold compile is timed as one process
        env = {"OMP_NUM_THREADS": str(threads), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
        for r in range(repeats):
            compiled, aot = str(work / f"compile-{r}"), str(work / f"aot-{r}")  # empty: the cold run fills each
            for path, mode, cache_dir in ((PATHS[0], "eager", str(work / f"eager-{r}")),
                                          (PATHS[1], "compile", compiled), (PATHS[2], "compile", compiled),
                                          (PATHS[3], "aot", aot), (PATHS[4], "aot", aot)):
                runs[path].append(run_fresh({**spec, "mode": mode}, timeout,
                                            {**env, "TORCHINDUCTOR_CACHE_DIR": cache_dir}))
        package_mb = package.stat().st_size / 1e6
    finally:
        shutil.rmtree(work, ignore_errors=True)
    want = runs[PATHS[0]][0]["tokens"]
    rows = []
    for path in PATHS:
        row = {"path": path, "identical": all(run["tokens"] == want for run in runs[path]), "runs": runs[path]}
        for key in ("imports", "ready", "first_token", "second_token", "all_tokens"):
            row[key] = statistics.median(run[key] for run in runs[path])
        rows.append(row)
    return {"model": loaded.label, "threads": threads, "repeats": repeats, "new_tokens": new_tokens,
            "prompt_len": len(prompt), "build_seconds": build_seconds,
            "package_mb": package_mb, "rows": rows}


# What each row of a `cold_start` report holds, as the table and `quotes` read it.
ROW_KEYS = ("path", "imports", "ready", "first_token", "second_token", "all_tokens", "identical", "runs")


@reads_report
def cold_start_table(report: dict[str, Any]) -> str:
    """The paths of a `cold_start` report as a Markdown table: seconds from process start (medians) to each stage.
    A report without its rows (`ROW_KEYS`) is a TypeError / ValueError naming it (`check_report`)."""
    check_report("report", report, ("rows",), "rows", ROW_KEYS)
    return markdown_table(["path", "imports done", "ready", "first token", "second token", "all tokens",
                           "identical tokens"],
                          [[r["path"], *(f"{r[k]:.2f} s" for k in ("imports", "ready", "first_token", "second_token",
                                                                    "all_tokens")), str(r["identical"])]
                           for r in report["rows"]])


@reads_report
def format_table(report: dict[str, Any]) -> str:
    check_report("report", report, ("model", "prompt_len", "new_tokens", "threads", "repeats", "build_seconds",
                                    "package_mb", "rows"))
    lines = [f"cold start, {report['model']}: a {report['prompt_len']}-token prompt, {report['new_tokens']} greedy "
             f"tokens, {report['threads']} thread(s), each path in a fresh process, median of {report['repeats']}; "
             f"seconds from process start", "", cold_start_table(report).rstrip("\n")]
    lines.append(f"AOT package: built ahead of time in {report['build_seconds']:.1f} s (export + AOTInductor), "
                 f"{report['package_mb']:.1f} MB. torch.compile's prefill runs eager: its compile lands in the "
                 "second token.")
    return "\n".join(lines)


# The paths' names in `quotes`, in the order of PATHS.
PATH_KEYS = ("eager", "compile_cold", "compile_warm", "aot_cold", "aot_warm")


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What the chapter text quotes from a report of `main --json`: the table ("cold_start"); per path (`PATH_KEYS`)
    its medians in seconds, `_ready`, `_first` (first token), `_all` (every token), `_load` (imports done to
    ready: loading the model or the package), and the fastest and slowest repeat to every token (`_all_min`,
    `_all_max`); the compile, which torch.compile's second token carries
    (`compile_cold_compile`, `compile_warm_compile`: second token minus first); how much sooner the package
    finished than torch.compile with a cache as cold or as warm (`aot_vs_compile_cold`, `aot_vs_compile_warm`,
    "2.2x"); whether every path gave the eager tokens (`identical`); the package (`build_seconds`, `package_mb`);
    the run's settings (`new_tokens`, `prompt_len`, `repeats`, `threads`, `model`, `cpu`, `command`)."""
    out = {"cold_start": cold_start_table(report)}  # checks the rows first
    check_report("report", report, ("build_seconds", "package_mb"))
    if len(report["rows"]) != len(PATH_KEYS):
        raise ValueError(f"report['rows'] must hold one row per path, {len(PATH_KEYS)} ({', '.join(PATH_KEYS)}), "
                         f"got {len(report['rows'])}")
    rows = dict(zip(PATH_KEYS, report["rows"]))
    for key, r in rows.items():
        out[f"{key}_ready"] = f"{r['ready']:.2f} s"
        out[f"{key}_first"] = f"{r['first_token']:.2f} s"
        out[f"{key}_all"] = f"{r['all_tokens']:.2f} s"
        out[f"{key}_load"] = f"{r['ready'] - r['imports']:.2f} s"
        every = [run["all_tokens"] for run in r["runs"]]
        out[f"{key}_all_min"], out[f"{key}_all_max"] = f"{min(every):.2f} s", f"{max(every):.2f} s"
    for cache in ("cold", "warm"):
        c = rows[f"compile_{cache}"]
        out[f"compile_{cache}_compile"] = f"{c['second_token'] - c['first_token']:.1f} s"
        out[f"aot_vs_compile_{cache}"] = f"{c['all_tokens'] / rows[f'aot_{cache}']['all_tokens']:.1f}x"
    out["identical"] = str(all(r["identical"] for r in report["rows"]))
    out["build_seconds"] = f"{report['build_seconds']:.1f} s"
    out["package_mb"] = f"{report['package_mb']:.1f} MB"
    for key in ("new_tokens", "prompt_len", "repeats", "threads", "model", "cpu", "command"):
        if key in report:
            out[key] = str(report[key])
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = bench_parser("python -m minillm.compile.aot", __doc__.splitlines()[0], "one repeat instead of three",
                      devices=("cpu",))
    ap.add_argument("--model", default="base", choices=MODEL_NAMES, help="the model to load (default base)")
    ap.add_argument("--timeout", default=600.0, help="seconds one fresh process may run (default 600)",
                    type=cli_type(check_timeout, float))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = start(build_parser(), argv)
    report = cold_start(args.model, repeats=1 if args.quick else 3, threads=args.threads, seed=args.seed,
                        timeout=args.timeout)
    print(format_table(report))
    write_report(args.json, report)
    return 0 if all(r["identical"] for r in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
