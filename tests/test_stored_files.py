"""Stored quantized (chapter 09) and pruned (chapter 10) checkpoints are verified on load: every corruption a user
can make by hand, or a disk can make by accident, is a ValueError naming the file and the field or tensor.

Each row of `CASES` saves a tiny model, damages the file one way, and loads it. The damage is done to the file
itself: tensors and metadata rewritten with safetensors (a NaN scale, fp16 bytes, a lying header), or one byte
flipped inside the data section, after the header (`_flip`), as a bad disk would. A flipped byte changes the
lowest bit of a float's mantissa (little-endian: the first byte of its 4), so the value stays finite and only the
recorded sha256 can find it. A header lie that changes no shape (n_head=4 for 2 heads of twice the width) is found
by the digest too; one that changes a shape is named by its field. Files from before the digest still load.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minillm import GPT, GPTConfig
from minillm.core.formats import model_from_bytes, model_to_bytes, read_header_metadata
from minillm.core.io import content_sha256
from minillm.prune.checkpoint import load_pruned, save_pruned
from minillm.prune.structured import mlp_neuron_scores, prune_heads, prune_mlp
from minillm.quant.checkpoint import load_quantized, save_quantized
from minillm.quant.linear import QuantConfig, quantize_model

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)


@functools.cache
def _models() -> dict[str, torch.nn.Module]:
    """name -> a tiny model of each stored kind, built once (the tests only read them)."""
    torch.manual_seed(0)
    m = GPT(CFG).eval()
    cal = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return {
        "int8": quantize_model(m, QuantConfig("int8")),
        "int4-asym": quantize_model(m, QuantConfig("int4", group_size=16, symmetric=False)),
        "mlp": prune_mlp(m, 0.25, mlp_neuron_scores(m, cal)),  # widths 96, 96 of 128
        "heads": prune_heads(m, {0: [1], 1: [0]}),  # n_head=1, head_dim=16 (given explicitly)
    }


def _save(kind: str, path: Path) -> Path:
    model = _models()[kind]
    if kind in ("int8", "int4-asym"):
        return save_quantized(model, path, method="rtn")
    return save_pruned(model, path, method="test", pattern="dense")


def _load(kind: str, path: Path) -> torch.nn.Module:
    return load_quantized(path) if kind in ("int8", "int4-asym") else load_pruned(path)


def _read(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


def _rewrite(path: Path, change: Callable[[dict[str, str], dict[str, torch.Tensor]], None]) -> Path:
    """Rewrite the file in place after `change(metadata, tensors)` edits them (the recorded sha256 kept as it was)."""
    meta, tensors = _read(path)
    change(meta, tensors)
    save_file(tensors, str(path), metadata=meta)
    return path


def _set(key: str, index: tuple[int, ...], value: float) -> Callable:
    def change(meta, tensors):
        tensors[key][index] = value
    return change


def _as_fp16(key: str) -> Callable:
    def change(meta, tensors):
        tensors[key] = tensors[key].half()
    return change


def _config_lie(**fields) -> Callable:
    def change(meta, tensors):
        meta["gpt_config"] = json.dumps({**json.loads(meta["gpt_config"]), **fields}, sort_keys=True)
    return change


def _widths_lie(widths: list[int]) -> Callable:
    def change(meta, tensors):
        meta["mlp_hidden"] = json.dumps(widths)
    return change


def _old_style(change: Callable) -> Callable:
    """The same damage to a file written before digests were recorded (no "sha256" field)."""
    def old(meta, tensors):
        change(meta, tensors)
        del meta["sha256"]
    return old


def _flip_byte(data: bytes, key: str) -> bytes:
    """Flip the lowest bit of the first byte of tensor `key`'s data, found through the safetensors header:
    8 bytes little-endian header length n, n bytes of JSON ({key: {"data_offsets": [start, end]}}), then the data."""
    out = bytearray(data)
    n = int.from_bytes(out[:8], "little")
    start = json.loads(out[8:8 + n])[key]["data_offsets"][0]
    out[8 + n + start] ^= 0x01
    return bytes(out)


def _flip(path: Path, key: str) -> Path:
    path.write_bytes(_flip_byte(path.read_bytes(), key))
    return path


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:-10])
    return path


@dataclass(frozen=True)
class Case:
    kind: str  # which model of `_models()` is saved
    damage: Callable[[Path], Path]  # the saved file -> the damaged file
    says: tuple[str, ...]  # what the message must name besides the file: the field or tensor, and the check


QKV_SCALE = "transformer.h.0.attn.c_attn.scale"
FC_ZERO = "transformer.h.1.mlp.c_fc.zero"
CASES: dict[str, Case] = {
    "nan-scale": Case("int8", lambda p: _rewrite(p, _set(QKV_SCALE, (0, 0), float("nan"))),
                      (QKV_SCALE, "non-finite")),
    "negative-scale": Case("int8", lambda p: _rewrite(p, _set(QKV_SCALE, (3, 0), -0.01)), (QKV_SCALE, "<= 0")),
    "zero-scale": Case("int4-asym", lambda p: _rewrite(p, _set(QKV_SCALE, (0, 1), 0.0)), (QKV_SCALE, "<= 0")),
    "zero-point-off-int4-grid": Case("int4-asym", lambda p: _rewrite(p, _set(FC_ZERO, (0, 0), 16)),
                                     (FC_ZERO, "[0, 15]")),
    "old-file-negative-scale": Case("int8", lambda p: _rewrite(p, _old_style(_set(QKV_SCALE, (0, 0), -1.0))),
                                    (QKV_SCALE, "<= 0")),
    "quant-flipped-weight-byte": Case("int8", lambda p: _flip(p, "transformer.h.0.mlp.c_fc.qweight"),
                                      ("sha256", "does not match")),
    "quant-flipped-layernorm-byte": Case("int8", lambda p: _flip(p, "transformer.h.1.ln_2.weight"),
                                         ("sha256", "does not match")),
    "quant-fp16-layernorm": Case("int8", lambda p: _rewrite(p, _as_fp16("transformer.ln_f.weight")),
                                 ("transformer.ln_f.weight", "torch.float16", "torch.float32")),
    "quant-n_head-lie": Case("int8", lambda p: _rewrite(p, _config_lie(n_head=4)), ("sha256", "does not match")),
    "quant-n_layer-lie": Case("int4-asym", lambda p: _rewrite(p, _config_lie(n_layer=3)), ("n_layer=3",)),
    "quant-truncated": Case("int8", _truncate, ("not a valid safetensors file", "truncated")),
    "pruned-nan-layernorm": Case("mlp", lambda p: _rewrite(p, _set("transformer.h.0.ln_1.bias", (5,), float("inf"))),
                                 ("transformer.h.0.ln_1.bias", "non-finite")),
    "pruned-flipped-weight-byte": Case("mlp", lambda p: _flip(p, "transformer.h.1.mlp.c_proj.weight"),
                                       ("sha256", "does not match")),
    "pruned-flipped-layernorm-byte": Case("mlp", lambda p: _flip(p, "transformer.h.0.ln_1.weight"),
                                          ("sha256", "does not match")),
    "pruned-fp16-weight": Case("mlp", lambda p: _rewrite(p, _as_fp16("transformer.h.0.attn.c_attn.weight")),
                               ("transformer.h.0.attn.c_attn.weight", "torch.float16", "torch.float32")),
    "old-file-fp16": Case("mlp", lambda p: _rewrite(p, _old_style(_as_fp16("transformer.wpe.weight"))),
                          ("transformer.wpe.weight", "torch.float16")),
    "pruned-n_head-lie": Case("mlp", lambda p: _rewrite(p, _config_lie(n_head=4)), ("sha256", "does not match")),
    "head-pruned-n_head-lie": Case("heads", lambda p: _rewrite(p, _old_style(_config_lie(n_head=2))),
                                   ("n_head=2", "head_dim=16", "transformer.h.0.attn.c_attn.weight")),
    "mlp_hidden-lie": Case("mlp", lambda p: _rewrite(p, _old_style(_widths_lie([96, 128]))),
                           ("mlp_hidden[1] = 128", "transformer.h.1.mlp.c_fc.weight")),
    "pruned-truncated": Case("mlp", _truncate, ("not a valid safetensors file", "truncated")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_damaged_file_is_refused_naming_the_file_and_the_field(tmp_path, name):
    case = CASES[name]
    path = case.damage(_save(case.kind, tmp_path / f"{name}.safetensors"))
    with pytest.raises(ValueError) as info:
        _load(case.kind, path)
    message = str(info.value)
    assert str(path) in message, message
    for part in case.says:
        assert part in message, f"{part!r} not in {message!r}"


@pytest.mark.parametrize("kind", list(_models()))
def test_an_untouched_file_round_trips_to_the_same_logits(tmp_path, kind):
    model = _models()[kind]
    path = _save(kind, tmp_path / "m.safetensors")
    meta, tensors = _read(path)
    assert meta["sha256"] == content_sha256(tensors, meta)  # recorded at save, over the fields and the tensors
    loaded = _load(kind, path)
    assert type(loaded) is type(model) and loaded.config == model.config
    idx = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


@pytest.mark.parametrize("kind", list(_models()))
def test_a_file_written_before_digests_still_loads(tmp_path, kind):
    path = _rewrite(_save(kind, tmp_path / "old.safetensors"), lambda meta, tensors: meta.pop("sha256"))
    loaded = _load(kind, path)
    idx = torch.randint(0, CFG.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(idx), _models()[kind](idx))


@pytest.mark.parametrize("kind", ["int8", "mlp"])
def test_model_bytes_carry_the_digest_and_the_same_checks(kind):
    """`model_to_bytes` records the file's digest too, so a flipped byte is found even without the sender's sha256
    of the whole transfer; the value checks live in the format's build, so bytes get them as files do."""
    from safetensors.torch import load, save

    data = model_to_bytes(_models()[kind])
    meta = read_header_metadata(data)
    assert "sha256" in meta
    with pytest.raises(ValueError, match="model bytes .* does not match the sha256"):
        model_from_bytes(_flip_byte(data, "transformer.h.0.ln_2.weight"))
    tensors = load(data)
    tensors["transformer.ln_f.weight"][0] = float("nan")
    with pytest.raises(ValueError, match="'transformer.ln_f.weight' holds 1 non-finite"):
        model_from_bytes(save(tensors, metadata={k: v for k, v in meta.items() if k != "sha256"}))


@pytest.mark.parametrize("kind", ["int8", "mlp"])
def test_saving_onto_a_directory_or_under_a_file_names_the_path(tmp_path, kind):
    with pytest.raises(ValueError, match="is a directory") as info:
        _save(kind, tmp_path)
    assert str(tmp_path) in str(info.value)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = blocker / "model.safetensors"
    with pytest.raises(ValueError, match="is a file, not a directory") as info:
        _save(kind, target)
    assert str(target) in str(info.value) and str(blocker) in str(info.value)
    assert blocker.read_text() == "not a directory" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
