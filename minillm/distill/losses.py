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

from minillm.core.config import (check_choice, check_float, check_has_data, check_int, check_strided,
                                 check_tensor_elements, is_float_compute, short_repr, tensor_kind)

KINDS = ("forward", "reverse")
# The smallest temperature the losses take. From it up, kd_loss is finite for any finite float32, float16 or
# bfloat16 logits: z / T stays below 7e40 (far inside float64) and T² stays a normal float. Below it nothing is
# left to learn from a temperature: softmax(z / T) is the argmax's one-hot for any logit gap above ~7 (exp(-700)
# underflows), and a subnormal T (1e-310) made z / T overflow and the loss NaN.
MIN_TEMPERATURE = 1e-2
# The largest. kd_loss sums in float64, and its error is the rounding of log-probabilities near -ln V (about 1e-16
# each) times T²: up to T = 1e4 the loss is within ~1e-7 of the exact value (float32's own resolution at a loss
# near 1; measured against 80-digit arithmetic), while the KL itself shrinks like 1/T². Past it the rounding
# overtakes the KL: 40% off at T = 1e8, exactly 0 at 1e30 (z / T then rounds to the same numbers on both sides).
# The large-T limit it approaches, mean((Δz - mean Δz)²) / 2 per position (Δz = z_t - z_s: Hinton et al.'s
# logit matching), is already within 0.1% at T = 1e3 for logits of order 1.
MAX_TEMPERATURE = 1e4


def check_temperature(temperature: object) -> float:
    """T in [MIN_TEMPERATURE, MAX_TEMPERATURE] = [1e-2, 1e4], else TypeError/ValueError naming the value."""
    temperature = check_float("temperature", temperature, 0.0, include_minimum=False)
    if temperature < MIN_TEMPERATURE:  # type: ignore[operator]
        raise ValueError(f"temperature must be at least MIN_TEMPERATURE={MIN_TEMPERATURE} (below it softmax(z / T) "
                         f"is already a one-hot argmax, and z / T leaves the float range), got {temperature}")
    if temperature > MAX_TEMPERATURE:  # type: ignore[operator]
        raise ValueError(f"temperature must be at most MAX_TEMPERATURE={MAX_TEMPERATURE:g} (above it the rounding of "
                         f"the float64 sum, which grows like T², overtakes the KL: the loss would be wrong), got "
                         f"{temperature}")
    return float(temperature)  # type: ignore[arg-type]


def check_kind(kind: object) -> str:
    """"forward" or "reverse", else TypeError/ValueError naming the value."""
    return check_choice("kind", kind, KINDS)  # the plain str: a str subclass's == is not consulted


def _check_logits(name: str, t: object) -> torch.Tensor:
    """A float tensor (..., V), V >= 2, at least one position, every row a distribution softmax can make.

    −inf is allowed (a masked token: probability 0) as long as a row keeps one finite logit; NaN and +inf are not
    (softmax of them is NaN). One host sync for the value checks.
    """
    if not is_float_compute(t):  # float8 is floating point but a storage format softmax refuses
        raise TypeError(f"{name} must be a float tensor of logits (..., V) (float16, bfloat16, float32 or float64), "
                        f"got {tensor_kind(t)}")
    check_has_data(name, t)
    if t.dim() == 0 or t.size(-1) < 2:
        raise ValueError(f"{name} must have shape (..., V) with V >= 2, got {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} has no positions (shape {tuple(t.shape)}): a mean over zero positions is undefined")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it has shapes but no values to compare")
    with torch.no_grad():
        bad = torch.stack([(torch.isnan(t) | torch.isposinf(t)).any(), ~torch.isfinite(t).any(dim=-1).all()]).tolist()
    if bad[0]:
        raise ValueError(f"{name} contains NaN or +inf: softmax of it is NaN")
    if bad[1]:
        raise ValueError(f"{name} has a row with no finite logit (all -inf): no distribution to compare")
    return t


def _check_pair(student_logits: object, teacher_logits: object) -> None:
    s = _check_logits("student_logits", student_logits)
    t = _check_logits("teacher_logits", teacher_logits)
    if tuple(s.shape) != tuple(t.shape):
        raise ValueError(f"student_logits {tuple(s.shape)} and teacher_logits {tuple(t.shape)} must have the same "
                         "shape (..., V)")
    if s.device != t.device:
        raise ValueError(f"student_logits on {s.device} and teacher_logits on {t.device} must be on one device")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
            kind: str = "forward") -> torch.Tensor:
    """T² · KL at temperature T, averaged over positions: a scalar in the logits' dtype. Logits (..., V), same shape.

    kind "forward": T² · KL(p‖q) = T² · Σ_v p_v (log p_v − log q_v)    (Hinton et al. 2015)
    kind "reverse": T² · KL(q‖p) = T² · Σ_v q_v (log q_v − log p_v)    (MiniLLM, Gu et al. 2024)
    with p = softmax(teacher_logits / T), q = softmax(student_logits / T), summed over the vocabulary V and then
    averaged over the N = numel / V positions (PyTorch's reduction="batchmean" on (N, V)).

    Worked example (V = 3, one position, T = 2): teacher logits 2·ln([0.5, 0.25, 0.25]) give p = [0.5, 0.25, 0.25];
    student logits [0, 0, 0] give q = [1/3, 1/3, 1/3]. Forward: 4 · (0.5 ln 1.5 + 0.5 ln 0.75) = 2 ln 1.125
    = 0.2356, and its gradient on the student logits is T (q − p) = [−1/3, 1/6, 1/6]. Reverse: 4 · (1/3) ln(32/27)
    = 0.2265.

    Masked tokens: a logit of −inf is a token with probability 0, and 0 · log 0 counts as 0 (as `F.kl_div` with
    probability targets counts it). A token masked on both sides drops out; one the weighting distribution gives mass
    but the other masks makes the KL +inf, as it is. Bad input (NaN or +inf logits, a row with no finite logit, no
    positions at all) is a ValueError naming the argument: there is no mean over zero positions to return. So is a
    temperature outside [MIN_TEMPERATURE, MAX_TEMPERATURE] = [1e-2, 1e4]: inside, the loss is finite for any finite
    logits and within ~1e-7 of the exact value; above, float64 rounding overtakes the KL, which shrinks like 1/T².
    """
    _check_pair(student_logits, teacher_logits)
    temperature = check_temperature(temperature)
    kind = check_kind(kind)
    # BEGIN SOLUTION
    V = student_logits.size(-1)
    dtype = torch.promote_types(student_logits.dtype, teacher_logits.dtype)  # the loss comes back in this dtype
    # subtle: at a large T both distributions are nearly uniform, and KL is second order in (z_s − z_t)/T: at T = 1e4
    # about 1e-8, while float32 log-probabilities near −ln V carry rounding errors of 1e-6 that do not cancel (about
    # 1% off at T = 1e3; at 1e4 off by the value itself, often negative). In float64 the same sum is good to ~1e-7
    # relative up to T ≈ 1e5; the cost is one (N, V) pass, small beside the two models' forwards.
    student_logits, teacher_logits = student_logits.double(), teacher_logits.double()
    # subtle: softmax ignores a shift, so each row's max is taken off before dividing by T: z / T can then not
    # overflow to +inf (and log_softmax to NaN) for any finite logits, only underflow to -inf (probability 0).
    student_logits = student_logits - student_logits.amax(dim=-1, keepdim=True).detach()  # (..., V), max 0
    teacher_logits = teacher_logits - teacher_logits.amax(dim=-1, keepdim=True).detach()  # (..., V), max 0
    log_q = F.log_softmax(student_logits.reshape(-1, V) / temperature, dim=-1)  # (N, V) the student's, at T
    log_p = F.log_softmax(teacher_logits.reshape(-1, V) / temperature, dim=-1)  # (N, V) the teacher's, at T
    # subtle: masked tokens. 0 · log 0 = 0 in the math but 0 · (−inf) = NaN in floating point, and so is its gradient.
    # A token both mask drops out (both log-probabilities set to 0: weight 1, difference 0, gradient blocked); then
    # the weighting side's −inf becomes the most negative float, so its term is 0 · (finite) = 0 while the other
    # side's −inf stays and makes the KL +inf where it should be.
    dead = torch.isneginf(log_p) & torch.isneginf(log_q)  # (N, V)
    log_p, log_q = log_p.masked_fill(dead, 0.0), log_q.masked_fill(dead, 0.0)
    lowest = torch.finfo(torch.float64).min
    if kind == "forward":
        log_p = log_p.clamp(min=lowest)
        kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # (N,) KL(p‖q): weighted by the teacher
    else:
        log_q = log_q.clamp(min=lowest)
        kl = (log_q.exp() * (log_q - log_p)).sum(dim=-1)  # (N,) KL(q‖p): weighted by the student
    # KL >= 0 (Gibbs); what rounding leaves below 0 when p = q is clamped, so the loss is never negative.
    kl = kl.clamp(min=0.0)
    # Hinton et al. §2: the soft term's gradients scale as 1/T², so multiply by T² to keep them level (in float64,
    # before rounding to the logits' dtype: KL alone can exceed float32 at a small T where T² · KL does not).
    return (temperature ** 2 * kl.mean()).to(dtype)
    # END SOLUTION


def check_targets(name: str, targets: object, shape: tuple[int, ...], vocab_size: int, device: torch.device) -> None:
    """`targets` an int64 (or int32) tensor of token ids of `shape` on `device`, every id in [0, vocab_size); a
    TypeError / ValueError naming `name` (the caller's argument: `targets` here, `y` in the trainer's objective).
    One host sync for the range."""
    vocab_size = check_int("vocab_size", vocab_size)
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 tensor of token ids, got {tensor_kind(targets)}")
    if tuple(targets.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (the logits without V), got {tuple(targets.shape)}")
    if targets.device != device:
        raise ValueError(f"{name} on {targets.device} and the logits on {device} must be on one device")
    check_strided(name, targets)
    if targets.numel() == 0:
        return
    # subtle: cross_entropy ignores target -100 (its ignore_index) without a word; every id must be a real token.
    low, high = (int(v) for v in torch.stack([targets.min(), targets.max()]).tolist())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} must be token ids in [0, V={vocab_size}), got values from {low} to {high}")


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
    labels, w = 1 distillation alone: the other term is computed and returned, but left out of `total` (an infinite
    term of weight 0, from a masked token, would make it NaN).
    """
    kd_weight = check_float("kd_weight", kd_weight, 0.0, 1.0)
    soft = kd_loss(student_logits, teacher_logits, temperature, kind)  # checks the logits, T and kind first
    V = student_logits.size(-1)
    check_targets("targets", targets, tuple(student_logits.shape[:-1]), V, student_logits.device)
    hard = F.cross_entropy(student_logits.reshape(-1, V), targets.reshape(-1).long())
    # subtle: a term of weight 0 is left out, not multiplied by 0. A masked token (a -inf logit) can make either
    # term +inf (the label's cross-entropy, or the KL where only one side masks it), and 0 · inf is NaN: w = 0 would
    # not be plain training on labels, nor w = 1 distillation alone.
    if kd_weight == 0:
        total = hard.to(soft.dtype)
    elif kd_weight == 1:
        total = soft
    else:
        total = (1.0 - kd_weight) * hard + kd_weight * soft
    return LossParts(total, hard, soft)


# ---- feature-based KD --------------------------------------------------------------------------------------

MAX_LAYERS = 10_000  # deeper than any model this package builds (GPT-2 XL has 48 blocks): a larger count is a mistake


def default_layer_pairs(student_layers: int, teacher_layers: int) -> list[tuple[int, int]]:
    """(student block, teacher block) pairs, 0-based: student block i matches the deepest teacher block no deeper in
    proportion, j = ⌊(i + 1) · Lt / Ls⌋ − 1, and at least block 0 (a student deeper than its teacher would otherwise
    get j = −1, Python's last block). Examples: 2 student and 6 teacher blocks -> [(0, 2), (1, 5)]; 3 and 2 ->
    [(0, 0), (1, 0), (2, 1)]. The last blocks always pair."""
    student_layers = check_int("student_layers", student_layers)
    teacher_layers = check_int("teacher_layers", teacher_layers)
    for name, n in (("student_layers", student_layers), ("teacher_layers", teacher_layers)):
        if n > MAX_LAYERS:  # the list holds one pair per student block: refused before it is built
            raise ValueError(f"{name} must be at most {MAX_LAYERS} blocks (a model's depth), got {n}")
    return [(i, max(0, (i + 1) * teacher_layers // student_layers - 1)) for i in range(student_layers)]


def _check_proj_weights(proj: object, student_h: torch.Tensor, name: str = "student_h") -> None:
    """A module's weights on student_h's device and of its dtype (unless autocast casts them per op): a
    ValueError/TypeError naming `name` (the caller's argument) and its device or dtype, before torch's matmul error."""
    if not isinstance(proj, nn.Module):
        return  # a plain function: nothing to compare
    weight = next((p for p in proj.parameters() if p.is_floating_point()), None)
    if weight is None:
        return
    if weight.device != student_h.device:
        raise ValueError(f"{name} is on {student_h.device} but proj's weights are on {weight.device}")
    if weight.dtype != student_h.dtype and not torch.is_autocast_enabled(student_h.device.type):
        raise TypeError(f"{name} is {student_h.dtype} but proj computes in {weight.dtype}; cast one to the other")


def _check_hidden(name: str, h: object) -> torch.Tensor:
    """`h` a float tensor of hidden states (..., C) with at least one position, real values, all finite; a
    TypeError / ValueError naming `name` otherwise (`feature_loss`'s arguments, or an entry of FeatureProjection's
    lists: `student_states[1]`)."""
    if not isinstance(h, torch.Tensor) or not h.is_floating_point():
        raise TypeError(f"{name} must be a float tensor of hidden states (..., C), got {tensor_kind(h)}")
    check_strided(name, h)  # nested, sparse, MKL-DNN, float8: refused by name before any value is read
    if h.dim() == 0 or h.numel() == 0:
        raise ValueError(f"{name} must have shape (..., C) with at least one position, got {tuple(h.shape)}")
    if h.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it has shapes but no values to compare")
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"{name} contains NaN or inf")
    return h


def feature_loss(student_h: torch.Tensor, teacher_h: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """Mean squared error between proj(student_h) and the normalised teacher_h: student (..., Cs), teacher (..., Ct).

    subtle: the residual stream grows with depth (a deep teacher block's states are several times larger than a
    shallow one's), so the teacher's states are layer-normalised per position (no learned gain) before matching;
    otherwise the deepest pair would dominate the sum and the scale of the loss would depend on the layer chosen.
    """
    for name, h in (("student_h", student_h), ("teacher_h", teacher_h)):
        _check_hidden(name, h)
    if not callable(proj):
        raise TypeError(f"proj must be a module mapping width Cs to Ct, got {type(proj).__name__}")
    if isinstance(proj, FeatureProjection):  # takes lists of every block's states, not one tensor
        raise TypeError("proj must map one tensor (..., Cs) to (..., Ct), got a FeatureProjection (it takes every "
                        "block's states: call it directly, or pass one of its projections, proj.proj[k])")
    if student_h.shape[:-1] != teacher_h.shape[:-1]:
        raise ValueError(f"student_h {tuple(student_h.shape)} and teacher_h {tuple(teacher_h.shape)} must agree on "
                         "every dimension but the last (the width)")
    if teacher_h.device != student_h.device:
        raise ValueError(f"student_h on {student_h.device} and teacher_h on {teacher_h.device} must be on one device")
    _check_proj_weights(proj, student_h)
    in_features = getattr(proj, "in_features", student_h.size(-1))  # an nn.Linear says what width it takes
    if in_features != student_h.size(-1):
        raise ValueError(f"the projection takes width {in_features}, but student_h has width {student_h.size(-1)}")
    try:
        mapped = proj(student_h)  # (..., Cs) -> (..., Ct)
    except RuntimeError as e:  # a module without in_features (an nn.Sequential) meets a wrong width only here
        if isinstance(e, torch.OutOfMemoryError):  # not a bad argument
            raise
        raise ValueError(f"proj failed on student_h of shape {tuple(student_h.shape)} (width {student_h.size(-1)}): "
                         f"{e}") from e
    except TypeError as e:  # a callable that does not take one tensor
        raise TypeError(f"proj must map one tensor (..., Cs) to (..., Ct); calling the {type(proj).__name__} on "
                        f"student_h failed: {e}") from e
    if not isinstance(mapped, torch.Tensor) or not mapped.is_floating_point():
        raise TypeError(f"proj must return a float tensor (..., Ct), got "
                        f"{tensor_kind(mapped)}")
    if mapped.shape != teacher_h.shape:
        raise ValueError(f"the projection maps width {student_h.size(-1)} to {mapped.size(-1)}, but the teacher's "
                         f"width is {teacher_h.size(-1)}")
    target = F.layer_norm(teacher_h, teacher_h.shape[-1:])  # (..., Ct) zero mean, unit variance per position
    return F.mse_loss(mapped, target)


def check_layer_pairs(layer_pairs: object, student_layers: int | None = None,
                      teacher_layers: int | None = None) -> list[tuple[int, int]]:
    """`layer_pairs` as a non-empty list of (student block, teacher block) pairs of plain ints, each index >= 0 and,
    when the depths are given, below them; TypeError/ValueError naming the bad pair otherwise."""
    if isinstance(layer_pairs, (str, bytes)) or not isinstance(layer_pairs, Sequence):
        raise TypeError(f"layer_pairs must be a list of (student block, teacher block) pairs, "
                        f"got {type(layer_pairs).__name__} {short_repr(layer_pairs)}")
    if len(layer_pairs) == 0:
        raise ValueError("layer_pairs must hold at least one (student block, teacher block) pair, got none")
    if student_layers is not None:
        student_layers = check_int("student_layers", student_layers)
    if teacher_layers is not None:
        teacher_layers = check_int("teacher_layers", teacher_layers)
    pairs: list[tuple[int, int]] = []
    for pos, pair in enumerate(layer_pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"layer_pairs[{pos}] must be a (student block, teacher block) pair of ints, got "
                            f"{short_repr(pair)}")
        # the plain ints (0-based block indices): a numpy int is refused saying to convert it, an int subclass's
        # comparisons are not consulted, and the list returned holds nothing of the caller's
        i = check_int(f"layer_pairs[{pos}][0] (a student block)", pair[0], 0)
        j = check_int(f"layer_pairs[{pos}][1] (a teacher block)", pair[1], 0)
        for idx, depth, who in ((i, student_layers, "student"), (j, teacher_layers, "teacher")):
            if depth is not None and idx >= depth:
                raise ValueError(f"layer_pairs[{pos}] = {(i, j)}: the {who} has {depth} blocks (0..{depth - 1})")
        if (i, j) in pairs:  # counted twice in the mean, with a projection each
            raise ValueError(f"layer_pairs[{pos}] = {(i, j)} is listed twice")
        pairs.append((i, j))
    return pairs


class FeatureProjection(nn.Module):
    """One learned `nn.Linear(Cs, Ct)` per (student block, teacher block) pair; `forward` is the mean feature loss.

    The projection is trained together with the student and thrown away afterwards: it only lets a narrow student
    be compared with a wide teacher (FitNets' "regressor").
    """

    def __init__(self, student_width: int, teacher_width: int, layer_pairs: Sequence[tuple[int, int]]):
        super().__init__()
        student_width = check_int("student_width", student_width)
        teacher_width = check_int("teacher_width", teacher_width)
        check_tensor_elements("student_width x teacher_width", (teacher_width, student_width))
        self.student_width, self.teacher_width = student_width, teacher_width
        self.layer_pairs: list[tuple[int, int]] = check_layer_pairs(layer_pairs)
        self.proj = nn.ModuleList(nn.Linear(student_width, teacher_width) for _ in self.layer_pairs)

    def check_projections(self) -> list[tuple[int, int]]:
        """The layer pairs, checked again, each with its projection an nn.Linear(student_width, teacher_width): both
        are attributes, and one replaced after construction (`proj[0] = nn.Linear(8, 7)`, a pair more than there
        are projections) is a ValueError / TypeError naming it, not a shape error about the states or a pair that
        `zip` drops without a word."""
        pairs = check_layer_pairs(self.layer_pairs)
        if len(self.proj) != len(pairs):
            raise ValueError(f"FeatureProjection.proj holds {len(self.proj)} projections for {len(pairs)} layer_pairs:"
                             " one per pair")
        for k, proj in enumerate(self.proj):
            if not isinstance(proj, nn.Linear):
                raise TypeError(f"FeatureProjection.proj[{k}] must be an nn.Linear, got {type(proj).__name__}")
            if (proj.in_features, proj.out_features) != (self.student_width, self.teacher_width):
                raise ValueError(f"FeatureProjection.proj[{k}] maps width {proj.in_features} to {proj.out_features}, "
                                 f"but the projection was built for student_width={self.student_width} -> "
                                 f"teacher_width={self.teacher_width}")
        return pairs

    def forward(self, student_states: Sequence[torch.Tensor], teacher_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """student_states: every student block's output (B, T, Cs); teacher_states: every teacher block's (B, T, Ct)."""
        for name, states in (("student_states", student_states), ("teacher_states", teacher_states)):
            if not isinstance(states, (list, tuple)):
                raise TypeError(f"{name} must be a list of every block's hidden states, got {type(states).__name__}")
        losses = []
        for pos, ((i, j), proj) in enumerate(zip(self.check_projections(), self.proj)):
            for name, states, block in (("student_states", student_states, i), ("teacher_states", teacher_states, j)):
                if block >= len(states):
                    raise ValueError(f"{name} holds {len(states)} blocks' hidden states: layer_pairs[{pos}] = "
                                     f"({i}, {j}) is out of range (it needs block {block})")
            # the entries checked under this call's names (feature_loss would call them student_h and teacher_h)
            s_h = _check_hidden(f"student_states[{i}]", student_states[i])
            t_h = _check_hidden(f"teacher_states[{j}]", teacher_states[j])
            _check_proj_weights(proj, s_h, f"student_states[{i}]")
            if s_h.shape[:-1] != t_h.shape[:-1] or s_h.size(-1) != proj.in_features or \
                    t_h.size(-1) != proj.out_features:
                raise ValueError(f"student_states[{i}] {tuple(s_h.shape)} and teacher_states[{j}] {tuple(t_h.shape)} "
                                 f"must be (..., Cs={proj.in_features}) and (..., Ct={proj.out_features}) over the "
                                 "same positions")
            losses.append(feature_loss(student_states[i], teacher_states[j], proj))
        return torch.stack(losses).mean()
