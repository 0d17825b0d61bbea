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
import operator
import re

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
from minillm.distill.run_state import TRAINER_FIELDS
from minillm.gpt.train import TrainConfig
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
TRAINER = {name: getattr(TrainConfig(), name) for name in TRAINER_FIELDS}  # run_state.SETTINGS["trainer"]
COLD_SPEC = {"mode": "eager", "threads": 1, "new_tokens": 1, "prompt": [1], "name": "tiny", "seed": 0}  # run_fresh
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


# ------------------------------------------------------------------ numbers whose comparisons lie, and huge ints
# A hostile run passed int and float subclasses whose comparison operators lie: checks that compared the caller's
# object were told LyingInt(10**6) <= 64, so speculation ran with γ = 10**6 (and silently never drafted), a draft
# cache grew past its window, a float temperature of 1e-9 passed its 1e-2 floor. Every check now compares, returns
# and stores the plain number the object holds (`check_int`, `check_float`, `plain_number`).

def _lying_refusals():
    from minillm.compile.fused_speculative import check_fused_gamma
    from minillm.distill.losses import default_layer_pairs
    from minillm.kernels.ops import _version
    from minillm.prune.masks import lowest_k_mask
    from minillm.quant.outliers import inject_outliers, outlier_report, smoothing_scales
    from minillm.quant.quantize import qrange, symmetric_params
    from minillm.speculative.engine import SpeculativeConfig
    from minillm.speculative.generate import DraftModelProposer, check_gamma
    from minillm.distill.losses import distillation_loss
    from helpers import AgreeingInt, LyingFloat, LyingInt

    model = GPT(CFG).eval()
    logits, labels = torch.randn(2, 3, 128), torch.randint(0, 128, (2, 3))
    scores = torch.randn(4, 16)
    return {
        "check_gamma": (lambda: check_gamma(LyingInt(10**6)), "gamma"),
        "check_fused_gamma": (lambda: check_fused_gamma(LyingInt(10**6)), "gamma"),
        "SpeculativeConfig": (lambda: SpeculativeConfig(gamma=LyingInt(10**6)), "gamma"),
        "DraftModelProposer": (lambda: DraftModelProposer(model, LyingInt(10**6)), "max_len"),
        "default_layer_pairs": (lambda: default_layer_pairs(LyingInt(10_001), 4), "student_layers"),
        "lowest_k_mask": (lambda: lowest_k_mask(scores, LyingInt(999)), "k"),
        "qrange": (lambda: qrange(AgreeingInt(99), True), "bits"),
        "symmetric_params": (lambda: symmetric_params(scores, 8, dim=LyingInt(7)), "dim"),
        "inject_outliers channels": (lambda: inject_outliers(model, [LyingInt(999)]), "channels"),
        "kernel version": (lambda: _version("softmax", LyingInt(99)), "version"),
        "kd_loss temperature": (lambda: kd_loss(logits, logits, temperature=LyingFloat(1e-9)), "temperature"),
        "distillation_loss kd_weight": (lambda: distillation_loss(logits, logits, labels, kd_weight=LyingFloat(3.0)),
                                        "kd_weight"),
        "inject_outliers factor": (lambda: inject_outliers(model, [3], factor=LyingFloat(1e9)), "factor"),
        "smoothing_scales alpha": (lambda: smoothing_scales(torch.ones(32), torch.ones(8, 32), LyingFloat(7.0)),
                                   "alpha"),
        "outlier_report threshold": (lambda: outlier_report({"x": torch.ones(4)}, LyingFloat(-1.0)), "threshold"),
    }


@pytest.mark.parametrize("case", sorted(_lying_refusals()))
def test_a_number_whose_comparisons_lie_is_checked_as_the_number_it_holds(case):
    call, name = _lying_refusals()[case]
    with pytest.raises(ValueError, match=name):
        call()


def test_a_lying_number_in_range_gives_what_the_plain_number_gives():
    """The other side of the rule: a subclass holding a valid value is that value (a check that compared the caller's
    object refused valid vocabularies and block indices with messages contradicting themselves)."""
    from minillm.distill.losses import FeatureProjection, check_layer_pairs
    from minillm.prune.masks import lowest_k_mask
    from minillm.speculative.bench import expected_tokens_per_call, predicted_speedup
    from minillm.speculative.sampling import check_draft_tokens
    from helpers import LyingFloat, LyingInt

    scores = torch.randn(4, 16)
    assert torch.equal(lowest_k_mask(scores, LyingInt(5)), lowest_k_mask(scores, 5))
    assert expected_tokens_per_call(LyingFloat(0.5), 3) == expected_tokens_per_call(0.5, 3) == 1.875
    assert predicted_speedup(LyingFloat(0.5), LyingInt(3), 0.1) == predicted_speedup(0.5, 3, 0.1)
    assert check_draft_tokens([1, 2, 3], LyingInt(8)) == [1, 2, 3]
    assert check_layer_pairs([(0, 1)], LyingInt(2), 4) == [(0, 1)]
    pairs = FeatureProjection(8, 16, [(LyingInt(1), 3)]).layer_pairs
    assert pairs == [(1, 3)] and all(type(i) is int for pair in pairs for i in pair)


def test_checked_numbers_are_stored_as_plain_python_numbers():
    """What a config keeps is a Python int or float, never the caller's object (whose repr may fail, or whose == may
    say False to the value it holds)."""
    import numpy as np
    from minillm.core.config import check_float
    from minillm.speculative.engine import SpeculativeConfig
    from helpers import LyingFloat, LyingInt

    assert type(check_float("x", np.float64(0.5))) is float and type(check_float("x", LyingFloat(0.5))) is float
    assert type(check_float("x", LyingInt(3))) is int
    stored = [QuantConfig("int4", group_size=LyingInt(8)).group_size,
              Int8ContiguousKVCache(CFG, 1, LyingInt(8)).max_len,
              GPTConfig(vocab_size=128, block_size=LyingInt(32), n_layer=2, n_head=2, n_embd=32).block_size,
              SamplingParams(max_new_tokens=LyingInt(5)).max_new_tokens, SamplingParams(seed=LyingInt(5)).seed,
              SpeculativeConfig(gamma=LyingInt(4)).gamma]
    assert stored == [8, 8, 32, 5, 5, 4] and all(type(v) is int for v in stored)
    assert type(SamplingParams(temperature=LyingFloat(0.5)).temperature) is float
    config = SpeculativeConfig()
    config.gamma = LyingInt(10**6)  # reassigned after construction: checked again where it is used
    with pytest.raises(ValueError, match="gamma"):
        config.check()


HUGE = 10**5000  # past 4,300 digits: str() of it is Python's own ValueError ("Exceeds the limit ...")


def _huge_calls():
    from minillm.core.stopping import check_eos_id, check_token_ids
    from minillm.distill.losses import check_layer_pairs
    from minillm.kernels.ops import _version
    from minillm.prune.masks import lowest_k_mask, nm_mask, num_pruned
    from minillm.prune.structured import lowest_heads, mask_heads
    from minillm.quant.quantize import qrange, quantize, symmetric_params

    model = GPT(CFG).eval()
    scores = torch.randn(4, 16)
    return {
        "token id": (lambda: check_token_ids("prompt", [HUGE], 128), "prompt[0]"),
        "eos_id": (lambda: check_eos_id(HUGE, 128), "eos_id"),
        "generate eos_id": (lambda: generate_speculative(model, model, [1, 2], SamplingParams.greedy(2), eos_id=HUGE),
                            "eos_id"),
        "quantize bits": (lambda: quantize(scores, bits=HUGE), "bits"),
        "qrange bits": (lambda: qrange(HUGE, True), "bits"),
        "dim": (lambda: symmetric_params(scores, 8, dim=HUGE), "dim"),
        "k": (lambda: lowest_k_mask(scores, HUGE), "k"),
        "n of N:M": (lambda: nm_mask(scores, HUGE, 4), "n"),
        "head id": (lambda: mask_heads(model, {0: [HUGE]}), "heads"),
        "per_block": (lambda: lowest_heads(torch.randn(2, 2), HUGE), "per_block"),
        "layer pair": (lambda: check_layer_pairs([(HUGE, 0)]), "layer_pairs"),
        "kernel version": (lambda: _version("softmax", HUGE), "version"),
        "num_pruned": (lambda: num_pruned(HUGE, 0.5), "n"),
        "seed": (lambda: SamplingParams(seed=HUGE), "seed"),
    }




def test_numpy_ints_in_layer_pairs_are_refused_saying_how_to_convert():
    import numpy as np
    from minillm.distill.losses import FeatureProjection

    with pytest.raises(TypeError, match=r"layer_pairs\[0\]\[0\].*convert it with int\(\)"):
        FeatureProjection(8, 16, [(np.int64(1), 3)])


class _FloatWithLyingConversion(float):
    """A float holding its value whose float() says 2.0: a check that calls float() on it reads 2.0."""

    def __float__(self):
        return 2.0


class _AboveNothing(int):
    """An int that is never above anything: `x <= 0` holds for it, so `if x <= 0: raise` is fooled by -4."""

    def __le__(self, other):
        return False

    def __gt__(self, other):
        return True


def _more_refusals():
    from minillm.compile.mirror import decode_step_by_hand
    from minillm.compile.sweep import Case
    from minillm.distill.bench import cost_model_speedup
    from minillm.kernels.mirror import paged_gather
    from minillm.prune.semi_structured import semi_structured_support, stored_bytes
    from minillm.quant.gptq import calibration_windows
    from minillm.quant.quantize import quantize
    from helpers import LyingInt

    model = GPT(CFG).eval()
    k, v = ([torch.zeros(1, 2, 8, 16) for _ in range(2)] for _ in range(2))  # (1, nh, max_len, hs) per layer
    pool, table, W = torch.randn(4, 4, 2, 8), torch.arange(4), torch.randn(8, 16)
    return {
        "element_bytes lying": (lambda: stored_bytes(W, "dense", element_bytes=_AboveNothing(-4)), "element_bytes"),
        "element_bytes huge": (lambda: stored_bytes(W, "dense", element_bytes=HUGE), "element_bytes"),
        "sweep Case huge": (lambda: Case("decode", HUGE, 8), "Case.batch"),
        "sweep Case past float": (lambda: Case("decode", 10**400, 8), "Case.batch"),
        "cost_model_speedup alpha": (lambda: cost_model_speedup(2.0, 3, 0.1), "alpha"),
        "cost_model_speedup c": (lambda: cost_model_speedup(0.5, 3, -5.0), "c"),
        "cost_model_speedup nan": (lambda: cost_model_speedup(float("nan"), 3, 0.1), "alpha"),
        "paged_gather lying": (lambda: paged_gather(pool, table, LyingInt(999)), "context_len"),
        "paged_gather huge": (lambda: paged_gather(pool, table, HUGE), "context_len"),
        "decode token lying": (lambda: decode_step_by_hand(model, k, v, LyingInt(999), 0, 0), "token"),
        "decode pos huge": (lambda: decode_step_by_hand(model, k, v, 1, HUGE, 0), "pos"),
        "decode slot lying": (lambda: decode_step_by_hand(model, k, v, 1, 0, LyingInt(999)), "slot"),
        "group_size huge": (lambda: quantize(W, bits=8, granularity="group", group_size=HUGE), "group_size"),
        "calibration seed 2**64": (lambda: calibration_windows(2, 8, 2**64), "seed"),
        "CUDA index 2**64": (lambda: semi_structured_support(2**64), "device"),
        "CUDA index huge": (lambda: semi_structured_support(HUGE), "device"),
    }


def test_eps_is_read_as_the_float_it_holds_not_its_float_conversion():
    from minillm.kernels.ops import check_eps

    assert check_eps(_FloatWithLyingConversion(1e-3)) == 1e-3
    assert type(check_eps(_FloatWithLyingConversion(1e-3))) is float


def test_cost_model_speedup_is_chapter_08s_model():
    from minillm.distill.bench import cost_model_speedup
    from minillm.speculative.bench import predicted_speedup

    assert cost_model_speedup(0.5, 3, 0.1) == predicted_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)


def test_a_decimal_is_refused_saying_how_to_convert_it():
    from decimal import Decimal
    from minillm.core.config import check_float, check_int

    with pytest.raises(TypeError, match=r"convert it with int\(\)"):
        check_int("n", Decimal(5))
    with pytest.raises(TypeError, match=r"convert it with float\(\)"):
        check_float("x", Decimal("0.5"))


class _NeverBelow(int):
    """An int that is never below anything: `x < 0` is False for it, so `if x < 0: raise` is fooled by -5."""

    def __lt__(self, other):
        return False


def _third_refusals():
    from minillm.compile.decode import integer_ids
    from minillm.compile.sweep import profile_table, thread_counts
    from minillm.core.timing import measure
    from minillm.gpt.train import TrainConfig
    from minillm.kernels.bench import percent, span, times
    from minillm.kernels.ops import check_head_size
    from minillm.prune.masks import check_keeps_one
    from helpers import LyingFloat, LyingInt

    ops = [{"name": f"op{i}", "calls_per_step": 1, "self_us_per_step": 1.0, "share": 0.25} for i in range(4)]
    return {
        "decoder token past int64": (lambda: integer_ids("token", 2**64, 1), "token"),
        "head size huge": (lambda: check_head_size("q", HUGE), "head size"),
        "head size lying": (lambda: check_head_size("q", LyingInt(99999)), "head size"),
        "head size float": (lambda: check_head_size("q", 1.5), "head size"),
        "times lying": (lambda: times(LyingFloat(-2.5)), "ratio"),
        "times past float": (lambda: times(10**400), "ratio"),
        "span lying": (lambda: span([1, LyingInt(-3), 7]), "values[1]"),
        "percent str": (lambda: percent("0.5"), "fraction"),
        "thread_counts int": (lambda: thread_counts(3), "threads"),
        "profile_table negative top": (lambda: profile_table(ops, top=-1), "top"),
        "profile_table float top": (lambda: profile_table(ops, top=1.5), "top"),
        "measure repeats 2**64": (lambda: measure(lambda: None, repeats=2**64), "repeats"),
        "keeps_one None": (lambda: check_keeps_one(None, 0.99, "x"), "n"),
        "keeps_one nan": (lambda: check_keeps_one(0, float("nan"), "x"), "sparsity"),
        "sampling temperature past float": (lambda: SamplingParams(temperature=10**400), "temperature"),
        "sampling max_new_tokens huge": (lambda: SamplingParams(max_new_tokens=HUGE), "max_new_tokens"),
        "train final_eval_tokens lying": (lambda: TrainConfig(final_eval_tokens=_NeverBelow(-5)), "final_eval_tokens"),
        "train seed 2**64": (lambda: TrainConfig(seed=2**64), "seed"),
    }


def _fourth_refusals():
    from minillm.compile.decode import check_decoder_room
    from minillm.distill.run_state import record_digest
    from minillm.kernels.bench import contender_key
    from minillm.kernels.ops import check_block_tables
    from minillm.quant.kv_cache import dequantize_kv
    from minillm.quant.quantize import dequantize, quantize
    from minillm.speculative.generate import lookup, prompt_lookup_proposals
    import numpy as np

    def float_shape():
        qt = quantize(torch.randn(4, 16))
        qt.shape = (4, 16.0)  # == (4, 16) in Python
        return dequantize(qt)

    tables, lens = torch.zeros(1, 2, dtype=torch.long), torch.tensor([3])
    codes = torch.zeros(2, 4, dtype=torch.int8)
    return {
        "stop holding a huge int": (lambda: SamplingParams(max_new_tokens=6, stop=[HUGE]), "stop"),
        "lookup ids past int64": (lambda: prompt_lookup_proposals([2**64, 1, 2, 2**64, 1], 3, 2), "ids[0]"),
        "lookup gamma float": (lambda: lookup([1, 2, 1], 1.5, 1), "lookup"),
        "lookup ngram negative": (lambda: lookup([1, 2, 1], 2, -1), "ngram"),
        "dequantize_kv inf scale": (lambda: dequantize_kv(codes, torch.tensor([[float("inf")], [1.0]])), "scale"),
        "record_digest numpy": (lambda: record_digest("", {"loss": np.float32(0.5)}), "loss"),
        "record_digest huge": (lambda: record_digest("", {"loss": HUGE}), "loss"),
        "contender_key int": (lambda: contender_key(2), "version"),
        "block tables num_blocks 2**64": (lambda: check_block_tables(tables, lens, 2**64, 4), "num_blocks"),
        "block tables block_size float": (lambda: check_block_tables(tables, lens, 4, 1.5), "block_size"),
        "decoder room None": (lambda: check_decoder_room(None, CFG, [1, 2, 3], SamplingParams.greedy(5)), "max_len"),
        "decoder room past window": (lambda: check_decoder_room(2**64, CFG, [1, 2, 3], SamplingParams.greedy(5)),
                                     "max_len"),
        "quantized shape of floats": (float_shape, "shape"),
    }


# Every row: (the call, the name its error must give). Each builder holds one hostile run's finds: ints past 4,300
# digits (`_huge_calls`); sites that compared, printed or passed on the caller's number as given (`_more_refusals`);
# a decoder's token past int64, report helpers, SamplingParams and TrainConfig (`_third_refusals`); a stop list,
# prompt lookup, a KV scale of inf, a records line, the block tables, a decoder's room, a quantized shape
# (`_fourth_refusals`).
def _named_refusals():
    return {f"{group}: {case}": row for group, rows in (("huge", _huge_calls()), ("second", _more_refusals()),
                                                        ("third", _third_refusals()), ("fourth", _fourth_refusals()))
            for case, row in rows.items()}


@pytest.mark.parametrize("case", sorted(_named_refusals()))
def test_a_hostile_number_or_value_is_refused_naming_the_argument(case):
    """A TypeError / ValueError naming the argument, and never Python's own message for an int past 4,300 digits
    (the library describes such an int by its size, `short_repr`)."""
    call, name = _named_refusals()[case]
    with pytest.raises((TypeError, ValueError), match=re.escape(name)) as info:
        call()
    assert "Exceeds the limit" not in str(info.value)


def test_a_fifth_hostile_runs_values_are_refused_before_any_work():
    """A fifth run's finds: layer_costs' calls had no bound (2**63 collected outputs until memory ran out) nor its
    sizes (torch's allocator named nothing); a records line keyed by an int; a decoder's batch_size of 10**5000 in
    a message."""
    from minillm.compile.decode import StaticDecoder
    from minillm.distill.run_state import record_digest
    from minillm.prune import bench as prune_bench
    from minillm.quant import bench as quant_bench

    for call, name in ((lambda: prune_bench.layer_costs((0.5,), (1,), repeats=1, calls=2**63), "calls"),
                       (lambda: quant_bench.layer_costs(calls=2**63), "calls"),
                       (lambda: quant_bench.layer_costs(in_features=128, out_features=2**40), "out_features"),
                       (lambda: quant_bench.layer_costs(tokens=(2**40,)), "tokens"),
                       (lambda: prune_bench.layer_costs((0.5,), (2**40,)), "tokens"),
                       (lambda: record_digest("", {1: 2.0, "a": 3.0}), "field names")):
        with pytest.raises((TypeError, ValueError), match=name):
            call()
    decoder = StaticDecoder(GPT(CFG).eval(), mode="eager")
    decoder.batch_size = HUGE
    with pytest.raises(ValueError, match="batch_size an int of"):
        decoder.generate_ids([1, 2], SamplingParams.greedy(3))


def test_a_sixth_hostile_runs_values_are_refused_or_taken_as_documented():
    """A sixth run's finds: the paged caches stored an int subclass as num_blocks and took an integer dtype (every K
    and V truncated); a benchmark's repeats past the cap; FakeQuantLinear's sizes; numpy token ids refused by the
    chapter 13 mirror and step (token ids take numpy ints everywhere else)."""
    import numpy as np
    from minillm.compile.decode import integer_ids
    from minillm.compile.mirror import decode_step_by_hand
    from minillm.compile.sweep import operator_name
    from minillm.distill.bench import check_prompts
    from minillm.quant.qat import FakeQuantLinear
    from minillm.speculative.bench import matmul_costs
    from minillm.speculative.verify_cache import VerifyKVCache
    from helpers import LyingInt

    model = GPT(CFG).eval()
    for call, name in ((lambda: VerifyKVCache(CFG, HUGE, 4), "num_blocks"),
                       (lambda: VerifyKVCache(CFG, 2, 4, dtype=torch.long), "dtype"),
                       (lambda: matmul_costs(model, [1], repeats=2**63), "repeats"),
                       (lambda: FakeQuantLinear(2**40, 4), "out_features x in_features"),
                       (lambda: FakeQuantLinear(1.5, 4), "in_features"),
                       (lambda: check_prompts(model, [[1, 2]], "p", HUGE), "new_tokens"),
                       (lambda: operator_name(None), "name")):
        with pytest.raises((TypeError, ValueError), match=name) as info:
            call()
        assert "Exceeds the limit" not in str(info.value)
    assert type(VerifyKVCache(CFG, LyingInt(8), 4).num_blocks) is int
    assert torch.equal(integer_ids("token", np.int64(3), 1), integer_ids("token", 3, 1))
    k, v = ([torch.zeros(1, 2, 8, 16) for _ in range(2)] for _ in range(2))
    k2, v2 = ([torch.zeros(1, 2, 8, 16) for _ in range(2)] for _ in range(2))
    assert torch.equal(decode_step_by_hand(model, k, v, np.int64(3), np.int64(0), 0),
                       decode_step_by_hand(model, k2, v2, 3, 0, 0))


class _FormatBomb(float):
    """A float whose formatting raises: a table must print the plain number its checks returned."""

    def __format__(self, spec):
        raise RuntimeError("formatted the caller's object")

    def __repr__(self):
        raise RuntimeError("formatted the caller's object")


def test_a_seventh_hostile_runs_values_are_refused_before_any_work(tmp_path):
    """A seventh run's finds: benchmark loops with no upper bound (2**40 draws, 10**6 timed forwards); public check
    helpers that read an attribute of None (their callers check first, a direct caller got AttributeError); a
    fine-tune's batch past one tensor; a str taken as a tokenizer; a sweep's prompt past the window named by the
    model; an empty prompt named `prompt_ids`; a table formatting the caller's float; compile jobs without a bound."""
    import numpy as np
    import torch.nn as nn
    from minillm.compile.cpu_paged import check_paged_arguments
    from minillm.compile.decode import check_eval_mode, eval_mode
    from minillm.compile.llamacpp import REF, format_rounds, format_table
    from minillm.compile.mirror import check_plain_model
    from minillm.distill.bench import teacher_continuations
    from minillm.distill.losses import check_targets
    from minillm.kernels.bench import parse_table, version_of
    from minillm.kernels.build import check_build_args
    from minillm.paged.paged_cache import PagedKVCache
    from minillm.prune.unstructured import block_linears
    from minillm.quant.qat import finetune_qat, keeping_zeros
    from minillm.quant.quantize import check_finite, check_scale_positive
    from minillm.speculative import bench as spec_bench

    torch.manual_seed(0)
    model, draft = GPT(CFG).eval(), GPT(CFG).eval()
    pools = [torch.zeros(4, 2, 2, 4) for _ in range(2)]
    q, tables, lens = torch.zeros(2, 2, 4), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, dtype=torch.long)
    rows = (
        (lambda: spec_bench.sampling_exactness(model, draft, [1, 2], draws=2**40), ValueError, "draws must be at most"),
        (lambda: spec_bench.forward_costs(model, draft, [1, 2], [1, 2], context=8, repeats=10**6), ValueError,
         "repeats must be at most"),
        (lambda: spec_bench.greedy_sweep(model, draft, [[1, 2]], 40, [1], 1), ValueError,
         r"prompts\[0\] has 2 tokens: with new_tokens=40"),
        (lambda: spec_bench.draft_agreement(model, draft, [[1, 2]], [list(range(40))]), ValueError,
         r"prompts\[0\] \(2 tokens\) and outputs\[0\] \(40 tokens\)"),
        (lambda: spec_bench.check_tokenizer("gpt2"), TypeError, "tokenizer must have an encode"),
        (lambda: finetune_qat(model, QuantConfig("int8"), steps=1, batch_size=10**9), ValueError,
         "batch_size x block_size x vocab_size"),
        (lambda: teacher_continuations(model, [[1], []], 4), ValueError, r"prompts\[1\] is empty"),
        (lambda: check_build_args(tmp_path / "build", 10**6, 10.0), ValueError, "jobs must be at most"),
        (lambda: PagedKVCache(CFG, np.int64(8), 4), TypeError, "num_blocks must be a Python int.*convert it"),
        (lambda: check_scale_positive(None), TypeError, "scale must be a floating-point tensor"),
        (lambda: check_finite("x", None), TypeError, "x must be a tensor"),
        (lambda: keeping_zeros(None).__enter__(), TypeError, "weights must be a list"),
        (lambda: keeping_zeros([torch.zeros(3)]).__enter__(), TypeError, r"weights\[0\] must be .* requires grad"),
        (lambda: block_linears(None), TypeError, "block must be a torch module"),
        (lambda: check_targets("y", torch.tensor([1]), (1,), None, torch.device("cpu")), TypeError, "vocab_size"),
        (lambda: ops.check_slot_range(None, 8), TypeError, "slot_mapping"),
        (lambda: ops.check_slot_range(torch.tensor([0.0, 3.0]), 8), ValueError, "slot_mapping must have dtype int64"),
        (lambda: ops.check_slot_range(torch.tensor([0, 1]), 0), ValueError, "only -1 .the pool has no slots"),
        (lambda: ops.check_distinct_slots(torch.tensor([[0, 1]])), ValueError, "slot_mapping must be 1-D"),
        (lambda: parse_table(None), TypeError, "text must be"),
        (lambda: version_of(None), TypeError, "name must be a kernel's name"),
        (lambda: check_plain_model(nn.Linear(4, 4), "the step"), TypeError, "the step needs a minillm GPT"),
        (lambda: eval_mode(None).__enter__(), TypeError, "model must be a torch module"),
        (lambda: check_eval_mode(None, "the step"), TypeError, "the step needs a torch module"),
        (lambda: check_paged_arguments(q, *pools, tables, lens.float()), TypeError, "context_lens must be an int64"),
        (lambda: check_paged_arguments(q, *pools, tables, lens, [1, 1]), TypeError, "query_lens must be an int64"),
        (lambda: format_rounds({REF: [1.0], 3: [2.0]}), TypeError, "keyed by path names"),
    )
    for call, error, message in rows:
        with pytest.raises(error, match=message):
            call()
    assert format_rounds({REF: [_FormatBomb(1.5), 2.0]}).splitlines()[2] == "| 1 | 2 |"
    assert "| llama.cpp f32 | 3 | 100% |" in format_table({REF: _FormatBomb(3.0), "x": 2.0})


def _report_readers():
    """Every function of the package marked `reads_report`: the tables and quotes built from a benchmark's report."""
    import pkgutil

    import minillm

    found = {}
    for info in pkgutil.walk_packages(minillm.__path__, "minillm."):
        if info.name.rsplit(".", 1)[-1] not in ("bench", "engine_bench", "fused_engine", "onnx_peer", "aot", "sweep",
                                                "llamacpp", "loadgen", "peer"):
            continue
        module = importlib.import_module(info.name)
        for name, fn in vars(module).items():
            if getattr(fn, "reads_report", False) and fn.__module__ == info.name:
                found[f"{info.name}.{name}"] = fn
    assert len(found) >= 50, sorted(found)
    return found


@pytest.mark.parametrize("name", sorted(_report_readers()))
def test_every_report_reader_names_itself_for_a_report_it_cannot_read(name):
    """A report that is no dict, an empty one, or one whose parts are None: a TypeError / ValueError naming the
    function (or the report), never a bare KeyError / IndexError / AttributeError from the middle of a table."""
    import inspect

    fn = _report_readers()[name]
    params = list(inspect.signature(fn).parameters.values())[1:]
    extra = ["x" for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    short = name.rsplit(".", 1)[-1]
    with pytest.raises(TypeError, match=rf"^report must be a report dict, got Tensor .*\({short} reads what"):
        fn(torch.zeros(2), *extra)
    for report in ({}, {"rows": None, "cases": None, "prompts": None, "points": None, "sizes": None}):
        try:
            fn(report, *extra)  # a reader whose sections are all optional gives an empty table
        except (TypeError, ValueError) as e:
            assert type(e) in (TypeError, ValueError), type(e)  # ours, not a subclass from inside (JSON, codecs)


def test_every_public_helper_checks_the_type_of_what_it_is_given():
    """Each public function and class of chapters 08-13 called with None (or an int) for its arguments answers
    with a TypeError / ValueError naming the argument. These were found by such a sweep: each read an attribute of
    its argument first (an AttributeError naming nothing)."""
    import argparse

    from minillm.compile.aot import DecodeStep
    from minillm.compile.cpu_gemv import as_cpp_reads
    from minillm.compile.decode import check_decoder_room, decoder_max_len, own_code, uncompilable_layer
    from minillm.compile.fused_step import build_cpp_decoder
    from minillm.distill.train import usage_error
    from minillm.engine.config import EngineConfig
    from minillm.kernels.tour import emulator_row
    from minillm.paged.block_manager import BlockManager
    from minillm.prune.structured import mlp_widths
    from minillm.quant.linear import block_linears
    from minillm.speculative.bench import encode
    from minillm.speculative.engine import PromptLookupDrafter, SpeculativeScheduler

    engine = EngineConfig(num_blocks=8, block_size=4)
    rows = (
        (lambda: SpeculativeScheduler(None, BlockManager(8, 4), None, 2, 32), "config must be an EngineConfig"),
        (lambda: SpeculativeScheduler(engine, None, None, 2, 32), "block_manager must be a BlockManager"),
        (lambda: SpeculativeScheduler(engine, BlockManager(8, 4), None, 2, 32), "drafter must be a Drafter"),
        (lambda: encode(None, "text"), "tokenizer must have an encode"),
        (lambda: block_linears(None), "block_linears needs a minillm GPT"),
        (lambda: mlp_widths(3), "mlp_widths needs a minillm GPT"),
        (lambda: usage_error(None, ValueError("steps must be positive")), "ap must be"),
        (lambda: as_cpp_reads(None), "t must be a tensor"),
        (lambda: decoder_max_len(None, 4), "config must be the model's GPTConfig"),
        (lambda: check_decoder_room(4, 3, [1], SamplingParams.greedy(2)), "config must be the model's GPTConfig"),
        (lambda: own_code(None), "fn must be a Python function"),
        (lambda: uncompilable_layer(None), "model must be a torch module"),
        (lambda: DecodeStep(None, 4), "DecodeStep needs a minillm GPT"),
        (lambda: build_cpp_decoder(None, [], []), "the fused C\\+\\+ step needs a minillm GPT"),
        (lambda: ops.check_block_tables(3, 3, 3, 3), "block_tables must be a torch.Tensor"),
        (lambda: emulator_row(None), "seed"),
    )
    for call, message in rows:
        with pytest.raises((TypeError, ValueError), match=message):
            call()
    drafter = PromptLookupDrafter(2, 32, torch.device("cpu"))  # a real drafter still builds its scheduler
    scheduler = SpeculativeScheduler(engine, BlockManager(8, 4), drafter, 2, 32)
    assert (scheduler.drafter, scheduler.gamma, scheduler.vocab_size) == (drafter, 2, 32)
    with pytest.raises(SystemExit):
        usage_error(argparse.ArgumentParser(prog="t"), ValueError("steps must be positive"))


class _EqualsAnything:
    """Not a str, but == says True to everything: a name check that asks the value (`mode in MODES`) takes it."""

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


class _StrEqualsAnything(str):
    """A str whose == says True to everything: compared as the plain str it holds, it is the name it spells."""

    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


def test_an_eighth_hostile_runs_names_and_helpers_are_refused_naming_the_argument():
    """An eighth run's finds: names (a mode, a method, a kind) were checked by asking the value `in` the choices,
    so a numpy array failed in numpy ("truth value ... ambiguous") and an object whose == says True was taken as the
    first choice; helpers that read an attribute of their argument first; block tables never checked themselves; a
    fused pruning comparison naming the calibration its caller never passed."""
    import numpy as np
    from minillm.compile.bench import pruned_fused
    from minillm.compile.cpu_gemv import check_finite_scale
    from minillm.compile.sweep import Case
    from minillm.distill.losses import check_kind
    from minillm.kernels.bench import time_ms
    from minillm.kernels.mirror import flash_attention_v3
    from minillm.prune.semi_structured import stored_bytes
    from minillm.prune.unstructured import prune_model
    from minillm.quant.quantize import tensor_state
    from minillm.speculative.engine import SpeculativeConfig

    model = GPT(CFG).eval()
    q = torch.zeros(1, 1, 4, 8)
    tables = torch.zeros(2, 3, dtype=torch.long)
    names = (
        (lambda v: QuantConfig(v), "mode must be one of"),
        (lambda v: SpeculativeConfig(method=v), "SpeculativeConfig.method must be one of"),
        (lambda v: GPTConfig(attn_impl=v), "attn_impl must be one of"),
        (lambda v: Case(v, 1, 4), "Case.kind must be one of"),
        (lambda v: stored_bytes(torch.zeros(4, 4), v), "format must be one of"),
        (lambda v: prune_model(model, v), "method must be one of"),
        (lambda v: check_kind(v), "kind must be one of"),
        (lambda v: StaticDecoder(model, mode=v), "mode must be one of"),
    )
    for make, message in names:
        for bad in (np.array(["int8", "int4"]), _EqualsAnything()):
            with pytest.raises(TypeError, match=message):
                make(bad)
        with pytest.raises(ValueError, match=message + r".*got 'zzz'"):
            make(_StrEqualsAnything("zzz"))
    config = QuantConfig(_StrEqualsAnything("int8"))
    assert type(config.mode) is str and config.mode == "int8" and config.bits == 8
    with pytest.raises(ValueError, match="p_dtype must be None"):
        flash_attention_v3(q, q, q, _EqualsAnything())
    rows = (
        (lambda: tensor_state(3), TypeError, "tensor_state takes tensors"),
        (lambda: ops.check_same_device(a=3, b=torch.zeros(1)), TypeError, "a must be a tensor"),
        (lambda: ops.check_block_tables(None, torch.ones(2, dtype=torch.long), 4, 4), TypeError, "block_tables"),
        (lambda: ops.check_block_tables(tables, torch.tensor([1.9, 1.9]), 4, 4), ValueError, "context_lens"),
        (lambda: ops.check_block_tables(tables, torch.ones(3, dtype=torch.long), 4, 4), ValueError,
         r"context_lens must have shape \(2,\)"),
        (lambda: check_finite_scale(None), TypeError, "scale must be a floating-point tensor"),
        (lambda: pruned_fused(model, [1, 2], SamplingParams.greedy(2), float("nan"), 1), ValueError, "fraction"),
        (lambda: pruned_fused(model, [1, 2], SamplingParams.greedy(2), 0.25, 1), ValueError,
         "vocab_size=128 does not hold them"),
        (lambda: time_ms(lambda: None, 2**40, 1), ValueError, "warmup must be at most"),
        (lambda: time_ms(lambda: None, 1, 1, max_calls=2**40), ValueError, "max_calls must be at most"),
    )
    for call, error, message in rows:
        with pytest.raises(error, match=message):
            call()


def test_a_ninth_hostile_runs_finds_are_refused_naming_the_argument(tmp_path):
    """A ninth run's finds: the same name checks at other sites (an output path, an attention backend, a compile
    backend, a resumed run's kind); helpers reading an attribute first; a compiler timeout past the OS's clock; a
    fine-tune of 2**40 steps; a fused speculation past the window (its rates counted tokens never generated); a
    cache device torch cannot read; a paged cache's gather with no batch (a bare AssertionError)."""
    import numpy as np
    from minillm.compile.bench import fused_speculation
    from minillm.compile.cpu_gemv import FastLinear, require_cpu_tensors
    from minillm.compile.decode import check_backend, hooked_module
    from minillm.compile.sweep import profile_table
    from minillm.core.io import check_output_file
    from minillm.distill.bench import report_section
    from minillm.distill.run_state import check_settings
    from minillm.kernels import tour as ktour
    from minillm.kernels.bench import command_line, contender_key, out_flag, ptxas_rows
    from minillm.kernels.build import run_compiler
    from minillm.prune.structured import recover
    from minillm.quant.bench import outlier_study
    from minillm.quant.kv_cache import Int8PagedKVCache
    from minillm.speculative.engine_bench import load_point, sweep_sizes
    from minillm.speculative.generate import DraftModelProposer
    from minillm.speculative.verify_cache import VerifyKVCache

    model = GPT(CFG).eval()
    settings = {"temperature": 2.0, "kd_weight": 0.5, "kind": _StrEqualsAnything("forward"), "feature_weight": 0.0,
                "teacher_sha256": None, "grad_accum": 1, "trainer": TRAINER}  # run_state.SETTINGS
    rows = (
        (lambda: check_output_file(np.array(["a.json", "b.json"]), "--json"), TypeError, "--json"),
        (lambda: out_flag(_EqualsAnything()), TypeError, "--out must be a path"),
        (lambda: load_point(model, [[1, 2]], 1, 2, None, attention_backend=np.array(["verify", "x"])), TypeError,
         "attention_backend must be one of"),
        (lambda: sweep_sizes("no", None), TypeError, "quick must be a bool"),
        (lambda: check_backend(_StrEqualsAnything("zzz")), ValueError, "backend must be one of torch.compile's"),
        (lambda: outlier_study(None, torch.zeros(4, dtype=torch.long), None), TypeError, "outlier_study"),
        (lambda: ptxas_rows(None), TypeError, "resources must be a list"),
        (lambda: command_line("zzz"), TypeError, "argv must be a list"),
        (lambda: run_compiler(["true"], "x", float(2**40)), ValueError, "timeout must be in"),
        (lambda: ktour.cast((torch.zeros(1),), "zzz"), TypeError, "dtype must be a floating-point torch.dtype"),
        (lambda: ktour.cast("zzz", torch.float16), TypeError, "args must be a tuple"),
        (lambda: ktour.compare("softmax", torch.zeros(1), torch.zeros(1), np.array([1, 2])), ValueError, "dtype"),
        (lambda: report_section({"a": {}}, np.array(["a", "b"])), TypeError, "key must be"),
        (lambda: hooked_module("zzz"), TypeError, "named_modules"),
        (lambda: profile_table(np.array([1, 2])), TypeError, "ops must be a list"),
        (lambda: FastLinear(2**40, 8), ValueError, "out_features x in_features"),
        (lambda: FastLinear(True, 8), TypeError, "in_features"),
        (lambda: require_cpu_tensors("zzz", x=torch.zeros(1)), TypeError, "dtype must be a torch.dtype"),
        (lambda: fused_speculation(model, model, [[1, 2, 3]], [1, 2, 3, 1, 2], 2000, 2, 2, 1), ValueError,
         r"prompts\[0\] has 3 tokens: with new_tokens=2000"),
        (lambda: fused_speculation(model, model, None, [1, 2], 2), TypeError, "prompts must be"),
        (lambda: fused_speculation(model, model, [[1]], [1, 2], 2, 2, 0), ValueError, "lookup_gamma"),
        (lambda: VerifyKVCache(CFG, 8, 4, device="zzz"), ValueError, "device must be a device like"),
        (lambda: VerifyKVCache(CFG, 8, 4, use_fast_decode="no"), TypeError, "use_fast_decode must be a bool"),
        (lambda: ContiguousKVCache(CFG, 1, 8, device="zzz"), ValueError, "device must be a device like"),
        (lambda: recover(model, model, 2**40), ValueError, "steps must be at most"),
        (lambda: DraftModelProposer(model, 16).prefill(None), TypeError, "prompt"),
        (lambda: DraftModelProposer(model, 16).rollback(None), TypeError, "length"),
        (lambda: Int8PagedKVCache(CFG, 8, 4).gather(0, 0), ValueError, "none is set"),
    )
    for call, error, message in rows:
        with pytest.raises(error, match=message):
            call()
    assert contender_key(_StrEqualsAnything("zzz")) == "torch"
    checked = check_settings(settings)
    assert type(checked["kind"]) is str and checked["kind"] != "reverse"


def test_a_second_sweep_of_every_public_helper_finds_each_named():
    """A second sweep of every public function of chapters 08-13 with a tensor, a list and a dict for each argument:
    the registers' span, a program's command and a cold-start child's spec read them before checking."""
    from minillm.compile.aot import run_child
    from minillm.kernels.bench import span
    from minillm.kernels.build import run_program

    for call, error, message in ((lambda: span(torch.zeros(2)), TypeError, "values must be a list"),
                                 (lambda: run_program([], "x"), TypeError, "cmd must be a non-empty list"),
                                 (lambda: run_child(torch.zeros(2)), TypeError, "spec must be"),
                                 (lambda: run_child({"mode": "eager"}), ValueError, r"it lacks \['threads'")):
        with pytest.raises(error, match=message):
            call()
    assert (span([]), span([3, 3]), span([2, 5])) == ("", "3", "2-5")


def test_a_tenth_hostile_runs_finds_are_refused_naming_the_argument():
    """A tenth run's finds, in methods as well as functions: an empty --out written as a file named 'None'; a
    compile backend's plain str not passed on; validation ids as a list; FastLinear's device, dtype and input; a
    fused speculation refused only after its whole run; meta caches; attend, propose and run_rounds arguments; a
    subprocess timeout past the OS clock; a benchmark's quick flag read by truthiness; sizes as arrays; quantized
    heads built from nothing; the CLIs' argv."""
    import argparse

    import numpy as np
    from minillm.bench.cli import pick_size
    from minillm.compile.aot import DecodeStep, run_fresh
    from minillm.compile.bench import fused_speculation
    from minillm.compile.cpu_gemv import FastLinear
    from minillm.compile.decode import check_backend
    from minillm.compile.sweep import profile_table
    from minillm.core.stopping import start_request
    from minillm.kernels.bench import from_report, out_flag
    from minillm.kernels.build import run_program
    from minillm.prune import bench as prune_bench
    from minillm.quant.bench import outlier_study
    from minillm.quant.kv_cache import Int8ContiguousKVCache
    from minillm.quant.linear import QuantEmbedding, TiedQuantHead
    from minillm.speculative import bench as spec_bench
    from minillm.speculative.engine import PromptLookupDrafter
    from minillm.speculative.engine_bench import load_sweep
    from minillm.speculative.generate import DraftModelProposer, run_rounds
    from minillm.speculative.verify_cache import VerifyKVCache

    model = GPT(CFG).eval()
    q = torch.zeros(1, 2, 1, 16)
    state = start_request(CFG, [1, 2], SamplingParams.greedy(4))
    rows = (
        (lambda: out_flag(""), argparse.ArgumentTypeError, "--out must name a .json file"),
        (lambda: from_report(None, "x"), TypeError, "text must be a str"),
        (lambda: outlier_study(model, [1], None), ValueError, "val must hold at least 2"),
        (lambda: FastLinear(16, 8, device="zzz"), ValueError, "device must be a device like"),
        (lambda: FastLinear(16, 8, dtype=torch.int8), TypeError, "dtype must be a floating-point"),
        (lambda: FastLinear(16, 8)(None), TypeError, "x must be a tensor"),
        (lambda: fused_speculation(model, model, [[1] * 31], [1, 2, 3, 1, 2], 1, 3, 3, 1), ValueError,
         "leaves no room for the cost model's verify of 4 rows"),
        (lambda: VerifyKVCache(CFG, 8, 4, device="meta"), ValueError, "'meta'"),
        (lambda: Int8ContiguousKVCache(CFG, 1, 16).attend(-1, q, q, q), ValueError, "layer_idx must be in"),
        (lambda: Int8ContiguousKVCache(CFG, 1, 16).attend(0, None, q, q), TypeError, "q must be a 4-D tensor"),
        (lambda: DraftModelProposer(model, 16).propose([1, 2], -1, state), ValueError, "gamma"),
        (lambda: DraftModelProposer(model, 16).propose([1, 2], 2, None), TypeError, "state must be"),
        (lambda: run_rounds(None, DraftModelProposer(model, 16), 2, None, None), TypeError, "state must be"),
        (lambda: PromptLookupDrafter(2, 128, torch.device("cpu")).propose(None, 2), TypeError, "req must be"),
        (lambda: run_program(["true"], "x", timeout=2**40), ValueError, "timeout must be in"),
        (lambda: run_fresh(COLD_SPEC, 2**40), ValueError, "timeout must be in"),
        (lambda: spec_bench.run_all(torch.device("cpu"), quick="zzz"), TypeError, "quick must be a bool"),
        (lambda: spec_bench.run_all(torch.device("cpu"), prompts=10**6), ValueError, "prompts must be at most 64"),
        (lambda: pick_size({"quick": 1}, np.array(["quick"])), TypeError, "size must be one of"),
        (lambda: prune_bench.Harness(model, False, prune_bench.SIZES["quick"], None), TypeError, "seed"),
        (lambda: QuantEmbedding(None), TypeError, "head must be"),
        (lambda: TiedQuantHead("zzz"), TypeError, "embedding must be"),
        (lambda: profile_table([{}], 1), ValueError, r"ops\[0\] must be an operator row"),
        (lambda: spec_bench.main([1, 2]), TypeError, "argv must be None or a list of str"),
        (lambda: DecodeStep(model, 16)(torch.tensor([[1]]), 0), TypeError, "position must be a"),
        (lambda: spec_bench.hf_assisted(model, model, [1, 2], 2**40), ValueError, "prompt has 2 tokens"),
        (lambda: load_sweep(model, None, new_tokens=2**40), ValueError, "prompt"),
    )
    for call, error, message in rows:
        with pytest.raises(error, match=message):
            call()
    assert type(check_backend(_StrEqualsAnything("eager"))) is str
    from minillm.compile.bench import run_all
    from minillm.compile.cpu_gemv import build_problem

    if build_problem() is None:  # the fused paths run: their pruning text's vocabulary is checked before any work
        with pytest.raises(ValueError, match="^run_all scores the MLP neurons of pruned_fused on training text"):
            run_all(model, real_text=False, quick=True, backend="eager", with_hf=False)


def test_an_eleventh_and_twelfth_hostile_runs_finds_are_refused_naming_the_argument():
    """Runs 34 and 35's finds (the surface sweep in tests/test_public_surface.py covers the classes they stand for):
    a chapter 05 batch that does not fit its pool, prompt-lookup drafts copied from non-ids, hand-built verify
    entries, a DraftModelDrafter of nothing, a FakeQuantLinear without its config, an objective's replaced
    attributes, a cold-start spec's values, result records out of range, the fused step on odd int4 groups, and a
    --work of ''. (A resume with another trainer setting: tests/test_hostile_08_11.py.)"""
    import dataclasses
    from types import SimpleNamespace

    from minillm.compile.aot import run_fresh
    from minillm.compile.fused_step import FusedCPUDecoder
    from minillm.compile.llamacpp import main as llamacpp_main
    from minillm.distill.train import DistillObjective
    from minillm.engine.request import Request
    from minillm.paged.paged_cache import PagedBatch, PagedKVCache
    from minillm.prune import bench as prune_bench
    from minillm.quant.linear import quantize_model
    from minillm.quant.qat import FakeQuantLinear
    from minillm.speculative.bench import ChiSquare
    from minillm.speculative.engine import DraftModelDrafter, VerifyEntry
    from minillm.speculative.generate import PromptLookupProposer, SpeculativeStats

    t = torch.tensor
    model = GPT(CFG).eval()
    state = SimpleNamespace(params=SamplingParams.greedy(4), generator=None)
    request = Request("r0", [1, 2, 3], SamplingParams.greedy(4))
    cache = PagedKVCache(CFG, 4, 4)
    objective = DistillObjective(model)
    objective.on_record = 5
    rows = (
        (lambda: cache.set_batch(PagedBatch(t([28]), t([[7]]), t([1]), t([1]))), ValueError, "block ids of the pool"),
        (lambda: cache.set_batch(PagedBatch(t([0, 0]), t([[0]]), t([2]), t([2]))), ValueError,
         r"slot_mapping\[1\] = 0, but sequence 0's block table puts its position 1 in slot 1"),
        (lambda: cache.set_batch(PagedBatch(t([8]), t([[0]]), t([9]), t([1]))), ValueError,
         r"context_lens\[0\] = 9 does not fit block_tables\[0\]"),
        (lambda: PromptLookupProposer(2, 32, "cpu").propose([1, 2, -1, 1, 2], 2, state), ValueError, "token id"),
        (lambda: PromptLookupProposer(2, 32, "cpu").propose([1, 2, None, 1, 2], 2, state), ValueError, "seq holds"),
        (lambda: VerifyEntry(request, 3, 2, [1, 2.5]), ValueError, r"draft_token_ids\[1\]"),
        (lambda: VerifyEntry(request, 3, 2, [1, 2], draft_probs=torch.ones(3, 32)), ValueError, "one row per draft"),
        (lambda: DraftModelDrafter(None), TypeError, "DraftModelDrafter"),
        (lambda: DraftModelDrafter(model).propose(request, 0), ValueError, "k must be positive"),
        (lambda: FakeQuantLinear(16, 8)(torch.randn(2, 16)), ValueError, "no qat_config"),
        (lambda: objective(model, t([[1, 2]]), t([[2, 3]])), TypeError, "on_record"),
        (lambda: run_fresh({**COLD_SPEC, "threads": "x"}, 60), TypeError, r"spec\['threads'\]"),
        (lambda: run_fresh({**COLD_SPEC, "prompt": [99999]}, 60), ValueError, r"spec\['prompt'\]\[0\]"),
        (lambda: SpeculativeStats(proposed=1, accepted=2), ValueError, "more than proposed"),
        (lambda: ChiSquare(n=-1, chi2=1.0, dof=1, p_value=2.0, tv=0.1), ValueError, "ChiSquare.n"),
        (lambda: dataclasses.replace(prune_bench.SIZES["quick"], num_prompts=0), ValueError, "Sizes.num_prompts"),
    )
    for call, error, message in rows:
        with pytest.raises(error, match=message):
            call()
    with pytest.raises(SystemExit):  # a usage error (exit 2) naming --work, not the pipeline run in the cwd
        llamacpp_main(["--work", ""])
    from minillm.compile.cpu_gemv import build_problem

    if build_problem() is None:  # odd int4 groups: the TypeError naming the layer, not the C++ RuntimeError
        odd = GPT(GPTConfig(vocab_size=48, block_size=16, n_layer=1, n_head=2, n_embd=48)).eval()
        with pytest.raises(TypeError, match="odd group_size=3"):
            FusedCPUDecoder(quantize_model(odd, QuantConfig("int4", group_size=3)))


def test_a_thirteenth_hostile_run_and_the_widened_sweeps_finds_are_refused_naming_the_argument():
    """Run 36's finds and those of the surface sweep's widening (tests/test_public_surface.py covers the functions):
    paged batches that write a block another sequence reads or list a block twice, malformed batches, plain-data
    steps no planner makes, sampled tokens that are no ids, a stale or foreign step output, hand-built entries past
    their request, tokenizers that decode to no str or cannot encode, a NaN hand-off, a cold-start spec only the
    child can check, a timed-prompt count past the prompts, a nested build lock, a vocabulary no tensor holds."""
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    import numpy as np

    from minillm.compile.aot import run_fresh
    from minillm.compile.fused_step import build_cpp_decoder
    from minillm.distill import bench as distill_bench
    from minillm.engine.config import EngineConfig
    from minillm.engine.llm import LLM
    from minillm.engine.request import Request
    from minillm.engine.scheduler import ScheduledRequest
    from minillm.engine.step import StepInput
    from minillm.engine.swap import SwapSpace
    from minillm.kernels.bench import copy_bandwidth
    from minillm.kernels.build import build_lock
    from minillm.paged.paged_cache import PagedBatch, PagedKVCache
    from minillm.speculative.generate import PromptLookupProposer
    from minillm.speculative.sampling import check_generator
    from minillm.speculative.verify_cache import VerifyKVCache

    t = torch.tensor
    model = GPT(CFG).eval()
    state = SimpleNamespace(params=SamplingParams.greedy(4), generator=None)
    good = dict(token_ids=[5, 6], positions=[0, 1], slot_mapping=[0, 1], block_tables=[[0]], context_lens=[2],
                query_lens=[2], sample_rows=[1])
    empty = torch.zeros(0, dtype=torch.int64)

    class DecodesToInt:
        def decode(self, ids):
            return 7

    class DecodesOnly:
        def decode(self, ids):
            return "x"

    rows = (
        (lambda: PagedKVCache(CFG, 8, 4).set_batch(PagedBatch(t([0, 0]), t([[0], [0]]), t([1, 1]), t([1, 1]))),
         ValueError, r"writes block 0, which sequence\(s\) \[1\] also read"),
        (lambda: VerifyKVCache(CFG, 8, 4).set_batch(PagedBatch(t([3]), t([[0, 0]]), t([8]), t([1]))), ValueError,
         r"block_tables\[0\] lists a block twice"),
        (lambda: PagedBatch(t([[0], [1]]), t([[0]]), t([2]), t([2])), ValueError, "slot_mapping must be"),
        (lambda: VerifyKVCache(CFG, 8, 4).set_batch(PagedBatch(empty, empty.view(0, 1), empty, empty)), ValueError,
         "at least one sequence"),
        (lambda: PagedBatch(t([0]), t([[0]]), t([1]), t([1]).to("meta")), ValueError, "query_lens"),
        (lambda: StepInput(**{**good, "positions": [5, 6]}).check(CFG, 8, 4), ValueError, "positions"),
        (lambda: StepInput(**{**good, "token_ids": [5, 6.7]}).check(CFG, 8, 4), TypeError, r"token_ids\[1\]"),
        (lambda: StepInput(**{**good, "sample_rows": [True]}).check(CFG, 8, 4), TypeError, r"sample_rows\[0\]"),
        (lambda: StepInput(**{**good, "cow_pairs": [(0,)]}).check(CFG, 8, 4), ValueError, r"cow_pairs\[0\]"),
        (lambda: StepInput(**good).check(None, 8, 4), TypeError, "config"),
        (lambda: SwapSpace(PagedKVCache(CFG, 8, 4)).swap_in("zz", [1]), ValueError, "holds no KV"),
        (lambda: ScheduledRequest(Request("x", [1, 2], SamplingParams.greedy(4)), 5, 0), ValueError, "runs past"),
        (lambda: ScheduledRequest(Request("x", [1, 2], SamplingParams.greedy(4)), 1, 7), ValueError, "runs past"),
        (lambda: LLM(model, tokenizer=DecodesToInt()).generate([[1, 2]], SamplingParams.greedy(2, stop=("x",))),
         TypeError, "decode must return a str"),
        (lambda: LLM(model, tokenizer=DecodesOnly()).generate(["hello"]), TypeError, "no encode"),
        (lambda: LLM(model).add_prefilled_request([4, 5, 6], SamplingParams.greedy(4), 1,
                                                  torch.full((2, 2, 3, 2, 16), float("nan"))), ValueError, "NaN"),
        (lambda: LLM(model).add_prefilled_request([4, 5, 6], SamplingParams.greedy(4), 1,
                                                  torch.zeros(2, 2, 3, 2, 16).to("meta")), ValueError, "kv"),
        (lambda: run_fresh({**COLD_SPEC, "prompt": [1] * 100_000}, 120), ValueError, "refused its spec"),
        (lambda: distill_bench.Sizes(None, 1, 8, 4, (2,), 5, 1), ValueError, "timed_prompts"),
        (lambda: PromptLookupProposer(2, 2**40, "cpu"), ValueError, "vocab_size"),
        (lambda: check_generator(torch.Generator(), "zzz"), ValueError, "device"),
        (lambda: build_cpp_decoder(model, [torch.zeros(1, 2, 8, 16)] * 2, []), ValueError, "k and v"),
        (lambda: ops.kv_cache_write(*[torch.zeros(1, 2, 16) for _ in range(2)],
                                    *[torch.zeros(2, 4, 2, 16) for _ in range(2)], t([0]), check_slots="no"),
         TypeError, "check_slots"),
        (lambda: copy_bandwidth(-1, 1, 1), ValueError, "num_bytes"),
    )
    for call, error, message in rows:
        with pytest.raises(error, match=message):
            call()
    engine = LLM(model, config=EngineConfig(num_blocks=16, block_size=4))
    other = LLM(model, config=EngineConfig(num_blocks=16, block_size=4))
    for e in (engine, other):
        e.add_request([1, 2, 3], SamplingParams.greedy(4))
    out = engine.scheduler.schedule()
    for sampled, error, message in (([2.7], TypeError, r"sampled\[0\]"), (["3"], TypeError, r"sampled\[0\]"),
                                    ([True], TypeError, r"sampled\[0\]"), ([CFG.vocab_size], ValueError, "vocabulary"),
                                    ([-1], ValueError, "vocabulary")):
        with pytest.raises(error, match=message):
            engine.scheduler.update(out, sampled, 0.0)
    with pytest.raises(ValueError, match="another scheduler's"):  # a refused update left out claimable; this is not
        engine.scheduler.update(other.scheduler.schedule(), [3], 0.0)
    engine.scheduler.update(out, [np.int64(3)], 0.0)  # a numpy int id is the id it holds
    with pytest.raises(ValueError, match="already updated"):
        engine.scheduler.update(out, [3], 0.0)
    assert PromptLookupProposer(2, 32, "cpu").propose([1, 2, np.int64(3), 1, 2], 2, state) == ([3, 1], None)
    folder = Path(tempfile.mkdtemp(prefix="minillm-lock-"))
    with build_lock(folder), build_lock(folder):  # nested in one thread: goes straight in, no wait for itself
        pass


def test_a_fourteenth_hostile_runs_finds_are_refused_and_an_aborted_entry_is_skipped():
    """Run 37's finds: fused-step caches that share memory, a copy or swap-in onto a block two sequences read,
    non-int values in a batch's lists, a token where an entry does not sample (or none where it does), a verify
    entry without a known token, tokenizers that encode to no list or decode to no bytes, and fields reassigned
    after their checks. A request aborted between schedule() and update() is skipped by the update."""
    import dataclasses

    from minillm.compile.fused_step import build_cpp_decoder
    from minillm.core.detokenize import IncrementalText
    from minillm.engine.config import EngineConfig
    from minillm.engine.llm import LLM
    from minillm.engine.request import Request
    from minillm.engine.scheduler import ScheduledRequest
    from minillm.engine.step import StepInput
    from minillm.paged.paged_cache import PagedBatch
    from minillm.speculative.engine import VerifyEntry

    t = torch.tensor
    model = GPT(CFG).eval()
    k = [torch.zeros(1, 2, 8, 16) for _ in range(2)]
    v = [torch.zeros(1, 2, 8, 16) for _ in range(2)]
    shared = dict(token_ids=[5, 6], positions=[3, 3], slot_mapping=[7, 11], block_tables=[[0, 1], [0, 2]],
                  context_lens=[4, 4], query_lens=[1, 1], sample_rows=[0, 1])
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams.greedy(4))

    class EncodesToInt:
        def decode(self, ids):
            return "x"

        def encode(self, text):
            return 5

    class BytesAsStr:
        def decode_single_token_bytes(self, token):
            return "a"

    batch = PagedBatch(t([0]), t([[0]]), t([1]), t([1]))
    entry = ScheduledRequest(request, 1, 0)
    rows = (
        (lambda: build_cpp_decoder(model, k, k), ValueError, r"k\[\d\] and v\[\d\] share memory"),
        (lambda: build_cpp_decoder(model, [k[0], k[0]], v), ValueError, r"k\[0\] and k\[1\] share memory"),
        (lambda: StepInput(**shared).check(CFG, 8, 4), None, None),  # two sequences share block 0: fine to read
        (lambda: StepInput(**{**shared, "cow_pairs": [(3, 0)]}).check(CFG, 8, 4), ValueError, "cow_pairs writes"),
        (lambda: StepInput(**{**shared, "swap_in": [("a", [0])]}).check(CFG, 8, 4), ValueError, "swap_in writes"),
        (lambda: PagedBatch.from_lists([0], [[0]], [1.5], [1]), TypeError, r"context_lens\[0\]"),
        (lambda: PagedBatch.from_lists([True], [[0]], [1], [1]), TypeError, r"slot_mapping\[0\]"),
        (lambda: PagedBatch.from_lists([], [], [], []), ValueError, "block_tables"),
        (lambda: VerifyEntry(request, 2, 4, [1, 2]), ValueError, "at least one known token"),
        (lambda: LLM(model, tokenizer=EncodesToInt()).generate(["hello"]), TypeError, "list of token ids"),
        (lambda: IncrementalText(BytesAsStr()).append(1), TypeError, "must return bytes"),
        (lambda: setattr(batch, "slot_mapping", t([[0]])), dataclasses.FrozenInstanceError, "slot_mapping"),
        (lambda: setattr(entry, "start", 9), dataclasses.FrozenInstanceError, "start"),
        # the host copies of the lengths are tuples: they cannot drift from the checked tensors in place
        (lambda: operator.setitem(batch.context_lens_list, 0, 9), TypeError, "does not support item assignment"),
    )
    for call, error, message in rows:
        if error is None:
            call()
            continue
        with pytest.raises(error, match=message):
            call()
    engine = LLM(model, config=EngineConfig(num_blocks=16, block_size=4, max_num_batched_tokens=4, max_num_seqs=4))
    long_id = engine.add_request(list(range(1, 10)), SamplingParams.greedy(2))  # 9 tokens: chunks of 4, 4, 1
    out = engine.scheduler.schedule()
    with pytest.raises(ValueError, match="does not sample"):
        engine.scheduler.update(out, [3], 0.0)
    engine.scheduler.update(out, [None], 0.0)
    out = engine.scheduler.schedule()
    engine.scheduler.abort(long_id)
    assert engine.scheduler.update(out, [None], 0.0) == []  # the aborted entry is skipped, nothing else changes
    engine.scheduler.check_invariants()
    short_id = engine.add_request([1, 2, 3], SamplingParams.greedy(2))
    out = engine.scheduler.schedule()
    with pytest.raises(ValueError, match="its next token is due"):
        engine.scheduler.update(out, [None], 0.0)
    assert short_id and engine.scheduler.update(out, [7], 0.0) == []


def test_a_fifteenth_hostile_runs_finds_are_refused_and_numpy_bools_are_bools():
    """Run 38's finds: a fused-step cache in the model's own weight memory, a batch list past int64 or on a device
    that cannot hold it, a verify entry whose drafts grew in place, and numpy 2's bool (named `bool`) as a flag."""
    import numpy as np

    from minillm.compile.fused_step import build_cpp_decoder
    from minillm.core.config import check_bool
    from minillm.engine.request import Request
    from minillm.paged.paged_cache import PagedBatch
    from minillm.quant.qat import FakeQuantLinear
    from minillm.speculative.engine import VerifyEntry

    model = GPT(CFG).eval()
    in_weights = model.transformer.wpe.weight.data.view(-1)[:256].view(1, 2, 8, 16)
    entry = VerifyEntry(Request("r", [1, 2, 3], SamplingParams.greedy(4)), 2, 2, [4])
    entry.draft_token_ids.append(5)
    rows = (
        (lambda: build_cpp_decoder(model, [in_weights, torch.zeros(1, 2, 8, 16)],
                                   [torch.zeros(1, 2, 8, 16) for _ in range(2)]), ValueError, "transformer.wpe"),
        (lambda: PagedBatch.from_lists([2**70], [[0]], [1], [1]), ValueError, "outside int64"),
        (lambda: PagedBatch.from_lists([0], [[0]], [1], [1], device="zzz"), ValueError, "device"),
        (entry.fed_tokens, ValueError, "changed in place"),
    )
    for call, error, message in rows:
        with pytest.raises(error, match=message):
            call()
    assert check_bool("flag", np.True_) is True and check_bool("flag", np.False_) is False
    assert FakeQuantLinear(16, 8, bias=np.False_).bias is None


def test_a_sixteenth_hostile_runs_finds_are_refused_and_an_empty_update_takes_nothing():
    """Run 39's finds: a context past what its table holds (before the block count overflows), a device minillm
    does not run on, a verify entry's drafts cleared or given bad ids in place, an empty update taking the claim
    of the step in flight, and chapter 09's flags as numpy bools."""
    import numpy as np

    from minillm.engine.config import EngineConfig
    from minillm.engine.llm import LLM
    from minillm.engine.request import Request
    from minillm.engine.scheduler import SchedulerOutput
    from minillm.paged.paged_cache import PagedBatch, PagedKVCache
    from minillm.quant.quantize import quantize
    from minillm.speculative.engine import VerifyEntry

    cleared = VerifyEntry(Request("r", [1, 2, 3], SamplingParams.greedy(4)), 2, 2, [4])
    cleared.draft_token_ids.clear()
    bad_id = VerifyEntry(Request("r", [1, 2, 3], SamplingParams.greedy(4)), 2, 2, [4])
    bad_id.draft_token_ids[0] = -3
    rows = (
        (lambda: PagedKVCache(CFG, 8, 4).set_batch(PagedBatch.from_lists([0], [[0]], [2**63 - 1], [1])), ValueError,
         r"context_lens\[0\]"),
        (lambda: PagedBatch.from_lists([0], [[0]], [1], [1], device="mps"), ValueError, "device"),
        (cleared.fed_tokens, ValueError, "changed in place"),
        (bad_id.fed_tokens, ValueError, "changed in place"),
    )
    for call, error, message in rows:
        with pytest.raises(error, match=message):
            call()
    engine = LLM(GPT(CFG).eval(), config=EngineConfig(num_blocks=16, block_size=4))
    engine.add_request([1, 2, 3], SamplingParams.greedy(2))
    out = engine.scheduler.schedule()
    assert engine.scheduler.update(SchedulerOutput(), [], 0.0) == []  # takes nothing: the step keeps its claim
    assert engine.scheduler.update(out, [5], 0.0) == []
    assert quantize(torch.randn(4, 8), bits=8, symmetric=np.True_).bits == 8


def test_a_seventeenth_hostile_runs_finds_are_refused_by_name():
    """Run 40's finds: a verify entry's drafts edited or grown in place (with valid ids too: a grown list once
    dropped a known token silently), a prompt-lookup drafter on a device minillm does not run on, and swaps naming
    blocks outside the pool (a failed swap-in once lost the host copy)."""
    from minillm.engine.request import Request
    from minillm.engine.swap import SwapSpace
    from minillm.paged.paged_cache import PagedKVCache
    from minillm.speculative.engine import SpeculativeConfig, SpeculativeLLM, VerifyEntry
    from minillm.speculative.generate import PromptLookupProposer

    def entry(n_known: int) -> VerifyEntry:  # feeds the last n_known of [1, 2, 3, 4], then draft 7
        return VerifyEntry(Request("r", [1, 2, 3, 4], SamplingParams.greedy(4)), n_known + 1, 4 - n_known, [7])

    grown, edited = entry(2), entry(1)
    assert grown.fed_tokens() == [3, 4, 7] and edited.fed_tokens() == [4, 7]
    grown.draft_token_ids.append(9)
    edited.draft_token_ids[0] = 10**6
    swap = SwapSpace(PagedKVCache(CFG, 4, 4))
    swap.swap_out("a", [1])
    rows = (
        (grown.fed_tokens, ValueError, r"changed in place .* built with \[7\], it now holds \[7, 9\]"),
        (edited.fed_tokens, ValueError, "changed in place"),
        (lambda: PromptLookupProposer(1, CFG.vocab_size, "mps"), ValueError, "device"),
        (lambda: SwapSpace(PagedKVCache(CFG, 4, 4)).swap_out("b", [9]), ValueError, r"outside the pool \[0, 4\)"),
        (lambda: SwapSpace(PagedKVCache(CFG, 4, 4)).swap_out("b", [1.5]), TypeError, r"block_table\[0\]"),
        (lambda: swap.swap_in("a", [7]), ValueError, "outside the pool"),
        (lambda: SwapSpace(PagedKVCache(CFG, 4, 4)).swap_in("a", [2, 2]), ValueError, "no KV under that key"),
    )
    for call, error, message in rows:
        with pytest.raises(error, match=message):
            call()
    two = SwapSpace(PagedKVCache(CFG, 4, 4))
    two.swap_out("b", [0, 1])
    with pytest.raises(ValueError, match=r"names blocks \[3\] twice"):  # run 41: one saved block was lost
        two.swap_in("b", [3, 3])
    two.swap_in("b", [2, 3])  # the refused swap-in kept the host copy
    swap.swap_in("a", [2])  # the refused swap-in kept the host copy

    llm = SpeculativeLLM(tiny(), speculative=SpeculativeConfig(method="prompt-lookup", gamma=3, ngram=1))
    schedule = llm.scheduler.schedule

    def schedule_then_edit():  # a caller editing the scheduled drafts between schedule and the forward
        out = schedule()
        for e in out.scheduled:
            if isinstance(e, VerifyEntry) and e.draft_token_ids:
                e.draft_token_ids[0] = CFG.vocab_size
        return out

    llm.scheduler.schedule = schedule_then_edit
    with pytest.raises(ValueError, match="changed in place"):
        llm.generate([[1, 2, 1, 2, 1, 2]], SamplingParams.greedy(8))


@pytest.mark.parametrize("tokens", [None, "zzz", [-1], [2**40], [True], [1.5], [CFG.vocab_size], torch.zeros(2)])
def test_a_bad_sampled_token_fails_its_request_alone_naming_it(tokens):
    """`accept_or_fail` turns a sampled token that is no id of the model's vocabulary into this request's failure
    (finish_reason "error", the message naming the token), never an id appended as another (1.5 and True were read
    as 1, -1 and ids past the vocabulary were kept)."""
    from minillm.core.stopping import start_request

    state = start_request(CFG, [1, 2, 3], SamplingParams.greedy(4))
    assert state.accept_or_fail(tokens, "request 'r0'") is True
    assert state.finish_reason == "error" and state.output_ids == []
    assert state.error.startswith("request 'r0' failed in its stop check: ")
    named = r"tokens must be a list|is no token id: an int \(Python or numpy\) in the vocabulary \[0, 128\)"
    assert re.search(named, state.error)
    good = start_request(CFG, [1, 2, 3], SamplingParams.greedy(4))
    assert good.accept_or_fail([5], "request 'r1'") is False and good.output_ids == [5]
