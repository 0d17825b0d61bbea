"""Chapter 11 (distillation): train a small student on a teacher's distributions, and ship it as chapter 08's draft.

- `losses`: `kd_loss` (T² · KL at temperature T, forward or reverse; the graded exercise), `distillation_loss` (mixed
  with the hard-label cross-entropy), `FeatureProjection` / `feature_loss` (hidden-state matching through a learned
  projection), `default_layer_pairs`.
- `train`: `DistillObjective` (the loss chapter 02's trainer runs), `distill`, and `python -m minillm.distill.train`,
  which reproduces the shipped `draft-distilled` and its hard-label control `draft-hardlabel`.
- `run_state`: what a distillation run keeps beside the trainer's checkpoints (its settings, the per-step loss terms),
  so that an interrupted run resumes exactly (`TrainConfig.resume`, `--resume DIR`).
- `bench`: validation perplexity, agreement with the teacher's greedy token, KL from the teacher and identical
  continuations, α and the end-to-end speed-up of speculative decoding with each draft
  (`python -m minillm.distill.bench`).
- `tour`: the chapter's two tour rows.
"""

from minillm.distill.losses import (
    FeatureProjection,
    LossParts,
    default_layer_pairs,
    distillation_loss,
    feature_loss,
    kd_loss,
)

__all__ = ["FeatureProjection", "LossParts", "default_layer_pairs", "distillation_loss", "feature_loss", "kd_loss"]
