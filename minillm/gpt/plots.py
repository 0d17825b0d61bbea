"""Chapter 02's pictures: the attention weights of a trained model, which the fused SDPA path never materializes.

What it adds: `attention_weights` runs the model's own forward and records softmax(q kᵀ/√hs) of every layer and
head, and `plot_attention` draws some of them as heat maps. It records through the model's one cache hook
(`KVCacheProtocol.attend`, see `minillm.core.model`), so nothing of the model is copied here. What it leaves out:
attention from cached decode steps (chapters 04-05 never form the full T x T matrix either).
"""

from __future__ import annotations

import math

import torch

from minillm.core.attention import attention_ref, causal_mask
from minillm.core.config import check_float_tensor, check_int_list, check_sequence, short_repr, tensor_kind
from minillm.core.model import require_model


class _AttentionRecorder:
    """A stand-in cache for one plain forward: attends causally over the T given tokens and keeps the weights."""

    def __init__(self) -> None:
        self.weights: dict[int, torch.Tensor] = {}  # layer -> (B, nh, T, T)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.size(-2)
        mask = causal_mask(T, k.size(-2), device=q.device)  # (T, T)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, nh, T, hs) @ (B, nh, hs, T) -> (B, nh, T, T)
        self.weights[layer_idx] = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # rows sum to 1
        return attention_ref(q, k, v, mask)  # (B, nh, T, hs): the model's own explicit attention


@torch.no_grad()
def attention_weights(model, idx: torch.Tensor) -> torch.Tensor:
    """Attention weights of every layer and head for one sequence: idx (T,) or (1, T) -> (n_layer, nh, T, T)."""
    require_model(model, "attention_weights (model)")
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a tensor of token ids, got {tensor_kind(idx)}")
    idx = idx.view(1, -1)  # (1, T)
    positions = model.check_inputs(idx, None)
    recorder = _AttentionRecorder()
    model.hidden(idx, positions, recorder)
    return torch.stack([recorder.weights[i][0] for i in sorted(recorder.weights)])  # (L, nh, T, T)


def plot_attention(weights: torch.Tensor, labels: list[str], cells: list[tuple[int, int]], axes=None):
    """Heat maps of weights[layer, head] for each (layer, head) in `cells`, one axis each; rows are queries.

    `labels` names the T tokens (tick labels on both axes). Returns the axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.axes import Axes

    L, nh, T, _ = check_float_tensor("weights", weights, ndim=4).shape  # (n_layer, nh, T, T)
    if not isinstance(labels, (list, tuple)) or len(labels) != T or not all(isinstance(s, str) for s in labels):
        raise TypeError(f"labels must be a list of {T} str (one per token), got {short_repr(labels)}")
    for i, cell in enumerate(check_sequence("cells", cells)):
        check_int_list(f"cells[{i}]", cell)
        if len(cell) != 2 or not (0 <= cell[0] < L and 0 <= cell[1] < nh):
            raise ValueError(f"cells[{i}] must be a (layer, head) pair in [0, {L}) x [0, {nh}), got {short_repr(cell)}")
    if axes is None:
        _, axes = plt.subplots(1, len(cells), figsize=(4 * len(cells), 4.2))
    axes = list(axes) if hasattr(axes, "__iter__") else [axes]
    if not axes or not all(isinstance(ax, Axes) for ax in axes):
        raise TypeError(f"axes must be None, a matplotlib Axes or a list of them, got {short_repr(axes)}")
    T = weights.size(-1)
    for ax, (layer, head) in zip(axes, cells):
        ax.imshow(weights[layer, head].cpu(), cmap="viridis", vmin=0, vmax=1)
        ax.set_xticks(range(T), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(T), labels, fontsize=7)
        ax.set_title(f"layer {layer}, head {head}")
        ax.set_xlabel("key (attended to)")
    axes[0].set_ylabel("query")
    return axes
