"""Model formats (`minillm.core.formats`): every kind of minillm model crosses a process boundary as bytes and comes
back the same model, and bytes that are not one come back as a ValueError naming what is wrong.

The round trips compare logits exactly: the tensors are copied bit for bit, so any difference would mean the
skeleton on the receiving side is not the sender's model. Chapter 07's test that the workers give the colocated
tokens with quantized and pruned models is in tests/test_09_quantization.py and tests/test_10_pruning.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from minillm import GPT, GPTConfig
from minillm.core.formats import (
    SHIPPED_FORMATS,
    ModelFormat,
    format_of,
    model_formats,
    model_from_bytes,
    model_to_bytes,
    read_header_metadata,
    register_model_format,
    sha256,
)
from minillm.prune.structured import mlp_neuron_scores, prune_heads, prune_mlp
from minillm.prune.unstructured import prune_model
from minillm.quant.linear import QuantConfig, QuantizedGPT, quantize_model

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32)


def base() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).eval()


def calibration() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))


def kinds() -> dict[str, tuple[str, torch.nn.Module]]:
    """name -> (the format that must claim it, the model)."""
    m, cal = base(), calibration()
    return {
        "plain": ("minillm-gpt", m),
        "unstructured-zeros": ("minillm-gpt", prune_model(m, "magnitude", 0.5)),
        "heads-removed": ("minillm-gpt", prune_heads(m, {0: [1], 1: [2]})),
        "int8": ("minillm-quant", quantize_model(m, QuantConfig("int8", quantize_head=True))),
        "int4": ("minillm-quant", quantize_model(m, QuantConfig("int4", group_size=16))),
        "w8a8": ("minillm-quant", quantize_model(m, QuantConfig("w8a8"))),
        "mlp-narrowed": ("minillm-pruned", prune_mlp(m, 0.25, mlp_neuron_scores(m, cal))),
        "mlp-and-heads": ("minillm-pruned", prune_mlp(prune_heads(m, {0: [0], 1: [3]}), 0.5,
                                                      mlp_neuron_scores(prune_heads(m, {0: [0], 1: [3]}), cal))),
    }


@pytest.mark.parametrize("kind", list(kinds()))
def test_every_kind_of_model_round_trips_exactly(kind):
    name, model = kinds()[kind]
    assert format_of(model).name == name
    data = model_to_bytes(model)
    assert read_header_metadata(data)["format"] == name
    back = model_from_bytes(data, expected_sha256=sha256(data))
    assert type(back) is type(model) and not back.training
    assert back.config == model.config
    idx = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(idx), model(idx))
    if isinstance(model, QuantizedGPT):
        assert back.quant_config == model.quant_config
    else:
        assert back.lm_head.weight is back.transformer.wte.weight  # re-tied by the skeleton, not stored twice


def test_every_shipped_format_is_known_in_a_fresh_interpreter():
    """The table names each format's module, so the receiver of quantized bytes need not have imported chapter 09."""
    data = model_to_bytes(quantize_model(base(), QuantConfig("int8")))
    code = ("import sys; from minillm.core.formats import model_from_bytes; "
            "m = model_from_bytes(sys.stdin.buffer.read()); print(type(m).__name__)")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().strip() == "QuantizedGPT"
    assert set(SHIPPED_FORMATS) <= set(model_formats())


def test_bytes_that_are_not_a_model_say_what_is_wrong():
    data = model_to_bytes(base())
    with pytest.raises(ValueError, match="does not match the sender's"):
        model_from_bytes(data, expected_sha256=sha256(b"other"))
    with pytest.raises(ValueError, match="cannot hold a safetensors header"):
        model_from_bytes(data[:5])
    with pytest.raises(ValueError, match="cannot hold a safetensors header"):
        model_from_bytes(data[:100])  # the header is cut
    with pytest.raises(ValueError, match="not valid safetensors"):
        model_from_bytes(data[:-10])  # the tensors are cut
    with pytest.raises(TypeError, match="must be bytes"):
        model_from_bytes("not bytes")
    from safetensors.torch import save

    with pytest.raises(ValueError, match="has no metadata"):
        model_from_bytes(save({"x": torch.zeros(2)}))
    with pytest.raises(ValueError, match="declare format 'other'; known formats"):
        model_from_bytes(save({"x": torch.zeros(2)}, metadata={"format": "other"}))
    with pytest.raises(ValueError, match="gpt_config' is missing"):
        model_from_bytes(save({"x": torch.zeros(2)}, metadata={"format": "minillm-gpt"}))


def test_metadata_that_disagrees_with_the_tensors_is_refused():
    from safetensors.torch import load, save

    int8 = model_to_bytes(quantize_model(base(), QuantConfig("int8")))
    meta = read_header_metadata(int8)
    as_int4 = {**meta, "quant_config": json.dumps(QuantConfig("int4", group_size=16).to_dict())}
    with pytest.raises(ValueError, match="metadata's mode implies"):
        model_from_bytes(save(load(int8), metadata=as_int4))
    narrowed = model_to_bytes(prune_mlp(base(), 0.5, mlp_neuron_scores(base(), calibration())))
    meta = read_header_metadata(narrowed)
    with pytest.raises(ValueError, match="block sparsity"):
        model_from_bytes(save(load(narrowed), metadata={**meta, "block_sparsity": "0.2500"}))
    plain = model_to_bytes(base())
    other = {**read_header_metadata(plain), "gpt_config": read_header_metadata(narrowed)["gpt_config"]
             .replace('"n_layer": 2', '"n_layer": 3')}
    with pytest.raises(ValueError, match="missing tensor 'transformer.h.2"):
        model_from_bytes(save(load(plain), metadata=other))


def test_a_model_no_format_claims_is_a_type_error_naming_it():
    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = base()

    with pytest.raises(TypeError, match="no model format claims a Wrapped; known formats"):
        model_to_bytes(Wrapped())
    with pytest.raises(TypeError, match="needs a ModelFormat"):
        register_model_format("minillm-gpt")
    taken = ModelFormat("minillm-gpt", lambda m: False, lambda m: {}, lambda meta, t, w: base())
    with pytest.raises(ValueError, match="already registered"):
        register_model_format(taken)


def test_models_no_format_can_rebuild_are_refused_at_the_sender():
    """A quantized model whose MLPs were pruned first, or a half-precision one, would fail on arrival with a
    message about a damaged file; the sender names the real reason instead."""
    from minillm.prune.structured import shrink_mlp
    from minillm.quant.checkpoint import save_quantized

    m = base()
    narrowed = quantize_model(shrink_mlp(m, [torch.arange(2 * CFG.n_embd)] * CFG.n_layer), QuantConfig("int8"))
    with pytest.raises(TypeError, match="no model format claims a QuantizedGPT"):
        model_to_bytes(narrowed)
    with pytest.raises(TypeError, match="full MLP width"):
        save_quantized(narrowed, "/tmp/never-written.safetensors")
    with pytest.raises(TypeError, match="torch.float16"):
        model_to_bytes(base().half())
    header = json.dumps({"__metadata__": {"format": ["a", "list"]}}).encode()  # hand-made: not a str
    with pytest.raises(ValueError, match="declare format"):
        model_from_bytes(len(header).to_bytes(8, "little") + header)
