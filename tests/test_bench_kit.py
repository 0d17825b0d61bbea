"""The measurement kit (`minillm.bench`): loader, workload presets, the over-time driver, the same-tokens check,
greedy agreement, KL divergence, output consistency, and the command line every benchmark shares.

No timing is asserted here: only that the kit's numbers are the ones it claims (lengths, orders, counts), that every
chapter benchmark's parser offers the shared options with the kit's defaults and help, and that no chapter's
benchmark imports another chapter's (a measurement two chapters share lives in the kit).
"""

from __future__ import annotations

import ast
import importlib
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from minillm import chapters
from minillm.bench import cli
from minillm.bench.agreement import (
    argmax_along,
    common_prefix,
    greedy_agreement,
    greedy_outputs,
    kl_divergence,
    output_consistency,
    teacher_forced_agreement,
    teacher_forced_kl,
)
from minillm.bench.check import SameTokens, same_tokens
from minillm.bench.driver import drive, engine_tokens
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.bench.workload import PRESETS, LengthDist, check_load_list, eval_prompts, make_workload, workload
from minillm.core.config import GPTConfig
from minillm.core.model import GPT
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.kvcache.generate import generate_ids

from helpers import context_model


# ------------------------------------------------------------------------------------------------- load_model


def test_load_model_random_init_is_seeded_and_labelled():
    a, b = load_model("tiny", seed=3), load_model("tiny", seed=3)
    assert not a.trained and "random init" in a.label and not a.model.training
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    c = load_model("tiny", seed=4)
    assert not torch.equal(a.model.lm_head.weight, c.model.lm_head.weight)
    assert a.tokenizer is not None  # the shipped tokenizer, so prompts can be real text


def test_load_model_random_init_on_request_even_for_a_shipped_name():
    loaded = load_model("base", random_init=True)
    assert not loaded.trained and loaded.label.startswith("base (random init")


# ---------------------------------------------------------------------------------------------------- workload


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_deterministic_per_seed_and_in_range(name):
    a = workload(name, 12, seed=5, rate=4.0, vocab_size=300)
    b = workload(name, 12, seed=5, rate=4.0, vocab_size=300)
    c = workload(name, 12, seed=6, rate=4.0, vocab_size=300)
    key = lambda wl: [(w.arrival_time, w.prompt_token_ids, w.output_len) for w in wl]  # noqa: E731
    assert key(a) == key(b) and key(a) != key(c)
    p, o = LengthDist.parse(PRESETS[name].prompt_len), LengthDist.parse(PRESETS[name].output_len)
    for w in a:
        assert min(p.args[:2]) <= len(w.prompt_token_ids) <= p.max
        assert o.args[-2 if o.kind == "lognormal" else 0] <= w.output_len <= o.max
        assert w.params.ignore_eos and w.params.max_new_tokens == w.output_len
    arrivals = [w.arrival_time for w in a]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    if not PRESETS[name].real_text:
        assert all(0 <= t < 300 for w in a for t in w.prompt_token_ids)


def test_preset_lengths_can_be_overridden_and_offline_is_all_at_zero():
    wl = workload("prefill-heavy", 4, seed=0, prompt_len="uniform:10:12", output_len=3)
    assert all(10 <= len(w.prompt_token_ids) <= 12 and w.output_len == 3 for w in wl)
    assert all(w.arrival_time == 0 for w in wl)  # rate = inf by default


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="mixed") as err:
        workload("bursty", 3)
    assert "prefill-heavy" in str(err.value)


def test_eval_prompts_are_consecutive_text_or_seeded_ids():
    text = eval_prompts([3, 5], vocab_size=100, real_text=True)
    assert [len(p) for p in text] == [3, 5]
    assert text[0] + text[1] == eval_prompts([8], vocab_size=100, real_text=True)[0]
    rnd = eval_prompts([4, 2], vocab_size=50, real_text=False, seed=1)
    assert rnd == eval_prompts([4, 2], vocab_size=50, real_text=False, seed=1)
    assert all(0 <= t < 50 for p in rnd for t in p)


# ------------------------------------------------------------------------------------------------------ driver


class FakeEngine:
    """One token per step for every request, in the order added: enough to watch the driver's bookkeeping."""

    def __init__(self):
        self.added: list[tuple[str, float]] = []  # (request id, arrival time) in the order the driver added them
        self.live: dict[str, SimpleNamespace] = {}

    def add_request(self, prompt, params, request_id=None, arrival_time=None):
        self.added.append((request_id, arrival_time))
        self.live[request_id] = SimpleNamespace(request_id=request_id, prompt_token_ids=list(prompt), finished=False,
                                                output_token_ids=[], token_times=[], arrival_time=arrival_time,
                                                want=params.max_new_tokens)
        return request_id

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        outs = []
        for rid, r in list(self.live.items()):
            r.output_token_ids.append(len(r.output_token_ids))
            r.token_times.append(time.perf_counter())
            r.finished = len(r.output_token_ids) == r.want
            if r.finished:
                del self.live[rid]
            outs.append(r)
        return outs


def test_driver_respects_arrival_order_and_collects_every_request():
    wl = make_workload(6, rate=200.0, prompt_len_dist="uniform:2:5", output_len_dist="uniform:1:4", seed=2)
    engine = FakeEngine()
    run = drive(engine, wl, realtime=True)
    assert [rid for rid, _ in engine.added] == [w.request_id for w in sorted(wl, key=lambda w: w.arrival_time)]
    added_at = [t for _, t in engine.added]
    assert added_at == sorted(added_at)
    assert [t - run.start for t in added_at] == pytest.approx(sorted(w.arrival_time for w in wl))
    assert list(run.outputs) == [w.request_id for w in wl]  # workload order
    assert run.output_token_ids == [list(range(w.output_len)) for w in wl]
    for times in run.times:
        assert times.token_times == sorted(times.token_times) and times.token_times[0] >= times.arrival
    assert run.output_tokens == sum(w.output_len for w in wl) and run.duration_s > 0 and run.cpu_s >= 0


def test_driver_feeds_a_tiny_engine_offline_and_online():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny")).eval()
    wl = make_workload(5, rate=100.0, prompt_len_dist="uniform:2:9", output_len_dist="uniform:1:6",
                       vocab_size=model.config.vocab_size, seed=4)
    for realtime in (False, True):
        llm = LLM(model, None, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32))
        run = drive(llm, wl, realtime=realtime)
        assert not llm.has_unfinished()
        assert run.output_token_ids == [generate_ids(model, w.prompt_token_ids, w.params) for w in wl]
        for w, times in zip(wl, run.times):
            assert len(times.token_times) == w.output_len and times.token_times == sorted(times.token_times)
            assert times.prompt_len == len(w.prompt_token_ids)
        summary = run.summary()
        assert summary["completed"] == 5 and summary["total_output"] == sum(w.output_len for w in wl)


# ------------------------------------------------------------------------------------------------- same_tokens


def test_same_tokens_equal_mismatch_and_missing():
    ref = {"a": [1, 2], "b": [3], "c": [4, 5]}
    assert same_tokens(ref, dict(ref)) == SameTokens(3, 3, None)
    got = same_tokens(ref, {"a": [1, 2], "b": [9], "c": [4, 5]}, unit="requests")
    assert (got.equal, got.total, got.first_mismatch, got.ok) == (2, 3, "b", False)
    assert got.check == "identical tokens, 2/3 requests"
    missing = same_tokens(ref, {"a": [1, 2], "b": [3]})
    assert (missing.equal, missing.first_mismatch) == (2, "c")


def test_same_tokens_on_lists_and_several_candidates():
    ref = [[1], [2, 3], [4]]
    assert same_tokens(ref, [[1], [2, 3], [4]]).check == "identical tokens, 3/3 prompts"
    assert same_tokens(ref, [[1], [2, 3]]).first_mismatch == 2  # a shorter candidate misses the last prompt
    three = same_tokens(ref, [[1], [2, 3], [4]], [[1], [2, 4], [4]])
    assert (three.equal, three.first_mismatch) == (2, 1)  # equal only where every candidate agrees
    assert same_tokens([], []).ok and same_tokens([], []).total == 0
    with pytest.raises(ValueError, match="candidate"):
        same_tokens(ref)
    assert math.isclose(same_tokens(ref, ref).equal / 3, 1.0)


# ------------------------------------------------------------------------------------------------- agreement


def _agreement_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()


def test_argmax_along_is_the_full_forward_argmax_at_the_continuation_positions():
    model = _agreement_model()
    prompt, cont = [1, 2, 3], [4, 5, 6, 7]
    with torch.inference_mode():
        want = model(torch.tensor([prompt + cont]))[0, 2:6].argmax(-1)  # positions 2..5 predict tokens 3..6
    assert torch.equal(argmax_along(model, prompt, cont), want)
    assert argmax_along(model, prompt, []).numel() == 0
    with pytest.raises(ValueError, match="prompt"):
        argmax_along(model, [], cont)


def test_the_two_agreements_agree_on_the_reference_s_own_argmax_path():
    """teacher_forced_agreement(ref, cand) counts where cand's argmax is ref's; greedy_agreement(cand) along ref's
    argmaxes counts the same positions."""
    ref, cand = _agreement_model(), GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16))
    prompts = [[1, 2, 3], [9, 8, 7]]
    conts = [[0] * 5 for _ in prompts]
    for _ in range(5):  # fixed-point iteration: after i rounds the first i tokens are ref's greedy ones
        conts = [argmax_along(ref, p, c).tolist() for p, c in zip(prompts, conts)]
    assert conts == [argmax_along(ref, p, c).tolist() for p, c in zip(prompts, conts)]  # ref's own greedy path
    seqs = [p + c for p, c in zip(prompts, conts)]
    agree, total = teacher_forced_agreement(ref, cand.eval(), seqs, prompt_len=3)
    assert total == 10 and teacher_forced_agreement(ref, ref, seqs, prompt_len=3) == (10, 10)
    assert greedy_agreement(cand, prompts, conts) == agree / total
    assert greedy_agreement(ref, prompts, conts) == 1.0
    with pytest.raises(ValueError):
        greedy_agreement(cand, prompts, conts[:1])


def test_kl_divergence_matches_f_kl_div_and_a_hand_computation():
    """p = softmax(0, 0) = (1/2, 1/2), q = softmax(0, ln 3) = (1/4, 3/4): KL(p || q) = 1/2 ln 2 + 1/2 ln(2/3)."""
    p_logits = torch.tensor([0.0, 0.0], dtype=torch.float64)
    q_logits = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)  # float64: ln 3 in float32 is off by 1e-8
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # 0.1438 nats
    assert kl_divergence(p_logits, q_logits).item() == pytest.approx(want, rel=1e-12)
    g = torch.Generator().manual_seed(0)
    ref, cand = torch.randn(4, 7, 50, generator=g) * 3, torch.randn(4, 7, 50, generator=g) * 3  # (B, T, V)
    kl = kl_divergence(ref, cand)
    assert kl.shape == (4, 7) and kl.dtype == torch.float64 and (kl > 0).all()
    oracle = F.kl_div(F.log_softmax(cand.double(), -1), F.log_softmax(ref.double(), -1), reduction="none",
                      log_target=True).sum(-1)  # (4, 7): PyTorch's KL(target || input)
    torch.testing.assert_close(kl, oracle, atol=1e-12, rtol=1e-10)
    assert torch.equal(kl_divergence(ref, ref), torch.zeros(4, 7, dtype=torch.float64))
    assert kl_divergence(ref, ref + 5.0).abs().max() < 1e-12  # a constant per row changes no probability


def test_kl_divergence_of_a_masked_vocabulary_has_no_nan():
    """A token the reference rules out adds 0 (F.kl_div gives NaN where both rule it out); a token only the
    candidate rules out makes the KL infinite."""
    g = torch.Generator().manual_seed(1)
    ref, cand = torch.randn(3, 10, generator=g), torch.randn(3, 10, generator=g)
    ref[:, 7:] = cand[:, 8:] = float("-inf")  # the reference allows 0..6, the candidate 0..7
    kl = kl_divergence(ref, cand)
    assert not kl.isnan().any() and torch.isfinite(kl).all()
    # over the reference's 7 tokens: the candidate's distribution leaves mass on token 7, the KL sums only 0..6
    log_p, log_q = F.log_softmax(ref[:, :7].double(), -1), F.log_softmax(cand.double(), -1)[:, :7]
    torch.testing.assert_close(kl, (log_p.exp() * (log_p - log_q)).sum(-1), atol=1e-12, rtol=1e-10)
    assert F.kl_div(F.log_softmax(cand, -1), F.log_softmax(ref, -1), reduction="none", log_target=True).isnan().any()
    assert torch.isinf(kl_divergence(cand, ref)).all()  # now the candidate rules out token 7, which p allows


def test_kl_divergence_refuses_bad_logits():
    x = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="candidate_logits"):
        kl_divergence(x, torch.zeros(2, 6))  # another vocabulary
    with pytest.raises(ValueError, match="reference_logits"):
        kl_divergence(torch.full((2, 5), float("nan")), x)
    with pytest.raises(ValueError, match="all -inf"):
        kl_divergence(x, torch.full((2, 5), float("-inf")))
    with pytest.raises(TypeError, match="reference_logits"):
        kl_divergence(torch.zeros(2, 5, dtype=torch.long), x)


def test_teacher_forced_kl_is_zero_for_the_same_model_and_agrees_with_the_argmax_count():
    ref, cand = _agreement_model(), GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16))
    cand.eval()
    seqs = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5]]
    same = teacher_forced_kl(ref, ref, seqs, prompt_len=3)
    assert same["kl_mean"] == same["kl_max"] == 0.0 and same["agreement"] == 1.0 and same["positions"] == 6
    r = teacher_forced_kl(ref, cand, seqs, prompt_len=3)
    assert (r["agree_positions"], r["positions"]) == teacher_forced_agreement(ref, cand, seqs, prompt_len=3)
    with torch.inference_mode():  # the hand computation: full forwards, the positions predicting seq[3:]
        kl = torch.cat([kl_divergence(ref(torch.tensor([s[:-1]]))[0, 2:], cand(torch.tensor([s[:-1]]))[0, 2:])
                        for s in seqs])  # (6,)
    assert r["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-9) and r["kl_mean"] > 0
    assert r["kl_max"] == pytest.approx(kl.max().item(), rel=1e-9)
    assert kl.min().item() <= r["kl_p99"] <= r["kl_max"]


def test_teacher_forced_kl_refuses_bad_input():
    model = _agreement_model()
    other = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match="sequences"):
        teacher_forced_kl(model, model, [], prompt_len=2)
    with pytest.raises(ValueError, match="prompt_len"):
        teacher_forced_kl(model, model, [[1, 2, 3]], prompt_len=0)
    with pytest.raises(ValueError, match=r"sequences\[1\]"):
        teacher_forced_kl(model, model, [[1, 2, 3], [1, 2]], prompt_len=2)
    with pytest.raises(ValueError, match="candidate has a vocabulary of 65"):
        teacher_forced_kl(model, other, [[1, 2, 3]], prompt_len=2)


class _BansOneToken(GPT):
    """The same model with one token's logit set to -inf: its greedy continuation is the original's until the
    original would pick that token."""

    banned = 0

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = super().logits(h).clone()  # (..., V)
        out[..., self.banned] = float("-inf")
        return out


def test_output_consistency_of_a_model_with_itself_and_with_a_crafted_twin():
    ref = context_model(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16), seed=0)
    prompts = [[1, 2, 3], [9, 8, 7], [4, 4, 4], [30, 31]]
    outs = greedy_outputs(ref, prompts, 8)
    params = SamplingParams.greedy(8, ignore_eos=True)
    assert outs == [generate_ids(ref, p, params) for p in prompts]  # the reference loop = chapter 04's cached one
    assert output_consistency(outs, outs) == {"identical": 4, "prompts": 4, "identical_fraction": 1.0,
                                              "mean_common_prefix": 8.0, "new_tokens": 8}
    twin = _BansOneToken(ref.config).eval()
    twin.load_state_dict(ref.state_dict())
    twin.banned = outs[0][2]  # the token ref picks third for the first prompt
    cand = greedy_outputs(twin, prompts, 8)
    # the twin follows ref until ref would pick the banned token: the common prefix ends at its first occurrence
    want = [out.index(twin.banned) if twin.banned in out else 8 for out in outs]
    assert [common_prefix(a, b) for a, b in zip(outs, cand)] == want and want[0] <= 2
    r = output_consistency(outs, cand)
    assert r["identical"] == sum(w == 8 for w in want) < 4 and r["mean_common_prefix"] == sum(want) / 4
    # teacher-forced, the twin gives the banned token probability 0 where ref gives it some: KL is +inf, not NaN
    kl = teacher_forced_kl(ref, twin, [p + o for p, o in zip(prompts, outs)], prompt_len=2)
    assert kl["kl_mean"] == kl["kl_p99"] == kl["kl_max"] == math.inf


def test_output_consistency_by_hand_and_its_bad_input():
    r = output_consistency([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]])
    assert r == {"identical": 1, "prompts": 2, "identical_fraction": 0.5, "mean_common_prefix": 2.5, "new_tokens": 3}
    model = _agreement_model()
    with pytest.raises(ValueError, match="prompts"):
        greedy_outputs(model, [], 4)
    with pytest.raises(ValueError, match="num_tokens"):
        greedy_outputs(model, [[1, 2]], 0)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        greedy_outputs(model, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="reference_outputs"):
        output_consistency([], [])
    with pytest.raises(ValueError, match="candidate_outputs"):
        output_consistency([[1]], [[1], [2]])
    with pytest.raises(ValueError, match=r"reference_outputs\[0\]"):
        output_consistency([[]], [[1]])


def test_engine_tokens_are_each_prompt_s_output_ids():
    class Out:
        def __init__(self, ids):
            self.output_token_ids = ids

    engine = SimpleNamespace(generate=lambda prompts, params: [Out([len(p), params]) for p in prompts])
    assert engine_tokens(engine, [[1], [1, 2]], 7) == [[1, 7], [2, 7]]


# ------------------------------------------------------------------------------------------------- one command line

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minillm"
KIT = "minillm.bench"


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _chapter_package(module: str) -> str | None:
    """The chapter package a module sits in ("minillm.quant" for minillm.quant.bench), None outside the chapters."""
    for c in chapters.CHAPTERS:
        if module == c.package or module.startswith(c.package + "."):
            return c.package
    return None


def _is_benchmark(path: Path) -> bool:
    """A chapter's benchmark: bench.py or *_bench.py of a chapter package, and chapter 13's two other measuring
    commands."""
    name = _module(path)
    return _chapter_package(name) is not None and (path.name == "bench.py" or path.stem.endswith("_bench")
                                                   or name in ("minillm.compile.sweep", "minillm.compile.llamacpp"))


BENCHMARK_FILES = sorted(p for p in PACKAGE.rglob("*.py") if _is_benchmark(p))
# A benchmark module with a command line (chapter 01's only measures, for the tour).
COMMANDS = [_module(p) for p in BENCHMARK_FILES
            if "def main(" in (src := p.read_text(encoding="utf-8")) or "def add_commands(" in src]


def _option(ap, flag: str):
    for action in ap._actions:
        if flag in action.option_strings:
            return action
    return None


def test_the_benchmark_list_is_complete():
    assert len(COMMANDS) >= 13
    assert {"minillm.naive.bench", "minillm.kvcache.bench", "minillm.quant.bench", "minillm.kernels.bench",
            "minillm.speculative.engine_bench", "minillm.compile.sweep"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_benchmark_parser_has_the_shared_options_with_the_kit_s_defaults(name, tmp_path):
    module = importlib.import_module(name)
    assert hasattr(module, "build_parser"), f"{name} builds its parser some other way than minillm.bench.cli"
    ap = module.build_parser()
    args = ap.parse_args([])
    device = _option(ap, "--device")
    default_device = "cpu" if "cpu" in device.choices else device.choices[0]  # only chapter 12's kernels: cuda
    assert args.device == default_device and set(device.choices) <= set(cli.DEVICE_CHOICES)
    assert device.help == cli.DEVICE_HELP.format(choices=", ".join(device.choices), default=default_device,
                                                 auto=cli.AUTO_HELP if "auto" in device.choices else "")
    assert (args.threads, args.json) == (cli.DEFAULT_THREADS, None)
    assert _option(ap, "--threads").help == cli.THREADS_HELP and _option(ap, "--json").help == cli.JSON_HELP
    if _option(ap, "--seed") is not None:
        assert args.seed == 0 and _option(ap, "--seed").help == cli.SEED_HELP
    out = str(tmp_path / "r.json")
    args = ap.parse_args(["--threads", "2", "--json", out, "--device", default_device])
    assert (args.threads, args.json, args.device) == (2, out, default_device)
    sizes = getattr(module, "SIZES", None)
    if sizes is not None:  # --size, and --quick as --size quick
        assert _option(ap, "--size").choices == list(sizes) and args.size == cli.DEFAULT_SIZE == "full"
        assert ap.parse_args(["--quick"]).size == "quick" and ap.parse_args(["--size", "tour"]).size == "tour"
    else:
        assert _option(ap, "--size") is None


def test_start_refuses_bad_threads_and_json_paths_before_any_work(tmp_path, capsys):
    ap = cli.bench_parser("prog", "a benchmark", "smaller")
    with pytest.raises(SystemExit) as e:
        cli.start(ap, ["--threads", "0"])
    assert e.value.code == 2 and "--threads must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.start(ap, ["--json", str(tmp_path)])
    assert "is a directory" in capsys.readouterr().err
    before = torch.get_num_threads()
    try:
        args = cli.start(ap, ["--threads", "1", "--quick"])
        assert args.quick and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="devices"):
        cli.bench_parser("prog", "a benchmark", devices=("tpu",))
    with pytest.raises(ValueError, match="'full'"):
        cli.bench_parser("prog", "a benchmark", sizes={"quick": 1})


def cross_chapter_bench_imports(source: str, module: str) -> set[tuple[str, str]]:
    """(module, imported benchmark) for each import in `source` (the text of `module`) of another chapter's
    benchmark module."""
    benches = {_module(p) for p in BENCHMARK_FILES}
    found = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # `from pkg import bench` too
        for imported in names:
            if imported in benches and _chapter_package(imported) != _chapter_package(module):
                found.add((module, imported))
    return found


def test_no_chapter_imports_another_chapter_s_benchmark():
    """Benchmarks and tours import the kit and chapter code, and their own chapter's benchmark; never another
    chapter's (the command line, minillm.course, sits above every chapter and may)."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path).removesuffix(".__init__")
        if _chapter_package(module) is not None:
            found |= cross_chapter_bench_imports(path.read_text(encoding="utf-8"), module)
    assert found == set(), f"import the shared measurement from {KIT} or the chapter's code instead: {sorted(found)}"


def test_the_import_check_sees_planted_cross_chapter_imports():
    """The check above can fail: chapter 10 importing chapter 09's benchmark, three ways; its own is allowed."""
    planted = ("from minillm.quant.bench import run_all\nfrom minillm.kvcache import bench\n"
               "import minillm.naive.bench\nfrom minillm.prune.bench import run_all as own\n")
    assert cross_chapter_bench_imports(planted, "minillm.prune.planted") == {
        ("minillm.prune.planted", "minillm.quant.bench"), ("minillm.prune.planted", "minillm.kvcache.bench"),
        ("minillm.prune.planted", "minillm.naive.bench")}


def test_markdown_table_aligns_and_refuses_a_wrong_alignment():
    """The one table every report is printed and quoted in: first column left, the rest right by default; a note
    after the last column passes through; an alignment that does not fit the header is a ValueError naming align."""
    assert markdown_table(["path", "tok/s"], [["eager", "588"], ["fused", "1,027", "note"]]) == (
        "| path | tok/s |\n|---|---:|\n| eager | 588 |\n| fused | 1,027 | note |\n")
    assert markdown_table(["a", "b", "c"], [], "lcr") == "| a | b | c |\n|---|:---:|---:|\n"
    for align in ("lr", "lrx", "lrrr"):
        with pytest.raises(ValueError, match="align must hold one of l, r, c per column"):
            markdown_table(["a", "b", "c"], [], align)


@pytest.mark.parametrize("loads, error, match", [
    ([], ValueError, r"loads must be a non-empty list"), ("1,4", ValueError, r"loads must be a non-empty list"),
    ({1: 1}, ValueError, r"loads must be a non-empty list"), ([1, 0], ValueError, r"loads\[1\] must be positive"),
    ([1, True], TypeError, r"loads\[1\] must be an int"), ([4.0], TypeError, r"loads\[0\] must be an int"),
    ([1, 2**40], ValueError, r"loads\[1\] must be at most 256 requests at once, got 1099511627776")])
def test_check_load_list_names_the_bad_load(loads, error, match):
    with pytest.raises(error, match=match):
        check_load_list(loads, most=256)


def test_check_load_list_gives_the_loads_as_a_list():
    assert check_load_list((1, 4, 16)) == [1, 4, 16]
    assert check_load_list([2**40]) == [2**40]  # no bound unless given


def test_markdown_table_refuses_a_table_that_would_render_wrong():
    """A row of another length, a cell with a line break, a header that is not a list of str: each a clear error
    naming it; a "|" in a cell is escaped (once: one the caller escaped stays)."""
    for bad, error, says in ((lambda: markdown_table(["a", "b"], [["x"]]), ValueError, r"rows\[0\] must hold 2 cells"),
                             (lambda: markdown_table(["a", "b"], [["x", "1", "n", "m"]]), ValueError, r"rows\[0\]"),
                             (lambda: markdown_table(["a", "b"], [["x", "1\n2"]]), ValueError,
                              r"rows\[0\]\[1\] must be one line"),
                             (lambda: markdown_table(None, []), TypeError, "header must be a list of str"),
                             (lambda: markdown_table([1, 2], []), TypeError, "header must be a list of str"),
                             (lambda: markdown_table(["a"], None), TypeError, "rows must be a list of rows"),
                             (lambda: markdown_table(["a"], [], 3), ValueError, "align must hold"),
                             (lambda: check_load_list([1], most="5"), TypeError, "most must be an int")):
        with pytest.raises(error, match=says):
            bad()
    assert markdown_table(["a|b", "c"], [["x|y", r"p\|q"]]) == "| a\\|b | c |\n|---|---:|\n| x\\|y | p\\|q |\n"


def test_markdown_table_names_a_cell_that_cannot_be_text():
    """An int past Python's digit limit (str() refuses it) is a ValueError naming the cell."""
    with pytest.raises(ValueError, match=r"rows\[0\]\[1\] cannot be written as text"):
        markdown_table(["a", "b"], [["x", 10 ** 5000]])


def test_markdown_table_refuses_an_empty_header():
    with pytest.raises(ValueError, match="header must name at least one column"):
        markdown_table([], [])
