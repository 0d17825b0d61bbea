"""Bad input the shared checks refuse for every chapter: meta tensors, float8 tensors, an out-of-range --seed.

A meta tensor has a shape and a dtype but no values, float8 is a storage format most torch ops refuse, and a seed
past 64 bits fails inside torch's generator (or is ignored by a benchmark that never seeds one). Each is refused
up front, by minillm's own check, naming the argument (`check_has_data`, `check_float_tensor`, `is_float_compute`,
`check_device`, `seed_argument`); the rows below are entry points of chapters 08-13 where a hostile run found
torch's own error instead.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from helpers import special_files
from minillm.bench.cli import bench_parser
from minillm.compile.decode import StaticDecoder, check_decoder_room
from minillm.core.checkpoint import (CONFIG_NAME, WEIGHTS_NAME, checkpoint_sha256, load_checkpoint,
                                     save_checkpoint)
from minillm.core.io import read_json_file, read_safetensors_file
from minillm.core.config import (GPTConfig, check_float_tensor, check_has_data, check_module_has_data,
                                 is_float_compute)
from minillm.core.model import GPT
from minillm.core.sampling import SamplingParams
from minillm.distill.losses import kd_loss
from minillm.gpt.pretrained import SHIPPED, pretrained_dir
from minillm.kernels import mirror, naive, ops
from minillm.kvcache.cache import ContiguousKVCache
from minillm.quant.kv_cache import Int8ContiguousKVCache, dequantize_kv, quantize_kv
from minillm.quant.qat import fake_quantize, qat_codes
from minillm.quant.linear import QuantConfig
from minillm.speculative.generate import generate_speculative
from minillm.speculative.sampling import (accept_greedy, accept_or_resample, prob_sum_tolerance,
                                          residual_distribution, sample_from_target)

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
P3 = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
Q3 = torch.tensor([[0.3, 0.3, 0.4], [0.5, 0.25, 0.25]])
F8 = torch.float8_e4m3fn


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).eval()


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


KV = torch.zeros(2, 4, 2, 8)
CASES = [
    # (id, call, error type, the argument the message must name)
    ("accept_or_resample tokens", lambda: accept_or_resample(P3, Q3[:1], meta(torch.tensor([1]))), ValueError,
     "draft_tokens"),
    ("accept_greedy tokens", lambda: accept_greedy(torch.zeros(2, 3), meta(torch.tensor([1]))), ValueError,
     "draft_tokens"),
    ("generate_speculative prompt", lambda: generate_speculative(tiny(), tiny(), meta(torch.tensor([5, 6])),
                                                                 SamplingParams.greedy(4)), ValueError, "prompt_ids"),
    ("StaticDecoder token", lambda: (lambda m, d: d(m, d.cache, meta(torch.tensor([3])), torch.tensor([0])))(
        *(lambda m: (m, StaticDecoder(m, "eager")))(tiny())), ValueError, "token"),
    ("check_decoder_room prompt", lambda: check_decoder_room(8, CFG, meta(torch.tensor([1, 2])),
                                                             SamplingParams.greedy(3)), ValueError, "prompt_ids"),
    ("dequantize_kv codes", lambda: dequantize_kv(meta(quantize_kv(torch.randn(5, 32))[0]),
                                                  quantize_kv(torch.randn(5, 32))[1]), ValueError, "codes"),
    ("Int8ContiguousKVCache device", lambda: Int8ContiguousKVCache(CFG, 1, 8, device="meta"), ValueError, "device"),
    ("fake_quantize w", lambda: fake_quantize(meta(torch.randn(8, 32)), QuantConfig("int8")), ValueError, "w"),
    ("qat_codes w", lambda: qat_codes(meta(torch.randn(8, 32)), QuantConfig("int8")), ValueError, "w"),
    ("mirror.paged_gather table", lambda: mirror.paged_gather(torch.zeros(6, 4, 2, 8), meta(torch.tensor([5, 1])), 6),
     ValueError, "block_table"),
    ("mirror.kv_cache_write slots", lambda: mirror.kv_cache_write(torch.randn(2, 2, 8), torch.randn(2, 2, 8), KV,
                                                                  KV.clone(), meta(torch.tensor([0, 1]))),
     ValueError, "slot_mapping"),
    ("naive.layernorm bias", lambda: naive.layernorm(torch.randn(2, 8), torch.ones(8), meta(torch.zeros(8))),
     ValueError, "bias"),
    ("ops.kv_cache_write slots (before the CUDA check)",
     lambda: ops.kv_cache_write(torch.randn(2, 2, 8), torch.randn(2, 2, 8), KV, KV.clone(),
                                meta(torch.tensor([0, 1]))), ValueError, "slot_mapping"),
    # float8: floating point to torch, a storage format to every op here
    ("residual_distribution float8", lambda: residual_distribution(P3.to(F8), Q3.to(F8)), TypeError, "p"),
    ("sample_from_target float8", lambda: sample_from_target(P3.to(F8)), TypeError, "p"),
    ("accept_greedy float8", lambda: accept_greedy(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 5.0]]).to(F8), [1]),
     TypeError, "target_logits"),
    ("prob_sum_tolerance float8", lambda: prob_sum_tolerance(F8), TypeError, "dtype"),
    ("kd_loss float8", lambda: kd_loss(torch.randn(3, 8).to(F8), torch.randn(3, 8).to(F8)), TypeError,
     "student_logits"),
    ("check_float_tensor float8", lambda: check_float_tensor("x", torch.zeros(2).to(F8)), TypeError, "x"),
    # sparse tensors (eighth hostile run: 136 argument positions failed inside torch, one gave wrong numbers): the
    # layout `check_has_data` and `check_float_tensor` look at, so every chapter's checks refuse them by name
    ("check_float_tensor sparse", lambda: check_float_tensor("x", torch.zeros(2).to_sparse()), TypeError, "x"),
    ("check_float_tensor sparse, shape only", lambda: check_float_tensor("w", torch.zeros(2, 2).to_sparse(),
                                                                         values=False), TypeError, "w"),
    ("naive.layernorm weight sparse", lambda: naive.layernorm(torch.randn(2, 8), torch.ones(8).to_sparse(),
                                                              torch.zeros(8)), TypeError, "weight"),
    ("ops.kv_cache_write slots sparse (before the CUDA check)",
     lambda: ops.kv_cache_write(torch.randn(2, 2, 8), torch.randn(2, 2, 8), KV, KV.clone(),
                                torch.tensor([0, 1]).to_sparse()), TypeError, "slot_mapping"),
    ("accept_greedy tokens sparse", lambda: accept_greedy(torch.zeros(2, 3), torch.tensor([1]).to_sparse()),
     TypeError, "draft_tokens"),
    ("kd_loss sparse", lambda: kd_loss(torch.randn(3, 8).to_sparse(), torch.randn(3, 8)), TypeError,
     "student_logits"),
    # a pool torch cannot write in place (`check_writable`): expanded, or requiring grad while grad mode is on
    ("mirror.kv_cache_write expanded pool", lambda: mirror.kv_cache_write(
        torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.zeros(1, 4, 2, 8).expand(2, 4, 2, 8), KV.clone(),
        torch.tensor([0, 1])), ValueError, "k_pool"),
    ("naive.kv_cache_write pool requiring grad", lambda: naive.kv_cache_write(
        torch.randn(2, 2, 8), torch.randn(2, 2, 8), KV.clone(), KV.clone().requires_grad_(), torch.tensor([0, 1])),
     ValueError, "v_pool"),
    # ninth hostile run: tensors every check took for dense ones (`check_strided` refuses them now): a nested tensor
    # (layout torch.strided, no shape), a quantized one, MKL-DNN, uint16/32/64 and float8
    ("check_float_tensor nested", lambda: check_float_tensor("x", torch.nested.nested_tensor([torch.zeros(2)])),
     TypeError, "x"),
    ("check_has_data nested int", lambda: check_has_data("ids", torch.nested.nested_tensor([torch.tensor([1, 2])])),
     TypeError, "ids"),
    ("check_has_data qint8", lambda: check_has_data("zero", torch.quantize_per_tensor(torch.zeros(2), 1.0, 0,
                                                                                        torch.qint8)), TypeError, "zero"),
    ("check_float_tensor mkldnn", lambda: check_float_tensor("x", torch.zeros(2).to_mkldnn()), TypeError, "x"),
    ("check_has_data uint64", lambda: check_has_data("block_tables", torch.zeros(2, dtype=torch.uint64)), TypeError,
     "block_tables"),
    ("check_has_data uint16", lambda: check_has_data("slots", torch.zeros(2, dtype=torch.uint16)), TypeError,
     "slots"),
    ("check_has_data float8 e5m2", lambda: check_has_data("h", torch.zeros(2).to(torch.float8_e5m2)), TypeError, "h"),
    ("check_module_has_data nested buffer", lambda: check_module_has_data("model", _with_buffer(
        torch.nested.nested_tensor([torch.zeros(2)]))), TypeError, "model"),
    ("accept_greedy tokens nested", lambda: accept_greedy(torch.zeros(2, 3), torch.nested.nested_tensor(
        [torch.tensor([1])])), TypeError, "draft_tokens"),
]


def _with_buffer(t: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    m.register_buffer("b", t)
    return m


@pytest.mark.parametrize("call, error, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_meta_and_float8_tensors_are_refused_by_name(call, error, name):
    with pytest.raises(error, match=rf"\b{name}\b"):
        call()


def test_float_compute_dtypes_are_the_four_torch_computes_in():
    assert [is_float_compute(torch.zeros(1, dtype=d)) for d in
            (torch.float16, torch.bfloat16, torch.float32, torch.float64, F8, torch.float8_e5m2, torch.int8)] \
        == [True, True, True, True, False, False, False]


BENCHES = ["minillm.kvcache.bench", "minillm.quant.bench", "minillm.prune.bench", "minillm.distill.bench",
           "minillm.speculative.bench", "minillm.speculative.engine_bench", "minillm.compile.bench",
           "minillm.compile.aot", "minillm.compile.sweep", "minillm.paged.bench", "minillm.distill.train"]


@pytest.mark.parametrize("module", BENCHES)
@pytest.mark.parametrize("seed", ["18446744073709551616", "-9223372036854775809", "seven"])
def test_a_seed_torch_cannot_take_is_a_usage_error_before_any_work(module, seed, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_:
        main(["--seed", seed])  # parsed before any other flag is looked at, or any work done
    assert exit_.value.code == 2
    assert "--seed" in capsys.readouterr().err


def test_the_tour_refuses_such_a_seed_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module("minillm.course.cli").main(["tour", "--seed", "18446744073709551616"])
    assert exit_.value.code == 2 and "--seed" in capsys.readouterr().err


def test_a_percent_sign_in_a_benchmarks_quick_help_prints_as_written():
    helptext = bench_parser("prog", "what", "half: 50% of the rows", sizes={"full": 1, "quick": 2}).format_help()
    assert "50% of the rows" in helptext


def test_a_model_with_an_untied_head_is_refused_on_save_not_saved_without_it(tmp_path):
    """Every checkpoint format stores the tied head once, as the embedding: an untied head would be dropped."""
    model = tiny()
    model.lm_head.weight = torch.nn.Parameter(torch.randn(CFG.vocab_size, CFG.n_embd))
    with pytest.raises(ValueError, match=r"model\.lm_head has a weight of its own"):
        save_checkpoint(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    model.lm_head.weight = model.transformer.wte.weight  # tied again: saved
    save_checkpoint(model, tmp_path / "ckpt")


@pytest.mark.parametrize("text", ["9" * 5000, "[" * 100_000 + "]" * 100_000, '{"a": 1', "\xff"])
def test_a_json_file_python_cannot_read_is_a_value_error_naming_it(tmp_path, text):
    bad = tmp_path / "bad.json"
    bad.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match="bad.json"):
        read_json_file(bad)


# ----- the seventh hostile run: a checkpoint's digest (core.checkpoint) ---------------------------------------------


def _flip(path, offset_from_end: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_config(directory, change) -> None:
    doc = json.loads((directory / CONFIG_NAME).read_text())
    change(doc)
    (directory / CONFIG_NAME).write_text(json.dumps(doc))


@pytest.mark.parametrize("damage", ["flipped-weight-byte", "n_head-edited", "sha256-edited"])
def test_c7_a_checkpoint_changed_after_saving_is_refused_naming_the_file(tmp_path, damage):
    # before: load_checkpoint kept no digest, so a flipped byte in a weight loaded (and `distill(init_from=...)`
    # trained from the corrupted student) without a word; an edited n_head (same shapes) ran another model
    save_checkpoint(tiny(), tmp_path)
    if damage == "flipped-weight-byte":
        _flip(tmp_path / WEIGHTS_NAME)
    elif damage == "n_head-edited":
        _edit_config(tmp_path, lambda doc: doc["config"].__setitem__("n_head", 4))
    else:
        _edit_config(tmp_path, lambda doc: doc.__setitem__("sha256", "0" * 64))
    with pytest.raises(ValueError, match=r"model\.safetensors.*does not match the sha256"):
        load_checkpoint(tmp_path)


def test_c7_a_checkpoint_without_a_digest_still_loads_and_metadata_is_not_hashed(tmp_path):
    model = tiny()
    save_checkpoint(model, tmp_path, extra_metadata={"note": "x"})
    doc = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert doc["sha256"] == checkpoint_sha256(read_safetensors_file(tmp_path / WEIGHTS_NAME), doc["config"])
    _edit_config(tmp_path, lambda d: d["metadata"].__setitem__("note", "edited"))  # training notes: not hashed
    load_checkpoint(tmp_path)
    _edit_config(tmp_path, lambda d: d.pop("sha256"))  # written before digests were recorded
    _flip(tmp_path / WEIGHTS_NAME)
    assert load_checkpoint(tmp_path).config == model.config  # loads, unverified


@pytest.mark.parametrize("name", SHIPPED)
def test_c7_every_shipped_checkpoint_carries_its_digest_and_passes_it(name):
    directory = pretrained_dir(name)
    if not (directory / WEIGHTS_NAME).is_file():
        pytest.skip(f"shipped checkpoint {name!r} is not present")
    doc = json.loads((directory / CONFIG_NAME).read_text())
    assert doc["sha256"] == checkpoint_sha256(read_safetensors_file(directory / WEIGHTS_NAME), doc["config"])
    load_checkpoint(directory)  # verified on load


def test_a_cache_too_large_for_one_tensor_is_refused_before_the_allocator():
    with pytest.raises(ValueError, match=r"batch_size x n_head x max_len x head_size"):
        ContiguousKVCache(CFG, 10**9, 32)


R8_BENCHES = [m for m in BENCHES if m != "minillm.distill.train"] + ["minillm.kernels.bench"]
R8_FLAGS = [("seed-negative", ["--seed", "-1"], "--seed"), ("threads-huge", ["--threads", "100000"], "--threads")]
if not torch.cuda.is_available():
    R8_FLAGS.append(("device-cuda-no-gpu", ["--device", "cuda"], "--device"))
R8_FLAGS.append(("json-empty", ["--json", ""], "--json"))  # ninth run: '' passed as "no report", silently


@pytest.mark.parametrize("module", R8_BENCHES)
@pytest.mark.parametrize("argv, flag", [pytest.param(*f[1:], id=f[0]) for f in R8_FLAGS])
def test_r8_a_bench_flag_the_libraries_refuse_is_a_usage_error_at_parse_time(module, argv, flag, capsys):
    """Eighth hostile run: --seed -1 passed the parser (64-bit range) and the libraries refused it after loading
    models, --threads 100000 died in torch's allocator (MemoryError), --device cuda without a GPU was resolve_device's
    traceback; each exit 1. Now exit 2 naming the flag, before any work (a flag a benchmark lacks, or a device it
    does not offer, is argparse's own usage error: exit 2 too)."""
    main = importlib.import_module(module).main
    if module == "minillm.kernels.bench" and flag == "--device":  # GPU-only: it says itself that it needs a GPU
        assert main(argv) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
        return
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err or "unrecognized arguments" in err


def test_r8_the_atomic_writers_refuse_a_path_that_is_no_regular_file(tmp_path):
    """Eighth hostile run: every atomic writer renamed its temp file onto the path, replacing a device node (as
    root: /dev/null) or a FIFO with a regular file. Now a ValueError naming the argument, before writing. Private
    nodes under tmp_path only: a FIFO, and as root a character device like /dev/null (c 1 3)."""
    import stat

    from minillm.core.io import atomic_write_text, check_output_file

    nodes = special_files(tmp_path, ".json")
    for node in nodes:
        kind = stat.S_IFMT(node.lstat().st_mode)
        with pytest.raises(ValueError, match=r"^path '.*' exists and is not a regular file \(a device, FIFO"):
            atomic_write_text(node, "{}")
        with pytest.raises(ValueError, match=r"^--json '.*' exists and is not a regular file"):
            check_output_file(node, "--json", (".json",))
        assert stat.S_IFMT(node.lstat().st_mode) == kind
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n.name for n in nodes)  # no temp file left


def test_engine_rechecks_a_config_changed_after_construction():
    """An EngineConfig field set after construction (num_blocks = 10**9) is checked again by LLM, naming the field,
    before the block manager would list a billion blocks."""
    from minillm import GPT, GPTConfig
    from minillm.engine import LLM, EngineConfig

    cfg = EngineConfig(num_blocks=8, block_size=4)
    cfg.num_blocks = 10 ** 9
    with pytest.raises(ValueError, match="num_blocks"):
        LLM(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)), None, cfg)
