"""Chapter 13's second CPU peer: the generator's step exported to ONNX and run by ONNX Runtime
(`minillm.compile.onnx_peer`). Its tokens equal chapter 04's generator's (greedy and sampled, up to the window's cap);
an edited, truncated or foreign file is refused naming it; export refuses what it cannot trace faithfully. No test
measures time. Skipped, saying why, without onnx and onnxruntime.
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import context_model
from minillm import GPTConfig
from minillm.compile import onnx_peer
from minillm.compile.onnx_peer import OnnxDecoder, export_onnx, onnx_problem
from minillm.core.sampling import SamplingParams
from minillm.kvcache.generate import generate_ids
from minillm.quant.linear import QuantConfig, quantize_model

pytestmark = pytest.mark.skipif(onnx_problem() is not None, reason=f"ONNX Runtime cannot run here: {onnx_problem()}")

SMALL = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)


@pytest.fixture(scope="module")
def model():
    return context_model(SMALL, seed=0).eval()


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    return export_onnx(model, tmp_path_factory.mktemp("onnx") / "step.onnx")


@pytest.mark.parametrize("prompt", [[5, 17, 99, 3], [1], list(range(40)), list(range(60))])
def test_onnx_runtime_gives_the_generators_tokens(model, exported, prompt):
    """Greedy and sampled (temperature, top-k, a seed) tokens equal chapter 04's generator's, including a prompt
    whose generation the window caps (60 tokens + 20 new in a 64-token window: 5 tokens)."""
    dec = OnnxDecoder(exported)
    for params in (SamplingParams.greedy(20, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=20, max_new_tokens=12, seed=3, ignore_eos=True)):
        assert dec.generate_ids(prompt, params) == generate_ids(model, prompt, params)
    assert dec.generate_ids(prompt, SamplingParams.greedy(0)) == []


def test_an_edited_damaged_or_foreign_file_is_refused_naming_it(model, exported, tmp_path):
    raw = bytearray(exported.read_bytes())
    weight = model.transformer.wpe.weight.detach()[3, :4].numpy().tobytes()  # stored as is (a Gather)
    at = raw.find(weight)
    assert at >= 0
    raw[at + 3] ^= 0x40  # one exponent bit of one weight
    (tmp_path / "edited.onnx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"edited\.onnx': the content does not match the sha256"):
        OnnxDecoder(tmp_path / "edited.onnx")
    (tmp_path / "cut.onnx").write_bytes(exported.read_bytes()[: 1000])
    with pytest.raises(ValueError, match=r"cut\.onnx' is not an ONNX model"):
        OnnxDecoder(tmp_path / "cut.onnx")
    import onnx

    foreign = onnx.load(str(exported))
    del foreign.metadata_props[:]
    onnx.save(foreign, str(tmp_path / "foreign.onnx"))
    with pytest.raises(ValueError, match=r"foreign\.onnx' is not a minillm ONNX step"):
        OnnxDecoder(tmp_path / "foreign.onnx")
    with pytest.raises(FileNotFoundError, match="no ONNX file"):
        OnnxDecoder(tmp_path / "missing.onnx")
    with pytest.raises(ValueError, match="threads must be positive"):
        OnnxDecoder(exported, threads=0)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        OnnxDecoder(3)


def test_export_refuses_what_it_cannot_trace_faithfully(model, tmp_path):
    with pytest.raises(TypeError, match="model must be a minillm GPT, got Linear"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "a.onnx")
    with pytest.raises(TypeError, match="the ONNX export needs a model of plain .* transformer.h.0.attn.c_attn = "
                                        "QuantLinear"):
        export_onnx(quantize_model(model, QuantConfig("int8")), tmp_path / "q.onnx")
    hooked = copy.deepcopy(model)
    hooked.transformer.h[1].mlp.register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.raises(ValueError, match="transformer.h.1.mlp has a forward hook"):
        export_onnx(hooked, tmp_path / "h.onnx")
    with pytest.raises(ValueError, match=r"path .*step.bin. must end in .onnx"):
        export_onnx(model, tmp_path / "step.bin")
    with pytest.raises(ValueError, match="path .* is a directory"):
        export_onnx(model, tmp_path)
    training = copy.deepcopy(model).train()
    training.transformer.h[0].eval()
    modes = [m.training for m in training.modules()]
    export_onnx(training, tmp_path / "t.onnx")
    assert [m.training for m in training.modules()] == modes  # exported in eval mode, each mode given back
    params = SamplingParams.greedy(8, ignore_eos=True)
    assert OnnxDecoder(tmp_path / "t.onnx").generate_ids([4, 5], params) == generate_ids(model, [4, 5], params)


def test_the_side_by_side_checks_three_paths_on_the_same_tokens(model, tmp_path):
    """`measure` on a small model: the three paths' tokens identical, every path timed; the text's quotes present.
    No figure's value is asserted (timing)."""
    report = onnx_peer.measure(model, [3, 4, 5], new_tokens=8, repeats=1, workdir=tmp_path)
    assert report["identical"] and set(report["tok_s"]) == set(onnx_peer.PATHS)
    q = onnx_peer.quotes({**report, "onnxruntime": "1.0", "cpu": "a CPU", "threads": 1})
    assert {"paths", "ort_tok_s", "ort_vs_eager", "fused_vs_ort", "onnx_mb", "identical"} <= set(q)
    with pytest.raises(ValueError, match="new_tokens must be positive"):
        onnx_peer.measure(model, [3], new_tokens=0)


def test_c13r11_a_resigned_file_whose_config_disagrees_with_its_graph_is_refused(model, exported, tmp_path):
    """Before: the digest (graph_sha256 is public) was the only check, so a file re-signed with an edited config
    loaded: a smaller vocabulary streamed ids past it, a smaller window failed inside ONNX Runtime, a removed field
    was a KeyError. Now the config is checked against the graph's inputs, outputs and position table, naming the
    file."""
    import json

    import onnx

    def resigned(name: str, **edit) -> str:
        proto = onnx.load(str(exported))
        meta = {e.key: e.value for e in proto.metadata_props}
        cfg = json.loads(meta["minillm_config"])
        cfg.update(edit)
        for e in proto.metadata_props:
            if e.key == "minillm_config":
                e.value = json.dumps(cfg) if edit else "not json"
        for e in proto.metadata_props:
            if e.key == "minillm_sha256":
                e.value = onnx_peer.graph_sha256(proto)
        onnx.save(proto, str(tmp_path / name))
        return str(tmp_path / name)

    with pytest.raises(ValueError, match=r"v\.onnx': logits has shape \[1, 512\] in the graph but the metadata's "
                                         r"config implies \[1, 64\]"):
        OnnxDecoder(resigned("v.onnx", vocab_size=64))
    with pytest.raises(ValueError, match=r"w\.onnx': the graph's position table is \[\[64, 64\]\]"):
        OnnxDecoder(resigned("w.onnx", block_size=32))
    with pytest.raises(ValueError, match=r"h\.onnx': past_k has shape"):
        OnnxDecoder(resigned("h.onnx", n_head=2))
    with pytest.raises(ValueError, match=r"j\.onnx': metadata field 'minillm_config' is not a model config"):
        OnnxDecoder(resigned("j.onnx"))
    with pytest.raises(TypeError, match="proto must be an onnx.ModelProto"):
        onnx_peer.graph_sha256({"graph": 1})


def test_c13r11_measure_times_only_tokens_it_generates(model, tmp_path):
    """Before: a request the window capped (30 + 8 tokens in a 32-token window... here 60 + 8 in 64) generated 5
    tokens and reported tok/s for 8. Now it is refused, naming new_tokens; a bad workdir names workdir."""
    with pytest.raises(ValueError, match=r"new_tokens=8 do not fit after a 60-token prompt .* at most 5"):
        onnx_peer.measure(model, list(range(60)), new_tokens=8, repeats=1, workdir=tmp_path)
    with pytest.raises(TypeError, match="workdir must be a str or os.PathLike"):
        onnx_peer.measure(model, [1], new_tokens=2, repeats=1, workdir=5)
    with pytest.raises(TypeError, match="model must be a minillm GPT"):
        onnx_peer.measure(None, [1], new_tokens=2)


def test_c13r12_onnx_runtimes_own_load_errors_name_the_file(model, exported, tmp_path):
    """Run 12: a graph edited and re-signed (here an opset ONNX Runtime has never heard of) passed the digest and
    config checks, then failed in ONNX Runtime's own words; a huge thread count was pybind's error; a workdir that is
    a file was blamed on export_onnx's path. Each now names what it is about."""
    import onnx

    proto = onnx.load(str(exported))
    proto.opset_import[0].version = 99
    for e in proto.metadata_props:
        if e.key == "minillm_sha256":
            e.value = onnx_peer.graph_sha256(proto)
    onnx.save(proto, str(tmp_path / "opset.onnx"))
    with pytest.raises(ValueError, match=r"opset\.onnx': ONNX Runtime cannot load the graph"):
        OnnxDecoder(tmp_path / "opset.onnx")
    with pytest.raises(ValueError, match="threads must be at most 1024"):
        OnnxDecoder(exported, threads=2**40)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="workdir"):
        onnx_peer.measure(model, [1], new_tokens=2, repeats=1, workdir=tmp_path / "file")
