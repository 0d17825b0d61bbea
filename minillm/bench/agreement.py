"""Quality against a reference: greedy agreement, KL divergence and output consistency of a candidate model.

Adds `argmax_along(model, prompt, continuation)` (one forward over prompt + continuation: the model's argmax at
each position that predicts a continuation token, `logits_along` for the logits themselves), and the measurements
chapters 09-11 report with it: `teacher_forced_agreement(reference, candidate, sequences, prompt_len)`, where two
models' argmaxes agree (a quantized or pruned model against fp32), and `greedy_agreement(model, prompts,
continuations)`, how often a model predicts a given continuation (a distilled draft against its teacher's greedy
tokens). Both models read the same tokens, so one early difference cannot cascade into later ones as it does when
each generates its own. Beside them, the two measures practitioners report with perplexity: `teacher_forced_kl`
(KL(p_reference || p_candidate) per position, from the same forwards as the agreement; `kl_divergence` is the
formula on logits) and `output_consistency` (free-running: how many prompts get the reference's continuation token
for token, and how long the common prefix is; `greedy_outputs` is the reference loop that makes continuations).
What it leaves out: sampling (speculative sampling's acceptance is `1 - TV`, chapter 08's `draft_agreement`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.config import check_float_tensor, check_int
from minillm.core.model import require_model


@torch.inference_mode()
def logits_along(model: nn.Module, prompt: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """(n, V) logits on the model's device, in its dtype: row i is the model's next-token logits after prompt +
    continuation[:i] (teacher forcing), for the n = len(continuation) positions predicting `continuation`, from one
    forward of prompt + continuation without its last token."""
    if len(prompt) < 1:
        raise ValueError("prompt must hold at least one token: its last token predicts the continuation's first, "
                         f"got {list(prompt)!r}")
    ids = torch.tensor([list(prompt) + list(continuation[:-1])], device=model.device)  # (1, P + n - 1)
    start = len(prompt) - 1
    return model(ids)[0, start:start + len(continuation)]  # (1, P + n - 1, V) -> (n, V)


@torch.inference_mode()
def argmax_along(model: nn.Module, prompt: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """(n,) int64 on the CPU: the model's argmax at the n positions predicting `continuation` (n = its length),
    from one forward of prompt + continuation without its last token (`logits_along`)."""
    if len(prompt) < 1:
        raise ValueError("argmax_along needs a prompt of at least one token: its last token predicts the first one")
    if not continuation:
        return torch.zeros(0, dtype=torch.long)
    return logits_along(model, prompt, continuation).argmax(-1).cpu()  # (n, V) -> (n,)


def teacher_forced_agreement(reference: nn.Module, candidate: nn.Module, sequences: Sequence[Sequence[int]],
                             prompt_len: int) -> tuple[int, int]:
    """(positions where the two models' argmax agree, positions) over each sequence's continuation part
    (`seq[prompt_len:]`, typically the reference's own greedy output)."""
    agree = total = 0
    for seq in sequences:
        prompt, cont = seq[:prompt_len], seq[prompt_len:]
        a, b = argmax_along(reference, prompt, cont), argmax_along(candidate, prompt, cont)  # (n,) each
        agree += int((a == b).sum())
        total += a.numel()
    return agree, total


def greedy_agreement(model: nn.Module, prompts: Sequence[Sequence[int]],
                     continuations: Sequence[Sequence[int]]) -> float:
    """Fraction of continuation tokens the model predicts as its argmax, given the prompt and the continuation's
    tokens before it (teacher forcing on, say, a teacher's own greedy path)."""
    hits = total = 0
    for prompt, cont in zip(prompts, continuations, strict=True):
        hits += int((argmax_along(model, prompt, cont) == torch.tensor(list(cont), dtype=torch.long)).sum())
        total += len(cont)
    return hits / total


def kl_divergence(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats, row by row: p = softmax(reference_logits), q = softmax(candidate_logits), both (..., V)
    -> (...,) float64.

        KL(p || q) = sum_v p_v (log p_v - log q_v)

    Direction: the expectation is under the reference p, so each token weighs as much as the reference believes in
    it, and a candidate pays for every token the reference finds likely and it does not (the "forward" KL that
    chapter 11's distillation minimizes). KL >= 0, and 0 exactly where the two distributions are equal; logits that
    differ by a constant in a row give 0 (softmax ignores it). Example: p = (1/2, 1/2), q = (1/4, 3/4) give
    1/2 ln 2 + 1/2 ln(2/3) = 0.1438 nats.
    Numerics: log_softmax in float64, never the log of a softmax (which underflows to log 0 = -inf). A token the
    reference rules out (logit -inf, p_v = 0) adds 0, the limit of p log(p/q), even where the candidate rules it out
    too; a token the reference allows and the candidate rules out makes the row +inf, which is its value.
    `F.kl_div(log_q, log_p, log_target=True)` sums the same terms but gives NaN for a token both rule out (tested
    against it on finite logits).
    """
    for name, x in (("reference_logits", reference_logits), ("candidate_logits", candidate_logits)):
        check_float_tensor(name, x)
        if x.dim() < 1 or x.size(-1) < 1:
            raise ValueError(f"{name} must have shape (..., V) with V >= 1, got {tuple(x.shape)}")
        if torch.isnan(x).any() or torch.isposinf(x).any():
            raise ValueError(f"{name} holds NaN or +inf: logits must be finite or -inf (a masked token)")
        if torch.isneginf(x).all(-1).any():
            raise ValueError(f"{name} has a row whose logits are all -inf: it is no distribution")
    if reference_logits.shape != candidate_logits.shape:
        raise ValueError(f"candidate_logits has shape {tuple(candidate_logits.shape)}, reference_logits "
                         f"{tuple(reference_logits.shape)}: the two must match (same positions, same vocabulary)")
    log_p = F.log_softmax(reference_logits.double(), dim=-1)  # (..., V)
    log_q = F.log_softmax(candidate_logits.double().to(log_p.device), dim=-1)  # (..., V)
    terms = log_p.exp() * (log_p - log_q)  # (..., V); NaN where exp(-inf) = 0 meets -inf - (-inf)
    # subtle: select the two limits, don't compute them (0 * inf is NaN): p_v = 0 adds 0 whatever q_v is, and
    # q_v = 0 < p_v adds +inf even where p_v is so small that exp(log p_v) underflows to 0
    p_zero, q_zero = torch.isneginf(log_p), torch.isneginf(log_q)  # (..., V) each
    terms = torch.where(p_zero, torch.zeros_like(terms), terms)
    terms = torch.where(q_zero & ~p_zero, torch.full_like(terms, float("inf")), terms)
    # Rounding can leave -1e-17 where the two are equal; KL is never negative.
    return terms.sum(-1).clamp_min(0.0)  # (...,)


@torch.inference_mode()
def teacher_forced_kl(reference: nn.Module, candidate: nn.Module, sequences: Sequence[Sequence[int]],
                      prompt_len: int) -> dict[str, float | int]:
    """How far a candidate's next-token distributions are from a reference's, teacher-forced: both models read each
    sequence, and at every position predicting a token of `seq[prompt_len:]` (typically the reference's own greedy
    continuation) `kl_divergence` compares them. One forward of each model per sequence gives both the KL and the
    argmax agreement (`teacher_forced_agreement`'s number, from the same logits).

    Returns {"kl_mean": mean over all positions of KL(p_reference || p_candidate), nats per token; "kl_p99": its
    99th percentile over positions (the measured value at or above 99% of them, sorted[ceil(0.99 (n - 1))]: no
    interpolation, which would turn an infinite KL into NaN; with a few hundred positions, about the second largest);
    "kl_max"; "agreement": the fraction of positions where the two argmaxes agree; "agree_positions"; "positions"}.
    Why beside perplexity: perplexity pools the log-probabilities of the true next tokens, where a candidate's gains
    at some positions cancel its losses at others; KL is >= 0 at every position and compares whole distributions,
    so two models can score a text alike and still disagree on many individual predictions, which KL sees.
    """
    if not sequences:
        raise ValueError(f"sequences must be a non-empty list of token lists, got {sequences!r}")
    prompt_len = check_int("prompt_len", prompt_len)
    for i, seq in enumerate(sequences):
        if len(seq) <= prompt_len:
            raise ValueError(f"sequences[{i}] has {len(seq)} tokens: it needs more than prompt_len={prompt_len}, "
                             "one at least to predict")
    vocab = require_model(reference, "teacher_forced_kl's reference").vocab_size
    if require_model(candidate, "teacher_forced_kl's candidate").vocab_size != vocab:
        raise ValueError(f"candidate has a vocabulary of {candidate.config.vocab_size} tokens, reference {vocab}: "
                         "KL compares distributions over the same tokens")
    kls, agree = [], 0
    for seq in sequences:
        prompt, cont = seq[:prompt_len], seq[prompt_len:]
        ref, cand = logits_along(reference, prompt, cont), logits_along(candidate, prompt, cont)  # (n, V) each
        kls.append(kl_divergence(ref, cand).cpu())  # (n,)
        agree += int((ref.argmax(-1).cpu() == cand.argmax(-1).cpu()).sum())
    kl = torch.cat(kls)  # (positions,) float64
    p99 = torch.quantile(kl, 0.99, interpolation="higher")
    return {"kl_mean": kl.mean().item(), "kl_p99": p99.item(), "kl_max": kl.max().item(),
            "agreement": agree / kl.numel(), "agree_positions": agree, "positions": kl.numel()}


@torch.inference_mode()
def greedy_outputs(model: nn.Module, prompts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation, `num_tokens` tokens, free-running (the model reads its own argmaxes), by
    full forwards without a cache: the kit's reference loop, one forward of the whole sequence per token. The
    chapters give `output_consistency` the tokens of their own cached loop instead (chapter 04's `generate_ids`,
    tested equal to this one). End-of-text is not special: every continuation has exactly `num_tokens` tokens."""
    config = require_model(model, "greedy_outputs")
    num_tokens = check_int("num_tokens", num_tokens)
    if not prompts:
        raise ValueError(f"prompts must be a non-empty list of token lists, got {prompts!r}")
    for i, p in enumerate(prompts):
        if not 1 <= len(p) <= config.block_size - num_tokens + 1:
            raise ValueError(f"prompts[{i}] has {len(p)} tokens: it needs at least 1 and, with num_tokens="
                             f"{num_tokens}, at most {config.block_size - num_tokens + 1} (block_size "
                             f"{config.block_size})")
    outputs = []
    for p in prompts:
        ids = torch.tensor([list(p)], device=model.device)  # (1, P)
        for _ in range(num_tokens):
            nxt = model(ids)[:, -1].argmax(-1, keepdim=True)  # (1, T, V) -> (1, V) -> (1, 1)
            ids = torch.cat([ids, nxt], dim=1)  # (1, T + 1)
        outputs.append(ids[0, len(p):].tolist())
    return outputs


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share: the index of their first difference, or the shorter length."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def output_consistency(reference_outputs: Sequence[Sequence[int]], candidate_outputs: Sequence[Sequence[int]]
                       ) -> dict[str, float | int]:
    """How often two models, each generating its own tokens from the same prompts, say the same thing: prompt i's
    continuation by the reference is `reference_outputs[i]`, by the candidate `candidate_outputs[i]` (free-running
    greedy, e.g. from `greedy_outputs` or `generate_ids`).

    Returns {"identical": prompts whose two continuations are equal token for token; "prompts"; "identical_fraction";
    "mean_common_prefix": mean over prompts of `common_prefix`, in tokens (the whole length where identical);
    "new_tokens": the longest reference continuation}. Free-running, one different argmax sends the rest of a
    continuation its own way, so this is stricter than teacher-forced agreement, and it is what a user sees.
    """
    if not reference_outputs:
        raise ValueError(f"reference_outputs must be a non-empty list of token lists, got {reference_outputs!r}")
    if len(candidate_outputs) != len(reference_outputs):
        raise ValueError(f"candidate_outputs holds {len(candidate_outputs)} continuations, reference_outputs "
                         f"{len(reference_outputs)}: one per prompt each")
    for i, out in enumerate(reference_outputs):
        if len(out) < 1:
            raise ValueError(f"reference_outputs[{i}] is empty: compare continuations of at least one token")
    same = sum(list(a) == list(b) for a, b in zip(reference_outputs, candidate_outputs))
    prefix = sum(common_prefix(a, b) for a, b in zip(reference_outputs, candidate_outputs))
    n = len(reference_outputs)
    return {"identical": same, "prompts": n, "identical_fraction": same / n, "mean_common_prefix": prefix / n,
            "new_tokens": max(len(out) for out in reference_outputs)}
