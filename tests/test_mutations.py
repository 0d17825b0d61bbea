"""The mutation check: plausible bugs planted one at a time, and the test that must now fail for each.

Sixteen such bugs were once planted in the package and the suite run against each: a copy-on-write that did not
copy the K/V and a swap-in that wrote the parked blocks in reverse passed every test; a decode position off by one
passed every chapter 04 test, an inverted causal mask every chapter 02 test; a ref count never decremented and a
scheduler that did not free finished requests made the suite hang. This file keeps those bugs (and a few more) as
text patches: each is applied to a fresh copy of the package in a temporary directory, the named tests are run
there in a subprocess, and they must fail (not hang: the subprocess has a timeout, and `LLM.generate` raises when
it stops making progress). A control run of the same tests on the unpatched copy must pass, so a failure is the
bug's doing. Marked slow (a minute or two on one core); `pytest -m slow tests/test_mutations.py` runs it alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # from the repository root
    old: str  # exactly once in the file
    new: str
    tests: tuple[str, str, str]  # (test file, "-k", expression): the tests that must fail


MUTANTS = (
    Mutant("cow-does-not-copy-kv", "minillm/paged/paged_cache.py",
           "            pool[dst] = pool[src]  # (n_pairs, bs, nh, hs) for K/V, (n_pairs, ...) for whatever else a block "
           "holds", "            pool[dst] = pool[dst]",
           ("tests/test_05_paged_attention.py", "-k", "copy_on_write or n_samples")),
    Mutant("int8-swap-forgets-scales", "minillm/quant/kv_cache.py",
           "        return self.k_pools + self.v_pools + self.k_scales + self.v_scales",
           "        return self.k_pools + self.v_pools", ("tests/test_engine_swap_int8.py", "-k", "swap or scales")),
    Mutant("swap-in-reversed", "minillm/engine/swap.py",
           "idx = torch.tensor(block_table, dtype=torch.int64, device=self.cache.device)  # (n,)\n        for pool, saved",
           "idx = torch.tensor(block_table[::-1], dtype=torch.int64, device=self.cache.device)\n        for pool, saved",
           ("tests/test_06_continuous_batching.py", "-k", "swap")),
    Mutant("decode-position-off-by-one", "minillm/kvcache/generate.py",
           "logits = decode_fn(model, cache, token, all_positions[pos:pos + 1])",
           "logits = decode_fn(model, cache, token, all_positions[pos + 1:pos + 2])",
           ("tests/test_04_kv_cache.py", "-k", "greedy_tokens_identical or seeded_sampling or finish_reasons")),
    Mutant("inverted-causal-mask", "minillm/core/attention.py",
           "    return k_pos <= q_pos  # (T_q, T_k)", "    return k_pos >= q_pos  # (T_q, T_k)",
           ("tests/test_02_gpt.py", "-k", "causal_mask_hand or later_tokens")),
    Mutant("ref-count-never-decremented", "minillm/paged/block_allocator.py",
           "        self.ref_counts[block] -= 1\n", "        self.ref_counts[block] -= 0\n",
           ("tests/test_06_continuous_batching.py", "-k", "engine_greedy_equals_alone")),
    Mutant("scheduler-does-not-free-finished", "minillm/engine/scheduler.py",
           "            if req.accept([int(tok)], now):\n                self.block_manager.free(req.request_id)\n",
           "            if req.accept([int(tok)], now):\n                pass\n",
           ("tests/test_06_continuous_batching.py", "-k", "engine_greedy_equals_alone")),
    Mutant("top-p-boundary", "minillm/core/sampling.py",
           "    drop_sorted = mass_before >= p", "    drop_sorted = mass_before > p",
           ("tests/test_03_naive_inference.py", "-k", "top_p")),
    Mutant("prefix-hash-without-parent", "minillm/paged/block_manager.py",
           "            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH\n",
           "            parent = ROOT_HASH\n",
           ("tests/test_05_paged_attention.py", "-k", "prefix")),
    Mutant("stop-string-at-index-0-missed", "minillm/core/stopping.py",
           "for s in self.params.stop) if i >= 0]", "for s in self.params.stop) if i > 0]",
           ("tests/test_03_naive_inference.py", "-k", "stop")),
    Mutant("slot-mapping-forgets-block-size", "minillm/paged/block_manager.py",
           "    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]",
           "    return [block_table[p // block_size] + p % block_size for p in range(start, end)]",
           ("tests/test_05_paged_attention.py", "-k", "slot or greedy_tokens")),
    Mutant("block-count-off-by-one", "minillm/paged/block_manager.py",
           "    return -(-num_tokens // block_size)", "    return num_tokens // block_size",
           ("tests/test_05_paged_attention.py", "-k", "block_tables_grow or greedy_tokens")),
    Mutant("left-padding-key-mask", "minillm/kvcache/cache.py",
           "real_key = slots.unsqueeze(0) >= self.pad_lens.unsqueeze(1)",
           "real_key = slots.unsqueeze(0) >= 0 * self.pad_lens.unsqueeze(1)",
           ("tests/test_04_kv_cache.py", "-k", "static_batch or padding")),
    Mutant("temperature-after-top-p", "minillm/core/sampling.py",
           "    if params.temperature != 1.0:\n        procs.append(Temperature(params.temperature))\n"
           "    if params.top_k > 0:\n        procs.append(TopK(params.top_k))\n"
           "    if params.top_p < 1.0:\n        procs.append(TopP(params.top_p))\n",
           "    if params.top_k > 0:\n        procs.append(TopK(params.top_k))\n"
           "    if params.top_p < 1.0:\n        procs.append(TopP(params.top_p))\n"
           "    if params.temperature != 1.0:\n        procs.append(Temperature(params.temperature))\n",
           ("tests/test_03_naive_inference.py", "-k", "temperature_then_top_p")),
    Mutant("evicts-a-referenced-cached-block", "minillm/paged/prefix_cache.py",
           "        if self.ref_counts[block] == 0:\n            del self._free[block]",
           "        if self.ref_counts[block] == 0:\n            pass",
           ("tests/test_06_continuous_batching.py", "-k", "engine_greedy_equals_alone and prefix")),
    Mutant("sampler-failure-takes-everyone-down", "minillm/engine/sampler.py",
           "                except Exception as exc:  # noqa: BLE001 - one request's failure, whatever it is, is its own\n"
           "                    req.state.fail(",
           "                except ZeroDivisionError as exc:\n                    req.state.fail(",
           ("tests/test_reliability_engine.py", "-k", "fails_alone_in_the_engine")),
    Mutant("generate-drops-other-outputs", "minillm/engine/frontend.py",
           "                    if key not in wanted:\n                        held.append(out)\n",
           "                    if key not in wanted:\n                        pass\n",
           ("tests/test_reliability_engine.py", "-k", "generate_keeps_other_requests_outputs_for_the_next_step")),
    Mutant("parallel-samples-share-one-seed", "minillm/engine/frontend.py",
           "state = first.state.fork(seed + index if seed is not None else None)",
           "state = first.state.fork(seed)",
           ("tests/test_engine_parallel_sampling.py", "-k", "seeded_samples_equal")),
    Mutant("forked-samples-never-scheduled", "minillm/engine/llm.py",
           "        self.scheduler.add_forked([r for r in started if not r.is_finished])\n",
           "",
           ("tests/test_engine_parallel_sampling.py", "-k", "share_the_prompt_blocks")),
    Mutant("handoff-kv-reversed", "minillm/disagg/decode_worker.py",
           "unpack_kv(payload, self.cache.k_pools, self.cache.v_pools, self.blocks.block_table(h.request_id))",
           "unpack_kv(payload, self.cache.k_pools, self.cache.v_pools, self.blocks.block_table(h.request_id)[::-1])",
           ("tests/test_07_disaggregation.py", "-k", "in_process")),
)


def _copy_repo(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    shutil.copytree(ROOT / "minillm", dest / "minillm", ignore=ignore)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _run(repo: Path, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    # Only the plugins these tests use (timeouts, hypothesis): loading every installed one (xdist, anyio, ...) cost
    # each of the ~26 runs two seconds of its seven-second start.
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "OMP_NUM_THREADS": "1"}  # one thread: the other xdist worker shares the cores
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout",
           "-p", "_hypothesis_pytestplugin", "-o", "timeout=120", *args]
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_every_mutant_names_existing_code():
    """Cheap, always run: every planted bug still applies to the code as it is (else it would test nothing)."""
    for m in MUTANTS:
        text = (ROOT / m.file).read_text(encoding="utf-8")
        assert text.count(m.old) == 1, f"{m.name}: its text is in {m.file} {text.count(m.old)} times"


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Path:
    return _copy_repo(tmp_path_factory.mktemp("minillm-copy"))


@pytest.mark.slow
def test_the_unpatched_copy_passes_every_selected_test(repo_copy):
    """The control: the same selections pass on an unpatched copy (and the copy is what gets imported)."""
    where = subprocess.run([sys.executable, "-c", "import minillm; print(minillm.__file__)"], cwd=repo_copy,
                           env={**os.environ, "PYTHONPATH": str(repo_copy)}, capture_output=True, text=True)
    assert where.stdout.strip().startswith(str(repo_copy)), where.stdout + where.stderr  # the copy, not the checkout
    # One run per test file, selecting the union of its mutants' expressions: a superset of every selection, so it
    # passing means each selection passes (20 selections, 9 files: the control costs 9 interpreter starts, not 20).
    union: dict[str, list[str]] = {}
    for m in MUTANTS:
        file, flag, expr = m.tests
        assert flag == "-k", f"{m.name}: tests are (file, '-k', expression)"
        union.setdefault(file, []).append(f"({expr})")
    for file, exprs in union.items():
        res = _run(repo_copy, (file, "-k", " or ".join(dict.fromkeys(exprs))))
        assert res.returncode == 0, f"{file} control:\n{res.stdout[-3000:]}{res.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_suite_catches_the_planted_bug(mutant, tmp_path):
    repo = _copy_repo(tmp_path)
    path = repo / mutant.file
    text = path.read_text(encoding="utf-8")
    assert text.count(mutant.old) == 1, f"{mutant.name}: its text is not in {mutant.file} once (the code moved on)"
    mutated = text.replace(mutant.old, mutant.new)
    if path.suffix == ".py":  # a stale `old` that is now a prefix of a longer line leaves a syntax error, not a bug
        compile(mutated, str(path), "exec")
    path.write_text(mutated, encoding="utf-8")
    res = _run(repo, mutant.tests)
    assert res.returncode == 1, (f"{mutant.name}: {' '.join(mutant.tests)} did not fail (exit {res.returncode})\n"
                                 f"{res.stdout[-3000:]}{res.stderr[-3000:]}")
    assert "failed" in res.stdout
