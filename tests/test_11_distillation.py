"""Chapter 11: distillation.

Graded (the exercise `kd_loss`): worked examples computed by hand (V = 3) for the value and the gradient in both KL
directions, agreement with `torch.nn.functional.kl_div`, the closed-form gradient and `gradcheck` in float64, and the
reason for T²: the soft term's gradient norm stays level across temperatures with it and shrinks like 1/T² without.
Not graded: bad input, hidden-state matching through a learned projection, the model's per-block hidden states, the
trainer's two openings (`init_from`, `loss_fn`), the fairness of the hard-label control (same batches), the
benchmark's measures on tiny models, the tables and numbers the text quotes from its committed results, and the
shipped students.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import minillm
from minillm import GPT, GPTConfig
from minillm.core.checkpoint import WEIGHTS_NAME, load_checkpoint, read_config, save_checkpoint
from minillm.distill import (
    FeatureProjection,
    default_layer_pairs,
    distillation_loss,
    feature_loss,
    kd_loss,
)
from minillm.course.results import load_report
from minillm.distill import bench as distill_bench
from minillm.distill.bench import acceptance, greedy_agreement, teacher_continuations
from minillm.distill.train import DistillObjective, distill
from minillm.gpt.dataset import BatchSampler
from minillm.gpt.pretrained import SHIPPED, pretrained_dir
from minillm.gpt.train import TrainConfig, train

P = [0.5, 0.25, 0.25]  # the worked example's teacher distribution (V = 3)


def worked_example(T: float = 2.0):
    """Teacher logits T·ln p (so softmax(z_t / T) = p), student logits 0 (so q = uniform at any T); float64."""
    zt = T * torch.log(torch.tensor([P], dtype=torch.float64))  # (1, 3)
    zs = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)  # (1, 3)
    return zs, zt


def random_logits(*shape: int, seed: int = 0, scale: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale,
            torch.randn(*shape, generator=g, dtype=torch.float64) * scale)


# ------------------------------------------------------------------------------------------ graded: kd_loss


@pytest.mark.graded(points=2, exercise="kd_loss")
def test_forward_kl_worked_example_value_and_gradient():
    """T = 2, p = [1/2, 1/4, 1/4], q = [1/3, 1/3, 1/3]:
    T² · KL(p‖q) = 4 · (1/2 ln(3/2) + 2 · 1/4 ln(3/4)) = 2 ln(9/8) = 0.23557;
    d/dz_s = T (q − p) = 2 · [1/3 − 1/2, 1/3 − 1/4, 1/3 − 1/4] = [−1/3, 1/6, 1/6]."""
    zs, zt = worked_example(2.0)
    loss = kd_loss(zs, zt, temperature=2.0, kind="forward")
    assert loss.dim() == 0
    assert math.isclose(loss.item(), 2 * math.log(9 / 8), rel_tol=1e-9)
    loss.backward()
    torch.testing.assert_close(zs.grad, torch.tensor([[-1 / 3, 1 / 6, 1 / 6]], dtype=torch.float64),
                               atol=1e-12, rtol=1e-9)
    # T = 1 on logits ln p: KL(p‖uniform) = 1/2 ln(3/2) + 1/2 ln(3/4) = 1/2 ln(9/8), no T² factor to speak of.
    zs1, zt1 = worked_example(1.0)
    assert math.isclose(kd_loss(zs1, zt1, 1.0).item(), 0.5 * math.log(9 / 8), rel_tol=1e-9)


@pytest.mark.graded(points=2, exercise="kd_loss")
def test_reverse_kl_worked_example_value_and_gradient():
    """T = 2: T² · KL(q‖p) = 4 · 1/3 · (ln(2/3) + 2 ln(4/3)) = 4/3 ln(32/27) = 0.22653; its gradient is
    T · q ⊙ (log q − log p − KL(q‖p)) = 2/3 · ([ln(2/3), ln(4/3), ln(4/3)] − 1/3 ln(32/27))."""
    zs, zt = worked_example(2.0)
    loss = kd_loss(zs, zt, temperature=2.0, kind="reverse")
    assert math.isclose(loss.item(), 4 / 3 * math.log(32 / 27), rel_tol=1e-9)
    loss.backward()
    kl = math.log(32 / 27) / 3
    want = torch.tensor([[math.log(2 / 3) - kl, math.log(4 / 3) - kl, math.log(4 / 3) - kl]],
                        dtype=torch.float64) * (2 / 3)
    torch.testing.assert_close(zs.grad, want, atol=1e-12, rtol=1e-9)
    assert not math.isclose(loss.item(), kd_loss(zs, zt, 2.0, "forward").item(), rel_tol=1e-3)  # KL is asymmetric


@pytest.mark.graded(points=2, exercise="kd_loss")
@pytest.mark.parametrize("T", [0.5, 1.0, 3.0])
def test_kd_loss_equals_torch_kl_div_on_batches_of_sequences(T):
    """(B, T, V) logits: T² times PyTorch's KL with log-probability targets, averaged over the B·T positions."""
    zs, zt = random_logits(2, 5, 7, seed=int(T * 10))
    log_q = F.log_softmax(zs / T, dim=-1).reshape(-1, 7)  # (10, 7)
    log_p = F.log_softmax(zt / T, dim=-1).reshape(-1, 7)  # (10, 7)
    forward = T ** 2 * F.kl_div(log_q, log_p, reduction="batchmean", log_target=True)  # KL(p‖q)
    reverse = T ** 2 * F.kl_div(log_p, log_q, reduction="batchmean", log_target=True)  # KL(q‖p)
    torch.testing.assert_close(kd_loss(zs, zt, T, "forward"), forward, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(kd_loss(zs, zt, T, "reverse"), reverse, atol=1e-12, rtol=1e-10)


@pytest.mark.graded(points=2, exercise="kd_loss")
@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_kd_loss_gradient_closed_form_and_gradcheck(kind):
    zs, zt = random_logits(4, 6, seed=1)
    T = 1.7
    z = zs.clone().requires_grad_(True)
    kd_loss(z, zt, T, kind).backward()
    q, p = F.softmax(zs / T, -1), F.softmax(zt / T, -1)  # (4, 6)
    if kind == "forward":
        want = T * (q - p) / 4  # the mean over 4 positions divides by 4
    else:
        kl = (q * (q.log() - p.log())).sum(-1, keepdim=True)  # (4, 1)
        want = T * q * (q.log() - p.log() - kl) / 4
    torch.testing.assert_close(z.grad, want, atol=1e-12, rtol=1e-9)
    assert torch.autograd.gradcheck(lambda a, b: kd_loss(a, b, T, kind),
                                    (zs.clone().requires_grad_(True), zt.clone().requires_grad_(True)))


@pytest.mark.graded(points=2, exercise="kd_loss")
@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_t_squared_keeps_the_gradient_norm_level_across_temperatures(kind):
    """Hinton et al. §2: the soft term's gradients scale as 1/T², hence the T². Measured on random logits: with it
    the norm stays within a factor 2.5 from T = 1 to T = 16 (it settles once T is large enough for the linear
    regime, q_T − p_T ≈ (z_s − z_t) / (V·T)); without it (loss / T²) the norm falls over 100x, and from T = 4 on
    as 1/T² (norm · T² level within 25%)."""
    zs, zt = random_logits(64, 50, seed=2)
    temps = [1.0, 2.0, 4.0, 8.0, 16.0]
    norms = []
    for T in temps:
        z = zs.clone().requires_grad_(True)
        kd_loss(z, zt, T, kind).backward()
        norms.append(z.grad.norm().item())
    assert max(norms) / min(norms) < 2.5, norms
    unscaled = [n / T ** 2 for n, T in zip(norms, temps)]  # the gradient of KL alone: T² is a constant factor
    assert unscaled[-1] < unscaled[0] / 100, unscaled
    level = [u * T ** 2 for u, T in zip(unscaled[2:], temps[2:])]
    assert max(level) / min(level) < 1.25, level


@pytest.mark.graded(points=1, exercise="kd_loss")
@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_kd_loss_is_zero_only_for_the_same_distribution(kind):
    zs, zt = random_logits(3, 5, seed=3)
    assert kd_loss(zs, zs.clone(), 2.0, kind).item() == pytest.approx(0.0, abs=1e-12)
    assert kd_loss(zs, zs + 4.0, 2.0, kind).item() == pytest.approx(0.0, abs=1e-12)  # softmax ignores a shift
    assert kd_loss(zs, zt, 2.0, kind).item() > 1e-3


@pytest.mark.graded(points=1, exercise="kd_loss")
def test_distillation_loss_mixes_hard_and_soft_terms():
    zs, zt = random_logits(2, 3, 5, seed=4)
    y = torch.tensor([[0, 4, 2], [1, 1, 3]])
    ce = F.cross_entropy(zs.reshape(-1, 5), y.reshape(-1))
    soft = kd_loss(zs, zt, 2.0, "reverse")
    torch.testing.assert_close(distillation_loss(zs, zt, y, 2.0, 0.0, "reverse").total, ce)
    torch.testing.assert_close(distillation_loss(zs, zt, y, 2.0, 1.0, "reverse").total, soft)
    parts = distillation_loss(zs, zt, y, 2.0, 0.25, "reverse")
    torch.testing.assert_close(parts.total, 0.75 * ce + 0.25 * soft)
    torch.testing.assert_close(parts.hard, ce)
    torch.testing.assert_close(parts.soft, soft)


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("T, error", [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                      (float("inf"), ValueError), ("2", TypeError), (True, TypeError)])
def test_bad_temperature_names_the_value(T, error):
    zs, zt = random_logits(2, 3)
    with pytest.raises(error, match="temperature"):
        kd_loss(zs, zt, T)


def test_bad_logits_kind_weight_and_targets_are_named():
    zs, zt = random_logits(2, 3)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\).*same shape"):
        kd_loss(zs, torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="student_logits"):
        kd_loss(torch.zeros(2, 3, dtype=torch.long), zt)
    with pytest.raises(TypeError, match="teacher_logits"):
        kd_loss(zs, [[0.0, 1.0, 2.0]])
    with pytest.raises(ValueError, match="V >= 2"):
        kd_loss(torch.zeros(2, 1), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="'sideways'"):
        kd_loss(zs, zt, kind="sideways")
    y = torch.tensor([0, 2])
    with pytest.raises(ValueError, match="kd_weight"):
        distillation_loss(zs, zt, y, kd_weight=1.5)
    with pytest.raises(ValueError, match=r"targets must have shape \(2,\)"):
        distillation_loss(zs, zt, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="targets"):
        distillation_loss(zs, zt, torch.tensor([0.0, 1.0]))


# ------------------------------------------------------------------------------------------ feature KD


def test_default_layer_pairs():
    assert default_layer_pairs(2, 6) == [(0, 2), (1, 5)]
    assert default_layer_pairs(1, 6) == [(0, 5)]
    assert default_layer_pairs(3, 3) == [(0, 0), (1, 1), (2, 2)]
    with pytest.raises(ValueError, match="student_layers"):
        default_layer_pairs(0, 6)


def tiny(seed: int, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_name("tiny", **overrides)).eval()


def test_hidden_collects_each_blocks_output_without_hooks():
    model = tiny(0, n_layer=3)
    idx = torch.randint(0, 512, (2, 9))
    pos = model.check_inputs(idx)
    states: list[torch.Tensor] = []
    with torch.no_grad():
        h = model.hidden(idx, pos, collect=states)
        plain = model.hidden(idx, pos)
    assert len(states) == 3 and all(s.shape == (2, 9, 32) for s in states)
    assert torch.equal(h, plain)  # collecting changes nothing
    assert torch.equal(model.transformer.ln_f(states[-1]), h)
    with torch.no_grad():  # the first block's output, by hand
        x = model.transformer.wte(idx) + model.transformer.wpe(pos)
        torch.testing.assert_close(states[0], model.transformer.h[0](x), atol=0, rtol=0)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_learned_projection_fits_a_teacher_whose_features_are_linear_in_the_students():
    """When the teacher's (normalised) states are an exact linear map of the student's, training the projection
    alone drives the feature loss to ~0: the learned map is what lets a width-8 student match a width-16 teacher."""
    g = torch.Generator().manual_seed(5)
    true_map = torch.randn(8, 16, generator=g)  # (Cs, Ct)
    true_map -= true_map.mean(dim=1, keepdim=True)  # every s @ map has zero mean over its 16 features
    s = torch.randn(4, 6, 8, generator=g)  # (B, T, Cs)
    s = s * 4 / (s @ true_map).norm(dim=-1, keepdim=True)  # ... and unit variance: |s @ map| = sqrt(16)
    t = s @ true_map  # (B, T, Ct): already layer-normalised, so the loss's target is t itself, linear in s
    fp = FeatureProjection(8, 16, [(0, 0)])
    start = fp([s], [t]).item()
    opt = torch.optim.Adam(fp.parameters(), lr=0.05)
    for _ in range(400):
        loss = fp([s], [t])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert start > 0.5 and loss.item() < 0.02 * start, (start, loss.item())


def test_feature_loss_values_and_errors():
    proj = torch.nn.Linear(2, 3)
    with torch.no_grad():
        proj.weight.zero_()
        proj.bias.zero_()
    s = torch.randn(5, 2)
    t = torch.randn(5, 3) * 10 + 3
    # A zero projection against normalised targets: the mean square of unit-variance rows is 1 - eps effects.
    assert feature_loss(s, t, proj).item() == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(ValueError, match="width is 4"):
        feature_loss(s, torch.randn(5, 4), proj)
    with pytest.raises(ValueError, match="every dimension but the last"):
        feature_loss(s, torch.randn(6, 3), proj)
    with pytest.raises(ValueError, match="out of range"):
        FeatureProjection(2, 3, [(0, 4)])([s], [t, t])
    with pytest.raises(ValueError, match="layer_pairs"):
        FeatureProjection(2, 3, [])


# ------------------------------------------------------------------------------------------ the objective


def test_objective_is_the_mixed_loss_and_leaves_the_teacher_untouched():
    teacher, student = tiny(1, n_layer=3, n_embd=64, n_head=4), tiny(2)
    obj = DistillObjective(teacher, temperature=2.0, kd_weight=0.7, kind="reverse")
    assert list(obj.parameters(recurse=True)) and not any(p.requires_grad for p in obj.parameters())
    x, y = torch.randint(0, 512, (2, 10)), torch.randint(0, 512, (2, 10))
    student.train()
    loss = obj(student, x, y)
    with torch.no_grad():
        want = distillation_loss(student(x), teacher(x), y, 2.0, 0.7, "reverse").total
    torch.testing.assert_close(loss.detach(), want, atol=1e-6, rtol=1e-6)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert student.transformer.wte.weight.grad is not None
    assert set(obj.records[-1]) == {"hard", "soft", "total"}


def test_objective_with_features_trains_its_projection_and_checks_its_arguments():
    teacher, student = tiny(1, n_layer=4, n_embd=64, n_head=4), tiny(2)
    obj = DistillObjective(teacher, 1.0, 0.5, "forward", feature_weight=0.3, student_config=student.config)
    trainable = [p for p in obj.parameters() if p.requires_grad]
    assert obj.features is not None and obj.features.layer_pairs == [(0, 1), (1, 3)]
    assert {tuple(p.shape) for p in trainable} == {(64, 32), (64,)}  # two Linear(32 -> 64), nothing of the teacher
    loss = obj(student, torch.randint(0, 512, (2, 8)), torch.randint(0, 512, (2, 8)))
    loss.backward()
    assert all(p.grad is not None for p in trainable) and "feature" in obj.records[-1]
    with pytest.raises(ValueError, match="student_config"):
        DistillObjective(teacher, feature_weight=0.1)
    with pytest.raises(ValueError, match="kd_weight"):
        DistillObjective(teacher, kd_weight=-0.1)
    with pytest.raises(TypeError, match="teacher"):
        DistillObjective(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="vocab_size"):
        DistillObjective(tiny(3, vocab_size=256))(student, torch.randint(0, 256, (1, 4)),
                                                 torch.randint(0, 256, (1, 4)))


# ------------------------------------------------------------------------------------------ the trainer's openings


def byte_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of a source file as token ids (< 256 < tiny's 512): real, repetitive text with no tokenizer."""
    import minillm.distill.losses as m

    data = torch.tensor(list(open(m.__file__, "rb").read()), dtype=torch.int64)
    return data[:-2000], data[-2000:]


TINY = dict(preset="tiny", model_overrides=dict(block_size=32), batch_size=4, eval_interval=0, eval_windows=4,
            final_eval_tokens=0, steps=4, warmup_steps=1)


@pytest.fixture
def tiny_checkpoint(tmp_path):
    save_checkpoint(tiny(7, block_size=32), tmp_path / "student")
    return str(tmp_path / "student")


def test_init_from_starts_from_the_checkpoint_and_a_ce_loss_fn_changes_nothing(tiny_checkpoint):
    tr, va = byte_tokens()
    start = load_checkpoint(tiny_checkpoint)
    plain = train(TrainConfig(**TINY, init_from=tiny_checkpoint), tr, va, progress=False)
    assert plain.step == 4 and not torch.equal(plain.model.transformer.wte.weight, start.transformer.wte.weight)
    one_step = train(TrainConfig(**{**TINY, "steps": 2}, init_from=tiny_checkpoint, lr=1e-12), tr, va, progress=False)
    torch.testing.assert_close(one_step.model.transformer.wte.weight, start.transformer.wte.weight, atol=1e-9, rtol=0)

    def ce(model, x, y):
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    hooked = train(TrainConfig(**TINY, init_from=tiny_checkpoint), tr, va, progress=False, loss_fn=ce)
    for a, b in zip(plain.model.parameters(), hooked.model.parameters()):
        assert torch.equal(a, b)


def test_trainer_rejects_bad_openings(tiny_checkpoint):
    with pytest.raises(ValueError, match="init_from.*resume"):
        TrainConfig(**TINY, init_from=tiny_checkpoint, resume=tiny_checkpoint)
    tr, va = byte_tokens()
    with pytest.raises(TypeError, match="loss_fn"):
        train(TrainConfig(**TINY), tr, va, progress=False, loss_fn="ce")


def test_control_and_distilled_runs_see_the_same_batches(tiny_checkpoint, monkeypatch):
    """The comparison is fair: same start, same batches in the same order; only the loss differs."""
    seen: list[torch.Tensor] = []
    original = BatchSampler.sample

    def recording(self, device="cpu"):
        x, y = original(self, device)
        seen.append(x.clone())
        return x, y

    monkeypatch.setattr(BatchSampler, "sample", recording)
    tr, va = byte_tokens()
    monkeypatch.setattr("minillm.gpt.train._load_data", lambda cfg: (tr, va))
    teacher = tiny(9, n_layer=3, n_embd=64, n_head=4, block_size=32)
    cfg = TrainConfig(**TINY, init_from=tiny_checkpoint)
    control, obj0 = distill(cfg, None, kd_weight=0.0, progress=False)
    n = len(seen)
    distilled, obj = distill(cfg, teacher, temperature=2.0, kd_weight=0.5, progress=False)
    assert obj0 is None and obj is not None and len(obj.records) == 4
    # 4 training batches + the validation windows, each run; the second run's draws equal the first's
    assert n == 5 and len(seen) == 10 and all(torch.equal(a, b) for a, b in zip(seen[:n], seen[n:]))
    assert not torch.equal(control.model.transformer.wte.weight, distilled.model.transformer.wte.weight)
    assert distilled.log["distillation"]["kd_weight"] == 0.5 and distilled.log["distillation"]["history"]
    with pytest.raises(ValueError, match="init_from"):
        distill(TrainConfig(**TINY), teacher, progress=False)
    with pytest.raises(ValueError, match="teacher"):
        distill(cfg, None, kd_weight=0.5, progress=False)


def test_a_feature_projection_in_the_loss_is_trained_by_the_trainer(tiny_checkpoint, monkeypatch):
    tr, va = byte_tokens()
    monkeypatch.setattr("minillm.gpt.train._load_data", lambda cfg: (tr, va))
    teacher = tiny(9, n_layer=2, n_embd=64, n_head=4, block_size=32)
    cfg = TrainConfig(**TINY, init_from=tiny_checkpoint)
    torch.manual_seed(0)
    _, obj = distill(cfg, teacher, kd_weight=0.5, feature_weight=1.0, progress=False)
    torch.manual_seed(0)
    fresh = FeatureProjection(32, 64, [(0, 0), (1, 1)])
    assert not torch.equal(obj.features.proj[0].weight, fresh.proj[0].weight)  # moved by the optimizer


# ------------------------------------------------------------------------------------------ the benchmark's measures


def test_a_model_agrees_with_itself_and_is_its_own_perfect_draft():
    teacher, other = tiny(4), tiny(5)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 9)]
    conts = teacher_continuations(teacher, prompts, 6)
    assert greedy_agreement(teacher, prompts, conts) == 1.0
    assert 0.0 <= greedy_agreement(other, prompts, conts) < 1.0
    same = acceptance(teacher, teacher, prompts, 6, gamma=2)
    assert same["alpha"] == 1.0 and same["identical"] and same["proposed"] > 0
    diff = acceptance(teacher, other, prompts, 6, gamma=2)
    assert diff["identical"] and diff["alpha"] < 1.0  # greedy speculative output is the target's, whatever the draft


def test_quotes_of_the_committed_results_hold_every_name_the_text_quotes():
    """The chapter's tables and numbers come from `quotes` of the committed results file (tests/test_texts.py checks
    that they match); here: every name the text asks for is there, the tables are tables, the command is shown."""
    root = Path(__file__).resolve().parent.parent
    results = "chapters/results/11-distillation.json"
    report = load_report(results, root)
    assert report["bench"] == "minillm.distill.bench" and report["size"] == "full"
    q = distill_bench.quotes(report)
    text = (root / "chapters" / "11-distillation.md").read_text(encoding="utf-8")
    used = set(re.findall(re.escape(results) + r"::([^ >\n]+) -->", text))
    assert {"quality", "acceptance", "speedup"} <= used and used <= set(q), used - set(q)
    for table in ("quality", "acceptance", "speedup"):
        lines = q[table].splitlines()
        assert q[table].endswith("\n") and lines[1].startswith("|---|") and len(lines) >= 2 + len(distill_bench.DRAFTS)
    assert report["command"] in text and report["identical"]


# ------------------------------------------------------------------------------------------ the shipped students


@pytest.mark.parametrize("name", ["draft-distilled", "draft-hardlabel"])
def test_shipped_students_load_with_their_recipe(name):
    assert name in SHIPPED
    if not (pretrained_dir(name) / WEIGHTS_NAME).is_file():
        pytest.skip(f"checkpoint {name!r} not trained yet")
    model, tok = minillm.load(name)
    assert model.config == GPTConfig.from_name("draft") and not model.training
    _, meta = read_config(pretrained_dir(name))
    assert meta["trained_with"].startswith("python -m minillm.distill.train")
    log = json.loads((pretrained_dir(name) / "training_log.json").read_text())
    kd = log["distillation"]
    assert (kd["kd_weight"] > 0) == (name == "draft-distilled")
    assert log["steps"] == json.loads((pretrained_dir("draft-distilled") / "training_log.json").read_text())["steps"]
    from minillm.bench.models import load_model

    loaded = load_model(name)
    assert loaded.trained and loaded.label == name


@pytest.mark.slow
def test_cli_runs_a_short_distillation(tmp_path, capsys):
    from minillm.distill.train import main

    out = tmp_path / "student"
    assert main(["--steps", "2", "--warmup-steps", "1", "--eval-interval", "0", "--eval-windows", "2",
                 "--final-eval-tokens", "0", "--batch-size", "2", "--kd-weight", "0.5", "--temperature", "2",
                 "--export", str(out), "--no-progress"]) == 0
    _, meta = read_config(out)
    assert meta["steps"] == 2 and "--kd-weight 0.5" in meta["trained_with"]
    log = json.loads((out / "training_log.json").read_text())
    assert log["distillation"]["temperature"] == 2.0 and log["train_config"]["init_from"].endswith("draft")
    assert "2 steps" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_kd_loss_on_cuda_matches_cpu(kind):
    zs, zt = random_logits(8, 16, 100, seed=6)
    want = kd_loss(zs.float(), zt.float(), 2.0, kind)
    got = kd_loss(zs.float().cuda(), zt.float().cuda(), 2.0, kind).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
