"""Reliability: bad inputs give errors that say what failed, interrupted saves resume exactly, NaN never trains.

One test per fixed failure: each of these once crashed with an unhelpful error, returned a silently wrong result, or
(checkpoints) resumed a torn run. Files go to `tmp_path`; the interrupt test kills a forked child in every stage of a
save and checks that resuming gives `torch.equal` weights to a run that was never interrupted.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal

import pytest
import torch

from minillm.core.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_checkpoint, read_config, save_checkpoint
from minillm.core.config import GPTConfig
from minillm.core.hf import to_hf_state_dict
from minillm.core.model import GPT
from minillm.gpt import train as train_module
from minillm.gpt.train import NonFiniteTrainingError, TrainConfig, train
from minillm.gpt.train_state import OPTIMIZER_NAME, find_checkpoint
from minillm.tokenizer import Tokenizer, load_tokenizer
from minillm.tokenizer.encode import encode_chunk, encode_chunk_fast

BASE_RANKS = {bytes([i]): i for i in range(256)}
# device="cpu": the kill test forks, and a forked child cannot use CUDA; resuming is not about the device.
TINY = dict(preset="tiny", model_overrides=dict(block_size=32), batch_size=4, eval_interval=0, eval_windows=8,
            final_eval_tokens=0, device="cpu")


def _byte_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of a source file as token ids (< 256 < tiny's 512): real, repetitive text without a tokenizer."""
    import minillm.core.model as m

    data = torch.tensor(list(open(m.__file__, "rb").read()), dtype=torch.int64)
    return data[:-2000], data[-2000:]


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    return load_tokenizer()


# ---- tokenizer: quadratic encode -------------------------------------------------------------------------------

class CountingRanks(dict):
    """A rank table that counts its lookups: the work of an encoder, measured without a clock."""

    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)

    def __getitem__(self, key):
        self.lookups += 1
        return super().__getitem__(key)


def test_fast_encoder_does_linear_lookups_on_one_long_run(shipped):
    """One 16k-letter chunk: the simple encoder rescans every pair after every merge (~n^2/2 lookups at n bytes);
    the heap encoder looks up each initial pair once and at most two new pairs per merge (<= 4n)."""
    fast = CountingRanks(shipped.mergeable_ranks)
    piece = ("the" * 5333).encode()
    ids = encode_chunk_fast(piece, fast)
    assert fast.lookups <= 4 * len(piece)
    simple = CountingRanks(shipped.mergeable_ranks)
    short = piece[:1200]
    assert encode_chunk(short, simple) == encode_chunk_fast(short, shipped.mergeable_ranks)
    assert simple.lookups > 50 * len(short)  # quadratic: already 50x more lookups per byte at 1,200 bytes
    assert shipped.encode("the" * 5333) == ids == shipped.to_tiktoken().encode_ordinary("the" * 5333)


def test_encode_throughput_reports_both_inputs(shipped):
    from minillm.tokenizer.bench import encode_throughput

    r = encode_throughput(shipped, ordinary_bytes=5_000, adversarial_chars=3_000, reference_chars=300, repeats=1)
    assert r.identical_ids and r.ordinary_MBps > 0 and r.adversarial_MBps > 0 and r.reference_MBps > 0


# ---- tokenizer: bad inputs ---------------------------------------------------------------------------------------

def test_decode_unknown_id_from_a_generator_names_the_id(shipped):
    with pytest.raises(ValueError, match="unknown token id 99999 at position 1"):  # was a bare KeyError
        shipped.decode(i for i in [10, 99999])


@pytest.mark.parametrize("bad", [1.0, True, 2.5])
def test_decode_rejects_float_and_bool_ids(shipped, bad):
    with pytest.raises(TypeError, match="must be an int"):  # 1.0 and True used to decode as byte 1
        shipped.decode([bad])
    with pytest.raises(TypeError, match="must be an int"):
        shipped.decode_bytes([65, bad])


def test_decode_still_accepts_numpy_ints(shipped):
    np = pytest.importorskip("numpy")
    assert shipped.decode([np.int64(104), np.int32(105)]) == "hi"


def test_split_pattern_that_skips_text_raises_instead_of_dropping_it():
    tok = Tokenizer(BASE_RANKS, r"\w+")
    with pytest.raises(ValueError, match="does not match the text ' ' at character 2"):
        tok.encode("ab cd")  # used to return the ids of "abcd"
    with pytest.raises(ValueError, match="'!!' at character 0"):
        tok.encode_ordinary("!!x")
    assert tok.decode(tok.encode("abcd")) == "abcd"  # text the pattern covers still encodes


def test_special_token_id_far_past_the_ranks_is_rejected():
    with pytest.raises(ValueError, match="special ids must follow the 256 mergeable ranks.*at most 1280"):
        Tokenizer(BASE_RANKS, "gpt2", {"<|endoftext|>": 10**9})  # used to make vocab_size 1,000,000,001
    # tiktoken's own encodings: right after the ranks (GPT-2), or with a few reserved ids unused (cl100k_base)
    assert Tokenizer(BASE_RANKS, "gpt2", {"<|endoftext|>": 256}).vocab_size == 257
    assert Tokenizer(BASE_RANKS, "gpt2", {"<|a|>": 256, "<|b|>": 275}).vocab_size == 276


def test_truncated_tokenizer_files_name_the_file(tmp_path, shipped):
    path = shipped.save(tmp_path / "tok.json")
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ValueError, match="tok.json"):
        Tokenizer.load(path)
    ranks = shipped.save(tmp_path / "tok.tiktoken")
    ranks.write_bytes(ranks.read_bytes()[:-7])  # cut inside the last line
    with pytest.raises(ValueError, match="tok.tiktoken"):
        Tokenizer.load(ranks, pattern="gpt4")


def test_tokenizer_train_rejects_a_directory_out_before_training(tmp_path, monkeypatch, capsys):
    from minillm.course.cli import main
    from minillm.tokenizer import commands

    def must_not_run(*args, **kwargs):
        raise AssertionError("training started although --out cannot be written")

    monkeypatch.setattr(commands, "build_default_tokenizer", must_not_run)
    assert main(["tokenizer", "train", "--vocab-size", "300", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["tokenizer", "train", "--vocab-size", "300", "--out", str(tmp_path / "tok.txt")]) == 2
    assert ".json" in capsys.readouterr().err


# ---- checkpoints and Hugging Face directories: corrupt files --------------------------------------------------

def _tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny"))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_checkpoint_weights_name_the_file(tmp_path, damage):
    save_checkpoint(_tiny_model(), tmp_path)
    weights = tmp_path / WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00" * 64)
    with pytest.raises(ValueError, match="model.safetensors.*not a valid safetensors file"):
        load_checkpoint(tmp_path)


def test_truncated_checkpoint_config_names_the_file(tmp_path):
    save_checkpoint(_tiny_model(), tmp_path)
    cfg = tmp_path / CONFIG_NAME
    cfg.write_text(cfg.read_text()[:40])
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        read_config(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path)


def test_checkpoint_config_with_nan_epsilon_is_rejected(tmp_path):
    save_checkpoint(_tiny_model(), tmp_path)
    doc = json.loads((tmp_path / CONFIG_NAME).read_text())
    doc["config"]["layer_norm_epsilon"] = float("nan")  # json writes NaN, which json.loads reads back
    (tmp_path / CONFIG_NAME).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="config.json.*layer_norm_epsilon"):
        read_config(tmp_path)


def _hf_dir(tmp_path):
    from safetensors.torch import save_file

    model = _tiny_model()
    c = model.config
    save_file(to_hf_state_dict(model), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="gpt2", vocab_size=c.vocab_size,
                                                          n_positions=c.block_size, n_layer=c.n_layer,
                                                          n_head=c.n_head, n_embd=c.n_embd)))
    return tmp_path


def test_corrupt_hugging_face_directory_names_the_file(tmp_path):
    d = _hf_dir(tmp_path)
    assert GPT.from_hf(d).config.n_layer == 2  # intact, it loads
    weights = d / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) - 100])
    with pytest.raises(ValueError, match="model.safetensors.*not a valid safetensors file"):
        GPT.from_hf(d)
    weights.write_bytes(good)
    (d / "config.json").write_text('{"model_type": "gpt2", "n_emb')
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        GPT.from_hf(d)


# ---- configs: NaN, inf, negative ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("layer_norm_epsilon", math.nan), ("layer_norm_epsilon", math.inf), ("layer_norm_epsilon", -1e-5),
    ("layer_norm_epsilon", 0.0), ("dropout", math.nan), ("dropout", -math.inf), ("dropout", -0.1),
])
def test_gpt_config_rejects_non_finite_and_out_of_range_floats(field, value):
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("weight_decay", math.nan), ("weight_decay", math.inf), ("weight_decay", -0.1), ("lr", math.nan),
    ("lr", math.inf), ("grad_clip", math.nan), ("grad_clip", math.inf), ("min_lr_ratio", math.nan),
    ("beta1", math.nan), ("beta2", math.inf), ("dropout", math.nan), ("max_minutes", math.inf),
    ("max_minutes", math.nan),
])
def test_train_config_rejects_non_finite_floats(field, value):
    with pytest.raises(ValueError, match=f"TrainConfig.{field}"):
        TrainConfig(**{field: value})


# ---- training: NaN stops the run, nothing is exported -----------------------------------------------------------

def test_training_that_diverges_stops_at_the_step_and_exports_nothing(tmp_path):
    tr, va = _byte_tokens()
    cfg = TrainConfig(**TINY, steps=4, warmup_steps=1, lr=1e30, grad_clip=0.0, export_dir=str(tmp_path / "export"),
                      out_dir=str(tmp_path / "run"))
    with pytest.raises(NonFiniteTrainingError, match=r"training stopped at step \d: (the loss|parameter)"):
        train(cfg, tr, va, progress=False)
    assert not (tmp_path / "export").exists()  # used to export a NaN model
    assert not list(tmp_path.glob("run/ckpt-*"))  # and saved no checkpoint of the diverged weights


def test_train_cli_rejects_nan_weight_decay(capsys):
    from minillm.course.cli import main

    assert main(["train", "--preset", "tiny", "--weight-decay", "nan", "--steps", "2", "--warmup-steps", "1",
                 "--no-progress"]) == 2  # used to exit 0 with a NaN model
    assert "TrainConfig.weight_decay must be a finite number" in capsys.readouterr().err


# ---- training checkpoints: one atomic unit, exact resume after any interrupt -------------------------------------

STAGES = ("started", "model", "optimizer", "train_state", "manifest", "renamed", "cleaned")
COMMITTED = STAGES.index("renamed")  # from this stage on, the new checkpoint exists


def _run_killed_at(run_dir, stage: str, kw: dict, tr, va) -> int:
    """Resume `run_dir` to step 4 in a forked child that SIGKILLs itself right after `stage` of the step-4 save."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest teardown, no finally blocks run after the kill, like a real SIGKILL
        try:
            torch.set_num_threads(1)
            save = train_module.save_train_state

            def on_write(s: str) -> None:
                if s == stage:
                    os.kill(os.getpid(), signal.SIGKILL)

            train_module.save_train_state = lambda *a, **k: save(*a, on_write=on_write, **k)
            train(TrainConfig(**kw, out_dir=str(run_dir), resume=str(run_dir), stop_after=4), tr, va, progress=False)
        finally:
            os._exit(3)  # reached only if the kill never happened
    _, status = os.waitpid(pid, 0)
    return status


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork to kill a save from outside")
def test_save_killed_at_every_stage_resumes_bit_exact(tmp_path):
    tr, va = _byte_tokens()
    kw = dict(TINY, steps=6, warmup_steps=1, dropout=0.1)  # dropout: the RNG state must resume exactly too
    straight = train(TrainConfig(**kw), tr, va, progress=False).model.state_dict()
    base = tmp_path / "base"
    train(TrainConfig(**kw, out_dir=str(base), stop_after=2), tr, va, progress=False)
    for k, stage in enumerate(STAGES):
        run = tmp_path / f"killed-after-{stage}"
        shutil.copytree(base, run)
        status = _run_killed_at(run, stage, kw, tr, va)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (stage, status)
        point = find_checkpoint(run)
        assert point.step == (4 if k >= COMMITTED else 2), stage  # the step-2 checkpoint survives until then
        result = train(TrainConfig(**kw, out_dir=str(run), resume=str(run)), tr, va, progress=False)
        assert result.step == 6 and result.log["resumed_from"]["step"] == point.step
        for name, value in result.model.state_dict().items():
            assert torch.equal(value, straight[name]), (stage, name)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """SIGINT (KeyboardInterrupt) half-way through a save: the old checkpoint stays, the new one never appears."""
    tr, va = _byte_tokens()
    kw = dict(TINY, steps=6, warmup_steps=1)
    run = tmp_path / "run"
    train(TrainConfig(**kw, out_dir=str(run), stop_after=2), tr, va, progress=False)
    save = train_module.save_train_state

    def on_write(stage: str) -> None:
        if stage == "optimizer":
            raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_train_state", lambda *a, **k: save(*a, on_write=on_write, **k))
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(**kw, out_dir=str(run), resume=str(run), stop_after=4), tr, va, progress=False)
    assert find_checkpoint(run).step == 2


def test_resume_skips_a_damaged_newest_checkpoint_and_says_so(tmp_path):
    tr, va = _byte_tokens()
    kw = dict(TINY, steps=6, warmup_steps=1)
    run = tmp_path / "run"
    train(TrainConfig(**kw, out_dir=str(run), stop_after=2), tr, va, progress=False)
    older = find_checkpoint(run).path
    keep = tmp_path / "keep"
    shutil.copytree(older, keep)
    train(TrainConfig(**kw, out_dir=str(run), resume=str(run), stop_after=4), tr, va, progress=False)
    newest = find_checkpoint(run)
    assert newest.step == 4 and not older.exists()  # the older one is deleted once the new one is complete
    shutil.copytree(keep, older)  # as if the cleanup had been interrupted
    opt = newest.path / OPTIMIZER_NAME
    opt.write_bytes(opt.read_bytes()[:-10])
    point = find_checkpoint(run)
    assert point.step == 2 and point.path == older
    assert "optimizer.safetensors does not match its sha256" in point.skipped[0]
    assert "skipped 1 newer incomplete" in point.describe()


def test_train_cli_resume_says_where_it_resumed(tmp_path, capsys):
    from minillm.course.cli import main
    from minillm.tokenizer import train_bpe

    import minillm.core.model as m

    text = open(m.__file__, encoding="utf-8").read()
    (tmp_path / "corpus.txt").write_text(text * 2, encoding="utf-8")
    train_bpe(text[:8000], 300).to_tokenizer().save(tmp_path / "tok.json")
    args = ["train", "--preset", "tiny", "--corpus", str(tmp_path / "corpus.txt"), "--tokenizer",
            str(tmp_path / "tok.json"), "--steps", "4", "--warmup-steps", "1", "--batch-size", "2",
            "--eval-interval", "0", "--final-eval-tokens", "0", "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(args + ["--stop-after", "2"]) == 0
    assert main(args + ["--resume", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "(step 2)" in out
    assert find_checkpoint(tmp_path / "run").step == 4
    assert main(["train", "--preset", "tiny", "--resume", str(tmp_path / "empty"), "--no-progress"]) == 2
    assert "resume directory not found" in capsys.readouterr().err
