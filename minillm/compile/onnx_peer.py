"""ONNX Runtime as a second CPU peer: the model exported once to ONNX, run by Microsoft's inference engine.

What it adds: `export_onnx(model, path)` writes the step of chapter 04's generator as one ONNX graph
(`torch.onnx.export`): token ids (1, T) at their positions and the keys and values so far (n_layer, 1, nh, P, hs)
in, the last token's logits (1, V) and the keys and values after it (n_layer, 1, nh, P + T, hs) out. One graph
serves the prompt (T tokens over P = 0) and every decode step (T = 1), the same shape Hugging Face's ONNX exports of
GPT-2 take. `OnnxDecoder(path)` loads it into an ONNX Runtime session (one thread unless asked for more) and
generates as chapter 04's `generate` does, the same checks and stop rules, with no PyTorch module at all.

Why: a user who wants a fast CPU decode without writing C++ exports to ONNX and lets ONNX Runtime fuse and run the
graph (ONNX Runtime, onnxruntime.ai). It is the other peer chapter 13 measures against, beside
llama.cpp: `python -m minillm.compile.onnx_peer [--quick] [--json FILE]` runs the eager generator, ONNX Runtime
and the fused C++ step (`FusedCPUDecoder`) in turn, one thread each, on `base`, and checks that the three give the
same greedy tokens.

What it leaves out: a fixed-size cache written in place (the graph returns the grown keys and values each step,
a copy of O(context) per token, as the standard exports do), batches, and quantized models (a TypeError naming the
layer, as the fused step's `check_plain_model`). The file records its model's config and a sha256 of its graph in
the ONNX metadata; a load recomputes it, so an edited or damaged file is a ValueError naming the file.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.bench.cli import bench_parser, start, write_report
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.bench.workload import eval_prompts
from minillm.compile.decode import check_id_range, eval_mode, hooked_module, tracing
from minillm.compile.fused_step import FusedCPUDecoder
from minillm.compile.mirror import check_plain_model
from minillm.core.config import (GPTConfig, check_float_tensor, check_int, check_module_has_data, reads_report,
                                 short_repr, tensor_kind)
from minillm.core.io import atomic_write_bytes, check_output_dir, check_output_file, check_path
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, sample_next
from minillm.core.stopping import RequestState, check_eos_id, start_request, validate_prompt
from minillm.core.timing import check_repeats, interleave
from minillm.kvcache.generate import generate_ids
from minillm.naive.generate import collect

FORMAT = "minillm-onnx-step/1"  # the file's metadata names its format, so another ONNX model is refused
MAX_THREADS = 1024  # ONNX Runtime's intra-op threads: a C int; far more than any CPU has
INPUTS = ("ids", "positions", "past_k", "past_v")
OUTPUTS = ("logits", "present_k", "present_v")


def onnx_problem() -> str | None:
    """Why ONNX export or ONNX Runtime cannot run here (None when both can): onnx or onnxruntime not installed."""
    for name in ("onnx", "onnxruntime"):
        try:
            __import__(name)
        except ImportError:
            return f"the {name} package is not installed (pip install 'minillm[hf]')"
    return None


class _PastCache:
    """The KV cache of the exported graph, as plain tensors: each layer's keys and values so far (1, nh, P, hs) come
    in, the new ones are concatenated after them, and the grown tensors are kept for the graph's outputs. T new
    queries attend causally: query i sees the P earlier tokens and new ones 0..i."""

    def __init__(self, past_k: tuple[torch.Tensor, ...], past_v: tuple[torch.Tensor, ...]):
        self.past_k, self.past_v = past_k, past_v
        self.present: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (1, nh, T, hs) -> (1, nh, T, hs)."""
        k = torch.cat([self.past_k[layer_idx], k], dim=2)  # (1, nh, P + T, hs)
        v = torch.cat([self.past_v[layer_idx], v], dim=2)
        self.present.append((k, v))
        T, S = q.shape[2], k.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # (T, S), True = may attend
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class OnnxStep(nn.Module):
    """What is exported: (ids (1, T), positions (1, T), past_k, past_v (L, 1, nh, P, hs)) -> (logits (1, V) of the
    last token, present_k, present_v (L, 1, nh, P + T, hs))."""

    def __init__(self, model: GPT):
        super().__init__()
        require_model(model, "OnnxStep")
        check_module_has_data("model", model)  # a meta model has no weights to run or export
        self.model = model

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step (class doc); run eagerly, its inputs are checked first (a TypeError / ValueError naming them):
        ids and positions (1, T) int64 with T >= 1, ids in the vocabulary and positions in the window, past_k and
        past_v float tensors (L, 1, nh, P, hs) of the model's sizes. While exported only the types are."""
        cfg = self.model.config
        for name, t in (("ids", ids), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
                raise TypeError(f"{name} must be a (1, T) int64 tensor, got {tensor_kind(t)}")
        dtype = self.model.lm_head.weight.dtype
        for name, t in (("past_k", past_k), ("past_v", past_v)):
            if check_float_tensor(name, t).dtype != dtype:  # SDPA would refuse the mix naming query, key and value
                raise TypeError(f"{name} must hold the model's {dtype}, got {t.dtype}")
        if not tracing():
            if ids.dim() != 2 or ids.size(0) != 1 or ids.size(1) == 0 or positions.shape != ids.shape:
                raise ValueError(f"ids and positions must both be (1, T) with T >= 1, got {tuple(ids.shape)} and "
                                 f"{tuple(positions.shape)}")
            want = (cfg.n_layer, 1, cfg.n_head, past_k.size(3) if past_k.dim() == 5 else "P", cfg.head_size)
            for name, t in (("past_k", past_k), ("past_v", past_v)):
                if tuple(t.shape) != want or t.shape != past_k.shape:
                    raise ValueError(f"{name} must be (n_layer, 1, n_head, P, head_size) = {want}, as past_k, got "
                                     f"{tuple(t.shape)}")
            check_id_range("ids", ids, cfg.vocab_size, f"vocab_size={cfg.vocab_size}")
            check_id_range("positions", positions, cfg.block_size, f"block_size={cfg.block_size}")
        cache = _PastCache(past_k.unbind(0), past_v.unbind(0))
        h = self.model.hidden(ids, positions, cache)  # (1, T, C)
        logits = self.model.logits(h[:, -1])  # (1, V)
        return logits, torch.stack([k for k, _ in cache.present]), torch.stack([v for _, v in cache.present])


def graph_sha256(proto: Any) -> str:
    """Hex sha256 of an ONNX model's graph (its nodes and weights, serialized) and of every metadata entry but the
    digest itself: what `export_onnx` records and `OnnxDecoder` checks. TypeError for anything but an ONNX model
    (`onnx.ModelProto`), ValueError for a metadata entry that is not text."""
    import onnx

    if not isinstance(proto, onnx.ModelProto):
        raise TypeError(f"proto must be an onnx.ModelProto (onnx.load(path)), got {type(proto).__name__}")
    h = hashlib.sha256(proto.graph.SerializeToString())
    entries = [(p.key, p.value) for p in proto.metadata_props if p.key != "minillm_sha256"]
    for key, value in entries:  # protobuf hands a string field that is not UTF-8 (a flipped byte) back as bytes
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata entry {short_repr(key)} = {short_repr(value)} is not UTF-8 text: a damaged "
                             f"file")
    for entry in sorted(entries):
        h.update(json.dumps(entry).encode())
    return h.hexdigest()


def export_onnx(model: GPT, path: str | os.PathLike) -> Path:
    """Export `model`'s generator step (module doc) to the ONNX file `path` (written atomically); returns the path.

    The model must be a float32 CPU GPT of plain layers (`check_plain_model`: a quantized or QAT model is a
    TypeError naming the layer) with no forward hook (a ValueError: the graph would hold it frozen as traced). It is
    exported in eval mode, its modules' modes given back afterwards. Takes a few seconds."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a minillm GPT, got {type(model).__name__}")
    problem = onnx_problem()
    if problem is not None:
        raise RuntimeError(f"cannot export to ONNX here: {problem}")
    if model.device.type != "cpu":
        raise ValueError(f"model must be on the CPU (ONNX Runtime runs it there), got {model.device}")
    check_plain_model(model, "the ONNX export")
    if model.lm_head.weight.dtype != torch.float32:
        raise TypeError(f"the ONNX export takes float32 weights, got {model.lm_head.weight.dtype}")
    hooked = hooked_module(list(model.named_modules())[1:])
    if hooked is not None:
        raise ValueError(f"model's {hooked} has a forward hook: the graph would hold it frozen as traced; remove the "
                         "hook before exporting")
    check_path(path, "path")
    out = check_output_file(path, "path", (".onnx",))
    import onnx

    cfg = model.config
    L, nh, hs = cfg.n_layer, cfg.n_head, cfg.head_size
    example = (torch.zeros(1, 3, dtype=torch.long), torch.arange(2, 5).unsqueeze(0), torch.zeros(L, 1, nh, 2, hs),
               torch.zeros(L, 1, nh, 2, hs))  # T = 3 new tokens after P = 2: neither size is baked in
    kwargs: dict[str, Any] = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    with eval_mode(model), torch.no_grad(), tempfile.TemporaryDirectory(prefix="minillm-onnx-") as tmp, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice and tracer warnings
        raw = os.path.join(tmp, "step.onnx")
        torch.onnx.export(OnnxStep(model), example, raw, input_names=list(INPUTS), output_names=list(OUTPUTS),
                          dynamic_axes={"ids": {1: "T"}, "positions": {1: "T"}, "past_k": {3: "P"},
                                        "past_v": {3: "P"}, "present_k": {3: "S"}, "present_v": {3: "S"}},
                          opset_version=17, **kwargs)
        proto = onnx.load(raw)
    for key, value in (("minillm_format", FORMAT), ("minillm_config", json.dumps(cfg.to_dict()))):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    digest = graph_sha256(proto)  # subtle: before the digest's own entry is added (an empty entry would count)
    entry = proto.metadata_props.add()
    entry.key, entry.value = "minillm_sha256", digest
    return atomic_write_bytes(out, proto.SerializeToString())


def _graph_config(proto: Any, meta: dict[str, str], where: str) -> GPTConfig:
    """The GPTConfig the metadata records, checked against the graph itself: the inputs and outputs `export_onnx`
    names, in order, with the shapes the config implies (the keys and values (n_layer, 1, n_head, P, head_size), the
    logits (1, vocab_size)) and the position table holding block_size rows. The digest only says the file is what
    was signed; this says the signed config describes this graph (a re-signed edit would otherwise decode with
    another vocabulary or fail inside ONNX Runtime). A ValueError naming the file and the field otherwise."""
    try:
        config = GPTConfig.from_dict(json.loads(meta["minillm_config"]))
    except KeyError:
        raise ValueError(f"{where}: metadata field 'minillm_config' is missing") from None
    except (json.JSONDecodeError, TypeError, ValueError, RecursionError) as e:  # RecursionError: JSON nested deep
        raise ValueError(f"{where}: metadata field 'minillm_config' is not a model config: {type(e).__name__}: "
                         f"{str(e)[:100]}") from e

    def dims(value: Any) -> list[Any]:
        return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]

    L, nh, hs = config.n_layer, config.n_head, config.head_size
    want = {"ids": [1, "T"], "positions": [1, "T"], "past_k": [L, 1, nh, "P", hs], "past_v": [L, 1, nh, "P", hs],
            "logits": [1, config.vocab_size], "present_k": [L, 1, nh, "S", hs], "present_v": [L, 1, nh, "S", hs]}
    got = {v.name: dims(v) for v in [*proto.graph.input, *proto.graph.output]}
    names = ([v.name for v in proto.graph.input], [v.name for v in proto.graph.output])
    if names != (list(INPUTS), list(OUTPUTS)):
        raise ValueError(f"{where}: the graph's inputs and outputs are {names}, not the {list(INPUTS)} and "
                         f"{list(OUTPUTS)} export_onnx writes")
    for name, shape in want.items():
        if got[name] != shape:
            raise ValueError(f"{where}: {name} has shape {got[name]} in the graph but the metadata's config implies "
                             f"{shape}; the config and the graph disagree")
    wpe = [list(t.dims) for t in proto.graph.initializer if t.name.endswith("transformer.wpe.weight")]
    if wpe != [[config.block_size, config.n_embd]]:
        raise ValueError(f"{where}: the graph's position table is {wpe} but the metadata's config implies "
                         f"[{config.block_size}, {config.n_embd}]; the config and the graph disagree")
    return config


class OnnxDecoder:
    """An ONNX file from `export_onnx`, checked (its sha256) and loaded into an ONNX Runtime CPU session with
    `threads` intra-op threads; `generate` / `generate_ids` are chapter 04's, without the model. Each call keeps its
    own keys and values, so streams do not share state."""

    def __init__(self, path: str | os.PathLike, threads: int = 1):
        problem = onnx_problem()
        if problem is not None:
            raise RuntimeError(f"cannot run ONNX Runtime here: {problem}")
        threads = check_int("threads", threads)  # the plain int, compared and passed on
        if threads > MAX_THREADS:
            raise ValueError(f"threads must be at most {MAX_THREADS}, got {threads}")
        p = check_path(path, "path")
        if not p.is_file():
            raise FileNotFoundError(f"no ONNX file at {str(p)!r}")
        import onnx
        import onnxruntime as ort

        where = f"path {str(p)!r}"
        try:
            proto = onnx.load(str(p))
        except Exception as e:  # protobuf's DecodeError and friends: the file is not an ONNX model
            raise ValueError(f"{where} is not an ONNX model (truncated or another file?): {e}") from e
        meta = {entry.key: entry.value for entry in proto.metadata_props}
        if meta.get("minillm_format") != FORMAT:
            raise ValueError(f"{where} is not a minillm ONNX step (metadata minillm_format = "
                             f"{meta.get('minillm_format')!r}, expected {FORMAT!r}); export one with export_onnx")
        try:
            digest = graph_sha256(proto)
        except ValueError as e:  # a metadata entry that is no text
            raise ValueError(f"{where}: {e}") from None
        if meta.get("minillm_sha256") != digest:
            raise ValueError(f"{where}: the content does not match the sha256 export_onnx recorded: an edited or "
                             "damaged file")
        self.config = _graph_config(proto, meta, where)
        self.path = p
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:  # a graph edited and re-signed can pass the checks above and still be no graph ONNX Runtime runs
            self._session = ort.InferenceSession(proto.SerializeToString(), options,
                                                 providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime's own exception classes (Fail, InvalidGraph, ...)
            raise ValueError(f"{where}: ONNX Runtime cannot load the graph: {e}") from e

    def _empty_past(self) -> np.ndarray:
        cfg = self.config
        return np.zeros((cfg.n_layer, 1, cfg.n_head, 0, cfg.head_size), dtype=np.float32)

    def generate(self, prompt_ids: Any, params: SamplingParams, tokenizer: Any = None, eos_id: int | None = None,
                 truncate: bool = False) -> Iterator[int]:
        """Stream generated token ids as chapter 04's `generate` does (same checks, same stop rules, the finish
        reason as the generator's return value): the prompt in one run of the graph, then one run per token."""
        check_eos_id(eos_id, self.config.vocab_size)
        state = start_request(self.config, prompt_ids, params, tokenizer, eos_id, truncate=truncate)
        if state.params.n != 1:
            raise ValueError(f"an OnnxDecoder streams one sequence; got n={state.params.n} parallel samples")
        return self._stream(state)

    def _stream(self, state: RequestState) -> Iterator[int]:
        if state.finished:  # max_new_tokens == 0
            return state.finish_reason
        ids = np.array([state.prompt_ids], dtype=np.int64)  # (1, T)
        positions = np.arange(ids.shape[1], dtype=np.int64)[None]  # (1, T)
        past_k = past_v = self._empty_past()
        while True:
            logits, past_k, past_v = self._session.run(None, {"ids": ids, "positions": positions, "past_k": past_k,
                                                              "past_v": past_v})  # (1, V), (L, 1, nh, S, hs) x 2
            token_id = int(sample_next(torch.from_numpy(logits), state.params, state.generator))
            yield token_id
            if state.accept([token_id]):
                return state.finish_reason
            ids = np.array([[token_id]], dtype=np.int64)
            positions = np.array([[past_k.shape[3]]], dtype=np.int64)

    def generate_ids(self, prompt_ids: Any, params: SamplingParams, tokenizer: Any = None,
                     eos_id: int | None = None, truncate: bool = False) -> list[int]:
        """`generate`, collected into a list of the new token ids."""
        return collect(self.generate(prompt_ids, params, tokenizer, eos_id, truncate))[0]


# ----- the side-by-side ----------------------------------------------------------------------------------------

PATHS = ("eager (generate_ids)", "ONNX Runtime", "fused C++ step")


def measure(model: GPT, prompt: list[int], new_tokens: int = 128, repeats: int = 5,
            workdir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Export `model`, then generate `new_tokens` greedy tokens after `prompt` with each of PATHS in turn (one warm-up
    round, `repeats` timed rounds, `interleave`): tok/s per path (median), the ratios the text quotes, and whether
    all three gave the same tokens. The torch thread count is the caller's; ONNX Runtime gets the same."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a minillm GPT, got {type(model).__name__}")
    new_tokens = check_int("new_tokens", new_tokens)
    repeats = check_repeats("repeats", repeats)
    if workdir is not None:
        check_output_dir(workdir, "workdir")  # a file there would be blamed on export_onnx's path
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    ids, capped = validate_prompt(prompt, params, model.config.vocab_size, model.config.block_size)
    if capped != new_tokens:  # the window would stop every path early: tok/s of tokens never generated
        raise ValueError(f"new_tokens={new_tokens} do not fit after a {len(ids)}-token prompt in the context window "
                         f"block_size={model.config.block_size}: at most {capped}")
    with contextlib.ExitStack() as stack:
        folder = workdir if workdir is not None else stack.enter_context(tempfile.TemporaryDirectory())
        onnx_path = export_onnx(model, Path(folder) / "step.onnx")
        mb = onnx_path.stat().st_size / 1e6
        ort_dec = OnnxDecoder(onnx_path, threads=torch.get_num_threads())
        fused = FusedCPUDecoder(model)
        outs: dict[str, list[int]] = {}
        runs = {PATHS[0]: lambda: generate_ids(model, prompt, params), PATHS[1]: lambda: ort_dec.generate_ids(
            prompt, params), PATHS[2]: lambda: fused.generate_ids(prompt, params)}
        with torch.inference_mode():
            for name, run in runs.items():
                outs[name] = run()
            timings = interleave(list(runs.values()), warmup=1, repeats=repeats)
    tok_s = {name: new_tokens / t.median for name, t in zip(runs, timings)}
    samples = {name: [new_tokens / s for s in t.times] for name, t in zip(runs, timings)}
    same = all(o == outs[PATHS[0]] for o in outs.values())
    return {"prompt_len": len(prompt), "new_tokens": new_tokens, "repeats": repeats, "onnx_mb": mb,
            "tok_s": tok_s, "samples": samples, "identical": same,
            "ort_vs_eager": tok_s[PATHS[1]] / tok_s[PATHS[0]], "fused_vs_ort": tok_s[PATHS[2]] / tok_s[PATHS[1]]}


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """`measure` on `base` with a 16-token prompt from the validation text (quick: 32 tokens, 2 repeats)."""
    import onnxruntime as ort

    loaded = load_model("base", "cpu", seed)
    prompt = eval_prompts([16], loaded.model.config.vocab_size, real_text=True, seed=seed)[0]
    report = measure(loaded.model, prompt, new_tokens=32 if quick else 128, repeats=2 if quick else 5)
    return {"model": loaded.label, "threads": torch.get_num_threads(), "onnxruntime": ort.__version__,
            "torch": torch.__version__, **report}


@reads_report
def format_table(report: dict[str, Any]) -> str:
    return markdown_table(["path", "tok/s (median)", "range over rounds"],
                          [[name, f"{report['tok_s'][name]:,.0f}", f"{min(report['samples'][name]):,.0f}–"
                            f"{max(report['samples'][name]):,.0f}"] for name in PATHS])


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What chapter 13's text quotes from a report of `main --json`: the table ("paths"), tok/s of each path
    (`ort_tok_s`, `eager_tok_s`, `fused_tok_s`), the two ratios, the file's size and the run's sizes."""
    tok = report["tok_s"]
    return {"paths": format_table(report), "ort_tok_s": f"{tok[PATHS[1]]:,.0f}", "eager_tok_s": f"{tok[PATHS[0]]:,.0f}",
            "fused_tok_s": f"{tok[PATHS[2]]:,.0f}", "ort_vs_eager": f"{report['ort_vs_eager']:.2f}x",
            "fused_vs_ort": f"{report['fused_vs_ort']:.2f}x", "onnx_mb": f"{report['onnx_mb']:.1f} MB",
            "identical": str(report["identical"]), "new_tokens": str(report["new_tokens"]),
            "onnxruntime": str(report["onnxruntime"]), "cpu": str(report["cpu"]), "threads": str(report["threads"])}


def build_parser() -> argparse.ArgumentParser:
    return bench_parser("python -m minillm.compile.onnx_peer", __doc__.split("\n")[0], "32 tokens, 2 rounds",
                        devices=("cpu",))


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = start(ap, argv)
    problem = onnx_problem()
    if problem is not None:
        ap.error(problem)
    report = run(quick=args.quick, seed=args.seed)
    print(f"{report['model']}, {report['threads']} thread(s), onnxruntime {report['onnxruntime']}, "
          f"{report['new_tokens']} greedy tokens; identical tokens: {report['identical']}")
    print(format_table(report), end="")
    print(f"ONNX Runtime vs eager {report['ort_vs_eager']:.2f}x; fused C++ step vs ONNX Runtime "
          f"{report['fused_vs_ort']:.2f}x")
    write_report(args.json, report)
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
