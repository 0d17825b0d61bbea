"""Chapter 13's fused C++ step under chapter 06's engine (`minillm.compile.fused_engine.FusedEngineModel`).

A step's hidden states and head against the model's own over the same paged pools (float32 to rounding, with the
K/V written to the same slots): decode rows, verify rows (several per sequence), rows that need more than one chunk
of 16 and a prefix already in the pool; the engine's greedy tokens identical to the plain model's for every float32
attention backend, with preemption (recompute and swap), prefix caching, a quantized KV pool (the model's forward
then), int8 and int4 models, the speculative engine (prompt lookup and a draft model); bad arguments and a changed
model as TypeError/ValueError naming them. No test measures time.
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import context_model, noisy_copy
from minillm import GPT, GPTConfig
from minillm.compile.cpu_gemv import build_problem
from minillm.compile.fused_engine import MAX_FUSED_ROWS, FusedEngineModel
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.paged import PagedBatch
from minillm.paged.backends import make_attention_backend
from minillm.quant.linear import QuantConfig, quantize_model
from minillm.speculative.engine import SpeculativeConfig, SpeculativeLLM

pytestmark = pytest.mark.skipif(build_problem() is not None, reason=f"cannot build the C++ step: {build_problem()}")

SMALL = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=64)
BS = 4  # a small block size: sequences span several blocks, in shuffled order


@pytest.fixture(scope="module")
def model() -> GPT:
    return context_model(SMALL, seed=0).eval()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 1 to 90 tokens: some prefilled in C++ (<= MAX_FUSED_ROWS), some by the model's forward."""
    g = torch.Generator().manual_seed(seed)
    lens = [1, 5, 90, 17, 64, 65, 3, 30, 12, 48][:n]
    return [torch.randint(0, SMALL.vocab_size, (t,), generator=g).tolist() for t in lens]


def shuffled_step(query_lens: list[int], context_lens: list[int], seed: int = 0) -> tuple[PagedBatch, int]:
    """A step's metadata over a pool of shuffled blocks: each sequence's blocks drawn at random (never shared), its
    new tokens the last query_lens[s] of context_lens[s]; returns the batch and the pool's block count."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // BS) for c in context_lens]
    nb = sum(need) + 3
    order = torch.randperm(nb, generator=g).tolist()
    tables = torch.full((len(need), max(need)), -1, dtype=torch.int64)
    slots = []
    for s, (q, c) in enumerate(zip(query_lens, context_lens)):
        tables[s, : need[s]] = torch.tensor(order[: need[s]])
        order = order[need[s]:]
        slots += [int(tables[s, j // BS]) * BS + j % BS for j in range(c - q, c)]
    return PagedBatch(torch.tensor(slots), tables, torch.tensor(context_lens), torch.tensor(query_lens)), nb


@pytest.mark.parametrize("query_lens,context_lens", [
    ([1, 1, 1], [5, 1, 13]),  # a decode step, one sequence starting
    ([5, 1, 3], [9, 20, 3]),  # verify rows (a last token and drafts) and a short prompt
    ([17, 2, 20], [17, 30, 26]),  # 39 rows: three chunks of up to 16, a sequence split across chunks
    ([MAX_FUSED_ROWS], [MAX_FUSED_ROWS + 7]),  # the most rows one C++ call takes, after a cached prefix
])
@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
def test_a_step_equals_the_models_own_over_the_same_pools(model, kind, query_lens, context_lens):
    """Both pools filled with the same random K/V for the tokens before the step; the model's `hidden` over one, the
    C++ step over the other: the hidden states (N, C) and the logits of every row agree to float rounding, and so
    do both pools afterwards (every new row's K/V at its slot in every layer, nothing else touched)."""
    m = model if kind == "float32" else quantize_model(model, QuantConfig(kind, group_size=32))
    fused = FusedEngineModel(m)
    batch, nb = shuffled_step(query_lens, context_lens)
    caches = [make_attention_backend("selective", SMALL, nb, BS) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    for pool_k, pool_v in zip(caches[0].k_pools, caches[0].v_pools):
        pool_k.copy_(torch.randn(pool_k.shape, generator=g))
        pool_v.copy_(torch.randn(pool_v.shape, generator=g))
    for i in range(SMALL.n_layer):
        caches[1].k_pools[i].copy_(caches[0].k_pools[i])
        caches[1].v_pools[i].copy_(caches[0].v_pools[i])
    ids = torch.randint(0, SMALL.vocab_size, (1, sum(query_lens)), generator=g)
    positions = torch.tensor([[c - q + j for q, c in zip(query_lens, context_lens) for j in range(q)]])
    with torch.inference_mode():
        caches[0].set_batch(batch)
        want = m.hidden(ids, positions, caches[0])
        caches[1].set_batch(batch)
        got = fused.hidden(ids, positions, caches[1])
        assert fused.num_fused_steps == 1
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fused.logits(got[0]), m.logits(want[0]), rtol=1e-4, atol=1e-4)
    for i in range(SMALL.n_layer):
        torch.testing.assert_close(caches[1].k_pools[i], caches[0].k_pools[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[1].v_pools[i], caches[0].v_pools[i], rtol=1e-5, atol=1e-5)


def engine_tokens(m, config: EngineConfig, ps: list[list[int]], new: int = 24) -> list[list[int]]:
    return [o.output_token_ids for o in LLM(m, None, config).generate(ps, SamplingParams.greedy(new, ignore_eos=True))]


@pytest.mark.parametrize("backend", ["selective", "selective-cpp", "verify-cpp", "paged"])
def test_the_engines_greedy_tokens_equal_the_models(model, backend):
    """Ten requests, four at a time, prompts of 1 to 90 tokens (long ones prefilled by the model's forward in chunks
    the engine splits, short ones in C++): the same tokens as the engine on the model itself, most steps in C++."""
    config = EngineConfig(num_blocks=120, block_size=BS, max_num_seqs=4, max_num_batched_tokens=48,
                          attention_backend=backend)
    fused = FusedEngineModel(model)
    assert engine_tokens(fused, config, prompts(10)) == engine_tokens(model, config, prompts(10))
    assert fused.num_fused_steps > 0


@pytest.mark.parametrize("setting", ["recompute", "swap", "prefix-caching", "kv-bfloat16"])
def test_the_engines_features_run_on_the_fused_step(model, setting):
    """Preemption (a pool too small for every request: recompute and swap), prefix caching (requests sharing a
    prompt) and a bfloat16 KV pool (which the C++ step leaves to the model's forward): the model's own tokens."""
    shared = prompts(1, seed=5)[0] * 9  # 9 tokens, twice over a block boundary
    ps = [shared + p for p in prompts(6, seed=2)] if setting == "prefix-caching" else prompts(8)
    kwargs = {"recompute": dict(num_blocks=40, preemption_mode="recompute"),
              "swap": dict(num_blocks=40, preemption_mode="swap", num_swap_blocks=200),
              "prefix-caching": dict(num_blocks=200, enable_prefix_caching=True),
              "kv-bfloat16": dict(num_blocks=200, kv_dtype="bfloat16")}[setting]
    config = EngineConfig(block_size=BS, max_num_seqs=4, max_num_batched_tokens=48, **kwargs)
    fused = FusedEngineModel(model)
    assert engine_tokens(fused, config, ps, 40) == engine_tokens(model, config, ps, 40)
    assert (fused.num_fused_steps > 0) == (setting != "kv-bfloat16")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_models_give_their_own_tokens(model, kind):
    q = quantize_model(model, QuantConfig(kind, group_size=32))
    config = EngineConfig(num_blocks=120, block_size=BS, max_num_seqs=4, attention_backend="selective-cpp")
    fused = FusedEngineModel(q)
    assert (fused.int8_linears, fused.int4_linears) == ((8, 0) if kind == "int8" else (0, 8))
    assert engine_tokens(fused, config, prompts(6)) == engine_tokens(q, config, prompts(6))


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_the_speculative_engine_verifies_on_the_fused_step(model, method):
    """Chapter 08's speculative engine with the target on the fused step (its verify rows in C++): the plain
    engine's greedy tokens, drafts proposed and some kept."""
    ps = [p[:12] * 3 for p in prompts(6, seed=4)]  # repetitive: prompt lookup finds drafts
    config = EngineConfig(num_blocks=200, block_size=BS, max_num_seqs=4, attention_backend="verify-cpp")
    draft = noisy_copy(model, 0.05, seed=1).eval() if method == "draft-model" else None
    spec = SpeculativeLLM(FusedEngineModel(model), None, config, speculative=SpeculativeConfig(method, gamma=4),
                          draft=draft)
    got = [o.output_token_ids for o in spec.generate(ps, SamplingParams.greedy(24, ignore_eos=True))]
    assert got == engine_tokens(model, config, ps)
    stats = spec.stats()
    assert stats["num_proposed"] > 0 and stats["acceptance_rate"] > 0


def test_bad_arguments_and_a_changed_model_are_refused(model):
    with pytest.raises(TypeError, match="FusedEngineModel needs a minillm GPT, got Linear"):
        FusedEngineModel(torch.nn.Linear(2, 2))
    fused = FusedEngineModel(copy.deepcopy(model))
    batch, nb = shuffled_step([2, 1], [4, 6])
    cache = make_attention_backend("selective", SMALL, nb, BS)
    cache.set_batch(batch)
    ids, positions = torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 5]])
    with torch.inference_mode():
        fused.hidden(ids, positions, cache)  # fine
        with pytest.raises(ValueError, match=r"token id 512 of row 1 is outside the vocabulary \[0, 512\)"):
            fused.hidden(torch.tensor([[1, 512, 3]]), positions, cache)
        with pytest.raises(ValueError, match=r"position 128 of row 2 is outside the context window \[0, 128\)"):
            fused.hidden(ids, torch.tensor([[2, 3, 128]]), cache)
        flipped = PagedBatch(batch.slot_mapping.flip(0), batch.block_tables, batch.context_lens, batch.query_lens)
        with pytest.raises(ValueError, match="the slots must follow the tables"):  # chapter 05's set_batch
            cache.set_batch(flipped)
        cache.batch = flipped  # past set_batch: the C++ step checks the slots against the tables itself too
        with pytest.raises(ValueError, match="slot .* of row 0 is not where its block table puts token 2 of "
                                             "sequence 0"):
            fused.hidden(ids, positions, cache)
        with pytest.raises(TypeError, match="idx must be an int64 tensor of token ids / positions, got torch.float32"):
            fused.hidden(ids.float(), positions, cache)
        with pytest.raises(ValueError, match=r"positions must be \(1, N\) or \(N,\) for idx \(1, N=3\), got shape"):
            fused.hidden(ids, positions.expand(2, 3), cache)
        with pytest.raises(ValueError, match=r"h must be \(\.\.\., C=64\) on the CPU, got shape \(2, 65\)"):
            fused.logits(torch.zeros(2, 65))
        fused.model.train()
        cache.set_batch(batch)
        with pytest.raises(ValueError, match="a FusedEngineModel step runs the model in eval mode"):
            fused.hidden(ids, positions, cache)
    fused.model.eval()
    config = EngineConfig(num_blocks=60, block_size=BS, max_num_seqs=2)
    fused.model.transformer.h[0].mlp.c_fc.weight = torch.nn.Parameter(torch.zeros(4 * 64, 64))
    with pytest.raises(ValueError, match=r"^the model was changed since this FusedEngineModel was built: .* "
                                         r"FusedEngineModel\(model\)"):
        engine_tokens(fused, config, prompts(2))
    hooked = FusedEngineModel(copy.deepcopy(model))
    hooked.model.transformer.h[1].register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.raises(ValueError, match=r"cannot run forward hooks, but the model's transformer.h.1 has one"):
        engine_tokens(hooked, config, prompts(2))


def test_the_benchmark_point_compares_both_engines_on_the_same_requests():
    """`load_point` on a small model: both engines' outputs identical, most steps in C++, the figures the text
    quotes present (`quotes`), and the console table (`format_report`); no figure's value is asserted (timing)."""
    from minillm.compile import fused_engine

    m = context_model(GPTConfig(vocab_size=4096, block_size=256, n_layer=1, n_head=2, n_embd=32), seed=0).eval()
    point = fused_engine.load_point(m, 2, repeats=1)
    assert point["identical"] and point["requests"] == 2 * fused_engine.REQUESTS_PER_SLOT
    assert 0 < point["fused_steps"] <= point["steps"]
    costs = fused_engine.step_costs(m, context=40, sizes=(1, 4, 6), repeats=1, calls=2)
    assert set(costs["step_ms"]) == {"1", "4", "6"} and costs["row_flops"] == 2 * (4 * 32 * 32 + 4 * 32 * 32 * 2 + 4096
                                                                                  * 32)
    report = {"model": "small", "threads": 1, "backend": fused_engine.BACKEND, "repeats": 1,
              "requests_per_slot": fused_engine.REQUESTS_PER_SLOT, "points": [point], "identical": True, "cpu": "a CPU",
              "step_costs": costs, "step_costs_short": costs}
    q = fused_engine.quotes(report)
    assert {"speedup_c2", "fast_tok_s_c2", "fused_tok_s_c2", "loads", "identical", "cpu", "step_ms_4", "row_ms",
            "row_gflops", "row_ms_short", "row_gflops_short"} <= set(q)
    with pytest.raises(ValueError, match="context must leave room for one new token"):
        fused_engine.step_costs(m, context=256)
    with pytest.raises(ValueError, match="sizes must list at least two batch sizes"):
        fused_engine.step_costs(m, sizes=(4,))
    assert "fused step tok/s" in fused_engine.format_report(report)
    with pytest.raises(ValueError, match="loads must be a non-empty list"):
        fused_engine.run([])
    with pytest.raises(ValueError, match=r"loads\[1\] must be"):
        fused_engine.run([1, 0])


def test_the_speculative_engine_benchmark_runs_on_the_fused_step():
    """`engine_bench.load_point(..., fused_step=True)`: both engines on `FusedEngineModel`, outputs identical; a
    fused_step that is not a bool is a TypeError naming it."""
    from minillm.speculative import engine_bench

    m = context_model(GPTConfig(vocab_size=512, block_size=128, n_layer=1, n_head=2, n_embd=32), seed=0).eval()
    ps = [p[:10] * 3 for p in prompts(4, seed=4)]
    point = engine_bench.load_point(m, ps, 2, 16, SpeculativeConfig("prompt-lookup", gamma=3), repeats=1,
                                    attention_backend="verify-cpp", fused_step=True)
    assert point["identical"]
    with pytest.raises(TypeError, match="fused_step must be a bool, got 'yes'"):
        engine_bench.load_point(m, ps, 2, 16, SpeculativeConfig(), fused_step="yes")


def test_the_engine_takes_the_fused_step_by_name(model):
    """`minillm.engine.step_models`: "fused-cpp" is chapter 13's fused step over `fast_cpu_model` (its module imported
    on first use); the engine on it gives the model's tokens; an unknown name or a second registration is refused."""
    from minillm.engine.step_models import register_step_model, step_model, step_model_names

    fused = step_model("fused-cpp", model)
    assert isinstance(fused, FusedEngineModel) and "fused-cpp" in step_model_names()
    config = EngineConfig(num_blocks=120, block_size=BS, max_num_seqs=4, attention_backend="selective-cpp")
    assert engine_tokens(fused, config, prompts(4)) == engine_tokens(model, config, prompts(4))
    with pytest.raises(ValueError, match=r"step model must be one of \[.*'fused-cpp'.*\], got 'tvm'"):
        step_model("tvm", model)
    register_step_model("fused-cpp-test", FusedEngineModel)
    with pytest.raises(ValueError, match="step model 'fused-cpp-test' is already registered"):
        register_step_model("fused-cpp-test", FusedEngineModel)
    with pytest.raises(TypeError, match="factory must be callable"):
        register_step_model("other", 3)


def test_c13r11_hostile_run_11_findings_are_refused_or_run(model):
    """Run 11: a paged-int8 pool (int8 codes, not float32 K/V) was sent to the C++ step, which refused the valid
    setting; hidden and logits took non-tensors and wrong dtypes into torch's own errors; step_costs read a
    QuantLinear's missing .weight after timing; load_point took any seed and load. Now: the int8 pool runs the
    model's forward (the model's tokens), and the rest are TypeError/ValueError naming the argument up front."""
    from minillm.compile import fused_engine

    config = EngineConfig(num_blocks=120, block_size=BS, max_num_seqs=4, attention_backend="paged-int8")
    fused = FusedEngineModel(model)
    assert engine_tokens(fused, config, prompts(4)) == engine_tokens(model, config, prompts(4))
    assert fused.num_fused_steps == 0
    with pytest.raises(TypeError, match="idx must be an int64 tensor of token ids / positions, got list"):
        fused.hidden([[1, 2]], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="idx is a meta tensor"):
        fused.hidden(torch.zeros(1, 2, dtype=torch.long, device="meta"), torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match=r"h must be a float32 tensor \(\.\.\., C=64\) .* got torch.float64"):
        fused.logits(torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(TypeError, match="h must be a float32 tensor .* got NoneType"):
        fused.logits(None)
    torch.testing.assert_close(fused.logits(torch.ones(2, 3, 64)), model.logits(torch.ones(2, 3, 64)))
    costs = fused_engine.step_costs(quantize_model(model, QuantConfig("int8")), context=8, sizes=(1, 4), repeats=1,
                                    calls=1)
    assert costs["row_flops"] == 2 * (2 * 12 * 64 * 64 + 512 * 64)
    with pytest.raises(TypeError, match="model must be a minillm GPT, got NoneType"):
        fused_engine.step_costs(None)
    with pytest.raises(ValueError, match="sizes must list at least two batch sizes"):
        fused_engine.step_costs(model, sizes=(True, 2))
    with pytest.raises(ValueError, match="concurrency must be at most 256 requests at once, got 1099511627776"):
        fused_engine.load_point(model, 2**40)
    with pytest.raises(ValueError, match="seed"):
        fused_engine.load_point(model, 1, seed=-1)
    with pytest.raises(ValueError, match="vocab_size=512 cannot hold the mixed workload's prompts"):
        fused_engine.load_point(model, 1)
    blocks = copy.deepcopy(model)
    del blocks.transformer.h[1]
    with pytest.raises(ValueError, match=r"needs the model's config.n_layer=2 blocks in transformer.h, got 1"):
        FusedEngineModel(blocks)


def test_c13r12_a_changed_model_is_caught_whichever_path_starts_the_sequence(model):
    """Run 12: the change check ran only in a fused step that started a sequence; a first step of more than 64 rows
    ran the model's forward with the new weights and skipped it, and the decode steps after it ran the C++ step's
    stale snapshot (tokens of neither model). Now any step over the paged pools that starts a sequence checks, and
    so does a replaced `.model` or a changed config."""
    config = EngineConfig(num_blocks=200, block_size=BS, max_num_seqs=4, max_num_batched_tokens=128)
    long_prompts = [p[:30] * 2 for p in prompts(4, seed=1)][:3]  # one step of more than MAX_FUSED_ROWS rows first
    assert sum(len(p) for p in long_prompts) > MAX_FUSED_ROWS
    for change in ("wte", "model", "config"):
        fused = FusedEngineModel(copy.deepcopy(model))
        engine_tokens(fused, config, long_prompts, 4)  # fine before the change
        if change == "wte":
            fused.model.transformer.wte.weight = torch.nn.Parameter(fused.model.transformer.wte.weight * 2)
            match = "^the model was changed since this FusedEngineModel was built: transformer.wte.weight"
        elif change == "model":
            fused.model = copy.deepcopy(model)
            match = "this FusedEngineModel's model was replaced after it was built"
        else:
            fused.model.config.n_layer = 1
            match = "the model's config was changed since this FusedEngineModel was built"
        with pytest.raises(ValueError, match=match):
            engine_tokens(fused, config, long_prompts, 4)


def test_c13r12_the_forward_path_checks_what_the_fused_path_checks(model):
    """Run 12: a step that ran the model's own forward took a 0-d idx (broadcast over every position), ids outside
    the vocabulary (torch's IndexError) and a cache without attend (AttributeError). Now that path runs the model's
    input checks, naming idx, and the cache is checked first."""
    fused = FusedEngineModel(model)
    with pytest.raises(ValueError, match=r"idx must have shape \(B, T\), got \(\)"):
        fused.hidden(torch.tensor(5), torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="idx"):
        fused.hidden(torch.tensor([[1, 512]]), torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="cache must be a KV cache .* got dict"):
        fused.hidden(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), {})
    with pytest.raises(TypeError, match="rows must be an int"):
        fused.fusable(None, "3")
    from minillm.engine.step_models import register_step_model, step_model
    with pytest.raises(ValueError, match="step model 'fused-cpp' is shipped by minillm.compile.fused_engine"):
        register_step_model("fused-cpp", lambda m: m)
    spoof = lambda m: m  # noqa: E731
    spoof.__module__ = "minillm.compile.fused_engine"  # the name alone decides, not what the factory claims
    with pytest.raises(ValueError, match="step model 'fused-cpp' is shipped by minillm.compile.fused_engine"):
        register_step_model("fused-cpp", spoof)
    with pytest.raises(TypeError, match="collect must be a list"):
        fused.hidden(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), None, collect="x")
    with pytest.raises(TypeError, match="step model must be a name"):
        step_model(["fused-cpp"], model)


def test_c13r12_a_shipped_step_model_name_cannot_be_taken_before_its_module_loads():
    """Run 12: registering "fused-cpp" before chapter 13's module was imported succeeded, and the module's own
    registration then failed, so FusedEngineModel could not be imported in that process. Now the name is refused."""
    import subprocess
    import sys

    code = ("from minillm.engine.step_models import register_step_model\n"
            "try:\n    register_step_model('fused-cpp', lambda m: m)\nexcept ValueError as e:\n    print(e)\n"
            "import minillm.compile.fused_engine\nprint('imported')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == ["step model 'fused-cpp' is shipped by minillm.compile.fused_engine, which "
                                       "registers it on first use; pick another name", "imported"]


def test_c13r13_the_benchmark_command_runs_and_refuses_bad_flags_naming_them():
    """Run 13: the module's own registration was refused when it ran as `__main__`, so `python -m
    minillm.compile.fused_engine` failed on every call, --help included. Now --help works, a bad --loads is a usage
    error (exit 2) naming the flag, before any model loads."""
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "minillm.compile.fused_engine", *args], capture_output=True,
                              text=True, timeout=300)

    ok = cli("--help")
    assert ok.returncode == 0 and "--loads" in ok.stdout, ok.stderr[-2000:]
    for bad, says in (("0", "loads[0] must be positive"), ("300", "loads[0] must be at most 256"), ("x", "--loads")):
        res = cli("--loads", bad)
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


def test_c13r13_a_changed_model_is_caught_when_every_prompt_hits_the_prefix_cache(model):
    """Run 13: a request whose prompt is all in the prefix cache starts with a context longer than its query, so no
    step "started a sequence" and the change check never ran: the old model's tokens, without a word. Now every step
    over the pools looks cheaply (`model_maybe_changed`), and a change is the full check's ValueError."""
    config = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, enable_prefix_caching=True)
    ps = [list(range(1, 11)), list(range(20, 40))]
    for change in ("wte", "eps", "hook"):
        fused = FusedEngineModel(copy.deepcopy(model))
        llm = LLM(fused, None, config)
        llm.generate(ps, SamplingParams.greedy(6, ignore_eos=True))
        if change == "wte":
            fused.model.transformer.wte.weight = torch.nn.Parameter(fused.model.transformer.wte.weight.clone())
        elif change == "eps":
            fused.model.transformer.ln_f.eps = 0.5
        else:
            fused.model.transformer.h[0].register_forward_hook(lambda mod, args, out: out)
        assert fused.model_maybe_changed()
        with pytest.raises(ValueError,
                           match="^the model was changed since this FusedEngineModel|cannot run forward hooks"):
            llm.generate(ps, SamplingParams.greedy(6, ignore_eos=True))
