"""Distillation losses: match a teacher's distributions (response-based KD) or its hidden states (feature-based KD).

What it adds, as pure functions on logits and hidden states:

- `kd_loss`: T² · KL between teacher and student distributions softened by a temperature T (Hinton et al. 2015,
  §2), in either direction: "forward" KL(p‖q) (the student covers everything the teacher thinks likely) or
  "reverse" KL(q‖p) (MiniLLM, Gu et al. 2024: the student puts its mass where the teacher is sure, "mode
  seeking"). p = softmax(z_t / T) is the teacher's, q = softmax(z_s / T) the student's.
- `distillation_loss`: (1 − w) · cross-entropy with the hard labels + w · `kd_loss`, the mix Hinton et al. train with.
- `FeatureProjection` and `feature_loss`: hidden-state matching (FitNets-style hints) through a learned linear map
  from the student's width to the teacher's, on chosen pairs of layers (`default_layer_pairs`).

Why T²: with z_s, z_t of one position and V tokens, d/dz_s of KL(p_T‖q_T) is (q_T − p_T) / T, and for large T
q_T − p_T ≈ (z_s − z_t) / (V·T) (logits centred), so the gradient of the soft term shrinks like 1/T². Multiplying by
T² keeps its size level as T changes, so the mixing weight w means the same at every temperature:

    d/dz_s [ T² · KL(p_T ‖ q_T) ] = T · (q_T − p_T)                                   (per position, forward)
    d/dz_s [ T² · KL(q_T ‖ p_T) ] = T · q_T ⊙ (log q_T − log p_T − KL(q_T ‖ p_T))     (per position, reverse)

What it leaves out: sequence-level KD (training on the teacher's generated text), MiniLLM's on-policy policy-gradient
optimisation of reverse KL over whole sampled responses (here reverse KL is taken per token, on corpus text),
attention-map transfer, and top-k sparse teacher distributions. Every loss averages over positions: logits of shape
(..., V) are flattened to (N, V) rows.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.config import check_float

KINDS = ("forward", "reverse")


def check_temperature(temperature: object) -> float:
    """T > 0 and finite, else TypeError/ValueError naming the value."""
    check_float("temperature", temperature, 0.0, include_minimum=False)
    return float(temperature)  # type: ignore[arg-type]


def _check_pair(student_logits: object, teacher_logits: object) -> None:
    for name, t in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor of logits (..., V), "
                            f"got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() == 0 or t.size(-1) < 2:
            raise ValueError(f"{name} must have shape (..., V) with V >= 2, got {tuple(t.shape)}")
    s_shape, t_shape = tuple(student_logits.shape), tuple(teacher_logits.shape)  # type: ignore[union-attr]
    if s_shape != t_shape:
        raise ValueError(f"student_logits {s_shape} and teacher_logits {t_shape} must have the same shape (..., V)")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
            kind: str = "forward") -> torch.Tensor:
    """T² · KL at temperature T, averaged over positions: a scalar. Logits (..., V) each, same shape.

    kind "forward": T² · KL(p‖q) = T² · Σ_v p_v (log p_v − log q_v)    (Hinton et al. 2015)
    kind "reverse": T² · KL(q‖p) = T² · Σ_v q_v (log q_v − log p_v)    (MiniLLM, Gu et al. 2024)
    with p = softmax(teacher_logits / T), q = softmax(student_logits / T), summed over the vocabulary V and then
    averaged over the N = numel / V positions (PyTorch's reduction="batchmean" on (N, V)).

    Worked example (V = 3, one position, T = 2): teacher logits 2·ln([0.5, 0.25, 0.25]) give p = [0.5, 0.25, 0.25];
    student logits [0, 0, 0] give q = [1/3, 1/3, 1/3]. Forward: 4 · (0.5 ln 1.5 + 0.5 ln 0.75) = 2 ln 1.125
    = 0.2356, and its gradient on the student logits is T (q − p) = [−1/3, 1/6, 1/6]. Reverse: 4 · (1/3) ln(32/27)
    = 0.2265.
    """
    _check_pair(student_logits, teacher_logits)
    temperature = check_temperature(temperature)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    # BEGIN SOLUTION
    V = student_logits.size(-1)
    log_q = F.log_softmax(student_logits.reshape(-1, V) / temperature, dim=-1)  # (N, V) the student's, at T
    log_p = F.log_softmax(teacher_logits.reshape(-1, V) / temperature, dim=-1)  # (N, V) the teacher's, at T
    if kind == "forward":
        kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # (N,) KL(p‖q): weighted by the teacher
    else:
        kl = (log_q.exp() * (log_q - log_p)).sum(dim=-1)  # (N,) KL(q‖p): weighted by the student
    # Hinton et al. §2: the soft term's gradients scale as 1/T², so multiply by T² to keep them level.
    return temperature ** 2 * kl.mean()
    # END SOLUTION


class LossParts(NamedTuple):
    """A distillation loss and the two terms it mixes (each a scalar tensor; `total` is what backward runs on)."""

    total: torch.Tensor  # (1 − w) · hard + w · soft
    hard: torch.Tensor  # cross-entropy with the hard labels (T = 1)
    soft: torch.Tensor  # kd_loss: T² · KL at temperature T


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                      temperature: float = 1.0, kd_weight: float = 0.5, kind: str = "forward") -> LossParts:
    """(1 − w) · CE(student, targets) + w · kd_loss(student, teacher, T): Hinton et al.'s weighted average.

    student_logits, teacher_logits (..., V); targets (...) int64 token ids. The hard-label term is at T = 1, the
    soft term carries its T² (so w is the share of the gradient each gets, at any T). w = 0 is plain training on
    labels, w = 1 distillation alone.
    """
    _check_pair(student_logits, teacher_logits)
    check_float("kd_weight", kd_weight, 0.0, 1.0)
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be an int64 tensor of token ids, got {getattr(targets, 'dtype', type(targets))}")
    if tuple(targets.shape) != tuple(student_logits.shape[:-1]):
        raise ValueError(f"targets must have shape {tuple(student_logits.shape[:-1])} (the logits without V), "
                         f"got {tuple(targets.shape)}")
    V = student_logits.size(-1)
    hard = F.cross_entropy(student_logits.reshape(-1, V), targets.reshape(-1).long())
    soft = kd_loss(student_logits, teacher_logits, temperature, kind)
    return LossParts((1.0 - kd_weight) * hard + kd_weight * soft, hard, soft)


# ---- feature-based KD --------------------------------------------------------------------------------------

def default_layer_pairs(student_layers: int, teacher_layers: int) -> list[tuple[int, int]]:
    """(student block, teacher block) pairs, 0-based: each student block matches the teacher block as deep, in
    proportion. Example: 2 student and 6 teacher blocks -> [(0, 2), (1, 5)] (the last blocks always pair)."""
    for name, n in (("student_layers", student_layers), ("teacher_layers", teacher_layers)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    return [(i, (i + 1) * teacher_layers // student_layers - 1) for i in range(student_layers)]


def feature_loss(student_h: torch.Tensor, teacher_h: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """Mean squared error between proj(student_h) and the normalised teacher_h: student (..., Cs), teacher (..., Ct).

    subtle: the residual stream grows with depth (a deep teacher block's states are several times larger than a
    shallow one's), so the teacher's states are layer-normalised per position (no learned gain) before matching;
    otherwise the deepest pair would dominate the sum and the scale of the loss would depend on the layer chosen.
    """
    if not isinstance(student_h, torch.Tensor) or not isinstance(teacher_h, torch.Tensor):
        raise TypeError("student_h and teacher_h must be tensors of hidden states (..., C)")
    if student_h.shape[:-1] != teacher_h.shape[:-1]:
        raise ValueError(f"student_h {tuple(student_h.shape)} and teacher_h {tuple(teacher_h.shape)} must agree on "
                         "every dimension but the last (the width)")
    mapped = proj(student_h)  # (..., Cs) -> (..., Ct)
    if mapped.shape != teacher_h.shape:
        raise ValueError(f"the projection maps width {student_h.size(-1)} to {mapped.size(-1)}, but the teacher's "
                         f"width is {teacher_h.size(-1)}")
    target = F.layer_norm(teacher_h, teacher_h.shape[-1:])  # (..., Ct) zero mean, unit variance per position
    return F.mse_loss(mapped, target)


class FeatureProjection(nn.Module):
    """One learned `nn.Linear(Cs, Ct)` per (student block, teacher block) pair; `forward` is the mean feature loss.

    The projection is trained together with the student and thrown away afterwards: it only lets a narrow student
    be compared with a wide teacher (FitNets' "regressor").
    """

    def __init__(self, student_width: int, teacher_width: int, layer_pairs: Sequence[tuple[int, int]]):
        super().__init__()
        for name, n in (("student_width", student_width), ("teacher_width", teacher_width)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        pairs = [tuple(p) for p in layer_pairs]
        if not pairs or any(len(p) != 2 or not all(isinstance(i, int) and i >= 0 for i in p) for p in pairs):
            raise ValueError(f"layer_pairs must be a non-empty list of (student block, teacher block) index pairs, "
                             f"got {layer_pairs!r}")
        self.layer_pairs: list[tuple[int, int]] = pairs  # type: ignore[assignment]
        self.proj = nn.ModuleList(nn.Linear(student_width, teacher_width) for _ in pairs)

    def forward(self, student_states: Sequence[torch.Tensor], teacher_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """student_states: every student block's output (B, T, Cs); teacher_states: every teacher block's (B, T, Ct)."""
        losses = []
        for (i, j), proj in zip(self.layer_pairs, self.proj):
            if i >= len(student_states) or j >= len(teacher_states):
                raise ValueError(f"layer pair ({i}, {j}) is out of range for {len(student_states)} student and "
                                 f"{len(teacher_states)} teacher blocks")
            losses.append(feature_loss(student_states[i], teacher_states[j], proj))
        return torch.stack(losses).mean()
