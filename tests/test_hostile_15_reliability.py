"""Hostile run 15's reliability findings, fixed by class: every bad input or misuse is a clear Python exception
naming the argument (or the file), never a silent wrong answer or an error from deep inside a step.

- C15: an AOT package (`minillm.compile.aot`) whose digest member is there but incomplete passed for a package that
  records no digest, so edited weights loaded unchecked; an empty zip and a member prepended in front of the
  package's folder read as "records none" too.
- B15: `register_shipped_step_model` took a non-callable factory (it replaced the shipped one and failed at the
  next `step_model`) and an unhashable name ("unhashable type", naming nothing).
- E15: two threads calling `generate()` on one engine (`LLM`, `SpeculativeLLM`) failed in the middle of a step (a
  q-shape ValueError in the paged cache, a bare AssertionError) and lost that thread's requests.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from helpers import assert_refused_by_minillm, context_model  # noqa: E402
from minillm import GPTConfig  # noqa: E402
from minillm.compile.cpu_gemv import build_problem  # noqa: E402
from minillm.core.io import with_sha256  # noqa: E402
from minillm.core.sampling import SamplingParams  # noqa: E402
from minillm.engine import LLM, EngineConfig  # noqa: E402
from minillm.speculative.engine import SpeculativeLLM  # noqa: E402

TINY = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)


# ----------------------------------------------------------------------------------------------------- C15: AOT

def _write_package(path: Path, members: dict[str, bytes], digest: bytes | dict | None = "exported",
                   first: tuple[str, bytes] | None = None) -> Path:
    """A zip laid out as `export_decode_step` lays out a package ("step/..." members, then the digest member),
    with the digest as the export computes it ("exported"), the given bytes or object instead, or none (None);
    `first`: a member written in front of everything else. Enough for `check_package`, which needs no library."""
    from minillm.compile.aot import DIGEST_NAME, FORMAT, _package_members

    if digest == "exported":  # over `members` only: a `first` member is an edit made after the export
        with zipfile.ZipFile(io.BytesIO(), "w") as z:
            for name, data in members.items():
                z.writestr(name, data)
            digest = with_sha256({"minillm_format": FORMAT}, _package_members(z, path, skip=None))
    with zipfile.ZipFile(path, "w") as z:
        if first is not None:
            z.writestr(*first)
        for name, data in members.items():
            z.writestr(name, data)
        if digest is not None:
            z.writestr("step/" + DIGEST_NAME, digest if isinstance(digest, bytes) else json.dumps(digest))
    return path


MEMBERS = {"step/data/weights.bin": bytes(range(64)), "step/archive/constants.bin": b"\x01\x02\x03"}


def test_c15_an_aot_digest_member_that_is_there_must_be_complete(tmp_path):
    """Before: a digest member `{}` (or without "sha256") made `check_package` answer False, as for a package
    exported before digests were recorded, and `AOTDecoder` loaded the package's edited weights and decoded other
    tokens without a word. "Records no digest" means no digest member at all; one that is there without a valid
    sha256 or format is a ValueError naming the file and the field, on check and on load (before the library)."""
    from minillm.compile.aot import FORMAT, AOTDecoder, check_package

    assert check_package(_write_package(tmp_path / "good.pt2", MEMBERS)) is True
    edited = {**MEMBERS, "step/data/weights.bin": bytes(reversed(range(64)))}
    sha = "0" * 64
    for name, digest, field in (("empty", {}, "sha256"), ("format-only", {"minillm_format": FORMAT}, "sha256"),
                                ("sha-null", {"minillm_format": FORMAT, "sha256": None}, "sha256"),
                                ("sha-int", {"minillm_format": FORMAT, "sha256": 5}, "sha256"),
                                ("sha-short", {"minillm_format": FORMAT, "sha256": "abc"}, "sha256"),
                                ("no-format", {"sha256": sha}, "minillm_format"),
                                ("other-format", {"minillm_format": "x", "sha256": sha}, "minillm_format")):
        path = _write_package(tmp_path / f"{name}.pt2", edited, digest)
        for call in (lambda: check_package(path), lambda: AOTDecoder(path)):
            assert_refused_by_minillm(call, ValueError, rf"{name}\.pt2': its 'step/minillm_sha256\.json' has no "
                                                        rf"valid '{field}' field")
    for name, raw in (("list", b"[1, 2]"), ("extra-int", json.dumps({"minillm_format": FORMAT, "sha256": sha,
                                                                     "n": 3}).encode())):
        path = _write_package(tmp_path / f"{name}.pt2", edited, raw)
        assert_refused_by_minillm(lambda: check_package(path), ValueError, rf"{name}\.pt2': its 'step/minillm_sha256"
                                                                           r"\.json' (is not the digest|field 'n')")
    path = _write_package(tmp_path / "unreadable.pt2", edited, b"{")
    assert_refused_by_minillm(lambda: check_package(path), ValueError, "cannot be read .*: a damaged package")
    # A package with no digest member at all is still the legacy case the docstring promises: False, it loads.
    assert check_package(_write_package(tmp_path / "legacy.pt2", edited, None)) is False


def test_c15_check_package_refuses_an_empty_zip_and_finds_a_digest_behind_a_prepended_member(tmp_path):
    """Before: an empty zip was "a package that records none" (False), and a member written in front of the
    package's folder hid the digest (looked up in the first member's folder): False, checking nothing. Now an
    empty zip is not a .pt2 package (as the loader would refuse it, but naming the file); the digest is found by
    name, so the prepended member, which it does not cover, fails it; two digest members are refused."""
    from minillm.compile.aot import AOTDecoder, check_package

    empty = tmp_path / "empty.pt2"
    zipfile.ZipFile(empty, "w").close()
    for call in (lambda: check_package(empty), lambda: AOTDecoder(empty)):
        assert_refused_by_minillm(call, ValueError, r"empty\.pt2' is not a \.pt2 package \(an empty zip archive\)")
    prepended = _write_package(tmp_path / "prepended.pt2", MEMBERS, first=("zzz/readme.txt", b"hi"))
    for call in (lambda: check_package(prepended), lambda: AOTDecoder(prepended)):
        assert_refused_by_minillm(call, ValueError, r"prepended\.pt2': the content does not match the sha256")
    two = _write_package(tmp_path / "two.pt2", MEMBERS, first=("zzz/minillm_sha256.json", b"{}"))
    assert_refused_by_minillm(lambda: check_package(two), ValueError, r"two\.pt2' holds 2 digest members")
    # the digest found by name, wherever the package's folder is: an intact package still checks out
    assert check_package(_write_package(tmp_path / "good.pt2", MEMBERS)) is True


@pytest.mark.slow
def test_c15_an_exported_package_with_its_digest_emptied_and_a_weight_edited_is_refused(tmp_path):
    """The finding end to end, on a real export: the package's stored weight edited and its digest member
    replaced by `{}` loaded and decoded the edited model before; now it is a ValueError naming the field. The
    export itself still decodes chapter 04's greedy tokens."""
    from minillm.compile.aot import DIGEST_NAME, AOTDecoder, aot_problem, check_package, export_decode_step
    from minillm.kvcache.generate import generate_ids

    if aot_problem() is not None:
        pytest.skip(f"AOTInductor cannot build here: {aot_problem()}")
    model = context_model(TINY, seed=0)
    package = export_decode_step(model, tmp_path / "step.pt2", max_len=16)
    params = SamplingParams.greedy(6, ignore_eos=True)
    assert check_package(package) is True
    assert AOTDecoder(package).generate_ids([5, 6, 7], params) == generate_ids(model, [5, 6, 7], params)
    weight = model.transformer.h[0].mlp.c_fc.weight.detach()[0, :4].numpy().tobytes()
    flipped = weight[:3] + bytes([weight[3] ^ 0x80])  # one weight's sign
    assert weight in package.read_bytes()  # stored uncompressed
    edited = tmp_path / "edited.pt2"
    with zipfile.ZipFile(package) as zin, zipfile.ZipFile(edited, "w") as zout:
        for info in zin.infolist():
            data = b"{}" if info.filename.endswith("/" + DIGEST_NAME) else zin.read(info.filename)
            zout.writestr(info, data.replace(weight, flipped))
    for call in (lambda: check_package(edited), lambda: AOTDecoder(edited)):
        assert_refused_by_minillm(call, ValueError, r"edited\.pt2': its '.*minillm_sha256\.json' has no valid "
                                                    r"'sha256' field \(got no such field")


# ----------------------------------------------------------------------------------------------- B15: step models

@pytest.mark.parametrize("name, factory, match", [
    ("fused-cpp", 3, "factory must be callable .* got int"),
    ("fused-cpp", None, "factory must be callable .* got NoneType"),
    (["fused-cpp"], lambda m: m, r"name must be a non-empty str, got \['fused-cpp'\]"),
    ({"fused-cpp": 1}, lambda m: m, "name must be a non-empty str"),
    ("", lambda m: m, "name must be a non-empty str, got ''"),
    (3, lambda m: m, "name must be a non-empty str, got 3"),
])
def test_b15_register_shipped_step_model_checks_both_arguments(name, factory, match):
    """Before: a non-callable factory replaced the shipped one (the next `step_model('fused-cpp', m)` failed with
    "'int' object is not callable"), and a list name raised "unhashable type: 'list'". Now the same checks as
    `register_step_model` (one shared function), before the registry is looked at or changed."""
    from minillm.engine import step_models

    before = dict(step_models._FACTORIES)
    assert_refused_by_minillm(lambda: step_models.register_shipped_step_model(name, factory), TypeError, match)
    assert_refused_by_minillm(lambda: step_models.register_step_model(name, factory), TypeError, match)
    assert step_models._FACTORIES == before  # nothing replaced


@pytest.mark.skipif(build_problem() is not None, reason=f"cannot build chapter 13's extension: {build_problem()}")
def test_b15_the_shipped_step_model_survives_a_refused_registration():
    """After the refused calls, the shipped name still wraps a model with the shipped implementation."""
    from minillm.compile.fused_engine import FusedEngineModel
    from minillm.engine.step_models import register_shipped_step_model, step_model

    model = context_model(TINY, seed=0).eval()
    step_model("fused-cpp", model)  # imports and registers the shipped module
    for factory in (3, None):
        with pytest.raises(TypeError, match="factory must be callable"):
            register_shipped_step_model("fused-cpp", factory)
    assert isinstance(step_model("fused-cpp", model), FusedEngineModel)


# -------------------------------------------------------------------------------------------- E15: engine threads

ENGINES = {"LLM": lambda m: LLM(m, None, EngineConfig(num_blocks=64, block_size=4)),
           "SpeculativeLLM": lambda m: SpeculativeLLM(m, None, EngineConfig(num_blocks=64, block_size=4))}
PROMPTS = [list(range(1, 11)), list(range(20, 40)), list(range(50, 61)), list(range(70, 87))]
PARAMS = SamplingParams.greedy(5, ignore_eos=True)
BUSY = "already running generate/step/add_request/abort in another thread: .* build one engine per thread"


def _in_thread(call):
    """Run `call()` in another thread to its end; the exception it raised, or None."""
    raised = []

    def run():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            raised.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    assert not t.is_alive()
    return raised[0] if raised else None


def _tokens(outputs):
    return [o.output_token_ids for o in outputs]


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_e15_an_engine_held_by_one_thread_refuses_every_call_from_another(kind):
    """Deterministic: the test holds the engine (`exclusive`) as a running generate() would. generate, add_request,
    step and abort from another thread are each a ValueError at once, leaving the engine untouched; the holder's
    own generate (nested under the guard, as generate's steps are) gives the undisturbed tokens."""
    model = context_model(TINY, seed=0)
    want = _tokens(ENGINES[kind](model).generate(PROMPTS, PARAMS))
    llm = ENGINES[kind](model)
    with llm.exclusive():
        for call in (lambda: llm.generate(PROMPTS, PARAMS), lambda: llm.add_request([1, 2, 3], PARAMS),
                     lambda: llm.step(), lambda: llm.abort("req-0")):
            exc = _in_thread(call)
            assert isinstance(exc, ValueError) and kind in str(exc), exc
            with pytest.raises(ValueError, match=BUSY):
                raise exc
        assert not llm.has_unfinished() and not llm._requests and llm.num_steps == 0  # nothing was touched
        assert _tokens(llm.generate(PROMPTS, PARAMS)) == want
    assert _in_thread(lambda: llm.generate(PROMPTS, PARAMS)) is None  # released: another thread may use it now


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_e15_a_second_generate_in_the_middle_of_a_step_is_refused_and_the_first_finishes_right(kind):
    """The finding's race made deterministic: the other thread's generate() runs to its end while the first call is
    inside its first step's forward. Before, it stepped the same scheduler (a q-shape ValueError from the paged
    cache, an AssertionError in the speculative sampler) and one thread's requests were lost. Now it is refused
    before it touches anything, and the first call's tokens are those of an engine nobody disturbed."""
    model = context_model(TINY, seed=0)
    want = _tokens(ENGINES[kind](model).generate(PROMPTS, PARAMS))
    llm = ENGINES[kind](model)
    execute, refused = llm.runner.execute, []

    def execute_and_interfere(step):
        if not refused:
            refused.append(_in_thread(lambda: llm.generate(PROMPTS[:2], PARAMS)))
        return execute(step)

    llm.runner.execute = execute_and_interfere
    assert _tokens(llm.generate(PROMPTS, PARAMS)) == want
    assert len(refused) == 1 and isinstance(refused[0], ValueError) and BUSY.split(":")[0] in str(refused[0])
    assert not llm.has_unfinished()  # nothing of the refused call was queued or left behind


def test_e15_every_request_changing_entry_point_of_the_engines_is_guarded():
    """generate, add_request, step and abort (and chapter 07's add_prefilled_request) hold the engine, in every
    engine with chapter 06's front end; a read (has_unfinished, stats) does not."""
    from minillm.disagg.llm import DisaggregatedLLM

    for cls in (LLM, SpeculativeLLM, DisaggregatedLLM):
        for name in ("generate", "add_request", "step", "abort"):
            assert hasattr(getattr(cls, name), "__wrapped__"), (cls.__name__, name)
    assert hasattr(LLM.add_prefilled_request, "__wrapped__")
    assert not hasattr(LLM.has_unfinished, "__wrapped__")
