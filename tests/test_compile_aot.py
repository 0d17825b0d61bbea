"""Chapter 13, ahead of time: the decode step exported (`torch.export`) and packaged by AOTInductor gives chapter 04's
greedy tokens, loads and decodes in a fresh process that never builds a GPT, and refuses bad input. No test here
measures time.

One package is built for the whole file (a module-scoped fixture: export + AOTInductor's C++ build of the SMALL model,
about 10-20 s on one CPU thread); everything else loads it. Skipped, with the reason, where AOTInductor cannot build.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest
import torch

from helpers import context_model
from minillm import GPTConfig
from minillm.compile import aot
from minillm.compile.aot import CHILD_MARK, AOTDecoder, aot_problem, cold_start, export_decode_step
from minillm.core.sampling import SamplingParams
from minillm.kvcache.generate import generate_ids

SMALL = GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=4, n_embd=64)  # test_13_compilation's
PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 42, 7, 9, 11, 300, 12], [64]]
MAX_LEN = 48  # below the window, so the package's own cache length is what a long request runs into

needs_aot = pytest.mark.skipif(aot_problem() is not None, reason=f"AOTInductor cannot build here: {aot_problem()}")


@pytest.fixture(scope="module")
def model():
    return context_model(SMALL, seed=0)


@pytest.fixture(scope="module")
def package(model, tmp_path_factory):
    """The one export of this file: SMALL's decode step with a 48-slot cache."""
    if aot_problem() is not None:
        pytest.skip(f"AOTInductor cannot build here: {aot_problem()}")
    return export_decode_step(model, tmp_path_factory.mktemp("aot") / "step.pt2", max_len=MAX_LEN)


@needs_aot
@pytest.mark.slow
def test_package_gives_the_generators_greedy_tokens(model, package):
    dec = AOTDecoder(package)
    assert dec.config == SMALL and dec.max_len == MAX_LEN
    assert [p.name for p in package.parent.iterdir()] == ["step.pt2"]  # written atomically: no temp file left
    params = SamplingParams.greedy(20, ignore_eos=True)
    for prompt in PROMPTS:  # one package, prompts of three lengths, each request over the previous one's cache
        assert dec.generate_ids(prompt, params) == generate_ids(model, prompt, params)


@needs_aot
@pytest.mark.slow
def test_package_honours_the_request_lifecycle(model, package):
    """Chapter 04's stop rules (eos, max_new_tokens), seeded sampling, and one stream at a time."""
    dec = AOTDecoder(package)
    want = generate_ids(model, PROMPTS[1], SamplingParams.greedy(12, ignore_eos=True))
    eos = want[5]
    assert dec.generate_ids(PROMPTS[1], SamplingParams.greedy(12), eos_id=eos) == want[: want.index(eos) + 1]
    assert dec.generate_ids(PROMPTS[0], SamplingParams.greedy(0)) == []
    seeded = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=50, seed=3)
    assert dec.generate_ids(PROMPTS[0], seeded) == generate_ids(model, PROMPTS[0], seeded)
    first = dec.generate(PROMPTS[0], SamplingParams.greedy(5, ignore_eos=True))
    next(first)
    assert dec.generate_ids(PROMPTS[2], SamplingParams.greedy(5, ignore_eos=True)) == \
        generate_ids(model, PROMPTS[2], SamplingParams.greedy(5, ignore_eos=True))
    with pytest.raises(RuntimeError, match="ended by a later generate"):
        next(first)  # its cache was rewritten by the second request: refused, never wrong tokens


@needs_aot
@pytest.mark.slow
def test_package_decodes_in_a_fresh_process_that_builds_no_model(model, package):
    """The cold-start child (`run_child`, mode "aot") in a new interpreter where constructing a GPT raises."""
    spec = {"mode": "aot", "package": str(package), "prompt": PROMPTS[1], "new_tokens": 12, "threads": 1}
    code = ("import json, sys; import minillm.core.model as m\n"
            "def refuse(*args, **kwargs): raise AssertionError('the AOT path built a GPT')\n"
            "m.GPT.__init__ = refuse\n"
            "from minillm.compile.aot import CHILD_MARK, run_child\n"
            "print(CHILD_MARK + json.dumps(run_child(json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.split(CHILD_MARK)[-1])
    assert result["tokens"] == generate_ids(model, PROMPTS[1], SamplingParams.greedy(12, ignore_eos=True))
    assert len(result["token_times"]) == 12


@needs_aot
@pytest.mark.slow
def test_package_refuses_bad_requests(package):
    dec = AOTDecoder(package)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] = 4096 is outside"):
        dec.generate_ids([1, SMALL.vocab_size], SamplingParams.greedy(3))
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        dec.generate_ids([1, 2], {"max_new_tokens": 3})
    with pytest.raises(ValueError, match=f"max_len={MAX_LEN} is too short"):
        dec.generate_ids(list(range(40)), SamplingParams.greedy(20))
    with pytest.raises(ValueError, match="eos_id=5000"):
        dec.generate_ids([1, 2], SamplingParams.greedy(3), eos_id=5000)
    with pytest.raises(ValueError, match="n=2"):
        dec.generate_ids([1, 2], SamplingParams(max_new_tokens=3, n=2, seed=0))


@needs_aot
@pytest.mark.slow
def test_a_damaged_or_edited_package_is_refused_naming_the_file(model, package, tmp_path):
    """Before: one exponent bit flipped in a stored weight loaded without a word and generated other tokens, where
    every other file minillm saves carries a sha256. Now the package carries one (`DIGEST_NAME`), checked on load: a
    byte flipped in place (caught by the zip's CRC) and a member rewritten with a valid CRC (caught by the sha256)
    are each a ValueError naming the file; the package itself still loads and decodes."""
    weight = model.transformer.h[0].mlp.c_fc.weight.detach()[0, :4].numpy().tobytes()
    flipped_weight = weight[:3] + bytes([weight[3] ^ 0x40])
    raw = bytearray(package.read_bytes())
    at = raw.find(weight)
    assert at >= 0  # the weights are stored uncompressed in the package
    raw[at:at + 4] = flipped_weight
    (tmp_path / "flipped.pt2").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"flipped\.pt2' is a damaged package: member '.*' cannot be read"):
        AOTDecoder(tmp_path / "flipped.pt2")
    with zipfile.ZipFile(package) as zin, zipfile.ZipFile(tmp_path / "edited.pt2", "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info.filename).replace(weight, flipped_weight))
    with pytest.raises(ValueError, match=r"edited\.pt2': the content does not match the sha256"):
        AOTDecoder(tmp_path / "edited.pt2")
    params = SamplingParams.greedy(6, ignore_eos=True)
    assert AOTDecoder(package).generate_ids(PROMPTS[0], params) == generate_ids(model, PROMPTS[0], params)


@needs_aot
@pytest.mark.slow
def test_a_package_packed_while_another_process_rewrote_its_files_is_refused(package, tmp_path):
    """Before: two pytest workers exported this file's model at once; AOTInductor packs its generated files from the
    shared inductor cache outside its own lock, so one package held an empty `*_metadata.json` (written by the other
    process at that moment) and failed to load with a JSON parse error. Now exports take a lock per inductor cache
    (`_export_lock`), and a package whose metadata members do not hold what it was built with is refused before it
    is written (`_check_built_metadata`)."""
    with zipfile.ZipFile(package) as z:
        names = [n for n in z.namelist() if n.endswith("_metadata.json")]
        assert names  # the wrapper's and the kernel's
        metadata = {k: v for k, v in json.loads(z.read(names[0])).items() if k.startswith("minillm_")}
        aot._check_built_metadata(z, metadata)  # the real package passes
        members = {n: z.read(n) for n in z.namelist()}
    emptied = tmp_path / "emptied.pt2"
    with zipfile.ZipFile(emptied, "w") as z:
        for name, data in members.items():
            z.writestr(name, b"" if name == names[0] else data)
    with zipfile.ZipFile(emptied) as z, pytest.raises(RuntimeError, match="AOTInductor packed a damaged .*_metadata"):
        aot._check_built_metadata(z, metadata)


def test_one_export_at_a_time_across_processes(tmp_path, monkeypatch):
    """`_export_lock` is a file lock another process waits on (the exports of two pytest workers, two terminals),
    one per inductor cache folder: a private folder here, so another worker's export never holds it meanwhile."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # read by the lock here and by the children
    lock = aot._export_lock()
    assert str(tmp_path) in lock.lock_file
    code = ("import sys; from filelock import Timeout; from minillm.compile.aot import _export_lock\n"
            "try:\n    _export_lock().acquire(timeout=0.2)\nexcept Timeout:\n    sys.exit(3)\nsys.exit(0)")
    with lock:
        held = subprocess.run([sys.executable, "-c", code], timeout=120)
    free = subprocess.run([sys.executable, "-c", code], timeout=120)
    assert (held.returncode, free.returncode) == (3, 0)


def test_loading_refuses_what_is_not_a_package(tmp_path):
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        AOTDecoder(3)
    with pytest.raises(ValueError, match="path must name a path"):
        AOTDecoder("")
    with pytest.raises(FileNotFoundError, match="no AOT decode-step package"):
        AOTDecoder(tmp_path / "missing.pt2")
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a .pt2 package"):
        AOTDecoder(junk)
    other = tmp_path / "other.pt2"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("readme.txt", "a zip, not a package")
    with pytest.raises(ValueError, match="could not be loaded as an AOTInductor package"):
        AOTDecoder(other)


def test_export_refuses_bad_arguments_before_building(model, tmp_path):
    out = tmp_path / "step.pt2"
    with pytest.raises(TypeError, match="model must be a minillm GPT"):
        export_decode_step(torch.nn.Linear(2, 2), out)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        export_decode_step(model, 7)
    with pytest.raises(ValueError, match="path must name a path"):
        export_decode_step(model, "")
    with pytest.raises(ValueError, match=r"must end in \.pt2"):
        export_decode_step(model, tmp_path / "step.bin")
    with pytest.raises(ValueError, match="is a directory"):
        export_decode_step(model, tmp_path)
    with pytest.raises(ValueError, match="max_len=65 is past"):
        export_decode_step(model, out, max_len=65)
    with pytest.raises(TypeError, match="max_len must be an int"):
        export_decode_step(model, out, max_len=4.0)
    with pytest.raises(ValueError, match="meta tensor"):
        export_decode_step(context_model(SMALL).to("meta"), out)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("kwargs,error,match", [
    ({"name": "gpt5"}, ValueError, "name must be one of"),
    ({"new_tokens": 0}, ValueError, "new_tokens must be positive"),
    ({"new_tokens": 300}, ValueError, "new_tokens=300"),
    ({"repeats": 1.5}, TypeError, "repeats must be an int"),
    ({"threads": 0}, ValueError, "threads must be positive"),
    ({"seed": -1}, ValueError, "seed must be non-negative"),
    ({"timeout": 0}, ValueError, "timeout must be"),
    ({"timeout": float("nan")}, ValueError, "timeout must be a finite number"),
])
def test_cold_start_refuses_bad_arguments_before_any_work(kwargs, error, match):
    with pytest.raises(error, match=match):
        cold_start(**{"name": "tiny", **kwargs})


@needs_aot
@pytest.mark.slow
def test_a_step_the_graph_refuses_or_answers_in_another_shape_names_the_package(package):
    """Hostile run 18: a re-signed package whose config is not its graph's reached the compiled kernel's own
    RuntimeError (a token id past the graph's vocabulary) or gave logits of another width. Each step's failure and
    width are now checked, naming the package. (A stand-in runner plays the graph here.)"""
    dec = AOTDecoder(package)

    def refuses(token, position):
        raise RuntimeError("index 200 is out of bounds for dimension 0 with size 128\nmore")

    dec._runner = refuses
    with pytest.raises(ValueError, match=r"step\.pt2' failed a step \(token 3, position 0\): its metadata does not "
                                         r"describe its compiled graph\? index 200 is out of bounds"):
        dec.generate_ids([3], SamplingParams.greedy(2, ignore_eos=True))
    dec._runner = lambda token, position: torch.zeros(1, SMALL.vocab_size + 1)
    with pytest.raises(ValueError, match=rf"logits of shape \(1, {SMALL.vocab_size + 1}\), but its metadata says"):
        dec.generate_ids([3], SamplingParams.greedy(2, ignore_eos=True))
